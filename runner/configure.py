"""The typed, checked config of a run: composed values in their schemas, the run's own model's layers and hooks,
the thread count resolved, every range checked."""

from __future__ import annotations

from omegaconf import DictConfig

from runner.layers import own_selection
from runner.options.compose import typed_config
from runner.schema import RunConfig, validate, with_threads


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The typed config for library code; a DictConfig is validated against the schema on the way. Its
    `layers.include` and `hooks` are the run's own model's (runner.layers.own_selection)."""
    if isinstance(cfg, RunConfig):
        return validate(with_threads(own_selection(cfg)))
    config = typed_config(cfg)
    return validate(with_threads(own_selection(config)))
