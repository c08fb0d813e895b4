"""The class's softmax probability (pytorch-grad-cam's ClassifierOutputSoftmaxTarget)."""

from dataclasses import dataclass

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.classifier:Probability")
@dataclass
class ProbabilityTargetConfig(TargetConfig):
    name: str = "probability"
