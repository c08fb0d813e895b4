"""HiResCAM (Draelos & Carin 2020): the gradient multiplies the activation element-wise, no pooling."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.hirescam:HiResCAM", tables=("cam",), family="cam")
@dataclass
class HiResCamConfig(CamConfig):
    name: str = "hirescam"
