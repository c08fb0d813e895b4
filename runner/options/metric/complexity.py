"""Complexity (Bhatt et al. 2020, Quantus `Complexity`): the entropy of the map's normalised mass; lower is simpler.

Its settings are `method.evaluation`'s `complexity_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.faithfulness_family:Complexity")
@dataclass
class ComplexityMetric:
    name: str = "complexity"
