"""Top mass (an example metric): the share of the map's mass in its `fraction` most salient pixels; 1 for a map
concentrated there, `fraction` for a uniform one. NaN for a map with no mass (all zero): undefined, not 0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.options.registry import METRICS


class TopMass:
    """The metric: maps (B, H, W), non-negative, at input resolution -> {"": (B,) float32}."""

    name = "top_mass"
    needs_masks = False

    def __init__(self, cfg: Any, settings: TopMassConfig) -> None:
        self.fraction = settings.fraction

    def compute(self, inputs: Any, maps: Any) -> dict[str, Any]:
        flat = maps.flatten(1).float()  # (B, P)
        k = max(1, round(self.fraction * flat.shape[1]))
        total = flat.sum(dim=1)
        top = flat.topk(k, dim=1).values.sum(dim=1)
        return {"": (top / total).where(total > 0, total.new_full((), float("nan")))}


@METRICS.option(TopMass)
@dataclass
class TopMassConfig:
    name: str = "top_mass"
    fraction: float = 0.1  # the share of the pixels counted as the top
