"""Pictures drawn during a run (runner/viz/pictures.py, issue 15): overlays wrapped and labelled (layers in model order
with their map sizes, the class by name with its probability, one colour bar, the maps' scaling said), the most
active channels on one scale, patching heatmaps over the dimmed photo, and the configured format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
import torch

import runner.app as app
from runner.data.base import Batch
from runner.schema import FigureFormat, FiguresConfig, MapScale
from runner.stats import upsample
from runner.viz import figure_style, pictures
from tests.conftest import make_config

# Seven layers of the embedded EfficientNet-Lite0, listed out of model order: panels must follow the model.
LAYERS = "[_conv_head,_blocks.1,_blocks.3,_blocks.5,_blocks.8,_blocks.11,_blocks.15]"
MODEL_ORDER = ["_blocks.1", "_blocks.3", "_blocks.5", "_blocks.8", "_blocks.11", "_blocks.15", "_conv_head"]
COLUMNS, DPI = 3, 40


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, Any]]:
    """Every (file, figure) the pictures save: the figure is kept to read its titles after it is drawn and saved."""
    kept: list[tuple[Path, Any]] = []
    save = figure_style.save

    def keeping(fig: Any, stem: Path, figures: FiguresConfig) -> Path:
        path = save(fig, stem, figures)
        kept.append((path, fig))
        return path

    monkeypatch.setattr(figure_style, "save", keeping)
    return kept


def panels(fig: Any) -> list[Any]:
    """The figure's panels that show something (not the colour bar, not the unused cells of the last row)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.images]


def rows_of(fig: Any) -> int:
    """How many rows the panels sit in."""
    return len({round(ax.get_position().y0, 3) for ax in panels(fig)})


def has_colour_bar(fig: Any) -> bool:
    return sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == 1


def cam_run(tmp_path: Path, *overrides: str) -> pd.DataFrame:
    config = make_config(
        "experiment=gradcam_effnet", "data.photos=[chelsea]", "data.image_size=32", f"layers.include={LAYERS}",
        "hooks=[]", "method.pictures=true", "method.faithfulness.enabled=false", f"figures.columns={COLUMNS}",
        f"figures.dpi={DPI}", *overrides,
    )  # fmt: skip
    return pd.read_parquet(app.run(config, tmp_path).tables["cam"])


@pytest.mark.slow
def test_overlay_is_wrapped_labelled_in_model_order_with_class_name(
    tmp_path: Path, saved: list[tuple[Path, Any]]
) -> None:
    frame = cam_run(tmp_path, "method.feature_grid_layer=_blocks.5")
    (path, fig), (grid_path, _) = saved
    assert path.name == "000000_chelsea_gradcam.png" and grid_path.name == "000000_chelsea_features__blocks.5.png"
    sizes = frame.set_index("layer")[["map_height", "map_width"]]
    titles = [ax.get_title() for ax in panels(fig)]
    assert titles == [
        "input 32x32",
        *(f"{n} {sizes.loc[n, 'map_height']}x{sizes.loc[n, 'map_width']}" for n in MODEL_ORDER),
    ]
    assert rows_of(fig) == 3  # 8 panels at 3 a row
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width <= (COLUMNS * figure_style.PANEL_INCHES + 0.3) * DPI  # the bbox's padding only
    assert height > width / 2  # rows, not a strip
    title = fig.get_suptitle()
    row = frame.iloc[0]
    assert f"'{row['target_name']}' ({row['target']})" in title and row["target_name"]
    assert f"chelsea (true: '{row['label_name']}' ({int(row['label'])}))" in title  # the true class, beside it
    assert f"p = {row['probability']:.3f}" in title
    assert pictures.scale_note(MapScale.per_map) in title.replace("\n", " ")
    assert has_colour_bar(fig)
    assert all(im.get_cmap().name == figure_style.SEQUENTIAL_CMAP for ax in panels(fig)[1:] for im in ax.images[1:])


