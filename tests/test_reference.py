"""Each method against an independent reference on the real embedded model (EfficientNet-Lite0 with its
ImageNet weights) at a few layers, so that a regression in any of them shows.

Small inputs (64 px, batch 2) keep the whole file well under a minute on 2 CPU cores. Each section
states its tolerance and why.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import skimage.data
import torch
import torch.nn.functional as F
import torchvision.transforms as T
from captum.attr import LayerGradCam
from PIL import Image
from scipy.stats import spearmanr
from torch import nn

from runner.data.base import Batch
from runner.hooks import HookSession, count_hooks, inplace_disabled
from runner.layers import resolve_layers
from runner.methods import build_method
from runner.metrics import curves as faithfulness
from runner.models import build_model
from runner.options.method.cam import FaithfulnessConfig
from runner.options.method.sanity import SanityConfig
from runner.schema import ModelConfig, ScoreCamWeights, TargetMode
from tests.test_cam_family import CPU, run_method
from tests.test_gradcam import maps_of

# ---- CAM family, faithfulness, sanity ----------------------------------------------------------------
# Three depths of EfficientNet-Lite0 at 64 px: 8x8 (40 channels), 4x4 (112), 2x2 (1280, the last conv).
LAYERS = ["_blocks.3", "_blocks.10", "_conv_head"]


@pytest.fixture(scope="module")
def effnet() -> nn.Module:
    """The embedded EfficientNet-Lite0 with its shipped ImageNet weights, frozen, in eval mode."""
    return build_model(ModelConfig(name="efficientnet_lite0", weights="embedded")).model


@pytest.fixture(scope="module")
def photos() -> torch.Tensor:
    """(2, 3, 64, 64): chelsea the cat and the coffee cup, squashed to 64 px, ImageNet-normalised (by hand)."""
    to_input = T.Compose([T.Resize((64, 64)), T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    return torch.stack(
        [to_input(Image.fromarray(skimage.data.chelsea())), to_input(Image.fromarray(skimage.data.coffee()))]
    )


def peer_raw_maps(
    name: str, model: nn.Module, x: torch.Tensor, targets: list[int], names: list[str] = LAYERS
) -> dict[str, torch.Tensor]:
    """pytorch-grad-cam's map per layer at the layer's resolution, before its min-max scaling and resize.

    All layers `names` from one of its passes; its `get_cam_image` is its per-layer map (ReLU is its next step).
    It backpropagates into the weights, so it gets its own copy with gradients on and in-place ops off.
    """
    pytest.importorskip("pytorch_grad_cam", reason="the dev extra installs grad-cam")
    import pytorch_grad_cam
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    from tests.test_cam_vs_pytorch_grad_cam import PEERS

    peers = {**PEERS, "scorecam": pytorch_grad_cam.ScoreCAM, "eigencam": pytorch_grad_cam.EigenCAM}
    peer = copy.deepcopy(model)
    for p in peer.parameters():
        p.requires_grad_(name not in ("scorecam", "eigencam"))
    layers = [peer.get_submodule(n) for n in names]
    wanted = [ClassifierOutputTarget(t) for t in targets]
    out = {}
    with inplace_disabled(peer), peers[name](model=peer, target_layers=layers) as cam:
        if name in ("scorecam", "eigencam"):
            with torch.no_grad():
                cam.activations_and_grads(x)  # forward only: what a gradient-free method reads
        else:
            cam(input_tensor=x, targets=wanted)  # forward and its backward: activations and gradients
        acts, grads = cam.activations_and_grads.activations, cam.activations_and_grads.gradients
        for i, (layer_name, layer) in enumerate(zip(names, layers, strict=True)):
            g = grads[i].numpy() if grads else None
            out[layer_name] = torch.from_numpy(cam.get_cam_image(x, layer, wanted, acts[i].numpy(), g, False)).float()
    return out


def assert_maps_close(ours: torch.Tensor, theirs: torch.Tensor, rel: float) -> None:
    """Maps equal to `rel` of the reference map's maximum (float32 sums over channels in another order)."""
    scale = float(theirs.abs().max())
    assert scale > 0, "a reference map that is all zero compares nothing"
    assert float((ours - theirs).abs().max()) <= rel * scale


