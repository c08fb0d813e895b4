"""Eigen-CAM (Muhammad & Yeasin 2020), gradient-free: the activations' first principal component.

Each sample's activations, as H*W points in channel space, are centred and projected on their
first right singular vector. The sign of a singular vector is arbitrary; it is chosen so that the
map correlates positively with the channel-summed activation, then ReLU. No backward pass runs.
"""

from __future__ import annotations

import torch

from runner.methods.cam import CamContext, CamMethod


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
