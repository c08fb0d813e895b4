"""The circuit scores of lm_edges: MIB's faithfulness curve and areas (faithfulness.py), the bootstrap stability of
edges and circuits (stability.py), and the EAP-IG graph file (export.py)."""

from __future__ import annotations

import json
import re
import warnings
from itertools import combinations
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from runner.methods.lm_edges import stability
from runner.methods.lm_edges.export import eap_ig_graph, write_eap_ig_graph
from runner.methods.lm_edges.faithfulness import (
    MIB_FRACTIONS,
    circuit_sizes,
    curve_areas,
    faithfulness,
    mib_size,
    top_edges,
)
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.stability import bootstrap

# ---------------------------------------------------------------------------------------------- faithfulness.py


def _mib_areas(percentages: list[float], f: list[float]) -> tuple[float, float]:
    """MIB's loop (MIB_circuit_track/evaluation.py, evaluate_area_under_curve, log_scale=False), transcribed."""
    area_under, area_from_1 = 0.0, 0.0
    for i in range(len(f) - 1):
        x_1, x_2 = percentages[i], percentages[i + 1]
        area_from_1 += (x_2 - x_1) * ((abs(1.0 - f[i]) + abs(1.0 - f[i + 1])) / 2)
        area_under += (x_2 - x_1) * ((f[i] + f[i + 1]) / 2)
    return area_under, area_from_1


def test_circuit_sizes_truncate_as_mib_and_add_the_empty_circuit() -> None:
    mib = [0, 70, 141, 353, 706, 1413, 3532, 7065, 14130, 35325, 70651]  # int(p * 70651): 353.255 -> 353
    assert circuit_sizes(70651) == mib
    assert circuit_sizes(70651, extra=(5, 70, 70651)) == sorted([*mib, 5])
    assert circuit_sizes(100) == [0, 1, 2, 5, 10, 20, 50, 100]  # 0.1%, 0.2%, 0.5% of 100 edges: 0 edges
    assert circuit_sizes(1000, fractions=(0.25,)) == [0, 250]
    with pytest.raises(ValueError):
        circuit_sizes(10, extra=(11,))


