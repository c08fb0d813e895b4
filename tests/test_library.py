"""The library functions: Grad-CAM (any CAM variant), activation patching and MPRT called on a model and a batch,
with no run directory and no Hydra, checked against independent references (pytorch-grad-cam, hand-made hooks)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from runner.errors import RunnerError
from runner.hooks import count_hooks
from runner.methods.cam import cam_maps
from runner.methods.mprt import mprt, spearman_rows
from runner.methods.patching import activation_patching
from tests.conftest import TinyNet, frozen
from tests.test_mprt import hand_maps
from tests.test_reference import assert_maps_close, peer_raw_maps


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    """torchvision's resnet18, random weights, left trainable (as a notebook's model would be), eval mode."""
    torch.manual_seed(3)
    return torchvision.models.resnet18(num_classes=10).eval()


@pytest.mark.parametrize("name", ["gradcam", "gradcampp"])
def test_cam_maps_equal_pytorch_grad_cam(name: str, resnet: nn.Module) -> None:
    """The maps at the layers' resolution, before pytorch-grad-cam's scaling; 1e-5 of the maximum."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    before = {k: v.clone() for k, v in resnet.state_dict().items()}
    layers = ["layer3", "layer4"]
    ours = cam_maps(resnet, x, layers, method=name)
    assert sorted(ours) == layers and ours["layer3"].shape == (2, 4, 4) and ours["layer4"].shape == (2, 2, 2)
    predicted = resnet(x).argmax(dim=1).tolist()
    theirs = peer_raw_maps(name, resnet, x, predicted, layers)
    for layer in layers:
        assert_maps_close(ours[layer], torch.relu(theirs[layer]), 1e-5)
    # A class given for every sample: the maps of that class, not the predicted one's.
    other = next(c for c in range(10) if c not in predicted)
    fixed = cam_maps(resnet, x, ["layer3"], method=name, target=other)
    assert_maps_close(
        fixed["layer3"], torch.relu(peer_raw_maps(name, resnet, x, [other] * 2, ["layer3"])["layer3"]), 1e-5
    )
    assert count_hooks(resnet) == 0
    assert all(torch.equal(before[k], v) for k, v in resnet.state_dict().items())
    assert all(p.grad is None for p in resnet.parameters())  # no weight gradient is written


def test_cam_maps_refuses_what_is_not_a_cam_method() -> None:
    model, x = frozen(TinyNet()), torch.randn(1, 3, 8, 8)
    with pytest.raises(RunnerError, match="not a CAM method"):
        cam_maps(model, x, ["features.2"], method="patching")
    with pytest.raises(RunnerError, match="gradcam"):
        cam_maps(model, x, ["features.2"], method="gradcma")
    with pytest.raises(RunnerError, match="outside the model's 5 classes"):
        cam_maps(model, x, ["features.2"], target=7)


def hand_patch(model: nn.Module, base: torch.Tensor, source: torch.Tensor, layer: str, channel: int) -> torch.Tensor:
    """The logits of `base` (1, C, H, W) with `layer`'s channel `channel` taken from `source`'s run: plain hooks."""
    kept: list[torch.Tensor] = []
    module = model.get_submodule(layer)
    handle = module.register_forward_hook(lambda m, a, out: kept.append(out.clone()))
    with torch.no_grad():
        model(source)
    handle.remove()

    def swap(m: nn.Module, a: object, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, channel] = kept[0][:, channel]
        return out

    handle = module.register_forward_hook(swap)
    try:
        with torch.no_grad():
            return model(base)
    finally:
        handle.remove()


def test_activation_patching_equals_a_hand_patch() -> None:
    """Denoising, one channel at a time: each row's `patched` is the target's logit of the corrupted run with that
    channel of the clean run put in, as plain hooks compute it; restoration is (patched - corrupted) / span."""
    torch.manual_seed(5)
    model = frozen(TinyNet())
    clean, corrupted = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    rows = activation_patching(model, clean, ["features.0"], corrupted, units="channel", metric="logit", min_span=0.0)
    assert len(rows) == 2 * 6 and set(rows["direction"]) == {"denoising"}
    target = model(clean).argmax(dim=1)
    for i in range(2):
        for channel in range(6):
            row = rows[(rows.sample_index == i) & (rows.channel == channel)].iloc[0]
            logits = hand_patch(model, corrupted[i : i + 1], clean[i : i + 1], "features.0", channel)
            assert row["target"] == target[i]
            assert row["patched"] == pytest.approx(float(logits[0, target[i]]), abs=1e-5)
        mine = rows[rows.sample_index == i]
        clean_logit, corrupted_logit = float(model(clean)[i, target[i]]), float(model(corrupted)[i, target[i]])
        assert mine["clean"].iloc[0] == pytest.approx(clean_logit, abs=1e-5)
        np.testing.assert_allclose(
            mine["restoration"], (mine["patched"] - corrupted_logit) / (clean_logit - corrupted_logit), rtol=1e-4
        )
    # Without corrupted inputs, the settings' corruption makes them: the default noise, a class given for all.
    # The whole layer patched in restores the clean run exactly.
    noisy = activation_patching(model, clean, ["features.2"], target=1, units="layer", corruption={"std": 0.5})
    assert noisy["target"].tolist() == [1, 1] and (noisy["clean"] != noisy["corrupted"]).all()
    np.testing.assert_allclose(noisy["patched"], noisy["clean"], atol=1e-5)
    np.testing.assert_allclose(noisy["clean"], model(clean)[:, 1].detach(), atol=1e-5)
    assert count_hooks(model) == 0
    with pytest.raises(RunnerError, match="unitz"):
        activation_patching(model, clean, ["features.2"], unitz="channel")


def test_mprt_equals_a_hand_randomised_model() -> None:
    """Independent order, Spearman: each step's value is rho between the trained model's Grad-CAM and the map of a
    copy with that one module reset after seed + 1 (as Quantus), from plain hooks; the model is left as it was."""
    torch.manual_seed(2)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = mprt(model, x, ["features.2"], order="independent", similarities=["spearman"], seed=7)
    steps = ["features.0", "features.2", "fc"]
    assert rows.groupby("step")["randomised_up_to"].first().tolist() == steps
    targets = model(x).argmax(dim=1)
    trained = hand_maps(model, x, "features.2", targets)
    for step, name in enumerate(steps, start=1):
        clone = copy.deepcopy(model)
        torch.manual_seed(8)
        clone.get_submodule(name).reset_parameters()
        expected = spearman_rows(trained, hand_maps(clone, x, "features.2", targets))
        got = rows[rows.step == step].sort_values("sample_index")["value"].to_numpy()
        np.testing.assert_allclose(got, expected.float().numpy(), atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert count_hooks(model) == 0
    fixed = mprt(model, x, ["features.2"], target=[0, 1, 2], max_steps=1, similarities=["spearman"])
    assert fixed["target"].tolist() == [0, 1, 2]
