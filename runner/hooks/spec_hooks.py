"""Spec hooks -> rows: the hooks a config's `hooks:` list asks for, and the `hooks` table they fill.

Each spec registers one of the four kinds (pre, forward, backward, tensor) on its layers with one action:
`record` takes per-sample statistics inside the hook (before any in-place op can overwrite the tensor) and keeps
them on the device until the batch ends; `scale`, `zero`, `add_noise` and `clamp` change the value in flight.
`add_noise` noise is drawn per sample, keyed by (hook seed, sample index, layer, role, call), so a sample's noise
does not depend on the batch size, an OOM split or a resume (runner/randomness.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.errors import RunnerError
from runner.fused_stats import fused_stats
from runner.hooks.tensors import TensorSaver
from runner.layers import Layer
from runner.randomness import per_sample_normal
from runner.schema import HookAction, HookKind, HookSpec, check_hook_spec
from runner.stats import stat_fields
from runner.tables import Presentation, declare

GRADIENT_KINDS = (HookKind.backward, HookKind.tensor)

# The `hooks` table's own columns: the key of each recorded tensor (`SpecHooks.record`), then its statistics.
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
    Presentation(keys=("hook", "role", "call"), values=("mean", "std", "min", "max", "frac_zero")),
)


@dataclass
class BoundHook:
    """A hook spec with its layers resolved."""

    spec: HookSpec
    layers: list[Layer]


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


class SpecHooks:
    """Registers hooks from specs and turns what the `record` ones see into the batch's `hooks` rows.

    The session owns the handles and counts calls; this reads the counts (`calls`, the session's dict, shared
    so a hook reads it directly) to label each row with its call index.
    """

    def __init__(self, calls: Mapping[str, int], tensors: TensorSaver) -> None:
        self.calls = calls  # module name -> forward calls so far in the current forward
        self.tensors = tensors
        self.batch_size = 0
        self.sample_indices: list[int] = []  # data set indices of the current batch's samples
        self.backward_seen: dict[str, int] = defaultdict(int)
        self.backward_ran: list[str] = []  # backward-hooked modules in the order their forward ran (diagnosis)
        self.records: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        self.recording = True  # off inside the runner's own forwards (HookSession.recording_paused)

    def begin_batch(self, batch_size: int, first_index: int) -> None:
        """Start a batch of `batch_size` samples from data set index `first_index`; drop the last one's rows."""
        self.batch_size = batch_size
        self.sample_indices = list(range(first_index, first_index + batch_size))
        self.new_forward()
        self.records.clear()

    def new_forward(self) -> None:
        """Start another forward within the batch (the session resets the call counts)."""
        self.backward_seen.clear()
        self.backward_ran.clear()

    def clear(self) -> None:
        """Drop every recorded row."""
        self.records.clear()

    def take_rows(self) -> dict[str, Any] | None:
        """This batch's recorded rows as columns (stats still on the device), then forget them; None if none."""
        if not self.records:
            return None
        ids: dict[str, list[Any]] = defaultdict(list)
        for key, _, index in self.records:
            for column, value in key.items():
                ids[column].extend([value] * len(index))
        stats = torch.cat([s for _, s, _ in self.records])  # (rows, len(STAT_NAMES))
        columns: dict[str, Any] = dict(ids)
        columns["sample_index"] = torch.cat([i for _, _, i in self.records])  # (rows,)
        columns["stats"] = stats
        self.records.clear()
        return columns

    def register(self, spec: HookSpec, name: str, module: nn.Module, handles: list[RemovableHandle]) -> None:
        """Register `spec`'s hook on `module`, appending each handle to `handles` as soon as it exists.

        The caller must count `module`'s calls (its pre-hook runs first, so `calls[name] - 1` is this call).
        """
        modify = None if spec.action is HookAction.record else _modifier(spec, lambda: self.sample_indices)
        kind = spec.kind
        calls = self.calls  # read on every call: a local, not an attribute lookup
        backward_seen = self.backward_seen

        def handle(role_prefix: str, value: Any, call: int) -> Any:
            """Record or modify `value`; return the replacement, or None to leave it as it is."""
            if modify is None:
                if not self.recording:
                    return None
                for role, tensor in _roles(role_prefix, value):
                    self.record(spec, name, module, role, call, tensor)
                return None
            position = iter(range(1 << 30))  # which tensor of a tuple: each gets its own noise
            return map_tensors(value, lambda t: modify(t, f"{name}|{kind.value}|{role_prefix}|{call}|{next(position)}"))

        if kind is HookKind.pre:

            def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
                return handle("input", args, calls[name] - 1)

            handles.append(module.register_forward_pre_hook(pre_hook))
        elif kind is HookKind.forward:

            def forward_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
                return handle("output", output, calls[name] - 1)

            handles.append(module.register_forward_hook(forward_hook))
        elif kind is HookKind.backward:

            def backward_hook(module: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> Any:
                # Backward runs in reverse: the first backward call belongs to the last forward call.
                call = calls[name] - 1 - backward_seen[name]
                backward_seen[name] += 1
                if modify is None:
                    handle("grad_output", tuple(grad_output), call)
                return handle("grad_input", tuple(grad_input), call)

            handles.append(module.register_full_backward_hook(backward_hook))
            backward_ran = self.backward_ran

            def note_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                backward_ran.append(name)  # for `explain`: an in-place error names this layer

            handles.append(module.register_forward_hook(note_forward))
        elif kind is HookKind.tensor:

            def tensor_hook_installer(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                call = calls[name] - 1
                for role, tensor in _roles("grad", output):
                    if tensor.requires_grad:
                        # Registered before any in-place successor runs: torch then hands this hook the
                        # gradient with respect to the value as the module produced it.
                        tensor.register_hook(lambda g, role=role, call=call: handle(role, g, call))

            handles.append(module.register_forward_hook(tensor_hook_installer))
        else:  # pragma: no cover - the schema's Enum makes this unreachable
            raise RunnerError(f"Unknown hook kind '{kind}'. Use one of: {', '.join(k.value for k in HookKind)}.")

    def record(self, spec: HookSpec, name: str, module: nn.Module, role: str, call: int, tensor: torch.Tensor) -> None:
        """Take `tensor`'s per-sample statistics as rows of the batch (and keep the tensor with `save_tensors`)."""
        stats, per_sample = fused_stats(tensor, self.batch_size)  # (N, 7) on the device: one read of the tensor
        # Per-sample rows carry the shape of one sample; a tensor without a batch dimension, its own.
        shape = tensor.shape[1:] if per_sample else tensor.shape
        index = torch.arange(self.batch_size) if per_sample else torch.tensor([-1])
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
            key["tensor_file"] = self.tensors.keep(tensor_key, tensor)
            key["tensor_key"] = tensor_key
        self.records.append((key, stats, index))

    def explain(self, error: BaseException, model: nn.Module) -> RunnerError | None:
        """A clear message for a torch error a backward spec hook caused (None when none did)."""
        text = str(error)
        if not (isinstance(error, RuntimeError) and "BackwardHookFunction" in text and "inplace" in text):
            return None
        if not self.backward_ran:
            return RunnerError(
                "A `backward` hook's module output is changed in place later in the model, which torch refuses for"
                " full backward hooks. Use `kind: tensor` on that layer (the gradient of its output), or hook"
                " another layer."
            )
        name = self.backward_ran[-1]
        module = model.get_submodule(name)
        others = sorted(set(self.backward_ran[:-1]) - {name})
        also = f" (or another backward-hooked layer that ran before it: {', '.join(others)})" if others else ""
        return RunnerError(
            f"A `backward` hook on '{name}' ({type(module).__name__}){also} cannot run: the model changes that"
            " layer's output in place afterwards (as `out += identity` in a ResNet block), which torch refuses for"
            f" full backward hooks. Use `kind: tensor` on '{name}' (the gradient of its output, the same as"
            " grad_output), or hook a layer whose output is not modified in place (its parent block, or the layer"
            " before it)."
        )
