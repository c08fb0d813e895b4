"""`method=lm_attention`: each head's attention weights on each pair's clean prompt, one row per (layer, head, query
position, key position): from the last position only (`query: last`, where the answer is read: what the heads
that move it attend to) or from every position (`query: all`, keys up to the query's, as the causal mask allows).

The weights are the `pattern` site of lm_patching, read by its engine (`SiteHooks`) where eager attention computes
them: the one softmax inside each attention module, after any attention softcap and the padding mask (a left-padded
pair's weights are those it has alone); one forward without gradient per batch. (Not `output_attentions=True`:
transformers 5 answers it with hooks of its own that stay on the model.) The report draws, per layer and head, the mean attention from the last
position to the answer's token and to the distractor's (where the prompt holds them: in IOI, the indirect object
and the subject), and the attention of the heads of the layer that attends most to the answer over every key.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.data.prompts import pair_texts
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import LanguageModelMethod, chosen_once, forward_last
from runner.methods.lm.cells import PAIR_TEXT_FIELDS, taken_views, token_strings
from runner.models.lm_sites import LanguageModelLayout, layout_of
from runner.options.method.lm_attention import LmAttentionConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns, concat_columns
from runner.site_kinds import Positions
from runner.tables import Presentation, declare

LM_ATTENTION_SCHEMA = declare(
    "lm_attention",
    [
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("head", pa.int64()),
        pa.field("query_position", pa.int64()),  # the attending token's position (BOS = 0 when prepended)
        pa.field("query_token", pa.string()),
        pa.field("query_token_text", pa.string()),  # the query's token decoded
        pa.field("position", pa.int64()),  # the attended (key) token's position
        *PAIR_TEXT_FIELDS,
        pa.field("weight", pa.float32()),  # the attention weight (a row over keys sums to 1)
    ],
    Presentation(
        keys=("layer",),
        values=("weight",),
        shown=(),
        figures="runner.viz.lm_plots:lm_attention_figures",
    ),
    classes=False,
)


class LmAttention(LanguageModelMethod):
    name = "lm_attention"
    table = "lm_attention"
    summary_values = ("weight",)
    cfg: LmAttentionConfig

    @classmethod
    def planned(cls, cfg: LmAttentionConfig, layout: LanguageModelLayout, target: Any) -> tuple[list[int], list[int]]:
        """The layers and heads read (the target is not used); refused: not eager attention, a layer or head out of
        range or given twice."""
        if layout.attn_implementation != "eager":
            raise RunnerError(
                "method=lm_attention reads the attention weights, which only eager attention forms (the model runs"
                f" {layout.attn_implementation!r}): set model.attn_implementation=eager."
            )
        layers = chosen_once("method.layers", cfg.layers, list(range(layout.layers)), "0")
        return layers, chosen_once("method.heads", cfg.heads, list(range(layout.heads)), "0")

    def setup(self, session: HookSession, num_samples: int) -> None:
        layout = layout_of(session.model)
        self.layers, self.heads = self.planned(self.cfg, layout, self.runtime.target)
        self.specs = [layout.site("pattern", layer) for layer in self.layers]
        self.hooks = SiteHooks(session.model, self.specs, session)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        ids = prompts.clean
        within_batch(0.0, f"lm_attention: the forward of {ids.shape[0]} prompts")
        with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
            out = forward_last(model, ids, prompts.mask)
        views = taken_views(self.hooks, self.specs, self.name)
        within_batch(0.5, f"lm_attention: the rows of {len(self.specs)} layers")
        strings = self.strings(batch)
        pads = prompts.pads.cpu()
        t = ids.shape[1]
        # every (row, head, query, key) kept: real query and key, key at or before the query
        queries = [t - 1] if Positions(self.cfg.query) is Positions.last else list(range(t))
        row, head, query, key = (g.reshape(-1) for g in torch.meshgrid(
            torch.arange(ids.shape[0]), torch.tensor(self.heads), torch.tensor(queries), torch.arange(t),
            indexing="ij"))  # fmt: skip
        keep = (query >= pads[row]) & (key >= pads[row]) & (key <= query)
        row, head, query, key = row[keep], head[keep], query[keep], key[keep]
        parts = [self._rows(spec.layer, views[spec.name].float().cpu(), row, head, query, key, pads, strings)
                 for spec in self.specs]  # fmt: skip
        return BatchOutput(
            predicted=out.logits[:, -1].float().argmax(dim=1), tables={self.table: concat_columns(parts)}
        )

    def _rows(self, layer: int, weights: torch.Tensor, row: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
              key: torch.Tensor, pads: torch.Tensor, strings: list[dict[str, Any]]) -> Columns:  # fmt: skip
        """One row per kept (pair, head, query, key) of one layer; `weights` (B, T query, H, T key), the pattern
        site's view."""
        r = row.tolist()
        queries, keys = (query - pads[row]).tolist(), (key - pads[row]).tolist()
        n = len(r)
        return {
            "sample_index": r,  # the pair's row in the batch: the writer adds the first index
            "layer": [layer] * n,
            "head": head.tolist(),
            "query_position": queries,
            "query_token": token_strings(strings, r, queries),
            "query_token_text": token_strings(strings, r, queries, "texts"),
            "position": keys,
            "token": token_strings(strings, r, keys),
            "answer": [strings[i]["answer"] for i in r],
            "distractor": [strings[i]["distractor"] for i in r],
            **pair_texts(strings, r, keys),
            "weight": weights[row, query, head, key],
        }
