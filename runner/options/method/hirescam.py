"""HiResCAM (Draelos & Carin 2020): the gradient multiplies the activation element-wise, no pooling.

cam = ReLU(sum_c dy/dA_c * A_c)      (exactly the map's contribution to y for a linear head)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class HiResCam:
    name = "hirescam"

    def cam(self, act: Tensor, grad: Tensor | None, ctx: Any) -> Tensor:
        assert grad is not None
        return (grad * act).sum(dim=1).relu()  # (B, H, W)
