"""`method=lm_edges`: every edge of a causal LM's graph scored on the run's discovery pairs (EAP, EAP-IG, ...:
scores.py), one ranking for the whole run, and its circuits evaluated on every pair (intervene.py).

Two passes over the data (runner/methods/base.py `passes`), each written shard by shard and resumed as any run:
  1. scoring: each discovery pair's score of every edge (table lm_edge_pair_scores: the scores are a result, and a
     resumed run reads them back rather than scoring again);
  2. evaluation: from the scores of every discovery pair read back (`begin_pass`), the edges are ranked once for the
     run, and its circuits (the top edges at each size) are evaluated on every pair of both parts (lm_circuit), the
     top_k edges patched exactly (lm_edge_exact).
Then the tables about the whole run (run_scores.py): lm_edges, the faithfulness curve with its areas, the bootstrap
stability of the circuits, the estimate's calibration. The ranking, and with it every circuit and curve, depends on the
pairs and the seed, not on the batch size or the order of the pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.lm.base import CorruptedPairsMethod, TokenPairs, forward_last
from runner.methods.lm.corruptions import Corrupted, EmbeddingEdit
from runner.methods.lm.pairs import PairMetrics, pair_metrics, score
from runner.methods.lm_edges.estimators import ESTIMATORS, Runs
from runner.methods.lm_edges.export import write_eap_ig_graph
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.intervene import ROWS_PER_FORWARD, Deltas, EdgeRuns, Patched
from runner.methods.lm_edges.plan import EdgePlan, Shape, edge_plan
from runner.methods.lm_edges.positions import Slots, pair_roles
from runner.methods.lm_edges.rows import naming_keys, typed, unit_columns
from runner.methods.lm_edges.run_scores import RunScores, final_tables
from runner.methods.lm_edges.scores import ScoreSum, integrated, writes
from runner.methods.lm_edges.split import DISCOVERY, split_pairs
from runner.models.check import available_bytes
from runner.models.lm_sites import LanguageModelLayout, layout_of
from runner.options.method.lm_edges import EdgeAblation, EdgeMode, EdgePaths, LmEdgesConfig, LmEdgesMethodConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns, Ragged
from runner.runtime import Runtime
from runner.targets.tokens import TokenTarget, target_name, token_target

log = logging.getLogger(__name__)
# Whether the circuits whose metric is known (every edge: the clean run; none, corrupted ablation: the corrupted run)
# are measured all the same (the tests that check the interventions against those identities set it)
MEASURE_KNOWN_CIRCUITS = False


class LmEdges(CorruptedPairsMethod):
    name = "lm_edges"
    table = "lm_edges"
    summary_values = ("score",)
    passes = 2  # scoring, then evaluation (module docstring)
    cfg: LmEdgesMethodConfig

    def __init__(self, cfg: LmEdgesMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        super().__init__(cfg, layers, runtime, cfg.edges, "method.edges")
        self.evaluating = False  # the pass: scoring (False) or evaluation
        self.run: RunScores | None = None  # the run's scores, read back before the evaluation
        self.parts: dict[str, str] = {}  # pair id -> discovery | held_out
        self.slots: Slots | None = None  # per-position edges: the run's position slots

    @classmethod
    def planned(cls, cfg: LmEdgesMethodConfig, layout: LanguageModelLayout, target: Any) -> TokenTarget:
        """The run's token target; refused: a target that scores no tokens, a circuit larger than the model's graph."""
        scored = token_target(target, cls.name, per_position=True)
        graph = EdgeGraph.of(layout)
        path_masks(cfg.edges, graph)  # a path naming no node, or no edge, is refused before the weights load
        if not cfg.edges.per_position:  # else the units are counted once the data's slots are known (prepare)
            _check_sizes(cfg.edges.circuit, graph.count, f"this model's graph has {graph.count} edges")
        return scored

    @classmethod
    def memory_plan(
        cls, cfg: LmEdgesMethodConfig, layout: LanguageModelLayout, skeleton: nn.Module, dataset: Dataset,
        batch_size: int, free: int | None,
    ) -> EdgePlan:  # fmt: skip
        """The run's plan (plan.py) on `skeleton` (the model on the meta device) for `dataset` in batches of
        `batch_size`, with `free` bytes on the device (the readers' gradients' default chunk is a quarter of it)."""
        p = cfg.edges
        count = len(dataset)  # type: ignore[arg-type]
        ids = [dataset[i][2] for i in range(count)]  # type: ignore[index]
        parts = split_pairs(ids, p.held_out, p.held_out_by, p.seed)
        found = [sum(parts[i] == DISCOVERY for i in ids[k : k + batch_size]) for k in range(0, count, batch_size)]
        tokens = max(int(dataset[i][0].shape[-1]) for i in range(count))  # type: ignore[index]
        slots = len(Slots.of(p.positions, pair_roles(dataset), "method.edges")) if p.per_position else 1
        shape = Shape(max(found, default=1), tokens, sum(1 for n in found if n), min(batch_size, count), slots)
        chunk = gradient_chunk_bytes(p, free)
        evaluates = bool(p.fractions) or bool(p.circuit)  # circuits (top_k's checks: the exact-edges phase)
        return edge_plan(skeleton, layout, p, shape, chunk, evaluates)

    def prepare(self, dataset: Dataset) -> None:
        super().prepare(dataset)
        ids = [dataset[i][2] for i in range(len(dataset))]  # type: ignore[arg-type]
        self.parts = split_pairs(ids, self.p.held_out, self.p.held_out_by, self.p.seed)
        if self.p.per_position:
            self.slots = Slots.of(self.p.positions, pair_roles(dataset), self.key)

    def setup(self, session: HookSession, num_samples: int) -> None:
        model = session.model
        self.layout = layout_of(model)
        self.target = self.planned(self.cfg, self.layout, self.runtime.target)
        self.graph = EdgeGraph.of(self.layout)
        self.hooks = EdgeRuns(model, self.layout, self.graph, session)
        self.corruption.setup(session, model, self.layout, interpolated=True)
        self.embed = dict(model.named_modules())[self.layout.arch.embed]
        self.width = getattr(getattr(model, "config", None), "hidden_size", None)  # d_model, for the export
        self.edge_index = self.graph.edges.nonzero()  # (E, 2) writer, reader: lm_edges' row order
        labels = None if self.slots is None else self.slots.labels
        self.columns = unit_columns(self.graph, self.edge_index, labels)  # per unit: edge, or (edge, slot)
        self.path_masks = path_masks(self.p, self.graph)  # (paths, writers, readers)
        log.info("lm_edges: %d edges (%d writers, %d readers)", len(self.edge_index), len(self.graph.writers),
                 len(self.graph.readers))  # fmt: skip
        if self.slots is not None:
            units = len(self.edge_index) * len(self.slots)
            _check_sizes(self.p.circuit, units, f"this run has {units} units (edges x position slots)")
            log.info("lm_edges: per position, %d slots (%s): %d units", len(self.slots), ", ".join(self.slots.labels),
                     len(self.edge_index) * len(self.slots))  # fmt: skip

    @property
    def per_edge(self) -> int:
        """Units per edge: its position slots (per-position edges), else 1."""
        return 1 if self.slots is None else len(self.slots)

    def _positions(self, sample_ids: list[str], mask: torch.Tensor) -> torch.Tensor | None:
        """(B, T) each position's slot (per-position edges), else None."""
        return None if self.slots is None else self.slots.of_batch(sample_ids, mask)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        return self._evaluate(model, batch) if self.evaluating else self._score(model, batch)

    def begin_pass(self, number: int, read: Callable[[str], pd.DataFrame | None]) -> None:
        """Before the evaluation: the run's scores read back, ranked once; its circuits and checked edges chosen."""
        self.evaluating = True
        self.run = RunScores.read(read, self.p, self.graph, self.edge_index, self.per_edge)
        log.info("lm_edges: the run's ranking from %d discovery pairs; circuits of %s edges evaluated on every pair",
                 self.run.pairs, ", ".join(map(str, self.run.sizes)) or "no")  # fmt: skip

    def final_tables(self, read: Callable[[str], pd.DataFrame | None]) -> dict[str, Columns]:
        assert self.run is not None
        self.tables = final_tables(self.run, read, self.p, self.columns, self.steps, target_name(self.target))
        return self.tables

    def finish(self, out: Path) -> None:
        """The run's edge scores in the graph file the EAP-IG code and the MIB circuit track read (export.py)."""
        edges = getattr(self, "tables", {}).get("lm_edges")
        if edges is not None and self.slots is not None:
            log.info("lm_edges: per-position edges are not exported to the EAP-IG graph file (it has no positions)")
        elif edges is not None:
            names = ("edge", "upstream", "downstream", "input", "downstream_layer", "downstream_head", "score")
            frame = pd.DataFrame({k: edges[k] for k in names})
            layout = self.layout
            write_eap_ig_graph(out / "lm_edges.eap_ig.json", frame, layout.layers, layout.heads, layout.kv_heads,
                               self.width or 0, self.graph.parallel)  # fmt: skip

    # -- pass 1: scoring -------------------------------------------------------------------------------------------
    def _score(self, model: nn.Module, whole: Batch) -> BatchOutput:
        """The batch's discovery pairs scored: their rows of lm_edge_pair_scores (and lm_edge_pairs)."""
        index = [i for i, s in enumerate(whole.sample_ids) if self.parts.get(s, DISCOVERY) == DISCOVERY]
        predicted = torch.full((whole.x.shape[0],), -1, dtype=torch.long, device=whole.x.device)
        if not index:
            return BatchOutput(predicted=predicted, tables={})
        batch = _pairs_of(whole, index)
        prompts, corrupted, clean_logits, clean_sites = self._clean_run(model, batch)
        clean_ids, mask = prompts.clean, prompts.mask
        kept: dict[str, torch.Tensor] = {}  # the corrupted run's views
        corrupted_logits: list[torch.Tensor] = []
        positions = self._positions(batch.sample_ids, mask)
        # every edge's score summed as the readers' gradients come, a chunk of layers at a time
        scores = ScoreSum(lambda: writes(self.graph, self.hooks.head_writes, clean_sites, kept, mask, positions is not None),
                          len(self.graph.readers), positions, self.per_edge)  # fmt: skip
        exact = self.p.mode is EdgeMode.exact
        runs = 0  # the gradient runs the scores sum (exact: none)
        if exact:
            kept, logits = self._corrupted_run(model, corrupted, mask)
            corrupted_logits.append(logits)
        else:
            runs = self._gradients(model, prompts, corrupted, clean_ids, clean_logits, kept, corrupted_logits, scores)
        metrics = self._metrics(prompts, corrupted, clean_logits, corrupted_logits[0], batch.sample_ids)
        deltas = scores.writes  # (writers, B, T, D)
        if exact:
            run = _Receiving(corrupted.ids, corrupted.edit, mask, kept, metrics)
            per_edge = self._exact(model, run, range(len(self.columns["edge"])), deltas, positions)
        else:
            per_edge = scores.per_edge(self.edge_index.to(deltas.device), 1.0 / runs)
        del scores
        per_edge = per_edge.float().cpu()  # (E, B)
        tables = {"lm_edge_pair_scores": self._pair_scores(per_edge, metrics, index, clean_sites, mask)}
        if len(self.path_masks):
            run = _Receiving(corrupted.ids, corrupted.edit, mask, kept, metrics)
            tables["lm_paths"] = self._paths(model, run, deltas, index)
        if self.p.per_pair:
            tables["lm_edge_pairs"] = self._pair_rows(per_edge, metrics, index)
        kept.clear()
        self.hooks.clear()
        predicted[index] = clean_logits.argmax(dim=1).to(predicted.device)
        return BatchOutput(predicted=predicted, tables=tables)

    def _clean_run(self, model: nn.Module, batch: Batch) -> tuple[TokenPairs, Corrupted, torch.Tensor,
                                                                    dict[str, torch.Tensor]]:  # fmt: skip
        """The batch's prompts and their corruption, and the clean run traced without gradients: its last logits and
        views."""
        prompts = self.prompts(batch)
        corrupted = self.corruption.corrupt(batch, prompts.clean, prompts.corrupted, prompts.mask)
        with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
            clean_logits = forward_last(model, prompts.clean, prompts.mask).logits[:, -1].float()
        return prompts, corrupted, clean_logits, self.hooks.kept

    def _metrics(
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

    def _corrupted_run(self, model: nn.Module, corrupted: Corrupted, mask: torch.Tensor) -> tuple[dict[str, torch.Tensor],
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

    def _common(self, rows: int) -> dict[str, list[Any]]:
        return {"mode": [self.p.mode.value] * rows, "metric": [target_name(self.target)] * rows}

    def _pair_scores(
        self, per_edge: torch.Tensor, metrics: PairMetrics, index: list[int], clean: dict[str, torch.Tensor],
        mask: torch.Tensor,
    ) -> Columns:  # fmt: skip
        """lm_edge_pair_scores: per pair its scores (E,), its metrics and flags (and its writers' sums for means)."""
        e, b = per_edge.shape
        out: Columns = {
            "sample_index": index, **self._common(b), "steps": [self.steps] * b,
            "clean": metrics.clean.float().cpu(), "corrupted": metrics.corrupted.float().cpu(),
            "degenerate": [r is not None for r in metrics.reasons], "small_span": list(metrics.small),
            "scores": Ragged(per_edge.T.contiguous().reshape(-1), [e] * b),
        }  # fmt: skip
        if self.p.ablation is EdgeAblation.mean:
            real = mask[:, :, None].float()
            sums = [(clean[name].flatten(2).float() * real).sum(1) for name in self.graph.writer_sites()]
            flat = torch.cat(sums, dim=1).cpu()  # (B, writer widths)
            out["writer_sums"] = Ragged(flat.reshape(-1), [flat.shape[1]] * b)
            out["positions"] = mask.sum(1).cpu()
        return out

    def _pair_rows(self, per_edge: torch.Tensor, metrics: PairMetrics, index: list[int]) -> Columns:
        """lm_edge_pairs: per (edge, pair) its score."""
        e, b = per_edge.shape
        pair = np.tile(np.arange(b), e)
        edge = np.repeat(np.arange(e), b)
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        out: Columns = {"sample_index": [index[i] for i in pair]}
        out.update({k: [v[i] for i in edge] for k, v in self.columns.items()})
        out.update({
            **self._common(e * b), "score": per_edge.reshape(-1), "clean": clean[pair], "corrupted": corrupted[pair],
            "degenerate": [metrics.reasons[i] is not None for i in pair], "small_span": [metrics.small[i] for i in pair],
        })  # fmt: skip
        return out

    def _gradients(
        self, model: nn.Module, prompts: Any, corrupted: Any, clean_ids: torch.Tensor, clean_logits: torch.Tensor,
        kept: dict[str, torch.Tensor], corrupted_logits: list[torch.Tensor], scores: ScoreSum,
    ) -> int:  # fmt: skip
        """The readers' gradients into `scores` (eap: at the corrupted run; eap_ig: of `steps` runs;
        clean_corrupted, eap_ig_activations: estimators.py), and how many runs they sum (the scores are their mean);
        the corrupted run's views and logits go to `kept` and `corrupted_logits` before any gradient does."""
        chunk = self._chunk_bytes(prompts.mask)
        if self.p.mode in ESTIMATORS:
            runs = Runs(model, self.hooks, self.corruption, self.runtime.autocast, self.graph, prompts.mask,
                        lambda logits: score(self.target, logits, prompts.answers, prompts.distractors, clean_logits),
                        scores.add, kept, corrupted_logits, chunk)  # fmt: skip
            return ESTIMATORS[self.p.mode](runs, clean_ids, corrupted, self.p.steps)
        with torch.no_grad():
            # the embedding outputs the interpolation runs between (the edit hook sits on this module)
            clean_embedding = self.embed(clean_ids)

        def run(alpha: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            """The corrupted prompt, its embeddings moved alpha of the way to the clean ones, traced."""
            self.corruption.active = _toward(corrupted.edit, clean_embedding, alpha, corrupted.ids.shape)
            try:
                with torch.enable_grad(), self.runtime.autocast(), self.hooks.keep(grad=True):
                    logits = forward_last(model, corrupted.ids, prompts.mask).logits[:, -1].float()
            finally:
                self.corruption.active = None
            views = self.hooks.kept
            self.hooks.kept = {}
            within_batch(0.5 * alpha, f"lm_edges: gradient run {round(alpha * self.steps) + 1}/{self.steps}")
            if alpha == 0:  # the corrupted run itself: its writes and its metric
                kept.update({name: view.detach() for name, view in views.items()})
                corrupted_logits.append(logits.detach())
            return views, score(self.target, logits, prompts.answers, prompts.distractors, clean_logits)

        integrated(self.steps, run, self.graph, scores.add, chunk)
        return self.steps

    def _chunk_bytes(self, mask: torch.Tensor) -> int | None:
        """The readers' gradients held at once on `mask`'s device (gradient_chunk_bytes)."""
        free = None if self.p.gradient_memory is not None else available_bytes(mask.device)
        return gradient_chunk_bytes(self.p, free)

    @property
    def steps(self) -> int:
        """The runs a score reads: eap_ig's steps, (1 + 2 layers) x steps for eap_ig_activations, 2 for
        clean_corrupted, 1 for eap and exact."""
        mode = self.p.mode
        if mode is EdgeMode.eap_ig_activations:
            return (1 + 2 * self.graph.layers) * self.p.steps
        return {EdgeMode.eap_ig: self.p.steps, EdgeMode.clean_corrupted: 2}.get(mode, 1)

    # -- pass 2: evaluation ----------------------------------------------------------------------------------------
    def _evaluate(self, model: nn.Module, batch: Batch) -> BatchOutput:
        """Every pair of the batch: the run's circuits (lm_circuit); the discovery pairs: the checked edges' exact
        effects (lm_edge_exact)."""
        assert self.run is not None
        tables: dict[str, Columns] = {}
        if not self.run.sizes and not self.run.checked:  # nothing to evaluate (no circuit asked for, no top_k)
            return BatchOutput(predicted=torch.full((batch.x.shape[0],), -1, device=batch.x.device), tables=tables)
        runs = self._runs(model, batch)
        splits = [self.parts.get(s, DISCOVERY) for s in batch.sample_ids]
        if self.run.sizes:
            ablated = runs.kept if self.p.ablation is EdgeAblation.corrupted else self.run.means_like(runs.clean_sites)
            positions = self._positions(batch.sample_ids, runs.mask)
            tables["lm_circuit"] = self._circuit(model, runs.clean_ids, runs.mask, ablated, runs.metrics, splits,
                                                 positions)  # fmt: skip
        predicted = runs.clean_logits.argmax(dim=1)
        index = [i for i, part in enumerate(splits) if part == DISCOVERY]
        if len(self.run.checked) and index:
            discovery = _pairs_of(batch, index)
            if len(index) < len(splits):  # the held-out pairs have no estimate to check: not patched
                runs = self._runs(model, discovery)
            deltas = writes(self.graph, self.hooks.head_writes, runs.clean_sites, runs.kept, runs.mask)
            receiving = _Receiving(runs.corrupted.ids, runs.corrupted.edit, runs.mask, runs.kept, runs.metrics)
            positions = self._positions(discovery.sample_ids, runs.mask)
            exact = self._exact(model, receiving, self.run.checked, deltas, positions).float().cpu()  # (checked, pairs)
            tables["lm_edge_exact"] = self._exact_rows(exact, runs.metrics, index, [batch.sample_ids[i] for i in index])
        self.hooks.clear()
        return BatchOutput(predicted=predicted, tables=tables)

    def _runs(self, model: nn.Module, batch: Batch) -> _Runs:
        """The batch's clean and corrupted runs, traced, and its pairs' metrics."""
        prompts, corrupted, clean_logits, clean_sites = self._clean_run(model, batch)
        clean_ids, mask = prompts.clean, prompts.mask
        kept, corrupted_logits = self._corrupted_run(model, corrupted, mask)
        metrics = self._metrics(prompts, corrupted, clean_logits, corrupted_logits, batch.sample_ids)
        return _Runs(clean_ids, mask, corrupted, clean_logits, clean_sites, kept, metrics)

    @staticmethod
    def _variants(pairs: int, copies: int) -> int:
        """Variants per intervention forward: rows (variants x copies x pairs) near ROWS_PER_FORWARD, at least one."""
        return max(1, ROWS_PER_FORWARD // (copies * pairs))

    def _intervened(self, model: nn.Module, deltas: Deltas, run: _Receiving) -> torch.Tensor:
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

    def _exact(
        self, model: nn.Module, run: _Receiving, units: Sequence[int], deltas: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """(len(units), B) each unit's exact effect: the corrupted run with the edge's reader reading + the writer's
        clean - corrupted write (per-position edges: at the unit's slot's positions, `positions` (B, T) the slots),
        minus the corrupted run's metric."""
        step = self._variants(run.ids.shape[0], Patched.COPIES)
        out = []
        for i in range(0, len(units), step):
            within_batch(0.5 + 0.3 * i / len(units), f"lm_edges: exact edges {i}/{len(units)}")
            chosen = torch.as_tensor(list(units[i : i + step]), dtype=torch.long)
            edges = [tuple(e) for e in self.edge_index[chosen // self.per_edge].tolist()]
            where = None if positions is None else positions[None] == (chosen % self.per_edge)[:, None, None].to(
                positions.device)  # fmt: skip  # (V, B, T)
            patched = Patched(edges, deltas, self.graph, where)
            out.append(self._intervened(model, patched, run) - run.metrics.corrupted[None].to(deltas.device))
        return torch.cat(out)

    def _paths(self, model: nn.Module, run: _Receiving, deltas: torch.Tensor, index: list[int]) -> Columns:
        """lm_paths: per (path set, pair) the corrupted run with each receiver reading + the clean - corrupted write
        of each of its senders, and that run's metric; `index`: the pairs' rows in the batch."""
        masks = self.path_masks.to(deltas.device)
        step = self._variants(run.ids.shape[0], self.hooks.paths(masks, deltas).copies)
        patched = torch.cat([
            self._intervened(model, self.hooks.paths(masks[i : i + step], deltas), run)
            for i in range(0, len(masks), step)
        ]).float().cpu()  # fmt: skip  # (P, B)
        metrics, b, n = run.metrics, run.ids.shape[0], len(masks)
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        restoration = metrics.restoration(patched).float().cpu()
        described = [_path_words(p, mask, self.graph) for p, mask in zip(self.p.paths, self.path_masks, strict=True)]
        return {
            "sample_index": index * n,
            "path": [d[0] for d in described for _ in range(b)],
            "senders": [d[1] for d in described for _ in range(b)],
            "receivers": [d[2] for d in described for _ in range(b)],
            "edges_patched": [int(mask.sum()) for mask in self.path_masks for _ in range(b)],
            "metric": [target_name(self.target)] * (n * b),
            "clean": clean.repeat(n),
            "corrupted": corrupted.repeat(n),
            "patched": patched.reshape(-1),
            "effect": (patched - corrupted[None]).reshape(-1),
            "restoration": restoration.reshape(-1),
            "degenerate": [metrics.reasons[i] is not None for i in range(b)] * n,
            "small_span": [metrics.small[i] for i in range(b)] * n,
        }

    def _circuit(
        self, model: nn.Module, clean_ids: torch.Tensor, mask: torch.Tensor, ablated: dict[str, torch.Tensor],
        metrics: PairMetrics, splits: list[str], positions: torch.Tensor | None,
    ) -> Columns:  # fmt: skip
        """Per (size, pair): the clean run with every edge outside the run's circuit of that size given the value of
        its writer in `ablated` (the corrupted run's views, or the discovery pairs' means), its metric, and the
        faithfulness (metric - empty) / (clean - empty), empty: the circuit of no edge. Per-position edges: circuits
        of units, `positions` (B, T) each position's slot."""
        assert self.run is not None
        sizes, total = self.run.sizes, len(self.columns["edge"])
        b, n = clean_ids.shape[0], len(sizes)
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        # Circuits whose metric is known without a forward: every edge kept is the clean run, none kept (every edge
        # corrupted) the corrupted run (tests/test_lm_edges.py measures both with MEASURE_KNOWN_CIRCUITS)
        known = {} if MEASURE_KNOWN_CIRCUITS else {total: clean}
        if not MEASURE_KNOWN_CIRCUITS and self.p.ablation is EdgeAblation.corrupted:
            known[0] = corrupted
        run = _Receiving(clean_ids, None, mask, ablated, metrics)
        step = self._variants(b, self.hooks.circuit_copies)
        device = clean_ids.device
        rows = [i for i, size in enumerate(sizes) if size not in known]
        found: dict[int, torch.Tensor] = {}
        for at in range(0, len(rows), step):
            within_batch(0.2 + 0.6 * at / len(rows), f"lm_edges: circuits {at}/{len(rows)}")
            chosen = rows[at : at + step]
            masks = self.run.circuit_masks(chosen).to(device)
            measured = self._intervened(model, self.hooks.circuit(masks, positions), run).float().cpu()  # (chosen, B)
            found.update(zip(chosen, measured, strict=True))
        measured = torch.stack([known[s] if s in known else found[i] for i, s in enumerate(sizes)])  # (sizes, B)
        empty = measured[sizes.index(0)]  # (B,) m(empty), measured: sizes always hold 0
        flagged = metrics.undefined.cpu()
        span = clean - empty
        faithful = torch.where(flagged | (span == 0), torch.nan, (measured - empty) / span)  # (sizes, B)
        return {
            "sample_index": list(range(b)) * n,
            "edges": [size for size in sizes for _ in range(b)],
            "fraction": [size / total for size in sizes for _ in range(b)],
            "total_edges": [total] * (n * b),
            "scored_by": [self.p.mode.value] * (n * b),
            "ablation": [self.p.ablation.value] * (n * b),
            "ranking": [self.p.ranking.value] * (n * b),
            "split": splits * n,
            "metric": [target_name(self.target)] * (n * b),
            "circuit_metric": measured.reshape(-1),
            "empty_metric": empty.repeat(n),
            "clean": clean.repeat(n),
            "corrupted": corrupted.repeat(n),
            "faithfulness": faithful.reshape(-1),
            "degenerate": [metrics.reasons[i] is not None for i in range(b)] * n,
            "small_span": [metrics.small[i] for i in range(b)] * n,
        }

    def _exact_rows(self, exact: torch.Tensor, metrics: PairMetrics, index: list[int], ids: list[str]) -> Columns:
        """lm_edge_exact: per (checked edge, discovery pair) its exact effect and the pair's estimate; `index`: the
        pairs' rows in the batch, `ids` their ids."""
        assert self.run is not None
        run = self.run
        pairs, checked = len(ids), len(run.checked)
        edges = np.repeat(np.asarray(run.checked), pairs)
        pair = np.tile(np.arange(pairs), checked)
        out: Columns = {"sample_index": [index[i] for i in pair]}
        out.update({key: [self.columns[key][e] for e in edges] for key in naming_keys(self.columns)})
        out.update({
            "chosen": np.repeat(run.chosen, pairs).tolist(), "rank": run.rank[edges],
            "estimate": [run.estimate(ids[i], e) for e, i in zip(edges.tolist(), pair.tolist(), strict=True)],
            "exact": exact.reshape(-1), **self._common(checked * pairs),
            "degenerate": [metrics.reasons[i] is not None for i in pair], "small_span": [metrics.small[i] for i in pair],
        })  # fmt: skip
        return typed("lm_edge_exact", out)


@dataclass
class _Runs:
    """A batch's clean and corrupted runs: prompts, the corruption, the clean logits, both runs' views, metrics."""

    clean_ids: torch.Tensor
    mask: torch.Tensor
    corrupted: Corrupted  # its ids and embedding edit
    clean_logits: torch.Tensor
    clean_sites: dict[str, torch.Tensor]
    kept: dict[str, torch.Tensor]  # the corrupted run's views
    metrics: PairMetrics


@dataclass
class _Receiving:
    """The run an intervention forward measures from: its prompts, edit, mask, the corrupted run's views, the pairs'
    metrics."""

    ids: torch.Tensor
    edit: EmbeddingEdit | None
    mask: torch.Tensor
    kept: dict[str, torch.Tensor]
    metrics: PairMetrics


def gradient_chunk_bytes(p: LmEdgesConfig, free: int | None) -> int | None:
    """The readers' gradients held at once (bytes), in the run and in its plan: method.edges.gradient_memory GiB,
    else a quarter of the device's `free` bytes (at least one layer's readers are held; None: unknown, every layer
    at once)."""
    if p.gradient_memory is not None:
        return int(p.gradient_memory * 2**30)
    return None if free is None else free // 4


def _pairs_of(batch: Batch, index: list[int]) -> Batch:
    """The pairs `index` of a batch as a batch of their own (still padded to the batch's longest: a left-padded pair
    computes as it would alone)."""
    if index == list(range(batch.x.shape[0])):
        return batch
    rows = torch.as_tensor(index, device=batch.x.device)
    extras = None if batch.extras is None else {k: v[rows] for k, v in batch.extras.items()}
    masks = None if batch.masks is None else batch.masks[rows]
    return Batch(batch.x[rows], batch.labels[rows], [batch.sample_ids[i] for i in index], batch.first_index, masks,
                 extras)  # fmt: skip


def _toward(

    edit: EmbeddingEdit | None, clean: torch.Tensor, alpha: float, shape: torch.Size
) -> EmbeddingEdit | None:  # fmt: skip
    """The edit that makes the corrupted run's embedding output E_c (edited by `edit`: E_c * s + t) into
    (1 - alpha) (E_c * s + t) + alpha * clean; `edit` itself at alpha = 0."""
    if alpha == 0:
        return edit
    b, t = shape
    scale = torch.ones(b, t, 1, device=clean.device) if edit is None else edit.scale.to(clean.device)
    shift = torch.zeros_like(clean) if edit is None else edit.shift.to(clean.device, clean.dtype)
    return EmbeddingEdit(scale * (1 - alpha), shift * (1 - alpha) + clean * alpha)


def _check_sizes(circuit: list[int], total: int, has: str) -> None:
    """Refused: a circuit size (method.edges.circuit) larger than the run's `total` edges (or units); `has` says
    what the run has."""
    larger = [n for n in circuit if n > total]
    if larger:
        raise RunnerError(
            f"method.edges.circuit={list(circuit)}: {has}, so a circuit of"
            f" {', '.join(map(str, larger))} cannot be chosen. Give sizes up to {total}, or fractions"
            " (method.edges.fractions)."
        )


def path_masks(p: LmEdgesConfig, graph: EdgeGraph) -> torch.Tensor:
    """(paths, writers, readers) bool: each of method.edges.paths' edges (graph.py `path_mask`)."""
    masks = [
        graph.path_mask(path.senders, path.receivers, f"method.edges.paths[{i}]") for i, path in enumerate(p.paths)
    ]
    return torch.stack(masks) if masks else torch.zeros((0, len(graph.writers), len(graph.readers)), dtype=torch.bool)


def _path_words(path: EdgePaths, mask: torch.Tensor, graph: EdgeGraph) -> tuple[str, str, str]:
    """(name, senders, receivers) of a path set: the nodes its edges join, in model order."""
    senders = " ".join(graph.writers[i].name for i in mask.any(1).nonzero().flatten().tolist())
    receivers = " ".join(graph.readers[i].name for i in mask.any(0).nonzero().flatten().tolist())
    return path.name or f"{senders} -> {receivers}", senders, receivers
