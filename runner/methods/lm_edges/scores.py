"""Edge attribution scores: every edge's first-order effect on the metric, from the writers' clean - corrupted writes
and the readers' gradients.

    score(w -> r) = sum over positions of (write_w(clean) - write_w(corrupted)) . dM/d(input of r)

with the gradient taken on the corrupted run (EAP, Syed et al. 2023; TransformerLens's `attribution_patch` at edge
granularity), or averaged over the runs whose input embeddings are corrupted + k/steps (clean - corrupted),
k = 0 .. steps-1 (EAP-IG, Hanna et al. 2024: their `get_scores_eap_ig`), or as estimators.py averages them
(clean_corrupted, eap_ig_activations). A positive score: moving the edge toward its clean value raises the metric.
With steps=1 eap and eap_ig are the same.

A reader's gradient is the gradient along its own path only: head h's query input is the residual stream as head h's
query projection reads it (through the block's norm), so dM/d(input of a{l}.h{h}<q>) is the vector-Jacobian product
of the stream -> q map with dM/dq restricted to head h; likewise per key-value head for k and v, and through the MLP
for its input. They come from the one backward of the metric plus one batched vector-Jacobian product per site and
layer (`is_grads_batched`), in the autograd graph of the traced run (SiteHooks.keep(grad=True)). A head's write is its
output through the attention's output projection alone (that projection is linear: o_proj(z_h) - o_proj(0)); in a
family that norms the attention's output after the heads are summed, times the norm's factor in its own run
(runner/methods/lm/writes.py HeadWrites): the clean write at the clean run's scale minus the corrupted write at the corrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.methods.lm.writes import HeadWrites, each_head_alone
from runner.methods.lm_edges.graph import EdgeGraph


def writes(
    graph: EdgeGraph, head_writes: HeadWrites, clean: dict[str, torch.Tensor], corrupted: dict[str, torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """(writers, B, T, D) float32: each writer's clean - corrupted write into the residual stream (0 at padding)."""
    parts = [(clean["resid_pre.0"] - corrupted["resid_pre.0"]).float()[None]]
    for layer in range(graph.layers):
        if head_writes.post_norm:  # not linear in z: each run's writes at its own scale
            delta = head_writes(layer, clean[f"head.{layer}"]) - head_writes(layer, corrupted[f"head.{layer}"])
        else:
            delta = head_writes(layer, clean[f"head.{layer}"] - corrupted[f"head.{layer}"])  # one projection
        parts.append(delta.float())  # (H, B, T, D)
        parts.append((clean[f"mlp_out.{layer}"] - corrupted[f"mlp_out.{layer}"]).float()[None])
    return torch.cat(parts) * mask[None, :, :, None].to(parts[0].dtype)


Sink = Callable[[int, torch.Tensor], None]  # (the first reader's index, the gradients of a run of readers)


def reader_gradients(
    graph: EdgeGraph, views: dict[str, torch.Tensor], metric: torch.Tensor, sink: Sink, runs: int = 1,
    chunk_bytes: int | None = None,
) -> None:  # fmt: skip
    """dM/d(each reader's input), float32, handed to `sink` a run of readers at a time in reader order: (first reader,
    (n, B, T, D)). From the traced run's `views` (site name -> the tensor the forward read, in the autograd graph) and
    its metric (B,) (pairs are independent: one backward of the sum); `runs` runs stacked in the forward's rows (run j's
    B pairs at rows j B .. (j + 1) B - 1): the sum of their gradients, summed one reader site at a time. Whole layers'
    readers go to the sink together up to `chunk_bytes` of gradients (at least one layer; None: every layer at once),
    so the readers' gradients (readers, B, T, D) are never held whole."""
    last = graph.layers - 1
    outputs = [f"{kind}.{layer}" for layer in range(graph.layers) for kind in ("q", "k", "v", "mlp_out")]
    outputs.append(f"resid_post.{last}")
    found = torch.autograd.grad(metric.sum(), [views[n] for n in outputs], retain_graph=True, allow_unused=True)
    grads = {n: torch.zeros_like(views[n]) if g is None else g for n, g in zip(outputs, found, strict=True)}
    del found
    parts: list[torch.Tensor] = []
    first = held = 0

    def flush() -> None:
        nonlocal first, held, parts
        if parts:
            block = torch.cat(parts)
            parts, held = [], 0
            sink(first, block)
            first += block.shape[0]

    for layer in range(graph.layers):
        stream = views[f"resid_pre.{layer}"]
        mine = []
        for kind in ("q", "k", "v"):
            site, grad = views[f"{kind}.{layer}"], grads.pop(f"{kind}.{layer}")  # (B, T, H, d)
            mine.append(_per_pair(_vjp(site, stream, each_head_alone(grad), batched=True), runs))  # (H, B, T, D)
        mlp_in = stream if graph.parallel else views[f"resid_mid.{layer}"]
        mlp = _vjp(views[f"mlp_out.{layer}"], mlp_in, grads.pop(f"mlp_out.{layer}"), batched=False)
        mine.append(_per_pair(mlp[None], runs))
        size = sum(p.numel() * p.element_size() for p in mine)
        if chunk_bytes is not None and held + size > chunk_bytes:  # the layers held so far first (at least one)
            flush()
        parts += mine
        held += size
    flush()
    sink(first, _per_pair(grads[f"resid_post.{last}"].float()[None], runs))


