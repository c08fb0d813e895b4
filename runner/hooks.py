"""The hook session: the one owner of every hook handle in a run.

The runner and its methods register no hook themselves; they ask the session, which
  - registers the four kinds from specs (pre, forward, backward, tensor), each with an action
    (record statistics, or modify the value in flight: scale, zero, add_noise, clamp);
  - counts calls per module per batch, so a module called twice per forward (EfficientNet's shared
    `_swish`) yields rows with call index 0 and 1;
  - keeps what in-place ops would overwrite intact: statistics are taken inside the hook, saved
    tensors are cloned, captured activations are handed on to the model as a clone;
  - turns `inplace=True` off on the model's modules while full backward hooks are registered
    (torch refuses an in-place op on their outputs), and restores it afterwards;
  - keeps state per batch only (`end_batch` returns it and drops it);
  - draws `add_noise` noise per sample, keyed by (hook seed, sample index, layer, role, call), so a sample's
    noise does not depend on the batch size, an OOM split or a resume (runner/randomness.py);
  - removes every handle in `__exit__`, also when the run raised.

One exception: `method=captum` hands a layer to captum, whose `attribute` call registers its own hooks
on it and removes them (in a `finally`) before it returns. Those hooks are not the session's, and none
outlives the call (tests/test_experiments.py checks with `count_hooks`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.errors import RunnerError
from runner.layers import Layer
from runner.randomness import per_sample_normal
from runner.schema import HookAction, HookKind, HookSpec, check_hook_spec
from runner.stats import STAT_NAMES, per_sample_stats, stat_fields
from runner.tables import declare

log = logging.getLogger(__name__)

GRADIENT_KINDS = (HookKind.backward, HookKind.tensor)


@dataclass
class BoundHook:
    """A hook spec with its layers resolved."""

    spec: HookSpec
    layers: list[Layer]


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


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every tensor in a (possibly nested) tuple/list, leaving other values alone."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def _roles(prefix: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """(role, tensor) pairs: `output` for a lone tensor, `output.0`, `output.1`, ... for a tuple."""
    if torch.is_tensor(value):
        return [(prefix, value)]
    if isinstance(value, (tuple, list)):
        return [(f"{prefix}.{i}", v) for i, v in enumerate(value) if torch.is_tensor(v)]
    return []


# A modifier gets the tensor and a purpose string naming where it is (layer, role, call, position).
Modifier = Callable[[torch.Tensor, str], torch.Tensor]


def keyed_noise(t: torch.Tensor, seed: int, sample_indices: Sequence[int], purpose: str) -> torch.Tensor:
    """Standard normal noise shaped like `t`, the same for a sample whatever batch it is in.

    Rows are samples when t's first dimension is the batch (or a multiple k of it: k copies, as patching's
    clean + corrupted forward; copy j of sample i is keyed by i and j). Any other tensor (no batch dimension,
    a perturbed chunk of one sample) is keyed by the batch's first sample index and t's shape.
    """
    n = len(sample_indices)
    rows = t.shape[0] if t.dim() > 0 else 0
    if n and rows and rows % n == 0:
        copies = [
            per_sample_normal(t.shape[1:], seed, sample_indices, f"{purpose}|copy{j}")  # (n, *t.shape[1:])
            for j in range(rows // n)
        ]
        return torch.cat(copies).to(device=t.device, dtype=t.dtype)  # (rows, *t.shape[1:])
    first = sample_indices[0] if n else 0
    shape = "x".join(map(str, t.shape))
    whole = per_sample_normal(t.shape, seed, [first], f"{purpose}|whole{shape}")  # (1, *t.shape)
    return whole[0].to(device=t.device, dtype=t.dtype)


def _modifier(spec: HookSpec, sample_indices: Callable[[], Sequence[int]]) -> Modifier:
    """The function a modifying hook applies to each tensor it sees; `sample_indices` gives the batch's samples."""
    action = spec.action
    if action is HookAction.scale:
        return lambda t, where: t * spec.factor
    if action is HookAction.zero:
        return lambda t, where: torch.zeros_like(t)
    check_hook_spec(spec, f"A `{action.value}` hook")  # library callers skip the config's validation
    if action is HookAction.clamp:
        return lambda t, where: t.clamp(min=spec.min, max=spec.max)
    if action is HookAction.add_noise:

        def add_noise(t: torch.Tensor, where: str) -> torch.Tensor:
            return t + spec.std * keyed_noise(t, spec.seed, sample_indices(), f"add_noise|{where}")

        return add_noise
    raise RunnerError(f"Hook action '{action}' is not a modification.")


