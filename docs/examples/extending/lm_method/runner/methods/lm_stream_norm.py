"""`method=lm_stream_norm`: |site| (the L2 norm over the hidden dimension) at the last position of each pair's clean
and corrupted prompt, for every chosen site and layer (default: each block's output, resid_post), and corrupted /
clean; one forward without gradient per prompt, the sites read through the hook session's `SiteHooks`."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import LanguageModelMethod, forward_last
from runner.methods.lm.cells import taken_views
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of
from runner.options.method.lm_stream_norm import LmStreamNormConfig
from runner.rows import BatchOutput
from runner.site_kinds import PER_HEAD
from runner.tables import Presentation, declare

LM_STREAM_NORM_SCHEMA = declare(
    "lm_stream_norm",
    [
        pa.field("site", pa.string()),  # resid_post, resid_pre, ...
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("clean_norm", pa.float32()),  # |site| at the clean prompt's last position
        pa.field("corrupted_norm", pa.float32()),  # the same in the corrupted prompt
        pa.field("ratio", pa.float32()),  # corrupted_norm / clean_norm
    ],
    Presentation(keys=("site",), values=("clean_norm", "corrupted_norm", "ratio"), shown=("site",)),
    classes=False,
)


class LmStreamNorm(LanguageModelMethod):
    name = "lm_stream_norm"
    table = "lm_stream_norm"
    summary_values = ("ratio",)
    cfg: LmStreamNormConfig

    @classmethod
    def planned(cls, cfg: LmStreamNormConfig, layout: LanguageModelLayout, target: Any) -> list[SiteSpec]:
        """Each (site, layer)'s spec; refused: a per-head site, a layer out of range, a site the family lacks."""
        per_head = [site for site in cfg.sites if site in PER_HEAD]
        if per_head:
            raise RunnerError(f"method.sites={per_head}: per-head sites have no one norm; give whole sites.")
        layers = layout.block_layers(cfg.layers, "method.layers")
        return [layout.site(kind, layer) for kind in cfg.sites for layer in layers]

    def setup(self, session: HookSession, num_samples: int) -> None:
        self.specs = self.planned(self.cfg, layout_of(session.model), self.runtime.target)
        self.hooks = SiteHooks(session.model, self.specs, session)  # one hook per site, registered by the session

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        norms, logits = [], []
        for ids in (prompts.clean, prompts.corrupted):  # a pair's prompts have one length: the same padding
            with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
                out = forward_last(model, ids, prompts.mask)
            views = taken_views(self.hooks, self.specs, self.name)  # site name -> (B, T, D)
            # left padding: the last position is the last index of every row
            norms.append(torch.stack([views[s.name][:, -1].float().norm(dim=-1) for s in self.specs], 1).cpu())
            logits.append(out.logits[:, -1])
        clean, corrupted = norms  # (B, sites x layers)
        pairs = clean.shape[0]
        return BatchOutput(
            predicted=logits[0].argmax(dim=-1),
            tables={self.table: {
                "sample_index": torch.arange(pairs).repeat_interleave(len(self.specs)),  # the pair's row in the batch
                "site": [spec.kind for spec in self.specs] * pairs,
                "layer": [spec.layer for spec in self.specs] * pairs,
                "clean_norm": clean.reshape(-1),
                "corrupted_norm": corrupted.reshape(-1),
                "ratio": (corrupted / clean).reshape(-1),
            }},
        )  # fmt: skip
