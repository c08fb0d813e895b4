"""The evaluation contract: what a metric sees (`MetricInputs`), what it returns, its config and registry.

A metric maps a batch's saliency maps (B, H, W) at input resolution to {variant: (B,) float32}. Each one
is a class that its option module (runner/options/metric/<name>.py) registers; `method.evaluation`
(`EvaluationConfig`, on every CAM method's config) names the metrics to run, and runner/metrics/table.py
turns their values into the `evaluation` table, beside the same metric on the layer's random map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.options.metric.evaluation import EvaluationConfig, metric_settings
from runner.options.registry import METRICS

if TYPE_CHECKING:  # runner.methods imports this module (CAM methods carry EvaluationConfig): no import cycle
    from runner.runtime import Runtime


@dataclass
class MetricInputs:
    """Everything a metric may use besides the maps."""

    model: nn.Module  # the run's model, eval mode, the run's capture hooks paused
    x: torch.Tensor  # (B, C, H, W) the batch's inputs on the device
    target: torch.Tensor  # (B,) int64, the class explained
    sample_index: torch.Tensor  # (B,) int64 global sample indices (per-sample seeds: same value at any batch size)
    masks: torch.Tensor | None  # (B, H, W) bool localisation masks at input resolution; None when the data has none
    runtime: Runtime  # runner.runtime.Runtime: autocast()/precision, device
    seed: int
    chunk: int = 64  # images per batched forward of perturbed inputs (evaluation_rows: resolved for the device)


class Metric:
    """One evaluation metric; its option module (runner/options/metric/<name>.py) registers it with its settings'
    schema. `settings`: that schema's instance (`method.evaluation.settings.<name>` merged into its defaults)."""

    name: str  # set from its option when loaded
    needs_masks: bool = False  # skipped (with one log line) when the data has no masks

    def __init__(self, cfg: EvaluationConfig, settings: Any = None) -> None:
        self.cfg = cfg
        self.settings = settings

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        """maps (B, H, W) float32, non-negative, upsampled to the input size -> {variant: (B,) float32}.
        NaN where undefined (and say why in the docstring); variant "" when the metric has one value."""
        raise NotImplementedError


def load_metrics() -> dict[str, type[Metric]]:
    """Every registered metric's class by name (each imported here, its `name` set from its option)."""
    classes = {}
    for option in METRICS:
        cls = option.load()
        cls.name = option.name
        classes[option.name] = cls
    return classes


def build_metrics(cfg: EvaluationConfig) -> list[Metric]:
    """The configured metrics, in the order named, each with its own settings (`settings.<name>`, in its schema);
    an unknown name is a RunnerError with the nearest names."""
    classes = load_metrics()
    return [classes[METRICS.get(name).name](cfg, metric_settings(cfg, name)) for name in cfg.metrics]
