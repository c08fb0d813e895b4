"""Localisation metrics: does the map point at the class's region? Batched on the device, one value per sample.

Each compares a map (B, H, W) at input resolution with the sample's localisation mask (B, H, W) bool (from an
image_folder side file or the built-in `composites` benchmark, runner/data/composites.py). A sample whose mask is
empty has no region to point at: its value is NaN (Quantus returns NaN too, with a warning; the CAM method logs
one warning per run naming the samples). A constant map (all zero, say) points nowhere and ranks no pixel: its
pointing game and relevance rank are NaN, where Quantus scores a hit and |mask|/N.

- pointing_game (Zhang et al. 2018; Quantus PointingGame): 1.0 when a pixel of the map's maximum lies in the
  mask (every tied maximum counts, as Quantus), else 0.0; `pointing_tolerance` px dilates the mask by a disc
  of that radius first (TorchRay's pointing game uses 15; 0 is Quantus's exact definition).
- energy_pointing_game (Score-CAM, Wang et al. 2020): the map's energy inside the mask's bounding box over its
  total, after min-max scaling the map to [0, 1] as Score-CAM's code does. Equal to relevance_mass when the
  mask is one box and the map's minimum is 0 (the runner's upsampled maps are min-max scaled).
- relevance_mass (Arras et al. 2022; Quantus RelevanceMassAccuracy): the map's mass inside the mask over its
  total mass.
- relevance_rank (Arras et al. 2022; Quantus RelevanceRankAccuracy): of the K = |mask| highest-valued pixels,
  the share inside the mask. Quantus breaks ties at the K-th value by numpy's (unstable) argsort; here tied
  pixels count by their expected share under a random tie order, so the value is order-free and equals
  Quantus's whenever the K-th and (K+1)-th values differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.errors import RunnerError
from runner.metrics.base import Metric, MetricInputs
from runner.stats import constant_rows


def _masks(inputs: MetricInputs, maps: torch.Tensor) -> torch.Tensor:
    """The batch's masks (B, H, W) bool on the maps' device."""
    if inputs.masks is None:
        raise RunnerError("A localisation metric needs masks: data=composites, or an image_folder with masks.json.")
    return inputs.masks.to(maps.device, torch.bool)


def _flat(maps: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(maps (B, N) float32, masks (B, N) bool, empty (B,) bool) with N = H * W."""
    b = maps.shape[0]
    a = maps.float().reshape(b, -1)  # (B, N)
    s = masks.reshape(b, -1)  # (B, N)
    return a, s, ~s.any(dim=1)


def _nan_where(values: torch.Tensor, undefined: torch.Tensor) -> torch.Tensor:
    """values (B,) as float32 with NaN where `undefined` (B,) bool."""
    return torch.where(undefined, torch.full_like(values, float("nan")), values).float()


def dilate(masks: torch.Tensor, radius: int) -> torch.Tensor:
    """(B, H, W) bool masks grown by a disc of `radius` px: a pixel is in when a mask pixel is within radius."""
    if radius <= 0:
        return masks
    offsets = torch.arange(-radius, radius + 1, device=masks.device, dtype=torch.float32)
    disc = (offsets[:, None] ** 2 + offsets[None, :] ** 2 <= radius**2).float()  # (2r+1, 2r+1)
    grown = F.conv2d(masks[:, None].float(), disc[None, None], padding=radius)  # (B, 1, H, W)
    return grown[:, 0] > 0.5


class PointingGame(Metric):
    """1.0 when the map's maximum (any tied one) lies in the mask grown by `pointing_tolerance` px, else 0.0;
    NaN where the mask is empty or the map is constant (every pixel its maximum) or not finite."""

    needs_masks = True

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        grown = dilate(_masks(inputs, maps), int(self.cfg.pointing_tolerance))  # (B, H, W)
        a, s, empty = _flat(maps, grown)
        peak = a == a.amax(dim=1, keepdim=True)  # (B, N) every pixel at the maximum
        hit = (peak & s).any(dim=1).float()  # (B,)
        return {"": _nan_where(hit, empty | constant_rows(a))}


