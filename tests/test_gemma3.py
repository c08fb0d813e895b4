"""The second real pretrained model offline, Gemma 3 270M (`model.name=gemma3-270m`: the pretrained google/gemma-3-270m,
Q4_K_M GGUF dequantised to float32; 18 layers, 4 query heads sharing 1 key-value head, head size 256, a norm after
each branch), slow tier.

On two IOI pairs ("ABC" corruption, denoising, token_logit_diff): its published shape; it prefers the indirect object;
the reference-free identities on real weights (the last layer's resid_post at the last position restores exactly 1,
the table's clean and corrupted metrics equal the model's own forward, resid_post of layer l equals resid_pre of l + 1
cell by cell); a sample of cells equal to TransformerLens 4.3's patching functions through its TransformerBridge on the
same weights; and lm_edges through its post-norms: exact effects of the top edges equal to one plain forward each
(tests/test_lm_edges.py's reference, written for Gemma's blocks)."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
from safetensors import safe_open

from runner.methods.lm_patching import lm_activation_patching
from runner.models.packaged_lm import converted_folder
from runner.options.model.hf_lm import PACKAGED_LMS
from tests.lm_references import tl_bridge
from tests.test_packaged_lm import IOI, IOI_PAIRS, packaged_ioi

pytestmark = [pytest.mark.slow, pytest.mark.real_model]  # every test reads the real model

GEMMA3 = "gemma3-270m"
LAYERS = [0, 8, 9, 17]  # first, a pair of neighbours (resid_post(8) = resid_pre(9)), last
# |runner - reference| in the logit difference (values up to ~9): float32 through 18 layers and a 262,144-token
# unembedding, the runner's variants batched against one forward per cell. Measured worst: see the prints.
TOLERANCE = 5e-5


@pytest.fixture(scope="module")
def gemma3() -> dict:
    """The packaged model, the pairs as token ids (BOS first, as the runner makes them) and their metric."""
    return packaged_ioi(GEMMA3)


@pytest.fixture(scope="module")
def exact(gemma3: dict) -> pd.DataFrame:
    sites = ["resid_pre", "resid_post", "attn_out", "mlp_out", "head"]
    started = time.perf_counter()
    table = lm_activation_patching(gemma3["model"], gemma3["tokenizer"], IOI_PAIRS, sites=sites, layers=LAYERS,
                                   directions=["denoising"])  # fmt: skip
    print(f"runner: {len(table)} exact rows in {time.perf_counter() - started:.1f} s")
    return table


def test_gemma3_has_its_published_shape(gemma3: dict) -> None:
    model = gemma3["model"]
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and config.model_type == PACKAGED_LMS[GEMMA3].model_type
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 1, 262144)
    assert 267e6 < sum(p.numel() for p in model.parameters()) < 269e6
    assert next(model.parameters()).dtype == torch.float32
    # Tied embeddings, as published: one tensor in the model and one in the converted file
    assert config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    with safe_open(converted_folder(GEMMA3) / "model.safetensors", "pt") as saved:
        assert "lm_head.weight" not in set(saved.keys())


def test_gemma3_prefers_the_indirect_object(gemma3: dict) -> None:
    model, tokenizer = gemma3["model"], gemma3["tokenizer"]
    for prompt, answer, distractor in IOI:
        (io,), (s,) = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (answer, distractor))
        with torch.no_grad():
            logits = model(**tokenizer(prompt, return_tensors="pt")).logits[0, -1]
        assert logits[io] - logits[s] > 0, (prompt, float(logits[io] - logits[s]))


def test_the_tables_clean_and_corrupted_metrics_are_the_models_own_forward(gemma3: dict, exact: pd.DataFrame) -> None:
    with torch.no_grad():
        clean = gemma3["metric"](gemma3["model"](input_ids=gemma3["clean"], use_cache=False).logits)
        corrupted = gemma3["metric"](gemma3["model"](input_ids=gemma3["corrupted"], use_cache=False).logits)
    assert (clean > 1).all() and (clean - corrupted > 1).all(), (clean, corrupted)
    first = exact.groupby("sample_index")[["clean", "corrupted"]].first()
    worst = max(float((torch.tensor(first[k].to_numpy()).float() - v).abs().max()) for k, v in
                (("clean", clean), ("corrupted", corrupted)))  # fmt: skip
    print("|table - own forward|", worst)
    assert worst <= TOLERANCE


def test_the_last_layers_stream_at_the_last_position_restores_exactly(exact: pd.DataFrame) -> None:
    last = int(exact.position.max())
    rows = exact[(exact.site == "resid_post") & (exact.layer == 17) & (exact.position == last)]
    assert len(rows) == len(IOI_PAIRS) and not rows.degenerate.any()
    print("|restoration - 1|", (rows.restoration - 1).abs().max())
    assert (rows.restoration - 1).abs().max() < 1e-5


def test_one_layers_output_stream_is_the_next_layers_input_stream(exact: pd.DataFrame) -> None:
    """resid_post(8) and resid_pre(9) are one tensor: every (position, pair) patched there gives the same metric."""
    keys = ["sample_index", "position"]
    post = exact[(exact.site == "resid_post") & (exact.layer == 8)].set_index(keys).patched
    pre = exact[(exact.site == "resid_pre") & (exact.layer == 9)].set_index(keys).patched
    assert len(post) == len(pre) > 10 and (post - exact.corrupted.iloc[0]).abs().max() > 1.0
    gap = float((post - pre.reindex(post.index)).abs().max())
    print("|resid_post(8) - resid_pre(9)|", gap)
    assert gap <= 1e-5


def test_runner_equals_transformerlens_on_a_sample_of_cells(
    gemma3: dict, exact: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resid_pre and attn_out at every position, each head at all positions, of layers 0 and 17: TransformerLens'
    get_act_patch_* through its TransformerBridge (Gemma 3's adapter) equal the runner's rows. The bridge's model
    unembeds the last position alone, the one the metric reads, as the runner's forwards do (30% less time; the
    full unembedding's values differ from these by rounding, 9.5e-6 at most)."""
    pytest.importorskip("transformer_lens")
    from transformer_lens import patching

    monkeypatch.setattr(patching, "tqdm", lambda cells: cells)
    bridge = tl_bridge(gemma3["model"], gemma3["tokenizer"], last_logits_only=True)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(gemma3["clean"])
    functions = {"resid_pre": ("get_act_patch_resid_pre", ("layer", "pos")),
                 "attn_out": ("get_act_patch_attn_out", ("layer", "pos")),
                 "head": ("get_act_patch_attn_head_out_all_pos", ("layer", "head"))}  # fmt: skip
    positions = gemma3["clean"].shape[1]
    worst = {}
    for site, (name, columns) in functions.items():
        count = 4 if site == "head" else positions
        index = pd.DataFrame([(layer, c) for layer in (0, 17) for c in range(count)], columns=list(columns))
        with torch.no_grad():
            result = getattr(patching, name)(bridge, gemma3["corrupted"], cache, gemma3["metric"],
                                             index_axis_names=None, index_df=index, reduce="none")  # fmt: skip
        theirs = result.values.float().cpu()  # (cells, pairs)
        rows = exact[exact.site == site]
        ours = []
        for layer, c in index.itertuples(index=False):
            cell = rows[(rows.layer == layer) & ((rows["head"] == c) if site == "head" else (rows.position == c))]
            ours.append(torch.tensor(cell.sort_values("sample_index").patched.to_numpy(dtype="float32")))
        worst[site] = float((torch.stack(ours) - theirs).abs().max())
        assert (theirs - float(exact.corrupted.iloc[0])).abs().max() > 0.5, site  # not vacuous
    print("worst |runner - TransformerLens| per site", worst)
    assert max(worst.values()) <= TOLERANCE, worst


