"""lm_edges' memory plan: the edges, readers and forwards of a run, and its peak memory, from the model's config
alone (its modules on the meta device: runner/models/memory.py), before any weight loads.

The peak is the largest of the run's phases, each the sum of what it holds at once:

  scoring (a gradient mode)   the weights; the clean run's views (no gradient); the corrupted run's views, kept
                              beside a later traced run (eap_ig's steps > 1, the estimators); one traced run
                              (saved tensors and views, measured on meta); the sites' gradients of the layers not
                              yet reduced; the readers' gradients of one chunk (method.edges.gradient_memory); the
                              writes (writers x B x T x D, float32); the scores (writers x readers x B[, slots]); and
                              the largest passing buffer: a layer's batched vector-Jacobian product (H copies of
                              the stream's gradient) or the heads' writes of a layer (H copies of the stream).
  circuits                    (the evaluation: circuit sizes or fractions) the weights, both runs' views of a
                              whole batch (both parts), one intervention forward of variants x copies x pairs rows
                              without gradient (about ROWS_PER_FORWARD rows, one variant at least; a copy per
                              reader of a layer, and copy 0) at its widest layer or at its logits, each variant's
                              writes so far (float32, every writer's at the last layer) and the copies' deltas.
  exact edges                 (mode exact, top_k's checks) the weights, both runs' views, the writes, and one
                              forward of two copies a variant.

An intervention forward's widest point is a block (its activations) or the logits that end it: rows x vocabulary
(float32 at the last position), with copy 0's rows copied out and the clean run's logits repeated beside them for
the metric (Gemma 3's 262,144 tokens make the logits, not a block, the widest point).

B is the most discovery pairs in one batch (the split is known from the pairs' ids before the model loads; the
circuits' batch holds both parts), T the longest prompt. Float32 parts stay float32 at any weight dtype (the scores'
accumulation); the rest is in the weights' dtype. The phases are what torch allocates (checked against its
allocator: scripts/plan_memory.py --allocator). `EdgePlan.resident` is the plan of the process's resident memory on
the CPU: there the C library keeps most of what the scoring pass frees for later allocations of other sizes, so the
evaluation's phases also hold the scoring pass's tensors (runner/plan.py adds the process itself). The GPU adds the
caching allocator's fragmentation, which the plan does not model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.hooks import HookSession
from runner.methods.lm.base import forward_last
from runner.methods.lm_edges.estimators import ESTIMATORS
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.intervene import ROWS_PER_FORWARD, EdgeRuns
from runner.models.lm_sites import LanguageModelLayout
from runner.models.memory import kept_bytes, parameter_bytes, traced_bytes
from runner.options.method.lm_edges import LmEdgesConfig


@dataclass(frozen=True)
class Phase:
    """What one phase of the run holds at once: (name, bytes) terms."""

    name: str
    terms: list[tuple[str, int]]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.terms)


@dataclass(frozen=True)
class EdgePlan:
    """The run's sizes and phases; `peak` is the largest phase."""

    counts: dict[str, int]
    phases: list[Phase] = field(default_factory=list)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    def resident(self) -> EdgePlan:
        """The plan of the resident memory on the CPU: each phase after the scoring pass (the evaluation's) also
        holds the scoring pass's tensors beyond the weights, which glibc's heap keeps after torch frees them (the
        evaluation's tensors, of other sizes, reuse little of it: measured, benchmarks/RESULTS.md)."""
        scoring = next((phase for phase in self.phases if phase.name == "scoring"), None)
        if scoring is None:
            return self
        freed = scoring.total - dict(scoring.terms).get("weights", 0)
        term = ("the scoring pass's freed memory", freed)
        return EdgePlan(self.counts, [p if p is scoring else Phase(p.name, [*p.terms, term]) for p in self.phases])


@dataclass(frozen=True)
class Shape:
    """The data's shape as the run will see it: `pairs` scored per batch at most (its discovery pairs), `tokens` the
    longest prompt, `batches` the scoring batches, `batch` the pairs an evaluation batch holds (both parts), `slots`
    per-position slots (1: per edge)."""

    pairs: int
    tokens: int
    batches: int
    batch: int
    slots: int = 1


def _meta_views(model: nn.Module, hooks: EdgeRuns, rows: int, tokens: int, grad: bool) -> int:
    """Bytes one run of `rows` prompts of `tokens` holds: traced (saved tensors and views), or its views alone."""
    ids = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    mask = torch.ones(rows, tokens, dtype=torch.long, device="meta")

    def forward() -> None:
        forward_last(model, ids, mask)

    if grad:
        return traced_bytes(model, forward, lambda: hooks.keep(grad=True), lambda: hooks.kept)
    with torch.no_grad(), hooks.keep():
        forward()
    return kept_bytes(hooks.kept)


