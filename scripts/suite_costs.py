"""Two of the test suite's costs, measured the way the suite pays them.

    .venv/bin/python scripts/suite_costs.py [--repeats 3]

- warm: a tiny `python -m runner` run (TinyNet on synthetic data, debug=tiny) started cold as a subprocess, and
  forked by the tests' warm server (tests/warm_python.py), timed in turns; median wall seconds each, and the CPU
  seconds of the cold processes.
- loop: test_lm_sites' plain reference over every site of the tiny Llama, denoising, on one thread: one forward per
  cell (patched_metric) against one forward per site and layer (patched_metrics), timed in turns; median seconds
  each, and each one's largest gap to the runner's rows.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import lm_references, test_lm_sites, warm_python  # noqa: E402

TINY = ["model._target_=tests.nets.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
        "data.num_classes=5", "debug=tiny", "progress=false", "method.pictures=false"]  # fmt: skip


def cold(out: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one cold process."""
    os.environ["RUNNER_COLD_PROCESSES"] = "1"  # tests.conftest, imported here with test_lm_sites, would serve it
    try:
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "runner", *TINY, f"hydra.run.dir={out}"], cwd=ROOT,
                              capture_output=True, text=True)  # fmt: skip
        wall = time.perf_counter() - start
    finally:
        del os.environ["RUNNER_COLD_PROCESSES"]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the cold run failed:\n{done.stderr[-2000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def warm(server: warm_python.Server, out: Path) -> float:
    """Wall seconds of one child forked by the server."""
    request = {"module": "runner", "args": [*TINY, f"hydra.run.dir={out}"], "unbuffered": False, "cwd": str(ROOT),
               "env": dict(os.environ), "new_session": False}  # fmt: skip
    with open(os.devnull, "w") as null:
        start = time.perf_counter()
        _, status = server.fork(request, [null.fileno()] * 3)
        code = os.waitstatus_to_exitcode(int(status.recv(64)))
        wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the served run exited {code}")
    return wall


def loops(repeats: int) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        model, tokenizer, _ = lm_references.build_tiny_lm("llama", seed=0, folder=folder)

    def one_each(model, arch, ids, site, layer, source, cells, metric):  # noqa: ANN001, ANN202
        return torch.stack([lm_references.patched_metric(model, arch, ids, site, layer, source, p, h, metric)
                            for p, h in cells])  # fmt: skip

    contenders = {"one forward per cell": one_each, "one per site and layer": lm_references.patched_metrics}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    worst: dict[str, float] = {}
    for _ in range(repeats):
        for name, reference in contenders.items():
            test_lm_sites.patched_metrics = reference
            start = time.perf_counter()
            worst[name], compared = test_lm_sites._worst_against_the_loop("llama", model, tokenizer, "denoising")
            times[name].append(time.perf_counter() - start)
    test_lm_sites.patched_metrics = lm_references.patched_metrics
    for name in contenders:
        print(f"loop, {name}: {statistics.median(times[name]):.2f} s (runner's own rows included), {compared} rows, "
              f"worst |runner - loop| {worst[name]:.1e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    server = warm_python.Server.get()
    walls: dict[str, list[float]] = {"cold": [], "warm": []}
    cpu: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(repeats):
            wall, seconds = cold(Path(folder) / f"cold{i}")
            walls["cold"].append(wall)
            cpu.append(seconds)
            walls["warm"].append(warm(server, Path(folder) / f"warm{i}"))
    print(f"warm: a tiny run started cold {statistics.median(walls['cold']):.2f} s ({statistics.median(cpu):.2f} s "
          f"of CPU), forked by the server {statistics.median(walls['warm']):.2f} s; median of {repeats}")  # fmt: skip
    loops(repeats)


if __name__ == "__main__":
    main()
