"""How passes run: device, autocast precision, the score they differentiate, and where pictures and files go."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.schema import FiguresConfig, Precision
from runner.targets.base import Target
from runner.targets.classifier import Logit


@dataclass
class Runtime:
    """How passes run (device, autocast precision), where pictures go (None: no pictures) and how they look, and
    the target: what score of the model's output a method takes for the class it explains (the logit by default);
    `output_dir`: the run's directory, for a method that writes files beside its tables (None: a library call)."""

    device: torch.device
    precision: Precision
    pictures_dir: Path | None = None
    figures: FiguresConfig = field(default_factory=FiguresConfig)  # dpi, format, map scale, columns
    class_names: list[str] | None = None  # the model's class names (pictures' titles); None: unknown
    target: Target = field(default_factory=Logit)  # the run's `target` (runner/targets/)
    output_dir: Path | None = None  # the run's directory (its lock held); None: no run directory

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision is Precision.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
