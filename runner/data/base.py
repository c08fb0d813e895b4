"""Data: the scikit-image photos (embedded default), any image folder, seeded synthetic tensors,
and torchvision data sets by name. Every sample is (image tensor, label or -1, sample id).

Each source is a config dataclass (its option's schema: conf/data/<name>.yaml names it first) and a
builder registered under that type with `@data_source(ItsConfig)`; a new source is one more pair here."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms as T

from runner.errors import RunnerError, suggest
from runner.registry import Registry
from runner.schema import MAX_IMAGE_SIDE, DataConfig, ResizeMode

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}
NO_LABEL = -1

# ImageNet-1k labels of the photos that show one ImageNet class; the others have no label.
PHOTO_LABELS = {"chelsea": 285, "cat": 285, "coffee": 967}  # 285 Egyptian cat, 967 espresso
# The 2-D photos and pictures that ship inside scikit-image (no download needed).
PHOTOS = (
    "astronaut", "binary_blobs", "brick", "camera", "cat", "cell", "checkerboard", "chelsea", "clock", "coffee",
    "coins", "colorwheel", "grass", "gravel", "horse", "hubble_deep_field", "immunohistochemistry", "logo",
    "microaneurysms", "moon", "motorcycle", "page", "retina", "rocket", "shepp_logan_phantom", "text",
)  # fmt: skip


# ---- the sources' configs ---------------------------------------------------------------------------------------
@dataclass
class ImageDataConfig(DataConfig):
    """A source of photos: how each becomes the model's input."""

    resize: ResizeMode = ResizeMode.square


@dataclass
class SkimagePhotosConfig(ImageDataConfig):
    name: str = "skimage_photos"
    photos: list[str] = field(
        default_factory=lambda: ["chelsea", "coffee", "rocket", "astronaut", "motorcycle", "horse"]
    )


@dataclass
class ImageFolderConfig(ImageDataConfig):
    name: str = "image_folder"
    root: str | None = None  # the folder (class-per-subfolder layouts get labels)
    strict: bool = False  # fail on an unreadable image instead of skipping it (skips are logged)


@dataclass
class TorchvisionDataConfig(ImageDataConfig):
    name: str = "torchvision"
    dataset: str | None = None  # the data set class name, e.g. CIFAR10
    root: str | None = None  # where the files are
    download: bool = False  # allowed to download (needs internet)
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra constructor arguments


# Bound that keeps a typo from allocating tens of gigabytes (data.shape=[3,60000,60000] is 43 GB a sample).
MAX_SAMPLE_ELEMENTS = 3 * MAX_IMAGE_SIDE * MAX_IMAGE_SIDE


@dataclass
class SyntheticConfig(DataConfig):
    name: str = "synthetic"
    shape: list[int] = field(default_factory=lambda: [3, 224, 224])  # one sample's shape
    count: int = 8  # how many samples
    num_classes: int = 1000  # labels drawn from range(num_classes)

    def check(self) -> list[str]:
        bad = super().check()
        bad += [f"data.{key}={value}" for key, value in (("count", self.count), ("num_classes", self.num_classes))
                if value < 1]  # fmt: skip
        if len(self.shape) < 1 or min(self.shape) < 1:
            bad.append(f"data.shape={self.shape} (positive sizes)")
        elif math.prod(self.shape) > MAX_SAMPLE_ELEMENTS:
            gigabytes = math.prod(self.shape) * 4 / 1e9
            raise RunnerError(
                f"data.shape={list(self.shape)} is {gigabytes:.1f} GB per sample in float32, above the bound of"
                f" {MAX_SAMPLE_ELEMENTS} values ([3,{MAX_IMAGE_SIDE},{MAX_IMAGE_SIDE}]); use a smaller shape,"
                " e.g. data.shape=[3,224,224]."
            )
        return bad


Builder = Callable[[Any, Callable | None, int], Dataset]
B = TypeVar("B", bound=Builder)
# Every data source's builder by its config type: (config, the weights' preprocessing or None, seed) -> data set.
DATA_SOURCES: Registry[type[DataConfig], Builder] = Registry("data source", lambda config: config.name)


