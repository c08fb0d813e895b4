"""The hook session: handle lifetime, call counting, and the captures and replacements methods ask for.

Spec hooks and their rows are runner/hooks/spec_hooks.py, tensor saving runner/hooks/tensors.py, in-place
switching runner/hooks/inplace.py, reversible model edits runner/hooks/edits.py; the session holds all their
handles in one list and removes them on one path.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from runner.dictionaries.splice import splice_hooks
from runner.errors import RunnerError
from runner.hooks.edits import Reinitialised
from runner.hooks.inplace import InplaceOff
from runner.hooks.spec_hooks import GRADIENT_KINDS, BoundHook, SpecHooks, map_tensors
from runner.hooks.tensors import TensorSaver
from runner.layers import Layer
from runner.models.lm_sites import SPLICED, layout_of
from runner.schema import HookAction, HookKind

log = logging.getLogger(__name__)


class Removable(Protocol):
    """What the session holds: a hook's RemovableHandle, the in-place switch, or a model edit."""

    def remove(self) -> None: ...


@dataclass
class Capture:
    """Per-batch copies of some layers' inputs and outputs, one list entry per call, for a method."""

    names: list[str]
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    inputs: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    active: bool = True  # off: the hooks pass everything through untouched and keep nothing

    def clear(self) -> None:
        self.outputs = {n: [] for n in self.names}
        self.inputs = {n: [] for n in self.names}

    def call_outputs(self, call: int, key: str) -> dict[str, torch.Tensor]:
        """Each layer's output at its call `call` of the last forward; a layer called fewer times is a RunnerError
        naming the config `key` that chose the call."""
        picked = {}
        for name in self.names:
            calls = self.outputs[name]
            if len(calls) <= call:
                raise RunnerError(f"Layer '{name}' was called {len(calls)} time(s) per forward; {key}={call}.")
            picked[name] = calls[call]
        return picked

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside keep nothing and pass everything through; capturing resumes on exit, also on an error."""
        was = self.active
        self.active = False
        try:
            yield
        finally:
            self.active = was


@dataclass
class Replacement:
    """A module output swapped in for activation patching: while `value` is set, the module's output at
    call `call` is replaced by it (its batch may be larger than the input's: later layers broadcast)."""

    name: str
    call: int = 0
    value: torch.Tensor | None = None


class HookSession:
    """Registers hooks from specs and captures for methods; removes them all on exit."""

    def __init__(self, model: nn.Module, hooks: list[BoundHook], tensor_dir: Path | None = None) -> None:
        self.model = model
        self.hooks = hooks
        self._handles: list[Removable] = []
        self._counted: set[str] = set()
        self._calls: dict[str, int] = defaultdict(int)  # shared with the spec hooks, which read it per call
        self._captures: list[Capture] = []
        self._tensors = TensorSaver(tensor_dir)
        self._spec_hooks = SpecHooks(self._calls, self._tensors)

    # ---- lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> HookSession:
        try:
            self._splice_dictionaries()
            if any(h.spec.kind is HookKind.backward for h in self.hooks):
                self._disable_inplace()
            for bound in self.hooks:
                for name, module in bound.layers:
                    self._count_calls(name, module)
                    self._spec_hooks.register(bound.spec, name, module, self._handles)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every handle (hooks and the in-place switch), drop every tensor held."""
        for handle in reversed(list(self._handles)):  # last in, first out: the in-place switch goes last
            handle.remove()
        self._handles.clear()
        for capture in self._captures:
            capture.clear()
        self._spec_hooks.clear()
        self._tensors.clear()

    def _splice_dictionaries(self) -> None:
        """Route each site of a language model that has a sparse dictionary spliced in through it (first, before any
        other hook on those modules: every other hook sees the spliced model)."""
        if not any(hasattr(m, SPLICED) for m in self.model.modules()):
            return
        for module, hook, pre in splice_hooks(self.model, layout_of(self.model)):
            self.add_hook(module, hook, pre=pre)

    @property
    def modified_modules(self) -> set[str]:
        """Names of the modules a user's hook changes values at (any action but record): a method that computes past
        them by other means than the modules' own calls (patching's cones) must not skip them."""
        return {name for h in self.hooks if h.spec.action is not HookAction.record for name, _ in h.layers}

    @property
    def needs_input_grad(self) -> bool:
        """Whether gradients must flow all the way to the input, so backward and tensor hooks fire everywhere."""
        return any(h.spec.kind in GRADIENT_KINDS for h in self.hooks)

    def _disable_inplace(self) -> None:
        switch = InplaceOff(self.model)
        self._handles.append(switch)
        if switch.modules:
            log.info("backward hooks: in-place ops turned off on %d modules for this run", len(switch.modules))

    # ---- per batch ------------------------------------------------------------------------------
    def begin_batch(self, batch_size: int, first_index: int) -> None:
        """Start a batch of `batch_size` samples from data set index `first_index`.

        The first index, not a batch number, keys the batch: an OOM split's halves keep their samples' noise
        and get sidecar files of their own.
        """
        self._calls.clear()
        self._spec_hooks.begin_batch(batch_size, first_index)
        self._tensors.begin_batch(first_index)
        for capture in self._captures:
            capture.clear()

    def end_batch(self) -> dict[str, Any] | None:
        """This batch's recorded rows as columns (stats still on the device), then forget them."""
        self._tensors.flush()
        for capture in self._captures:  # also when nothing was recorded: an OOM retry must not hold them
            capture.clear()
        return self._spec_hooks.take_rows()

    def new_forward(self) -> None:
        """Start another forward within the batch: call indices count from 0 again (patching runs many)."""
        self._calls.clear()
        self._spec_hooks.new_forward()

    @contextmanager
    def recording_paused(self) -> Iterator[None]:
        """The runner's own forwards inside (metrics', faithfulness', Score-CAM's masked inputs, MPRT's steps):
        `record` hooks keep nothing and call counts are restored on exit, also on an error, so the `hooks` table
        holds the user's forward only. Modifying hooks stay on: the model evaluated is the model explained.
        (zennit's `Composite.inactive()` is the model for this.)"""
        was, calls = self._spec_hooks.recording, dict(self._calls)
        self._spec_hooks.recording = False
        try:
            yield
        finally:
            self._spec_hooks.recording = was
            self._calls.clear()
            self._calls.update(calls)

    def explain(self, error: BaseException) -> RunnerError | None:
        """A clear message for a torch error the hooks caused (None when they did not cause it)."""
        return self._spec_hooks.explain(error, self.model)

    # ---- captures and replacements for methods --------------------------------------------------
    def capture(self, layers: list[Layer], differentiable: bool = True, inputs: bool = False) -> Capture:
        """Keep each layer's output per call (as a tensor gradients can be taken to), and optionally its inputs.

        The model continues on a clone of the output, so an in-place op after the layer cannot
        overwrite what was captured (VGG's conv -> ReLU(inplace=True)).
        """
        capture = Capture([n for n, _ in layers])
        capture.clear()
        self._captures.append(capture)
        for name, module in layers:
            self._count_calls(name, module)
            if inputs:
                self._handles.append(module.register_forward_pre_hook(self._input_keeper(capture, name)))
            self._handles.append(module.register_forward_hook(self._output_keeper(capture, name, differentiable)))
        return capture

    @staticmethod
    def _input_keeper(capture: Capture, name: str) -> Callable[..., None]:
        def keep(module: nn.Module, args: tuple[Any, ...]) -> None:
            if capture.active:
                capture.inputs[name].append(map_tensors(args, lambda t: t.detach().clone()))

        return keep

    @staticmethod
    def _output_keeper(capture: Capture, name: str, differentiable: bool) -> Callable[..., Any]:
        def keep(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not capture.active:
                return None
            if not torch.is_tensor(output):
                raise RunnerError(
                    f"Layer '{name}' ({type(module).__name__}) returns {type(output).__name__}, not a tensor;"
                    " pick a layer whose output is one tensor."
                )
            act = output
            if differentiable and not act.requires_grad and torch.is_grad_enabled():
                act = act.detach().requires_grad_()  # frozen weights: start the graph here, truncating backward
            capture.outputs[name].append(act)
            return act.clone()

        return keep

    def replace(self, layers: list[Layer], call: int = 0) -> dict[str, Replacement]:
        """A replacement per layer, inactive until its `value` is set (activation patching)."""
        replacements = {}
        for name, module in layers:
            self._count_calls(name, module)
            replacement = Replacement(name, call)
            self._handles.append(module.register_forward_hook(self._replacer(replacement)))
            replacements[name] = replacement
        return replacements

    def _replacer(self, replacement: Replacement) -> Callable[..., Any]:
        calls = self._calls

        def swap(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if replacement.value is None or calls[replacement.name] - 1 != replacement.call:
                return None
            return replacement.value

        return swap

    def add_hook(self, module: nn.Module, hook: Callable[..., Any], pre: bool, always_call: bool = False) -> Removable:
        """Register a method's own hook on `module`, owned by the session (removed on exit, also after an error):
        a forward pre-hook `(module, args, kwargs)` when `pre`, else a forward hook `(module, args, kwargs, output)`.
        The language-model sites (runner/models/lm_sites.py) are read and replaced through these. `always_call`: the
        forward hook runs also when the forward raises (it undoes what the pre-hook set up)."""
        if pre:
            handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            handle = module.register_forward_hook(hook, with_kwargs=True, always_call=always_call)
        self._handles.append(handle)
        return handle

    def own(self, handle: Removable) -> Removable:
        """Make `handle.remove()` part of closing the session: an undo that must run also after an interrupt
        (KeyboardInterrupt skips torch's `always_call` forward hooks, which catch Exception only)."""
        self._handles.append(handle)
        return handle

    # ---- reversible model edits ---------------------------------------------------------------------
    def reinitialise(self, modules: list[nn.Module], seed: int) -> Reinitialised:
        """Re-initialise `modules` in place, in order, after seeding a forked random state with `seed` (each by its
        `reset_parameters`; the run's random state is untouched). The edit's `remove()` restores the original
        values; whatever is still in place when the session closes is restored then, also after an error."""
        edit = Reinitialised(modules, seed, on_remove=self._forget)
        self._handles.append(edit)
        return edit

    def _forget(self, handle: Removable) -> None:
        """Drop a handle removed before the session closes (MPRT makes and removes edits at every step)."""
        self._handles = [h for h in self._handles if h is not handle]

    # ---- call counting --------------------------------------------------------------------------
    def _count_calls(self, name: str, module: nn.Module) -> None:
        """Count `module`'s calls per forward with a pre-hook that runs before every other hook on it."""
        if name in self._counted:
            return
        self._counted.add(name)
        calls = self._calls

        def count(module: nn.Module, args: tuple[Any, ...]) -> None:
            calls[name] += 1

        self._handles.append(module.register_forward_pre_hook(count, prepend=True))


def count_hooks(model: nn.Module) -> int:
    """How many module hooks are registered anywhere in the model (0 after a clean run)."""
    total = 0
    for module in model.modules():
        total += len(module._forward_hooks) + len(module._forward_pre_hooks)
        total += len(module._backward_hooks) + len(getattr(module, "_backward_pre_hooks", {}))
    return total
