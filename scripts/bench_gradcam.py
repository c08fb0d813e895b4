"""Grad-CAM at L layers: the hand-written floor, the runner, captum and pytorch-grad-cam, side by side.

    python scripts/bench_gradcam.py                                   # EfficientNet-Lite0, 7 layers, batch 8, CPU
    python scripts/bench_gradcam.py --model vgg16 --batch 64 --size 224 --precision bf16   # on a GPU

(a) floor: one forward with plain hooks, one torch.autograd.grad to the L activations, the CAM arithmetic
(b) runner: the GradCAM method through the hook session, rows moved to the host (what a run adds per batch)
(c) captum LayerGradCam, once per layer (it takes one layer per call)
(d) pytorch-grad-cam GradCAM, once per layer (for per-layer maps; it averages layers otherwise)
Peers get the model as their users do (parameters requiring grad); the floor and the runner freeze it.
Prints seconds per batch (median of --repeat), images/s, and each one's ratio to the floor.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from benchtools import pick_device, timed
from torch import nn

from runner.data import Batch
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import Runtime, build_method
from runner.models import build_model
from runner.results import to_host
from runner.schema import MethodConfig, ModelConfig, Precision

LAYERS = {
    "efficientnet_lite0": [
        "_blocks.1",
        "_blocks.3",
        "_blocks.5",
        "_blocks.8",
        "_blocks.11",
        "_blocks.15",
        "_conv_head",
    ],
    "vgg16": ["features.*:Conv2d"],
    "resnet50": ["layer1", "layer2", "layer3", "layer4"],
}


def floor(model: nn.Module, layers: list[tuple[str, nn.Module]], x: torch.Tensor, autocast) -> Callable[[], object]:
    """Grad-CAM written by hand the fast way: frozen weights, one forward, one autograd.grad to the activations."""

    def run() -> list[torch.Tensor]:
        acts: list[torch.Tensor] = []

        def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            out = out if out.requires_grad else out.detach().requires_grad_()
            acts.append(out)
            return out.clone()  # the next in-place ReLU must not overwrite the kept activation

        handles = [m.register_forward_hook(keep) for _, m in layers]
        try:
            with torch.enable_grad(), autocast():
                logits = model(x).float()
            target = logits.argmax(dim=1)
            score = logits.gather(1, target[:, None]).sum()
            grads = torch.autograd.grad(score, acts)
            return [
                torch.relu((g.float().mean((2, 3), keepdim=True) * a.float()).sum(1))
                for a, g in zip(acts, grads, strict=True)
            ]
        finally:
            for h in handles:
                h.remove()

    return run


def runner_gradcam(model: nn.Module, layers, x: torch.Tensor, runtime: Runtime) -> Callable[[], object]:
    method = build_method(MethodConfig(name="gradcam"), layers, runtime)
    batch = Batch(x, torch.full((x.shape[0],), -1, device=x.device), [str(i) for i in range(x.shape[0])], 0)
    session = HookSession(model, []).__enter__()
    method.setup(session, x.shape[0])

    def run() -> object:
        session.begin_batch(x.shape[0], 0)
        out = method.run_batch(model, batch, session)
        session.end_batch()
        return to_host(out.tables["cam"])

    run.close = session.close  # type: ignore[attr-defined]
    return run


def captum_per_layer(model: nn.Module, layers, x: torch.Tensor, autocast) -> Callable[[], object]:
    from captum.attr import LayerGradCam

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            target = model(x).argmax(dim=1)
        maps = []
        for _, module in layers:
            with autocast():
                maps.append(LayerGradCam(model, module).attribute(x, target=target.tolist(), relu_attributions=True))
        return maps

    return run


def pytorch_grad_cam_per_layer(model: nn.Module, layers, x: torch.Tensor) -> Callable[[], object]:
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    def run() -> list[object]:
        with torch.no_grad():
            target = model(x).argmax(dim=1).tolist()
        maps = []
        for _, module in layers:
            with GradCAM(model=model, target_layers=[module]) as cam:
                maps.append(cam(input_tensor=x, targets=[ClassifierOutputTarget(t) for t in target]))
        return maps

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0", choices=sorted(LAYERS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip", nargs="*", default=[], help="peers to leave out: captum pytorch-grad-cam")
    args = parser.parse_args()

    device = pick_device(args.device)
    torch.manual_seed(0)
    weights = "embedded" if args.model == "efficientnet_lite0" else None  # offline: torchvision weights are random here
    model = build_model(ModelConfig(name=args.model, weights=weights)).model.to(device)
    layers = resolve_layers(model, LAYERS[args.model])
    peer_model = copy.deepcopy(model)
    for p in peer_model.parameters():
        p.requires_grad_(True)  # how peers' users hold a model
    peer_layers = [(n, peer_model.get_submodule(n)) for n, _ in layers]
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    runtime = Runtime(device, Precision(args.precision))

    contenders: dict[str, Callable[[], object]] = {
        "floor (hand-written)": floor(model, layers, x, runtime.autocast),
        "runner": runner_gradcam(model, layers, x, runtime),
    }
    if "captum" not in args.skip:
        contenders["captum LayerGradCam x L"] = captum_per_layer(peer_model, peer_layers, x, runtime.autocast)
    if "pytorch-grad-cam" not in args.skip:
        try:
            contenders["pytorch-grad-cam x L"] = pytorch_grad_cam_per_layer(peer_model, peer_layers, x)
        except ImportError:
            print("pytorch-grad-cam not installed (pip install grad-cam): left out")
    print(f"model={args.model} layers={len(layers)} batch={args.batch} size={args.size} precision={args.precision} "
          f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")  # fmt: skip
    seconds = {name: timed(fn, device, args.repeat) for name, fn in contenders.items()}
    base = seconds["floor (hand-written)"]
    print(f"{'contender':28s} {'s/batch':>9s} {'img/s':>9s} {'x floor':>8s}")
    for name, s in seconds.items():
        print(f"{name:28s} {s:9.4f} {args.batch / s:9.1f} {s / base:8.2f}")
    peers = [s for n, s in seconds.items() if n not in ("floor (hand-written)", "runner")]
    if peers:
        print(f"runner vs. fastest peer: {min(peers) / seconds['runner']:.2f}x faster")


if __name__ == "__main__":
    main()
