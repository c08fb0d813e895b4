"""What lm_edges' two passes run on a batch of pairs (scoring.py, evaluation.py): the clean and the corrupted run
traced without gradients, the pairs' metrics, and intervention forwards (intervene.py's deltas) measured on the
metric: exact edges, circuits, paths."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.data.base import Batch
from runner.methods.lm.base import TokenPairs, forward_last
from runner.methods.lm.corruptions import Corrupted, Corruption, EmbeddingEdit
from runner.methods.lm.pairs import PairMetrics, pair_metrics, score
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.intervene import ROWS_PER_FORWARD, Deltas, EdgeRuns, Patched
from runner.methods.lm_edges.positions import Slots
from runner.options.method.lm_edges import LmEdgesConfig
from runner.progress import within_batch
from runner.rows import Columns
from runner.runtime import Runtime
from runner.targets.tokens import TokenTarget, target_name


class PairRuns:
    """A run's pairs as both passes run them: the settings `p`, the token target, the runtime, the corruption, the
    hooks on the graph's sites, the graph and its edges (`edge_index` (E, 2) writer, reader; `columns`: each unit's
    naming columns), the position slots (per-position edges, else None), how a batch reads as prompt pairs
    (`prompts`), and the flags already warned about (`warned`, `name`, `key`: how messages name the method)."""

    def __init__(
        self, p: LmEdgesConfig, target: TokenTarget, runtime: Runtime, corruption: Corruption, hooks: EdgeRuns,
        graph: EdgeGraph, edge_index: torch.Tensor, columns: Columns, slots: Slots | None,
        prompts: Callable[[Batch], TokenPairs], warned: set[str], name: str, key: str,
    ) -> None:  # fmt: skip
        self.p, self.target, self.runtime, self.corruption, self.hooks = p, target, runtime, corruption, hooks
        self.graph, self.edge_index, self.columns, self.slots = graph, edge_index, columns, slots
        self.prompts, self.warned, self.name, self.key = prompts, warned, name, key

    @property
    def per_edge(self) -> int:
        """Units per edge: its position slots (per-position edges), else 1."""
        return 1 if self.slots is None else len(self.slots)

    def positions(self, sample_ids: list[str], mask: torch.Tensor) -> torch.Tensor | None:
        """(B, T) each position's slot (per-position edges), else None."""
        return None if self.slots is None else self.slots.of_batch(sample_ids, mask)

    def clean_run(self, model: nn.Module, batch: Batch) -> tuple[TokenPairs, Corrupted, torch.Tensor,
                                                                    dict[str, torch.Tensor]]:  # fmt: skip
        """The batch's prompts and their corruption, and the clean run traced without gradients: its last logits and
        views."""
        prompts = self.prompts(batch)
        corrupted = self.corruption.corrupt(batch, prompts.clean, prompts.corrupted, prompts.mask)
        with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
            clean_logits = forward_last(model, prompts.clean, prompts.mask).logits[:, -1].float()
        return prompts, corrupted, clean_logits, self.hooks.kept

    def metrics(
        self, prompts: TokenPairs, corrupted: Corrupted, clean_logits: torch.Tensor, corrupted_logits: torch.Tensor,
        ids: list[str],
    ) -> PairMetrics:  # fmt: skip
        """The pairs' clean and corrupted metrics and flags (a flagged pair is warned about once, and left out of the
        run's means)."""
        return pair_metrics(
            self.target,
            prompts,
            corrupted.ids,
            corrupted.edit,
            clean_logits,
            corrupted_logits,
            ids,
            self.p.min_span,
            self.warned,
            self.name,
            self.key,
            "the pair is left out of the run's means",
        )

    def corrupted_run(self, model: nn.Module, corrupted: Corrupted, mask: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                                            torch.Tensor]:  # fmt: skip
        """The corrupted prompts' run, traced without gradients: its views and last logits."""
        self.corruption.active = corrupted.edit
        try:
            with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
                logits = forward_last(model, corrupted.ids, mask).logits[:, -1].float()
        finally:
            self.corruption.active = None
        views = dict(self.hooks.kept)
        return views, logits

    def common(self, rows: int) -> dict[str, list[Any]]:
        return {"mode": [self.p.mode.value] * rows, "metric": [target_name(self.target)] * rows}

    def runs(self, model: nn.Module, batch: Batch) -> BatchRuns:
        """The batch's clean and corrupted runs, traced, and its pairs' metrics."""
        prompts, corrupted, clean_logits, clean_sites = self.clean_run(model, batch)
        clean_ids, mask = prompts.clean, prompts.mask
        kept, corrupted_logits = self.corrupted_run(model, corrupted, mask)
        metrics = self.metrics(prompts, corrupted, clean_logits, corrupted_logits, batch.sample_ids)
        return BatchRuns(clean_ids, mask, corrupted, clean_logits, clean_sites, kept, metrics)

    @staticmethod
    def variants(pairs: int, copies: int) -> int:
        """Variants per intervention forward: rows (variants x copies x pairs) near ROWS_PER_FORWARD, at least one."""
        return max(1, ROWS_PER_FORWARD // (copies * pairs))

    def intervened(self, model: nn.Module, deltas: Deltas, run: Receiving) -> torch.Tensor:
        """(variants, B) the metric of copy 0 of each variant of an intervention forward on `run`'s prompts."""
        b = run.ids.shape[0]
        rows = deltas.variants * deltas.copies
        self.corruption.active = None if run.edit is None else run.edit.repeat(rows)
        try:
            with torch.no_grad(), self.runtime.autocast(), self.hooks.run(deltas, b, run.kept):
                logits = forward_last(model, run.ids.repeat(rows, 1), run.mask.repeat(rows, 1)).logits[:, -1].float()
        finally:
            self.corruption.active = None
        measured = logits.view(deltas.variants, deltas.copies, b, -1)[:, 0].flatten(0, 1)  # (V x B, vocab)
        m = run.metrics
        v = deltas.variants
        return score(self.target, measured, m.answers.repeat(v, 1), m.distractors.repeat(v, 1),
                     m.clean_logits.repeat(v, 1)).view(v, b)  # fmt: skip

    def exact(
        self, model: nn.Module, run: Receiving, units: Sequence[int], deltas: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """(len(units), B) each unit's exact effect: the corrupted run with the edge's reader reading + the writer's
        clean - corrupted write (per-position edges: at the unit's slot's positions, `positions` (B, T) the slots),
        minus the corrupted run's metric."""
        step = self.variants(run.ids.shape[0], Patched.COPIES)
        out = []
        for i in range(0, len(units), step):
            within_batch(0.5 + 0.3 * i / len(units), f"lm_edges: exact edges {i}/{len(units)}")
            chosen = torch.as_tensor(list(units[i : i + step]), dtype=torch.long)
            edges = [tuple(e) for e in self.edge_index[chosen // self.per_edge].tolist()]
            where = None if positions is None else positions[None] == (chosen % self.per_edge)[:, None, None].to(
                positions.device)  # fmt: skip  # (V, B, T)
            patched = Patched(edges, deltas, self.graph, where)
            out.append(self.intervened(model, patched, run) - run.metrics.corrupted[None].to(deltas.device))
        return torch.cat(out)


@dataclass
class BatchRuns:
    """A batch's clean and corrupted runs: prompts, the corruption, the clean logits, both runs' views, metrics."""

    clean_ids: torch.Tensor
    mask: torch.Tensor
    corrupted: Corrupted  # its ids and embedding edit
    clean_logits: torch.Tensor
    clean_sites: dict[str, torch.Tensor]
    kept: dict[str, torch.Tensor]  # the corrupted run's views
    metrics: PairMetrics


@dataclass
class Receiving:
    """The run an intervention forward measures from: its prompts, edit, mask, the corrupted run's views, the pairs'
    metrics."""

    ids: torch.Tensor
    edit: EmbeddingEdit | None
    mask: torch.Tensor
    kept: dict[str, torch.Tensor]
    metrics: PairMetrics


def pairs_of(batch: Batch, index: list[int]) -> Batch:
    """The pairs `index` of a batch as a batch of their own (still padded to the batch's longest: a left-padded pair
    computes as it would alone)."""
    if index == list(range(batch.x.shape[0])):
        return batch
    rows = torch.as_tensor(index, device=batch.x.device)
    extras = None if batch.extras is None else {k: v[rows] for k, v in batch.extras.items()}
    masks = None if batch.masks is None else batch.masks[rows]
    return Batch(batch.x[rows], batch.labels[rows], [batch.sample_ids[i] for i in index], batch.first_index, masks,
                 extras)  # fmt: skip
