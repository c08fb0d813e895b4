"""Targets (runner/targets/, the `target` config group): each score equals pytorch-grad-cam's target of the same
meaning on a real model output; Grad-CAM with target=probability equals pytorch-grad-cam's GradCAM with
ClassifierOutputSoftmaxTarget; the default leaves the `cam` table as the class's logit makes it; bad targets fail
in one line."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.errors import ConfigCompositionException
from torch import nn

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession, inplace_disabled
from runner.layers import resolve_layers
from runner.methods import build_method, method_config
from runner.options.registry import TARGETS
from runner.runtime import Runtime
from runner.schema import Precision, TargetMode
from runner.targets import Target, build_target
from tests.conftest import CONF, TinyNet, frozen, make_config, run_cli

pytest.importorskip("pytorch_grad_cam", reason="the dev extra installs grad-cam")
import pytorch_grad_cam  # noqa: E402
from pytorch_grad_cam.utils import model_targets as peer  # noqa: E402


def target(name: str, **settings: object) -> Target:
    return build_target(TARGETS.config(name, **settings))


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return frozen(torchvision.models.resnet18(weights=None))


@pytest.fixture(scope="module")
def logits(resnet: nn.Module) -> torch.Tensor:
    """(4, 1000) a real classifier's output (random resnet18 on 64 px inputs)."""
    torch.manual_seed(1)
    with torch.no_grad():
        return resnet(torch.randn(4, 3, 64, 64))


