"""Eigen-CAM (Muhammad & Yeasin 2020, arXiv:2008.00299), gradient-free: the activations' first principal component."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.eigencam:EigenCAM", tables=("cam",), family="cam")
@dataclass
class EigenCamConfig(CamConfig):
    name: str = "eigencam"
