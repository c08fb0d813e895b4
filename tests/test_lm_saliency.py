"""Gradient x activation (method=lm_grad_x_act) against plain autograd written here, and the logit lens
(method=lm_logit_lens) against TransformerLens 4.3's `logit_lens` through its bridge and against the model's own
logits, on random-weight GPT-2 and Llama (grouped-query) models; left padding; the CLI and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.errors import RunnerError
from runner.hooks import count_hooks
from runner.methods.lm_saliency import lm_grad_x_act, lm_logit_lens
from tests.conftest import run_cli
from tests.lm_references import build_tiny_lm, tl_bridge

# Pairs of two lengths (8 and 6 tokens with the BOS): one batch is left-padded.
PAIRS = [
    {"clean": "t01 t02 t03 t04 t01 t02 t03", "corrupted": "t09 t08 t07 t06 t01 t02 t03", "answer": "t04",
     "distractor": "t06"},
    {"clean": "t11 t12 t13 t11 t12", "corrupted": "t15 t16 t17 t11 t12", "answer": "t13", "distractor": "t17"},
    {"clean": "t05 t06 t07 t08 t05 t06 t07", "corrupted": "t10 t19 t00 t03 t05 t06 t07", "answer": "t08",
     "distractor": "t03"},
]  # fmt: skip
SAME_LENGTH = [PAIRS[0], PAIRS[2]]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))


def _ids(tokenizer, text: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.tensor([[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]])


def _hooks(model: nn.Module) -> int:
    """Module hooks other than transformers 5's own: output_hidden_states=True leaves output-capturing hooks on the
    blocks for good (the plain references below ask for hidden states)."""
    return count_hooks(model) - sum(
        "output_capturing_hook" in getattr(h, "__qualname__", "")
        for m in model.modules()
        for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
    )


def _token(tokenizer, text: str) -> int:  # type: ignore[no-untyped-def]
    return int(tokenizer.convert_tokens_to_ids(text))


# ---- gradient x activation ----------------------------------------------------------------------------------------
def _parts(model: nn.Module, layer: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(attention, MLP, attention output projection) of block `layer`, GPT-2 or Llama."""
    if hasattr(model, "transformer"):
        block = model.transformer.h[layer]
        return block.attn, block.mlp, block.attn.c_proj
    block = model.model.layers[layer]
    return block.self_attn, block.mlp, block.self_attn.o_proj


def reference_grad_x_act(model: nn.Module, ids: torch.Tensor, answer: int, distractor: int) -> dict[str, torch.Tensor]:
    """Plain autograd on one unpadded prompt (1, T): {site: (layers, T) or (layers, T, heads)} of grad . activation
    of logit[answer] - logit[distractor] at the last position. resid_pre from output_hidden_states with retain_grad;
    attn_out, mlp_out and the heads' outputs (the output projection's input) from hooks that retain their grad."""
    layers = model.config.num_hidden_layers
    heads = model.config.num_attention_heads
    kept: dict[str, list[torch.Tensor]] = {"attn_out": [], "mlp_out": [], "head": []}

    def keep(site: str, tensor: torch.Tensor) -> None:
        tensor.retain_grad()
        kept[site].append(tensor)

    handles = []
    for layer in range(layers):
        attn, mlp, out_proj = _parts(model, layer)
        handles.append(attn.register_forward_hook(lambda m, a, out: keep("attn_out", out[0])))
        handles.append(mlp.register_forward_hook(lambda m, a, out: keep("mlp_out", out)))
        handles.append(out_proj.register_forward_pre_hook(lambda m, a: keep("head", a[0])))
    try:
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        for h in out.hidden_states[:layers]:  # hidden_states[l]: block l's input (the last entry is after the norm)
            h.retain_grad()
        (out.logits[0, -1, answer] - out.logits[0, -1, distractor]).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    found = {"resid_pre": torch.stack([(h.grad * h).sum(-1)[0] for h in out.hidden_states[:layers]])}
    for site in ("attn_out", "mlp_out"):
        found[site] = torch.stack([(t.grad * t).sum(-1)[0] for t in kept[site]])
    found["head"] = torch.stack([(t.grad * t)[0].unflatten(-1, (heads, -1)).sum(-1) for t in kept["head"]])
    return {site: value.detach() for site, value in found.items()}


