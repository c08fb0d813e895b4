"""method=cam_vs_patching: per (sample, layer, CAM method), Spearman's rho between each cell's CAM mass and the
exact patching effect of the same cell, checked against a plain loop (one forward per cell, hand-written CAMs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import skimage.data
import torch
import torchvision.transforms as T
from PIL import Image
from scipy.stats import spearmanr
from torch import nn

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import build_method
from runner.methods.cam_vs_patching import agreement
from runner.methods.patching import CorruptionConfig, CorruptionKind, PatchDirection, PatchingConfig
from runner.methods.patching.corruption import NOISE_PURPOSE
from runner.models import build_model
from runner.options.method.cam_vs_patching import CamVsPatchingConfig
from runner.randomness import per_sample_normal
from runner.runtime import Runtime
from runner.schema import ModelConfig, Precision
from tests.conftest import TinyNet, frozen, make_config

CPU = Runtime(torch.device("cpu"), Precision.fp32)


def run(model: nn.Module, x: torch.Tensor, layers: list[str], cams: list[str], **patching: object) -> pd.DataFrame:
    """The method's rows for inputs x, as a frame (one batch, no writer)."""
    cfg = CamVsPatchingConfig(cam_methods=cams, exact_patching=PatchingConfig(**patching))
    method = build_method(cfg, resolve_layers(model, layers), CPU)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{i}" for i in range(x.shape[0])], 0)
    with HookSession(model, []) as session:
        method.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        columns = method.run_batch(model, batch, session).tables["cam_vs_patching"]
    return pd.DataFrame({k: v.numpy() if torch.is_tensor(v) else v for k, v in columns.items()})


def edges(size: int, cells: int) -> list[int]:
    """Cell boundaries of a `cells`-cell grid over `size` pixels, as patching's `grid` cuts a map."""
    cells = min(cells, size)
    return [round(i * size / cells) for i in range(cells + 1)]


