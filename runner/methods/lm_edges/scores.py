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


def reader_gradients(
    graph: EdgeGraph, views: dict[str, torch.Tensor], metric: torch.Tensor, runs: int = 1
) -> torch.Tensor:  # fmt: skip
    """(readers, B, T, D) float32: dM/d(each reader's input), from the traced run's `views` (site name -> the tensor
    the forward read, in the autograd graph) and its metric (B,) (pairs are independent: one backward of the sum);
    `runs` runs stacked in the forward's rows (run j's B pairs at rows j B .. (j + 1) B - 1): the sum of their
    gradients, summed one reader site at a time."""
    last = graph.layers - 1
    outputs = [f"{kind}.{layer}" for layer in range(graph.layers) for kind in ("q", "k", "v", "mlp_out")]
    outputs.append(f"resid_post.{last}")
    found = torch.autograd.grad(metric.sum(), [views[n] for n in outputs], retain_graph=True, allow_unused=True)
    grads = {n: torch.zeros_like(views[n]) if g is None else g for n, g in zip(outputs, found, strict=True)}
    parts: list[torch.Tensor] = []
    for layer in range(graph.layers):
        stream = views[f"resid_pre.{layer}"]
        for kind in ("q", "k", "v"):
            site, grad = views[f"{kind}.{layer}"], grads[f"{kind}.{layer}"]  # (B, T, H, d)
            parts.append(_per_pair(_vjp(site, stream, each_head_alone(grad), batched=True), runs))  # (H, B, T, D)
        mlp_in = stream if graph.parallel else views[f"resid_mid.{layer}"]
        mlp = _vjp(views[f"mlp_out.{layer}"], mlp_in, grads[f"mlp_out.{layer}"], batched=False)
        parts.append(_per_pair(mlp[None], runs))
    parts.append(_per_pair(grads[f"resid_post.{last}"].float()[None], runs))
    return torch.cat(parts)


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


def edge_scores(writes: torch.Tensor, gradients: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """(writers, readers, B) float32: each edge's score per pair (0 where (w, r) is not an edge)."""
    scores = torch.einsum("wbtd,rbtd->wrb", writes, gradients)
    return scores * edges[:, :, None].to(scores.device, scores.dtype)


def unit_scores(
    writes: torch.Tensor, gradients: torch.Tensor, edge_index: torch.Tensor, slots: torch.Tensor, count: int
) -> torch.Tensor:  # fmt: skip
    """(E x count, B) float32: each (edge, position slot) unit's score per pair, edge-major (unit e count + s): the
    edge's score at each position where its reader reads the write (the key's position for a key or value reader),
    summed over the pair's positions of slot s (`slots` (B, T): each position's slot, -1 at padding; positions.py).
    Summed over the slots they are `edge_scores`, to float rounding."""
    per = torch.einsum("wbtd,rbtd->wrbt", writes, gradients)[edge_index[:, 0], edge_index[:, 1]]  # (E, B, T)
    where = torch.where(slots >= 0, slots, count).to(per.device)  # padding to one more slot, dropped
    out = per.new_zeros(*per.shape[:2], count + 1)
    out.scatter_add_(2, where[None].expand_as(per), per)
    return out[..., :count].transpose(1, 2).reshape(-1, per.shape[1])


def integrated(
    steps: int, run: Callable[[float], tuple[dict[str, torch.Tensor], torch.Tensor]], graph: EdgeGraph
) -> torch.Tensor:
    """(readers, B, T, D) the readers' gradients averaged over `steps` runs: `run(alpha)` runs the model traced with
    its input embeddings corrupted + alpha (clean - corrupted) and gives its views and metric (B,); alpha = k/steps,
    k = 0 .. steps-1. One run's graph at a time: memory does not grow with `steps`."""
    total: torch.Tensor | None = None
    for k in range(steps):
        views, metric = run(k / steps)
        g = reader_gradients(graph, views, metric)
        del views, metric
        total = g if total is None else total + g
    assert total is not None
    return total / steps
