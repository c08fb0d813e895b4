"""Grad-CAM element-wise (pytorch-grad-cam's `GradCAMElementWise`): no channel weights, the positive part of
each activation times its gradient, summed over channels.

cam = ReLU(sum_c ReLU(dy/dA_c * A_c))

This file is the whole of a CAM variant: its config (the option's schema), its map, its registration;
conf/method/gradcam_elementwise.yaml makes it `method=gradcam_elementwise`.
"""

from __future__ import annotations

import torch

from runner.methods.cam import CamContext, CamMethod


class GradCAMElementWise(CamMethod):
    name = "gradcam_elementwise"

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        assert grad is not None
        return torch.relu(torch.relu(grad * act).sum(dim=1))  # (B, H, W)
