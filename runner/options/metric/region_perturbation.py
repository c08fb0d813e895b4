"""Region perturbation (Samek et al. 2016, Quantus `RegionPerturbation`): the score as patches are perturbed most relevant first (MoRF).

Its settings are `method.evaluation`'s `region_perturbation_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.faithfulness_family:RegionPerturbation")
@dataclass
class RegionPerturbationMetric:
    name: str = "region_perturbation"
