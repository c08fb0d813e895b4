"""Gradient-free and one-gradient readings of a causal language model on the clean prompt of each pair:
gradient x activation at every site, layer and position (grad_x_act.py, `method=lm_grad_x_act`) and the logit lens
per layer and position (logit_lens.py, `method=lm_logit_lens`), direct logit attribution of every writer into the
stream (dla.py, `method=lm_dla`). `lm_grad_x_act` and `lm_logit_lens` run them on a
model and a list of pairs from a notebook, with no run directory.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from torch import nn

from runner.data.prompts import pairs_batch
from runner.methods.base import Method, as_frame, library_config, library_token_runtime, run_prepared
from runner.models.check import check_positions
from runner.options.method.lm_dla import LmDlaConfig
from runner.options.method.lm_grad_x_act import LmGradXActConfig
from runner.options.method.lm_logit_lens import LmLogitLensConfig


def lm_grad_x_act(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff", bos: bool = True,
    **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_grad_x_act` table of `model` (a Hugging Face causal LM in eval mode) on `pairs` ([{clean, corrupted,
    answer, distractor}], as data=prompts takes them; only the clean prompts are read), all in one batch;
    `settings`: sites, layers. The model's hooks are removed before it returns."""
    from runner.methods.lm_saliency.grad_x_act import LmGradXAct

    cfg = library_config(LmGradXActConfig, **settings)
    return _run(LmGradXAct(cfg, [], library_token_runtime(next(model.parameters()).device, target)), model,
                tokenizer, pairs, bos)  # fmt: skip


def lm_logit_lens(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff", bos: bool = True,
    **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_logit_lens` table of `model` on `pairs` (as `lm_grad_x_act`); `settings`: layers."""
    from runner.methods.lm_saliency.logit_lens import LmLogitLens

    cfg = library_config(LmLogitLensConfig, **settings)
    return _run(LmLogitLens(cfg, [], library_token_runtime(next(model.parameters()).device, target)), model,
                tokenizer, pairs, bos)  # fmt: skip


def lm_dla(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff", bos: bool = True,
    **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_dla` table of `model` on `pairs` (as `lm_grad_x_act`); `settings`: positions, accumulated."""
    from runner.methods.lm_saliency.dla import LmDla

    cfg = library_config(LmDlaConfig, **settings)
    return _run(LmDla(cfg, [], library_token_runtime(next(model.parameters()).device, target)), model, tokenizer,
                pairs, bos)  # fmt: skip


def _run(method: Method, model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], bos: bool) -> pd.DataFrame:
    dataset, batch = pairs_batch(pairs, tokenizer, bos, next(model.parameters()).device)
    check_positions(model, dataset)  # a run checks this as the model meets its data
    return as_frame(run_prepared(method, model, batch, dataset).tables[method.table])


__all__ = ["lm_dla", "lm_grad_x_act", "lm_logit_lens"]
