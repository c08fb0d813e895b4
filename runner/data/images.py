"""Photos to input tensors: the resize modes (square, crop, letterbox, none), EXIF orientation, decoding at the
size needed, the ImageNet normalisation, and a model's own preprocessing where its weights bring one."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from runner.options.data.images import ImageDataConfig
from runner.schema import DataConfig, ResizeMode

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)


IMAGENET_STD = (0.229, 0.224, 0.225)


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
        from torchvision import transforms as T  # noqa: N812  # imported when used: it loads torch._dynamo

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
    from torchvision import transforms as T  # noqa: N812  # imported when used: it loads torch._dynamo

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


EXIF_ORIENTATION = 0x0112  # the EXIF tag that says how a viewer turns the stored pixels upright


# A JPEG is decoded at the smallest 1/2, 1/4 or 1/8 scale that keeps both sides at least this many times the size
# its transform needs: Pillow's `reducing_gap` (3: "indistinguishable from fair resampling"), so a big photo is never
# decoded at full size and the result stays within an 8-bit level or two of a full decode.
DRAFT_GAP = 3