def test_faithfulness_is_the_normalised_metric_and_nan_without_a_span() -> None:
    got = faithfulness(np.array([1.0, 2.0, 3.0, 5.0]), 1.0, 3.0)
    np.testing.assert_allclose(got, [0.0, 0.5, 1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = faithfulness(np.array([1.0, 2.0]), np.array([2.0, 0.0]), np.array([2.0, 4.0]))
    assert np.isnan(got[0]) and got[1] == 0.5


def test_curve_areas_of_a_perfect_circuit() -> None:
    total = 70651
    sizes = circuit_sizes(total)[1:]
    cpr, cmd = curve_areas(sizes, total, np.ones(len(sizes)))
    assert cpr == pytest.approx(1.0 - 0.001, abs=1e-12)  # the x-range, not 1: no point at 0, no normalisation
    assert cmd == pytest.approx(0.0, abs=1e-12)


def test_curve_areas_are_exact_for_a_linear_curve() -> None:
    total = 1000  # int(p * 1000) = 1000 p for MIB's fractions: f(size) = size / total = p exactly
    sizes = circuit_sizes(total)[1:]
    f = np.array(sizes) / total
    cpr, cmd = curve_areas(sizes, total, f)
    assert cpr == pytest.approx((1.0 - 0.001**2) / 2, abs=1e-12)
    assert cmd == pytest.approx((1.0 - 0.001) - (1.0 - 0.001**2) / 2, abs=1e-12)  # |1 - x| = 1 - x on [0.001, 1]


def test_curve_areas_of_x_squared_within_the_trapezoid_error() -> None:
    total = 10**6
    fractions = [k / 1000 for k in range(1, 1001)]
    sizes = [mib_size(p, total) for p in fractions]
    assert len(set(sizes)) == len(sizes)
    cpr, _ = curve_areas(sizes, total, np.array(fractions) ** 2, fractions=fractions)
    exact = (1.0 - 0.001**3) / 3
    bound = 0.999 * 0.001**2 * 2 / 12  # (b - a) h^2 max|f''| / 12
    assert exact <= cpr <= exact + bound + 1e-12  # f convex: the trapezoids lie above


def test_curve_areas_by_hand_and_as_mib_loops() -> None:
    cpr, cmd = curve_areas([1, 5, 10], 10, np.array([0.2, 1.4, 1.0]), fractions=(0.1, 0.5, 1.0))
    assert cpr == pytest.approx(0.4 * (0.2 + 1.4) / 2 + 0.5 * (1.4 + 1.0) / 2)  # 0.92
    assert cmd == pytest.approx(0.4 * (0.8 + 0.4) / 2 + 0.5 * (0.4 + 0.0) / 2)  # 0.34
    total = 70651
    sizes = circuit_sizes(total)[1:]
    f = np.random.default_rng(0).normal(0.6, 0.5, len(sizes))
    np.testing.assert_allclose(curve_areas(sizes, total, f), _mib_areas(list(MIB_FRACTIONS), f.tolist()), rtol=1e-12)


def test_curve_areas_use_mib_points_only() -> None:
    total = 1000
    sizes = circuit_sizes(total)[1:]
    f = np.linspace(0.1, 1.0, len(sizes))
    base = curve_areas(sizes, total, f)
    assert curve_areas([*sizes, 3, 7], total, np.r_[f, 100.0, -5.0]) == pytest.approx(base)  # extra sizes ignored
    small = circuit_sizes(100)  # 0.1%..0.5% of 100 edges are the empty circuit, whose f MIB uses 3 times
    got = curve_areas(small, 100, np.linspace(0.0, 1.0, len(small)))
    by_size = dict(zip(small, np.linspace(0.0, 1.0, len(small)), strict=True))
    want = _mib_areas(list(MIB_FRACTIONS), [by_size[mib_size(p, 100)] for p in MIB_FRACTIONS])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.isnan(curve_areas(sizes[1:], total, f[1:])).all()  # a point MIB needs is missing
    assert np.isnan(curve_areas(sizes, total, np.r_[np.nan, f[1:]])).all()


def test_top_edges_ties_nan_and_absolute() -> None:
    scores = np.array([1.0, 3.0, np.nan, 3.0, -5.0, 1.0, -np.inf])
    assert top_edges(scores, 7, absolute=False).tolist() == [1, 3, 0, 5, 4, 6, 2]
    assert top_edges(scores, 4, absolute=True).tolist() == [6, 4, 1, 3]
    assert top_edges(scores, 0, absolute=True).tolist() == []
    with pytest.raises(ValueError):
        top_edges(scores, 8, absolute=True)
    many = np.zeros(5000)
    many[::7] = -1.0  # ties in a long array, where an unstable sort scrambles them
    assert top_edges(many, 4000, absolute=False).tolist() == [i for i in range(5000) if i % 7][:4000]
    assert top_edges(many, 10, absolute=True).tolist() == list(range(0, 70, 7))


# ------------------------------------------------------------------------------------------------- stability.py


def _bootstrap_by_hand(scores: np.ndarray, sizes: list[int], resamples: int, seed: int, absolute: bool):
    """The documented bootstrap, one resample and one pair of resamples at a time with Python sets."""
    e, n = scores.shape
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    means = np.stack([scores[:, d].astype(np.float64).mean(1) for d in draws])  # (R, E)
    lo, hi = np.quantile(means, [0.025, 0.975], axis=0)
    tops = {s: [set(top_edges(m, s, absolute).tolist()) for m in means] for s in sizes}
    inclusion = {s: np.array([sum(i in t for t in tops[s]) / resamples for i in range(e)]) for s in sizes}
    jaccard = {}
    for s in sizes:
        values = [len(a & b) / len(a | b) for a, b in combinations(tops[s], 2)]
        jaccard[s] = (np.mean(values), np.percentile(values, 5), np.percentile(values, 95))
    return lo, hi, inclusion, jaccard


@pytest.mark.parametrize("absolute", [False, True])
def test_bootstrap_equals_the_loops_it_stands_for(monkeypatch: pytest.MonkeyPatch, absolute: bool) -> None:
    rng = np.random.default_rng(1)
    scores = (rng.normal(0, 1, (30, 12)) + rng.normal(0, 0.5, (30, 1))).astype(np.float32)  # (E, N)
    sizes = [1, 4, 10, 29]
    lo, hi, inclusion, jaccard = _bootstrap_by_hand(scores, sizes, 25, 7, absolute)
    for block in (stability._BLOCK, 7):  # blocks of 7 values: many edge, resample and Gram blocks
        monkeypatch.setattr(stability, "_BLOCK", block)
        got = bootstrap(scores, sizes, 25, 7, absolute)
        np.testing.assert_allclose(got.lo, lo, rtol=1e-12)
        np.testing.assert_allclose(got.hi, hi, rtol=1e-12)
        for s in sizes:
            np.testing.assert_array_equal(got.inclusion[s], inclusion[s])
            np.testing.assert_allclose(got.jaccard[s], jaccard[s], rtol=1e-12)
    assert 0 < jaccard[4][0] < 1  # the case is not trivial


def test_identical_pairs_give_one_circuit_and_a_point_interval() -> None:
    values = np.array([3.0, -7.0, 1.0, 5.0, 0.0, 2.0])
    scores = np.repeat(values[:, None], 9, axis=1)  # every pair the same
    got = bootstrap(scores, [1, 2, 5, 6], 50, 0, absolute=True)
    np.testing.assert_array_equal(got.lo, values)
    np.testing.assert_array_equal(got.hi, values)
    for s in (1, 2, 5, 6):
        assert got.jaccard[s] == (1.0, 1.0, 1.0)
        want = np.zeros(6)
        want[top_edges(values, s, absolute=True)] = 1.0
        np.testing.assert_array_equal(got.inclusion[s], want)


def test_interval_width_shrinks_as_one_over_sqrt_pairs() -> None:
    rng = np.random.default_rng(2)
    centres = np.arange(20, dtype=np.float64) * 10.0
    widths = []
    for n in (100, 400):
        scores = centres[:, None] + rng.normal(0, 1, (20, n))
        got = bootstrap(scores, [], 400, 3, absolute=False)
        assert np.all(got.lo < centres + 1) and np.all(got.hi > centres - 1)
        widths.append(float(np.mean(got.hi - got.lo)))
    assert widths[1] / widths[0] == pytest.approx(0.5, rel=0.15)


def test_an_edge_far_above_the_rest_is_always_included() -> None:
    rng = np.random.default_rng(3)
    scores = rng.normal(0, 1, (40, 30))
    scores[5] += 50.0
    scores[9] -= 80.0
    signed = bootstrap(scores, [1, 3], 100, 0, absolute=False)
    assert signed.inclusion[1][5] == 1.0 and signed.inclusion[3][5] == 1.0 and signed.inclusion[1][9] == 0.0
    assert signed.inclusion[1].sum() == pytest.approx(1.0) and signed.inclusion[3].sum() == pytest.approx(3.0)
    absolute = bootstrap(scores, [1, 2], 100, 0, absolute=True)
    assert absolute.inclusion[1][9] == 1.0 and absolute.inclusion[2][5] == 1.0


def test_the_seed_fixes_the_bootstrap() -> None:
    scores = np.random.default_rng(4).normal(0, 1, (25, 15))
    a, b = bootstrap(scores, [3, 10], 60, 11, True), bootstrap(scores, [3, 10], 60, 11, True)
    np.testing.assert_array_equal(a.lo, b.lo)
    np.testing.assert_array_equal(a.hi, b.hi)
    assert a.jaccard == b.jaccard
    for s in (3, 10):
        np.testing.assert_array_equal(a.inclusion[s], b.inclusion[s])
    assert not np.array_equal(bootstrap(scores, [3], 60, 12, True).lo, a.lo)


def test_the_bootstrap_draws_pairs_by_id_not_by_column() -> None:
    """The same pairs in another column order, their ids with them: the same resamples, to the bit (the means are
    summed in the ids' order too). Without the ids the draws are by column: another order, another bootstrap."""
    rng = np.random.default_rng(6)
    scores = (rng.normal(0, 1, (40, 9)) + rng.normal(0, 0.3, (1, 9))).astype(np.float32)  # (E, N)
    ids = [f"pair-{k}" for k in (3, 10, 7, 0, 8, 1, 5, 2, 4)]  # not in sorted order
    shuffled = rng.permutation(9)
    for absolute in (False, True):
        a = bootstrap(scores, [0, 2, 5, 40], 50, 3, absolute, ids=ids)
        b = bootstrap(scores[:, shuffled], [0, 2, 5, 40], 50, 3, absolute, ids=[ids[i] for i in shuffled])
        np.testing.assert_array_equal(a.lo, b.lo)
        np.testing.assert_array_equal(a.hi, b.hi)
        for s in (2, 5, 40):
            np.testing.assert_array_equal(a.inclusion[s], b.inclusion[s])
            assert a.jaccard[s] == b.jaccard[s]
        # the columns in the ids' sorted order, without ids: that same bootstrap
        by_id = sorted(range(9), key=lambda i: ids[i])
        c = bootstrap(scores[:, by_id], [0, 2, 5, 40], 50, 3, absolute)
        np.testing.assert_array_equal(a.lo, c.lo)
        assert a.jaccard == c.jaccard
        # by column position, the order of the columns changes the draws
        assert not np.array_equal(bootstrap(scores[:, shuffled], [2], 50, 3, absolute).lo, c.lo)
    with pytest.raises(ValueError, match="distinct ids"):
        bootstrap(scores, [2], 50, 3, True, ids=["a"] * 9)
    with pytest.raises(ValueError, match="distinct ids"):
        bootstrap(scores, [2], 50, 3, True, ids=ids[:8])


def test_bootstrap_edge_cases_are_nan_not_errors() -> None:
    scores = np.random.default_rng(5).normal(0, 1, (8, 6))
    got = bootstrap(scores, [0, 3, 8], 20, 0, absolute=True)
    assert np.isnan(got.jaccard[0]).all()  # two empty circuits: 0/0
    assert got.jaccard[8] == (1.0, 1.0, 1.0) and (got.inclusion[8] == 1.0).all()
    one_pair = bootstrap(scores[:, :1], [3], 20, 0, absolute=True)
    assert np.isnan(one_pair.lo).all() and np.isnan(one_pair.jaccard[3]).all() and np.isnan(one_pair.inclusion[3]).all()
    one_resample = bootstrap(scores, [3], 1, 0, absolute=True)
    assert np.isnan(one_resample.hi).all() and np.isnan(one_resample.jaccard[3]).all()
    assert one_resample.inclusion[3].sum() == 3.0
    with pytest.raises(ValueError):
        bootstrap(scores, [9], 20, 0, absolute=True)


# ---------------------------------------------------------------------------------------------------- export.py

_EDGE = re.compile(r"^(input|a\d+\.h\d+|m\d+)->(a\d+\.h\d+<[qkv]>|m\d+|logits)$")


def _edge_frame(layers: int, heads: int, kv_heads: int, parallel: bool) -> pd.DataFrame:
    """The lm_edges identifier columns of graph.py's graph, with a distinct score per edge."""
    layout = SimpleNamespace(layers=layers, heads=heads, kv_heads=kv_heads,
                             arch=SimpleNamespace(mid_norm=None if parallel else "post_attention_layernorm"))  # fmt: skip
    graph = EdgeGraph.of(layout)  # type: ignore[arg-type]
    rows = []
    for w, r in graph.edges.nonzero().tolist():
        up, down = graph.writers[w], graph.readers[r]
        rows.append({"edge": f"{up.name}->{down.name}", "upstream": up.name, "downstream": down.name,
                     "input": down.kind, "downstream_layer": None if down.kind == "logits" else down.layer,
                     "downstream_head": down.head})  # fmt: skip
    frame = pd.DataFrame(rows)
    frame["score"] = np.linspace(-1.0, 1.0, len(frame))
    assert len(frame) == graph.count
    return frame


def _eap_ig_edge_names(layers: int, heads: int, parallel: bool) -> set[str]:
    """The edges of EAP-IG's `Graph.from_model` (src/eap/graph.py), its loops transcribed."""
    names, stream = set(), ["input"]
    for layer in range(layers):
        attn, mlp = [f"a{layer}.h{h}" for h in range(heads)], f"m{layer}"
        names |= {f"{node}->{a}<{x}>" for node in stream for a in attn for x in "qkv"}
        if parallel:
            names |= {f"{node}->{mlp}" for node in stream}
            stream += [*attn, mlp]
        else:
            stream += attn
            names |= {f"{node}->{mlp}" for node in stream}
            stream.append(mlp)
    return names | {f"{node}->logits" for node in stream}


@pytest.mark.parametrize(("heads", "kv_heads", "parallel"), [(4, 2, False), (4, 1, True), (3, 3, False)])
def test_export_is_eap_ig_graph_ungrouped(heads: int, kv_heads: int, parallel: bool) -> None:
    frame = _edge_frame(2, heads, kv_heads, parallel)
    d = eap_ig_graph(frame, 2, heads, kv_heads, 64, parallel)
    assert d["cfg"] == {"n_layers": 2, "n_heads": heads, "parallel_attn_mlp": parallel, "d_model": 64}
    kv = frame["input"].isin(["k", "v"])
    assert len(d["edges"]) == (~kv).sum() + kv.sum() * (heads // kv_heads)
    assert set(d["edges"]) == _eap_ig_edge_names(2, heads, parallel)
    assert all(_EDGE.match(name) for name in d["edges"])
    nodes = ["input", *(f"a{layer}.h{h}" for layer in range(2) for h in range(heads)), "m0"]
    assert list(d["nodes"])[: heads + 2] == nodes[: heads + 1] + ["m0"] and list(d["nodes"])[-1] == "logits"
    assert len(d["nodes"]) == 1 + 2 * (heads + 1) + 1


def test_export_scores_circuit_and_file_round_trip(tmp_path) -> None:
    frame = _edge_frame(2, 4, 2, parallel=False)
    score = dict(zip(frame["edge"], frame["score"], strict=True))
    circuit = ["input->a1.g1<k>", "a0.h1->a1.h2<q>", "m1->logits"]
    path = write_eap_ig_graph(tmp_path / "g.json", frame, 2, 4, 2, 576, False, in_circuit=circuit)
    d = json.loads(path.read_text())
    for h in (2, 3):  # query heads 2 and 3 read key-value head 1 (4 heads, 2 groups)
        assert d["edges"][f"input->a1.h{h}<k>"] == {"score": score["input->a1.g1<k>"], "in_graph": True}
    assert d["edges"]["input->a1.h1<k>"] == {"score": score["input->a1.g0<k>"], "in_graph": False}
    assert d["edges"]["a0.h1->a1.h2<q>"] == {"score": score["a0.h1->a1.h2<q>"], "in_graph": True}
    assert d["edges"]["m1->logits"]["in_graph"] and sum(e["in_graph"] for e in d["edges"].values()) == 4
    in_graph = {name for name, node in d["nodes"].items() if node["in_graph"]}
    assert in_graph == {"input", "a1.h2", "a1.h3", "a0.h1", "m1", "logits"}
    with pytest.raises(ValueError):
        eap_ig_graph(frame, 2, 4, 2, 576, False, in_circuit=["input->a1.h3<k>"])  # not an lm_edges name
