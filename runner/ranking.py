"""Rank statistics shared by the methods that compare orderings (sanity's maps, patching's estimates, MPRT's rows).

Spearman's rho is Pearson's r of average ranks (ties share the mean of their ranks), the textbook
definition and `scipy.stats.spearmanr`'s: CAM maps are full of ties (every pixel ReLU set to 0). A
side that is constant (an all-zero map, say) has no order, so rho is NaN there, never a number.
"""

from __future__ import annotations

import torch


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """(N,) float64 ranks 1..N of a 1-D tensor, ties given the mean of the ranks they span (scipy's `rankdata`)."""
    return row_average_ranks(values[None])[0]


def row_average_ranks(values: torch.Tensor) -> torch.Tensor:
    """(N, D) float64 ranks 1..D of each row of `values` (N, D), ties given the mean of the ranks they span."""
    return ranks_of_sorted(*values.sort(dim=1, stable=True))


def ranks_of_sorted(ordered: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(N, D) float64 average ranks from a row-wise sort (sorted values (N, D), their indices (N, D)): callers that
    sort anyway (MPRT's top pixels) rank without a second sort."""
    n, d = ordered.shape
    position = torch.arange(d, device=ordered.device).expand(n, d)  # (N, D)
    differs = ordered[:, 1:] != ordered[:, :-1]  # (N, D-1): a tie group ends between two sorted positions
    yes = torch.ones(n, 1, dtype=torch.bool, device=ordered.device)
    first = torch.where(torch.cat([yes, differs], dim=1), position, 0).cummax(dim=1).values  # group's first position
    last = torch.where(torch.cat([differs, yes], dim=1), position, d - 1).flip(1).cummin(dim=1).values.flip(1)
    mean = (first + last).double() / 2 + 1  # (N, D) the mean of ranks first+1 .. last+1, in sorted order
    return torch.empty_like(mean).scatter_(1, order, mean)


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


def toward_source(estimated: torch.Tensor, receiver: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """How far each estimated patched metric moves the receiving run's metric toward the source run's:
    (estimated - receiver) * sign(source - receiver), the quantity patching's top-k ranks by (denoising: toward the
    clean metric; noising: toward the corrupted one, usually down). Where the two runs' metrics are equal (no
    direction), the size of the change |estimated - receiver|. `receiver` and `source` broadcast against `estimated`."""
    change = estimated - receiver
    sign = torch.sign(source - receiver)
    return torch.where(sign == 0, change.abs(), change * sign)
