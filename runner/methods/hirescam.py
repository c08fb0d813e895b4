"""HiResCAM (Draelos & Carin 2020): the gradient multiplies the activation element-wise, no pooling.

cam = ReLU(sum_c dy/dA_c * A_c)      (exactly the map's contribution to y for a linear head)
"""

from __future__ import annotations

import torch

from runner.methods.cam import CamContext, CamMethod


class HiResCAM(CamMethod):
    name = "hirescam"

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        assert grad is not None
        return torch.relu((grad * act).sum(dim=1))  # (B, H, W)
