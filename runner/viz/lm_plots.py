"""Heatmaps of the language-model tables: layer x position (the prompt's tokens on the x axis) and layer x head.

- `lm_patching_figures`: per (direction, patch_method, metric) and site, the mean over pairs of each cell's effect:
  restoration where denoising, the drop 1 - restoration where noising (as the vision figures: 0 is "no effect" in
  both directions, so one diverging colour map centred at 0 reads both). Whole-site cells (resid_pre, attn_out,
  mlp_out, resid_mid, resid_post): layer x position. Per-head cells at every position (`head_positions: all`):
  layer x head. Per-head cells at each position: head x position for the one layer with the largest |mean effect|
  (a layer x position map per head would be dozens of figures); the caption names the layer.
- `lm_grad_x_act_figures`: per (metric, site), layer x position of the mean gradient x activation; per-head sites
  summed over heads first (the sum is the site's whole gradient x activation), and a layer x head map summed over
  positions beside it.
- `lm_logit_lens_figures`: per metric, layer x position of the mean lens value (layer -1: the embeddings).

The position axis: positions count from each pair's first token (left padding removed). Pairs of one length share
every position. Pairs of different lengths are aligned at their LAST token (the prediction, which the metric reads):
x then counts back from it (0 = last), so a position holds the same role in every pair; the caption says so. A tick
shows the token where every pair has the same one there, else the first pair's token followed by `*` (e.g. names in
IOI prompts). At most MAX_POSITIONS positions are drawn, the last ones (nearest the prediction), said in the caption.
NaN cells (every pair's value undefined: small_span or degenerate) are grey; captions give the number of pairs.
Every value is averaged over pairs with `nanmean`: a pair without a value at a cell is left out of that cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from runner.schema import FiguresConfig
from runner.viz import figure_style as style
from runner.viz.plots import _layer_ticks, _name, _split, left_out_pairs

Figure = Any  # matplotlib.figure.Figure

MAX_POSITIONS = 64  # positions drawn at most (the last ones): a long prompt's map stays readable
NAN_COLOUR = "#d9d9d9"  # cells without a value: light grey, apart from the colour map's white 0
PAIR_COLUMNS = ("run_id", "sample")  # a pair is a sample of one run (a sweep's jobs reuse sample numbers)
ROW_INCHES = 0.32  # height of one heatmap row (a layer or a head)
EMBEDDINGS = -1  # the logit lens' layer of the embeddings


# --- the figures of each table ---------------------------------------------------------------------------------


def lm_patching_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per (direction, patch_method, metric) and site: layer x position, layer x head or head x position heatmaps
    of the mean over pairs of restoration (denoising) or the drop, 1 - restoration (noising)."""
    if not {"restoration", "site", "layer"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    noising = frame["direction"] == "noising" if "direction" in frame.columns else False
    frame = frame.assign(effect=frame["restoration"].where(~noising, 1 - frame["restoration"]))
    out = []
    for key, part in _split(frame, ["direction", "patch_method", "metric"]):
        direction = key[0] if key and "direction" in frame.columns else None
        label = "drop (1 - restoration)" if direction == "noising" else "restoration"
        meaning = ("1: patching the corrupted activation breaks the clean output entirely" if direction == "noising"
                   else "1: patching the clean activation restores the clean output")  # fmt: skip
        for (site,), cells in _split(part, ["site"]):
            name = f"{site}, {_name(key)}"
            words = f"mean over pairs of the {label} ({meaning}; 0: no effect)"
            left = _left_out(cells)
            whole, heads = cells[cells["head"].isna()], cells[cells["head"].notna()]
            if whole["position"].notna().any():
                fig, caption = _layer_position(whole, "effect", by, figures, f"{label}: {name}", label)
                out.append((f"Patching ({name}): {words} per layer and position{caption}{left}.", fig))
            every = heads[heads["position"].isna()]
            if not every.empty:
                fig, caption = _layer_head(every, "effect", by, figures, f"{label}: {name}", label)
                out.append((f"Patching ({name}, each head at every position at once): {words} per layer and head"
                            f"{caption}{left}.", fig))  # fmt: skip
            each = heads[heads["position"].notna()]
            if not each.empty:
                fig, caption = _head_position(each, "effect", by, figures, f"{label}: {name}", label)
                out.append((f"Patching ({name}, each head at each position): {words} per head and position{caption}"
                            f"{left}.", fig))  # fmt: skip
    return out


def lm_grad_x_act_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per (metric, site): layer x position of the mean gradient x activation (per-head sites summed over heads),
    and for per-head sites a layer x head map summed over positions."""
    if not {"value", "site", "layer", "position"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    out = []
    for key, part in _split(frame, ["metric", "site"]):
        name = _name(key)
        heads = "head" in part.columns and part["head"].notna().any()
        what = "gradient x activation"
        if heads:  # the heads' terms add up to the site's whole gradient x activation
            keys = [*_pair_columns(part), *([by] if by in part.columns else []), "layer", "position", "token"]
            summed = part.groupby(keys, dropna=False, observed=True, sort=False)["value"].sum(min_count=1)
            fig, caption = _layer_position(summed.reset_index(), "value", by, figures, f"{what}: {name}", what)
            out.append((f"Gradient x activation ({name}): mean over pairs of the sum over heads, per layer and"
                        f" position{caption}.", fig))  # fmt: skip
            keys = [*_pair_columns(part), *([by] if by in part.columns else []), "layer", "head"]
            summed = part.groupby(keys, dropna=False, observed=True, sort=False)["value"].sum(min_count=1)
            fig, caption = _layer_head(summed.reset_index(), "value", by, figures, f"{what}: {name}", what)
            out.append((f"Gradient x activation ({name}): mean over pairs of the sum over positions, per layer and"
                        f" head{caption}.", fig))  # fmt: skip
        else:
            fig, caption = _layer_position(part, "value", by, figures, f"{what}: {name}", what)
            out.append((f"Gradient x activation ({name}): mean over pairs per layer and position{caption}.", fig))
    return out


def lm_logit_lens_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per metric: layer x position of the mean lens value (the run's target read at each layer's residual)."""
    if not {"value", "layer", "position"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    out = []
    for key, part in _split(frame, ["metric"]):
        name = _name(key) or "value"
        values = part["value"].to_numpy(float)
        signed = bool(np.nanmin(values, initial=0.0) < 0 < np.nanmax(values, initial=0.0))
        fig, caption = _layer_position(part, "value", by, figures, f"logit lens: {name}", name, centred=signed)
        out.append((f"Logit lens: mean over pairs of {name} read from each layer's residual (the model's final norm"
                    f" and unembedding; layer emb: the embeddings) per layer and position{caption}.", fig))  # fmt: skip
    return out


# --- the three kinds of map --------------------------------------------------------------------------------------


def _layer_position(
    frame: pd.DataFrame, value: str, by: str | None, figures: FiguresConfig, title: str, label: str,
    *, centred: bool = True,
) -> tuple[Figure, str]:  # fmt: skip
    """Layer x position map of `value`'s mean over pairs, one panel per value of `by`; (figure, caption's end)."""
    frame, ticks, note = position_axis(frame)
    layers = sorted(frame["layer"].dropna().unique().tolist())
    panels = [(t, mean_grid(p, value, "layer", "_x", layers, ticks["_x"].tolist())) for t, p in _panels(frame, by)]
    fig = _heatmap(panels, title, figures, ticks["label"].tolist(), "token (position)",
                   [_layer_name(v) for v in layers], "layer", label, centred=centred)  # fmt: skip
    return fig, f"; tokens on the x axis{note}{_pairs_note(frame, value)}"


def _layer_head(
    frame: pd.DataFrame, value: str, by: str | None, figures: FiguresConfig, title: str, label: str
) -> tuple[Figure, str]:
    """Layer x head map of `value`'s mean over pairs, one panel per value of `by`; (figure, caption's end)."""
    layers = sorted(frame["layer"].dropna().unique().tolist())
    heads = sorted(frame["head"].dropna().unique().tolist())
    panels = [(t, mean_grid(p, value, "layer", "head", layers, heads)) for t, p in _panels(frame, by)]
    fig = _heatmap(panels, title, figures, [str(int(h)) for h in heads], "head",
                   [_layer_name(v) for v in layers], "layer", label)  # fmt: skip
    return fig, _pairs_note(frame, value)


def _head_position(
    frame: pd.DataFrame, value: str, by: str | None, figures: FiguresConfig, title: str, label: str
) -> tuple[Figure, str]:
    """Head x position map of the one layer with the largest |mean| (over pairs) cell; (figure, caption's end)."""
    means = frame.groupby(["layer", "head", "position"], observed=True)[value].mean().abs()
    layers = sorted(frame["layer"].dropna().unique().tolist())
    layer = means.idxmax()[0] if means.notna().any() else layers[0]
    part = frame[frame["layer"] == layer]
    part, ticks, note = position_axis(part)
    heads = sorted(part["head"].dropna().unique().tolist())
    panels = [(t, mean_grid(p, value, "head", "_x", heads, ticks["_x"].tolist())) for t, p in _panels(part, by)]
    fig = _heatmap(panels, f"{title}, layer {_layer_name(layer)}", figures, ticks["label"].tolist(),
                   "token (position)", [str(int(h)) for h in heads], f"head (layer {_layer_name(layer)})", label)  # fmt: skip
    chosen = (f"; layer {_layer_name(layer)}, the layer with the largest |mean| cell of the {len(layers)} patched"
              " (the others are in the table)" if len(layers) > 1 else f"; layer {_layer_name(layer)}")  # fmt: skip
    return fig, f"{chosen}; tokens on the x axis{note}{_pairs_note(part, value)}"


# --- the position axis and the grids ----------------------------------------------------------------------------


def position_axis(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(rows with a position, each with its x slot `_x`; the drawn slots in order with their tick `label`; the
    caption's note). Pairs of one length: `_x` is the position; else positions count back from each pair's last
    token (0 = last). Only the last MAX_POSITIONS slots are kept."""
    frame = frame[frame["position"].notna()]
    pairs = _pair_columns(frame)
    length = frame.groupby(pairs, observed=True)["position"].transform("max") if pairs else frame["position"].max()
    aligned = bool(pairs) and length.nunique() > 1
    frame = frame.assign(_x=(frame["position"] - length if aligned else frame["position"]).astype(int))
    slots = sorted(frame["_x"].unique().tolist())
    note = ""
    if aligned:
        note += ("; pairs of different lengths aligned at their last token (the prediction): x counts positions back"
                 " from it")  # fmt: skip
    if len(slots) > MAX_POSITIONS:
        note += f"; the last {MAX_POSITIONS} of {len(slots)} positions"
        slots = slots[-MAX_POSITIONS:]
        frame = frame[frame["_x"] >= slots[0]]
    labels = []
    order = frame.sort_values(pairs) if pairs else frame
    differ = False
    for slot in slots:
        tokens = order.loc[order["_x"] == slot, "token"] if "token" in order.columns else pd.Series(dtype=object)
        shown = _token(tokens.iloc[0] if len(tokens) else None)
        if tokens.nunique(dropna=False) > 1:
            shown, differ = f"{shown}*", True
        labels.append(shown)
    if differ:
        note += "; *: the pairs' tokens differ there, the label is the first pair's token"
    return frame, pd.DataFrame({"_x": slots, "label": labels}), note


def mean_grid(
    frame: pd.DataFrame, value: str, rows: str, columns: str, ys: Sequence[Any], xs: Sequence[Any]
) -> np.ndarray:
    """(len(ys), len(xs)) mean of `value` per (rows, columns) cell over the frame's rows (pairs), NaN left out; NaN
    where a cell has no value."""
    means = frame.groupby([rows, columns], observed=True)[value].mean()
    grid = means.reindex(pd.MultiIndex.from_product([list(ys), list(xs)], names=[rows, columns]))
    return grid.to_numpy(float).reshape(len(ys), len(xs))  # (Y, X)


def _heatmap(
    panels: list[tuple[str, np.ndarray]], title: str, figures: FiguresConfig, xlabels: list[str], xname: str,
    ylabels: list[str], yname: str, label: str, *, centred: bool = True,
) -> Figure:  # fmt: skip
    """One heatmap per panel (title, (Y, X) grid) on one colour scale with one colour bar: diverging and centred at
    0 (`centred`, signed effects), else sequential; NaN cells grey."""
    plt = style.pyplot()
    grids = [g for _, g in panels]
    finite = np.concatenate([g[np.isfinite(g)] for g in grids]) if grids else np.array([])
    if centred:
        span = float(np.abs(finite).max()) if finite.size else 1.0
        span = span if span > 0 else 1.0
        low, high, name = -span, span, style.DIVERGING_CMAP
    else:
        low = float(finite.min()) if finite.size else 0.0
        high = float(finite.max()) if finite.size else 1.0
        low, high, name = low, (high if high > low else low + 1.0), style.FEATURE_CMAP
    cmap = plt.get_cmap(name).with_extremes(bad=NAN_COLOUR)
    width = style.full_width(figures)
    ny, nx = grids[0].shape if grids else (1, 1)
    cols = 1 if nx > 24 else min(len(panels), max(1, int(width // max(3.0, 0.3 * nx + 1.5))))
    nrows, cols = style.grid_shape(len(panels), cols)
    height = max(2.4, ROW_INCHES * ny + 1.6)  # room for the layer rows and the rotated token names
    fig, axes = plt.subplots(nrows, cols, figsize=(width, height * nrows + 0.6), squeeze=False, layout="constrained")
    image = None
    for ax, (panel, grid) in zip(axes.flat, panels, strict=False):
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=low, vmax=high, aspect="auto",
                          interpolation="nearest")  # fmt: skip
        ax.set_xlim(-0.5, grid.shape[1] - 0.5)
        if xname == "head":  # short numbers: upright
            ax.set_xticks(range(len(xlabels)), xlabels, fontsize=style.TICK_SIZE)
        else:
            _layer_ticks(ax, fig, xlabels, panel_width=width / cols)
        ax.set_yticks(range(len(ylabels)), ylabels, fontsize=style.TICK_SIZE)
        ax.set_xlabel(xname, fontsize=style.PANEL_TITLE_SIZE)
        ax.set_ylabel(yname, fontsize=style.PANEL_TITLE_SIZE)
        if panel:
            ax.set_title(panel, fontsize=style.PANEL_TITLE_SIZE)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes.flat[: len(panels)]), shrink=0.9)
        bar.set_label(f"mean {label}", fontsize=style.TICK_SIZE)
        bar.ax.tick_params(labelsize=style.TICK_SIZE)
    fig.suptitle(title, fontsize=style.TITLE_SIZE)
    return fig


# --- helpers ---------------------------------------------------------------------------------------------------


def _numeric(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with layer, head and position as numbers (a stored table's `layer` is a categorical)."""
    cols = {c: pd.to_numeric(frame[c].astype(object), errors="coerce") for c in ("layer", "head", "position")
            if c in frame.columns}  # fmt: skip
    if "head" not in frame.columns:
        cols["head"] = pd.Series(np.nan, index=frame.index)
    return frame.assign(**cols)


def _pair_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in PAIR_COLUMNS if c in frame.columns]


def _panels(frame: pd.DataFrame, by: str | None) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per value of `by` (a swept column), or one untitled panel."""
    if not by or by not in frame.columns:
        return [("", frame)]
    return [(f"{by.removeprefix('sweep.')}={k[0]}", p) for k, p in _split(frame, [by])]


def _pairs_note(frame: pd.DataFrame, value: str) -> str:
    """How many pairs have a value, for a caption."""
    pairs = _pair_columns(frame)
    valued = frame[frame[value].notna()]
    n = len(valued.drop_duplicates(pairs)) if pairs else int(len(valued) > 0)
    return f"; N = {n} pair{'s' if n != 1 else ''}; grey cells: no value"


def _left_out(frame: pd.DataFrame) -> str:
    """The pairs left out of a patching map (NaN restoration), by why, for a caption."""
    counts = left_out_pairs(frame) if "restoration" in frame.columns else {}
    parts = [f"{n} {why}" for why, n in counts.items() if n]
    return f"; left out: {', '.join(parts)}" if parts else ""


def _layer_name(layer: Any) -> str:
    return "emb" if layer == EMBEDDINGS else str(int(layer))


def _token(token: Any) -> str:
    """A token as a tick label: control characters visible, a missing token `?`."""
    if token is None or (isinstance(token, float) and token != token):
        return "?"
    return str(token).replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