def data_source(config: type[DataConfig]) -> Callable[[B], B]:
    """Function decorator: `build` makes the data set of configs of type `config` (option `config.name`)."""
    return DATA_SOURCES.register(config)


def data_config_class(name: str) -> type[DataConfig]:
    """The config dataclass of the data source called `name` (RunnerError with the nearest names if none is)."""
    return DATA_SOURCES.key(name)


def data_config(name: str, **fields: Any) -> DataConfig:
    """The config of the data source called `name` with `fields` (a key of another source is a TypeError)."""
    return data_config_class(name)(**fields)


@dataclass
class Batch:
    """One batch on the device, with the identities of its samples."""

    x: torch.Tensor  # (B, C, H, W)
    labels: torch.Tensor  # (B,) int64, -1 where there is no label
    sample_ids: list[str]
    first_index: int  # position of the batch's first sample in the data set
    masks: torch.Tensor | None = None  # (B, H, W) bool localisation masks at input resolution; None: the data has none

    def part(self, lo: int, hi: int) -> Batch:
        """Samples lo..hi-1 as a batch of their own (masks included)."""
        masks = None if self.masks is None else self.masks[lo:hi]
        return Batch(self.x[lo:hi], self.labels[lo:hi], self.sample_ids[lo:hi], self.first_index + lo, masks)


def letterbox_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) with the long side scaled to `size`, the aspect ratio kept."""
    scale = size / max(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


class LongSide:
    """A PIL image with its long side scaled to `size` (aspect kept): a photo is resized before it becomes a float
    tensor, so a big one never is one at full size (an 8000 px square would be 768 MB)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, im: Image.Image) -> Image.Image:
        new_h, new_w = letterbox_size(im.height, im.width, self.size)
        return im if (new_h, new_w) == (im.height, im.width) else im.resize((new_w, new_h), Image.Resampling.BILINEAR)