def test_exact_edges_through_the_post_norms_equal_one_plain_forward_each(gemma3: dict) -> None:
    """lm_edges on the real weights: the exact effects of the top 6 edges (and 6 random) equal one forward each with
    the edge's reader reading + its writer's clean - corrupted write, heads' writes at their run's post-norm scale
    (tests/test_lm_edges.py's reference for Gemma's blocks)."""
    from runner.methods.lm_edges import lm_edge_attribution
    from tests.test_lm_edges import _edge_setup, _perturbed_logits

    model, tokenizer = gemma3["model"], gemma3["tokenizer"]
    pair = IOI_PAIRS[0]
    table = lm_edge_attribution(model, tokenizer, [pair], mode="eap", top_k=6)
    checked = table[table.exact.notna()]
    assert len(checked) == 12 and checked.upstream.str.match(r"a\d+\.h\d+$").any()  # heads' writes among them
    e = _edge_setup(model, tokenizer, pair)
    for key in ("answer", "distractor"):  # SentencePiece: " Mary" is the token "▁Mary", not a token by that name
        (e[key],) = tokenizer(pair[key], add_special_tokens=False)["input_ids"]
    readers = {reader[0]: reader for _, reader in e["edges"]}

    def metric(logits: torch.Tensor) -> float:
        return float(logits[e["answer"]] - logits[e["distractor"]])

    worst = 0.0
    with torch.no_grad():
        base = metric(model(e["corrupted"]).logits[0, -1])
        for row in checked.itertuples():
            _, layer, kind, index = readers[row.downstream]
            write = e["writes"][row.upstream]
            got = metric(_perturbed_logits(model, e["corrupted"], e["embedding"], layer, kind, index, write, e["d"]))
            worst = max(worst, abs((got - base) - float(row.exact)))
    print(f"top edges {checked[checked['rank'] <= 6].edge.tolist()}; worst |exact - plain forward| {worst:.2e}")
    assert worst <= TOLERANCE
