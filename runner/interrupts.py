"""Stopping on a signal: a run's `Interrupted` error, and a sweep stopped as one.

Ctrl-C (SIGINT) and SIGTERM (what `timeout`, SLURM and `docker stop` send, often to the whole process group)
stop a run after its current batch (runner/loop.py `stop_on_signals`). A sweep (`-m`) is stopped as one:
`guard_sweep` holds the sweep's own process. With the basic launcher the jobs run in that process, so a
signal between jobs stops the sweep at once, and a job the signal stops ends it. With a launcher that runs jobs
in worker processes (joblib), the signal is passed on to the workers (each stops after its batch; a worker that
got it already from the process group counts the two as one), a worker starts no job after it, and the sweep's
process waits for them, ends any left, and prints one line with the one command that resumes the sweep.
Nothing here imports torch: the sweep's own process never needs it.
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from types import FrameType
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.errors import RunnerError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAME_SIGNAL_S = 1.0  # a second signal this soon after the first is the same stop (the group's and the forwarded)


class Interrupted(RunnerError):
    """A run stopped by a signal (or a sweep's job not started after one): what is kept (`detail`), and where."""

    def __init__(
        self, head: str, detail: str, directory: str, signal_name: str, sweep: str | None = None
    ) -> None:  # fmt: skip
        self.head, self.detail, self.directory = head, detail, directory
        self.signal_name, self.sweep = signal_name, sweep  # the sweep's folder, in a sweep's job
        super().__init__(f"{head} {detail} Run the same command with hydra.run.dir={directory} to resume.")

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str, str | None]]:  # a joblib worker sends it pickled
        return type(self), (self.head, self.detail, self.directory, self.signal_name, self.sweep)


class SweepInterrupted(KeyboardInterrupt):
    """The sweep's own process stopped at once by a signal (between jobs, or a second signal)."""


# ---- the job's side ---------------------------------------------------------------------------------------------
@dataclass
class _Received:
    name: str | None = None  # the first stop signal this process received, if any
    at: float = 0.0  # when (time.monotonic)
    sweep: str | None = None  # in a sweep's own process: the sweep's folder (SweepCallback)


received = _Received()  # this process's: a parallel sweep's worker starts no job once it is set


class SweepCallback(Callback):
    """Hydra callback (conf/hydra/default.yaml): the sweep's own process learns its folder (Hydra keeps it from
    the process otherwise), and a worker notes a stop signal from its job's start on, instead of dying of it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        received.sweep = str(config.hydra.sweep.dir)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if parallel_sweep_job():
            keep_noting_signals()


def note_signal(signum: int) -> bool:
    """Record a stop signal; whether it is a new one (False: the same stop delivered twice, within SAME_SIGNAL_S)."""
    now = time.monotonic()
    if received.name is not None and now - received.at < SAME_SIGNAL_S:
        return False
    if received.name is None:
        received.name, received.at = signal.Signals(signum).name, now
    return True


def parallel_sweep_job() -> bool:
    """Whether this is a sweep's job run by a launcher other than the basic one (in a worker process)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return False
        return "BasicLauncher" not in str(HydraConfig.get().launcher.get("_target_", ""))
    except Exception:  # no Hydra config of a run: not a sweep's job
        return False


def sweep_dir() -> str | None:
    """The sweep's folder, from Hydra's config of this process (None outside a sweep)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return str(HydraConfig.get().sweep.dir)
    except Exception:  # no Hydra config of a sweep
        pass
    return received.sweep


def keep_noting_signals() -> None:
    """Between jobs in a parallel sweep's worker: a stop signal is noted (no job starts after it), not fatal."""
    if threading.current_thread() is threading.main_thread():
        for number in STOP_SIGNALS:
            signal.signal(number, lambda signum, frame: note_signal(signum) and None)


# ---- the sweep's own process ------------------------------------------------------------------------------------
def resume_command(sweep: str, argv: list[str]) -> str:
    """`python -m runner -m <the same overrides> hydra.sweep.dir=<sweep>`: what resumes this sweep."""
    kept = [a for a in argv if a not in ("-m", "--multirun") and not a.lstrip("+").startswith("hydra.sweep.dir=")]
    return shlex.join(["python", "-m", "runner", "-m", *kept, f"hydra.sweep.dir={sweep}"])


@contextmanager
def guard_sweep(enabled: bool) -> Iterator[None]:
    """In a sweep's own process: a stop signal is passed on to the workers (if any) or stops the sweep at once."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        first = received.name is None
        if not note_signal(signum):
            return
        workers = multiprocessing.active_children()
        if first and workers:  # they stop after their batch; wait for them (the launcher collects their jobs)
            # printed, not logged: this process has Hydra's logging (to stdout), not the jobs' (to stderr)
            print(
                f"[WARNING] {received.name}: stopping the sweep after each running job's current batch", file=sys.stderr
            )
            for worker in workers:
                if worker.pid is not None:
                    with suppress(OSError):  # ended meanwhile
                        os.kill(worker.pid, signum)
            return
        raise SweepInterrupted(received.name)

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def end_workers() -> None:
    """End the sweep's worker processes, so that none outlives it. By now the launcher has collected every job (or
    given up on them), so the workers are idle: joblib's executor is shut down, and any process left is killed."""
    loky = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(loky, "_executor", None)
    if executor is not None:
        with suppress(Exception):  # a broken executor: the workers are killed below
            executor.shutdown(wait=True, kill_workers=True)  # idle by now: nothing of theirs is lost
    for worker in multiprocessing.active_children():
        worker.join(1)
        if worker.is_alive():
            worker.kill()
            worker.join(5)


def interrupted_line(error: BaseException | None, argv: list[str]) -> str:
    """The one line of a sweep stopped by a signal: what is kept, and the command that resumes it."""
    name = getattr(error, "signal_name", None) or received.name or "a signal"
    sweep = getattr(error, "sweep", None) or sweep_dir()
    resume = resume_command(sweep, argv) if sweep else "the same command with hydra.sweep.dir=<the sweep's folder>"
    return (
        f"Interrupted ({name}): the sweep stopped; its finished jobs and complete shards are kept. Resume it with:"
        f" {resume} (finished jobs and complete shards are skipped)."
    )
