"""Grad-CAM element-wise (pytorch-grad-cam's `GradCAMElementWise`): no channel weights, the positive part of
each activation times its gradient, summed over channels."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.gradcam_elementwise:GradCAMElementWise", tables=("cam",), family="cam")
@dataclass
class GradCamElementWiseConfig(CamConfig):
    name: str = "gradcam_elementwise"
