"""Grad-CAM element-wise (pytorch-grad-cam's `GradCAMElementWise`): no channel weights, the positive part of
each activation times its gradient, summed over channels.

cam = ReLU(sum_c ReLU(dy/dA_c * A_c))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class GradCamElementWise:
    name = "gradcam_elementwise"

    def cam(self, act: Tensor, grad: Tensor | None, ctx: Any) -> Tensor:
        assert grad is not None
        return (grad * act).relu().sum(dim=1).relu()  # (B, H, W)
