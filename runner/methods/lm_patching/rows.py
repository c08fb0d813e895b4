"""The `lm_patching` table: its columns, declared once, and the rows of one direction's patched cells, whichever
mode (exact or attribution) had their patched metrics."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch

from runner.data.prompts import pair_texts
from runner.hooks.sites import Cell
from runner.methods.lm.cells import PAIR_TEXT_FIELDS
from runner.methods.lm.pairs import PairMetrics, Receiver
from runner.rows import Columns
from runner.tables import Presentation, declare, optional

LM_PATCHING_SCHEMA = declare(
    "lm_patching",
    [
        pa.field("corrupted_id", pa.string()),
        pa.field("direction", pa.string()),  # denoising | noising
        pa.field("site", pa.string()),  # resid_pre, attn_out, mlp_out, head, ...
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("head", pa.int64()),  # the head (site latent: the latent's index); null for whole-site cells
        pa.field("position", pa.int64()),  # the token's position (BOS = 0 when prepended); null: every position
        *PAIR_TEXT_FIELDS,
        pa.field("metric", pa.string()),  # the run's target
        pa.field("patch_method", pa.string()),  # exact | attribution (a first-order estimate)
        *(pa.field(n, pa.float32()) for n in ("clean", "corrupted", "patched", "restoration")),
        pa.field("degenerate", pa.bool_()),
        pa.field("degenerate_reason", pa.string()),
        pa.field("small_span", pa.bool_()),
        optional("rank_correlation", pa.float32(), "method.patching.mode=attribution_topk"),
    ],
    Presentation(
        keys=("direction", "site", "patch_method", "metric"),
        values=("restoration",),
        shown=("metric",),
        figures="runner.viz.lm_plots:lm_patching_figures",
    ),
    classes=False,
)


def cell_rows(
    run: Receiver, cells: list[Cell], patched: torch.Tensor, metrics: PairMetrics, pairs: list[dict[str, Any]],
    kind: str = "exact", select: torch.Tensor | None = None,
) -> Columns:  # fmt: skip
    """One row per (cell, pair) of `patched` (C, B), leaving out cells at a pair's padding positions (and, given
    `select` (C, B), the (cell, pair)s it leaves False); `pairs`: each pair's strings (`pair_strings`); `kind`: how
    `patched` was had (exact | attribution)."""
    b, t = run.mask.shape
    pads = (t - run.mask.sum(1)).tolist()
    restoration = metrics.restoration(patched)
    keep_c, keep_b, positions = [], [], []
    for c, cell in enumerate(cells):
        for row in range(b):
            if cell.position is not None and cell.position < pads[row]:
                continue  # a padding position of this pair
            if select is not None and not select[c, row]:
                continue
            keep_c.append(c)
            keep_b.append(row)
            positions.append(None if cell.position is None else cell.position - pads[row])
    ci, bi = torch.tensor(keep_c, dtype=torch.long), torch.tensor(keep_b, dtype=torch.long)
    return {
        "sample_index": bi.tolist(),  # the pair's row in the batch: the writer adds the batch's first index
        "corrupted_id": [run.corrupted_names[r] for r in keep_b],
        "direction": [run.direction.value] * len(keep_b),
        "site": [cells[c].kind for c in keep_c],
        "layer": [cells[c].layer for c in keep_c],
        "head": [cells[c].head for c in keep_c],
        "position": positions,
        "token": [
            pairs[r]["tokens"][p] if p is not None and p < len(pairs[r]["tokens"]) else None
            for r, p in zip(keep_b, positions, strict=True)
        ],  # fmt: skip
        "answer": [pairs[r]["answer"] for r in keep_b],
        "distractor": [pairs[r]["distractor"] for r in keep_b],
        **pair_texts(pairs, keep_b, positions),
        "metric": [metrics.name] * len(keep_b),
        "patch_method": [kind] * len(keep_b),
        "clean": metrics.clean.cpu()[bi],
        "corrupted": metrics.corrupted.cpu()[bi],
        "patched": patched.cpu()[ci, bi],
        "restoration": restoration[ci, bi],
        "degenerate": [metrics.reasons[r] is not None for r in keep_b],
        "degenerate_reason": [metrics.reasons[r] for r in keep_b],
        "small_span": [metrics.small[r] for r in keep_b],
    }
