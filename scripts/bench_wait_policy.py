"""OpenMP's wait policy where processes share the CPUs, and where a process is alone on them (runner/cpu_sharing.py).

    .venv/bin/python scripts/bench_wait_policy.py [--rounds 3]

1. The README's joblib sweep (four jobs of gradcam_effnet at debug=tiny, `hydra.launcher.n_jobs=4`, `threads: null`)
   as the runner runs it (its sweep sets OMP_WAIT_POLICY=PASSIVE for workers that would oversubscribe the CPUs), and
   with `threads=1` (one thread a worker: nothing to wait for): wall and the children's CPU seconds, one run each.
2. Why the policy is not set for every run: one process alone on its CPUs, MobileNetV3-small forward and backward
   (batch 2, 224 px, every CPU's threads, 3 untimed then 30 timed iterations), OpenMP's default against PASSIVE, each
   in a fresh process (libgomp reads the policy when torch loads it), interleaved over `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=4", "experiment=gradcam_effnet",
         "method=gradcam,layercam", "seed=0,1", "debug=tiny", "progress=false"]  # fmt: skip
LONE = """
import time, torch, torchvision
torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
m = torchvision.models.mobilenet_v3_small().eval()
x = torch.randn(2, 3, 224, 224, requires_grad=True)
for _ in range(3):
    m(x).sum().backward()
t = time.perf_counter()
for _ in range(30):
    m(x).sum().backward()
print(time.perf_counter() - t)
"""


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def sweep(extra: list[str], folder: Path) -> tuple[float, float]:
    """Wall and CPU seconds of the sweep with `extra` overrides into `folder` (it must succeed)."""
    started, cpu = time.perf_counter(), children_cpu()
    done = subprocess.run([sys.executable, "-m", "runner", *SWEEP, *extra, f"hydra.sweep.dir={folder}"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the sweep failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started, children_cpu() - cpu


def lone(policy: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", LONE], env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"{platform.processor() or platform.machine()}, {cpus} CPUs, python {platform.python_version()}")
    if "OMP_WAIT_POLICY" in os.environ:
        sys.exit("unset OMP_WAIT_POLICY first: the runner keeps a policy the user set")
    with tempfile.TemporaryDirectory() as scratch:
        for name, extra in (("as the runner runs it", []), ("threads=1", ["threads=1"])):
            wall, cpu = sweep(extra, Path(scratch) / name.replace(" ", "_").replace("=", ""))
            print(f"joblib sweep, {name}: {wall:.1f} s wall, {cpu:.0f} CPU-s")
    times: dict[str, list[float]] = {"default": [], "PASSIVE": []}
    for _ in range(args.rounds):
        for policy in times:
            times[policy].append(lone(None if policy == "default" else policy))
    for policy, seconds in times.items():
        print(
            f"one process, {cpus} threads, {policy}: {min(seconds):.2f}-{max(seconds):.2f} s over {args.rounds} rounds"
        )


if __name__ == "__main__":
    main()
