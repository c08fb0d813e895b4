"""EigenCAM's projection: the full SVD it used before issue 12 vs the top eigenvector of the smaller Gram matrix.

    cd scripts && ../.venv/bin/python bench_eigencam.py [--rounds 11]

Interleaved (old, new per round), median of the rounds, at two layer shapes: EfficientNet-Lite0's head at
224 px (8, 1280, 7, 7) and a VGG16 block-3 conv at 224 px (8, 512, 28, 28). Both give the same maps
(tests/test_device_paths.py checks 1e-5); this only times them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runner.methods.cam import CamContext  # noqa: E402
from runner.methods.eigencam import EigenCAM  # noqa: E402
from runner.options.method.eigencam import EigenCamConfig

CPU = torch.device("cpu")


def full_svd_eigencam(act: torch.Tensor) -> torch.Tensor:
    """EigenCAM before issue 12 (full SVD of the centred (HW, C) matrix): (B, C, H, W) -> (B, H, W)."""
    b, c, h, w = act.shape
    points = act.reshape(b, c, h * w).transpose(1, 2)  # (B, HW, C)
    centred = points - points.mean(dim=1, keepdim=True)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # vh: (B, k, C)
    projection = (centred @ vh[:, 0, :, None]).squeeze(2)  # (B, HW)
    reference = points.sum(dim=2) - points.sum(dim=2).mean(dim=1, keepdim=True)  # (B, HW)
    sign = torch.sign((projection * reference).sum(dim=1, keepdim=True))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return torch.relu(projection * sign).reshape(b, h, w)


def runner_eigencam(act: torch.Tensor) -> torch.Tensor:
    method = EigenCAM(EigenCamConfig(), [], CPU)
    context = CamContext(nn.Identity(), torch.zeros(act.shape[0], 3, 8, 8), torch.zeros(1), CPU)
    return method.cam(act, None, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds")
    print(f"{'shape':>20}  {'full SVD ms':>12}  {'Gram eigh ms':>12}  {'speed-up':>8}  max |diff| / max")
    for shape in [(8, 1280, 7, 7), (8, 512, 28, 28)]:
        act = torch.relu(torch.randn(*shape))
        old_map, new_map = full_svd_eigencam(act), runner_eigencam(act)  # warm-up, and the maps compared
        diff = float((old_map - new_map).abs().max() / old_map.abs().max())
        old, new = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            full_svd_eigencam(act)
            t1 = time.perf_counter()
            runner_eigencam(act)
            new.append(time.perf_counter() - t1)
            old.append(t1 - t0)
        o, n = statistics.median(old) * 1e3, statistics.median(new) * 1e3
        print(f"{str(shape):>20}  {o:12.1f}  {n:12.1f}  {o / n:7.1f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
