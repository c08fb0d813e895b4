"""What the language-model saliency methods share: the clean prompt of each pair and the (pair, position) grid of a
left-padded batch without its padding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runner.data.base import Batch
from runner.errors import RunnerError


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
