"""Evaluation metrics: the runner (runner/metrics, batched over layers and samples) vs Quantus 0.6.0 on the same
maps, model and settings.

    cd scripts && ../.venv/bin/python bench_metrics.py [--quick] [--size 224] [--rounds 3] [--metrics road,...]

Maps: Grad-CAM (the runner's) of the embedded EfficientNet-Lite0 at the seven layers of gradcam_effnet on the six
scikit-image photos, upsampled to the input and scaled to [0, 1]. Each contender has its own model copy; rounds
are interleaved (scripts/benchtools.py). Quantus gets one call per layer (its a_batch: the photos' maps of that
layer); the runner one call for all layers. Settings are Quantus's defaults unless --quick (fewer steps, 64 px).
ROAD runs on the photos in grey through a model that repeats the channel (as tests/test_metrics.py: Quantus
0.6.0's ROAD indexes a one-channel map over C*H*W pixels and fails on RGB), with noise 0.01 in both (Quantus's default): the values then differ by the noise draws, not the times.

Like for like: the runner is timed on the layers' maps only (no random maps). Per metric it prints the forwards
each side runs per map (the runner's ROAD runs MoRF and LeRF, Quantus's ROAD MoRF only: twice the forwards and
imputations) and the speed-up per forward (Quantus's seconds per forward over the runner's). Two lines bound what
batching alone can give: forward img/s at batch 1 (Quantus's ROAD), 6 (one call's photos) and the runner's chunk;
and, for ROAD, the imputation alone (--imputation-only: just that line): Quantus's (scipy spsolve, one image) vs
the runner's two solvers (direct, per image; batched CG), per image, with each one's largest difference from Quantus.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchtools import Contender, close_all, interleaved, pick_device, report, synchronize  # noqa: E402

from runner.chunks import forward_chunk  # noqa: E402
from runner.data.base import Batch, build_dataset  # noqa: E402
from runner.hooks import HookSession  # noqa: E402
from runner.layers import resolve_layers  # noqa: E402
from runner.methods import build_method, method_config  # noqa: E402
from runner.metrics import (  # noqa: E402
    EvaluationConfig,
    MetricInputs,
    load_metrics,
)
from runner.metrics.faithfulness_family import noisy_linear_imputation  # noqa: E402
from runner.models import build_model  # noqa: E402
from runner.options.data.skimage_photos import SkimagePhotosConfig  # noqa: E402
from runner.runtime import Runtime
from runner.schema import ModelConfig, Precision  # noqa: E402
from runner.stats import upsample

LAYERS = ["_blocks.1", "_blocks.3", "_blocks.5", "_blocks.8", "_blocks.11", "_blocks.15", "_conv_head"]


def photos_and_maps(model: nn.Module, size: int, runtime: Runtime) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x (B, 3, S, S), target (B,), maps (L, B, S, S)): the photos, the predicted classes, Grad-CAM per layer."""
    data = build_dataset(SkimagePhotosConfig(image_size=size), None, 0)
    x = torch.stack([data[i][0] for i in range(len(data))]).to(runtime.device)
    method = build_method(method_config("gradcam"), resolve_layers(model, LAYERS), runtime)
    batch = Batch(x, torch.full((x.shape[0],), -1), [str(i) for i in range(x.shape[0])], 0)
    with HookSession(model, []) as session:
        method.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        rows = method.run_batch(model, batch, session).tables["cam"]
    flat, lengths = rows["map"].values, rows["map"].lengths
    maps = [
        upsample(m.reshape(1, h, w), (size, size))[0]
        for m, h, w in zip(flat.split(lengths), rows["map_height"], rows["map_width"], strict=True)
    ]
    target = rows["target"][: x.shape[0]]
    return x, target, torch.stack(maps).reshape(len(LAYERS), x.shape[0], size, size)


