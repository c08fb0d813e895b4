"""Plots of result tables: per-layer curves in model order with 95% bootstrap intervals across samples.

- `per_layer_figure(frame, value, by)`: x the layers in model order (`layer_index`), y the mean of `value` over
  samples with its 95% percentile bootstrap interval (runner/analysis.py `summarise`) as a shaded band, one panel
  per value of `by` (a swept column such as `sweep.method`) on one y scale; a random-map baseline dashed orange
  beside the explanation's dark blue line.
- `mprt_figure(frame, similarity, by)`: x the randomisation step (ticks: the module re-initialised up to there),
  y the mean similarity to the trained model's map with its interval, one line per layer in model order.
- `table_figures(table, frame, by)`: the standard figures of one results table, each with a one-sentence caption
  (what `runner report` shows); [] for a table without a standard figure or a frame with nothing to draw.

Every figure is as wide as the page (`figures.columns` panels), its legend outside the panels. A point with one
sample has no interval (NaN): it is drawn without a band; bands made of fewer than five samples are grey and the
caption says so. Patching figures draw `patching_effects`, one statistic per pair that the report's table
summarises too: restoration where denoising, the drop (1 - restoration) where noising. NaN values (undefined statistics,
e.g. a degenerate map's faithfulness) are left out before averaging; captions say how many samples entered.
Style (sizes, fonts, colour maps, saving) comes from runner/viz/figure_style.py; the caller saves each Figure with
`figure_style.save`, which closes it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from runner.analysis import summarise
from runner.frames import layers_in_model_order
from runner.schema import FiguresConfig
from runner.viz import figure_style as style

Figure = Any  # matplotlib.figure.Figure; matplotlib is imported on first use (it is slow)
FigureBuilder = Callable[[pd.DataFrame, "str | None", FiguresConfig], "list[tuple[str, Figure]]"]

BAND_ALPHA = 0.2  # the interval band's opacity: the line stays readable through overlapping bands
LINE_COLOUR_CMAP = "tab10"  # categorical lines (swept values, methods): distinct hues
AXES_SHARE = 0.78  # the part of a figure's width the axes take (the rest: y label, ticks, margins)
PLOT_HEIGHT = 4.0  # inches of one row of panels of curves
REFERENCE = "reference"  # gid of a drawn reference line (y = 0), left out of legends
MAX_STEP_TICKS = 12  # an MPRT run may re-initialise dozens of modules: label at most this many steps
CAM_HEADLINE = "cam_frac_zero"  # the cam table's figure without AUCs: a raw map's maximum compares no layers
PAIR_KEYS = (
    "sample",
    "sample_id",
    "corrupted_id",
    "direction",
    "layer",
    "layer_index",
    "unit",
    "patch_method",
    "metric",
)
CAPTION_WORDS = {
    "deletion_auc": "deletion AUC (lower: the map's top pixels matter more)",
    "insertion_auc": "insertion AUC (higher: the map's top pixels suffice)",
    "cam_frac_zero": "the share of the map at zero (no positive evidence; scale-free, unlike the raw map's values)",
    "restoration": "restoration (1: the patch restores the clean output)",
    "spearman": "Spearman's rho between the CAM and the patching effects",
}


def per_layer_figure(
    frame: pd.DataFrame, value: str, by: str | None = None, title: str | None = None,
    figures: FiguresConfig | None = None, *, baseline: str | None = None,
) -> Figure:  # fmt: skip
    """`value`'s mean over samples per layer (model order) with its 95% bootstrap band: one panel per value of `by`
    (small multiples on one y scale, not one tangle of lines and bands).

    `baseline`: a second column (e.g. `random_value`) drawn dashed in a contrasting colour in each panel.
    """
    return _per_layer(frame, value, [by] if by else [], [], title, figures, baseline)[0]


def mprt_figure(
    frame: pd.DataFrame, similarity: str = "spearman", by: str | None = None, figures: FiguresConfig | None = None
) -> Figure:
    """MPRT similarity to the trained model's map per randomisation step, one line per layer in model order.

    One panel per value of `by` (and per `order` where the table has several).
    """
    return _mprt(frame, similarity, by, figures)[0]


def table_figures(
    table: str,
    frame: pd.DataFrame,
    by: str | None = None,
    figures: FiguresConfig | None = None,
    builder: str | None = None,
) -> list[tuple[str, Figure]]:
    """The standard figures of one results table as (caption, Figure); [] for what cannot be drawn. `builder`: the
    table's figures as its declaration names them ("module:function", runner.tables.Presentation.figures), else
    those of the declared table `table` in this process."""
    from runner.options.registry import resolve
    from runner.tables import presentation

    reference = builder or presentation(table).figures
    builder = resolve(reference) if reference else None
    if builder is None or frame is None or frame.empty:
        return []
    if by is not None and by not in frame.columns:
        by = None  # a column the table lacks compares nothing; draw the pooled figure
    return builder(frame, by, figures or FiguresConfig())  # type: ignore[operator]


# --- per-layer curves ---------------------------------------------------------------------------------------


def _per_layer(
    frame: pd.DataFrame, value: str, panels: Sequence[str], lines: Sequence[str], title: str | None,
    figures: FiguresConfig | None, baseline: str | None = None, ylabel: str | None = None,
) -> tuple[Figure, pd.DataFrame]:  # fmt: skip
    """The per-layer figure, one panel per value of the `panels` columns and one line per value of `lines` in each,
    and its summary rows (*panels, *lines, layer, n, mean, ci_low, ci_high)."""
    figures = figures or FiguresConfig()
    plt = style.pyplot()
    frame, unit = _with_unit(frame)
    layers = layers_in_model_order(frame)
    panels = [c for c in panels if c in frame.columns]
    lines = [c for c in lines if c in frame.columns and c not in panels]
    summary = _summary(frame, value, [*panels, *lines, "layer"], unit)
    base = _summary(frame, baseline, [*panels, *lines, "layer"], unit) if baseline and baseline in frame else None
    panel_keys = _line_keys(summary, panels) or [()]
    width = style.full_width(figures)
    most = max(1, int(width // max(4.0, 0.45 * len(layers) + 1.5)))  # panels a row: room for the layer names
    rows, cols = style.grid_shape(len(panel_keys), most)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width, PLOT_HEIGHT * rows + 0.6), squeeze=False, sharey=True, layout="constrained"
    )
    few = bool(len(summary)) and int(summary["n"].min()) < style.FEW_SAMPLES
    x = np.arange(len(layers))  # (L,) positions of the layers in model order
    colours = _line_colours(len(_line_keys(summary, lines)) if lines else 1)
    legend: dict[str, Any] = {}
    for ax, pkey in zip(axes.flat, panel_keys, strict=False):
        part = _select(summary, panels, pkey) if panels else summary
        base_part = None if base is None else (_select(base, panels, pkey) if panels else base)
        keys = _line_keys(part, lines)
        for k, key in enumerate(keys):
            colour = colours[k % len(colours)] if lines else style.EXPLANATION_COLOUR
            label = _label(lines, key) if lines else ("explanation" if base is not None else value)
            legend[label] = _draw_line(ax, x, _select(part, lines, key), layers, colour, label, "-", few)
            if base_part is not None:
                rows_b = _select(base_part, lines, key)
                legend[f"{label} (random map)" if lines else "random map"] = _draw_line(
                    ax, x, rows_b, layers, style.BASELINE_COLOUR, "random map", "--", few
                )
        if not keys:
            ax.text(0.5, 0.5, f"no {value} values", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlim(-0.5, max(len(layers) - 0.5, 0.5))
        _layer_ticks(ax, fig, layers, panel_width=width / cols)
        ax.set_xlabel("layer (model order)", fontsize=style.PANEL_TITLE_SIZE)
        ax.tick_params(axis="y", labelsize=style.TICK_SIZE)
        ax.grid(True, alpha=0.3)
        if panels:
            ax.set_title(_label(panels, pkey, named=True), fontsize=style.PANEL_TITLE_SIZE)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel or f"mean {value}", fontsize=style.PANEL_TITLE_SIZE)
    for ax in list(axes.flat)[len(panel_keys) :]:
        ax.set_visible(False)
    fig.suptitle(title or f"{value} per layer", fontsize=style.TITLE_SIZE)
    if len(legend) > 1 or lines:  # outside the panels, below them: never over the data nor the title
        fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncol=min(len(legend), 6),
                   fontsize=style.TICK_SIZE, frameon=False)  # fmt: skip
    return fig, summary


def _line_colours(n: int) -> list[Any]:
    """`n` distinct hues for categorical lines, the baseline's orange left out (it marks random maps)."""
    plt = style.pyplot()
    palette = [c for i, c in enumerate(plt.get_cmap(LINE_COLOUR_CMAP).colors) if i not in (1, 7)]  # no orange, grey
    return palette[: max(n, 1)] if n <= len(palette) else list(plt.get_cmap(LINE_COLOUR_CMAP).colors)


