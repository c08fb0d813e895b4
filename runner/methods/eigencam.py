"""Eigen-CAM (Muhammad & Yeasin 2020, arXiv:2008.00299), gradient-free: the activations' first principal component.

Each sample's activations, as H*W points in channel space, are centred (as pytorch-grad-cam's
`get_2d_projection` does) and projected on their first right singular vector, then ReLU. No
backward pass runs.

The sign of a singular vector is arbitrary, and the paper gives no rule for it. The rule here is
the runner's own: the sign that makes the map correlate positively with the channel-summed
activation (the component points where the layer is active). It differs from
- pytorch-grad-cam's `EigenCAM`: keeps whatever sign LAPACK's SVD returns, so its map can be the
  ReLU of the negated component (the background); where the signs agree the maps are equal
  (tests/test_reference.py compares up to this sign);
- pytorch-grad-cam's `get_2d_projection_with_sign_correction` (Seg-Eigen-CAM, Chung & Ying 2025,
  Eq. 13): flips when |min| > |max| of the projection, a rule on the extremes, not on the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.methods.base import register
from runner.methods.cam import CamConfig, CamContext, CamMethod


@dataclass
class EigenCamConfig(CamConfig):
    name: str = "eigencam"


@register(EigenCamConfig)
class EigenCAM(CamMethod):
    name = "eigencam"
    needs_gradients = False

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        b, c, h, w = act.shape
        points = act.reshape(b, c, h * w).transpose(1, 2)  # (B, HW, C)
        centred = points - points.mean(dim=1, keepdim=True)
        _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # vh: (B, k, C)
        projection = (centred @ vh[:, 0, :, None]).squeeze(2)  # (B, HW)
        reference = points.sum(dim=2) - points.sum(dim=2).mean(dim=1, keepdim=True)  # (B, HW)
        sign = torch.sign((projection * reference).sum(dim=1, keepdim=True))
        sign = torch.where(sign == 0, torch.ones_like(sign), sign)
        return torch.relu(projection * sign).reshape(b, h, w)
