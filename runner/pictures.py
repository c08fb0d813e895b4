"""Pictures per sample: the input beside each layer's map overlaid, and a grid of one layer's feature maps."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from runner.data import IMAGENET_MEAN, IMAGENET_STD, Batch


def _figure_module():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _display(x: torch.Tensor) -> torch.Tensor:
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


def write_overlays(
    directory: Path, batch: Batch, layers: list[str], saliency: list[torch.Tensor], method: str, limit: int
) -> None:
    """One PNG per sample (the first `limit`): the input, then each layer's map (upsampled, in [0, 1]) over it."""
    shown = _shown(batch, limit)
    if not shown:
        return
    plt = _figure_module()
    directory.mkdir(parents=True, exist_ok=True)
    maps = [m.detach().cpu().numpy() for m in saliency]
    for i, sample_id in shown:
        image = _display(batch.x[i].detach().float())
        fig, axes = plt.subplots(1, len(layers) + 1, figsize=(2.2 * (len(layers) + 1), 2.5), squeeze=False)
        axes[0, 0].imshow(image)
        axes[0, 0].set_title(sample_id, fontsize=8)
        for j, (layer, m) in enumerate(zip(layers, maps, strict=True), start=1):
            axes[0, j].imshow(image)
            axes[0, j].imshow(m[i], cmap="jet", alpha=0.5, vmin=0, vmax=1)
            axes[0, j].set_title(layer, fontsize=7)
        for ax in axes.flat:
            ax.axis("off")
        fig.suptitle(method, fontsize=9)
        fig.tight_layout()
        fig.savefig(directory / f"{batch.first_index + i:06d}_{_safe(sample_id)}_{method}.png", dpi=80)
        plt.close(fig)


def write_feature_grid(
    directory: Path, batch: Batch, layer: str, act: torch.Tensor, limit: int, channels: int = 16
) -> None:
    """One PNG per sample (the first `limit`): the first `channels` feature maps of `layer` (activations (B, C, h, w))."""
    if not _shown(batch, limit):
        return
    plt = _figure_module()
    directory.mkdir(parents=True, exist_ok=True)
    shown = act[:, :channels].detach().cpu().numpy()
    cols = 4
    rows = (shown.shape[1] + cols - 1) // cols
    for i, sample_id in _shown(batch, limit):
        fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.6 * rows), squeeze=False)
        for k, ax in enumerate(axes.flat):
            if k < shown.shape[1]:
                ax.imshow(shown[i, k], cmap="viridis")
                ax.set_title(f"ch {k}", fontsize=6)
            ax.axis("off")
        fig.suptitle(f"{sample_id}: {layer}", fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / f"{batch.first_index + i:06d}_{_safe(sample_id)}_features_{_safe(layer)}.png", dpi=80)
        plt.close(fig)


def write_patching_heatmaps(directory: Path, batch: Batch, columns: dict, limit: int) -> None:
    """One PNG per (pair, direction), for the first `limit` pairs: each layer's restoration over its grid of
    cells (exact where measured)."""
    if not _shown(batch, limit):
        return
    plt = _figure_module()
    directory.mkdir(parents=True, exist_ok=True)
    restoration = columns["restoration"].detach().cpu().numpy()
    index = columns["sample_index"].cpu().numpy()
    kinds = set(columns["patch_method"])
    shown = "exact" if "exact" in kinds else "attribution"
    for i, sample_id in _shown(batch, limit):
        for direction in sorted(set(columns["direction"])):
            rows = [
                r for r in range(len(restoration))
                if index[r] == i and columns["direction"][r] == direction and columns["patch_method"][r] == shown
            ]  # fmt: skip
            layers = list(dict.fromkeys(columns["layer"][r] for r in rows))
            if not layers:
                continue
            # Finite values only: a degenerate pair (paired with itself, target == contrast) has every
            # restoration NaN, and its picture is then an empty grid, not a crash that loses the run.
            finite = [abs(float(restoration[r])) for r in rows if math.isfinite(float(restoration[r]))]
            scale = max(1e-6, max(finite, default=1.0))
            fig, axes = plt.subplots(1, len(layers), figsize=(2.4 * len(layers), 2.6), squeeze=False)
            for ax, layer in zip(axes[0], layers, strict=True):
                cells = [r for r in rows if columns["layer"][r] == layer]
                gh, gw = columns["grid_h"][cells[0]], columns["grid_w"][cells[0]]
                grid = torch.full((gh, gw), float("nan"))
                for r in cells:
                    grid[columns["y"][r], columns["x"][r]] = float(restoration[r])
                image = ax.imshow(grid.numpy(), cmap="RdBu_r", vmin=-scale, vmax=scale)  # shared, symmetric scale
                ax.set_title(layer, fontsize=7)
                ax.axis("off")
            fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="restoration")
            undefined = "" if finite else ", restoration undefined (NaN)"
            fig.suptitle(
                f"{sample_id} vs {columns['corrupted_id'][rows[0]]}: {direction} ({shown}){undefined}", fontsize=8
            )
            name = f"{batch.first_index + i:06d}_{_safe(sample_id)}_patching_{direction}.png"
            fig.savefig(directory / name, dpi=80)
            plt.close(fig)
