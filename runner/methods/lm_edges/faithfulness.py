"""The MIB circuit track's faithfulness curve and its two areas, CPR and CMD (Mueller et al. 2025).

As `evaluate_area_under_curve` in hannamw/MIB-circuit-track (MIB_circuit_track/evaluation.py) computes them:
  - the curve's x is the fraction p of the model's edges, p in MIB_FRACTIONS; the circuit at p holds the top
    int(p * edges) edges (truncation, MIB's `int(pct * n_scored_items)`), chosen by `Graph.apply_topn`;
  - f(p) = (mean m(C) - mean m(empty)) / (mean m(full) - mean m(empty)): a ratio of means over the data, not a mean of
    per-pair ratios; m(empty) is the circuit of no edge, measured with the same ablation, m(full) the clean model;
  - CPR = the trapezoid sum of f over the points (p, f(p)), CMD = the trapezoid sum of |1 - f|, both over x = p itself:
    no point at p = 0, no normalisation by the x-range (f = 1 everywhere gives CPR = 1 - 0.001 = 0.999, CMD = 0);
  - the published tables take CPR from signed ranking (`--absolute` off) and CMD from absolute ranking when both
    were run (print_results.py); the library default of `evaluate_area_under_curve` is absolute=True.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from runner.errors import RunnerError
from runner.options.method.lm_edges import MIB_FRACTIONS  # the curve's x (its config default, declared there)


def mib_size(fraction: float, total: int) -> int:
    """The edge count MIB evaluates at `fraction` of `total` edges: int(fraction * total), truncated."""
    return int(fraction * total)


def circuit_sizes(total: int, extra: Sequence[int] = (), fractions: Sequence[float] = MIB_FRACTIONS) -> list[int]:
    """The curve's edge counts, ascending and unique: 0 (m(empty), which f needs), MIB's at `fractions`, `extra`."""
    bad = [n for n in extra if not 0 <= n <= total]
    if bad:
        raise ValueError(f"circuit sizes {bad} are outside 0..{total} (the graph's edges)")
    return sorted({0, *(mib_size(p, total) for p in fractions), *(int(n) for n in extra)})


def faithfulness(circuit: np.ndarray, empty: np.ndarray | float, full: np.ndarray | float) -> np.ndarray:
    """(m(C) - m(empty)) / (m(full) - m(empty)), broadcast, float64; NaN where the denominator is 0."""
    num = np.asarray(circuit, dtype=np.float64) - np.asarray(empty, dtype=np.float64)
    den = np.asarray(full, dtype=np.float64) - np.asarray(empty, dtype=np.float64)
    num, den = np.broadcast_arrays(num, den)
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den != 0)  # only where defined: no division warning
    return out


def curve_areas(
    sizes: Sequence[int], total: int, f: np.ndarray, fractions: Sequence[float] = MIB_FRACTIONS
) -> tuple[float, float]:
    """(CPR, CMD) as MIB computes them: trapezoid sums over x = each fraction p (ascending) of f at int(p * total)
    edges, looked up in (sizes, f). Sizes on the curve but at none of `fractions` (extra sizes) do not enter, so the
    areas are comparable with published ones. NaN if a needed size is missing or NaN, or under two fractions."""
    f = np.asarray(f, dtype=np.float64)
    if len(sizes) != len(f) or len(set(sizes)) != len(sizes):
        raise ValueError(f"curve_areas: {len(sizes)} sizes (unique) and {len(f)} faithfulness values expected")
    at = dict(zip((int(n) for n in sizes), f.tolist(), strict=True))
    x = np.array(sorted(fractions), dtype=np.float64)
    y = np.array([at.get(mib_size(p, total), np.nan) for p in x])
    if len(x) < 2 or np.isnan(y).any():
        return float("nan"), float("nan")
    dx = np.diff(x)
    cpr = float(np.sum(dx * (y[:-1] + y[1:]) / 2))
    gap = np.abs(1.0 - y)  # MIB: the trapezoid of |1 - f| at the points, not |1 - f| integrated between them
    cmd = float(np.sum(dx * (gap[:-1] + gap[1:]) / 2))
    return cpr, cmd


def top_edges(scores: np.ndarray, n: int, absolute: bool) -> np.ndarray:
    """The indices of the n edges of largest score (absolute: largest |score|), best first; ties go to the lower index,
    NaN scores rank last. (MIB's `apply_topn` uses torch.argsort, which breaks ties in no fixed order.)"""
    key = np.asarray(scores, dtype=np.float64)
    if not 0 <= n <= len(key):
        raise ValueError(f"top_edges: n={n} outside 0..{len(key)}")
    key = np.abs(key) if absolute else key
    # a stable ascending sort of -key: larger first, equal keys in index order, NaN (= -NaN) sorted to the end
    return np.argsort(-key, kind="stable")[:n]


def mib_scores(scores: pd.DataFrame) -> pd.DataFrame:
    """The MIB circuit track's table from lm_circuit_scores rows of both rankings (a run of method.edges.ranking=both,
    or runs of each: `runner.results.load(folder, "lm_circuit_scores")`): per (scored_by, ablation, metric, split),
    CPR from the signed ranking's curve and CMD from the absolute one's, as print_results.py takes them (the mean
    where several runs give a group). Refused: rows lacking either ranking."""
    keys = [k for k in ("scored_by", "ablation", "metric", "split") if k in scores.columns]
    present = set(scores["ranking"]) if "ranking" in scores.columns else set()
    if not {"signed", "absolute"} <= present:
        raise RunnerError(
            f"mib_scores needs lm_circuit_scores of both rankings (signed for CPR, absolute for CMD); these rows have"
            f" {sorted(present) or 'none'}. Run both in one run with method.edges.ranking=both (experiment"
            " edges_mib_lm_induction does)."
        )
    cpr = scores[scores["ranking"] == "signed"].groupby(keys, observed=True)["cpr"].mean()
    cmd = scores[scores["ranking"] == "absolute"].groupby(keys, observed=True)["cmd"].mean()
    return pd.concat([cpr, cmd], axis=1).reset_index()
