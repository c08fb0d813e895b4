"""Grad-CAM at L layers: floors, the runner, torchcam, captum and pytorch-grad-cam, interleaved, each on its own model.

    python scripts/bench_gradcam.py                                   # EfficientNet-Lite0, 7 layers, batch 8, 224 px, CPU
    python scripts/bench_gradcam.py --model vgg16 --size 64           # VGG16, 13 convs, batch 8, 64 px, CPU
    python scripts/bench_gradcam.py --model vgg16 --batch 128 --size 224 --precision bf16 --skip captum pytorch-grad-cam

Contenders (each on its own deep copy of the model; see scripts/benchtools.py for the hook checks and the timing):
  plain forward        one forward under no_grad: what any of them costs at least
  tight floor          in-place ops switched off on its copy, forward hooks keep the L outputs (no clones), one
                       torch.autograd.grad to them, the CAM arithmetic: the least work for exact maps
  old floor            the earlier hand-written floor: hooks registered per call, each activation cloned
  runner               the `gradcam` method through the hook session, rows moved to the host as a run moves them
  torchcam 1 forward   torchcam 0.5.0 GradCAM(model, target_layer=[all L]), targets from the same forward
  torchcam README      the same with the targets from an extra no-grad forward, maps normalised (its defaults)
  captum x L           LayerGradCam, once per layer (it takes one layer per call)
  pytorch-grad-cam x L GradCAM once per layer (for per-layer maps; it averages layers otherwise)
Peers get the model as their users hold it (parameters requiring grad); floors and the runner freeze it.
Before timing, the maps of the first --check-batch images (8) are compared, each contender on its own model copy:
every contender's against captum's at each layer (torchcam is known to be
wrong after an in-place ReLU, since it keeps a reference to the conv output that the ReLU then overwrites).
"""

from __future__ import annotations

import argparse
import copy

import torch
from benchtools import Contender, close_all, interleaved, pick_device, report
from torch import nn

from runner.data.base import Batch
from runner.hooks import HookSession, count_hooks, disable_inplace
from runner.host_copy import HostCopy, column_tensors, with_tensors
from runner.layers import resolve_layers
from runner.methods import Runtime, build_method, method_config_class
from runner.models import build_model
from runner.rows import Ragged, to_host
from runner.schema import ModelConfig, Precision

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
CHECK_LAYER = {"vgg16": "features.28"}  # the conv whose output an in-place ReLU overwrites; target: captum +- 1e-5
PEERS = ("torchcam", "captum", "pytorch-grad-cam")
Layers = list[tuple[str, nn.Module]]


def own_copy(model: nn.Module, names: list[str], trainable: bool = False) -> tuple[nn.Module, Layers]:
    """A deep copy of the model (parameters requiring grad if `trainable`, as peers' users hold a model)."""
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        p.requires_grad_(trainable)
    return copied, [(n, copied.get_submodule(n)) for n in names]