def _draw_line(
    ax: Any, x: np.ndarray, rows: pd.DataFrame, layers: list[str], colour: Any, label: str, ls: str, few: bool
) -> Any:
    """One line (a marker per point: a lone point stays visible) and its band where an interval exists; the band
    grey where fewer than FEW_SAMPLES samples made it. Returns the line (a legend handle)."""
    rows = rows.set_index("layer").reindex(layers)
    (line,) = ax.plot(x, rows["mean"].to_numpy(float), marker="o", markersize=5, color=colour, linestyle=ls,
                      linewidth=2, label=label)  # fmt: skip
    low, high = rows["ci_low"].to_numpy(float), rows["ci_high"].to_numpy(float)  # (L,), NaN: < 2 samples
    if np.isfinite(low).any():
        band = style.FEW_COLOUR if few else colour
        ax.fill_between(x, low, high, color=band, alpha=BAND_ALPHA if ls == "-" else BAND_ALPHA / 2, linewidth=0)
    return line


def _layer_ticks(
    ax: Any, fig: Any, names: list[str], positions: Sequence[float] | None = None, panel_width: float | None = None
) -> None:
    """Tick labels `names` rotated (45 degrees, or 90 and smaller where dense) so that neighbours do not overlap
    (`panel_width`: the inches of one panel, default the figure's width)."""
    positions = list(range(len(names))) if positions is None else list(positions)
    if not names:
        ax.set_xticks([])
        return
    low, high = ax.get_xlim()
    axes_inches = (panel_width or fig.get_figwidth()) * AXES_SHARE
    spacing = axes_inches / max((high - low), 1e-9)  # inches between neighbouring positions one unit apart
    gaps = np.diff(sorted(positions)) if len(positions) > 1 else np.array([high - low])
    dx = spacing * float(np.min(gaps))  # inches between the closest two ticks
    size, rotation = rotation_for(dx, style.TICK_SIZE)
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
    width = style.full_width(figures)
    rows, cols = style.grid_shape(len(panels), max(1, int(width // 5.5)))  # 5.5 in: room for a dozen step names
    fig, axes = plt.subplots(
        rows, cols, figsize=(width, PLOT_HEIGHT * rows + 0.8), squeeze=False, sharey=True, layout="constrained"
    )
    cmap = plt.get_cmap(style.FEATURE_CMAP)
    colours = [cmap(v) for v in np.linspace(0.0, 0.85, max(len(layers), 1))]  # early dark, late light: model order
    few = bool(len(summary)) and int(summary["n"].min()) < style.FEW_SAMPLES
    legend: dict[str, Any] = {}
    for ax, key in zip(axes.flat, panels, strict=False):
        part = _select(summary, panel_cols, key) if panel_cols else summary
        raw = _select(frame, panel_cols, key) if panel_cols else frame
        for layer, colour in zip(layers, colours, strict=False):
            rows_l = part[part["layer"] == layer].sort_values("step")
            if rows_l.empty:
                continue
            x = rows_l["step"].to_numpy(float)  # (S,)
            (line,) = ax.plot(x, rows_l["mean"].to_numpy(float), marker="o", markersize=4, linewidth=2,
                              color=colour, label=layer)  # fmt: skip
            legend[layer] = line
            low, high = rows_l["ci_low"].to_numpy(float), rows_l["ci_high"].to_numpy(float)
            if np.isfinite(low).any():
                band = style.FEW_COLOUR if few else colour
                ax.fill_between(x, low, high, color=band, alpha=BAND_ALPHA / 2 if few else BAND_ALPHA, linewidth=0)
        _step_ticks(ax, fig, raw, cols)
        ax.axhline(0.0, color="grey", linewidth=0.8, gid=REFERENCE)  # no similarity: not a legend entry
        ax.set_xlabel("randomised up to (step)", fontsize=style.PANEL_TITLE_SIZE)
        ax.tick_params(axis="y", labelsize=style.TICK_SIZE)
        ax.grid(True, alpha=0.3)
        if panel_cols:
            ax.set_title(_label(panel_cols, key, named=True), fontsize=style.PANEL_TITLE_SIZE)
        if len(ax.get_lines()) <= 1:  # the y = 0 reference alone
            ax.text(0.5, 0.5, f"no {similarity} values", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"mean {similarity}", fontsize=style.PANEL_TITLE_SIZE)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"MPRT: {similarity} to the trained model's map as weights are re-initialised", fontsize=style.TITLE_SIZE
    )
    if legend:  # one legend for every panel, below them: never over the data nor the title
        fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncol=min(len(legend), 7),
                   fontsize=style.TICK_SIZE, title="layer (model order)", title_fontsize=style.TICK_SIZE,
                   frameon=False)  # fmt: skip
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
    _layer_ticks(ax, fig, labels, steps[keep].tolist(), panel_width=fig.get_figwidth() / cols)


# --- the standard figures of each table ---------------------------------------------------------------------


def _needs_layers(builder: FigureBuilder) -> FigureBuilder:
    """A table's figures drawn per layer: none for a frame without a `layer` column."""

    @functools.wraps(builder)
    def drawn(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
        return builder(frame, by, figures) if "layer" in frame.columns else []

    return drawn


@_needs_layers
def cam_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """deletion/insertion AUC per layer (those present with values), else the share of the map at zero."""
    values = [v for v in ("deletion_auc", "insertion_auc") if v in frame.columns and frame[v].notna().any()]
    values = values or ([CAM_HEADLINE] if CAM_HEADLINE in frame.columns else [])
    out = []
    for value in values:
        baseline = f"random_{value}" if f"random_{value}" in frame.columns else None
        fig, summary = _per_layer(frame, value, _lines(by), [], None, figures, baseline)
        what = CAPTION_WORDS.get(value, value)
        extra = f"; orange dashed: the same for a random map ({baseline})" if baseline else ""
        out.append((f"Mean over samples of {what} per layer in model order, 95% bootstrap band{_panels_note(by)}"
                    f"{extra}{_n_note(summary, frame, value)}.", fig))  # fmt: skip
    return out


@_needs_layers
def evaluation_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """One figure per (metric, variant): the metric's value per layer beside its random-map value."""
    if "value" not in frame.columns:
        return []
    out = []
    for key, part in _split(frame, ["metric", "variant"]):
        name = _name(key) or "value"
        baseline = "random_value" if "random_value" in part.columns else None
        fig, summary = _per_layer(part, "value", _lines(by), [], f"{name} per layer", figures, baseline, f"mean {name}")
        extra = "; orange dashed: the same metric of a random map" if baseline else ""
        out.append((f"{name}: mean over samples per layer in model order, 95% bootstrap band{_panels_note(by)}"
                    f"{extra}{_n_note(summary, part, 'value')}.", fig))  # fmt: skip
    return out


@_needs_layers
def mprt_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
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


def patching_effects(frame: pd.DataFrame, keep: Sequence[str] = ()) -> pd.DataFrame:
    """The patching table's one statistic per (pair, direction, layer, patch method, swept values): `effect`, the
    restoration where denoising and the drop it causes, 1 - restoration, where noising, of the whole layer or, for
    finer units, of the strongest unit. NaN restorations (small_span or degenerate pairs) are left out, so a pair
    with none left has NaN; `unit` and `direction` say which statistic a row holds. `keep`: more columns to keep
    (a compared column)."""
    if "restoration" not in frame.columns:
        return frame.iloc[:0]
    noising = (frame["direction"] == "noising") if "direction" in frame.columns else False
    effect = frame["restoration"].where(~noising, 1 - frame["restoration"])  # noising: the drop, 1 = fully broken
    swept = [c for c in frame.columns if c.startswith("sweep.")]
    keys = list(dict.fromkeys(c for c in (*PAIR_KEYS, *swept, *keep) if c in frame.columns))
    per_pair = frame.assign(effect=effect).groupby(keys, sort=False, dropna=False, observed=True)["effect"]
    return per_pair.max().reset_index()  # max skips NaN; all NaN: NaN


def effect_words(direction: str | None, unit: str | None) -> str:
    """What `patching_effects` holds for one direction and unit, for captions of its table and figure."""
    whole = unit in (None, "layer")
    if direction == "noising":
        what = "the whole layer's" if whole else f"the most damaging {unit}'s"
        return f"{what} drop, 1 - restoration (1: the corrupted activation breaks the clean output entirely)"
    what = "the whole layer's" if whole else f"the best {unit}'s"
    return f"{what} restoration (1: the clean activation restores the clean output)"


@_needs_layers
def patching_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per (direction, unit): `patching_effects` per layer, restoration where denoising, the drop where noising."""
    if "restoration" not in frame.columns:
        return []
    effects = patching_effects(frame, [by] if by else [])
    out = []
    for key, part in _split(effects, ["direction", "unit"]):
        direction, unit = (key + (None, None))[:2]
        words = effect_words(direction, unit)
        name = _name(key)
        label = "drop" if direction == "noising" else "restoration"
        fig, summary = _per_layer(part, "effect", _lines(by), _lines(None, "patch_method", part),
                                  f"{label} per layer ({name})", figures, None, f"mean {label}")  # fmt: skip
        out.append((f"Patching ({name}): mean over pairs of {words}, per layer in model order, 95% bootstrap band"
                    f"{_panels_note(by)}{_n_note(summary, part, 'effect')}{_left_out_note(frame, key)}.", fig))  # fmt: skip
    return out


@_needs_layers
def cam_vs_patching_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Spearman's rho between each CAM method's map and the patching effects, per layer, by cam_method."""
    if "spearman" not in frame.columns:
        return []
    out = []
    for key, part in _split(frame, ["direction"]):
        lines = _lines(None, "cam_method", part)
        name = _name(key)
        title = "CAM vs patching: Spearman's rho per layer" + (f" ({name})" if name else "")
        fig, summary = _per_layer(part, "spearman", _lines(by), lines, title, figures, None, "mean Spearman's rho")
        out.append((f"Mean over samples of {CAPTION_WORDS['spearman']} per layer in model order"
                    f"{f' ({name})' if name else ''}, 95% bootstrap band{_panels_note(by)}"
                    f"{_n_note(summary, part, 'spearman')}.", fig))  # fmt: skip
    return out


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


def _label(lines: Sequence[str], key: tuple, named: bool = False) -> str:
    """A legend label: the value alone for one column, `column=value` pairs for several (or `named`: a panel's
    title, which says what the value is)."""
    if len(lines) == 1 and not named:
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
    return [
        (k if isinstance(k, tuple) else (k,), g)
        for k, g in frame.groupby(present, sort=False, dropna=False, observed=True)
    ]


def _panels_note(by: str | None) -> str:
    return f"; one panel per {by.removeprefix('sweep.')}" if by else ""


def _left_out_note(frame: pd.DataFrame, key: tuple) -> str:
    """How many pairs `patching_effects` left out (NaN restoration), and why, for a caption."""
    counts = left_out_pairs(frame[frame["direction"] == key[0]] if key and "direction" in frame.columns else frame)
    parts = [f"{n} {why}" for why, n in counts.items() if n]
    return f"; left out: {', '.join(parts)}" if parts else ""


def left_out_pairs(frame: pd.DataFrame) -> dict[str, int]:
    """Pairs (sample, direction, swept values) of a patching frame whose restoration is NaN, by why: small_span
    (|clean - corrupted| below method.patching.min_span) or degenerate (restoration undefined)."""
    keys = [c for c in ("sample", "direction", *(c for c in frame.columns if c.startswith("sweep."))) if c in frame]
    nan = frame["restoration"].isna() if "restoration" in frame.columns else pd.Series(False, index=frame.index)
    small = frame["small_span"].fillna(False).astype(bool) if "small_span" in frame.columns else nan & False
    pairs = {
        "pairs with small_span (|clean - corrupted| below method.patching.min_span)": frame[nan & small],
        "degenerate pairs (restoration undefined)": frame[nan & ~small],
    }
    return {why: len(rows.drop_duplicates(keys)) if keys else int(len(rows) > 0) for why, rows in pairs.items()}


def _n_note(summary: pd.DataFrame, frame: pd.DataFrame, value: str) -> str:
    """How many samples entered each point, and how many values were NaN (left out), for a caption."""
    if summary.empty:
        return "; no values to draw"
    n = summary["n"].astype(int)
    note = f"; n = {n.min()} sample{'s' if n.max() != 1 else ''} per point" if n.min() == n.max() else \
        f"; n = {n.min()} to {n.max()} samples per point"  # fmt: skip
    if (n < 2).any():
        note += " (no band where n = 1)"
    if (n < style.FEW_SAMPLES).any():
        note += f"; grey bands: fewer than {style.FEW_SAMPLES} samples, an interval over so few is rough"
    missing = int(frame[value].isna().sum()) if value in frame.columns else 0
    if missing:
        note += f"; {missing} NaN value{'s' if missing != 1 else ''} (undefined) left out"
    return note
