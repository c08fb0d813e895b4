"""`method=lm_edges`: every edge of a causal LM's graph scored per pair (EAP or EAP-IG, scores.py), into the `lm_edges`
table: one row per (edge, batch) with the mean over the batch's pairs and its spread, or per (edge, pair)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.language_model import forward_last
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.intervene import Deltas, EdgeRuns, Patched
from runner.methods.lm_edges.scores import edge_scores, integrated, writes
from runner.methods.lm_patching.corruptions import EmbeddingEdit
from runner.methods.lm_patching.metric import PairMetrics, pair_metrics, score
from runner.methods.lm_patching.paired import CorruptedPairsMethod
from runner.models.lm_sites import LanguageModelLayout, layout_of
from runner.options.method.lm_edges import EdgeAblation, EdgeMode, LmEdgesMethodConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns
from runner.runtime import Runtime
from runner.tables import Presentation, declare
from runner.targets.tokens import TokenTarget, target_name, token_target

log = logging.getLogger(__name__)
# Rows (variants x copies x pairs) an intervention forward aims for (exact edges, circuits)
ROWS_PER_FORWARD = 256

LM_EDGES_SCHEMA = declare(
    "lm_edges",
    [
        pa.field("edge", pa.string()),  # upstream->downstream, e.g. a3.h1->a7.h2<q>, m2->logits, input->a0.g1<k>
        pa.field("upstream", pa.string()),  # input | a{layer}.h{head} | m{layer}
        pa.field("downstream", pa.string()),  # a{layer}.h{head}<q> | a{layer}.g{kv head}<k|v> | m{layer} | logits
        pa.field("input", pa.string()),  # what the downstream node reads with: q | k | v | mlp | logits
        pa.field("upstream_layer", pa.int64()),  # null for input
        pa.field("upstream_head", pa.int64()),  # null for input and MLPs
        pa.field("downstream_layer", pa.int64()),  # null for logits
        pa.field("downstream_head", pa.int64()),  # the head (q), the key-value head (k, v); null otherwise
        pa.field("mode", pa.string()),  # eap | eap_ig | exact
        pa.field("steps", pa.int64()),  # the gradient's runs (eap: 1)
        pa.field("metric", pa.string()),  # the run's target
        pa.field("score", pa.float32()),  # the edge's first-order effect on the metric (the batch's mean over pairs)
        pa.field("score_std", pa.float32()),  # the spread over the batch's pairs (NaN for a per-pair row or one pair)
        # the exact effect: the corrupted run with the edge's reader reading the writer's clean write, minus the
        # corrupted run's metric (mode=exact: = score; eap, eap_ig: the top_k edges', NaN for the others)
        pa.field("exact", pa.float32()),
        pa.field("pairs", pa.int64()),  # pairs behind the row (0: every pair of the batch flagged)
        pa.field("clean", pa.float32()),  # the clean and corrupted runs' metrics (means for a batch's row)
        pa.field("corrupted", pa.float32()),
        pa.field("degenerate", pa.bool_()),  # per-pair rows: as in lm_patching; a batch's row: no pair behind it
        pa.field("small_span", pa.bool_()),
    ],
    Presentation(
        keys=("mode", "input", "metric"),
        values=("score",),
        shown=("metric",),
        figures="runner.viz.circuit_plots:lm_edges_figures",
    ),
)
LM_CIRCUIT_SCHEMA = declare(
    "lm_circuit",
    [
        pa.field("edges", pa.int64()),  # the circuit's size: the batch's edges of largest |mean score| kept
        pa.field("total_edges", pa.int64()),
        pa.field("scored_by", pa.string()),  # the mode that ranked the edges: eap | eap_ig | exact
        pa.field("ablation", pa.string()),  # what the left-out edges carry: corrupted | mean
        pa.field("metric", pa.string()),
        # the clean run with every other edge given its ablated value (its corrupted one, or its writer's mean)
        pa.field("circuit_metric", pa.float32()),
        pa.field("clean", pa.float32()),
        pa.field("corrupted", pa.float32()),
        pa.field("faithfulness", pa.float32()),  # (circuit_metric - corrupted) / (clean - corrupted); NaN if flagged
        pa.field("degenerate", pa.bool_()),
        pa.field("small_span", pa.bool_()),
    ],
    Presentation(
        keys=("scored_by", "edges", "metric"),
        values=("faithfulness",),
        shown=("metric",),
        figures="runner.viz.circuit_plots:lm_circuit_figures",
    ),
)


class LmEdges(CorruptedPairsMethod):
    name = "lm_edges"
    table = "lm_edges"
    summary_values = ("score",)
    cfg: LmEdgesMethodConfig

    def __init__(self, cfg: LmEdgesMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        super().__init__(cfg, layers, runtime, cfg.edges, "method.edges")

    @classmethod
    def planned(cls, cfg: LmEdgesMethodConfig, layout: LanguageModelLayout, target: Any) -> TokenTarget:
        """The run's token target; refused: a target that scores no tokens, a family whose heads' writes are not
        linear in their outputs (a norm after the attention's output projection)."""
        scored = token_target(target, cls.name, per_position=True)
        if layout.arch.attn_branch:
            raise RunnerError(
                f"method=lm_edges scores each head's write into the residual stream, which {layout.arch.family}"
                f" passes through a norm ({layout.arch.attn_branch}) after the heads are summed: a head's write is not"
                " its own. Use method=lm_patching (sites head, q, k, v) for this family."
            )
        return scored

    def setup(self, session: HookSession, num_samples: int) -> None:
        model = session.model
        self.layout = layout_of(model)
        self.target = self.planned(self.cfg, self.layout, self.runtime.target)
        self.graph = EdgeGraph.of(self.layout)
        self.hooks = EdgeRuns(model, self.layout, self.graph, session)
        self.corruption.setup(session, model, self.layout, interpolated=True)
        self.embed = dict(model.named_modules())[self.layout.arch.embed]
        self.edge_index = self.graph.edges.nonzero()  # (E, 2) writer, reader
        self.columns = _edge_columns(self.graph, self.edge_index)
        log.info("lm_edges: %d edges (%d writers, %d readers)", len(self.edge_index), len(self.graph.writers),
                 len(self.graph.readers))  # fmt: skip

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        clean_ids, mask = prompts.clean, prompts.mask
        corrupted = self.corruption.corrupt(batch, clean_ids, prompts.corrupted, mask)
        with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
            clean_logits = forward_last(model, clean_ids, mask).logits[:, -1].float()
        clean_sites = self.hooks.kept
        kept: dict[str, torch.Tensor] = {}  # the corrupted run's views
        corrupted_logits: list[torch.Tensor] = []
        if self.p.mode is EdgeMode.exact:
            self.corruption.active = corrupted.edit
            try:
                with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
                    corrupted_logits.append(forward_last(model, corrupted.ids, mask).logits[:, -1].float())
            finally:
                self.corruption.active = None
            kept.update(self.hooks.kept)
            gradients = None
        else:
            gradients = self._gradients(model, prompts, corrupted, clean_ids, clean_logits, kept, corrupted_logits)
        metrics = pair_metrics(self.target, prompts, corrupted.ids, corrupted.edit, clean_logits,
                               corrupted_logits[0], batch.sample_ids, self.p.min_span, self.warned, self.name,
                               self.key, "the pair is left out of its batch's mean")  # fmt: skip
        deltas = writes(self.graph, self.layout, model, clean_sites, kept, mask)  # (writers, B, T, D)
        run = _Receiving(corrupted.ids, corrupted.edit, mask, kept, metrics)
        exact_mode = gradients is None
        if exact_mode:
            per_edge = self._exact(model, run, self.edge_index.tolist(), deltas)
        else:
            per_edge = edge_scores(deltas, gradients, self.graph.edges)[self.edge_index[:, 0], self.edge_index[:, 1]]
            del gradients
        per_edge = per_edge.float().cpu()  # (E, B)
        kept_pairs = ~metrics.undefined  # (B,) the pairs a batch's mean is over
        mean = per_edge[:, kept_pairs].mean(1) if bool(kept_pairs.any()) else per_edge.mean(1)  # the batch's ranking
        exact = torch.full_like(per_edge, float("nan"))
        if exact_mode:
            exact = per_edge
        elif self.p.top_k:
            top = mean.abs().argsort(descending=True)[: self.p.top_k]
            exact[top] = self._exact(model, run, self.edge_index[top].tolist(), deltas).float().cpu()
        tables = {self.table: self._rows(per_edge, exact, metrics)}
        if self.p.circuit:
            ablated = kept if self.p.ablation is EdgeAblation.corrupted else _means(clean_sites, mask)
            tables["lm_circuit"] = self._circuit(model, clean_ids, mask, ablated, metrics, mean)
        kept.clear()
        self.hooks.clear()
        return BatchOutput(predicted=clean_logits.argmax(dim=1), tables=tables)

    def _gradients(
        self, model: nn.Module, prompts: Any, corrupted: Any, clean_ids: torch.Tensor, clean_logits: torch.Tensor,
        kept: dict[str, torch.Tensor], corrupted_logits: list[torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        """(readers, B, T, D) the readers' gradients (eap: at the corrupted run; eap_ig: averaged over `steps` runs);
        the corrupted run's views and logits go to `kept` and `corrupted_logits`."""
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

        return integrated(self.steps, run, self.graph)

    @property
    def steps(self) -> int:
        """The runs a score reads: eap_ig's steps, 1 for eap and exact."""
        return self.p.steps if self.p.mode is EdgeMode.eap_ig else 1

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

    def _exact(self, model: nn.Module, run: _Receiving, edges: list[list[int]], deltas: torch.Tensor) -> torch.Tensor:
        """(len(edges), B) each edge's exact effect: the corrupted run with the edge's reader reading + the writer's
        clean - corrupted write, minus the corrupted run's metric."""
        step = self._variants(run.ids.shape[0], Patched.COPIES)
        out = []
        for i in range(0, len(edges), step):
            within_batch(0.5 + 0.3 * i / len(edges), f"lm_edges: exact edges {i}/{len(edges)}")
            patched = Patched([tuple(e) for e in edges[i : i + step]], deltas, self.graph)
            out.append(self._intervened(model, patched, run) - run.metrics.corrupted[None].to(deltas.device))
        return torch.cat(out)

    def _circuit(
        self, model: nn.Module, clean_ids: torch.Tensor, mask: torch.Tensor, ablated: dict[str, torch.Tensor],
        metrics: PairMetrics, mean: torch.Tensor,
    ) -> Columns:  # fmt: skip
        """Per (size, pair): the clean run with every edge but the batch's `n` of largest |mean score| given the value
        of its writer in `ablated` (the corrupted run's views, or their means), its metric and the faithfulness
        (metric - corrupted) / (clean - corrupted)."""
        sizes = [min(n, len(mean)) for n in self.p.circuit]
        order = mean.abs().argsort(descending=True)
        masks = torch.zeros(len(sizes), *self.graph.edges.shape, dtype=torch.bool)
        for i, n in enumerate(sizes):
            chosen = self.edge_index[order[:n]]
            masks[i, chosen[:, 0], chosen[:, 1]] = True
        run = _Receiving(clean_ids, None, mask, ablated, metrics)
        step = self._variants(clean_ids.shape[0], self.hooks.circuit_copies)
        device = clean_ids.device
        parts = []
        for i in range(0, len(sizes), step):
            within_batch(0.8 + 0.2 * i / len(sizes), f"lm_edges: circuits {i}/{len(sizes)}")
            parts.append(self._intervened(model, self.hooks.circuit(masks[i : i + step].to(device)), run))
        measured = torch.cat(parts).float().cpu()
        b = clean_ids.shape[0]
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        faithful = metrics.restoration(measured)  # (sizes, B): NaN for a flagged pair
        n = len(sizes)
        return {
            "sample_index": list(range(b)) * n,
            "edges": [size for size in sizes for _ in range(b)],
            "total_edges": [len(mean)] * (n * b),
            "scored_by": [self.p.mode.value] * (n * b),
            "ablation": [self.p.ablation.value] * (n * b),
            "metric": [target_name(self.target)] * (n * b),
            "circuit_metric": measured.reshape(-1),
            "clean": clean.repeat(n),
            "corrupted": corrupted.repeat(n),
            "faithfulness": faithful.reshape(-1),
            "degenerate": [metrics.reasons[i] is not None for i in range(b)] * n,
            "small_span": [metrics.small[i] for i in range(b)] * n,
        }

    def _rows(self, per_edge: torch.Tensor, exact: torch.Tensor, metrics: PairMetrics) -> Columns:
        """Per (edge, pair) rows, or per edge the mean over the pairs not flagged (degenerate or small span)."""
        e, b = per_edge.shape
        clean, corrupted = metrics.clean.float().cpu(), metrics.corrupted.float().cpu()
        common = {"mode": [self.p.mode.value], "steps": [self.steps], "metric": [target_name(self.target)]}
        if self.p.per_pair:
            pair = np.tile(np.arange(b), e)
            edge = np.repeat(np.arange(e), b)
            out: dict[str, Any] = {"sample_index": pair.tolist()}
            out.update({k: [v[i] for i in edge] for k, v in self.columns.items()})
            out.update({k: v * (e * b) for k, v in common.items()})
            out.update({
                "score": per_edge.reshape(-1), "score_std": torch.full((e * b,), float("nan")),
                "exact": exact.reshape(-1), "pairs": [1] * (e * b), "clean": clean[pair], "corrupted": corrupted[pair],
                "degenerate": [metrics.reasons[i] is not None for i in pair],
                "small_span": [metrics.small[i] for i in pair],
            })  # fmt: skip
            return out
        keep = ~metrics.undefined
        n = int(keep.sum())
        nan = torch.full((e,), float("nan"))
        out = {"sample_index": [-1] * e, **self.columns}
        out.update({k: v * e for k, v in common.items()})
        out.update({
            "score": per_edge[:, keep].mean(1) if n else nan,
            "score_std": per_edge[:, keep].std(1) if n > 1 else nan,
            "exact": exact[:, keep].mean(1) if n else nan,
            "pairs": [n] * e,
            "clean": clean[keep].mean().expand(e) if n else nan,
            "corrupted": corrupted[keep].mean().expand(e) if n else nan,
            "degenerate": [n == 0] * e, "small_span": [False] * e,
        })  # fmt: skip
        return out


@dataclass
class _Receiving:
    """The run an intervention forward measures from: its prompts, edit, mask, the corrupted run's views, the pairs'
    metrics."""

    ids: torch.Tensor
    edit: EmbeddingEdit | None
    mask: torch.Tensor
    kept: dict[str, torch.Tensor]
    metrics: PairMetrics


def _means(views: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each writer's view (B, T, ...) replaced by its mean over the batch's real positions, broadcast back."""
    real = mask.bool()
    out = {}
    for name, view in views.items():
        mean = view[real].float().mean(0).to(view.dtype)  # (...) over every (pair, real position)
        out[name] = mean.expand_as(view)
    return out


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


def _edge_columns(graph: EdgeGraph, index: torch.Tensor) -> dict[str, list[Any]]:
    """The identifier columns of the edges `index` (E, 2) (writer, reader), in that order."""
    out: dict[str, list[Any]] = {k: [] for k in ("edge", "upstream", "downstream", "input", "upstream_layer",
                                                  "upstream_head", "downstream_layer", "downstream_head")}  # fmt: skip
    for w, r in index.tolist():
        up, down = graph.writers[w], graph.readers[r]
        out["edge"].append(f"{up.name}->{down.name}")
        out["upstream"].append(up.name)
        out["downstream"].append(down.name)
        out["input"].append(down.kind)
        out["upstream_layer"].append(None if up.kind == "input" else up.layer)
        out["upstream_head"].append(up.head)
        out["downstream_layer"].append(None if down.kind == "logits" else down.layer)
        out["downstream_head"].append(down.head)
    return out
