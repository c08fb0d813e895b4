"""Layer selection by name, glob, type and exclusion; clear errors before any data is loaded."""

from __future__ import annotations

import pytest
from torch import nn

from runner.errors import RunnerError
from runner.layers import resolve_layers


def names(layers: list[tuple[str, nn.Module]]) -> list[str]:
    return [n for n, _ in layers]


def test_exact_name_glob_and_type(vgg16: nn.Module) -> None:
    assert names(resolve_layers(vgg16, ["features.28"])) == ["features.28"]
    convs = names(resolve_layers(vgg16, ["features.*:Conv2d"]))
    assert len(convs) == 13 and convs[0] == "features.0" and convs[-1] == "features.28"
    assert names(resolve_layers(vgg16, ["Linear"])) == ["classifier.0", "classifier.3", "classifier.6"]
    assert len(resolve_layers(vgg16, ["features.*"])) == 31


def test_model_order_and_no_duplicates(vgg16: nn.Module) -> None:
    picked = names(resolve_layers(vgg16, ["features.28", "Conv2d", "features.2"]))
    assert picked == names(resolve_layers(vgg16, ["Conv2d"]))


def test_exclusions_by_name_and_type(vgg16: nn.Module) -> None:
    children = names(resolve_layers(vgg16, ["features.*"], exclude=["ReLU", "MaxPool2d"]))
    assert children == names(resolve_layers(vgg16, ["features.*:Conv2d"]))
    assert "features.28" not in names(resolve_layers(vgg16, ["Conv2d"], exclude=["features.28"]))


def test_unknown_name_suggests_nearest(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match=r"features\.31.*does not exist.*Did you mean: features\.3"):
        resolve_layers(vgg16, ["features.31"])


def test_pattern_matching_nothing_fails(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match=r"'blocks\.\*' matches no module"):
        resolve_layers(vgg16, ["blocks.*"])


def test_unknown_type_lists_types(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match=r"no module of type 'Conv3d'.*Conv2d"):
        resolve_layers(vgg16, ["Conv3d"])


def test_exclusions_removing_everything_fail(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match="remove every layer"):
        resolve_layers(vgg16, ["features.28"], exclude=["Conv2d"])


# ---- own models first: an experiment's layers and hooks belong to the model it names ---------------------------------
@pytest.mark.slow
def test_another_model_inherits_neither_the_experiments_layers_nor_its_hooks() -> None:
    from tests.conftest import make_config

    default = make_config()
    assert default.for_model.model == "embedded:efficientnet_lite0"
    assert default.layers.include == default.for_model.include and default.hooks == default.for_model.hooks
    for change in (["model=vgg16"], ["model._target_=tests.conftest.TinyNet"], ["model=timm", "model.name=resnet18"],
                   ["model=resnet18", "model.checkpoint=x.pt"]):  # fmt: skip
        config = make_config(*change)
        assert config.layers.include == ["auto"] and config.hooks == [], change
    # A checkpoint of the experiment's own model keeps them; what the user sets wins for any model.
    same = make_config("model.checkpoint=x.pt")
    assert same.layers.include == default.layers.include and same.hooks == default.hooks
    mine = make_config("model=vgg16", "layers.include=[features.28]", "hooks=[{kind: forward}]")
    assert mine.layers.include == ["features.28"] and [h.kind.value for h in mine.hooks] == ["forward"]
    assert make_config("layers.include=auto").layers.include == ["auto"]  # explicit, for the default model too
    assert make_config("layers.include=[auto,_conv_head]").hooks == default.hooks
    with pytest.raises(RunnerError, match=r"layers.include=5: give a list of layer selectors"):
        make_config("layers.include=5")


def test_dropping_the_experiments_selection_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest import make_config

    with caplog.at_level("INFO", logger="runner.layers"):
        make_config("model=vgg16")
    text = caplog.text
    assert "the experiment's layers (_blocks.2, " in text and "torchvision:vgg16: layers.include=auto" in text
    assert "the experiment's 4 hook(s) name modules of embedded:efficientnet_lite0" in text


def test_selector_errors_name_the_config_entry(vgg16: nn.Module) -> None:
    with pytest.raises(RunnerError, match=r"'features\.99' does not exist.*\(from hooks\[2\]\.layers\)"):
        resolve_layers(vgg16, ["features.99"], where="hooks[2].layers")
    with pytest.raises(RunnerError, match=r"'blocks\.\*' matches no module.*\(from layers\.include\)"):
        resolve_layers(vgg16, ["blocks.*"])
    with pytest.raises(RunnerError, match=r"no module of type 'Conv3d'.*\(from layers\.exclude\)"):
        resolve_layers(vgg16, ["Conv2d"], exclude=["Conv3d"])
    with pytest.raises(RunnerError, match=r"method\.randomize: 'auto' is chosen from a forward"):
        resolve_layers(vgg16, ["auto"], where="method.randomize")


@pytest.mark.slow
def test_a_run_names_the_entry_of_a_layer_it_cannot_find(tmp_path) -> None:  # noqa: ANN001
    """The sanity experiment's `method.randomize` names EfficientNet modules: on VGG16 the error says so."""
    import runner.app as app
    from tests.conftest import make_config

    config = make_config("experiment=sanity_randomization", "model=vgg16", "model.weights=null", "debug=tiny")
    assert config.layers.include == ["auto"]  # its layers are not inherited; its method's own entry is the user's
    with pytest.raises(RunnerError, match=r"Layer '_fc' does not exist.*\(from method\.randomize\)"):
        app.run(config, tmp_path)
