"""lm_edges in bounded memory: the readers' gradients are handed on a chunk of whole layers at a time
(method.edges.gradient_memory) and every edge's score summed as they come, never the whole (readers, B, T, D) tensor.
Chunked scores equal the scores of every layer at once, in every estimator and per position."""

from __future__ import annotations

import pytest
import torch

from runner.methods.lm_edges import lm_edge_attribution
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.scores import ScoreSum, reader_gradients
from runner.models.lm_sites import layout_of
from tests.lm_references import build_tiny_lm
from tests.test_lm_patching import PAIRS


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm("llama", seed=0, folder=tmp_path_factory.mktemp("llama"))
    return model, tokenizer


@pytest.mark.parametrize(
    "settings",
    [{"mode": "eap_ig", "steps": 3}, {"mode": "clean_corrupted"}, {"mode": "eap_ig_activations", "steps": 2},
     {"mode": "eap", "per_position": True, "positions": "index"}],
)  # fmt: skip
def test_chunked_scores_equal_every_layer_at_once(llama, settings: dict, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    chunks: list[int] = []
    add = ScoreSum.add
    monkeypatch.setattr(ScoreSum, "add", lambda self, first, g: (chunks.append(g.shape[0]), add(self, first, g))[1])
    whole = lm_edge_attribution(model, tokenizer, PAIRS, per_pair=True, gradient_memory=1024.0, **settings)
    at_once, chunks[:] = list(chunks), []
    chunked = lm_edge_attribution(model, tokenizer, PAIRS, per_pair=True, gradient_memory=1e-12, **settings)
    layers = EdgeGraph.of(layout_of(model)).layers
    assert len(chunks) == len(at_once) * (layers + 1) // 2  # every layer alone, then the logits (else 2 a run)
    assert list(whole.edge) == list(chunked.edge)
    scale = float(whole.score.abs().max())
    assert scale > 0.1
    worst = float((whole.score - chunked.score).abs().max())
    print(f"{settings}: {len(whole)} rows, worst |chunked - whole| = {worst:.2e} of {scale:.2e}")
    assert worst <= 1e-6 * scale


def test_a_budget_hands_the_gradients_on_a_layer_at_a_time(llama) -> None:  # type: ignore[no-untyped-def]
    """The sink gets the readers in order: with a budget below one layer, each layer's readers alone, then the
    logits; without one, every layer at once, then the logits; the same gradients either way."""
    from runner.hooks import HookSession
    from runner.methods.lm_edges.intervene import EdgeRuns

    model, tokenizer = llama
    layout = layout_of(model)
    graph = EdgeGraph.of(layout)
    ids = torch.tensor([[1, 5, 7, 9, 5, 7]])
    with HookSession(model, []) as session:
        hooks = EdgeRuns(model, layout, graph, session)
        with torch.enable_grad(), hooks.keep(grad=True):
            logits = model(ids).logits[:, -1]
        views, metric = hooks.kept, logits[:, 3] - logits[:, 4]
        got: dict[str, list[tuple[int, torch.Tensor]]] = {"small": [], "all": []}
        reader_gradients(graph, views, metric, lambda i, g: got["small"].append((i, g)), chunk_bytes=1)
        reader_gradients(graph, views, metric, lambda i, g: got["all"].append((i, g)), chunk_bytes=None)
    per_layer = len(graph.readers_of(0, "q")) + 2 * len(graph.readers_of(0, "k")) + 1
    assert [i for i, _ in got["small"]] == [layer * per_layer for layer in range(graph.layers + 1)]
    assert [i for i, _ in got["all"]] == [0, graph.layers * per_layer]
    small = torch.cat([g for _, g in got["small"]])
    assert small.shape[0] == len(graph.readers) and torch.equal(small, torch.cat([g for _, g in got["all"]]))


def test_bfloat16_weights_score_edges_as_float32_does(llama) -> None:  # type: ignore[no-untyped-def]
    """The model in bfloat16 (its forward and gradients), the writes, gradients and scores summed in float32: the
    same ranking as float32 (Spearman over every edge) and scores within 10% of the largest (bf16 keeps 8 bits of
    mantissa: 0.4% a rounding, through every block and back)."""
    import copy

    model, tokenizer = llama
    full = lm_edge_attribution(model, tokenizer, PAIRS, mode="eap_ig", steps=3).set_index("edge").score.astype(float)
    half = copy.deepcopy(model).to(torch.bfloat16)
    low = lm_edge_attribution(half, tokenizer, PAIRS, mode="eap_ig", steps=3).set_index("edge").score.astype(float)
    low = low[full.index]
    assert low.notna().all() and low.abs().max() > 0
    scale = float(full.abs().max())
    worst = float((low - full).abs().max())
    spearman = full.rank().corr(low.rank())
    print(f"bf16 vs fp32: {len(full)} edges, worst {worst / scale:.2e} of the largest, Spearman {spearman:.4f}")
    assert worst <= 0.1 * scale and spearman >= 0.98
