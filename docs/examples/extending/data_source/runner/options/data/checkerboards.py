"""Checkerboards (an example data source): `count` seeded images of `squares` x `squares` black and white cells
at a random phase, label 0 when the top-left cell is dark, else 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.options.registry import DATA
from runner.schema import DataConfig


def checkerboards(cfg: CheckerboardsConfig, preprocess: Any, seed: int) -> Any:
    """The data set: sample i is (image (3, S, S), label, id), the same for the same seed at any batch size."""
    import torch

    class Checkerboards(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return cfg.count

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
            phase = int(torch.randint(2, (1,), generator=torch.Generator().manual_seed(seed * 1_000_003 + i)))
            cells = torch.arange(cfg.image_size) * cfg.squares // cfg.image_size
            board = ((cells[:, None] + cells[None, :] + phase) % 2).float()
            return board.expand(3, -1, -1).clone(), 1 - phase, f"checkerboard-{i}"

    return Checkerboards()


@DATA.option(checkerboards)
@dataclass
class CheckerboardsConfig(DataConfig):
    name: str = "checkerboards"
    squares: int = 8  # cells per side
    count: int = 8  # images

    def check(self) -> list[str]:
        return super().check() + [f"data.{k}={v}" for k, v in (("squares", self.squares), ("count", self.count)) if v < 1]
