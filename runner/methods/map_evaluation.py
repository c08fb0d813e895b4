"""Evaluation of a CAM method's maps: the faithfulness columns of the `cam` table and the `evaluation` table.

A consumer of maps, not a map maker: `CamMethod.run_batch` hands it each target's maps (each (B, h, w) at its
layer's resolution) and puts what it returns beside the rows. Both systems score the same saliency (each map
upsampled to the input and scaled to [0, 1]) against the same random baseline (`random_baselines`):
  - `method.faithfulness` (runner/faithfulness.py): deletion/insertion AUC, average drop, increase, as 8 columns
    of the `cam` table (one value per map, so they sit in the map's row);
  - `method.evaluation.metrics` (runner/metrics/): the registered metrics, as rows of the `evaluation` table
    (a metric may have several variants, so one row per metric and variant, joined to `cam` on its keys).
"""

from __future__ import annotations

import torch
from torch import nn

from runner.data.base import Batch
from runner.methods.base import OnceWarnings
from runner.metrics import curves as faithfulness
from runner.metrics.base import Metric, build_metrics
from runner.metrics.table import evaluation_rows
from runner.options.method.cam import FaithfulnessConfig
from runner.options.metric.evaluation import EvaluationConfig
from runner.randomness import per_sample_uniform
from runner.rows import Block, Columns, concat_columns
from runner.runtime import Runtime
from runner.stats import constant_rows, upsample


def random_baselines(
    maps: list[torch.Tensor], size: tuple[int, int] | torch.Size, seed: int, first_index: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's map (B, h, w) and its random baseline, upsampled to `size`: each (B, H, W) in [0, 1]; and whether
    each random map is constant at its resolution (B,) (a 1x1 layer's: no more an order than its own map).

    One random map per sample and resolution, shared by the layers of that resolution, so that layers are
    compared with the same baseline (by faithfulness and by the evaluation metrics alike). Drawn from (seed,
    sample index, resolution), never from the batch: the same sample gets the same baseline at any batch
    size, after an OOM split and on resume."""
    indices = range(first_index, first_index + maps[0].shape[0])
    by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for m in maps:
        h, w = m.shape[1:]
        if (h, w) not in by_shape:
            by_shape[(h, w)] = per_sample_uniform(
                (h, w), seed, indices, f"faithfulness.random_map.{h}x{w}", m.device
            )  # (B, h, w)
    saliency = [upsample(m.detach(), size) for m in maps]
    random_saliency = [upsample(by_shape[tuple(m.shape[1:])], size) for m in maps]
    random_flat = [faithfulness.degenerate_maps(by_shape[tuple(m.shape[1:])]) for m in maps]
    return saliency, random_saliency, random_flat


class MapEvaluation:
    """Faithfulness columns and the registered metrics' rows for one method's maps, target by target."""

    def __init__(
        self, faithfulness_cfg: FaithfulnessConfig, evaluation_cfg: EvaluationConfig, runtime: Runtime,
        warn: OnceWarnings,
    ) -> None:  # fmt: skip
        self.faithfulness_cfg, self.evaluation_cfg, self.runtime, self.warn = (
            faithfulness_cfg, evaluation_cfg, runtime, warn,
        )  # fmt: skip
        # Built here so that an unknown metric name fails before the first batch, with the nearest names.
        self.metrics: list[Metric] = build_metrics(evaluation_cfg) if evaluation_cfg.metrics else []
        self._parts: list[Columns] = []  # this batch's `evaluation` rows, one part per target

    @property
    def enabled(self) -> bool:
        return self.faithfulness_cfg.enabled or bool(self.metrics)

    def evaluate(
        self,
        model: nn.Module,
        batch: Batch,
        names: list[tuple[str, int]],
        maps: list[torch.Tensor],
        target: torch.Tensor,
        target_rank: int,
        probs: torch.Tensor,
    ) -> Block | None:
        """The faithfulness block (L*B, 8) of one target's maps (None when off); the metrics' rows are kept for
        `take_table`. `model`'s capture and record hooks must be paused. NaN where undefined: a map constant or not
        finite at its layer's resolution, and all faithfulness values where all logits are equal."""
        if target_rank == 0:  # a batch's first target: drop parts of an attempt that failed (OOM back-off)
            self._parts = []
        if not self.enabled:
            return None
        degenerate = [faithfulness.degenerate_maps(m) for m in maps]  # each (B,)
        saliency, random_saliency, random_flat = random_baselines(
            maps, batch.x.shape[-2:], self.faithfulness_cfg.seed, batch.first_index
        )
        block = None
        if self.faithfulness_cfg.enabled:
            b = target.shape[0]
            block = faithfulness.evaluate(
                model, batch.x, saliency, random_saliency, target, probs, self.faithfulness_cfg, self.runtime,
                sample_indices=range(batch.first_index, batch.first_index + b), degenerate=degenerate,
                undefined=constant_rows(probs), random_degenerate=random_flat,
            )  # fmt: skip
        if self.metrics:
            self._parts.append(
                self._metric_rows(
                    model, batch, names, saliency, random_saliency, target, target_rank, degenerate, random_flat
                )  # fmt: skip
            )
        return block

    def take_table(self) -> Columns | None:
        """This batch's `evaluation` rows (None when no metric is configured), then forget them."""
        if not self._parts:
            return None
        columns, self._parts = concat_columns(self._parts), []
        return columns

    def _metric_rows(
        self,
        model: nn.Module,
        batch: Batch,
        names: list[tuple[str, int]],
        saliency: list[torch.Tensor],
        random_saliency: list[torch.Tensor],
        target: torch.Tensor,
        target_rank: int,
        degenerate: list[torch.Tensor],
        random_degenerate: list[torch.Tensor],
    ) -> Columns:
        """The `evaluation` rows of one target: each metric on each layer's map and on its random map;
        a `degenerate` (B,) map's values NaN and flagged, a constant random map's random values NaN."""
        if batch.masks is not None and any(m.needs_masks for m in self.metrics):
            # A box smaller than a pixel at the model's input size vanishes when the mask is resized with the photo.
            empty = ~batch.masks.flatten(1).any(dim=1)  # (B,)
            self.warn(
                "empty_mask", empty, batch,
                f"a localisation mask is empty at the model's input size {tuple(batch.x.shape[-2:])} (a box smaller"
                " than a pixel after resizing vanishes, or the side file gives none); their localisation values NaN",
            )  # fmt: skip
        with torch.no_grad():  # the metrics' perturbed forwards keep nothing
            return evaluation_rows(
                self.metrics, names, saliency, random_saliency, model, batch.x, target, target_rank,
                batch.first_index, self.runtime, self.evaluation_cfg.seed, masks=batch.masks,
                chunk=self.evaluation_cfg.chunk, degenerate=degenerate, random_degenerate=random_degenerate,
            )  # fmt: skip
