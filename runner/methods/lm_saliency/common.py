"""What the language-model saliency methods share: the clean prompt of each pair, the run's token target, the
pair's strings, and the (pair, position) grid of a left-padded batch without its padding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.targets.tokens import TokenTarget


@dataclass
class CleanPrompts:
    """A batch's clean prompts (the corrupted ones are not used by these methods)."""

    ids: torch.Tensor  # (B, T) left-padded token ids
    mask: torch.Tensor  # (B, T) 1 on real tokens
    answers: torch.Tensor  # (B, A) token sets padded with -1
    distractors: torch.Tensor  # (B, A)

    @property
    def pads(self) -> torch.Tensor:
        """(B,) padding tokens on the left of each row: the table's position p is row index pads + p."""
        return self.mask.shape[1] - self.mask.sum(1)


def clean_prompts(batch: Batch, method: str) -> CleanPrompts:
    """The clean half of a batch of prompt pairs; RunnerError for another kind of batch."""
    if batch.x.dim() != 3 or batch.extras is None:
        raise RunnerError(f"method={method} takes prompt pairs: use data=prompts.")
    extras = batch.extras
    return CleanPrompts(batch.x[:, 0], extras["attention_mask"], extras["answers"], extras["distractors"])


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
    return str(getattr(target, "name", type(target).__name__))


def pair_strings(dataset: Dataset | None, sample_id: str) -> dict[str, Any]:
    """The pair's clean tokens as strings (by position), its answer and distractor as text; empty without a data
    set of pairs (a library call on token ids)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    pair = getattr(dataset, "by_id", {}).get(sample_id)
    if pair is None:
        return {"tokens": [], "answer": None, "distractor": None}
    return {"tokens": pair.tokens, "answer": " ".join(pair.answer_tokens),
            "distractor": " ".join(pair.distractor_tokens)}  # fmt: skip


def tokenizer_of(dataset: Dataset | None) -> Any:
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return getattr(dataset, "tokenizer", None)


def real_cells(pads: torch.Tensor, positions: int, heads: int = 0) -> tuple[torch.Tensor, ...]:
    """Row, index (in the padded batch) and head of every real (non-padding) cell of a (B, T[, H]) grid, in
    (row, position, head) order; heads=0: no head axis (head comes back empty)."""
    b = pads.shape[0]
    shape = (b, positions, max(heads, 1))
    row, index, head = (g.reshape(-1) for g in torch.meshgrid(
        torch.arange(b), torch.arange(positions), torch.arange(shape[2]), indexing="ij"))  # fmt: skip
    keep = index >= pads.cpu()[row]
    return row[keep], index[keep], head[keep] if heads else torch.empty(0, dtype=torch.long)


def token_strings(strings: list[dict[str, Any]], rows: list[int], positions: list[int]) -> list[str | None]:
    """The clean token at each (row, position), None where the pair's strings are unknown."""
    return [strings[r]["tokens"][p] if p < len(strings[r]["tokens"]) else None
            for r, p in zip(rows, positions, strict=True)]  # fmt: skip
