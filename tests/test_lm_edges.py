"""method=lm_edges: the edge graph, EAP and EAP-IG scores against a plain autograd reference written here (a grouped-query
Llama: each edge's score is d metric / d eps with eps x the writer's clean - corrupted write added to the reader's
input alone), and the identity every edge graph must keep: a writer's edges sum to its node's attribution.

The references are written for Llama's block and for the families that norm each branch's output after it (Gemma 2
and 3, OLMo 2: `post_attention_layernorm` after the heads are summed). There a head's write is its output through
the output projection times the post-norm's factor gain / RMS(the summed output) in its own run, written here from
each family's RMSNorm (Gemma: x / RMS x (1 + weight); OLMo 2: x / RMS x weight)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import RunnerError
from runner.methods.lm_edges import lm_edge_attribution
from runner.methods.lm_edges.estimators import ESTIMATORS
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_patching import lm_activation_patching
from runner.models.lm_sites import layout_of, layout_of_config
from tests.devices import DEVICE_PARAMS
from tests.lm_references import FAMILIES, build_tiny_lm, tiny_config
from tests.test_lm_patching import PAIRS, _ids


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm("llama", seed=0, folder=tmp_path_factory.mktemp("llama"))
    return model, tokenizer


POST_NORMED = ("gemma2", "gemma3_text", "olmo2")  # a norm after the heads are summed, and after the MLP


@pytest.fixture(scope="module", params=["llama", *POST_NORMED])
def edge_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The grouped-query Llama and a random-weight model of each family whose heads' sum is normed (4 query heads,
    2 key-value heads)."""
    if request.param == "llama":
        return request.getfixturevalue("llama")
    model, tokenizer, _ = build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))
    return model, tokenizer


def _block_parts(model: nn.Module) -> dict[str, Any]:
    """Where a block's parts are, from each family's modeling file: the norm q/k/v read the stream through (None: the
    stream itself), the norm the MLP reads it through, the module whose output is the MLP's write, and the norm after
    the heads' sum with its gain (None: the sum is the write)."""
    family = model.config.model_type
    if family in ("gemma2", "gemma3_text"):
        return {"qkv_norm": "input_layernorm", "mlp_norm": "pre_feedforward_layernorm",
                "mlp_write": "post_feedforward_layernorm", "post_norm": "post_attention_layernorm",
                "gain": lambda norm: 1 + norm.weight}  # fmt: skip
    if family == "olmo2":
        return {"qkv_norm": None, "mlp_norm": None, "mlp_write": "post_feedforward_layernorm",
                "post_norm": "post_attention_layernorm", "gain": lambda norm: norm.weight}  # fmt: skip
    return {
        "qkv_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
        "mlp_write": "mlp",
        "post_norm": None,
    }


def _head_writes(model: nn.Module, layer: int, z: torch.Tensor) -> list[torch.Tensor]:
    """Each head's write of the run whose layer-`layer` o_proj input is `z` (..., H d): its slice of o_proj; where the
    family norms the heads' sum, times gain / RMS(sum) of this run."""
    heads = model.config.num_attention_heads
    block = model.model.layers[layer]
    o = block.self_attn.o_proj.weight  # (D, H d)
    d = o.shape[1] // heads
    writes = [F.linear(z[..., h * d : (h + 1) * d], o[:, h * d : (h + 1) * d]) for h in range(heads)]
    parts = _block_parts(model)
    if parts["post_norm"] is None:
        return writes
    norm = getattr(block, parts["post_norm"])
    summed = F.linear(z, o)
    factor = parts["gain"](norm) * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    return [w * factor for w in writes]


