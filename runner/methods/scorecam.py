"""Score-CAM (Wang et al. 2020), forward-only: each channel's map, used as a mask, is scored.

    M_c  = normalise(upsample(A_c)) in [0, 1]         (B, C, H, W), bilinear to the input's size
    p_c  = model(x * M_c)[target]                     all C masked inputs of all samples as batched
                                                      forwards of `method.score_chunk` images
    cam  = ReLU(sum_c w_c A_c)

The channel weights w follow `method.scorecam_weights`:
- `paper` (default): w_c = softmax(p_c)[target], the target's probability on the masked input, as
  the authors' code (haofanwang/Score-CAM, cam/scorecam.py) computes it; a constant channel (nothing
  to mask by) gets weight 0, as there. The paper's Eq. 4 also subtracts the score of a baseline
  image; the authors' code does not, and neither does this.
- `pytorch_grad_cam`: w = softmax over channels of the target's logits (the paper's Algorithm 1 and
  pytorch-grad-cam's `ScoreCAM`), with pytorch-grad-cam's mask: bilinear with align_corners=True,
  scaled by (M - min) / (max - min + 1e-8). The maps equal pytorch-grad-cam's (tests/test_reference.py).
No backward pass runs. Cost: C forwards per sample and layer (512 at VGG16's last conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.chunks import chunked_forward, forward_chunk, indices, target_scores
from runner.methods.cam import CamContext, CamMethod
from runner.schema import ScoreCamWeights
from runner.stats import upsample


def pytorch_grad_cam_masks(maps: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """(N, H, W) masks as pytorch-grad-cam builds them: bilinear (align_corners=True), (M - min) / (max - min + 1e-8)."""
    up = F.interpolate(maps[:, None].float(), size=tuple(size), mode="bilinear", align_corners=True)[:, 0]
    lo = up.flatten(1).amin(dim=1)[:, None, None]
    hi = up.flatten(1).amax(dim=1)[:, None, None]
    return (up - lo) / (hi - lo + 1e-8)


class ScoreCAM(CamMethod):
    name = "scorecam"
    needs_gradients = False

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        b, c, h, w = act.shape
        size = ctx.x.shape[-2:]
        paper = ScoreCamWeights(self.cfg.scorecam_weights) is ScoreCamWeights.paper
        maps = act.reshape(b * c, h, w)
        sample = torch.arange(b, device=act.device).repeat_interleave(c)  # (B*C,) which sample each mask is for
        chunk = forward_chunk(self.cfg.score_chunk, act.device, size)  # small on a CPU (runner/chunks.py)

        def masked(span: range) -> torch.Tensor:  # masks are built per chunk: all B*C at input size would not fit
            idx = indices(span, act.device)
            masks = upsample(maps[idx], size) if paper else pytorch_grad_cam_masks(maps[idx], size)  # (n, H, W)
            return ctx.x[sample[idx]] * masks[:, None]  # (n, C_in, H, W)

        per_mask = ctx.target[sample]  # (B*C,) the class each masked input is scored for
        scores = chunked_forward(ctx.model, masked, chunk, ctx.runtime, target_scores(per_mask, paper), total=b * c)
        scores = scores.reshape(b, c)  # (B, C)
        if paper:
            flat = maps.flatten(1)
            constant = (flat.amax(dim=1) == flat.amin(dim=1)).reshape(b, c)  # (B, C) no mask to apply
            weights = torch.where(constant, torch.zeros_like(scores), scores)
        else:
            weights = scores.softmax(dim=1)  # (B, C) over channels
        return torch.relu(torch.einsum("bc,bchw->bhw", weights, act))
