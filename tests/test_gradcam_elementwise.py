"""The shape of a new CAM variant: one file (runner/methods/gradcam_elementwise.py) and one YAML give a method
that composes, runs, and equals pytorch-grad-cam's GradCAMElementWise."""

from __future__ import annotations

import pytest
import torch

from runner.hooks import inplace_disabled
from runner.methods import cam_methods
from runner.options.method.gradcam_elementwise import GradCamElementWise
from runner.stats import upsample
from tests.conftest import TinyNet, frozen, make_config
from tests.test_cam_family import run_method

pytorch_grad_cam = pytest.importorskip("pytorch_grad_cam", reason="the dev extra installs grad-cam")
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # noqa: E402


def test_registered_and_composed_from_its_one_yaml() -> None:
    method = cam_methods()["gradcam_elementwise"]
    assert issubclass(method, GradCamElementWise) and method is cam_methods()["gradcam_elementwise"]
    assert type(make_config("method=gradcam_elementwise").method) is GradCamElementWise.config  # type: ignore[attr-defined]


def test_same_map_as_pytorch_grad_cam_elementwise() -> None:
    torch.manual_seed(4)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    ours = run_method(model, x, ["features.2"], name="gradcam_elementwise")
    mine = upsample(ours["map"].values.reshape(3, 8, 8), (8, 8))  # min-max scaled, as pytorch-grad-cam does
    for p in model.parameters():
        p.requires_grad_(True)  # pytorch-grad-cam backpropagates into the weights
    targets = [ClassifierOutputTarget(t) for t in ours["target"].tolist()]
    with inplace_disabled(model), pytorch_grad_cam.GradCAMElementWise(model, [model.features[2]]) as cam:
        theirs = torch.from_numpy(cam(input_tensor=x, targets=targets)).float()
    gradcam = upsample(run_method(model, x, ["features.2"], name="gradcam")["map"].values.reshape(3, 8, 8), (8, 8))
    assert (mine - gradcam).abs().max() > 0.05  # a map of its own, not Grad-CAM's
    torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)
