"""Column dicts, the form in which methods hand a batch's rows over (name -> list, tensor, Block or Ragged),
and their row-wise concatenation: shared by every method that builds its rows in parts."""

from __future__ import annotations

from typing import Any

import torch

from runner.results import Block, Ragged


def concat_columns(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Row-wise concatenation of column dicts with the same keys (lists, tensors, blocks, ragged)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts]
        if isinstance(first, Block):
            out[key] = Block(torch.cat([v.values for v in values]), first.names)
        elif isinstance(first, Ragged):
            out[key] = Ragged(torch.cat([v.values for v in values]), [n for v in values for n in v.lengths])
        elif torch.is_tensor(first):
            out[key] = torch.cat(values)
        else:
            out[key] = [item for v in values for item in v]
    return out
