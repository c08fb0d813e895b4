"""Per-sample statistics from one read of each tensor: the `record` hook's path (runner/stats.py gives the same values).

Each sample's row is cut into blocks of `b` elements (b divides the row, at most `MAX_BLOCK`). One pass over the
data gives, per block, its min, max, zero count, float32 mean m and the sums of the centred, scaled values
c = (x - m) * k (k = 1/spread, |c| <= 1: no float32 overflow at 1e20, no underflow at 1e-25). Everything after
that is float64 arithmetic on (N, D/b) block terms, Chan's merge of block moments:

    sum x = b*m + s1/k,  M2_block = (s2 - s1^2/b)/k^2,  M2 = sum M2_block + sum b*(mean_block - mean)^2

so nothing cancels (s1 is only m's rounding residue) and no value is read twice. A block fits in registers, so
under `torch.compile` (CUDA only, compiled on first use, eager if compilation fails) the block pass is one fused
kernel that reads the tensor once; on the CPU the same ops run eagerly, a chunk of samples at a time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from runner.stats import CHUNK_ELEMENTS, per_sample_stats

log = logging.getLogger(__name__)

# Largest block: Inductor keeps a reduction of up to 1024 elements in registers (a "persistent" reduction).
MAX_BLOCK = 1024
# A row without a divisor this large is one block (a looped reduction: correct, reads the row more than once).
MIN_BLOCK = 64


@functools.lru_cache(maxsize=256)
def block_size(n: int) -> int:
    """The largest divisor of `n` that is at most MAX_BLOCK; `n` itself when that divisor is below MIN_BLOCK."""
    for b in range(min(n, MAX_BLOCK), MIN_BLOCK - 1, -1):
        if n % b == 0:
            return b
    return n


def block_terms(blocks: torch.Tensor) -> torch.Tensor:
    """(N, nb, 7) per-block terms of `blocks` (N, nb, b): lo, hi, zeros, m, k, s1, s2 in the working precision.

    Plain elementwise ops and reductions over the last dimension, no data-dependent control flow: what
    Inductor fuses into one kernel.
    """
    work = torch.float64 if blocks.dtype == torch.float64 or not blocks.is_floating_point() else torch.float32
    b = blocks.shape[-1]
    x = blocks.to(work)  # (N, nb, b); under compile a cast in registers, not a copy
    lo, hi = torch.aminmax(x, dim=-1)  # (N, nb); NaN propagates, inf shows as itself
    zeros = (x == 0).sum(dim=-1).to(work)
    m = x.sum(dim=-1) / b
    # A block sum that overflows (values near 1e33 in float32): the midrange is a finite centre.
    m = torch.where(torch.isfinite(m), m, lo / 2 + hi / 2)
    spread = torch.maximum(hi - m, m - lo)  # (N, nb) the largest |x - m|
    # 1/spread, capped where spread is subnormal (its inverse would overflow); 1 for a constant or non-finite block.
    k = torch.where((spread > 0) & torch.isfinite(spread), (1 / spread).clamp_max(2.0**100), torch.ones_like(spread))
    c = torch.sub(x, m[..., None]).mul_(k[..., None])  # (N, nb, b), |c| <= 1; in place: one temporary in eager
    s1 = c.sum(dim=-1)
    s2 = c.square_().sum(dim=-1)
    return torch.stack([lo, hi, zeros, m, k, s1, s2], dim=-1)


def merge_blocks(terms: torch.Tensor, b: int) -> torch.Tensor:
    """(N, 7) float32 statistics (runner.stats.STAT_NAMES order) from (N, nb, 7) block terms, in float64."""
    t = terms.double()
    lo, hi, zeros, m, k, s1, s2 = t.unbind(-1)  # each (N, nb)
    n = b * t.shape[1]
    block_sum = b * m + s1 / k
    mean = block_sum.sum(dim=1) / n  # (N,)
    within = ((s2 - s1 * s1 / b) / (k * k)).clamp_min(0)  # each block's centred sum of squares
    between = b * (block_sum / b - mean[:, None]).square()
    var = (within.sum(dim=1) + between.sum(dim=1)) / n
    low, high = lo.amin(dim=1), hi.amax(dim=1)  # NaN in any block makes the row's NaN
    nonfinite = ~(torch.isfinite(low) & torch.isfinite(high))
    l2 = (n * (var + mean * mean)).sqrt()
    frac_zero = zeros.sum(dim=1) / n
    stats = torch.stack([mean, var.sqrt(), low, high, l2, frac_zero, nonfinite.double()], dim=1)  # (N, 7)
    return stats.float()


def _fused(flat: torch.Tensor, b: int) -> torch.Tensor:
    """(N, 7) statistics of the rows of `flat` (N, D), D a multiple of b."""
    return merge_blocks(block_terms(flat.reshape(flat.shape[0], -1, b)), b)


_compiled: Callable[[torch.Tensor, int], torch.Tensor] | None = None
_compile_failed = False


def _compiled_fused(flat: torch.Tensor, b: int) -> torch.Tensor:
    """`_fused` under torch.compile (compiled on first use); eager, logged once, when compilation fails."""
    global _compiled, _compile_failed
    if not _compile_failed:
        try:
            if _compiled is None:
                _compiled = torch.compile(_fused, fullgraph=True)
            # Batch sizes differ (an OOM split, a short last batch): symbolic from the start. Row and block sizes,
            # which differ by layer, turn symbolic at their second value (Dynamo's automatic dynamic shapes), so a
            # model's layers cost a few compilations, not one each (which would pass Dynamo's recompile limit).
            torch._dynamo.maybe_mark_dynamic(flat, 0)
            return _compiled(flat, b)
        except Exception as error:  # no Triton, no compiler, an unsupported op: the same values eagerly
            _compile_failed = True
            log.warning("fused statistics: torch.compile failed (%s); computing them eagerly", error)
    return _fused(flat, b)


def fused_stats(tensor: torch.Tensor, batch_size: int, compile: bool | None = None) -> tuple[torch.Tensor, bool]:
    """(stats, per_sample) as runner.stats.per_sample_stats: stats (N, 7) float32 on the tensor's device.

    `compile`: None compiles on CUDA only; True or False forces it (tests compile on the CPU).
    """
    t = tensor.detach()
    if t.dtype == torch.float64 or t.dtype == torch.bool or t.is_complex():
        return per_sample_stats(t, batch_size)  # float64's range needs the power-of-two scaling; rare on a hot path
    per_sample = t.dim() > 0 and t.shape[0] == batch_size
    flat = t.reshape(batch_size if per_sample else 1, -1)  # (N, D), no copy
    if flat.shape[1] == 0:
        return per_sample_stats(t, batch_size)
    b = block_size(flat.shape[1])
    if compile if compile is not None else flat.is_cuda:
        return _compiled_fused(flat, b), per_sample  # fused: no temporaries to bound
    rows = max(1, CHUNK_ELEMENTS // flat.shape[1])  # eager: bound the float32 temporaries as stats.py does
    return torch.cat([_fused(flat[i : i + rows], b) for i in range(0, flat.shape[0], rows)]), per_sample
