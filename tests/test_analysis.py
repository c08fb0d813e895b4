"""runner.analysis: bootstrap intervals over samples and paired tests, against scipy and hand computations."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

import runner.results
from runner.analysis import EXACT_MAX, paired_test, sign_flip_p, summarise
from runner.errors import RunnerError

ROOT = Path(__file__).resolve().parents[1]


def table(n: int = 12, seed: int = 0) -> pd.DataFrame:
    """A cam-like table: 2 layers x 2 methods x n samples, method b worse than a by about 0.3 at layer l2."""
    rng = np.random.default_rng(seed)
    rows = []
    for layer, method in itertools.product(["l1", "l2"], ["a", "b"]):
        shift = 0.3 if (layer, method) == ("l2", "b") else 0.0
        for s, v in enumerate(rng.normal(size=n) - shift):
            rows.append({"layer": layer, "method": method, "sample": s, "score": v})
    return pd.DataFrame(rows)


def scipy_interval(values: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    res = stats.bootstrap(
        (values,), np.mean, n_resamples=n_boot, method="percentile", rng=np.random.default_rng(seed), vectorized=True
    )
    return res.confidence_interval.low, res.confidence_interval.high


def test_summarise_interval_is_scipys_percentile_bootstrap() -> None:
    frame = table()
    out = summarise(frame, "score", by=["layer", "method"], n_boot=999, seed=7)
    assert out[["layer", "method"]].values.tolist() == [["l1", "a"], ["l1", "b"], ["l2", "a"], ["l2", "b"]]
    for row in out.itertuples():
        values = frame[(frame.layer == row.layer) & (frame.method == row.method)]["score"].to_numpy()
        low, high = scipy_interval(values, 999, 7)
        assert row.n == 12 and row.mean == pytest.approx(values.mean(), abs=1e-12)
        assert (row.ci_low, row.ci_high) == pytest.approx((low, high), abs=1e-12)
        assert row.ci_low < row.mean < row.ci_high


def test_summarise_counts_each_sample_once_and_drops_nan() -> None:
    frame = pd.DataFrame({
        "layer": ["l"] * 6, "method": ["m"] * 6,
        "sample": [0, 0, 1, 1, 2, 3],  # two targets for samples 0 and 1
        "score": [1.0, 3.0, 5.0, 7.0, 9.0, np.nan],
    })  # fmt: skip
    out = summarise(frame, "score", n_boot=200, seed=0)
    assert out["n"].tolist() == [3]  # samples 0, 1, 2: sample 3 has only NaN
    assert out["mean"].tolist() == [pytest.approx((2.0 + 6.0 + 9.0) / 3)]
    low, high = scipy_interval(np.array([2.0, 6.0, 9.0]), 200, 0)
    assert (out["ci_low"][0], out["ci_high"][0]) == pytest.approx((low, high), abs=1e-12)


def test_summarise_interval_of_one_sample_is_nan() -> None:
    out = summarise(pd.DataFrame({"layer": ["l"], "method": ["m"], "sample": [0], "score": [1.0]}), "score")
    assert out["n"][0] == 1 and out["mean"][0] == 1.0 and np.isnan(out["ci_low"][0]) and np.isnan(out["ci_high"][0])


def test_sign_flip_p_by_hand() -> None:
    # flips of (1, 2, 3): sums 6, 4, 2, 0, 0, -2, -4, -6; |mean| >= 2 only for +-6: p = 2/8
    assert sign_flip_p(np.array([1.0, 2.0, 3.0]), 0, 0) == 0.25
    assert sign_flip_p(np.zeros(4), 0, 0) == 1.0
    assert np.isnan(sign_flip_p(np.array([]), 0, 0))


def test_sign_flip_p_is_scipys_exact_permutation_test() -> None:
    diffs = np.random.default_rng(1).normal(0.4, 1.0, size=9)
    expected = stats.permutation_test(
        (diffs,), np.mean, permutation_type="samples", n_resamples=np.inf, vectorized=True
    ).pvalue
    assert sign_flip_p(diffs, 0, 0) == pytest.approx(expected, abs=1e-12)


def test_sign_flip_p_beyond_exact_is_a_close_monte_carlo_estimate() -> None:
    n = EXACT_MAX + 2
    diffs = np.random.default_rng(2).normal(0.3, 1.0, size=n)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # every pattern, by another route
    exact = float((np.abs(signs @ diffs) >= abs(diffs.sum()) - 1e-9).mean())
    estimate = sign_flip_p(diffs, 20000, 0)
    assert 0.01 < exact < 0.99 and estimate == pytest.approx(exact, abs=0.015)


def test_paired_test_against_scipy() -> None:
    frame = table()
    out = paired_test(frame, "score", ("method", "a", "b"), by=["layer"], n_boot=999, seed=3).set_index("layer")
    assert out.columns[:2].tolist() == ["method_a", "method_b"]
    for layer in ("l1", "l2"):
        a = frame[(frame.layer == layer) & (frame.method == "a")].sort_values("sample")["score"].to_numpy()
        b = frame[(frame.layer == layer) & (frame.method == "b")].sort_values("sample")["score"].to_numpy()
        row = out.loc[layer]
        assert row["n"] == 12 and row["mean_diff"] == pytest.approx((a - b).mean(), abs=1e-12)
        assert (row["mean_a"], row["mean_b"]) == pytest.approx((a.mean(), b.mean()), abs=1e-12)
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(scipy_interval(a - b, 999, 3), abs=1e-12)
        assert row["p_wilcoxon"] == pytest.approx(stats.wilcoxon(a - b).pvalue, abs=1e-12)
        exact = stats.permutation_test((a - b,), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue
        assert row["p_value"] == pytest.approx(exact, abs=1e-12)  # 12 pairs: every sign pattern


def test_paired_test_pairs_only_samples_with_both() -> None:
    frame = table(n=6)
    frame = frame[~((frame.method == "b") & (frame["sample"] == 0))]  # sample 0 has no b
    out = paired_test(frame, "score", ("method", "a", "b"), by=["layer"], n_boot=50)
    assert out["n"].tolist() == [5, 5]
    a = frame[(frame.layer == "l1") & (frame.method == "a") & (frame["sample"] > 0)]["score"].to_numpy()
    assert out["mean_a"][0] == pytest.approx(a.mean(), abs=1e-12)  # sample 0's a is left out too


def test_paired_test_between_layers() -> None:
    out = paired_test(table(), "score", ("layer", "l1", "l2"), by=["method"], n_boot=50)
    assert out["method"].tolist() == ["a", "b"] and out.columns[1:3].tolist() == ["layer_a", "layer_b"]


def test_summaries_list_layers_in_model_order_as_an_ordered_categorical() -> None:
    """By `layer_index` (features.2 before features.10), not by name and not by first appearance."""
    frame = table(n=4)
    frame["layer"] = frame["layer"].map({"l1": "features.10", "l2": "features.2"})  # features.10 comes first
    frame["layer_index"] = frame["layer"].map({"features.10": 11, "features.2": 3})
    for out in (
        summarise(frame, "score", by=["layer", "method"], n_boot=50),
        paired_test(frame, "score", ("method", "a", "b"), by=["layer"], n_boot=50, n_perm=50),
    ):
        assert isinstance(out["layer"].dtype, pd.CategoricalDtype) and out["layer"].cat.ordered
        assert list(out["layer"].cat.categories) == ["features.2", "features.10"]
        assert list(dict.fromkeys(out["layer"])) == ["features.2", "features.10"]
        assert out.groupby("layer").size().index.tolist() == ["features.2", "features.10"]
    # Without a position (a frame built by hand): as the layers come.
    plain = summarise(frame.drop(columns="layer_index"), "score", by=["layer"], n_boot=50)
    assert plain["layer"].tolist() == ["features.10", "features.2"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: summarise(f, "nope"), "no column.*'nope'"),
        (lambda f: paired_test(f, "score", ("method", "a", "c")), r"method=\['c'\] has no rows"),
        (lambda f: paired_test(f, "score", ("method", "a", "b"), by=["method"]), "cannot also be in by"),
        (lambda f: summarise(f, "method", by=["layer"]), "not numeric"),
    ],
)
def test_clear_errors(call, message: str) -> None:  # noqa: ANN001
    with pytest.raises(RunnerError, match=message):
        call(table(n=3))


def test_runner_results_re_exports_them() -> None:
    assert runner.results.summarise is summarise and runner.results.paired_test is paired_test


def test_summarize_script_reports_intervals(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("summarize_script", ROOT / "scripts" / "summarize.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    frame = table().rename(columns={"score": "spearman"}).assign(experiment="e", direction="denoising")
    frame = frame.rename(columns={"method": "cam_method"})
    path = tmp_path / "part.parquet"
    frame.to_parquet(path)
    out = script.summarize_intervals(path, "cam_vs_patching", 999, 7)
    assert out.columns.tolist() == ["n", "spearman", "spearman_low", "spearman_high"]
    row = out.loc[("e", "denoising", "l2", "b")]
    values = frame[(frame.layer == "l2") & (frame.cam_method == "b")]["spearman"].to_numpy()
    assert (row["spearman_low"], row["spearman_high"]) == pytest.approx(scipy_interval(values, 999, 7), abs=1e-12)
    paired = script.paired(path, "cam_vs_patching", ["cam_method", "a", "b"], "spearman", 99, 0)
    assert paired.index.names == ["experiment", "direction", "layer"] and paired["n"].tolist() == [12, 12]
