"""CAM vs patching agreement: does a map's mass predict the causal effect of the same spatial cell?

For each target layer, the layer's map is cut into the cells of activation patching (`units=cell`: the
`grid` of runner/methods/patching/units.py, or square cells of `cell_size`). Per cell:
  CAM mass  = the sum of a CAM method's map (at the layer's own resolution) over the cell;
  effect    = the exact patching effect of that cell (runner/methods/patching/engine.py's ExactEngine),
              signed so that a larger effect means the cell matters more for the target:
              denoising: patched - corrupted (how much the clean cell restores),
              noising:   clean - patched (how much the corrupted cell breaks).
Each row is Spearman's rho (runner/ranking.py) between the two, per (sample, direction, layer, CAM method):
the causal check of a saliency map. One forward of the clean and corrupted inputs gives every layer's
activations (and, with one `autograd.grad` of the clean target scores, every gradient CAM's maps); one
patching sweep per (sample, direction, layer) is shared by all `cam_methods`.

rho is NaN, with `degenerate` set and the reason in `degenerate_reason`, where it is undefined:
`constant_map` (the CAM mass is equal in every cell, e.g. an all-zero map, or not finite), `constant_effect`
(every cell's effect is equal), `single_cell` (a grid of one cell), and the patching pair's own reasons that
leave effects meaningless (`self_pair`, `target_is_contrast`, `zero_span`: runner/methods/patching/rows.py).
`constant_logits` flags the row but leaves rho a number (the target is arbitrary, as in the patching table).
"""

from __future__ import annotations

import pyarrow as pa
import torch
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.base import Method, check_targets, select_targets
from runner.methods.cam import CamContext, CamMethod, to_spatial
from runner.methods.patching.corruption import corrupt
from runner.methods.patching.engine import ExactEngine
from runner.methods.patching.metric import metric
from runner.methods.patching.rows import UNDEFINED, degenerate_reasons
from runner.methods.patching.units import Units, enumerate_units
from runner.options.method.cam_vs_patching import CamVsPatchingConfig
from runner.options.method.patching import (
    PatchDirection,
    PatchUnit,
)
from runner.ranking import spearman
from runner.rows import BatchOutput, Columns, concat_columns
from runner.runtime import Runtime
from runner.tables import Presentation, declare