# Tolerance per method, relative to each map's maximum. Grad-CAM, XGrad-CAM, HiResCAM, LayerCAM: 1e-5
# (measured <= 4e-7: float32 sums in another order). Grad-CAM++: 3e-4 (measured 6.4e-5 at _blocks.10):
# its alpha's denominator 2g^2 + sum(A) g^3 cancels by up to 1000x there, so float32 rounding is
# amplified; in float64 the same formula on pytorch-grad-cam's own activations and gradients is 5e-5
# away from pytorch-grad-cam's float32 numbers, so neither side is wrong.
GRADIENT_CAMS = {"gradcam": 1e-5, "gradcampp": 3e-4, "xgradcam": 1e-5, "hirescam": 1e-5, "layercam": 1e-5}


@pytest.mark.parametrize("name", sorted(GRADIENT_CAMS))
def test_gradient_cams_equal_pytorch_grad_cam(name: str, effnet: nn.Module, photos: torch.Tensor) -> None:
    """Maps at the layer's resolution, before pytorch-grad-cam's scaling; tolerances in GRADIENT_CAMS."""
    ours = run_method(effnet, photos, LAYERS, name=name)
    theirs = peer_raw_maps(name, effnet, photos, ours["target"][:2].tolist())
    for layer in LAYERS:
        assert_maps_close(maps_of(ours, layer), torch.relu(theirs[layer]), GRADIENT_CAMS[name])


def test_scorecam_pytorch_grad_cam_weights_equal_pytorch_grad_cam(effnet: nn.Module, photos: torch.Tensor) -> None:
    """`method.scorecam_weights=pytorch_grad_cam` gives its numbers. Tolerance 1e-4 of the maximum: the
    masked inputs go through the model in other batches (16 there, 64 here), and the softmax of logits
    amplifies their float32 differences (measured: <= 2e-6)."""
    layers = LAYERS[:1]  # 40 channels: 40 masked forwards a side (the last conv's 1280 would take minutes)
    x = photos[:1]  # one photo: each costs a masked forward per channel on each side
    ours = run_method(effnet, x, layers, name="scorecam", scorecam_weights=ScoreCamWeights.pytorch_grad_cam)
    theirs = peer_raw_maps("scorecam", effnet, x, ours["target"][:1].tolist(), layers)
    for layer in layers:
        assert_maps_close(maps_of(ours, layer), torch.relu(theirs[layer]), 1e-4)
    paper = run_method(effnet, x, layers, name="scorecam")  # the default weights are not the peer's
    assert float((maps_of(paper, layers[0]) / maps_of(paper, layers[0]).amax() -
                  torch.relu(theirs[layers[0]]) / torch.relu(theirs[layers[0]]).amax()).abs().max()) > 1e-3  # fmt: skip


def test_eigencam_equals_pytorch_grad_cam_up_to_the_documented_sign(effnet: nn.Module, photos: torch.Tensor) -> None:
    """The peer keeps LAPACK's sign; the runner flips the component to correlate positively with the
    channel sum of the activations (runner/methods/eigencam.py). Tolerance 1e-4 of the maximum: SVDs
    from different LAPACK calls (numpy float32 there, torch here)."""
    ours = run_method(effnet, photos, LAYERS, name="eigencam")
    theirs = peer_raw_maps("eigencam", effnet, photos, ours["target"][:2].tolist())
    acts: dict[str, torch.Tensor] = {}
    handles = [effnet.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: acts.__setitem__(n, o.clone()))
               for n in LAYERS]  # fmt: skip
    try:
        effnet(photos)
    finally:
        for h in handles:
            h.remove()
    for layer in LAYERS:
        projection = theirs[layer].flatten(1)  # (B, HW)
        total = acts[layer].sum(dim=1).flatten(1)  # (B, HW) channel sum
        sign = torch.sign(((total - total.mean(1, keepdim=True)) * projection).sum(1, keepdim=True))  # (B, 1)
        expected = torch.relu(projection * sign).reshape(theirs[layer].shape)
        assert_maps_close(maps_of(ours, layer), expected, 1e-4)


def test_gradcam_equals_captum_layer_gradcam(effnet: nn.Module, photos: torch.Tensor) -> None:
    """Tolerance 1e-5 of the maximum (measured: <= 1e-6)."""
    ours = run_method(effnet, photos, LAYERS, name="gradcam")
    targets = ours["target"][:2].tolist()
    for layer in LAYERS:
        captum = LayerGradCam(effnet, effnet.get_submodule(layer)).attribute(photos, target=targets)  # (B, 1, h, w)
        assert_maps_close(maps_of(ours, layer), torch.relu(captum.squeeze(1)).detach(), 1e-5)


