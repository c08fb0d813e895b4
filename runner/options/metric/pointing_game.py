"""Pointing game (Zhang et al. 2018, Quantus `PointingGame`): whether the map's maximum falls in the object's mask.

Its settings are `method.evaluation`'s `pointing_game_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.localisation:PointingGame")
@dataclass
class PointingGameMetric:
    name: str = "pointing_game"
