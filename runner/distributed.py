"""Several processes on one machine (`torchrun --nproc_per_node=N -m runner ...`): which shards are mine.

torchrun sets RANK and WORLD_SIZE. Shard s goes to rank s % WORLD_SIZE; each rank writes its own
shard files and manifest, so the union is exactly a single-process run's table. A process group
(gloo on CPU, nccl on GPU) is used only to agree on the output directory and to wait for each other
at the end, so that rank 0 can summarise the whole table. Rank 0 holds the output directory's lock
for all ranks and tells the others whether it got it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from runner.errors import RunnerError

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def local_device_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_cuda_device() -> torch.device:
    """This process's GPU under torchrun (its LOCAL_RANK); a RunnerError when torchrun started more processes on
    this machine than it has GPUs (a rank past the last GPU would fail inside CUDA with an invalid device)."""
    local = local_device_index()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", str(local + 1)))  # torchrun's --nproc_per_node
    gpus = torch.cuda.device_count()
    if local >= gpus or processes > gpus:  # every rank refuses, not only those past the last GPU: one clear exit
        raise RunnerError(
            f"torchrun started {max(processes, local + 1)} processes on this machine (LOCAL_RANK={local}), but only"
            f" {gpus} CUDA GPU(s) are visible: one process per GPU. Run torchrun --nproc_per_node={gpus}, or"
            " device=cpu to run the processes on the CPU."
        )
    return torch.device("cuda", local)


@contextmanager
def process_group(device: torch.device, timeout_minutes: float) -> Iterator[None]:
    """Join the process group for the run when started by torchrun with more than one process, and leave it at the
    end, also on a failure. Its timeout (`distributed_timeout_minutes`) bounds every collective, the final barrier
    included: ranks with uneven shards finish minutes apart, past NCCL's default of 10 minutes."""
    if not timeout_minutes > 0:
        raise RunnerError(f"distributed_timeout_minutes={timeout_minutes}: give a positive number of minutes.")
    _, world = rank_and_world()
    joined = world > 1 and not dist.is_initialized()  # a group the caller made is the caller's to destroy
    if joined:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    try:
        yield
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def from_rank0(value: T) -> T:
    """Rank 0's value, for every rank (as is without a process group); a picklable value."""
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def shared_directory(path: Path) -> Path:
    """Rank 0's output directory, for every rank (their own Hydra run dirs may differ by a second)."""
    return Path(from_rank0(str(path)))


def barrier() -> None:
    """Wait for every rank (within the process group's timeout); nothing without a process group."""
    if dist.is_initialized():
        dist.barrier()
