"""Path patching (method.edges.paths, table lm_paths) against a reference written here on a grouped-query Llama (one
forward per path set, plain hooks: each receiver's input plus its senders' clean - corrupted writes), a single edge's
path against lm_edges' exact edge, a set against the sum of nothing but its own edges; and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import RunnerError
from runner.methods.lm_edges import lm_edge_attribution, lm_path_patching
from tests.conftest import run_cli
from tests.lm_references import build_tiny_lm
from tests.test_lm_edges import _block_parts, _edge_setup
from tests.test_lm_patching import PAIRS

PAIR = PAIRS[0]

PATHS = [
    {"senders": ["a0.*"], "receivers": ["a1.h0<q>", "a1.h2<q>", "a1.g1<k>"], "name": "heads to queries and a key"},
    {"senders": ["input", "m0"], "receivers": ["a1.g0<v>", "logits"]},
    {"senders": ["a0.h1"], "receivers": ["a1.h3<q>"]},
    {"senders": ["a*", "m*", "input"], "receivers": ["logits"], "name": "direct to the logits"},
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm("llama", seed=0, folder=tmp_path_factory.mktemp("llama"))
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    return model, tokenizer


def reference(
    model: nn.Module, tokenizer: Any, pair: dict[str, str], senders: list[str], receivers: list[str]
) -> float:
    """The corrupted run with every receiver reading + the sum of its senders' clean - corrupted writes (edges only:
    a sender of an earlier layer), minus the corrupted run's metric; one forward, plain hooks."""
    from fnmatch import fnmatchcase

    e = _edge_setup(model, tokenizer, pair)

    def metric(logits: torch.Tensor) -> float:
        return float(logits[e["answer"]] - logits[e["distractor"]])

    with torch.no_grad():
        base = metric(model(e["corrupted"]).logits[0, -1])  # before any hook
    inner, parts, d = model.model, _block_parts(model), e["d"]
    added: dict[tuple[int, str], list[tuple[int | None, torch.Tensor]]] = {}
    for reader, layer, kind, index in {r for _, r in e["edges"]}:
        if not any(fnmatchcase(reader, p) for p in receivers):
            continue
        sent = [w for w, r in e["edges"] if r[0] == reader and any(fnmatchcase(w, p) for p in senders)]
        if sent:
            added.setdefault((layer, kind), []).append((index, sum(e["writes"][w] for w in sent)))
    stream: dict[int, torch.Tensor] = {}
    handles = []
    for (layer, kind), reads in added.items():
        if kind == "logits":
            total = sum(a for _, a in reads)
            handles.append(inner.norm.register_forward_pre_hook(lambda m, args, t=total: (args[0] + t,)))
            continue
        assert kind in ("q", "k", "v"), kind  # the paths above reach no MLP
        block = inner.layers[layer]
        proj = getattr(block.self_attn, f"{kind}_proj")

        def keep(m, args, kwargs, layer=layer):  # type: ignore[no-untyped-def]
            stream[layer] = args[0] if args else kwargs["hidden_states"]

        def swap(m, args, out, layer=layer, block=block, proj=proj, reads=reads):  # type: ignore[no-untyped-def]
            out = out.clone()
            for index, delta in reads:
                read = getattr(block, parts["qkv_norm"])(stream[layer] + delta)
                cols = slice(index * d, (index + 1) * d)
                out[..., cols] = F.linear(read, proj.weight, proj.bias)[..., cols]
            return out

        handles += [block.register_forward_pre_hook(keep, with_kwargs=True), proj.register_forward_hook(swap)]

    with torch.no_grad():
        try:
            return metric(model(e["corrupted"]).logits[0, -1]) - base
        finally:
            for handle in handles:
                handle.remove()


def test_path_sets_equal_the_reference_on_a_grouped_query_model(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    table = lm_path_patching(model, tokenizer, [PAIR], PATHS)
    assert len(table) == len(PATHS)
    for path, row in zip(PATHS, table.itertuples(), strict=True):
        expected = reference(model, tokenizer, PAIR, path["senders"], path["receivers"])
        assert row.effect == pytest.approx(expected, abs=1e-4), row.path
        assert row.patched - row.corrupted == pytest.approx(row.effect, abs=1e-5)
    assert table["effect"].abs().max() > 0.05  # not a comparison of zeros
    assert table["path"].iloc[0] == "heads to queries and a key"
    assert table["receivers"].iloc[0] == "a1.h0<q> a1.h2<q> a1.g1<k>"
    assert table["edges_patched"].tolist()[:3] == [4 * 3, 2 * 2, 1]


def test_one_edges_path_is_its_exact_edge(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    edges = lm_edge_attribution(model, tokenizer, [PAIR], mode="exact", per_pair=True, held_out=0.0)
    exact = edges.set_index("edge")["score"]
    singles = [{"senders": [w], "receivers": [r]} for w, r in (("a0.h1", "a1.h3<q>"), ("m0", "a1.g0<v>"),
                                                              ("input", "logits"), ("a1.h2", "m1"))]  # fmt: skip
    table = lm_path_patching(model, tokenizer, [PAIR], singles)
    for path, effect in zip(singles, table["effect"], strict=True):
        assert effect == pytest.approx(exact[f"{path['senders'][0]}->{path['receivers'][0]}"], abs=1e-5)


def test_senders_after_their_receivers_or_unknown_names_are_refused(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    with pytest.raises(RunnerError, match=r"no edge joins senders \['a1.h0'\] to receivers \['a0.h1<q>'\]"):
        lm_path_patching(model, tokenizer, [PAIR], [{"senders": ["a1.h0"], "receivers": ["a0.h1<q>"]}])
    with pytest.raises(RunnerError, match=r"'a0.h9' names none of the model's writers"):
        lm_path_patching(model, tokenizer, [PAIR], [{"senders": ["a0.h9"], "receivers": ["logits"]}])
    with pytest.raises(RunnerError, match=r"paths\[0\]: give senders"):
        lm_path_patching(model, tokenizer, [PAIR], [{"senders": [], "receivers": ["logits"]}])


def test_a_bad_path_on_the_cli_is_refused_before_the_weights_load(tmp_path: Path) -> None:
    refused = run_cli("experiment=edges_lm_induction", "method.edges.paths=[{senders: [a5.h0], receivers: [logits]}]",
                      f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert refused.returncode == 2 and "'a5.h0' names none of the model's writers" in refused.stderr, refused.stderr
    assert not (tmp_path / "run" / "lm_paths.parquet").exists()


def test_path_effects_do_not_change_with_batching_or_padding(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    pairs = [*PAIRS, {"clean": "t01 t02 t01", "corrupted": "t05 t02 t01", "answer": "t02", "distractor": "t05"}]
    together = lm_path_patching(model, tokenizer, pairs, PATHS)  # one left-padded batch
    for i, pair in enumerate(pairs):
        alone = lm_path_patching(model, tokenizer, [pair], PATHS)
        mine = together[together["sample_index"] == i]
        assert mine["effect"].tolist() == pytest.approx(alone["effect"].tolist(), abs=1e-5)
        assert mine["path"].tolist() == alone["path"].tolist()
    assert together["effect"].abs().max() > 0.05
