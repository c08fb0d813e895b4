"""Localisation (issue 14): the four metrics against Quantus and by hand, masks from an image folder's side files
through every input geometry and the loader, the built-in composites benchmark, and its experiment."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torch import nn

import runner.app as app
from runner.data.base import Batch, build_dataset, make_loader, sample_masks, to_batch
from runner.data.composites import POSITIONS, cell_mask
from runner.errors import RunnerError
from runner.metrics.base import MetricInputs, load_metrics
from runner.options.data.composites import CompositeLayout, CompositesConfig
from runner.options.data.image_folder import ImageFolderConfig
from runner.options.metric.evaluation import EvaluationConfig
from runner.runtime import Runtime
from runner.schema import Precision, ResizeMode
from tests.conftest import make_config

CPU = torch.device("cpu")


def compute(name: str, maps: torch.Tensor, masks: torch.Tensor, **settings: object) -> torch.Tensor:
    """(B,) values of metric `name` on maps (B, H, W) and masks (B, H, W)."""
    metric = load_metrics()[name](EvaluationConfig(metrics=[name], **settings))  # type: ignore[arg-type]
    b = maps.shape[0]
    inputs = MetricInputs(
        model=nn.Identity(), x=torch.zeros(b, 3, *maps.shape[1:]), target=torch.zeros(b, dtype=torch.int64),
        sample_index=torch.arange(b), masks=masks, runtime=Runtime(device=CPU, precision=Precision.fp32), seed=0,
    )  # fmt: skip
    assert metric.needs_masks
    return metric.compute(inputs, maps)[""]


def random_case(seed: int = 0, b: int = 6, side: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Continuous maps (no ties) and box masks of different sizes, one of them touching the map's peak."""
    g = torch.Generator().manual_seed(seed)
    maps = torch.rand(b, side, side, generator=g)  # (B, side, side)
    masks = torch.zeros(b, side, side, dtype=torch.bool)
    for i in range(b):
        y, x = (int(v) for v in torch.randint(0, side - 8, (2,), generator=g))
        masks[i, y : y + 3 + i, x : x + 5 + i] = True
    peak = maps[0].flatten().argmax()
    masks[0].view(-1)[peak] = True  # sample 0 is a hit
    return maps, masks


# ---- the metrics -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "quantus_class"),
    [("pointing_game", "PointingGame"), ("relevance_mass", "RelevanceMassAccuracy"),
     ("relevance_rank", "RelevanceRankAccuracy")],
)  # fmt: skip
def test_agrees_with_quantus(name: str, quantus_class: str) -> None:
    quantus = pytest.importorskip("quantus")
    maps, masks = random_case()
    maps[1] = torch.relu(maps[1] - 0.5)  # a CAM-like map with a plateau of zeros (pointing ties do not matter)
    b = maps.shape[0]
    reference = getattr(quantus, quantus_class)(normalise=False, abs=False, disable_warnings=True)
    expected = reference(
        model=nn.Sequential(nn.Flatten(), nn.Linear(3 * 24 * 24, 3)), x_batch=np.zeros((b, 3, 24, 24), np.float32),
        y_batch=np.zeros(b, np.int64), a_batch=maps[:, None].numpy(), s_batch=masks[:, None].numpy().astype(np.float32),
        channel_first=True, device="cpu",
    )  # fmt: skip
    ours = compute(name, maps, masks)
    assert ours.dtype == torch.float32 and ours.shape == (b,)
    if name == "relevance_mass":  # a ratio of float32 sums: the summation order differs from numpy's
        np.testing.assert_allclose(ours.numpy(), np.asarray(expected, np.float64), rtol=1e-6)
    else:  # a comparison or a count: exact
        np.testing.assert_array_equal(ours.numpy(), np.asarray(expected, np.float32))
    assert len(set(ours.tolist())) > 1  # the case separates hits from misses


def test_empty_mask_is_nan_and_a_hit_is_one() -> None:
    maps, masks = random_case(b=2)
    masks[1] = False
    for name in ("pointing_game", "energy_pointing_game", "relevance_mass", "relevance_rank"):
        values = compute(name, maps, masks)
        assert torch.isnan(values[1]) and not torch.isnan(values[0]), name
    assert compute("pointing_game", maps, masks)[0] == 1.0


