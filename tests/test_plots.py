"""runner/viz/plots.py: per-layer curves in model order with bootstrap bands, MPRT curves, each table's standard figures."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import matplotlib.colors
import numpy as np
import pandas as pd
import pytest

from runner import app
from runner.frames import layers_in_model_order
from runner.options.registry import METHODS
from runner.results import load
from runner.schema import FiguresConfig
from runner.viz import figure_style
from runner.viz.plots import left_out_pairs, mprt_figure, patching_effects, per_layer_figure, table_figures
from tests.conftest import make_config

for _option in METHODS:  # each method's module declares its tables and their figures (runner.tables.Presentation)
    _option.load()

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plot_sweep.py"
TINY_RUN = [
    "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,16,16]",
    "data.count=4", "data.batch_size=4", "data.num_classes=5", "layers.include=[features.2,features.0]", "hooks=[]",
]  # fmt: skip
VGG_CONVS = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]  # VGG16's 13 convolutions (module indices)


@pytest.fixture(autouse=True)
def _close_figures():  # noqa: ANN202 - a fixture that only cleans up
    """Close every figure a test left open (matplotlib keeps them alive otherwise)."""
    yield
    figure_style.pyplot().close("all")


def frame_of(layers: dict[str, int], samples: int, methods: tuple[str, ...] = ("gradcam",)) -> pd.DataFrame:
    """A cam-like table: one row per (method, sample, layer), rows in the dict's order (not model order)."""
    rows = []
    for m, method in enumerate(methods):
        for s in range(samples):
            for name, index in layers.items():
                rows.append({"sweep.method": method, "sample": s, "layer": name, "layer_index": index,
                             "value": index + 100 * m + s})  # fmt: skip
    return pd.DataFrame(rows)


def tick_texts(ax) -> list[str]:  # noqa: ANN001 - a matplotlib Axes
    """The x tick labels as shown."""
    return [t.get_text() for t in ax.get_xticklabels()]


def test_layers_in_model_order_and_one_panel_per_swept_value() -> None:
    frame = frame_of(
        {"features.28": 28, "features.2": 2, "features.10": 10}, samples=3, methods=("layercam", "gradcam")
    )
    fig = per_layer_figure(frame, "value", by="sweep.method")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["method=gradcam", "method=layercam"]  # small multiples, sorted
    for ax in panels:
        assert tick_texts(ax) == ["features.2", "features.10", "features.28"]
        assert len(ax.get_lines()) == 1 and len(ax.collections) == 1  # one line, one band: no spaghetti
        assert "layer" in ax.get_xlabel()
    # y follows the x order: layercam (m=0) at features.2 is mean(2 + s for s in 0..2) = 3, gradcam 103.
    np.testing.assert_allclose(panels[0].get_lines()[0].get_ydata(), [103, 111, 129])
    np.testing.assert_allclose(panels[1].get_lines()[0].get_ydata(), [3, 11, 29])
    assert panels[0].get_shared_y_axes().joined(panels[0], panels[1])  # one y scale to compare them on
    assert fig.get_suptitle()


def test_baseline_in_a_contrasting_colour_and_the_legend_outside_the_data() -> None:
    frame = frame_of({"a": 0, "b": 1, "c": 2}, samples=6)
    frame["random_value"] = frame["value"] + 5
    fig = per_layer_figure(frame, "value", baseline="random_value")
    ax = fig.axes[0]
    explanation, random = ax.get_lines()
    assert explanation.get_linestyle() == "-" and random.get_linestyle() == "--"
    assert explanation.get_color() == figure_style.EXPLANATION_COLOUR
    assert random.get_color() == figure_style.BASELINE_COLOUR != explanation.get_color()
    assert ax.get_legend() is None and len(fig.legends) == 1  # the figure's legend, not one over the axes
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["explanation", "random map"]
    fig.canvas.draw()
    legend_box = fig.legends[0].get_window_extent()
    assert not legend_box.overlaps(ax.get_window_extent())  # beside the data, never on it
    title_box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert not legend_box.overlaps(title_box)  # nor on the title


def test_figures_span_the_page_in_readable_fonts() -> None:
    fig = per_layer_figure(frame_of({"a": 0, "b": 1}, samples=6), "value")
    assert fig.get_figwidth() == pytest.approx(FiguresConfig().columns * figure_style.PANEL_INCHES)  # 1200 px
    ax = fig.axes[0]
    sizes = [t.get_fontsize() for t in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label)]
    assert min(sizes) >= 10  # points: 14 px at 100 dpi (was 7 pt, about 9 px)


