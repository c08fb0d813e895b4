"""The suite budget's calibration workload (tests/suite_budget.py): its time here, and why CPU time scales the budget.

    .venv/bin/python scripts/bench_suite_calibration.py [--processes 6]

1. `calibration_seconds()` as the suite's controller times it (a fresh process that has imported tests/conftest.py),
   in `--processes` processes one after another: what `REFERENCE_CALIBRATION_S` is set from on the reference machine.
2. On one CPU, alone and then shared with a busy process: the workload's CPU time (what scales the budget) and its
   wall time (which a process sharing the CPU stretches).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AS_THE_CONTROLLER = (
    "import tests.conftest; from tests.suite_budget import calibration_seconds; print(calibration_seconds())"
)


def timed(calibration_seconds) -> tuple[float, float]:  # noqa: ANN001
    """The workload's median CPU seconds and the wall seconds of the whole call (six runs, one of them untimed)."""
    started = time.perf_counter()
    cpu = calibration_seconds()
    return cpu, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=6)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs")
    seconds = []
    for _ in range(args.processes):
        done = subprocess.run([sys.executable, "-c", AS_THE_CONTROLLER], cwd=ROOT, capture_output=True, text=True,
                              check=True)  # fmt: skip
        seconds.append(float(done.stdout.split()[-1]))
    print("as the controller times it, " + ", ".join(f"{s:.4f}" for s in seconds) + " s CPU")

    from tests.suite_budget import calibration_seconds

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        alone = timed(calibration_seconds)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # inherits the one CPU
        try:
            time.sleep(0.2)
            shared = timed(calibration_seconds)
        finally:
            busy.kill()
            busy.wait()
    finally:
        os.sched_setaffinity(0, cpus)
    for name, (cpu, wall) in (("alone", alone), ("with a busy process", shared)):
        print(f"one CPU, {name}: median {cpu:.4f} s CPU a run, {wall / 6:.4f} s wall a run (of six)")


if __name__ == "__main__":
    main()
