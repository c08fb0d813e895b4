"""`method=lm_cache`: an activation cache of a causal language model: the chosen sites' tensors at every layer chosen,
on each pair's clean prompt (its real positions, or the last one), written per batch to safetensors files beside an
index table, and read back with `runner.results.load_activations(run_dir)`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig, light_layers
from runner.site_kinds import Positions, SiteSelection


@METHODS.option("runner.methods.lm_cache:LmCache", tables=("lm_cache",), family=LM_FAMILY)
@dataclass
class LmCacheConfig(MethodConfig):
    """The sites and layers kept and at which positions; the run's `target` is not used (the table has no metric).
    Tensors are stored as float32 whatever the model's dtype (bfloat16 and float16 widen exactly)."""

    name: str = "lm_cache"
    sites: list[str] = field(default_factory=lambda: ["resid_pre", "attn_out", "mlp_out"])  # any, per-head ones too
    layers: Optional[list[int]] = None  # null: every layer  # noqa: UP045 (OmegaConf)
    positions: Positions = Positions.all  # all: each pair's real positions; last: its last one

    def selection(self) -> SiteSelection:
        return SiteSelection("method", tuple(self.sites), None if self.layers is None else tuple(self.layers))

    def lightened(self, layers: int) -> LmCacheConfig:
        return self if self.layers is not None else dataclasses.replace(self, layers=light_layers(layers))
