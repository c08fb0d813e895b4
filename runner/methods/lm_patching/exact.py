"""Exact patching of a causal LM: each cell's metric with its value put into the receiving run, many cells per
forward (stacked along the batch: row c * B + b is cell c of pair b, runner/hooks/sites.py).

The chunks are sized by `StackSizer` (probed on CUDA, ~`ROWS_PER_FORWARD` rows on the CPU). With
method.patching.reuse_prefix a chunk runs only the positions and blocks its cells can change, on the receiving run's
cached keys and values and block inputs of the others (prefix.py), and a cell before the first position where the
two runs differ is not run at all (`first_difference`: its metric is the receiving run's).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from runner.chunk_sizing import CAP, StackSizer
from runner.data.prompts import position_ids
from runner.hooks import HookSession
from runner.hooks.sites import Cell, SiteHooks
from runner.methods.lm.corruptions import Corruption, EmbeddingEdit
from runner.methods.lm.readout import Readout
from runner.methods.lm_patching.prefix import (
    BlockReplay,
    cache_name,
    chunks_by_tile,
    prefix_cache,
    receiving_cache,
    start_of,
)
from runner.models.lm_sites import LanguageModelLayout, SiteSpec
from runner.options.method.lm_patching import LmPatchingConfig
from runner.progress import WHOLE_BATCH, Stage
from runner.runtime import Runtime
from runner.targets.tokens import TokenTarget

# Rows of the stacked batch a patched forward aims for (variants x pairs), measured on the CPU. Smaller chunks
# start later in the prompt (prefix.py): 32 rows measured faster than 64 and 16 on GPT-2-small-wide blocks.
ROWS_PER_FORWARD = 32


class ExactPatcher:
    """The site hooks of a model and what runs its patched forwards: `hooks` also keep the clean and corrupted runs'
    sites (the sources) and, with the gradient on, attribution's receiving run."""

    def __init__(
        self, session: HookSession, layout: LanguageModelLayout, specs: Sequence[SiteSpec], target: TokenTarget,
        corruption: Corruption, runtime: Runtime, settings: LmPatchingConfig,
    ) -> None:  # fmt: skip
        model = session.model
        self.corruption, self.runtime, self.reuse_prefix = corruption, runtime, settings.reuse_prefix
        self.layers = layout.layers
        self.readout = Readout(model, layout, target)
        self.replay = BlockReplay(model, layout.arch.blocks, session)
        self.cache_key = cache_name(model)  # the forward's name for the key/value cache, read once, not per chunk
        self.hooks = SiteHooks(model, specs, session)
        self.stacks = StackSizer(settings.chunk, "patched cell")

    def patched_metrics(
        self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, noise: EmbeddingEdit | None,
        sources: dict[str, torch.Tensor], cells: list[Cell], answers: torch.Tensor, distractors: torch.Tensor,
        clean_logits: torch.Tensor, stage: Stage = WHOLE_BATCH,
    ) -> torch.Tensor:  # fmt: skip
        """(len(cells), B) metric of every cell patched into the run of `ids` (with the edit `noise` of its
        embeddings); with method.patching.reuse_prefix, each chunk runs only the positions its cells can change, on
        the receiving run's cached keys and values of the others (prefix.py). Each chunk done moves the run's bar
        within `stage`, naming the cells it ran."""
        b, t = ids.shape
        done = 0
        stage.report(0, len(cells), f"0/{len(cells)} cells")
        positions = position_ids(mask)
        out = torch.full((len(cells), b), float("nan"))  # NaN, not stale memory, in a cell no forward wrote
        keys_values = None  # the receiving run's cache, made for the first part that starts after position 0
        unreadable = False  # the model returned no cache the runner can read: whole prompts for every part
        received = False  # the receiving run was run (its cache and block inputs kept)
        replay = self.replay if self.reuse_prefix else None

        def forward(part: Sequence[int]) -> None:
            nonlocal keys_values, unreadable, received
            c = len(part)
            start = min(start_of(cells[i]) for i in part) if self.reuse_prefix and not unreadable else 0
            lowest = min(cells[i].layer for i in part) if replay is not None else 0
            if (start > 0 or lowest > 0) and not received:
                received = True
                self.corruption.active = noise
                if replay is not None:
                    replay.inputs, replay.recording = {}, True
                try:
                    with self.runtime.autocast():
                        keys_values = receiving_cache(model, ids, mask, positions)
                finally:
                    self.corruption.active = None
                    if replay is not None:
                        replay.recording = False
                unreadable = keys_values is None
            if unreadable:
                start = 0
            if replay is None or not replay.ready():
                lowest = 0
            self.hooks.plan([cells[i] for i in part], b, sources, start)
            edit = None if noise is None else (noise.suffix(start) if start else noise).repeat(c)
            self.corruption.active = edit
            inputs = {
                "input_ids": ids[:, start:].repeat(c, 1), "attention_mask": mask.repeat(c, 1),
                "position_ids": positions[:, start:].repeat(c, 1), "use_cache": start > 0,
                **({self.cache_key: prefix_cache(keys_values, start, c)} if start else {}),
            }  # fmt: skip
            try:
                with replay.skipping(lowest, start, c) if lowest else nullcontext():
                    metric = self.readout.metric(inputs, answers.repeat(c, 1), distractors.repeat(c, 1),
                                                 clean_logits.repeat(c, 1), self.runtime.autocast)  # fmt: skip
            finally:
                self.corruption.active = None
                self.hooks.patches = {}
            out[torch.tensor(part)] = metric.detach().float().view(c, b).cpu()
            nonlocal done
            done += c
            ran = sorted({(cells[i].kind, cells[i].layer) for i in part}, key=lambda k: (k[1], k[0]))
            layers = f"layer {ran[0][1]}" if ran[0][1] == ran[-1][1] else f"layers {ran[0][1]}-{ran[-1][1]}"
            sites = ", ".join(dict.fromkeys(kind for kind, _ in ran))
            stage.report(done, len(cells), f"{done}/{len(cells)} cells ({sites}, {layers})")

        # cells (each b rows) per forward; the probes that size it on CUDA run the cells that start first (the most
        # positions: the largest forwards)
        by_start = sorted(range(len(cells)), key=lambda i: start_of(cells[i]))
        key = f"{b} pairs x {t} tokens"
        chunk = self.stacks.stack(key, ids.device, len(cells), lambda k: forward(by_start[:k]),
                                  otherwise=max(1, ROWS_PER_FORWARD // b), cap=max(1, CAP // b))  # fmt: skip
        parts = chunks_by_tile(cells, chunk, self.layers, t) if self.reuse_prefix else [
            list(range(first, min(first + chunk, len(cells)))) for first in range(0, len(cells), chunk)
        ]  # fmt: skip
        self.stacks.run(parts, forward, key)
        return out


def first_difference(clean: torch.Tensor, corrupted: torch.Tensor, edit: EmbeddingEdit | None,
                     mask: torch.Tensor) -> int:  # fmt: skip
    """The first index (of the left-padded batch) where any pair's clean and corrupted runs differ: a token, or a
    position the corrupted run's embedding edit changes; the batch's length where none does."""
    differs = (clean != corrupted) & mask.bool()
    if edit is not None:
        scale, shift = edit.scale.to(differs.device), edit.shift.to(differs.device)
        differs |= ((scale != 1).any(-1) | (shift != 0).any(-1)) & mask.bool()
    where = differs.any(0).nonzero()
    return int(where[0]) if len(where) else clean.shape[1]


def unchanged_latents(
    cells: Sequence[Cell], clean: dict[str, torch.Tensor], corrupted: dict[str, torch.Tensor]
) -> set[int]:
    """The cells of a dictionary's latents (site `latent`) whose value is the same in the clean and the corrupted run
    for every pair: patching one puts into the receiving run the value it already has, so it has no effect (its
    restoration is 0) and the method neither runs nor reports it. A sparse dictionary's latent is zero in both runs
    almost everywhere (a TopK SAE of 4,096 latents with k = 32 fires at most 32 per position)."""
    same: dict[str, torch.Tensor] = {}  # site name -> (T, width) bool: equal at that position for every pair
    for name, view in clean.items():
        if name.startswith("latent."):
            same[name] = (view == corrupted[name]).all(dim=-1).all(dim=0).cpu()  # (B, T, width, 1) -> (T, width)
    unchanged = set()
    for c, cell in enumerate(cells):
        if cell.kind != "latent":
            continue
        equal = same[f"latent.{cell.layer}"][:, cell.head]  # (T,)
        if bool(equal.all() if cell.position is None else equal[cell.position]):
            unchanged.add(c)
    return unchanged
