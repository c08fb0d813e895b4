"""A segmentation output's (B, K, H, W) channel of the class summed over a region (pytorch-grad-cam's SemanticSegmentationTarget).

The region is the data's localisation mask of each sample, or `region: [top, left, bottom, right]`, a box in fractions
of the output's height and width."""

from dataclasses import dataclass
from typing import Optional

from runner.errors import RunnerError
from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.segmentation:SegmentationRegion")
@dataclass
class SegmentationRegionTargetConfig(TargetConfig):
    name: str = "segmentation_region"
    # [top, left, bottom, right] in [0, 1], fractions of the output's height and width; null: the data's masks.
    region: Optional[list[float]] = None  # noqa: UP045 (OmegaConf)

    def check(self) -> list[str]:
        box = self.region
        if box is not None and (
            len(box) != 4 or not all(0 <= v <= 1 for v in box) or box[0] >= box[2] or box[1] >= box[3]
        ):
            raise RunnerError(
                f"target.region={list(box)}: give [top, left, bottom, right] as fractions in [0, 1] with"
                " top < bottom and left < right, e.g. target.region=[0.25,0.25,0.75,0.75]."
            )
        return []
