"""The KL divergence of a run's next-token distribution from the clean run's, KL(clean || run): 0 on the clean run."""

from dataclasses import dataclass
from typing import ClassVar

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.tokens:KlToClean")
@dataclass
class KlToCleanTargetConfig(TargetConfig):
    name: str = "kl_to_clean"
    MODALITY: ClassVar[str] = "text"  # it scores a language model's tokens
