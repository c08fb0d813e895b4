"""A language model's next-token log-probability of the answer (of any token of the answer set)."""

from dataclasses import dataclass
from typing import ClassVar

from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.tokens:AnswerLogprob")
@dataclass
class AnswerLogprobTargetConfig(TargetConfig):
    name: str = "answer_logprob"
    MODALITY: ClassVar[str] = "text"  # it scores a language model's tokens
