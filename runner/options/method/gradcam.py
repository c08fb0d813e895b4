"""Grad-CAM (Selvaraju et al. 2017): channel weight = the gradient averaged over the map.

w_c = mean_{h,w} dy/dA_c        cam = ReLU(sum_c w_c A_c)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class GradCam:
    name = "gradcam"

    def channel_weights(self, act: Tensor, grad: Tensor) -> Tensor:
        return grad.mean(dim=(2, 3))  # (B, C)
