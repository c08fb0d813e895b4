"""Uncertainty over samples: per-group means with bootstrap intervals, and paired tests between two methods or layers.

The unit of resampling is the sample: a table's rows are first averaged per (group, sample) (over targets,
calls or jobs the grouping does not name), NaN values dropped, so that each sample counts once.

- `summarise(frame, value, by=[layer, method])`: per group, the mean over samples and its 95% percentile
  bootstrap interval (`n_boot` resamples of the samples with replacement, drawn from `seed`); the same
  interval as `scipy.stats.bootstrap((x,), np.mean, method="percentile", rng=np.random.default_rng(seed))`.
- `paired_test(frame, value, between=("method", a, b), by=[layer])`: per group, the samples that have both a
  and b, the mean of the differences a - b, its bootstrap interval, a two-sided sign-flip permutation p-value
  (exact over all 2^n sign patterns up to `EXACT_MAX` samples, else `n_perm` random flips) and Wilcoxon's
  signed-rank p-value (scipy; NaN where it is undefined, e.g. all differences zero).
An interval of fewer than two samples is NaN: one value says nothing about its spread.
Where `layer` is a grouping column, the result's `layer` is an ordered categorical in model order (runner/viz/summary.py
`with_layer_order`: by `layer_index`, or the input's own categorical order) and its rows follow that order.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

from runner.errors import RunnerError
from runner.frames import with_layer_order

LEVEL = 0.95
EXACT_MAX = 16  # up to 2^16 sign patterns enumerated exactly; beyond, Monte Carlo flips
SUMMARY_COLUMNS = ["n", "mean", "ci_low", "ci_high"]
PAIRED_COLUMNS = ["n", "mean_a", "mean_b", "mean_diff", "ci_low", "ci_high", "p_value", "p_wilcoxon"]


def _per_sample(frame: pd.DataFrame, value: str, keys: Sequence[str], unit: Sequence[str]) -> pd.DataFrame:
    """`value` averaged per (keys, unit), NaN values dropped first: one row per sample and group."""
    missing = [c for c in (value, *keys, *unit) if c not in frame.columns]
    if missing:
        raise RunnerError(
            f"The table has no column(s) {', '.join(map(repr, missing))}; it has {', '.join(map(str, frame.columns))}."
        )
    data = frame[[*keys, *unit, value]].dropna(subset=[value])
    if not pd.api.types.is_numeric_dtype(data[value]):
        raise RunnerError(f"Column '{value}' is {data[value].dtype}, not numeric: pick a measured column.")
    return data.groupby([*keys, *unit], sort=False, dropna=False, observed=True)[value].mean().reset_index()


def _groups(data: pd.DataFrame, by: Sequence[str]):  # noqa: ANN202 - (key tuple, frame) pairs
    """(key tuple, rows) per group of `by`, in order of first appearance; one group () when `by` is empty."""
    if not by:
        return [((), data)]
    groups = data.groupby(list(by), sort=False, dropna=False, observed=True)
    return [(k if isinstance(k, tuple) else (k,), g) for k, g in groups]


def _in_layer_order(result: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """`result` with `layer` the ordered categorical of `frame` (model order) and its rows stably in that order."""
    if "layer" not in result.columns or "layer" not in frame.columns:
        return result
    layers = pd.Categorical(result["layer"], dtype=frame["layer"].dtype)
    return result.assign(layer=layers).sort_values("layer", kind="stable").reset_index(drop=True)


def bootstrap_interval(values: np.ndarray, n_boot: int, seed: int, level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (n,): NaN for n < 2.

    Resamples are `np.random.default_rng(seed).integers(0, n, (n_boot, n))`, as scipy.stats.bootstrap draws them.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[0]
    if n < 2:
        return float("nan"), float("nan")
    if n_boot < 1:
        raise RunnerError(f"n_boot={n_boot}: give at least 1 resample (1000 to 10000 is usual).")
    resamples = np.random.default_rng(seed).integers(0, n, (n_boot, n))  # (n_boot, n) sample indices
    means = values[resamples].mean(axis=-1)  # (n_boot,)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(low), float(high)


def sign_flip_p(diffs: np.ndarray, n_perm: int, seed: int) -> float:
    """Two-sided p-value of mean(diffs) == 0 by flipping the signs of the paired differences (n,).

    Exact (every sign pattern) up to EXACT_MAX values, else (1 + hits) / (1 + n_perm) over random flips. NaN for n = 0.
    """
    diffs = np.asarray(diffs, dtype=np.float64)
    n = diffs.shape[0]
    if n == 0:
        return float("nan")
    observed = abs(diffs.mean())
    tolerance = 1e-12 * max(1.0, observed)  # a flip equal to the observed mean up to rounding counts as a hit
    if n <= EXACT_MAX:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # (2^n, n)
        return float((np.abs(signs @ diffs / n) >= observed - tolerance).mean())
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(n_perm, n))  # (n_perm, n)
    hits = int((np.abs(signs @ diffs / n) >= observed - tolerance).sum())
    return (1 + hits) / (1 + n_perm)


def wilcoxon_p(diffs: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of the differences (scipy), NaN where undefined (no nonzero one)."""
    try:
        from scipy.stats import wilcoxon
    except ImportError:  # pragma: no cover - scipy comes with scikit-image, a dependency
        return float("nan")
    diffs = np.asarray(diffs, dtype=np.float64)
    if diffs.shape[0] == 0 or not np.any(diffs != 0):
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-sample and tie notes: the value is reported as scipy computes it
        try:
            return float(wilcoxon(diffs).pvalue)
        except ValueError:
            return float("nan")


