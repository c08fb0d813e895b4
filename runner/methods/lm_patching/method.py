"""`method=lm_patching`: each pair's clean and corrupted runs, then every cell (site x layer x position, or x head)
patched in each direction, many cells per forward, or estimated to first order (mode=attribution), into the
`lm_patching` table."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from runner.data.base import Batch
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.lm.base import CorruptedPairsMethod, forward_last
from runner.methods.lm.pairs import Receiver, pair_metrics
from runner.methods.lm_patching.attribution import attribution_rows
from runner.methods.lm_patching.engine import cells_of
from runner.methods.lm_patching.exact import ExactPatcher, first_difference, unchanged_latents
from runner.methods.lm_patching.rows import cell_rows
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of
from runner.options.method.lm_patching import HeadPositions, LmPatchingMethodConfig
from runner.options.method.patching import PatchDirection, PatchMode
from runner.progress import Stage, within_batch
from runner.rows import BatchOutput, Columns, concat_columns
from runner.runtime import Runtime
from runner.targets.tokens import TokenTarget, token_target

log = logging.getLogger(__name__)


class LmPatching(CorruptedPairsMethod):
    name = "lm_patching"
    table = "lm_patching"
    summary_values = ("restoration", "rank_correlation")
    cfg: LmPatchingMethodConfig

    def __init__(self, cfg: LmPatchingMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        super().__init__(cfg, layers, runtime, cfg.patching, "method.patching")

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
        self.layout = layout_of(session.model)
        self.target, self.layers, specs = self.planned(self.cfg, self.layout, self.runtime.target)
        self.exact = ExactPatcher(session, self.layout, specs, self.target, self.corruption, self.runtime, self.p)
        self.hooks = self.exact.hooks  # they also keep the clean and corrupted runs' sites (the sources)
        self.corruption.setup(session, session.model, self.layout)

    # ---- one batch of pairs ---------------------------------------------------------------------------
    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        clean_ids, mask = prompts.clean, prompts.mask
        b, t = clean_ids.shape
        corrupted = self.corruption.corrupt(batch, clean_ids, prompts.corrupted, mask)
        corrupted_ids, noise = corrupted.ids, corrupted.edit  # noise: the corrupted run's embedding edit, if any
        within_batch(0.0, "lm_patching: the clean and corrupted runs")
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
        metrics = pair_metrics(self.target, prompts, corrupted_ids, noise, clean_logits, corrupted_logits,
                               batch.sample_ids, self.p.min_span, self.warned)  # fmt: skip
        pairs = self.strings(batch)
        cells = cells_of(self.layout, self.p.sites, self.layers, t,
                         self.p.head_positions is HeadPositions.each)  # fmt: skip
        first = first_difference(clean_ids, corrupted_ids, noise, mask)
        same = unchanged_latents(cells, clean_sites, corrupted_sites)
        if same:  # a latent with the same value in both runs of every pair: no effect, no forward, no row
            self._say_unchanged(len(same), sum(c.kind == "latent" for c in cells))
            cells = [c for i, c in enumerate(cells) if i not in same]
        top_k = self.p.top_k if self.p.mode is PatchMode.attribution_topk else None
        parts: list[Columns] = []
        for n, direction in enumerate(self.p.directions):
            stage = Stage(n / len(self.p.directions), 1 / len(self.p.directions), f"lm_patching {direction.value}")
            denoising = direction is PatchDirection.denoising
            run = Receiver(direction, corrupted_ids if denoising else clean_ids, mask, noise if denoising else None,
                           clean_sites if denoising else corrupted_sites, metrics.receiving(direction),
                           corrupted.names)  # fmt: skip
            if self.p.mode is not PatchMode.exact:
                parts += attribution_rows(self.exact, model, run, cells, metrics, pairs, top_k, stage)
                continue
            # A cell before the first position where the two runs differ patches a value into a run that already
            # has it (the causal mask: nothing there sees the difference): its metric is the receiving run's.
            patched = run.metric.float().cpu().expand(len(cells), b).clone()
            live = [i for i, c in enumerate(cells) if c.position is None or c.position >= first]
            if live:
                patched[live] = self.exact.patched_metrics(model, run.ids, mask, run.edit, run.sources,
                                                           [cells[i] for i in live], metrics.answers,
                                                           metrics.distractors, metrics.clean_logits, stage)  # fmt: skip
            parts.append(cell_rows(run, cells, patched, metrics, pairs))
        self.hooks.clear()
        columns = concat_columns(parts)
        return BatchOutput(predicted=clean_logits.argmax(dim=1), tables={self.table: columns})

    def _say_unchanged(self, unchanged: int, latents: int) -> None:
        """Log, once a run, that a dictionary's unchanged latent cells have no rows (their restoration would be 0)."""
        if "unchanged_latents" in self.warned:
            return
        self.warned.add("unchanged_latents")
        log.info("lm_patching: %d of %d latent cells of the first batch have the same value in the clean and the"
                 " corrupted run of every pair (their restoration is 0): no rows for them", unchanged, latents)  # fmt: skip

    def _logits(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 next-token logits at the last position (left padding: the same index for every row)."""
        with torch.no_grad(), self.runtime.autocast():
            out = forward_last(model, ids, mask)
        return out.logits[:, -1].float()
