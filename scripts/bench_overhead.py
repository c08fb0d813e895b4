"""What recording costs: a plain forward, a minimal hand-written recording hook, and the runner's `record`.

    python scripts/bench_overhead.py                      # VGG16 conv outputs and every EfficientNet-Lite0 leaf, CPU
    python scripts/bench_overhead.py --size 224 --batch 128 --precision bf16   # on a GPU

(a) plain: N batches through the model, no hooks
(b) floor: a forward hook written by hand computing the same per-sample statistics (mean, std, min,
    max, L2 norm, fraction of zeros) the fastest way we know (four reads, no temporaries), kept on the
    device, one transfer per batch
(c) fused: a forward hook written by hand around runner/fused_stats.py's one-read statistics (compiled on CUDA),
    kept on the device, one transfer per timed run (the run loop's once-a-shard copy)
(d) runner: the hook session's `record` on the same modules (the fused statistics), rows moved to the host once per
    timed run as the run loop does once a shard (runner/shard_stats.py)
Each contender runs on its own copy of the model, checked for foreign hooks before every call, and the three are
timed interleaved, round-robin (scripts/benchtools.py). Prints seconds per batch (median, spread), the overheads
over a plain forward and the ratios; the targets are (d) within 1.15x of a plain forward (VGG16, bf16, batch 128,
224 px on an H100) and within 1.1x of (b) on every EfficientNet-Lite0 leaf.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
from benchtools import Contender, interleaved, pick_device, report
from torch import nn

from runner.fused_stats import fused_stats
from runner.hooks import BoundHook, HookSession
from runner.layers import resolve_layers
from runner.models import build_model
from runner.runtime import Runtime
from runner.schema import HookKind, HookSpec, ModelConfig, Precision
from runner.shard_stats import ShardStats

SETUPS = {
    "vgg16 conv outputs": ("vgg16", ["features.*:Conv2d"]),
    "efficientnet_lite0 every leaf": ("efficientnet_lite0", None),
}


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and not list(m.children())]


def floor_hooks(layers, batch: int):
    """Hand-written: per call, six per-sample statistics stacked on the device; one transfer per batch."""
    kept: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        flat = out.detach().reshape(batch, -1)
        n = flat.shape[1]
        total = flat.sum(1, dtype=torch.float64)
        l2 = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64)
        mean = total / n
        std = (l2 * l2 / n - mean * mean).clamp_min(0).sqrt()
        lo, hi = torch.aminmax(flat, dim=1)
        zero = (flat == 0).sum(1) / n
        kept.append(torch.stack([mean, std, lo.double(), hi.double(), l2, zero.double()], 1).float())

    return kept, [m.register_forward_hook(hook) for _, m in layers]


def plain(model: nn.Module, xs: list[torch.Tensor], runtime: Runtime) -> Contender:
    """N batches through the model, no hooks."""

    @torch.no_grad()
    def run() -> None:
        for x in xs:
            with runtime.autocast():
                model(x)

    return Contender("plain", run, model)


def floor(model: nn.Module, names: list[str], xs: list[torch.Tensor], batch: int, runtime: Runtime) -> Contender:
    """The hand-written recording hooks, registered per call, one transfer per batch."""
    layers = [(n, model.get_submodule(n)) for n in names]

    def run() -> None:
        kept, handles = floor_hooks(layers, batch)
        try:
            with torch.no_grad():
                for x in xs:
                    kept.clear()
                    with runtime.autocast():
                        model(x)
                    torch.cat(kept).cpu().numpy()
        finally:
            for h in handles:
                h.remove()

    return Contender("floor", run, model)


def fused(model: nn.Module, names: list[str], xs: list[torch.Tensor], batch: int, runtime: Runtime) -> Contender:
    """Hand-written hooks around the fused statistics, kept on the device, one transfer per timed run."""
    layers = [(n, model.get_submodule(n)) for n in names]

    def run() -> None:
        kept: list[torch.Tensor] = []

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            kept.append(fused_stats(out, batch)[0])

        handles = [m.register_forward_hook(hook) for _, m in layers]
        try:
            with torch.no_grad():
                for x in xs:
                    with runtime.autocast():
                        model(x)
            torch.cat(kept).cpu().numpy()
        finally:
            for h in handles:
                h.remove()

    return Contender("fused", run, model)


def runner(model: nn.Module, names: list[str], xs: list[torch.Tensor], batch: int, runtime: Runtime) -> Contender:
    """The hook session's `record` (forward statistics), a session per call, rows to the host once per timed run."""
    layers = [(n, model.get_submodule(n)) for n in names]

    def run() -> None:
        shard = ShardStats()
        with HookSession(model, [BoundHook(HookSpec(kind=HookKind.forward), layers)]) as session, torch.no_grad():
            for i, x in enumerate(xs):
                session.begin_batch(batch, i * batch)
                with runtime.autocast():
                    model(x)
                shard.add(session.end_batch())({"sample": np.arange(i * batch, (i + 1) * batch)})
        produce = shard.flush({})
        if produce is not None:
            produce()  # the writer thread's job: waits for the one copy, builds the rows

    return Contender("runner", run, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--batches", type=int, default=3, help="batches per timed run")
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds, each contender once per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender first")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    device = pick_device(args.device)
    runtime = Runtime(device, Precision(args.precision))
    print(f"batch={args.batch} size={args.size} batches={args.batches} precision={args.precision} device={device} "
          f"torch={torch.__version__} threads={torch.get_num_threads()}")  # fmt: skip
    summary = []
    for label, (name, selectors) in SETUPS.items():
        torch.manual_seed(0)
        weights = "embedded" if name == "efficientnet_lite0" else None
        base = build_model(ModelConfig(name=name, weights=weights)).model.to(device)
        names = [n for n, _ in (resolve_layers(base, selectors) if selectors else leaves(base))]
        xs = [torch.randn(args.batch, 3, args.size, args.size, device=device) for _ in range(args.batches)]
        timings = interleaved(
            [plain(copy.deepcopy(base), xs, runtime), floor(copy.deepcopy(base), names, xs, args.batch, runtime),
             fused(copy.deepcopy(base), names, xs, args.batch, runtime),
             runner(copy.deepcopy(base), names, xs, args.batch, runtime)],
            device, reference="floor", rounds=args.rounds, warmup=args.warmup,
        )  # fmt: skip
        print(f"{label} ({len(names)} modules), seconds per batch:")
        report(timings, per_call=args.batch, divide=args.batches)
        t_plain, t_floor, t_fused, t_runner = (
            timings.median(n) / args.batches for n in ("plain", "floor", "fused", "runner")
        )
        summary.append(f"{label:32s} {len(names):7d} {t_plain:8.4f} {t_floor:8.4f} {t_fused:8.4f} {t_runner:8.4f} "
                       f"{t_floor / t_plain - 1:+7.0%} {t_fused / t_plain - 1:+7.0%} {t_runner / t_plain - 1:+8.0%} "
                       f"{t_runner / t_floor:12.2f} {timings.paired('runner'):7.2f}")  # fmt: skip
    print(f"{'setup':32s} {'modules':>7s} {'plain s':>8s} {'floor s':>8s} {'fused s':>8s} {'runner s':>8s} "
          f"{'floor+':>7s} {'fused+':>7s} {'runner+':>8s} {'runner/floor':>12s} {'paired':>7s}")  # fmt: skip
    print("\n".join(summary))


if __name__ == "__main__":
    main()
