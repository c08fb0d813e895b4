"""`method=lm_logit_lens`: the residual stream after each block, read through the model's own final norm and
unembedding, at every position of each pair's clean prompt (nostalgebraist 2020).

Layer -1 is the embeddings (block 0's input: token plus position embeddings where the model adds them), layer l is
block l's output; the norm is applied to each layer's residual with its own statistics. The last block's output is
what the model itself normalises and unembeds, so the last layer's lens is the model's own logits (the final norm
applied once: `output_hidden_states[-1]` is already after it; the family's final softcap, Gemma 2's and 3's, applied
as the model applies it). The residuals come from one forward without
gradient; the lens is taken one layer at a time, so only (B, T, vocabulary) logits are held at once.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.data.prompts import pair_texts, tokenizer_of
from runner.hooks import HookSession
from runner.methods.lm.base import LanguageModelMethod, TokenPairs, chosen_once, forward_last
from runner.methods.lm.cells import PAIR_TEXT_FIELDS, real_cells, token_strings
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of, read_site, unembedding
from runner.options.method.lm_logit_lens import LmLogitLensConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns, concat_columns
from runner.tables import Presentation, declare
from runner.targets.tokens import AnswerLogprob, TokenTarget, set_mean, target_name, token_target

EMBEDDINGS = -1  # the layer of the embeddings (block 0's input)

LM_LOGIT_LENS_SCHEMA = declare(
    "lm_logit_lens",
    [
        pa.field("layer", pa.int64()),  # -1: the embeddings; l: block l's output
        pa.field("position", pa.int64()),  # the token's position (BOS = 0 when prepended)
        *PAIR_TEXT_FIELDS,
        pa.field("answer_logit", pa.float32()),  # the lens logit of the answer (mean over a token set)
        pa.field("distractor_logit", pa.float32()),
        pa.field("answer_logprob", pa.float32()),  # the lens log-probability of the answer (of any of its set)
        pa.field("metric", pa.string()),  # the run's target
        pa.field("value", pa.float32()),  # the target at this layer's and position's lens logits
        pa.field("top_token_id", pa.int64()),  # the lens' most likely next token
        pa.field("top_token", pa.string()),  # its string (null without the tokenizer)
        pa.field("top_token_text", pa.string()),  # that token decoded (" Paris")
        pa.field("top_prob", pa.float32()),  # its probability
    ],
    Presentation(
        keys=("metric",),
        values=("value", "top_prob"),
        shown=("metric",),
        figures="runner.viz.lm_plots:lm_logit_lens_figures",
    ),
    classes=False,
)


class LmLogitLens(LanguageModelMethod):
    name = "lm_logit_lens"
    table = "lm_logit_lens"
    summary_values = ("value",)
    cfg: LmLogitLensConfig

    @classmethod
    def planned(cls, cfg: LmLogitLensConfig, layout: LanguageModelLayout, target: Any) -> tuple[TokenTarget, list[int]]:
        """The run's token target and the layers read; refused: a target that scores no tokens, a layer out of range
        or given twice."""
        scored = token_target(target, cls.name, per_position=True)
        every = [EMBEDDINGS, *range(layout.layers)]
        return scored, chosen_once("method.layers", cfg.layers, every, f"{EMBEDDINGS} (the embeddings)")

    def setup(self, session: HookSession, num_samples: int) -> None:
        model = session.model
        layout = layout_of(model)
        self.target, self.layers = self.planned(self.cfg, layout, self.runtime.target)
        self.last = layout.layers - 1
        modules = dict(model.named_modules())
        self.norm, self.unembed = modules[layout.arch.final_norm], unembedding(model)
        self.layout = layout
        # The last block's output is always read: its lens is the reference distribution of kl_to_clean.
        self.specs = {layer: layout.site("resid_pre", 0) if layer == EMBEDDINGS else layout.site("resid_post", layer)
                      for layer in dict.fromkeys([*self.layers, self.last])}  # fmt: skip
        self.kept: dict[int, torch.Tensor] = {}
        self.capturing = False
        for layer, spec in self.specs.items():
            session.add_hook(modules[spec.module], self._hook(layer, spec), pre=spec.where == "input")

    def _hook(self, layer: int, spec: SiteSpec) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *output: Any) -> None:
            if self.capturing:
                self.kept[layer] = read_site(spec, args, kwargs, output[0] if output else None).detach()

        return hook

    def lens(self, residual: torch.Tensor) -> torch.Tensor:
        """(B, T, V) float32 logits of a residual stream (B, T, D) through the final norm, the unembedding and the
        family's final softcap.
        Their `forward`, not the module call: hooks a user put on them would count calls the model did not make."""
        device = next(self.norm.parameters(), residual).device
        normed = self.norm.forward(residual.to(device))
        device = next(self.unembed.parameters()).device
        return self.layout.logits(self.unembed.forward(normed.to(device)).float())

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        ids = prompts.clean
        within_batch(0.0, f"lm_logit_lens: the forward of {ids.shape[0]} prompts")
        self.kept, self.capturing = {}, True
        try:
            with torch.no_grad(), self.runtime.autocast():
                out = forward_last(model, ids, prompts.mask)
        finally:
            self.capturing = False
        kept, self.kept = self.kept, {}
        strings = self.strings(batch)
        rows, index, _ = real_cells(prompts.pads, ids.shape[1])
        within_batch(0.3, f"lm_logit_lens: the lens at {len(self.layers)} layers")
        with torch.no_grad(), self.runtime.autocast():
            final = self.lens(kept[self.last])[rows, index]  # (N, V) the model's own logits at each real cell
            parts = [self._rows(batch, layer, self.lens(kept[layer])[rows, index], final, prompts, rows, index,
                                strings) for layer in self.layers]  # fmt: skip
        return BatchOutput(
            predicted=out.logits[:, -1].float().argmax(dim=1), tables={self.table: concat_columns(parts)}
        )

    def _rows(self, batch: Batch, layer: int, logits: torch.Tensor, final: torch.Tensor, prompts: TokenPairs,
              rows: torch.Tensor, index: torch.Tensor, strings: list[dict[str, Any]]) -> Columns:  # fmt: skip
        """One row per real (pair, position) of one layer; `logits` and `final` (N, V) at those cells."""
        device = logits.device
        answers, distractors = prompts.answers.to(device)[rows], prompts.distractors.to(device)[rows]  # (N, A)
        value = self.target.score_tokens(logits, answers, distractors, final.to(device))
        top_prob, top_id = logits.softmax(-1).max(-1)
        tokenizer = tokenizer_of(self.dataset)
        top_ids = top_id.tolist()
        positions = (index - prompts.pads.cpu()[rows]).tolist()
        r = rows.tolist()
        n = len(r)
        return {
            "sample_index": rows.tolist(),  # the pair's row in the batch: the writer adds the first index
            "layer": [layer] * n,
            "position": positions,
            "token": token_strings(strings, r, positions),
            "answer": [strings[i]["answer"] for i in r],
            "distractor": [strings[i]["distractor"] for i in r],
            **pair_texts(strings, r, positions),
            "answer_logit": set_mean(logits, answers).cpu(),
            "distractor_logit": set_mean(logits, distractors).cpu(),
            "answer_logprob": AnswerLogprob().score_tokens(logits, answers, distractors, None).cpu(),
            "metric": [target_name(self.target)] * n,
            "value": value.cpu(),
            "top_token_id": top_ids,
            "top_token": tokenizer.convert_ids_to_tokens(top_ids) if tokenizer is not None else [None] * n,
            "top_token_text": [tokenizer.decode([i]) for i in top_ids] if tokenizer is not None else [None] * n,
            "top_prob": top_prob.cpu(),
        }
