"""The CAM family's shared pass: every target layer from one forward and one backward per target.

For a layer with activations A (B, C, H, W) and the target class's logit y, a CAM method maps
(A, dy/dA) to a (B, H, W) map at the layer's own resolution. Most variants only choose channel
weights w (B, C) and return ReLU(sum_c w_c A_c); the rest override `cam` itself.

All layers' activations come from one forward; all their gradients from one
`torch.autograd.grad(y, [A_1 .. A_L])` per target with frozen parameters, so backward stops at the
earliest layer and no weight gradient is computed. The activations are the modules' true outputs:
the session hands the model a clone, so an in-place ReLU after a conv cannot overwrite them.
Token models (ViT, (B, T, D) outputs) are reshaped to the patch grid after dropping `token_prefix`
leading tokens.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import NO_LABEL, Batch
from runner.errors import RunnerError, suggest
from runner.fused_stats import fused_stats
from runner.hooks import HookSession
from runner.layers import Layer, resolve_layers
from runner.methods.base import (
    Method,
    OnceWarnings,
    check_targets,
    forward,
    gradients,
    library_config,
    library_runtime,
    select_target_sets,
)
from runner.methods.map_evaluation import MapEvaluation
from runner.methods.map_pictures import draw_maps
from runner.metrics import curves as faithfulness
from runner.options.method.cam import CamConfig, MapDtype, cam_method_names
from runner.options.registry import METHODS, Option
from runner.rows import BatchOutput, Block, Columns, Ragged, concat_columns
from runner.runtime import Runtime
from runner.schema import TargetMode
from runner.stats import STAT_NAMES, constant_rows, per_sample_stats, stat_fields
from runner.tables import Presentation, declare, optional

log = logging.getLogger(__name__)


@dataclass
class CamContext:
    """What a map may need beyond A and dA: Score-CAM re-runs the model on masked inputs."""

    model: nn.Module
    x: torch.Tensor  # (B, C, H, W) the input batch
    target: torch.Tensor  # (B,) the class explained
    runtime: Runtime


@dataclass
class CamForward:
    """One forward of a batch with a CAM method's capture on: what each target's maps are made from."""

    logits: torch.Tensor  # (B, K) float32
    x: torch.Tensor  # the input as the forward took it (requiring grad where gradient hooks must fire everywhere)
    entries: list[tuple[str, int, torch.Tensor]]  # (layer, call, activation), every call of every target layer


def to_spatial(
    t: torch.Tensor, name: str, module_type: str, method: str, token_prefix: int, hint: str = ""
) -> torch.Tensor:
    """(B, C, H, W) view of a layer output: as is, or ViT tokens (B, T, D) -> (B, D, h, w) on the patch grid."""
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        tokens = t[:, token_prefix:]  # (B, T', D)
        side = math.isqrt(tokens.shape[1])
        if side * side == tokens.shape[1]:
            return tokens.transpose(1, 2).reshape(t.shape[0], t.shape[2], side, side)
        raise RunnerError(
            f"Layer '{name}' outputs {tuple(t.shape)}: after dropping {token_prefix} leading token(s),"
            f" {tokens.shape[1]} tokens do not form a square patch grid. Set method.token_prefix."
        )
    raise RunnerError(
        f"{method} needs spatial activations (batch, channels, height, width) or tokens (batch, tokens, dim),"
        f" but layer '{name}' ({module_type}) outputs shape {tuple(t.shape)}. Pick convolutional layers,"
        f" e.g. layers.include=[Conv2d]{hint}."
    )


# The `cam` table's own columns (`CamMethod.rows`; faithfulness.evaluate's metrics; captum's method name).
CAM_SCHEMA = declare(
    "cam",
    [
        pa.field("layer", pa.string()),
        pa.field("module_type", pa.string()),
        pa.field("call", pa.int32()),
        pa.field("target", pa.int64()),
        pa.field("target_rank", pa.int64()),
        pa.field("score", pa.float32()),  # the target's score (target=logit, the default: the class's logit)
        pa.field("probability", pa.float32()),
        pa.field("map_height", pa.int64()),
        pa.field("map_width", pa.int64()),
        *stat_fields("cam_"),
        pa.field("degenerate", pa.bool_()),
        pa.field("constant_logits", pa.bool_()),
        optional("map", pa.list_(pa.float32()), "method.store_maps=true"),
        *(optional(c, pa.float32(), "method.faithfulness.enabled=true") for c in faithfulness.COLUMNS),
        optional("captum_method", pa.string(), "method=captum"),
    ],
    Presentation(
        keys=("method", "call"),
        # scale-free columns first: a raw map's cam_max is the layer's own scale and compares no layers
        values=(
            "score",
            "cam_frac_zero",
            "deletion_auc",
            "insertion_auc",
            "avg_drop",
            "random_deletion_auc",
            "random_insertion_auc",
            "random_avg_drop",
        ),  # fmt: skip
        figures="runner.viz.plots:cam_figures",
    ),
)


MIN, MAX, NONFINITE = (STAT_NAMES.index(s) for s in ("min", "max", "nonfinite"))  # columns of the statistics
MAP_DTYPES = {MapDtype.float32: torch.float32, MapDtype.float16: torch.float16}  # method.map_dtype


def map_stats(maps: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(B, 7) statistics of each map (B, h, w): on CUDA one fused pass (runner/fused_stats.py, as `record` hooks
    compute theirs, compiled); on the CPU, where nothing is compiled, runner/stats.py's reductions."""
    stats, _ = (fused_stats if maps.is_cuda else per_sample_stats)(maps, batch_size)
    return stats


