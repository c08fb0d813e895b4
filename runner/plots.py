"""Plots of result tables: per-layer curves in model order with 95% bootstrap intervals across samples.

- `per_layer_figure(frame, value, by)`: x the layers in model order (`layer_index`), y the mean of `value` over
  samples with its 95% percentile bootstrap interval (runner/analysis.py `summarise`) as a shaded band, one line
  per value of `by` (a swept column such as `sweep.method`, or `method`, `variant`, `cam_method`).
- `mprt_figure(frame, similarity, by)`: x the randomisation step (ticks: the module re-initialised up to there),
  y the mean similarity to the trained model's map with its interval, one line per layer in model order.
- `table_figures(table, frame, by)`: the standard figures of one results table, each with a one-sentence caption
  (what `runner report` shows); [] for a table without a standard figure or a frame with nothing to draw.

A point with one sample has no interval (NaN): it is drawn without a band. NaN values (undefined statistics,
e.g. a degenerate map's faithfulness) are left out before averaging; captions say how many samples entered.
Style (sizes, fonts, colour maps, saving) comes from runner/figure_style.py; the caller saves each Figure with
`figure_style.save`, which closes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from runner import figure_style as style
from runner.analysis import summarise
from runner.schema import FiguresConfig
from runner.summary import layers_in_model_order

Figure = Any  # matplotlib.figure.Figure; matplotlib is imported on first use (it is slow)

BAND_ALPHA = 0.2  # the interval band's opacity: the line stays readable through overlapping bands
LINE_COLOUR_CMAP = "tab10"  # categorical lines (swept values, methods): distinct hues
TICK_SIZE = 7  # points; layer names are long (_blocks.15._depthwise_conv), so smaller than panel titles
AXES_SHARE = 0.78  # the part of a figure's width the axes take (the rest: y label, ticks, margins)
PLOT_HEIGHT = 3.2  # inches of one panel of curves
REFERENCE = "reference"  # gid of a drawn reference line (y = 0), left out of legends
MAX_STEP_TICKS = 12  # an MPRT run may re-initialise dozens of modules: label at most this many steps
CAPTION_WORDS = {
    "deletion_auc": "deletion AUC (lower: the map's top pixels matter more)",
    "insertion_auc": "insertion AUC (higher: the map's top pixels suffice)",
    "cam_max": "the map's maximum",
    "restoration": "restoration (1: the patch restores the clean output)",
    "spearman": "Spearman's rho between the CAM and the patching effects",
}


def per_layer_figure(
    frame: pd.DataFrame, value: str, by: str | None = None, title: str | None = None,
    figures: FiguresConfig | None = None, *, baseline: str | None = None,
) -> Figure:  # fmt: skip
    """`value`'s mean over samples per layer (model order) with its 95% bootstrap band, one line per `by` value.

    `baseline`: a second column (e.g. `random_value`) drawn dashed in each line's colour.
    """
    return _per_layer(frame, value, [by] if by else [], title, figures, baseline)[0]


def mprt_figure(
    frame: pd.DataFrame, similarity: str = "spearman", by: str | None = None, figures: FiguresConfig | None = None
) -> Figure:
    """MPRT similarity to the trained model's map per randomisation step, one line per layer in model order.

    One panel per value of `by` (and per `order` where the table has several).
    """
    return _mprt(frame, similarity, by, figures)[0]


def table_figures(
    table: str, frame: pd.DataFrame, by: str | None = None, figures: FiguresConfig | None = None
) -> list[tuple[str, Figure]]:
    """The standard figures of one results table as (caption, Figure); [] for what cannot be drawn."""
    builder = _BUILDERS.get(table)
    if builder is None or frame is None or frame.empty or "layer" not in frame.columns:
        return []
    if by is not None and by not in frame.columns:
        by = None  # a column the table lacks compares nothing; draw the pooled figure
    return builder(frame, by, figures or FiguresConfig())


# --- per-layer curves ---------------------------------------------------------------------------------------


def _per_layer(
    frame: pd.DataFrame, value: str, lines: Sequence[str], title: str | None, figures: FiguresConfig | None,
    baseline: str | None = None, ylabel: str | None = None,
) -> tuple[Figure, pd.DataFrame]:  # fmt: skip
    """The per-layer figure and its summary rows (layer, *lines, n, mean, ci_low, ci_high)."""
    figures = figures or FiguresConfig()
    plt = style.pyplot()
    frame, unit = _with_unit(frame)
    layers = layers_in_model_order(frame)
    lines = [c for c in lines if c in frame.columns]
    summary = _summary(frame, value, [*lines, "layer"], unit)
    base = _summary(frame, baseline, [*lines, "layer"], unit) if baseline and baseline in frame.columns else None
    fig, ax = plt.subplots(figsize=(_layer_width(len(layers), figures), PLOT_HEIGHT))
    x = np.arange(len(layers))  # (L,) positions of the layers in model order
    colours = plt.get_cmap(LINE_COLOUR_CMAP).colors
    keys = _line_keys(summary, lines)
    for k, key in enumerate(keys):
        colour = colours[k % len(colours)]
        label = _label(lines, key) if lines else ("explanation" if base is not None else value)
        _draw_line(ax, x, _select(summary, lines, key), layers, colour, label, "-")
        if base is not None:
            _draw_line(ax, x, _select(base, lines, key), layers, colour, f"{label} (random map)" if lines else
                       "random map", "--")  # fmt: skip
    if not keys:
        ax.text(0.5, 0.5, f"no {value} values", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlim(-0.5, max(len(layers) - 0.5, 0.5))
    _layer_ticks(ax, fig, layers)
    ax.set_xlabel("layer (model order)", fontsize=style.PANEL_TITLE_SIZE)
    ax.set_ylabel(ylabel or f"mean {value}", fontsize=style.PANEL_TITLE_SIZE)
    ax.tick_params(axis="y", labelsize=TICK_SIZE)
    ax.grid(True, alpha=0.3)
    ax.set_title(
        title or f"{value} per layer" + (f" by {', '.join(lines)}" if lines else ""), fontsize=style.TITLE_SIZE
    )
    if lines or base is not None:
        _legend(ax, fontsize=TICK_SIZE, ncol=2 if len(ax.get_lines()) > 6 else 1, loc="best")
    fig.tight_layout()
    return fig, summary


def _draw_line(ax: Any, x: np.ndarray, rows: pd.DataFrame, layers: list[str], colour: Any, label: str, ls: str) -> None:
    """One line (a marker per point: a lone point stays visible) and its band where an interval exists."""
    rows = rows.set_index("layer").reindex(layers)
    ax.plot(x, rows["mean"].to_numpy(float), marker="o", markersize=3.5, color=colour, linestyle=ls, label=label)
    low, high = rows["ci_low"].to_numpy(float), rows["ci_high"].to_numpy(float)  # (L,), NaN: < 2 samples
    if np.isfinite(low).any():
        ax.fill_between(x, low, high, color=colour, alpha=BAND_ALPHA if ls == "-" else BAND_ALPHA / 2, linewidth=0)


def _legend(ax: Any, **kwargs: Any) -> None:
    """A legend of every line, handles passed explicitly: matplotlib skips labels starting with '_' (EfficientNet's
    `_blocks.5`, `_conv_head`) when it collects them itself."""
    lines = [line for line in ax.get_lines() if line.get_gid() != REFERENCE]
    ax.legend(lines, [line.get_label() for line in lines], **kwargs)


def _layer_width(n_layers: int, figures: FiguresConfig) -> float:
    """The figure's width in inches: grows with the layers, never beyond figures.columns panels."""
    return min(figures.columns * style.PANEL_INCHES, max(2 * style.PANEL_INCHES, 0.55 * n_layers + 1.5))


