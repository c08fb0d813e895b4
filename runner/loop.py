"""The batch loop of one shard: each batch through the hooks and the method, its rows to the writer.

Two things can cut a batch short, and both are handled here: a stop signal (Ctrl-C or SIGTERM: the run
stops after the current batch, `stop_on_signals`), and CUDA out-of-memory (the batch is halved until it
fits, `run_with_backoff`). `run` (runner/app.py) plans the shards and keeps the complete ones on a failure.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from runner.data.base import Batch, RangesSampler, make_loader, to_batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.ids import ClassNames, rows_for
from runner.interrupts import (
    STOP_SIGNALS,
    Interrupted,
    keep_noting_signals,
    note_signal,
    parallel_sweep_job,
    received,
    sweep_dir,
)
from runner.progress import RunProgress
from runner.rows import BatchOutput
from runner.schema import RunConfig
from runner.shard_stats import ShardStats
from runner.store.writer import ShardedWriter

if TYPE_CHECKING:  # the loop runs any method through the protocol; it imports none
    from runner.methods.base import Method

log = logging.getLogger(__name__)

# The `hooks` table's statistics stay on the device until the shard ends and cross to the host in one copy
# (runner/shard_stats.py); False copies them per batch (the reference the tests compare with).
DEFER_HOOK_STATS = True
# Each batch's tables cross to the host in one pinned, non-blocking copy that the writer thread waits for
# (runner/host_copy.py): None does so on CUDA only (on the CPU the packing would be a copy for nothing); True or
# False forces it (tests compare the two paths' tables).
PACK_ROWS: bool | None = None


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """Ctrl-C (SIGINT) or SIGTERM sets the event; the run stops after the current batch. A second one stops
    at once (KeyboardInterrupt, which `run` turns into one line with the resume command). In a parallel sweep's
    worker the same signal twice within a second (the process group's and the one the sweep passes on) counts
    once; a plain run takes every signal as it comes (a quick second Ctrl-C is a user's "now")."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    quiet = parallel_sweep_job()  # the sweep's own process says it, once for all its workers

    def handle(signum: int, frame: object) -> None:
        if not note_signal(signum) and quiet:
            return
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        name = signal.Signals(signum).name
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "%s: stopping after the current batch (Ctrl-C or the signal again to stop now)",
            name,
        )

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    if quiet and received.name is not None:  # the worker noted the sweep's signal while this job was starting
        stop.set()
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if quiet:  # a signal between this worker's jobs is noted, and no job starts after it
            keep_noting_signals()


def interrupted(head: str, detail: str, directory: Path) -> Interrupted:
    """A run's `Interrupted` error: `detail` says what is kept; a sweep's job also names its sweep."""
    return Interrupted(head, detail, str(directory), received.name or "a signal", sweep_dir())


def shard_batches(shard: int, shard_samples: int, total: int, config: RunConfig) -> int:
    """How many batches shard `shard` holds (the last shard may be short)."""
    samples = min(shard_samples, total - shard * shard_samples)
    return -(-samples // config.data.batch_size)


@dataclass
class ShardLoop:
    """Everything the per-shard loop needs."""

    config: RunConfig
    device: torch.device
    dataset: Dataset
    shard_samples: int
    model: torch.nn.Module
    method: Method
    session: HookSession
    writer: ShardedWriter
    id_columns: dict[str, Any]  # the run's id columns (runner/ids.py `run_columns`)
    categories: ClassNames  # the model's and the labels' class names (runner/ids.py)
    stop: threading.Event
    batches: Iterator[Any]  # the run's one loader (`run_loader`), consumed shard by shard
    progress: RunProgress | None = None  # the run's bar: a step per batch


def shard_range(shard: int, shard_samples: int, total: int) -> range:
    """The data set indices of shard `shard`."""
    start = shard * shard_samples
    return range(start, min(start + shard_samples, total))


def run_loader(
    dataset: Dataset, shards: Iterable[int], shard_samples: int, config: RunConfig, device: torch.device
) -> DataLoader:
    """One loader over `shards`' samples in shard order: its workers live for the whole run, not one shard.

    A shard holds whole batches (shard_samples is a multiple of the batch size and only the data set's last
    shard is short), so no batch straddles two shards; shards a resume skips are not in the sampler."""
    total = len(dataset)  # type: ignore[arg-type]
    sampler = RangesSampler([shard_range(s, shard_samples, total) for s in shards])
    return make_loader(dataset, config.data, device, sampler)


def run_shard(shard: int, loop: ShardLoop) -> None:
    """Every batch of one shard through the method; rows go to the shard's files (on the writer thread)."""
    indices = shard_range(shard, loop.shard_samples, len(loop.dataset))  # type: ignore[arg-type]
    start = indices.start
    first = start
    deferred = ShardStats() if DEFER_HOOK_STATS else None
    pack = PACK_ROWS if PACK_ROWS is not None else loop.device.type == "cuda"
    for _ in range(-(-len(indices) // loop.config.data.batch_size)):  # this shard's batches, from the run's loader
        raw = next(loop.batches)
        batch = to_batch(raw, loop.device, first, loop.config.channels_last)
        for part in run_with_backoff(batch, loop.model, loop.method, loop.session, loop.config):
            on_samples = None
            if deferred is not None and part[2] is not None:  # recorded rows: their statistics wait for the shard
                on_samples = deferred.add(part[2])
                part = (part[0], part[1], None)
            loop.writer.submit(rows_for(part, loop.id_columns, loop.categories, on_samples, pack))
        if loop.progress is not None:
            loop.progress.batch_done()
        if loop.stop.is_set():
            done = len(loop.writer.completed_shards())
            raise interrupted(
                "Interrupted.",
                f"{done} complete shard(s) are kept in {loop.writer.directory}; the shard in progress (from sample"
                f" {start}) is discarded.",
                loop.writer.directory,
            )
        first += batch.x.shape[0]
    hook_rows = deferred.flush(loop.id_columns) if deferred is not None else None
    if hook_rows is not None:
        loop.writer.submit(hook_rows)


def run_with_backoff(
    batch: Batch, model: torch.nn.Module, method: Method, session: HookSession, config: RunConfig
) -> list[tuple[Batch, BatchOutput, dict[str, Any] | None]]:
    """(batch, method output, recorded hook rows) for the batch, halving it on CUDA out-of-memory until it fits."""
    # Keyed by the first sample, not the batch number: an OOM split's halves get their own sidecar files.
    session.begin_batch(batch.x.shape[0], batch.first_index)
    try:
        output = method.run_batch(model, batch, session)
        return [(batch, output, session.end_batch())]
    except torch.cuda.OutOfMemoryError:
        # Retried below, after this block: inside it, the exception's traceback keeps the failed attempt's frames
        # (its activations and autograd graph) alive, so the halves would run short of that memory and fail too.
        pass
    except RuntimeError as error:
        explained = session.explain(error)  # a torch error the hooks caused, as one clear message
        if explained is not None:
            raise explained from error
        raise
    # Drop what the failed attempt recorded, unwritten: starting the batch again clears its rows, the method's
    # captures and its kept sidecar tensors (end_batch would copy those to the host and write the failed whole
    # batch's file, which the first half's then replaces).
    session.begin_batch(batch.x.shape[0], batch.first_index)
    size = batch.x.shape[0]
    if size == 1:
        raise RunnerError(
            "CUDA out of memory with a batch of 1: the model and method do not fit this GPU. Try precision=bf16,"
            " fewer layers, or a smaller method.patching.chunk / method.score_chunk."
        )
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
        parts += run_with_backoff(batch.part(lo, hi), model, method, session, config)
    return parts
