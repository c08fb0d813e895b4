"""Any folder of images; class-per-subfolder layouts get labels, localisation masks beside the images are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.fingerprints import contents_digest, listing_digest
from runner.options.data.images import IMAGE_SUFFIXES, MASK_SUFFIX, MASKS_FILE, ImageDataConfig
from runner.options.registry import DATA


@DATA.option("runner.data.sources:folder_source")
@dataclass
class ImageFolderConfig(ImageDataConfig):
    name: str = "image_folder"
    root: str | None = None  # the folder (class-per-subfolder layouts get labels)
    strict: bool = False  # fail on an unreadable image instead of skipping it (skips are logged)

    def fingerprint(self) -> dict[str, str]:
        """The folder's images (name, size and modification time of each; no contents: folders can be large) and
        its mask side files (masks.json, *.mask.png: contents hashed, since an edited mask may keep its size)."""
        folder = Path(self.root).expanduser() if self.root else None
        if folder is None or not folder.is_dir():
            return {}
        count, digest = listing_digest(folder, lambda p: p.suffix.lower() in IMAGE_SUFFIXES)
        found = {"data.root (contents)": f"{count} files, {digest}"}
        sides = sorted(p for p in folder.rglob("*") if p.name.lower().endswith(MASK_SUFFIX) and p.is_file())
        if (folder / MASKS_FILE).is_file():
            sides.insert(0, folder / MASKS_FILE)
        if sides:
            found["data.root masks (contents)"] = f"{len(sides)} files, {contents_digest(folder, sides)}"
        return found
