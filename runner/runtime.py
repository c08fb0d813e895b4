"""How passes run: device, autocast precision, and where pictures go. Foundation: imports no runner package
but the schema's enums."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.schema import FiguresConfig, Precision


@dataclass
class Runtime:
    """How passes run (device, autocast precision), where pictures go (None: no pictures) and how they look."""

    device: torch.device
    precision: Precision
    pictures_dir: Path | None = None
    figures: FiguresConfig = field(default_factory=FiguresConfig)  # dpi, format, map scale, columns
    class_names: list[str] | None = None  # the model's class names (pictures' titles); None: unknown

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision is Precision.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