def quantus_metric(name: str, cfg: EvaluationConfig) -> Callable[..., object]:
    """The Quantus metric with the runner's settings."""
    import quantus

    if name == "sparseness":
        return quantus.Sparseness(disable_warnings=True)
    if name == "complexity":
        return quantus.Complexity(disable_warnings=True)
    if name == "road":
        return quantus.ROAD(percentages=cfg.road_percentages, noise=cfg.road_noise, disable_warnings=True)
    if name == "faithfulness_correlation":
        return quantus.FaithfulnessCorrelation(
            nr_runs=cfg.faithfulness_correlation_runs,
            subset_size=cfg.faithfulness_correlation_subset_size,
            perturb_baseline=cfg.faithfulness_correlation_baseline,
            disable_warnings=True,
        )
    if name == "region_perturbation":
        return quantus.RegionPerturbation(
            patch_size=cfg.region_size, regions_evaluation=cfg.region_steps, perturb_baseline=cfg.region_baseline,
            disable_warnings=True,
        )  # fmt: skip
    raise ValueError(f"no Quantus peer for {name}")


class Gray(nn.Module):
    """A one-channel model: the image repeated into the three channels of the wrapped one."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.expand(-1, 3, -1, -1))  # (B, 1, H, W) -> (B, 3, H, W)


def forwards_per_map(name: str, cfg: EvaluationConfig) -> tuple[int, int]:
    """(Quantus's, the runner's) model forwards per map (each one image; the runner batches them by its chunk)."""
    steps = {
        "road": (len(cfg.road_percentages), 2 * len(cfg.road_percentages)),  # the runner: MoRF and LeRF
        "faithfulness_correlation": (1 + cfg.faithfulness_correlation_runs,) * 2,  # the unperturbed one + runs
        "region_perturbation": (1 + cfg.region_steps,) * 2,
    }
    return steps.get(name, (0, 0))


@torch.no_grad()
def forward_rates(model: nn.Module, x: torch.Tensor, batches: list[int], device: torch.device) -> str:
    """Forward img/s of `model` at each batch size (best of 3): how much batching alone buys on this device."""
    out = []
    for b in batches:
        xb = x.repeat(-(-b // x.shape[0]), 1, 1, 1)[:b]  # (b, C, S, S)
        model(xb)  # warm-up
        best = float("inf")
        for _ in range(3):
            synchronize(device)
            start = time.perf_counter()
            model(xb)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        out.append(f"batch {b}: {b / best:.1f}")
    return "forward img/s, " + ", ".join(out)


def imputation_line(x: torch.Tensor, maps: torch.Tensor, cfg: EvaluationConfig, percentages: list[float]) -> None:
    """Seconds per image of the imputation alone, MoRF on the first layer's maps: Quantus (scipy spsolve, one image
    at a time), the runner's direct solve (SuperLU, factorised once per image, the road_solver CPU default) and its
    batched CG (all photos at once, at cfg.road_tolerance; the accelerator default); the largest difference of
    each from Quantus's values."""
    from quantus.functions.perturb_func import noisy_linear_imputation as peer

    n, _, h, w = x.shape
    order = maps.flatten(1).argsort(dim=1, descending=True, stable=True)  # (B, HW)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(h * w, device=x.device).expand(n, -1))
    for p in percentages:
        removed = (rank < int(h * w * p / 100)).reshape(n, h, w)  # (B, H, W)
        start = time.perf_counter()
        theirs = [
            peer(x[i].cpu().numpy().astype(np.float64), np.flatnonzero(removed[i].cpu().numpy()), noise=0.0)
            for i in range(n)
        ]
        seconds = {"quantus": (time.perf_counter() - start) / n}
        reference = torch.from_numpy(np.stack(theirs))  # (B, C, H, W) float64
        error, converged = {}, True
        for solver in ["direct", "cg"]:
            synchronize(x.device)
            start = time.perf_counter()
            out, ok = noisy_linear_imputation(
                x.double(), removed, None, cfg.road_tolerance, cfg.road_max_iterations, solver
            )  # (B, C, H, W)
            synchronize(x.device)
            seconds[solver] = (time.perf_counter() - start) / n
            error[solver] = float((out.cpu() - reference).abs().amax())
            converged &= ok
        print(
            f"imputation {p:4.0f}% removed, s/image: quantus {seconds['quantus']:.3f}, runner direct"
            f" {seconds['direct']:.3f} (x{seconds['quantus'] / seconds['direct']:.2f}), runner cg {seconds['cg']:.3f}"
            f" (x{seconds['quantus'] / seconds['cg']:.2f}); max |runner - quantus| direct {error['direct']:.1e},"
            f" cg {error['cg']:.1e} (tolerance {cfg.road_tolerance:g}; converged {converged})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 px, fewer steps, one round: a smoke run")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--metrics", default="sparseness,complexity,road,faithfulness_correlation,region_perturbation")
    parser.add_argument("--imputation-only", action="store_true", help="only ROAD's imputation line (no metrics)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    size, rounds = (64, 1) if args.quick else (args.size, args.rounds)
    device = pick_device(args.device)
    runtime = Runtime(device, Precision.fp32)
    cfg = EvaluationConfig()
    chunk = forward_chunk(cfg.chunk, torch.device(device), (size, size))  # the runner's default for this device
    if args.quick:
        cfg.road_percentages = [10.0, 50.0, 90.0]
        cfg.faithfulness_correlation_runs = 10
        cfg.region_steps = 10
    base = build_model(ModelConfig(name="efficientnet_lite0", weights="embedded")).model.to(device)
    x, target, maps = photos_and_maps(copy.deepcopy(base), size, runtime)
    n_layers, b = maps.shape[:2]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; {b} photos at {size} px,"
        f" {n_layers} layers; median of {rounds} interleaved rounds; the runner without random maps"
    )
    imputation_percentages = [5.0, 50.0, 95.0] if not args.quick else [10.0, 90.0]
    if args.imputation_only:
        imputation_line(x, maps[0], cfg, imputation_percentages)
        return
    print(forward_rates(copy.deepcopy(base).eval(), x, sorted({1, b, chunk, 64}), device))
    for name in args.metrics.split(","):
        model, xm = (Gray(base).eval(), x.mean(dim=1, keepdim=True)) if name == "road" else (base, x)
        ours_model, their_model = copy.deepcopy(model), copy.deepcopy(model)
        metric = load_metrics()[name](cfg)
        inputs = MetricInputs(
            ours_model, xm.repeat(n_layers, 1, 1, 1), target.repeat(n_layers), torch.arange(b).repeat(n_layers),
            None, runtime, 0, chunk,
        )  # fmt: skip
        peer = quantus_metric(name, cfg)
        x_np, y_np = xm.cpu().numpy(), target.cpu().numpy()
        a_np = maps[:, :, None].cpu().numpy()  # (L, B, 1, S, S)

        def runner_call(metric=metric, inputs=inputs) -> object:  # noqa: ANN001
            with torch.no_grad():
                return metric.compute(inputs, maps.reshape(-1, size, size))

        def quantus_call(peer=peer, model=their_model, x_np=x_np, y_np=y_np, a_np=a_np) -> object:  # noqa: ANN001
            return [
                peer(model=model, x_batch=x_np, y_batch=y_np, a_batch=a_np[i].copy(), device=str(device))
                for i in range(n_layers)
            ]

        contenders = [
            Contender("quantus " + name, quantus_call, their_model),
            Contender("runner " + name, runner_call, ours_model),
        ]
        print(f"\n{name}")
        timings = interleaved(contenders, device, reference="quantus " + name, rounds=rounds, warmup=0)
        report(timings, per_call=n_layers * b, unit="maps/s")
        theirs_fw, ours_fw = forwards_per_map(name, cfg)
        if ours_fw:
            per_forward = (timings.median("quantus " + name) / theirs_fw) / (timings.median("runner " + name) / ours_fw)
            print(
                f"forwards per map: quantus {theirs_fw}, runner {ours_fw}; speed-up per forward x{per_forward:.2f}"
                f" (whole call x{1 / timings.ratio('runner ' + name):.2f})"
            )
        if name == "road":
            imputation_line(x, maps[0], cfg, imputation_percentages)
        close_all(contenders)
        np.random.seed(0)


if __name__ == "__main__":
    main()
