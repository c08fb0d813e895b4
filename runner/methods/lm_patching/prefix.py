"""The unpatched prefix of a patched run, computed once per receiving run and reused by every variant.

A cell patched at position p changes nothing at positions < p (the causal mask): every variant of a chunk whose
cells all sit at p or later shares the receiving run's keys and values there. The receiving run is run once with the
KV cache on; each chunk then runs only its positions >= p, on a copy of the cached keys and values of positions < p
(repeated for its variants), the sites' tensors and the embedding edit cut to the same positions. Chunks take the
cells in order of position, so most chunks start late in the prompt. A model whose cache the runner cannot read
(or a cell with no position: a head at every position, an attention pattern) runs the whole prompt instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runner.methods.lm_patching.engine import Cell

log = logging.getLogger(__name__)

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values (B, heads, T, head size)


def start_of(cell: Cell) -> int:
    """The first position a cell's patch changes: its position, or 0 (a head at every position; the pattern site,
    whose key positions the prefix would cut)."""
    return 0 if cell.position is None or cell.kind == "pattern" else cell.position


def chunks_by_start(cells: Sequence[Cell], chunk: int) -> list[tuple[int, list[int]]]:
    """The cells' indices in chunks of at most `chunk`, in order of start position, each with the chunk's start (the
    smallest of its cells' starts)."""
    order = sorted(range(len(cells)), key=lambda i: start_of(cells[i]))
    out = []
    for first in range(0, len(order), chunk):
        part = order[first : first + chunk]
        out.append((min(start_of(cells[i]) for i in part), part))
    return out


def cached_keys_values(past: Any) -> KeyValues | None:
    """The per-layer keys and values of a forward's `past_key_values` (transformers 5's `Cache.layers`, 4.x's
    `key_cache`/`value_cache`, or legacy tuples); None where the form is not one of those."""
    if past is None:
        return None
    layers = getattr(past, "layers", None)
    if layers is not None and all(hasattr(layer, "keys") for layer in layers):
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(past, "key_cache"):
        return list(zip(past.key_cache, past.value_cache, strict=True))
    if isinstance(past, tuple | list) and all(isinstance(item, tuple | list) and len(item) >= 2 for item in past):
        return [(item[0], item[1]) for item in past]
    return None


def prefix_cache(keys_values: KeyValues, start: int, copies: int) -> Any:
    """A fresh cache holding positions < `start` of every layer, repeated for `copies` variants along the batch
    (row c * B + b: pair b), as the model's forward takes it; fresh, because a forward appends to its cache."""
    from transformers import DynamicCache

    return DynamicCache(
        [(k[:, :, :start].repeat(copies, 1, 1, 1), v[:, :, :start].repeat(copies, 1, 1, 1)) for k, v in keys_values]
    )


def receiving_cache(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
) -> KeyValues | None:
    """The receiving run's keys and values at every layer (one forward with the cache on), or None where the model
    returns none the runner can read (logged once per model)."""
    base = getattr(model, "base_model", model)  # the blocks alone: the unembedding's output is not needed
    with torch.no_grad():
        out = base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    found = cached_keys_values(getattr(out, "past_key_values", None))
    if found is None and not getattr(model, "_runner_no_prefix_logged", False):
        log.info("lm_patching: %s returns no key/value cache the runner can read: each variant runs the whole"
                 " prompt", type(model).__name__)  # fmt: skip
        model._runner_no_prefix_logged = True  # type: ignore[attr-defined]
    return found
