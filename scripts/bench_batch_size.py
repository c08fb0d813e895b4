"""Forward img/s of the embedded EfficientNet-Lite0 at several batch sizes: how large a batch pays on this device.

    cd scripts && ../.venv/bin/python bench_batch_size.py [--size 224] [--device cpu]

The default chunk of perturbed forwards (runner.chunks.forward_chunk) follows from it: on a 2-core CPU a
batch of 64 images at 224 px ran 2.5x slower per image than one of 8 (benchmarks/RESULTS.md, issue 14).
"""

from __future__ import annotations

import argparse
import time

import torch
from benchtools import busy_text, gpu_busy

from runner.models import build_model
from runner.schema import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,4,8,16,32,64")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(ModelConfig()).model.eval().to(device)
    torch.manual_seed(0)
    with torch.inference_mode():
        for b in (int(v) for v in args.batches.split(",")):
            x = torch.randn(b, 3, args.size, args.size, device=device)
            model(x)  # warm-up
            reps = max(2, 64 // b)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(reps):
                model(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / reps
            busy = gpu_busy({"forward": lambda x=x: model(x)}, device).get("forward")
            gpu = f"   GPU busy {busy_text(busy)}" if busy is not None else ""
            print(f"batch {b:4d}: {b / seconds:8.1f} img/s{gpu}", flush=True)


if __name__ == "__main__":
    main()