def _layer_ticks(ax: Any, fig: Any, names: list[str], positions: Sequence[float] | None = None) -> None:
    """Tick labels `names` rotated (45 degrees, or 90 and smaller where dense) so that neighbours do not overlap."""
    positions = list(range(len(names))) if positions is None else list(positions)
    if not names:
        ax.set_xticks([])
        return
    low, high = ax.get_xlim()
    axes_inches = fig.get_figwidth() * AXES_SHARE
    spacing = axes_inches / max((high - low), 1e-9)  # inches between neighbouring positions one unit apart
    gaps = np.diff(sorted(positions)) if len(positions) > 1 else np.array([high - low])
    dx = spacing * float(np.min(gaps))  # inches between the closest two ticks
    size, rotation = rotation_for(dx, TICK_SIZE)
    ax.set_xticks(positions, names, rotation=rotation, fontsize=size)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right" if rotation == 45 else "center")
        label.set_rotation_mode("anchor" if rotation == 45 else "default")


def rotation_for(dx_inches: float, size: float) -> tuple[float, int]:
    """(font size, rotation) for tick labels dx_inches apart: rotated text lines dx*sin(rotation) apart must
    leave room for a line of text (1.3 x the font size)."""
    line = 1.3 * size / 72  # inches a line of text needs
    if dx_inches * math.sin(math.radians(45)) >= line:
        return size, 45
    if dx_inches >= line:
        return size, 90
    return max(3.0, dx_inches * 72 / 1.3), 90  # shrink the font: overlapping names are worse than small ones


