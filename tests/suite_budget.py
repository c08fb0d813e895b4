"""Where the suite's time goes, and its tripwire (pytest hooks; tests/conftest.py installs them).

Each run of the suite ends with one line: its wall time, the CPU seconds of its processes (the controller, its
workers and what they started), the seconds its tests took on each worker and the files that took most; every file's
seconds are kept in pytest's cache (`.pytest_cache/v/runner/seconds_by_file`) for the next look at where the time
goes.

The suite's goal (600 s wall on two quiet cores, the fast tier under two minutes) is met by keeping tests cheap and
measured on a quiet machine (benchmarks/RESULTS.md), not gated: the same suite's wall time moves about two-fold with
the machine it lands on. `RUNNER_SUITE_TRIPWIRE_S=1800` fails a whole-suite run that passes but takes longer than
1,800 s wall: a test that hangs or a suite that has grown several-fold, not a slow day.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runner.cpu_sharing import available_cpus

TRIPWIRE_VARIABLE = "RUNNER_SUITE_TRIPWIRE_S"


@dataclass
class Measured:
    """A whole suite's time: wall seconds, CPU seconds of its processes, and the tripwire it passed (None: within
    it, or none set)."""

    wall: float
    cpu: float
    tripped: float | None = None


MEASURED = pytest.StashKey[Measured]()
_SUITE_STARTED = time.perf_counter()
_SECONDS_BY_FILE: dict[str, float] = {}
_SECONDS_BY_WORKER: dict[str, float] = {}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (xdist's workers once they
    stop, and what they started and waited for)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def over_tripwire(wall: float, passed: bool, tripwire: str | None) -> float | None:
    """The tripwire (seconds) a passing suite of `wall` seconds went over; None where it did not, failed anyway or
    none is set."""
    if not tripwire or not passed:
        return None
    limit = float(tripwire)
    return limit if wall > limit else None


def _whole_suite(config: pytest.Config) -> bool:
    """No selection: every test of testpaths, every tier."""
    args = [a for a in config.args if a.rstrip("/") not in ("tests", str(Path(__file__).parent))]
    return not args and not config.getoption("keyword") and not config.getoption("markexpr")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)  # xdist's controller
    if worker is not None:
        _SECONDS_BY_WORKER[worker] = _SECONDS_BY_WORKER.get(worker, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or not _SECONDS_BY_FILE:  # an xdist worker: the controller sums
        return
    if getattr(session.config, "cache", None) is not None:  # -p no:cacheprovider: nothing kept
        session.config.cache.set(
            "runner/seconds_by_file", dict(sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1]))
        )
    measured = Measured(time.perf_counter() - _SUITE_STARTED, cpu_seconds())
    if _whole_suite(session.config):
        measured.tripped = over_tripwire(measured.wall, exitstatus == 0, os.environ.get(TRIPWIRE_VARIABLE))
        if measured.tripped is not None:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[MEASURED] = measured


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _SECONDS_BY_FILE:
        return
    spent = sum(_SECONDS_BY_FILE.values())
    top = sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])[:8]
    workers = sorted(_SECONDS_BY_WORKER.items())  # how evenly the files were spread
    by_worker = f" ({', '.join(f'{w} {s:.0f}' for w, s in workers)})" if workers else ""
    measured = config.stash.get(MEASURED, None) or Measured(time.perf_counter() - _SUITE_STARTED, cpu_seconds())
    terminalreporter.write_line(
        f"suite: {measured.wall:.0f} s wall, {measured.cpu:.0f} CPU-seconds on {available_cpus()} CPUs,"
        f" {spent:.0f} test-seconds{by_worker}; most: " + ", ".join(f"{Path(p).name} {s:.0f}" for p, s in top)
    )
    if measured.tripped is not None:
        terminalreporter.write_line(
            f"suite over its tripwire: {measured.wall:.0f} s wall > {TRIPWIRE_VARIABLE}={measured.tripped:.0f}"
            " (a hung test, or a suite grown several-fold: the goal is 600 s on two quiet cores)",
            red=True,
        )
