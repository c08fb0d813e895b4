"""Pictures per sample: the input and each layer's map over it, a grid of one layer's most active feature maps,
and patching heatmaps over the photo. Each kind is built by a `*_figure` function (reusable by `runner report`)
and saved by a `write_*` one in the style and format of runner/viz/figure_style.py."""

from __future__ import annotations

import math
import re
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from runner.data.base import Batch
from runner.data.images import IMAGENET_MEAN, IMAGENET_STD
from runner.schema import FiguresConfig, MapScale
from runner.stats import upsample
from runner.viz import figure_style

FEATURE_CHANNELS = 16  # channels in a feature grid: the most active ones
DIM = 0.4  # patching heatmaps: the photo beneath is blended this much towards mid-grey, so the cells stand out


@dataclass
class Explained:
    """What the overlays of a batch's drawn samples are titled with: the class explained, its logit and probability."""

    target: list[int]
    score: list[float]
    probability: list[float]
    names: list[str] | None = None  # the model's class names; None: classes by index


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def class_label(target: int, names: list[str] | None) -> str:
    """'Egyptian cat' (285) where the model names its classes, else class 285."""
    if names is not None and 0 <= target < len(names):
        return f"'{names[target]}' ({target})"
    return f"class {target}"


def _wrapped(text: str, width_inches: float, size: float) -> str:
    """`text` wrapped to lines that fit `width_inches` at font `size` (points), so a title never widens the figure."""
    chars = max(20, int(width_inches * 72 / (0.55 * size)))  # a character is about 0.55 em wide
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _display(x: torch.Tensor) -> np.ndarray:
    """(C, H, W) normalised input -> (H, W, 3) in [0, 1] for display (ImageNet statistics assumed)."""
    mean = torch.tensor(IMAGENET_MEAN, device=x.device)[:, None, None]
    std = torch.tensor(IMAGENET_STD, device=x.device)[:, None, None]
    image = (x[:3] * std[: x.shape[0]] + mean[: x.shape[0]]).clamp(0, 1)
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    return image.permute(1, 2, 0).cpu().numpy()


def _shown(batch: Batch, limit: int) -> list[tuple[int, str]]:
    """(index in batch, sample id) of the batch's samples among the data set's first `limit`."""
    return [(i, s) for i, s in enumerate(batch.sample_ids) if batch.first_index + i < limit]


def drawn_count(batch: Batch, limit: int) -> int:
    """How many of the batch's samples get pictures: its leading ones among the data set's first `limit`."""
    return max(0, min(len(batch.sample_ids), limit - batch.first_index))


def _axes_grid(
    panels: int, columns: int, panel_inches: float, header_inches: float, width: float | None = None
) -> tuple[Any, np.ndarray]:
    """A figure of `panels` axes in even rows of at most `columns` (constrained layout), and its axes (rows, cols).
    `width`: the figure's width in inches, the panels as large as fit (at most twice `panel_inches`)."""
    plt = figure_style.pyplot()
    rows, cols = figure_style.grid_shape(panels, columns)
    if width is not None:
        panel_inches = min(2 * panel_inches, 0.92 * width / cols)  # room for the colour bar beside the grid
    fig, axes = plt.subplots(
        rows, cols, figsize=(cols * panel_inches, rows * panel_inches + header_inches), squeeze=False,
        layout="constrained",
    )  # fmt: skip
    for ax in axes.flat:
        ax.axis("off")
    return fig, axes


# ---- overlays -----------------------------------------------------------------------------------------------------
def scale_note(scale: MapScale) -> str:
    """The line under an overlay's title that says how its maps were scaled to [0, 1]."""
    if scale is MapScale.shared:
        return "one scale shared by all layers: min-max over the sample's maps of every layer"
    return "maps min-max scaled per map (shapes comparable across layers, magnitudes not)"


