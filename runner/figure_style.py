"""One style for every figure (pictures during a run, plots of tables, `runner report`): matplotlib without a
display, the colour maps, panel sizes, wrapped grids, and saving in the configured format and resolution."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from runner.schema import FiguresConfig

SEQUENTIAL_CMAP = "inferno"  # perceptually uniform, readable in grey; for maps in [0, 1]
FEATURE_CMAP = "viridis"  # perceptually uniform; feature maps (activations)
DIVERGING_CMAP = "RdBu_r"  # signed effects (patching restoration), centred on 0
PANEL_INCHES = 2.4  # one panel's width; `FiguresConfig.columns` of them make the figure's width
TITLE_SIZE = 9
PANEL_TITLE_SIZE = 8


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display); imported on first use (it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grid_shape(panels: int, columns: int) -> tuple[int, int]:
    """(rows, columns) of a grid of `panels` wrapped at `columns` per row."""
    cols = max(1, min(panels, columns))
    return math.ceil(panels / cols), cols


def save(fig: Any, stem: Path, figures: FiguresConfig) -> Path:
    """Write `fig` to `stem` + the configured format's suffix at the configured dpi, close it, return the path."""
    plt = pyplot()
    path = stem.with_name(f"{stem.name}.{figures.format.value}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=figures.dpi, bbox_inches="tight")
    plt.close(fig)
    return path