def test_grad_x_act_equals_plain_autograd_with_left_padding(tiny) -> None:  # type: ignore[no-untyped-def]
    """Every row of one left-padded batch of pairs of two lengths equals plain autograd on that pair alone, 1e-5."""
    model, tokenizer, _ = tiny
    model.requires_grad_(False)  # frozen, as a run loads it: the gradient must start at the embeddings' output
    try:
        table = lm_grad_x_act(model, tokenizer, PAIRS)
    finally:
        model.requires_grad_(True)  # the plain reference below reads gradients through the parameters' graph
    assert _hooks(model) == 0
    assert set(table.site) == {"resid_pre", "attn_out", "mlp_out", "head"} and set(table.metric) == {"token_logit_diff"}
    worst = 0.0
    for i, pair in enumerate(PAIRS):
        ids = _ids(tokenizer, pair["clean"])
        want = reference_grad_x_act(
            model, ids, _token(tokenizer, pair["answer"]), _token(tokenizer, pair["distractor"])
        )
        mine = table[table.sample_index == i]
        assert list(mine.token[(mine.site == "resid_pre") & (mine.layer == 0)]) == tokenizer.convert_ids_to_tokens(
            ids[0]
        )  # no rows at padding positions, positions from the first real token
        for site, values in want.items():
            rows = mine[mine.site == site]
            assert len(rows) == values.numel(), site
            index = [torch.tensor(rows.layer.to_numpy(int)), torch.tensor(rows.position.to_numpy(int))]
            if site == "head":
                index.append(torch.tensor(rows["head"].to_numpy(int)))
            else:
                assert rows["head"].isna().all()
            got = torch.tensor(rows.value.to_numpy().copy())
            worst = max(worst, float((got - values[tuple(index)]).abs().max()))
    print(f"worst |grad x act - autograd| = {worst:.2e}")
    assert worst <= 1e-5, worst
    assert (table.value.abs() > 1e-4).any()  # the comparison is not between zeros


def test_grad_x_act_per_head_sites_and_checks(tiny) -> None:  # type: ignore[no-untyped-def]
    """q has every head, k and v the key-value heads (Llama: 2 of 4); a site's norms are those of its own vectors;
    a target that is zero on the clean prompt and an unknown site are refused."""
    model, tokenizer, _ = tiny
    table = lm_grad_x_act(model, tokenizer, [PAIRS[0]], sites=["q", "k", "v", "resid_post"], layers=[1])
    kv = model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") else 4
    assert table.groupby("site")["head"].nunique().to_dict() == {"q": 4, "k": kv, "v": kv, "resid_post": 0}
    assert (table.groupby("site").size() == table.groupby("site")["head"].nunique().clip(lower=1) * 8).all()
    assert (table.value.abs() <= table.grad_norm * table.act_norm + 1e-6).all()  # Cauchy-Schwarz
    with pytest.raises(RunnerError, match="target=kl_to_clean is 0 on the clean prompt"):
        lm_grad_x_act(model, tokenizer, PAIRS, target="kl_to_clean")
    with pytest.raises(RunnerError, match="method.sites=\\['nope'\\]"):
        lm_grad_x_act(model, tokenizer, PAIRS, sites=["nope"])
    with pytest.raises(RunnerError, match="method.layers=\\[5\\]: the model has layers 0..1"):
        lm_grad_x_act(model, tokenizer, PAIRS, layers=[5])
    assert _hooks(model) == 0


