"""A segmentation model's class channel summed over a region (pytorch-grad-cam's SemanticSegmentationTarget)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.errors import RunnerError
from runner.options.target.segmentation_region import SegmentationRegionTargetConfig


class SegmentationRegion:
    """sum over the region of output[b, class_b]: the region a box in fractions (`region`) or each sample's mask."""

    def __init__(self, config: SegmentationRegionTargetConfig) -> None:
        self.region = None if config.region is None else [float(v) for v in config.region]

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        if output.dim() != 4:
            raise RunnerError(
                "target=segmentation_region takes a segmentation model's (batch, classes, height, width) output; the"
                f" model returned {tuple(output.shape)}. A classifier takes target=logit or probability."
            )
        b, _, h, w = output.shape
        channel = output[torch.arange(b, device=output.device), classes]  # (B, H, W) the class's scores
        return (channel * self.mask(b, h, w, masks, output.device).to(output.dtype)).flatten(1).sum(dim=1)

    def mask(self, b: int, h: int, w: int, masks: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """(B, H, W) 0/1 region at the output's resolution."""
        if self.region is not None:
            top, left, bottom, right = self.region
            # Rounded to whole pixels, at least one pixel each way: a thin box still covers something.
            r0, c0 = min(round(top * h), h - 1), min(round(left * w), w - 1)
            r1, c1 = max(round(bottom * h), r0 + 1), max(round(right * w), c0 + 1)
            box = torch.zeros(h, w, device=device)
            box[r0:r1, c0:c1] = 1
            return box.expand(b, h, w)
        if masks is None:
            raise RunnerError(
                "target=segmentation_region needs a region: set target.region=[top,left,bottom,right] (fractions of"
                " the output), or use data with localisation masks."
            )
        masks = masks.to(device).float()
        if masks.shape[-2:] != (h, w):  # the input's masks at the output's resolution
            masks = F.interpolate(masks[:, None], size=(h, w), mode="nearest")[:, 0]
        return masks
