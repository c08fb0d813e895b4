"""Language-model activation patching (method=lm_patching) against a plain one-forward-per-cell loop written with
plain hooks (tests/lm_references.py), on random-weight GPT-2 and Llama (grouped-query) models; identities; padding;
the noise corruption; the prompt checks; the CLI's refusals; `runner layers` on a language model."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from runner.data.prompts import prompts_source
from runner.errors import RunnerError
from runner.hooks import count_hooks
from runner.methods.lm_patching import lm_activation_patching
from runner.models.lm_sites import layout_of
from runner.options.data.prompts import PromptsConfig
from runner.options.registry import lm_method_names
from tests.conftest import run_cli
from tests.lm_references import build_tiny_lm, logit_diff, loop_patching

# Three pairs of equal length (the loop takes one unpadded batch); answers/distractors are one token each.
PAIRS = [
    {"clean": "t01 t02 t03 t04 t01 t02 t03", "corrupted": "t09 t08 t07 t06 t01 t02 t03", "answer": "t04",
     "distractor": "t06"},
    {"clean": "t11 t12 t13 t14 t11 t12 t13", "corrupted": "t15 t16 t17 t18 t11 t12 t13", "answer": "t14",
     "distractor": "t18"},
    {"clean": "t05 t06 t07 t08 t05 t06 t07", "corrupted": "t10 t19 t00 t03 t05 t06 t07", "answer": "t08",
     "distractor": "t03"},
]  # fmt: skip


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, folder = build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))
    return model, tokenizer, folder


def _ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_every_cell_equals_the_plain_loop(tiny, direction: str) -> None:  # type: ignore[no-untyped-def]
    """Every (site, layer, position or head, pair) of the batched engine equals one forward per cell, 1e-5."""
    model, tokenizer, _ = tiny
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre", "attn_out", "mlp_out", "head"],
                                   directions=[direction])  # fmt: skip
    assert count_hooks(model) == 0
    clean = torch.tensor([_ids(tokenizer, p["clean"]) for p in PAIRS])
    corrupted = torch.tensor([_ids(tokenizer, p["corrupted"]) for p in PAIRS])
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(p["answer"]) for p in PAIRS])
    distractor = torch.tensor([tokenizer.convert_tokens_to_ids(p["distractor"]) for p in PAIRS])
    worst = 0.0
    for site in ("resid_pre", "attn_out", "mlp_out", "head"):
        expected = loop_patching(
            model,
            clean,
            corrupted,
            site,
            logit_diff(answer, distractor),
            direction="denoise" if direction == "denoising" else "noise",
            reduce="none",
        )
        rows = table[table.site == site]  # fmt: skip
        cell = "head" if site == "head" else "position"
        assert len(rows) == expected.numel()
        got = torch.tensor(rows.patched.to_numpy().copy())
        want = expected[rows.layer.to_numpy(), rows[cell].astype(int).to_numpy(), rows.sample_index.to_numpy()]
        worst = max(worst, float((got - want).abs().max()))
    print(f"worst |engine - loop| = {worst:.2e}")
    assert worst <= 1e-5, worst


def test_a_padded_batch_equals_each_pair_alone(tiny) -> None:  # type: ignore[no-untyped-def]
    """Pairs of different lengths, left-padded in one batch with position_ids from the mask: each row equals the
    pair run alone (GPT-2 would differ by up to ~0.6 with positions from arange)."""
    model, tokenizer, _ = tiny
    pairs = [PAIRS[0], {"clean": "t11 t12 t13 t11 t12", "corrupted": "t15 t16 t17 t11 t12", "answer": "t13",
                        "distractor": "t17"}]  # fmt: skip
    together = lm_activation_patching(model, tokenizer, pairs, sites=["resid_pre", "head"])
    for i, pair in enumerate(pairs):
        alone = lm_activation_patching(model, tokenizer, [pair], sites=["resid_pre", "head"])
        mine = together[together.sample_index == i].reset_index(drop=True)
        assert mine[["site", "layer", "head", "position"]].equals(alone[["site", "layer", "head", "position"]])
        assert (mine.patched - alone.patched).abs().max() <= 1e-5
        assert (mine.clean - alone.clean).abs().max() <= 1e-5


def test_identities(tiny) -> None:  # type: ignore[no-untyped-def]
    """The last block's output at the last position decides the next token: patched in, it restores exactly (1),
    and the corrupted one breaks exactly (noising: the corrupted metric). BOS (position 0) is the same token on
    both sides: patching it changes nothing."""
    model, tokenizer, _ = tiny
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_post", "resid_pre"],
                                   directions=["denoising", "noising"])  # fmt: skip
    last_layer = int(table.layer.max())
    final = table[(table.site == "resid_post") & (table.layer == last_layer) & (table.position == 7)]
    assert len(final) == 6
    denoise = final[final.direction == "denoising"]
    assert (denoise.restoration - 1).abs().max() < 1e-4
    assert (denoise.patched - denoise.clean).abs().max() < 1e-5
    noise = final[final.direction == "noising"]
    assert (noise.patched - noise.corrupted).abs().max() < 1e-5
    bos = table[(table.site == "resid_pre") & (table.position == 0)]
    assert (bos.patched - bos.corrupted).abs().where(bos.direction == "denoising", 0).max() < 1e-5
    assert set(bos.token) == {tokenizer.bos_token}


def test_clean_into_clean_is_flagged_not_a_number(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, _ = tiny
    same = [{**PAIRS[0], "corrupted": PAIRS[0]["clean"]}]
    table = lm_activation_patching(model, tokenizer, same, sites=["resid_pre"])
    assert table.degenerate.all() and set(table.degenerate_reason) == {"self_pair"}
    assert table.restoration.isna().all()
    assert (table.patched - table.clean).abs().max() < 1e-5  # the clean metric, everywhere


def test_noise_corruption_noises_only_its_span(tiny) -> None:  # type: ignore[no-untyped-def]
    """Causal tracing: the clean prompt with noise on positions [1, 3); layer 0's residual patched back at a
    position outside the span changes nothing, and the same seed gives the same numbers."""
    model, tokenizer, _ = tiny
    settings = {"sites": ["resid_pre"], "layers": [0], "corruption": {"kind": "noise", "std": 3.0, "span": [1, 3]}}
    first = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    again = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    assert first.patched.equals(again.patched)
    assert ((first.clean - first.corrupted).abs() > 1e-4).all()  # the noise moves the metric
    outside = first[~first.position.isin([1, 2])]
    assert (outside.patched - outside.corrupted).abs().max() < 1e-5
    inside = first[first.position.isin([1, 2])]
    assert (inside.patched - inside.corrupted).abs().max() > 1e-4


def test_prompt_checks(tiny) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer, _ = tiny
    with pytest.raises(RunnerError, match="clean prompt is 4 tokens and the corrupted one 3"):
        prompts_source(PromptsConfig(pairs=[{"clean": "t01 t02 t03", "corrupted": "t01 t02", "answer": "t04",
                                             "distractor": "t05"}]), tokenizer, 0)  # fmt: skip
    with pytest.raises(RunnerError, match="answer 't04 t05' is 2 tokens"):
        prompts_source(PromptsConfig(pairs=[{"clean": "t01", "corrupted": "t02", "answer": "t04 t05",
                                             "distractor": "t05"}]), tokenizer, 0)  # fmt: skip
    config = PromptsConfig(template="{A} t01 {B}", answer="{A}", distractor="{B}", slots={"A": ["t02", "t03"],
                           "B": ["t04", "t05"]}, corrupted_slots={"A": ["t06", "t07"]})  # fmt: skip
    pairs = prompts_source(config, tokenizer, 0)
    assert len(pairs) == 2 and pairs.pairs[1].tokens == ["<bos>", "t03", "t01", "t05"]
    assert tokenizer.convert_ids_to_tokens(pairs.pairs[1].corrupted) == ["<bos>", "t07", "t01", "t05"]


@pytest.mark.slow
def test_cli_runs_a_folder_model_and_refuses_mixed_modalities(tiny, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    _, _, folder = tiny
    pairs = tmp_path / "pairs.jsonl"
    import json

    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS))
    done = run_cli("model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={pairs}",
                   "method=lm_patching", "target=token_logit_diff", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    from runner.results import load

    table = load(tmp_path / "run")
    assert set(table.site) == {"resid_pre", "attn_out", "mlp_out", "head"} and len(set(table.sample_id)) == 3
    refused = run_cli("model=hf_lm", f"model.name={folder}", f"hydra.run.dir={tmp_path / 'bad'}")
    message = f"is a language model: it takes a method for language models (method={' | '.join(lm_method_names())})"
    assert refused.returncode == 2 and message in refused.stderr
    assert "Traceback" not in refused.stderr
    from runner.commands.layers import main as layers_main

    assert layers_main(["model=hf_lm", f"model.name={folder}", "method=lm_patching", "data=prompts"]) == 0
    listed = capsys.readouterr().out
    assert "head.1" in listed and "resid_pre.0" in listed


def test_restoration_is_nan_where_undefined_only(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer, _ = tiny
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre"])
    defined = table[~table.degenerate & ~table.small_span]
    assert all(math.isfinite(v) for v in defined.restoration)


@pytest.mark.slow
def test_a_device_mapped_model_gives_the_same_rows(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """model.device_map with an explicit per-block map (accelerate's dispatch, its hooks on every block, one block
    offloaded to disk) gives the rows the plain model gives; random weights with a device map are refused, since the map places weights as they
    load. On a machine with several devices the same map spreads the blocks and each tensor follows its module."""
    model, _, folder = tiny
    import json

    from runner.results import load

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS))
    base = ["model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={pairs}", "method=lm_patching",
            "target=token_logit_diff"]  # fmt: skip
    blocks = [name for name, _ in model.named_children()]  # transformer / model, lm_head
    inner = getattr(model, blocks[0])
    modules = [f"{blocks[0]}.{name}" for name, _ in inner.named_children() if name not in ("h", "layers")]
    layers = [
        f"{blocks[0]}.{'h' if hasattr(inner, 'h') else 'layers'}.{i}" for i in range(model.config.num_hidden_layers)
    ]
    # The last block offloaded to disk: accelerate dispatches the model (an all-CPU map would load it plainly), its
    # hooks bring that block's weights in for each forward, beside the runner's on the same modules.
    places = {name: "cpu" for name in [*modules, *layers, *blocks[1:]]} | {layers[-1]: "disk"}
    mapping = ",".join(f"{name}:{place}" for name, place in places.items())
    plain = run_cli(*base, f"hydra.run.dir={tmp_path / 'plain'}")
    mapped = run_cli(*base, f"model.device_map={{{mapping}}}", f"+model.kwargs.offload_folder={tmp_path / 'offload'}",
                     f"hydra.run.dir={tmp_path / 'mapped'}")  # fmt: skip
    assert plain.returncode == 0 and mapped.returncode == 0, mapped.stderr
    a, b = load(tmp_path / "plain"), load(tmp_path / "mapped")
    assert len(a) == len(b) > 0
    # 1e-5, not bit-equal: the plain model's variants read only the answer and distractor logits (readout.py), a
    # device-mapped one's the whole vocabulary's, so float rounding differs.
    assert abs(a.patched.to_numpy() - b.patched.to_numpy()).max() <= 1e-5
    refused = run_cli(*base, "model.weights=null", f"model.device_map={{{mapping}}}",
                      f"hydra.run.dir={tmp_path / 'random'}")  # fmt: skip
    assert refused.returncode == 2 and "model.device_map places saved weights" in refused.stderr


@pytest.mark.parametrize("corruption", [{"kind": "pair"}, {"kind": "noise", "std": 3.0, "span": [1, 4]}])
def test_the_reused_prefix_gives_the_rows_of_whole_prompts_on_fewer_positions(tiny, corruption) -> None:  # type: ignore[no-untyped-def]
    """reuse_prefix: each chunk runs only the positions its cells can change, on the receiving run's cached keys
    and values, and only the blocks from its lowest patched layer (the ones below replayed from the receiving run):
    the rows equal those of whole-prompt runs (1e-5), with fewer token positions through the last block."""
    model, tokenizer, _ = tiny
    blocks = dict(model.named_modules())[layout_of(model).arch.blocks]
    first, last = blocks[0], blocks[-1]
    seen: list[int] = []
    below: list[int] = []
    handle = last.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0] * args[0].shape[1]))
    handle_first = first.register_forward_hook(lambda module, args, output: below.append(1))
    try:
        tables = {}
        for reuse in (False, True):
            seen.clear()
            tables[reuse] = lm_activation_patching(
                model, tokenizer, PAIRS, sites=["resid_pre", "attn_out", "k", "head"], head_positions="each",
                directions=["denoising", "noising"], corruption=corruption, reuse_prefix=reuse, chunk=4,
            )  # fmt: skip
            tables[reuse].attrs["positions"] = sum(seen)
            tables[reuse].attrs["first_block_calls"] = len(below)
            below.clear()
    finally:
        handle.remove()
        handle_first.remove()
    whole, reused = tables[False], tables[True]
    assert len(whole) == len(reused) > 0
    assert (whole.patched - reused.patched).abs().max() <= 1e-5
    assert reused.attrs["positions"] < 0.75 * whole.attrs["positions"], (reused.attrs, whole.attrs)
    assert reused.attrs["first_block_calls"] < whole.attrs["first_block_calls"], (reused.attrs, whole.attrs)


@contextmanager
def full_vocabulary_readout() -> Iterator[None]:
    """Inside, every Readout takes the full path (the whole vocabulary's logits through the model), whatever the
    target: the reference the answer-only readout is compared with."""
    from runner.methods.lm.readout import Readout

    original = Readout.__init__

    def full(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        self.compact = False

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Readout, "__init__", full)
        yield


@pytest.mark.parametrize("target", ["token_logit_diff", "token_prob_diff"])
def test_the_answer_readout_equals_the_full_vocabulary(tiny, target: str) -> None:  # type: ignore[no-untyped-def]
    """token_logit_diff reads only the answer and distractor logits, so variants compute just those columns of the
    unembedding (readout.py); with token sets of two tokens, the rows equal a run that computes the whole
    vocabulary's logits (1e-5). token_prob_diff needs the whole vocabulary and never takes the shortcut."""
    from runner.methods.lm.readout import Readout
    from runner.models.lm_sites import layout_of
    from runner.targets.tokens import TokenLogitDiff, TokenProbDiff

    model, tokenizer, _ = tiny
    pairs = [{**p, "answer": [p["answer"], "t00"], "distractor": [p["distractor"], "t19"]} for p in PAIRS]
    settings = {"sites": ["resid_pre", "head"], "directions": ["denoising", "noising"]}
    compact = lm_activation_patching(model, tokenizer, pairs, target=target, **settings)
    with full_vocabulary_readout():
        whole = lm_activation_patching(model, tokenizer, pairs, target=target, **settings)
    assert len(compact) == len(whole) > 0
    assert (compact.patched - whole.patched).abs().max() <= 1e-5
    expected = target == "token_logit_diff"
    chosen = TokenLogitDiff() if expected else TokenProbDiff()
    assert Readout(model, layout_of(model), chosen).compact is expected


def test_a_model_without_a_readable_cache_runs_whole_prompts(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Where the model returns no key/value cache the runner can read, every variant runs the whole prompt (asked
    for once, not per chunk), with the same rows."""
    import runner.methods.lm_patching.prefix as prefix

    model, tokenizer, _ = tiny
    settings = {"sites": ["resid_pre", "attn_out"], "chunk": 2}
    expected = lm_activation_patching(model, tokenizer, PAIRS, reuse_prefix=False, **settings)
    asked = []
    monkeypatch.setattr(prefix, "cached_keys_values", lambda past: asked.append(1))
    got = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    assert len(asked) == 1
    assert (got.patched - expected.patched).abs().max() <= 1e-5


@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_cells_before_the_first_difference_are_not_run_and_still_equal_the_loop(
    tiny, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Pairs whose prompts share their first four tokens (BOS and three words): no forward patches a cell before
    position 4 (the runs are equal there, so the patched metric is the receiving run's), and every row, those
    included, equals one forward per cell."""
    from runner.methods.lm_patching.exact import ExactPatcher

    model, tokenizer, _ = tiny
    pairs = [{**p, "corrupted": " ".join(p["clean"].split()[:3] + p["corrupted"].split()[3:])} for p in PAIRS]
    run_cells: list = []
    original = ExactPatcher.patched_metrics

    def spy(self, model, ids, mask, noise, sources, cells, *args):  # type: ignore[no-untyped-def]
        run_cells.extend(cells)
        return original(self, model, ids, mask, noise, sources, cells, *args)

    monkeypatch.setattr(ExactPatcher, "patched_metrics", spy)
    sites = ["resid_pre", "attn_out", "head"]
    table = lm_activation_patching(model, tokenizer, pairs, sites=sites, directions=[direction])
    whole = [c for c in run_cells if c.position is not None]
    assert whole and min(c.position for c in whole) == 4
    assert len(table) == len(pairs) * (len(run_cells) + 2 * 4 * 2)  # 2 whole sites x positions 0-3 x 2 layers
    ids = {k: torch.tensor([_ids(tokenizer, p[k]) for p in pairs]) for k in ("clean", "corrupted")}
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(p["answer"]) for p in pairs])
    distractor = torch.tensor([tokenizer.convert_tokens_to_ids(p["distractor"]) for p in pairs])
    for site in sites:
        expected = loop_patching(model, ids["clean"], ids["corrupted"], site, logit_diff(answer, distractor),
                                 direction="denoise" if direction == "denoising" else "noise", reduce="none")  # fmt: skip
        rows = table[table.site == site]
        cell = "head" if site == "head" else "position"
        want = expected[rows.layer.to_numpy(), rows[cell].astype(int).to_numpy(), rows.sample_index.to_numpy()]
        torch.testing.assert_close(torch.tensor(rows.patched.to_numpy().copy()), want.float(), atol=1e-5, rtol=0)
    early = table[table.position.notna() & (table.position < 4)]
    receiving = "corrupted" if direction == "denoising" else "clean"
    assert (early.patched == early[receiving]).all() and len(early) == len(pairs) * 2 * 4 * 2
