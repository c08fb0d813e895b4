"""torch.profiler traces of one Grad-CAM batch (the runner's, rows on the host) and one exact patching call.

    cd scripts && python profile_gpu.py                                      # the GPU session's sizes, on CUDA
    cd scripts && python profile_gpu.py --batch 2 --size 32 --device cpu     # a smoke run

The contenders are bench_gradcam.py's `runner` (VGG16, its 13 convs) and bench_patching.py's `runner exact` (VGG16,
5 layers of 7x7 cells), each warmed up once, then profiled for one call. Writes, to --out (default $OUT, else
./profiles): `<name>.txt` (the operators by device time, then by CPU time, and the GPU busy fraction) and
`<name>.json.gz` (a Chrome trace, for Perfetto or chrome://tracing).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
from bench_gradcam import LAYERS, RunnerGradcam, own_copy
from bench_patching import runner_patching
from benchtools import busy_text, gpu_busy, pick_device, synchronize
from torch.profiler import ProfilerActivity, profile

from runner.layers import resolve_layers
from runner.methods import Runtime
from runner.methods.patching import PatchMode
from runner.models import build_model
from runner.schema import ModelConfig, Precision

PATCH_LAYERS = ["features.4", "features.9", "features.16", "features.23", "features.30"]  # bench_patching's


def profile_one(name: str, fn: Callable[[], object], device: torch.device, out: Path, rows: int) -> None:
    """Warm `fn` up, profile one call, write its operator tables and trace; print where the time went."""
    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    with profile(activities=activities, record_shapes=False) as prof:
        fn()
        synchronize(device)
    averages = prof.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = gpu_busy({name: fn}, device).get(name)  # a separate call: the trace above keeps its own timing
    text = [f"{name}: GPU busy {busy_text(busy)}", averages.table(sort_by=sort, row_limit=rows)]
    if device.type == "cuda":
        text.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    (out / f"{name}.txt").write_text("\n\n".join(text))
    prof.export_chrome_trace(str(out / f"{name}.json.gz"))  # gzip: traces of launch-bound code are large
    print(text[0])
    print(averages.table(sort_by=sort, row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128, help="Grad-CAM images per batch")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=os.environ.get("OUT", "profiles"))
    parser.add_argument("--rows", type=int, default=40, help="operators listed per table")
    args = parser.parse_args()

    device = pick_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    base = build_model(ModelConfig(name="vgg16", weights=None)).model.to(device)
    runtime = Runtime(device, Precision(args.precision))
    print(f"vgg16 batch={args.batch} size={args.size} precision={args.precision} device={device} -> {out}")

    names = [n for n, _ in resolve_layers(base, LAYERS["vgg16"])]
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)  # (B, 3, S, S)
    gradcam = RunnerGradcam(*own_copy(base, names), x, runtime)
    try:
        profile_one("gradcam_batch", gradcam.run, device, out, args.rows)
    finally:
        gradcam.session.close()
    del gradcam, x

    one = torch.randn(1, 3, args.size, args.size, device=device)  # (1, 3, S, S): patching explains one image
    patching = runner_patching(own_copy(base, [])[0], PATCH_LAYERS, one, runtime, PatchMode.exact, None)
    try:
        profile_one("patching_call", patching.fn, device, out, args.rows)
    finally:
        if patching.close is not None:
            patching.close()


if __name__ == "__main__":
    main()