class CamMethod(Method):
    """Base of the CAM family: capture, one gradient pass per target, maps and rows. What consumes the maps runs
    after the rows: evaluation (runner/methods/map_evaluation.py) and pictures (runner/methods/map_pictures.py)."""

    name = "cam"
    table = "cam"  # every CAM method (and captum) writes the same table: a sweep over methods is one table
    needs_gradients = True
    # the console summary: scale-free columns (a raw map's cam_max is the layer's own scale and compares no layers)
    summary_values = (
        "score", "cam_frac_zero", "deletion_auc", "random_deletion_auc", "insertion_auc",
        "random_insertion_auc", "avg_drop", "random_avg_drop",
    )  # fmt: skip

    def __init__(self, cfg: CamConfig, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.layers, self.runtime = cfg, layers, runtime
        self.module_types = {name: type(module).__name__ for name, module in layers}
        self.warn = OnceWarnings(self.name, log)  # which once-per-run warnings were given
        self.evaluation = MapEvaluation(cfg.faithfulness, cfg.evaluation, runtime, self.warn)

    def setup(self, session: HookSession, num_samples: int) -> None:
        check_targets(self.cfg, num_samples)
        self.capture = session.capture(self.layers, differentiable=self.needs_gradients)
        convs = [n for n, m in session.model.named_modules() if isinstance(m, nn.Conv2d)]
        self.spatial_hint = f" (this model's last convolutions: {', '.join(convs[-4:])})" if convs else ""
        grid = self.cfg.feature_grid_layer
        if grid is not None and grid not in self.capture.names:
            raise RunnerError(
                f"method.feature_grid_layer='{grid}' must be one of the target layers: {self.capture.names}."
            )

    # ---- what variants change -------------------------------------------------------------------
    def channel_weights(self, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """(B, C) weight of each channel."""
        raise NotImplementedError

    def cam(self, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        """(B, H, W) map from activations (B, C, H, W) and their gradients (None for gradient-free methods)."""
        assert grad is not None
        return torch.relu(torch.einsum("bc,bchw->bhw", self.channel_weights(act, grad), act))

    # ---- the pass -------------------------------------------------------------------------------
    def forward(self, model: nn.Module, batch: Batch, session: HookSession) -> CamForward:
        """The user's forward of `batch` with the capture on (after `setup`): logits and every captured call."""
        logits, x = forward(model, batch, session, self.runtime, with_grad=self.needs_gradients)
        for name in self.capture.names:
            if not self.capture.outputs[name]:
                raise RunnerError(f"Layer '{name}' was never called in the forward pass; pick a layer the model uses.")
        entries = [(n, c, a) for n in self.capture.names for c, a in enumerate(self.capture.outputs[n])]
        return CamForward(logits, x, entries)

    def maps(
        self, fwd: CamForward, target: torch.Tensor, model: nn.Module, x: torch.Tensor, session: HookSession,
        retain_graph: bool = False, masks: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Each entry's map (B, h, w) at its layer's resolution for the classes `target` (B,): one backward of the
        target's score (the run's `target`: the logit by default) to every captured activation (`retain_graph` for a
        later target), then `cam` per entry. `x` is the batch's input (B, C, H, W), which Score-CAM masks; `masks`
        the batch's localisation masks, for a target that scores a region."""
        if self.needs_gradients:
            score = self.runtime.target.score(fwd.logits, target, masks)  # (B,)
            grads = gradients(score, [a for _, _, a in fwd.entries], fwd.x, session, retain_graph=retain_graph)
        else:
            grads = [None] * len(fwd.entries)
        ctx = CamContext(model, x, target, self.runtime)
        # Past the user's forward and backward: Score-CAM's masked inputs run forwards of their own, which the
        # user's `record` hooks and the capture must not see.
        with session.recording_paused(), self._capture_paused():
            return [
                self.layer_map(name, act, grad, ctx) for (name, _, act), grad in zip(fwd.entries, grads, strict=True)
            ]

    def layer_map(self, name: str, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        """The map (B, h, w) of layer `name` from its activation and gradient (token outputs put on their grid)."""
        module_type = self.module_types[name]
        a = to_spatial(act.detach().float(), name, module_type, self.name, self.cfg.token_prefix, self.spatial_hint)
        if self.needs_gradients and grad is None:
            raise RunnerError(f"The target score does not depend on layer '{name}', so it has no gradient there.")
        g = None if grad is None else to_spatial(grad.float(), name, module_type, self.name, self.cfg.token_prefix)
        return self.cam(a, g, ctx)  # (B, h, w)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        fwd = self.forward(model, batch, session)
        target_sets = select_target_sets(self.cfg, fwd.logits, batch)  # (B, K)
        probs = fwd.logits.detach().softmax(dim=1)
        parts: list[Columns] = []
        for k in range(target_sets.shape[1]):
            target = target_sets[:, k]  # (B,)
            last = k == target_sets.shape[1] - 1
            maps = self.maps(fwd, target, model, batch.x, session, retain_graph=not last, masks=batch.masks)
            score = self.runtime.target.score(fwd.logits, target, batch.masks)  # (B,) the run's target
            parts.append(self.consume(model, batch, session, fwd.entries, maps, target, k, score, probs))
        return BatchOutput(predicted=fwd.logits.argmax(dim=1), tables=self._tables(concat_columns(parts)))

    def consume(
        self, model: nn.Module, batch: Batch, session: HookSession, entries: list[tuple[str, int, Any]],
        maps: list[torch.Tensor], target: torch.Tensor, target_rank: int, score: torch.Tensor, probs: torch.Tensor,
    ) -> Columns:  # fmt: skip
        """One target's rows, then what consumes its maps: evaluation (faithfulness columns beside the rows, the
        `evaluation` table's rows kept for `_tables`) and, for a batch's first target, pictures. Their forwards
        are the method's own: the user's `record` hooks and the capture do not see them."""
        columns = self.rows(entries, maps, target, target_rank, score, probs, batch)
        names = [(name, call) for name, call, _ in entries]
        with session.recording_paused(), self._capture_paused():
            block = self.evaluation.evaluate(model, batch, names, maps, target, target_rank, probs)
        if block is not None:
            columns["faithfulness"] = block
        if target_rank == 0:
            grid = self.cfg.feature_grid_layer
            feature_grid = None
            if grid is not None and self.runtime.pictures_dir is not None:
                act = dict((name, a) for name, _, a in entries)[grid]  # (B, ...)
                spatial = to_spatial(
                    act.detach().float(), grid, self.module_types[grid], self.name, self.cfg.token_prefix
                )
                feature_grid = (grid, spatial)
            draw_maps(
                self.runtime, batch, self.name, [name for name, _, _ in entries], maps, target, score, probs,
                self.cfg.pictures_max, feature_grid,
            )  # fmt: skip
        return columns

    def _tables(self, columns: Columns) -> dict[str, Columns]:
        """The batch's tables: this method's, and `evaluation` when metrics are configured (its parts then reset)."""
        tables = {self.table: columns}
        evaluation = self.evaluation.take_table()
        if evaluation is not None:
            tables["evaluation"] = evaluation
        return tables

    def rows(
        self,
        entries: list[tuple[str, int, Any]],
        maps: list[torch.Tensor],
        target: torch.Tensor,
        target_rank: int,
        score: torch.Tensor,
        probs: torch.Tensor,
        batch: Batch,
    ) -> Columns:
        """The `cam` table's rows of one target, one per (entry, sample): the target, its score and probability,
        the map's size and statistics, flags, and the map itself (`store_maps`)."""
        b = target.shape[0]
        n = len(entries)
        sizes = [(m.shape[1], m.shape[2]) for m in maps]
        # All logits equal (a zero-initialised head, say) <=> uniform probabilities: every class is the
        # "prediction", the one explained is arbitrary. Rows are flagged and their faithfulness is NaN.
        flat_logits = constant_rows(probs)  # (B,)
        self.warn(
            "constant_logits", flat_logits, batch,
            "all logits are equal, so the class explained is arbitrary (random or untrained weights?);"
            " rows flagged constant_logits, faithfulness NaN",
        )  # fmt: skip
        stats = torch.cat([map_stats(m, b) for m in maps])  # (n*b, 7), layer-major like the rows
        # A constant map (all zero, say) or one with NaN/inf ranks no pixel: flagged, and NaN metrics. Read off the
        # statistics (min == max, or non-finite: runner.metrics.curves.degenerate_maps exactly), not the maps again.
        degenerate = (stats[:, MIN] == stats[:, MAX]) | (stats[:, NONFINITE] != 0)  # (n*b,)
        self.warn(
            "degenerate", degenerate.view(n, b).any(dim=0), batch,
            "a map is constant (all zero, say) or not finite at some layer; rows flagged degenerate,"
            " their faithfulness and evaluation metrics NaN",
        )  # fmt: skip
        columns: Columns = {
            "layer": [name for name, _, _ in entries for _ in range(b)],
            "module_type": [self.module_types[name] for name, _, _ in entries for _ in range(b)],
            "call": [call for _, call, _ in entries for _ in range(b)],
            "sample_index": torch.arange(b, device=target.device).repeat(n),
            "target": target.repeat(n),
            "target_rank": [target_rank] * (b * n),
            "score": score.detach().repeat(n),
            "probability": probs.gather(1, target[:, None]).squeeze(1).repeat(n),
            "map_height": [h for h, _ in sizes for _ in range(b)],
            "map_width": [w for _, w in sizes for _ in range(b)],
            "cam": Block(stats, [f"cam_{s}" for s in STAT_NAMES]),
            "degenerate": degenerate,
            "constant_logits": flat_logits.repeat(n),
        }
        if self.cfg.store_maps:
            # One buffer of every map, in the stored precision: the float16 copy is made by the concatenation itself.
            flat = torch.empty(
                sum(m.numel() for m in maps), dtype=MAP_DTYPES[self.cfg.map_dtype], device=maps[0].device
            )
            columns["map"] = Ragged(
                torch.cat([m.detach().reshape(-1) for m in maps], out=flat), [h * w for h, w in sizes for _ in range(b)]
            )
        return columns

    def _capture_paused(self) -> contextlib.AbstractContextManager[None]:
        """The capture paused (keeps nothing, passes everything through); a no-op for captum, which captures nothing."""
        capture = getattr(self, "capture", None)
        return capture.paused() if capture is not None else contextlib.nullcontext()


@functools.cache
def variant_method(option: Option) -> type[CamMethod]:
    """The CAM method of a variant registered with `cam_variant`: its rule class mixed into the shared pass (one
    class per option, so that every lookup of the option finds the same class)."""
    rule = option.rule
    namespace = {"name": option.name, "__module__": rule.__module__, "__doc__": rule.__doc__}
    return type(rule.__name__, (rule, CamMethod), namespace)


# ---- the library function: maps of a model and a batch, no run directory ------------------------------------------
def cam_names() -> list[str]:
    """The CAM variants' option names (family "cam"; captum, which makes no CAM pass of its own, is not one)."""
    return cam_method_names()


def cam_method(name: str, layers: list[Layer], runtime: Runtime, **settings: Any) -> CamMethod:
    """The CAM variant called `name` (gradcam, gradcampp, scorecam, ...) on `layers`, its config fields `settings`
    checked as a run checks them; a RunnerError with the nearest names for an unknown or a non-CAM method."""
    if name not in cam_names():
        raise RunnerError(f"'{name}' is not a CAM method: one of {', '.join(cam_names())}.{suggest(name, cam_names())}")
    option = METHODS.get(name)
    return option.load()(library_config(option.schema, **settings), layers, runtime)  # type: ignore[no-any-return]


def inner_cam(cfg: CamConfig, inner: str, layers: list[Layer], runtime: Runtime) -> CamMethod:
    """The CAM method `inner` (a randomisation test's `method.inner`), made with `cfg`'s CAM fields (store_maps,
    token_prefix, ...); the inner method's own fields (scorecam's score_chunk, say) keep their defaults."""
    if inner not in cam_names():
        raise RunnerError(f"method.inner='{inner}' must be a CAM method: {', '.join(cam_names())}.")
    option = METHODS.get(inner)
    shared = {f.name: getattr(cfg, f.name) for f in fields(CamConfig) if f.name != "name"}
    return option.load()(option.schema(**shared), layers, runtime)  # type: ignore[no-any-return]


def cam_maps(
    model: nn.Module,
    x: torch.Tensor,
    layers: list[str],
    method: str = "gradcam",
    target: int | list[int] | torch.Tensor | None = None,
    call: int = 0,
    **settings: Any,
) -> dict[str, torch.Tensor]:
    """Each target layer's map (B, h, w), at the layer's own resolution, of `model` (in eval mode) on the batch `x`
    (B, C, H, W): Grad-CAM or any CAM variant, from one forward and one backward, with no run directory.

    `layers`: names or selectors as `layers.include` (e.g. ["layer4", "Conv2d"]); `target`: the class explained,
    None for each sample's predicted class, a class id for all, or (B,) ids; `call`: which call of a module used
    several times per forward; `settings`: the method's own config fields (e.g. scorecam_weights="paper").
    The maps are those the `cam` table's `map` column holds. The model's weights and hooks are left as they were.
    """
    cam = cam_method(method, resolve_layers(model, list(layers)), library_runtime(x), **settings)
    if cam.cfg.target is not TargetMode.predicted or cam.cfg.class_ids:
        raise RunnerError("cam_maps: choose the class with target=..., not with the config's target fields.")
    b = x.shape[0]
    targets = None if target is None else torch.as_tensor(target, device=x.device).reshape(-1).expand(b)
    with HookSession(model, []) as session:
        cam.setup(session, b)
        session.begin_batch(b, 0)
        batch = Batch(x, torch.full((b,), NO_LABEL, dtype=torch.long), [str(i) for i in range(b)], 0)
        fwd = cam.forward(model, batch, session)
        targets = fwd.logits.argmax(dim=1) if targets is None else targets.long()
        if bool(((targets < 0) | (targets >= fwd.logits.shape[1])).any()):
            raise RunnerError(f"target={targets.tolist()}: outside the model's {fwd.logits.shape[1]} classes.")
        maps = cam.maps(fwd, targets, model, x, session)
        session.end_batch()
    return {name: m for (name, c, _), m in zip(fwd.entries, maps, strict=True) if c == call}
