"""Sparseness (Chalasani et al. 2020, Quantus `Sparseness`): the Gini index of the map; higher is sparser.

Its settings are `method.evaluation`'s `sparseness_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.faithfulness_family:Sparseness")
@dataclass
class SparsenessMetric:
    name: str = "sparseness"
