"""The class's logit minus another class's (`other`), or minus the largest other logit (`other: null`)."""

from dataclasses import dataclass
from typing import Optional

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.classifier:LogitDifference")
@dataclass
class LogitDifferenceTargetConfig(TargetConfig):
    name: str = "logit_difference"
    # The class subtracted, by id; null: for each sample the highest-scoring class other than the one explained.
    other: Optional[int] = None  # noqa: UP045 (OmegaConf)

    def check(self) -> list[str]:
        return [] if self.other is None or self.other >= 0 else [f"target.other={self.other}"]
