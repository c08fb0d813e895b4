"""Activation patching over spatial cells: the naive loop, the runner's exact patching, attribution patching.

    python scripts/bench_patching.py                                  # VGG16, 5 layers x 7x7 cells, 128 px, CPU
    python scripts/bench_patching.py --size 224 --device cuda         # on a GPU

(a) naive loop: one full forward per cell, batch of one pair (as the transformer libraries' helpers do)
(b) runner, exact: variants stacked along the batch in chunks, the unpatched prefix run at batch 1
(c) runner, attribution: every cell's first-order estimate from one clean+corrupted forward and one backward
Also one plain forward of the pair, so that (c) reads in forward passes. Each contender runs on its own copy of the
model, checked for foreign hooks before every call (the runner's sessions stay open on their own copies), and all
four are timed interleaved, round-robin (scripts/benchtools.py). Prints seconds (median, spread), cells/s, ratios.
"""

from __future__ import annotations

import argparse
import copy

import torch
from benchtools import Contender, close_all, interleaved, pick_device, report
from torch import nn

from runner.data.base import Batch
from runner.hooks import HookSession, count_hooks
from runner.layers import resolve_layers
from runner.methods import Runtime, build_method
from runner.methods.patching import PatchingConfig, PatchingMethodConfig, PatchMode, PatchUnit, enumerate_units
from runner.models import build_model
from runner.schema import ModelConfig, Precision


def runner_patching(
    model: nn.Module, names: list[str], x: torch.Tensor, runtime: Runtime, mode: PatchMode, chunk: int | None
) -> Contender:
    """The runner's patching method in a hook session held open on its own model."""
    layers = [(n, model.get_submodule(n)) for n in names]
    cfg = PatchingMethodConfig(patching=PatchingConfig(units=PatchUnit.cell, grid=[7, 7], mode=mode, chunk=chunk))
    method = build_method(cfg, layers, runtime)
    batch = Batch(x, torch.tensor([-1], device=x.device), ["pair"], 0)
    session = HookSession(model, []).__enter__()
    method.setup(session, 1)

    def run() -> object:
        session.begin_batch(1, 0)
        return method.run_batch(model, batch, session).tables["patching"]["patched"].cpu()

    # Cone replacements are registered on first use: resident, the session's own, counted after the warm-up.
    return Contender(f"runner {mode.value}", run, model, hooks=count_hooks(model), close=session.close, lazy=True)


def naive_loop(model: nn.Module, names: list[str], x: torch.Tensor, corrupted: torch.Tensor) -> Contender:
    """Per layer: clean activation once, then one full batch-1 forward of the corrupted input per cell."""
    layers = [(n, model.get_submodule(n)) for n in names]

    def run() -> list[float]:
        out = []
        with torch.no_grad():
            target = int(model(x).argmax())
            for name, module in layers:
                keep = {}
                h = module.register_forward_hook(lambda m, a, o: keep.setdefault("a", o.detach().clone()))
                model(x)
                h.remove()
                clean = keep["a"]
                h = module.register_forward_hook(lambda m, a, o: keep.__setitem__("c", o.detach().clone()))
                model(corrupted)
                h.remove()
                units = enumerate_units(name, tuple(clean.shape[1:]), PatchUnit.cell, [7, 7], None)
                for u in range(units.count):
                    mask = units.masks(u, u + 1, x.device)
                    patched = keep["c"] + mask * (clean - keep["c"])
                    h = module.register_forward_hook(lambda m, a, o, p=patched: p)
                    out.append(float(model(corrupted)[0, target]))
                    h.remove()
        return out

    return Contender("naive loop (1 forward/cell)", run, model)


def pair_forward(model: nn.Module, pair: torch.Tensor) -> Contender:
    """One plain forward of the (clean, corrupted) pair: the unit of the `forwards` column."""

    @torch.no_grad()
    def run() -> torch.Tensor:
        return model(pair)

    return Contender("one forward of the pair", run, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg16")
    parser.add_argument(
        "--layers", nargs="*", default=["features.4", "features.9", "features.16", "features.23", "features.30"]
    )
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=None, help="variants per forward (default: automatic)")
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds, each contender once per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per contender first")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()

    device = pick_device(args.device)
    torch.manual_seed(0)
    weights = "embedded" if args.model == "efficientnet_lite0" else None
    model = build_model(ModelConfig(name=args.model, weights=weights)).model.to(device)
    layers = resolve_layers(model, args.layers)
    runtime = Runtime(device, Precision(args.precision))
    x = torch.randn(1, 3, args.size, args.size, device=device)
    corrupted = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(device)  # std-1 noise

    with torch.no_grad():
        cells = 0
        for name, module in layers:
            keep = {}
            h = module.register_forward_hook(lambda m, a, o: keep.setdefault("a", o))
            model(x)
            h.remove()
            cells += enumerate_units(name, tuple(keep["a"].shape[1:]), PatchUnit.cell, [7, 7], None).count

    pair = torch.cat([x, corrupted])  # (2, 3, S, S)
    names = [n for n, _ in layers]
    contenders = [
        pair_forward(copy.deepcopy(model), pair),
        naive_loop(copy.deepcopy(model), names, x, corrupted),
        runner_patching(copy.deepcopy(model), names, x, runtime, PatchMode.exact, args.chunk),
        runner_patching(copy.deepcopy(model), names, x, runtime, PatchMode.attribution, args.chunk),
    ]
    print(f"model={args.model} layers={len(layers)} cells={cells} size={args.size} device={device} "
          f"precision={args.precision} torch={torch.__version__} threads={torch.get_num_threads()}")  # fmt: skip
    try:
        timings = interleaved(contenders, device, reference="one forward of the pair", rounds=args.rounds,
                              warmup=args.warmup)  # fmt: skip
    finally:
        close_all(contenders)
    report(timings, per_call=cells, unit="cells/s")  # "x ref" and "paired": in forwards of the pair
    naive = "naive loop (1 forward/cell)"
    for name in ("runner exact", "runner attribution"):
        print(f"{name}: {timings.median(naive) / timings.median(name):.1f}x faster than the naive loop "
              f"(paired {1 / timings.paired(name, naive):.1f}x), {timings.ratio(name):.2f} forwards of the pair")  # fmt: skip


if __name__ == "__main__":
    main()
