"""Processes that share the CPUs: a parallel sweep's workers (joblib) and torchrun's ranks on one machine.

Each such process runs torch with the run's thread count (`threads`: the same number in every process, so that
tables are identical under every launcher; null: every CPU this process may use), so together they start more
threads than there are CPUs. OpenMP's threads (libgomp, torch's CPU pool) spin for a while when they wait for work,
and a spinning thread holds a CPU that another process's work needs. Where the processes would oversubscribe the
CPUs, their threads wait asleep instead (OMP_WAIT_POLICY=PASSIVE): the same values, computed without the spinning.
A process alone on its CPUs keeps the default, which is faster there. A policy the user set is kept. libgomp reads
the variable once, when torch loads it: it is set in the environment the workers start with, or in a rank before
it imports torch. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one: a SLURM job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def oversubscribed(processes: int, threads: int | None, cpus: int) -> bool:
    """Whether `processes` processes of `threads` torch threads each (None: `cpus` each) are more threads than
    `cpus`, with more than one process (one process's threads never wait on another's) of more than one thread
    (a one-thread process has no team to wait for: its policy changes nothing)."""
    threads = threads or cpus
    return processes > 1 and threads > 1 and processes * threads > cpus


def wait_asleep_where_shared(processes: int, threads: int | None, cpus: int) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in this process's environment (what the processes it starts inherit) where
    `processes` processes of `threads` threads would oversubscribe `cpus` CPUs and no policy is set; whether it set
    it."""
    if WAIT_POLICY in os.environ or not oversubscribed(processes, threads, cpus):
        return False
    os.environ[WAIT_POLICY] = PASSIVE
    return True


def concurrent_jobs(launcher: DictConfig, cpus: int) -> int:
    """How many jobs a launcher's config runs at once: joblib's n_jobs (-1: every CPU, -2: all but one, as joblib
    counts); 1 for a launcher without n_jobs (the basic one runs jobs in this process, one at a time; a cluster's
    jobs run on CPUs of their own)."""
    n_jobs = launcher.get("n_jobs")
    if not isinstance(n_jobs, int) or n_jobs == 0:
        return 1
    return n_jobs if n_jobs > 0 else max(1, cpus + 1 + n_jobs)


class SharedCpusCallback(Callback):
    """Hydra callback (conf/hydra/default.yaml): in a sweep's own process, before its launcher starts the workers,
    OMP_WAIT_POLICY=PASSIVE for workers that would oversubscribe the CPUs; removed again when the sweep ends."""

    def __init__(self) -> None:
        self._set = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        cpus = available_cpus()
        jobs = concurrent_jobs(config.hydra.launcher, cpus)
        threads = config.get("threads")
        self._set = wait_asleep_where_shared(jobs, threads if isinstance(threads, int) else None, cpus)
        if self._set:
            log.debug("%d concurrent jobs of %s threads on %d CPUs: %s=%s for the workers", jobs,
                      threads or "all", cpus, WAIT_POLICY, PASSIVE)  # fmt: skip

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._set:
            os.environ.pop(WAIT_POLICY, None)
            self._set = False


def rank_waits_asleep_where_shared(threads: int | None) -> bool:
    """In a torchrun rank that has not imported torch yet: OMP_WAIT_POLICY=PASSIVE where this machine's ranks
    (LOCAL_WORLD_SIZE) of `threads` threads each would oversubscribe its CPUs; whether it set it."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if "torch" in sys.modules or not ranks.isdigit():
        return False
    return wait_asleep_where_shared(int(ranks), threads, available_cpus())
