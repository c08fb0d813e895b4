"""Score-CAM (Wang et al. 2020), forward-only: each channel's map, used as a mask, is scored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS
from runner.schema import ScoreCamWeights


@METHODS.option("runner.methods.scorecam:ScoreCAM", tables=("cam",), family="cam")
@dataclass
class ScoreCamConfig(CamConfig):
    name: str = "scorecam"
    score_chunk: Optional[int] = None  # noqa: UP045 (OmegaConf) masked inputs per forward; null: forward_chunk
    # `paper` (each channel's weight is the target's softmax probability on the masked input, as Wang et al.
    # 2020 and their code) or `pytorch_grad_cam` (a softmax over channels of the target's logits)
    scorecam_weights: ScoreCamWeights = ScoreCamWeights.paper

    SPEED_KEYS: ClassVar[tuple[str, ...]] = ("score_chunk",)  # left out of the resume key

    def check(self) -> list[str]:
        bad = self.score_chunk is not None and self.score_chunk < 1
        return super().check() + ([f"method.score_chunk={self.score_chunk}"] if bad else [])
