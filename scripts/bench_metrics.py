"""Evaluation metrics: the runner (runner/metrics, batched over layers and samples) vs Quantus 0.6.0 on the same
maps, model and settings.

    cd scripts && ../.venv/bin/python bench_metrics.py [--quick] [--size 224] [--rounds 3] [--metrics road,...]

Maps: Grad-CAM (the runner's) of the embedded EfficientNet-Lite0 at the seven layers of gradcam_effnet on the six
scikit-image photos, upsampled to the input and scaled to [0, 1]. Each contender has its own model copy; rounds
are interleaved (scripts/benchtools.py). Quantus gets one call per layer (its a_batch: the photos' maps of that
layer); the runner one call for all layers. Settings are Quantus's defaults unless --quick (fewer steps, 64 px).
ROAD runs with noise 0.01 in both (Quantus's default): the values then differ by the noise draws, not the times.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchtools import Contender, close_all, interleaved, pick_device, report  # noqa: E402

from runner import faithfulness  # noqa: E402
from runner.data import Batch, SkimagePhotosConfig, build_dataset  # noqa: E402
from runner.hooks import HookSession  # noqa: E402
from runner.layers import resolve_layers  # noqa: E402
from runner.methods import build_method, method_config  # noqa: E402
from runner.methods.base import Runtime  # noqa: E402
from runner.metrics import EvaluationConfig, MetricInputs, load_metrics  # noqa: E402
from runner.models import build_model  # noqa: E402
from runner.schema import ModelConfig, Precision  # noqa: E402

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
        faithfulness.upsample(m.reshape(1, h, w), (size, size))[0]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 px, fewer steps, one round: a smoke run")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--metrics", default="sparseness,complexity,road,faithfulness_correlation,region_perturbation")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    size, rounds = (64, 1) if args.quick else (args.size, args.rounds)
    device = pick_device(args.device)
    runtime = Runtime(device, Precision.fp32)
    cfg = EvaluationConfig(chunk=64)
    if args.quick:
        cfg.road_percentages = [10.0, 50.0, 90.0]
        cfg.faithfulness_correlation_runs = 10
        cfg.region_steps = 10
    base = build_model(ModelConfig(name="efficientnet_lite0", weights="embedded")).model.to(device)
    x, target, maps = photos_and_maps(copy.deepcopy(base), size, runtime)
    n_layers, b = maps.shape[:2]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; {b} photos at {size} px,"
        f" {n_layers} layers; median of {rounds} interleaved rounds"
    )
    for name in args.metrics.split(","):
        ours_model, their_model = copy.deepcopy(base), copy.deepcopy(base)
        metric = load_metrics()[name](cfg)
        inputs = MetricInputs(
            ours_model, x.repeat(n_layers, 1, 1, 1), target.repeat(n_layers), torch.arange(b).repeat(n_layers),
            None, runtime, 0,
        )  # fmt: skip
        peer = quantus_metric(name, cfg)
        x_np, y_np = x.cpu().numpy(), target.cpu().numpy()
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
        close_all(contenders)
        np.random.seed(0)


if __name__ == "__main__":
    main()
