"""`runner plan [overrides]`: a run's memory plan before any weight loads (runner/plan.py): its edges, readers and
forwards, each phase's memory terms, and the peak against the device's free memory.

The model's config (its modules on the meta device), its tokenizer and the data are read; no weights. Exit 0 when
the run fits, 1 when it would not (the settings that would fit are printed), 2 with one line for bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runner.errors import RunnerError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="runner plan",
        description="A run's memory plan from the model's config alone (no weights load): edges, readers, forwards,"
        " each phase's memory and the peak against the device's free memory. Takes the run's overrides, e.g."
        " `runner plan experiment=ioi_edges_smollm2 data.batch_size=4`; --free GB plans for a device with that much"
        " free memory (e.g. a GPU elsewhere).",
    )
    parser.add_argument("--free", type=float, metavar="GB", help="free memory to plan against (default: the device's)")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for a run (key=value)")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    from runner.app import resolve_device
    from runner.commands.layers import compose
    from runner.configure import to_run_config
    from runner.plan import GB, fitting, plan_lines, prepare, run_plan

    if args.free is not None and args.free <= 0:
        raise RunnerError(f"--free {args.free}: give the free memory in GB, above 0.")
    torch.set_num_threads(1)
    config = to_run_config(compose(args.overrides))
    device = resolve_device(config.device)
    free = None if args.free is None else int(args.free * GB)
    prepared = prepare(config)
    plan = run_plan(config, device, free, prepared)
    print("\n".join(plan_lines(plan)))
    if plan.fits:
        return 0
    settings = fitting(config, plan, prepared)
    print("fits with: " + ("; ".join(settings) if settings else "none of a smaller batch, chunk or dtype"))
    return 1
