"""Bad inputs to a language-model run, each refused with one line (a RunnerError: the CLI prints it and exits 2),
before the model loads where the input alone shows it, and with no results written: prompt pairs (repeated ids,
words outside the vocabulary, prompts longer than the model's positions, JSONL lines that are no object, files that
are not UTF-8, a noise span past a prompt), model folders (damaged or missing weights, a tokenizer larger than the
embedding, a pickle, remote code, device maps, config values) and `_target_`s a config may not name; and the inputs
that must work: `corrupted` left out where the corruption does not read it, `data.slots` as a dict on the command
line, the docs' IOI template as written."""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import yaml

import runner.app as app
from runner.data.prompts import prompts_source
from runner.errors import RunnerError
from runner.options.data.prompts import PromptsConfig
from tests.conftest import make_config, run_cli
from tests.lm_references import build_tiny_lm

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [
    {"clean": "t01 t02 t03 t04 t01 t02 t03", "corrupted": "t09 t08 t07 t06 t01 t02 t03", "answer": "t04",
     "distractor": "t06"},
    {"clean": "t11 t12 t13 t14 t11 t12 t13", "corrupted": "t15 t16 t17 t18 t11 t12 t13", "answer": "t14",
     "distractor": "t18"},
]  # fmt: skip
# An image run on a tiny module (tests.conftest.TinyNet), for the `_target_` refusals.
TINY_IMAGE = ["model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
              "data.count=2", "data.num_classes=5", "layers.include=[features.2]", "hooks=[]"]  # fmt: skip
