"""The memory plan (`runner plan`, runner/plan.py) against the measured peak of the same run, on random Llamas of
several sizes built from the shipped induction model's config (model.weights=null with model.config's overrides)
and its 32 pairs, through the run itself (runner.app.run: both passes, every table).

    python scripts/plan_memory.py                      # three sizes, eap_ig
    python scripts/plan_memory.py --mode eap --sizes 4x512x8x4
    python scripts/plan_memory.py --scoring-only         # no circuits or checked edges: the scoring pass's peak

Measured: the peak of the bytes torch's CPU allocator holds during the run (the profiler's allocation events;
runner/models/memory.py `peak_bytes`), the weights included (they load inside the run). Prints per size the planned
peak, its phase, the measured peak and the plan's error.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runner.app import run  # noqa: E402
from runner.commands.layers import compose  # noqa: E402
from runner.configure import to_run_config  # noqa: E402
from runner.models.memory import peak_bytes  # noqa: E402
from runner.plan import GB, run_plan  # noqa: E402

# layers x width x heads x key-value heads; the MLP 4x as wide, heads 64 wide where the width allows
SIZES = ("4x256x8x4", "8x512x8x2", "6x768x12x4")
SCORING_ONLY = ["method.edges.fractions=[]", "method.edges.circuit=[]", "method.edges.top_k=0"]


def overrides(size: str, mode: str, batch: int) -> list[str]:
    layers, width, heads, kv = (int(v) for v in size.split("x"))
    return [
        "experiment=edges_lm_induction", "model.weights=null", f"+model.config.num_hidden_layers={layers}",
        f"+model.config.hidden_size={width}", f"+model.config.num_attention_heads={heads}",
        f"+model.config.num_key_value_heads={kv}", f"+model.config.head_dim={width // heads}",
        f"+model.config.intermediate_size={4 * width}", f"method.edges.mode={mode}", f"data.batch_size={batch}",
        "progress=false",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--mode", default="eap_ig")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--scoring-only", action="store_true", help="no circuits, no checked edges")
    parser.add_argument("overrides", nargs="*", help="more of the run's overrides (key=value)")
    args = parser.parse_args()
    more = [*args.overrides, *(SCORING_ONLY if args.scoring_only else [])]
    torch.set_num_threads(1)
    print(f"{'size':<12}{'planned GB':>11}  {'phase':<22}{'measured GB':>12}{'error':>8}")
    for size in args.sizes:
        config = to_run_config(compose([*overrides(size, args.mode, args.batch), *more]))
        plan = run_plan(config, torch.device("cpu"), free=2**60)
        with tempfile.TemporaryDirectory() as out:
            _, measured = peak_bytes(lambda config=config, out=out: run(config, out), torch.device("cpu"))
        error = plan.peak / measured - 1
        print(f"{size:<12}{plan.peak / GB:>11.3f}  {plan.method.peak.name:<22}{measured / GB:>12.3f}{error:>+8.1%}")


if __name__ == "__main__":
    main()