def test_pointing_tolerance_grows_the_mask_by_a_disc() -> None:
    maps = torch.zeros(1, 20, 20)
    maps[0, 10, 10] = 1.0  # the peak
    masks = torch.zeros(1, 20, 20, dtype=torch.bool)
    masks[0, 10, 13:] = True  # 3 px to the right of the peak
    masks[0, 12:, 12:] = True  # diagonal: 2*sqrt(2) = 2.83 px away
    assert compute("pointing_game", maps, masks).item() == 0.0  # Quantus: the peak itself must be inside
    assert compute("pointing_game", maps, masks, pointing_tolerance=2).item() == 0.0
    assert compute("pointing_game", maps, masks, pointing_tolerance=3).item() == 1.0
    masks[0, 10, 13:] = False
    assert compute("pointing_game", maps, masks, pointing_tolerance=2).item() == 0.0  # 2.83 > 2
    assert compute("pointing_game", maps, masks, pointing_tolerance=3).item() == 1.0


def test_energy_pointing_game_uses_the_scaled_map_inside_the_masks_box() -> None:
    maps = torch.full((1, 4, 4), 1.0)  # minimum 1: scaling to [0, 1] moves every pixel
    maps[0, 0, 0], maps[0, 1, 1], maps[0, 3, 3] = 3.0, 2.0, 5.0
    masks = torch.zeros(1, 4, 4, dtype=torch.bool)
    masks[0, 0, 0] = masks[0, 1, 1] = True  # two diagonal pixels: their box is the 2x2 top-left corner
    # scaled: (v - 1) / 4 -> 0.5, 0.25, 1.0 and zeros; box holds 0.5 + 0.25 of 1.75
    assert compute("energy_pointing_game", maps, masks).item() == pytest.approx(0.75 / 1.75)
    # relevance_mass: the raw mass in the mask alone, (3 + 2) / (13 + 3 + 2 + 5)
    assert compute("relevance_mass", maps, masks).item() == pytest.approx(5.0 / 23.0)
    flat = compute("energy_pointing_game", torch.ones(1, 4, 4), masks)
    assert torch.isnan(flat).all()  # a constant map has no energy to place


def test_relevance_rank_counts_ties_at_the_kth_value_by_their_share() -> None:
    maps = torch.tensor([[[3.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]])  # (1, 2, 4)
    masks = torch.zeros(1, 2, 4, dtype=torch.bool)
    masks[0, 0, 0] = masks[0, 0, 1] = True  # K = 2: the 3 and one of the four tied 1s
    # top-2 = {3.0} plus one of 4 tied pixels, one of which is in the mask: expected hits 1 + 1/4
    assert compute("relevance_rank", maps, masks).item() == pytest.approx(1.25 / 2)


# ---- masks from an image folder ----------------------------------------------------------------------------------
BOX = (30, 10, 70, 40)  # x0, y0, x1, y1 in a 100 x 60 photo


def write_boxed_photo(path: Path) -> None:
    """A 100 x 60 white photo with a black rectangle exactly at BOX."""
    array = np.full((60, 100, 3), 255, dtype=np.uint8)
    x0, y0, x1, y1 = BOX
    array[y0:y1, x0:x1] = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def dark(x: torch.Tensor) -> torch.Tensor:
    """(H, W) bool: the input's near-black pixels (the rectangle), from (3, H, W) normalised."""
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    return (x * std + mean).mean(dim=0) < 0.25  # black; the bands are the mean colour (0.45)


def iou(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a & b).sum() / (a | b).sum())


@pytest.mark.parametrize("resize", [ResizeMode.pad, ResizeMode.crop, ResizeMode.square, ResizeMode.none])
@pytest.mark.parametrize("side_file", ["json", "png"])
def test_folder_masks_follow_the_photos_geometry(tmp_path: Path, resize: ResizeMode, side_file: str) -> None:
    write_boxed_photo(tmp_path / "cats" / "a.png")
    if side_file == "json":
        (tmp_path / "masks.json").write_text(json.dumps({"cats/a.png": {"boxes": [list(BOX)]}}))
    else:
        mask = np.zeros((60, 100), dtype=np.uint8)
        mask[BOX[1] : BOX[3], BOX[0] : BOX[2]] = 255
        Image.fromarray(mask).save(tmp_path / "cats" / "a.mask.png")
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=48, resize=resize), None, 0)
    assert len(dataset) == 1  # the .mask.png is not an image
    x = dataset[0][0]  # (3, h, w)
    masks = sample_masks(dataset)
    assert masks is not None
    mask = masks("cats/a.png")
    assert mask.dtype == torch.bool and mask.shape == x.shape[-2:]
    assert iou(mask, dark(x)) > 0.85, resize  # the mask lies on the rectangle the model sees
    if resize is ResizeMode.crop:  # 100 x 60 -> 80 x 48, 16 px cut each side: x 30..70 -> 24..56 -> 8..40
        columns = mask.any(dim=0).nonzero()[:, 0]
        assert mask.shape == (48, 48) and (int(columns.min()), int(columns.max())) == (8, 39)
    if resize is ResizeMode.pad:  # 100 x 60 -> 48 x 29 at rows 9..37: y 10..40 -> rows 9 + 4.8..19.3
        rows = mask.any(dim=1).nonzero()[:, 0]
        assert (int(rows.min()), int(rows.max())) == (14, 27)


