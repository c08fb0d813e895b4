"""Edge interventions: every reader of the graph reads its own input, in one forward.

A model reads one residual stream per block; an edge intervention changes what one reader (head h's query, a key-value
head's key or value, an MLP) reads and nothing else. Each pair is run as C copies stacked in the batch: copy 0 is the
run measured, copy c >= 1 is reader c of the current block (its q heads, then its k and v key-value heads, then its MLP).
At each block the copies' streams are set to copy 0's plus their reader's delta, and copy 0 takes from each copy only
what its reader computes (head h's query columns from the q copy of h, ...), so copy 0's forward is the model's with
every reader's input changed by its own delta, exactly (the same modules on the same inputs). The logits reader's
delta is added to copy 0's final stream.

The deltas come from `Deltas`:
  - `Patched` (exact edge patching): the run of the corrupted prompt, reader r of edge v's variant reading
    + (clean - corrupted) write of the edge's writer: the edge's true effect;
  - `Circuit` (circuit evaluation, Hanna et al. 2024's evaluate_graph): the run of the clean prompt, each reader reading
    - sum over its edges outside the circuit of (this run's write - the corrupted run's write): every edge outside the
    circuit carries its corrupted value.
A head's write is its output through the attention's output projection (linear: o(z_h) - o(0)), as in scores.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runner.hooks import HookSession
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_patching.engine import SiteHooks
from runner.models.lm_sites import LanguageModelLayout, SiteSpec


def head_writes(out_proj: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """(..., H, T?, D): each head's write of `z` (..., T, H, d) through the output projection alone, as (H, ...) first:
    o(z with only head h) - o(0), the projection's own forward (not its hooks)."""
    heads = z.shape[-2]
    one_head = torch.eye(heads, dtype=z.dtype, device=z.device).view(heads, *(1,) * (z.dim() - 2), heads, 1)
    alone = (z[None] * one_head).flatten(-2)  # (H, ..., T, H x d)
    return out_proj.forward(alone) - out_proj.forward(torch.zeros_like(alone.flatten(0, -2)[:1]))


class Deltas:
    """What each reader's input gets added in a run of `variants` variants."""

    variants: int

    def of(self, readers: Sequence[int], current: torch.Tensor) -> torch.Tensor:
        """(variants, len(readers), B, T, D) the deltas of `readers` (graph indices), given copy 0's writes so far minus
        the corrupted run's, `current` (variants, writers so far, B, T, D)."""
        raise NotImplementedError


class Patched(Deltas):
    """Exact edge patching: variant v adds `write[w_v]` (B, T, D) to reader r_v's input alone."""

    def __init__(self, edges: Sequence[tuple[int, int]], writes: torch.Tensor) -> None:
        self.edges, self.writes, self.variants = list(edges), writes, len(edges)

    def of(self, readers: Sequence[int], current: torch.Tensor) -> torch.Tensor:
        b, t, d = self.writes.shape[1:]
        out = self.writes.new_zeros(self.variants, len(readers), b, t, d)
        slot = {r: i for i, r in enumerate(readers)}
        for v, (w, r) in enumerate(self.edges):
            if r in slot:
                out[v, slot[r]] = self.writes[w]
        return out


class Circuit(Deltas):
    """Circuit evaluation: variant v keeps the edges `kept[v]` (writers, readers) bool; every other edge's reader reads
    minus (this run's write - the corrupted run's)."""

    def __init__(self, kept: torch.Tensor) -> None:
        self.kept, self.variants = kept, kept.shape[0]

    def of(self, readers: Sequence[int], current: torch.Tensor) -> torch.Tensor:
        w = current.shape[1]
        dropped = (~self.kept[:, :w, list(readers)]).to(current.dtype)  # (V, W, R)
        return -torch.einsum("vwr,vwbtd->vrbtd", dropped, current)


