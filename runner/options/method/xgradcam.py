"""XGrad-CAM (Fu et al. 2020): gradients weighted by the normalised activations.

w_c = sum_{h,w} (A_c / sum_{h,w} A_c) * dy/dA_c        cam = ReLU(sum_c w_c A_c)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class XGradCam:
    name = "xgradcam"

    def channel_weights(self, act: Tensor, grad: Tensor) -> Tensor:
        total = act.sum(dim=(2, 3))  # (B, C)
        return (grad * act).sum(dim=(2, 3)) / (total + 1e-7)
