"""`method=lm_attention`: the attention weights of a causal language model's heads on each pair's clean prompt, from
the last position (where the answer is read) or from every position, as a table and as report heatmaps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig, light_layers
from runner.site_kinds import Positions, SiteSelection


@METHODS.option("runner.methods.lm_saliency.attention:LmAttention", tables=("lm_attention",), family=LM_FAMILY)
@dataclass
class LmAttentionConfig(MethodConfig):
    """The layers and heads read; the run's `target` is not used (the table has no metric). Needs eager attention
    (model.attn_implementation=eager, hf_lm's default): fused kernels never form the weights."""

    name: str = "lm_attention"
    layers: Optional[list[int]] = None  # null: every layer  # noqa: UP045 (OmegaConf)
    heads: Optional[list[int]] = None  # null: every head  # noqa: UP045 (OmegaConf)
    query: Positions = Positions.last  # last: the last position's weights over every key; all: every query's

    def selection(self) -> SiteSelection:
        layers = None if self.layers is None else tuple(self.layers)
        return SiteSelection("method", ("pattern",), layers, sites_chosen=False)

    def lightened(self, layers: int) -> LmAttentionConfig:
        return self if self.layers is not None else dataclasses.replace(self, layers=light_layers(layers))
