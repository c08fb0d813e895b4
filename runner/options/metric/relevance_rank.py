"""Relevance rank accuracy (Arras et al. 2022, Quantus `RelevanceRankAccuracy`): the share of the mask's size of top-ranked pixels that fall inside it.

Its settings are `method.evaluation`'s `relevance_rank_*` fields where it has any (runner/options/metric/evaluation.py)."""

from dataclasses import dataclass

from runner.options.registry import METRICS


@METRICS.option("runner.metrics.localisation:RelevanceRank")
@dataclass
class RelevanceRankMetric:
    name: str = "relevance_rank"
