"""`method=lm_grad_x_act`: gradient x activation of the run's token target at each site, layer and position (and
head) of a causal language model, from one forward and one backward of each pair's clean prompt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from runner.errors import RunnerError
from runner.options.method.lm_patching import LM_SITES
from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig, light_layers


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

    def check(self) -> list[str]:
        bad = super().check()
        unknown = [s for s in self.sites if s not in LM_SITES]
        if unknown or not self.sites or len(set(self.sites)) != len(self.sites):
            raise RunnerError(
                f"method.sites={list(self.sites)}: each one of {', '.join(LM_SITES)}, once (at least one)."
            )
        return bad
