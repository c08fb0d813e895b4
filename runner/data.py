"""Data: the scikit-image photos (embedded default), any image folder, seeded synthetic tensors,
and torchvision data sets by name. Every sample is (image tensor, label or -1, sample id)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

from runner.errors import RunnerError, suggest
from runner.schema import DataConfig, ResizeMode

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}
NO_LABEL = -1

# ImageNet-1k labels of the photos that show one ImageNet class; the others have no label.
PHOTO_LABELS = {"chelsea": 285, "cat": 285, "coffee": 967}  # 285 Egyptian cat, 967 espresso


@dataclass
class Batch:
    """One batch on the device, with the identities of its samples."""

    x: torch.Tensor  # (B, C, H, W)
    labels: torch.Tensor  # (B,) int64, -1 where there is no label
    sample_ids: list[str]
    first_index: int  # position of the batch's first sample in the data set


def standard_transform(size: int, resize: ResizeMode) -> Callable[[Image.Image], torch.Tensor]:
    """ImageNet normalisation at `size`: squash to a square, or resize the short side and centre-crop."""
    if resize is ResizeMode.square:
        geometry: list[Any] = [T.Resize((size, size))]
    else:
        geometry = [T.Resize(size), T.CenterCrop(size)]
    return T.Compose([*geometry, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def _to_rgb(array: np.ndarray) -> Image.Image:
    if array.dtype == bool:
        array = array.astype(np.uint8) * 255
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    return Image.fromarray(array[..., :3])


def _skimage_photo(name: str) -> np.ndarray:
    import skimage.data

    if name == "motorcycle":  # shipped as a stereo pair; the left view is the photo
        return skimage.data.stereo_motorcycle()[0]
    return getattr(skimage.data, name)()


class ImageListDataset(Dataset):
    """Images produced by loaders, preprocessed on access."""

    def __init__(self, items: list[tuple[str, Callable[[], Image.Image], int]], transform: Callable) -> None:
        self.items = items
        self.transform = transform
        self.skipped: list[str] = []  # files left out because they could not be read

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        sample_id, load, label = self.items[i]
        return self.transform(load()), label, sample_id


class SyntheticDataset(Dataset):
    """Seeded random tensors: the same seed gives the same samples, in any order of access."""

    def __init__(self, shape: list[int], count: int, num_classes: int, seed: int) -> None:
        self.shape, self.count, self.num_classes, self.seed = shape, count, num_classes, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(self.shape, generator=g)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        return x, label, f"synthetic-{i}"


def build_dataset(cfg: DataConfig, preprocess: Callable | None, seed: int) -> Dataset:
    """The configured data set; `preprocess` (from the model's weights) wins over the standard transform.
    Unreadable image files are left out and listed by `skipped_files` (or fail the run when data.strict)."""
    transform = preprocess or standard_transform(cfg.image_size, cfg.resize)
    if cfg.name == "skimage_photos":
        dataset: Dataset = _skimage_dataset(cfg.photos, transform)
    elif cfg.name == "image_folder":
        dataset = _folder_dataset(cfg.root, transform, cfg.strict)
    elif cfg.name == "synthetic":
        dataset = SyntheticDataset(list(cfg.shape), cfg.count, cfg.num_classes, seed)
    elif cfg.name == "torchvision":
        dataset = _torchvision_dataset(cfg, transform)
    else:
        kinds = ["skimage_photos", "image_folder", "synthetic", "torchvision"]
        raise RunnerError(
            f"Unknown data source '{cfg.name}'.{suggest(cfg.name, kinds)} Use one of: {', '.join(kinds)}."
        )
    if cfg.limit is not None:
        dataset = torch.utils.data.Subset(dataset, range(min(cfg.limit, len(dataset))))  # type: ignore[arg-type]
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise RunnerError(f"The data set '{cfg.name}' has no samples (limit={cfg.limit}).")
    return dataset


def skipped_files(dataset: Dataset) -> list[str]:
    """The input files the data set left out as unreadable (for the log and the tables' metadata)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return list(getattr(dataset, "skipped", []))


def _skimage_dataset(names: list[str], transform: Callable) -> ImageListDataset:
    import skimage.data

    known = [n for n in dir(skimage.data) if not n.startswith("_")] + ["motorcycle"]
    items = []
    for name in names:
        if name not in known:
            raise RunnerError(f"scikit-image has no photo '{name}'.{suggest(name, known)}")
        items.append((name, lambda name=name: _to_rgb(_skimage_photo(name)), PHOTO_LABELS.get(name, NO_LABEL)))
    return ImageListDataset(items, transform)


def _readable(path: Path) -> bool:
    """Whether PIL can decode the whole file (a truncated or corrupt image fails here, before the run)."""
    try:
        with Image.open(path) as im:
            im.load()
        return True
    except Exception:
        return False


def _folder_dataset(root: str | None, transform: Callable, strict: bool) -> ImageListDataset:
    if not root:
        raise RunnerError("data.name=image_folder needs data.root=/path/to/images.")
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise RunnerError(f"Image folder not found: {folder}. Check `data.root`.")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise RunnerError(
            f"Image folder {folder} contains no images ({', '.join(sorted(IMAGE_SUFFIXES))}). Check `data.root`."
        )
    unreadable = [p for p in files if not _readable(p)]
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
            raise RunnerError(f"Every image in {folder} is unreadable or corrupt.")
    # Class-per-subfolder layout (like torchvision's ImageFolder): labels are the sorted subfolder indices.
    classes = sorted({p.relative_to(folder).parts[0] for p in files if len(p.relative_to(folder).parts) > 1})
    has_classes = classes and all(len(p.relative_to(folder).parts) > 1 for p in files)

    def label(p: Path) -> int:
        return classes.index(p.relative_to(folder).parts[0]) if has_classes else NO_LABEL

    def opener(p: Path) -> Callable[[], Image.Image]:
        def load() -> Image.Image:
            try:
                with Image.open(p) as im:
                    return im.convert("RGB")
            except Exception as e:
                raise RunnerError(
                    f"Cannot read image {p} ({type(e).__name__}: {e}). Remove or replace the file."
                ) from e

        return load

    dataset = ImageListDataset([(str(p.relative_to(folder)), opener(p), label(p)) for p in files], transform)
    dataset.skipped = [str(p) for p in unreadable]
    return dataset


def _torchvision_dataset(cfg: DataConfig, transform: Callable) -> Dataset:
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
        def __len__(self) -> int:
            return len(base)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
            x, y = base[i]
            return x, int(y) if isinstance(y, (int, np.integer)) else NO_LABEL, f"{cfg.dataset}-{i}"

    return WithIds()


def make_loader(dataset: Dataset, cfg: DataConfig, device: torch.device) -> DataLoader:
    """Batches in data set order; pinned memory (for non-blocking copies) on GPUs unless configured otherwise."""
    workers = cfg.num_workers > 0
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=False,  # sample order is part of the result's identity (and of resuming)
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=cfg.persistent_workers and workers,
    )


def to_batch(
    raw: tuple[torch.Tensor, torch.Tensor, list[str]],
    device: torch.device,
    first_index: int,
    channels_last: bool = False,
) -> Batch:
    x, labels, ids = raw
    non_blocking = device.type == "cuda"  # from pinned memory the copy overlaps with work already queued
    x = x.to(device, non_blocking=non_blocking)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return Batch(x, labels.to(device, non_blocking=non_blocking), list(ids), first_index)
