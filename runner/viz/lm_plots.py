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
- `lm_logit_lens_figures`: per metric, layer x position of the mean lens value (layer -1: the embeddings), each cell
  labelled with the lens' top token (the most frequent over pairs, with its share where pairs differ).
- `lm_attention_figures`: from each pair's last position, layer x head of the mean attention to the answer's token
  and to the distractor's, and head x position for the layer of the head that attends most to the answer.

One colour scale per quantity: the maps of one (direction, metric) of `lm_patching` (every site, exact and
attribution rows, the head maps too) share one scale, as do the maps of one metric of `lm_grad_x_act`, so that a
+-0.002 map looks as faint as it is beside a +-0.4 one; each panel's title gives its own range.

The position axis: positions count from each pair's first token (left padding removed), read from the whole table
(every row of the pair), not from the rows one map draws: `attribution_topk` writes exact rows for each pair's top
cells only, and those sparse rows are drawn at the table's positions, blank where no pair has a value. Pairs of one
length share every position. Pairs of different lengths are aligned at their LAST token (the prediction, which the
metric reads): x then counts back from it (0 = last), so a position holds the same role in every pair; the caption
says so. A tick shows the token, decoded (`ĠAlice` is `Alice`, a newline `⏎`), where every pair has the same one
there, else the first pair's token followed by `*` (e.g. names in IOI prompts), and in brackets the position (the
table's, or the count back from the last token). At most MAX_POSITIONS positions are
drawn, the last ones (nearest the prediction), said in the caption. NaN cells (no pair has a value: small_span,
degenerate, or a cell no pair re-patched) are grey; captions give the number of pairs. Every value is averaged over
pairs with `nanmean`: a pair without a value at a cell is left out of that cell.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache
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
NOTED_ROW_INCHES = 0.5  # ... with a top token written in each cell (two lines of small text)
MAX_NOTED_COLUMNS = 32  # cells are labelled only where they are wide enough to hold a token
MAX_TOKEN_CHARS = 14  # a longer token is cut, with "…"
EMBEDDINGS = -1  # the logit lens' layer of the embeddings


# --- the figures of each table ---------------------------------------------------------------------------------


@dataclass
class Map:
    """One heatmap figure before it is drawn: its panels (title, (Y, X) grid), their labels and caption. Maps of one
    quantity are drawn together (`draw`) on one colour scale."""

    panels: list[tuple[str, np.ndarray]]
    title: str
    xlabels: list[str]
    xname: str
    ylabels: list[str]
    yname: str
    label: str  # the quantity, on the colour bar
    caption: str
    centred: bool = True  # diverging and centred at 0 (signed effects), else sequential
    notes: list[np.ndarray] = field(default_factory=list)  # per panel, (Y, X) text written in the cells


