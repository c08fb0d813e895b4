"""The sum of all the model's outputs, whatever the class (pytorch-grad-cam's RawScoresOutputTarget)."""

from dataclasses import dataclass

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.classifier:Raw")
@dataclass
class RawTargetConfig(TargetConfig):
    name: str = "raw"
