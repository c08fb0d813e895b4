"""Attribution patching of a causal LM (Nanda 2023): every cell's first-order estimate of its patched metric.

Per direction, the receiving run (denoising: the corrupted prompt; noising: the clean one) runs once with every
site's tensor kept in the autograd graph, and the metric summed over pairs is differentiated once:

    estimate(cell) = metric(receiver) + sum over the cell's elements of (a_source - a_receiver) * dM/da_receiver

so an estimate reads like the `patched` column of an exact row. Per-head sites (head, q, k, v) are differentiated
through their (B, T, H, d) views, so every site, layer, position and head comes from the same backward.
`attribution_topk` then patches exactly (exact.py), per pair and site, the `top_k` cells estimated to move the
metric furthest toward the source run's (denoising: toward the clean metric; noising: toward the corrupted one,
whichever way that is), and reports Spearman's rho between their estimated and exact effects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.hooks.sites import Cell
from runner.methods.lm.base import forward_last
from runner.methods.lm.pairs import PairMetrics, Receiver
from runner.methods.lm_patching.exact import ExactPatcher
from runner.methods.lm_patching.rows import cell_rows
from runner.progress import WHOLE_BATCH, Stage
from runner.ranking import spearman, toward_source
from runner.rows import Columns


def estimate_cells(
    patcher: ExactPatcher, model: nn.Module, run: Receiver, cells: list[Cell], metrics: PairMetrics
) -> torch.Tensor:
    """(len(cells), B) float32 on the CPU: each cell's first-order estimate of the metric with it patched in (the
    receiving run's sites kept in the autograd graph by `patcher`'s hooks)."""
    patcher.corruption.active = run.edit
    try:
        with torch.enable_grad(), patcher.runtime.autocast(), patcher.hooks.keep(grad=True):
            out = forward_last(model, run.ids, run.mask)
            metric = metrics.of(out.logits[:, -1].float())
    finally:
        patcher.corruption.active = None
    views = patcher.hooks.kept
    patcher.hooks.kept = {}
    names = sorted({f"{cell.kind}.{cell.layer}" for cell in cells})
    # The pairs' metrics are independent (no row reads another), so one backward of their sum gives each its own.
    grads = torch.autograd.grad(metric.sum(), [views[n] for n in names], allow_unused=True)
    sums: dict[str, torch.Tensor] = {}  # site name -> (B, T) or (B, T, H): the estimate's terms summed per cell
    for name, grad in zip(names, grads, strict=True):
        view = views[name].detach()
        if grad is None:  # a site the metric does not read: every estimate is the receiver's metric
            grad = torch.zeros_like(view)
        diff = run.sources[name].to(view.device).float() - view.float()
        sums[name] = (diff * grad.float()).sum(-1).cpu()
    del views, grads
    rows = []
    for cell in cells:
        terms = sums[f"{cell.kind}.{cell.layer}"]
        if cell.head is None:
            rows.append(terms[:, cell.position])
        elif cell.position is None:
            rows.append(terms[:, :, cell.head].sum(1))
        else:
            rows.append(terms[:, cell.position, cell.head])
    return run.metric.detach().float().cpu()[None] + torch.stack(rows)


def attribution_rows(
    patcher: ExactPatcher, model: nn.Module, run: Receiver, cells: list[Cell], metrics: PairMetrics,
    pairs: list[dict[str, Any]], top_k: int | None, stage: Stage = WHOLE_BATCH,
) -> list[Columns]:  # fmt: skip
    """One direction's rows: every cell's estimate (patch_method attribution), and given `top_k`
    (attribution_topk) each pair's top_k cells per site patched exactly (patch_method exact, with their rank
    correlation); the run's bar moves within `stage` (the estimates, then each pair's exact cells)."""
    stage.report(0, 1, f"estimating {len(cells)} cells (one backward)")
    estimates = estimate_cells(patcher, model, run, cells, metrics)
    rows = cell_rows(run, cells, estimates, metrics, pairs, kind="attribution")
    if top_k is None:
        return [rows]
    b, t = run.mask.shape
    pads = (t - run.mask.sum(1)).tolist()
    source = metrics.source(run.direction)  # (B,) the source run's metric
    toward = toward_source(estimates, run.metric.detach().float().cpu(), source.detach().float().cpu())  # (C, B)
    chosen = [_top_cells(cells, toward[:, row], pads[row], top_k) for row in range(b)]
    union = sorted({c for picked in chosen for c in picked})
    where = {c: u for u, c in enumerate(union)}
    patched = torch.full((len(union), b), float("nan"))
    select = torch.zeros((len(union), b), dtype=torch.bool)
    rho: dict[tuple[int, str], float] = {}
    for row, picked in enumerate(chosen):
        # One pair at a time: each pair has its own cells, and the engine patches a cell into every pair it runs.
        exact = patcher.patched_metrics(
            model, run.ids[row : row + 1], run.mask[row : row + 1],
            None if run.edit is None else run.edit.rows(row),
            {name: source[row : row + 1] for name, source in run.sources.items()},
            [cells[c] for c in picked], metrics.answers[row : row + 1], metrics.distractors[row : row + 1],
            metrics.clean_logits[row : row + 1],
            Stage(stage.start + stage.span * (0.2 + 0.8 * row / b), stage.span * 0.8 / b,
                  f"{stage.label}: pair {row + 1}/{b}'s top cells"),
        )[:, 0].cpu()  # fmt: skip
        for c, value in zip(picked, exact.tolist(), strict=True):
            patched[where[c], row] = value
            select[where[c], row] = True
        effect = exact - float(run.metric[row])
        for kind in dict.fromkeys(cells[c].kind for c in picked):
            part = [k for k, c in enumerate(picked) if cells[c].kind == kind]
            # a degenerate pair's effects are float noise around 0: their order says nothing
            defined = len(part) > 1 and metrics.reasons[row] is None
            estimated = estimates[[picked[k] for k in part], row]
            rho[(row, kind)] = float(spearman(estimated, effect[part])) if defined else float("nan")
    exact_rows = cell_rows(run, [cells[c] for c in union], patched, metrics, pairs, kind="exact", select=select)
    exact_rows["rank_correlation"] = torch.tensor(
        [rho[(i, kind)] for i, kind in zip(exact_rows["sample_index"], exact_rows["site"], strict=True)],
        dtype=torch.float32,
    )  # fmt: skip
    rows["rank_correlation"] = torch.full((len(rows["site"]),), float("nan"))
    return [rows, exact_rows]


def _top_cells(cells: list[Cell], toward: torch.Tensor, pads: int, top_k: int) -> list[int]:
    """Per site kind, the indices of the `top_k` cells estimated to move the metric furthest toward the source
    run's (`toward`, (C,): ranking.toward_source; as for vision), leaving out the pair's padding positions."""
    by_kind: dict[str, list[int]] = {}
    for c, cell in enumerate(cells):
        if cell.position is None or cell.position >= pads:
            by_kind.setdefault(cell.kind, []).append(c)
    picked = []
    for members in by_kind.values():
        order = toward[members].argsort(descending=True, stable=True)[:top_k]
        picked += [members[k] for k in order.tolist()]
    return picked
