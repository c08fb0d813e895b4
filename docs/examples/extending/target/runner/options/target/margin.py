"""Margin (an example target): the class's logit minus the mean logit over all classes, times `scale`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


class Margin:
    """The score: (B, K) logits and (B,) classes -> (B,), differentiable in the logits."""

    def __init__(self, config: MarginTargetConfig) -> None:
        self.scale = config.scale

    def score(self, output: Any, classes: Any, masks: Any = None) -> Any:
        return self.scale * (output.gather(1, classes[:, None]).squeeze(1) - output.mean(dim=1))


@TARGETS.option(Margin)
@dataclass
class MarginTargetConfig(TargetConfig):
    name: str = "margin"
    scale: float = 1.0