# ---- the logit lens -----------------------------------------------------------------------------------------------
def test_grad_x_act_of_the_pattern_equals_autograd_on_the_returned_attentions(tiny) -> None:  # type: ignore[no-untyped-def]
    """pattern: per head and query position, the sum over keys of d(target)/d(pattern) x pattern, equal (1e-5) to
    plain autograd through the attention weights eager attention returns (output_attentions=True); the site
    crashed with an IndexError before."""
    model, tokenizer, _ = tiny
    table = lm_grad_x_act(model, tokenizer, PAIRS[:1], sites=["pattern", "resid_mid"])
    assert _hooks(model) == 0
    pair = PAIRS[0]
    ids = torch.tensor(_ids(tokenizer, pair["clean"]))
    out = model(input_ids=ids, output_attentions=True, use_cache=False)
    last = out.logits[0, -1]
    score = last[_token(tokenizer, pair["answer"])] - last[_token(tokenizer, pair["distractor"])]
    grads = torch.autograd.grad(score, out.attentions)
    model.zero_grad(set_to_none=True)
    rows = table[table.site == "pattern"]
    heads = out.attentions[0].shape[1]
    assert len(rows) == len(out.attentions) * heads * ids.shape[1]
    worst = 0.0
    for layer, (att, grad) in enumerate(zip(out.attentions, grads, strict=True)):
        want = (att * grad).sum(-1)[0].detach()  # (H, T_query)
        mine = rows[rows.layer == layer]
        got = torch.tensor(mine.value.to_numpy().copy())
        worst = max(worst, float((got - want[mine["head"].to_numpy(int), mine.position.to_numpy(int)]).abs().max()))
    assert worst <= 1e-5, worst
    assert (rows.value.abs() > 1e-4).any()


def test_logit_lens_last_layer_is_the_models_own_logits(tiny) -> None:  # type: ignore[no-untyped-def]
    """The last block's lens at every position is model(ids).logits (the final norm applied once), 1e-6; the
    earlier layers are the final norm and unembedding applied to output_hidden_states (a plain reference), 1e-5."""
    model, tokenizer, _ = tiny
    table = lm_logit_lens(model, tokenizer, SAME_LENGTH, target="answer_logprob")
    assert _hooks(model) == 0
    layers = model.config.num_hidden_layers
    assert sorted(set(table.layer)) == [-1, *range(layers)]
    norm, unembed = (model.transformer.ln_f, model.lm_head) if hasattr(model, "transformer") else (
        model.model.norm, model.lm_head)  # fmt: skip
    ids = torch.cat([_ids(tokenizer, p["clean"]) for p in SAME_LENGTH])  # one batch, as the method ran it
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        # hidden_states[l + 1] is block l's output except the last, which is already after the final norm.
        stack = [unembed(norm(h)) for h in out.hidden_states[:layers]] + [out.logits]
    for i, pair in enumerate(SAME_LENGTH):
        answer, distractor = _token(tokenizer, pair["answer"]), _token(tokenizer, pair["distractor"])
        lens = [logits[i] for logits in stack]
        mine = table[table.sample_index == i]
        for layer, logits in zip(range(-1, layers), lens, strict=True):
            rows = mine[mine.layer == layer].sort_values("position")
            tol = 1e-6 if layer == layers - 1 else 1e-5
            assert (torch.tensor(rows.answer_logit.to_numpy()) - logits[:, answer]).abs().max() <= tol
            assert (torch.tensor(rows.distractor_logit.to_numpy()) - logits[:, distractor]).abs().max() <= tol
            logprob = logits.log_softmax(-1)[:, answer]
            assert (torch.tensor(rows.value.to_numpy()) - logprob).abs().max() <= tol  # value: the run's target
            assert (torch.tensor(rows.answer_logprob.to_numpy()) - logprob).abs().max() <= tol
            assert list(rows.top_token_id) == logits.argmax(-1).tolist()
            assert list(rows.top_token) == tokenizer.convert_ids_to_tokens(logits.argmax(-1).tolist())
            assert (torch.tensor(rows.top_prob.to_numpy()) - logits.softmax(-1).max(-1).values).abs().max() <= tol
            assert list(rows.token) == tokenizer.convert_ids_to_tokens(ids[i])