def test_the_graph_of_a_grouped_query_model() -> None:
    """SmolLM2-135M's shape (30 layers, 9 query heads, 3 key-value heads): readers per layer 9 q + 3 k + 3 v + 1 MLP,
    writers per layer 9 heads + 1 MLP; a sequential block's MLP reads its own layer's heads, a parallel one's not."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=64, vocab_size=10)  # fmt: skip
    graph = EdgeGraph.of(layout_of_config(config))
    assert (len(graph.writers), len(graph.readers)) == (1 + 30 * 10, 30 * 16 + 1)
    # a reader of layer l reads 1 + 10 l writers; an MLP also its layer's 9 heads; the logits read all 301
    expected = sum(15 * (1 + 10 * i) + (1 + 10 * i + 9) for i in range(30)) + 301
    assert graph.count == expected
    assert "a3.g2<k>" in {r.name for r in graph.readers} and "a3.g3<k>" not in {r.name for r in graph.readers}
    parallel = EdgeGraph.of(layout_of_config(tiny_config("gptj", 40)))
    assert (
        parallel.parallel and parallel.count == EdgeGraph.of(layout_of_config(tiny_config("gpt2", 40))).count - 2 * 4
    )  # 2 layers x 4 heads


def _edge_setup(model: nn.Module, tokenizer: Any, pair: dict[str, str]) -> dict[str, Any]:
    """What the references read of one pair on a Llama: the prompts' ids, the embedding outputs, both runs' writer
    outputs (_captured), every writer's clean - corrupted write, the readers (name, layer, kind, head) and the edges'
    (writer, reader) names."""
    inner = model.model
    layers, heads = len(inner.layers), model.config.num_attention_heads
    kv = model.config.num_key_value_heads
    d = getattr(model.config, "head_dim", None) or model.config.hidden_size // heads
    clean = torch.tensor([_ids(tokenizer, pair["clean"])])
    corrupted = torch.tensor([_ids(tokenizer, pair["corrupted"])])
    a, b = _captured(model, clean), _captured(model, corrupted)
    writes = {"input": a["input"] - b["input"]}
    for i in range(layers):
        for h, (write_a, write_b) in enumerate(
            zip(_head_writes(model, i, a[f"z{i}"]), _head_writes(model, i, b[f"z{i}"]), strict=True)
        ):
            writes[f"a{i}.h{h}"] = write_a - write_b
        writes[f"m{i}"] = a[f"m{i}"] - b[f"m{i}"]
    readers = [(f"a{i}.h{h}<q>", i, "q", h) for i in range(layers) for h in range(heads)]
    readers += [(f"a{i}.g{g}<{k}>", i, k, g) for i in range(layers) for k in "kv" for g in range(kv)]
    readers += [(f"m{i}", i, "mlp", None) for i in range(layers)] + [("logits", layers, "logits", None)]
    edges = []
    for reader in readers:
        for writer in writes:
            source = -1 if writer == "input" else int(writer[1:].split(".")[0])
            if source < reader[1] or (reader[2] == "mlp" and writer.startswith("a") and source == reader[1]):
                edges.append((writer, reader))
    answer, distractor = (tokenizer.convert_tokens_to_ids(pair[k]) for k in ("answer", "distractor"))
    return {"clean": clean, "corrupted": corrupted, "clean_embedding": a["input"], "embedding": b["input"],
            "clean_sites": a, "corrupted_sites": b, "writes": writes, "edges": edges, "d": d, "answer": answer,
            "distractor": distractor}  # fmt: skip


def _reference(model: nn.Module, tokenizer: Any, pair: dict[str, str], alpha: float = 0.0) -> dict[str, float]:
    """Every edge's score of one pair on a Llama, by plain autograd: the run on the corrupted prompt (its embeddings
    moved `alpha` of the way to the clean ones), with eps x (the writer's clean - corrupted write) added to the
    reader's input alone (head h's query: q_proj(norm(stream + eps w)) for h's columns only), d metric / d eps."""
    e = _edge_setup(model, tokenizer, pair)
    embedding = e["embedding"] + alpha * (e["clean_embedding"] - e["embedding"])
    return _edge_derivatives(model, e, e["corrupted"], embedding)


def _edge_derivatives(
    model: nn.Module, e: dict[str, Any], ids: torch.Tensor, embedding: torch.Tensor,
    fixed: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:  # fmt: skip
    """Every edge's d metric / d eps in the run of `ids` with the embedding output `embedding` (and the outputs
    `fixed`, _perturbed_logits), eps x the writer's clean - corrupted write added to the reader's input alone."""
    scores: dict[str, float] = {}
    for writer, (reader, layer, kind, index) in e["edges"]:
        eps = torch.zeros((), requires_grad=True)
        added = eps * e["writes"][writer]
        logits = _perturbed_logits(model, ids, embedding, layer, kind, index, added, e["d"], fixed)
        metric = logits[e["answer"]] - logits[e["distractor"]]
        found = torch.autograd.grad(metric, eps, allow_unused=True)[0]  # None: a fixed output cuts the reader off
        scores[f"{writer}->{reader}"] = 0.0 if found is None else float(found)
    return scores


def _clean_corrupted_reference(model: nn.Module, tokenizer: Any, pair: dict[str, str]) -> dict[str, float]:
    """mode=clean_corrupted from its definition: each edge's d metric / d eps at the clean prompt's run and at the
    corrupted prompt's run, averaged."""
    e = _edge_setup(model, tokenizer, pair)
    at_clean = _edge_derivatives(model, e, e["clean"], e["clean_embedding"])
    at_corrupted = _edge_derivatives(model, e, e["corrupted"], e["embedding"])
    return {edge: (at_clean[edge] + at_corrupted[edge]) / 2 for edge in at_clean}


def _eap_clean_reference(model: nn.Module, tokenizer: Any, pair: dict[str, str]) -> dict[str, float]:
    """mode=eap_clean from the EAP-IG code's EAP (`get_scores_eap`: (corrupted - clean) write . the reader's gradient
    at the clean run), its sign flipped: each edge's d metric / d eps at the clean prompt's run, eps x the writer's
    clean - corrupted write added to the reader's input alone."""
    e = _edge_setup(model, tokenizer, pair)
    return _edge_derivatives(model, e, e["clean"], e["clean_embedding"])


def test_eap_clean_is_twice_clean_corrupted_less_eap(llama) -> None:  # type: ignore[no-untyped-def]
    """The clean run's gradient is twice the mean of the clean and corrupted runs' less the corrupted run's, edge by
    edge and pair by pair (pairs of two lengths, padded), and it ranks the edges otherwise than eap."""
    model, tokenizer = llama
    pairs = [*PAIRS, {"clean": "t01 t02 t01", "corrupted": "t05 t02 t01", "answer": "t02", "distractor": "t05"}]
    by_mode = {
        mode: lm_edge_attribution(model, tokenizer, pairs, mode=mode, per_pair=True).score.astype(float).to_numpy()
        for mode in ("eap", "eap_clean", "clean_corrupted")
    }
    expected = 2 * by_mode["clean_corrupted"] - by_mode["eap"]
    scale = np.abs(by_mode["eap_clean"]).max()
    assert np.abs(by_mode["eap_clean"] - expected).max() <= 1e-5 * max(1.0, scale)
    assert np.abs(by_mode["eap_clean"] - by_mode["eap"]).max() > 0.01 * scale


def _ig_activations_reference(model: nn.Module, tokenizer: Any, pair: dict[str, str], steps: int) -> dict[str, float]:
    """mode=eap_ig_activations from its definition (Hanna et al.'s get_scores_ig_activations, sign flipped): each
    edge's d metric / d eps averaged over the runs of the clean prompt with one group's output (the embeddings, layer
    l's o_proj input z: all its heads, layer l's MLP output) set to a x its clean + (1 - a) x its corrupted value,
    a = k / steps, k = 1 .. steps."""
    e = _edge_setup(model, tokenizer, pair)
    clean, corrupted = e["clean_sites"], e["corrupted_sites"]
    groups = ["input"] + [f"{part}{i}" for i in range(len(model.model.layers)) for part in "zm"]
    total: dict[str, float] = {}
    for group in groups:
        for k in range(1, steps + 1):
            alpha = k / steps
            value = alpha * clean[group] + (1 - alpha) * corrupted[group]
            embedding, fixed = (value, {}) if group == "input" else (e["clean_embedding"], {group: value})
            for edge, v in _edge_derivatives(model, e, e["clean"], embedding, fixed).items():
                total[edge] = total.get(edge, 0.0) + v / (len(groups) * steps)
    return total


def _loop(model: nn.Module, tokenizer: Any, pair: dict[str, str], noising: bool = False) -> dict[str, float]:
    """Every edge patched alone, one forward each: the corrupted run with the edge's reader reading + (clean -
    corrupted) write, minus the corrupted run's metric; `noising`: the clean run with the reader reading - that write
    (the edge alone corrupted), minus the clean run's metric."""
    e = _edge_setup(model, tokenizer, pair)
    ids, embedding = (e["clean"], e["clean_embedding"]) if noising else (e["corrupted"], e["embedding"])
    sign = -1.0 if noising else 1.0

    def metric(logits: torch.Tensor) -> float:
        return float(logits[e["answer"]] - logits[e["distractor"]])

    with torch.no_grad():
        base = metric(model(ids).logits[0, -1])
        return {
            f"{writer}->{reader}": metric(
                _perturbed_logits(model, ids, embedding, layer, kind, index, sign * e["writes"][writer], e["d"])
            ) - base
            for writer, (reader, layer, kind, index) in e["edges"]
        }  # fmt: skip


def _captured(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The embedding output, each layer's o_proj input (z) and MLP write (_block_parts) on `ids`."""
    inner, kept = model.model, {}
    mlp_write = _block_parts(model)["mlp_write"]
    handles = [inner.embed_tokens.register_forward_hook(lambda m, a, o: kept.__setitem__("input", o))]
    for i, layer in enumerate(inner.layers):
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, i=i: kept.__setitem__(f"z{i}", a[0])))  # fmt: skip
        handles.append(getattr(layer, mlp_write).register_forward_hook(
            lambda m, a, o, i=i: kept.__setitem__(f"m{i}", o)))  # fmt: skip
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return kept


def _perturbed_logits(
    model: nn.Module, ids: torch.Tensor, embedding: torch.Tensor, layer: int, kind: str, index: int | None,
    added: torch.Tensor, d: int, fixed: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The last position's logits of the run of `ids` with the embedding output `embedding` and `added` put into one
    reader's input: head `index`'s q (or key-value head's k, v) input of `layer`, its MLP's, or the final norm's;
    `fixed`: outputs set to constants, "z{l}" layer l's o_proj input (all heads), "m{l}" its MLP's write."""
    inner, stream = model.model, {}
    parts = _block_parts(model)
    handles = [inner.embed_tokens.register_forward_hook(lambda m, args, o: embedding)]
    for name, value in (fixed or {}).items():
        block = inner.layers[int(name[1:])]
        if name[0] == "z":
            handles.append(block.self_attn.o_proj.register_forward_pre_hook(lambda m, args, v=value: (v,)))
        else:
            handles.append(getattr(block, parts["mlp_write"]).register_forward_hook(lambda m, args, o, v=value: v))
    if kind in ("q", "k", "v"):
        block = inner.layers[layer]
        proj = getattr(block.self_attn, f"{kind}_proj")

        def keep(m, args, kwargs):  # type: ignore[no-untyped-def]
            stream["x"] = args[0] if args else kwargs["hidden_states"]

        def swap(m, args, out):  # type: ignore[no-untyped-def]
            # the module's own arithmetic, not its call (which would run this hook again)
            read = stream["x"] + added
            if parts["qkv_norm"] is not None:
                read = getattr(block, parts["qkv_norm"])(read)
            new = F.linear(read, proj.weight, proj.bias)
            cols = slice(index * d, (index + 1) * d)
            out = out.clone()
            out[..., cols] = new[..., cols]
            return out

        handles += [block.register_forward_pre_hook(keep, with_kwargs=True), proj.register_forward_hook(swap)]
    elif kind == "mlp" and parts["mlp_norm"] is None:  # the MLP reads the stream itself
        handles.append(inner.layers[layer].mlp.register_forward_pre_hook(lambda m, args: (args[0] + added,)))
    elif kind == "mlp":
        norm = getattr(inner.layers[layer], parts["mlp_norm"])
        handles.append(norm.register_forward_pre_hook(lambda m, args: stream.__setitem__("x", args[0])))
        handles.append(inner.layers[layer].mlp.register_forward_pre_hook(
            lambda m, args: (norm.forward(stream["x"] + added),)))  # fmt: skip
    else:
        handles.append(inner.norm.register_forward_pre_hook(lambda m, args: (args[0] + added,)))
    try:
        return model(ids).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()


# every gradient mode the registry has (exact has none: test_exact_edges_equal_the_plain_loop...): the interpolating
# ones at 3 steps, eap_ig_activations marked slow ((1 + 2 layers) x 3 runs of a plain autograd reference each)
GRADIENT_MODES = [
    pytest.param(mode.value, 3, marks=pytest.mark.slow) if mode.value == "eap_ig_activations"
    else (mode.value, 3 if mode.value == "eap_ig" else 1)
    for mode, estimator in ESTIMATORS.items() if estimator.traced
]  # fmt: skip


@pytest.mark.parametrize("mode,steps", GRADIENT_MODES)
def test_every_edge_equals_the_autograd_reference_on_grouped_query_models(edge_model, mode: str, steps: int) -> None:  # type: ignore[no-untyped-def]
    """On Llama and on the post-normed families (each head's write at its run's norm scale), every mode's every edge
    equals plain autograd on the definition."""
    model, tokenizer = edge_model
    pair = PAIRS[0]
    table = lm_edge_attribution(model, tokenizer, [pair], mode=mode, steps=steps, per_pair=True)
    reference: dict[str, float] = {}
    if mode not in ("eap", "eap_ig", "clean_corrupted", "eap_clean", "eap_ig_activations"):
        raise AssertionError(f"mode {mode} has no reference here: write its definition as the others are")
    if mode == "clean_corrupted":
        reference = _clean_corrupted_reference(model, tokenizer, pair)
    elif mode == "eap_clean":
        reference = _eap_clean_reference(model, tokenizer, pair)
    elif mode == "eap_ig_activations":
        reference = _ig_activations_reference(model, tokenizer, pair, steps)
    for k in range(steps if mode in ("eap", "eap_ig") else 0):
        for edge, value in _reference(model, tokenizer, pair, alpha=k / steps).items():
            reference[edge] = reference.get(edge, 0.0) + value / steps
    ours = dict(zip(table.edge, table.score.astype(float), strict=True))
    assert set(ours) == set(reference)  # the same edges: k and v per key-value head, the same-layer MLP edges
    scale = max(abs(v) for v in reference.values())
    worst = max(abs(ours[e] - reference[e]) for e in reference)
    print(f"{mode}: {len(ours)} edges, worst |runner - autograd| = {worst:.2e} (largest score {scale:.2e})")
    assert worst <= 1e-5 * max(1.0, scale)


@pytest.mark.parametrize("mode", ["clean_corrupted", "eap_ig_activations"])
def test_runs_stacked_in_one_forward_equal_the_runs_one_by_one(llama, mode: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """estimators.py stacks a batch's runs in the rows of a forward (RUN_ROWS): the same scores as one run a forward,
    with pairs of two lengths (padding) and an embedding corruption (each run's edit stacked with the others')."""
    from runner.methods.lm_edges import estimators

    model, tokenizer = llama
    pairs = [*PAIRS, {"clean": "t01 t02 t01", "corrupted": "t05 t02 t01", "answer": "t02", "distractor": "t05"}]
    settings = {"mode": mode, "steps": 2, "per_pair": True, "corruption": {"kind": "noise"}}
    stacked = lm_edge_attribution(model, tokenizer, pairs, **settings)
    monkeypatch.setattr(estimators, "RUN_ROWS", 1)
    alone = lm_edge_attribution(model, tokenizer, pairs, **settings)
    assert stacked.score.abs().max() > 0.1
    torch.testing.assert_close(torch.tensor(stacked.score.astype(float).to_numpy()),
                               torch.tensor(alone.score.astype(float).to_numpy()), rtol=1e-5, atol=1e-5)  # fmt: skip


EDGE_FAMILIES = list(FAMILIES)


@pytest.mark.parametrize("arch", EDGE_FAMILIES)
def test_a_writers_edges_sum_to_its_node_attribution(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Sum over a writer's out-edges = the writer's attribution-patching estimate (lm_patching mode=attribution at
    its own site, all positions): the readers' gradients split the stream's gradient without loss or overlap
    (sequential and parallel blocks, fused and grouped-query projections). Where the heads' sum is normed, a head's
    node estimate goes through the norm's Jacobian, which its edges' frozen scale does not: there a layer's heads'
    edges together equal the attention output's node estimate (attn_out: the norm's output)."""
    model, tokenizer, _ = build_tiny_lm(arch, seed=1, folder=tmp_path)
    post_normed = bool(layout_of(model).arch.attn_branch)
    edges = lm_edge_attribution(model, tokenizer, PAIRS, mode="eap", per_pair=True)
    heads = "attn_out" if post_normed else "head"
    nodes = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre", heads, "mlp_out"], layers=None,
                                   mode="attribution")  # fmt: skip
    nodes = nodes[(nodes.site != "resid_pre") | (nodes.layer == 0)]
    name = {
        "resid_pre": lambda r: "input",
        "head": lambda r: f"a{int(r['layer'])}.h{int(r['head'])}",
        "attn_out": lambda r: f"a{int(r['layer'])}",
        "mlp_out": lambda r: f"m{int(r['layer'])}",
    }
    effect = nodes.patched - nodes.corrupted
    writer = nodes.apply(lambda r: name[r.site](r), axis=1).rename("writer")
    node_sum = effect.groupby([writer, nodes.sample_index]).sum()
    upstream = edges.upstream.str.replace(r"\.h\d+$", "", regex=True) if post_normed else edges.upstream
    edge_sum = edges.score.astype(float).groupby([upstream.rename("writer"), edges.sample_index]).sum()
    joined = node_sum.to_frame("node").join(edge_sum.to_frame("edges"), how="inner")
    assert len(joined) == len(node_sum) == len(edge_sum)
    gap = float((joined.node - joined.edges).abs().max())
    print(f"{arch}: worst |sum of edges - node attribution| = {gap:.2e} over {len(joined)} writers x pairs")
    assert gap <= 1e-5 * max(1.0, float(joined.node.abs().max()))


def test_exact_edges_equal_the_plain_loop_and_top_k_patches_the_best_scored(edge_model) -> None:  # type: ignore[no-untyped-def]
    """mode=exact: every edge of the grouped-query Llama (and of the post-normed families) equals one forward with
    that edge alone patched (the loop above), 1e-5; top_k: the same exact effects on the eap run's top_k edges by
    |score|, NaN elsewhere."""
    model, tokenizer = edge_model
    pair = PAIRS[0]
    loop = _loop(model, tokenizer, pair)
    exact = lm_edge_attribution(model, tokenizer, [pair], mode="exact")  # one pair: the run's score is the pair's
    ours = dict(zip(exact.edge, exact.score.astype(float), strict=True))
    assert set(ours) == set(loop) and (exact.score == exact.exact).all()
    worst = max(abs(ours[k] - loop[k]) for k in loop)
    print(f"exact: {len(loop)} edges, worst |runner - loop| = {worst:.2e}")
    assert worst <= 1e-5
    top = lm_edge_attribution(model, tokenizer, [pair], mode="eap", top_k=7)
    patched = top[top.exact.notna()]
    assert len(patched) == 14  # the 7 best and 7 others drawn at random (the calibration's sample)
    assert set(patched[patched["rank"] <= 7].edge) == set(top.assign(size=top.score.abs()).nlargest(7, "size").edge)
    assert max(abs(float(r.exact) - loop[r.edge]) for r in patched.itertuples()) <= 1e-5


@pytest.fixture
def measured_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The circuits of every edge and of none measured by an intervention forward, not taken as known."""
    from runner.methods.lm_edges import evaluation

    monkeypatch.setattr(evaluation, "MEASURE_KNOWN_CIRCUITS", True)


def test_circuits_of_every_edge_and_of_none_restore_1_and_0_and_one_edge_less_is_that_edge_corrupted(
    edge_model, measured_ends
) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = edge_model
    pair = PAIRS[0]
    edges = lm_edge_attribution(model, tokenizer, [pair], mode="eap", per_pair=True)
    total = len(edges)
    method_cfg = {"mode": "eap", "circuit": [0, total - 1, total]}
    from runner.data.prompts import pairs_batch
    from runner.methods.base import library_config, library_token_runtime, run_prepared
    from runner.methods.lm_edges.method import LmEdges
    from runner.options.method.lm_edges import LmEdgesMethodConfig

    dataset, batch = pairs_batch([pair], tokenizer, True, torch.device("cpu"))
    method = LmEdges(library_config(LmEdgesMethodConfig, edges=method_cfg), [],
                     library_token_runtime(torch.device("cpu"), "token_logit_diff"))  # fmt: skip
    circuit = run_prepared(method, model, batch, dataset).tables["lm_circuit"]
    faithful = dict(zip(circuit["edges"], circuit["faithfulness"].tolist(), strict=True))
    assert abs(faithful[total] - 1) <= 1e-5 and abs(faithful[0]) <= 1e-5
    # the edge left out of the largest circuit but one: the one of smallest |score|; the clean run with it alone
    # corrupted (the loop's noising patch)
    dropped = edges.assign(size=edges.score.abs()).nsmallest(1, "size").edge.item()
    noised = _loop(model, tokenizer, pair, noising=True)[dropped]
    metric = dict(zip(circuit["edges"], circuit["circuit_metric"].tolist(), strict=True))[total - 1]
    clean = float(circuit["clean"][0])
    assert abs((metric - clean) - noised) <= 1e-5, (metric - clean, noised)


def test_a_mean_ablated_circuit_of_every_edge_restores_1_and_of_none_differs_from_the_corrupted_run(
    edge_model, measured_ends
) -> None:  # type: ignore[no-untyped-def]
    from runner.data.prompts import pairs_batch
    from runner.methods.base import library_config, library_token_runtime, run_prepared
    from runner.methods.lm_edges.method import LmEdges
    from runner.options.method.lm_edges import LmEdgesMethodConfig

    model, tokenizer = edge_model
    total = EdgeGraph.of(layout_of(model)).count
    settings = {"mode": "eap", "circuit": [0, total], "ablation": "mean"}
    dataset, batch = pairs_batch(PAIRS, tokenizer, True, torch.device("cpu"))
    method = LmEdges(library_config(LmEdgesMethodConfig, edges=settings), [],
                     library_token_runtime(torch.device("cpu"), "token_logit_diff"))  # fmt: skip
    circuit = run_prepared(method, model, batch, dataset).tables["lm_circuit"]
    edges = torch.tensor(circuit["edges"])
    faithful = circuit["faithfulness"]
    assert set(circuit["ablation"]) == {"mean"}
    assert (faithful[edges == total] - 1).abs().max() <= 1e-5
    # every edge carrying the batch's mean write is not the corrupted run
    assert (circuit["circuit_metric"][edges == 0] - circuit["corrupted"][edges == 0]).abs().min() > 1e-3


@pytest.mark.parametrize("arch", POST_NORMED)
def test_post_normed_head_writes_sum_to_the_attention_output_in_each_run(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In a family that norms the heads' sum, the heads' writes (intervene.HeadWrites) equal this test's definition
    and sum to what the attention adds to the stream (the post-norm's output), in the clean and in the corrupted run:
    no share of the norm's output is left to no writer."""
    from runner.hooks import HookSession
    from runner.methods.lm_edges.intervene import HeadWrites

    model, tokenizer, _ = build_tiny_lm(arch, seed=4, folder=tmp_path)
    layout = layout_of(model)
    writes = HeadWrites(model, layout, layout.layers)
    assert writes.post_norm
    block = model.model.layers[1]
    seen: dict[str, torch.Tensor] = {}
    for prompt in (PAIRS[0]["clean"], PAIRS[0]["corrupted"]):
        with HookSession(model, []):
            handles = [block.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0])),
                       block.post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o))]  # fmt: skip
            with torch.no_grad():
                model(torch.tensor([_ids(tokenizer, prompt)]))
            for handle in handles:
                handle.remove()
        heads = model.config.num_attention_heads
        ours = writes(1, seen["z"].unflatten(-1, (heads, -1)))  # (H, B, T, D)
        torch.testing.assert_close(ours, torch.stack(_head_writes(model, 1, seen["z"])), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.sum(0), seen["out"], rtol=1e-5, atol=1e-6)