def plain_loop(
    model: nn.Module, layer: str, clean: torch.Tensor, corrupted: torch.Tensor, grid: int, noising: bool = False
) -> dict[str, float]:
    """Per hand-written CAM, Spearman's rho (scipy) of cell mass vs effect: one forward per cell, batch 1.

    Denoising: the clean cell into the corrupted run, effect patched - corrupted; noising: the corrupted cell
    into the clean run, effect clean - patched.
    """
    module = model.get_submodule(layer)
    kept: dict[str, torch.Tensor] = {}

    def keep(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        kept["act"] = o.detach().clone().requires_grad_(True)
        return kept["act"].clone()  # the model goes on with a copy: an in-place ReLU cannot touch `act`

    handle = module.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            logits = model(clean)
            target = int(logits[0].argmax())
            act = kept["act"]
            (grad,) = torch.autograd.grad(logits[0, target], [act])
        with torch.no_grad():
            corrupted_score = float(model(corrupted)[0, target])
            corrupted_act = kept["act"].detach()
    finally:
        handle.remove()
    act, grad = act.detach(), grad[0]  # (1, C, h, w), (C, h, w)
    maps = {
        "gradcam": torch.relu((grad.mean(dim=(1, 2))[:, None, None] * act[0]).sum(0)),
        "layercam": torch.relu((torch.relu(grad) * act[0]).sum(0)),
        "hirescam": torch.relu((grad * act[0]).sum(0)),
    }  # each (h, w)
    base_input, base, source = (clean, act, corrupted_act) if noising else (corrupted, corrupted_act, act)
    base_score = float(logits[0, target].detach()) if noising else corrupted_score
    h, w = act.shape[2:]
    ys, xs = edges(h, grid), edges(w, grid)
    effects, masses = [], {k: [] for k in maps}
    for i in range(len(ys) - 1):
        for j in range(len(xs) - 1):
            cell = (slice(ys[i], ys[i + 1]), slice(xs[j], xs[j + 1]))
            patched = base.clone()
            patched[(0, slice(None), *cell)] = source[(0, slice(None), *cell)]
            handle = module.register_forward_hook(lambda m, a, o, p=patched: p)
            try:
                with torch.no_grad():
                    score = float(model(base_input)[0, target])
            finally:
                handle.remove()
            effects.append(base_score - score if noising else score - base_score)
            for k, cam in maps.items():
                masses[k].append(float(cam[cell].sum()))
    return {k: float(spearmanr(m, effects).statistic) for k, m in masses.items()}


def noised(x: torch.Tensor, std: float) -> torch.Tensor:
    """The corrupted twin the method makes for a batch starting at index 0 (per-sample noise, seed 0)."""
    return x + std * per_sample_normal(x.shape[1:], 0, range(x.shape[0]), NOISE_PURPOSE)


def test_agrees_with_a_plain_loop_on_tinynet() -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(2, 3, 12, 12)
    layers = ["features.0", "features.2"]  # convs, each followed by an in-place ReLU
    frame = run(model, x, layers, ["gradcam", "layercam", "hirescam"], grid=[4, 4], chunk=5)
    assert len(frame) == 2 * 2 * 3 and (frame["n_cells"] == 16).all()
    corrupted = noised(x, 1.0)
    for i in range(2):
        for layer in layers:
            expected = plain_loop(model, layer, x[i : i + 1], corrupted[i : i + 1], 4)
            rows = frame[(frame.sample_index == i) & (frame.layer == layer)].set_index("cam_method")["spearman"]
            for name, rho in expected.items():
                assert np.isfinite(rho)
                assert rows[name] == pytest.approx(rho, abs=1e-5), (i, layer, name)


@pytest.fixture(scope="module")
def effnet() -> nn.Module:
    return build_model(ModelConfig(name="efficientnet_lite0", weights="embedded")).model


@pytest.mark.slow
def test_agrees_with_a_plain_loop_on_efficientnet_lite0(effnet: nn.Module) -> None:
    to_input = T.Compose([T.Resize((64, 64)), T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    x = to_input(Image.fromarray(skimage.data.chelsea()))[None]  # (1, 3, 64, 64)
    layers = ["_blocks.2", "_blocks.10"]  # 16x16 (uneven 7x7 cells) and 4x4 (capped grid)
    std = 1.5
    frame = run(
        effnet, x, layers, ["gradcam", "layercam", "hirescam"], grid=[7, 7],
        corruption=CorruptionConfig(kind=CorruptionKind.noise, std=std),
    )  # fmt: skip
    assert frame.groupby("layer")["n_cells"].first().to_dict() == {"_blocks.2": 49, "_blocks.10": 16}
    corrupted = noised(x, std)
    for layer in layers:
        expected = plain_loop(effnet, layer, x, corrupted, 7)
        rows = frame[frame.layer == layer].set_index("cam_method")["spearman"]
        for name, rho in expected.items():
            assert rows[name] == pytest.approx(rho, abs=1e-4), (layer, name)
    assert not frame["degenerate"].any()


def test_noising_effect_is_what_the_corrupted_cell_breaks() -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(1, 3, 8, 8)
    frame = run(model, x, ["features.2"], ["gradcam", "layercam"], grid=[4, 4], directions=list(PatchDirection))
    assert frame["direction"].tolist() == ["denoising", "denoising", "noising", "noising"]
    corrupted = noised(x, 1.0)
    for noising in (False, True):
        expected = plain_loop(model, "features.2", x, corrupted, 4, noising=noising)
        rows = frame[frame.direction == ("noising" if noising else "denoising")].set_index("cam_method")["spearman"]
        for name in ("gradcam", "layercam"):
            assert np.isfinite(expected[name]) and rows[name] == pytest.approx(expected[name], abs=1e-5)


def test_self_pair_is_nan_and_flagged() -> None:
    torch.manual_seed(0)
    frame = run(
        frozen(TinyNet()), torch.randn(1, 3, 8, 8), ["features.2"], ["gradcam"], grid=[2, 2],
        corruption=CorruptionConfig(kind=CorruptionKind.none),
    )  # fmt: skip
    assert frame["spearman"].isna().all() and frame["degenerate"].all()
    assert "self_pair" in frame["degenerate_reason"].iloc[0]


def test_agreement_flags_each_undefined_case() -> None:
    effect = torch.tensor([0.5, 0.1, 0.9, 0.3], dtype=torch.float64)
    mass = torch.tensor([[1.0, 0.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    rho, why = agreement(mass, effect, "")
    assert float(rho[0]) == pytest.approx(spearmanr(mass[0], effect).statistic) and why[0] == ""
    assert torch.isnan(rho[1]) and why[1] == "constant_map"
    rho, why = agreement(mass, torch.zeros(4, dtype=torch.float64), "")
    assert torch.isnan(rho).all() and why == ["constant_effect", "constant_effect,constant_map"]
    rho, why = agreement(mass[:, :1], effect[:1], "")
    assert torch.isnan(rho).all() and why == ["single_cell", "single_cell"]
    rho, why = agreement(mass, effect, "zero_span")  # restoration undefined: the effects are float noise
    assert torch.isnan(rho).all() and why[0] == "zero_span"
    rho, why = agreement(mass, effect, "constant_logits")  # flagged, but a number
    assert float(rho[0]) == pytest.approx(spearmanr(mass[0], effect).statistic) and why[0] == "constant_logits"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.cam_methods=[gradcan]", "Did you mean: gradcam"),
        ("method.cam_methods=[]", "at least one"),
        ("method.exact_patching.units=channel", "units must be cell"),
        ("method.exact_patching.mode=attribution", "mode exact"),
        ("method.exact_patching.directions=[]", "method.exact_patching.directions"),
    ],
)
def test_bad_settings_fail_at_start_up(override: str, message: str) -> None:
    with pytest.raises(RunnerError, match=message):
        make_config("experiment=cam_vs_patching_effnet", override)


def test_effnet_experiment_writes_the_table_at_debug_tiny(tmp_path: Path) -> None:
    result = app.run(make_config("experiment=cam_vs_patching_effnet", "debug=tiny"), tmp_path)
    frame = pd.read_parquet(result.tables["cam_vs_patching"])
    methods = ["gradcam", "gradcampp", "xgradcam", "hirescam", "layercam", "eigencam"]
    assert len(frame) == 2 * 4 * len(methods)  # 2 photos x 4 layers x 6 CAM methods, one direction
    assert set(frame["cam_method"]) == set(methods) and (frame["method"] == "cam_vs_patching").all()
    cells = frame.groupby("layer", sort=False)["n_cells"].first()
    assert cells.to_dict() == {"_blocks.5": 4, "_blocks.10": 4, "_blocks.15": 1, "_conv_head": 1}  # 32 px maps
    one = frame[frame.n_cells == 1]
    assert one["spearman"].isna().all() and one["degenerate_reason"].str.contains("single_cell").all()
    many = frame[(frame.n_cells > 1) & ~frame.degenerate]
    assert len(many) > 0 and many["spearman"].between(-1, 1).all()
