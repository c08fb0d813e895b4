"""`method=lm_grad_x_act`: gradient x activation at every selected site, layer and position (and head) of each
pair's clean prompt, from one forward and one backward per batch.

value = sum over the hidden (per-head sites: the head's) dimension of d(target)/d(activation) * activation; for the
`pattern` site (eager attention), per head and query position, the sum over the keys of gradient x pattern. Every
selected site stays in the same forward, so each site's gradient is the total derivative of the target: through
everything downstream of it, other selected sites included (what gradient x activation means; not the direct
effect). The target is the run's token target at the last position (left padding: the same index for every row);
the parameters are frozen, so the pass stops at the embeddings and no weight gradient is computed.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.data.prompts import pair_texts
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import LanguageModelMethod, forward_last
from runner.methods.lm.cells import PAIR_TEXT_FIELDS, real_cells, taken_views, token_strings
from runner.methods.lm.pairs import score
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of
from runner.options.method.lm_grad_x_act import LmGradXActConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns, concat_columns
from runner.site_kinds import PER_HEAD
from runner.tables import Presentation, declare
from runner.targets.tokens import TokenTarget, target_name, token_target

LM_GRAD_X_ACT_SCHEMA = declare(
    "lm_grad_x_act",
    [
        pa.field("site", pa.string()),  # resid_pre, attn_out, mlp_out, head, ...
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("head", pa.int64()),  # null for whole sites
        pa.field("position", pa.int64()),  # the token's position (BOS = 0 when prepended)
        *PAIR_TEXT_FIELDS,
        pa.field("metric", pa.string()),  # the run's target, differentiated
        pa.field("value", pa.float32()),  # gradient . activation over the hidden (or head) dimension
        pa.field("grad_norm", pa.float32()),  # |gradient| over the same dimension
        pa.field("act_norm", pa.float32()),  # |activation|
    ],
    Presentation(
        keys=("site", "metric"),
        values=("value",),
        shown=("metric",),
        figures="runner.viz.lm_plots:lm_grad_x_act_figures",
    ),
    classes=False,
)


class LmGradXAct(LanguageModelMethod):
    name = "lm_grad_x_act"
    table = "lm_grad_x_act"
    summary_values = ("value",)
    cfg: LmGradXActConfig

    @classmethod
    def planned(
        cls, cfg: LmGradXActConfig, layout: LanguageModelLayout, target: Any
    ) -> tuple[TokenTarget, list[SiteSpec]]:
        """The run's token target and each (site, layer)'s spec; refused: a target with no gradient on the clean
        prompt, a layer out of range, a site the family lacks or its attention never materialises."""
        scored = token_target(target, cls.name, per_position=False)
        layers = layout.block_layers(cfg.layers, "method.layers")
        return scored, [layout.site(kind, layer) for kind in cfg.sites for layer in layers]

    def setup(self, session: HookSession, num_samples: int) -> None:
        model = session.model
        layout = layout_of(model)
        self.target, self.specs = self.planned(self.cfg, layout, self.runtime.target)
        # The sites kept in the autograd graph, each the very tensor the rest of the forward reads (the engine of
        # lm_patching): resid_mid is the stream both branches read, pattern the softmax inside eager attention.
        self.hooks = SiteHooks(model, self.specs, session)
        self.capturing = False
        # Frozen parameters and integer ids: nothing in the forward would need a gradient; the embeddings' output
        # is made to, so the graph starts there and every site's gradient is its total derivative.
        embed = dict(model.named_modules())[layout.arch.embed]
        session.add_hook(embed, self._grad_from_here, pre=False)

    def _grad_from_here(self, module: nn.Module, args: Any, kwargs: Any, output: torch.Tensor) -> Any:
        if not self.capturing or output.requires_grad:
            return None
        return output.detach().requires_grad_(True)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        within_batch(0.0, f"lm_grad_x_act: the forward of {prompts.clean.shape[0]} prompts")
        self.capturing = True
        try:
            with torch.enable_grad(), self.runtime.autocast(), self.hooks.keep(grad=True):
                out = forward_last(model, prompts.clean, prompts.mask)
        finally:
            self.capturing = False
        views = taken_views(self.hooks, self.specs, self.name)
        logits = out.logits[:, -1].float()  # (B, V)
        metric = score(self.target, logits, prompts.answers, prompts.distractors, logits.detach())  # (B,)
        # Rows are independent, so d(sum)/d(row's activation) is that row's own gradient.
        within_batch(0.4, f"lm_grad_x_act: the backward to {len(self.specs)} sites")
        grads = torch.autograd.grad(metric.sum(), [views[s.name] for s in self.specs], allow_unused=True)
        strings = self.strings(batch)
        within_batch(0.8, "lm_grad_x_act: the rows")
        parts = [self._rows(batch, spec, views[spec.name].detach(), grad, prompts.pads, strings)
                 for spec, grad in zip(self.specs, grads, strict=True)]  # fmt: skip
        return BatchOutput(predicted=logits.detach().argmax(dim=1), tables={self.table: concat_columns(parts)})

    def _rows(self, batch: Batch, spec: SiteSpec, view: torch.Tensor, grad: torch.Tensor | None, pads: torch.Tensor,
              strings: list[dict[str, Any]]) -> Columns:  # fmt: skip
        """One row per (pair, real position[, head]) of one site; pattern: per query position and head, summed over
        the keys."""
        act = view.float()  # (B, T, D), (B, T, H, d) or, for pattern, (B, T_query, H, T_key)
        g = torch.zeros_like(act) if grad is None else grad.float()  # unused: no effect on the target
        value, grad_norm, act_norm = ((g * act).sum(-1), g.norm(dim=-1), act.norm(dim=-1))  # (B, T[, H])
        per_head = spec.kind in PER_HEAD
        rows, index, heads = real_cells(pads, act.shape[1], spec.heads if per_head else 0)
        at = (rows, index, heads) if per_head else (rows, index)
        positions = (index - pads.cpu()[rows]).tolist()
        r = rows.tolist()
        n = len(r)
        return {
            "sample_index": rows.tolist(),  # the pair's row in the batch: the writer adds the first index
            "site": [spec.kind] * n,
            "layer": [spec.layer] * n,
            "head": heads.tolist() if per_head else [None] * n,
            "position": positions,
            "token": token_strings(strings, r, positions),
            "answer": [strings[i]["answer"] for i in r],
            "distractor": [strings[i]["distractor"] for i in r],
            **pair_texts(strings, r, positions),
            "metric": [target_name(self.target)] * n,
            "value": value.cpu()[at],
            "grad_norm": grad_norm.cpu()[at],
            "act_norm": act_norm.cpu()[at],
        }