def test_a_post_normed_projection_with_a_bias_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm("olmo2", seed=0, folder=tmp_path)
    block = model.model.layers[0].self_attn
    block.o_proj.bias = nn.Parameter(torch.zeros(block.o_proj.out_features))
    with pytest.raises(RunnerError, match=r"output projection has a bias, which post_attention_layernorm norms"):
        lm_edge_attribution(model, tokenizer, PAIRS[:1])


def test_batch_rows_are_the_mean_and_spread_of_the_pair_rows(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = llama
    pairs = lm_edge_attribution(model, tokenizer, PAIRS, mode="eap", per_pair=True)
    batch = lm_edge_attribution(model, tokenizer, PAIRS, mode="eap")
    assert len(pairs) == 3 * len(batch) and (batch.pairs == 3).all() and (batch.sample_index == -1).all()
    grouped = pairs.groupby("edge").score
    mean, std = grouped.mean(), grouped.std()
    assert (batch.set_index("edge").score - mean).abs().max() <= 1e-6
    assert (batch.set_index("edge").score_std - std).abs().max() <= 1e-6


@pytest.mark.slow
def test_eap_equals_transformer_lens_edge_attribution_on_gpt2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TransformerLens 4.3's `attribution_patch` at edge granularity (its split q/k/v inputs, per position) summed over
    positions equals mode=eap on a random GPT-2, edge by edge, 1e-5 (TL refuses grouped-query models)."""
    pytest.importorskip("transformer_lens")
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch

    from tests.lm_references import tl_bridge, tl_edge_name

    model, tokenizer, folder = build_tiny_lm("gpt2", seed=2, folder=tmp_path)
    pair = PAIRS[1]
    ours = lm_edge_attribution(model, tokenizer, [pair], mode="eap", per_pair=True)
    bridge = tl_bridge(folder, tokenizer)
    answer, distractor = (tokenizer.convert_tokens_to_ids(pair[k]) for k in ("answer", "distractor"))
    clean = torch.tensor([_ids(tokenizer, pair["clean"])])
    corrupted = torch.tensor([_ids(tokenizer, pair["corrupted"])])
    result = attribution_patch(bridge, clean, corrupted, lambda logits: logits[0, -1, answer] - logits[0, -1, distractor],
                               EdgeAttributionConfig(granularity="edge"))  # fmt: skip

    theirs: dict[str, float] = {}
    for (writer, reader), value in result.edge_scores.items():
        key = f"{tl_edge_name(writer)}->{tl_edge_name(reader)}"
        theirs[key] = theirs.get(key, 0.0) + float(value)
    mine = dict(zip(ours.edge, ours.score.astype(float), strict=True))
    assert set(mine) == set(theirs)
    worst = max(abs(mine[k] - theirs[k]) for k in mine)
    print(f"TransformerLens: {len(mine)} edges, worst |runner - TL| = {worst:.2e}")
    assert worst <= 1e-5 * max(1.0, max(abs(v) for v in theirs.values()))


def _by_sites(model: nn.Module, tokenizer: Any, pair: dict[str, str]) -> dict[str, float]:
    """Exact effects of a few edges, each patched by two plain runs through the sites' own hooks (no copies): the
    corrupted run with the reader's whole input stream + the writer's clean - corrupted output, its reader site kept;
    then the corrupted run with that site (that head's columns) put in its place. Writers: input, m0."""
    from runner.hooks import HookSession
    from runner.hooks.sites import SiteHooks, _Patch

    layout = layout_of(model)
    clean, corrupted = (torch.tensor([_ids(tokenizer, pair[k])]) for k in ("clean", "corrupted"))
    answer, distractor = (tokenizer.convert_tokens_to_ids(pair[k]) for k in ("answer", "distractor"))
    last = layout.layers - 1
    mlp_in = "resid_pre" if layout.arch.mid_norm is None else "resid_mid"
    names = [("resid_pre", 0), ("mlp_out", 0), ("resid_pre", 1), (mlp_in, 1), ("q", 1), ("k", 1), ("v", 1),
             ("mlp_out", 1), ("resid_post", last)]  # fmt: skip
    specs = {f"{k}.{i}": layout.site(k, i) for k, i in names}
    one = torch.tensor([0])

    def metric(logits: torch.Tensor) -> float:
        return float(logits[0, -1, answer] - logits[0, -1, distractor])

    with torch.no_grad(), HookSession(model, []) as session:
        patcher = SiteHooks(model, list(specs.values()), session)
        keeper = SiteHooks(model, list(specs.values()), session)
        with keeper.keep():
            model(clean)
        a = keeper.kept
        with keeper.keep():
            base = metric(model(corrupted).logits)
        b = keeper.kept
        writes = {"input": a["resid_pre.0"] - b["resid_pre.0"], "m0": a["mlp_out.0"] - b["mlp_out.0"]}
        reader_of = {"q": ("resid_pre.1", "q.1", 1), "k": ("resid_pre.1", "k.1", 0),
                     "v": ("resid_pre.1", "v.1", layout.kv_heads - 1), "m1": (f"{mlp_in}.1", "mlp_out.1", None)}  # fmt: skip
        out = {}
        for writer, write in writes.items():
            for kind, (stream, site, head) in reader_of.items():
                patcher.sources = {stream: b[stream] + write}
                patcher.patches = {stream: _Patch(one, one, None, None)}
                with keeper.keep():
                    model(corrupted)
                value = keeper.kept[site]
                patcher.sources = {site: value}
                patcher.patches = {site: _Patch(one, one, None, None if head is None else torch.tensor([head]))}
                patched = metric(model(corrupted).logits)
                reader = "m1" if kind == "m1" else f"a1.{'h' if kind == 'q' else 'g'}{head}<{kind}>"
                out[f"{writer}->{reader}"] = patched - base
            patcher.sources = {f"resid_post.{last}": b[f"resid_post.{last}"] + write}
            patcher.patches = {f"resid_post.{last}": _Patch(one, one, None, None)}
            out[f"{writer}->logits"] = metric(model(corrupted).logits) - base
        patcher.clear()
    return out


@pytest.mark.parametrize("arch", EDGE_FAMILIES)
def test_exact_edges_equal_two_plain_site_patches_in_every_family(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The copies stacked in one forward (intervene.py) against two plain runs per edge through the site adapters
    (per family fused or grouped q/k/v, parallel or sequential blocks, MLPs on flattened positions), 1e-5."""
    model, tokenizer, _ = build_tiny_lm(arch, seed=3, folder=tmp_path)
    pair = PAIRS[2]
    reference = _by_sites(model, tokenizer, pair)
    table = lm_edge_attribution(model, tokenizer, [pair], mode="exact", per_pair=True)
    ours = dict(zip(table.edge, table.score.astype(float), strict=True))
    worst = max(abs(ours[k] - v) for k, v in reference.items())
    print(f"{arch}: {len(reference)} edges, worst |runner - two plain patches| = {worst:.2e}")
    assert worst <= 1e-5 * max(1.0, max(abs(v) for v in reference.values()))


def test_settings_out_of_range_are_refused_with_their_key() -> None:
    from runner.options.method.lm_edges import LmEdgesConfig, LmEdgesMethodConfig

    for bad, words in (({"circuit": [10, -1]}, "circuit sizes are edge counts"), ({"top_k": -2}, "top_k=-2"),
                       ({"steps": 0}, "method.edges.steps=0"),
                       ({"min_span": -1.0}, "method.edges.min_span=-1.0")):  # fmt: skip
        with pytest.raises(RunnerError, match=words):
            LmEdgesMethodConfig(edges=LmEdgesConfig(**bad)).check()


@pytest.mark.parametrize("device", DEVICE_PARAMS)  # cuda where there is one, marked gpu (`make test-gpu`)
@pytest.mark.parametrize("mode", [mode.value for mode in ESTIMATORS])  # every mode the registry has
def test_edges_and_circuits_on_the_device_equal_the_cpu(llama, device: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Scores, exact effects (top_k) and circuits computed on `device` equal the CPU's (on the CPU: the same code
    path with the model moved, a copy, run twice)."""
    import copy

    from runner.data.prompts import pairs_batch
    from runner.methods.base import library_config, library_token_runtime, run_prepared
    from runner.methods.lm_edges.method import LmEdges
    from runner.options.method.lm_edges import LmEdgesMethodConfig

    model, tokenizer = llama
    settings = {"mode": mode, "steps": 2, "top_k": 4, "circuit": [0, 10, 40], "per_pair": True}

    def run(on: str) -> dict:
        moved = copy.deepcopy(model).to(on)
        dataset, batch = pairs_batch(PAIRS, tokenizer, True, torch.device(on))
        method = LmEdges(library_config(LmEdgesMethodConfig, edges=settings), [],
                         library_token_runtime(torch.device(on), "token_logit_diff"))  # fmt: skip
        return run_prepared(method, moved, batch, dataset).tables

    here, cpu = run(device), run("cpu")
    for table, column in (("lm_edges", "score"), ("lm_edges", "exact"), ("lm_circuit", "circuit_metric")):
        ours, theirs = (torch.as_tensor(t[table][column]).cpu().float() for t in (here, cpu))
        assert ours.shape == theirs.shape and not ours.isnan().all(), (table, column)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, equal_nan=True)
