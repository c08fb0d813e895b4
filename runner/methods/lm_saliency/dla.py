"""`method=lm_dla`: direct logit attribution on each pair's clean prompt, at its last position (or every position).

The residual stream the final norm reads is a sum of writes: the embeddings (block 0's input: token plus position
embeddings, Gemma's scaling included), each head's output through the attention's output projection
(runner/methods/lm/writes.py `HeadWrites`: o(z_h) - o(0), times a post-norm's share at the run's own scale where the
family has one), each attention's output bias o(0) where the projection has one, and each MLP's output (after its
post-norm, where the family has one). Each write c goes through the final norm made linear at the run's own scale
(`FrozenNorm`: gain * centred(c) / scale(x), the scale of the run's final stream x, as TransformerLens'
`apply_ln_to_stack`) and onto the target's direction, the unembedding's answer row minus its distractor row (each the
mean over its token set); `answer_value` and `distractor_value` are the two rows' parts (a head that raises the
difference by lowering the distractor shows it there). The row `bias` holds what no writer owns: the final norm's
bias and the unembedding's bias on that direction. So the contributions sum to the logit difference exactly (to
float rounding) before the family's final softcap; `total` is that sum, `logit_diff` the model's own (after the
softcap, Gemma 2's: there they differ).

`accumulated`: the stream before each block l (resid_pre.l) and the final stream, each through the same frozen norm
onto the direction, without the bias row (TransformerLens' `accumulated_resid` with `logit_attrs`): the last one plus
`bias` is `total`.

With sparse dictionaries spliced in (model.dictionaries), the site each one writes is split once more into its active
latents' decoder writes f_i x W_dec[i] (kind `latent`, `head` the latent's index, writer `d<layer>.f<i>`), its error
(`latent_error`) and its decoder bias (`latent_bias`), through the same frozen norm: for a dictionary at an MLP
(mlp_out, or a transcoder) the three add up to that MLP's row, at attn_out to the layer's heads and attention bias, at
a stream site to the accumulated stream there (resid_post.l: resid_pre.l+1's row). Like `accumulated`, these rows
re-split writers already counted, so `total` leaves them out; a latent that is zero at a position has no row there.

One forward without gradient per batch; the writers are summed back and compared with the final stream, and a family
whose stream holds a write the runner does not know (the sum differs) is refused rather than reported wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.data.prompts import pair_texts
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import LanguageModelMethod, forward_last
from runner.methods.lm.cells import PAIR_TEXT_FIELDS, real_cells, taken_views, token_strings
from runner.methods.lm.writes import FrozenNorm, HeadWrites
from runner.models.lm_sites import LanguageModelLayout, layout_of, unembedding
from runner.options.method.lm_dla import LmDlaConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns
from runner.site_kinds import Positions
from runner.tables import Presentation, declare
from runner.targets.tokens import TokenLogitDiff, TokenTarget, set_mean, target_name, token_target

EMBEDDINGS = -1  # the layer of the embeddings' write (block 0's input)

LM_DLA_SCHEMA = declare(
    "lm_dla",
    [
        pa.field("kind", pa.string()),  # embeddings | head | attn_bias | mlp | bias | accumulated
        pa.field("writer", pa.string()),  # input, a3.h2, a3.bias, m3, bias; accumulated: resid_pre.3, resid_post.29
        pa.field(
            "layer", pa.int64()
        ),  # the writer's block (-1: the embeddings; null: bias); accumulated: blocks before
        pa.field("head", pa.int64()),  # the head (kind head), else null
        pa.field("position", pa.int64()),  # the token's position (BOS = 0 when prepended)
        *PAIR_TEXT_FIELDS,
        pa.field("metric", pa.string()),  # the run's target (token_logit_diff)
        pa.field("value", pa.float32()),  # the writer's contribution to the logit difference
        pa.field("answer_value", pa.float32()),  # ... to the answer's logit (value = answer_value - distractor_value)
        pa.field("distractor_value", pa.float32()),  # ... to the distractor's logit
        pa.field("total", pa.float32()),  # the sum of the contributions: the logit difference before any softcap
        pa.field("logit_diff", pa.float32()),  # the model's own logit difference at this position (after a softcap)
    ],
    Presentation(keys=("kind",), values=("value",), shown=(), figures="runner.viz.lm_plots:lm_dla_figures"),
    classes=False,
)


class LmDla(LanguageModelMethod):
    name = "lm_dla"
    table = "lm_dla"
    summary_values = ("value",)
    cfg: LmDlaConfig

    @classmethod
    def planned(cls, cfg: LmDlaConfig, layout: LanguageModelLayout, target: Any) -> TokenTarget:
        """The run's target; refused: a target the stream's writers do not add up to (not linear in the logits)."""
        scored = token_target(target, cls.name, per_position=False)
        if not isinstance(scored, TokenLogitDiff):
            raise RunnerError(
                f"method=lm_dla splits a logit difference, which is linear in the residual stream, into its writers;"
                f" target={target_name(scored)} is not linear in the logits. Use target=token_logit_diff (a pair"
                " without a distractor reads the answer's logit)."
            )
        return scored

    def setup(self, session: HookSession, num_samples: int) -> None:
        model = session.model
        layout = layout_of(model)
        self.target = self.planned(self.cfg, layout, self.runtime.target)
        self.layout = layout
        modules = dict(model.named_modules())
        self.norm, self.unembed = modules[layout.arch.final_norm], unembedding(model)
        width = getattr(getattr(model, "config", None), "hidden_size", None)
        if width is not None and self.unembed.weight.shape[1] != width:
            raise RunnerError(
                f"method=lm_dla: this model's unembedding reads {self.unembed.weight.shape[1]} features, not the"
                f" stream's {width} (a projection between the final norm and the unembedding, as OPT-350m's):"
                " the runner does not split it. Use method=lm_logit_lens."
            )
        self.head_writes = HeadWrites(model, layout, layout.layers, method=self.name)
        self.biased = [getattr(o, "bias", None) is not None for o in self.head_writes.out_proj]
        last = layout.layers - 1
        self.specs = [
            *(layout.site(kind, layer) for layer in range(layout.layers) for kind in ("resid_pre", "head", "mlp_out")),
            layout.site("resid_post", last),
            *(layout.site(kind, p.layer) for p in layout.dictionaries for kind in ("latent", "error")),
        ]
        self.dictionaries = {p.layer: model.get_submodule(p.module).dictionary for p in layout.dictionaries}
        for layer, dictionary in self.dictionaries.items():
            if dictionary.spec.normalize == "constant_norm_rescale":  # each write divided by its input's own norm
                raise RunnerError(
                    f"method=lm_dla: the dictionary at layer {layer} rescales each input by its norm"
                    " (constant_norm_rescale), which this split does not keep: use method=lm_grad_x_act or lm_patching."
                )
        self.hooks = SiteHooks(model, self.specs, session)
        self.final = f"resid_post.{last}"

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        ids = prompts.clean
        within_batch(0.0, f"lm_dla: the forward of {ids.shape[0]} prompts")
        with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
            out = forward_last(model, ids, prompts.mask)
        views = taken_views(self.hooks, self.specs, self.name)
        b, t = ids.shape
        if Positions(self.cfg.positions) is Positions.last:
            rows, index = torch.arange(b), torch.full((b,), t - 1)
        else:
            rows, index, _ = real_cells(prompts.pads, t)
        within_batch(0.4, f"lm_dla: the writers of {self.layout.layers} layers at {len(rows)} positions")
        with torch.no_grad():
            columns = self._columns(views, rows, index, prompts.answers, prompts.distractors)
        strings = self.strings(batch)
        positions = (index - prompts.pads.cpu()[rows]).tolist()
        columns.update(self._pair_columns(strings, rows.tolist(), positions, columns.pop("_cell")))
        return BatchOutput(predicted=out.logits[:, -1].float().argmax(dim=1), tables={self.table: columns})

    def _writes(self, views: dict[str, torch.Tensor], rows: torch.Tensor, index: torch.Tensor) -> tuple[
        torch.Tensor, list[tuple[str, str, int | None, int | None]]
    ]:  # fmt: skip
        """(W, N, D) float32 every writer's write at the N cells, and each writer's (kind, name, layer, head)."""
        at = {name: view[rows.to(view.device), index.to(view.device)] for name, view in views.items()}
        parts, names = [at["resid_pre.0"].float()[None]], [("embeddings", "input", EMBEDDINGS, None)]
        for layer in range(self.layout.layers):
            z = at[f"head.{layer}"]  # (N, H, d)
            heads = self.head_writes(layer, z).float()  # (H, N, D)
            parts.append(heads)
            names += [("head", f"a{layer}.h{h}", layer, h) for h in range(heads.shape[0])]
            if self.biased[layer]:  # o(0): what the attention adds whatever its heads output
                o = self.head_writes.out_proj[layer]
                bias = o.forward(torch.zeros_like(z.flatten(-2)[:1])).float()  # (1, D)
                parts.append(bias.expand(z.shape[0], -1)[None])
                names.append(("attn_bias", f"a{layer}.bias", layer, None))
            parts.append(at[f"mlp_out.{layer}"].float()[None])
            names.append(("mlp", f"m{layer}", layer, None))
        return torch.cat([p.to(parts[0].device) for p in parts]), names

    def _columns(self, views: dict[str, torch.Tensor], rows: torch.Tensor, index: torch.Tensor,
                 answers: torch.Tensor, distractors: torch.Tensor) -> Columns:  # fmt: skip
        writes, names = self._writes(views, rows, index)
        stream = views[self.final][rows.to(writes.device), index.to(writes.device)].float()  # (N, D)
        self._check_sum(writes.sum(0), stream)
        device = self.unembed.weight.device
        frozen = FrozenNorm(self.norm, stream.to(device))
        a, d = answers.to(device)[rows.to(device)], distractors.to(device)[rows.to(device)]  # (N, A)
        weight = self.unembed.weight.float()  # (V, D)
        # each writer toward the answer's row and toward the distractor's (the last axis); the value is their difference
        rows_of = torch.stack([_set_rows(weight, a), _set_rows(weight, d)], dim=-1)  # (N, D, 2)
        toward = torch.einsum("wnd,ndk->wnk", frozen(writes.to(device)), rows_of)  # (W, N, 2)
        bias = torch.einsum("d,ndk->nk", frozen.bias, rows_of)  # the final norm's bias on each row (N, 2)
        if getattr(self.unembed, "bias", None) is not None:
            unembed_bias = self.unembed.bias.float()[None].expand(len(a), -1)
            bias = bias + torch.stack([set_mean(unembed_bias, a), set_mean(unembed_bias, d)], dim=-1)
        toward = torch.cat([toward, bias[None]])
        names.append(("bias", "bias", None, None))
        if self.cfg.accumulated:
            streams = [views[f"resid_pre.{layer}"] for layer in range(self.layout.layers)] + [views[self.final]]
            at = torch.stack([s[rows.to(s.device), index.to(s.device)].to(device) for s in streams])  # (L + 1, N, D)
            toward = torch.cat([toward, torch.einsum("lnd,ndk->lnk", frozen(at), rows_of)])
            names += [("accumulated", f"resid_pre.{layer}", layer, None) for layer in range(self.layout.layers)]
            names.append(("accumulated", self.final, self.layout.layers, None))
        values = toward[..., 0] - toward[..., 1]  # (W', N)
        total = values[: writes.shape[0] + 1].sum(0)  # (N,) the writers and the bias row
        logits = self.layout.logits(self.unembed.forward(self.norm.forward(stream.to(device))).float())  # (N, V)
        logit_diff = set_mean(logits, a) - set_mean(logits, d)
        w, n = values.shape
        kinds, writers, layers, heads = (np.array(c, dtype=object) for c in zip(*names, strict=True))
        cell = np.tile(np.arange(n), w)  # row-major (writer, cell): row w * N + n
        kinds, writers, layers, heads = (np.repeat(x, n) for x in (kinds, writers, layers, heads))  # row w * N + n
        split = self._dictionary_rows(views, rows, index, frozen, rows_of)
        if split is not None:  # the dictionaries' rows after the writers' (a cell's active latents only)
            kinds, writers, layers, heads, cell = (
                np.concatenate([x, y]) for x, y in zip((kinds, writers, layers, heads, cell), split[:5], strict=True)
            )
            toward = torch.cat([toward.reshape(-1, 2), split[5]])  # (rows, 2)
            values = toward[..., 0] - toward[..., 1]
        return {
            "_cell": cell,
            "kind": kinds,
            "writer": writers,
            "layer": layers,
            "head": heads,
            "metric": [target_name(self.target)] * len(cell),
            "value": values.reshape(-1).cpu(),
            "answer_value": toward[..., 0].reshape(-1).cpu(),
            "distractor_value": toward[..., 1].reshape(-1).cpu(),
            "total": total.cpu()[cell],
            "logit_diff": logit_diff.cpu()[cell],
        }

    def _dictionary_rows(
        self, views: dict[str, torch.Tensor], rows: torch.Tensor, index: torch.Tensor, frozen: FrozenNorm,
        rows_of: torch.Tensor,
    ) -> tuple[np.ndarray, ...] | None:  # fmt: skip
        """Each spliced dictionary's active latents, error and decoder bias at the N cells, as rows: (kinds, writers,
        layers, heads, cells) and (rows, 2) their values toward the answer's and the distractor's rows; None without
        dictionaries."""
        if not self.dictionaries:
            return None
        device = rows_of.device
        parts: list[tuple[list[str], list[str], list[int], list[int | None], list[int], torch.Tensor]] = []
        for layer, dictionary in self.dictionaries.items():
            f = views[f"latent.{layer}"][rows.to(device), index.to(device)][..., 0].float()  # (N, width)
            error = views[f"error.{layer}"][rows.to(device), index.to(device)].float()  # (N, D)
            scale = dictionary.spec.scale if dictionary.spec.normalize == "expected_average_only_in" else 1.0
            most = max(int((f != 0).sum(-1).max()), 1)  # the most latents active at one cell
            active = f.abs().topk(most, dim=-1)  # (N, most): each cell's active latents first
            acts = f.gather(-1, active.indices)  # (N, most)
            w_dec = dictionary.W_dec.float().to(device) / scale  # (width, D)
            writes = (acts[..., None] * w_dec[active.indices]).transpose(0, 1)  # (most, N, D)
            bias = (dictionary.b_dec.float().to(device) / scale).expand_as(error)  # (N, D)
            toward = torch.einsum("wnd,ndk->wnk", frozen(torch.cat([writes, error[None], bias[None]])), rows_of)
            live = (acts != 0).T  # (most, N)
            latent_at, cell_at = live.nonzero(as_tuple=True)
            ids = active.indices.T[latent_at, cell_at].tolist()
            n = f.shape[0]
            parts.append((
                ["latent"] * len(ids) + ["latent_error"] * n + ["latent_bias"] * n,
                [f"d{layer}.f{i}" for i in ids] + [f"d{layer}.error"] * n + [f"d{layer}.b_dec"] * n,
                [layer] * (len(ids) + 2 * n),
                [*ids, *([None] * (2 * n))],
                [*cell_at.tolist(), *range(n), *range(n)],
                torch.cat([toward[latent_at, cell_at], toward[-2], toward[-1]]),
            ))  # fmt: skip
        columns = [np.array([x for part in parts for x in part[c]], dtype=object) for c in range(4)]
        cells = np.array([x for part in parts for x in part[4]], dtype=np.int64)
        return (*columns, cells, torch.cat([part[5] for part in parts]))

    def _check_sum(self, summed: torch.Tensor, stream: torch.Tensor) -> None:
        """Refuse a family whose final stream is not the sum of the writes read (a write the runner does not know)."""
        tolerance = max(1e-3, 50 * torch.finfo(stream.dtype if stream.is_floating_point() else torch.float32).eps)
        scale = stream.abs().amax().clamp(min=1e-6)
        error = float((summed.to(stream.device) - stream).abs().amax() / scale)
        if error > tolerance:
            raise RunnerError(
                f"method=lm_dla: this {self.layout.arch.family} model's final stream is not the sum of its embeddings',"
                f" heads', attention biases' and MLPs' writes (relative error {error:.2g}): its forward adds something"
                " the runner's layout does not know. Use method=lm_patching or lm_logit_lens for this family."
            )

    def _pair_columns(self, strings: list[dict[str, Any]], rows: list[int], positions: list[int],
                      cell: np.ndarray) -> Columns:  # fmt: skip
        """The pair's columns of each row, whose cell is `cell` (index into `rows` and `positions`)."""
        r = [rows[c] for c in cell.tolist()]
        p = [positions[c] for c in cell.tolist()]
        return {
            "sample_index": r,  # the pair's row in the batch: the writer adds the first index
            "position": p,
            "token": token_strings(strings, r, p),
            "answer": [strings[i]["answer"] for i in r],
            "distractor": [strings[i]["distractor"] for i in r],
            **pair_texts(strings, r, p),
        }


def _set_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(N, D) the mean of `weight`'s rows (V, D) over each row's token set `ids` (N, A) padded with -1 (a set
    without tokens: zeros)."""
    real = (ids >= 0).float()
    picked = weight[ids.clamp(min=0)] * real[..., None]  # (N, A, D)
    return picked.sum(1) / real.sum(1, keepdim=True).clamp(min=1)
