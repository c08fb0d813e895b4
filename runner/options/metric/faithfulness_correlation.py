"""Faithfulness correlation (Bhatt et al. 2020, Quantus `FaithfulnessCorrelation`): Pearson correlation of random subsets' attribution sums with the score drops they cause.

Its settings are `method.evaluation`'s `faithfulness_correlation_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.faithfulness_family:FaithfulnessCorrelation")
@dataclass
class FaithfulnessCorrelationMetric:
    name: str = "faithfulness_correlation"
