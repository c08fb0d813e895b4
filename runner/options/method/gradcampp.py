"""Grad-CAM++ (Chattopadhay et al. 2018): pixel-wise weights alpha for the positive gradients."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.gradcampp:GradCAMPlusPlus", tables=("cam",), family="cam")
@dataclass
class GradCamPlusPlusConfig(CamConfig):
    name: str = "gradcampp"
