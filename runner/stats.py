"""Per-sample summary statistics of a tensor, computed on its device in a few fused reductions."""

from __future__ import annotations

import pyarrow as pa
import torch
import torch.nn.functional as F

STAT_NAMES = ("mean", "std", "min", "max", "l2_norm", "frac_zero", "nonfinite")


def stat_fields(prefix: str = "") -> list[pa.Field]:
    """The statistics' declared columns (`prefix` + name): float32, and the `nonfinite` flag a boolean."""
    return [pa.field(f"{prefix}{s}", pa.bool_() if s == "nonfinite" else pa.float32()) for s in STAT_NAMES]


# Elements per chunk of samples: bounds the temporaries (a float32 copy of the chunk, centred, and its `== 0` mask)
# at 16 MiB + 4 MiB whatever the tensor's size; a sample larger than this is one chunk on its own.
CHUNK_ELEMENTS = 1 << 22


def per_sample_stats(tensor: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, bool]:
    """(stats, per_sample): stats is (N, len(STAT_NAMES)) float32, one row per sample.

    A tensor whose first dimension is not the batch (a buffer, a shared weight) gets one row with
    sample index -1, so nothing is silently dropped.
    """
    t = tensor.detach()
    per_sample = t.dim() > 0 and t.shape[0] == batch_size
    flat = t.reshape(batch_size if per_sample else 1, -1)  # (N, D), in the tensor's own dtype: no copy
    rows = max(1, CHUNK_ELEMENTS // max(1, flat.shape[1]))
    stats = torch.cat([_chunk_stats(flat[i : i + rows]) for i in range(0, flat.shape[0], rows)])  # (N, 7)
    return stats.float(), per_sample


def _chunk_stats(flat: torch.Tensor) -> torch.Tensor:
    """(N, 7) float64 statistics of the rows of `flat` (N, D), computed in float32 (float64 for float64 and
    integer input) with only the per-row accumulators in float64.

    Shifted moments: each row is centred on its float32 mean m and scaled by a power of two s (exact) to
    |c| <= 1, c = (x - m) / s. Then mean = m + s * sum(c) / D and var = s^2 * (sum(c^2) / D - (sum(c) / D)^2):
    sum(c) is only the rounding residue of m, so nothing cancels (x - m is even exact where x is within a
    factor 2 of m, Sterbenz), and the scaling keeps c^2 from overflowing or underflowing float32 (gradients of
    1e-25, activations of 1e20). The L2 norm needs no pass of its own: sum(x^2) = D * (var + mean^2).
    """
    n = flat.shape[1]
    work = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
    if not flat.is_floating_point():
        flat, work = flat.double(), torch.float64  # integers: a float32 sum could round large counts
    lo, hi = torch.aminmax(flat, dim=1)  # NaN in a row makes both NaN, inf shows as itself
    nonfinite = ~(torch.isfinite(lo) & torch.isfinite(hi))
    shift = flat.sum(dim=1, dtype=work) / n  # (N,) float32; on GPUs bf16/fp16 are read as such, no copy
    # A sum that overflows float32 (values near 1e33): the midrange is a finite shift; scaling handles the rest.
    shift = torch.where(torch.isfinite(shift), shift, lo.to(work) / 2 + hi.to(work) / 2)
    lo64, hi64, shift64 = lo.double(), hi.double(), shift.double()
    spread = torch.maximum(hi64 - shift64, shift64 - lo64)  # (N,) the largest |x - m|
    _, exponent = torch.frexp(torch.where((spread > 0) & torch.isfinite(spread), spread, torch.ones_like(spread)))
    exponent = exponent.clamp(-120, 120)  # 2^-exponent stays a normal float32
    inverse = torch.ldexp(torch.ones_like(shift), -exponent)  # (N,) 1/s in the working precision, exact
    centred = torch.sub(flat, shift[:, None]).mul_(inverse[:, None])  # (N, D) in the working precision, |c| <= 1
    s1 = centred.sum(dim=1).double()  # (N,)
    # Squared in place and summed: torch's sums are pairwise (a few ulp), its CPU vector_norm is not (~1e-6).
    s2 = centred.square_().sum(dim=1).double()  # (N,)
    del centred
    scale = torch.ldexp(torch.ones_like(shift64), exponent)  # (N,) s in float64
    residue = s1 / n
    mean = shift64 + scale * residue
    var = (scale * scale * (s2 / n - residue * residue)).clamp_min(0)
    l2 = (n * (var + mean * mean)).sqrt()
    frac_zero = (flat == 0).sum(dim=1).double() / n
    return torch.stack([mean, var.sqrt(), lo64, hi64, l2, frac_zero, nonfinite.double()], dim=1)


def uniform_rows(tensor: torch.Tensor) -> torch.Tensor:
    """(B,) bool: row b of `tensor` (B, ...) has one value throughout (a NaN row compares unequal: False)."""
    lo, hi = torch.aminmax(tensor.detach().flatten(1), dim=1)
    return hi == lo


def constant_rows(tensor: torch.Tensor) -> torch.Tensor:
    """(B,) bool: row b of `tensor` (B, ...) has one value throughout (all zero, say) or holds a NaN/inf.

    Such a row orders nothing: a map that ranks no pixel, logits that prefer no class.
    """
    return uniform_rows(tensor) | ~torch.isfinite(tensor.detach().flatten(1)).all(dim=1)


def upsample(maps: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """(B, h, w) maps -> (B, H, W) at the input's size, bilinear, each scaled to [0, 1]; a map constant at its own
    resolution becomes all 0 (a non-finite one keeps its NaN).

    Decided before upsampling: float32 bilinear weights leave 1-ulp ripples on a constant map, which min-max
    scaling would stretch into a full-range map of noise."""
    constant = uniform_rows(maps)[:, None, None]  # (B, 1, 1); a non-finite map is not zeroed
    up = F.interpolate(maps[:, None].float(), size=tuple(size), mode="bilinear", align_corners=False)[:, 0]
    lo = up.flatten(1).amin(dim=1)[:, None, None]
    hi = up.flatten(1).amax(dim=1)[:, None, None]
    scaled = (up - lo) / (hi - lo).clamp_min(1e-12)  # (B, H, W)
    return torch.where(constant, torch.zeros_like(scaled), scaled)
