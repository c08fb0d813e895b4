"""lm_edges' second pass: from the run's ranking (run_scores.py, made once from every discovery pair's scores), its
circuits evaluated on every pair of both parts (lm_circuit) and the checked edges (top_k's and as many random) patched
exactly on the discovery pairs (lm_edge_exact)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runner.data.base import Batch
from runner.methods.lm.pairs import PairMetrics
from runner.methods.lm_edges.pair_runs import PairRuns, Receiving, pairs_of
from runner.methods.lm_edges.rows import naming_keys, typed
from runner.methods.lm_edges.run_scores import RunScores, joined
from runner.methods.lm_edges.scores import writes
from runner.methods.lm_edges.split import DISCOVERY
from runner.options.method.lm_edges import EdgeAblation
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns
from runner.targets.tokens import target_name

# Whether the circuits whose metric is known (every edge: the clean run; none, corrupted ablation: the corrupted run)
# are measured all the same (the tests that check the interventions against those identities set it)
MEASURE_KNOWN_CIRCUITS = False


class Evaluation:
    """The evaluation pass of a run (`batch` per batch): `pairs` what it runs on, `run` the run's scores and ranking
    (with ranking=both, the circuits of each ranking are evaluated: `ranked`; `run` is the primary, absolute one),
    `parts` each pair id's part (discovery | held_out)."""

    def __init__(self, pairs: PairRuns, run: RunScores, parts: dict[str, str]) -> None:
        self.pairs, self.p, self.parts = pairs, pairs.p, parts
        self.ranked = run.rankings()
        self.run = self.ranked[-1]

    def batch(self, model: nn.Module, batch: Batch) -> BatchOutput:
        """Every pair of the batch: the run's circuits (lm_circuit); the discovery pairs: the checked edges' exact
        effects (lm_edge_exact)."""
        tables: dict[str, Columns] = {}
        if not self.run.sizes and not self.run.checked:  # nothing to evaluate (no circuit asked for, no top_k)
            return BatchOutput(predicted=torch.full((batch.x.shape[0],), -1, device=batch.x.device), tables=tables)
        runs = self.pairs.runs(model, batch)
        splits = [self.parts.get(s, DISCOVERY) for s in batch.sample_ids]
        if self.run.sizes:
            ablated = runs.kept if self.p.ablation is EdgeAblation.corrupted else self.run.means_like(runs.clean_sites)
            positions = self.pairs.positions(batch.sample_ids, runs.mask)
            tables["lm_circuit"] = joined([
                self._circuit(ranked, model, runs.clean_ids, runs.mask, ablated, runs.metrics, splits, positions)
                for ranked in self.ranked
            ])  # fmt: skip
        predicted = runs.clean_logits.argmax(dim=1)
        index = [i for i, part in enumerate(splits) if part == DISCOVERY]
        if len(self.run.checked) and index:
            discovery = pairs_of(batch, index)
            if len(index) < len(splits):  # the held-out pairs have no estimate to check: not patched
                runs = self.pairs.runs(model, discovery)
            deltas = writes(self.pairs.graph, self.pairs.hooks.head_writes, runs.clean_sites, runs.kept, runs.mask)
            receiving = Receiving(runs.corrupted.ids, runs.corrupted.edit, runs.mask, runs.kept, runs.metrics)
            positions = self.pairs.positions(discovery.sample_ids, runs.mask)
            exact = self.pairs.exact(model, receiving, self.run.checked, deltas, positions)  # (checked, pairs)
            exact = exact.float().cpu()
            tables["lm_edge_exact"] = self._exact_rows(exact, runs.metrics, index, [batch.sample_ids[i] for i in index])
        self.pairs.hooks.clear()
        return BatchOutput(predicted=predicted, tables=tables)

    def _circuit(
        self, ranked: RunScores, model: nn.Module, clean_ids: torch.Tensor, mask: torch.Tensor,
        ablated: dict[str, torch.Tensor], metrics: PairMetrics, splits: list[str], positions: torch.Tensor | None,
    ) -> Columns:  # fmt: skip
        """Per (size, pair): the clean run with every edge outside `ranked`'s circuit of that size given the value of
        its writer in `ablated` (the corrupted run's views, or the discovery pairs' means), its metric, and the
        faithfulness (metric - empty) / (clean - empty), empty: the circuit of no edge. Per-position edges: circuits
        of units, `positions` (B, T) each position's slot."""
        sizes, total = ranked.sizes, len(self.pairs.columns["edge"])
        b, n = clean_ids.shape[0], len(sizes)
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        # Circuits whose metric is known without a forward: every edge kept is the clean run, none kept (every edge
        # corrupted) the corrupted run (tests/test_lm_edges.py measures both with MEASURE_KNOWN_CIRCUITS)
        known = {} if MEASURE_KNOWN_CIRCUITS else {total: clean}
        if not MEASURE_KNOWN_CIRCUITS and self.p.ablation is EdgeAblation.corrupted:
            known[0] = corrupted
        run = Receiving(clean_ids, None, mask, ablated, metrics)
        step = self.pairs.variants(b, self.pairs.hooks.circuit_copies)
        device = clean_ids.device
        rows = [i for i, size in enumerate(sizes) if size not in known]
        found: dict[int, torch.Tensor] = {}
        for at in range(0, len(rows), step):
            within_batch(0.2 + 0.6 * at / len(rows), f"lm_edges: circuits {at}/{len(rows)}")
            chosen = rows[at : at + step]
            masks = ranked.circuit_masks(chosen).to(device)
            deltas = self.pairs.hooks.circuit(masks, positions)
            measured = self.pairs.intervened(model, deltas, run).float().cpu()  # (chosen, B)
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
            "ranking": [ranked.p.ranking.value] * (n * b),
            "split": splits * n,
            "metric": [target_name(self.pairs.target)] * (n * b),
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
        run = self.run
        pairs, checked = len(ids), len(run.checked)
        edges = np.repeat(np.asarray(run.checked), pairs)
        pair = np.tile(np.arange(pairs), checked)
        out: Columns = {"sample_index": [index[i] for i in pair]}
        out.update({key: [self.pairs.columns[key][e] for e in edges] for key in naming_keys(self.pairs.columns)})
        out.update({
            "chosen": np.repeat(run.chosen, pairs).tolist(), "rank": run.rank[edges],
            "estimate": [run.estimate(ids[i], e) for e, i in zip(edges.tolist(), pair.tolist(), strict=True)],
            "exact": exact.reshape(-1), **self.pairs.common(checked * pairs),
            "degenerate": [metrics.reasons[i] is not None for i in pair], "small_span": [metrics.small[i] for i in pair],
        })  # fmt: skip
        return typed("lm_edge_exact", out)