def scaled_maps(maps: list[torch.Tensor], size: tuple[int, int] | torch.Size, scale: MapScale) -> list[torch.Tensor]:
    """Each layer's maps (B, h, w) upsampled to the input, (B, H, W) in [0, 1]: per map (as faithfulness scales
    them), or with one min and max per sample over all layers (maps NaN or infinite somewhere are left out of it)."""
    if scale is MapScale.per_map:
        return [upsample(m, size) for m in maps]
    up = [F.interpolate(m[:, None].float(), size=tuple(size), mode="bilinear", align_corners=False)[:, 0] for m in maps]
    stacked = torch.stack(up)  # (L, B, H, W)
    finite = stacked.isfinite()
    lo = torch.where(finite, stacked, math.inf).amin(dim=(0, 2, 3))  # (B,)
    hi = torch.where(finite, stacked, -math.inf).amax(dim=(0, 2, 3))  # (B,)
    span = (hi - lo).clamp_min(1e-12)[:, None, None]  # (B, 1, 1)
    return [(u - lo[:, None, None]) / span for u in up]


def overlay_figure(
    image: np.ndarray,
    labels: list[str],
    maps: list[np.ndarray],
    sizes: list[tuple[int, int]],
    title: str,
    note: str,
    figures: FiguresConfig,
) -> Any:
    """The input (H, W, 3), then each layer's map (H, W) in [0, 1] over it, titled with the layer and its map size;
    wrapped at `figures.columns` panels a row, one colour bar, `note` (the maps' scaling) under `title`."""
    width = figure_style.full_width(figures)
    fig, axes = _axes_grid(len(labels) + 1, figures.columns, figure_style.PANEL_INCHES, 0.9, width)
    flat = axes.flat
    flat[0].imshow(image)
    flat[0].set_title(f"input {image.shape[0]}x{image.shape[1]}", fontsize=figure_style.PANEL_TITLE_SIZE)
    shown = None
    for ax, label, m, (h, w) in zip(flat[1:], labels, maps, sizes, strict=False):
        ax.imshow(image)
        shown = ax.imshow(m, cmap=figure_style.SEQUENTIAL_CMAP, alpha=0.55, vmin=0, vmax=1)
        ax.set_title(f"{label} {h}x{w}", fontsize=figure_style.PANEL_TITLE_SIZE)
    if shown is not None:
        # The bar from an opaque twin of the maps: the translucent overlay would wash out its colours.
        solid = figure_style.pyplot().cm.ScalarMappable(norm=shown.norm, cmap=shown.cmap)
        fig.colorbar(solid, ax=axes.ravel().tolist(), shrink=0.8, label="map (scaled to [0, 1])")
    width = fig.get_size_inches()[0]
    fig.suptitle(
        _wrapped(title, width, figure_style.TITLE_SIZE) + "\n" + _wrapped(note, width, figure_style.PANEL_TITLE_SIZE),
        fontsize=figure_style.TITLE_SIZE,
    )
    return fig


def _layer_labels(layers: list[str]) -> list[str]:
    """The layers' panel labels: a module called more than once per forward gets its call index."""
    counts, seen = Counter(layers), Counter[str]()
    labels = []
    for name in layers:
        labels.append(f"{name} (call {seen[name]})" if counts[name] > 1 else name)
        seen[name] += 1
    return labels


def write_overlays(
    directory: Path,
    batch: Batch,
    layers: list[str],
    saliency: list[torch.Tensor],
    method: str,
    limit: int,
    explained: Explained | None = None,
    sizes: list[tuple[int, int]] | None = None,
    figures: FiguresConfig | None = None,
) -> list[Path]:
    """One figure per sample (the first `limit`): the input, then each layer's map over it (`saliency`: each
    (B', H, W) in [0, 1], scaled as `figures.map_scale` says; B' >= the samples drawn). Returns the files."""
    figures = figures or FiguresConfig()
    shown = _shown(batch, limit)
    if not shown:
        return []
    maps = [m.detach().float().cpu().numpy() for m in saliency]
    sizes = sizes or [(m.shape[-2], m.shape[-1]) for m in saliency]
    labels = _layer_labels(layers)
    written = []
    for i, sample_id in shown:
        title = f"{sample_id}"
        if int(batch.labels[i]) >= 0:  # the true class beside the explained one: a wrong prediction shows
            title += f" (true: {class_label(int(batch.labels[i]), explained.names if explained else None)})"
        title += f": {method}"
        if explained is not None:
            target = explained.target[i]
            title += (
                f" for {class_label(target, explained.names)}, logit {explained.score[i]:.2f},"
                f" p = {explained.probability[i]:.3f}"
            )
        fig = overlay_figure(
            _display(batch.x[i].detach().float()), labels, [m[i] for m in maps], sizes, title,
            scale_note(figures.map_scale), figures,
        )  # fmt: skip
        stem = directory / f"{batch.first_index + i:06d}_{_safe(sample_id)}_{method}"
        written.append(figure_style.save(fig, stem, figures))
    return written


