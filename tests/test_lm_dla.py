"""Direct logit attribution (method=lm_dla) against TransformerLens 4.3's `decompose_resid`, `stack_head_results`,
`accumulated_resid` and `logit_attrs` on a random GPT-2 (norms and biases random), against a reference written here
on a grouped-query Llama and a post-norm Gemma 2 (softcapped logits); its identity (the writers and the bias row sum
to the logit difference) in every family; invariance to batching and padding; the CLI and its refusals."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from runner.data.prompts import pairs_batch
from runner.methods.lm_saliency import lm_dla
from tests.conftest import run_cli
from tests.lm_references import FAMILIES, build_tiny_lm, tl_bridge
from tests.test_lm_saliency import PAIRS, SAME_LENGTH


def randomised(model: nn.Module, seed: int = 1) -> nn.Module:
    """`model` with every norm's weight and every bias moved off its init (at 1 and 0 a norm hides where it sits)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm("gpt2", seed=0, folder=tmp_path_factory.mktemp("gpt2"))
    return randomised(model), tokenizer


def by_writer(frame: pd.DataFrame) -> pd.Series:
    return frame.set_index(["sample_index", "writer"])["value"].astype(float)


# ---- against TransformerLens ----------------------------------------------------------------------------------------
def test_dla_equals_transformerlens_logit_attrs_on_gpt2(gpt2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = gpt2
    ours = lm_dla(model, tokenizer, SAME_LENGTH)
    _, batch = pairs_batch(SAME_LENGTH, tokenizer, True, torch.device("cpu"))
    ids, answers, distractors = batch.x[:, 0], batch.extras["answers"][:, 0], batch.extras["distractors"][:, 0]
    bridge = tl_bridge(model, tokenizer)
    # fold_value_biases off: it moves each head's b_V into the attention's b_O, and so out of the head's write;
    # center_unembed off: it shifts every logit by the same amount, which a difference cancels but a single logit keeps
    bridge.enable_compatibility_mode(disable_warnings=True, fold_value_biases=False, center_unembed=False)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)

        def attrs(stack: torch.Tensor, wrong: torch.Tensor | None = distractors) -> torch.Tensor:
            """(components, batch) at the last position: onto answer - distractor, or the answer alone."""
            return cache.logit_attrs(stack, tokens=answers, incorrect_tokens=wrong, pos_slice=-1)

        parts, labels = cache.decompose_resid(layer=-1, mode="all", apply_ln=False, pos_slice=-1, return_labels=True)
        whole = dict(zip(labels, attrs(parts), strict=True))
        heads, head_labels = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=False, return_labels=True)
        per_head = dict(zip(head_labels, attrs(heads), strict=True))
        answer_only = dict(zip(head_labels, attrs(heads, None), strict=True))
        streams, stream_labels = cache.accumulated_resid(layer=-1, pos_slice=-1, apply_ln=False, return_labels=True)
        accumulated = attrs(streams)
    values = by_writer(ours)
    for row in range(len(SAME_LENGTH)):
        mine = values.xs(row, level="sample_index")
        assert mine["input"] == pytest.approx(float(whole["embed"][row] + whole["pos_embed"][row]), abs=1e-4)
        for layer in range(2):
            heads_here = [float(per_head[f"L{layer}H{h}"][row]) for h in range(4)]
            assert [mine[f"a{layer}.h{h}"] for h in range(4)] == pytest.approx(heads_here, abs=1e-4)
            toward_answer = [float(answer_only[f"L{layer}H{h}"][row]) for h in range(4)]
            answer_part = ours.set_index(["sample_index", "writer"])["answer_value"].astype(float).xs(row)
            assert [answer_part[f"a{layer}.h{h}"] for h in range(4)] == pytest.approx(toward_answer, abs=1e-4)
            attention = sum(mine[f"a{layer}.h{h}"] for h in range(4)) + mine[f"a{layer}.bias"]
            assert attention == pytest.approx(float(whole[f"{layer}_attn_out"][row]), abs=1e-4)
            assert mine[f"m{layer}"] == pytest.approx(float(whole[f"{layer}_mlp_out"][row]), abs=1e-4)
        assert [mine["resid_pre.0"], mine["resid_pre.1"], mine["resid_post.1"]] == pytest.approx(
            accumulated[:, row].tolist(), abs=1e-4
        )
        assert stream_labels == ["0_pre", "1_pre", "final_post"]
    assert values.abs().max() > 0.05  # not a comparison of zeros
    assert (ours["answer_value"] - ours["distractor_value"] - ours["value"]).abs().max() < 1e-5
    # the bias row is what TL folds into b_U: the final LN's bias on the direction
    last = ours.drop_duplicates("sample_index").sort_values("sample_index")
    true = logits[torch.arange(len(ids)), -1, answers] - logits[torch.arange(len(ids)), -1, distractors]
    assert last["logit_diff"].tolist() == pytest.approx(true.tolist(), abs=1e-4)