def summarise(
    frame: pd.DataFrame, value: str, by: Sequence[str] = ("layer", "method"), n_boot: int = 2000, seed: int = 0,
    unit: Sequence[str] = ("sample",), level: float = LEVEL,
) -> pd.DataFrame:  # fmt: skip
    """Per group of `by`: n samples, the mean of `value` over them and its percentile bootstrap interval (groups in
    order of first appearance, layers in model order)."""
    if "layer" in by:
        frame = with_layer_order(frame)
    data = _per_sample(frame, value, by, unit)
    rows = []
    for key, group in _groups(data, by):
        values = group[value].to_numpy(dtype=np.float64)
        low, high = bootstrap_interval(values, n_boot, seed, level)
        mean = float(values.mean()) if len(values) else float("nan")
        rows.append((*key, len(values), mean, low, high))
    return _in_layer_order(pd.DataFrame(rows, columns=[*by, *SUMMARY_COLUMNS]), frame)


def paired_test(
    frame: pd.DataFrame, value: str, between: tuple[str, object, object], by: Sequence[str] = ("layer",),
    n_boot: int = 2000, n_perm: int = 10000, seed: int = 0, unit: Sequence[str] = ("sample",), level: float = LEVEL,
) -> pd.DataFrame:  # fmt: skip
    """Per group of `by`: a vs b of `between` = (column, a, b) on the samples that have both, differences a - b."""
    column, a, b = between
    if column in by:
        raise RunnerError(f"paired_test: '{column}' is what is compared; it cannot also be in by={list(by)}.")
    if column not in frame.columns:
        raise RunnerError(f"The table has no column '{column}' to compare {a!r} and {b!r} by.")
    present = set(frame[column].dropna().unique())
    absent = [v for v in (a, b) if v not in present]
    if absent:
        raise RunnerError(f"paired_test: {column}={absent} has no rows; the table has {sorted(map(str, present))}.")
    if "layer" in by:
        frame = with_layer_order(frame)
    data = _per_sample(frame[frame[column].isin([a, b])], value, [*by, column], unit)
    keys = [*by, *unit]
    left = data[data[column] == a].drop(columns=column)
    right = data[data[column] == b].drop(columns=column)
    paired = left.merge(right, on=keys, suffixes=("_a", "_b"))  # only the samples measured under both
    rows = []
    for key, group in _groups(paired, by):
        va, vb = group[f"{value}_a"].to_numpy(np.float64), group[f"{value}_b"].to_numpy(np.float64)
        diffs = va - vb  # (n,)
        n = len(diffs)
        low, high = bootstrap_interval(diffs, n_boot, seed, level)
        means = [float(v.mean()) if n else float("nan") for v in (va, vb, diffs)]
        rows.append((*key, a, b, n, *means, low, high, sign_flip_p(diffs, n_perm, seed), wilcoxon_p(diffs)))
    return _in_layer_order(pd.DataFrame(rows, columns=[*by, f"{column}_a", f"{column}_b", *PAIRED_COLUMNS]), frame)
