"""Several processes on one machine (`torchrun --nproc_per_node=N -m runner ...`): which shards are mine.

torchrun sets RANK and WORLD_SIZE. Shard s goes to rank s % WORLD_SIZE; each rank writes its own
shard files and manifest, so the union is exactly a single-process run's table. A process group
(gloo on CPU, nccl on GPU) is used only to agree on the output directory and to wait for each other
at the end, so that rank 0 can summarise the whole table. Rank 0 holds the output directory's lock
for all ranks and tells the others whether it got it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def local_device_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init(device: torch.device) -> None:
    """Join the process group once, when started by torchrun with more than one process."""
    _, world = rank_and_world()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


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
    if dist.is_initialized():
        dist.barrier()
