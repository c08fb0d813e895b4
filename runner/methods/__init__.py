"""Methods by name. Each is one small module; the CAM family shares `cam`, all share `base`."""

from __future__ import annotations

from runner.errors import RunnerError, suggest
from runner.layers import Layer
from runner.methods.base import BatchOutput, Method, Runtime
from runner.methods.cam import CamMethod
from runner.methods.captum_layer import CaptumLayer
from runner.methods.eigencam import EigenCAM
from runner.methods.gradcam import GradCAM
from runner.methods.gradcampp import GradCAMPlusPlus
from runner.methods.hirescam import HiResCAM
from runner.methods.hook_check import HookCheck
from runner.methods.layercam import LayerCAM
from runner.methods.patching import Patching
from runner.methods.record import Record
from runner.methods.sanity import Sanity
from runner.methods.scorecam import ScoreCAM
from runner.methods.xgradcam import XGradCAM
from runner.schema import MethodConfig

CAM_METHODS: dict[str, type[CamMethod]] = {
    m.name: m for m in (GradCAM, GradCAMPlusPlus, XGradCAM, HiResCAM, LayerCAM, EigenCAM, ScoreCAM)
}
METHODS = {**CAM_METHODS, **{m.name: m for m in (CaptumLayer, Sanity, Patching, Record, HookCheck)}}


def build_method(cfg: MethodConfig, layers: list[Layer], runtime: Runtime) -> Method:
    if cfg.name not in METHODS:
        raise RunnerError(f"Unknown method '{cfg.name}'.{suggest(cfg.name, METHODS)} Available: {', '.join(METHODS)}.")
    return METHODS[cfg.name](cfg, layers, runtime)


__all__ = ["CAM_METHODS", "METHODS", "BatchOutput", "Method", "Runtime", "build_method"]
