"""A torchvision data set class (CIFAR10, ImageNet, ...) from files already on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.options.data.images import ImageDataConfig
from runner.options.registry import DATA


@DATA.option("runner.data.sources:torchvision_source")
@dataclass
class TorchvisionDataConfig(ImageDataConfig):
    name: str = "torchvision"
    dataset: str | None = None  # the data set class name, e.g. CIFAR10
    root: str | None = None  # where the files are
    download: bool = False  # allowed to download (needs internet)
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra constructor arguments