class EnergyPointingGame(Metric):
    """Energy of the min-max scaled map inside the mask's bounding box over its total; NaN where the mask is
    empty or the map is constant (no energy to place) or not finite."""

    needs_masks = True

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        masks = _masks(inputs, maps)  # (B, H, W)
        a, s, empty = _flat(maps, masks)
        lo, hi = a.amin(dim=1, keepdim=True), a.amax(dim=1, keepdim=True)  # (B, 1)
        scaled = (a - lo) / (hi - lo).clamp_min(1e-12)  # (B, N) in [0, 1]
        rows, cols = masks.any(dim=2), masks.any(dim=1)  # (B, H), (B, W): where the mask has pixels
        ys = torch.arange(masks.shape[1], device=a.device)  # (H,)
        xs = torch.arange(masks.shape[2], device=a.device)  # (W,)
        big = masks.shape[1] + masks.shape[2]
        y0 = torch.where(rows, ys, big).amin(dim=1)  # (B,) the box's first row
        y1 = torch.where(rows, ys, -1).amax(dim=1)  # (B,) its last row
        x0 = torch.where(cols, xs, big).amin(dim=1)
        x1 = torch.where(cols, xs, -1).amax(dim=1)
        in_rows = (ys[None] >= y0[:, None]) & (ys[None] <= y1[:, None])  # (B, H)
        in_cols = (xs[None] >= x0[:, None]) & (xs[None] <= x1[:, None])  # (B, W)
        box = (in_rows[:, :, None] & in_cols[:, None, :]).reshape(a.shape[0], -1)  # (B, N)
        inside = (scaled * box).sum(dim=1)  # (B,)
        total = scaled.sum(dim=1)  # (B,)
        undefined = empty | (hi[:, 0] <= lo[:, 0]) | ~torch.isfinite(a).all(dim=1)
        return {"": _nan_where(inside / total.clamp_min(1e-30), undefined)}


class RelevanceMass(Metric):
    """The map's mass inside the mask over its total mass (Quantus RelevanceMassAccuracy); NaN where the mask is
    empty or the map's total is 0 (nothing to place) or not finite."""

    needs_masks = True

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        a, s, empty = _flat(maps, _masks(inputs, maps))
        inside = (a * s).sum(dim=1)  # (B,)
        total = a.sum(dim=1)  # (B,)
        undefined = empty | (total == 0) | ~torch.isfinite(total)
        return {"": _nan_where(inside / torch.where(total == 0, torch.ones_like(total), total), undefined)}


class RelevanceRank(Metric):
    """Share of the mask among the map's K = |mask| highest pixels (Quantus RelevanceRankAccuracy), ties at the
    K-th value counted by their expected share; NaN where the mask is empty or the map is constant (no pixel ranks
    above another) or not finite."""

    needs_masks = True

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        a, s, empty = _flat(maps, _masks(inputs, maps))
        k = s.sum(dim=1)  # (B,) pixels in the mask
        ordered = a.sort(dim=1, descending=True).values  # (B, N)
        kth = ordered.gather(1, (k - 1).clamp_min(0)[:, None])  # (B, 1) the K-th highest value
        above = a > kth  # (B, N) certainly in the top K
        tied = a == kth  # (B, N) sharing the K-th value: only (K - #above) of them are in the top K
        n_above, n_tied = above.sum(dim=1), tied.sum(dim=1)  # (B,)
        share = (k - n_above).float() / n_tied.clamp_min(1).float()  # (B,) expected fraction of tied pixels taken
        hits = (above & s).sum(dim=1).float() + (tied & s).sum(dim=1).float() * share  # (B,)
        return {"": _nan_where(hits / k.clamp_min(1).float(), empty | constant_rows(a))}
