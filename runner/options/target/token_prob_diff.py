"""A language model's next-token probability of the answer tokens minus that of the distractor tokens (sums over token sets)."""

from dataclasses import dataclass
from typing import ClassVar

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.tokens:TokenProbDiff")
@dataclass
class TokenProbDiffTargetConfig(TargetConfig):
    name: str = "token_prob_diff"
    MODALITY: ClassVar[str] = "text"  # it scores a language model's tokens
