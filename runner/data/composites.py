"""Localisation masks: an image folder's side files, their geometry, and the built-in offline benchmark.

A mask is (H, W) bool at the model input's resolution, made from the photo-resolution region with the same
resize / crop / letterbox as the photo (`mask_transform`), so it lies on the pixels the model sees.

Image folder side files (either or both; a sample with neither gets an empty mask, so its localisation
values are NaN):
- `masks.json` in data.root: {"relative/path.png": {"boxes": [[x0, y0, x1, y1], ...]}} in the stored photo's
  pixels (x right, y down from the top-left corner; x1, y1 exclusive): the union of the boxes.
- `<name>.mask.png` beside `<name>.<ext>`: the same size as the photo; non-zero pixels are the region. Files
  ending in `.mask.png` are never read as images.
Both are in the stored pixels (what an image library reads, before any EXIF orientation): a photo with an EXIF
orientation is turned upright when read (runner/data/base.py `read_photo`), and its mask is turned the same way, so it
stays on the same pixels of the scene. A JPEG decoded at a reduced scale takes its mask scaled to that size first.

The built-in benchmark `data=composites`: real scikit-image photos whose class the embedded EfficientNet-Lite0
names at top-1, each pasted into one cell of a 2x2 grid (the other cells the mean colour, or the other photos
with layout=grid), once at each of the four positions. Label = the photo's ImageNet class (explain
it with method.target=label); mask = its cell. Deterministic and offline.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from PIL import Image
from torch.utils.data import Dataset

from runner.data.base import ImageListDataset
from runner.data.images import IMAGENET_MEAN, _skimage_photo, _to_rgb
from runner.data.masks import box_mask, mask_transform
from runner.data.sources import _logged_transform
from runner.options.data.composites import COMPOSITE_CLASSES, CompositeLayout, CompositesConfig

POSITIONS = ("top_left", "top_right", "bottom_left", "bottom_right")
CELL = 224  # px of a grid cell: the composite is 2 * CELL square before the input transform


@lru_cache(maxsize=16)
def _cell(name: str) -> Image.Image:
    """The photo's centre square at CELL x CELL px."""
    photo = _to_rgb(_skimage_photo(name))
    side = min(photo.size)
    left, top = (photo.width - side) // 2, (photo.height - side) // 2
    return photo.crop((left, top, left + side, top + side)).resize((CELL, CELL), Image.Resampling.BILINEAR)


def composite(name: str, position: int, others: list[str]) -> Image.Image:
    """The 2 CELL square picture: photo `name` in cell `position` (POSITIONS' order), `others` in the rest
    (the mean colour where `others` is empty)."""
    mean = tuple(round(255 * m) for m in IMAGENET_MEAN)
    canvas = Image.new("RGB", (2 * CELL, 2 * CELL), mean)  # type: ignore[arg-type]  # an RGB triple
    rest = iter(others)
    for cell in range(4):
        fill = name if cell == position else next(rest, None)
        if fill is not None:
            canvas.paste(_cell(fill), ((cell % 2) * CELL, (cell // 2) * CELL))
    return canvas


def cell_mask(position: int) -> torch.Tensor:
    """(2 CELL, 2 CELL) bool: the cell at `position`."""
    row, col = divmod(position, 2)
    return box_mask([[col * CELL, row * CELL, (col + 1) * CELL, (row + 1) * CELL]], 2 * CELL, 2 * CELL)


class CompositeMasks:
    """The composites' masks by sample id ('<photo>@<position>'), at the input's resolution."""

    def __init__(self, geometry: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.by_position = [geometry(cell_mask(p)) for p in range(4)]  # each (h, w)

    def __call__(self, sample_id: str) -> torch.Tensor:
        return self.by_position[POSITIONS.index(sample_id.rsplit("@", 1)[1])]


def composites_dataset(cfg: CompositesConfig, transform: Callable, geometry: Callable) -> ImageListDataset:
    """Each photo at each of the four positions: photo-major, POSITIONS' order."""
    items: list[tuple[str, Callable[[], Image.Image], int]] = []
    for name in cfg.photos:
        distractors = [other for other in cfg.photos if other != name]
        for position, where in enumerate(POSITIONS):
            others = []
            if cfg.layout is CompositeLayout.grid and distractors:
                others = [distractors[(position + j) % len(distractors)] for j in range(3)]

            def load(name: str = name, position: int = position, others: list[str] = others) -> Image.Image:
                return composite(name, position, others)

            items.append((f"{name}@{where}", load, COMPOSITE_CLASSES[name]))
    dataset = ImageListDataset(items, transform)
    dataset.model_labels = True  # ImageNet-1k indices
    dataset.masks = CompositeMasks(geometry)
    return dataset


def composites_source(cfg: CompositesConfig, preprocess: Callable | None, seed: int) -> Dataset:
    return composites_dataset(cfg, _logged_transform(cfg, preprocess), mask_transform(cfg, preprocess))
