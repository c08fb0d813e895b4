"""Grad-CAM (Selvaraju et al. 2017): channel weight = the gradient averaged over the map."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.gradcam:GradCAM", tables=("cam",), family="cam")
@dataclass
class GradCamConfig(CamConfig):
    name: str = "gradcam"