class ScoreSum:
    """Every edge's score summed one run of readers at a time: total[w, r] += write_w . g_r over the chunks the
    gradient runs hand over (`add`, a sink of reader_gradients), so that only a chunk of the readers' gradients is
    held. `writes_of()` gives the writes (writers, B, T, D); it is called at the first chunk (by then the corrupted
    run's views are kept). Per-position edges: `positions` (B, T) each position's slot (-1: padding), `count` slots;
    the total is then per slot (writers, readers, B, slots)."""

    def __init__(
        self, writes_of: Callable[[], torch.Tensor], readers: int, positions: torch.Tensor | None = None,
        count: int = 1,
    ) -> None:  # fmt: skip
        self.writes_of, self.readers, self.count = writes_of, readers, count
        # each position's slot, padding in one more slot (dropped): made once, read by every chunk
        self._slot_of = None if positions is None else torch.where(positions >= 0, positions, count)
        self._writes: torch.Tensor | None = None
        self.total: torch.Tensor | None = None

    @property
    def writes(self) -> torch.Tensor:
        if self._writes is None:
            self._writes = self.writes_of()
        return self._writes

    def add(self, first: int, gradients: torch.Tensor) -> None:
        """Readers first .. first + n - 1's gradients (n, B, T, D)."""
        w = self.writes
        if self.total is None:
            slots = () if self._slot_of is None else (self.count,)
            self.total = w.new_zeros(w.shape[0], self.readers, w.shape[1], *slots)
        readers = slice(first, first + gradients.shape[0])
        if self._slot_of is None:
            self.total[:, readers] += torch.einsum("wbtd,rbtd->wrb", w, gradients)
            return
        per = torch.einsum("wbtd,rbtd->wrbt", w, gradients)  # (W, n, B, T)
        slotted = per.new_zeros(*per.shape[:3], self.count + 1)
        slotted.scatter_add_(3, self._slot_of.to(per.device)[None, None].expand_as(per), per)
        self.total[:, readers] += slotted[..., : self.count]

    def per_edge(self, edge_index: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """(E, B) each edge's score per pair, or per-position (E x count, B), edge-major (unit e count + s); times
        `scale` (1 / the runs averaged)."""
        assert self.total is not None, "no gradient was added"
        picked = self.total[edge_index[:, 0], edge_index[:, 1]] * scale  # (E, B[, S])
        return picked if self._slot_of is None else picked.transpose(1, 2).reshape(-1, picked.shape[1])


def _per_pair(x: torch.Tensor, runs: int) -> torch.Tensor:
    """(n, B, T, D) from (n, runs x B, T, D): the stacked runs' sum."""
    return x if runs == 1 else x.unflatten(1, (runs, -1)).sum(1)


def _vjp(output: torch.Tensor, stream: torch.Tensor, cotangent: torch.Tensor, batched: bool) -> torch.Tensor:
    """The vector-Jacobian product of stream -> output with `cotangent` (a batch of them when `batched`), float32;
    zeros where the output does not depend on the stream."""
    found = torch.autograd.grad(
        output, stream, cotangent, retain_graph=True, allow_unused=True, is_grads_batched=batched
    )[0]
    if found is None:
        shape = (cotangent.shape[0], *stream.shape) if batched else stream.shape
        return torch.zeros(shape, device=stream.device)
    return found.float()


def integrated(
    steps: int, run: Callable[[float], tuple[dict[str, torch.Tensor], torch.Tensor]], graph: EdgeGraph, sink: Sink,
    chunk_bytes: int | None = None,
) -> None:  # fmt: skip
    """The readers' gradients of `steps` runs into `sink` (their sum: the caller divides by `steps`): `run(alpha)`
    runs the model traced with its input embeddings corrupted + alpha (clean - corrupted) and gives its views and
    metric (B,); alpha = k/steps, k = 0 .. steps-1. One run's graph at a time: memory does not grow with `steps`."""
    for k in range(steps):
        views, metric = run(k / steps)
        reader_gradients(graph, views, metric, sink, chunk_bytes=chunk_bytes)
        del views, metric
