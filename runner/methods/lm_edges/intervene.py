"""Edge interventions: every reader of the graph reads its own input, in one forward.

A model reads one residual stream per block; an edge intervention changes what one reader (head h's query, a key-value
head's key or value, an MLP) reads and nothing else. Each pair is run as copies stacked in the batch: copy 0 is the
run measured, the others play readers of the current block (`Deltas.slots`: in a circuit every reader has its copy, in
the block's order of q heads, k and v key-value heads, MLP; in exact patching copy 1 plays the edge's reader). At each
block the copies' streams are set to copy 0's plus their reader's delta, and copy 0 takes from each copy only what
its reader computes (head h's query columns from the copy playing h's query, ...), so copy 0's forward is the model's with
every reader's input changed by its own delta, exactly (the same modules on the same inputs). The logits reader's
delta is added to copy 0's final stream.

The deltas come from `Deltas`:
  - `Patched` (exact edge patching): the run of the corrupted prompt, reader r of edge v's variant reading
    + (clean - corrupted) write of the edge's writer: the edge's true effect;
  - `Circuit` (circuit evaluation, Hanna et al. 2024's evaluate_graph): the run of the clean prompt, each reader reading
    - sum over its edges outside the circuit of (this run's write - the corrupted run's write): every edge outside the
    circuit carries its corrupted value.
A head's write is runner/methods/lm/writes.py's `HeadWrites`: its output through the attention's output projection
(o(z_h) - o(0)), times a post-norm's factor at the run's own summed output where the family has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.writes import HeadWrites
from runner.methods.lm_edges.graph import INPUT_KINDS, EdgeGraph
from runner.models.lm_sites import LanguageModelLayout, SiteSpec

# Rows (variants x copies x pairs) an intervention forward aims for (exact edges, circuits, paths)
ROWS_PER_FORWARD = 256


class Deltas:
    """What each reader's input gets added in a run of `variants` variants, and which copy holds which reader.

    `slots(layer)` (V, copies - 1): the reader (graph index) copy c + 1 of variant v plays at `layer`, -1 for a copy
    that plays none there (it follows copy 0)."""

    variants: int
    copies: int  # copy 0 and the readers' copies
    reads_writes: bool = True  # whether `of` reads copy 0's writes (kept per writer through the forward)

    def slots(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def of(self, slots: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """(V, n, B, T, D) the deltas of the readers `slots` (V, n) (-1: none, a zero delta), given copy 0's writes so
        far minus the reference run's, `current` (V, writers so far, B, T, D)."""
        raise NotImplementedError