def test_bands_of_fewer_than_five_samples_are_grey_and_said_in_the_caption() -> None:
    frame = frame_of({"a": 0, "b": 1}, samples=3).rename(columns={"value": "deletion_auc"})
    [(caption, fig)] = table_figures("cam", frame)
    assert "grey bands: fewer than 5 samples" in caption
    [band] = fig.axes[0].collections
    assert matplotlib.colors.to_hex(band.get_facecolor()[0]) == figure_style.FEW_COLOUR
    [(caption, fig)] = table_figures(
        "cam", frame_of({"a": 0, "b": 1}, samples=5).rename(columns={"value": "deletion_auc"})
    )
    assert "grey" not in caption
    [band] = fig.axes[0].collections
    assert matplotlib.colors.to_hex(band.get_facecolor()[0]) == figure_style.EXPLANATION_COLOUR


def test_grids_wrap_into_even_rows() -> None:
    assert figure_style.grid_shape(6, 5) == (2, 3)  # an overlay's input and five layers: 3 + 3, no orphan
    assert figure_style.grid_shape(8, 5) == (2, 4)
    assert figure_style.grid_shape(5, 5) == (1, 5) and figure_style.grid_shape(1, 5) == (1, 1)


def patching_frame(restoration: dict[tuple[str, int], list[float]], small: set[int] = frozenset()) -> pd.DataFrame:
    """A patching-like table: per (direction, sample) the restorations of its cells, at one layer."""
    rows = []
    for (direction, sample), values in restoration.items():
        for cell, r in enumerate(values):
            rows.append({"sample": sample, "direction": direction, "layer": "l", "layer_index": 0, "unit": "cell",
                         "y": 0, "x": cell, "patch_method": "exact", "metric": "logit", "small_span": sample in small,
                         "restoration": np.nan if sample in small else r})  # fmt: skip
    return pd.DataFrame(rows)


def test_patching_draws_the_best_cell_and_noising_as_the_drop() -> None:
    frame = patching_frame(
        {("denoising", 0): [0.1, 0.5], ("denoising", 1): [0.3, 0.2], ("denoising", 2): [26.85, 0.0],
         ("noising", 0): [0.9, 0.4], ("noising", 1): [1.0, 0.8], ("noising", 2): [1.0, 1.0]},
        small={2},
    )  # fmt: skip
    effects = patching_effects(frame).set_index(["direction", "sample"])["effect"]
    assert effects[("denoising", 0)] == pytest.approx(0.5) and effects[("noising", 0)] == pytest.approx(0.6)
    assert np.isnan(effects[("denoising", 2)])  # small_span: out of the mean, not 26.85 dominating it
    (denoising, fig_d), (noising, fig_n) = table_figures("patching", frame)
    np.testing.assert_allclose(fig_d.axes[0].get_lines()[0].get_ydata(), [(0.5 + 0.3) / 2])
    np.testing.assert_allclose(fig_n.axes[0].get_lines()[0].get_ydata(), [(0.6 + 0.2) / 2])  # 1 - restoration
    assert "best cell's restoration" in denoising and "most damaging cell's drop" in noising
    assert "left out: 1 pairs with small_span" in denoising and "left out: 1 pairs with small_span" in noising
    assert left_out_pairs(frame)["pairs with small_span (|clean - corrupted| below method.patching.min_span)"] == 2


def test_band_with_two_samples_none_with_one() -> None:
    two = per_layer_figure(frame_of({"a": 0, "b": 1}, samples=2), "value").axes[0]
    assert len(two.collections) == 1  # one band for the one line
    band = two.collections[0].get_paths()[0].vertices  # the band spans sample 0 to sample 1 at each layer
    assert band[:, 1].min() == pytest.approx(0.0) and band[:, 1].max() == pytest.approx(2.0)
    one = per_layer_figure(frame_of({"a": 0, "b": 1}, samples=1), "value").axes[0]
    assert one.collections == [] or len(one.collections) == 0  # n = 1: no interval, no band
    np.testing.assert_allclose(one.get_lines()[0].get_ydata(), [0, 1])  # but the points are drawn


def test_nan_values_left_out_and_said_in_the_caption() -> None:
    frame = frame_of({"a": 0, "b": 1}, samples=3).rename(columns={"value": "deletion_auc"})
    frame.loc[(frame["layer"] == "b") & (frame["sample"] == 0), "deletion_auc"] = np.nan
    [(caption, fig)] = table_figures("cam", frame)
    assert "n = 2 to 3 samples" in caption and "1 NaN value" in caption
    np.testing.assert_allclose(fig.axes[0].get_lines()[0].get_ydata(), [1.0, 2.5])  # b: mean of samples 1 and 2
    only_nan = frame.assign(deletion_auc=np.nan)
    [(_, fig)] = table_figures("cam", only_nan.assign(cam_frac_zero=0.5))  # no AUCs: the share of the map at 0
    assert fig.axes[0].get_ylabel() == "mean cam_frac_zero"


