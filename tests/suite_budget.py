"""Where the suite's time goes, and its budget in the reference machine's seconds (pytest hooks; tests/conftest.py
installs them).

Each run of the suite ends with one line: its wall time, the seconds its workers spent (the CPU time it takes on a
machine of that many cores), each worker's share and the files that took most; every file's seconds are kept in
pytest's cache (`.pytest_cache/v/runner/seconds_by_file`) for the next look at where the time goes.

`RUNNER_SUITE_BUDGET_S=600` fails a whole-suite run that passes but would have taken longer than 600 s on the
reference machine (two quiet cores of the development machine, `REFERENCE`). Machines of one kind differ about
two-fold in speed from day to day (the same suite took 529 s on one and 1,031-1,142 s on others), so a budget in
this machine's seconds would fail the suite for the machine's speed, or pass a suite that grew on a fast day. Two
things scale the wall time to the reference machine's:
- the CPU's speed: a fixed single-threaded workload like the suite's own (a small convolutional net's forward and
  backward passes, a language model's MLP products, Python sorting and JSON), its CPU time (not wall: a process
  sharing the CPU does not make it longer) timed before the workers start and again after they end, the median of
  five runs each;
- the share of the CPUs the hypervisor gave to other machines while the suite ran (steal time, /proc/stat): a
  virtual machine's neighbours take that much of its time.
What neither sees, and the budget assumes away: other processes on this machine (a quiet machine, as CI's is).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runner.cpu_sharing import available_cpus

# The calibration workload's median CPU seconds on the reference machine, timed as the suite's controller times it
# (tests/conftest.py imported): the development machine of 2026-12-02 (two cores of an Intel Xeon, AVX-512, torch
# 2.14.1), quiet, where `make test` from a fresh clone took 539-551 s with every cache cold.
REFERENCE = "two quiet cores of the development machine of 2026-12-02"
REFERENCE_CALIBRATION_S = 0.188
BUDGET_VARIABLE = "RUNNER_SUITE_BUDGET_S"
PROC_STAT = Path("/proc/stat")


@dataclass
class Measured:
    """A whole suite's time: wall seconds here, the share of the CPUs' time stolen, seconds on the reference machine,
    and the budget it went over (None: within it, or none set)."""

    wall: float
    stolen: float
    on_reference: float
    over_budget: float | None = None


MEASURED = pytest.StashKey[Measured]()
STEAL_AT_START = pytest.StashKey[float | None]()  # the steal seconds as the first calibration ended
_SUITE_STARTED = time.perf_counter()
_SECONDS_BY_FILE: dict[str, float] = {}
_SECONDS_BY_WORKER: dict[str, float] = {}
_CALIBRATIONS: list[float] = []  # the workload's median CPU seconds: before the workers start, after they end
_CALIBRATING_S: list[float] = []  # the wall time the timings took, not the suite's


def calibration_seconds(runs: int = 5) -> float:
    """The median CPU seconds, over `runs` after one untimed, of a fixed single-threaded workload like the suite's,
    in three parts of about equal time: 40 forward and backward passes of a small convolutional net (torch's
    dispatch and small kernels, as the tests' tiny models), 25 products of a language model's MLP shape (64 x 576 by
    576 x 1536 and back: BLAS, as the real models' forwards), and sorting 20,000 rows and a JSON round trip (the
    interpreter). The calling thread's CPU time: what the CPU's speed sets, not its share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each xdist worker computes, in this thread
    try:
        generator = torch.Generator().manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10),
        )  # fmt: skip
        images = torch.randn(4, 3, 32, 32, generator=generator)
        tokens, weight = torch.randn(64, 576, generator=generator), torch.randn(576, 1536, generator=generator)
        rows = [{"layer": f"block{i}", "score": (i * 7919) % 1000 / 3, "name": str(i) * 3} for i in range(20_000)]
        seconds = []
        for run in range(runs + 1):  # the first, untimed: its first calls' one-time costs are not the CPU's speed
            started = time.thread_time()
            for _ in range(40):
                net.zero_grad(set_to_none=True)
                net(images).logsumexp(1).sum().backward()
            for _ in range(25):
                (tokens @ weight).relu_() @ weight.T
            json.loads(json.dumps(sorted(rows, key=lambda row: -row["score"])))
            if run:
                seconds.append(time.thread_time() - started)
        return statistics.median(seconds)
    finally:
        torch.set_num_threads(threads)