class Patched(Deltas):
    """Exact edge patching: variant v adds `writes[w_v]` (B, T, D) to reader r_v's input alone; two copies a variant
    (copy 1 plays r_v in its layer)."""

    COPIES = 2

    def __init__(
        self, edges: Sequence[tuple[int, int]], writes: torch.Tensor, graph: EdgeGraph,
        positions: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """`positions` (V, B, T) bool: where variant v's write is added (per-position edges; None: everywhere)."""
        self.edges, self.writes, self.variants, self.copies = list(edges), writes, len(edges), self.COPIES
        self.reads_writes = False  # fixed deltas: no (V, writers, B, T, D) of copy 0's writes kept
        self.layer = torch.tensor([graph.readers[r].layer for _, r in edges])
        self.reader = torch.tensor([r for _, r in edges])
        self.writer = torch.tensor([w for w, _ in edges], device=writes.device)
        self.positions = positions

    def slots(self, layer: int) -> torch.Tensor:
        return torch.where(self.layer == layer, self.reader, -1)[:, None]  # (V, 1)

    def of(self, slots: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        mine = (slots == self.reader[:, None].to(slots.device)).to(self.writes.device, self.writes.dtype)  # (V, n)
        added = self.writes[self.writer]  # (V, B, T, D)
        if self.positions is not None:
            added = added * self.positions[..., None].to(added.device, added.dtype)
        return mine[:, :, None, None, None] * added[:, None]


class ReaderCopies(Deltas):
    """Deltas whose copies play a block's readers in `by_layer`'s order (each layer's list of reader indices), the
    same in every variant; copy c + 1 plays the layer's c-th reader, -1: none."""

    def __init__(self, variants: int, by_layer: list[list[int]], copies: int) -> None:
        self.variants, self.copies = variants, copies
        self.by_layer = [torch.tensor(r + [-1] * (self.copies - 1 - len(r))) for r in by_layer]

    def slots(self, layer: int) -> torch.Tensor:
        return self.by_layer[layer][None].expand(self.variants, -1) if layer < len(self.by_layer) else (
            torch.full((self.variants, self.copies - 1), -1)
        )  # fmt: skip


class Circuit(ReaderCopies):
    """Circuit evaluation: variant v keeps the edges `kept[v]` (writers, readers) bool; every other edge's reader reads
    minus (this run's write - the reference run's). Every reader of a layer has its copy, in `by_layer`'s order.
    Per-position edges: `kept[v]` (writers, readers, slots) keeps units, and `positions` (B, T) gives each position's
    slot (-1: padding, where nothing is changed)."""

    def __init__(
        self, kept: torch.Tensor, by_layer: list[list[int]], copies: int, positions: torch.Tensor | None = None
    ) -> None:  # fmt: skip
        super().__init__(kept.shape[0], by_layer, copies)
        self.kept, self.positions = kept, positions

    def of(self, slots: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        w = current.shape[1]
        slots = slots.to(self.kept.device)
        reading = (slots >= 0)[:, None, :]  # (V, 1, n)
        if self.positions is None:
            index = slots.clamp(min=0)[:, None, :].expand(-1, w, -1)  # (V, W, n)
            dropped = (~self.kept[:, :w].gather(2, index)) & reading  # (V, W, n)
            return -torch.einsum("vwn,vwbtd->vnbtd", dropped.to(current.dtype), current)
        count = self.kept.shape[-1]
        index = slots.clamp(min=0)[:, None, :, None].expand(-1, w, -1, count)  # (V, W, n, S)
        kept = self.kept[:, :w].gather(2, index)
        kept = torch.cat([kept, kept.new_ones(*kept.shape[:3], 1)], dim=3)  # padding: kept, nothing changed
        where = torch.where(self.positions >= 0, self.positions, count).to(kept.device)  # (B, T)
        dropped = (~kept[..., where]) & reading[..., None, None]  # (V, W, n, B, T)
        return -torch.einsum("vwnbt,vwbtd->vnbtd", dropped.to(current.dtype), current)


class Paths(ReaderCopies):
    """Path patching (Wang et al. 2022): variant v's receivers read + the clean - corrupted write of each of their
    senders in `patched[v]` (writers, readers) bool, fixed deltas on the corrupted run; every other reader reads what
    that run computes. Readers take copies as in a circuit (`by_layer`); a variant of one edge is `Patched`'s."""

    def __init__(self, patched: torch.Tensor, writes: torch.Tensor, by_layer: list[list[int]], copies: int) -> None:
        super().__init__(patched.shape[0], by_layer, copies)
        self.patched, self.writes = patched, writes
        self.reads_writes = False  # fixed deltas

    def of(self, slots: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        w = self.patched.shape[1]
        slots = slots.to(self.patched.device)
        index = slots.clamp(min=0)[:, None, :].expand(-1, w, -1)  # (V, W, n)
        sending = self.patched.gather(2, index) & (slots >= 0)[:, None, :]  # (V, W, n)
        return torch.einsum("vwn,wbtd->vnbtd", sending.to(self.writes.dtype), self.writes)


class EdgeRuns(SiteHooks):
    """The hooks of edge interventions (module docstring), on the sites the graph reads."""

    def __init__(self, model: nn.Module, layout: LanguageModelLayout, graph: EdgeGraph, session: HookSession) -> None:
        super().__init__(model, [layout.site(kind, layer) for kind, layer in graph.sites()], session)
        self.graph, self.layout = graph, layout
        self.head_writes = HeadWrites(model, layout, graph.layers)
        # per layer: the readers' graph indices in copy order (q heads, k, v key-value heads, MLP)
        self.by_layer = [
            [i for kind in ("q", "k", "v", "mlp") for i in graph.readers_of(layer, kind)] for layer in range(graph.layers)
        ]  # fmt: skip
        self.circuit_copies = 1 + max(len(r) for r in self.by_layer)  # copy 0 and one per reader of a block
        self.kind_of = torch.tensor([INPUT_KINDS.index(r.kind) for r in graph.readers] + [-1])  # [-1]: no reader
        self.head_of = torch.tensor([-1 if r.head is None else r.head for r in graph.readers] + [-1])
        self.logits_reader = len(graph.readers) - 1
        self.running: _Run | None = None

    def _active(self, spec: SiteSpec) -> bool:
        return self.keeping or self.running is not None or spec.name in self.patches

    def circuit(self, kept: torch.Tensor, positions: torch.Tensor | None = None) -> Circuit:
        return Circuit(kept, self.by_layer, self.circuit_copies, positions)

    def paths(self, patched: torch.Tensor, writes: torch.Tensor) -> Paths:
        """Path patching of the sets `patched` (V, writers, readers): copies only for the readers some set reaches
        (a set of one receiver runs 2 copies a variant, not a circuit's one per reader of a block)."""
        touched = patched.any(0).any(0).cpu()  # (readers,)
        by_layer = [[r for r in readers if touched[r]] for readers in self.by_layer]
        return Paths(patched, writes, by_layer, 1 + max(1, *(len(r) for r in by_layer)))

    def run(self, deltas: Deltas, pairs: int, reference: dict[str, torch.Tensor]) -> _Running:
        """`with hooks.run(deltas, B, views):` the forward inside (of variants x deltas.copies x pairs rows, row
        (v, c, b) at (v * copies + c) * B + b) is an edge intervention; `reference`: the views a left-out edge's
        write is measured against (the corrupted run's kept views)."""
        return _Running(self, _Run(deltas, pairs, reference))

    def visit(self, spec: SiteSpec, raw: torch.Tensor) -> torch.Tensor | None:
        run = self.running
        if run is None:
            return super().visit(spec, raw)
        view = spec.get(raw)
        d = run.deltas
        rows = view.view(d.variants, d.copies, run.pairs, *view.shape[1:])
        layer = spec.layer
        new: torch.Tensor | None = None
        if spec.kind == "resid_pre":
            if layer == 0 and d.reads_writes:  # the embeddings' write: copy 0's input minus the reference run's
                run.add((rows[:, 0] - run.reference["resid_pre.0"][None].to(rows.dtype))[:, None])
            new = self._set_copies(rows, layer, ("q", "k", "v", "mlp") if self.graph.parallel else ("q", "k", "v"), run)
        elif spec.kind == "resid_mid":
            new = self._set_copies(rows, layer, ("mlp",), run)
        elif spec.kind in ("q", "k", "v"):
            # copy 0's head h from the copy that plays reader (kind, h) in its variant (copy 0 where none does)
            slots = run.slots(layer).to(rows.device)  # (V, copies - 1)
            heads = rows.shape[-2]
            plays = (self.kind_of.to(rows.device)[slots] == INPUT_KINDS.index(spec.kind))[:, :, None] & (
                self.head_of.to(rows.device)[slots][:, :, None] == torch.arange(heads, device=rows.device)
            )  # (V, copies - 1, heads)
            source = _playing_copy(plays)  # (V, heads)
            index = source.view(d.variants, 1, 1, 1, heads, 1).expand(-1, 1, *rows.shape[2:])
            new = rows.clone()
            new[:, 0] = rows.gather(1, index)[:, 0]
        elif spec.kind == "head" and d.reads_writes:
            z, reference = rows[:, 0], run.reference[f"head.{layer}"][None].to(rows.dtype)  # (V, B, T, H, d)
            if self.head_writes.post_norm:  # copy 0's writes minus the reference run's, each at its own run's scale
                writes = self.head_writes(layer, z) - self.head_writes(layer, reference)  # (H, V, B, T, D)
            else:  # linear in z: one projection of the difference
                writes = self.head_writes(layer, z - reference)
            run.add(writes.movedim(0, 1))  # (V, H, B, T, D)
        elif spec.kind == "mlp_out":
            slots = run.slots(layer).to(rows.device)
            source = _playing_copy(self.kind_of.to(rows.device)[slots] == INPUT_KINDS.index("mlp"))  # (V,)
            new = rows.clone()
            new[:, 0] = rows[torch.arange(d.variants, device=rows.device), source]
            if d.reads_writes:
                run.add((new[:, 0] - run.reference[f"mlp_out.{layer}"][None].to(rows.dtype))[:, None])
        elif spec.kind == "resid_post" and layer == self.graph.layers - 1:
            new = rows.clone()
            logits = torch.full((d.variants, 1), self.logits_reader)
            new[:, 0] = rows[:, 0] + d.of(logits, run.current())[:, 0].to(rows.dtype)
        return None if new is None else spec.put(raw, new.view(view.shape))

    def _set_copies(self, rows: torch.Tensor, layer: int, kinds: tuple[str, ...], run: _Run) -> torch.Tensor:
        """`rows` (V, C, B, T, D) with every copy set to copy 0's stream, plus its reader's delta where that reader is
        of `kinds` (the readers that read this stream)."""
        new = rows[:, :1].expand_as(rows).clone()
        slots = run.slots(layer)
        wanted = torch.tensor([INPUT_KINDS.index(k) for k in kinds])
        reads = torch.isin(self.kind_of[slots], wanted) & (slots >= 0)
        if bool(reads.any()):
            new[:, 1:] += run.deltas.of(torch.where(reads, slots, -1), run.current()).to(rows.dtype)
        return new


def _playing_copy(plays: torch.Tensor) -> torch.Tensor:
    """From `plays` (V, copies - 1, ...) bool, whether copy c + 1 plays a reader: the copy that does, 0 (copy 0 itself)
    where none does; (V, ...)."""
    copies = torch.arange(1, plays.shape[1] + 1, device=plays.device).view(1, -1, *(1,) * (plays.dim() - 2))
    return (plays * copies).amax(1)


class _Run:
    """One intervention forward's state: its deltas, copy 0's writes so far (minus the reference run's)."""

    def __init__(self, deltas: Deltas, pairs: int, reference: dict[str, torch.Tensor]) -> None:
        self.deltas, self.pairs, self.reference = deltas, pairs, reference
        self.writes: list[torch.Tensor] = []  # each (V, n, B, T, D)
        self._slots: dict[int, torch.Tensor] = {}

    def slots(self, layer: int) -> torch.Tensor:
        """(V, copies - 1) the readers the copies play at `layer` (made once per layer and forward)."""
        if layer not in self._slots:
            self._slots[layer] = self.deltas.slots(layer)
        return self._slots[layer]

    def add(self, writes: torch.Tensor) -> None:
        """Copy 0's next writers' writes (V, n, B, T, D) minus the reference run's (kept where the deltas read them)."""
        self.writes.append(writes.float())

    def current(self) -> torch.Tensor:
        return torch.cat(self.writes, dim=1) if self.writes else torch.empty(0)


class _Running:
    def __init__(self, hooks: EdgeRuns, run: _Run) -> None:
        self.hooks, self.run_ = hooks, run

    def __enter__(self) -> None:
        self.hooks.running = self.run_

    def __exit__(self, *exc: Any) -> None:
        self.hooks.running = None
