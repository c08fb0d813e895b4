"""Rows as methods hand them over: column dicts (name -> list, tensor, `Block` or `Ragged`), their row-wise
concatenation, and their move to the host for writing. Foundation: imports nothing of runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch


@dataclass
class Block:
    """A (rows, k) tensor that becomes k named columns."""

    values: torch.Tensor
    names: list[str]


@dataclass
class Ragged:
    """A list column from one flat tensor: row i holds the next lengths[i] values."""

    values: torch.Tensor
    lengths: list[int]


def to_host(columns: dict[str, Any]) -> dict[str, Any]:
    """Move every tensor column to the host (numpy); expand blocks into named columns."""
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if isinstance(value, Block):
            array = value.values.detach().cpu().numpy()
            for i, sub in enumerate(value.names):
                # flags travel as 0/1 with the other statistics; they are stored as booleans
                out[sub] = array[:, i].astype(bool) if sub.endswith("nonfinite") else array[:, i]
        elif isinstance(value, Ragged):
            offsets = np.concatenate([[0], np.cumsum(value.lengths)]).astype(np.int32)
            out[name] = pa.ListArray.from_arrays(
                pa.array(offsets),
                pa.array(value.values.detach().cpu().float().numpy()),  # float16 maps cross as such
            )
        elif torch.is_tensor(value):
            out[name] = value.detach().cpu().numpy()
        else:
            out[name] = value
    return out


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


Columns = dict[str, Any]


@dataclass
class BatchOutput:
    """What a method hands back per batch: the predicted classes, and rows per table (columns, on device)."""

    predicted: torch.Tensor  # (B,)
    tables: dict[str, Columns] = field(default_factory=dict)
