"""`method=lm_edges`: every edge of a causal LM's graph scored on the run's discovery pairs (EAP, EAP-IG, ...:
scores.py), one ranking for the whole run, and its circuits evaluated on every pair (intervene.py).

Two passes over the data (runner/methods/base.py `passes`), each written shard by shard and resumed as any run;
this class is the adapter that runs them:
  1. scoring (scoring.py): each discovery pair's score of every edge by the mode's estimator (estimators.py) (table
     lm_edge_pair_scores: the scores are a result, and a resumed run reads them back rather than scoring again);
  2. evaluation (evaluation.py): from the scores of every discovery pair read back (`begin_pass`), the edges are
     ranked once for the run, and its circuits (the top edges at each size) are evaluated on every pair of both
     parts (lm_circuit), the top_k edges patched exactly (lm_edge_exact).
Both run their pairs through pair_runs.py (the clean and corrupted runs, the metrics, intervention forwards).
Then the tables about the whole run (run_scores.py): lm_edges, the faithfulness curve with its areas, the bootstrap
stability of the circuits, the estimate's calibration. The ranking, and with it every circuit and curve, depends on the
pairs and the seed, not on the batch size or the order of the pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.lm.base import CorruptedPairsMethod
from runner.methods.lm_edges.evaluation import Evaluation
from runner.methods.lm_edges.export import write_eap_ig_graph
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.intervene import EdgeRuns
from runner.methods.lm_edges.pair_runs import PairRuns
from runner.methods.lm_edges.plan import EdgePlan, Shape, edge_plan
from runner.methods.lm_edges.positions import Slots, pair_roles
from runner.methods.lm_edges.rows import unit_columns
from runner.methods.lm_edges.run_scores import RunScores, final_tables
from runner.methods.lm_edges.scoring import Scoring, gradient_chunk_bytes, path_masks
from runner.methods.lm_edges.split import DISCOVERY, split_pairs
from runner.models.lm_sites import LanguageModelLayout, layout_of
from runner.options.method.lm_edges import LmEdgesMethodConfig
from runner.rows import BatchOutput, Columns
from runner.runtime import Runtime
from runner.targets.tokens import TokenTarget, target_name, token_target

log = logging.getLogger(__name__)


class LmEdges(CorruptedPairsMethod):
    name = "lm_edges"
    table = "lm_edges"
    summary_values = ("score",)
    passes = 2  # scoring, then evaluation (module docstring)
    cfg: LmEdgesMethodConfig

    def __init__(self, cfg: LmEdgesMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        super().__init__(cfg, layers, runtime, cfg.edges, "method.edges")
        self.evaluation: Evaluation | None = None  # the second pass, once the run's scores are read back
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
        target = self.planned(self.cfg, self.layout, self.runtime.target)
        self.graph = graph = EdgeGraph.of(self.layout)
        hooks = EdgeRuns(model, self.layout, graph, session)
        self.corruption.setup(session, model, self.layout, interpolated=True)
        embed = dict(model.named_modules())[self.layout.arch.embed]
        self.width = getattr(getattr(model, "config", None), "hidden_size", None)  # d_model, for the export
        edge_index = graph.edges.nonzero()  # (E, 2) writer, reader: lm_edges' row order
        labels = None if self.slots is None else self.slots.labels
        self.columns = unit_columns(graph, edge_index, labels)  # per unit: edge, or (edge, slot)
        self.pairs = PairRuns(self.p, target, self.runtime, self.corruption, hooks, graph, edge_index, self.columns,
                              self.slots, self.prompts, self.warned, self.name, self.key)  # fmt: skip
        self.scoring = Scoring(self.pairs, self.parts, embed, path_masks(self.p, graph))
        self.evaluation = None  # made from the run's scores, read back (begin_pass)
        log.info("lm_edges: %d edges (%d writers, %d readers); scored by %s: the gradient at %s",
                 len(edge_index), len(graph.writers), len(graph.readers), self.p.mode.value,
                 self.scoring.estimator.gradient_point)  # fmt: skip
        if self.slots is not None:
            units = len(edge_index) * len(self.slots)
            _check_sizes(self.p.circuit, units, f"this run has {units} units (edges x position slots)")
            log.info("lm_edges: per position, %d slots (%s): %d units", len(self.slots), ", ".join(self.slots.labels),
                     units)  # fmt: skip

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        if self.evaluation is not None:
            return self.evaluation.batch(model, batch)
        return self.scoring.batch(model, batch)

    def begin_pass(self, number: int, read: Callable[[str], pd.DataFrame | None]) -> None:
        """Before the evaluation: the run's scores read back, ranked once; its circuits and checked edges chosen."""
        run = RunScores.read(read, self.p, self.graph, self.pairs.edge_index, self.pairs.per_edge)
        self.evaluation = Evaluation(self.pairs, run, self.parts)
        log.info("lm_edges: the run's ranking from %d discovery pairs; circuits of %s edges evaluated on every pair",
                 run.pairs, ", ".join(map(str, run.sizes)) or "no")  # fmt: skip

    def final_tables(self, read: Callable[[str], pd.DataFrame | None]) -> dict[str, Columns]:
        assert self.evaluation is not None
        runs, metric = self.evaluation.ranked, target_name(self.pairs.target)
        self.tables = final_tables(runs, read, self.p, self.columns, self.scoring.steps, metric)
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
