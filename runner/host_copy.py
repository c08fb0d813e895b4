"""Tensors to the host in one transfer per device, started on the main thread and waited for on the writer thread.

A table's columns leave the device as `to_host` (runner/rows.py) would move them one `.cpu()` at a time: each such
copy goes into pageable memory and waits for the device (on CUDA, a synchronisation per column, and the compute
stream idles while the driver stages a large column such as the CAM maps through a bounce buffer). Here the tensors
of a batch's tables are packed into one byte buffer on their device (one `cat`, each piece aligned to 8 bytes so
that it can be viewed back as its dtype), and that buffer is copied once into pinned host memory, `non_blocking`,
on a side stream that waits for the batch's kernels: the next batch's kernels run while the copy does. `HostCopy.wait`,
called on the writer thread, waits for that copy alone (a CUDA event) and views the host buffer back as the original
tensors: same dtypes, shapes and values, so `to_host` then makes the same columns it makes from device tensors.

On the CPU the packing is an ordinary copy, which the run skips (runner/loop.py `PACK_ROWS`); tests force it there
to check the packing against the per-batch path. Foundation: imports only runner.rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runner.rows import Block, Columns, Ragged

# What a column's tensor is replaced by while its copy is under way (`with_tensors(columns, repeat(PLACEHOLDER))`):
# the writer's job then holds the columns' names and host values, none of the batch's device tensors.
PLACEHOLDER = torch.empty(0)
ALIGN = 8  # bytes: the largest element size packed (int64, float64), so each piece views back as its dtype

_copy_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream host copies run on (main thread only)


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies to the host on `device` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _copy_streams:
        _copy_streams[index] = torch.cuda.Stream(device=index)
    return _copy_streams[index]


@dataclass
class _Packed:
    """One device's tensors on their way to the host: the host buffer, its copy's event, where each tensor lies."""

    host: torch.Tensor  # (bytes,) uint8, pinned on CUDA
    done: torch.cuda.Event | None  # recorded after the copy (None: the copy was an ordinary host one)
    layout: list[tuple[int, int, torch.dtype, torch.Size]]  # (position in the input, byte offset, dtype, shape)


def _pack(items: list[tuple[int, torch.Tensor]]) -> _Packed:
    """Pack `items` (position, tensor), all on one device, into one buffer and start its copy to the host."""
    pieces: list[torch.Tensor] = []
    layout: list[tuple[int, int, torch.dtype, torch.Size]] = []
    offset = 0
    device = items[0][1].device
    for position, tensor in items:
        raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)  # (bytes,) a view where it can be
        pad = -raw.numel() % ALIGN
        pieces.append(raw)
        if pad:
            pieces.append(torch.empty(pad, dtype=torch.uint8, device=device))  # contents never read
        layout.append((position, offset, tensor.dtype, tensor.shape))
        offset += raw.numel() + pad
    staging = torch.cat(pieces)  # (bytes,) one kernel for every column of the batch
    if not staging.is_cuda:
        return _Packed(staging, None, layout)
    stream = _copy_stream(staging.device)
    stream.wait_stream(torch.cuda.current_stream(staging.device))  # the copy starts after the batch's kernels
    host = torch.empty(staging.shape, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(staging, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    staging.record_stream(stream)  # freed on the compute stream now, reused only once the copy has read it
    return _Packed(host, done, layout)


class HostCopy:
    """Tensors (on any devices) copied to the host in one transfer per device; `wait()` gives them back on the host.

    Made on the main thread (it starts the copies and returns at once); `wait` may run on another thread."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.count = len(tensors)
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, tensor in enumerate(tensors):
            by_device.setdefault(tensor.device, []).append((i, tensor))
        self._packed = [_pack(items) for items in by_device.values()]

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host, in the order given, each its original dtype and shape (views of the buffers)."""
        out: list[torch.Tensor | None] = [None] * self.count
        for packed in self._packed:
            if packed.done is not None:
                packed.done.synchronize()  # this copy alone: the device goes on with later batches
            for position, offset, dtype, shape in packed.layout:
                size = shape.numel() * dtype.itemsize
                out[position] = packed.host[offset : offset + size].view(dtype).reshape(shape)
        return out  # type: ignore[return-value]  # every position is filled: the layouts cover the input


def column_tensors(columns: Columns) -> list[torch.Tensor]:
    """The tensors of a column dict, in column order: each tensor column, each block's and each ragged column's values."""
    found: list[torch.Tensor] = []
    for value in columns.values():
        if isinstance(value, (Block, Ragged)):
            found.append(value.values)
        elif torch.is_tensor(value):
            found.append(value)
    return found


def with_tensors(columns: Columns, tensors: Iterator[torch.Tensor]) -> Columns:
    """`columns` with its tensors (in `column_tensors` order) replaced by the next ones of `tensors`."""
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if isinstance(value, Block):
            out[name] = Block(next(tensors), value.names)
        elif isinstance(value, Ragged):
            out[name] = Ragged(next(tensors), value.lengths)
        elif torch.is_tensor(value):
            out[name] = next(tensors)
        else:
            out[name] = value
    return out
