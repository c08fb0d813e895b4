"""LayerCAM (Jiang et al. 2021): only positive gradients, element-wise.

cam = ReLU(sum_c ReLU(dy/dA_c) * A_c)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.methods.base import register
from runner.methods.cam import CamConfig, CamContext, CamMethod


@dataclass
class LayerCamConfig(CamConfig):
    name: str = "layercam"


@register(LayerCamConfig)
class LayerCAM(CamMethod):
    name = "layercam"

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        assert grad is not None
        return torch.relu((torch.relu(grad) * act).sum(dim=1))  # (B, H, W)
