"""Per-sample summary statistics of a tensor, computed on its device in a few fused reductions."""

from __future__ import annotations

import torch

STAT_NAMES = ("mean", "std", "min", "max", "l2_norm", "frac_zero")


def per_sample_stats(tensor: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, bool]:
    """(stats, per_sample): stats is (N, len(STAT_NAMES)) float32, one row per sample.

    A tensor whose first dimension is not the batch (a buffer, a shared weight) gets one row with
    sample index -1, so nothing is silently dropped.
    """
    t = tensor.detach()
    per_sample = t.dim() > 0 and t.shape[0] == batch_size
    flat = t.reshape(batch_size if per_sample else 1, -1).float()  # (N, D)
    var, mean = torch.var_mean(flat, dim=1, correction=0)  # population std: the tensor is the population
    lo, hi = torch.aminmax(flat, dim=1)
    l2 = torch.linalg.vector_norm(flat, dim=1)
    frac_zero = (flat == 0).float().mean(dim=1)
    stats = torch.stack([mean, var.sqrt(), lo, hi, l2, frac_zero], dim=1)  # (N, 6)
    return stats, per_sample
