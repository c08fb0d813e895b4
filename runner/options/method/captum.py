"""captum's layer attribution methods through the runner's tables (`method=captum method.captum=NAME`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.captum_layer:CaptumLayer", tables=("cam",))
@dataclass
class CaptumConfig(CamConfig):
    name: str = "captum"
    captum: str = "LayerGradientXActivation"  # the captum.attr layer method (SUPPORTED)
    captum_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {n_steps: 16} for integrated gradients