class Letterbox:
    """Scale the long side to `size` (aspect ratio kept), then pad to size x size around the centre with 0:
    the mean colour once normalised, as the occlusion corruption uses."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (C, H, W) normalised
        h, w = x.shape[-2:]
        new_h, new_w = letterbox_size(h, w, self.size)
        if (new_h, new_w) != (h, w):  # a photo comes scaled already (LongSide)
            x = T.functional.resize(x, [new_h, new_w], antialias=True)  # (C, new_h, new_w)
        top, left = (self.size - new_h) // 2, (self.size - new_w) // 2
        return torch.nn.functional.pad(x, (left, self.size - new_w - left, top, self.size - new_h - top))


def standard_transform(
    size: int, resize: ResizeMode, mean: Any = IMAGENET_MEAN, std: Any = IMAGENET_STD
) -> Callable[[Image.Image], torch.Tensor]:
    """Normalisation (ImageNet's by default) at `size`, with the geometry `resize` names (see ResizeMode)."""
    normalise = [T.ToTensor(), T.Normalize(mean, std)]
    if resize is ResizeMode.square:
        return T.Compose([T.Resize((size, size)), *normalise])
    if resize is ResizeMode.crop:
        return T.Compose([T.Resize(size), T.CenterCrop(size), *normalise])
    if resize is ResizeMode.pad:  # resized before normalising, padded after: the bands are exactly 0
        return T.Compose([LongSide(size), *normalise, Letterbox(size)])
    return T.Compose([T.Resize(size), *normalise])  # none: short side to size, aspect kept, nothing cut


def describe_resize(size: int, resize: ResizeMode) -> str:
    """One line for the log: how photos become inputs."""
    return {
        ResizeMode.square: f"squashed to {size}x{size} (data.resize=square: the aspect ratio changes)",
        ResizeMode.crop: f"short side to {size}, centre crop {size}x{size} (data.resize=crop: the long side's ends"
        " are cut off)",
        ResizeMode.pad: f"letterboxed to {size}x{size} (data.resize=pad: long side to {size}, aspect kept, padded"
        " with the mean colour)",
        ResizeMode.none: f"short side to {size}, aspect kept, nothing cut (data.resize=none: a batch of different"
        " sizes is padded at the bottom and right to its largest image with the mean colour)",
    }[resize]


def model_input_size(preprocess: Callable | None) -> int | None:
    """The square input side a model's own preprocessing makes (a Hugging Face image processor's, timm's data
    config's, torchvision weights' crop), or None when the model says none (random init, `_target_`, embedded)."""
    size = getattr(preprocess, "input_size", None)  # runner.models.base.Preprocess (timm, Hugging Face)
    if size is None:
        crop = getattr(preprocess, "crop_size", None)  # torchvision weights' transforms: [224]
        if isinstance(crop, (list, tuple)) and crop and all(c == crop[0] for c in crop):
            size = crop[0]
    return int(size) if isinstance(size, int) and size > 0 else None


def sized_for_model(cfg: DataConfig, preprocess: Callable | None) -> DataConfig:
    """`cfg` with the model's own input size, where the model has one: every source's inputs are then the size
    the model takes (photos: `image_size`; synthetic tensors: the height and width of `shape`), said in the log."""
    size = model_input_size(preprocess)
    if size is None:
        return cfg
    shape = getattr(cfg, "shape", None)
    if shape is not None:  # a source that says its samples' shape: channels kept, height and width the model's
        if len(shape) != 3 or list(shape[1:]) == [size, size]:
            return cfg
        log.info("inputs: %dx%d, the model's own size (its preprocessing); data.shape=%s becomes %s", size, size,
                 list(shape), [shape[0], size, size])  # fmt: skip
        return dataclasses.replace(cfg, shape=[shape[0], size, size])  # type: ignore[call-arg]
    if cfg.image_size != size:
        log.info("inputs: %dx%d, the model's own size (its preprocessing); data.image_size=%d is not used",
                 size, size, cfg.image_size)  # fmt: skip
    return dataclasses.replace(cfg, image_size=size)


def image_transform(cfg: ImageDataConfig, preprocess: Callable | None) -> tuple[Callable, str]:
    """The transform for photos and its description for the log.

    A model's own preprocessing (torchvision weights, timm's data config, a Hugging Face image processor) is
    used whole for `square` and `crop`; for `pad` and `none` the geometry is the runner's, at the model's own
    input size (`sized_for_model`), with the model's mean and std, so nothing is cut.
    """
    if preprocess is None:
        return standard_transform(cfg.image_size, cfg.resize), describe_resize(cfg.image_size, cfg.resize)
    if cfg.resize in (ResizeMode.pad, ResizeMode.none):
        mean, std = getattr(preprocess, "mean", IMAGENET_MEAN), getattr(preprocess, "std", IMAGENET_STD)
        transform = standard_transform(cfg.image_size, cfg.resize, mean, std)
        return transform, describe_resize(cfg.image_size, cfg.resize) + ", the model's mean and std"
    resize_size, crop_size = getattr(preprocess, "resize_size", "?"), getattr(preprocess, "crop_size", "?")
    return preprocess, (
        f"the model's own preprocessing (short side to {resize_size}, centre crop {crop_size}); data.resize and"
        " data.image_size are not used (data.resize=pad or none keeps the whole photo)"
    )


def _to_uint8(array: np.ndarray) -> np.ndarray:
    """8-bit values of an image array, scaled from its type's range (16-bit, float in [0, 1]), never clipped."""
    if array.dtype == bool:
        return array.astype(np.uint8) * 255
    if array.dtype == np.uint8:
        return array
    values = array.astype(np.float64)
    if np.issubdtype(array.dtype, np.floating):
        top = 1.0 if values.size == 0 or values.max() <= 1.0 else 255.0
    elif array.dtype.itemsize <= 2:
        top = float(np.iinfo(array.dtype).max)  # 16-bit: 65535 is white, also in a dark image
    else:  # PIL's mode I (int32) holds 8-bit or 16-bit data: the values say which
        peak = values.max() if values.size else 0
        top = 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else float(np.iinfo(array.dtype).max)
    return np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8)