# ---- feature grids ------------------------------------------------------------------------------------------------
def top_channels(act: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The `k` channels of one sample's activations (C, h, w) with the highest mean, most active first, and means."""
    means = act.float().mean(dim=(1, 2))  # (C,)
    values, indices = means.topk(min(k, means.shape[0]))
    return indices.tolist(), values.tolist()


def feature_figure(act: torch.Tensor, title: str, figures: FiguresConfig, k: int = FEATURE_CHANNELS) -> Any:
    """One sample's `k` most active channels of a layer (activations (C, h, w)), most active first, each titled with
    its index and mean, on one colour scale with one colour bar; `title` (sample, layer) above."""
    channels, means = top_channels(act, k)
    shown = act[channels].float().cpu().numpy()  # (k, h, w)
    finite = shown[np.isfinite(shown)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    columns = min(figures.columns, math.ceil(math.sqrt(len(channels))))  # a square-ish grid of small maps
    fig, axes = _axes_grid(len(channels), columns, 0.75 * figure_style.PANEL_INCHES, 0.9)
    image = None
    for ax, c, mean, m in zip(axes.flat, channels, means, shown, strict=False):
        image = ax.imshow(m, cmap=figure_style.FEATURE_CMAP, vmin=lo, vmax=hi if hi > lo else lo + 1e-6)
        ax.set_title(f"ch {c} mean {mean:.3g}", fontsize=figure_style.PANEL_TITLE_SIZE)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="activation")
    width = fig.get_size_inches()[0]
    text = (
        f"{title}: top {len(channels)} of {act.shape[0]} channels by mean activation\n"
        f"one colour scale for all panels: {lo:.3g} to {hi:.3g}"
    )
    fig.suptitle(_wrapped(text, width, figure_style.TITLE_SIZE), fontsize=figure_style.TITLE_SIZE)
    return fig


def write_feature_grid(
    directory: Path,
    batch: Batch,
    layer: str,
    act: torch.Tensor,
    limit: int,
    channels: int = FEATURE_CHANNELS,
    figures: FiguresConfig | None = None,
) -> list[Path]:
    """One figure per sample (the first `limit`): the `channels` most active feature maps of `layer`
    (activations (B', C, h, w), B' >= the samples drawn). Returns the files."""
    figures = figures or FiguresConfig()
    written = []
    for i, sample_id in _shown(batch, limit):
        fig = feature_figure(act[i].detach(), f"{sample_id}, layer {layer}", figures, channels)
        stem = directory / f"{batch.first_index + i:06d}_{_safe(sample_id)}_features_{_safe(layer)}"
        written.append(figure_style.save(fig, stem, figures))
    return written


# ---- patching heatmaps --------------------------------------------------------------------------------------------
def patching_figure(
    image: np.ndarray, layers: list[str], grids: list[np.ndarray], title: str, figures: FiguresConfig,
    quantity: str = "restoration",
) -> Any:  # fmt: skip
    """Each layer's cell grid (gh, gw) of `quantity` (restoration, or a noising patch's drop) over the dimmed photo
    (H, W, 3), upsampled nearest and translucent, on one scale centred on 0 with one colour bar; in even rows of at
    most `figures.columns` panels."""
    finite = np.concatenate([g[np.isfinite(g)] for g in grids]) if grids else np.array([])
    # Finite values only: a degenerate pair (paired with itself, target == contrast) has every restoration
    # NaN, and its picture is then an empty grid over the photo, not a crash that loses the run.
    scale = max(1e-6, float(np.abs(finite).max()) if finite.size else 1.0)
    dimmed = (1 - DIM) * image + DIM * 0.5  # (H, W, 3), blended towards mid-grey
    size = image.shape[:2]
    fig, axes = _axes_grid(
        len(layers), figures.columns, figure_style.PANEL_INCHES, 0.9, figure_style.full_width(figures)
    )
    shown = None
    for ax, layer, grid in zip(axes.flat, layers, grids, strict=False):  # axes: whole rows, some unused
        cells = F.interpolate(torch.from_numpy(grid).float()[None, None], size=size, mode="nearest")[0, 0]  # (H, W)
        ax.imshow(dimmed)
        shown = ax.imshow(cells.numpy(), cmap=figure_style.DIVERGING_CMAP, vmin=-scale, vmax=scale, alpha=0.7)
        ax.set_title(f"{layer} {grid.shape[0]}x{grid.shape[1]} cells", fontsize=figure_style.PANEL_TITLE_SIZE)
    if shown is not None:
        solid = figure_style.pyplot().cm.ScalarMappable(norm=shown.norm, cmap=shown.cmap)  # opaque, as above
        fig.colorbar(solid, ax=axes.ravel().tolist(), shrink=0.8, label=quantity)
    width = fig.get_size_inches()[0]
    text = f"{title}\n{quantity} per patched cell over the dimmed clean photo; one scale, centred on 0 (±{scale:.3g})"
    fig.suptitle(_wrapped(text, width, figure_style.TITLE_SIZE), fontsize=figure_style.TITLE_SIZE)
    return fig


def write_patching_heatmaps(
    directory: Path,
    batch: Batch,
    columns: dict,
    limit: int,
    class_names: list[str] | None = None,
    figures: FiguresConfig | None = None,
) -> list[Path]:
    """One figure per (pair, direction), for the first `limit` pairs: each layer's restoration over its grid of
    cells (exact where measured) over the clean photo. Returns the files."""
    figures = figures or FiguresConfig()
    if not _shown(batch, limit):
        return []
    restoration = columns["restoration"].detach().float().cpu().numpy()
    index = np.asarray(columns["sample_index"].cpu())
    targets = np.asarray(columns["target"].cpu()) if "target" in columns else None
    kinds = set(columns["patch_method"])
    measured = "exact" if "exact" in kinds else "attribution"
    written = []
    for i, sample_id in _shown(batch, limit):
        for direction in sorted(set(columns["direction"])):
            rows = [
                r for r in range(len(restoration))
                if index[r] == i and columns["direction"][r] == direction and columns["patch_method"][r] == measured
            ]  # fmt: skip
            layers = list(dict.fromkeys(columns["layer"][r] for r in rows))  # the rows' order: model order
            if not layers:
                continue
            grids = []
            for layer in layers:
                cells = [r for r in rows if columns["layer"][r] == layer]
                grid = np.full((columns["grid_h"][cells[0]], columns["grid_w"][cells[0]]), np.nan, dtype=np.float32)
                for r in cells:
                    grid[columns["y"][r], columns["x"][r]] = restoration[r]
                grids.append(grid)
            noising = direction == "noising"
            if noising:  # what matters is what breaks the output: drawn as the drop, 1 - restoration
                grids = [1 - g for g in grids]
            quantity = "drop (1 - restoration)" if noising else "restoration"
            undefined = "" if any(np.isfinite(g).any() for g in grids) else ", restoration undefined (NaN)"
            target = "" if targets is None else f", target {class_label(int(targets[rows[0]]), class_names)}"
            title = f"{sample_id} vs corrupted {columns['corrupted_id'][rows[0]]}: {direction} ({measured}){target}"
            fig = patching_figure(
                _display(batch.x[i].detach().float()), layers, grids, title + undefined, figures, quantity
            )
            stem = directory / f"{batch.first_index + i:06d}_{_safe(sample_id)}_patching_{direction}"
            written.append(figure_style.save(fig, stem, figures))
    return written
