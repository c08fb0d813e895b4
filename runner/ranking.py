"""Rank statistics shared by the methods that compare orderings (sanity's maps, patching's estimates).

Spearman's rho is Pearson's r of average ranks (ties share the mean of their ranks), the textbook
definition and `scipy.stats.spearmanr`'s: CAM maps are full of ties (every pixel ReLU set to 0). A
side that is constant (an all-zero map, say) has no order, so rho is NaN there, never a number.
"""

from __future__ import annotations

import torch


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """(N,) float64 ranks 1..N of a 1-D tensor, ties given the mean of the ranks they span (scipy's `rankdata`)."""
    _, inverse, counts = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # (U,) rank of each distinct value's last occurrence
    return (ends - (counts.double() - 1) / 2)[inverse]  # mean of ranks end-count+1 .. end


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman's rho of two 1-D tensors: Pearson's r of their average ranks, as `scipy.stats.spearmanr`.

    NaN (float32) where it is undefined: either side constant (all ranks tied, e.g. an all-zero map),
    holding a NaN/inf, or fewer than two values.
    """
    if a.numel() < 2 or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return torch.tensor(float("nan"), device=a.device)
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = ra.norm() * rb.norm()
    if float(denominator) == 0.0:  # a constant side: every rank equal, no order to correlate
        return torch.tensor(float("nan"), device=a.device)
    return ((ra * rb).sum() / denominator).clamp(-1.0, 1.0).float()
