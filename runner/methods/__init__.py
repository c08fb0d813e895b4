"""Methods, one registry: each module of this package defines a config dataclass (its option's schema), a
method class, and `@register(ItsConfig)`; importing the package imports every module, so a new method is
one file here plus one YAML in conf/method/ (whose defaults list names `/schema/method/<name>`). A method
too large for one file is a subpackage whose `__init__` registers it (`patching/`).
The CAM family shares `cam`, all share `base`."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from runner.layers import Layer
from runner.methods.base import METHODS, BatchOutput, Method, register, targets_by_name
from runner.runtime import Runtime
from runner.schema import MethodConfig

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

from runner.methods.cam import CamMethod  # noqa: E402 (after the modules that register)
from runner.methods.captum_layer import CaptumLayer  # noqa: E402

# The CAM variants: methods that make maps from a layer's activations (and gradients); `sanity` compares them.
CAM_METHODS: dict[str, type[CamMethod]] = {
    config.name: method
    for config, method in METHODS.items()
    if issubclass(method, CamMethod) and not issubclass(method, CaptumLayer)
}


def method_config_class(name: str) -> type[MethodConfig]:
    """The config dataclass of the method called `name` (RunnerError with the nearest names if none is)."""
    return METHODS.key(name)


def method_config(name: str, **fields: Any) -> MethodConfig:
    """The config of the method called `name` with `fields` (a key of another method is a TypeError)."""
    return method_config_class(name)(**fields)


def method_class(cfg: MethodConfig) -> type[Method]:
    """The method class that runs `cfg`, chosen by its config type."""
    return METHODS.for_config(cfg, "method")


def build_method(
    cfg: MethodConfig, layers: list[Layer], runtime: Runtime, model_names: list[str] | None = None
) -> Method:
    """The method that runs `cfg` on `layers`; targets by name (method.class_names) become `model_names`' ids."""
    return method_class(cfg)(targets_by_name(cfg, model_names), layers, runtime)


__all__ = [
    "CAM_METHODS",
    "METHODS",
    "BatchOutput",
    "Method",
    "Runtime",
    "build_method",
    "method_class",
    "method_config",
    "method_config_class",
    "register",
]
