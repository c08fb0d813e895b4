"""The unpatched prefix of a patched run, computed once per receiving run and reused by every variant: the positions
before a chunk's first patched one (the KV cache) and the blocks below its lowest patched layer (BlockReplay).

A cell patched at position p changes nothing at positions < p (the causal mask): every variant of a chunk whose
cells all sit at p or later shares the receiving run's keys and values there. The receiving run is run once with the
KV cache on; each chunk then runs only its positions >= p, on a copy of the cached keys and values of positions < p
(repeated for its variants), the sites' tensors and the embedding edit cut to the same positions. A model whose
cache the runner cannot read (or a cell with no position: a head at every position, an attention pattern) runs the
whole prompt instead. Chunks are tiles of layers x positions (`chunks_by_tile`), so that both cuts are large.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runner.hooks.sites import Cell

log = logging.getLogger(__name__)

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values (B, heads, T, head size)


def start_of(cell: Cell) -> int:
    """The first position a cell's patch changes: its position, or 0 (a head at every position; the pattern site,
    whose key positions the prefix would cut)."""
    return 0 if cell.position is None or cell.kind == "pattern" else cell.position


def chunks_by_tile(cells: Sequence[Cell], chunk: int, layers: int, positions: int) -> list[list[int]]:
    """The cells' indices in chunks of at most `chunk`, ordered by tiles of g layers x all positions (then by start
    position, then layer), so that a chunk's cells share a high lowest layer and a late first position: its forward
    runs blocks from its lowest layer at positions from its first (BlockReplay, the cached prefix). g ~
    sqrt(chunk x layers / positions) balances the two."""
    g = max(1, round((chunk * layers / max(1, positions)) ** 0.5))
    order = sorted(range(len(cells)), key=lambda i: (cells[i].layer // g, start_of(cells[i]), cells[i].layer))
    return [order[first : first + chunk] for first in range(0, len(order), chunk)]


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


def cache_name(model_or_output: Any) -> str:
    """What a model's forward (or its output) calls the key/value cache: `cache` in recent transformers releases,
    `past_key_values` in older ones (where both exist, the old name warns of its deprecation on every run)."""
    fields = getattr(model_or_output, "__dataclass_fields__", None)
    if fields is None:  # a model: its forward's parameters
        fields = inspect.signature(type(model_or_output).forward).parameters
    return "cache" if "cache" in fields else "past_key_values"


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
    returns none the runner can read, or one that lacks some positions (logged once per model).

    The run is given a cache of plain layers, which keep every position: the cache a model makes for itself keeps
    only the last window of a sliding-window layer (Gemma 2 and 3, Mistral), which the prefix of every position
    before a chunk's first would lack."""
    from transformers import DynamicCache

    base = getattr(model, "base_model", model)  # the blocks alone: the unembedding's output is not needed
    with torch.no_grad():
        out = base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{cache_name(base): DynamicCache()})  # fmt: skip
    found = cached_keys_values(getattr(out, cache_name(out), None))
    if found is not None and any(k.shape[-2] != ids.shape[1] for k, _ in found):
        found = None
    if found is None and not getattr(model, "_runner_no_prefix_logged", False):
        log.info("lm_patching: %s returns no key/value cache the runner can read: each variant runs the whole"
                 " prompt", type(model).__name__)  # fmt: skip
        model._runner_no_prefix_logged = True  # type: ignore[attr-defined]
    return found


class _Replay(nn.Module):
    """Stands in for a block below a chunk's lowest patched layer: returns the receiving run's input of the next
    block at the chunk's positions (`value`), or its own input unchanged (`value` None: a block whose output the
    next stand-in ignores), in the block's own output form."""

    def __init__(self, value: torch.Tensor | None, as_tuple: bool) -> None:
        super().__init__()
        self.value, self.as_tuple = value, as_tuple

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = hidden_states if self.value is None else self.value
        return (out,) if self.as_tuple else out


class BlockReplay:
    """Blocks below a chunk's lowest patched layer computed once, not per variant.

    A cell at layer l changes nothing below block l, at any position: every variant of a chunk whose cells sit at
    layer l0 or above reads, at block l0's input, the receiving run's residual stream there. The receiving run's
    block inputs are kept (session-owned pre-hooks, on while `recording`); a chunk's forward then runs with blocks
    0..l0-1 replaced by stand-ins that hand block l0 that tensor (cut to the chunk's positions, repeated for its
    variants), and the blocks are put back after it, also after an error.
    """

    def __init__(self, model: nn.Module, blocks_name: str, session: Any) -> None:
        self.blocks: nn.ModuleList = dict(model.named_modules())[blocks_name]  # type: ignore[assignment]
        self.recording = False
        self.inputs: dict[int, torch.Tensor] = {}  # block index -> (B, T, D) the receiving run's input
        self.as_tuple: bool | None = None  # whether a block returns a tuple (transformers 4.x) or a tensor (5.x)
        for index, block in enumerate(self.blocks):
            session.add_hook(block, self._keeper(index), pre=True)
        session.add_hook(self.blocks[0], self._form, pre=False)

    def _keeper(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.recording:
                hidden = args[0] if args else kwargs["hidden_states"]
                self.inputs[index] = hidden.detach()

        return hook

    def _form(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.recording:
            self.as_tuple = isinstance(output, tuple)

    def ready(self) -> bool:
        return self.as_tuple is not None and len(self.inputs) == len(self.blocks)

    def skipping(self, lowest: int, start: int, copies: int) -> _Swapped:
        """`with replay.skipping(l0, p, c):` the forward inside runs blocks l0.. only, at positions p.., for c
        variants stacked along the batch."""
        return _Swapped(self, lowest, start, copies)


class _Swapped:
    def __init__(self, replay: BlockReplay, lowest: int, start: int, copies: int) -> None:
        self.replay, self.lowest, self.start, self.copies = replay, lowest, start, copies
        self.saved: list[nn.Module] = []

    def __enter__(self) -> None:
        r = self.replay
        if self.lowest == 0:
            return
        value = r.inputs[self.lowest][:, self.start :].repeat(self.copies, 1, 1)
        self.saved = [r.blocks[j] for j in range(self.lowest)]
        for j in range(self.lowest):
            r.blocks[j] = _Replay(value if j == self.lowest - 1 else None, bool(r.as_tuple))

    def __exit__(self, *exc: object) -> None:
        for j, block in enumerate(self.saved):
            self.replay.blocks[j] = block
