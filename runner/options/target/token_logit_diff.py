"""A language model's next-token logit of the answer minus the distractor's (means over token sets)."""

from dataclasses import dataclass
from typing import ClassVar

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.tokens:TokenLogitDiff")
@dataclass
class TokenLogitDiffTargetConfig(TargetConfig):
    name: str = "token_logit_diff"
    MODALITY: ClassVar[str] = "text"  # it scores a language model's tokens