def lm_patching_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per (direction, patch_method, metric) and site: layer x position, layer x head or head x position heatmaps
    of the mean over pairs of restoration (denoising) or the drop, 1 - restoration (noising); the maps of one
    (direction, metric) on one colour scale."""
    if not {"restoration", "site", "layer"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    noising = frame["direction"] == "noising" if "direction" in frame.columns else False
    frame = frame.assign(effect=frame["restoration"].where(~noising, 1 - frame["restoration"]))
    topk = "patch_method" in frame.columns and frame["patch_method"].eq("attribution").any()
    groups: dict[tuple, list[Map]] = {}
    for key, part in _split(frame, ["direction", "patch_method", "metric"]):
        values = dict(zip([c for c in ("direction", "patch_method", "metric") if c in frame.columns], key, strict=True))
        direction = values.get("direction")
        label = "drop (1 - restoration)" if direction == "noising" else "restoration"
        meaning = ("1: patching the corrupted activation breaks the clean output entirely" if direction == "noising"
                   else "1: patching the clean activation restores the clean output")  # fmt: skip
        sparse = ("; exact rows are each pair's top cells only (attribution_topk): a cell's mean is over the pairs"
                  " that re-patched it, blank where none did" if topk and values.get("patch_method") == "exact"
                  else "")  # fmt: skip
        maps = groups.setdefault((direction, values.get("metric")), [])
        for (site,), cells in _split(part, ["site"]):
            name = f"{site}, {_name(key)}"
            words = f"mean over pairs of the {label} ({meaning}; 0: no effect)"
            left = _left_out(cells)
            reference = frame[frame["site"] == site]  # every row of the site: the pairs' positions and tokens
            whole, heads = cells[cells["head"].isna()], cells[cells["head"].notna()]
            if site == "latent":  # a dictionary's thousands of latents: those with the largest effects are drawn
                heads, shown = _top_latents(heads, "effect", TOP_LATENTS)
                left += shown
            if whole["position"].notna().any():
                drawn = _layer_position(whole, "effect", by, f"{label}: {name}", label, reference)
                maps.append(replace(drawn, caption=f"Patching ({name}): {words} per layer and position"
                                    f"{drawn.caption}{sparse}{left}."))  # fmt: skip
            every = heads[heads["position"].isna()]
            if not every.empty:
                drawn = _layer_head(every, "effect", by, f"{label}: {name}", label)
                maps.append(replace(drawn, caption=f"Patching ({name}, each head at every position at once): {words}"
                                    f" per layer and head{drawn.caption}{sparse}{left}."))  # fmt: skip
            each = heads[heads["position"].notna()]
            if not each.empty:
                unit = "latent" if site == "latent" else "head"
                drawn = _head_position(each, "effect", by, f"{label}: {name}", label, reference, unit)
                maps.append(replace(drawn, caption=f"Patching ({name}, each {unit} at each position): {words} per"
                                    f" {unit} and position{drawn.caption}{sparse}{left}."))  # fmt: skip
    return _draw_groups(groups, figures, "of this direction and metric")


TOP_LATENTS = 24  # a dictionary's latents drawn in a patching map: those with the largest mean effect


def _top_latents(cells: pd.DataFrame, value: str, count: int) -> tuple[pd.DataFrame, str]:
    """The rows of the `count` latents (the `head` column of site `latent`) whose mean over pairs of `value` is
    largest in size at some cell, and the caption's words for what was left out ('' when none was)."""
    means = cells.groupby(["layer", "head", "position"], dropna=False, observed=True)[value].mean().abs()
    peak = means.groupby(level=["layer", "head"], observed=True).max().sort_values(ascending=False)
    if len(peak) <= count:
        return cells, ""
    kept = set(peak.index[:count])
    rows = cells[[(layer, head) in kept for layer, head in zip(cells["layer"], cells["head"], strict=True)]]
    return rows, f"; the {count} latents of {len(peak)} with the largest effects (rows of the table hold them all)"


