"""Edge attribution scores: every edge's first-order effect on the metric, from the writers' clean - corrupted writes
and the readers' gradients.

    score(w -> r) = sum over positions of (write_w(clean) - write_w(corrupted)) . dM/d(input of r)

with the gradient taken where each mode's estimator takes it (estimators.py: at the corrupted run, eap; at the clean
run, eap_clean; averaged over interpolating runs, eap_ig and eap_ig_activations; ...). A positive score: moving the
edge toward its clean value raises the metric.

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
    mask: torch.Tensor, per_position: bool = False,
) -> torch.Tensor:  # fmt: skip
    """(writers, B, T, D) float32: each writer's clean - corrupted write into the residual stream (0 at padding).

    Written writer group by writer group into one buffer (no concatenation: the writes are held once). The buffer is
    laid out as ScoreSum's products read it without a copy: (B, writers, T, D) (`per_position`: (B, T, writers, D));
    the tensor returned is a view of it in (writers, B, T, D) order."""
    b, t = mask.shape
    width = clean["resid_pre.0"].shape[-1]
    count = len(graph.writers)
    dims = (b, t, count, width) if per_position else (b, count, t, width)
    buffer = torch.empty(dims, dtype=torch.float32, device=mask.device)
    out = buffer.permute(2, 0, 1, 3) if per_position else buffer.transpose(0, 1)  # (writers, B, T, D)
    out[0] = clean["resid_pre.0"] - corrupted["resid_pre.0"]
    first = 1
    for layer in range(graph.layers):
        if head_writes.post_norm:  # not linear in z: each run's writes at its own scale
            delta = head_writes(layer, clean[f"head.{layer}"]) - head_writes(layer, corrupted[f"head.{layer}"])
        else:
            delta = head_writes(layer, clean[f"head.{layer}"] - corrupted[f"head.{layer}"])  # one projection
        out[first : first + delta.shape[0]] = delta  # (H, B, T, D)
        first += delta.shape[0]
        del delta
        out[first] = clean[f"mlp_out.{layer}"] - corrupted[f"mlp_out.{layer}"]
        first += 1
    out.mul_(mask[None, :, :, None].to(out.dtype))
    return out


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
    stream0 = views["resid_pre.0"]
    runs_b, t, width = stream0.shape
    b = runs_b // runs
    per_layer = graph.heads + 2 * graph.kv_heads + 1  # a layer's readers: its query heads, keys, values, MLP
    layer_bytes = per_layer * b * t * width * 4
    group = graph.layers if chunk_bytes is None else max(1, min(graph.layers, chunk_bytes // layer_bytes))
    block = None  # the run of readers handed over next, filled layer by layer (no concatenation: held once)
    first = 0
    for layer in range(graph.layers):
        at = layer % group
        if at == 0:
            block = stream0.new_empty((min(group, graph.layers - layer) * per_layer, b, t, width), dtype=torch.float32)
        assert block is not None
        stream, row = views[f"resid_pre.{layer}"], at * per_layer
        for kind in ("q", "k", "v"):
            site, grad = views[f"{kind}.{layer}"], grads.pop(f"{kind}.{layer}")  # (B, T, H, d)
            found = _per_pair(_vjp(site, stream, each_head_alone(grad), batched=True), runs)  # (H, B, T, D)
            block[row : row + found.shape[0]] = found
            row += found.shape[0]
            del found, grad
        mlp_in = stream if graph.parallel else views[f"resid_mid.{layer}"]
        mlp = _vjp(views[f"mlp_out.{layer}"], mlp_in, grads.pop(f"mlp_out.{layer}"), batched=False)
        block[row] = _per_pair(mlp[None], runs)[0]
        del mlp
        if at == group - 1 or layer == graph.layers - 1:
            sink(first, block)
            first += block.shape[0]
            block = None
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
        """Readers first .. first + n - 1's gradients (n, B, T, D). The products read the writes and the gradients in
        place (batched matrix products over strided views of writes()' buffer and of `gradients`): no copy of
        either is made."""
        w = self.writes  # (W, B, T, D), a view of (B, W, T, D) or, per position, (B, T, W, D)
        n = gradients.shape[0]
        if self.total is None:
            slots = () if self._slot_of is None else (self.count,)
            self.total = w.new_zeros(w.shape[0], self.readers, w.shape[1], *slots)
        readers = slice(first, first + n)
        if self._slot_of is None:
            per_pair = torch.bmm(_laid_out(w, (1, 0, 2, 3)).flatten(2), gradients.flatten(2).permute(1, 2, 0))
            self.total[:, readers] += per_pair.permute(1, 2, 0)  # (B, W, n) -> (W, n, B)
            return
        b, t = w.shape[1], w.shape[2]
        rows = _laid_out(w, (1, 2, 0, 3)).flatten(0, 1)  # (B T, W, D)
        per = torch.bmm(rows, gradients.flatten(1, 2).permute(1, 2, 0)).unflatten(0, (b, t))  # (B, T, W, n)
        per = per.permute(2, 3, 0, 1)  # (W, n, B, T)
        slotted = per.new_zeros(*per.shape[:3], self.count + 1)
        slotted.scatter_add_(3, self._slot_of.to(per.device)[None, None].expand_as(per), per)
        self.total[:, readers] += slotted[..., : self.count]

    def per_edge(self, edge_index: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """(E, B) each edge's score per pair, or per-position (E x count, B), edge-major (unit e count + s); times
        `scale` (1 / the runs averaged)."""
        assert self.total is not None, "no gradient was added"
        picked = self.total[edge_index[:, 0], edge_index[:, 1]] * scale  # (E, B[, S])
        return picked if self._slot_of is None else picked.transpose(1, 2).reshape(-1, picked.shape[1])


def _laid_out(w: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """`w` permuted to `order`, contiguous: a view where writes() laid its buffer out that way, else a copy (writes
    made elsewhere, e.g. a test's)."""
    return w.permute(order).contiguous()


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
