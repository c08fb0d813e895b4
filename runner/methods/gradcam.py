"""Grad-CAM (Selvaraju et al. 2017): channel weight = the gradient averaged over the map.

w_c = mean_{h,w} dy/dA_c        cam = ReLU(sum_c w_c A_c)
"""

from __future__ import annotations

import torch

from runner.methods.cam import CamMethod


class GradCAM(CamMethod):
    name = "gradcam"

    def channel_weights(self, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad.mean(dim=(2, 3))  # (B, C)
