"""Gradient-free and one-gradient readings of a causal language model on the clean prompt of each pair:
gradient x activation at every site, layer and position (grad_x_act.py, `method=lm_grad_x_act`) and the logit lens
per layer and position (logit_lens.py, `method=lm_logit_lens`). `lm_grad_x_act` and `lm_logit_lens` run them on a
model and a list of pairs from a notebook, with no run directory.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from torch import nn

from runner.data.base import to_batch
from runner.data.prompts import prompts_source
from runner.hooks import HookSession
from runner.methods.base import Method, as_frame, library_config
from runner.options.data.prompts import PromptsConfig
from runner.options.method.lm_grad_x_act import LmGradXActConfig
from runner.options.method.lm_logit_lens import LmLogitLensConfig
from runner.runtime import Runtime
from runner.schema import Precision
from runner.targets import build_target


def lm_grad_x_act(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff", bos: bool = True,
    **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_grad_x_act` table of `model` (a Hugging Face causal LM in eval mode) on `pairs` ([{clean, corrupted,
    answer, distractor}], as data=prompts takes them; only the clean prompts are read), all in one batch;
    `settings`: sites, layers. The model's hooks are removed before it returns."""
    from runner.methods.lm_saliency.grad_x_act import LmGradXAct

    cfg = library_config(LmGradXActConfig, **settings)
    return _run(LmGradXAct(cfg, [], Runtime(next(model.parameters()).device, Precision.fp32)), model, tokenizer,
                pairs, target, bos)  # fmt: skip


def lm_logit_lens(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff", bos: bool = True,
    **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_logit_lens` table of `model` on `pairs` (as `lm_grad_x_act`); `settings`: layers."""
    from runner.methods.lm_saliency.logit_lens import LmLogitLens

    cfg = library_config(LmLogitLensConfig, **settings)
    return _run(LmLogitLens(cfg, [], Runtime(next(model.parameters()).device, Precision.fp32)), model, tokenizer,
                pairs, target, bos)  # fmt: skip


def _run(method: Method, model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str,
         bos: bool) -> pd.DataFrame:  # fmt: skip
    from runner.options.registry import TARGETS

    dataset = prompts_source(PromptsConfig(pairs=pairs, bos=bos), tokenizer, 0)
    batch = to_batch(dataset.collate([dataset[i] for i in range(len(dataset))]), next(model.parameters()).device, 0)
    method.runtime.target = build_target(TARGETS.get(target).schema())  # type: ignore[attr-defined, call-arg]
    method.prepare(dataset)
    b = batch.x.shape[0]
    with HookSession(model, []) as session:
        method.setup(session, b)
        session.begin_batch(b, 0)
        out = method.run_batch(model, batch, session)
        session.end_batch()
    return as_frame(out.tables[method.table])


__all__ = ["lm_grad_x_act", "lm_logit_lens"]