# The `cam_vs_patching` table's own columns (`CamVsPatching.run_batch`): one row per (sample, direction, layer,
# CAM method).
CAM_VS_PATCHING_SCHEMA = declare(
    "cam_vs_patching",
    [
        pa.field("corrupted_id", pa.string()),
        pa.field("direction", pa.string()),  # denoising | noising
        pa.field("layer", pa.string()),
        pa.field("module_type", pa.string()),
        pa.field("cam_method", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("target", pa.int64()),
        pa.field("grid_h", pa.int64()),
        pa.field("grid_w", pa.int64()),
        pa.field("n_cells", pa.int64()),
        pa.field("spearman", pa.float32()),  # NaN where flagged undefined
        pa.field("degenerate", pa.bool_()),
        pa.field("degenerate_reason", pa.string()),
    ],
    Presentation(
        keys=("cam_method", "direction"),
        values=("spearman",),
        figures="runner.viz.plots:cam_vs_patching_figures",
        shown=("cam_method",),
    ),
)


def cell_mass(units: Units, maps: torch.Tensor) -> torch.Tensor:
    """(M, cells) each map's sum over each cell, for maps (M, H, W) at the layer's resolution."""
    masks = units.masks(0, units.count, maps.device)[:, 0].to(maps.dtype)  # (cells, H, W)
    return torch.einsum("mhw,chw->mc", maps, masks)


def agreement(mass: torch.Tensor, effect: torch.Tensor, pair_reason: str) -> tuple[torch.Tensor, list[str]]:
    """(M,) Spearman's rho of each row of `mass` (M, cells) with `effect` (cells,), and each row's reasons.

    `pair_reason`: the patching pair's comma-joined degenerate reasons ("" if none); those in UNDEFINED make rho NaN.
    """
    shared = [r for r in pair_reason.split(",") if r]
    if effect.numel() < 2:
        shared.append("single_cell")
    elif not bool(torch.isfinite(effect).all()) or float(effect.max()) == float(effect.min()):
        shared.append("constant_effect")
    undefined = any(r in UNDEFINED or r in ("single_cell", "constant_effect") for r in shared)
    rhos, reasons = [], []
    flat = mass.amax(dim=1) == mass.amin(dim=1)  # (M,) no cell ranks above another
    finite = torch.isfinite(mass).all(dim=1)  # (M,)
    for m in range(mass.shape[0]):
        own = [*shared] + (["constant_map"] if effect.numel() >= 2 and (bool(flat[m]) or not bool(finite[m])) else [])
        nan = undefined or "constant_map" in own
        rhos.append(torch.tensor(float("nan"), device=mass.device) if nan else spearman(mass[m], effect))
        reasons.append(",".join(own))
    return torch.stack(rhos).float(), reasons


class CamVsPatching(Method):
    name = "cam_vs_patching"
    table = "cam_vs_patching"
    summary_values = ("spearman",)

    def __init__(self, cfg: CamVsPatchingConfig, layers: list[Layer], runtime: Runtime) -> None:
        from runner.methods import cam_methods, method_config  # here: that package imports this module

        bad = cfg.check()  # a library caller may skip validation: cam_methods and units are checked before any work
        if bad:
            raise RunnerError(f"Out of range: {', '.join(bad)}.")
        self.cfg, self.p, self.layers, self.runtime = cfg, cfg.exact_patching, layers, runtime
        self.module_types = {n: type(m).__name__ for n, m in layers}
        # Each CAM method only turns (activation, gradient) into a map here: its `cam`, no capture of its own.
        self.cams: dict[str, CamMethod] = {
            name: cam_methods()[name](method_config(name), layers, runtime) for name in cfg.cam_methods
        }
        self.needs_gradients = any(c.needs_gradients for c in self.cams.values())
        self.dataset: Dataset | None = None
        self.warned: set[str] = set()

    def prepare(self, dataset: Dataset) -> None:
        """Keep the data set: corruption.kind=pair takes a sample's partner from it."""
        self.dataset = dataset

    def setup(self, session: HookSession, num_samples: int) -> None:
        check_targets(self.cfg, num_samples)
        self.capture = session.capture(self.layers, differentiable=self.needs_gradients)
        self.replacements = session.replace(self.layers, call=self.p.call)
        self.engine = ExactEngine(self.p, self.runtime, session, self.capture, self.replacements)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        b = batch.x.shape[0]
        corrupted, corrupted_ids = corrupt(batch, self.p.corruption, self.dataset)
        both = torch.cat([batch.x, corrupted])  # (2B, C, H, W): clean rows :b, corrupted rows b:
        if session.needs_input_grad:  # gradient hooks fire everywhere only if the pass reaches the input
            both = both.detach().requires_grad_(True)
        session.new_forward()
        self.capture.clear()
        with torch.set_grad_enabled(self.needs_gradients or session.needs_input_grad), self.runtime.autocast():
            logits = model(both).float()  # (2B, K)
        acts = self.capture.call_outputs(self.p.call, "method.exact_patching.call")  # each (2B, ...)
        names = list(acts)
        clean_logits, corrupted_logits = logits[:b].detach(), logits[b:].detach()
        target = select_targets(self.cfg, clean_logits, batch)  # (B,)
        contrast = self._contrast(corrupted_logits, target)
        m_clean = metric(self.p.metric, clean_logits, target, contrast)  # (B,)
        m_corrupted = metric(self.p.metric, corrupted_logits, target, contrast)  # (B,)
        reasons = degenerate_reasons(
            batch, corrupted, logits.detach(), target, contrast, m_clean, m_corrupted, self.p.metric, self.warned
        )
        maps = self._maps(model, batch, names, acts, logits, target, both)  # layer -> (M, B, h, w)
        self.capture.clear()
        parts: list[Columns] = []
        for direction in self.p.directions:
            denoising = direction is PatchDirection.denoising
            for i in range(b):
                base_input = (corrupted if denoising else batch.x)[i : i + 1]
                base_metric = m_corrupted[i] if denoising else m_clean[i]
                for name in names:
                    clean_act, corrupted_act = acts[name][i].detach(), acts[name][b + i].detach()
                    base, source = (corrupted_act, clean_act) if denoising else (clean_act, corrupted_act)
                    units = enumerate_units(name, tuple(base.shape), PatchUnit.cell, self.p.grid, self.p.cell_size)
                    patched = self.engine.patched_metrics(
                        model, name, base_input, base, source, units, target[i], contrast[i]
                    )  # (cells,) one sweep, shared by every CAM method
                    effect = (patched - base_metric) if denoising else (base_metric - patched)  # (cells,)
                    mass = cell_mass(units, maps[name][:, i])  # (M, cells)
                    rho, why = agreement(mass.double(), effect.double(), reasons[i])
                    parts.append(self._columns(i, direction, name, units, rho, why, target[i], corrupted_ids[i]))
        return BatchOutput(predicted=clean_logits.argmax(dim=1), tables={self.table: concat_columns(parts)})

    def _maps(
        self, model: nn.Module, batch: Batch, names: list[str], acts: dict[str, torch.Tensor], logits: torch.Tensor,
        target: torch.Tensor, both: torch.Tensor,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Per layer, (M, B, h, w) every CAM method's map of the clean rows, from one gradient pass for all layers."""
        b = target.shape[0]
        grads: list[torch.Tensor | None] = [None] * len(names)
        if self.needs_gradients:
            score = logits[:b].gather(1, target[:, None]).sum()  # the clean rows' target scores
            wanted = [acts[n] for n in names] + ([both] if both.requires_grad else [])
            grads = list(torch.autograd.grad(score, wanted, allow_unused=True)[: len(names)])
        ctx = CamContext(model, batch.x, target, self.runtime)
        out = {}
        with self.capture.paused():  # Score-CAM's masked forwards must not be captured
            for name, grad in zip(names, grads, strict=True):
                kind = self.module_types[name]
                a = to_spatial(acts[name][:b].detach().float(), name, kind, self.name, self.cfg.token_prefix)
                if self.needs_gradients and grad is None:
                    raise RunnerError(
                        f"The target score does not depend on layer '{name}', so it has no gradient there."
                    )
                g = None if grad is None else to_spatial(grad[:b].float(), name, kind, self.name, self.cfg.token_prefix)
                out[name] = torch.stack([
                    cam.cam(a, g if cam.needs_gradients else None, ctx).detach().float() for cam in self.cams.values()
                ])  # fmt: skip
        return out

    def _contrast(self, corrupted_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(B,) the logit_diff contrast class: the configured one, else the corrupted run's prediction."""
        if self.p.contrast_class is not None:
            if not 0 <= self.p.contrast_class < corrupted_logits.shape[1]:
                raise RunnerError(
                    f"method.exact_patching.contrast_class={self.p.contrast_class} is outside the model's classes."
                )
            return torch.full_like(target, self.p.contrast_class)
        return corrupted_logits.argmax(dim=1)

    def _columns(
        self, i: int, direction: PatchDirection, name: str, units: Units, rho: torch.Tensor, why: list[str],
        target: torch.Tensor, corrupted_id: str,
    ) -> Columns:  # fmt: skip
        """The rows of one (sample, direction, layer): one per CAM method."""
        n = len(self.cams)
        device = rho.device
        grid_h, grid_w = units.grid or (1, 1)
        return {
            "sample_index": torch.full((n,), i, device=device),
            "corrupted_id": [corrupted_id] * n,
            "direction": [direction.value] * n,
            "layer": [name] * n,
            "module_type": [self.module_types[name]] * n,
            "cam_method": list(self.cams),
            "metric": [self.p.metric.value] * n,
            "target": target.repeat(n).to(device),
            "grid_h": [grid_h] * n,
            "grid_w": [grid_w] * n,
            "n_cells": [units.count] * n,
            "spearman": rho,
            "degenerate": [bool(r) for r in why],
            "degenerate_reason": why,
        }
