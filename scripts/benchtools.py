"""What the benchmark scripts share: the device choice and a median wall-clock timer that waits for the GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def pick_device(name: str) -> torch.device:
    """`auto`: the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up call (allocations, cudnn autotuning)."""
    fn()
    times = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
