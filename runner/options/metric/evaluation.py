"""What `method.evaluation` holds: the metrics to compute, their shared draws and chunking, and the built-in
metrics' settings (one flat field per setting, prefixed by its metric); a metric with settings of its own takes them
from `settings.<metric>`, checked against its option's schema."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import RunnerError
from runner.options.registry import METRICS


@dataclass
class EvaluationConfig:
    """Which metrics to compute per (sample, layer, target) and their settings (one flat field per setting,
    prefixed by its metric; defaults as the paper / Quantus 0.6.0)."""

    metrics: list[str] = field(default_factory=list)  # registered metric names; empty: no `evaluation` table
    # A metric's own settings by its name ({my_metric: {threshold: 0.5}}), checked against its option's schema
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # per-sample draws (noise, random subsets): from (seed, sample index), never from the batch
    chunk: Optional[int] = None  # noqa: UP045 (OmegaConf) images per forward of perturbed inputs; null: forward_chunk
    SPEED_KEYS: ClassVar[tuple[str, ...]] = ("chunk",)  # left out of the resume key
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

    def check(self) -> None:
        """Each named metric exists and its `settings` fit its schema (RunnerError naming the key otherwise)."""
        for name in self.metrics:
            metric_settings(self, name)
        unused = sorted(set(self.settings) - set(self.metrics))
        if unused:
            raise RunnerError(
                f"method.evaluation.settings names {', '.join(unused)}, which method.evaluation.metrics does not"
                f" compute: add it to metrics or drop its settings."
            )


def metric_settings(cfg: EvaluationConfig, name: str) -> Any:
    """Metric `name`'s settings: `cfg.settings[name]` merged into its option's schema (RunnerError for an unknown
    metric or a key its schema does not have)."""
    schema = METRICS.get(name).schema  # raises for an unknown name, with the nearest ones
    given = cfg.settings.get(name) or {}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), {"name": name, **dict(given)})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        raise RunnerError(
            f"method.evaluation.settings.{name}{'.' + key if key else ''}: {str(e).splitlines()[0]}"
            f" (the settings of metric '{name}': {', '.join(f.name for f in fields(schema) if f.name != 'name') or 'none'})."
        ) from None
