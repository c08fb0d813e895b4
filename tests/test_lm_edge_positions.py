"""method.edges.per_position: each edge scored, ranked and kept at each position slot. Checked against the plain
autograd reference of test_lm_edges.py with the write added at one position at a time (a grouped-query Llama and the
post-normed families), against one forward per (edge, position) for mode=exact, and by identities: an edge's units sum
to its edge score, the circuit of every unit restores 1 and of none 0, one unit left out is that edge corrupted at those
positions alone; a pair's units do not change when it is batched (left-padded) beside a longer one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runner.errors import RunnerError
from runner.methods.lm_edges import lm_edge_attribution
from runner.methods.lm_edges.positions import Slots, role_slots
from runner.options.method.lm_edges import PositionSlots
from tests.lm_references import build_tiny_lm
from tests.test_lm_edges import POST_NORMED, _edge_setup, _perturbed_logits
from tests.test_lm_patching import PAIRS


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm("llama", seed=0, folder=tmp_path_factory.mktemp("llama"))
    return model, tokenizer


@pytest.fixture(scope="module", params=["llama", *POST_NORMED])
def edge_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The grouped-query Llama and a random-weight model of each family whose heads' sum is normed."""
    if request.param == "llama":
        return request.getfixturevalue("llama")
    model, tokenizer, _ = build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))
    return model, tokenizer


