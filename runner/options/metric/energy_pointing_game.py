"""Energy-based pointing game (Wang et al. 2020, Score-CAM): the share of the map's mass inside the mask.

Its settings are `method.evaluation`'s `energy_pointing_game_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.localisation:EnergyPointingGame")
@dataclass
class EnergyPointingGameMetric:
    name: str = "energy_pointing_game"