# --- MPRT ---------------------------------------------------------------------------------------------------


def _mprt(
    frame: pd.DataFrame, similarity: str, by: str | None, figures: FiguresConfig | None
) -> tuple[Figure, pd.DataFrame]:
    """The MPRT figure and its summary rows (panel columns, layer, step, n, mean, ci_low, ci_high)."""
    figures = figures or FiguresConfig()
    plt = style.pyplot()
    if "similarity" in frame.columns:
        frame = frame[frame["similarity"] == similarity]
    frame, unit = _with_unit(frame)
    panel_cols = [c for c in (by, "order") if c and c in frame.columns and frame[c].nunique(dropna=False) > 1]
    if by and by in frame.columns and by not in panel_cols:
        panel_cols.insert(0, by)  # a swept column is named in the title even with one value
    layers = layers_in_model_order(frame) if "layer" in frame.columns else []
    summary = _summary(frame, "value", [*panel_cols, "layer", "step"], unit)
    panels = _line_keys(summary, panel_cols) or [()]
    rows, cols = style.grid_shape(len(panels), max(1, min(figures.columns // 2, 3)))
    width = min(figures.columns * style.PANEL_INCHES, max(2 * style.PANEL_INCHES, cols * 2 * style.PANEL_INCHES))
    fig, axes = plt.subplots(rows, cols, figsize=(width, PLOT_HEIGHT * rows), squeeze=False, sharey=True)
    cmap = plt.get_cmap(style.FEATURE_CMAP)
    colours = [cmap(v) for v in np.linspace(0.0, 0.85, max(len(layers), 1))]  # early dark, late light: model order
    for ax, key in zip(axes.flat, panels, strict=False):
        part = _select(summary, panel_cols, key) if panel_cols else summary
        raw = _select(frame, panel_cols, key) if panel_cols else frame
        for layer, colour in zip(layers, colours, strict=False):
            rows_l = part[part["layer"] == layer].sort_values("step")
            if rows_l.empty:
                continue
            x = rows_l["step"].to_numpy(float)  # (S,)
            ax.plot(x, rows_l["mean"].to_numpy(float), marker="o", markersize=3, color=colour, label=layer)
            low, high = rows_l["ci_low"].to_numpy(float), rows_l["ci_high"].to_numpy(float)
            if np.isfinite(low).any():
                ax.fill_between(x, low, high, color=colour, alpha=BAND_ALPHA, linewidth=0)
        _step_ticks(ax, fig, raw, cols)
        ax.axhline(0.0, color="grey", linewidth=0.6, gid=REFERENCE)  # no similarity: not a legend entry
        ax.set_xlabel("randomised up to (step)", fontsize=style.PANEL_TITLE_SIZE)
        ax.set_ylabel(f"mean {similarity}", fontsize=style.PANEL_TITLE_SIZE)
        ax.tick_params(axis="y", labelsize=TICK_SIZE)
        ax.grid(True, alpha=0.3)
        if panel_cols:
            ax.set_title(_label(panel_cols, key), fontsize=style.PANEL_TITLE_SIZE)
        if len(ax.get_lines()) > 1:  # a layer's line besides the y = 0 reference
            _legend(ax, fontsize=TICK_SIZE - 1, title="layer", title_fontsize=TICK_SIZE, loc="best")
        else:
            ax.text(0.5, 0.5, f"no {similarity} values", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"MPRT: {similarity} to the trained model's map as weights are re-initialised", fontsize=style.TITLE_SIZE
    )
    fig.tight_layout()
    return fig, summary


def _step_ticks(ax: Any, fig: Any, raw: pd.DataFrame, cols: int) -> None:
    """Ticks at (at most MAX_STEP_TICKS) steps, labelled with the module re-initialised up to that step."""
    if "step" not in raw.columns or raw.empty:
        return
    named = raw.drop_duplicates("step").sort_values("step")
    steps = named["step"].to_numpy()
    names = (
        named["randomised_up_to"].astype(str).tolist() if "randomised_up_to" in named.columns else list(map(str, steps))
    )
    keep = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), MAX_STEP_TICKS)).round().astype(int))
    ax.set_xlim(steps.min() - 0.5, steps.max() + 0.5)
    labels = [f"{names[i]} ({steps[i]})" for i in keep]
    width = fig.get_figwidth()
    fig.set_figwidth(width / cols)  # `_layer_ticks` measures spacing on one panel's width
    _layer_ticks(ax, fig, labels, steps[keep].tolist())
    fig.set_figwidth(width)


