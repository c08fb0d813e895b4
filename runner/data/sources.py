"""The built-in data sources' builders (config, the weights' preprocessing or None, seed) -> data set; each is
named by its option module in runner/options/data/."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from runner.data.base import NO_LABEL, ImageListDataset, SyntheticDataset
from runner.data.images import (
    _skimage_photo,
    _to_rgb,
    decode_size,
    draft,
    exif_orientation,
    image_transform,
    read_photo,
    upright,
)
from runner.errors import RunnerError, suggest
from runner.options.data.image_folder import ImageFolderConfig
from runner.options.data.images import IMAGE_SUFFIXES, ImageDataConfig
from runner.options.data.skimage_photos import PHOTO_LABELS, PHOTOS, SkimagePhotosConfig
from runner.options.data.synthetic import SyntheticConfig
from runner.options.data.torchvision import TorchvisionDataConfig

log = logging.getLogger(__name__)


def _logged_transform(cfg: ImageDataConfig, preprocess: Callable | None) -> Callable:
    """The photos' transform, said in the log."""
    transform, how = image_transform(cfg, preprocess)
    log.info("images: %s", how)
    return transform


def skimage_source(cfg: SkimagePhotosConfig, preprocess: Callable | None, seed: int) -> Dataset:
    return _skimage_dataset(cfg.photos, _logged_transform(cfg, preprocess))


def folder_source(cfg: ImageFolderConfig, preprocess: Callable | None, seed: int) -> Dataset:
    from runner.data.masks import folder_masks, mask_transform

    need = decode_size(cfg, preprocess)
    dataset = _folder_dataset(cfg.root, _logged_transform(cfg, preprocess), cfg.strict, need)
    ids = [sample_id for sample_id, _, _ in dataset.items]
    dataset.masks = folder_masks(Path(str(cfg.root)).expanduser(), ids, mask_transform(cfg, preprocess), need)
    return dataset


def synthetic_source(cfg: SyntheticConfig, preprocess: Callable | None, seed: int) -> Dataset:
    return SyntheticDataset(list(cfg.shape), cfg.count, cfg.num_classes, seed)


def torchvision_source(cfg: TorchvisionDataConfig, preprocess: Callable | None, seed: int) -> Dataset:
    # Files a data set reads with PIL keep their EXIF orientation tag: turned upright as in an image folder.
    from torchvision import transforms as T  # noqa: N812  # imported when used: it loads torch._dynamo

    return _torchvision_dataset(cfg, T.Compose([upright, _logged_transform(cfg, preprocess)]))


def _skimage_dataset(names: list[str], transform: Callable) -> ImageListDataset:
    valid = f"Photos shipped with scikit-image: {', '.join(PHOTOS)}."
    if not names:
        raise RunnerError(f"data.photos is empty: name at least one photo, e.g. data.photos=[chelsea,coffee]. {valid}")
    items = []
    for name in names:
        if name not in PHOTOS:
            _check_other_photo(name, valid)
        items.append((name, lambda name=name: _to_rgb(_skimage_photo(name)), PHOTO_LABELS.get(name, NO_LABEL)))
    dataset = ImageListDataset(items, transform)
    dataset.model_labels = True  # ImageNet-1k indices
    return dataset


def _check_other_photo(name: str, valid: str) -> None:
    """A name outside PHOTOS is allowed if scikit-image can load it as one 2-D image (some need a download)."""
    import skimage.data

    if name.startswith("_") or not callable(getattr(skimage.data, name, None)):
        raise RunnerError(f"scikit-image has no photo '{name}'.{suggest(name, PHOTOS)} {valid}")
    try:
        array = np.asarray(_skimage_photo(name))
    except Exception as e:
        raise RunnerError(
            f"Cannot load scikit-image's '{name}' ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''});"
            f" it may need a download (pooch and internet). {valid}"
        ) from e
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise RunnerError(f"scikit-image's '{name}' is not a 2-D photo (shape {array.shape}). {valid}")


def _orientation_if_readable(path: Path, need: int | None) -> int | None:
    """The file's EXIF orientation (1: upright) if PIL can decode the whole file, else None (a truncated or corrupt
    image fails here, before the run; a JPEG's reduced-scale decode still reads every byte of it)."""
    try:
        with Image.open(path) as im:
            draft(im, need)
            im.load()
            return exif_orientation(im)
    except Exception:
        return None


