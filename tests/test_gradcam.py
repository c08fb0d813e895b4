"""Grad-CAM: equal to captum's LayerGradCam and to a hand-built reference, at every layer from one pass."""

from __future__ import annotations

import pytest
import torch
from captum.attr import LayerGradCam
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import build_method, method_config_class
from runner.runtime import Runtime
from runner.schema import Precision, TargetMode

CPU = Runtime(torch.device("cpu"), Precision.fp32)


def run_gradcam(model: nn.Module, x: torch.Tensor, layers: list[str], **method: object) -> dict:
    cfg = method_config_class("gradcam")(**method)
    gradcam = build_method(cfg, resolve_layers(model, layers), CPU)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{i}" for i in range(x.shape[0])], 0)
    with HookSession(model, []) as session:
        gradcam.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        out = gradcam.run_batch(model, batch, session)
    return out.tables["cam"]


def maps_of(columns: dict, layer: str) -> torch.Tensor:
    """(B, H, W) maps of one layer out of the ragged map column."""
    rows = [i for i, name in enumerate(columns["layer"]) if name == layer]
    h, w = columns["map_height"][rows[0]], columns["map_width"][rows[0]]
    lengths = columns["map"].lengths
    start = sum(lengths[: rows[0]])
    return columns["map"].values[start : start + len(rows) * h * w].reshape(len(rows), h, w)


def reference_gradcam(prefix: nn.Module, suffix: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Grad-CAM by hand: split the network at the layer, differentiate the suffix w.r.t. the activation."""
    with torch.no_grad():
        act = prefix(x)
    act = act.clone().requires_grad_(True)
    score = suffix(act.clone()).gather(1, target[:, None]).sum()  # clone: the suffix may start with ReLU(inplace)
    (grad,) = torch.autograd.grad(score, act)
    return torch.relu((grad.mean(dim=(2, 3), keepdim=True) * act).sum(1)).detach()


def vgg_split(vgg: nn.Module, k: int) -> tuple[nn.Module, nn.Module]:
    prefix = vgg.features[: k + 1]
    suffix = nn.Sequential(vgg.features[k + 1 :], vgg.avgpool, nn.Flatten(1), vgg.classifier)
    return prefix, suffix


def test_matches_hand_built_reference_at_every_vgg_conv(vgg16: nn.Module) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    columns = run_gradcam(vgg16, x, ["features.*:Conv2d"])
    target = columns["target"][:2]
    assert target.tolist() == vgg16(x).argmax(1).tolist()  # default target: the predicted class
    for k in (0, 10, 28):
        expected = reference_gradcam(*vgg_split(vgg16, k), x, target)
        torch.testing.assert_close(maps_of(columns, f"features.{k}"), expected, rtol=1e-4, atol=1e-6)
    assert len(set(columns["layer"])) == 13


@pytest.mark.parametrize("layer", ["features.26", "features.28"])  # 28: a conv followed by ReLU(inplace=True)
def test_equals_captum_layer_gradcam(vgg16: nn.Module, layer: str) -> None:
    torch.manual_seed(2)
    x = torch.randn(3, 3, 32, 32)
    columns = run_gradcam(vgg16, x, [layer])
    ours = maps_of(columns, layer)
    captum = LayerGradCam(vgg16, vgg16.get_submodule(layer)).attribute(x, target=columns["target"][:3].tolist())
    captum = torch.relu(captum.squeeze(1)).detach()  # (B, H, W), captum's map before its own normalisation
    assert captum.abs().max() > 0
    assert (ours - captum).abs().max() < 1e-5


def test_no_weight_gradients_are_computed(vgg16: nn.Module) -> None:
    run_gradcam(vgg16, torch.randn(1, 3, 32, 32), ["features.28"])
    assert all(p.grad is None for p in vgg16.parameters())


def test_fixed_targets() -> None:
    torch.manual_seed(0)
    from tests.conftest import TinyNet, frozen

    model = frozen(TinyNet())
    x = torch.randn(2, 3, 8, 8)
    columns = run_gradcam(model, x, ["features.2"], target=TargetMode.fixed, class_ids=[3])
    assert columns["target"].tolist() == [3, 3]
    torch.testing.assert_close(columns["score"], model(x)[:, 3])


def test_fixed_targets_must_match_the_data(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match="3 ids but the data set has 2 samples"):
        run_gradcam(vgg16, torch.randn(2, 3, 32, 32), ["features.28"], target=TargetMode.fixed, class_ids=[1, 2, 3])


def test_label_target_needs_labels(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match="no label: s0, s1"):
        run_gradcam(vgg16, torch.randn(2, 3, 32, 32), ["features.28"], target=TargetMode.label)


def test_non_spatial_layer_is_a_clear_error(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match=r"spatial.*classifier\.0.*Linear"):
        run_gradcam(vgg16, torch.randn(2, 3, 32, 32), ["classifier.0"])