LM_RUN = ["data=prompts", "method=lm_patching", "target=token_logit_diff", "method.patching.sites=[resid_pre]"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random two-layer GPT-2 and Llama folders (32 positions) with a word-level tokenizer over t00..t19."""
    return {arch: build_tiny_lm(arch, 0, tmp_path_factory.mktemp(arch))[2] for arch in ("gpt2", "llama")}


def pairs_file(folder: Path, pairs: list[Any], name: str = "pairs.jsonl") -> Path:
    file = folder / name
    file.write_text("\n".join(json.dumps(p) for p in pairs))
    return file


def refusal(out: Path, *overrides: str, at_start: bool = False) -> str:
    """The one-line RunnerError a run of `overrides` stops with; nothing written. `at_start`: when the config is
    checked, before any model loads."""
    with pytest.raises(RunnerError) as caught:
        config = make_config(*overrides)
        assert not at_start, "the config passed its start-up checks"
        app.run(config, out)
    message = str(caught.value)
    assert "\n" not in message, message
    assert not list(out.rglob("*.parquet*"))
    return message


def lm(folder: Path, pairs: Path, *overrides: str) -> list[str]:
    return ["model=hf_lm", f"model.name={folder}", *LM_RUN, f"data.file={pairs}", *overrides]


# ---- prompt pairs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ({"answer": "zzz"}, "the answer 'zzz' has 'zzz' outside the tokenizer's vocabulary"),
        ({"distractor": "t03 qq"}, "the distractor 't03 qq' has 'qq' outside"),
        ({"clean": "t01 zzz t03 t04 t01 t02 t03"}, "the clean prompt 't01 zzz t03 t04 t01 t02 t03' has 'zzz' outside"),
        ({"corrupted": "t09 t08 t07 t06 t01 t02 yy"}, "the corrupted prompt 't09 t08 t07 t06 t01 t02 yy' has 'yy'"),
    ],
)
def test_a_word_outside_the_vocabulary_is_refused_by_name(folders: dict[str, Path], pair: dict, message: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["gpt2"])
    with pytest.raises(RunnerError, match=re.escape(message)):
        prompts_source(PromptsConfig(pairs=[{**PAIRS[0], **pair}]), tokenizer, 0)


def test_the_unknown_tokens_own_text_is_not_unknown(folders: dict[str, Path]) -> None:
    """A prompt that writes the unknown token out (GPT-2's is its end-of-text token) means it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["gpt2"])
    pairs = prompts_source(PromptsConfig(pairs=[{**PAIRS[0], "clean": "<unk> t02 t03 t04 t01 t02 t03"}]), tokenizer, 0)
    assert pairs.pairs[0].tokens[1] == "<unk>"


def test_two_pairs_of_one_id_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    pairs = pairs_file(tmp_path, [{**p, "id": "same"} for p in PAIRS])
    message = refusal(tmp_path / "run", *lm(folders["gpt2"], pairs), at_start=True)
    assert message.startswith("Prompt pairs 0 and 1 (counted from 0) share the id 'same'")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # GPT-2: an index error mid-run; Llama: a silent table
def test_a_prompt_longer_than_the_models_positions_is_refused(
    folders: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    long = " ".join(["t01"] * 40)
    pairs = pairs_file(tmp_path, [{**PAIRS[0], "clean": long, "corrupted": long.replace("t01", "t02", 1)}])
    message = refusal(tmp_path / "run", *lm(folders[arch], pairs))
    assert message == (
        "Prompt pair pair-0 is 41 tokens (BOS included) but the model has 32 positions: shorten the prompts to at"
        " most 32 tokens."
    )


def test_the_library_functions_refuse_a_prompt_longer_than_the_models_positions(folders: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runner.methods.lm_patching import lm_activation_patching
    from runner.methods.lm_saliency import lm_grad_x_act, lm_logit_lens

    model = AutoModelForCausalLM.from_pretrained(folders["llama"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(folders["llama"])
    long = " ".join(["t01"] * 40)
    pairs = [{**PAIRS[0], "clean": long, "corrupted": long.replace("t01", "t02", 1)}]
    for function in (lm_activation_patching, lm_grad_x_act, lm_logit_lens):
        with pytest.raises(RunnerError, match="is 41 tokens .* but the model has 32 positions"):
            function(model, tokenizer, pairs)


@pytest.mark.parametrize(
    ("line", "kind"), [("[1, 2]", "an array"), ("null", "a null"), ('"hello"', "a string"), ("7", "a number")]
)
def test_a_jsonl_line_that_is_no_object_is_refused(
    folders: dict[str, Path], tmp_path: Path, line: str, kind: str
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    message = refusal(tmp_path / "run", *lm(folders["gpt2"], pairs), at_start=True)
    assert message.startswith(f"{pairs}:2 is a JSON {kind.split()[1]}, not an object: one pair per line")


def test_a_pairs_file_that_is_not_utf8_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    lines = [json.dumps(PAIRS[0]), json.dumps({**PAIRS[1], "id": "café"}, ensure_ascii=False)]
    pairs.write_bytes("\n".join(lines).encode("latin-1"))
    message = refusal(tmp_path / "run", *lm(folders["gpt2"], pairs), at_start=True)
    assert message == f"{pairs}:2 is not UTF-8 (byte 0xe9): save the file as UTF-8."


def test_data_limit_reads_only_the_first_pairs_of_a_large_file(tmp_path: Path) -> None:
    """data.limit=N stops reading a JSONL or CSV file after its first N pairs: a broken line after them (which a
    whole read refuses) is never reached, so a million-line file with data.limit=4 costs four lines."""
    from runner.options.data.prompts import read_pairs_file

    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join([*(json.dumps({**PAIRS[0], "id": f"p{i}"}) for i in range(4)), "[not a pair"]) + "\n")
    assert [p["id"] for p in read_pairs_file(jsonl, 4)] == ["p0", "p1", "p2", "p3"]
    with pytest.raises(RunnerError, match=r"pairs.jsonl:5 is not a JSON object"):
        read_pairs_file(jsonl)
    table = tmp_path / "pairs.csv"
    table.write_text("clean,answer,distractor\n" + "".join(f"t0{i} t02,t02,t05\n" for i in range(1, 6)))
    assert [p["clean"] for p in read_pairs_file(table, 2)] == ["t01 t02", "t02 t02"]
    assert len(read_pairs_file(table)) == 5


def test_a_pair_that_is_no_mapping_is_refused(folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["gpt2"])
    with pytest.raises(RunnerError, match=r"Prompt pair 1 \(counted from 0\) is 'oops', not a mapping"):
        prompts_source(PromptsConfig(pairs=[PAIRS[0], "oops"]), tokenizer, 0)


def test_a_noise_span_past_a_prompt_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    pairs = pairs_file(tmp_path, PAIRS)
    message = refusal(tmp_path / "run", *lm(folders["gpt2"], pairs, "method.patching.corruption.kind=noise",
                                            "method.patching.corruption.span=[6,9]"))  # fmt: skip
    assert message.startswith("method.patching.corruption.span=[6, 9] reaches past pair pair-0, which has 8 tokens")


def test_corrupted_is_optional_where_the_corruption_does_not_read_it(folders: dict[str, Path], tmp_path: Path) -> None:
    """noise, zero, mean and resample edit or replace the clean prompt: a pair without `corrupted` runs; kind=pair
    runs the pair's own corrupted prompt and refuses a pair that has none."""
    bare = [{k: v for k, v in p.items() if k != "corrupted"} for p in PAIRS]
    pairs = pairs_file(tmp_path, bare)
    result = app.run(make_config(*lm(folders["gpt2"], pairs, "method.patching.corruption.kind=zero")), tmp_path / "z")
    table = pd.read_parquet(result.tables["lm_patching"])
    assert set(table.sample_id) == {"pair-0", "pair-1"}
    assert set(table.corrupted_id) == {"pair-0 (zero)", "pair-1 (zero)"}
    message = refusal(tmp_path / "pair", *lm(folders["gpt2"], pairs))
    assert message.startswith("method.patching.corruption.kind=pair runs each pair's own corrupted prompt, and pair(s)"
                              " pair-0, pair-1 have none")  # fmt: skip


def test_slots_given_as_a_dict_on_the_command_line(folders: dict[str, Path]) -> None:
    """The documented form `data.slots={IO: [...], S: [...]}` (no `+`), as `+data.slots.IO=[...]` works."""
    from transformers import AutoTokenizer

    common = ["model=hf_lm", *LM_RUN, "data.template='{A} t01 {B}'", "data.answer='{A}'", "data.distractor='{B}'"]
    config = make_config(*common, "data.slots={A: [t02, t03], B: [t04, t05]}", "data.corrupted_slots={A: [t06, t07]}")
    assert config.data.slots == {"A": ["t02", "t03"], "B": ["t04", "t05"]}
    pairs = prompts_source(config.data, AutoTokenizer.from_pretrained(folders["gpt2"]), 0)
    assert [p.tokens for p in pairs.pairs] == [["<bos>", "t02", "t01", "t04"], ["<bos>", "t03", "t01", "t05"]]
    assert make_config(*common, "+data.slots.A=[t02]", "+data.slots.B=[t04]").data.slots == {"A": ["t02"], "B": ["t04"]}
    with pytest.raises(Exception, match="slotz"):  # a misspelt key of the schema is still refused
        make_config(*common, "data.slotz={A: [t02]}")


# ---- the docs' IOI template -------------------------------------------------------------------------------------


def docs_ioi_data() -> dict[str, Any]:
    """The `data:` YAML block of docs/language_models.md that holds the IOI template, as written there."""
    text = (ROOT / "docs" / "language_models.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)]
    found = [b["data"] for b in blocks if isinstance(b, dict) and "template" in (b.get("data") or {})]
    assert len(found) == 1, "docs/language_models.md: one data.template example"
    return found[0]


def bpe_tokenizer(texts: list[str]) -> Any:
    """A GPT-2-style byte-level BPE tokenizer trained here on `texts` (each name one token with its leading space,
    as in GPT-2's vocabulary), offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    raw.train_from_iterator(texts * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")  # fmt: skip


def test_the_docs_ioi_template_runs_as_written_with_the_abc_corruption() -> None:
    """Copied from the docs, the template tokenises on a GPT-2-style tokenizer (no double space before a name), and
    its corrupted prompt is IOI's ABC corruption: the second mention of the subject (S2) becomes a third name, the
    first mention and the indirect object stay."""
    data = docs_ioi_data()
    config = PromptsConfig(**data)
    filled = [config.template.format(**{k: v[i] for k, v in config.slots.items()}) for i in range(2)]
    names = [f" {v}" for values in [*config.slots.values(), *config.corrupted_slots.values()] for v in values]
    tokenizer = bpe_tokenizer([*filled, *names, " ".join(names)])
    pairs = prompts_source(config, tokenizer, 0)
    for index, pair in enumerate(pairs.pairs):
        io, s, s2 = (config.slots[k][index] for k in ("IO", "S", "S2"))
        c = config.corrupted_slots["S2"][index]
        assert s2 == s and c not in (io, s)
        clean = tokenizer.decode(pair.clean[1:])
        corrupted = tokenizer.decode(pair.corrupted[1:])
        assert clean == f"When {io} and {s} went to the store, {s} gave a drink to"
        assert corrupted == f"When {io} and {s} went to the store, {c} gave a drink to"
        assert pair.answer_tokens == tokenizer.convert_ids_to_tokens(tokenizer(f" {io}")["input_ids"])
        assert pair.distractor_tokens == tokenizer.convert_ids_to_tokens(tokenizer(f" {s}")["input_ids"])
        changed = [p for p, (a, b) in enumerate(zip(pair.clean, pair.corrupted, strict=True)) if a != b]
        assert len(changed) == 1  # one token: S2's


def test_the_ioi_experiment_is_the_docs_template() -> None:
    """conf/experiment/patching_lm_ioi.yaml and the docs' example fill the same template with the same corruption."""
    experiment = make_config("experiment=patching_lm_ioi").data
    data = docs_ioi_data()
    assert (experiment.template, experiment.answer, experiment.distractor) == (
        data["template"], data["answer"], data["distractor"],
    )  # fmt: skip
    assert set(experiment.corrupted_slots) == set(data["corrupted_slots"]) == {"S2"}
    assert experiment.slots["S2"] == experiment.slots["S"]


# ---- model folders -----------------------------------------------------------------------------------------------


def copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_a_truncated_safetensors_file_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_folder(folders["gpt2"], tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = refusal(tmp_path / "run", *lm(folder, pairs_file(tmp_path, PAIRS)))
    assert message.startswith(f"The weights in {folder} cannot be read (")
    assert message.endswith("the .safetensors file is damaged or incomplete (an interrupted copy or download); copy"
                            " or save it again.")  # fmt: skip


def test_an_empty_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    message = refusal(tmp_path / "run", *lm(tmp_path / "empty", pairs_file(tmp_path, PAIRS)))
    assert message.startswith(f"model.name={tmp_path / 'empty'} is a folder without config.json (empty)")


def test_a_tokenizer_larger_than_the_embedding_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    from tests.lm_references import build_tokenizer

    folder = copy_folder(folders["gpt2"], tmp_path / "model")
    build_tokenizer(40).save_pretrained(folder)
    message = refusal(tmp_path / "run", *lm(folder, pairs_file(tmp_path, PAIRS)))
    assert message.startswith(f"The tokenizer of {folder} has 44 tokens but the model's embedding has 24 rows")


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("this ran",))


def test_a_pickle_that_holds_more_than_tensors_is_refused_without_torchs_advice(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = copy_folder(folders["gpt2"], tmp_path / "model")
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, "extra": _Evil()}, folder / "pytorch_model.bin")
    message = refusal(tmp_path / "run", *lm(folder, pairs_file(tmp_path, PAIRS)))
    assert message.startswith(f"The weights in {folder} are refused: a pickle (pytorch_model.bin) that holds more than"
                              " tensors (it names print)")  # fmt: skip
    assert "weights_only=False" not in message and "this ran" not in capsys.readouterr().out


def test_a_folder_that_needs_its_own_code_is_refused_without_asking(folders: dict[str, Path], tmp_path: Path) -> None:
    """transformers is always told trust_remote_code=False: no "[y/N]" prompt, no code of the folder run."""
    folder = copy_folder(folders["gpt2"], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil_lm", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    message = refusal(tmp_path / "run", *lm(folder, pairs_file(tmp_path, PAIRS)))
    assert message.startswith(f"{folder} needs its own Python code to load (its config's auto_map")
    assert not (tmp_path / "ran").exists()


def test_trust_remote_code_is_refused_like_weights_only_false(folders: dict[str, Path], tmp_path: Path) -> None:
    pairs = pairs_file(tmp_path, PAIRS)
    message = refusal(tmp_path / "run", *lm(folders["gpt2"], pairs, "+model.kwargs.trust_remote_code=true"))
    assert message.startswith("model.kwargs.trust_remote_code is refused: it runs Python code shipped with the model")


def test_trust_remote_code_is_refused_for_an_image_classifier_too() -> None:
    from runner.models import build_model

    config = make_config("model=hf", "model.name=any/folder", "+model.kwargs.trust_remote_code=true")
    with pytest.raises(RunnerError, match=r"^model\.kwargs\.trust_remote_code is refused"):
        build_model(config.model)


def gpt2_run(folders: dict[str, Path], tmp_path: Path) -> list[str]:
    """A patching run of the random GPT-2 on PAIRS (written into tmp_path)."""
    pairs = pairs_file(tmp_path, PAIRS)
    return ["model=hf_lm", f"model.name={folders['gpt2']}", "data=prompts", "target=token_logit_diff",
            f"data.file={pairs}"]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.device_map=nonsense"], "model.device_map=nonsense: not a device map. Give auto, balanced"),
        (["model.device_map={no.such.module: 0}"], "model.device_map names 'no.such.module', which is no module"),
        (["model.device_map={transformer.h.0: nowhere}"], "model.device_map.transformer.h.0=nowhere: not a device"),
        (["model.weights=null", "+model.config.n_layer=abc"], "model.config.n_layer='abc' is refused by GPT2Config:"),
        (["model.weights=null", "+model.config.n_layayer=3"], "model.config.n_layayer: GPT2Config has no such key."),
        (["model.weights=null", "+model.config.n_head=5"], "Cannot build the model from its config with model.config"),
    ],
)
def test_bad_device_maps_and_config_values_are_refused(
    folders: dict[str, Path], tmp_path: Path, overrides: list[str], message: str
) -> None:
    pytest.importorskip("accelerate")
    assert refusal(tmp_path / "run", *gpt2_run(folders, tmp_path), *overrides).startswith(message)


def test_flash_attention_without_flash_attn_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    pairs = pairs_file(tmp_path, PAIRS)
    message = refusal(tmp_path / "run", *lm(folders["gpt2"], pairs, "model.attn_implementation=flash_attention_2"))
    assert message.startswith("model.attn_implementation=flash_attention_2 needs the flash-attn package")


# ---- the run itself ----------------------------------------------------------------------------------------------


def test_layers_include_on_a_text_run_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    message = refusal(
        tmp_path / "run", "model=hf_lm", *LM_RUN, "data.file=induction", "layers.include=[no.such.module]"
    )
    assert message.startswith("layers.include=['no.such.module'] selects modules for image methods; method=lm_patching")


# What the model's config alone shows wrong, refused before its weights load: (method and its settings, message).
PATCHING = ["method=lm_patching", "method.patching.sites=[resid_pre]"]
BEFORE_WEIGHTS = [
    ([*PATCHING, "method.patching.layers=[0,2]"], "method.patching.layers=[2]: the model has layers 0..1."),
    ([*PATCHING, "method.patching.layers=[1,1]"], "method.patching.layers=[1, 1] names layer(s) [1] twice"),
    (["method=lm_grad_x_act", "method.layers=[0,0]"], "method.layers=[0, 0] names layer(s) [0] twice"),
    ([*PATCHING, "target=logit"], "method=lm_patching measures a language model's answer: use target=token_logit_diff,"),
    (["method=lm_patching", "method.patching.sites=[pattern]", "model.attn_implementation=sdpa"],
     "Site pattern needs the attention pattern, which attn_implementation=sdpa never materialises"),
    (["method=lm_grad_x_act", "method.layers=[5]"], "method.layers=[5]: the model has layers 0..1."),
    (["method=lm_grad_x_act", "target=kl_to_clean"],
     "target=kl_to_clean is 0 on the clean prompt that method=lm_grad_x_act reads"),
    (["method=lm_logit_lens", "method.layers=[-1,2]"],
     "method.layers=[-1, 2]: each of -1 (the embeddings) .. 1, once (at least one)."),
    # random weights: the layer count is the config's after model.config's overrides
    ([*PATCHING, "model.weights=null", "+model.config.n_layer=1", "method.patching.layers=[1]"],
     "method.patching.layers=[1]: the model has layers 0..0."),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), BEFORE_WEIGHTS)
def test_what_the_models_config_shows_wrong_is_refused_before_its_weights_load(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], message: str
) -> None:
    monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    assert refusal(tmp_path / "run", *gpt2_run(folders, tmp_path), *overrides).startswith(message)


def test_the_shipped_models_layers_are_checked_before_it_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    message = refusal(tmp_path / "run", "experiment=patching_lm_induction", "method.patching.layers=[3]")
    assert message == "method.patching.layers=[3]: the model has layers 0..1."


def test_a_hub_id_not_in_the_cache_is_one_line_with_no_download_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, a download would retry for half a minute before failing: the cache is looked up on disk instead."""
    import socket

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: pytest.fail(f"a network look-up: {a[:2]}"))
    monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    message = refusal(
        tmp_path / "run", "model=hf_lm", "model.name=EleutherAI/pythia-70m", *LM_RUN, "data.file=induction"
    )
    assert message.startswith(
        f"model.name=EleutherAI/pythia-70m is no local folder, and no hub id of that name is in the Hugging Face cache"
        f" {tmp_path / 'hub'}: the runner does not download language models. On a machine with internet, `hf download"
        " EleutherAI/pythia-70m` fills its cache (copy it here, or point HF_HOME at it)"
    )


def test_a_hub_id_in_the_cache_runs(folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache lookup finds what `hf download` leaves: refs/main naming a snapshot that holds the files."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--tiny-org--tiny-gpt2"
    shutil.copytree(folders["gpt2"], repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    pairs = pairs_file(tmp_path, PAIRS)
    result = app.run(make_config("model=hf_lm", "model.name=tiny-org/tiny-gpt2", *LM_RUN, f"data.file={pairs}"),
                     tmp_path / "run")  # fmt: skip
    assert len(pd.read_parquet(result.tables["lm_patching"])) > 0


def test_an_lm_run_of_the_default_experiment_says_nothing_of_its_image_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default experiment's layers and hooks name EfficientNet-Lite0's modules: a language model inherits none,
    and its log does not mention them (an image model in their place is told, test_config.py)."""
    caplog.set_level(logging.INFO)
    config = make_config("model=hf_lm", *LM_RUN, "data.file=induction", "data.limit=2")
    assert config.for_model.model == "embedded:efficientnet_lite0" and config.hooks == []
    app.run(config, tmp_path / "run")
    shown = [r.getMessage() for r in caplog.records]
    assert shown and not [m for m in shown if "efficientnet" in m.lower() or "_blocks" in m], shown


def test_an_lm_run_warns_nothing(folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No deprecation warning from transformers: the key/value cache goes under the name the model's forward takes."""
    pairs = pairs_file(tmp_path, PAIRS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app.run(make_config(*lm(folders["llama"], pairs)), tmp_path / "run")
    shown = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not [m for m in shown if "past_key_values" in m or "cache" in m], shown
    assert "past_key_values" not in caplog.text


# ---- `_target_`s a config may not name ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["os.system", "shutil.rmtree", "subprocess.run", "pickle.loads"])
def test_a_callable_target_is_held_to_the_model_targets_refusals(tmp_path: Path, target: str) -> None:
    message = refusal(tmp_path / "run", *TINY_IMAGE, "target=callable", f"target._target_={target}")
    assert message.startswith(f"target._target_={target} ")
    assert "refused" in message and "HYDRA_INSTANTIATE_ALLOWLIST_OVERRIDE" not in message


@pytest.mark.parametrize("target", ["os.system", "shutil.rmtree"])
def test_a_blocked_model_target_is_one_line_that_offers_no_bypass(tmp_path: Path, target: str) -> None:
    done = run_cli(*TINY_IMAGE, f"model._target_={target}", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("[INFO]")]
    assert errors == [
        f"[ERROR] model._target_={target} is refused: Hydra blocks it in configs, since it can run commands, evaluate"
        " code or change files."
    ]
