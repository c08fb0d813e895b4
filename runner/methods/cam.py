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
import logging
import math
from dataclasses import dataclass

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.base import Method, check_targets, forward, gradients, select_target_sets
from runner.metrics import curves as faithfulness
from runner.metrics.base import Metric, build_metrics
from runner.metrics.table import evaluation_rows
from runner.options.method.cam import CamConfig
from runner.randomness import per_sample_uniform
from runner.rows import BatchOutput, Block, Columns, Ragged, concat_columns
from runner.runtime import Runtime
from runner.schema import MapScale
from runner.stats import STAT_NAMES, constant_rows, per_sample_stats, stat_fields, upsample
from runner.tables import declare, optional
from runner.viz import pictures

log = logging.getLogger(__name__)


@dataclass
class CamContext:
    """What a map may need beyond A and dA: Score-CAM re-runs the model on masked inputs."""

    model: nn.Module
    x: torch.Tensor  # (B, C, H, W) the input batch
    target: torch.Tensor  # (B,) the class explained
    runtime: Runtime


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


# The `cam` table's own columns (`CamMethod._rows`; faithfulness.evaluate's metrics; captum's method name).
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
)


class CamMethod(Method):
    """Base of the CAM family: capture, gradient pass per target, maps, rows, faithfulness, pictures."""

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
        self._warned: set[str] = set()  # which once-per-run warnings were given
        # Built here so that an unknown metric name fails before the first batch, with the nearest names.
        self.metrics: list[Metric] = build_metrics(cfg.evaluation) if cfg.evaluation.metrics else []
        self._evaluation: list[Columns] = []  # this batch's `evaluation` rows, one part per target

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
    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        logits, x = forward(model, batch, session, self.runtime, with_grad=self.needs_gradients)
        target_sets = select_target_sets(self.cfg, logits, batch)  # (B, K)
        for name in self.capture.names:
            if not self.capture.outputs[name]:
                raise RunnerError(f"Layer '{name}' was never called in the forward pass; pick a layer the model uses.")
        entries = [(n, c, a) for n in self.capture.names for c, a in enumerate(self.capture.outputs[n])]
        probs = logits.detach().softmax(dim=1)
        parts: list[Columns] = []
        for k in range(target_sets.shape[1]):
            target = target_sets[:, k]  # (B,)
            score = self.runtime.target.score(logits, target, batch.masks)  # (B,) the target's score (run's `target`)
            if self.needs_gradients:
                last = k == target_sets.shape[1] - 1
                grads = gradients(score, [a for _, _, a in entries], x, session, retain_graph=not last)
            else:
                grads = [None] * len(entries)
            ctx = CamContext(model, batch.x, target, self.runtime)
            # Past the user's forward and backward: Score-CAM's masked inputs, faithfulness and the metrics run
            # forwards of their own, which the user's `record` hooks and the capture must not see.
            with session.recording_paused(), self._capture_paused():
                maps = [self._map(name, act, grad, ctx) for (name, _, act), grad in zip(entries, grads, strict=True)]
                parts.append(self._rows(entries, maps, target, k, score, probs, batch, ctx))
        return BatchOutput(predicted=logits.argmax(dim=1), tables=self._tables(concat_columns(parts)))

    def _tables(self, columns: Columns) -> dict[str, Columns]:
        """The batch's tables: this method's, and `evaluation` when metrics are configured (its parts then reset)."""
        tables = {self.table: columns}
        if self._evaluation:
            tables["evaluation"] = concat_columns(self._evaluation)
            self._evaluation = []
        return tables

    def _map(self, name: str, act: torch.Tensor, grad: torch.Tensor | None, ctx: CamContext) -> torch.Tensor:
        module_type = self.module_types[name]
        a = to_spatial(act.detach().float(), name, module_type, self.name, self.cfg.token_prefix, self.spatial_hint)
        if self.needs_gradients and grad is None:
            raise RunnerError(f"The target score does not depend on layer '{name}', so it has no gradient there.")
        g = None if grad is None else to_spatial(grad.float(), name, module_type, self.name, self.cfg.token_prefix)
        return self.cam(a, g, ctx)  # (B, h, w)

    def _rows(
        self,
        entries: list[tuple[str, int, torch.Tensor]],
        maps: list[torch.Tensor],
        target: torch.Tensor,
        target_rank: int,
        score: torch.Tensor,
        probs: torch.Tensor,
        batch: Batch,
        ctx: CamContext,
    ) -> Columns:
        b = target.shape[0]
        n = len(entries)
        sizes = [(m.shape[1], m.shape[2]) for m in maps]
        # All logits equal (a zero-initialised head, say) <=> uniform probabilities: every class is the
        # "prediction", the one explained is arbitrary. Rows are flagged and their faithfulness is NaN.
        flat_logits = constant_rows(probs)  # (B,)
        self._warn_once(
            "constant_logits", flat_logits, batch,
            "all logits are equal, so the class explained is arbitrary (random or untrained weights?);"
            " rows flagged constant_logits, faithfulness NaN",
        )  # fmt: skip
        # A constant map (all zero, say) or one with NaN/inf ranks no pixel: flagged, and NaN metrics.
        degenerate = [faithfulness.degenerate_maps(m) for m in maps]  # each (B,)
        self._warn_once(
            "degenerate", torch.stack(degenerate).any(dim=0), batch,
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
            "cam": Block(torch.cat([per_sample_stats(m, b)[0] for m in maps]), [f"cam_{s}" for s in STAT_NAMES]),
            "degenerate": torch.cat(degenerate),
            "constant_logits": flat_logits.repeat(n),
        }
        if self.cfg.store_maps:
            columns["map"] = Ragged(
                torch.cat([m.reshape(-1) for m in maps]), [h * w for h, w in sizes for _ in range(b)]
            )
        size = batch.x.shape[-2:]
        saliency: list[torch.Tensor] | None = None
        if self.cfg.faithfulness.enabled or self.metrics:
            saliency, random_saliency, random_flat = self._saliency(maps, batch)
        if self.cfg.faithfulness.enabled:
            metrics = faithfulness.evaluate(
                ctx.model, batch.x, saliency, random_saliency, target, probs, self.cfg.faithfulness, self.runtime,
                sample_indices=range(batch.first_index, batch.first_index + b), degenerate=degenerate,
                undefined=flat_logits, random_degenerate=random_flat,
            )  # fmt: skip
            columns["faithfulness"] = metrics
        if self.metrics:
            if target_rank == 0:  # a batch's first target: drop parts of an attempt that failed (OOM back-off)
                self._evaluation = []
            self._evaluation.append(
                self._evaluate(
                    entries, saliency, random_saliency, target, target_rank, batch, ctx, degenerate, random_flat
                )
            )
        # Pictures show the data set's first pictures_max samples, a batch's leading ones: only their maps are
        # upsampled for them, and a batch past the last picture does no picture work at all.
        drawn = 0
        if self.runtime.pictures_dir is not None and target_rank == 0:
            drawn = pictures.drawn_count(batch, self.cfg.pictures_max)
        if drawn:
            figures = self.runtime.figures
            # Faithfulness's maps are scaled per map; a scale shared by the layers needs the maps before that.
            shown = saliency
            if shown is None or figures.map_scale is not MapScale.per_map:
                shown = pictures.scaled_maps([m[:drawn] for m in maps], size, figures.map_scale)  # (drawn, H, W)
            explained = pictures.Explained(
                target[:drawn].tolist(), score[:drawn].detach().float().tolist(),
                probs.gather(1, target[:drawn, None])[:, 0].tolist(), self.runtime.class_names,
            )  # fmt: skip
            pictures.write_overlays(
                self.runtime.pictures_dir, batch, [name for name, _, _ in entries], shown, self.name,
                self.cfg.pictures_max, explained, sizes, figures,
            )  # fmt: skip
            grid = self.cfg.feature_grid_layer
            if grid is not None:
                act = dict((name, a) for name, _, a in entries)[grid][:drawn]  # (drawn, ...)
                pictures.write_feature_grid(
                    self.runtime.pictures_dir,
                    batch,
                    grid,
                    to_spatial(act.detach().float(), grid, self.module_types[grid], self.name, self.cfg.token_prefix),
                    self.cfg.pictures_max,
                    figures=figures,
                )
        return columns

    def _saliency(
        self, maps: list[torch.Tensor], batch: Batch
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's map and its random baseline, upsampled to the input: each (B, H, W) in [0, 1]; and whether
        each random map is constant at its resolution (B,) (a 1x1 layer's: no more an order than its own map).

        One random map per sample and resolution, shared by the layers of that resolution, so that layers are
        compared with the same baseline (by faithfulness and by the evaluation metrics alike). Drawn from (seed,
        sample index, resolution), never from the batch: the same sample gets the same baseline at any batch
        size, after an OOM split and on resume."""
        size = batch.x.shape[-2:]
        indices = range(batch.first_index, batch.first_index + batch.x.shape[0])
        by_shape: dict[tuple[int, ...], torch.Tensor] = {}
        for m in maps:
            h, w = m.shape[1:]
            if (h, w) not in by_shape:
                by_shape[(h, w)] = per_sample_uniform(
                    (h, w), self.cfg.faithfulness.seed, indices, f"faithfulness.random_map.{h}x{w}", m.device
                )  # (B, h, w)
        saliency = [upsample(m.detach(), size) for m in maps]
        random_saliency = [upsample(by_shape[tuple(m.shape[1:])], size) for m in maps]
        random_flat = [faithfulness.degenerate_maps(by_shape[tuple(m.shape[1:])]) for m in maps]
        return saliency, random_saliency, random_flat

    def _evaluate(
        self,
        entries: list[tuple[str, int, torch.Tensor]],
        saliency: list[torch.Tensor],
        random_saliency: list[torch.Tensor],
        target: torch.Tensor,
        target_rank: int,
        batch: Batch,
        ctx: CamContext,
        degenerate: list[torch.Tensor],
        random_degenerate: list[torch.Tensor],
    ) -> Columns:
        """The `evaluation` rows of one target: each metric on each layer's map and on its random map (`_saliency`);
        a `degenerate` (B,) map's values NaN and flagged, a constant random map's random values NaN."""
        if batch.masks is not None and any(m.needs_masks for m in self.metrics):
            # A box smaller than a pixel at the model's input size vanishes when the mask is resized with the photo.
            empty = ~batch.masks.flatten(1).any(dim=1)  # (B,)
            self._warn_once(
                "empty_mask", empty, batch,
                f"a localisation mask is empty at the model's input size {tuple(batch.x.shape[-2:])} (a box smaller"
                " than a pixel after resizing vanishes, or the side file gives none); their localisation values NaN",
            )  # fmt: skip
        with self._capture_paused(), torch.no_grad():  # the metrics' perturbed forwards keep nothing
            return evaluation_rows(
                self.metrics, [(name, call) for name, call, _ in entries], saliency, random_saliency, ctx.model,
                batch.x, target, target_rank, batch.first_index, self.runtime, self.cfg.evaluation.seed,
                masks=batch.masks, chunk=self.cfg.evaluation.chunk, degenerate=degenerate,
                random_degenerate=random_degenerate,
            )  # fmt: skip

    def _capture_paused(self) -> contextlib.AbstractContextManager[None]:
        """The capture paused (keeps nothing, passes everything through); a no-op for captum, which captures nothing."""
        capture = getattr(self, "capture", None)
        return capture.paused() if capture is not None else contextlib.nullcontext()

    def _warn_once(self, key: str, flags: torch.Tensor, batch: Batch, message: str) -> None:
        """One log line per run (the flag column marks every row) naming the first samples concerned."""
        if key in self._warned or not bool(flags.any()):
            return
        self._warned.add(key)
        ids = [s for s, f in zip(batch.sample_ids, flags.tolist(), strict=False) if f]
        log.warning("%s: %s (first: %s)", self.name, message, ", ".join(ids[:5]))