def per_sample(make_peer, output: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """pytorch-grad-cam's way: one target object per sample, called on that sample's output, summed as its loss."""
    return torch.stack([make_peer(int(c))(o).sum() for o, c in zip(output, classes, strict=True)])


# ---- each target's score against pytorch-grad-cam's target -------------------------------------------------------
CLASSES = torch.tensor([3, 0, 999, 3])


@pytest.mark.parametrize(
    ("name", "settings", "make_peer"),
    [
        ("logit", {}, peer.ClassifierOutputTarget),
        ("probability", {}, peer.ClassifierOutputSoftmaxTarget),
        ("raw", {}, lambda c: peer.RawScoresOutputTarget()),
        (
            "logit_difference",
            {"other": 7},
            lambda c: lambda o: peer.ClassifierOutputTarget(c)(o) - peer.ClassifierOutputTarget(7)(o),
        ),
        (
            "multi_label",
            {"labels": [1, 5, 999]},
            lambda c: lambda o: sum(peer.ClassifierOutputTarget(label)(o) for label in (1, 5, 999)),
        ),
    ],
)
def test_classifier_targets_equal_pytorch_grad_cams(name: str, settings: dict, make_peer, logits: torch.Tensor) -> None:
    ours = target(name, **settings).score(logits, CLASSES)
    assert ours.shape == (4,)
    torch.testing.assert_close(ours, per_sample(make_peer, logits, CLASSES), rtol=1e-6, atol=1e-6)


def test_logit_difference_against_the_largest_other_logit(logits: torch.Tensor) -> None:
    ours = target("logit_difference").score(logits, CLASSES)
    top2 = logits.topk(2, dim=1)
    for i, c in enumerate(CLASSES.tolist()):
        rival = top2.indices[i, 1] if top2.indices[i, 0] == c else top2.indices[i, 0]
        expected = peer.ClassifierOutputTarget(c)(logits[i]) - peer.ClassifierOutputTarget(int(rival))(logits[i])
        assert float(ours[i]) == pytest.approx(float(expected), abs=1e-6)
    assert float(ours[0]) < 0 and float(ours[3]) < 0  # class 3 is no sample's top class here: below its rival


def test_binary_target_equals_pytorch_grad_cams(resnet: nn.Module) -> None:
    torch.manual_seed(2)
    head = nn.Linear(1000, 1)  # a one-output classifier on the resnet's features
    with torch.no_grad():
        output = head(resnet(torch.randn(4, 3, 64, 64)))  # (4, 1)
    classes = torch.tensor([1, 0, 1, 0])
    expected = per_sample(peer.BinaryClassifierOutputTarget, output, classes)
    torch.testing.assert_close(target("binary").score(output, classes), expected)
    torch.testing.assert_close(target("binary", category=1).score(output, classes), output[:, 0])  # every sample's 1
    with pytest.raises(RunnerError, match=r"target=binary takes a one-output classifier.*\(2, 1000\)"):
        target("binary").score(torch.zeros(2, 1000), torch.zeros(2, dtype=torch.long))


def test_segmentation_region_equals_pytorch_grad_cams() -> None:
    torch.manual_seed(3)
    segmenter = nn.Conv2d(3, 4, 3, padding=1)  # (B, 4 classes, 8, 8): a segmentation output
    with torch.no_grad():
        output = segmenter(torch.randn(2, 3, 8, 8))
    classes = torch.tensor([2, 1])
    # The data's masks, at the output's resolution here.
    masks = torch.zeros(2, 8, 8, dtype=torch.bool)
    masks[0, 1:4, 2:7] = True
    masks[1, 5:, :3] = True
    expected = torch.stack(
        [
            peer.SemanticSegmentationTarget(int(c), m.numpy().astype(np.float32))(o)
            for o, c, m in zip(output, classes, masks, strict=True)
        ]
    )
    torch.testing.assert_close(target("segmentation_region").score(output, classes, masks), expected)
    # The same masks at twice the resolution (the input's) are brought to the output's: nearest, the same region.
    big = masks.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    torch.testing.assert_close(target("segmentation_region").score(output, classes, big), expected)
    # A box in fractions: rows 2..5, columns 0..3 of the 8x8 output.
    box = np.zeros((8, 8), np.float32)
    box[2:6, 0:4] = 1
    boxed = target("segmentation_region", region=[0.25, 0.0, 0.75, 0.5]).score(output, classes)
    torch.testing.assert_close(boxed, torch.stack([peer.SemanticSegmentationTarget(2, box)(output[0]),
                                                   peer.SemanticSegmentationTarget(1, box)(output[1])]))  # fmt: skip
    with pytest.raises(RunnerError, match="needs a region: set target.region"):
        target("segmentation_region").score(output, classes)
    with pytest.raises(RunnerError, match=r"segmentation model's \(batch, classes, height, width\) output"):
        target("segmentation_region", region=[0, 0, 1, 1]).score(torch.zeros(2, 5), classes)


def test_targets_refuse_what_they_cannot_score(logits: torch.Tensor) -> None:
    with pytest.raises(RunnerError, match=r"target.labels: ids \[1000\] are outside the model's 1000 outputs"):
        target("multi_label", labels=[1, 1000]).score(logits, CLASSES)
    with pytest.raises(RunnerError, match="target=multi_label needs target.labels"):
        target("multi_label")
    with pytest.raises(RunnerError, match=r"target.region=\[0.5, 0.0, 0.25, 1.0\]: give \[top, left, bottom, right\]"):
        target("segmentation_region", region=[0.5, 0.0, 0.25, 1.0])
    with pytest.raises(RunnerError, match=r"target=probability takes a classifier's \(batch, classes\) output"):
        target("probability").score(torch.zeros(2, 3, 4, 4), CLASSES[:2])
    with pytest.raises(RunnerError, match=r"Out of range: target.other=-1"):
        target("logit_difference", other=-1)


# ---- Grad-CAM with a target: pytorch-grad-cam's maps --------------------------------------------------------------
LAYERS = ["layer3", "layer4"]  # 4x4 and 2x2 at 64 px


def run_with_target(model: nn.Module, x: torch.Tensor, layers: list[str], score: Target, **cfg: object) -> dict:
    runtime = Runtime(torch.device("cpu"), Precision.fp32, target=score)
    method = build_method(method_config(**cfg), resolve_layers(model, layers), runtime)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{i}" for i in range(x.shape[0])], 0)
    with HookSession(model, []) as session:
        method.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        return method.run_batch(model, batch, session).tables[method.table]


def layer_maps(columns: dict, layer: str, b: int) -> torch.Tensor:
    """(B, h, w) maps of `layer` (rows are layer-major, one per sample)."""
    rows = [i for i, name in enumerate(columns["layer"]) if name == layer]
    h, w = int(columns["map_height"][rows[0]]), int(columns["map_width"][rows[0]])
    values = columns["map"].values.split(columns["map"].lengths)
    return torch.stack([values[i] for i in rows]).reshape(b, h, w)


def peer_gradcam_maps(model: nn.Module, x: torch.Tensor, classes: list[int]) -> dict[str, torch.Tensor]:
    """pytorch-grad-cam's GradCAM with ClassifierOutputSoftmaxTarget, per layer at its resolution before its min-max
    scaling and resize (`get_cam_image`, then the ReLU it applies next); on a copy with gradients on, in-place off."""
    theirs = copy.deepcopy(model)
    for p in theirs.parameters():
        p.requires_grad_(True)
    layers = [theirs.get_submodule(n) for n in LAYERS]
    wanted = [peer.ClassifierOutputSoftmaxTarget(c) for c in classes]
    out = {}
    with inplace_disabled(theirs), pytorch_grad_cam.GradCAM(model=theirs, target_layers=layers) as cam:
        cam(input_tensor=x, targets=wanted)
        acts, grads = cam.activations_and_grads.activations, cam.activations_and_grads.gradients
        for i, (name, layer) in enumerate(zip(LAYERS, layers, strict=True)):
            raw = cam.get_cam_image(x, layer, wanted, acts[i].numpy(), grads[i].numpy(), False)
            out[name] = torch.relu(torch.from_numpy(raw).float())
    return out


def test_gradcam_with_probability_equals_pytorch_grad_cams_softmax_target(resnet: nn.Module) -> None:
    """Tolerance: 1e-5 of each layer's largest map value (float32 sums over 256/512 channels in another order)."""
    torch.manual_seed(5)
    x = torch.randn(3, 3, 64, 64)
    ours = run_with_target(resnet, x, LAYERS, target("probability"), name="gradcam")
    classes = ours["target"][:3].tolist()
    theirs = peer_gradcam_maps(resnet, x, classes)
    with torch.no_grad():
        probs = resnet(x).softmax(dim=1)
    torch.testing.assert_close(ours["score"][:3], probs[torch.arange(3), classes])  # the score column: the target's
    by_logit = run_with_target(resnet, x, LAYERS, target("logit"), name="gradcam")
    for layer in LAYERS:
        mine, reference = layer_maps(ours, layer, 3), theirs[layer]
        scale = float(reference.abs().max())
        assert scale > 0
        assert float((mine - reference).abs().max()) <= 1e-5 * scale, layer
        # The probability's map is not the logit's rescaled: the softmax subtracts the other classes' gradients.
        logit_map = layer_maps(by_logit, layer, 3)
        unit = lambda m: m.flatten(1) / m.flatten(1).amax(dim=1, keepdim=True).clamp_min(1e-30)  # noqa: E731
        assert float((unit(mine) - unit(logit_map)).abs().max()) > 1e-3, layer


def test_captum_differentiates_the_target_too() -> None:
    """captum's LayerGradCam with target=probability gives Grad-CAM's probability maps (before its ReLU)."""
    torch.manual_seed(6)
    model = frozen(TinyNet())
    x = torch.randn(2, 3, 8, 8)
    probability = target("probability")
    ours = run_with_target(model, x, ["features.2"], probability, name="gradcam")
    captum = run_with_target(model, x, ["features.2"], probability, name="captum", captum="LayerGradCam")
    torch.testing.assert_close(torch.relu(captum["map"].values), ours["map"].values, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(captum["score"], ours["score"])
    logit_only = run_with_target(model, x, ["features.2"], target("logit"), name="gradcam")["map"].values
    assert not torch.allclose(logit_only / logit_only.max(), ours["map"].values / ours["map"].values.max())


# ---- a callable target ------------------------------------------------------------------------------------------------
def margin(output: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """A user's target: the class's logit minus the best other one (what logit_difference with other=null is)."""
    chosen = output.gather(1, classes[:, None]).squeeze(1)
    others = output.clone()
    others[torch.arange(output.shape[0]), classes] = -torch.inf
    return chosen - others.max(dim=1).values


def gathered_logit(output: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    return output[torch.arange(output.shape[0]), classes]


def not_a_score(output: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    return output  # (B, K): a score per class, not per sample


def test_a_callable_target_is_imported_and_differentiated() -> None:
    torch.manual_seed(7)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    mine = run_with_target(model, x, ["features.0", "features.2"], target("callable", _target_="tests.test_targets.margin"),
                           name="gradcam", target=TargetMode.fixed, class_ids=[1])  # fmt: skip
    built_in = run_with_target(model, x, ["features.0", "features.2"], target("logit_difference"),
                               name="gradcam", target=TargetMode.fixed, class_ids=[1])  # fmt: skip
    with torch.no_grad():
        expected = margin(model(x), torch.ones(3, dtype=torch.long))
    torch.testing.assert_close(mine["score"][:3], expected)
    torch.testing.assert_close(mine["map"].values, built_in["map"].values)
    assert float(mine["map"].values.abs().max()) > 0


def test_a_callable_target_that_cannot_serve_fails_in_one_line() -> None:
    with pytest.raises(RunnerError, match=r"target=callable needs `target._target_`"):
        target("callable")
    with pytest.raises(RunnerError, match=r"module `tests.test_targets` has no `no_such_function`"):
        target("callable", _target_="tests.test_targets.no_such_function")
    with pytest.raises(RunnerError, match=r"Cannot import `nowhere_pkg.fn` for target._target_"):
        target("callable", _target_="nowhere_pkg.fn")
    wrong = target("callable", _target_="tests.test_targets.not_a_score")
    with pytest.raises(RunnerError, match=r"returned torch.Size\(\[2, 5\]\); a target returns one score per sample"):
        wrong.score(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))


# ---- runs: the default unchanged, the config group's errors -----------------------------------------------------------
RUN = ("model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
       "data.count=4", "data.num_classes=5", "data.batch_size=2", "hooks=[]", "layers.include=[features.0,features.2]",
       "method.target=topk", "method.top_k=2")  # fmt: skip
SAME_ROWS = ["layer", "call", "sample", "target", "target_rank", "score", "probability", "map", "cam_mean"]


def test_the_default_target_is_the_logit_and_leaves_the_cam_table_as_it_was(tmp_path: Path) -> None:
    """No `target` given, target=logit, and a hand-written gather of the logit as a callable give one `cam` table."""
    default = make_config(*RUN)
    assert default.target.name == "logit" and type(default.target).__name__ == "LogitTargetConfig"
    tables = {
        name: pd.read_parquet(app.run(make_config(*RUN, *extra), tmp_path / name).tables["cam"])
        for name, extra in (
            ("default", ()),
            ("logit", ("target=logit",)),
            ("by_hand", ("target=callable", "target._target_=tests.test_targets.gathered_logit")),
        )
    }
    reference = tables["default"][SAME_ROWS]
    assert len(reference) == 2 * 4 * 2 and float(reference["cam_mean"].abs().max()) > 0
    for name in ("logit", "by_hand"):
        pd.testing.assert_frame_equal(tables[name][SAME_ROWS], reference, check_exact=True, obj=name)


def test_an_unknown_target_exits_2_in_one_line_with_suggestions(tmp_path: Path) -> None:
    done = run_cli("target=probabilty", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Could not find 'target/probabilty'" in lines[0], done.stderr
    assert lines[0].endswith("Did you mean: probability?"), lines[0]


def test_a_key_of_another_target_is_refused_at_composition() -> None:
    from runner.options.compose import config_error_line

    with pytest.raises(ConfigCompositionException) as info:
        make_config("target=probability", "target.labels=[1,2]")
    line = config_error_line(info.value.__cause__)
    assert "(key: target.labels)" in line and "belongs to target=multi_label, not to target=probability" in line
    with pytest.raises(
        RunnerError, match=r"key: target.other\).*belongs to target=logit_difference, not to target=logit"
    ):
        make_config("+target.other=3")
    assert make_config("target=logit_difference", "target.other=3").target.other == 3


@pytest.mark.slow
def test_a_segmentation_target_on_a_classifier_run_fails_in_one_line(tmp_path: Path) -> None:
    done = run_cli(*RUN, "target=segmentation_region", "target.region=[0,0,1,1]", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if "[ERROR]" in line]
    assert len(lines) == 1 and "takes a segmentation model's (batch, classes, height, width) output" in lines[0]


def test_no_target_given_is_the_logit_for_an_image_method_and_the_logit_difference_for_a_language_model() -> None:
    """target=default (the primary config's): resolved when the config is typed, so the run names what it measured;
    a language-model method with an image target is refused there, before torch loads."""
    assert make_config().target.name == "logit"
    lm = ["model=hf_lm", "data=prompts", "data.file=induction"]
    from runner.options.registry import LM_FAMILY, METHODS, discover

    discover()
    language_model_methods = [option.name for option in METHODS if option.family == LM_FAMILY]
    assert {"lm_patching", "lm_edges"} <= set(language_model_methods)
    for method in language_model_methods:
        assert make_config(*lm, f"method={method}").target.name == "token_logit_diff", method
    assert make_config(*lm, "method=lm_patching", "target=answer_logprob").target.name == "answer_logprob"
    with pytest.raises(RunnerError, match=r"^method=lm_edges measures a language model's answer: use target="):
        make_config(*lm, "method=lm_edges", "target=probability")


@pytest.mark.slow
def test_each_target_is_one_option_module_and_one_yaml() -> None:
    """What a new target takes: its module in runner/options/target/ (found by the one discovery) and its YAML
    naming its schema; the composed config holds that schema, with no list of targets anywhere else."""
    modules = {p.stem for p in (CONF.parent / "runner" / "options" / "target").glob("*.py")} - {"__init__"}
    yamls = {p.stem for p in (CONF / "target").glob("*.yaml")}
    assert modules == yamls == set(TARGETS.names())
    for name in TARGETS.names():
        option = TARGETS.get(name)
        assert option.module == f"runner.options.target.{name}"
        assert f"- /schema/target/{name}@_here_" in (CONF / "target" / f"{name}.yaml").read_text()
        assert callable(getattr(option.load(), "score", None))
    settings = {"multi_label": ["target.labels=[1]"], "callable": ["target._target_=tests.test_targets.margin"]}
    for name in TARGETS.names():
        config = make_config(f"target={name}", *settings.get(name, []))
        resolved = "logit" if name == "default" else name  # `default` is the method's own: an image method's logit
        assert type(config.target) is TARGETS.get(resolved).schema
        assert isinstance(build_target(config.target), Target)
