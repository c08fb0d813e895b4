"""Language-model patching's corruptions (resample, zero and mean ablation of the input embeddings) and the `pattern`
site, each against a plain computation that does not use the runner's hooks: the chosen pair's clean prompt run
alone, `inputs_embeds` built by hand, and a head's output rebuilt from a pattern read with output_attentions=True;
on random-weight GPT-2 and Llama (grouped-query) models; the CLI's refusals."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from runner.data.base import to_batch
from runner.data.prompts import pairs_batch, prompts_source
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm_patching import _patch, lm_activation_patching
from runner.models.lm_sites import layout_of
from runner.options.data.prompts import PromptsConfig
from tests.conftest import run_cli
from tests.lm_references import build_tiny_lm, n_heads

# Four pairs of one length (8 tokens with BOS), so each has three same-length partners to resample from.
PAIRS = [
    {"clean": "t01 t02 t03 t04 t01 t02 t03", "corrupted": "t09 t08 t07 t06 t01 t02 t03", "answer": "t04",
     "distractor": "t06"},
    {"clean": "t11 t12 t13 t14 t11 t12 t13", "corrupted": "t15 t16 t17 t18 t11 t12 t13", "answer": "t14",
     "distractor": "t18"},
    {"clean": "t05 t06 t07 t08 t05 t06 t07", "corrupted": "t10 t19 t00 t03 t05 t06 t07", "answer": "t08",
     "distractor": "t03"},
    {"clean": "t16 t02 t09 t13 t16 t02 t09", "corrupted": "t04 t07 t01 t18 t16 t02 t09", "answer": "t13",
     "distractor": "t18"},
]  # fmt: skip


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))


def _ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]


def _token(tokenizer, text: str) -> int:  # type: ignore[no-untyped-def]
    return int(tokenizer.convert_tokens_to_ids(text))


@torch.no_grad()
def _logit_diff(model, tokenizer, pair: dict, **inputs: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """The pair's answer-minus-distractor logit at the last position of one plain forward of `inputs`."""
    last = model(**inputs, use_cache=False).logits[0, -1]
    return float(last[_token(tokenizer, pair["answer"])] - last[_token(tokenizer, pair["distractor"])])


# ---- resample ---------------------------------------------------------------------------------------------------
def test_resample_takes_another_pairs_clean_prompt(tiny) -> None:  # type: ignore[no-untyped-def]
    """Each pair's corrupted metric is its answer/distractor read on the chosen partner's clean prompt run alone; the
    partner is another pair of the same length, named in corrupted_id; the draw depends on the seed only."""
    model, tokenizer, _ = tiny
    settings = {"sites": ["resid_pre"], "layers": [0], "corruption": {"kind": "resample", "seed": 3}}
    table = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    ids = [f"pair-{i}" for i in range(len(PAIRS))]
    for i, pair in enumerate(PAIRS):
        rows = table[table.sample_index == i]
        (partner,) = set(rows.corrupted_id)
        assert partner in ids and partner != ids[i]
        other = PAIRS[ids.index(partner)]
        want = _logit_diff(model, tokenizer, pair, input_ids=torch.tensor([_ids(tokenizer, other["clean"])]))
        assert abs(float(rows.corrupted.iloc[0]) - want) <= 1e-5
    again = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    assert again.corrupted_id.equals(table.corrupted_id) and again.patched.equals(table.patched)
    seeds = {
        tuple(lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre"], layers=[0],
                                     corruption={"kind": "resample", "seed": s}).groupby("sample_index")
              .corrupted_id.first())
        for s in range(6)
    }  # fmt: skip
    assert len(seeds) > 1  # the seed chooses


