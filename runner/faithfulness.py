"""How faithful is a map? Deletion/insertion AUC (Petsiuk et al. 2018) and average drop / increase
in confidence (Chattopadhay et al. 2018), each beside the same metric for a random map.

Deletion: remove pixels from most to least salient (replaced by 0, the data set's mean after
normalisation) and follow the target's probability; a faithful map makes it fall fast (low AUC).
Insertion: start from a blurred copy and put pixels back in the same order (high AUC is good).
All steps of all samples go through the model as batched forwards of `chunk` images, never a
Python loop per image. The random map has the layer's own resolution, so both are equally coarse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.functional import gaussian_blur

from runner.results import Block
from runner.schema import FaithfulnessConfig

METRICS = ("deletion_auc", "insertion_auc", "avg_drop", "increase")
COLUMNS = [*METRICS, *(f"random_{m}" for m in METRICS)]


def upsample(maps: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """(B, h, w) maps -> (B, H, W) at the input's size, bilinear, each scaled to [0, 1]."""
    up = F.interpolate(maps[:, None].float(), size=tuple(size), mode="bilinear", align_corners=False)[:, 0]
    lo = up.flatten(1).amin(dim=1)[:, None, None]
    hi = up.flatten(1).amax(dim=1)[:, None, None]
    return (up - lo) / (hi - lo).clamp_min(1e-12)


def blurred(x: torch.Tensor) -> torch.Tensor:
    """The insertion baseline: a strong blur that keeps colours but removes detail."""
    side = min(x.shape[-2:])
    kernel = max(3, min(31, (side // 4) * 2 + 1))
    return gaussian_blur(x, [kernel, kernel], [kernel / 3.0, kernel / 3.0])


@torch.no_grad()
def probabilities(model: nn.Module, images: torch.Tensor, target: torch.Tensor, chunk: int, runtime) -> torch.Tensor:
    """Softmax probability of `target` (N,) for images (N, C, H, W), in batched forwards of `chunk`."""
    out = []
    for start in range(0, images.shape[0], chunk):
        with runtime.autocast():
            logits = model(images[start : start + chunk]).float()
        out.append(logits.softmax(dim=1).gather(1, target[start : start + chunk, None]).squeeze(1))
    return torch.cat(out)


@torch.no_grad()
def curve_aucs(
    model: nn.Module,
    x: torch.Tensor,
    saliency: torch.Tensor,
    target: torch.Tensor,
    steps: int,
    chunk: int,
    runtime,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(deletion AUC, insertion AUC), each (B,), for saliency maps (B, H, W) of inputs x (B, C, H, W)."""
    b, c, h, w = x.shape
    pixels = h * w
    rank = saliency.flatten(1).argsort(dim=1, descending=True).argsort(dim=1)  # (B, P) 0 = most salient
    fractions = torch.linspace(0, 1, steps + 1, device=x.device)  # (S,)
    counts = (fractions * pixels).round().long()  # pixels changed at each step
    zeros, blur = torch.zeros_like(x), blurred(x)
    curves = {}
    for mode in ("deletion", "insertion"):
        probs = []
        for start in range(0, b * (steps + 1), chunk):
            idx = torch.arange(start, min(start + chunk, b * (steps + 1)), device=x.device)
            sample, step = idx // (steps + 1), idx % (steps + 1)
            changed = (rank[sample] < counts[step][:, None]).reshape(-1, 1, h, w)  # (n, 1, H, W)
            if mode == "deletion":
                images = torch.where(changed, zeros[sample], x[sample])
            else:
                images = torch.where(changed, x[sample], blur[sample])
            probs.append(probabilities(model, images, target[sample], chunk, runtime))
        curve = torch.cat(probs).reshape(b, steps + 1)  # (B, S)
        curves[mode] = torch.trapezoid(curve, fractions, dim=1)
    return curves["deletion"], curves["insertion"]


@torch.no_grad()
def drop_increase(
    model: nn.Module,
    x: torch.Tensor,
    saliency: torch.Tensor,
    target: torch.Tensor,
    clean: torch.Tensor,
    chunk: int,
    runtime,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(average drop, increase), each (B,): the input kept only where the map is high."""
    masked = x * saliency[:, None]
    kept = probabilities(model, masked, target, chunk, runtime)
    drop = torch.relu(clean - kept) / clean.clamp_min(1e-12)
    return drop, (kept > clean).float()


def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    saliency: list[torch.Tensor],
    random_saliency: list[torch.Tensor],
    target: torch.Tensor,
    probs: torch.Tensor,
    cfg: FaithfulnessConfig,
    runtime,
) -> Block:
    """All metrics for each layer's maps and for the random maps, as a (L*B, 8) block in row order."""
    clean = probs.gather(1, target[:, None]).squeeze(1)  # (B,)
    rows = []
    for maps, random_maps in zip(saliency, random_saliency, strict=True):
        values = []
        for m in (maps, random_maps):
            deletion, insertion = curve_aucs(model, x, m, target, cfg.steps, cfg.chunk, runtime)
            drop, increase = drop_increase(model, x, m, target, clean, cfg.chunk, runtime)
            values += [deletion, insertion, drop, increase]
        rows.append(torch.stack(values, dim=1))  # (B, 8)
    return Block(torch.cat(rows), COLUMNS)
