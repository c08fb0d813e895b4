"""Cross-check: each CAM variant's map equals pytorch-grad-cam's (the de-facto reference implementation),
after the min-max scaling pytorch-grad-cam applies. The layer keeps the input's 8x8 resolution, so
pytorch-grad-cam's resize to the input size is the identity.

The layer is a conv followed by ReLU(inplace=True). pytorch-grad-cam keeps a reference to the conv's
output, which that ReLU then overwrites, so it is given the model with in-place ops off; the runner
gets the model as it is and must give the same maps."""

from __future__ import annotations

import pytest
import torch

from runner.hooks import inplace_disabled
from runner.stats import upsample
from tests.conftest import TinyNet, frozen
from tests.test_cam_family import run_method

pytorch_grad_cam = pytest.importorskip("pytorch_grad_cam", reason="the dev extra installs grad-cam")
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # noqa: E402

PEERS = {
    "gradcam": pytorch_grad_cam.GradCAM,
    "gradcampp": pytorch_grad_cam.GradCAMPlusPlus,
    "xgradcam": pytorch_grad_cam.XGradCAM,
    "hirescam": pytorch_grad_cam.HiResCAM,
    "layercam": pytorch_grad_cam.LayerCAM,
}


@pytest.mark.parametrize("name", sorted(PEERS))
def test_same_map_as_pytorch_grad_cam(name: str) -> None:
    torch.manual_seed(4)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    ours = run_method(model, x, ["features.2"], name=name)
    targets = ours["target"].tolist()
    mine = upsample(ours["map"].values.reshape(3, 8, 8), (8, 8))  # min-max scaled, as pytorch-grad-cam does
    for p in model.parameters():
        p.requires_grad_(True)  # pytorch-grad-cam backpropagates into the weights
    with inplace_disabled(model):
        theirs = peer_maps(name, model, x, targets)
    assert float(mine.max()) == pytest.approx(1.0)
    torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)


def peer_maps(name: str, model: torch.nn.Module, x: torch.Tensor, targets: list[int]) -> torch.Tensor:
    with PEERS[name](model=model, target_layers=[model.features[2]]) as cam:
        return torch.from_numpy(cam(input_tensor=x, targets=[ClassifierOutputTarget(t) for t in targets])).float()


def test_pytorch_grad_cam_is_wrong_on_the_in_place_layer() -> None:
    """The trap the runner avoids: on the model as it is, the peer's Grad-CAM uses post-ReLU activations."""
    torch.manual_seed(4)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    ours = run_method(model, x, ["features.2"], name="gradcam")
    mine = upsample(ours["map"].values.reshape(3, 8, 8), (8, 8))
    for p in model.parameters():
        p.requires_grad_(True)
    theirs = peer_maps("gradcam", model, x, ours["target"].tolist())
    assert (mine - theirs).abs().max() > 0.05
