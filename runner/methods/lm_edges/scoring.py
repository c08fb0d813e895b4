"""lm_edges' first pass: each discovery pair's score of every edge (table lm_edge_pair_scores), by the mode's
estimator (estimators.py: the readers' gradients of its runs, scores.py: times the writers' clean - corrupted writes)
or, for mode exact, by patching every unit; the path-patching sets (lm_paths) and, with per_pair, a row per (edge,
pair) (lm_edge_pairs)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runner.data.base import Batch
from runner.methods.lm.base import TokenPairs
from runner.methods.lm.corruptions import Corrupted
from runner.methods.lm.pairs import PairMetrics, score
from runner.methods.lm_edges.estimators import ESTIMATORS, Runs
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.pair_runs import PairRuns, Receiving, pairs_of
from runner.methods.lm_edges.scores import ScoreSum, writes
from runner.methods.lm_edges.split import DISCOVERY
from runner.models.check import available_bytes
from runner.options.method.lm_edges import EdgeAblation, EdgePaths, LmEdgesConfig
from runner.rows import BatchOutput, Columns, Ragged
from runner.targets.tokens import target_name


class Scoring:
    """The scoring pass of a run (`batch` per batch): `pairs` what it runs on, `parts` each pair id's part
    (discovery | held_out: held-out pairs are not scored), `embed` the embeddings module, `path_masks` (paths,
    writers, readers) the path-patching sets' edges."""

    def __init__(
        self, pairs: PairRuns, parts: dict[str, str], embed: nn.Module, path_masks: torch.Tensor
    ) -> None:  # fmt: skip
        self.pairs, self.p, self.parts, self.embed, self.path_masks = pairs, pairs.p, parts, embed, path_masks
        self.estimator = ESTIMATORS[self.p.mode]

    @property
    def steps(self) -> int:
        """The runs a score reads (the estimator's: 1 for eap, eap_clean and exact, eap_ig's steps, ...)."""
        return self.estimator.runs(self.p.steps, self.pairs.graph.layers)

    def batch(self, model: nn.Module, whole: Batch) -> BatchOutput:
        """The batch's discovery pairs scored: their rows of lm_edge_pair_scores (and lm_edge_pairs)."""
        index = [i for i, s in enumerate(whole.sample_ids) if self.parts.get(s, DISCOVERY) == DISCOVERY]
        predicted = torch.full((whole.x.shape[0],), -1, dtype=torch.long, device=whole.x.device)
        if not index:
            return BatchOutput(predicted=predicted, tables={})
        pairs, batch = self.pairs, pairs_of(whole, index)
        prompts, corrupted, clean_logits, clean_sites = pairs.clean_run(model, batch)
        mask = prompts.mask
        kept: dict[str, torch.Tensor] = {}  # the corrupted run's views
        corrupted_logits: list[torch.Tensor] = []
        positions = pairs.positions(batch.sample_ids, mask)
        # every edge's score summed as the readers' gradients come, a chunk of layers at a time
        scores = ScoreSum(lambda: writes(pairs.graph, pairs.hooks.head_writes, clean_sites, kept, mask, positions is not None),
                          len(pairs.graph.readers), positions, pairs.per_edge)  # fmt: skip
        exact = not self.estimator.traced
        runs = 0  # the gradient runs the scores sum (exact: none)
        if exact:
            kept, logits = self.pairs.corrupted_run(model, corrupted, mask)
            corrupted_logits.append(logits)
        else:
            runs = self._gradients(model, prompts, corrupted, clean_logits, kept, corrupted_logits, scores)
        metrics = self.pairs.metrics(prompts, corrupted, clean_logits, corrupted_logits[0], batch.sample_ids)
        deltas = scores.writes  # (writers, B, T, D)
        if exact:
            run = Receiving(corrupted.ids, corrupted.edit, mask, kept, metrics)
            per_edge = self.pairs.exact(model, run, range(len(self.pairs.columns["edge"])), deltas, positions)
        else:
            per_edge = scores.per_edge(self.pairs.edge_index.to(deltas.device), 1.0 / runs)
        del scores
        per_edge = per_edge.float().cpu()  # (E, B)
        tables = {"lm_edge_pair_scores": self._pair_scores(per_edge, metrics, index, clean_sites, mask)}
        if len(self.path_masks):
            run = Receiving(corrupted.ids, corrupted.edit, mask, kept, metrics)
            tables["lm_paths"] = self._paths(model, run, deltas, index)
        if self.p.per_pair:
            tables["lm_edge_pairs"] = self._pair_rows(per_edge, metrics, index)
        kept.clear()
        self.pairs.hooks.clear()
        predicted[index] = clean_logits.argmax(dim=1).to(predicted.device)
        return BatchOutput(predicted=predicted, tables=tables)

    def _gradients(
        self, model: nn.Module, prompts: TokenPairs, corrupted: Corrupted, clean_logits: torch.Tensor,
        kept: dict[str, torch.Tensor], corrupted_logits: list[torch.Tensor], scores: ScoreSum,
    ) -> int:  # fmt: skip
        """The readers' gradients of the mode's runs (estimators.py) into `scores`, and how many runs they sum (the
        scores are their mean); the corrupted run's views and logits go to `kept` and `corrupted_logits` before any
        gradient does."""
        pairs = self.pairs
        runs = Runs(model, pairs.hooks, pairs.corruption, pairs.runtime.autocast, pairs.graph, prompts.mask,
                    lambda logits: score(pairs.target, logits, prompts.answers, prompts.distractors, clean_logits),
                    scores.add, kept, corrupted_logits, self._chunk_bytes(prompts.mask), self.embed)  # fmt: skip
        self.estimator.gradients(runs, prompts.clean, corrupted, self.p.steps)
        return self.steps

    def _pair_scores(
        self, per_edge: torch.Tensor, metrics: PairMetrics, index: list[int], clean: dict[str, torch.Tensor],
        mask: torch.Tensor,
    ) -> Columns:  # fmt: skip
        """lm_edge_pair_scores: per pair its scores (E,), its metrics and flags (and its writers' sums for means)."""
        e, b = per_edge.shape
        out: Columns = {
            "sample_index": index, **self.pairs.common(b), "steps": [self.steps] * b,
            "clean": metrics.clean.float().cpu(), "corrupted": metrics.corrupted.float().cpu(),
            "degenerate": [r is not None for r in metrics.reasons], "small_span": list(metrics.small),
            "scores": Ragged(per_edge.T.contiguous().reshape(-1), [e] * b),
        }  # fmt: skip
        if self.p.ablation is EdgeAblation.mean:
            real = mask[:, :, None].float()
            sums = [(clean[name].flatten(2).float() * real).sum(1) for name in self.pairs.graph.writer_sites()]
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
        out.update({k: [v[i] for i in edge] for k, v in self.pairs.columns.items()})
        out.update({
            **self.pairs.common(e * b), "score": per_edge.reshape(-1), "clean": clean[pair], "corrupted": corrupted[pair],
            "degenerate": [metrics.reasons[i] is not None for i in pair], "small_span": [metrics.small[i] for i in pair],
        })  # fmt: skip
        return out

    def _chunk_bytes(self, mask: torch.Tensor) -> int | None:
        """The readers' gradients held at once on `mask`'s device (gradient_chunk_bytes)."""
        free = None if self.p.gradient_memory is not None else available_bytes(mask.device)
        return gradient_chunk_bytes(self.p, free)

    def _paths(self, model: nn.Module, run: Receiving, deltas: torch.Tensor, index: list[int]) -> Columns:
        """lm_paths: per (path set, pair) the corrupted run with each receiver reading + the clean - corrupted write
        of each of its senders, and that run's metric; `index`: the pairs' rows in the batch."""
        masks = self.path_masks.to(deltas.device)
        step = self.pairs.variants(run.ids.shape[0], self.pairs.hooks.paths(masks, deltas).copies)
        patched = torch.cat([
            self.pairs.intervened(model, self.pairs.hooks.paths(masks[i : i + step], deltas), run)
            for i in range(0, len(masks), step)
        ]).float().cpu()  # fmt: skip  # (P, B)
        metrics, b, n = run.metrics, run.ids.shape[0], len(masks)
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        restoration = metrics.restoration(patched).float().cpu()
        described = [
            _path_words(p, mask, self.pairs.graph) for p, mask in zip(self.p.paths, self.path_masks, strict=True)
        ]
        return {
            "sample_index": index * n,
            "path": [d[0] for d in described for _ in range(b)],
            "senders": [d[1] for d in described for _ in range(b)],
            "receivers": [d[2] for d in described for _ in range(b)],
            "edges_patched": [int(mask.sum()) for mask in self.path_masks for _ in range(b)],
            "metric": [target_name(self.pairs.target)] * (n * b),
            "clean": clean.repeat(n),
            "corrupted": corrupted.repeat(n),
            "patched": patched.reshape(-1),
            "effect": (patched - corrupted[None]).reshape(-1),
            "restoration": restoration.reshape(-1),
            "degenerate": [metrics.reasons[i] is not None for i in range(b)] * n,
            "small_span": [metrics.small[i] for i in range(b)] * n,
        }


def gradient_chunk_bytes(p: LmEdgesConfig, free: int | None) -> int | None:
    """The readers' gradients held at once (bytes), in the run and in its plan: method.edges.gradient_memory GiB,
    else a quarter of the device's `free` bytes (at least one layer's readers are held; None: unknown, every layer
    at once)."""
    if p.gradient_memory is not None:
        return int(p.gradient_memory * 2**30)
    return None if free is None else free // 4


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
