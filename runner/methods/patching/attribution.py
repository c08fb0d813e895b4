"""Attribution patching (Nanda 2023): every unit's first-order estimate of its exact patching effect.

estimate_u = sum over u of (source_act - base_act) * dM/d(base_act): every unit of every layer from one
clean+corrupted forward and one backward per direction.
"""

from __future__ import annotations

import torch

from runner.errors import RunnerError
from runner.methods.patching.metric import metric
from runner.methods.patching.units import Units
from runner.options.method.patching import PatchDirection, PatchMetric

UNITS_PER_STEP = 256  # units whose masks are built at once while summing estimates (bounds the masks' memory)


def estimate_maps(
    kind: PatchMetric, directions: list[PatchDirection], logits: torch.Tensor, acts: dict[str, torch.Tensor],
    names: list[str], target: torch.Tensor, contrast: torch.Tensor, b: int,
) -> dict[tuple[PatchDirection, str], torch.Tensor]:  # fmt: skip
    """Per direction and layer: (B, *act shape) of (source - base) * dM/d(base), from one backward each.

    `logits` (2B, K) and `acts` (2B, ...) hold the clean run in rows :b and the corrupted run in rows b:.
    """
    out = {}
    for k, direction in enumerate(directions):
        base_rows = slice(b, 2 * b) if direction is PatchDirection.denoising else slice(0, b)
        m = metric(kind, logits[base_rows], target, contrast).sum()
        retain = k < len(directions) - 1
        grads = torch.autograd.grad(m, [acts[n] for n in names], retain_graph=retain, allow_unused=True)
        for name, g in zip(names, grads, strict=True):
            if g is None:
                raise RunnerError(f"The metric does not depend on layer '{name}': nothing to patch there.")
            clean, corrupted = acts[name][:b].detach(), acts[name][b:].detach()
            diff = clean - corrupted if direction is PatchDirection.denoising else corrupted - clean
            out[(direction, name)] = (diff * g[base_rows]).float()
    return out


def unit_estimates(units: Units, estimate_map: torch.Tensor) -> torch.Tensor:
    """(units.count,) each unit's estimate: the sum of one sample's `estimate_map` (*act shape) over the unit."""
    return torch.cat([
        (units.masks(s, min(s + UNITS_PER_STEP, units.count), estimate_map.device) * estimate_map).flatten(1).sum(1)
        for s in range(0, units.count, UNITS_PER_STEP)
    ])  # fmt: skip