# The `hooks` table's own columns: the key of each recorded tensor (`HookSession._record`), then its statistics.
HOOKS_SCHEMA = declare(
    "hooks",
    [
        pa.field("layer", pa.string()),
        pa.field("module_type", pa.string()),
        pa.field("hook", pa.string()),  # pre | forward | backward | tensor
        pa.field("role", pa.string()),  # input.0, output, grad_input.0, grad_output.0, grad
        pa.field("call", pa.int32()),
        pa.field("shape", pa.string()),  # of one sample, e.g. 8x4x4
        pa.field("tensor_file", pa.string()),  # null unless save_tensors
        pa.field("tensor_key", pa.string()),
        *stat_fields(),
    ],
)


class HookSession:
    """Registers hooks from specs and captures for methods; removes them all on exit."""

    def __init__(self, model: nn.Module, hooks: list[BoundHook], tensor_dir: Path | None = None) -> None:
        self.model = model
        self.hooks = hooks
        self.tensor_dir = tensor_dir
        self._handles: list[RemovableHandle] = []
        self._counted: set[str] = set()
        self._calls: dict[str, int] = defaultdict(int)
        self._backward_seen: dict[str, int] = defaultdict(int)
        self._inplace_restore: list[nn.Module] = []
        self._captures: list[Capture] = []
        self._batch_size = 0
        self._first_index = -1
        self._sample_indices: list[int] = []  # data set indices of the current batch's samples
        self._backward_ran: list[str] = []  # backward-hooked modules in the order their forward ran (diagnosis)
        self._records: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        self._saved: dict[str, torch.Tensor] = {}

    # ---- lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> HookSession:
        try:
            if any(h.spec.kind is HookKind.backward for h in self.hooks):
                self._disable_inplace()
            for bound in self.hooks:
                for name, module in bound.layers:
                    self._register(bound.spec, name, module)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every handle, restore in-place flags, drop every tensor held."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        restore_inplace(self._inplace_restore)
        self._inplace_restore.clear()
        for capture in self._captures:
            capture.clear()
        self._records.clear()
        self._saved.clear()

    @property
    def needs_input_grad(self) -> bool:
        """Whether gradients must flow all the way to the input, so backward and tensor hooks fire everywhere."""
        return any(h.spec.kind in GRADIENT_KINDS for h in self.hooks)

    def _disable_inplace(self) -> None:
        self._inplace_restore = disable_inplace(self.model)
        if self._inplace_restore:
            log.info("backward hooks: in-place ops turned off on %d modules for this run", len(self._inplace_restore))

    # ---- per batch ------------------------------------------------------------------------------
    def begin_batch(self, batch_size: int, first_index: int) -> None:
        """Start a batch of `batch_size` samples from data set index `first_index`.

        The first index, not a batch number, keys the batch: an OOM split's halves keep their samples' noise
        and get sidecar files of their own.
        """
        self._batch_size = batch_size
        self._first_index = first_index
        self._sample_indices = list(range(first_index, first_index + batch_size))
        self._calls.clear()
        self._backward_seen.clear()
        self._backward_ran.clear()
        self._records.clear()
        self._saved.clear()
        for capture in self._captures:
            capture.clear()

    def end_batch(self) -> dict[str, Any] | None:
        """This batch's recorded rows as columns (stats still on the device), then forget them."""
        if self.tensor_dir is not None and self._saved:
            self._write_tensors()
        if not self._records:
            return None
        ids: dict[str, list[Any]] = defaultdict(list)
        for key, _, index in self._records:
            for column, value in key.items():
                ids[column].extend([value] * len(index))
        stats = torch.cat([s for _, s, _ in self._records])  # (rows, len(STAT_NAMES))
        columns: dict[str, Any] = dict(ids)
        columns["sample_index"] = torch.cat([i for _, _, i in self._records])
        columns["stats"] = stats
        self._records.clear()
        for capture in self._captures:
            capture.clear()
        return columns

    # ---- captures for methods ---------------------------------------------------------------------
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
        def swap(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if replacement.value is None or self._calls[replacement.name] - 1 != replacement.call:
                return None
            return replacement.value

        return swap

    def new_forward(self) -> None:
        """Start another forward within the batch: call indices count from 0 again (patching runs many)."""
        self._calls.clear()
        self._backward_seen.clear()
        self._backward_ran.clear()

    def explain(self, error: BaseException) -> RunnerError | None:
        """A clear message for a torch error the hooks caused (None when they did not cause it)."""
        text = str(error)
        if not (isinstance(error, RuntimeError) and "BackwardHookFunction" in text and "inplace" in text):
            return None
        if not self._backward_ran:
            return RunnerError(
                "A `backward` hook's module output is changed in place later in the model, which torch refuses for"
                " full backward hooks. Use `kind: tensor` on that layer (the gradient of its output), or hook"
                " another layer."
            )
        name = self._backward_ran[-1]
        module = self.model.get_submodule(name)
        others = sorted(set(self._backward_ran[:-1]) - {name})
        also = f" (or another backward-hooked layer that ran before it: {', '.join(others)})" if others else ""
        return RunnerError(
            f"A `backward` hook on '{name}' ({type(module).__name__}){also} cannot run: the model changes that"
            " layer's output in place afterwards (as `out += identity` in a ResNet block), which torch refuses for"
            f" full backward hooks. Use `kind: tensor` on '{name}' (the gradient of its output, the same as"
            " grad_output), or hook a layer whose output is not modified in place (its parent block, or the layer"
            " before it)."
        )

    # ---- hooks from specs -------------------------------------------------------------------------
    def _count_calls(self, name: str, module: nn.Module) -> None:
        if name in self._counted:
            return
        self._counted.add(name)

        def count(module: nn.Module, args: tuple[Any, ...]) -> None:
            self._calls[name] += 1

        self._handles.append(module.register_forward_pre_hook(count, prepend=True))

    def _register(self, spec: HookSpec, name: str, module: nn.Module) -> None:
        self._count_calls(name, module)
        modify = None if spec.action is HookAction.record else _modifier(spec, lambda: self._sample_indices)
        kind = spec.kind

        def handle(role_prefix: str, value: Any, call: int) -> Any:
            """Record or modify `value`; return the replacement, or None to leave it as it is."""
            if modify is None:
                for role, tensor in _roles(role_prefix, value):
                    self._record(spec, name, module, role, call, tensor)
                return None
            position = iter(range(1 << 30))  # which tensor of a tuple: each gets its own noise
            return map_tensors(value, lambda t: modify(t, f"{name}|{kind.value}|{role_prefix}|{call}|{next(position)}"))

        if kind is HookKind.pre:

            def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
                return handle("input", args, self._calls[name] - 1)

            self._handles.append(module.register_forward_pre_hook(pre_hook))
        elif kind is HookKind.forward:

            def forward_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
                return handle("output", output, self._calls[name] - 1)

            self._handles.append(module.register_forward_hook(forward_hook))
        elif kind is HookKind.backward:

            def backward_hook(module: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> Any:
                # Backward runs in reverse: the first backward call belongs to the last forward call.
                call = self._calls[name] - 1 - self._backward_seen[name]
                self._backward_seen[name] += 1
                if modify is None:
                    handle("grad_output", tuple(grad_output), call)
                return handle("grad_input", tuple(grad_input), call)

            self._handles.append(module.register_full_backward_hook(backward_hook))

            def note_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                self._backward_ran.append(name)  # for `explain`: an in-place error names this layer

            self._handles.append(module.register_forward_hook(note_forward))
        elif kind is HookKind.tensor:

            def tensor_hook_installer(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                call = self._calls[name] - 1
                for role, tensor in _roles("grad", output):
                    if tensor.requires_grad:
                        # Registered before any in-place successor runs: torch then hands this hook the
                        # gradient with respect to the value as the module produced it.
                        tensor.register_hook(lambda g, role=role, call=call: handle(role, g, call))

            self._handles.append(module.register_forward_hook(tensor_hook_installer))
        else:  # pragma: no cover - the schema's Enum makes this unreachable
            raise RunnerError(f"Unknown hook kind '{kind}'. Use one of: {', '.join(k.value for k in HookKind)}.")

    def _record(self, spec: HookSpec, name: str, module: nn.Module, role: str, call: int, tensor: torch.Tensor) -> None:
        stats, per_sample = per_sample_stats(tensor, self._batch_size)
        # Per-sample rows carry the shape of one sample; a tensor without a batch dimension, its own.
        shape = tensor.shape[1:] if per_sample else tensor.shape
        index = torch.arange(self._batch_size) if per_sample else torch.tensor([-1])
        key = {
            "layer": name,
            "module_type": type(module).__name__,
            "hook": spec.kind.value,
            "role": role,
            "call": call,
            "shape": "x".join(map(str, shape)),
            "tensor_file": None,
            "tensor_key": None,
        }
        if spec.save_tensors:
            tensor_key = f"{name}|{spec.kind.value}|{role}|{call}"
            self._saved[tensor_key] = tensor.detach().clone()  # a clone: a later in-place op must not change it
            key["tensor_file"] = self._tensor_file_name()
            key["tensor_key"] = tensor_key
        self._records.append((key, stats, index))

    def _tensor_file_name(self) -> str:
        return f"batch-{self._first_index:06d}.safetensors"

    def _write_tensors(self) -> None:
        from safetensors.torch import save_file

        assert self.tensor_dir is not None
        self.tensor_dir.mkdir(parents=True, exist_ok=True)
        path = self.tensor_dir / self._tensor_file_name()
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous().cpu() for k, v in self._saved.items()}, str(tmp))
        tmp.replace(path)  # atomic: a killed run leaves no half file under the final name
        self._saved.clear()


def disable_inplace(model: nn.Module) -> list[nn.Module]:
    """Set `inplace=False` on every module that has it on; return them, for restoring."""
    switched = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for module in switched:
        module.inplace = False  # type: ignore[assignment]
    return switched


def restore_inplace(modules: list[nn.Module]) -> None:
    """Undo `disable_inplace`."""
    for module in modules:
        module.inplace = True  # type: ignore[assignment]


@contextmanager
def inplace_disabled(model: nn.Module) -> Iterator[None]:
    """In-place ops off inside the block (same values, one more buffer each), restored after, also on error."""
    switched = disable_inplace(model)
    try:
        yield
    finally:
        restore_inplace(switched)


def count_hooks(model: nn.Module) -> int:
    """How many module hooks are registered anywhere in the model (0 after a clean run)."""
    total = 0
    for module in model.modules():
        total += len(module._forward_hooks) + len(module._forward_pre_hooks)
        total += len(module._backward_hooks) + len(getattr(module, "_backward_pre_hooks", {}))
    return total


__all__ = ["STAT_NAMES", "BoundHook", "Capture", "HookSession", "Replacement", "count_hooks", "map_tensors"]