def lm_grad_x_act_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per (metric, site): layer x position of the mean gradient x activation (per-head sites summed over heads),
    and for per-head sites a layer x head map summed over positions; the maps of one metric on one colour scale."""
    if not {"value", "site", "layer", "position"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    groups: dict[tuple, list[Map]] = {}
    for key, part in _split(frame, ["metric", "site"]):
        name = _name(key)
        maps = groups.setdefault(key[:1] if "metric" in frame.columns else (), [])
        heads = "head" in part.columns and part["head"].notna().any()
        what = "gradient x activation"
        if heads:  # the heads' terms add up to the site's whole gradient x activation
            keys = [*_pair_columns(part), *([by] if by in part.columns else []), "layer", "position", "token"]
            summed = part.groupby(keys, dropna=False, observed=True, sort=False)["value"].sum(min_count=1)
            drawn = _layer_position(summed.reset_index(), "value", by, f"{what}: {name}", what, part)
            maps.append(replace(drawn, caption=f"Gradient x activation ({name}): mean over pairs of the sum over"
                                f" heads, per layer and position{drawn.caption}."))  # fmt: skip
            keys = [*_pair_columns(part), *([by] if by in part.columns else []), "layer", "head"]
            summed = part.groupby(keys, dropna=False, observed=True, sort=False)["value"].sum(min_count=1)
            drawn = _layer_head(summed.reset_index(), "value", by, f"{what}: {name}", what)
            maps.append(replace(drawn, caption=f"Gradient x activation ({name}): mean over pairs of the sum over"
                                f" positions, per layer and head{drawn.caption}."))  # fmt: skip
        else:
            drawn = _layer_position(part, "value", by, f"{what}: {name}", what, part)
            maps.append(replace(drawn, caption=f"Gradient x activation ({name}): mean over pairs per layer and"
                                f" position{drawn.caption}."))  # fmt: skip
    return _draw_groups(groups, figures, "of this metric")


def lm_logit_lens_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per metric: layer x position of the mean lens value (the run's target read at each layer's residual), each
    cell labelled with the lens' most frequent top token over pairs."""
    if not {"value", "layer", "position"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    out = []
    for key, part in _split(frame, ["metric"]):
        name = _name(key) or "value"
        values = part["value"].to_numpy(float)
        signed = bool(np.nanmin(values, initial=0.0) < 0 < np.nanmax(values, initial=0.0))
        drawn = _layer_position(part, "value", by, f"logit lens: {name}", name, part, centred=signed,
                                notes="top_token" if "top_token" in part.columns else None)  # fmt: skip
        said = ("; each cell: the lens' top token, the most frequent over pairs (with its share where they differ)"
                if drawn.notes else "")  # fmt: skip
        caption = (f"Logit lens: mean over pairs of {name} read from each layer's residual (the model's final norm"
                   f" and unembedding; layer emb: the embeddings) per layer and position{drawn.caption}{said}.")  # fmt: skip
        out += _draw_groups({key: [replace(drawn, caption=caption)]}, figures, "")
    return out


def lm_dla_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """At each pair's last position: a layer x head map of the heads' mean direct logit attribution, and per layer
    the attention's (heads and bias), the MLP's and the accumulated stream's, mean over pairs."""
    if not {"kind", "value", "layer", "head", "position"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    pairs = _pair_columns(frame)
    last = frame.groupby(pairs, observed=True)["position"].transform("max") if pairs else frame["position"].max()
    frame = frame[frame["position"] == last]
    heads = frame[frame["kind"] == "head"]
    out = []
    if not heads.empty:
        drawn = _layer_head(heads, "value", by, "direct logit attribution of each head", "contribution")
        caption = ("Direct logit attribution at each pair's last position: each head's write through the final norm"
                   " (at the run's scale) onto the answer - distractor unembedding, mean over pairs per layer and head"
                   f" (red: toward the answer){drawn.caption}.")  # fmt: skip
        out += _draw_groups({(): [replace(drawn, caption=caption)]}, figures, "")
    out += _dla_layers(frame, figures)
    return out


def _dla_layers(frame: pd.DataFrame, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per layer, mean over pairs: the attention's contribution (its heads and bias), the MLP's, and the accumulated
    stream's (left of block l: the stream before it)."""
    per_pair = _pair_columns(frame)
    attention = frame[frame["kind"].isin(["head", "attn_bias"])]
    parts = {
        "attention": attention.groupby([*per_pair, "layer"], observed=True)["value"].sum(),
        "MLP": frame[frame["kind"] == "mlp"].groupby([*per_pair, "layer"], observed=True)["value"].sum(),
        "accumulated stream": frame[frame["kind"] == "accumulated"]
        .groupby([*per_pair, "layer"], observed=True)["value"]
        .sum(),
    }
    means = {name: series.groupby("layer", observed=True).mean() for name, series in parts.items() if len(series)}
    if not means:
        return []
    plt = style.pyplot()
    fig, ax = plt.subplots(figsize=(style.full_width(figures), 3.2), layout="constrained")
    for name, series in means.items():
        ax.plot(series.index.astype(float), series.to_numpy(float), marker="o", markersize=3, label=name)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("layer (accumulated stream: before block l; the last point is the final stream)",
                  fontsize=style.PANEL_TITLE_SIZE)  # fmt: skip
    ax.set_ylabel("logit difference", fontsize=style.PANEL_TITLE_SIZE)
    ax.set_title("direct logit attribution per layer", fontsize=style.PANEL_TITLE_SIZE)
    ax.legend(fontsize=style.TICK_SIZE, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    caption = ("Direct logit attribution per layer at each pair's last position, mean over pairs: each layer's"
               " attention (its heads and output bias) and MLP, and the accumulated stream before each block read"
               " through the final norm at the run's scale (TransformerLens' accumulated_resid)"
               f"{_pairs_note(frame, 'value')}.")  # fmt: skip
    return [(caption, fig)]


def lm_attention_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """From each pair's last position: layer x head maps of the mean attention to the answer's token and to the
    distractor's (summed over the positions that hold it, 0 where the prompt has none), and a head x position map
    of the layer whose head attends most to the answer; one colour scale (weights, 0 to 1)."""
    if not {"weight", "layer", "head", "position", "query_position"} <= set(frame.columns):
        return []
    frame = _numeric(frame)
    pairs = _pair_columns(frame)
    last = (
        frame.groupby(pairs, observed=True)["query_position"].transform("max")
        if pairs
        else frame["query_position"].max()
    )
    frame = frame[frame["query_position"] == last]
    maps = []
    best_layer = None
    for role in ("answer", "distractor"):
        if role not in frame.columns or "token" not in frame.columns:
            continue
        marked = frame.assign(_to=frame["weight"].where(frame["token"] == frame[role], 0.0))
        keys = [*pairs, *([by] if by in marked.columns else []), "layer", "head"]
        summed = marked.groupby(keys, dropna=False, observed=True, sort=False)["_to"].sum().reset_index()
        drawn = _layer_head(summed, "_to", by, f"attention to the {role}", "attention weight")
        maps.append(replace(drawn, centred=False, caption=f"Attention from the last position to the {role}'s token"
                            f" (summed over the positions that hold it): mean over pairs per layer and head"
                            f"{drawn.caption}."))  # fmt: skip
        if role == "answer" and summed["_to"].notna().any():
            best_layer = summed.groupby(["layer", "head"], observed=True)["_to"].mean().idxmax()[0]
    if best_layer is not None:
        part = frame[frame["layer"] == best_layer]
        drawn = _head_position(part, "weight", by, "attention from the last position", "attention weight", part)
        maps.append(replace(drawn, centred=False, caption=f"Attention from the last position over every key, each head"
                            f" of layer {_layer_name(best_layer)} (the layer of the head that attends most to the"
                            f" answer): mean over pairs{drawn.caption}."))  # fmt: skip
    return _draw_groups({(): maps}, figures, "of attention weights") if maps else []


# --- the three kinds of map --------------------------------------------------------------------------------------


def _layer_position(
    frame: pd.DataFrame, value: str, by: str | None, title: str, label: str, reference: pd.DataFrame,
    *, centred: bool = True, notes: str | None = None,
) -> Map:  # fmt: skip
    """Layer x position map of `value`'s mean over pairs, one panel per value of `by`, at the positions and tokens
    of `reference` (the table's rows of the same pairs); `notes`: a column whose most frequent value per cell is
    written in it."""
    axis = position_axis(frame, reference)
    frame, ticks, note = axis.frame, axis.slots, axis.note
    layers = sorted(frame["layer"].dropna().unique().tolist())
    xs = ticks["_x"].tolist()
    parts = _panels(frame, by)
    panels = [(t, mean_grid(p, value, "layer", "_x", layers, xs)) for t, p in parts]
    written = [top_grid(p, notes, "layer", "_x", layers, xs) for _, p in parts] if notes else []
    if len(xs) > MAX_NOTED_COLUMNS:
        written = []  # cells too narrow for a token
    return Map(panels, title, ticks["tick"].tolist(), axis.title, [_layer_name(v) for v in layers], "layer",
               label, f"; {axis.words} on the x axis{note}{_pairs_note(frame, value)}", centred, written)  # fmt: skip


def _layer_head(frame: pd.DataFrame, value: str, by: str | None, title: str, label: str) -> Map:
    """Layer x head map of `value`'s mean over pairs, one panel per value of `by`."""
    layers = sorted(frame["layer"].dropna().unique().tolist())
    heads = sorted(frame["head"].dropna().unique().tolist())
    panels = [(t, mean_grid(p, value, "layer", "head", layers, heads)) for t, p in _panels(frame, by)]
    return Map(panels, title, [str(int(h)) for h in heads], "head", [_layer_name(v) for v in layers], "layer", label,
               _pairs_note(frame, value))  # fmt: skip


def _head_position(
    frame: pd.DataFrame, value: str, by: str | None, title: str, label: str, reference: pd.DataFrame,
    unit: str = "head",
) -> Map:  # fmt: skip
    """Head x position map of the one layer with the largest |mean| (over pairs) cell (`unit`: what a row is called:
    a head, or a dictionary's latent)."""
    means = frame.groupby(["layer", "head", "position"], observed=True)[value].mean().abs()
    layers = sorted(frame["layer"].dropna().unique().tolist())
    layer = means.idxmax()[0] if means.notna().any() else layers[0]
    part = frame[frame["layer"] == layer]
    axis = position_axis(part, reference)
    part, ticks, note = axis.frame, axis.slots, axis.note
    heads = sorted(part["head"].dropna().unique().tolist())
    panels = [(t, mean_grid(p, value, "head", "_x", heads, ticks["_x"].tolist())) for t, p in _panels(part, by)]
    chosen = (f"; layer {_layer_name(layer)}, the layer with the largest |mean| cell of the {len(layers)} patched"
              " (the others are in the table)" if len(layers) > 1 else f"; layer {_layer_name(layer)}")  # fmt: skip
    return Map(panels, f"{title}, layer {_layer_name(layer)}", ticks["tick"].tolist(), axis.title,
               [str(int(h)) for h in heads], f"{unit} (layer {_layer_name(layer)})", label,
               f"{chosen}; {axis.words} on the x axis{note}{_pairs_note(part, value)}")  # fmt: skip


# --- the position axis and the grids ----------------------------------------------------------------------------


def shared_label(shown: list[str], roles: pd.Series | None) -> tuple[str, str]:
    """A position's label over the pairs (`shown`: each pair's token there, `roles`: each pair's role there) and how
    it was had: their shared token ("token"); where the tokens differ, the roles if every pair has one ("role": `S2`,
    `IO/S1`), else the first pair's token marked `*` ("first")."""
    shown = shown or ["?"]
    if len(set(shown)) == 1:
        return shown[0], "token"
    if roles is not None and len(roles) and roles.notna().all():
        return "/".join(sorted({str(r) for r in roles})), "role"
    return f"{shown[0]}*", "first"


@dataclass(frozen=True)
class PositionAxis:
    """The x axis of a position map: `frame`'s rows with their slot `_x`; `slots`, the drawn slots in order with
    their `label` and `tick`; the caption's `note`; the axis' `title`."""

    frame: pd.DataFrame
    slots: pd.DataFrame
    note: str
    title: str = "token (position)"

    @property
    def words(self) -> str:
        """What the axis shows, for a caption."""
        return "roles" if self.title == "role" else "tokens"


def position_axis(frame: pd.DataFrame, reference: pd.DataFrame | None = None) -> PositionAxis:
    """The position axis of `frame`'s rows. Each pair's length, tokens and roles come from `reference` (default:
    `frame`), the table's rows of the same pairs, so that rows which hold some positions only (attribution_topk's
    exact rows) land where the table has them and every slot of the table is drawn. Pairs never mix two prompts'
    tokens in one slot:
      - pairs of one length: the slot is the position;
      - pairs of different lengths whose tokens, counted back from the last token, agree (or differ only where
        each pair names the position's role): the slot counts back from the last token (0 = last);
      - else pairs with the same roles in the same order: the slot is a role's first, inner or last token, or a
        stretch between roles (`aligned_by_role`, as causal tracing averages prompts of different lengths);
      - else, where the tokens agree at half the slots or more (one template, names of different lengths): from
        the last token, the other slots' labels marked `*`;
      - else only the most common length's pairs are drawn, and the note says how many.
    Only the last MAX_POSITIONS slots are kept."""
    reference = frame if reference is None else reference
    frame = frame[frame["position"].notna()]
    reference = reference[reference["position"].notna()]
    plan, keys = _planned(reference)
    frame = frame.join(plan.slots.set_index(keys)[["_x"]], on=keys)
    frame = frame[frame["_x"].notna()].astype({"_x": int})
    named = plan.slots.drop_duplicates("_x").set_index("_x")["_label"] if plan.by_role else None
    order = plan.slots
    slots = sorted(order["_x"].unique().tolist())
    note = plan.note
    if len(slots) > MAX_POSITIONS:
        note += f"; the last {MAX_POSITIONS} of {len(slots)} positions"
        slots = slots[-MAX_POSITIONS:]
        frame = frame[frame["_x"] >= slots[0]]
    if named is not None:
        labels = [named[slot] for slot in slots]
        return PositionAxis(frame, pd.DataFrame({"_x": slots, "label": labels, "tick": labels}), note, "role")
    labels = []
    differ = by_role = False
    for slot in slots:
        here = order[order["_x"] == slot]
        tokens = here["token"] if "token" in here.columns else pd.Series(dtype=object)
        label, how = shared_label([display_token(t) for t in tokens], here["role"] if "role" in here.columns else None)
        by_role, differ = by_role or how == "role", differ or how == "first"
        labels.append(label)
    if by_role:
        note += (
            "; where the pairs' tokens differ the label is the position's role (IO/S1: IO in some pairs, S1 in others)"
        )
    if differ:
        note += "; *: the pairs' tokens differ there, the label is the first pair's token"
    ticks = [f"{label} ({slot})" for label, slot in zip(labels, slots, strict=True)]  # the table's position beside it
    return PositionAxis(frame, pd.DataFrame({"_x": slots, "label": labels, "tick": ticks}), note)


def by_role_slots(frame: pd.DataFrame) -> pd.DataFrame | None:
    """`frame`'s rows with a position, each with its role slot (`_x`) and the slot's name (`_label`: `last
    subject`), where `position_axis` aligns the pairs by role; None where it does not (one length, or aligned at
    the last token, or the roles differ in order)."""
    rows = frame[frame["position"].notna()]
    plan, keys = _planned(rows)
    if not plan.by_role:
        return None
    return rows.join(plan.slots.set_index(keys)[["_x", "_label"]], on=keys)


def _planned(rows: pd.DataFrame) -> tuple[_SlotPlan, list[str]]:
    """The slot plan of the (pair, position)s of `rows` (each with a position), and the columns that key them."""
    keys = [*_pair_columns(rows), "position"]
    return _slot_plan(rows.drop_duplicates(keys).sort_values(keys), keys[:-1]), keys


@dataclass(frozen=True)
class _SlotPlan:
    slots: pd.DataFrame  # one row per drawn (pair, position): the pair columns, position, token, role, `_x`
    note: str
    by_role: bool = False  # `_x` numbers role slots, named in `_label`


def _slot_plan(positions: pd.DataFrame, pairs: list[str]) -> _SlotPlan:
    """Where each pair's positions go on the axis (`positions`: one row per (pair, position), sorted); see
    `position_axis` for the four cases."""
    whole = positions.assign(_x=positions["position"].astype(int))
    if not pairs:
        return _SlotPlan(whole, "")
    lengths = positions.groupby(pairs, observed=True)["position"].transform("max")
    if lengths.nunique() <= 1:
        return _SlotPlan(whole, "")
    from_end = positions.assign(_x=(positions["position"] - lengths).astype(int))
    agree = [_agree(p) for _, p in from_end.groupby("_x") if len(p) > 1]  # the slots that two pairs or more hold
    aligned_at_end = "; pairs of different lengths aligned at their last token (the prediction): x counts positions"
    if all(agree):
        return _SlotPlan(from_end, f"{aligned_at_end} back from it")
    by_role = aligned_by_role(positions, pairs)
    if by_role is not None:
        return _SlotPlan(by_role, "; pairs of different lengths aligned by role: a role's (or a stretch between roles')"
                         " first, inner and last tokens, the inner ones averaged", by_role=True)  # fmt: skip
    if 2 * sum(agree) >= len(agree):  # one template whose names differ in length, not two prompts' tokens mixed
        return _SlotPlan(from_end, f"{aligned_at_end} back from it")
    common = lengths.value_counts()
    length = common[common == common.max()].index.max()  # the most common length; of two, the longer
    drawn = whole[lengths == length]
    n_drawn, n_all = len(drawn.drop_duplicates(pairs)), len(positions.drop_duplicates(pairs))
    return _SlotPlan(drawn, f"; the pairs differ in length and in their roles' order: drawn are the {n_drawn} of"
                     f" {n_all} pairs of length {int(length) + 1} (every pair is in the table)")  # fmt: skip


def _agree(slot: pd.DataFrame) -> bool:
    """Whether the pairs' tokens at one slot are one token, or differ only where each pair names its role."""
    tokens = slot["token"].map(display_token).tolist() if "token" in slot.columns else []
    return shared_label(tokens, slot["role"] if "role" in slot.columns else None)[1] != "first"


def aligned_by_role(positions: pd.DataFrame, pairs: list[str]) -> pd.DataFrame | None:
    """`positions` (one row per (pair, position), sorted) with `_x` and `_label` by role, or None where the pairs'
    roles differ in order (or name no role). Each pair's positions split into runs of one role (a role named twice
    counts twice: `subject`, `subject (2)`) and the stretches between them (`before subject`, `after subject`,
    possibly empty). A run or stretch holds one slot when it is one token in every pair, else its first, inner and
    last tokens (`first subject`, `inner subject`, `last subject`); a one-token role run is its last token (the
    subject's last token is causal tracing's), a one-token stretch its first."""
    if "role" not in positions.columns:
        return None
    runs = {}
    for pair, rows in positions.groupby(pairs, observed=True, sort=False):
        roles = rows["role"].tolist()
        named, gaps, gap, seen = [], [], [], {}
        i = 0
        while i < len(roles):
            if roles[i] is None or pd.isna(roles[i]):
                gap.append(rows.index[i])
                i += 1
                continue
            j = i
            while j < len(roles) and roles[j] == roles[i]:
                j += 1
            seen[roles[i]] = seen.get(roles[i], 0) + 1
            named.append((roles[i] if seen[roles[i]] == 1 else f"{roles[i]} ({seen[roles[i]]})", list(rows.index[i:j])))
            gaps.append(gap)
            gap = []
            i = j
        runs[pair] = (named, [*gaps, gap])
    orders = {tuple(name for name, _ in named) for named, _ in runs.values()}
    if len(orders) != 1 or not next(iter(orders)):
        return None
    names = next(iter(orders))
    segments = []  # (label, is a role, each pair's row indices)
    for k, name in enumerate(names):
        gap_name = f"before {name}" if k == 0 else f"after {names[k - 1]}"
        segments.append((gap_name, False, [gaps[k] for _, gaps in runs.values()]))
        segments.append((name, True, [named[k][1] for named, _ in runs.values()]))
    segments.append((f"after {names[-1]}", False, [gaps[-1] for _, gaps in runs.values()]))
    x, label = pd.Series(np.nan, index=positions.index), pd.Series(None, index=positions.index, dtype=object)
    slot = 0
    for name, is_role, members in segments:
        longest = max(len(m) for m in members)
        if longest == 0:
            continue
        if longest == 1:
            for m in members:
                x[m], label[m] = slot, name
            slot += 1
            continue
        parts = ["first", "inner", "last"] if longest > 2 else ["first", "last"]
        for m in members:
            for i, index in enumerate(m):
                if len(m) == 1:
                    where = "last" if is_role else "first"
                else:
                    where = "first" if i == 0 else "last" if i == len(m) - 1 else "inner"
                x[index], label[index] = slot + parts.index(where), f"{where} {name}"
        slot += len(parts)
    return positions.assign(_x=x.astype(int), _label=label)


def mean_grid(
    frame: pd.DataFrame, value: str, rows: str, columns: str, ys: Sequence[Any], xs: Sequence[Any]
) -> np.ndarray:
    """(len(ys), len(xs)) mean of `value` per (rows, columns) cell over the frame's rows (pairs), NaN left out; NaN
    where a cell has no value."""
    means = frame.groupby([rows, columns], observed=True)[value].mean()
    grid = means.reindex(pd.MultiIndex.from_product([list(ys), list(xs)], names=[rows, columns]))
    return grid.to_numpy(float).reshape(len(ys), len(xs))  # (Y, X)


def top_grid(
    frame: pd.DataFrame, column: str, rows: str, columns: str, ys: Sequence[Any], xs: Sequence[Any]
) -> np.ndarray:
    """(len(ys), len(xs)) text per cell: the most frequent (decoded) value of `column` over the frame's rows, with
    its share of them where they differ ("Paris 60%"); "" where a cell has none."""
    grid = np.full((len(ys), len(xs)), "", dtype=object)
    where = {(y, x): (i, j) for i, y in enumerate(ys) for j, x in enumerate(xs)}
    valued = frame[frame[column].notna()]
    for (y, x), tokens in valued.groupby([rows, columns], observed=True)[column]:
        if (y, x) not in where:
            continue
        counts = tokens.map(display_token).value_counts()
        share = counts.iloc[0] / counts.sum()
        grid[where[y, x]] = counts.index[0] if share == 1 else f"{counts.index[0]}\n{share:.0%}"
    return grid


def _draw_groups(groups: dict[tuple, list[Map]], figures: FiguresConfig, shared: str) -> list[tuple[str, Figure]]:
    """Each group's maps drawn on one colour scale (the group's finite values), in order; the caption says which maps
    share it (`shared`, when a group has several)."""
    out = []
    for maps in groups.values():
        limits = colour_limits([g for m in maps for _, g in m.panels], all(m.centred for m in maps))
        for drawn in maps:
            note = (f" Colour scale shared by the {len(maps)} maps {shared}; each panel's title gives its own range."
                    if len(maps) > 1 and shared else "")  # fmt: skip
            out.append((drawn.caption + note, _heatmap(drawn, figures, limits)))
    return out


def colour_limits(grids: Sequence[np.ndarray], centred: bool) -> tuple[float, float]:
    """(low, high) of one colour scale over `grids`' finite values: symmetric about 0 where `centred`."""
    finite = np.concatenate([g[np.isfinite(g)].ravel() for g in grids]) if grids else np.array([])
    if centred:
        span = float(np.abs(finite).max()) if finite.size else 1.0
        span = span if span > 0 else 1.0
        return -span, span
    low = float(finite.min()) if finite.size else 0.0
    high = float(finite.max()) if finite.size else 1.0
    return low, (high if high > low else low + 1.0)


def _range_title(title: str, grid: np.ndarray) -> str:
    """A panel's title with the range of its own cells (its share of the shared colour scale)."""
    finite = grid[np.isfinite(grid)]
    span = f"cells {finite.min():.3g} to {finite.max():.3g}" if finite.size else "no value"
    return f"{title}: {span}" if title else span


def _heatmap(drawn: Map, figures: FiguresConfig, limits: tuple[float, float]) -> Figure:
    """One heatmap per panel on the colour scale `limits` with one colour bar: diverging where the map is `centred`,
    else sequential; NaN cells grey; each panel titled with its own range, its cells labelled with `notes`."""
    plt = style.pyplot()
    panels = drawn.panels
    low, high = limits
    cmap = plt.get_cmap(style.DIVERGING_CMAP if drawn.centred else style.FEATURE_CMAP).with_extremes(bad=NAN_COLOUR)
    width = style.full_width(figures)
    ny, nx = panels[0][1].shape if panels else (1, 1)
    cols = 1 if nx > 24 else min(len(panels), max(1, int(width // max(3.0, 0.3 * nx + 1.5))))
    nrows, cols = style.grid_shape(len(panels), cols)
    row = NOTED_ROW_INCHES if drawn.notes else ROW_INCHES
    height = max(2.4, row * ny + 1.8)  # room for the layer rows and the rotated token names
    fig, axes = plt.subplots(nrows, cols, figsize=(width, height * nrows + 0.6), squeeze=False, layout="constrained")
    image = None
    for i, (ax, (panel, grid)) in enumerate(zip(axes.flat, panels, strict=False)):
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=low, vmax=high, aspect="auto",
                          interpolation="nearest")  # fmt: skip
        ax.set_xlim(-0.5, grid.shape[1] - 0.5)
        if drawn.xname == "head":  # short numbers: upright
            ax.set_xticks(range(len(drawn.xlabels)), drawn.xlabels, fontsize=style.TICK_SIZE)
        else:
            _layer_ticks(ax, fig, drawn.xlabels, panel_width=width / cols)
        ax.set_yticks(range(len(drawn.ylabels)), drawn.ylabels, fontsize=style.TICK_SIZE)
        ax.set_xlabel(drawn.xname, fontsize=style.PANEL_TITLE_SIZE)
        ax.set_ylabel(drawn.yname, fontsize=style.PANEL_TITLE_SIZE)
        ax.set_title(_range_title(panel, grid), fontsize=style.PANEL_TITLE_SIZE)
        if i < len(drawn.notes):
            _write_cells(ax, drawn.notes[i], grid, image)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes.flat[: len(panels)]), shrink=0.9)
        bar.set_label(f"mean {drawn.label}", fontsize=style.TICK_SIZE)
        bar.ax.tick_params(labelsize=style.TICK_SIZE)
    fig.suptitle(drawn.title, fontsize=style.TITLE_SIZE)
    return fig


def _write_cells(ax: Any, notes: np.ndarray, grid: np.ndarray, image: Any) -> None:
    """Each cell's text, dark on light cells and light on dark ones."""
    for (y, x), text in np.ndenumerate(notes):
        if not text:
            continue
        red, green, blue, _ = image.to_rgba(grid[y, x]) if np.isfinite(grid[y, x]) else (0.85, 0.85, 0.85, 1)
        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
        ax.text(x, y, text, ha="center", va="center", fontsize=style.TICK_SIZE - 3, linespacing=0.9,
                color="white" if dark else "black")  # fmt: skip


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


def display_token(token: Any) -> str:
    """A token as the text it stands for, for a label: a byte-level BPE piece decoded (`ĠAlice` -> `Alice`), a
    SentencePiece `▁` a space and a byte token `<0x0A>` its byte; the spaces around it dropped, a newline `⏎`, a tab
    `⇥`, a token of spaces `␣`; cut at MAX_TOKEN_CHARS; a missing token `?`."""
    if token is None or (isinstance(token, float) and token != token) or token is pd.NA:
        return "?"
    text = decode_piece(str(token))
    shown = text.strip(" ") or ("␣" if text else "")
    shown = shown.replace("\r\n", "⏎").replace("\n", "⏎").replace("\r", "⏎").replace("\t", "⇥")
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)
    return shown if len(shown) <= MAX_TOKEN_CHARS else shown[: MAX_TOKEN_CHARS - 1] + "…"


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def decode_piece(piece: str) -> str:
    """The text of a tokenizer's piece: GPT-2-style byte-level BPE (`Ġ` a space, `Ċ` a newline) decoded where the
    piece holds one of its remapped characters and its bytes are UTF-8, SentencePiece's `▁` a space and `<0xNN>` its
    byte; other pieces as they are."""
    decoder = _byte_decoder()
    if any(256 <= ord(c) < 324 for c in piece) and all(c in decoder for c in piece):
        try:
            return bytes(decoder[c] for c in piece).decode("utf-8")
        except UnicodeDecodeError:
            pass  # a piece of a multi-byte character, or not byte-level BPE: as it is
    piece = BYTE_TOKEN.sub(lambda m: chr(int(m.group(1), 16)) if int(m.group(1), 16) < 128 else m.group(0), piece)
    return piece.replace("▁", " ")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: each of its 256 characters -> its byte (printable bytes stand for
    themselves, the others are shifted to 256 and up: a space is `Ġ`, a newline `Ċ`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}
