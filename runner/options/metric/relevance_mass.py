"""Relevance mass accuracy (Arras et al. 2022, Quantus `RelevanceMassAccuracy`): the map's mass inside the mask over its total.

Its settings are `method.evaluation`'s `relevance_mass_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.localisation:RelevanceMass")
@dataclass
class RelevanceMassMetric:
    name: str = "relevance_mass"