def test_masks_travel_with_the_batch_through_the_loader(tmp_path: Path) -> None:
    write_boxed_photo(tmp_path / "a.png")
    Image.fromarray(np.full((30, 30, 3), 255, np.uint8)).save(tmp_path / "b.png")  # no region: empty mask
    (tmp_path / "masks.json").write_text(json.dumps({"a.png": {"boxes": [list(BOX)]}}))
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=24, resize=ResizeMode.none, batch_size=2)
    dataset = build_dataset(cfg, None, 0)
    batch = to_batch(next(iter(make_loader(dataset, cfg, CPU))), CPU, 0)
    assert batch.masks is not None and batch.masks.dtype == torch.bool
    assert batch.masks.shape == (2, *batch.x.shape[-2:])  # padded like the images (a: 24 x 40, b: 24 x 24)
    assert bool(batch.masks[0].any()) and not bool(batch.masks[1].any())
    assert iou(batch.masks[0], dark(batch.x[0])) > 0.85
    half = batch.part(1, 2)
    assert half.masks is not None and torch.equal(half.masks, batch.masks[1:]) and half.first_index == 1
    plain = ImageFolderConfig(root=str(tmp_path / "none"), image_size=24)
    (tmp_path / "none").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "none" / "c.png")
    no_masks = build_dataset(plain, None, 0)
    assert sample_masks(no_masks) is None
    assert to_batch(next(iter(make_loader(no_masks, plain, CPU))), CPU, 0).masks is None


def test_bad_side_files_fail_clearly(tmp_path: Path) -> None:
    write_boxed_photo(tmp_path / "a.png")
    (tmp_path / "masks.json").write_text(json.dumps({"b.png": {"boxes": [list(BOX)]}}))
    with pytest.raises(RunnerError, match="names 'b.png', which is not an image.*a.png"):
        build_dataset(ImageFolderConfig(root=str(tmp_path)), None, 0)
    (tmp_path / "masks.json").write_text(json.dumps({"a.png": {"boxes": [[1, 2, 3]]}}))
    with pytest.raises(RunnerError, match=r"needs \{'boxes'"):
        build_dataset(ImageFolderConfig(root=str(tmp_path)), None, 0)
    (tmp_path / "masks.json").unlink()
    Image.fromarray(np.zeros((5, 5), np.uint8)).save(tmp_path / "a.mask.png")
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path)), None, 0)
    with pytest.raises(RunnerError, match="must have the image's size"):
        sample_masks(dataset)("a.png")  # type: ignore[misc]


# ---- the built-in benchmark --------------------------------------------------------------------------------------
def interior(x: torch.Tensor, position: int) -> torch.Tensor:
    """(3, 28, 28) of a 64 px composite's cell at `position`, 2 px in from its edges (resampling mixes those)."""
    row, col = divmod(position, 2)
    return x[:, row * 32 + 2 : row * 32 + 30, col * 32 + 2 : col * 32 + 30]


