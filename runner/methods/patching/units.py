"""The units patched in one layer (the whole output, a channel, a spatial cell, a token) and their masks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runner.errors import RunnerError
from runner.options.method.patching import PatchUnit


@dataclass
class Units:
    """The units of one layer: broadcastable masks on demand, and their identifier columns."""

    kind: PatchUnit
    shape: tuple[int, ...]  # one sample's activation shape
    count: int
    channel: list[int | None]
    y: list[int | None]
    x: list[int | None]
    token: list[int | None]
    cells: list[tuple[int, int, int, int]]  # cell bounds (y0, y1, x0, x1) for cell units
    grid: tuple[int, int] | None

    def masks(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """(n, *shape) bool masks of units start..stop, broadcastable (size 1 where a unit spans the dim)."""
        return self.masks_of(range(start, stop), device)

    def masks_of(self, order: Sequence[int], device: torch.device) -> torch.Tensor:
        """(n, *shape) bool masks of the units `order`, in that order, on `device` in at most one host-device copy.

        Channels and tokens: a contiguous block (a range) costs no host-device transfer, any other order one copy of
        its indices (not one per unit, as indexing with CPU tensors did: two syncs per channel). Cells: the masks
        are made on the host and moved in one copy (the exact engine keeps them for the next sample).
        """
        if self.kind is PatchUnit.layer:
            return torch.ones((1, *self.shape), dtype=torch.bool, device=device)
        n = len(order)
        if self.kind in (PatchUnit.channel, PatchUnit.token):
            picked = _device_index(order, device)  # (n,)
            hot = picked[:, None] == torch.arange(self.shape[0], device=device)  # (n, C or T) one-hot rows
            return hot.reshape(n, self.shape[0], *(1,) * (len(self.shape) - 1))  # (n, C, 1, 1) or (n, T, 1)
        # the cells' masks built on the host at once and moved in one copy (not one fill per cell on the device)
        h, w = self.shape[1:]
        y0, y1, x0, x1 = (np.array([self.cells[u][k] for u in order])[:, None] for k in range(4))
        rows, cols = np.arange(h)[None], np.arange(w)[None]
        inside = ((rows >= y0) & (rows < y1))[:, :, None] & ((cols >= x0) & (cols < x1))[:, None, :]  # (n, H, W)
        return torch.from_numpy(inside[:, None]).to(device)  # (n, 1, H, W)


def _device_index(order: Sequence[int], device: torch.device) -> torch.Tensor:
    """(n,) int64 unit indices on `device`: made there for a contiguous block, one host-device copy otherwise."""
    n = len(order)
    start = order[0] if n else 0
    if list(order) == list(range(start, start + n)):
        return torch.arange(start, start + n, device=device)
    return torch.tensor(list(order), dtype=torch.int64, device=device)


def enumerate_units(
    name: str, shape: tuple[int, ...], kind: PatchUnit, grid: list[int], cell_size: int | None
) -> Units:
    """The units of a layer whose per-sample activation has `shape`."""
    if kind is PatchUnit.layer:
        return Units(kind, shape, 1, [None], [None], [None], [None], [], None)
    if kind is PatchUnit.channel:
        c = shape[0]
        return Units(kind, shape, c, list(range(c)), [None] * c, [None] * c, [None] * c, [], None)
    if kind is PatchUnit.token:
        if len(shape) != 2:
            raise RunnerError(f"units=token needs (batch, tokens, dim) outputs; layer '{name}' gives {(None, *shape)}.")
        t = shape[0]
        return Units(kind, shape, t, [None] * t, [None] * t, [None] * t, list(range(t)), [], None)
    if len(shape) != 3:
        raise RunnerError(
            f"units=cell needs spatial outputs (batch, channels, height, width); layer '{name}' gives {(None, *shape)}."
            " Use units=channel or token, or pick convolutional layers."
        )
    h, w = shape[1:]
    if cell_size:
        edges_y, edges_x = list(range(0, h, cell_size)) + [h], list(range(0, w, cell_size)) + [w]
    else:
        gh, gw = min(grid[0], h), min(grid[1], w)
        edges_y = [round(i * h / gh) for i in range(gh + 1)]
        edges_x = [round(j * w / gw) for j in range(gw + 1)]
    cells, ys, xs = [], [], []
    for i in range(len(edges_y) - 1):
        for j in range(len(edges_x) - 1):
            cells.append((edges_y[i], edges_y[i + 1], edges_x[j], edges_x[j + 1]))
            ys.append(i)
            xs.append(j)
    n = len(cells)
    return Units(kind, shape, n, [None] * n, ys, xs, [None] * n, cells, (len(edges_y) - 1, len(edges_x) - 1))