def test_sanity_spearman_equals_scipy(effnet: nn.Module, photos: torch.Tensor) -> None:
    """Per (layer, sample) rho between the trained and the randomised model's maps equals
    scipy.stats.spearmanr of the same two maps (NaN where scipy's is). Tolerance 1e-6 absolute."""
    layers = LAYERS[1:]
    cfg = SanityConfig(randomize=["_conv_head", "_bn1", "_fc"])
    method = build_method(cfg, resolve_layers(effnet, layers), CPU)
    batch = Batch(photos, torch.full((2,), -1), ["chelsea", "coffee"], 0)
    before = {k: v.clone() for k, v in effnet.state_dict().items()}
    with HookSession(effnet, []) as session:
        method.setup(session, 2)
        session.begin_batch(2, 0)
        rows = method.run_batch(effnet, batch, session).tables["sanity"]
    assert all(torch.equal(before[k], v) for k, v in effnet.state_dict().items())
    # The run's model is the trained one again; the randomised model rebuilt by hand: the listed layers' modules
    # reset in order after one seed (method.faithfulness.seed).
    assert count_hooks(effnet) == 0
    trained = run_method(effnet, photos, layers, name="gradcam")
    targets = trained["target"][:2].tolist()
    clone = copy.deepcopy(effnet)
    torch.manual_seed(cfg.faithfulness.seed)
    for name in cfg.randomize:
        for sub in clone.get_submodule(name).modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
    randomised = run_method(clone, photos, layers, name="gradcam", target=TargetMode.fixed, class_ids=targets)
    rhos = []
    for layer in layers:
        for a, b in zip(maps_of(trained, layer), maps_of(randomised, layer), strict=True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # scipy warns on a constant map, and answers NaN
                rhos.append(spearmanr(a.flatten().numpy(), b.flatten().numpy()).statistic)
    assert 0 < np.isnan(rhos).sum() < len(rhos)  # here a randomised 2x2 map is all zero: both paths are checked
    np.testing.assert_allclose(rows["spearman"].numpy(), np.array(rhos, dtype=np.float64), atol=1e-6)
    np.testing.assert_array_equal(rows["degenerate"].numpy(), np.isnan(rhos))


def test_deletion_auc_equals_a_plain_loop(effnet: nn.Module, photos: torch.Tensor) -> None:
    """Deletion AUC per (layer, sample) from a loop of single-image forwards: pixels zeroed in numpy lexsort
    order (saliency descending, ties by the seeded per-sample key), trapezoid over `steps` + 1 points.
    Tolerance 1e-5 absolute: batched and single-image forwards differ in float32 rounding."""
    cfg = FaithfulnessConfig(enabled=True, steps=5, seed=3)
    layers = LAYERS[1:2]  # 4x4, upsampled 16x: forwards at one layer keep this test short
    ours = run_method(effnet, photos, layers, name="gradcam", faithfulness=cfg)
    got = ours["faithfulness"].values[:, ours["faithfulness"].names.index("deletion_auc")]  # (L*B,)
    pixels = 64 * 64
    keys = faithfulness.tie_keys(cfg.seed, [0, 1], pixels, torch.device("cpu")).numpy()  # (B, P)
    expected = []
    for layer in layers:
        maps = maps_of(ours, layer)  # (B, h, w) at the layer's resolution
        up = F.interpolate(maps[:, None], size=(64, 64), mode="bilinear", align_corners=False)[:, 0]
        lo, hi = up.flatten(1).amin(1)[:, None, None], up.flatten(1).amax(1)[:, None, None]
        saliency = ((up - lo) / (hi - lo)).flatten(1).numpy()  # (B, P) in [0, 1]
        for b in range(2):
            order = np.lexsort((keys[b], -saliency[b]))
            target = int(ours["target"][b])
            curve = []
            for k in range(cfg.steps + 1):
                image = photos[b].clone().reshape(3, pixels)
                image[:, order[: round(k / cfg.steps * pixels)]] = 0
                with torch.no_grad():
                    curve.append(float(effnet(image.reshape(1, 3, 64, 64)).softmax(1)[0, target]))
            expected.append(np.trapezoid(curve, np.linspace(0, 1, cfg.steps + 1)))
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)
    assert not ours["degenerate"].any()  # these maps are real rankings, so the comparison means something


