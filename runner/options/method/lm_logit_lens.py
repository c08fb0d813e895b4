"""`method=lm_logit_lens`: each layer's residual stream read through the model's own final norm and unembedding, at
every position of each pair's clean prompt (layer -1: the embeddings; layer l: block l's output)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig, light_layers
from runner.site_kinds import SiteSelection


@METHODS.option("runner.methods.lm_saliency.logit_lens:LmLogitLens", tables=("lm_logit_lens",), family=LM_FAMILY)
@dataclass
class LmLogitLensConfig(MethodConfig):
    """The layers read (-1: the embeddings, l: block l's output); `value` is the run's `target` at each position's
    lens logits (target=token_logit_diff, token_prob_diff, answer_logprob or kl_to_clean)."""

    name: str = "lm_logit_lens"
    layers: Optional[list[int]] = None  # null: -1 (the embeddings) and every block  # noqa: UP045 (OmegaConf)

    def selection(self) -> SiteSelection:
        layers = None if self.layers is None else tuple(self.layers)
        return SiteSelection("method", ("resid_post",), layers, sites_chosen=False)

    def lightened(self, layers: int) -> LmLogitLensConfig:
        return self if self.layers is not None else dataclasses.replace(self, layers=[-1, *light_layers(layers)])
