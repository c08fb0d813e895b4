"""The evaluation contract: what a metric sees (`MetricInputs`), what it returns, its config and registry.

A metric maps a batch's saliency maps (B, H, W) at input resolution to {variant: (B,) float32}. Each one
is a class registered with `@METRICS.register("<name>")` in a module of this package; `method.evaluation`
(`EvaluationConfig`, on every CAM method's config) names the metrics to run, and runner/metrics/table.py
turns their values into the `evaluation` table, beside the same metric on the layer's random map.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from runner.options.metric.evaluation import EvaluationConfig
from runner.registry import Registry

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
    """One evaluation metric; subclasses are registered with @METRICS.register("<name>")."""

    name: str  # set by the registry
    needs_masks: bool = False  # skipped (with one log line) when the data has no masks

    def __init__(self, cfg: EvaluationConfig) -> None:
        self.cfg = cfg

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        """maps (B, H, W) float32, non-negative, upsampled to the input size -> {variant: (B,) float32}.
        NaN where undefined (and say why in the docstring); variant "" when the metric has one value."""
        raise NotImplementedError


M = TypeVar("M", bound=type[Metric])


class _MetricRegistry(Registry[str, type[Metric]]):
    """Registry keyed by the metric's name; registering also sets the class's `name`."""

    def register(self, key: str) -> Callable[[M], M]:  # type: ignore[override]  # narrows T to metric classes
        add = super().register(key)

        def named(cls: M) -> M:
            cls.name = key
            return add(cls)

        return named


METRICS: Registry[str, type[Metric]] = _MetricRegistry("metric", lambda name: name)


def load_metrics() -> Registry[str, type[Metric]]:
    """METRICS with every module of this package imported (each registers its metrics on import)."""
    import runner.metrics as package

    for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        importlib.import_module(f"{package.__name__}.{module}")
    return METRICS


def build_metrics(cfg: EvaluationConfig) -> list[Metric]:
    """The configured metrics, in the order named; an unknown name is a RunnerError with the nearest names."""
    registry = load_metrics()
    return [registry[registry.key(name)](cfg) for name in cfg.metrics]
