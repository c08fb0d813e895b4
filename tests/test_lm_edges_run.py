"""method=lm_edges over a whole run: the pairs split into a discovery and a held-out part, one ranking from the
discovery pairs' scores, every circuit evaluated on every pair, resumed after an interrupt without scoring again, and
the invariances a run must keep (the batch size, the order of the pairs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from runner import app
from runner.errors import RunnerError
from runner.methods.lm_edges import lm_edge_attribution
from runner.methods.lm_edges.method import LmEdges
from runner.methods.lm_edges.scoring import Scoring
from runner.methods.lm_edges.split import DISCOVERY, HELD_OUT, split_pairs
from runner.options.method.lm_edges import HeldOutBy, LmEdgesConfig, LmEdgesMethodConfig
from runner.results import load
from tests.conftest import make_config
from tests.test_lm_edges import llama  # noqa: F401 (the fixture)
from tests.test_lm_patching import PAIRS

RUN_TABLES = ("lm_edges", "lm_circuit_curve", "lm_circuit_scores")


def test_the_split_depends_on_the_ids_and_seed_not_their_order() -> None:
    ids = [f"pair-{i}" for i in range(20)]
    parts = split_pairs(ids, 0.25, HeldOutBy.pair, seed=0)
    assert sum(p == HELD_OUT for p in parts.values()) == 5
    assert split_pairs(ids[::-1], 0.25, HeldOutBy.pair, seed=0) == parts
    assert split_pairs(ids, 0.25, HeldOutBy.pair, seed=1) != parts  # another seed, another draw (20 choose 5)


def test_a_template_split_keeps_each_template_in_one_part() -> None:
    ids = [f"ioi-{k:04d}-{'abba' if k % 2 else 'baba'}-t{(k // 2) % 4}" for k in range(16)]
    parts = split_pairs(ids, 0.5, HeldOutBy.template, seed=0)
    by_template: dict[str, set[str]] = {}
    for i, part in parts.items():
        by_template.setdefault(i.rsplit("-", 1)[1], set()).add(part)
    assert all(len(p) == 1 for p in by_template.values()) and len(by_template) == 4
    assert sorted(next(iter(p)) for p in by_template.values()).count(HELD_OUT) == 2
    with pytest.raises(RunnerError, match="-t<k>"):
        split_pairs(["a", "b", "c"], 0.5, HeldOutBy.template, seed=0)


def test_by_default_half_the_pairs_are_held_out_from_eight_pairs_on() -> None:
    assert set(split_pairs([str(i) for i in range(7)], None, HeldOutBy.pair, 0).values()) == {DISCOVERY}
    eight = split_pairs([str(i) for i in range(8)], None, HeldOutBy.pair, 0)
    assert sum(p == HELD_OUT for p in eight.values()) == 4
    with pytest.raises(RunnerError, match="both parts need at least one"):
        split_pairs(["a", "b"], 0.1, HeldOutBy.pair, 0)


def test_settings_the_run_cannot_honour_are_refused() -> None:
    for bad, words in (({"circuit": [5, 5]}, "given once"), ({"steps": 10**8}, "1 to 1024"),
                       ({"fractions": [0.5, 2.0]}, r"in \(0, 1\]"), ({"held_out": 1.0}, r"in \[0, 1\)"),
                       ({"resamples": 1}, "resamples=1"),
                       ({"corruption": {"kind": "pair", "span": "subject"}}, "would leave it unused")):  # fmt: skip
        with pytest.raises(RunnerError, match=words):
            edges = LmEdgesConfig(**{k: v for k, v in bad.items() if k != "corruption"})
            if "corruption" in bad:
                edges.corruption.span = bad["corruption"]["span"]
            LmEdgesMethodConfig(edges=edges).check()


def test_a_circuit_larger_than_the_graph_is_refused_before_the_weights_load(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="graph has 110 edges"):  # the shipped induction model's graph
        app.run(make_config("experiment=edges_lm_induction", "method.edges.circuit=[5,500]"), tmp_path)
    assert not list(tmp_path.glob("*.parquet"))


def test_the_run_level_scores_do_not_depend_on_the_order_of_the_pairs(llama) -> None:  # noqa: F811
    model, tokenizer = llama
    forward = lm_edge_attribution(model, tokenizer, PAIRS, mode="eap").set_index("edge")
    backward = lm_edge_attribution(model, tokenizer, PAIRS[::-1], mode="eap").set_index("edge")
    assert (forward.score - backward.score).abs().max() <= 1e-6
    assert (forward["rank"] == backward["rank"]).all()


def _induction(tmp_path: Path, *extra: str) -> dict[str, pd.DataFrame]:
    overrides = ["experiment=edges_lm_induction", "data.limit=16", "method.edges.top_k=4", "method.edges.resamples=40",
                 "progress=false", "report=false", *extra]  # fmt: skip
    app.run(make_config(*overrides), tmp_path)
    return {t: load(tmp_path, t) for t in (*RUN_TABLES, "lm_circuit")}


def _same(a: dict[str, pd.DataFrame], b: dict[str, pd.DataFrame]) -> None:
    """The run-level tables of two runs equal to float rounding (1e-5)."""
    keys = {"lm_edges": ["edge"], "lm_circuit_curve": ["split", "edges"], "lm_circuit_scores": ["split"]}
    values = {"lm_edges": ["score", "rank", "score_lo", "exact"], "lm_circuit_curve": ["faithfulness", "jaccard"],
              "lm_circuit_scores": ["cpr", "cmd"]}  # fmt: skip
    for table in RUN_TABLES:
        x = a[table].set_index(keys[table]).sort_index()[values[table]].astype(float)
        y = b[table].set_index(keys[table]).sort_index()[values[table]].astype(float)
        assert x.index.equals(y.index), table
        assert np.allclose(x.to_numpy(), y.to_numpy(), atol=1e-5, equal_nan=True), table


@pytest.mark.slow
def test_batch_sizes_4_and_16_give_the_same_circuits_and_curves(tmp_path: Path) -> None:
    four = _induction(tmp_path / "b4", "data.batch_size=4")
    sixteen = _induction(tmp_path / "b16", "data.batch_size=16")
    _same(four, sixteen)
    curve = four["lm_circuit_curve"]
    assert set(curve.split) == {DISCOVERY, HELD_OUT} and set(curve.pairs) <= {8}  # 16 pairs: 8 held out
    circuit = four["lm_circuit"]
    assert set(circuit.groupby("split")["sample"].nunique()) == {8}  # every pair of both parts evaluated
    full = curve[curve.edges == curve.total_edges]
    assert (full.faithfulness.astype(float) - 1).abs().max() <= 1e-5  # every edge kept: the model
    # the export: every edge of the graph with its run score (the induction model has a key-value head per head, so
    # key-value head g's edges are query head g's there)
    exported = json.loads((tmp_path / "b4" / "lm_edges.eap_ig.json").read_text())["edges"]
    edges = four["lm_edges"]
    assert len(exported) == len(edges)
    assert all(abs(exported[r.edge.replace(".g", ".h")]["score"] - float(r.score)) <= 1e-6 for r in edges.itertuples())
    # CPR and CMD by hand from the pairs' rows: MIB's points int(p x edges), f a ratio of means, trapezoids over p
    total = int(circuit.total_edges.iloc[0])
    fractions = np.array([0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
    scores = four["lm_circuit_scores"].set_index("split")
    for split, part in circuit[~(circuit.degenerate | circuit.small_span)].groupby("split"):
        means = part.groupby("edges")[["circuit_metric", "empty_metric", "clean"]].mean()
        f = np.array([(means.circuit_metric[int(p * total)] - means.empty_metric[int(p * total)])
                      / (means.clean[int(p * total)] - means.empty_metric[int(p * total)]) for p in fractions])  # fmt: skip
        cpr = float(np.sum(np.diff(fractions) * (f[1:] + f[:-1]) / 2))
        cmd = float(np.sum(np.diff(fractions) * (np.abs(1 - f[1:]) + np.abs(1 - f[:-1])) / 2))
        assert abs(scores.cpr[split] - cpr) <= 1e-5 and abs(scores.cmd[split] - cmd) <= 1e-5, split


@pytest.mark.slow
def test_an_interrupted_run_resumes_from_its_scores_and_ends_as_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _induction(tmp_path / "whole", "data.batch_size=4", "output.shard_batches=1")

    def stop(self, number, read):  # noqa: ANN001, ANN202
        raise RunnerError("stopped between the passes")

    with monkeypatch.context() as patched:
        patched.setattr(LmEdges, "begin_pass", stop)
        with pytest.raises(RunnerError, match="between the passes"):
            _induction(tmp_path / "cut", "data.batch_size=4", "output.shard_batches=1")
    assert len(list((tmp_path / "cut" / "lm_edge_pair_scores.parquet").glob("part-*"))) == 4  # the scores kept

    def no_scoring(self, model, batch):  # noqa: ANN001, ANN202
        raise AssertionError("a resumed run scored a pair again")

    monkeypatch.setattr(Scoring, "batch", no_scoring)
    _same(whole, _induction(tmp_path / "cut", "data.batch_size=4", "output.shard_batches=1"))


@pytest.mark.slow
def test_ranking_both_evaluates_each_rankings_circuits_as_its_own_run(tmp_path: Path) -> None:
    """method.edges.ranking=both in one run: per ranking, the circuits' metrics, the curve, CPR/CMD and the
    stability rows of the run of that ranking alone; the run's lm_edges (rank, checked edges) are the absolute
    ranking's; mib_scores reads CPR from its signed rows and CMD from its absolute ones."""
    from runner.methods.lm_edges import mib_scores

    tables = ("lm_circuit", "lm_circuit_curve", "lm_circuit_scores", "lm_circuit_stability", "lm_edges")
    runs = {}
    for ranking in ("both", "signed", "absolute"):
        out = tmp_path / ranking
        app.run(make_config("experiment=edges_lm_induction", "data.limit=16", "method.edges.top_k=4",
                            "method.edges.resamples=40", "progress=false", "report=false",
                            f"method.edges.ranking={ranking}"), out)  # fmt: skip
        runs[ranking] = {t: load(out, t) for t in tables}
    both = runs["both"]
    keys = {"lm_circuit": ["split", "edges", "sample_id"], "lm_circuit_curve": ["split", "edges"],
            "lm_circuit_scores": ["split"], "lm_circuit_stability": ["edges", "edge"]}  # fmt: skip
    values = {"lm_circuit": ["circuit_metric", "faithfulness"], "lm_circuit_curve": ["faithfulness", "jaccard"],
              "lm_circuit_scores": ["cpr", "cmd"], "lm_circuit_stability": ["inclusion", "rank"]}  # fmt: skip
    for table, key in keys.items():
        assert set(both[table]["ranking"]) == {"signed", "absolute"}, table
        for ranking in ("signed", "absolute"):
            x = both[table][both[table]["ranking"] == ranking].set_index(key).sort_index()[values[table]]
            y = runs[ranking][table].set_index(key).sort_index()[values[table]]
            assert x.index.equals(y.index), (table, ranking)
            assert np.allclose(x.to_numpy(float), y.to_numpy(float), atol=1e-6, equal_nan=True), (table, ranking)
    signed, absolute = (runs[r]["lm_circuit_curve"] for r in ("signed", "absolute"))
    assert not np.allclose(signed["faithfulness"].to_numpy(float), absolute["faithfulness"].to_numpy(float))
    ranks = both["lm_edges"].set_index("edge")["rank"].sort_index()
    assert ranks.equals(runs["absolute"]["lm_edges"].set_index("edge")["rank"].sort_index())
    table = mib_scores(both["lm_circuit_scores"]).set_index("split")
    scores = {r: runs[r]["lm_circuit_scores"].set_index("split") for r in ("signed", "absolute")}
    assert np.allclose(table["cpr"], scores["signed"].loc[table.index, "cpr"])
    assert np.allclose(table["cmd"], scores["absolute"].loc[table.index, "cmd"])
