"""`method=lm_patching`: each pair's clean and corrupted runs, then every cell (site x layer x position, or x head)
patched in each direction, many cells per forward, into the `lm_patching` table."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import pyarrow as pa
import torch
from torch import nn
from torch.utils.data import Dataset

from runner.chunk_sizing import CAP, StackSizer
from runner.data.base import Batch
from runner.data.prompts import position_ids
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.language_model import LanguageModelMethod
from runner.methods.lm_patching.attribution import Receiver, attribution_rows
from runner.methods.lm_patching.corruptions import Corruption, EmbeddingEdit
from runner.methods.lm_patching.engine import Cell, SiteHooks, cells_of
from runner.methods.lm_patching.prefix import (
    BlockReplay,
    cache_name,
    chunks_by_tile,
    prefix_cache,
    receiving_cache,
    start_of,
)
from runner.methods.lm_patching.readout import Readout
from runner.methods.patching.rows import small_spans
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of
from runner.options.method.lm_patching import HeadPositions, LmPatchingMethodConfig
from runner.options.method.patching import PatchDirection, PatchMode
from runner.rows import BatchOutput, Columns, concat_columns
from runner.runtime import Runtime
from runner.tables import Presentation, declare, optional
from runner.targets.tokens import TokenTarget, target_name, token_target

log = logging.getLogger(__name__)

LM_PATCHING_SCHEMA = declare(
    "lm_patching",
    [
        pa.field("corrupted_id", pa.string()),
        pa.field("direction", pa.string()),  # denoising | noising
        pa.field("site", pa.string()),  # resid_pre, attn_out, mlp_out, head, ...
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("head", pa.int64()),  # null for whole-site cells
        pa.field("position", pa.int64()),  # the token's position (BOS = 0 when prepended); null: every position
        pa.field("token", pa.string()),  # the clean prompt's token at `position`
        pa.field("answer", pa.string()),
        pa.field("distractor", pa.string()),
        pa.field("metric", pa.string()),  # the run's target
        pa.field("patch_method", pa.string()),  # exact | attribution (a first-order estimate)
        *(pa.field(n, pa.float32()) for n in ("clean", "corrupted", "patched", "restoration")),
        pa.field("degenerate", pa.bool_()),
        pa.field("degenerate_reason", pa.string()),
        pa.field("small_span", pa.bool_()),
        optional("rank_correlation", pa.float32(), "method.patching.mode=attribution_topk"),
    ],
    Presentation(
        keys=("direction", "site", "patch_method", "metric"),
        values=("restoration",),
        shown=("metric",),
        figures="runner.viz.lm_plots:lm_patching_figures",
    ),
)
# Rows of the stacked batch a patched forward aims for (variants x pairs), measured on the CPU. Smaller chunks
# start later in the prompt (prefix.py): 32 rows measured faster than 64 and 16 on GPT-2-small-wide blocks.
ROWS_PER_FORWARD = 32


class LmPatching(LanguageModelMethod):
    name = "lm_patching"
    table = "lm_patching"
    summary_values = ("restoration", "rank_correlation")
    cfg: LmPatchingMethodConfig

    def __init__(self, cfg: LmPatchingMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        super().__init__(cfg, layers, runtime)
        self.p = cfg.patching
        self.warned: set[str] = set()
        self.corruption = Corruption(self.p.corruption)
        self.stacks = StackSizer(self.p.chunk, "patched cell")

    def prepare(self, dataset: Dataset) -> None:
        super().prepare(dataset)
        self.corruption.prepare(dataset)

    @classmethod
    def planned(
        cls, cfg: LmPatchingMethodConfig, layout: LanguageModelLayout, target: Any
    ) -> tuple[TokenTarget, list[int], list[SiteSpec]]:
        """The run's token target, the patched layers and each (site, layer)'s spec; refused: a target that scores no
        tokens, a layer out of range, a site the family lacks or its attention never materialises."""
        scored = token_target(target, cls.name, per_position=True)
        layers = layout.block_layers(cfg.patching.layers, "method.patching.layers")
        return scored, layers, [layout.site(kind, layer) for kind in cfg.patching.sites for layer in layers]

    def setup(self, session: HookSession, num_samples: int) -> None:
        model = session.model
        self.layout = layout_of(model)
        self.target, self.layers, specs = self.planned(self.cfg, self.layout, self.runtime.target)
        self.readout = Readout(model, self.layout, self.target)
        self.replay = BlockReplay(model, self.layout.arch.blocks, session)
        self.cache_key = cache_name(model)  # the forward's name for the key/value cache, read once, not per chunk
        self.hooks = SiteHooks(model, specs, session)
        self.corruption.setup(session, model, self.layout)

    # ---- one batch of pairs ---------------------------------------------------------------------------
    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        if batch.x.dim() != 3 or batch.extras is None:
            raise RunnerError("method=lm_patching takes prompt pairs: use data=prompts.")
        clean_ids, corrupted_ids = batch.x[:, 0], batch.x[:, 1]
        mask = batch.extras["attention_mask"]
        answers, distractors = batch.extras["answers"], batch.extras["distractors"]
        b, t = clean_ids.shape
        corrupted = self.corruption.corrupt(batch, clean_ids, corrupted_ids, mask)
        corrupted_ids, noise = corrupted.ids, corrupted.edit  # noise: the corrupted run's embedding edit, if any
        with self.hooks.keep():
            clean_logits = self._logits(model, clean_ids, mask)
        clean_sites = self.hooks.kept
        self.corruption.active = noise
        try:
            with self.hooks.keep():
                corrupted_logits = self._logits(model, corrupted_ids, mask)
        finally:
            self.corruption.active = None
        corrupted_sites = self.hooks.kept
        m_clean = self._metric(clean_logits, answers, distractors, clean_logits)
        m_corrupted = self._metric(corrupted_logits, answers, distractors, clean_logits)
        flags = self._flags(batch, clean_ids, corrupted_ids, noise, m_clean, m_corrupted)
        cells = cells_of(self.layout, self.p.sites, self.layers, t,
                         self.p.head_positions is HeadPositions.each)  # fmt: skip
        first = first_difference(clean_ids, corrupted_ids, noise, mask)
        parts: list[Columns] = []
        for direction in self.p.directions:
            denoising = direction is PatchDirection.denoising
            receiver_ids = corrupted_ids if denoising else clean_ids
            receiver_noise = noise if denoising else None
            sources = clean_sites if denoising else corrupted_sites
            if self.p.mode is not PatchMode.exact:
                run = Receiver(direction, receiver_ids, mask, receiver_noise, sources,
                               m_corrupted if denoising else m_clean, corrupted.names)  # fmt: skip
                parts += attribution_rows(self, model, batch, run, cells, answers, distractors, clean_logits,
                                          m_clean, m_corrupted, flags)  # fmt: skip
                continue
            # A cell before the first position where the two runs differ patches a value into a run that already
            # has it (the causal mask: nothing there sees the difference): its metric is the receiving run's.
            receiving = (m_corrupted if denoising else m_clean).float().cpu()
            patched = receiving.expand(len(cells), b).clone()
            live = [i for i, c in enumerate(cells) if c.position is None or c.position >= first]
            if live:
                patched[live] = self.patched_metrics(model, receiver_ids, mask, receiver_noise, sources,
                                                     [cells[i] for i in live], answers, distractors, clean_logits)  # fmt: skip
            parts.append(self._rows(batch, direction, cells, patched, m_clean, m_corrupted, flags, mask,
                                    corrupted.names))  # fmt: skip
        self.hooks.clear()
        columns = concat_columns(parts)
        return BatchOutput(predicted=clean_logits.argmax(dim=1), tables={self.table: columns})

    def patched_metrics(
        self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, noise: EmbeddingEdit | None,
        sources: dict[str, torch.Tensor], cells: list[Cell], answers: torch.Tensor, distractors: torch.Tensor,
        clean_logits: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """(len(cells), B) metric of every cell patched into the run of `ids` (with the edit `noise` of its
        embeddings); with method.patching.reuse_prefix, each chunk runs only the positions its cells can change, on
        the receiving run's cached keys and values of the others (prefix.py)."""
        b, t = ids.shape
        positions = position_ids(mask)
        out = torch.full((len(cells), b), float("nan"))  # NaN, not stale memory, in a cell no forward wrote
        keys_values = None  # the receiving run's cache, made for the first part that starts after position 0
        unreadable = False  # the model returned no cache the runner can read: whole prompts for every part
        received = False  # the receiving run was run (its cache and block inputs kept)
        replay = self.replay if self.p.reuse_prefix else None

        def forward(part: Sequence[int]) -> None:
            nonlocal keys_values, unreadable, received
            c = len(part)
            start = min(start_of(cells[i]) for i in part) if self.p.reuse_prefix and not unreadable else 0
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

        # cells (each b rows) per forward; the probes that size it on CUDA run the cells that start first (the most
        # positions: the largest forwards)
        by_start = sorted(range(len(cells)), key=lambda i: start_of(cells[i]))
        key = f"{b} pairs x {t} tokens"
        chunk = self.stacks.stack(key, ids.device, len(cells), lambda k: forward(by_start[:k]),
                                  otherwise=max(1, ROWS_PER_FORWARD // b), cap=max(1, CAP // b))  # fmt: skip
        parts = chunks_by_tile(cells, chunk, self.layout.layers, t) if self.p.reuse_prefix else [
            list(range(first, min(first + chunk, len(cells)))) for first in range(0, len(cells), chunk)
        ]  # fmt: skip
        self.stacks.run(parts, forward, key)
        return out

    def _logits(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 next-token logits at the last position (left padding: the same index for every row)."""
        with torch.no_grad(), self.runtime.autocast():
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                        logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1].float()

    def _metric(self, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor,
                clean: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return self.target.score_tokens(logits, answers.to(logits.device), distractors.to(logits.device),
                                        clean.to(logits.device))  # fmt: skip

    def _flags(self, batch: Batch, clean_ids: torch.Tensor, corrupted_ids: torch.Tensor, noise: EmbeddingEdit | None,
               m_clean: torch.Tensor, m_corrupted: torch.Tensor) -> dict[str, list[Any]]:  # fmt: skip
        """Per pair: why its restoration is undefined (identical prompts, an equal metric) and small spans."""
        equal = ~torch.isfinite(m_clean - m_corrupted) | (m_clean == m_corrupted)
        same = (clean_ids == corrupted_ids).all(1).to(equal.device) if noise is None else torch.zeros_like(equal)
        spans = small_spans(m_clean, m_corrupted, self.p.min_span).to(equal.device)
        # the three flags in one transfer (on CUDA, one host sync a batch)
        same, equal, spans = torch.stack([same, equal, spans], dim=1).cpu().T.tolist()
        reasons = ["self_pair" if s else "zero_span" if e else None for s, e in zip(same, equal, strict=True)]
        small = [bool(f) and r is None for f, r in zip(spans, reasons, strict=True)]
        for key, flags, text in (
            ("degenerate", [r is not None for r in reasons],
             "the clean and corrupted prompts (or metrics) are identical: restoration is NaN"),
            ("small_span", small, f"|clean - corrupted| is below method.patching.min_span={self.p.min_span} of"
             " their size: restoration is NaN (small_span=True)"),
        ):  # fmt: skip
            if any(flags) and key not in self.warned:
                self.warned.add(key)
                ids = [s for s, f in zip(batch.sample_ids, flags, strict=True) if f]
                log.warning("lm_patching: %s (first: %s)", text, ", ".join(ids[:5]))
        return {"reason": reasons, "small": small}

    def _rows(self, batch: Batch, direction: PatchDirection, cells: list[Cell], patched: torch.Tensor,
              m_clean: torch.Tensor, m_corrupted: torch.Tensor, flags: dict[str, list[Any]],
              mask: torch.Tensor, corrupted_names: list[str], kind: str = "exact",
              select: torch.Tensor | None = None) -> Columns:  # fmt: skip
        """One row per (cell, pair), leaving out cells at a pair's padding positions (and, given `select` (C, B),
        the (cell, pair)s it leaves False); `kind`: how `patched` was had (exact | attribution)."""
        b, t = mask.shape
        pads = (t - mask.sum(1)).tolist()
        pairs = self.strings(batch)
        span = (m_clean - m_corrupted).cpu()
        undefined = torch.tensor([r is not None or s for r, s in zip(flags["reason"], flags["small"], strict=True)])
        restoration = ((patched.cpu() - m_corrupted.cpu()) / span).masked_fill(undefined, float("nan"))
        keep_c, keep_b, positions = [], [], []
        for c, cell in enumerate(cells):
            for row in range(b):
                if cell.position is not None and cell.position < pads[row]:
                    continue  # a padding position of this pair
                if select is not None and not select[c, row]:
                    continue
                keep_c.append(c)
                keep_b.append(row)
                positions.append(None if cell.position is None else cell.position - pads[row])
        ci, bi = torch.tensor(keep_c, dtype=torch.long), torch.tensor(keep_b, dtype=torch.long)
        return {
            "sample_index": bi.tolist(),  # the pair's row in the batch: the writer adds the batch's first index
            "corrupted_id": [corrupted_names[r] for r in keep_b],
            "direction": [direction.value] * len(keep_b),
            "site": [cells[c].kind for c in keep_c],
            "layer": [cells[c].layer for c in keep_c],
            "head": [cells[c].head for c in keep_c],
            "position": positions,
            "token": [
                pairs[r]["tokens"][p] if p is not None and p < len(pairs[r]["tokens"]) else None
                for r, p in zip(keep_b, positions, strict=True)
            ],  # fmt: skip
            "answer": [pairs[r]["answer"] for r in keep_b],
            "distractor": [pairs[r]["distractor"] for r in keep_b],
            "metric": [target_name(self.target)] * len(keep_b),
            "patch_method": [kind] * len(keep_b),
            "clean": m_clean.cpu()[bi],
            "corrupted": m_corrupted.cpu()[bi],
            "patched": patched.cpu()[ci, bi],
            "restoration": restoration[ci, bi],
            "degenerate": [flags["reason"][r] is not None for r in keep_b],
            "degenerate_reason": [flags["reason"][r] for r in keep_b],
            "small_span": [flags["small"][r] for r in keep_b],
        }


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
