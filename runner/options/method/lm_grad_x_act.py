"""`method=lm_grad_x_act`: gradient x activation of the run's token target at each site, layer and position (and
head) of a causal language model, from one forward and one backward of each pair's clean prompt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig, light_layers
from runner.site_kinds import SiteSelection


@METHODS.option("runner.methods.lm_saliency.grad_x_act:LmGradXAct", tables=("lm_grad_x_act",), family=LM_FAMILY)
@dataclass
class LmGradXActConfig(MethodConfig):
    """The sites and layers read; the score differentiated is the run's `target` (target=token_logit_diff,
    token_prob_diff or answer_logprob)."""

    name: str = "lm_grad_x_act"
    sites: list[str] = field(default_factory=lambda: ["resid_pre", "attn_out", "mlp_out", "head"])
    layers: Optional[list[int]] = None  # null: every layer  # noqa: UP045 (OmegaConf)

    def lightened(self, layers: int) -> LmGradXActConfig:
        return self if self.layers is not None else dataclasses.replace(self, layers=light_layers(layers))

    def selection(self) -> SiteSelection:
        return SiteSelection("method", tuple(self.sites), None if self.layers is None else tuple(self.layers))
