"""The tiny models a run started in another process builds by `model._target_=tests.nets.NAME`: this module imports
torch alone, so such a process does not import pytest, Hydra's test composition and every option schema a second
time, as `tests.conftest` (or a test module) as its target would (about 0.7 s a process). conftest re-exports them."""

from __future__ import annotations

import glob
import os
import time

import torch
from torch import nn


class TinyNet(nn.Module):
    """conv -> ReLU(inplace) -> conv -> ReLU(inplace) -> pool -> linear: the in-place trap in miniature."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(inplace=True)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.features(x)).flatten(1))


class SlowNet(TinyNet):
    """TinyNet that takes a while per forward, so a test can kill a run between shards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.25)
        return super().forward(x)


class SleepyNet(TinyNet):
    """TinyNet that sleeps `delay` seconds per forward: a batch long enough to signal twice inside it."""

    def __init__(self, delay: float = 1.0) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return super().forward(x)


class ThreadsSeen(TinyNet):
    """TinyNet that appends torch's intra-op thread count at each forward to the file `log` (a file: the class may be
    imported twice, by pytest and by the run's `_target_`, and a sweep's jobs run in other processes)."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.log, "a") as f:
            f.write(f"{torch.get_num_threads()}\n")
        return super().forward(x)


class SumNet(ThreadsSeen):
    """ThreadsSeen whose logits all carry one long float32 sum of the input (3.8 million terms): torch splits such a
    sum by its thread count, so its rounding shows which count computed it (in `score`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.stack([sample.flatten().repeat(20_000).sum() for sample in x])  # (B,)
        return super().forward(x) + total[:, None]  # the same for every class: predictions and maps unchanged


class HeldNet(TinyNet):
    """TinyNet whose forwards wait while the file `hold` exists, once a file matching `after` does (a glob: the run's
    first shard): a live run, holding its folder, for exactly as long as a test needs, not for a fixed time."""

    def __init__(self, hold: str, after: str) -> None:
        super().__init__()
        self.hold, self.after = hold, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while os.path.exists(self.hold) and glob.glob(self.after):
            time.sleep(0.02)
        return super().forward(x)


class ParentSeen(TinyNet):
    """TinyNet that appends its process's pid and its parent's to the file `log` when built: which process started a
    sweep's workers or torchrun's ranks."""

    def __init__(self, log: str) -> None:
        super().__init__()
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\n")
