"""Grad-CAM++ (Chattopadhay et al. 2018): pixel-wise weights alpha for the positive gradients.

    alpha = g^2 / (2 g^2 + sum_{h,w} A * g^3 + eps)     (0 where g = 0; eps = 1e-6 as in pytorch-grad-cam,
                                                        so tiny gradients get small weights, not 1/2)
    w_c   = sum_{h,w} alpha * ReLU(g)              cam = ReLU(sum_c w_c A_c)

using the exponential-score closed form (higher derivatives as powers of the first), as the paper
and pytorch-grad-cam do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class GradCamPlusPlus:
    name = "gradcampp"

    def channel_weights(self, act: Tensor, grad: Tensor) -> Tensor:
        g2, g3 = grad.pow(2), grad.pow(3)
        alpha = g2 / (2 * g2 + act.sum(dim=(2, 3), keepdim=True) * g3 + 1e-6)
        alpha = alpha.where(grad != 0, alpha.new_zeros(()))
        return (alpha * grad.relu()).sum(dim=(2, 3))  # (B, C)
