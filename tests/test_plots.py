"""runner/plots.py: per-layer curves in model order with bootstrap bands, MPRT curves, each table's standard figures."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from runner import app, figure_style
from runner.plots import mprt_figure, per_layer_figure, table_figures
from runner.results import load
from runner.schema import FiguresConfig
from runner.summary import layers_in_model_order
from tests.conftest import make_config

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


def test_layers_in_model_order_and_one_line_per_swept_value() -> None:
    frame = frame_of(
        {"features.28": 28, "features.2": 2, "features.10": 10}, samples=3, methods=("layercam", "gradcam")
    )
    fig = per_layer_figure(frame, "value", by="sweep.method")
    ax = fig.axes[0]
    assert tick_texts(ax) == ["features.2", "features.10", "features.28"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["gradcam", "layercam"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gradcam", "layercam"]
    # y follows the x order: layercam (m=0) at features.2 is mean(2 + s for s in 0..2) = 3, gradcam 103.
    np.testing.assert_allclose(lines["layercam"].get_ydata(), [3, 11, 29])
    np.testing.assert_allclose(lines["gradcam"].get_ydata(), [103, 111, 129])
    assert "layer" in ax.get_xlabel() and ax.get_title()


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
    [(_, fig)] = table_figures("cam", only_nan.assign(cam_max=1.0))  # no AUC values: the map's maximum instead
    assert fig.axes[0].get_ylabel() == "mean cam_max"


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
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["_blocks.5", "_blocks.10", "_conv_head"]
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
    frame = frame_of({"a": 0, "b": 1}, samples=2).rename(columns={"value": "cam_max"})
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
        assert "random map" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
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
