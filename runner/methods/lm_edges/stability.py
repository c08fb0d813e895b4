"""Bootstrap stability of edge scores and circuits: how much of a circuit is the data, how much the draw of the pairs.

Resample r draws N pairs with replacement (`numpy.random.default_rng(seed).integers(0, N, (R, N))[r]`), positions in
the pairs' canonical order: sorted by their ids where the ids are given (a draw is then keyed by pair id, and the same
pairs in another order give the same resamples, to the bit), else the columns' order. Its edge scores are the means
over the drawn pairs, W @ scores.T / N with W the (R, N) matrix of draw counts, in float64 (summed in that order).
From them:
  - each edge's percentile interval of its resampled mean at `level`;
  - per circuit size n, each edge's inclusion: the fraction of resamples whose top-n (`top_edges`) holds it;
  - per size n, the Jaccard overlap |A ∩ B| / |A ∪ B| of the top-n sets A, B of every pair of resamples: its mean and
    5th/95th percentiles over the R(R-1)/2 pairs. Pairs of resamples, not each resample against the full-data
    circuit: the spread of the estimator itself, as the stability analyses of circuits report it (Méloux et al.
    2025). Size 0 has no Jaccard (0/0, NaN); size E has 1.
With fewer than 2 pairs or 2 resamples there is no spread to measure: intervals and Jaccard are NaN (with one pair,
inclusion too).

Memory stays bounded for E ~ 1.5M edges: the means are made in blocks of _BLOCK float64 values (pass 1 over edge
blocks for the intervals, pass 2 over resample blocks for the rankings), and the circuits are kept as one small
integer per (resample, edge): the smallest size whose top-n holds it (R x E bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runner.methods.lm_edges.faithfulness import top_edges

_BLOCK = 1 << 24  # float64 values per block of means (128 MiB)


@dataclass
class Stability:
    lo: np.ndarray  # (E,) float64: each edge's resampled mean, lower end of the interval at `level`
    hi: np.ndarray  # (E,) float64: upper end
    inclusion: dict[int, np.ndarray]  # size -> (E,) float64: the fraction of resamples whose top-n holds the edge
    jaccard: dict[int, tuple[float, float, float]]  # size -> (mean, 5th, 95th percentile) over pairs of resamples


def _means(counts: np.ndarray, scores: np.ndarray, cols: slice, order: list[int] | None) -> np.ndarray:
    """(rows of counts, edges in cols) float64: the resamples' mean scores (an edge block converted at a time, its
    pairs put in the canonical `order`: the sums run in that order)."""
    block = scores[cols] if order is None else scores[cols][:, order]
    return counts @ block.astype(np.float64).T / scores.shape[1]


def canonical_order(ids: Sequence[str] | None, n: int) -> list[int] | None:
    """The columns in their ids' sorted order (None: the columns' own order, as where they are sorted already)."""
    if ids is None:
        return None
    if len(ids) != n or len(set(ids)) != n:
        raise ValueError(f"bootstrap: {n} pairs need {n} distinct ids, got {len(ids)} ({len(set(ids))} distinct)")
    order = sorted(range(n), key=lambda i: ids[i])
    return None if order == list(range(n)) else order


def _blocks(total: int, step: int) -> list[slice]:
    return [slice(i, min(i + step, total)) for i in range(0, total, step)]


def bootstrap(
    scores: np.ndarray, sizes: Sequence[int], resamples: int, seed: int, absolute: bool, level: float = 0.95,
    ids: Sequence[str] | None = None,
) -> Stability:  # fmt: skip
    """The bootstrap over pairs of `scores` (E, N) (edge x pair): intervals, inclusion and Jaccard per size; `ids`
    (N distinct): the pairs' ids, whose sorted order the draws are made in."""
    e, n = scores.shape
    sizes = sorted({int(s) for s in sizes})
    if resamples < 1 or n < 1 or not 0 < level < 1 or any(not 0 <= s <= e for s in sizes):
        raise ValueError(f"bootstrap: resamples={resamples}, pairs={n}, level={level}, sizes within 0..{e} needed")
    canonical = canonical_order(ids, n)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(resamples, n))  # (R, N) the pairs each resample takes
    offsets = (draws + n * np.arange(resamples)[:, None]).ravel()
    counts = np.bincount(offsets, minlength=resamples * n).reshape(resamples, n).astype(np.float64)  # (R, N) W
    spread = n >= 2 and resamples >= 2

    lo, hi = np.full(e, np.nan), np.full(e, np.nan)
    if spread:
        tail = (1 - level) / 2
        for cols in _blocks(e, max(1, _BLOCK // (resamples + n))):
            lo[cols], hi[cols] = np.quantile(_means(counts, scores, cols, canonical), [tail, 1 - tail], axis=0)

    # smallest[r, i]: the index in `sizes` of the smallest size whose top-n in resample r holds edge i (len: none)
    smallest = np.full((resamples, e), len(sizes), dtype=np.min_scalar_type(len(sizes)))
    held = np.zeros((len(sizes), e), dtype=np.int32)  # resamples whose top-n holds the edge, per size
    for rows in _blocks(resamples, max(1, _BLOCK // max(e, 1))) if sizes else []:
        block = np.empty((rows.stop - rows.start, e))  # (r, E)
        for cols in _blocks(e, max(1, _BLOCK // (n + block.shape[0]))):
            block[:, cols] = _means(counts[rows], scores, cols, canonical)
        for r, means in zip(range(rows.start, rows.stop), block, strict=True):
            order = top_edges(means, sizes[-1], absolute)
            for k in range(len(sizes) - 1, -1, -1):  # largest first, so each edge ends at its smallest size
                smallest[r, order[: sizes[k]]] = k
                held[k, order[: sizes[k]]] += 1

    inclusion = {s: held[k] / resamples if n >= 2 else np.full(e, np.nan) for k, s in enumerate(sizes)}
    jaccard = {s: _jaccard(smallest, held[k], k, s) if spread else (np.nan,) * 3 for k, s in enumerate(sizes)}
    return Stability(lo, hi, inclusion, jaccard)


def _jaccard(smallest: np.ndarray, held: np.ndarray, k: int, size: int) -> tuple[float, float, float]:
    """(mean, 5th, 95th percentile) of the Jaccard overlap of the top-`size` sets over pairs of resamples."""
    if size == 0:
        return (np.nan,) * 3  # two empty sets: 0/0
    resamples = smallest.shape[0]
    # |A_i ∩ A_j| = edges in every resample + the Gram matrix of the others' membership (edges in none add nothing)
    common = np.full((resamples, resamples), float((held == resamples).sum()))
    mixed = np.flatnonzero((held > 0) & (held < resamples))
    for cols in _blocks(len(mixed), max(1, _BLOCK // resamples)):
        member = (smallest[:, mixed[cols]] <= k).astype(np.float32)  # (R, m) exact: counts < 2^24
        common += member @ member.T
    inter = common[np.triu_indices(resamples, 1)]
    overlap = inter / (2 * size - inter)  # |A| = |B| = size
    return float(overlap.mean()), float(np.percentile(overlap, 5)), float(np.percentile(overlap, 95))
