"""Model-randomisation sanity check (Adebayo et al. 2018), per layer.

A copy of the model has the layers in `method.randomize` (and everything inside them)
re-initialised; the inner CAM method (`method.inner`) computes maps on both models for the same
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
from dataclasses import fields

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods.base import Method
from runner.methods.cam import CamMethod
from runner.options.method.cam import CamConfig
from runner.options.method.sanity import SanityConfig
from runner.ranking import spearman
from runner.rows import BatchOutput, Columns, Ragged
from runner.runtime import Runtime
from runner.schema import MethodConfig, TargetMode
from runner.tables import declare

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
)


class Sanity(Method):
    name = "sanity"
    table = "sanity"
    summary_values = ("spearman",)

    def __init__(self, cfg: SanityConfig, layers, runtime: Runtime) -> None:
        from runner.methods import cam_methods, method_config

        if cfg.inner not in cam_methods():
            raise RunnerError(f"method.inner='{cfg.inner}' must be a CAM method: {', '.join(cam_methods())}.")
        if cfg.target is TargetMode.topk:
            raise RunnerError("method=sanity compares one map per sample: use target predicted, label or fixed.")
        if not cfg.randomize:
            raise RunnerError(
                "method=sanity needs method.randomize=[...]: the layers to re-initialise, e.g. [classifier]."
            )
        self.cfg, self.layers, self.runtime = cfg, layers, runtime
        self.inner_class = cam_methods()[cfg.inner]
        shared = {f.name: getattr(cfg, f.name) for f in fields(CamConfig) if f.name != "name"}
        self.inner_cfg = method_config(cfg.inner, **shared)
        self.trained: CamMethod = self.inner_class(self.inner_cfg, layers, Runtime(runtime.device, runtime.precision, target=runtime.target))
        self.random: CamMethod | None = None

    def setup(self, session: HookSession, num_samples: int) -> None:
        self.num_samples = num_samples
        self.trained.setup(session, num_samples)

    def _randomised_copy(self, model: nn.Module) -> nn.Module:
        clone = copy.deepcopy(model)
        for module in clone.modules():  # the copy must not carry the session's hooks along
            module._forward_hooks.clear()
            module._forward_pre_hooks.clear()
            module._backward_hooks.clear()
        torch.manual_seed(self.cfg.faithfulness.seed)
        for _, module in resolve_layers(clone, self.cfg.randomize, where="method.randomize"):
            for sub in module.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
                if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                    sub.reset_running_stats()
        for p in clone.parameters():
            p.requires_grad_(False)
        return clone.eval()

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        if self.random is None:
            self.copy = self._randomised_copy(model)
            layers = [(name, self.copy.get_submodule(name)) for name, _ in self.layers]
            self.random = self.inner_class(self.inner_cfg, layers, Runtime(self.runtime.device, self.runtime.precision, target=self.runtime.target))
            self.random.setup(session, self.num_samples)
        trained_output = self.trained.run_batch(model, batch, session)
        trained = trained_output.tables[self.trained.table]
        # The randomised model explains the trained model's targets, so both maps answer the same question.
        self.random.cfg = _with_fixed_targets(self.inner_cfg, trained["target"], batch)
        randomised = self.random.run_batch(self.copy, batch, session).tables[self.random.table]
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
