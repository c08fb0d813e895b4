"""Activation patching for causal language models: sites x layers x positions (or heads), batched.

For each prompt pair and direction (denoising: the corrupted prompt with one clean activation put in place;
noising: the clean prompt with one corrupted activation), the metric of the patched run is reported raw and as
restoration = (patched - corrupted) / (clean - corrupted), as for vision. Variants are stacked along the batch
(runner/hooks/sites.py), or estimated to first order from one backward per direction (attribution.py, mode=attribution);
the table is method.py's `lm_patching`. `lm_activation_patching` runs it on a model and a list of
pairs from a notebook, with no run directory.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from torch import nn

from runner.data.base import Batch
from runner.data.prompts import pairs_batch
from runner.methods.base import as_frame, library_config, library_token_runtime, run_prepared
from runner.methods.lm_patching.method import LmPatching
from runner.models.check import check_positions
from runner.options.method.lm_patching import LmPatchingMethodConfig


def lm_activation_patching(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff",
    bos: bool = True, **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_patching` table of `model` (a Hugging Face causal LM in eval mode) on `pairs` ([{clean, corrupted,
    answer, distractor}], as data=prompts takes them), all pairs in one batch; `target` names the metric;
    `settings`: LmPatchingConfig's fields (sites, layers, head_positions, directions, corruption, chunk, mode,
    top_k); mode="attribution" gives first-order estimates (attribution.py). The model's hooks are removed before
    it returns."""
    dataset, batch = pairs_batch(pairs, tokenizer, bos, next(model.parameters()).device)
    check_positions(model, dataset)  # a run checks this as the model meets its data
    return _patch(model, batch, target, settings, dataset)


def lm_patching_on_ids(
    model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor,
    target: str = "token_logit_diff", **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """`lm_activation_patching` on token ids already made: clean and corrupted (B, T), answers and distractors (B,)
    or (B, A) token sets padded with -1; no padding, no tokenizer (the `token` columns are then empty)."""
    b, t = clean.shape
    extras = {"attention_mask": torch.ones((b, t), dtype=torch.long, device=clean.device),
              "answers": answers.reshape(b, -1), "distractors": distractors.reshape(b, -1)}  # fmt: skip
    batch = Batch(torch.stack([clean, corrupted], 1), answers.reshape(b, -1)[:, 0], [f"pair-{i}" for i in range(b)],
                  0, None, extras)  # fmt: skip
    return _patch(model, batch, target, settings, None)


def _patch(model: nn.Module, batch: Batch, target: str, settings: dict[str, Any], dataset: Any) -> pd.DataFrame:
    cfg = library_config(LmPatchingMethodConfig, patching=settings)
    method = LmPatching(cfg, [], library_token_runtime(batch.x.device, target))
    return as_frame(run_prepared(method, model, batch, dataset).tables["lm_patching"])


__all__ = ["lm_activation_patching", "lm_patching_on_ids"]
