"""ROAD (Rong et al. 2022, Quantus `ROAD`): the target's score as the most relevant pixels are removed by noisy linear imputation.

Its settings are `method.evaluation`'s `road_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.faithfulness_family:Road")
@dataclass
class RoadMetric:
    name: str = "road"
