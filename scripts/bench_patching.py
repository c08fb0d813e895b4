"""Activation patching over spatial cells: the naive loop, the runner's exact patching, attribution patching.

    python scripts/bench_patching.py                                  # VGG16, 5 layers x 7x7 cells, 128 px, CPU
    python scripts/bench_patching.py --size 224 --device cuda         # on a GPU

(a) naive loop: one full forward per cell, batch of one pair (as the transformer libraries' helpers do)
(b) runner, exact: variants stacked along the batch in chunks, the unpatched prefix run at batch 1
(c) runner, attribution: every cell's first-order estimate from one clean+corrupted forward and one backward
Also one plain forward of the pair, so that (c) reads in forward passes. Prints seconds, cells/s, ratios.
"""

from __future__ import annotations

import argparse

import torch
from benchtools import pick_device, timed
from torch import nn

from runner.data import Batch
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import Runtime, build_method
from runner.methods.patching import enumerate_units
from runner.models import build_model
from runner.schema import MethodConfig, ModelConfig, PatchingConfig, PatchMode, PatchUnit, Precision


def runner_patching(model: nn.Module, layers, x: torch.Tensor, runtime: Runtime, mode: PatchMode, chunk: int | None):
    cfg = MethodConfig(
        name="patching", patching=PatchingConfig(units=PatchUnit.cell, grid=[7, 7], mode=mode, chunk=chunk)
    )
    method = build_method(cfg, layers, runtime)
    batch = Batch(x, torch.tensor([-1], device=x.device), ["pair"], 0)
    session = HookSession(model, []).__enter__()
    method.setup(session, 1)

    def run() -> object:
        session.begin_batch(1, 0)
        return method.run_batch(model, batch, session).tables["patching"]["patched"].cpu()

    return run


def naive_loop(model: nn.Module, layers, x: torch.Tensor, corrupted: torch.Tensor):
    """Per layer: clean activation once, then one full batch-1 forward of the corrupted input per cell."""

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

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg16")
    parser.add_argument(
        "--layers", nargs="*", default=["features.4", "features.9", "features.16", "features.23", "features.30"]
    )
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=None, help="variants per forward (default: automatic)")
    parser.add_argument("--repeat", type=int, default=3)
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

    pair = torch.cat([x, corrupted])
    seconds = {
        "one forward of the pair": timed(lambda: model(pair), device, args.repeat),
        "naive loop (1 forward/cell)": timed(naive_loop(model, layers, x, corrupted), device, args.repeat),
        "runner exact": timed(
            runner_patching(model, layers, x, runtime, PatchMode.exact, args.chunk), device, args.repeat
        ),
        "runner attribution": timed(
            runner_patching(model, layers, x, runtime, PatchMode.attribution, args.chunk), device, args.repeat
        ),
    }
    print(f"model={args.model} layers={len(layers)} cells={cells} size={args.size} device={device} "
          f"precision={args.precision} torch={torch.__version__} threads={torch.get_num_threads()}")  # fmt: skip
    naive = seconds["naive loop (1 forward/cell)"]
    forward = seconds["one forward of the pair"]
    print(f"{'contender':30s} {'seconds':>9s} {'cells/s':>9s} {'vs naive':>9s} {'forwards':>9s}")
    for name, s in seconds.items():
        rate = f"{cells / s:9.1f}" if name != "one forward of the pair" else f"{'':>9s}"
        print(f"{name:30s} {s:9.4f} {rate} {naive / s:8.1f}x {s / forward:9.2f}")


if __name__ == "__main__":
    main()
