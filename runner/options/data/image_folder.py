"""Any folder of images; class-per-subfolder layouts get labels, localisation masks beside the images are read."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.data.images import ImageDataConfig
from runner.options.registry import DATA


@DATA.option("runner.data.sources:folder_source")
@dataclass
class ImageFolderConfig(ImageDataConfig):
    name: str = "image_folder"
    root: str | None = None  # the folder (class-per-subfolder layouts get labels)
    strict: bool = False  # fail on an unreadable image instead of skipping it (skips are logged)