def test_mprt_lines_are_layers_in_model_order() -> None:
    rows = []
    for layer, index in (("_conv_head", 90), ("_blocks.5", 30), ("_blocks.10", 60)):  # not model order
        for step, up_to in ((1, "_fc"), (2, "_conv_head"), (3, "_blocks.15")):
            for s in range(3):
                for similarity in ("spearman", "ssim"):
                    value = 1.0 - step / 4 + 0.01 * s + (0.5 if similarity == "ssim" else 0)
                    rows.append({"sample": s, "layer": layer, "layer_index": index, "order": "top_down", "step": step,
                                 "randomised_up_to": up_to, "similarity": similarity, "value": value})  # fmt: skip
    frame = pd.DataFrame(rows)
    fig = mprt_figure(frame, "spearman")
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_child")][:3] == [
        "_blocks.5", "_blocks.10", "_conv_head"]  # fmt: skip
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["_blocks.5", "_blocks.10", "_conv_head"]
    assert tick_texts(ax) == ["_fc (1)", "_conv_head (2)", "_blocks.15 (3)"]
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), [0.76, 0.51, 0.26])  # spearman only, not ssim
    assert len(ax.collections) == 3  # a band per layer (3 samples)
    captions = [c for c, _ in table_figures("mprt", frame)]
    assert len(captions) == 2 and "spearman" in captions[0] and "ssim" in captions[1]


def test_table_figures_unknown_empty_or_partial() -> None:
    frame = frame_of({"a": 0}, samples=2)
    assert table_figures("hooks", frame) == []
    assert table_figures("no_such_table", frame) == []
    for table in ("cam", "evaluation", "mprt", "patching", "cam_vs_patching"):
        assert table_figures(table, frame.iloc[:0]) == []
        assert table_figures(table, frame[["sample", "layer"]]) == []  # none of the table's measured columns


def test_width_limit_and_readable_ticks_for_thirteen_layers() -> None:
    layers = {f"features.{i}": i for i in reversed(VGG_CONVS)}
    frame = frame_of(layers, samples=2)
    for columns in (5, 2):
        figures = FiguresConfig(columns=columns)
        fig = per_layer_figure(frame, "value", figures=figures)
        assert fig.get_figwidth() <= columns * figure_style.PANEL_INCHES + 1e-9
        ax = fig.axes[0]
        assert tick_texts(ax) == [f"features.{i}" for i in VGG_CONVS]
        fig.canvas.draw()
        xs = ax.transData.transform([(x, 0) for x in ax.get_xticks()])[:, 0]  # (13,) pixels
        for label in ax.get_xticklabels():
            line = 1.2 * label.get_fontsize() * fig.dpi / 72  # pixels a line of text needs
            # Parallel rotated labels dx apart are dx * sin(rotation) apart: room for a line each.
            assert np.diff(xs).min() * math.sin(math.radians(label.get_rotation())) >= line


def test_per_layer_of_a_partial_sweep_frame_lacking_by() -> None:
    frame = frame_of({"a": 0, "b": 1}, samples=2).rename(columns={"value": "cam_frac_zero"})
    [(caption, fig)] = table_figures("cam", frame, by="sweep.not_there")
    assert len(fig.axes[0].get_lines()) == 1 and "n = 2 samples" in caption


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of the tiny CNN: cam (with deletion/insertion) and evaluation tables, 4 samples, 2 layers."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    overrides = ["method.evaluation.metrics=[sparseness,complexity]", "method.faithfulness.enabled=true",
                 "method.faithfulness.steps=4"]  # fmt: skip
    app.run(make_config(*TINY_RUN, *overrides), out)
    return out


def test_figures_of_a_real_run(tiny_run: Path) -> None:
    cam, evaluation = load(tiny_run, "cam"), load(tiny_run, "evaluation")
    assert layers_in_model_order(cam) == ["features.0", "features.2"]
    cam_figures = table_figures("cam", cam.iloc[::-1])  # rows in reverse: the figure orders by layer_index
    assert [f.axes[0].get_ylabel() for _, f in cam_figures] == ["mean deletion_auc", "mean insertion_auc"]
    for caption, fig in cam_figures:
        assert tick_texts(fig.axes[0]) == ["features.0", "features.2"] and caption.endswith(".")
        assert "random map" in [t.get_text() for t in fig.legends[0].get_texts()]
    eval_figures = table_figures("evaluation", evaluation, by="method")
    metrics = sorted(set(evaluation["metric"]))
    assert len(eval_figures) == evaluation[["metric", "variant"]].drop_duplicates().shape[0] >= len(metrics)
    for caption, fig in eval_figures:
        assert tick_texts(fig.axes[0]) == ["features.0", "features.2"]
        assert any(m in caption for m in metrics) and "n = 4 samples" in caption


def test_plot_sweep_script(tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["plot_sweep.py", str(tiny_run), "--value", "deletion_auc", "--format", "svg"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert (tiny_run / "per_layer_deletion_auc.svg").stat().st_size > 0
    assert out.index("features.0") < out.index("features.2") and "ci_low" in out
    monkeypatch.setattr(sys, "argv", ["plot_sweep.py", str(tiny_run), "--value", "no_such_column"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 2 and "no_such_column" in capsys.readouterr().err
