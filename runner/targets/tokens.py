"""Language-model targets: what a run's next-token output scores, given each pair's answer and distractor tokens.

`score_tokens(logits, answers, distractors, clean)`: logits (B, V) float32 at the last position; answers and
distractors (B, A) token ids padded with -1 (token sets); clean (B, V) the clean run's logits (KL needs them).
Each returns (B,) and is differentiable in `logits` (attribution patching and the gradient pass differentiate it).
"""

from __future__ import annotations

from typing import Any

import torch

from runner.errors import RunnerError
from runner.options.registry import lm_method_names
from runner.schema import TargetConfig


def set_mean(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean of `values` (B, V) over each row's token set `ids` (B, A) padded with -1."""
    real = ids >= 0
    picked = values.gather(1, ids.clamp(min=0)) * real
    return picked.sum(1) / real.sum(1).clamp(min=1)


def _set_sum(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    real = ids >= 0
    return (values.gather(1, ids.clamp(min=0)) * real).sum(1)


class TokenTarget:
    """A language-model target; `text = True` tells methods that take token targets apart from class targets."""

    text = True
    # Whether score_tokens reads only the answer and distractor columns of the logits (then any (B, K) logits of
    # those tokens, with the sets' ids renumbered into 0..K-1, give the same score).
    reads_only_answer_logits = False

    def __init__(self, config: TargetConfig | None = None) -> None:
        self.name = config.name if config is not None else type(self).__name__

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """A class target's call: refused (a token target needs a pair's answer and distractor tokens)."""
        raise RunnerError(
            f"target={self.name} scores a language model's next token for a prompt pair: it takes a method for"
            f" language models (method={' | '.join(lm_method_names())}); image methods take target=logit,"
            " probability, logit_difference, ..."
        )

    def score_tokens(
        self, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor, clean: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError


class TokenLogitDiff(TokenTarget):
    reads_only_answer_logits = True  # a patching engine may compute only those logits (lm/readout.py)

    def score_tokens(
        self, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor, clean: torch.Tensor | None
    ) -> torch.Tensor:
        return set_mean(logits, answers) - set_mean(logits, distractors)


class TokenProbDiff(TokenTarget):
    def score_tokens(
        self, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor, clean: torch.Tensor | None
    ) -> torch.Tensor:
        probs = logits.softmax(-1)
        return _set_sum(probs, answers) - _set_sum(probs, distractors)


class AnswerLogprob(TokenTarget):
    def score_tokens(
        self, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor, clean: torch.Tensor | None
    ) -> torch.Tensor:
        logp = logits.log_softmax(-1)
        return logp.gather(1, answers.clamp(min=0)).masked_fill(answers < 0, float("-inf")).logsumexp(1)


class KlToClean(TokenTarget):
    def score_tokens(
        self, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor, clean: torch.Tensor | None
    ) -> torch.Tensor:
        assert clean is not None, "kl_to_clean needs the clean run's logits"
        p = clean.log_softmax(-1)
        return (p.exp() * (p - logits.log_softmax(-1))).sum(-1)


def token_target(target: Any, method: str, per_position: bool) -> TokenTarget:
    """The run's target if it scores tokens; RunnerError naming the ones that do otherwise."""
    names = "token_logit_diff, token_prob_diff, answer_logprob" + (" or kl_to_clean" if per_position else "")
    if not getattr(target, "text", False):
        raise RunnerError(f"method={method} measures a language model's answer: use target={names}.")
    if not per_position and getattr(target, "name", "") == "kl_to_clean":
        # On the clean prompt KL(clean || clean) is 0 and so is its gradient: every value would be 0.
        raise RunnerError(
            f"target=kl_to_clean is 0 on the clean prompt that method={method} reads: use target={names}."
        )
    return target


def target_name(target: Any) -> str:
    """The name a table's `metric` column gives the run's target."""
    return str(getattr(target, "name", type(target).__name__))
