"""What the language-model saliency methods share beyond their base (`LanguageModelMethod`): the sites one forward
kept, and the (pair, position) grid of a left-padded batch without its padding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import torch

from runner.errors import RunnerError
from runner.hooks.sites import SiteHooks
from runner.models.lm_sites import SiteSpec

# A position's text in every LM table with positions, in this order (after its `position`)
PAIR_TEXT_FIELDS = [
    pa.field("token", pa.string()),  # the clean prompt's token at `position`
    pa.field("token_text", pa.string()),  # that token decoded alone: " Jacob" for `ĠJacob` or `▁Jacob`
    pa.field("role", pa.string()),  # the position's role: IO, S1, S2 (data=ioi), subject, end (the last), ...
    pa.field("answer", pa.string()),
    pa.field("distractor", pa.string()),
    pa.field("answer_text", pa.string()),  # the answer decoded (" Mary"; a set's tokens joined by |)
    pa.field("distractor_text", pa.string()),  # the distractor decoded
]


def taken_views(hooks: SiteHooks, specs: Sequence[SiteSpec], method: str) -> dict[str, torch.Tensor]:
    """The site views the last kept forward left in `hooks` (taken: the hooks hold none after), one per spec; a site
    the forward never reached is refused (a family whose module layout the adapter misreads), not left out."""
    views, hooks.kept = hooks.kept, {}
    missing = [spec.name for spec in specs if spec.name not in views]
    if missing:
        raise RunnerError(f"method={method}: the forward never reached {', '.join(missing)}.")
    return views


def real_cells(pads: torch.Tensor, positions: int, heads: int = 0) -> tuple[torch.Tensor, ...]:
    """Row, index (in the padded batch) and head of every real (non-padding) cell of a (B, T[, H]) grid, in
    (row, position, head) order; heads=0: no head axis (head comes back empty)."""
    b = pads.shape[0]
    shape = (b, positions, max(heads, 1))
    row, index, head = (g.reshape(-1) for g in torch.meshgrid(
        torch.arange(b), torch.arange(positions), torch.arange(shape[2]), indexing="ij"))  # fmt: skip
    keep = index >= pads.cpu()[row]
    return row[keep], index[keep], head[keep] if heads else torch.empty(0, dtype=torch.long)


def token_strings(
    strings: list[dict[str, Any]], rows: list[int], positions: list[int], key: str = "tokens"
) -> list[str | None]:
    """The clean token at each (row, position) (`key="texts"`: decoded), None where the pair's strings are unknown."""
    return [strings[r][key][p] if p is not None and p < len(strings[r][key]) else None
            for r, p in zip(rows, positions, strict=True)]  # fmt: skip