# ---- against a reference written here ------------------------------------------------------------------------------
def reference_dla(model: nn.Module, ids: torch.Tensor, answer: int, distractor: int) -> dict[str, float]:
    """One prompt's writers at its last position, from the modules' weights and plain hooks: a Llama-layout model
    (q/k/v/o projections, RMS norms) with or without Gemma's post-norms and (1 + weight) gains."""
    config = model.config
    layers = model.model.layers
    gemma = "gemma" in config.model_type
    kept: dict[str, torch.Tensor] = {}
    handles = [layers[0].register_forward_pre_hook(lambda m, a, k: kept.update(embed=a[0] if a else k["hidden_states"]),
                                                   with_kwargs=True)]  # fmt: skip
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, i=i: kept.update({f"z{i}": a[0]})))  # fmt: skip
        mlp_out = layer.post_feedforward_layernorm if gemma else layer.mlp
        handles.append(mlp_out.register_forward_hook(lambda m, a, o, i=i: kept.update({f"m{i}": o})))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    for handle in handles:
        handle.remove()

    def rms_gain(norm: nn.Module) -> torch.Tensor:
        return (1.0 + norm.weight) if gemma else norm.weight

    def rms(v: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return (v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon if hasattr(norm, "variance_epsilon")
                else v.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # fmt: skip

    writes = {"input": kept["embed"][0, -1]}
    heads, head_dim = config.num_attention_heads, config.head_dim
    for i, layer in enumerate(layers):
        z = kept[f"z{i}"][0, -1]  # (H x d)
        weight = layer.self_attn.o_proj.weight  # (D, H x d)
        for h in range(heads):
            part = weight[:, h * head_dim : (h + 1) * head_dim] @ z[h * head_dim : (h + 1) * head_dim]
            if gemma:  # the post-attention norm's share at this run's summed output
                norm = layer.post_attention_layernorm
                part = rms_gain(norm) * part / rms(weight @ z, norm)
            writes[f"a{i}.h{h}"] = part
        writes[f"m{i}"] = kept[f"m{i}"][0, -1]
    final = sum(writes.values())
    norm = model.model.norm
    unembed = model.lm_head.weight
    direction = unembed[answer] - unembed[distractor]
    values = {name: float((rms_gain(norm) * c / rms(final, norm)) @ direction) for name, c in writes.items()}
    capped = out.logits[0, -1]
    values["_logit_diff"] = float(capped[answer] - capped[distractor])
    return values


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_dla_equals_a_reference_on_grouped_query_and_post_norm_models(arch: str, tmp_path: Path) -> None:
    """Llama with 4 query heads sharing 2 key-value heads; Gemma 2 with its post-norms, (1 + weight) gains and final
    logit softcap: the writers sum to the logit difference before the softcap, not after it."""
    model, tokenizer, _ = build_tiny_lm(arch, seed=0, folder=tmp_path / arch)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ours = by_writer(lm_dla(model, tokenizer, SAME_LENGTH, accumulated=False))
    dataset, batch = pairs_batch(SAME_LENGTH, tokenizer, True, torch.device("cpu"))
    frame = lm_dla(model, tokenizer, SAME_LENGTH)
    for row in range(len(SAME_LENGTH)):
        ids = batch.x[row : row + 1, 0]
        answer, distractor = int(batch.extras["answers"][row, 0]), int(batch.extras["distractors"][row, 0])
        reference = reference_dla(model, ids, answer, distractor)
        mine = ours.xs(row, level="sample_index")
        names = [n for n in reference if not n.startswith("_")]
        assert [mine[n] for n in names] == pytest.approx([reference[n] for n in names], abs=1e-4)
        assert max(abs(reference[n]) for n in names) > 0.05
        pair = frame[frame["sample_index"] == row].iloc[0]
        assert float(pair["logit_diff"]) == pytest.approx(reference["_logit_diff"], abs=1e-4)
        if arch == "gemma2":  # the softcap bends each logit: the writers sum to the uncapped difference
            assert model.config.final_logit_softcapping
            assert abs(float(pair["total"]) - float(pair["logit_diff"])) > 1e-3
            assert float(pair["total"]) == pytest.approx(sum(reference[n] for n in names), abs=1e-4)
        else:
            assert float(pair["total"]) == pytest.approx(float(pair["logit_diff"]), abs=1e-4)


# ---- identities and invariances -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_the_writers_sum_to_the_logit_difference_in_every_family(arch: str, tmp_path: Path) -> None:
    model, tokenizer, _ = build_tiny_lm(arch, seed=0, folder=tmp_path / arch)
    frame = lm_dla(model, tokenizer, PAIRS, positions="all")
    writers = frame[frame["kind"] != "accumulated"]
    summed = writers.groupby(["sample_index", "position"])["value"].sum()
    total = writers.groupby(["sample_index", "position"])["total"].first()
    assert (summed - total).abs().max() < 1e-4
    final = frame[(frame["kind"] == "accumulated") & (frame["layer"] == frame["layer"].max())]
    bias = frame[frame["kind"] == "bias"]
    assert final["value"].to_numpy() + bias["value"].to_numpy() == pytest.approx(bias["total"].to_numpy(), abs=1e-4)
    if not getattr(model.config, "final_logit_softcapping", None):
        assert (frame["total"] - frame["logit_diff"]).abs().max() < 1e-4  # linear readout: the model's own value
    assert frame["value"].abs().max() > 0.01


def test_dla_does_not_change_with_batching_or_padding(gpt2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = gpt2
    together = lm_dla(model, tokenizer, PAIRS, positions="all")  # one left-padded batch of three lengths
    alone = pd.concat([lm_dla(model, tokenizer, [pair], positions="all").assign(sample_index=i) for i, pair in
                       enumerate(PAIRS)])  # fmt: skip
    keys = ["sample_index", "position", "writer"]
    a, b = together.set_index(keys)["value"].sort_index(), alone.set_index(keys)["value"].sort_index()
    assert a.index.equals(b.index) and (a - b).abs().max() < 1e-5
    assert together["position"].min() == 0  # positions are the pair's own, padding left out


# ---- the CLI -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.real_model
def test_the_cli_run_names_the_name_mover_like_writers(tmp_path: Path) -> None:
    done = run_cli("model=hf_lm", "model.name=smollm2-135m", "data=ioi", "data.limit=4", "method=lm_dla",
                   f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    frame = pd.read_parquet(tmp_path / "run" / "lm_dla.parquet")
    assert {"label", "predicted"}.isdisjoint(frame.columns)
    head = frame[frame["kind"] == "head"].groupby("writer")["value"].mean()
    assert head.idxmax() == "a23.h3"  # SmolLM2's strongest name mover (docs/language_models.md)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["target=answer_logprob"], "method=lm_dla splits a logit difference"),
        (["method.positions=first"], "positions"),
    ],
)
def test_refusals(tmp_path: Path, overrides: list[str], message: str) -> None:
    refused = run_cli("model=hf_lm", "model.name=smollm2-135m", "data=ioi", "method=lm_dla", *overrides,
                      f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert not (tmp_path / "run" / "lm_dla.parquet").exists()
