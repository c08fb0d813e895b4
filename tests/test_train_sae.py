"""method=train_sae and data=text: a sparse autoencoder trained on planted sparse directions finds them (TopK and
JumpReLU), training is bit-equal for a seed, every evaluation figure equals a computation written here on the same
tensors (FVU, L0, dead, dense, the three cross-entropies with plain hooks, recovered), a CLI run on the shipped
induction model writes a SAELens folder that loads back and gives the run's FVU, and bad input stops with one
message before the model loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import runner.app as app
import runner.models
from runner.data.text import text_source
from runner.dictionaries.formats import load_dictionary
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.methods.train_sae import collect_activations
from runner.methods.train_sae.activations import SiteReader, check_buffer
from runner.methods.train_sae.evaluation import reconstruction, recovered, spliced_losses
from runner.methods.train_sae.features import marked_context
from runner.methods.train_sae.training import JumpReLU, Step, Training, train_dictionary
from runner.models.lm_sites import layout_of
from runner.options.data.text import TextConfig
from tests.conftest import make_config, run_cli

INDUCTION = Path(runner.models.__file__).parent / "lm_induction"
QUICK = ["experiment=train_sae_induction", "method.steps=60", "data.windows=60", "threads=1"]  # threads: one_thread


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """One torch thread: these small tensors gain nothing from two, and on a shared machine two threads spin-wait on
    each other (a loaded two-core machine ran this file 10x slower with them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def induction() -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(INDUCTION, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(INDUCTION)


def planted(seed: int, n: int = 4096, d: int = 16, m: int = 32, active: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """n points, each the sum of `active` of m random unit directions (weights in [1, 3]) plus one offset."""
    g = torch.Generator().manual_seed(seed)
    directions = F.normalize(torch.randn(m, d, generator=g), dim=-1)  # (m, d)
    chosen = torch.stack([torch.randperm(m, generator=g)[:active] for _ in range(n)])  # (n, active)
    weights = torch.zeros(n, m).scatter(1, chosen, torch.rand(n, active, generator=g) * 2 + 1)  # (n, m)
    return weights @ directions + torch.randn(d, generator=g), directions


def found(decoder: torch.Tensor, directions: torch.Tensor) -> int:
    """How many planted directions some decoder row points along (cosine above 0.9)."""
    return int(((directions @ F.normalize(decoder, dim=-1).t()).max(1).values > 0.9).sum())


# TopK: at least 29 of the 32 directions (90%); JumpReLU, whose thresholds learn more slowly: at least 26 (80%).
@pytest.mark.parametrize(("architecture", "settings", "steps", "least"),
                         [("topk", {"k": 3}, 400, 29), ("jumprelu", {"l0_coefficient": 0.5}, 1500, 26)])  # fmt: skip
def test_a_trained_sae_finds_the_planted_directions(architecture: str, settings: dict, steps: int, least: int) -> None:
    x, directions = planted(seed=0)
    untrained = F.normalize(torch.randn(64, 16, generator=torch.Generator().manual_seed(123)), dim=-1)
    assert found(untrained, directions) == 0  # chance finds none: the count below is the training's
    training = Training(architecture, 64, steps=steps, batch_tokens=256, lr=0.01 if architecture == "jumprelu" else 0.005,
                        **settings)  # fmt: skip
    trained = train_dictionary(x, training)
    assert found(trained.dictionary.W_dec, directions) >= least
    assert trained.curve["fvu"][-1] < 0.3 and 1 <= trained.curve["l0"][-1] <= 6
    assert len(trained.curve["step"]) == steps


def test_training_is_bit_equal_for_a_seed_and_not_for_another() -> None:
    x, _ = planted(seed=1, n=1024)
    for architecture, extra in (("topk", {"k": 3}), ("jumprelu", {})):
        runs = [train_dictionary(x, Training(architecture, 32, steps=30, batch_tokens=128, seed=s, **extra)).dictionary
                for s in (7, 7, 8)]  # fmt: skip
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), (architecture, name)
        assert not torch.equal(runs[0].W_dec, runs[2].W_dec)
        assert torch.allclose(runs[0].W_dec.norm(dim=-1), torch.ones(32))  # decoder rows kept at unit norm


def test_jumprelu_gradients_are_the_papers_pseudo_derivatives() -> None:
    h = torch.tensor([[0.50, 0.98, 1.02, 2.00]], requires_grad=True)  # (1, 4): two of them within eps/2 of theta
    theta = torch.full((4,), 1.0, requires_grad=True)
    eps = 0.1
    (JumpReLU.apply(h, theta, eps) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert torch.equal(h.grad, torch.tensor([[0.0, 0.0, 3.0, 4.0]]))  # H(h - theta) * g: no kernel term for h
    assert torch.allclose(theta.grad, torch.tensor([0.0, -2.0, -3.0, 0.0]) / eps)  # -(theta/eps) K((h-theta)/eps) g
    theta.grad = None
    Step.apply(h, theta, eps).sum().backward()
    assert torch.allclose(theta.grad, torch.tensor([0.0, -1.0, -1.0, 0.0]) / eps)  # -(1/eps) K((h-theta)/eps)


def windows_of(tokenizer: object, **fields: object) -> object:
    return text_source(TextConfig(source="induction", context=33, **fields), tokenizer, seed=0)


def test_text_windows_start_with_bos_and_hold_out_a_seeded_share(induction: tuple, tmp_path: Path) -> None:
    _, tokenizer = induction
    data = windows_of(tokenizer)
    assert data.windows.shape == (250, 33) and bool((data.windows[:, 0] == tokenizer.bos_token_id).all())
    assert data.windows[0, 1:].tolist() == tokenizer("t49 t53 t05 t33 t62 t51 t38 t61")["input_ids"] * 2 + \
        data.windows[0, 17:].tolist()  # fmt: skip
    assert len(data.held_out) == 25 and data.held_out == windows_of(tokenizer).held_out
    assert data.held_out != text_source(TextConfig(source="induction", context=33), tokenizer, seed=1).held_out
    drawn = windows_of(tokenizer, windows=20, limit=10)
    assert len(drawn) == 10 and drawn.starts == sorted(drawn.starts) and len(drawn.held_out) == 1
    batch = data.collate([data[i] for i in range(4)])
    assert batch[0].shape == (4, 33) and batch[3]["held_out"].tolist() == [i in data.held_out for i in range(4)]
    lines = tmp_path / "text.jsonl"
    lines.write_text('{"text": "t01 t02 t03"}\n\n{"text": "t04"}\n')
    plain = tmp_path / "text.txt"
    plain.write_text("t01 t02\nt03\n\n\nt04\n")
    for source in (lines, plain):
        made = text_source(TextConfig(source=str(source), context=3, holdout=0.5), tokenizer, seed=0)
        assert made.windows[:, 1:].tolist() == [[1, 2], [3, 4]], source


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.txt", r"data.source=.*missing.txt: no such file\.$"),
        ("\n \n", "empty.txt", r"has no text: it is empty \(or blank\)\.$"),
        ('{"text": "t01"}\n{"words": "t02"}\n', "lines.jsonl", r"lines.jsonl:2 has no \"text\" string"),
        ("t01", "text.csv", r"give python_docs .* a .txt file"),
    ],
)
def test_bad_text_is_refused_with_the_config(tmp_path: Path, content: str | None, name: str, message: str) -> None:
    file = tmp_path / name
    if content is not None:
        file.write_text(content)
    with pytest.raises(RunnerError, match=message):
        make_config(*QUICK, f"data.source={file}")


def test_text_the_tokenizer_cannot_read_is_refused(induction: tuple) -> None:
    with pytest.raises(RunnerError, match=r"tokens are the tokenizer's unknown token '<unk>'"):
        text_source(TextConfig(source="python_docs"), induction[1], seed=0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.architecture=relu", r"^method.architecture=relu: train_sae trains topk or jumprelu\.$"),
        ("method.width=0", r"^Out of range: method.width=0"),
        ("method.k=null", r"^method.architecture=topk needs method.k"),
        ("method.site=head", r"^method.site=head: an SAE reads one of resid_pre"),
    ],
)
def test_bad_settings_are_refused_with_the_config(override: str, message: str) -> None:
    with pytest.raises(RunnerError, match=message):
        make_config(*QUICK, override)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*QUICK, "method.layer=2"], r"^method.layer=\[2\]: the model has layers 0..1\.$"),
        (
            ["model=hf_lm", "data=prompts", "data.file=induction", "method=train_sae"],
            r"^method=train_sae reads windows of text \(data=text\), and data=prompts gives pairs\.$",
        ),
        (
            ["model=hf_lm", "data=text", "data.source=induction", "method=lm_patching"],
            r"^method=lm_patching reads pairs of text \(data=prompts \| ioi\), and data=text gives windows\.$",
        ),
    ],
)
def test_run_refusals_come_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  overrides: list[str], message: str) -> None:  # fmt: skip
    def no_model(cfg: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(app, "build_model", no_model)
    with pytest.raises(RunnerError, match=message):
        app.run(make_config(*overrides), tmp_path)


def test_a_missing_file_exits_2_with_one_line(tmp_path: Path) -> None:
    done = run_cli(*QUICK, f"data.source={tmp_path / 'nope.txt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"data.source={tmp_path / 'nope.txt'}: no such file." in done.stderr


def test_a_buffer_above_half_the_free_memory_is_refused() -> None:
    check_buffer(10_000, 64, 128, 512, free=10**9)
    with pytest.raises(RunnerError, match=r"holds the activations of 1,000,000 positions x 576 values in memory"):
        check_buffer(1_000_000, 576, 4096, 1024, free=2 * 10**9)


def hand_encode(dictionary: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, x_hat) of a TopK dictionary written out here: x' = s x, h = (x' - b_dec) W_enc + b_enc, the k largest
    kept (ReLU), x_hat = (f W_dec + b_dec) / s."""
    s = dictionary.spec.scale
    h = (x * s - dictionary.b_dec) @ dictionary.W_enc + dictionary.b_enc
    top = h.topk(dictionary.spec.k, dim=-1)
    f = torch.zeros_like(h).scatter(-1, top.indices, top.values.clamp(min=0))
    return f, (f @ dictionary.W_dec + dictionary.b_dec) / s


def test_every_evaluation_figure_equals_a_computation_written_here(induction: tuple) -> None:
    model, tokenizer = induction
    data = windows_of(tokenizer, windows=40)
    held = sorted(data.held_out)
    train = [i for i in range(len(data)) if i not in data.held_out]
    with torch.no_grad():  # the stream after block 0: hidden_states[1] (block 1 is not the last: no final norm)
        stream = model(input_ids=data.windows, output_hidden_states=True).hidden_states[1][:, 1:]  # (N, 32, 64)
    trained = train_dictionary(stream[train].reshape(-1, 64), Training("topk", 32, k=4, steps=40, batch_tokens=256))
    dictionary = trained.dictionary
    with torch.no_grad():
        dictionary.b_enc[:3] = -1e4  # never among a position's top k: dead
        dictionary.b_enc[3] = 1e4  # always among them: dense
    x = stream[held].reshape(-1, 64)
    assert torch.allclose(collect_activations(model, data.windows[held], "resid_post", 0, batch_size=3), x, atol=1e-6)
    f, x_hat = hand_encode(dictionary, x)
    rec = reconstruction(dictionary, x)
    fires = (f > 0).sum(0)
    assert rec.fvu == pytest.approx(float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()), rel=1e-5)
    assert rec.l0 == pytest.approx(float((f > 0).sum(1).float().mean()), rel=1e-6)
    assert torch.equal(rec.fires, fires)
    assert rec.dead == int((fires == 0).sum()) >= 3 and rec.dense == int((fires > 0.1 * len(x)).sum()) >= 1
    massive = x.clone()
    massive[:2] *= 100  # two positions far above 10 x the median norm
    error = (massive - hand_encode(dictionary, massive)[1]).pow(2).sum(-1)  # (N,)
    typical = massive[2:]
    rec = reconstruction(dictionary, massive)
    assert rec.massive == 2 and rec.fvu == pytest.approx(float(error.sum() / (massive - massive.mean(0)).pow(2).sum()),
                                                         rel=1e-5)  # fmt: skip
    assert rec.fvu_without_massive == pytest.approx(float(error[2:].sum() / (typical - typical.mean(0)).pow(2).sum()),
                                                    rel=1e-5)  # fmt: skip

    # The three forwards, against plain hooks on block 0's output (positions 1.. replaced; the BOS kept)
    ids = data.windows[held]
    replacement: list[torch.Tensor | None] = [None]

    def replace(module: object, args: object, output: object) -> object:
        if replacement[0] is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        new = torch.cat([hidden[:, :1], replacement[0]], dim=1)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handle = model.model.layers[0].register_forward_hook(replace)
    try:
        ce = {}
        for name, value in (("clean", None), ("sae", hand_encode(dictionary, stream[held])[1]),
                            ("zero", torch.zeros_like(stream[held]))):  # fmt: skip
            replacement[0] = value
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            losses = F.cross_entropy(logits[:, 1:-1].flatten(0, 1), ids[:, 2:].flatten(), reduction="none")
            ce[name] = losses.view(len(held), -1).mean(1)  # (windows,): the predictions after the BOS
    finally:
        handle.remove()
    with HookSession(model, []) as session:
        layout = layout_of(model)
        reader = SiteReader(model, layout, layout.site("resid_post", 0), session)
        assert torch.allclose(reader.read(ids)[:, 1:], stream[held], atol=1e-6)
        losses = spliced_losses(reader, dictionary, ids, first=1)
    for name in ("clean", "sae", "zero"):
        assert torch.allclose(getattr(losses, name), ce[name], atol=1e-5), name
    means = [float(ce[name].mean()) for name in ("clean", "sae", "zero")]
    share, degenerate = recovered(*means)
    assert share == pytest.approx((means[2] - means[1]) / (means[2] - means[0]), rel=1e-9) and not degenerate
    assert math.isnan(recovered(2.0, 3.0, 2.0 + 1e-8)[0]) and recovered(2.0, 3.0, 2.0 + 1e-8)[1]


def test_a_context_marks_its_token(induction: tuple) -> None:
    tokenizer = induction[1]
    ids = [64, *tokenizer("t01 t02 t03 t04 t05 t06 t07 t08 t09 t10 t11 t12 t13 t14")["input_ids"]]
    assert marked_context(tokenizer, ids, 10, first=1) == "...t02 t03 t04 t05 t06 t07 t08 t09 «t10» t11 t12 t13..."
    assert marked_context(tokenizer, ids, 1, first=1) == "«t01» t02 t03 t04..."


def folder_fvu(model: torch.nn.Module, tokenizer: object, folder: Path) -> float:
    """The FVU of the dictionary in `folder` (loaded as any SAELens folder) on QUICK's held-out windows, their stream
    after block 0 read from a plain forward."""
    loaded = load_dictionary(folder)
    data = windows_of(tokenizer, windows=60)
    with torch.no_grad():
        x = model(input_ids=data.windows[sorted(data.held_out)], output_hidden_states=True).hidden_states[1]
        x = x[:, 1:].reshape(-1, 64)  # every position but the BOS
        return float((x - loaded(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


def test_a_cli_run_writes_a_saelens_folder_that_gives_its_fvu(induction: tuple, tmp_path: Path) -> None:
    model, tokenizer = induction
    result = app.run(make_config(*QUICK), tmp_path)
    tables = {name: pd.read_parquet(path) for name, path in result.tables.items()}
    assert set(tables) == {"train_sae", "train_sae_steps", "train_sae_features", "train_sae_windows"}
    evaluation = tables["train_sae"].iloc[0]
    assert (evaluation["site"], evaluation["layer"], evaluation["hook_name"], evaluation["k"]) == (
        "resid_post", 0, "blocks.0.hook_resid_post", 4)  # fmt: skip
    assert len(tables["train_sae_steps"]) == 60 and len(tables["train_sae_features"]) == 128
    windows = tables["train_sae_windows"]
    assert len(windows) == 60 and (windows["split"] == "held_out").sum() == 6 and windows["ce_sae"].notna().sum() == 6
    features = tables["train_sae_features"]
    assert int(features["dead"].sum()) == evaluation["dead"] and int(features["dense"].sum()) == evaluation["dense"]
    live = features[~features["dead"]].iloc[0]
    assert len(live["top_contexts"]) > 0 and "«" in live["top_contexts"][0] and len(live["promoted"]) == 10

    cfg = json.loads((tmp_path / "dictionary" / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name"] == "blocks.0.hook_resid_post" and cfg["architecture"] == "topk"
    assert (cfg["metadata"]["runner_site"], cfg["metadata"]["runner_layer"]) == ("resid_post", 0)
    assert folder_fvu(model, tokenizer, tmp_path / "dictionary") == pytest.approx(evaluation["fvu"], rel=1e-4)

    before = (tmp_path / "dictionary" / "sae_weights.safetensors").stat().st_mtime_ns
    again = app.run(make_config(*QUICK), tmp_path)  # the run is complete: nothing is trained again
    assert pd.read_parquet(again.tables["train_sae"]).equals(tables["train_sae"])
    assert (tmp_path / "dictionary" / "sae_weights.safetensors").stat().st_mtime_ns == before


def test_the_ioi_source_is_data_iois_sentences_whole() -> None:
    """Each sentence of data.source=ioi is a data=ioi template filled with two names of its list, the subject twice,
    then the indirect object: "When Mary and John went to the store, John gave a drink to Mary."."""
    import re

    from runner.options.data.ioi import NAMES, TEMPLATES
    from runner.options.data.text import documents

    found = documents("ioi")
    assert len(found) == 400 and found == documents("ioi")  # a fixed seed: the same text every time
    patterns = [re.escape(t).replace(r"\{name1\}", r"(\w+)").replace(r"\{name2\}", r"(\w+)").replace(r"\{S\}", r"(\w+)")
                for t in TEMPLATES]  # fmt: skip
    text, matched = found[0], 0
    while text:  # each sentence in turn: a template's words, then the indirect object and a full stop
        hit = next(h for h in (re.match(pattern + r" (\w+)\.( |$)", text) for pattern in patterns) if h)
        first, second, subject, io = hit.groups()[:4]
        assert {first, second} == {subject, io} and subject != io and {subject, io} <= set(NAMES)
        text, matched = text[hit.end() :], matched + 1
    assert matched == 8


def test_a_jumprelu_run_writes_its_thresholds(induction: tuple, tmp_path: Path) -> None:
    model, tokenizer = induction
    result = app.run(make_config(*QUICK, "method.architecture=jumprelu"), tmp_path)
    evaluation = pd.read_parquet(result.tables["train_sae"]).iloc[0]
    assert evaluation["architecture"] == "jumprelu" and pd.isna(evaluation["k"])
    cfg = json.loads((tmp_path / "dictionary" / "cfg.json").read_text())
    loaded = load_dictionary(tmp_path / "dictionary")
    assert cfg["architecture"] == loaded.spec.architecture == "jumprelu" and bool((loaded.threshold > 0).all())
    assert folder_fvu(model, tokenizer, tmp_path / "dictionary") == pytest.approx(evaluation["fvu"], rel=1e-4)