def grad_cams(acts: list[torch.Tensor], grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Grad-CAM's arithmetic: ReLU(sum_c mean_hw(dA_c) A_c), one (B, H, W) map per layer."""
    return [
        torch.relu((g.float().mean((2, 3), keepdim=True) * a.detach().float()).sum(1))  # (B, H, W)
        for a, g in zip(acts, grads, strict=True)
    ]


def target_score(logits: torch.Tensor) -> torch.Tensor:
    """Sum over the batch of each sample's top logit (Grad-CAM explains the predicted class)."""
    logits = logits.float()  # (B, K)
    return logits.gather(1, logits.argmax(dim=1, keepdim=True)).sum()


def plain_forward(model: nn.Module, x: torch.Tensor, autocast) -> Contender:
    """One forward, no gradients."""

    @torch.no_grad()
    def run() -> torch.Tensor:
        with autocast():
            return model(x)

    return Contender("plain forward (no grad)", run, model)


def tight_floor(model: nn.Module, layers: Layers, x: torch.Tensor, autocast) -> Contender:
    """In-place ops off on this copy for good, resident hooks keeping the outputs themselves, one autograd.grad."""
    disable_inplace(model)  # its own copy: nothing else runs on it, so nothing to restore
    acts: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if out.requires_grad:
            acts.append(out)  # no clone: with in-place ops off, nothing later overwrites it
            return None
        out = out.detach().requires_grad_()  # the first hooked layer of a frozen model: start the graph here
        acts.append(out)
        return out

    handles = [m.register_forward_hook(keep) for _, m in layers]

    def run() -> list[torch.Tensor]:
        acts.clear()
        with torch.enable_grad(), autocast():
            logits = model(x)  # (B, K)
        grads = torch.autograd.grad(target_score(logits), acts)
        maps = grad_cams(acts, grads)
        acts.clear()
        return maps

    def close() -> None:
        for h in handles:
            h.remove()

    return Contender("tight floor (in-place off, no clones)", run, model, hooks=len(layers), close=close)


def old_floor(model: nn.Module, layers: Layers, x: torch.Tensor, autocast) -> Contender:
    """The earlier hand-written floor, unchanged: hooks registered per call, each activation cloned."""

    def run() -> list[torch.Tensor]:
        acts: list[torch.Tensor] = []

        def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            out = out if out.requires_grad else out.detach().requires_grad_()
            acts.append(out)
            return out.clone()  # the next in-place ReLU must not overwrite the kept activation

        handles = [m.register_forward_hook(keep) for _, m in layers]
        try:
            with torch.enable_grad(), autocast():
                logits = model(x)
            return grad_cams(acts, torch.autograd.grad(target_score(logits), acts))
        finally:
            for h in handles:
                h.remove()

    return Contender("old floor (hand-written, clones)", run, model)


class RunnerGradcam:
    """The runner's `gradcam` method in a hook session held open on its own model."""

    def __init__(self, model: nn.Module, layers: Layers, x: torch.Tensor, runtime: Runtime) -> None:
        self.model, self.x = model, x
        self.method = build_method(method_config_class("gradcam")(), layers, runtime)
        self.batch = Batch(x, torch.full((x.shape[0],), -1, device=x.device), [str(i) for i in range(x.shape[0])], 0)
        self.session = HookSession(model, []).__enter__()
        self.method.setup(self.session, x.shape[0])

    def columns(self) -> dict:
        """One batch's `cam` table columns, still on the device."""
        self.session.begin_batch(self.x.shape[0], 0)
        out = self.method.run_batch(self.model, self.batch, self.session)
        self.session.end_batch()
        return out.tables["cam"]

    def run(self) -> object:
        """What a run adds per batch: the pass and the rows to the host, moved as a run moves them (on CUDA one
        pinned copy, runner/host_copy.py; waited for here, where a run's writer thread waits while the next batch
        computes)."""
        columns = self.columns()
        if self.x.is_cuda:
            columns = with_tensors(columns, iter(HostCopy(column_tensors(columns)).wait()))
        return to_host(columns)

    def maps(self) -> list[torch.Tensor]:
        """The per-layer maps, (B, h, w) each, from the `map` column (rows: layer-major, then sample)."""
        cols = self.columns()
        flat: Ragged = cols["map"]
        b = self.x.shape[0]
        heights, widths = cols["map_height"][::b], cols["map_width"][::b]
        sizes = [b * h * w for h, w in zip(heights, widths, strict=True)]
        parts = flat.values.split(sizes)
        return [p.reshape(b, h, w) for p, h, w in zip(parts, heights, widths, strict=True)]

    def contender(self) -> Contender:
        """As a contender whose own hooks are the session's capture hooks."""
        return Contender("runner", self.run, self.model, hooks=count_hooks(self.model), close=self.session.close)


def torchcam_gradcam(model: nn.Module, layers: Layers, x: torch.Tensor, autocast, readme: bool) -> Contender:
    """torchcam 0.5.0 GradCAM at all L layers: one extractor, one forward, one autograd.grad inside it."""
    from torchcam.methods import GradCAM

    extractor = GradCAM(model, target_layer=[n for n, _ in layers])

    def run() -> list[torch.Tensor]:
        if readme:  # the target from a forward of its own, the maps min-max normalised (the call's default)
            with torch.no_grad(), autocast():
                target = model(x).argmax(dim=1).tolist()
            with autocast():
                scores = model(x)  # (B, K)
            return extractor(class_idx=target, scores=scores.float())
        with autocast():
            scores = model(x)  # (B, K)
        return extractor(class_idx=scores.argmax(dim=1).tolist(), scores=scores.float(), normalized=False)

    name = "torchcam README (extra forward, normalised)" if readme else "torchcam (targets from the same forward)"
    return Contender(name, run, model, hooks=count_hooks(model), close=extractor.remove_hooks)


def captum_per_layer(model: nn.Module, layers: Layers, x: torch.Tensor, autocast) -> Contender:
    """captum LayerGradCam, one call per layer after a no-grad forward for the targets."""
    from captum.attr import LayerGradCam

    def run() -> list[torch.Tensor]:
        with torch.no_grad(), autocast():
            target = model(x).argmax(dim=1).tolist()
        maps = []
        for _, module in layers:
            with autocast():
                cam = LayerGradCam(model, module).attribute(x, target=target, relu_attributions=True)  # (B, 1, h, w)
            maps.append(cam[:, 0])
        return maps

    return Contender(f"captum LayerGradCam x {len(layers)}", run, model)


def pytorch_grad_cam_per_layer(model: nn.Module, layers: Layers, x: torch.Tensor) -> Contender:
    """pytorch-grad-cam GradCAM, one call per layer (maps resized to the input, in numpy)."""
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

    return Contender(f"pytorch-grad-cam x {len(layers)}", run, model)


def max_diff(maps: list[torch.Tensor], reference: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Per layer: max |map - reference| and that over max |reference|."""
    out = []
    for m, r in zip(maps, reference, strict=True):
        m, r = m.detach().float(), r.detach().float()
        diff = float((m - r).abs().max())
        out.append((diff, diff / max(float(r.abs().max()), 1e-30)))
    return out


def check_maps(names: list[str], maps: dict[str, list[torch.Tensor]], check_layer: str | None) -> None:
    """Print max map differences per layer (absolute, and relative to the reference's max): each contender against
    captum's LayerGradCam, and torchcam against the runner."""
    columns = {f"{label} - captum": max_diff(m, maps["captum"]) for label, m in maps.items() if label != "captum"}
    if "torchcam" in maps:
        columns["torchcam - runner"] = max_diff(maps["torchcam"], maps["runner"])
    print("maps: max |difference| per layer, absolute (relative to the second one's max)")
    print(f"{'layer':14s}" + "".join(f" {label:>24s}" for label in columns))
    for i, name in enumerate(names):
        print(f"{name:14s}" + "".join(f" {d[i][0]:11.2e} ({d[i][1]:8.2e})" for d in columns.values()))
    if check_layer in names:
        abs_diff, rel_diff = columns["runner - captum"][names.index(check_layer)]
        verdict = "met" if max(abs_diff, rel_diff) <= 1e-5 else "NOT met"  # relative too: random weights make tiny maps
        print(f"target: runner = captum at {check_layer} within 1e-5: {verdict} (max diff {abs_diff:.2e}, relative {rel_diff:.2e})")  # fmt: skip


def maps_on(base: nn.Module, names: list[str], x: torch.Tensor, runtime: Runtime, torchcam: bool) -> dict:
    """Each checked contender's maps of `x` (the check's slice of the batch), each on its own model copy, freed after:
    captum's reference at the timed batch size would not fit where the others do (VGG16, fp32, 128 images)."""
    autocast = runtime.autocast
    contenders = {
        "captum": captum_per_layer(*own_copy(base, names, trainable=True), x, autocast),
        "tight floor": tight_floor(*own_copy(base, names), x, autocast),
        "old floor": old_floor(*own_copy(base, names), x, autocast),
        **({"torchcam": torchcam_gradcam(*own_copy(base, names, trainable=True), x, autocast, readme=False)}
           if torchcam else {}),
    }  # fmt: skip
    try:
        maps = {label: c.fn() for label, c in contenders.items()}
        maps["runner"] = RunnerGradcam(*own_copy(base, names), x, runtime).maps()
    finally:
        close_all(list(contenders.values()))
    return maps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0", choices=sorted(LAYERS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds, each contender once per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender first")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip", nargs="*", default=[], choices=PEERS, help="peers to leave out of the timing")
    parser.add_argument("--check-batch", type=int, default=8,
                        help="images the maps are compared on before timing (the first ones of the batch): captum's"
                        " reference runs at this size, not the timed batch's")  # fmt: skip
    args = parser.parse_args()

    device = pick_device(args.device)
    torch.manual_seed(0)
    weights = "embedded" if args.model == "efficientnet_lite0" else None  # offline: torchvision weights are random here
    base = build_model(ModelConfig(name=args.model, weights=weights)).model.to(device)
    names = [n for n, _ in resolve_layers(base, LAYERS[args.model])]
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)  # (B, 3, S, S)
    runtime = Runtime(device, Precision(args.precision))
    autocast = runtime.autocast
    print(f"model={args.model} layers={len(names)} batch={args.batch} size={args.size} precision={args.precision} "
          f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} rounds={args.rounds}")  # fmt: skip

    runner = RunnerGradcam(*own_copy(base, names), x, runtime)
    contenders = [
        plain_forward(own_copy(base, names)[0], x, autocast),
        tight_floor(*own_copy(base, names), x, autocast),
        old_floor(*own_copy(base, names), x, autocast),
        runner.contender(),
    ]
    torchcam_one = None
    if "torchcam" not in args.skip:
        torchcam_one = torchcam_gradcam(*own_copy(base, names, trainable=True), x, autocast, readme=False)
        contenders.append(torchcam_one)
        contenders.append(torchcam_gradcam(*own_copy(base, names, trainable=True), x, autocast, readme=True))
    if "captum" not in args.skip:
        contenders.append(captum_per_layer(*own_copy(base, names, trainable=True), x, autocast))
    if "pytorch-grad-cam" not in args.skip:
        try:
            contenders.append(pytorch_grad_cam_per_layer(*own_copy(base, names, trainable=True), x))
        except ImportError:
            print("pytorch-grad-cam not installed (pip install grad-cam): left out")
    check_maps(names, maps_on(base, names, x[: args.check_batch], runtime, "torchcam" not in args.skip),
               CHECK_LAYER.get(args.model))  # fmt: skip

    try:
        timings = interleaved(contenders, device, reference="tight floor (in-place off, no clones)",
                              rounds=args.rounds, warmup=args.warmup)  # fmt: skip
    finally:
        close_all(contenders)
    report(timings, per_call=args.batch)
    print(
        f"runner / tight floor: {timings.ratio('runner'):.2f} (paired {timings.paired('runner'):.2f}); target <= 1.05"
    )
    old = "old floor (hand-written, clones)"
    print(f"runner / old floor: {timings.ratio('runner', old):.2f} (paired {timings.paired('runner', old):.2f})")
    if torchcam_one is not None:
        t = torchcam_one.name
        print(f"runner / torchcam (one forward): {timings.ratio('runner', t):.2f} (paired "
              f"{timings.paired('runner', t):.2f}); target <= 0.8")  # fmt: skip
    peers = {n: timings.median(n) for n in timings.seconds if n.startswith(("torchcam", "captum", "pytorch-grad-cam"))}
    if peers:
        fastest = min(peers, key=peers.__getitem__)
        print(f"fastest peer: {fastest}; runner / fastest peer: {timings.ratio('runner', fastest):.2f}")


if __name__ == "__main__":
    main()