def _to_rgb(array: np.ndarray) -> Image.Image:
    array = _to_uint8(array)
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    return Image.fromarray(array[..., :3])


def pil_to_rgb(im: Image.Image) -> Image.Image:
    """RGB of any PIL image; 16-bit and 32-bit grey images are scaled to 0-255 (PIL's convert clips them)."""
    if im.mode.startswith("I") or im.mode == "F":  # I;16, I;16B, I;16L, I (32-bit int), F (float)
        return _to_rgb(np.asarray(im))
    return im.convert("RGB")


EXIF_ORIENTATION = 0x0112  # the EXIF tag that says how a viewer turns the stored pixels upright
# A JPEG is decoded at the smallest 1/2, 1/4 or 1/8 scale that keeps both sides at least this many times the size
# its transform needs: Pillow's `reducing_gap` (3: "indistinguishable from fair resampling"), so a big photo is never
# decoded at full size and the result stays within an 8-bit level or two of a full decode.
DRAFT_GAP = 3


def exif_orientation(im: Image.Image) -> int:
    """An opened image's EXIF orientation: 1 stored upright (or no tag), 2-8 flipped and/or turned."""
    try:
        value = im.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # a damaged EXIF block: the pixels as stored
        return 1
    return value if isinstance(value, int) and 2 <= value <= 8 else 1


def upright(image: Any) -> Any:
    """A PIL image as a viewer shows it (its EXIF orientation applied); anything else (a tensor, an array) as is."""
    if isinstance(image, Image.Image) and exif_orientation(image) != 1:
        return ImageOps.exif_transpose(image)
    return image


def oriented(im: Image.Image, orientation: int) -> Image.Image:
    """`im` (stored pixels) turned as EXIF `orientation` says: by PIL's own exif_transpose, so that a mask turned
    here lands on the pixels its photo's turned copy shows."""
    if orientation == 1:
        return im
    im = im.copy()
    im.getexif()[EXIF_ORIENTATION] = orientation
    return ImageOps.exif_transpose(im)


def draft(im: Image.Image, need: int | None) -> None:
    """Decode a JPEG at a reduced scale (in place, before it is loaded) when both sides stay >= DRAFT_GAP * need;
    other formats, and need=None (the size is unknown), decode in full."""
    if need is not None:
        im.draft(None, (DRAFT_GAP * need, DRAFT_GAP * need))


def decode_size(cfg: ImageDataConfig, preprocess: Callable | None) -> int | None:
    """The side a photo needs before its transform: data.image_size, or the model's preprocessing resize size
    where that applies (None where it does not say: decoded in full)."""
    if preprocess is None or cfg.resize in (ResizeMode.pad, ResizeMode.none):
        return cfg.image_size
    size = getattr(preprocess, "resize_size", None)
    sizes = list(size) if isinstance(size, (list, tuple)) else [size]
    return max(sizes) if all(isinstance(v, int) and v > 0 for v in sizes) else None


