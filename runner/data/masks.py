"""Localisation masks: read beside an image folder (masks.json boxes, <image>.mask.png files) and brought to
the model's input geometry by the same resize as the image."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from runner.data.images import Letterbox, draft, exif_orientation, oriented
from runner.errors import RunnerError, suggest
from runner.options.data.images import MASK_SUFFIX, MASKS_FILE, ImageDataConfig
from runner.schema import ResizeMode


def is_mask_file(path: Path) -> bool:
    """Whether a folder file is a `<name>.mask.png` side file (a mask, never an image)."""
    return path.name.lower().endswith(MASK_SUFFIX)


def _pixel_size(size: object) -> bool:
    """Whether `size` is one torchvision's resize and centre crop take: an int, or a list of one or two ints."""
    if isinstance(size, int):
        return True
    return isinstance(size, (list, tuple)) and 1 <= len(size) <= 2 and all(isinstance(v, int) for v in size)


def mask_transform(cfg: ImageDataConfig, preprocess: Callable | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """(H, W) bool at the photo's size -> (h, w) bool at the input's, with the photos' geometry (image_transform's
    choice): resized as a 0/1 image like the photo, then a pixel is in where at least half of it is."""
    from torchvision.transforms import functional as TF  # noqa: N812  # imported when used: it loads torch._dynamo

    size, resize = cfg.image_size, cfg.resize
    steps: list[Callable[[torch.Tensor], torch.Tensor]]
    if preprocess is not None and resize in (ResizeMode.square, ResizeMode.crop):
        resize_size, crop_size = getattr(preprocess, "resize_size", None), getattr(preprocess, "crop_size", None)
        if not (_pixel_size(resize_size) and _pixel_size(crop_size)):  # None, or an image processor's "64x64"
            raise RunnerError(
                "Localisation masks need the input geometry, and this model's own preprocessing does not say it:"
                " set data.resize=pad or data.resize=none (the runner's geometry, the weights' mean and std)."
            )
        steps = [lambda m: TF.resize(m, resize_size, antialias=True), lambda m: TF.center_crop(m, crop_size)]
    elif resize is ResizeMode.square:
        steps = [lambda m: TF.resize(m, [size, size], antialias=True)]
    elif resize is ResizeMode.crop:
        steps = [lambda m: TF.resize(m, size, antialias=True), lambda m: TF.center_crop(m, [size, size])]
    elif resize is ResizeMode.pad:
        steps = [Letterbox(size)]  # its bands are 0: outside the mask
    else:
        steps = [lambda m: TF.resize(m, size, antialias=True)]

    def apply(mask: torch.Tensor) -> torch.Tensor:
        m = mask.float()[None]  # (1, H, W)
        for step in steps:
            m = step(m)
        return m[0] >= 0.5  # (h, w)

    return apply


def box_mask(boxes: list[list[float]], height: int, width: int) -> torch.Tensor:
    """(height, width) bool: the union of [x0, y0, x1, y1] boxes (x1, y1 exclusive), clipped to the image."""
    mask = torch.zeros(height, width, dtype=torch.bool)
    for x0, y0, x1, y1 in boxes:
        left, top = max(0, math.floor(x0)), max(0, math.floor(y0))
        right, bottom = min(width, math.ceil(x1)), min(height, math.ceil(y1))
        if right > left and bottom > top:
            mask[top:bottom, left:right] = True
    return mask


class FolderMasks:
    """The masks of an image folder's samples, by sample id (relative path), at the input's resolution."""

    def __init__(self, folder: Path, boxes: dict[str, list[list[float]]], pngs: dict[str, Path],
                 geometry: Callable[[torch.Tensor], torch.Tensor], need: int | None = None) -> None:  # fmt: skip
        self.folder, self.boxes, self.pngs, self.geometry = folder, boxes, pngs, geometry
        self.need = need  # the side the photos are decoded for (runner/data/base.py `read_photo`)

    def __call__(self, sample_id: str) -> torch.Tensor:
        """(h, w) bool mask of `sample_id`; empty when the side files give it no region."""
        with Image.open(self.folder / sample_id) as im:  # the header only
            width, height = im.size  # the stored pixels, which the side files are in
            orientation = exif_orientation(im)
            draft(im, self.need)
            decoded = im.size  # the size read_photo decodes it at (a JPEG may decode at a reduced scale)
        mask = box_mask(self.boxes.get(sample_id, []), height, width)  # (height, width)
        png = self.pngs.get(sample_id)
        if png is not None:
            with Image.open(png) as im:
                array = np.asarray(im if im.mode.startswith("I") or im.mode == "F" else im.convert("RGB"))
            if array.ndim == 3:
                array = array.max(axis=-1)
            if array.shape != (height, width):
                raise RunnerError(
                    f"Mask {png} is {array.shape[1]}x{array.shape[0]} px but its image {sample_id} is"
                    f" {width}x{height}: a .mask.png must have the image's size."
                )
            mask |= torch.from_numpy(array > 0)
        return self.geometry(_as_read(mask, decoded, orientation))


def _as_read(mask: torch.Tensor, decoded: tuple[int, int], orientation: int) -> torch.Tensor:
    """A stored-pixel mask (H, W) on the pixels of its photo as read_photo returns it: scaled to the decoded
    (width, height) (a fraction per pixel: the geometry thresholds it once, at the input's size), then turned by its
    EXIF orientation with the photo's own transpose. Unchanged for an upright photo decoded in full."""
    if decoded == (mask.shape[1], mask.shape[0]) and orientation == 1:
        return mask
    from torchvision.transforms import functional as TF  # noqa: N812  # imported when used: it loads torch._dynamo

    m = mask.float()  # (H, W)
    if decoded != (m.shape[1], m.shape[0]):
        m = TF.resize(m[None], [decoded[1], decoded[0]], antialias=True)[0]  # (decoded h, decoded w)
    if orientation != 1:
        m = torch.from_numpy(np.array(oriented(Image.fromarray(m.numpy()), orientation)))
    return m


def folder_masks(
    folder: Path, sample_ids: list[str], geometry: Callable[[torch.Tensor], torch.Tensor], need: int | None = None
) -> FolderMasks | None:
    """The folder's masks from its side files (see the module's docstring); None when it has none."""
    boxes: dict[str, list[list[float]]] = {}
    side = folder / MASKS_FILE
    if side.is_file():
        boxes = _read_boxes(side, sample_ids)
    pngs = {}
    for sample_id in sample_ids:
        path = folder / sample_id
        png = path.with_name(path.stem + MASK_SUFFIX)
        if png.is_file():
            pngs[sample_id] = png
    if not boxes and not pngs:
        return None
    return FolderMasks(folder, boxes, pngs, geometry, need)


def _read_boxes(side: Path, sample_ids: list[str]) -> dict[str, list[list[float]]]:
    """masks.json's boxes by sample id, checked: every key an image of the folder, every box 4 numbers."""
    example = '{"cat/a.png": {"boxes": [[10, 20, 110, 140]]}}'
    try:
        entries = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise RunnerError(f"Cannot read {side} ({type(e).__name__}: {e}). Expected e.g. {example}.") from e
    if not isinstance(entries, dict):
        raise RunnerError(f"{side} must map image paths to {{'boxes': [...]}}, e.g. {example}.")
    known = set(sample_ids)
    boxes: dict[str, list[list[float]]] = {}
    for key, entry in entries.items():
        if key not in known:
            raise RunnerError(
                f"{side} names '{key}', which is not an image of the folder.{suggest(key, sample_ids)}"
                " Keys are paths relative to data.root, as the sample_id column shows them."
            )
        items = entry.get("boxes") if isinstance(entry, dict) else None
        ok = isinstance(items, list) and all(
            isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) for v in b) for b in items
        )
        if not ok:
            raise RunnerError(f"{side}: '{key}' needs {{'boxes': [[x0, y0, x1, y1], ...]}} in pixels, e.g. {example}.")
        boxes[key] = [[float(v) for v in b] for b in items]  # type: ignore[union-attr]
    return boxes
