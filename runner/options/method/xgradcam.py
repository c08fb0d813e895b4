"""XGrad-CAM (Fu et al. 2020): gradients weighted by the normalised activations."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.xgradcam:XGradCAM", tables=("cam",), family="cam")
@dataclass
class XGradCamConfig(CamConfig):
    name: str = "xgradcam"