@pytest.mark.slow
def test_shared_scale_is_said_and_svg_is_written(tmp_path: Path, saved: list[tuple[Path, Any]]) -> None:
    cam_run(tmp_path, "figures.map_scale=shared", "figures.format=svg")
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == ["000000_chelsea_gradcam.svg"]
    ((_, fig),) = saved
    title = fig.get_suptitle().replace("\n", " ")
    assert pictures.scale_note(MapScale.shared) in title and pictures.scale_note(MapScale.per_map) not in title
    # One scale for all layers: 0 and 1 are reached once over the sample's layers, not in every map.
    maps = [ax.images[1].get_array() for ax in panels(fig)[1:]]
    assert min(float(m.min()) for m in maps) == pytest.approx(0)
    assert max(float(m.max()) for m in maps) == pytest.approx(1)
    assert sum(float(m.max()) > 0.999 for m in maps) < len(maps)


def test_scaled_maps_per_map_is_faithfulness_scaling_and_shared_keeps_ratios() -> None:
    maps = [torch.rand(2, 4, 4) * 10, torch.rand(2, 2, 2)]  # the first layer's values are ten times larger
    per_map = pictures.scaled_maps(maps, (8, 8), MapScale.per_map)
    for got, m in zip(per_map, maps, strict=True):
        torch.testing.assert_close(got, upsample(m, (8, 8)))  # today's values, unchanged
    shared = pictures.scaled_maps(maps, (8, 8), MapScale.shared)
    assert all(float(s[b].max()) < 0.2 for s in shared[1:] for b in range(2))  # small maps stay small
    assert torch.stack(shared).amin(dim=(0, 2, 3)).abs().max() < 1e-6
    torch.testing.assert_close(torch.stack(shared).amax(dim=(0, 2, 3)), torch.ones(2))
    nan = [maps[0], torch.full((2, 2, 2), float("nan"))]  # a degenerate layer must not blank the others
    assert torch.isfinite(pictures.scaled_maps(nan, (8, 8), MapScale.shared)[0]).all()


@pytest.mark.slow
def test_feature_grid_shows_the_most_active_channels_on_one_scale(
    tmp_path: Path, saved: list[tuple[Path, Any]]
) -> None:
    act = torch.rand(1, 48, 4, 4)  # (B, C, h, w)
    act[0, 40] += 5  # the most active channel
    act[0, 7] += 3  # the second
    batch = Batch(torch.zeros(1, 3, 8, 8), torch.tensor([-1]), ["cat"], 0)
    figures = FiguresConfig(format=FigureFormat.pdf)
    (path,) = pictures.write_feature_grid(tmp_path, batch, "layer4", act, limit=1, figures=figures)
    assert path.name == "000000_cat_features_layer4.pdf" and path.stat().st_size > 0
    ((_, fig),) = saved
    shown = panels(fig)
    assert len(shown) == 16
    assert shown[0].get_title().startswith("ch 40 mean") and shown[1].get_title().startswith("ch 7 mean")
    means = [float(ax.get_title().split()[-1]) for ax in shown]
    assert means == sorted(means, reverse=True)
    assert len({ax.images[0].get_clim() for ax in shown}) == 1  # one colour scale
    assert has_colour_bar(fig)
    title = fig.get_suptitle().replace("\n", " ")
    assert "layer4" in title and "top 16 of 48 channels by mean activation" in title and "one colour scale" in title


