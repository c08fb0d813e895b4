"""The memory plan (`runner plan`, runner/plan.py) against the measured peak of the same run.

    python scripts/plan_memory.py                           # every case below, peak resident memory
    python scripts/plan_memory.py --cases smollm2:4 llama:8x512x8x2
    python scripts/plan_memory.py --allocator               # the random Llamas against torch's allocator

Cases: `smollm2:N` and `gemma3:N`, experiment ioi_edges_smollm2 / ioi_edges_gemma3 with data.n_pairs=N in one batch
of N (the real packaged models, converted into the runner's cache first: the plan converts them); `llama:LxWxHxK`, a
random Llama from the shipped induction model's config (model.weights=null with model.config's overrides: layers x
width x query heads x key-value heads, the MLP 4x as wide, heads W/H wide) on its 32 pairs in batches of 16. Each run
is the whole run (runner.app.run: both passes, every table) with the experiment's method settings.

Measured, by default: the peak resident memory of the run as its own process (`python -m runner OVERRIDES`: its
VmHWM as it exits), against the plan on the CPU (the process, the tokenizer, the weights and the
method's phases as resident memory holds them). With --allocator: the peak of the bytes torch's CPU allocator holds
during the run in this process (the profiler's allocation events; runner/models/memory.py `peak_bytes`), against the
plan's tensors alone. Prints per case the planned peak, its phase, the measured peak and the plan's error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runner.app import run  # noqa: E402
from runner.commands.layers import compose  # noqa: E402
from runner.configure import to_run_config  # noqa: E402
from runner.models.memory import PEAK_RSS_PROBE, peak_bytes  # noqa: E402
from runner.plan import GB, run_plan  # noqa: E402

LLAMAS = ("llama:4x256x8x4", "llama:8x512x8x2", "llama:6x768x12x4")
CASES = ("smollm2:4", "smollm2:16", "smollm2:32", "gemma3:4", "gemma3:16", *LLAMAS)
SCORING_ONLY = ["method.edges.fractions=[]", "method.edges.circuit=[]", "method.edges.top_k=0"]


def overrides(case: str, mode: str | None) -> list[str]:
    kind, _, value = case.partition(":")
    mode_override = [f"method.edges.mode={mode}"] if mode else []
    if kind in ("smollm2", "gemma3"):
        n = int(value)
        return [f"experiment=ioi_edges_{kind}", f"data.n_pairs={n}", f"data.batch_size={n}", *mode_override,
                "progress=false"]  # fmt: skip
    if kind != "llama":
        raise SystemExit(f"{case}: a case is smollm2:N, gemma3:N or llama:LxWxHxK")
    layers, width, heads, kv = (int(v) for v in value.split("x"))
    return [
        "experiment=edges_lm_induction", "model.weights=null", f"+model.config.num_hidden_layers={layers}",
        f"+model.config.hidden_size={width}", f"+model.config.num_attention_heads={heads}",
        f"+model.config.num_key_value_heads={kv}", f"+model.config.head_dim={width // heads}",
        f"+model.config.intermediate_size={4 * width}", *mode_override, "data.batch_size=16", "progress=false",
    ]  # fmt: skip


def peak_rss(arguments: list[str]) -> int:
    """The peak resident memory (bytes) of `python -m runner ARGUMENTS` run as its own process, into a temporary
    directory."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", PEAK_RSS_PROBE, *arguments, f"hydra.run.dir={out}"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if done.returncode != 0 or "PEAK_RSS_KIB" not in done.stderr:
        raise SystemExit(f"runner {' '.join(arguments)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return int(done.stderr.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", help=f"default: {' '.join(CASES)} ({' '.join(LLAMAS)} with --allocator)")
    parser.add_argument("--mode", help="method.edges.mode (default: the experiment's)")
    parser.add_argument("--allocator", action="store_true", help="torch's allocator's peak, in this process")
    parser.add_argument("--scoring-only", action="store_true", help="no circuits, no checked edges")
    parser.add_argument("overrides", nargs="*", help="more of the run's overrides (key=value)")
    args = parser.parse_args()
    more = [*args.overrides, *(SCORING_ONLY if args.scoring_only else [])]
    cases = args.cases or list(LLAMAS if args.allocator else CASES)
    torch.set_num_threads(1)
    what = "torch's allocator" if args.allocator else "peak RSS"
    print(f"{'case':<18}{'planned GB':>11}  {'phase':<14}{f'measured GB ({what})':>32}{'error':>8}")
    for case in cases:
        arguments = [*overrides(case, args.mode), *more]
        config = to_run_config(compose(arguments))
        plan = run_plan(config, torch.device("cpu"), free=2**60)  # converts a packaged model first, once
        if args.allocator:
            planned, phase = plan.tensors, plan.method.peak.name
            with tempfile.TemporaryDirectory() as out:
                _, measured = peak_bytes(lambda config=config, out=out: run(config, out), torch.device("cpu"))
        else:
            planned, phase = plan.peak, plan.peak_phase.name
            measured = peak_rss(arguments)
        error = planned / measured - 1
        print(f"{case:<18}{planned / GB:>11.3f}  {phase:<14}{measured / GB:>32.3f}{error:>+8.1%}", flush=True)


if __name__ == "__main__":
    main()
