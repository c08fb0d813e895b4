"""Model-randomisation sanity check (Adebayo et al. 2018), per layer.

The layers in `method.randomize` (and everything inside them) are re-initialised in the run's model, as a
reversible edit its hook session owns (undone before the batch ends); the inner CAM method (`method.inner`) computes maps on both models for the same
inputs and targets; each row holds the Spearman rank correlation between the two maps of one
(sample, layer). A map that does not change when the weights it claims to explain are destroyed
(correlation near 1) explains the input, not the model.

Spearman's rho (runner/ranking.py) is Pearson's r of average ranks, as `scipy.stats.spearmanr`: CAM maps
are full of ties (every pixel ReLU set to 0). A map that is constant (all zero, say) has no order, so rho is
NaN and the row is flagged `degenerate`.

This is the single-step special case, kept as it was: `method=mprt` (runner/methods/mprt.py) runs the full test
as Quantus's MPRT, step by step (cascading or independent) with Spearman, SSIM and top-k intersection.
"""

from __future__ import annotations

import copy

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession, resettable
from runner.layers import resolve_layers
from runner.methods.base import Method
from runner.methods.cam import CamMethod, inner_cam
from runner.options.method.sanity import SanityConfig
from runner.ranking import spearman
from runner.rows import BatchOutput, Columns, Ragged
from runner.runtime import Runtime
from runner.schema import MethodConfig, TargetMode
from runner.tables import Presentation, declare

# The `sanity` table's own columns (`Sanity.run_batch`): one row per (sample, layer, call).
SANITY_SCHEMA = declare(
    "sanity",
    [
        pa.field("layer", pa.string()),
        pa.field("module_type", pa.string()),
        pa.field("call", pa.int32()),
        pa.field("target", pa.int64()),
        pa.field("map_height", pa.int64()),
        pa.field("map_width", pa.int64()),
        pa.field("spearman", pa.float32()),  # NaN where a map is constant or not finite
        pa.field("degenerate", pa.bool_()),
        pa.field("inner_method", pa.string()),
        pa.field("randomized", pa.string()),  # method.randomize, comma-joined
    ],
    Presentation(keys=("randomized", "inner_method"), values=("spearman",)),
)


class Sanity(Method):
    name = "sanity"
    table = "sanity"
    summary_values = ("spearman",)

    def __init__(self, cfg: SanityConfig, layers, runtime: Runtime) -> None:
        if cfg.target is TargetMode.topk:
            raise RunnerError("method=sanity compares one map per sample: use target predicted, label or fixed.")
        if not cfg.randomize:
            raise RunnerError(
                "method=sanity needs method.randomize=[...]: the layers to re-initialise, e.g. [classifier]."
            )
        self.cfg, self.layers, self.runtime = cfg, layers, runtime
        self.trained: CamMethod = inner_cam(
            cfg, cfg.inner, layers, Runtime(runtime.device, runtime.precision, target=runtime.target)
        )
        self.inner_cfg = self.trained.cfg
        self.random: CamMethod | None = None

    def setup(self, session: HookSession, num_samples: int) -> None:
        self.trained.setup(session, num_samples)
        # Every resettable module in (and below) the listed layers, in order; one seed before the first.
        self.modules = resettable(
            m for _, m in resolve_layers(session.model, self.cfg.randomize, where="method.randomize")
        )

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        trained_output = self.trained.run_batch(model, batch, session)
        trained = trained_output.tables[self.trained.table]
        # The randomised model explains the trained model's targets, so both maps answer the same question.
        fixed = _with_fixed_targets(self.inner_cfg, trained["target"], batch)
        self.trained.capture.clear()  # the randomised forward's activations must not follow the trained ones
        # The listed layers re-initialised in the run's model as an edit the session owns, undone before the batch
        # ends (by the session, should this raise); the randomised forward is the method's own, not the user's.
        edit = session.reinitialise(self.modules, self.cfg.faithfulness.seed)
        cfg, self.trained.cfg = self.trained.cfg, fixed
        try:
            with session.recording_paused():
                randomised = self.trained.run_batch(model, batch, session).tables[self.trained.table]
        finally:
            self.trained.cfg = cfg
            edit.remove()
            self.trained.capture.clear()
        a, b = trained["map"], randomised["map"]
        assert isinstance(a, Ragged) and isinstance(b, Ragged)
        rho = torch.stack(
            [spearman(x, y) for x, y in zip(a.values.split(a.lengths), b.values.split(b.lengths), strict=True)]
        )
        columns: Columns = {
            key: trained[key]
            for key in ("layer", "module_type", "call", "sample_index", "target", "map_height", "map_width")
        }
        columns["spearman"] = rho
        # NaN rho: either map is constant (or not finite); which one shows in the cam columns of a CAM run.
        columns["degenerate"] = torch.isnan(rho)
        columns["inner_method"] = [self.cfg.inner] * len(rho)
        columns["randomized"] = [",".join(self.cfg.randomize)] * len(rho)
        return BatchOutput(predicted=trained_output.predicted, tables={self.table: columns})


def _with_fixed_targets(cfg: MethodConfig, targets: torch.Tensor, batch: Batch) -> MethodConfig:
    """The config for the randomised model: explain exactly the classes the trained model's maps explain."""
    fixed = copy.copy(cfg)
    fixed.target = TargetMode.fixed
    per_sample = targets[: len(batch.sample_ids)].tolist()
    fixed.class_ids = [0] * batch.first_index + per_sample
    return fixed
