"""Random tensors of a given shape with random labels: smoke tests and speed measurements."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runner.errors import RunnerError
from runner.options.registry import DATA
from runner.schema import MAX_IMAGE_SIDE, DataConfig

# Bound that keeps a typo from allocating tens of gigabytes (data.shape=[3,60000,60000] is 43 GB a sample).
MAX_SAMPLE_ELEMENTS = 3 * MAX_IMAGE_SIDE * MAX_IMAGE_SIDE


@DATA.option("runner.data.sources:synthetic_source")
@dataclass
class SyntheticConfig(DataConfig):
    name: str = "synthetic"
    shape: list[int] = field(default_factory=lambda: [3, 224, 224])  # one sample's shape
    count: int = 8  # how many samples
    num_classes: int = 1000  # labels drawn from range(num_classes)

    def check(self) -> list[str]:
        bad = super().check()
        bad += [f"data.{key}={value}" for key, value in (("count", self.count), ("num_classes", self.num_classes))
                if value < 1]  # fmt: skip
        if len(self.shape) < 1 or min(self.shape) < 1:
            bad.append(f"data.shape={self.shape} (positive sizes)")
        elif math.prod(self.shape) > MAX_SAMPLE_ELEMENTS:
            gigabytes = math.prod(self.shape) * 4 / 1e9
            raise RunnerError(
                f"data.shape={list(self.shape)} is {gigabytes:.1f} GB per sample in float32, above the bound of"
                f" {MAX_SAMPLE_ELEMENTS} values ([3,{MAX_IMAGE_SIDE},{MAX_IMAGE_SIDE}]); use a smaller shape,"
                " e.g. data.shape=[3,224,224]."
            )
        return bad
