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
# Font sizes in points. Figures are drawn at the page's full width (figures.columns x PANEL_INCHES, 1200 px at
# 100 dpi) and shown at about that size, so a point is about 1.4 px: 10 pt ticks read as 14 px text.
TITLE_SIZE = 13
PANEL_TITLE_SIZE = 11
TICK_SIZE = 10
EXPLANATION_COLOUR = "#1f5fa8"  # the explanation's line (dark blue) ...
BASELINE_COLOUR = "#e07b00"  # ... and its random-map baseline (orange, dashed): apart in hue and in lightness
FEW_SAMPLES = 5  # below this many samples a bootstrap interval is rough: drawn grey, said in the caption
FEW_COLOUR = "#9a9a9a"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display); imported on first use (it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def full_width(figures: FiguresConfig) -> float:
    """The width in inches of a figure that spans the page: `figures.columns` panels."""
    return figures.columns * PANEL_INCHES


def grid_shape(panels: int, columns: int) -> tuple[int, int]:
    """(rows, columns) of a grid of `panels`, at most `columns` per row, the rows as even as they can be: 6 panels
    at 5 a row are 2 rows of 3, not 5 and an orphan."""
    rows = math.ceil(max(panels, 1) / max(1, columns))
    return rows, max(1, math.ceil(panels / rows))


def save(fig: Any, stem: Path, figures: FiguresConfig) -> Path:
    """Write `fig` to `stem` + the configured format's suffix at the configured dpi, close it, return the path."""
    plt = pyplot()
    path = stem.with_name(f"{stem.name}.{figures.format.value}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=figures.dpi, bbox_inches="tight")
    plt.close(fig)
    return path