def read_photo(path: Path, need: int | None = None) -> Image.Image:
    """An image file as the RGB photo a viewer shows: EXIF orientation applied, 16-bit scaled to 8-bit, a JPEG
    decoded no larger than it must be for a side of `need` px (`draft`)."""
    with Image.open(path) as im:
        draft(im, need)
        return pil_to_rgb(upright(im))


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
        self.classes: list[str] | None = None  # the labels' names by index, where the data set has them
        self.model_labels = False  # whether labels are the model's class indices (the photos' ImageNet ones)
        # A sample id's localisation mask (H, W) bool at input resolution (runner/data/composites.py); None: no masks.
        self.masks: Callable[[str], torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        sample_id, load, label = self.items[i]
        return self.transform(load()), label, sample_id


class SyntheticDataset(Dataset):
    """Seeded random tensors: the same seed gives the same samples, in any order of access."""

    model_labels = True  # labels are drawn from range(num_classes): class indices of the model, as target=label uses

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
    """The configured data set; `preprocess` (from the model's weights) wins over the standard transform, and
    the model's own input size over the configured one (`sized_for_model`). Unreadable image files are left
    out and listed by `skipped_files` (or fail the run when data.strict)."""
    cfg = sized_for_model(cfg, preprocess)
    build = DATA_SOURCES.for_config(cfg, "data")
    dataset = build(cfg, preprocess, seed)
    if cfg.limit is not None:
        dataset = torch.utils.data.Subset(dataset, range(min(cfg.limit, len(dataset))))  # type: ignore[arg-type]
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise RunnerError(
            f"The data set '{cfg.name}' has no samples (limit={cfg.limit}): check data.root / data.dataset, or"
            " remove data.limit."
        )
    return dataset


def _logged_transform(cfg: ImageDataConfig, preprocess: Callable | None) -> Callable:
    """The photos' transform, said in the log."""
    transform, how = image_transform(cfg, preprocess)
    log.info("images: %s", how)
    return transform


@data_source(SkimagePhotosConfig)
def _skimage_source(cfg: SkimagePhotosConfig, preprocess: Callable | None, seed: int) -> Dataset:
    return _skimage_dataset(cfg.photos, _logged_transform(cfg, preprocess))


@data_source(ImageFolderConfig)
def _folder_source(cfg: ImageFolderConfig, preprocess: Callable | None, seed: int) -> Dataset:
    from runner.data.composites import folder_masks, mask_transform

    need = decode_size(cfg, preprocess)
    dataset = _folder_dataset(cfg.root, _logged_transform(cfg, preprocess), cfg.strict, need)
    ids = [sample_id for sample_id, _, _ in dataset.items]
    dataset.masks = folder_masks(Path(str(cfg.root)).expanduser(), ids, mask_transform(cfg, preprocess), need)
    return dataset


@data_source(SyntheticConfig)
def _synthetic_source(cfg: SyntheticConfig, preprocess: Callable | None, seed: int) -> Dataset:
    return SyntheticDataset(list(cfg.shape), cfg.count, cfg.num_classes, seed)


@data_source(TorchvisionDataConfig)
def _torchvision_source(cfg: TorchvisionDataConfig, preprocess: Callable | None, seed: int) -> Dataset:
    # Files a data set reads with PIL keep their EXIF orientation tag: turned upright as in an image folder.
    return _torchvision_dataset(cfg, T.Compose([upright, _logged_transform(cfg, preprocess)]))


def skipped_files(dataset: Dataset) -> list[str]:
    """The input files the data set left out as unreadable (for the log and the tables' metadata)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return list(getattr(dataset, "skipped", []))


def sample_masks(dataset: Dataset) -> Callable[[str], torch.Tensor] | None:
    """The data set's mask of a sample id ((H, W) bool at input resolution), or None when it has no masks."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return getattr(dataset, "masks", None)


def label_classes(dataset: Dataset) -> tuple[list[str] | None, bool]:
    """(the data set's own names of its labels by index, or None; whether its labels are the model's classes)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    classes = getattr(dataset, "classes", None)
    if not isinstance(classes, (list, tuple)) or not all(isinstance(c, str) for c in classes):
        classes = None  # e.g. torchvision's ImageNet: a tuple of synonyms per class
    return (list(classes) if classes else None), bool(getattr(dataset, "model_labels", False))


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


def pad_collate(samples: list[tuple[torch.Tensor, int, str]]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Stack a batch; images of different sizes (data.resize=none) are padded at the bottom and right to the
    batch's largest height and width with 0, the mean colour once normalised (top-left pixels keep their place)."""
    images = [x for x, _, _ in samples]
    height = max(x.shape[-2] for x in images)
    width = max(x.shape[-1] for x in images)
    padded = [torch.nn.functional.pad(x, (0, width - x.shape[-1], 0, height - x.shape[-2])) for x in images]
    labels = torch.tensor([int(y) for _, y, _ in samples], dtype=torch.int64)  # (B,)
    return torch.stack(padded), labels, [i for _, _, i in samples]  # (B, C, height, width)


class MaskCollate:
    """A collate that appends the samples' masks (B, H, W) bool, looked up by sample id, to (x, labels, ids);
    masks are padded like their images (data.resize=none: bottom and right, outside the region)."""

    def __init__(self, collate: Callable, masks: Callable[[str], torch.Tensor]) -> None:
        self.collate, self.masks = collate, masks

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor]:
        x, labels, ids = self.collate(samples)
        height, width = x.shape[-2:]
        masks = []
        for sample_id, image in zip(ids, x, strict=True):
            mask = self.masks(sample_id)  # (h, w) bool
            if mask.shape[0] > height or mask.shape[1] > width:  # a data set bug: masks follow the photos' geometry
                raise RunnerError(f"The mask of {sample_id} is {tuple(mask.shape)}, its input {tuple(image.shape)}.")
            masks.append(torch.nn.functional.pad(mask, (0, width - mask.shape[1], 0, height - mask.shape[0])))
        return x, labels, list(ids), torch.stack(masks)  # masks (B, height, width)


