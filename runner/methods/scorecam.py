"""Score-CAM (Wang et al. 2020), forward-only: each channel's map, used as a mask, is scored.

    M_c  = normalise(upsample(A_c)) in [0, 1]         (B, C, H, W)
    s_c  = softmax(model(x * M_c))[target]            all C masked inputs of all samples as batched
                                                      forwards of `method.score_chunk` images
    w    = softmax_c(s)                                cam = ReLU(sum_c w_c A_c)
No backward pass runs. Cost: C forwards per sample and layer (512 at VGG16's last conv).
"""

from __future__ import annotations

import torch

from runner.faithfulness import probabilities, upsample
from runner.methods.cam import CamContext, CamMethod


class ScoreCAM(CamMethod):
    name = "scorecam"
    needs_gradients = False

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        b, c, h, w = act.shape
        size = ctx.x.shape[-2:]
        maps = act.reshape(b * c, h, w)
        sample = torch.arange(b, device=act.device).repeat_interleave(c)  # (B*C,) which sample each mask is for
        scores = []
        chunk = self.cfg.score_chunk
        for start in range(0, b * c, chunk):  # masks are built per chunk: all B*C at input size would not fit
            idx = torch.arange(start, min(start + chunk, b * c), device=act.device)
            masks = upsample(maps[idx], size)[:, None]  # (n, 1, H, W) in [0, 1]
            masked = ctx.x[sample[idx]] * masks
            scores.append(probabilities(ctx.model, masked, ctx.target[sample[idx]], chunk, ctx.runtime))
        weights = torch.cat(scores).reshape(b, c).softmax(dim=1)  # (B, C)
        return torch.relu(torch.einsum("bc,bchw->bhw", weights, act))
