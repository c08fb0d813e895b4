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
