"""Start-up times of the `runner` command, each the median wall time of N fresh processes.

    .venv/bin/python scripts/bench_startup.py [--repeats 5]

Rows: `runner --help`, `runner --cfg job` (from the schema snapshot: one untimed call writes it first),
`runner ls DIR`, `python -c "import torch"`, `import torch` + building the default model (the embedded
EfficientNet-Lite0, as a run builds it), and a tiny run (`runner debug=tiny`: that model, 2 photos at 32 px).
The run's own overhead is the tiny run minus import + model build: the targets are 1.5 s for the first
three rows and 1 s for the overhead (issue 13).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, "-m", "runner"]  # what the `runner` console script runs, minus the script's own stub
BUILD = "from runner.models import build_model\nfrom runner.schema import ModelConfig\nbuild_model(ModelConfig())\n"


def wall(command: list[str], repeats: int, env: dict[str, str]) -> list[float]:
    """Wall seconds of `repeats` fresh processes of `command` (each must succeed)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        env = dict(os.environ)
        runs = Path(scratch) / "runs"
        tiny = [*RUNNER, "debug=tiny"]
        subprocess.run([*tiny, f"hydra.run.dir={runs / 'one'}"], cwd=ROOT, capture_output=True, env=env, check=True)
        rows = {
            "runner --help": wall([*RUNNER, "--help"], args.repeats, env),
            "runner --cfg job": wall([*RUNNER, "--cfg", "job"], args.repeats, env),
            "runner ls DIR (1 run)": wall([*RUNNER, "ls", str(runs)], args.repeats, env),
            'python -c "import torch"': wall([sys.executable, "-c", "import torch"], args.repeats, env),
            "import torch + build the model": wall([sys.executable, "-c", BUILD], args.repeats, env),
        }
        tiny_times = []
        for i in range(args.repeats):  # a fresh directory each time: a finished one would be skipped, not run
            tiny_times += wall([*tiny, f"hydra.run.dir={runs / f'tiny{i}'}"], 1, env)
        rows["runner debug=tiny (a run)"] = tiny_times
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load:.2f},"
          f" median of {args.repeats} processes")  # fmt: skip
    print(f"{'command':<34}{'median s':>10}{'min s':>9}{'max s':>9}")
    medians = {}
    for name, times in rows.items():
        medians[name] = statistics.median(times)
        print(f"{name:<34}{medians[name]:>10.2f}{min(times):>9.2f}{max(times):>9.2f}")
    overhead = medians["runner debug=tiny (a run)"] - medians["import torch + build the model"]
    print(f"{'a run over import + model build':<34}{overhead:>10.2f}   (target <= 1.0)")


if __name__ == "__main__":
    main()
