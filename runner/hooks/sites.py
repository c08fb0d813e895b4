"""The hooks on a causal LM's sites (the LM twin of spec_hooks.py): keep each site's tensor, or patch cells into it.

One hook per site module, registered once through the hook session, does one of three things per forward: keep the
site's tensor (a base run), replace some rows' cells from a source run's tensor (a patched run), or nothing. A
patched run stacks many variants in the batch: C cells x B pairs rows, row c * B + b being pair b with cell c
patched, so one forward measures C cells of every pair. Cells of a site at one position write only that position
(and head); the causal mask then leaves every earlier position as the receiving run had it.

`resid_mid` is the residual stream between attention and MLP, which both the MLP's branch and the skip connection
read: it is kept and replaced at the attention's output (`SiteSpec.stream`), as the block's input (kept by a
pre-hook on the block) plus that output, and a replacement is written back as the attention's output plus
(new - stream), exact zeros wherever nothing is patched.

A site whose tensor the forward changes in place after the hook (`SiteSpec.mutated`: Falcon's parallel blocks add the
attention's output into the MLP's output tensor) is kept as a copy, and traced through a copy passed on in its place.

A site whose module runs on the positions flattened (OPT's fc2: (batch x positions, d) rows; `SiteSpec.rows_of`) is
viewed with the (batch, positions) of its block's input, kept by a pre-hook on the block, and flattened back.

The `pattern` site lives inside the attention's forward: a pre-hook on the attention module enters a torch function
mode that sees the one softmax eager attention computes (the same call in GPT-2, Llama and GPT-NeoX, transformers
4.x and 5.x) and keeps or replaces its output; the module's forward hook leaves the mode, also after an error (and
the hook session's close, or the next forward, after an interrupt, which torch's forward hooks do not see).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.models.lm_sites import SiteSpec, read_site, with_output, with_site

SOFTMAX = {torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax, torch.special.softmax}


@dataclass(frozen=True)
class Cell:
    """What one variant patches: a site of a layer, at one position (None: all) and one head (None: the whole)."""

    kind: str
    layer: int
    position: int | None
    head: int | None


@dataclass
class _Patch:
    """One site module's part of a patched run: rows of the stacked batch, their pair, position and head."""

    rows: torch.Tensor  # (N,) rows of the stacked batch
    pairs: torch.Tensor  # (N,) the pair (row of the source tensor) each row takes its value from
    positions: torch.Tensor | None  # (N,) or None: all positions
    heads: torch.Tensor | None  # (N,) or None: the whole site


