"""What every photo source shares (how a photo becomes the model's input) and the file names they read."""

from __future__ import annotations

from dataclasses import dataclass

from runner.schema import DataConfig, ResizeMode

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}


# ---- the sources' configs ---------------------------------------------------------------------------------------
@dataclass
class ImageDataConfig(DataConfig):
    """A source of photos: how each becomes the model's input."""

    resize: ResizeMode = ResizeMode.square


MASKS_FILE = "masks.json"


MASK_SUFFIX = ".mask.png"