def edge_plan(
    skeleton: nn.Module, layout: LanguageModelLayout, p: LmEdgesConfig, shape: Shape, chunk_bytes: int | None,
    evaluates: bool,
) -> EdgePlan:  # fmt: skip
    """The plan of lm_edges on `skeleton` (the model on the meta device) for data of `shape`; `chunk_bytes`: the
    readers' gradients held at once (None: every layer); `evaluates`: whether the run evaluates circuits (sizes or
    fractions; top_k's checked edges are the exact-edges phase)."""
    graph = EdgeGraph.of(layout)
    config = getattr(skeleton, "config", None)
    width = int(config.hidden_size)
    inner = int(getattr(config, "intermediate_size", 4 * width) or 4 * width)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    head_dim = int(getattr(config, "head_dim", None) or width // layout.heads)
    weights = parameter_bytes(skeleton)
    e = next(skeleton.parameters()).element_size()
    b, t, s = shape.pairs, shape.tokens, shape.slots
    writers, readers, layers = len(graph.writers), len(graph.readers), graph.layers
    per_layer = layout.heads + 2 * layout.kv_heads + 1
    stream = b * t * width  # one (B, T, D) tensor's elements
    estimator = ESTIMATORS[p.mode]  # its runs (exact: none traced) and how many a traced forward stacks
    runs = estimator.runs(p.steps, layers) if estimator.traced else 0
    stacked = estimator.stacked(p.steps, layers, b) if runs else 1
    rows = stacked * b
    with HookSession(skeleton, []) as session:
        hooks = EdgeRuns(skeleton, layout, graph, session)
        views = _meta_views(skeleton, hooks, b, t, grad=False)
        traced = _meta_views(skeleton, hooks, rows, t, grad=True) if runs else 0
        whole_views = _meta_views(skeleton, hooks, shape.batch, t, grad=False) if evaluates else 0  # circuits' runs
        hooks.clear()
    edges = int(graph.count)
    counts = {"edges": edges, "units": edges * s, "writers": writers, "readers": readers, "layers": layers,
              "pairs_per_batch": b, "tokens": t, "runs_per_batch": runs,
              "forwards_per_batch": 2 + (-(-runs // stacked) if runs else 0)}  # fmt: skip
    writes_bytes = writers * stream * 4
    scores_bytes = writers * readers * b * s * 4
    both_views = (("clean run's views", views), ("corrupted run's views", views))
    phases = []
    if runs:
        layer_bytes = per_layer * stream * 4
        group = layers if chunk_bytes is None else max(1, min(layers, chunk_bytes // layer_bytes))
        site_grads = rows * t * (layout.heads * head_dim + 2 * layout.kv_heads * head_dim + width) * e
        vjp = layout.heads * rows * t * width * (3 * e + 4) + (layout.heads * stream * 4 if stacked > 1 else 0)
        head_writes = 3 * layout.heads * stream * e * (2 if getattr(hooks.head_writes, "post_norm", False) else 1)
        kept = estimator.kept_views * views
        per_position = writers * per_layer * group * stream // width * 8 if s > 1 else 0  # (W, n, B, T) twice
        phases.append(Phase("scoring", [
            ("weights", weights), ("clean run's views", views), ("corrupted run's views", kept),
            ("traced run", traced), ("sites' gradients", (layers - group + 1) * site_grads),
            ("readers' gradients (a chunk)", group * layer_bytes), ("writes", writes_bytes), ("scores", scores_bytes),
            ("passing buffers", max(vjp, head_writes) + per_position),
        ]))  # fmt: skip
    if evaluates:  # circuits over every pair of a batch: copy 0 and a copy per reader of a layer, per variant
        whole = shape.batch
        both = 2 * whole_views
        copies = per_layer + 1
        variants = max(1, ROWS_PER_FORWARD // (copies * whole))
        one = variants * whole * t * width  # a (V, B, T, D) tensor's elements
        forward = _forward(layout, width, inner, t, e, variants * copies * whole, vocab, variants * whole)
        passing = copies * one * 4  # a layer's copies' deltas
        current = writers * one * 4  # each variant's writes so far, float32 (at the last layer: every writer's)
        phases.append(Phase("circuits", [
            ("weights", weights), ("both runs' views", both), ("a forward's activations", forward),
            ("variants' writes so far", current), ("passing buffers", passing),
        ]))  # fmt: skip
    if p.top_k or not runs:  # exact edges (mode exact, top_k's checks): two copies a variant
        rows = max(1, ROWS_PER_FORWARD // (2 * b)) * 2 * b
        phases.append(Phase("exact edges", [
            ("weights", weights), *both_views, ("writes", writes_bytes),
            ("a forward's activations", _forward(layout, width, inner, t, e, rows, vocab, rows // 2)),
        ]))  # fmt: skip
    return EdgePlan(counts, phases)


def _forward(
    layout: LanguageModelLayout, width: int, inner: int, tokens: int, e: int, rows: int, vocab: int, measured: int,
) -> int:  # fmt: skip
    """Bytes of one forward of `rows` rows without gradient at its widest point, a block or the logits. A block: the
    embeddings, the stream, its norms, attention output and sums (six streams wide), the MLP's gate, up and product,
    and one layer's attention scores and probabilities. The logits: rows x `vocab` at the last position (in the
    weights' dtype, and in float32), beside the `measured` rows' logits copied out (copy 0's) and the clean run's
    logits repeated to match them for the metric (float32)."""
    block = rows * tokens * (6 * width + 3 * inner) * e + 2 * rows * layout.heads * tokens * tokens * 4
    logits = rows * vocab * (e + (4 if e != 4 else 0)) + 2 * measured * vocab * 4
    return max(block, logits)
