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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, TypeVar

import torch
from torch import nn

from runner.registry import Registry

if TYPE_CHECKING:  # runner.methods imports this module (CAM methods carry EvaluationConfig): no import cycle
    from runner.runtime import Runtime


@dataclass
class EvaluationConfig:
    """Which metrics to compute per (sample, layer, target) and their settings (one flat field per setting,
    prefixed by its metric; defaults as the paper / Quantus 0.6.0)."""

    metrics: list[str] = field(default_factory=list)  # names from METRICS; empty: no `evaluation` table
    seed: int = 0  # per-sample draws (noise, random subsets): from (seed, sample index), never from the batch
    chunk: Optional[int] = None  # noqa: UP045 (OmegaConf) images per forward of perturbed inputs; null: forward_chunk
    # sparseness / complexity: no settings (map statistics)
    # ROAD (Rong et al. 2022; Quantus ROAD defaults)
    road_percentages: list[float] = field(default_factory=lambda: [float(p) for p in range(1, 100, 2)])
    road_noise: float = 0.01  # std of the noise added to each imputed pixel (Quantus noise=0.01)
    road_solver: str = "auto"  # the imputation: "direct" (scipy SuperLU, host), "cg" (batched, on the device), "auto"
    # (direct on the CPU, cg on an accelerator); both solve the same system (tests/test_metrics.py)
    road_tolerance: float = 1e-5  # the imputation's conjugate gradients stop at this relative residual
    road_max_iterations: int = 2000  # ... or after this many (a warning says when a solve did not converge)
    # faithfulness correlation (Bhatt et al. 2020; Quantus FaithfulnessCorrelation defaults)
    faithfulness_correlation_runs: int = 100  # random subsets per sample
    faithfulness_correlation_subset_size: int = 224  # pixels per subset
    faithfulness_correlation_baseline: str = "black"  # "black" (the image's minimum), "mean" (its mean), "uniform"
    faithfulness_correlation_softmax: bool = False  # False: the drop in the target's logit (Quantus's default)
    # region perturbation (Samek et al. 2016; Quantus RegionPerturbation defaults)
    region_size: int = 8  # patch side in pixels
    region_steps: int = 100  # patches perturbed, in MoRF order
    region_baseline: str = "black"  # "black" (the image's minimum) or "mean" (the unperturbed image's mean)
    region_softmax: bool = True  # True: the drop in the target's probability (Quantus's default)
    # localisation (runner/metrics/localisation.py): pointing_game, energy_pointing_game, relevance_mass/rank
    pointing_tolerance: int = 0  # px the mask is grown by (a disc); 0: Quantus PointingGame, 15: TorchRay's


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
