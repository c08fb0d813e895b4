"""LayerCAM (Jiang et al. 2021): only positive gradients, element-wise."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.layercam:LayerCAM", tables=("cam",), family="cam")
@dataclass
class LayerCamConfig(CamConfig):
    name: str = "layercam"