class EdgeRuns(SiteHooks):
    """The hooks of edge interventions (module docstring), on the sites the graph reads."""

    def __init__(self, model: nn.Module, layout: LanguageModelLayout, graph: EdgeGraph, session: HookSession,
                 specs: Sequence[SiteSpec]) -> None:  # fmt: skip
        super().__init__(model, specs, session)
        self.graph, self.layout = graph, layout
        modules = dict(model.named_modules())
        self.out_proj = [modules[layout.site("head", layer).module] for layer in range(graph.layers)]
        # per layer: the readers' graph indices in copy order (q heads, k, v key-value heads, MLP); copies = 1 + that
        self.by_layer = [
            [i for kind in ("q", "k", "v", "mlp") for i in graph.readers_of(layer, kind)] for layer in range(graph.layers)
        ]  # fmt: skip
        self.copies = 1 + max(len(r) for r in self.by_layer)
        self.logits_reader = len(graph.readers) - 1
        self.running: _Run | None = None

    def _active(self, spec: SiteSpec) -> bool:
        return self.keeping or self.running is not None or spec.name in self.patches

    def run(self, deltas: Deltas, pairs: int, corrupted: dict[str, torch.Tensor]) -> _Running:
        """`with hooks.run(deltas, B, kept):` the forward inside (of variants x copies x pairs rows, row (v, c, b) at
        (v * copies + c) * B + b) is an edge intervention; `corrupted`: the corrupted run's kept views."""
        return _Running(self, _Run(deltas, pairs, corrupted))

    def visit(self, spec: SiteSpec, raw: torch.Tensor) -> torch.Tensor | None:
        run = self.running
        if run is None:
            return super().visit(spec, raw)
        view = spec.get(raw)
        v, c, b = run.deltas.variants, self.copies, run.pairs
        rows = view.view(v, c, b, *view.shape[1:])
        layer = spec.layer
        new: torch.Tensor | None = None
        if spec.kind == "resid_pre":
            if layer == 0:  # the embeddings' write: copy 0's input minus the corrupted run's
                run.add(rows[:, 0] - run.corrupted["resid_pre.0"][None].to(rows.dtype))
            readers = [r for r in self.by_layer[layer] if self.graph.readers[r].kind != "mlp" or self.graph.parallel]
            new = self._set_copies(rows, layer, readers, run)
        elif spec.kind == "resid_mid":
            new = self._set_copies(rows, layer, self.graph.readers_of(layer, "mlp"), run)
        elif spec.kind in ("q", "k", "v"):
            copies = torch.tensor([1 + self.by_layer[layer].index(r) for r in self.graph.readers_of(layer, spec.kind)])
            new = rows.clone()
            # copy c's head c: (V, heads, B, T, heads, d) -> its diagonal (V, B, T, d, heads) -> (V, B, T, heads, d)
            new[:, 0] = rows[:, copies.to(rows.device)].diagonal(dim1=1, dim2=4).movedim(-1, -2)
        elif spec.kind == "head":
            z = rows[:, 0] - run.corrupted[f"head.{layer}"][None].to(rows.dtype)  # (V, B, T, H, d)
            run.add(head_writes(self.out_proj[layer], z).movedim(0, 1))  # (V, H, B, T, D)
        elif spec.kind == "mlp_out":
            copy = 1 + self.by_layer[layer].index(self.graph.readers_of(layer, "mlp")[0])
            new = rows.clone()
            new[:, 0] = rows[:, copy]
            run.add((new[:, 0] - run.corrupted[f"mlp_out.{layer}"][None].to(rows.dtype))[:, None])
        elif spec.kind == "resid_post" and layer == self.graph.layers - 1:
            new = rows.clone()
            new[:, 0] = rows[:, 0] + run.deltas.of([self.logits_reader], run.current())[:, 0].to(rows.dtype)
        return None if new is None else spec.put(raw, new.view(view.shape))

    def _set_copies(self, rows: torch.Tensor, layer: int, readers: list[int], run: _Run) -> torch.Tensor:
        """`rows` (V, C, B, T, D) with every copy set to copy 0's stream, plus `readers`' deltas in theirs."""
        new = rows[:, :1].expand_as(rows).clone()
        if readers:
            copies = torch.tensor([1 + self.by_layer[layer].index(r) for r in readers], device=rows.device)
            new[:, copies] += run.deltas.of(readers, run.current()).to(rows.dtype)
        return new


class _Run:
    """One intervention forward's state: its deltas, copy 0's writes so far (minus the corrupted run's)."""

    def __init__(self, deltas: Deltas, pairs: int, corrupted: dict[str, torch.Tensor]) -> None:
        self.deltas, self.pairs, self.corrupted = deltas, pairs, corrupted
        self.writes: list[torch.Tensor] = []  # each (V, n, B, T, D)

    def add(self, writes: torch.Tensor) -> None:
        self.writes.append(writes.float() if writes.dim() == 5 else writes[:, None].float())

    def current(self) -> torch.Tensor:
        return torch.cat(self.writes, dim=1)


class _Running:
    def __init__(self, hooks: EdgeRuns, run: _Run) -> None:
        self.hooks, self.run_ = hooks, run

    def __enter__(self) -> None:
        self.hooks.running = self.run_

    def __exit__(self, *exc: Any) -> None:
        self.hooks.running = None