# --- the standard figures of each table ---------------------------------------------------------------------


def _cam(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """deletion/insertion AUC per layer (those present with values), else the map's maximum."""
    values = [v for v in ("deletion_auc", "insertion_auc") if v in frame.columns and frame[v].notna().any()]
    values = values or (["cam_max"] if "cam_max" in frame.columns else [])
    out = []
    for value in values:
        baseline = f"random_{value}" if f"random_{value}" in frame.columns else None
        fig, summary = _per_layer(frame, value, _lines(by), None, figures, baseline)
        what = CAPTION_WORDS.get(value, value)
        extra = f"; dashed: the same for a random map ({baseline})" if baseline else ""
        out.append((f"Mean {what} per layer in model order, 95% bootstrap band over samples{extra}"
                    f"{_n_note(summary, frame, value)}.", fig))  # fmt: skip
    return out


def _evaluation(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """One figure per (metric, variant): the metric's value per layer beside its random-map value."""
    if "value" not in frame.columns:
        return []
    out = []
    for key, part in _split(frame, ["metric", "variant"]):
        name = _name(key) or "value"
        baseline = "random_value" if "random_value" in part.columns else None
        fig, summary = _per_layer(part, "value", _lines(by), f"{name} per layer", figures, baseline, f"mean {name}")
        extra = "; dashed: the same metric of a random map" if baseline else ""
        out.append((f"{name}: mean per layer in model order, 95% bootstrap band over samples{extra}"
                    f"{_n_note(summary, part, 'value')}.", fig))  # fmt: skip
    return out


def _mprt_table(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """One MPRT figure per similarity present."""
    if not {"step", "value"} <= set(frame.columns):
        return []
    names = frame["similarity"].dropna().unique().tolist() if "similarity" in frame.columns else ["value"]
    out = []
    for name in names:
        fig, summary = _mprt(frame, name, by, figures)
        part = frame[frame["similarity"] == name] if "similarity" in frame.columns else frame
        out.append((f"MPRT: mean {name} between the trained and the re-initialised model's maps per step (cascading"
                    f" steps re-initialise more modules), one line per layer in model order, 95% bootstrap band"
                    f" over samples; near 0: the map depends on the weights{_n_note(summary, part, 'value')}.", fig))  # fmt: skip
    return out


def _patching(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Restoration per layer, one figure per (direction, unit): a whole-layer patch's, else the best unit's."""
    if "restoration" not in frame.columns:
        return []
    out = []
    for key, part in _split(frame, ["direction", "unit"]):
        unit = key[1] if len(key) > 1 else None
        lines = _lines(by, "patch_method", part)
        keys = [c for c in ("layer", "layer_index", *lines, *_unit_cols(part)) if c in part.columns]
        if unit not in (None, "layer"):  # many units per layer: the strongest single unit's restoration per sample
            part = part.groupby(keys, sort=False, dropna=False)["restoration"].max().reset_index()
        name = _name(key)
        how = "mean restoration" if unit in (None, "layer") else f"mean over samples of the best {unit}'s restoration"
        fig, summary = _per_layer(part, "restoration", lines, f"restoration per layer ({name})", figures, None, how)
        out.append((f"Patching ({name}): {how} per layer in model order (1: the patch restores the clean output),"
                    f" 95% bootstrap band over samples{_n_note(summary, part, 'restoration')}.", fig))  # fmt: skip
    return out


def _cam_vs_patching(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Spearman's rho between each CAM method's map and the patching effects, per layer, by cam_method."""
    if "spearman" not in frame.columns:
        return []
    out = []
    for key, part in _split(frame, ["direction"]):
        lines = _lines(by, "cam_method", part)
        name = _name(key)
        title = "CAM vs patching: Spearman's rho per layer" + (f" ({name})" if name else "")
        fig, summary = _per_layer(part, "spearman", lines, title, figures, None, "mean Spearman's rho")
        out.append((f"Mean {CAPTION_WORDS['spearman']} per layer in model order{f' ({name})' if name else ''},"
                    f" 95% bootstrap band over samples{_n_note(summary, part, 'spearman')}.", fig))  # fmt: skip
    return out


_BUILDERS = {
    "cam": _cam,
    "evaluation": _evaluation,
    "mprt": _mprt_table,
    "patching": _patching,
    "cam_vs_patching": _cam_vs_patching,
}


# --- helpers ------------------------------------------------------------------------------------------------


def _with_unit(frame: pd.DataFrame) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """`frame` and the column that names a sample (the bootstrap's unit); each row its own sample without one."""
    if "sample" in frame.columns:
        return frame, ("sample",)
    return frame.assign(_row=np.arange(len(frame))), ("_row",)


def _unit_cols(frame: pd.DataFrame) -> list[str]:
    """The columns that name a sample, present in `frame`."""
    return [c for c in ("sample",) if c in frame.columns]


def _summary(frame: pd.DataFrame, value: str, by: list[str], unit: tuple[str, ...]) -> pd.DataFrame:
    """runner.analysis.summarise of `value` by `by`; empty (with its columns) when nothing can be summarised."""
    columns = [*by, "n", "mean", "ci_low", "ci_high"]
    if frame.empty or value not in frame.columns or not pd.api.types.is_numeric_dtype(frame[value]):
        return pd.DataFrame(columns=columns)
    if frame[value].dtype == bool:
        frame = frame.assign(**{value: frame[value].astype(float)})
    return summarise(frame, value, by=by, unit=unit)


def _line_keys(summary: pd.DataFrame, lines: Sequence[str]) -> list[tuple]:
    """The distinct values of the `lines` columns in `summary`, sorted (a stable legend across figures)."""
    if summary.empty:
        return []
    if not lines:
        return [()]
    keys = summary[list(lines)].drop_duplicates().itertuples(index=False, name=None)
    return sorted(keys, key=lambda k: tuple(str(v) for v in k))


def _select(summary: pd.DataFrame, lines: Sequence[str], key: tuple) -> pd.DataFrame:
    """The rows of `summary` whose `lines` columns equal `key` (NaN equal to NaN)."""
    mask = np.ones(len(summary), dtype=bool)
    for column, value in zip(lines, key, strict=True):
        col = summary[column]
        mask &= (
            col.isna() if value is None or (isinstance(value, float) and math.isnan(value)) else col == value
        ).to_numpy()
    return summary[mask]


def _name(key: tuple) -> str:
    """A part's name from its key values, empty and missing ones left out: ("road", "morf") -> "road morf"."""
    return " ".join(str(k) for k in key if k is not None and k == k and str(k) != "")


def _label(lines: Sequence[str], key: tuple) -> str:
    """A legend label: the value alone for one column, `column=value` pairs for several."""
    if len(lines) == 1:
        return str(key[0])
    return ", ".join(f"{c.removeprefix('sweep.')}={v}" for c, v in zip(lines, key, strict=True))


def _lines(by: str | None, extra: str | None = None, frame: pd.DataFrame | None = None) -> list[str]:
    """The columns whose values make separate lines: `by`, and `extra` where the frame has several of its values."""
    lines = [by] if by else []
    if extra and frame is not None and extra in frame.columns and frame[extra].nunique() > 1 and extra != by:
        lines.append(extra)
    return lines


def _split(frame: pd.DataFrame, columns: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """(key, rows) per combination of the `columns` present, in order of first appearance; one part without any."""
    present = [c for c in columns if c in frame.columns]
    if not present:
        return [((), frame)]
    return [(k if isinstance(k, tuple) else (k,), g) for k, g in frame.groupby(present, sort=False, dropna=False)]


def _n_note(summary: pd.DataFrame, frame: pd.DataFrame, value: str) -> str:
    """How many samples entered each point, and how many values were NaN (left out), for a caption."""
    if summary.empty:
        return "; no values to draw"
    n = summary["n"].astype(int)
    note = f"; n = {n.min()} sample{'s' if n.max() != 1 else ''} per point" if n.min() == n.max() else \
        f"; n = {n.min()} to {n.max()} samples per point"  # fmt: skip
    if (n < 2).any():
        note += " (no band where n = 1)"
    missing = int(frame[value].isna().sum()) if value in frame.columns else 0
    if missing:
        note += f"; {missing} NaN value{'s' if missing != 1 else ''} (undefined) left out"
    return note