# ---- patching (appended by the patching section) -----------------------------------------------------
# Patching rows against one full forward per patched unit at batch 1 (what TransformerLens-style helpers
# do): the runner batches variants, reuses the prefix at batch 1 and carries cells as cones where it can.


def plain_patching_loop(
    model: nn.Module, layer: str, base_input: torch.Tensor, base: torch.Tensor, source: torch.Tensor,
    cells: list[tuple[int, int, int, int]], target: int,
) -> torch.Tensor:  # fmt: skip
    """(cells,) target logit with `layer`'s output (1, C, h, w) = base, one cell (y0, y1, x0, x1) from source."""
    out = []
    for y0, y1, x0, x1 in cells:
        patched = base.clone()
        patched[:, :, y0:y1, x0:x1] = source[:, :, y0:y1, x0:x1]
        handle = model.get_submodule(layer).register_forward_hook(lambda m, a, o, p=patched: p)
        try:
            with torch.no_grad():
                out.append(model(base_input)[0, target])
        finally:
            handle.remove()
    return torch.stack(out)


def test_patching_equals_one_forward_per_unit(effnet: nn.Module, photos: torch.Tensor) -> None:
    """Chelsea against coffee, both directions, every cell of two depths (4x4 at _blocks.5, 2x2 at
    _conv_head). Tolerance 1e-4 absolute on target logits of about 36 (measured: 3.1e-5 on `patched`,
    7e-7 on `restoration`): float32 forwards at other batch sizes round differently."""
    from runner.data.base import Batch
    from runner.hooks import HookSession
    from runner.layers import resolve_layers
    from runner.methods import build_method
    from runner.methods.patching import (
        CorruptionConfig,
        CorruptionKind,
        PatchDirection,
        PatchingConfig,
        PatchingMethodConfig,
    )

    layers = ["_blocks.5", "_conv_head"]
    directions = [PatchDirection.denoising, PatchDirection.noising]
    corruption = CorruptionConfig(kind=CorruptionKind.pair, pair_with="coffee")
    cfg = PatchingMethodConfig(patching=PatchingConfig(corruption=corruption, directions=directions))
    method = build_method(cfg, resolve_layers(effnet, layers), CPU)
    method.bind_dataset([(photos[0], -1, "chelsea"), (photos[1], -1, "coffee")])
    clean, corrupted = photos[:1], photos[1:]  # (1, 3, 64, 64) each
    with HookSession(effnet, []) as session:
        method.setup(session, 1)
        session.begin_batch(1, 0)
        rows = method.run_batch(effnet, Batch(clean, torch.tensor([-1]), ["chelsea"], 0), session).tables["patching"]
    acts: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
    handles = [effnet.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: acts[n].append(o.clone()))
               for n in layers]  # fmt: skip
    try:
        with torch.no_grad():
            logits = torch.cat([effnet(clean), effnet(corrupted)])  # (2, 1000)
    finally:
        for h in handles:
            h.remove()
    target = int(logits[0].argmax())
    expected, expected_restoration = [], []
    for direction in directions:
        base_input = corrupted if direction is PatchDirection.denoising else clean
        for layer in layers:
            clean_act, corrupted_act = acts[layer]  # (1, C, h, w) each
            denoising = direction is PatchDirection.denoising
            base, source = (corrupted_act, clean_act) if denoising else (clean_act, corrupted_act)
            h, w = base.shape[-2:]  # grids of 7x7 are capped at the map: one cell per position
            cells = [(y, y + 1, x, x + 1) for y in range(h) for x in range(w)]
            patched = plain_patching_loop(effnet, layer, base_input, base, source, cells, target)
            expected.append(patched)
            expected_restoration.append((patched - logits[1, target]) / (logits[0, target] - logits[1, target]))
    assert rows["target"].unique().tolist() == [target]
    torch.testing.assert_close(rows["patched"], torch.cat(expected), rtol=0, atol=1e-4)
    torch.testing.assert_close(rows["restoration"], torch.cat(expected_restoration), rtol=0, atol=1e-4)
    assert float(torch.cat(expected).std()) > 0.1  # cells differ: the comparison has teeth
