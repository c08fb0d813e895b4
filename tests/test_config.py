"""The config tree composes into the typed schema; typos and wrong types fail at start-up."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from runner.errors import RunnerError
from runner.schema import HookAction, HookKind, Precision, RunConfig
from tests.conftest import CONF, make_config


def test_default_composes_to_typed_objects() -> None:
    cfg = make_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.model.name == "efficientnet_lite0" and cfg.data.name == "skimage_photos"
    assert {h.kind for h in cfg.hooks} == set(HookKind)  # the default records all four kinds
    assert all(isinstance(h.action, HookAction) for h in cfg.hooks)
    assert cfg.precision is Precision.fp32


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment: str) -> None:
    cfg = make_config(f"experiment={experiment}")
    assert cfg.name == experiment
    assert cfg.layers.include, "every experiment selects target layers"


@pytest.mark.parametrize(
    "override",
    [
        "model.nmae=vgg16",  # misspelled key
        "+model.nmae=vgg16",  # `+` cannot smuggle in a key the schema lacks
        "data.batch_size=four",  # wrong type
        "precision=fp8",  # not in the enum
        "hooks=[{kind: sideways}]",  # unknown hook kind
        "hooks=[{kind: forward, action: explode}]",  # unknown action
    ],
)
def test_bad_config_fails_at_composition(override: str) -> None:
    with pytest.raises((ConfigCompositionException, ValidationError, RunnerError)) as info:
        make_config(override)
    message = str(info.value) + str(getattr(info.value, "__cause__", ""))
    assert any(word in message for word in ("nmae", "four", "fp8", "sideways", "explode"))