class SiteHooks:
    """Keeps or replaces the sites `specs` on every forward, as `mode` says."""

    def __init__(self, model: nn.Module, specs: Sequence[SiteSpec], session: HookSession) -> None:
        self.specs = {s.name: s for s in specs}
        self.kept: dict[str, torch.Tensor] = {}  # site name -> (B, T, ...) view of the last kept run
        self.keeping = False
        self.tracing = False  # a kept run whose views stay in the autograd graph (attribution patching)
        # site name -> (rows (N,), values (N, T, ...)): a kept run's rows of the site given these values, which the
        # rest of the forward reads (and which, traced, pass no gradient to what computed the site)
        self.fixed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sources: dict[str, torch.Tensor] = {}  # site name -> (B, T, ...) source views of a patched run
        self.patches: dict[str, _Patch] = {}
        self.bases: dict[str, torch.Tensor] = {}  # stream site name -> this forward's (B, T, D) block input
        self.shapes: dict[str, tuple[int, int]] = {}  # rows site name -> this forward's (B, T)
        modules = dict(model.named_modules())
        for spec in specs:
            module = modules[spec.module]
            if spec.stream is not None:
                session.add_hook(modules[spec.stream.base], self._base_hook(spec), pre=True)
                session.add_hook(modules[spec.stream.branch], self._stream_hook(spec), pre=False)
            elif spec.where == "softmax":
                mode = _SoftmaxSite(self, spec)
                session.add_hook(module, mode.enter, pre=True)
                session.add_hook(module, mode.leave, pre=False, always_call=True)
                session.own(mode)  # an interrupt inside the module skips `leave`: the session's close exits it
            elif spec.where == "input":
                session.add_hook(module, self._pre_hook(spec), pre=True)
            else:
                if spec.rows_of:
                    session.add_hook(modules[spec.rows_of], self._shape_hook(spec), pre=True)
                session.add_hook(module, self._hook(spec), pre=False)

    def _pre_hook(self, spec: SiteSpec) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            new = self.visit(spec, read_site(spec, args, kwargs, None))
            return None if new is None else with_site(spec, args, kwargs, None, new)

        return hook

    def _hook(self, spec: SiteSpec) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            raw = read_site(spec, args, kwargs, output)
            if spec.rows_of:  # (B x T, ...) rows: viewed with the positions as every site's view has them
                raw = raw.view(*self.shapes[spec.name], *raw.shape[1:])
            new = self.visit(spec, raw)
            if new is not None and spec.rows_of:
                new = new.flatten(0, 1)
            return None if new is None else with_site(spec, args, kwargs, output, new)

        return hook

    def _shape_hook(self, spec: SiteSpec) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.shapes[spec.name] = (hidden.shape[0], hidden.shape[1])

        return hook

    def _active(self, spec: SiteSpec) -> bool:
        return self.keeping or spec.name in self.patches

    def _base_hook(self, spec: SiteSpec) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._active(spec):
                self.bases[spec.name] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _stream_hook(self, spec: SiteSpec) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if not self._active(spec):
                return None
            base = self.bases.pop(spec.name)
            branch = output[0] if isinstance(output, tuple) else output
            stream = base + branch  # what the block adds: the input of its mid norm, bit for bit
            if self.keeping and self.tracing:
                # The branch's output becomes (view - base): the block's sum is then `view` (up to rounding), read
                # by the MLP and the skip connection alike, so dM/dview is the stream's total derivative; the
                # gradient of upstream sites reaches them through `view` only (the two `base` terms cancel).
                view = stream if stream.requires_grad else stream.detach().requires_grad_(True)
                self.kept[spec.name] = view
                return with_output(output, view - base)
            new = self.visit(spec, stream)
            return None if new is None else with_output(output, branch + (new - stream))

        return hook

    def visit(self, spec: SiteSpec, raw: torch.Tensor) -> torch.Tensor | None:
        """Keep the site's tensor `raw`, or return it with this run's cells patched in (None: leave it)."""
        if self.keeping:
            view = spec.get(raw)
            fixed = self.fixed.get(spec.name)
            if fixed is not None:
                rows, values = fixed
                view = view.index_copy(0, rows.to(view.device), values.to(view.device, view.dtype))
            if not self.tracing:
                # A tensor the forward changes in place later (SiteSpec.mutated) is kept as it is now: a copy.
                self.kept[spec.name] = view.detach().clone() if spec.mutated else view.detach()
                return None if fixed is None else spec.put(raw, view)
            # Passed on in the site's place, so the metric's gradient w.r.t. this very tensor exists; a view that
            # nothing upstream makes require grad (frozen weights, token ids) becomes a leaf that does.
            if not view.requires_grad:
                view = view.detach().requires_grad_(True)
            self.kept[spec.name] = view
            passed = spec.put(raw, view)
            # mutated: the forward gets a copy to change in place, so the kept tensor keeps its values (and a leaf is
            # never changed in place, which autograd refuses); the gradient reaches it through the copy
            return passed.clone() if spec.mutated else passed
        patch = self.patches.get(spec.name)
        if patch is None:
            return None
        view = spec.get(raw)
        new = view.clone()
        source = self.sources[spec.name].to(new.device, new.dtype)  # a device-mapped model: the module's device
        rows, pairs = patch.rows.to(new.device), patch.pairs.to(new.device)
        if patch.positions is None:
            if patch.heads is None:
                new[rows] = source[pairs]
            else:
                heads = patch.heads.to(new.device)
                new[rows, :, heads] = source[pairs, :, heads]
        else:
            positions = patch.positions.to(new.device)
            if patch.heads is None:
                new[rows, positions] = source[pairs, positions]
            else:
                heads = patch.heads.to(new.device)
                new[rows, positions, heads] = source[pairs, positions, heads]
        return spec.put(raw, new)

    def keep(self, grad: bool = False, fixed: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> _Keeping:
        """`with hooks.keep():` the forward inside keeps every site's tensor in `kept`; `grad=True`: in the autograd
        graph (run it with grad enabled), each tensor the one the rest of the forward reads; `fixed` (site name ->
        (rows (N,), values (N, T, ...))): those rows of those sites given those values (kept as given)."""
        fixed = fixed or {}
        refused = [name for name in fixed if name not in self.specs or self.specs[name].stream is not None]
        if refused:
            raise RunnerError(f"Sites {refused} cannot be fixed in a kept run: not hooked here, or a stream sum.")
        return _Keeping(self, grad, fixed)

    def plan(self, cells: Sequence[Cell], pairs: int, sources: dict[str, torch.Tensor], start: int = 0) -> None:
        """Set up a patched run of `cells` (cell c of pair b at row c * pairs + b) from `sources` (site name ->
        (pairs, T, ...) views of the source run); `start`: the run reads positions `start`.. only (the prefix
        reused, prefix.py), so the sources and the cells' positions are cut and shifted to match."""
        grouped: dict[str, list[tuple[int, Cell]]] = {}
        for c, cell in enumerate(cells):
            grouped.setdefault(f"{cell.kind}.{cell.layer}", []).append((c, cell))
        # only the sites this run patches are cut to its positions
        self.sources = {name: sources[name] if start == 0 else sources[name][:, start:] for name in grouped}
        self.patches = {}
        # the index tensors are made on the host with numpy, one per site: their cost does not grow with the cells
        for name, members in grouped.items():
            variant = np.array([c for c, _ in members])
            rows = (variant[:, None] * pairs + np.arange(pairs)).reshape(-1)  # (N,) cell c's pairs at c * pairs + b
            pair_ids = np.tile(np.arange(pairs), len(members))
            first = members[0][1]
            positions = (
                None if first.position is None
                else np.repeat(np.array([cell.position - start for _, cell in members]), pairs)
            )  # fmt: skip
            heads = None if first.head is None else np.repeat(np.array([cell.head for _, cell in members]), pairs)
            self.patches[name] = _Patch(
                *(None if a is None else torch.from_numpy(a) for a in (rows, pair_ids, positions, heads))
            )

    def clear(self) -> None:
        self.patches, self.sources, self.kept, self.bases = {}, {}, {}, {}


class _SoftmaxSite(TorchFunctionMode):
    """The attention pattern of one attention module: the output of the one softmax its forward computes."""

    def __init__(self, hooks: SiteHooks, spec: SiteSpec) -> None:
        super().__init__()
        self.hooks, self.spec, self.seen, self.inside = hooks, spec, 0, False

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.remove()  # still inside: an earlier forward was interrupted before `leave`
        if self.hooks.keeping or self.spec.name in self.hooks.patches:  # other runs pay nothing
            self.seen, self.inside = 0, True
            self.__enter__()

    def remove(self) -> None:
        """Leave the mode if this site is inside it (torch's mode stack keeps it, and the model, alive otherwise)."""
        if self.inside:
            self.inside = False
            self.__exit__(None, None, None)

    def leave(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self.inside:
            return
        self.remove()
        if self.seen != 1:
            raise RunnerError(
                f"Site {self.spec.name}: {self.spec.module} computed {self.seen} softmaxes in one forward, not the one"
                " of eager attention; the pattern site needs model.attn_implementation=eager."
            )

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SOFTMAX:
            self.seen += 1
            new = self.hooks.visit(self.spec, out)
            return out if new is None else new
        return out


class _Keeping:
    def __init__(self, hooks: SiteHooks, grad: bool, fixed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.hooks, self.grad, self.fixed = hooks, grad, fixed

    def __enter__(self) -> None:
        self.hooks.kept = {}
        self.hooks.keeping, self.hooks.tracing, self.hooks.fixed = True, self.grad, self.fixed

    def __exit__(self, *exc: object) -> None:
        self.hooks.keeping = self.hooks.tracing = False
        self.hooks.fixed = {}
