"""The metric of a patched run from the logits it needs: only the answer and distractor tokens' when the target
reads nothing else (token_logit_diff), else the whole vocabulary's.

A variant's forward ends in the unembedding, a (rows x vocabulary) product: on GPT-2 small's widths it is a fifth of
a patched chunk's time on a CPU. A target that reads only the answer and distractor logits gets them from the base
model's last hidden state (after its final norm) times those tokens' rows of the unembedding: the same linear map,
cut to the columns used, then the family's final softcap (`LanguageModelLayout.logits`: elementwise, so exact on
the columns alone). Models whose unembedding is not a plain linear map of the final hidden state (device-mapped
models, whose unembedding may sit on another device or on disk) take the full path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.methods.lm.pairs import score
from runner.models.lm_sites import LanguageModelLayout, unembedding


class Readout:
    """Runs a (patched) forward and scores it with the run's token target."""

    def __init__(self, model: nn.Module, layout: LanguageModelLayout, target: Any) -> None:
        self.model, self.target, self.layout = model, target, layout
        self.base: nn.Module | None = getattr(model, "base_model", None)
        unembed = unembedding(model)
        self.unembed = unembed if isinstance(unembed, nn.Linear) else None
        self.compact = (
            bool(getattr(target, "reads_only_answer_logits", False))
            and self.base is not None and self.base is not model and self.unembed is not None
            and not hasattr(model, "hf_device_map") and self.unembed.weight.device.type != "meta"
        )  # fmt: skip

    def metric(self, inputs: dict[str, Any], answers: torch.Tensor, distractors: torch.Tensor,
               clean_logits: torch.Tensor, autocast: Any) -> torch.Tensor:  # fmt: skip
        """(rows,) the target's metric at the last position of the forward of `inputs` (answers and distractors:
        (rows, A) token sets padded with -1; clean_logits (rows, V), for kl_to_clean)."""
        if not self.compact:
            with torch.no_grad(), autocast():
                logits = self.model(**inputs, logits_to_keep=1).logits[:, -1].float()
            return score(self.target, logits, answers, distractors, clean_logits)
        assert self.base is not None and self.unembed is not None
        with torch.no_grad(), autocast():
            hidden = self.base(**inputs).last_hidden_state[:, -1]  # (rows, D), after the final norm
        weight = self.unembed.weight.detach()  # a metric of patched runs: no gradient (as the full path's no_grad)
        sets = torch.cat([answers, distractors], dim=1)
        tokens = torch.unique(sets[sets >= 0])  # (K,) sorted
        bias = None if self.unembed.bias is None else self.unembed.bias.detach()
        rows = weight[tokens.to(weight.device)].float()  # (K, D)
        logits = hidden.to(weight.device).float() @ rows.T  # (rows, K): the unembedding's columns the target reads
        if bias is not None:
            logits = logits + bias[tokens.to(bias.device)].float()
        logits = self.layout.logits(logits)  # the model's own post-processing (Gemma 2's softcap)

        def compact(ids: torch.Tensor) -> torch.Tensor:
            found = torch.searchsorted(tokens, ids.clamp(min=0))
            return torch.where(ids >= 0, found, -1).to(logits.device)

        return self.target.score_tokens(logits, compact(answers), compact(distractors), None)
