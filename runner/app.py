"""`run(cfg)`: the whole experiment as a plain function (the CLI and the tests both call it).

config -> model, layers, hooks, method (all checked before any data is loaded) -> data -> per batch:
hooks fire, the method computes rows -> Parquet tables in the output dir -> a per-layer summary.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig
from torch.utils.data import Subset
from tqdm import tqdm

from runner import distributed
from runner.data import NO_LABEL, Batch, build_dataset, make_loader, skipped_files, to_batch
from runner.errors import RunnerError
from runner.hooks import BoundHook, HookSession
from runner.layers import Layer, resolve_layers
from runner.methods import Runtime, build_method, method_class
from runner.models import build_model, check_input
from runner.provenance import provenance, resume_key, swept_columns
from runner.results import Block, DirectoryLock, ShardedWriter, to_host, write_failure
from runner.schema import RunConfig, to_run_config
from runner.stats import STAT_NAMES

log = logging.getLogger(__name__)

# What the console summary reports: per layer (and hook, role, call), the mean of these columns where present:
# the hooks table's, and those the method declares (`Method.summary_values`).
SUMMARY_KEYS = ("direction", "patch_method", "layer", "hook", "role", "call")
HOOK_SUMMARY_VALUES = ("mean", "std", "frac_zero")


@dataclass
class RunResult:
    output_dir: Path
    tables: dict[str, Path]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunnerError(f"device={name} was asked for, but no CUDA GPU is available. Use device=auto or device=cpu.")
    try:
        return torch.device(name)
    except RuntimeError:
        raise RunnerError(f"Unknown device '{name}'. Use auto, cpu, cuda or cuda:N.") from None


def _pictures_on(config: RunConfig) -> bool:
    """Pictures as configured; by default on for a single run, off in a sweep (one PNG per sample per job adds up)."""
    if config.method.pictures is not None:
        return config.method.pictures
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN)


def _default_output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise RunnerError("No output directory: pass output_dir to run(), or set output.dir=PATH.")
    return Path(HydraConfig.get().runtime.output_dir)


def _bind_hooks(model: torch.nn.Module, config: RunConfig, target_layers: list[Layer] | None) -> list[BoundHook]:
    bound = []
    for i, spec in enumerate(config.hooks):
        if spec.layers:
            layers = resolve_layers(model, spec.layers)
        elif target_layers is not None:
            layers = target_layers
        else:
            raise RunnerError(
                f"hooks[{i}] names no layers and `layers.include` is empty: give the hook `layers: [...]`."
            )
        bound.append(BoundHook(spec, layers))
    return bound


def run(cfg: DictConfig | RunConfig, output_dir: str | Path | None = None) -> RunResult:
    """Run one experiment into `output_dir` (default: Hydra's run dir); resume it if that holds an unfinished
    run of the same config and inputs. Bad input raises RunnerError before anything is written; a failure
    later keeps only complete shards. One run writes a directory at a time: a second one is refused."""
    config = to_run_config(cfg)
    out = Path(output_dir or config.output.dir or _default_output_dir())
    _check_writable(out)
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    if device.type == "cuda" and distributed.rank_and_world()[1] > 1:
        device = torch.device("cuda", distributed.local_device_index())  # torchrun: one GPU per process
        torch.cuda.set_device(device)
    distributed.init(device)
    out = distributed.shared_directory(out)
    lock = DirectoryLock(out)
    refusal = None
    if distributed.rank_and_world()[0] == 0:  # rank 0 holds the lock for all ranks of a torchrun
        try:
            lock.acquire()
        except RunnerError as e:
            refusal = str(e)
    refusal = distributed.from_rank0(refusal)
    if refusal is not None:
        raise RunnerError(refusal)
    try:
        return _run_locked(config, out, device)
    finally:
        lock.release()


def _run_locked(config: RunConfig, out: Path, device: torch.device) -> RunResult:
    """`run` once this process (or its rank 0) holds the output directory's lock."""
    runtime = Runtime(device, config.precision, out / "pictures" if _pictures_on(config) else None)

    bundle = build_model(config.model)
    model = bundle.model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    target_layers = (
        resolve_layers(model, config.layers.include, config.layers.exclude) if config.layers.include else None
    )
    if target_layers is None and method_class(config.method).needs_layers:
        raise RunnerError(f"method={config.method.name} needs target layers: set layers.include=[...].")
    hooks = _bind_hooks(model, config, target_layers)
    method = build_method(config.method, target_layers or [], runtime)

    dataset = build_dataset(config.data, bundle.preprocess, config.seed)
    # One forward: a shape the model refuses fails here.
    check_input(model, dataset[0][0], config.data.batch_size, device)
    method.prepare(dataset)
    rank, world = distributed.rank_and_world()
    shard_samples = config.output.shard_batches * config.data.batch_size
    num_shards = -(-len(dataset) // shard_samples)
    run_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    identity = {
        "run_id": run_id,
        "experiment": config.name,
        "model": config.model._target_ or config.model.name,
        "method": config.method.name,
        **swept_columns(config),
    }
    key, details = resume_key(config, shard_samples, len(dataset))
    writer = ShardedWriter(out, provenance(config, run_id, skipped_files(dataset)), key, rank, details=details)
    done = writer.resume()  # complete shards whose files are intact; a damaged one runs again
    mine = [s for s in range(num_shards) if s % world == rank and s not in done]
    if done:
        log.info("resuming %s: %d of %d shards complete, %d to run here", out, len(done), num_shards, len(mine))
    log.info(
        "run %s: %s on %s, %d samples, device %s", run_id, config.method.name, identity["model"], len(dataset), device
    )
    side_dirs = [d for d in (out / "tensors", runtime.pictures_dir) if d is not None and not d.exists()]
    try:
        with HookSession(model, hooks, out / "tensors") as session, _stop_on_signals() as stop:
            method.setup(session, len(dataset))
            progress = tqdm(total=sum(_shard_batches(s, shard_samples, len(dataset), config) for s in mine),
                            desc=config.name, unit="batch", disable=not config.progress)  # fmt: skip
            loop = _Loop(config, device, dataset, shard_samples, model, method, session, writer, identity,
                         bundle.categories, stop)  # fmt: skip
            for shard in mine:
                writer.begin_shard(shard)
                _run_shard(shard, loop)
                writer.commit_shard()
                progress.update(_shard_batches(shard, shard_samples, len(dataset), config))
            progress.close()
            writer.finish()
            writer.close()
    except BaseException as error:
        writer.abort_shard()
        writer.close()
        if world == 1:  # a sidecar half-written when the run failed (one writer per directory: none is live)
            for stale in (out / "tensors").glob("*.tmp"):
                stale.unlink(missing_ok=True)
        kept = _complete_shards(writer)
        if not kept:  # nothing to resume: leave nothing behind
            for directory in side_dirs:
                shutil.rmtree(directory, ignore_errors=True)
        clear = write_failure(error, out)
        if clear is not None:
            raise clear from None
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C or SIGTERM: stopped at once, one line
            raise RunnerError(
                f"Stopped at once. {len(kept)} complete shard(s) are kept in {out}; the shard in progress is"
                f" discarded. Run the same command with hydra.run.dir={out} to resume."
            ) from None
        raise
    method.finish(out)  # a method's final check (hook_check's tolerance) fails the run after its tables are written
    distributed.barrier()
    tables = writer.tables()
    if rank == 0:
        _summarise(tables, (*HOOK_SUMMARY_VALUES, *method.summary_values))
        log.info("results: %s", out)
    return RunResult(out, tables)


def check_output_arguments(argv: list[str]) -> None:
    """`hydra.run.dir=` / `hydra.sweep.dir=` on the command line that is a file or not writable: a RunnerError
    before Hydra trips on it (Hydra makes the directory and its log file before the run starts)."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        value = value.strip().strip("'\"")
        if sep and key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            _check_writable(Path(value).expanduser(), key.lstrip("+"))


def _check_writable(out: Path, key: str = "hydra.run.dir") -> None:
    """Fail before any work when results could not be written."""
    if out.exists() and not out.is_dir():
        raise RunnerError(f"Cannot write results to {out}: it is a file, not a directory. Choose another {key}=PATH.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-check-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunnerError(
            f"Cannot write results to {out} ({e.strerror or e}). Choose a writable directory with"
            f" {key}=PATH{' (or output.dir=PATH)' if key == 'hydra.run.dir' else ''}."
        ) from None


def _complete_shards(writer: ShardedWriter) -> set[int]:
    """The shards the manifests list, or none when a manifest cannot be read (the run is failing anyway)."""
    try:
        return writer.completed_shards()
    except RunnerError:
        return set()


# What `timeout`, SLURM and `docker stop` send, handled as Ctrl-C is: the run stops after the batch, resumable.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """Ctrl-C (SIGINT) or SIGTERM sets the event; the run stops after the current batch. A second one stops
    at once (KeyboardInterrupt, which `run` turns into one line with the resume command)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        name = signal.Signals(signum).name
        log.warning("%s: stopping after the current batch (Ctrl-C or the signal again to stop now)", name)

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _shard_batches(shard: int, shard_samples: int, total: int, config: RunConfig) -> int:
    samples = min(shard_samples, total - shard * shard_samples)
    return -(-samples // config.data.batch_size)


@dataclass
class _Loop:
    """Everything the per-shard loop needs."""

    config: RunConfig
    device: torch.device
    dataset: Any
    shard_samples: int
    model: torch.nn.Module
    method: Any
    session: HookSession
    writer: ShardedWriter
    identity: dict[str, Any]
    categories: list[str] | None
    stop: threading.Event


def _run_shard(shard: int, loop: _Loop) -> None:
    """Every batch of one shard through the method; rows go to the shard's files (on the writer thread)."""
    start = shard * loop.shard_samples
    indices = range(start, min(start + loop.shard_samples, len(loop.dataset)))
    loader = make_loader(Subset(loop.dataset, indices), loop.config.data, loop.device)
    first = start
    for raw in loader:
        batch = to_batch(raw, loop.device, first, loop.config.channels_last)
        for part in _run_with_backoff(batch, loop.model, loop.method, loop.session, loop.config):
            loop.writer.submit(_rows_for(part, loop.identity, loop.categories))
        if loop.stop.is_set():
            done = len(loop.writer.completed_shards())
            raise RunnerError(
                f"Interrupted. {done} complete shard(s) are kept in {loop.writer.directory}; the shard in progress"
                f" (from sample {start}) is discarded. Run the same command with hydra.run.dir={loop.writer.directory}"
                " to resume."
            )
        first += batch.x.shape[0]


def _run_with_backoff(batch: Batch, model, method, session, config: RunConfig) -> list[tuple[Batch, Any, Any]]:
    """(batch, method output, recorded hook rows) for the batch, halving it on CUDA out-of-memory until it fits."""
    # Keyed by the first sample, not the batch number: an OOM split's halves get their own sidecar files.
    session.begin_batch(batch.x.shape[0], batch.first_index)
    try:
        output = method.run_batch(model, batch, session)
        return [(batch, output, session.end_batch())]
    except RuntimeError as error:
        if not isinstance(error, torch.cuda.OutOfMemoryError):
            explained = session.explain(error)  # a torch error the hooks caused, as one clear message
            if explained is not None:
                raise explained from error
            raise
        session.end_batch()  # drop what the failed attempt recorded
        size = batch.x.shape[0]
        if size == 1:
            raise RunnerError(
                "CUDA out of memory with a batch of 1: the model and method do not fit this GPU. Try precision=bf16,"
                " fewer layers, or a smaller method.patching.chunk / method.score_chunk."
            ) from None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = size // 2
        log.warning(
            "CUDA out of memory at batch size %d (samples from %d): retrying as %d + %d",
            size,
            batch.first_index,
            half,
            size - half,
        )
        parts = []
        for lo, hi in ((0, half), (half, size)):
            sub = Batch(batch.x[lo:hi], batch.labels[lo:hi], batch.sample_ids[lo:hi], batch.first_index + lo)
            parts += _run_with_backoff(sub, model, method, session, config)
        return parts


def _rows_for(part: tuple[Batch, Any, Any], identity: dict[str, Any], categories: list[str] | None):
    """The writer thread's job for one batch: move rows to the host and add the identifier columns."""
    batch, output, recorded = part

    def produce() -> list[tuple[str, dict[str, Any]]]:
        samples = _sample_columns(batch, output.predicted, categories)
        rows = [(table, _with_ids(identity, samples, to_host(columns))) for table, columns in output.tables.items()]
        if recorded is not None:
            recorded["stats"] = Block(recorded.pop("stats"), list(STAT_NAMES))
            rows.append(("hooks", _with_ids(identity, samples, to_host(recorded))))
        return rows

    return produce


def _sample_columns(batch: Batch, predicted: torch.Tensor, categories: list[str] | None) -> dict[str, np.ndarray]:
    """Per-sample identifiers of a batch, moved to the host in one transfer."""
    host = torch.stack([batch.labels.to(predicted.device), predicted]).cpu().numpy()  # (2, B)
    names = [categories[p] if categories and 0 <= p < len(categories) else None for p in host[1]]
    return {
        "sample": np.arange(batch.first_index, batch.first_index + len(batch.sample_ids)),
        "sample_id": np.array(batch.sample_ids, dtype=object),
        "label": np.array([None if y == NO_LABEL else int(y) for y in host[0]], dtype=object),
        "predicted": host[1],
        "predicted_name": np.array(names, dtype=object),
    }


def _with_ids(identity: dict[str, str], samples: dict[str, np.ndarray], columns: dict[str, Any]) -> dict[str, Any]:
    """Identifier columns first (run, experiment, model, method, sample...), then the table's own."""
    local = np.asarray(columns.pop("sample_index"))
    rows = len(local)
    per_batch = local >= 0  # -1: a row about the whole batch (a tensor without a batch dimension)
    picked = np.where(per_batch, local, 0)
    ids: dict[str, Any] = {k: [v] * rows for k, v in identity.items()}
    for name, values in samples.items():
        column = values[picked].astype(object)
        column[~per_batch] = None
        ids[name] = column
    return {**ids, **columns}


def _summarise(paths: dict[str, Path], summary_values: tuple[str, ...]) -> None:
    for table, path in paths.items():
        present = set(pq.read_schema(sorted(path.glob("part-*.parquet"))[0]).names)
        keys = [k for k in SUMMARY_KEYS if k in present]
        values = [v for v in summary_values if v in present]
        frame = pd.read_parquet(path, columns=keys + values)
        summary = frame.groupby(keys, sort=False)[values].mean()
        with pd.option_context(
            "display.width", 200, "display.max_rows", 60, "display.max_columns", 20, "display.precision", 4
        ):
            log.info("%s (%d rows, per layer):\n%s", table, len(frame), summary)
