"""LayerCAM (Jiang et al. 2021): only positive gradients, element-wise.

cam = ReLU(sum_c ReLU(dy/dA_c) * A_c)
"""

from __future__ import annotations

import torch

from runner.methods.cam import CamContext, CamMethod


class LayerCAM(CamMethod):
    name = "layercam"

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        assert grad is not None
        return torch.relu((torch.relu(grad) * act).sum(dim=1))  # (B, H, W)