class RangesSampler(Sampler[int]):
    """The indices of `ranges`, one range after another: one loader's order over a run's shards."""

    def __init__(self, ranges: list[range]) -> None:
        self.ranges = ranges

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.ranges)

    def __len__(self) -> int:
        return sum(len(r) for r in self.ranges)


# Workers a GPU run gets when data.num_workers is null: enough to decode JPEGs ahead of the GPU, few enough
# not to crowd a shared node (each worker holds a copy of the data set's Python state).
GPU_DEFAULT_WORKERS = 4


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one: a SLURM job's share, not the node's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def loader_settings(cfg: DataConfig, device: torch.device) -> tuple[int, bool]:
    """(num_workers, pin_memory) for `device`: explicit values as given; null workers are 0 on the CPU (the
    model competes with them for the same cores) and min(4, CPUs) on a GPU; null pinning is on for a GPU."""
    on_gpu = device.type == "cuda"
    workers = cfg.num_workers
    if workers is None:
        workers = min(GPU_DEFAULT_WORKERS, available_cpus()) if on_gpu else 0
    return workers, on_gpu if cfg.pin_memory is None else cfg.pin_memory


def make_loader(
    dataset: Dataset, cfg: DataConfig, device: torch.device, sampler: Sampler[int] | None = None
) -> DataLoader:
    """Batches in data set order (or `sampler`'s); workers and pinned memory as `loader_settings` resolves them."""
    num_workers, pin_memory = loader_settings(cfg, device)
    workers = num_workers > 0
    collate: Callable | None = pad_collate if getattr(cfg, "resize", None) is ResizeMode.none else None
    masks = sample_masks(dataset)
    if masks is not None:  # localisation masks travel with their batch
        collate = MaskCollate(collate or torch.utils.data.default_collate, masks)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        collate_fn=collate,
        shuffle=False,  # sample order is part of the result's identity (and of resuming)
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=cfg.persistent_workers and workers,
    )


def to_batch(
    raw: tuple[Any, ...],
    device: torch.device,
    first_index: int,
    channels_last: bool = False,
) -> Batch:
    """The loader's (x, labels, ids[, masks]) on the device as a Batch."""
    x, labels, ids, *rest = raw
    non_blocking = device.type == "cuda"  # from pinned memory the copy overlaps with work already queued
    x = x.to(device, non_blocking=non_blocking)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    masks = rest[0].to(device, non_blocking=non_blocking) if rest else None  # (B, H, W) bool
    return Batch(x, labels.to(device, non_blocking=non_blocking), list(ids), first_index, masks)


import runner.data.composites  # noqa: E402, F401  # registers the `composites` source (it builds on this module)
