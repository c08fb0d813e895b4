"""Pictures of a CAM method's maps: a consumer of the maps, called by `CamMethod.run_batch` after the rows.

Pictures show the data set's first `method.pictures_max` samples, a batch's leading ones: only their maps are
upsampled for them, and a batch past the last picture does no picture work at all. The drawing itself is
runner/pictures.py.
"""

from __future__ import annotations

import torch

from runner.data.base import Batch
from runner.runtime import Runtime
from runner.viz import pictures


def draw_maps(
    runtime: Runtime,
    batch: Batch,
    method: str,
    names: list[str],
    maps: list[torch.Tensor],
    target: torch.Tensor,
    score: torch.Tensor,
    probs: torch.Tensor,
    limit: int,
    feature_grid: tuple[str, torch.Tensor] | None = None,
) -> None:
    """Overlays of each layer's map (B, h, w) for the batch's samples among the first `limit` (titled with the
    `target` (B,) explained, its `score` (B,) and probability from `probs` (B, K)); and a grid of the first feature
    maps of `feature_grid` = (layer, its activations (B, C, h, w)) when given. Nothing without a pictures folder."""
    drawn = 0 if runtime.pictures_dir is None else pictures.drawn_count(batch, limit)
    if not drawn:
        return
    assert runtime.pictures_dir is not None
    figures = runtime.figures
    sizes = [(m.shape[1], m.shape[2]) for m in maps]
    shown = pictures.scaled_maps([m[:drawn] for m in maps], batch.x.shape[-2:], figures.map_scale)  # (drawn, H, W)
    explained = pictures.Explained(
        target[:drawn].tolist(), score[:drawn].detach().float().tolist(),
        probs.gather(1, target[:drawn, None])[:, 0].tolist(), runtime.class_names,
    )  # fmt: skip
    pictures.write_overlays(runtime.pictures_dir, batch, names, shown, method, limit, explained, sizes, figures)
    if feature_grid is not None:
        layer, act = feature_grid
        pictures.write_feature_grid(runtime.pictures_dir, batch, layer, act[:drawn], limit, figures=figures)