@pytest.mark.slow
def test_logit_lens_equals_transformer_lens(tiny) -> None:  # type: ignore[no-untyped-def]
    """TransformerLens 4.3's `logit_lens` through its TransformerBridge (stack entry 0_pre = layer -1, l_pre = block
    l - 1's output, final_post = the last block's), every layer and position, 1e-5."""
    from transformer_lens.tools.analysis.logit_lens import logit_lens

    model, tokenizer, folder = tiny
    table = lm_logit_lens(model, tokenizer, SAME_LENGTH, target="token_logit_diff")
    ids = torch.cat([_ids(tokenizer, p["clean"]) for p in SAME_LENGTH])
    with torch.no_grad():
        tl = logit_lens(tl_bridge(folder), ids, positions=None).values  # (layers + 1, B, T, V)
    assert tl.shape[0] == model.config.num_hidden_layers + 1
    worst = 0.0
    for i, pair in enumerate(SAME_LENGTH):
        answer, distractor = _token(tokenizer, pair["answer"]), _token(tokenizer, pair["distractor"])
        for entry in range(tl.shape[0]):
            rows = table[(table.sample_index == i) & (table.layer == entry - 1)].sort_values("position")
            logits = tl[entry, i].float()  # (T, V)
            diff = logits[:, answer] - logits[:, distractor]
            worst = max(worst, float((torch.tensor(rows.value.to_numpy()) - diff).abs().max()),
                        float((torch.tensor(rows.answer_logit.to_numpy()) - logits[:, answer]).abs().max()),
                        float((torch.tensor(rows.top_prob.to_numpy()) - logits.softmax(-1).max(-1).values).abs().max()))  # fmt: skip
    print(f"worst |lens - TransformerLens| = {worst:.2e}")
    assert worst <= 1e-5, worst


def test_logit_lens_padded_batch_equals_each_pair_alone(tiny) -> None:  # type: ignore[no-untyped-def]
    """Pairs of two lengths, left-padded, under every token target: each pair's rows equal it run alone; no row
    at a padding position; kl_to_clean is 0 at the last layer (its reference is that layer's lens)."""
    model, tokenizer, _ = tiny
    for target in ("token_logit_diff", "token_prob_diff", "answer_logprob", "kl_to_clean"):
        together = lm_logit_lens(model, tokenizer, PAIRS, target=target)
        for i, pair in enumerate(PAIRS):
            alone = lm_logit_lens(model, tokenizer, [pair], target=target)
            mine = together[together.sample_index == i].reset_index(drop=True)
            assert mine[["layer", "position", "token", "top_token"]].equals(
                alone[["layer", "position", "token", "top_token"]]
            )
            for column in ("value", "answer_logit", "top_prob"):
                assert (mine[column] - alone[column]).abs().max() <= 1e-5, (target, column)
        assert len(together) == 3 * (8 + 6 + 8)  # three layers (-1, 0, 1) of the real positions only
        if target == "kl_to_clean":
            assert together[together.layer == 1].value.abs().max() <= 1e-5
            assert together[together.layer == -1].value.min() > 1e-3
    with pytest.raises(RunnerError, match="method.layers=\\[-2\\]: each of -1 \\(the embeddings\\) .. 1"):
        lm_logit_lens(model, tokenizer, PAIRS, layers=[-2])
    picked = lm_logit_lens(model, tokenizer, PAIRS, layers=[0])
    assert set(picked.layer) == {0}


# ---- the command line ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_writes_each_table_and_refuses_an_image_model(tmp_path: Path) -> None:
    _, _, folder = build_tiny_lm("gpt2", seed=0, folder=tmp_path / "model")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS))
    from runner.results import load

    for method, sites in (("lm_grad_x_act", {"resid_pre", "attn_out", "mlp_out", "head"}), ("lm_logit_lens", None)):
        # batches of one pair: rows of the second batch name its own pair (the writer adds the batch's first index)
        done = run_cli("debug=tiny", "data.batch_size=1", "model=hf_lm", f"model.name={folder}", "data=prompts",
                       f"data.file={pairs}", f"method={method}", "target=token_logit_diff",
                       f"hydra.run.dir={tmp_path / method}")  # fmt: skip
        assert done.returncode == 0, done.stderr
        table = load(tmp_path / method)
        assert set(table.method) == {method} and set(table["sample"]) == {0, 1}
        assert set(table.sample_id) == {"pair-0", "pair-1"}
        assert table.value.notna().all()
        if sites is not None:
            assert set(table.site) == sites
        else:
            assert set(table.layer) == {-1, 0, 1} and table.top_token.notna().all()
    image = ["model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.count=2"]
    for method in ("lm_grad_x_act", "lm_logit_lens"):
        refused = run_cli(*image, f"method={method}", f"hydra.run.dir={tmp_path / 'bad'}")
        assert refused.returncode == 2, refused.stderr
        assert f"method={method} and data=synthetic need a language model (model=hf_lm)" in refused.stderr
        assert "Traceback" not in refused.stderr
