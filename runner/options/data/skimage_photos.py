"""The photos that ship inside scikit-image (no download): ImageNet labels where a photo shows one class."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.options.data.images import ImageDataConfig
from runner.options.registry import DATA

# ImageNet-1k labels of the photos that show one ImageNet class; the others have no label.
PHOTO_LABELS = {"chelsea": 285, "cat": 285, "coffee": 967}  # 285 Egyptian cat, 967 espresso


# The 2-D photos and pictures that ship inside scikit-image (no download needed).
PHOTOS = (
    "astronaut", "binary_blobs", "brick", "camera", "cat", "cell", "checkerboard", "chelsea", "clock", "coffee",
    "coins", "colorwheel", "grass", "gravel", "horse", "hubble_deep_field", "immunohistochemistry", "logo",
    "microaneurysms", "moon", "motorcycle", "page", "retina", "rocket", "shepp_logan_phantom", "text",
)  # fmt: skip


@DATA.option("runner.data.sources:skimage_source")
@dataclass
class SkimagePhotosConfig(ImageDataConfig):
    name: str = "skimage_photos"
    photos: list[str] = field(
        default_factory=lambda: ["chelsea", "coffee", "rocket", "astronaut", "motorcycle", "horse"]
    )
