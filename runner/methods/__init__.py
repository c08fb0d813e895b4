"""Methods by name. Each is one small module; all share `base`."""

from __future__ import annotations

from runner.errors import RunnerError, suggest
from runner.layers import Layer
from runner.methods.base import BatchOutput, Method, Runtime
from runner.methods.gradcam import GradCAM
from runner.methods.hook_check import HookCheck
from runner.methods.record import Record
from runner.schema import MethodConfig

METHODS = {m.name: m for m in (GradCAM, Record, HookCheck)}


def build_method(cfg: MethodConfig, layers: list[Layer], runtime: Runtime) -> Method:
    if cfg.name not in METHODS:
        raise RunnerError(f"Unknown method '{cfg.name}'.{suggest(cfg.name, METHODS)} Available: {', '.join(METHODS)}.")
    return METHODS[cfg.name](cfg, layers, runtime)


__all__ = ["METHODS", "BatchOutput", "Method", "Runtime", "build_method"]
