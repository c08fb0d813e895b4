"""`runner layers`: the model's modules from one dry forward; the same forward checks a run's layers before data loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import runner.app as app
from runner.commands.layers import format_table, layer_table, main
from runner.errors import RunnerError
from runner.layers import _cam_usable, check_selection, dry_forward, named_layers
from tests.conftest import SharedActivation, TinyNet, make_config, tiny_vit

TINY = ["model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,32,32]",
        "data.count=2", "data.batch_size=2", "data.num_classes=5", "hooks=[]"]  # fmt: skip
EFFNET = ["data.image_size=64", "hooks=[]"]


class SpareNet(TinyNet):
    """TinyNet with a dropout that its forward never calls (as timm's `attn_drop` under fused attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Dropout()


def no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ---- the table -------------------------------------------------------------------------------------------------
def test_tinynet_table_in_model_order_with_shapes_calls_cam_and_selection() -> None:
    table = layer_table(make_config(*TINY, "layers.include=[features.2]"))
    assert table["layer"].tolist() == [n for n, _ in TinyNet().named_modules() if n]
    assert table["layer_index"].tolist() == list(range(len(table)))
    row = table.set_index("layer")
    assert row.loc["features.0", "type"] == "Conv2d" and row.loc["features.0", "output_shape"] == "1x6x32x32"
    assert row.loc["pool", "output_shape"] == "1x8x1x1" and row.loc["fc", "output_shape"] == "1x5"
    assert row["calls"].tolist() == [1] * len(table) and row.loc["features", "calls"] == 1
    assert row.loc["features.2", "cam"] and not row.loc["fc", "cam"]
    assert table[table["selected"]]["layer"].tolist() == ["features.2"]
    assert table.attrs["input_shape"] == [3, 32, 32] and table.attrs["selection_error"] is None


@pytest.mark.slow
def test_embedded_effnet_table_at_64px() -> None:
    table = layer_table(make_config(*EFFNET, "layers.include=[_blocks.15,_conv_head]"))
    row = table.set_index("layer")
    assert len(table) == 184 and table["layer"].iloc[0] == "_conv_stem"
    assert row.loc["_conv_stem", "output_shape"] == "1x32x32x32"  # stride 2 at 64 px
    assert row.loc["_fc", "output_shape"] == "1x1000" and not row.loc["_fc", "cam"]
    assert row.loc["_swish", "calls"] == 2  # one activation module called twice per forward
    assert table[table["selected"]]["layer"].tolist() == ["_blocks.15", "_conv_head"]


def test_call_counts_and_hooks_removed_also_on_error(tiny: nn.Module) -> None:
    shared = SharedActivation()
    probes = dry_forward(shared, torch.zeros(4), named_layers(shared))
    assert probes["act"].calls == 2 and probes["a"].calls == 1 and probes["act"].output == "1x4"
    assert no_hooks(shared)
    tiny.train()
    with pytest.raises(RuntimeError):
        dry_forward(tiny, torch.zeros(4, 8, 8), named_layers(tiny))  # 4 channels: the first conv refuses
    assert no_hooks(tiny) and tiny.training  # hooks gone and train mode restored after the failure
    # A run's check leaves an input the model refuses to the input check after data loading (the real sample).
    assert check_selection(tiny, named_layers(tiny), torch.zeros(4, 8, 8)) is None and no_hooks(tiny)


def test_cam_usable_for_spatial_maps_and_square_token_grids() -> None:
    assert _cam_usable((1, 8, 4, 4)) and _cam_usable((1, 17, 16)) and _cam_usable((1, 16, 16))
    assert not _cam_usable((1, 15, 16)) and not _cam_usable((1, 10)) and not _cam_usable((1, 2, 3, 4, 5))
    vit = tiny_vit().eval()
    probes = dry_forward(vit, torch.zeros(3, 32, 32), named_layers(vit))
    assert probes["encoder.layers.encoder_layer_1"].output == "1x17x16" and probes["encoder.layers.encoder_layer_1"].cam
    assert not probes["heads.head"].cam


def test_main_prints_filtered_table_and_selection_notes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--grep", "^features\\.[02]$", "layers.include=[features.2]"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split() == ["1", "features.0", "Conv2d", "1x6x32x32", "1", "yes"]
    assert lines[2].split() == ["3", "*", "features.2", "Conv2d", "1x8x32x32", "1", "yes"]
    assert len(lines) == 4 and "2 of 7 modules shown" in lines[3]
    assert main([*TINY, "layers.include=[layer4.*]"]) == 0  # the table still prints; the selection's error follows
    out = capsys.readouterr().out
    assert "Selection: Layer selector 'layer4.*' matches no module" in out and "features.*" in out
    assert main([*TINY, "no_such_key=1"]) == 2
    assert "[ERROR]" in capsys.readouterr().err


def test_runner_command_dispatches_layers(capsys: pytest.CaptureFixture[str]) -> None:
    from runner.commands.cli import main as cli_main

    assert cli_main(["layers", *TINY, "--grep", "Linear"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["6", "fc", "Linear", "1x5", "1"]


def test_format_table_marks_selected_modules_never_called() -> None:
    table = layer_table(make_config(*TINY, "model._target_=tests.test_layer_table.SpareNet", "layers.include=[spare]"))
    assert table.set_index("layer").loc["spare", "calls"] == 0
    assert "never called in the forward (a run would fail): spare" in format_table(table)


# ---- the run's layer check, before data loads ------------------------------------------------------------------
@pytest.fixture
def no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that gets as far as building its data fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data source was built before the layer check")

    monkeypatch.setattr(app, "build_dataset", refuse)


@pytest.mark.usefixtures("no_data")
def test_run_fails_on_modules_never_called_before_data_loads(tmp_path: Path) -> None:
    config = make_config(*TINY, "model._target_=tests.test_layer_table.SpareNet", "layers.include=[features.2,spare]")
    with pytest.raises(RunnerError, match=r"never called in the forward pass.*: spare\..*layers\.exclude=\[Dropout\]"):
        app.run(config, tmp_path / "out")


@pytest.mark.usefixtures("no_data")
def test_hook_layers_never_called_fail_too(tmp_path: Path) -> None:
    config = make_config(
        *TINY, "model._target_=tests.test_layer_table.SpareNet", "layers.include=[features.2]",
        "hooks=[{kind: forward, layers: [spare]}]",
    )  # fmt: skip
    with pytest.raises(RunnerError, match=r"never called.*: spare\."):
        app.run(config, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.usefixtures("no_data")
def test_glob_matching_nothing_suggests_before_data_loads(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match=r"'layer4\.\*' matches no module\. Modules at the top level: .*_blocks\.\*"):
        app.run(make_config(*EFFNET, "layers.include=[layer4.*]"), tmp_path / "a")
    with pytest.raises(RunnerError, match=r"'_block\.\*' matches no module\. Did you mean: _blocks\.\*\?"):
        app.run(make_config(*EFFNET, "layers.include=[_block.*]"), tmp_path / "b")


# ---- layer_index in every table with a layer; summaries in model order -------------------------------------------
class DeepNet(nn.Module):
    """VGG-like: `features.0` ... `features.11` (conv, ReLU pairs), so that names sort features.10 before features.2."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        convs = [nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1) for i in range(6)]
        self.features = nn.Sequential(*(m for conv in convs for m in (conv, nn.ReLU(inplace=True))))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.features(x)).flatten(1))


DEEP = [*TINY, "model._target_=tests.test_layer_table.DeepNet"]


def test_tables_carry_layer_index_in_model_order(tmp_path: Path) -> None:
    from runner.layers import layer_order
    from runner.results import load

    hooks = "hooks=[{kind: forward, layers: [features.10]}, {kind: forward, layers: [features.2]}]"
    result = app.run(make_config(*DEEP, "layers.include=[Conv2d]", hooks), tmp_path)
    order = layer_order(DeepNet())
    for table in ("cam", "hooks"):
        frame = load(result.output_dir, table)
        assert frame["layer_index"].tolist() == [order[n] for n in frame["layer"]], table
        assert frame.columns.get_loc("layer_index") == frame.columns.get_loc("layer") + 1
    cams = load(result.output_dir, "cam").sort_values("layer_index", kind="stable")
    assert list(dict.fromkeys(cams["layer"])) == [f"features.{i}" for i in (0, 2, 4, 6, 8, 10)]
    assert order["features.2"] == 3 and order["features.10"] == 11  # named_modules order, `features` itself is 0


@pytest.mark.slow
def test_load_gives_layer_as_an_ordered_categorical_in_model_order_across_runs(tmp_path: Path) -> None:
    """Two runs (as two sweep jobs) with different layer sets: one table, the union of layers in model order."""
    import pandas as pd

    from runner.results import load

    app.run(make_config(*DEEP, "layers.include=[features.10,features.2]"), tmp_path / "0")
    app.run(make_config(*DEEP, "layers.include=[features.4,features.0]"), tmp_path / "1")
    order = ["features.0", "features.2", "features.4", "features.10"]
    frame = load(tmp_path)  # the cam table: the runs' main table
    assert isinstance(frame["layer"].dtype, pd.CategoricalDtype) and frame["layer"].cat.ordered
    assert list(frame["layer"].cat.categories) == order
    assert frame.groupby("layer")["cam_max"].mean().index.tolist() == order
    assert list(frame.sort_values("layer")["layer"].unique()) == order  # sorting is model order too
    assert list(load(tmp_path / "0")["layer"].cat.categories) == ["features.2", "features.10"]
    assert list(load(tmp_path / "1" / "cam.parquet" / "part-000000.parquet")["layer"].cat.categories) == [
        "features.0",
        "features.4",
    ]


def test_console_summary_and_scripts_order_layers_by_layer_index(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import pandas as pd

    import runner.hooks  # noqa: F401  (declares the hooks table and how it is summarised)
    from runner.frames import in_model_order, layers_in_model_order
    from runner.viz.summary import summarise

    folder = tmp_path / "hooks.parquet"
    folder.mkdir()
    rows = pd.DataFrame({"layer": ["features.10", "features.2", "features.10", "features.2"],
                         "layer_index": [11, 3, 11, 3], "hook": ["forward"] * 4, "mean": [1.0, 2.0, 3.0, 4.0]})  # fmt: skip
    rows.to_parquet(folder / "part-000000.parquet")
    with caplog.at_level("INFO", logger="runner.viz.summary"):
        summarise({"hooks": folder})
    text = caplog.text
    assert text.index("features.2 ") < text.index("features.10 ")
    assert layers_in_model_order(rows) == ["features.2", "features.10"]
    assert in_model_order(rows, ["layer", "hook"])["layer"].tolist() == ["features.2"] * 2 + ["features.10"] * 2
    assert layers_in_model_order(rows.drop(columns="layer_index")) == ["features.10", "features.2"]  # older tables


def test_console_summary_of_a_metric_table_shows_each_metric_beside_its_baseline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import pandas as pd

    import runner.metrics.table  # noqa: F401  (declares the evaluation table and how it is summarised)
    from runner.viz.summary import summarise

    evaluation, other = tmp_path / "evaluation.parquet", tmp_path / "other.parquet"
    evaluation.mkdir(), other.mkdir()
    pd.DataFrame({"layer": ["a"] * 4, "layer_index": [1] * 4, "call": [0] * 4,
                  "metric": ["road", "road", "sparseness", "sparseness"], "variant": ["morf", "lerf", "", ""],
                  "value": [0.1, 0.3, 0.5, 0.7], "random_value": [0.2, 0.2, 0.4, 0.4]}).to_parquet(evaluation / "part-000000.parquet")  # fmt: skip
    pd.DataFrame({"layer": ["a", "b"], "x": [1, 2]}).to_parquet(other / "part-000000.parquet")
    with caplog.at_level("INFO", logger="runner.viz.summary"):
        summarise({"evaluation": evaluation, "other": other}, {"other": ("mean",)})
    text = caplog.text
    assert "Empty DataFrame" not in text
    assert "random_value" in text and "morf" in text and "sparseness" in text  # per metric and variant
    assert "other: 2 rows" in text  # nothing to average: its row count only


# ---- layers.include=auto: a few evenly spaced blocks with spatial outputs, per model ---------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "size", "chosen"),
    [
        ("resnet18", 224, ["layer1.1", "layer2.1", "layer3.1", "layer4.1"]),  # BasicBlocks: each stage's last
        ("resnet18", 32, ["layer1.1", "layer2.0", "layer3.0", "layer3.1"]),  # layer4 is 1x1 at 32 px: left out
        ("vgg16", 64, ["features.7", "features.14", "features.21", "features.28"]),  # no blocks: its Conv2d layers
    ],
)
def test_auto_picks_evenly_spaced_blocks_with_spatial_outputs(build: str, size: int, chosen: list[str]) -> None:
    import torchvision

    from runner.layers import auto_layers

    model = getattr(torchvision.models, build)(weights=None).eval()
    assert auto_layers(model, torch.zeros(3, size, size)) == chosen
    assert no_hooks(model)


def test_auto_on_tokens_and_a_model_without_blocks(tiny: nn.Module) -> None:
    from runner.layers import auto_layers

    vit = tiny_vit().eval()  # two EncoderBlocks of 17 tokens: a class token and a 4x4 grid
    assert auto_layers(vit, torch.zeros(3, 32, 32)) == [
        "encoder.layers.encoder_layer_0",
        "encoder.layers.encoder_layer_1",
    ]
    assert auto_layers(vit, torch.zeros(3, 32, 32), token_prefix=0) != auto_layers(vit, torch.zeros(3, 32, 32))
    assert auto_layers(tiny, torch.zeros(3, 8, 8)) == ["features.0", "features.2"]  # its Conv2d layers


@pytest.mark.slow
def test_auto_in_runner_layers_and_in_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`auto` alone or beside other selectors, in layers.include and in a hook's layers; the choice is logged."""
    assert main([*TINY, "layers.include=auto"]) == 0
    captured = capsys.readouterr()
    assert "2 selected (*)" in captured.out and "layers.include=auto: features.0, features.2" in captured.err
    config = make_config(*TINY, "layers.include=[features.2,auto]", "hooks=[{kind: forward, layers: [auto]}]")
    result = app.run(config, tmp_path)
    import pandas as pd

    assert set(pd.read_parquet(result.tables["cam"])["layer"]) == {"features.0", "features.2"}
    assert set(pd.read_parquet(result.tables["hooks"])["layer"]) == {"features.0", "features.2"}
