"""LayerCAM (Jiang et al. 2021): only positive gradients, element-wise.

cam = ReLU(sum_c ReLU(dy/dA_c) * A_c)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.options.method.cam import cam_variant

if TYPE_CHECKING:
    from torch import Tensor


@cam_variant
class LayerCam:
    name = "layercam"

    def cam(self, act: Tensor, grad: Tensor | None, ctx: Any) -> Tensor:
        assert grad is not None
        return (grad.relu() * act).sum(dim=1).relu()  # (B, H, W)
