"""Grad-CAM on positive gradients (an example variant): channel weight = the positive part of the gradient,
averaged over the map.

w_c = mean_{h,w} ReLU(dy/dA_c)        cam = ReLU(sum_c w_c A_c)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class GradCamPositive:
    name = "gradcam_positive"

    def channel_weights(self, act: Tensor, grad: Tensor) -> Tensor:
        return grad.relu().mean(dim=(2, 3))  # (B, C)