def _folder_dataset(root: str | None, transform: Callable, strict: bool, need: int | None = None) -> ImageListDataset:
    if not root:
        raise RunnerError("data.name=image_folder needs data.root=/path/to/images.")
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise RunnerError(f"Image folder not found: {folder}. Check `data.root`.")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                   and not p.name.lower().endswith(".mask.png"))  # fmt: skip  # masks (runner/data/composites.py)
    if not files:
        raise RunnerError(
            f"Image folder {folder} contains no images ({', '.join(sorted(IMAGE_SUFFIXES))}). Check `data.root`."
        )
    orientations = {p: _orientation_if_readable(p, need) for p in files}
    unreadable = [p for p in files if orientations[p] is None]
    if unreadable:
        names = ", ".join(str(p.relative_to(folder)) for p in unreadable[:20])
        if strict:
            raise RunnerError(
                f"{len(unreadable)} unreadable or corrupt image file(s) in {folder}: {names}."
                " Remove or replace them, or set data.strict=false to skip them."
            )
        log.warning("skipping %d unreadable or corrupt image file(s) in %s: %s", len(unreadable), folder, names)
        files = [p for p in files if p not in set(unreadable)]
        if not files:
            raise RunnerError(
                f"Every image in {folder} ({len(unreadable)} file(s): {names}) is unreadable or corrupt. Replace them"
                " with readable images, or point data.root at another folder."
            )
    # Class-per-subfolder layout (like torchvision's ImageFolder): labels are the sorted subfolder indices.
    classes = sorted({p.relative_to(folder).parts[0] for p in files if len(p.relative_to(folder).parts) > 1})
    has_classes = classes and all(len(p.relative_to(folder).parts) > 1 for p in files)

    def label(p: Path) -> int:
        return classes.index(p.relative_to(folder).parts[0]) if has_classes else NO_LABEL

    turned = sum(orientations[p] not in (None, 1) for p in files)
    if turned:  # said once: a phone photo stored sideways is shown (and fed) upright, as every viewer shows it
        log.info("images: %d of %d carry an EXIF orientation and are turned upright as a viewer shows them (their"
                 " masks with them)", turned, len(files))  # fmt: skip

    def opener(p: Path) -> Callable[[], Image.Image]:
        def load() -> Image.Image:
            try:
                return read_photo(p, need)
            except Exception as e:
                raise RunnerError(
                    f"Cannot read image {p} ({type(e).__name__}: {e}). Remove or replace the file."
                ) from e

        return load

    dataset = ImageListDataset([(str(p.relative_to(folder)), opener(p), label(p)) for p in files], transform)
    dataset.skipped = [str(p) for p in unreadable]
    dataset.classes = classes if has_classes else None  # label_name: the class folders' names
    return dataset


def _torchvision_dataset(cfg: TorchvisionDataConfig, transform: Callable) -> Dataset:
    import torchvision.datasets

    if not cfg.dataset or not hasattr(torchvision.datasets, cfg.dataset):
        names = [n for n in dir(torchvision.datasets) if n[:1].isupper()]
        raise RunnerError(f"Unknown torchvision data set '{cfg.dataset}'.{suggest(str(cfg.dataset), names)}")
    root = Path(cfg.root or "data").expanduser()
    try:
        base = getattr(torchvision.datasets, cfg.dataset)(
            str(root), download=cfg.download, transform=transform, **cfg.kwargs
        )
    except Exception as e:
        hint = "" if cfg.download else " Set data.download=true (needs internet) or put the files under data.root."
        raise RunnerError(
            f"Cannot open torchvision data set {cfg.dataset} at {root} ({type(e).__name__}: {e}).{hint}"
        ) from e

    class WithIds(Dataset):
        classes = getattr(base, "classes", None)  # label_name (CIFAR10's 'airplane', ...), where the set names them

        def __len__(self) -> int:
            return len(base)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
            x, y = base[i]
            return x, int(y) if isinstance(y, (int, np.integer)) else NO_LABEL, f"{cfg.dataset}-{i}"

    return WithIds()
