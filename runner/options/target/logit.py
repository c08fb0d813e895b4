"""The class's logit (pytorch-grad-cam's ClassifierOutputTarget): the score every method differentiates by default."""

from dataclasses import dataclass

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.classifier:Logit")
@dataclass
class LogitTargetConfig(TargetConfig):
    name: str = "logit"
