"""method=mprt: the similarities against scipy/skimage, the randomisation steps against a hand-made copy, batch
independence, the run's model left as it was, and agreement with quantus.MPRT on the real EfficientNet-Lite0."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import skimage
import skimage.metrics
import torch
from torch import nn

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession, count_hooks
from runner.layers import resolve_layers
from runner.methods import build_method, method_config
from runner.methods.mprt import (
    compare,
    prepare,
    reference,
    spearman_rows,
    ssim_rows,
    topk_intersection_rows,
)
from runner.ranking import row_average_ranks
from runner.schema import TargetMode
from tests.conftest import TinyNet, frozen, make_config
from tests.test_cam_family import CPU, run_method
from tests.test_reference import effnet, photos  # noqa: F401  (module fixtures: the real embedded model, 2 photos)


def tied_maps(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    """(n, h, w) float64 maps with ReLU zeros and rounded values: many ties, as CAM maps have."""
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(n, h, w, generator=g, dtype=torch.float64)).mul(4).round().div(4)


def test_similarities_match_scipy_and_skimage() -> None:
    a, b = tied_maps(3, 12, 10, 0), tied_maps(3, 12, 10, 1)
    b[1] = a[1] * 0.5 + b[1] * 0.1  # one pair correlated
    rho = spearman_rows(a, b)
    ssim = ssim_rows(a, b)
    flat = ssim_rows(a, b, flat=True)
    for i in range(3):
        x, y = a[i].numpy(), b[i].numpy()
        rng = float(max(x.max(), y.max()) - min(x.min(), y.min()))  # Quantus's data_range
        assert rho[i].item() == pytest.approx(scipy.stats.spearmanr(x.ravel(), y.ravel())[0], abs=1e-12)
        assert ssim[i].item() == pytest.approx(skimage.metrics.structural_similarity(x, y, data_range=rng), abs=1e-12)
        expected_flat = skimage.metrics.structural_similarity(x.ravel(), y.ravel(), data_range=rng)
        assert flat[i].item() == pytest.approx(expected_flat, abs=1e-12)
    assert rho[1] > 0.5 and ssim[1] > ssim[0]
    zero = torch.zeros(1, 12, 10, dtype=torch.float64)
    assert torch.isnan(spearman_rows(zero, a[:1])).all() and torch.isnan(topk_intersection_rows(zero, a[:1], 0.1)).all()


def test_batched_ranks_and_similarities_match_per_row_references() -> None:
    """The batched engine (one reference, one compare per step for all layers' rows) against scipy/skimage row by
    row, on many ties, a constant row and a 224 px map (the size the runner compares at)."""
    values = tied_maps(4, 9, 7, 2).flatten(1)
    values[2] = 0.0  # one constant row: all ranks tied
    np.testing.assert_array_equal(row_average_ranks(values).numpy(), scipy.stats.rankdata(values.numpy(), axis=1))
    a, b = tied_maps(3, 224, 224, 3), tied_maps(3, 224, 224, 4)
    b[0] = a[0]
    a[2] = 0.0
    sims = ["spearman", "ssim", "topk_intersection"]
    got = compare(reference(a, sims, 0.1), b, sims)  # (K, N)
    for i in range(3):
        x, y = a[i].numpy(), b[i].numpy()
        rng = float(max(x.max(), y.max()) - min(x.min(), y.min()))
        rho = scipy.stats.spearmanr(x.ravel(), y.ravel())[0] if i != 2 else np.nan
        np.testing.assert_allclose(got[0, i].item(), rho, atol=1e-12)
        np.testing.assert_allclose(
            got[1, i].item(), skimage.metrics.structural_similarity(x, y, data_range=rng), atol=1e-12
        )
    assert got[0, 0].item() == pytest.approx(1.0) and got[2, 0].item() == 1.0 and torch.isnan(got[2, 2])
    k = round(0.1 * 224 * 224)
    top_a, top_b = (np.argsort(-m[1].numpy().ravel(), kind="stable")[:k] for m in (a, b))
    assert got[2, 1].item() == len(np.intersect1d(top_a, top_b)) / k


def test_topk_intersection_counts_shared_top_pixels() -> None:
    a = torch.arange(10.0).reshape(1, 2, 5)  # top 20% (2 pixels): 9 and 8
    b = a.clone()
    assert topk_intersection_rows(a, b, 0.2).item() == 1.0
    b[0, 1, 4] = -1.0  # pixel 9 leaves b's top two: 8 and 7 are b's top
    assert topk_intersection_rows(a, b, 0.2).item() == 0.5
    assert topk_intersection_rows(a, a.flip(-1).flip(-2), 0.2).item() == 0.0


def test_prepare_normalises_each_map_by_its_own_maximum() -> None:
    maps = torch.tensor([[[1.0, 2.0], [0.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]])  # (2, 2, 2)
    out = prepare(maps, (4, 4))
    assert out.shape == (2, 4, 4) and out.dtype == torch.float64
    assert out[0].max().item() == 1.0 and (out[1] == 0).all()  # the zero map stays zero, no NaN
    alone = prepare(maps[:1] * 10, (4, 4))
    torch.testing.assert_close(alone[0], out[0])  # not the batch's maximum (Quantus's default)


def mprt_pass(model: nn.Module, batches: list[torch.Tensor], layers: list[str], **cfg: object) -> pd.DataFrame:
    """The mprt rows of `batches` run through one session, one run_batch each, as a frame with global samples."""
    method = build_method(method_config("mprt", **cfg), resolve_layers(model, layers), CPU)
    frames, first = [], 0
    n = sum(len(x) for x in batches)
    with HookSession(model, []) as session:
        method.setup(session, n)
        for x in batches:
            session.begin_batch(len(x), first)
            batch = Batch(x, torch.full((len(x),), -1), [f"s{i}" for i in range(first, first + len(x))], first)
            columns = method.run_batch(model, batch, session).tables["mprt"]
            frame = pd.DataFrame({k: (v.tolist() if torch.is_tensor(v) else v) for k, v in columns.items()})
            frame["sample"] = frame.pop("sample_index") + first
            frames.append(frame)
            session.end_batch()
            first += len(x)
    return pd.concat(frames, ignore_index=True)


def hand_maps(model: nn.Module, x: torch.Tensor, layer: str, targets: torch.Tensor) -> torch.Tensor:
    """Grad-CAM at `layer` from plain hooks, prepared as MPRT compares maps: (B, H, W) float64."""
    kept: list[torch.Tensor] = []

    def keep(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        kept.append(output)
        return output.clone()  # the model goes on with a clone: a following in-place ReLU cannot overwrite it

    handle = model.get_submodule(layer).register_forward_hook(keep)
    try:
        x = x.clone().requires_grad_(True)  # frozen weights: the graph starts at the input
        score = model(x).gather(1, targets[:, None]).sum()
        (grad,) = torch.autograd.grad(score, kept)
    finally:
        handle.remove()
    cam = torch.relu((grad.mean(dim=(2, 3), keepdim=True) * kept[0]).sum(dim=1))  # (B, h, w)
    return prepare(cam.detach(), x.shape[-2:])


@pytest.mark.parametrize("order", ["top_down", "independent"])
def test_steps_match_a_hand_randomised_copy(order: str) -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(3, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    rows = mprt_pass(model, [x], ["features.0", "features.2"], order=order, similarities=["spearman", "ssim"], seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # re-initialised in a forked random state
    modules = ["fc", "features.2", "features.0"] if order == "top_down" else ["features.0", "features.2", "fc"]
    assert rows.groupby("step")["randomised_up_to"].first().tolist() == modules
    assert len(rows) == 3 * 2 * 2 * 3  # steps x layers x similarities x samples
    targets = model(x).argmax(dim=1)
    trained = {layer: hand_maps(model, x, layer, targets) for layer in ["features.0", "features.2"]}
    clone = copy.deepcopy(model)
    for step, name in enumerate(modules, start=1):
        if order == "independent":
            clone.load_state_dict(before)
        torch.manual_seed(8)  # seed + 1, as Quantus
        clone.get_submodule(name).reset_parameters()
        for layer in ["features.0", "features.2"]:
            got = rows[(rows.step == step) & (rows.layer == layer) & (rows.similarity == "spearman")]
            expected = spearman_rows(trained[layer], hand_maps(clone, x, layer, targets))
            np.testing.assert_allclose(got.sort_values("sample")["value"], expected.float(), atol=1e-6)
    # The run's model, its hooks and the random state are as they were.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert count_hooks(model) == 0
    assert (rows.value[rows.step == 1] < 1).any()  # the weights changed the maps


def test_rows_do_not_depend_on_the_batching() -> None:
    """The copy is back to the trained weights at each batch: two batches give the one batch's values."""
    torch.manual_seed(1)
    model = frozen(TinyNet())
    x = torch.randn(4, 3, 8, 8)
    whole = mprt_pass(model, [x], ["features.2"])
    split = mprt_pass(model, [x[:2], x[2:]], ["features.2"])
    key = ["sample", "step", "similarity"]
    whole, split = whole.sort_values(key).reset_index(drop=True), split.sort_values(key).reset_index(drop=True)
    np.testing.assert_allclose(whole["value"], split["value"], atol=1e-6)
    assert whole["randomised_up_to"].tolist() == split["randomised_up_to"].tolist()


def test_randomize_and_max_steps_choose_the_steps() -> None:
    model = frozen(TinyNet())
    x = torch.randn(2, 3, 8, 8)
    rows = mprt_pass(model, [x], ["features.2"], randomize=["Conv2d"], similarities=["spearman"])
    assert rows.groupby("step")["randomised_up_to"].first().tolist() == ["features.2", "features.0"]
    rows = mprt_pass(model, [x], ["features.2"], max_steps=1, similarities=["spearman"])
    assert rows["randomised_up_to"].unique().tolist() == ["fc"]


def test_bad_settings_fail_clearly() -> None:
    model, x = frozen(TinyNet()), torch.randn(1, 3, 8, 8)
    with pytest.raises(RunnerError, match="ssim"):
        run_method(model, x, ["features.2"], name="mprt", similarities=["ssmi"])
    with pytest.raises(RunnerError, match="selects no module"):
        mprt_pass(model, [x], ["features.2"], randomize=["features.1"])  # a ReLU: nothing to re-initialise
    with pytest.raises(RunnerError, match="one map per sample"):
        run_method(model, x, ["features.2"], name="mprt", target=TargetMode.topk, top_k=2)


@pytest.mark.slow
def test_mprt_effnet_writes_its_table(tmp_path: Path) -> None:
    config = make_config("experiment=mprt_effnet", "debug=tiny", "data.image_size=32", "method.max_steps=3")
    frame = pd.read_parquet(app.run(config, tmp_path).tables["mprt"])
    assert sorted(frame["similarity"].unique()) == ["spearman", "ssim", "topk_intersection"]
    assert frame["randomised_up_to"].drop_duplicates().tolist() == ["_fc", "_bn1", "_conv_head"]
    assert len(frame) == 2 * 5 * 3 * 3  # samples x layers x steps x similarities


# ---- agreement with quantus.MPRT (the real model and photos: tests/test_reference.py's fixtures) ---------------


@pytest.mark.slow
def test_agrees_with_quantus_mprt(effnet: nn.Module, photos: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Same model, photos, layer order (top-down cascading), seed, and similarity functions: Quantus's own
    (scipy's Spearman, skimage's SSIM through quantus.ssim) inside quantus.MPRT's loop; explain_func is the
    runner's Grad-CAM at one layer. Quantus normalises by the batch's maximum by default; given per-sample axes it
    normalises as the runner does. The maps are the same float32 numbers on both sides and the comparison runs in
    float64, so the tolerance (1e-6) covers only summation order (skimage's filters vs. average pooling)."""
    quantus = pytest.importorskip("quantus", reason="the dev extra installs quantus")
    from quantus.functions.similarity_func import correlation_spearman
    from quantus.functions.similarity_func import ssim as quantus_ssim
    from quantus.helpers.model.pytorch_model import PyTorchModel

    layer, steps, size = "_blocks.5", 3, photos.shape[-2:]
    targets = effnet(photos).argmax(dim=1)

    def explain(model: nn.Module, inputs: np.ndarray, targets: np.ndarray, **_: object) -> np.ndarray:
        x = torch.as_tensor(inputs)
        cfg = method_config("gradcam", target=TargetMode.fixed, class_ids=[int(t) for t in targets])
        method = build_method(cfg, resolve_layers(model, [layer]), CPU)
        with HookSession(model, []) as session:
            method.setup(session, len(x))
            session.begin_batch(len(x), 0)
            batch = Batch(x, torch.full((len(x),), -1), [str(i) for i in range(len(x))], 0)
            cam = method.run_batch(model, batch, session).tables["cam"]
        h, w = cam["map_height"][0], cam["map_width"][0]
        maps = cam["map"].values.reshape(len(x), h, w)  # (B, h, w)
        up = torch.nn.functional.interpolate(maps[:, None], size=tuple(size), mode="bilinear", align_corners=False)
        return up.double().numpy()  # (B, 1, H, W): the runner's float32 map, compared in float64

    seen: list[dict[str, np.ndarray]] = []

    def similarity(a: np.ndarray, b: np.ndarray, batched: bool = True, **_: object) -> np.ndarray:
        """Quantus's functions on each pair: Spearman (returned to Quantus), SSIM of the images and of the rows."""
        images = [quantus_ssim(x.reshape(size), y.reshape(size)) for x, y in zip(a, b, strict=True)]
        seen.append(
            {"spearman": correlation_spearman(a, b, batched=True), "ssim": np.array(images),
             "ssim_flat": np.array(quantus_ssim(a, b, batched=True))}
        )  # fmt: skip
        return seen[-1]["spearman"]

    # Quantus's own randomisation, stopped after `steps` modules (it would go on through all ~130 of the model).
    generator = PyTorchModel.get_random_layer_generator

    def first_steps(self: PyTorchModel, order: str = "top_down", seed: int = 42) -> object:
        return itertools.islice(generator(self, order=order, seed=seed), steps)

    monkeypatch.setattr(PyTorchModel, "get_random_layer_generator", first_steps)
    metric = quantus.MPRT(
        similarity_func=similarity, layer_order="top_down", seed=42, normalise_func_kwargs={"normalise_axes": [1, 2, 3]},
        disable_warnings=True, display_progressbar=False,
    )  # fmt: skip
    scores = metric(model=effnet, x_batch=photos.numpy(), y_batch=targets.numpy(), a_batch=None, explain_func=explain,
                    device="cpu", batch_size=2)  # fmt: skip
    names = [k for k in scores if k != "original"]
    sims = ["spearman", "ssim", "ssim_flat"]
    rows = mprt_pass(effnet, [photos], [layer], max_steps=steps, similarities=sims, seed=42)
    assert rows.groupby("step")["randomised_up_to"].first().tolist() == names == ["_fc", "_bn1", "_conv_head"]
    for step, name in enumerate(names, start=1):
        np.testing.assert_allclose(seen[step]["spearman"], scores[name], atol=1e-12)  # seen[0]: the original model
        for s in sims:
            got = rows[(rows.step == step) & (rows.similarity == s)].sort_values("sample")["value"].to_numpy()
            np.testing.assert_allclose(got, seen[step][s], atol=1e-6, equal_nan=True, err_msg=f"{name} {s}")
    assert (rows.value[rows.similarity == "spearman"] < 0.99).any()  # the head's randomisation moved the maps


def test_ssim_stays_in_its_range_on_near_constant_maps() -> None:
    """Maps within 1e-7 of 1 (what upsampling leaves of a nearly flat map): SSIM's window (co)variances as
    E[xy] - E[x]E[y] cancelled to rounding noise against a c2 of 1e-17 and SSIM reached -16 and +11. Centred on
    each map's mean they are exact to far below c2: every value in [-1, 1], and ordinary maps agree with skimage."""
    g = torch.Generator().manual_seed(0)
    a = 1 - torch.rand(50, 32, 32, generator=g, dtype=torch.float64) * 1e-7
    b = 1 - torch.rand(50, 32, 32, generator=g, dtype=torch.float64) * 1e-7
    for flat in (False, True):
        s = ssim_rows(a, b, flat=flat)
        assert torch.isfinite(s).all() and (s.abs() <= 1).all(), (flat, s.min(), s.max())
    # The same structure far from 0 or at 0: SSIM's structure term does not move, luminance is ~1 in both.
    shifted = ssim_rows((a - 1) * 1e7 + 1e9, (b - 1) * 1e7 + 1e9)
    torch.testing.assert_close(ssim_rows(a, b), shifted, atol=1e-6, rtol=0)


def test_a_constant_layer_map_is_nan_and_flagged_in_the_mprt_table() -> None:
    """TinyNet's `pool` is 1x1: its maps are constant at their own resolution. Upsampling left 1-ulp ripples that
    gave it a Spearman and an SSIM; every similarity is NaN and the rows flagged, the conv's rows are not."""
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(2, 3, 8, 8)
    sims = ["spearman", "ssim", "topk_intersection"]
    rows = mprt_pass(model, [x], ["features.2", "pool"], max_steps=2, similarities=sims)
    pool, conv = rows[rows.layer == "pool"], rows[rows.layer == "features.2"]
    assert len(pool) == 2 * 3 * 2 and pool["degenerate"].all() and pool["value"].isna().all()
    assert not conv["degenerate"].any() and conv["value"].notna().all()
    prepared = prepare(torch.full((1, 1, 1), 0.37), (8, 8))
    assert (prepared == 1).all()  # exactly constant, so it orders nothing