def steal_seconds(stat: str, cpus: set[int]) -> float:
    """The seconds the hypervisor ran other machines on `cpus` (the steal column of /proc/stat's `cpuN` lines)."""
    ticks = 0
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0].startswith("cpu") and fields[0][3:].isdigit() and int(fields[0][3:]) in cpus:
            ticks += int(fields[8]) if len(fields) > 8 else 0
    return ticks / os.sysconf("SC_CLK_TCK")


def _steal_now() -> float | None:
    try:
        return steal_seconds(PROC_STAT.read_text(), os.sched_getaffinity(0))
    except (OSError, AttributeError, ValueError, IndexError):  # not Linux: no steal counted
        return None


def reference_seconds(
    wall: float, calibrations: list[float], stolen: float = 0.0, reference: float = REFERENCE_CALIBRATION_S
) -> float:
    """`wall` seconds here as seconds on the reference machine: scaled by how much faster the reference's CPU ran the
    calibration workload than this one did (the mean of its timings here), and by the share `stolen` (0 to 1) of the
    CPUs' time that other machines had."""
    return wall * reference / statistics.fmean(calibrations) * (1.0 - min(max(stolen, 0.0), 0.9))


def _whole_suite(config: pytest.Config) -> bool:
    """No selection: every test of testpaths, every tier."""
    args = [a for a in config.args if a.rstrip("/") not in ("tests", str(Path(__file__).parent))]
    return not args and not config.getoption("keyword") and not config.getoption("markexpr")


def _calibrate() -> None:
    started = time.perf_counter()
    _CALIBRATIONS.append(calibration_seconds())
    _CALIBRATING_S.append(time.perf_counter() - started)


def _suite_wall() -> float:
    return time.perf_counter() - _SUITE_STARTED - sum(_CALIBRATING_S)


def _stolen_share(config: pytest.Config, wall: float) -> float:
    """The share of the suite's CPUs' time that other machines had while it ran (0 where it is not counted)."""
    start, now = config.stash.get(STEAL_AT_START, None), _steal_now()
    if start is None or now is None or wall <= 0:
        return 0.0
    return (now - start) / (wall * available_cpus())


def pytest_configure(config: pytest.Config) -> None:
    # The controller, before xdist starts its workers: the machine as the suite finds it.
    if not hasattr(config, "workerinput") and _whole_suite(config):
        _calibrate()
        config.stash[STEAL_AT_START] = _steal_now()


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
    if not _CALIBRATIONS:  # not the whole suite: no budget
        return
    wall = _suite_wall()
    stolen = _stolen_share(session.config, wall)
    _calibrate()  # the workers have ended
    measured = Measured(wall, stolen, reference_seconds(wall, _CALIBRATIONS, stolen))
    budget = os.environ.get(BUDGET_VARIABLE)
    if budget and exitstatus == 0 and measured.on_reference > float(budget):
        measured.over_budget = float(budget)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[MEASURED] = measured


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _SECONDS_BY_FILE:
        return
    spent = sum(_SECONDS_BY_FILE.values())
    top = sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])[:8]
    workers = sorted(_SECONDS_BY_WORKER.items())  # how evenly the files were spread
    by_worker = f" ({', '.join(f'{w} {s:.0f}' for w, s in workers)})" if workers else ""
    measured = config.stash.get(MEASURED, None)
    on_reference = ""
    if measured is not None:
        timings = " and ".join(f"{c:.3f}" for c in _CALIBRATIONS)
        on_reference = (
            f" = {measured.on_reference:.0f} s on the reference machine (calibration {timings} s CPU here,"
            f" {REFERENCE_CALIBRATION_S:.3f} s there; {100 * measured.stolen:.1f}% of the CPUs' time stolen)"
        )
    wall = _suite_wall() if measured is None else measured.wall
    terminalreporter.write_line(
        f"suite: {wall:.0f} s wall{on_reference}, {spent:.0f} worker-seconds{by_worker}; most: "
        + ", ".join(f"{Path(p).name} {s:.0f}" for p, s in top)
    )
    if measured is not None and measured.over_budget is not None:
        terminalreporter.write_line(
            f"suite over its budget: {measured.on_reference:.0f} s on the reference machine ({REFERENCE})"
            f" > {BUDGET_VARIABLE}={measured.over_budget:.0f}",
            red=True,
        )
