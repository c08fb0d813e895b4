"""method=lm_edges' tables about the whole run depend on the pairs, not on how they come: the same pairs in another
order give the same bootstrap (lm_edges' score_lo and score_hi, lm_circuit_stability, the curve's Jaccard) to the bit,
and another batch size the same calibration (lm_edge_calibration), its sign agreement exactly, on a model with edges
whose exact effect is 0 (a head and an MLP that write nothing), which rounding makes 0 or ±1e-7 by the batch."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from runner import app
from runner.methods.lm_edges.run_scores import SIGN_TOLERANCE, _calibration
from runner.results import load
from tests.conftest import make_config
from tests.lm_references import build_tiny_lm

TABLES = ("lm_edges", "lm_circuit_stability", "lm_circuit_curve", "lm_edge_calibration", "lm_edge_exact",
          "lm_edge_pair_scores")  # fmt: skip
WORDS = [f"t{i:02d}" for i in range(4, 20)]
# six induction pairs of equal length (no padding), ids not in their data order
PAIRS = []
for k, name in enumerate(("pair-e", "pair-b", "pair-f", "pair-a", "pair-d", "pair-c")):
    w = [WORDS[(k * 5 + j * 3) % 16] for j in range(8)]
    PAIRS.append({"id": name, "clean": " ".join(w[:4] + w[:3]), "corrupted": " ".join(w[4:] + w[:3]),
                  "answer": w[3], "distractor": w[7]})  # fmt: skip


def _calibration_frame(exact: list[float], estimate: list[float], ids: list[str]) -> pd.DataFrame:
    n = len(exact)
    return pd.DataFrame({"chosen": ["top"] * n, "edge": [f"e{i}" for i in range(n)], "sample": [0] * n,
                         "sample_id": ids, "estimate": estimate, "exact": exact, "mode": ["eap"] * n,
                         "degenerate": [False] * n, "small_span": [False] * n})  # fmt: skip


def test_sign_agreement_counts_only_effects_above_float_rounding() -> None:
    """Two edges with an effect and two with none, whose exact effect one batch rounds to 0 and another to ±6e-8:
    the same sign agreement, over the two with an effect; an estimate of 0 where there is one disagrees."""
    spans = pd.Series({"p": 2.0, "q": 0.5})
    estimate = [0.4, -0.1, 0.0, 0.0]
    one = _calibration(_calibration_frame([0.3, 0.2, 0.0, 0.0], estimate, ["p", "q", "p", "q"]), "m", spans)
    other = _calibration(_calibration_frame([0.3, 0.2, 5.96e-8, -5.96e-8], estimate, ["p", "q", "p", "q"]), "m", spans)
    for got in (one, other):
        assert got["chosen"][0] == "top" and got["sign_agreement"][0] == 0.5 and got["sign_counted"][0] == 2
        assert np.isnan(got["sign_agreement"][1]) and got["sign_counted"][1] == 0  # no random edge
    # the tolerance is the pair's: 1e-3 x its |clean - corrupted|
    edge = [SIGN_TOLERANCE * 2.0 * 1.01, SIGN_TOLERANCE * 2.0 * 0.99, SIGN_TOLERANCE * 0.5 * 1.01]
    got = _calibration(_calibration_frame(edge, [1.0, 1.0, -1.0], ["p", "p", "q"]), "m", spans)
    assert got["sign_counted"][0] == 2 and got["sign_agreement"][0] == 0.5
    estimate_zero = _calibration(_calibration_frame([0.3], [0.0], ["p"]), "m", spans)
    assert estimate_zero["sign_agreement"][0] == 0.0 and estimate_zero["sign_counted"][0] == 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, pd.DataFrame]]:
    """One model (a random two-layer Llama whose layer-0 head 0 and layer-1 MLP write nothing), every edge checked
    exactly (top_k above half the edges), run on PAIRS in one batch, in reverse order and in another order in one
    batch, and in batches of 2."""
    root = tmp_path_factory.mktemp("invariance")
    model, _, folder = build_tiny_lm("llama", 0, root / "model")
    with torch.no_grad():
        width = model.config.hidden_size // model.config.num_attention_heads
        model.model.layers[0].self_attn.o_proj.weight[:, :width] = 0
        model.model.layers[1].mlp.down_proj.weight.zero_()
    model.save_pretrained(folder)
    orders = {"b6": (PAIRS, 6), "reversed": (PAIRS[::-1], 6), "shuffled": ([PAIRS[i] for i in (2, 5, 0, 4, 1, 3)], 6),
              "b2": (PAIRS, 2)}  # fmt: skip
    out = {}
    for name, (pairs, batch) in orders.items():
        data = root / f"{name}.jsonl"
        data.write_text("\n".join(json.dumps(p) for p in pairs))
        app.run(make_config("model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={data}",
                            "method=lm_edges", "target=token_logit_diff", f"data.batch_size={batch}",
                            "method.edges.mode=eap", "method.edges.top_k=1000", "method.edges.held_out=0",
                            "method.edges.fractions=[]", "method.edges.circuit=[2,5,10]", "method.edges.resamples=40",
                            "progress=false", "report=false"), root / name)  # fmt: skip
        out[name] = {t: load(root / name, t).drop(columns=["run_id"]) for t in TABLES}
    return out


@pytest.mark.slow
def test_the_same_pairs_in_another_order_give_the_same_bootstrap_to_the_bit(runs) -> None:  # type: ignore[no-untyped-def]
    """One batch of every pair (no padding): each pair's scores are the same in either order, and so, to the bit, the
    run's scores, ranks, bootstrap intervals, circuits' inclusion and Jaccard."""
    first = runs["b6"]
    assert first["lm_circuit_stability"]["inclusion"].between(0, 1, inclusive="neither").any()  # resamples differ
    for name in ("reversed", "shuffled"):
        other = runs[name]
        a, b = (r["lm_edges"].set_index("edge") for r in (first, other))
        for column in ("score", "score_std", "score_lo", "score_hi", "rank"):
            np.testing.assert_array_equal(a[column].to_numpy(float), b.loc[a.index, column].to_numpy(float), column)
        pd.testing.assert_frame_equal(first["lm_circuit_stability"], other["lm_circuit_stability"])
        curve = ["split", "edges", "jaccard", "jaccard_lo", "jaccard_hi", "inclusion"]
        pd.testing.assert_frame_equal(first["lm_circuit_curve"][curve], other["lm_circuit_curve"][curve])


@pytest.mark.slow
def test_the_calibration_does_not_depend_on_the_batch_size(runs) -> None:  # type: ignore[no-untyped-def]
    """Batches of 2 and of 6: the exact effects differ by float rounding (the patched runs stack other rows), edges
    that write nothing among them; the sign agreement and its count are the same, the rest to 1e-5."""
    six, two = runs["b6"]["lm_edge_calibration"], runs["b2"]["lm_edge_calibration"]
    exact = runs["b2"]["lm_edge_exact"]
    nothing = exact[exact.upstream.eq("a0.h0") | exact.downstream.eq("m1") | exact.upstream.eq("m1")]
    assert len(nothing) and (nothing.estimate == 0).all() and nothing.exact.abs().max() < 1e-6  # no effect
    assert six.chosen.tolist() == two.chosen.tolist()
    assert six.sign_counted.tolist() == two.sign_counted.tolist() and six.sign_counted.iloc[0] > 0
    np.testing.assert_array_equal(six.sign_agreement.to_numpy(float), two.sign_agreement.to_numpy(float))
    for column in ("spearman", "mean_abs_error"):
        np.testing.assert_allclose(six[column].to_numpy(float), two[column].to_numpy(float), atol=1e-5, err_msg=column)
    # by hand: the (edge, pair) of pairs not flagged whose |exact| > 1e-3 x the pair's |clean - corrupted|
    pairs = runs["b2"]["lm_edge_pair_scores"].set_index("sample_id")
    span = (pairs.clean.astype(float) - pairs.corrupted.astype(float)).abs()
    usable = exact[~(exact.degenerate | exact.small_span)]
    counted = usable.exact.abs().to_numpy(float) > 1e-3 * span.loc[usable.sample_id].to_numpy()
    assert two.chosen.iloc[-1] == "all" and counted.sum() == two.sign_counted.iloc[-1] < len(usable)
    agree = np.sign(usable.estimate.to_numpy(float)[counted]) == np.sign(usable.exact.to_numpy(float)[counted])
    assert two.sign_agreement.iloc[-1] == agree.mean()
