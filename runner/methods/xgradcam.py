"""XGrad-CAM (Fu et al. 2020): gradients weighted by the normalised activations.

w_c = sum_{h,w} (A_c / sum_{h,w} A_c) * dy/dA_c        cam = ReLU(sum_c w_c A_c)
"""

from __future__ import annotations

import torch

from runner.methods.cam import CamMethod


class XGradCAM(CamMethod):
    name = "xgradcam"

    def channel_weights(self, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        total = act.sum(dim=(2, 3))  # (B, C)
        return (grad * act).sum(dim=(2, 3)) / (total + 1e-7)
