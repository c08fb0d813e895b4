"""The devices a device-path test runs on: the CPU always, CUDA where there is one; and a count of host syncs.

A test of the GPU path takes the device as a parameter, so its code runs on the CPU in every `make test` (a stale
call fails there, not first on a GPU) and on CUDA where `make test-gpu` finds one. The `cuda` case is added only
when CUDA exists: on a CPU machine it is absent, never a skip that would stand in for a failure.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", *(["cuda"] if CUDA else [])]
# For a test selected by `-m gpu` only on CUDA (a file whose CPU cases already run elsewhere in the suite).
DEVICE_PARAMS = ["cpu", *([pytest.param("cuda", marks=pytest.mark.gpu)] if CUDA else [])]

# The text of the warning torch.cuda.set_sync_debug_mode("warn") gives at each synchronizing CUDA call.
SYNC_WARNING = "called a synchronizing CUDA operation"
# On the CPU, the stand-in: the reads of a tensor's value into Python (`.item()`, `bool(t)`, `int(t)`, `float(t)`),
# each a sync on CUDA. Copies to the host (`.cpu()`, `.tolist()`) and pageable host-to-device copies are no-ops on
# the CPU, not dispatched, so they are not seen: the CPU count is a lower bound of the CUDA count.
SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class _ScalarReads(TorchDispatchMode):
    """Records each read of a tensor's value into Python (the CPU stand-in for a host sync)."""

    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is SCALAR_READ:
            self.reads.append(f"a scalar read ({func}) of a {args[0].dtype} tensor")
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_syncs(device: str | torch.device) -> Iterator[list[str]]:
    """The host-device syncs made inside, one entry each, filled on exit.

    On CUDA: counted under set_sync_debug_mode("warn"), which warns at every sync (a `.item()`, a `.cpu()`, a copy
    from pageable host memory to the device); other warnings are passed on, not counted; the previous mode is
    restored. On the CPU: the scalar reads (`SCALAR_READ`), seen by a dispatch mode."""
    syncs: list[str] = []
    if torch.device(device).type != "cuda":
        with _ScalarReads(syncs):
            yield syncs
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each sync warns from the same place: keep every one
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if SYNC_WARNING in str(w.message):
            syncs.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
