"""`method=lm_dla`: direct logit attribution of a causal language model on each pair's clean prompt: each writer into
the residual stream (the embeddings, each head, each attention's bias, each MLP) projected through the final norm, at
the run's own scale, onto the target's direction (answer - distractor unembedding), and the accumulated stream per
layer."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig
from runner.site_kinds import Positions, SiteSelection


@METHODS.option("runner.methods.lm_saliency.dla:LmDla", tables=("lm_dla",), family=LM_FAMILY)
@dataclass
class LmDlaConfig(MethodConfig):
    """The positions read and whether the accumulated stream is listed; the run's `target` must be linear in the
    logits (target=token_logit_diff: the answer's minus the distractor's logit, each the mean over its token set)."""

    name: str = "lm_dla"
    positions: Positions = Positions.last  # last: each pair's last position; all: every real position
    accumulated: bool = True  # also each layer's accumulated stream (TransformerLens' accumulated_resid)

    def selection(self) -> SiteSelection:
        """Every layer's writers and streams: a decomposition needs them all."""
        kinds = ("resid_pre", "head", "mlp_out", "resid_post")
        return SiteSelection("method", kinds, None, sites_chosen=False, layers_chosen=False)