@pytest.mark.slow
def test_patching_heatmap_over_dimmed_photo_with_class_name(tmp_path: Path, saved: list[tuple[Path, Any]]) -> None:
    config = make_config(
        "experiment=patching_effnet", "data.image_size=32", f"layers.include={LAYERS}", "method.pictures=true",
        f"figures.columns={COLUMNS}", f"figures.dpi={DPI}",
    )  # fmt: skip
    frame = pd.read_parquet(app.run(config, tmp_path).tables["patching"])
    ((path, fig),) = saved
    assert path.name == "000000_chelsea_patching_denoising.png"
    assert [ax.get_title().split()[0] for ax in panels(fig)] == MODEL_ORDER
    assert rows_of(fig) == 3  # 7 panels at 3 a row
    assert matplotlib.image.imread(path).shape[1] <= (COLUMNS * figure_style.PANEL_INCHES + 0.3) * DPI
    row = frame.iloc[0]
    title = fig.get_suptitle().replace("\n", " ")
    assert f"'{row['target_name']}'" in title and row["target_name"]
    assert str(row["corrupted_id"]) in title and "denoising" in title
    assert has_colour_bar(fig)
    for ax in panels(fig):
        photo, cells = ax.images  # the photo beneath, then the cells
        assert float(np.asarray(photo.get_array()).max()) <= 1 - pictures.DIM / 2 + 1e-6  # dimmed towards grey
        assert cells.get_cmap().name == figure_style.DIVERGING_CMAP
        low, high = cells.get_clim()
        assert low == -high  # centred on 0


def test_overlay_rows_are_even_without_an_orphan_panel(tmp_path: Path, saved: list[tuple[Path, Any]]) -> None:
    cam_run(tmp_path, "layers.include=[_blocks.1,_blocks.3,_blocks.5,_blocks.8,_blocks.11]", "figures.columns=5")
    ((_, fig),) = saved
    rows = {}
    for ax in panels(fig):  # the input and five layers: 2 rows of 3 at 5 a row, not 5 and 1
        rows.setdefault(round(ax.get_position().y0, 3), []).append(ax)
    assert sorted(len(r) for r in rows.values()) == [3, 3]


def test_noising_heatmap_draws_the_drop(tmp_path: Path, saved: list[tuple[Path, Any]]) -> None:
    config = make_config(
        "experiment=patching_effnet", "data.image_size=32", "layers.include=[_blocks.5]", "method.pictures=true",
        "method.patching.directions=[noising]", "method.patching.grid=[2,2]", f"figures.dpi={DPI}",
    )  # fmt: skip
    frame = pd.read_parquet(app.run(config, tmp_path).tables["patching"]).sort_values(["y", "x"])
    ((path, fig),) = saved
    assert path.name == "000000_chelsea_patching_noising.png"
    assert "drop (1 - restoration) per patched cell" in fig.get_suptitle().replace("\n", " ")
    (ax,) = panels(fig)
    cells = np.asarray(ax.images[1].get_array())  # (H, W): each cell's value, nearest-upsampled
    h, w = cells.shape
    shown = cells[[0, 0, h - 1, h - 1], [0, w - 1, 0, w - 1]]  # one pixel of each 2x2 cell, row by row
    np.testing.assert_allclose(shown, 1 - frame["restoration"].to_numpy(), rtol=0, atol=1e-5)
    bar = next(a for a in fig.axes if a.get_label() == "<colorbar>")
    assert bar.get_ylabel() == "drop (1 - restoration)"


# ---- a patching heatmap of all-NaN restorations is still drawn -------------------------------------------------------
def test_heatmap_of_all_nan_restorations_is_written(tmp_path: Path) -> None:
    batch = Batch(torch.zeros(1, 3, 8, 8), torch.tensor([-1]), ["cat"], 0)
    columns = {
        "restoration": torch.full((4,), float("nan")),
        "sample_index": torch.zeros(4, dtype=torch.long),
        "patch_method": ["exact"] * 4, "direction": ["denoising"] * 4, "layer": ["l"] * 4,
        "grid_h": [2] * 4, "grid_w": [2] * 4, "y": [0, 0, 1, 1], "x": [0, 1, 0, 1], "corrupted_id": ["cat"] * 4,
    }  # fmt: skip
    pictures.write_patching_heatmaps(tmp_path, batch, columns, limit=4)
    assert (tmp_path / "000000_cat_patching_denoising.png").stat().st_size > 0