def test_composites_put_the_labelled_photo_in_the_masked_cell() -> None:
    cfg = CompositesConfig(photos=["chelsea", "camera"], image_size=64, layout=CompositeLayout.grid)
    dataset = build_dataset(cfg, None, 0)
    assert len(dataset) == 8
    ids = [dataset[i][2] for i in range(8)]
    assert ids == [f"{p}@{where}" for p in ("chelsea", "camera") for where in POSITIONS]
    assert [dataset[i][1] for i in range(8)] == [285] * 4 + [872] * 4
    masks = sample_masks(dataset)
    assert masks is not None
    chelsea = [dataset[i][0] for i in range(4)]  # (3, 64, 64) each: chelsea in cell i, camera elsewhere
    for position in range(4):
        mask = masks(ids[position])
        assert mask.shape == (64, 64) and int(mask.sum()) == 32 * 32
        assert torch.equal(mask, cell_mask(position)[::7, ::7])  # the cell, at input resolution
        other = (position + 1) % 4
        inside = interior(chelsea[position], position)  # the cat, wherever it is
        assert torch.allclose(inside, interior(chelsea[other], other), atol=1e-5)
        assert not torch.allclose(inside, interior(chelsea[other], position), atol=0.1)  # there: camera
    again = build_dataset(cfg, None, 0)
    assert all(torch.equal(dataset[i][0], again[i][0]) for i in range(8))  # deterministic


def test_composites_name_an_unusable_photo() -> None:
    with pytest.raises(RunnerError, match="'rockett'"):
        make_config("data=composites", "data.photos=[rockett]").data.check()


@pytest.mark.slow
def test_embedded_model_names_each_composites_class() -> None:
    """The benchmark's premise: the pretrained model's top-1 on every (default: background) composite is its label."""
    import runner.models

    model = runner.models.build_model(make_config().model).model.eval()
    dataset = build_dataset(CompositesConfig(), None, 0)
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])  # (N, 3, 224, 224)
    labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    assert torch.equal(predicted, labels), [dataset[i][2] for i in range(len(dataset)) if predicted[i] != labels[i]]


@pytest.mark.slow
def test_localisation_experiment_writes_the_evaluation_table(tmp_path: Path) -> None:
    result = app.run(make_config("experiment=localisation_effnet", "debug=tiny"), tmp_path)
    frame = pd.read_parquet(result.tables["evaluation"])
    metrics = {"pointing_game", "energy_pointing_game", "relevance_mass", "relevance_rank"}
    assert set(frame["metric"]) == metrics
    assert set(frame["sample"]) == {0, 1} and frame["layer"].nunique() == 7
    # 32 px: the deepest layers' maps are 1 x 1, constant once upsampled, so their mass metrics are NaN
    assert frame["value"].notna().any() and frame["random_value"].notna().any()
    assert frame["value"].dropna().between(0, 1).all()
    cam = pd.read_parquet(result.tables["cam"])
    assert set(cam["target"]) == {285}  # the composites' label is explained (chelsea first)


def test_batch_without_masks_keeps_its_default() -> None:
    batch = Batch(torch.zeros(2, 3, 4, 4), torch.tensor([-1, -1]), ["a", "b"], 0)
    assert batch.masks is None and batch.part(0, 1).masks is None


def test_a_constant_map_points_nowhere_and_ranks_nothing() -> None:
    """An all-zero (or any constant) map: every pixel is its maximum and all are tied, so the pointing game
    scored a hit and relevance rank |mask|/N, where relevance mass and energy were already NaN."""
    _, masks = random_case(b=2)
    maps = torch.zeros(2, 24, 24)
    maps[1] = 0.5
    for name in ("pointing_game", "energy_pointing_game", "relevance_rank"):
        assert torch.isnan(compute(name, maps, masks)).all(), name
    assert torch.isnan(compute("relevance_mass", maps, masks)[0])  # no mass to place


def test_a_mask_that_vanishes_at_the_model_size_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1-pixel box in a 100 x 60 photo is gone at 24 px: its localisation values are NaN, and the log says so once,
    naming the sample."""
    write_boxed_photo(tmp_path / "cats" / "a.png")
    write_boxed_photo(tmp_path / "cats" / "b.png")
    boxes = {"cats/a.png": {"boxes": [list(BOX)]}, "cats/b.png": {"boxes": [[50, 30, 51, 31]]}}
    (tmp_path / "masks.json").write_text(json.dumps(boxes))
    config = make_config(
        "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=image_folder", f"data.root={tmp_path}",
        "data.image_size=24", "data.batch_size=1", "layers.include=[features.2]", "hooks=[]",
        "method.evaluation.metrics=[pointing_game,relevance_mass]",
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        result = app.run(config, tmp_path / "out")
    frame = pd.read_parquet(result.tables["evaluation"])
    assert frame.groupby("sample")["value"].apply(lambda v: v.isna().all()).tolist() == [False, True]
    warned = [r.getMessage() for r in caplog.records if "mask is empty" in r.getMessage()]
    assert len(warned) == 1 and "b.png" in warned[0] and "a.png" not in warned[0]
