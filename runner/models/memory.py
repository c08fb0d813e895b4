"""Memory of a language model's run measured without running it, and measured when it runs.

`traced_bytes` runs the model on the meta device (shapes only, no memory) and sums what a traced forward keeps alive:
the tensors autograd saves for the backward (`torch.autograd.graph.saved_tensors_hooks`) and the views the caller's
hooks keep, each storage once, the weights left out. `parameter_bytes` is the weights' size in their dtype.
`peak_bytes` measures a call: the CUDA allocator's peak on a GPU, and on the CPU the peak of the bytes torch's
allocator holds (the profiler's allocation events summed in time order; the process's resident size would count the C
library's caching of freed pages, which varies 2x between runs of the same call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn


def parameter_bytes(model: nn.Module) -> int:
    """The weights and buffers of `model` (a meta model's too), in their own dtypes."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _storages(tensors: Iterator[torch.Tensor]) -> dict[int, int]:
    """Each distinct storage among `tensors` (its address in memory: a meta tensor's too), with its bytes."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out[storage._cdata] = storage.nbytes()
    return out


def traced_bytes(
    model: nn.Module, forward: Callable[[], Any], keeping: Callable[[], AbstractContextManager[Any]],
    kept: Callable[[], dict[str, torch.Tensor]],
) -> int:  # fmt: skip
    """Bytes a traced forward holds once it has run: `forward()` under gradients, inside `keeping()` (the caller's
    hooks, which leave their views in `kept()`), run on meta tensors; the saved tensors and the kept views, each
    storage once, the model's weights and buffers excluded."""
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), torch.enable_grad(), keeping():
        forward()
    held = _storages(iter([*saved, *kept().values()]))
    for key in _storages(iter([*model.parameters(), *model.buffers()])):
        held.pop(key, None)
    return sum(held.values())


def kept_bytes(views: dict[str, torch.Tensor]) -> int:
    """Bytes of a run's kept views (each storage once)."""
    return sum(_storages(iter(views.values())).values())


def peak_bytes(call: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """`call()`'s result and the most memory it held at once beyond what was held before it (bytes): on CUDA the
    allocator's peak; on the CPU the peak of torch's allocations and frees, summed in time order (profiler)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = call()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        result = call()
    events: list[tuple[int, int]] = []
    pending = list(recorded.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while pending:
        node = pending.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        pending.extend(node.children)
    events.sort()
    held = peak = 0
    for _, size in events:
        held += size
        peak = max(peak, held)
    return result, peak


def status_bytes(field: str) -> int:
    """A field of this process's /proc/self/status in bytes (Linux: VmRSS, its resident memory now; VmHWM, its
    high-water mark); 0 where it is not there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


# `python -c PEAK_RSS_PROBE ARGS` is `python -m runner ARGS` printing its peak resident memory as it exits, on stderr
# (PEAK_RSS_KIB n): status_bytes("VmHWM"), this process's own high-water mark (ru_maxrss would not do: a child's
# starts at its parent's, carried over the fork and exec). scripts/plan_memory.py and tests/test_plan.py measure so.
PEAK_RSS_PROBE = """import atexit, runpy, sys
def peak():
    from runner.models.memory import status_bytes
    print("PEAK_RSS_KIB", status_bytes("VmHWM") // 1024, file=sys.stderr)
atexit.register(peak)
sys.argv = ["runner", *sys.argv[1:]]
runpy.run_module("runner", run_name="__main__", alter_sys=True)
"""
