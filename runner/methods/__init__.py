"""Methods: the implementations behind runner/options/method/'s options (each option module names its class here).

A method class subclasses `Method` (runner/methods/base.py); the CAM family shares `cam`. These helpers find a
config's implementation through the option registry; nothing here imports a method module until it is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.layers import Layer
from runner.options.registry import METHODS
from runner.runtime import Runtime
from runner.schema import MethodConfig

if TYPE_CHECKING:
    from runner.methods.base import Method
    from runner.methods.cam import CamMethod


def method_config_class(name: str) -> type[MethodConfig]:
    """The config dataclass of the method called `name` (RunnerError with the nearest names if none is)."""
    return METHODS.get(name).schema


def method_config(name: str, **fields: Any) -> MethodConfig:
    """The config of the method called `name` with `fields` (a key of another method is a TypeError)."""
    return METHODS.config(name, **fields)


def method_class(cfg: MethodConfig) -> type[Method]:
    """The method class that runs `cfg`, chosen by its config type."""
    return METHODS.for_config(cfg).load()


def cam_methods() -> dict[str, type[CamMethod]]:
    """The CAM variants (family "cam"): methods that make maps from a layer's activations and gradients."""
    return {option.name: option.load() for option in METHODS if option.family == "cam"}


def build_method(
    cfg: MethodConfig, layers: list[Layer], runtime: Runtime, model_names: list[str] | None = None
) -> Method:
    """The method that runs `cfg` on `layers`; targets by name (method.class_names) become `model_names`' ids."""
    from runner.methods.base import targets_by_name

    return method_class(cfg)(targets_by_name(cfg, model_names), layers, runtime)


__all__ = ["build_method", "cam_methods", "method_class", "method_config", "method_config_class"]