def test_resample_is_the_same_in_any_batching(tiny) -> None:  # type: ignore[no-untyped-def]
    """The partner is drawn by the pair's index in the data set: one batch of four and batches of one and three give
    the same partners and numbers."""
    model, tokenizer, _ = tiny
    dataset = prompts_source(PromptsConfig(pairs=PAIRS), tokenizer, 0)
    settings = {"sites": ["resid_pre"], "layers": [0], "corruption": {"kind": "resample", "seed": 1}}

    def run(first: int, last: int):  # type: ignore[no-untyped-def]
        raw = dataset.collate([dataset[i] for i in range(first, last)])
        table = _patch(model, to_batch(raw, torch.device("cpu"), first), "token_logit_diff", settings, dataset)
        table["sample_index"] += first  # the row in the batch -> the index in the data set
        return table.sort_values(["sample_index", "position"])

    whole = run(0, 4)
    whole, parts = whole.reset_index(drop=True), pd.concat([run(0, 1), run(1, 4)], ignore_index=True)
    assert whole.corrupted_id.equals(parts.corrupted_id)
    assert (whole.corrupted - parts.corrupted).abs().max() <= 1e-5
    assert (whole.patched - parts.patched).abs().max() <= 1e-5


def test_resample_refuses_a_pair_without_a_partner(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, _ = tiny
    lonely = {"clean": "t01 t02 t03", "corrupted": "t05 t02 t03", "answer": "t04", "distractor": "t06"}
    with pytest.raises(RunnerError, match=r"no other pair has the length of pair-4 \(4 tokens\)"):
        lm_activation_patching(model, tokenizer, [*PAIRS, lonely], sites=["resid_pre"],
                               corruption={"kind": "resample"})  # fmt: skip


# ---- zero and mean ablation of the input embeddings -------------------------------------------------------------
def _hand_embeddings(model, tokenizer, kind: str, span: tuple[int, int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(pairs, T, D) the clean prompts' embedding output with positions [span) zeroed or set to the mean embedding of
    every clean-prompt token of PAIRS but BOS, computed here with the embedding matrix."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        x = embed(torch.tensor([_ids(tokenizer, p["clean"]) for p in PAIRS])).clone()
        if kind == "zero":
            x[:, span[0] : span[1]] = 0
        else:
            every = [t for p in PAIRS for t in _ids(tokenizer, p["clean"])[1:]]
            x[:, span[0] : span[1]] = embed.weight[every].mean(0)
    return x


@pytest.mark.parametrize("kind", ["zero", "mean"])
@pytest.mark.parametrize("span", [None, [2, 5]])
def test_ablation_equals_hand_built_inputs_embeds(tiny, kind: str, span: list[int] | None) -> None:  # type: ignore[no-untyped-def]
    """The corrupted metric is the model run on inputs_embeds built by hand (span null: every position but BOS)."""
    model, tokenizer, _ = tiny
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre"], layers=[0],
                                   corruption={"kind": kind, "span": span})  # fmt: skip
    t = len(_ids(tokenizer, PAIRS[0]["clean"]))
    embeds = _hand_embeddings(model, tokenizer, kind, (1, t) if span is None else (span[0], span[1]))
    with torch.no_grad():
        last = model(inputs_embeds=embeds, use_cache=False).logits[:, -1]
    for i, pair in enumerate(PAIRS):
        rows = table[table.sample_index == i]
        want = float(last[i, _token(tokenizer, pair["answer"])] - last[i, _token(tokenizer, pair["distractor"])])
        assert abs(float(rows.corrupted.iloc[0]) - want) <= 1e-6, (kind, i)
        assert set(rows.corrupted_id) == {f"pair-{i} ({kind})"}
    # BOS (position 0) is outside the null span: patching it back changes nothing
    bos = table[table.position == 0]
    assert (bos.patched - bos.corrupted).abs().max() <= 1e-6


@pytest.mark.parametrize("kind", ["zero", "mean"])
def test_ablation_restored_at_resid_pre_0(tiny, kind: str) -> None:  # type: ignore[no-untyped-def]
    """With one ablated position, layer 0's residual input at that position put back restores exactly (denoising)
    and the ablated one put into the clean run gives the ablated metric (noising); other positions change nothing."""
    model, tokenizer, _ = tiny
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre"], layers=[0],
                                   directions=["denoising", "noising"],
                                   corruption={"kind": kind, "span": [3, 4]})  # fmt: skip
    assert ((table.clean - table.corrupted).abs() > 1e-4).all()
    at = table[table.position == 3]
    denoise, noise = at[at.direction == "denoising"], at[at.direction == "noising"]
    assert (denoise.patched - denoise.clean).abs().max() <= 1e-5 and (denoise.restoration - 1).abs().max() <= 1e-4
    assert (noise.patched - noise.corrupted).abs().max() <= 1e-5
    rest = table[table.position != 3]
    receiver = rest.corrupted.where(rest.direction == "denoising", rest.clean)
    assert (rest.patched - receiver).abs().max() <= 1e-5


LONGER = [
    {"clean": "t02 t03 t05 t07 t11 t13 t17 t19 t02", "corrupted": "t02 t03 t05 t07 t11 t13 t17 t19 t03",
     "answer": "t05", "distractor": "t07"},
    {"clean": "t01 t03 t05 t07 t09 t11 t13 t15 t17 t19", "corrupted": "t01 t03 t05 t07 t09 t11 t13 t15 t17 t18",
     "answer": "t00", "distractor": "t02"},
    {"clean": "t19 t18 t17 t16 t15 t14 t13 t12 t11 t10 t09", "corrupted": "t19 t18 t17 t16 t15 t14 t13 t12 t11 t10 t08",
     "answer": "t01", "distractor": "t02"},
]  # fmt: skip


def test_a_pairs_noise_does_not_depend_on_the_pairs_beside_it(tiny) -> None:  # type: ignore[no-untyped-def]
    """Causal-tracing noise is drawn per pair at its own length and placed after its padding: the same pair (the
    same index, the same seed) alone and left-padded beside 1, 2 or 3 longer pairs gets the same noise, so the same
    corrupted metric (drawn at the padded length, it read other rows of its draw: -2.459 alone vs +0.350 batched on
    the shipped model)."""
    model, tokenizer, _ = tiny
    settings = {"sites": ["resid_pre"], "layers": [0], "corruption": {"kind": "noise"}, "directions": ["denoising"]}
    alone = lm_activation_patching(model, tokenizer, PAIRS[:1], **settings)
    for others in (1, 2, 3):
        together = lm_activation_patching(model, tokenizer, [PAIRS[0], *LONGER[:others]], **settings)
        mine = together[together.sample_index == 0]
        assert mine.corrupted.nunique() == 1
        # a padded row's forward differs from the row alone by float rounding only (3e-7 seen; 1.5 with the old draw)
        assert float(mine.corrupted.iloc[0]) == pytest.approx(float(alone.corrupted.iloc[0]), abs=1e-5)
    # the edit itself, bit for bit: the pair's rows of the shift are the same in every batch
    dataset, batch = pairs_batch([PAIRS[0], *LONGER], tokenizer, True, torch.device("cpu"))
    single, one = pairs_batch(PAIRS[:1], tokenizer, True, torch.device("cpu"))
    shifts = []
    for data, b in ((dataset, batch), (single, one)):
        method = _noise_method(model, data)
        edit = method.corrupt(b, b.x[:, 0], b.x[:, 1], b.extras["attention_mask"]).edit
        shifts.append(edit.shift[0, -len(_ids(tokenizer, PAIRS[0]["clean"])) :])
    assert torch.equal(shifts[0], shifts[1]) and shifts[0].abs().sum() > 0


def _noise_method(model, dataset):  # type: ignore[no-untyped-def]
    """The noise corruption of `dataset`, set up on `model` (hooks removed again: only its draws are used)."""
    from runner.methods.lm.corruptions import Corruption
    from runner.options.method.lm_patching import LmCorruptionConfig

    corruption = Corruption(LmCorruptionConfig(kind="noise"))
    corruption.prepare(dataset)
    with HookSession(model, []) as session:
        corruption.setup(session, model, layout_of(model))
    return corruption


def test_mean_and_resample_refuse_bare_token_ids(tiny) -> None:  # type: ignore[no-untyped-def]
    from runner.methods.lm_patching import lm_patching_on_ids

    model, tokenizer, _ = tiny
    ids = torch.tensor([_ids(tokenizer, PAIRS[0]["clean"])])
    for kind in ("mean", "resample"):
        with pytest.raises(RunnerError, match=f"kind={kind} draws on the data set's prompts"):
            lm_patching_on_ids(model, ids, ids, torch.tensor([4]), torch.tensor([5]), sites=["resid_pre"],
                               corruption={"kind": kind})  # fmt: skip


# ---- the pattern site ---------------------------------------------------------------------------------------------
def test_pattern_reads_what_output_attentions_returns(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, _ = tiny
    layout = layout_of(model)
    specs = [layout.site("pattern", layer) for layer in range(layout.layers)]
    ids = torch.tensor([_ids(tokenizer, p["clean"]) for p in PAIRS])
    with HookSession(model, []) as session, torch.no_grad():
        hooks = SiteHooks(model, specs, session)
        with hooks.keep():
            out = model(input_ids=ids, output_attentions=True, use_cache=False)
    for layer in range(layout.layers):
        kept = hooks.kept[f"pattern.{layer}"]  # (B, T_query, H, T_key)
        assert kept.shape == (4, ids.shape[1], n_heads(model), ids.shape[1])
        assert torch.equal(kept.transpose(1, 2), out.attentions[layer])


def _values(model, layer: int) -> tuple[torch.nn.Module, callable]:  # type: ignore[no-untyped-def,valid-type]
    """The module whose output holds layer's values and how to view them (B, T, heads, d), one per query head."""
    heads = n_heads(model)
    if hasattr(model, "transformer"):
        attn = model.transformer.h[layer].attn
        return attn.c_attn, lambda out: out.chunk(3, dim=-1)[2].unflatten(-1, (heads, -1))
    attn = model.model.layers[layer].self_attn
    groups = heads // model.config.num_key_value_heads
    return attn.v_proj, lambda out: out.unflatten(-1, (-1, attn.head_dim)).repeat_interleave(groups, dim=2)


def _out_proj(model, layer: int) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    if hasattr(model, "transformer"):
        return model.transformer.h[layer].attn.c_proj
    return model.model.layers[layer].self_attn.o_proj


@torch.no_grad()
def _pattern_patched(model, ids: torch.Tensor, layer: int, head: int, pattern: torch.Tensor,  # type: ignore[no-untyped-def]
                     query: int | None) -> torch.Tensor:  # fmt: skip
    """Logits (B, T, V) of `ids` with head `head`'s attention pattern at `layer` replaced by `pattern` (B, Tq, Tk) at
    query positions `query` (None: all): the head's output (its slice of the output projection's input) rebuilt
    as pattern @ values, the values read from the same forward."""
    values_module, view = _values(model, layer)
    seen: dict[str, torch.Tensor] = {}
    d = model.config.hidden_size // n_heads(model)
    rows = slice(None) if query is None else slice(query, query + 1)

    def keep_values(module, args, output):  # type: ignore[no-untyped-def]
        seen["v"] = view(output)[:, :, head]  # (B, Tk, d)

    def replace_head(module, args):  # type: ignore[no-untyped-def]
        x = args[0].clone()
        x[:, rows, head * d : (head + 1) * d] = (pattern @ seen["v"])[:, rows]
        return (x, *args[1:])

    handles = [values_module.register_forward_hook(keep_values),
               _out_proj(model, layer).register_forward_pre_hook(replace_head)]  # fmt: skip
    try:
        return model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("each", [False, True])
def test_pattern_patching_equals_a_hand_rebuilt_head(tiny, each: bool) -> None:  # type: ignore[no-untyped-def]
    """Every (layer, head[, query position]) pattern cell, denoising, equals the corrupted run with that head's output
    rebuilt by hand from the clean run's pattern (output_attentions=True) and the corrupted run's values."""
    model, tokenizer, _ = tiny
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["pattern"],
                                   head_positions="each" if each else "all")  # fmt: skip
    clean = torch.tensor([_ids(tokenizer, p["clean"]) for p in PAIRS])
    corrupted = torch.tensor([_ids(tokenizer, p["corrupted"]) for p in PAIRS])
    answer = torch.tensor([_token(tokenizer, p["answer"]) for p in PAIRS])
    distractor = torch.tensor([_token(tokenizer, p["distractor"]) for p in PAIRS])
    with torch.no_grad():
        patterns = model(input_ids=clean, output_attentions=True, use_cache=False).attentions
    heads, t = n_heads(model), clean.shape[1]
    assert len(table) == 2 * heads * (t if each else 1) * len(PAIRS)
    worst = 0.0
    for (layer, head, position), rows in table.groupby(["layer", "head", "position"], dropna=False):
        query = None if position != position else int(position)  # NaN: every query position
        logits = _pattern_patched(model, corrupted, int(layer), int(head), patterns[int(layer)][:, int(head)], query)
        last = logits[:, -1]
        want = last[range(len(PAIRS)), answer] - last[range(len(PAIRS)), distractor]
        got = torch.tensor(rows.sort_values("sample_index").patched.to_numpy(copy=True))
        worst = max(worst, float((got - want).abs().max()))
    assert worst <= 1e-5, worst
    moved = table[(table.patched - table.corrupted).abs() > 1e-4]
    assert len(moved) > 0  # some pattern matters


def test_pattern_refused_without_eager_attention(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, _ = tiny
    model.config._attn_implementation = "sdpa"
    try:
        assert "pattern" not in layout_of(model).available()
        with pytest.raises(RunnerError, match="attn_implementation=sdpa never materialises"):
            lm_activation_patching(model, tokenizer, PAIRS, sites=["pattern"])
    finally:
        model.config._attn_implementation = "eager"
    assert "pattern" in layout_of(model).available()


@pytest.mark.slow
def test_cli_refusals(tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """From the CLI: the pattern site with sdpa attention, and resample with a pair of a length no other has; each
    one message, exit 2, no traceback. `runner layers` lists the pattern sites of an eager model, shaped
    (batch, query positions, heads, key positions)."""
    from runner.commands.layers import main as layers_main

    _, _, folder = tiny
    assert layers_main(["model=hf_lm", f"model.name={folder}", "method=lm_patching", "data=prompts"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if "pattern.1" in line]
    assert len(listed) == 1 and "[1, 4, 4, 4]" in listed[0], listed
    pairs = tmp_path / "pairs.jsonl"
    import json

    lonely = {"clean": "t01 t02 t03", "corrupted": "t05 t02 t03", "answer": "t04", "distractor": "t06"}
    pairs.write_text("\n".join(json.dumps(p) for p in [*PAIRS, lonely]))
    common = ("model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={pairs}", "method=lm_patching",
              "target=token_logit_diff")  # fmt: skip
    done = run_cli(*common, "model.attn_implementation=sdpa", "method.patching.sites=[pattern]",
                   f"hydra.run.dir={tmp_path / 'sdpa'}")  # fmt: skip
    assert done.returncode == 2 and "load the model with model.attn_implementation=eager" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_cli(*common, "method.patching.corruption.kind=resample", f"hydra.run.dir={tmp_path / 'resample'}")
    assert done.returncode == 2 and "no other pair has the length of pair-4 (4 tokens)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_cli_resample_in_batches_of_any_size(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """From the CLI, batches of four and of three (the last one holding one pair) write the same rows: each pair
    named by its own sample_id and resampled from the same partner."""
    from runner.results import load

    _, _, folder = tiny
    pairs = tmp_path / "pairs.jsonl"
    import json

    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS))
    tables = []
    for size in (4, 3):
        done = run_cli("model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={pairs}",
                       f"data.batch_size={size}", "method=lm_patching", "target=token_logit_diff",
                       "method.patching.sites=[resid_pre]", "method.patching.corruption.kind=resample",
                       f"hydra.run.dir={tmp_path / str(size)}")  # fmt: skip
        assert done.returncode == 0, done.stderr
        table = load(tmp_path / str(size)).sort_values(["sample_id", "layer", "position"]).reset_index(drop=True)
        tables.append(table)
    one, other = tables
    assert sorted(set(one.sample_id)) == [f"pair-{i}" for i in range(len(PAIRS))]
    assert one.corrupted_id.equals(other.corrupted_id) and (one.sample_id != one.corrupted_id).all()
    assert (one.patched - other.patched).abs().max() <= 1e-5
