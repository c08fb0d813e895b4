"""A single-output (binary) classifier's output, signed for the category (pytorch-grad-cam's BinaryClassifierOutputTarget)."""

from dataclasses import dataclass
from typing import Optional

from runner.errors import RunnerError
from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.classifier:Binary")
@dataclass
class BinaryTargetConfig(TargetConfig):
    name: str = "binary"
    # 1: the output itself (evidence for the positive category), 0: its negation; the same for every sample.
    # null: the class `method.target` chose (a one-output model's prediction is always 0, its only column).
    category: Optional[int] = None  # noqa: UP045 (OmegaConf)

    def check(self) -> list[str]:
        if self.category not in (None, 0, 1):
            raise RunnerError(f"target.category={self.category}: a binary classifier's category is 0 or 1 (or null).")
        return []
