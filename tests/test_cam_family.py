"""The CAM family: hand-built cases with known answers for each method, top-k targets, ViT tokens,
captum's layer methods, faithfulness and the randomisation sanity check."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import build_method, cam_methods, method_config
from runner.methods.cam import CamContext
from runner.options.method.eigencam import EigenCamConfig
from runner.options.method.scorecam import ScoreCamConfig
from runner.runtime import Runtime
from runner.schema import Precision, ScoreCamWeights, TargetMode
from tests.conftest import TinyNet, frozen, make_config

CPU = Runtime(torch.device("cpu"), Precision.fp32)

# A hand-built case: 2 channels on a 2x2 map.
A = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [0.0, 1.0]]])[None]  # (1, 2, 2, 2)
G = torch.tensor([[[0.5, 0.5], [0.5, 0.5]], [[-1.0, 2.0], [0.0, 1.0]]])[None]
EXPECTED = {
    # w = mean(G) = (0.5, 0.5)
    "gradcam": 0.5 * A[0, 0] + 0.5 * A[0, 1],
    # w_c = sum(G*A)/sum(A): (5/10, 2/3)
    "xgradcam": 0.5 * A[0, 0] + (2 / 3) * A[0, 1],
    # alpha*relu(G) summed: channel 0: 4 * (0.25 / 1.75) * 0.5 = 2/7; channel 1: 2/32*4... = 0.25 + 0.2
    "gradcampp": (2 / 7) * A[0, 0] + 0.45 * A[0, 1],
    # element-wise: sum_c G*A = [[0.5-1, 1+2], [1.5+0, 2+1]], then ReLU
    "hirescam": torch.tensor([[0.0, 3.0], [1.5, 3.0]]),
    # element-wise with ReLU(G): [[0.5+0, 1+2], [1.5+0, 2+1]]
    "layercam": torch.tensor([[0.5, 3.0], [1.5, 3.0]]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hand_built_channel_weights(name: str) -> None:
    method = cam_methods()[name](method_config(name), [], CPU)
    ctx = CamContext(nn.Identity(), torch.zeros(1, 3, 2, 2), torch.tensor([0]), CPU)
    torch.testing.assert_close(method.cam(A, G, ctx)[0], torch.relu(EXPECTED[name]))


def test_eigencam_is_the_first_principal_component() -> None:
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    u = torch.tensor([3.0, 4.0])  # every pixel is s_hw * u: rank one, principal direction u/|u|
    act = (u[:, None, None] * s)[None]  # (1, 2, 2, 2)
    method = cam_methods()["eigencam"](EigenCamConfig(), [], CPU)
    got = method.cam(act, None, CamContext(nn.Identity(), torch.zeros(1, 3, 2, 2), torch.tensor([0]), CPU))
    torch.testing.assert_close(got[0], torch.relu(s - 2.5) * 5.0, rtol=1e-5, atol=1e-5)  # (s - mean s) * |u|


class SumModel(nn.Module):
    """logits = [sum of the input, 0]: the probability of class 0 is sigmoid(sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum(dim=(1, 2, 3))
        return torch.stack([total, torch.zeros_like(total)], dim=1)


def test_scorecam_scores_each_channel_as_a_mask() -> None:
    x = torch.ones(1, 1, 2, 2)
    act = torch.tensor([[[0.0, 1.0], [0.0, 1.0]], [[0.0, 0.0], [0.0, 2.0]]])[None]  # at input resolution
    method = cam_methods()["scorecam"](ScoreCamConfig(score_chunk=1), [], CPU)
    got = method.cam(act, None, CamContext(SumModel(), x, torch.tensor([0]), CPU))
    # masks after min-max: channel 0 keeps 2 pixels (sum 2), channel 1 keeps 1 (sum 1)
    w = torch.sigmoid(torch.tensor([2.0, 1.0]))  # method.scorecam_weights=paper: the probabilities themselves
    torch.testing.assert_close(got[0], torch.relu(w[0] * act[0, 0] + w[1] * act[0, 1]))


def run_method(model: nn.Module, x: torch.Tensor, layers: list[str], **cfg: object) -> dict:
    method_cfg = method_config(**cfg)
    method = build_method(method_cfg, resolve_layers(model, layers), CPU)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{i}" for i in range(x.shape[0])], 0)
    with HookSession(model, []) as session:
        method.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        return method.run_batch(model, batch, session).tables[getattr(method, "table", method.name)]


def test_topk_targets_from_one_forward() -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(2, 3, 8, 8)
    columns = run_method(model, x, ["features.0", "features.2"], name="gradcam", target=TargetMode.topk, top_k=3)
    assert len(columns["layer"]) == 3 * 2 * 2  # k targets x layers x samples
    ranks = torch.tensor(columns["target_rank"])
    top = model(x).topk(3, dim=1).indices
    for k in range(3):
        assert columns["target"][ranks == k].reshape(2, 2)[0].tolist() == top[:, k].tolist()
    single = run_method(model, x, ["features.0", "features.2"], name="gradcam")
    first = columns["map"].values[: single["map"].values.numel()]
    torch.testing.assert_close(first, single["map"].values)  # rank 0 is the predicted class


def test_vit_token_maps_on_the_patch_grid(tmp_path: Path) -> None:
    config = make_config(
        "model._target_=tests.conftest.tiny_vit",
        "model.weights=null",
        "data=synthetic",
        "data.shape=[3,32,32]",
        "data.count=3",
        "hooks=[]",
        "layers.include=[encoder.layers.encoder_layer_0,encoder.layers.encoder_layer_1.ln_1]",
    )
    frame = pd.read_parquet(app.run(config, tmp_path).tables["cam"])
    assert len(frame) == 2 * 3
    assert (frame["map_height"] == 4).all() and (frame["map_width"] == 4).all()  # 16 patches, class token dropped
    assert (frame["cam_max"] > 0).all()


def test_captum_gradient_x_activation_is_hirescam_before_relu() -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(2, 3, 8, 8)
    captum = run_method(model, x, ["features.2"], name="captum", captum="LayerGradientXActivation")
    hires = run_method(model, x, ["features.2"], name="hirescam")
    torch.testing.assert_close(torch.relu(captum["map"].values), hires["map"].values, rtol=1e-5, atol=1e-6)
    assert float(captum["map"].values.min()) < 0  # captum's map is signed


def test_captum_integrated_gradients_runs_per_layer() -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    columns = run_method(
        model, torch.randn(2, 3, 8, 8), ["features.0", "features.2"], name="captum",
        captum="LayerIntegratedGradients", captum_kwargs={"n_steps": 8},
    )  # fmt: skip
    assert columns["layer"] == ["features.0"] * 2 + ["features.2"] * 2
    assert columns["map"].values.abs().sum() > 0


def test_unknown_captum_method() -> None:
    with pytest.raises(RunnerError, match="LayerGradCamm.*LayerGradCam"):
        run_method(frozen(TinyNet()), torch.randn(1, 3, 8, 8), ["features.2"], name="captum", captum="LayerGradCamm")


def test_sanity_check_sees_randomised_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    same = run_method(model, x, ["features.2"], name="sanity", randomize=["features.3"])  # a ReLU: nothing to reset
    assert torch.allclose(same["spearman"], torch.ones(3))
    changed = run_method(model, x, ["features.2"], name="sanity", randomize=["fc"])
    assert (changed["spearman"] < 0.99).all()


def test_sanity_needs_layers_to_randomise() -> None:
    with pytest.raises(RunnerError, match="randomize"):
        run_method(frozen(TinyNet()), torch.randn(1, 3, 8, 8), ["features.2"], name="sanity")


@pytest.mark.slow
def test_gradcam_beats_random_maps_on_the_embedded_model(tmp_path: Path) -> None:
    """Deletion AUC (lower is better) at the last conv layer, real weights and photos, vs. random maps."""
    config = make_config(
        "experiment=gradcam_effnet", "layers.include=[_conv_head]", "method.faithfulness.steps=10", "data.batch_size=6"
    )
    frame = pd.read_parquet(app.run(config, tmp_path).tables["cam"])
    assert len(frame) == 6
    assert frame["deletion_auc"].mean() < frame["random_deletion_auc"].mean()
    assert frame["deletion_auc"].between(0, 1).all() and frame["avg_drop"].between(0, 1).all()


@pytest.mark.slow
def test_pictures_are_written(tmp_path: Path) -> None:
    config = make_config("data.photos=[chelsea]", "data.image_size=64", "hooks=[]", "method.pictures=true",
                         "method.feature_grid_layer=_conv_head")  # fmt: skip
    app.run(config, tmp_path)
    names = sorted(p.name for p in (tmp_path / "pictures").iterdir())
    assert names == ["000000_chelsea_features__conv_head.png", "000000_chelsea_gradcam.png"]
    assert all((tmp_path / "pictures" / n).stat().st_size > 1000 for n in names)


# ---- one batch at any position in the data set -----------------------------------------------------------------------
def run_at(model: nn.Module, x: torch.Tensor, layers: list[str], first_index: int = 0, **cfg: object) -> dict:
    """One batch whose first sample is sample `first_index` of the data set (tests.test_cam_family.run_method: 0)."""
    method = build_method(method_config(**cfg), resolve_layers(model, layers), CPU)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{first_index + i}" for i in range(x.shape[0])], first_index)
    with HookSession(model, []) as session:
        method.setup(session, first_index + x.shape[0])
        session.begin_batch(x.shape[0], 0)
        return method.run_batch(model, batch, session).tables[getattr(method, "table", method.name)]


# ---- sanity: a constant map has no rank correlation ------------------------------------------------------------------
class ZeroHeadNet(TinyNet):
    """TinyNet whose `fc`, when re-initialised, becomes all zeros: the randomised model's maps are all zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc.reset_parameters = lambda: (nn.init.zeros_(self.fc.weight), nn.init.zeros_(self.fc.bias))


def test_sanity_flags_a_constant_map_with_nan() -> None:
    torch.manual_seed(0)
    model = frozen(ZeroHeadNet())
    x = torch.randn(3, 3, 8, 8)
    columns = run_at(model, x, ["features.2"], name="sanity", randomize=["fc"])
    assert torch.isnan(columns["spearman"]).all()  # not a finite rho for an all-zero map
    assert columns["degenerate"].all()
    same = run_at(frozen(TinyNet()), x, ["features.2"], name="sanity", randomize=["features.3"])
    assert not same["degenerate"].any() and torch.allclose(same["spearman"], torch.ones(3))


# ---- Score-CAM: the paper's and pytorch-grad-cam's weights, masked inputs in chunks ----------------------------------
def _scorecam(weights: ScoreCamWeights, act: torch.Tensor) -> torch.Tensor:
    method = cam_methods()["scorecam"](ScoreCamConfig(score_chunk=2, scorecam_weights=weights), [], CPU)
    return method.cam(act, None, CamContext(SumModel(), torch.ones(1, 1, 2, 2), torch.tensor([0]), CPU))[0]


def test_scorecam_weights_paper_and_pytorch_grad_cam() -> None:
    act = torch.tensor([[[0.0, 1.0], [0.0, 1.0]], [[0.0, 0.0], [0.0, 2.0]], [[3.0, 3.0], [3.0, 3.0]]])[None]
    # masks after min-max: channel 0 keeps 2 pixels (logit 2), channel 1 one (logit 1), channel 2 is constant
    paper = torch.sigmoid(torch.tensor([2.0, 1.0]))  # probabilities; the constant channel weighs 0 (authors' code)
    torch.testing.assert_close(
        _scorecam(ScoreCamWeights.paper, act), torch.relu(paper[0] * act[0, 0] + paper[1] * act[0, 1])
    )
    # pytorch-grad-cam: softmax over channels of the logits; its constant channel's mask is 0 (logit 0)
    w = torch.tensor([2.0, 1.0, 0.0]).softmax(dim=0)
    got = _scorecam(ScoreCamWeights.pytorch_grad_cam, act)
    torch.testing.assert_close(got, torch.relu(torch.einsum("c,chw->hw", w, act[0])), rtol=1e-5, atol=1e-6)
    assert make_config("method=scorecam", "method.scorecam_weights=pytorch_grad_cam").method.scorecam_weights is (
        ScoreCamWeights.pytorch_grad_cam
    )


def test_scorecam_masked_inputs_go_through_in_small_batches_on_cpu_unless_a_chunk_is_set() -> None:
    model = TinyNet().eval()
    sizes: list[int] = []
    model.register_forward_hook(lambda _m, inputs, _o: sizes.append(inputs[0].shape[0]))
    act = torch.rand(1, 20, 7, 7)  # 20 channels: 20 masked inputs of 224 px
    ctx = CamContext(model, torch.rand(1, 3, 224, 224), torch.tensor([0]), CPU)
    for chunk, largest in ((None, 8), (3, 3)):
        cam_methods()["scorecam"](ScoreCamConfig(score_chunk=chunk), [], CPU).cam(act, None, ctx)
        assert max(sizes) == largest and sum(sizes) == 20
        sizes.clear()
    assert ScoreCamConfig(score_chunk=0).check() == ["method.score_chunk=0"]