@pytest.fixture
def measured_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The circuits of every unit and of none measured by an intervention forward, not taken as known."""
    from runner.methods.lm_edges import evaluation

    monkeypatch.setattr(evaluation, "MEASURE_KNOWN_CIRCUITS", True)


SHORT = {"clean": "t01 t02 t03 t01 t02", "corrupted": "t09 t08 t07 t01 t02", "answer": "t03", "distractor": "t07"}


def _label(t: int, length: int) -> str:
    back = length - 1 - t
    return "end" if back == 0 else f"end-{back}"


def _per_position(model: nn.Module, tokenizer: Any, pair: dict[str, str], noising: bool = False,
                  exact: bool = False) -> dict[str, float]:  # fmt: skip
    """Every (edge, position) of one pair by plain autograd (eps_t x the writer's clean - corrupted write at position
    t added to the reader's input alone, d metric / d eps_t, on the corrupted run) or, `exact`, one forward per
    (edge, position) with the write added there (`noising`: the clean run with it taken away there), minus the run's
    metric. Keys: edge@end-k."""
    e = _edge_setup(model, tokenizer, pair)
    ids, embedding = (e["clean"], e["clean_embedding"]) if noising else (e["corrupted"], e["embedding"])
    length = ids.shape[1]
    out: dict[str, float] = {}

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[e["answer"]] - logits[e["distractor"]]

    with torch.no_grad():
        base = float(metric(model(ids).logits[0, -1]))
    for writer, (reader, layer, kind, index) in e["edges"]:
        write = e["writes"][writer]  # (1, T, D)
        if exact:
            for t in range(length):
                at = torch.zeros(length, 1)
                at[t] = -1.0 if noising else 1.0
                with torch.no_grad():
                    logits = _perturbed_logits(model, ids, embedding, layer, kind, index, at * write, e["d"])
                out[f"{writer}->{reader}@{_label(t, length)}"] = float(metric(logits)) - base
            continue
        eps = torch.zeros(length, 1, requires_grad=True)
        logits = _perturbed_logits(model, ids, embedding, layer, kind, index, eps * write, e["d"])
        found = torch.autograd.grad(metric(logits), eps, allow_unused=True)[0]
        for t in range(length):
            out[f"{writer}->{reader}@{_label(t, length)}"] = 0.0 if found is None else float(found[t])
    return out


def test_role_slots_name_positions_as_wang_et_al() -> None:
    """A role, the token after it (S1+1), the rest of the stretch (after S1), start before the first; the run's slots
    ordered by where they first fall on average; index slots count back from the last token; positions=role without
    roles is refused."""
    abba = [None, None, "IO", None, "S1", None, None, "S2", None, "end"]
    assert role_slots(abba) == ["start", "start", "IO", "IO+1", "S1", "S1+1", "after S1", "S2", "S2+1", "end"]
    assert role_slots([None, "subject", "subject", None, None, "end"]) == [
        "start", "subject", "subject", "subject+1", "after subject", "end"]  # fmt: skip
    baba = [None, None, "S1", None, "IO", None, None, "S2", None, "end"]
    slots = Slots.of(PositionSlots.auto, {"a": abba, "b": baba}, "method.edges")
    assert slots.how is PositionSlots.role
    assert slots.labels[:3] == ["start", "IO", "S1"] and slots.labels[-1] == "end"
    assert {"IO+1", "S1+1", "after S1", "after IO", "S2", "S2+1"} <= set(slots.labels)
    mask = torch.tensor([[1] * 10, [1] * 10])
    grid = slots.of_batch(["a", "b"], mask)
    assert [slots.labels[i] for i in grid[0].tolist()] == role_slots(abba)
    plain = {"x": [None, None, "end"], "y": [None, "end"]}
    counted = Slots.of(PositionSlots.auto, plain, "method.edges")
    assert counted.how is PositionSlots.index and counted.labels == ["end-2", "end-1", "end"]
    padded = counted.of_batch(["y", "x"], torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert padded.tolist() == [[-1, 1, 2], [0, 1, 2]]
    with pytest.raises(RunnerError, match="positions=role"):
        Slots.of(PositionSlots.role, plain, "method.edges")


def test_per_position_eap_equals_the_autograd_reference_and_sums_to_the_edge(edge_model) -> None:  # type: ignore[no-untyped-def]
    """Every (edge, position) of the grouped-query Llama (and the post-normed families) equals d metric / d eps_t with
    the write added at position t alone, 1e-5 (a key or value edge at the key's position); an edge's units sum to its
    edge score."""
    model, tokenizer = edge_model
    pair = PAIRS[0]
    units = lm_edge_attribution(model, tokenizer, [pair], mode="eap", per_position=True, positions="index")
    reference = _per_position(model, tokenizer, pair)
    ours = dict(zip(units.edge, units.score.astype(float), strict=True))
    assert set(ours) == set(reference)
    scale = max(abs(v) for v in reference.values())
    worst = max(abs(ours[k] - reference[k]) for k in reference)
    print(f"per-position eap: {len(ours)} units, worst |runner - autograd| = {worst:.2e} (largest {scale:.2e})")
    assert worst <= 1e-5 * max(1.0, scale)
    edges = lm_edge_attribution(model, tokenizer, [pair], mode="eap")
    summed = units.assign(base=units.edge.str.split("@").str[0]).groupby("base").score.sum()
    assert (summed[edges.edge].to_numpy() - edges.score.to_numpy()).__abs__().max() <= 1e-5 * max(1.0, scale)
    # a query reads its own position, so the edge into the logits has a score at the last position only
    into_logits = units[units.downstream == "logits"]
    assert (into_logits[into_logits.slot != "end"].score == 0).all() and (into_logits.score != 0).any()


def test_per_position_exact_equals_one_forward_per_edge_and_position(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    pair = PAIRS[0]
    exact = lm_edge_attribution(model, tokenizer, [pair], mode="exact", per_position=True, positions="index")
    loop = _per_position(model, tokenizer, pair, exact=True)
    ours = dict(zip(exact.edge, exact.score.astype(float), strict=True))
    assert set(ours) == set(loop)
    worst = max(abs(ours[k] - loop[k]) for k in loop)
    print(f"per-position exact: {len(loop)} units, worst |runner - loop| = {worst:.2e}")
    assert worst <= 1e-5
    top = lm_edge_attribution(model, tokenizer, [pair], mode="eap", per_position=True, positions="index", top_k=5)
    patched = top[top.exact.notna()]
    assert len(patched) == 10 and max(abs(float(r.exact) - loop[r.edge]) for r in patched.itertuples()) <= 1e-5


def test_unit_circuits_restore_1_and_0_and_one_unit_less_is_that_edge_corrupted_there(llama, measured_ends) -> None:  # type: ignore[no-untyped-def]
    from runner.data.prompts import pairs_batch
    from runner.methods.base import library_config, library_token_runtime, run_prepared
    from runner.methods.lm_edges.method import LmEdges
    from runner.options.method.lm_edges import LmEdgesMethodConfig

    model, tokenizer = llama
    pair = PAIRS[0]
    settings: dict[str, Any] = {"mode": "eap", "per_position": True, "positions": "index", "ranking": "signed"}
    units = lm_edge_attribution(model, tokenizer, [pair], **settings)
    total = len(units)
    dataset, batch = pairs_batch([pair], tokenizer, True, torch.device("cpu"))
    cfg = library_config(LmEdgesMethodConfig, edges={**settings, "circuit": [0, total - 1, total]})
    method = LmEdges(cfg, [], library_token_runtime(torch.device("cpu"), "token_logit_diff"))
    circuit = run_prepared(method, model, batch, dataset).tables["lm_circuit"]
    faithful = dict(zip(circuit["edges"], circuit["faithfulness"].tolist(), strict=True))
    assert abs(faithful[total] - 1) <= 1e-5 and abs(faithful[0]) <= 1e-5
    # ranked by signed score, the unit left out of the largest circuit but one is the most negative: the clean run
    # with that edge corrupted at that position alone
    dropped = units.sort_values("rank").iloc[-1]
    assert dropped.score < -1e-3
    noised = _per_position(model, tokenizer, pair, noising=True, exact=True)[dropped.edge]
    metric = dict(zip(circuit["edges"], circuit["circuit_metric"].tolist(), strict=True))[total - 1]
    assert abs((metric - float(circuit["clean"][0])) - noised) <= 1e-5, (metric - float(circuit["clean"][0]), noised)


def test_a_pairs_units_do_not_change_when_batched_beside_a_longer_pair(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    alone = lm_edge_attribution(model, tokenizer, [SHORT], mode="eap", per_pair=True, per_position=True,
                                positions="index")  # fmt: skip
    both = lm_edge_attribution(model, tokenizer, [PAIRS[0], SHORT], mode="eap", per_pair=True, per_position=True,
                               positions="index")  # fmt: skip
    short = both[both.sample_index == 1].set_index("edge").score
    mine = alone.set_index("edge").score
    assert set(mine.index) < set(short.index)  # the batch has more slots (end-7, end-6: none of the short pair's)
    assert (short.drop(mine.index) == 0).all()
    assert (short[mine.index] - mine).abs().max() <= 1e-5


def test_role_slots_from_the_pairs_roles(llama) -> None:  # type: ignore[no-untyped-def]
    """Pairs that name roles (character spans of the clean prompt) are scored per role slot: IO, S1, their +1
    stretches, end; summed over the slots, the edge score."""
    model, tokenizer = llama
    abba = {**PAIRS[0], "roles": {"IO": [4, 7], "S1": [8, 11]}}  # t02 and t03
    units = lm_edge_attribution(model, tokenizer, [abba], mode="eap", per_position=True)
    assert list(dict.fromkeys(units.slot)) == ["start", "IO", "S1", "S1+1", "after S1", "end"]
    edges = lm_edge_attribution(model, tokenizer, [PAIRS[0]], mode="eap")
    summed = units.assign(base=units.edge.str.split("@").str[0]).groupby("base").score.sum()
    assert (summed[edges.edge].to_numpy() - edges.score.to_numpy()).__abs__().max() <= 1e-5
