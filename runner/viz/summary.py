"""The console summary at the end of a run: per table, the mean of its measured columns per layer; for a table of
cells within a layer (the language-model tables: a row per pair, layer and position or head), the cells where the
mean over pairs peaks instead (`peak_summary`), which the report shows too; for the tables with a summary of their
own (run_summaries.py: the top edges, the circuit's curve), that."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from runner.frames import with_layer_order
from runner.tables import presentation
from runner.viz.run_summaries import RUN_SUMMARIES

log = logging.getLogger(__name__)

# The columns that place a cell within a layer. A table with a `position` holds one row per (pair, layer, cell): a
# mean over its positions would average the one cell that carries an effect with many that carry none.
CELL_AXES = ("position", "head")
PAIR_COLUMNS = ("run_id", "sample")  # a pair is a sample of one run (a sweep's jobs reuse sample numbers)
EFFECT = "effect"  # restoration where denoising, the drop 1 - restoration where noising (0: no effect in both)
PEAK_WORDS = (
    "Per layer in model order: the cell (position, head) where the mean over pairs is largest (max) and where it is"
    " smallest (min), and those means; the token at that position where the pairs share it (else its role, IO, S1, S2,"
    " subject or end, where the data names one, or the first pair's token marked *), and how many pairs have a value"
    " there when not all do. Pairs of different lengths with their roles in one order are placed by role instead:"
    " `last subject` is each pair's last subject token, `after subject` the tokens that follow it. A mean over a layer's positions is not"
    " shown: it would average the cell that carries an effect with those that carry none."
)
EFFECT_WORDS = " `effect`: the restoration where denoising, the drop 1 - restoration where noising."


def is_cell_table(columns: Sequence[str]) -> bool:
    """Whether a table holds one row per cell within a layer (position or head), as the language-model tables do."""
    return "position" in columns and "layer" in columns


def peak_summary(
    frame: pd.DataFrame, keys: Sequence[str], values: Sequence[str], means: Sequence[str] = ()
) -> pd.DataFrame:
    """Per (layer, keys): for each of `values`, the largest and smallest mean over pairs of a cell and where it is
    (`<value> max`, `<value> max at`, `<value> min`, `<value> min at`); for each of `means` (a value of the pair,
    not of the cell, such as `rank_correlation`) its mean (`<value> mean`); and the pairs with a value (`n`). With noising rows,
    `restoration` is summarised as the `effect` (the drop where noising), so that max is the strongest effect in
    both directions.
    Layers in model order."""
    from runner.viz.lm_plots import by_role_slots, display_token

    if "restoration" in values and "direction" in frame.columns and frame["direction"].eq("noising").any():
        noising = frame["direction"] == "noising"
        frame = frame.assign(**{EFFECT: frame["restoration"].where(~noising, 1 - frame["restoration"])})
        values = [EFFECT if v == "restoration" else v for v in values]
    group = ["layer", *(k for k in keys if k in frame.columns and k != "layer")]
    cells = [c for c in CELL_AXES if c in frame.columns]
    pairs = [c for c in PAIR_COLUMNS if c in frame.columns]
    slots = by_role_slots(frame) if "position" in cells else None
    if slots is not None:  # pairs of different lengths: a cell is a role's slot ("last subject"), not a position
        frame = slots.assign(position=slots["_x"], token=slots["_label"], role=None).drop(columns=["_x", "_label"])
    tokens = _cell_tokens(frame, group, cells, pairs, display_token if slots is None else str)  # slot names whole
    rows = []
    for key, part in frame.groupby(group, observed=True, dropna=False, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(group, key, strict=True))
        cells_of = part.groupby(cells, observed=True, dropna=False)[list(values)]
        cell_means, counts = cells_of.mean(), cells_of.count()  # counts: the pairs with a value at each cell
        valued = part[part[list(values)].notna().any(axis=1)]  # pairs left out (NaN: small_span, ...) not counted
        n = len(valued.drop_duplicates(pairs)) if pairs else int(len(valued) > 0)
        for value in values:
            column = cell_means[value].dropna()
            for end, index in (("max", column.to_numpy().argmax), ("min", column.to_numpy().argmin)):
                i = index() if len(column) else None
                at = None if i is None else column.index[i]
                row[f"{value} {end}"] = float("nan") if i is None else float(column.iloc[i])
                if i is None:
                    row[f"{value} {end} at"] = ""
                    continue
                token = tokens.get(_key((*key, *_tuple(at))))
                where = _where(at if isinstance(at, tuple) else (at,), cells, token, by_role=slots is not None)
                if row.get("site") == "latent":  # a dictionary's latents are its "heads" (runner/site_kinds.py)
                    where = where.replace("head ", "latent ", 1)
                fewer = int(counts[value].loc[[at]].iloc[0])
                row[f"{value} {end} at"] = where + (f", {fewer} of {n} pairs" if fewer < n else "")
        row.update({f"{value} mean": part[value].mean() for value in means})
        row["n"] = n
        rows.append(row)
    out = pd.DataFrame(rows)
    if not out.empty and isinstance(frame["layer"].dtype, pd.CategoricalDtype):  # model order
        order = {layer: i for i, layer in enumerate(frame["layer"].cat.categories)}
        out = out.assign(_rank=out["layer"].map(order)).sort_values("_rank", kind="stable").drop(columns="_rank")
    return out.reset_index(drop=True)


def _cell_tokens(frame: pd.DataFrame, group: list[str], cells: list[str], pairs: list[str], show) -> dict:  # noqa: ANN001
    """(group values..., cell values...) -> the token there: the pairs' shared token; where they differ, the
    position's role(s) (`S2`, `IO/S1`) if every pair has one, else the first pair's token with `*`."""
    if "token" not in frame.columns or "position" not in cells:
        return {}
    found = {}
    rows = frame[frame["position"].notna()].drop_duplicates([*group, *cells, *pairs])
    from runner.viz.lm_plots import shared_label

    for key, part in rows.groupby([*group, *cells], observed=True, dropna=False, sort=False):
        roles = part["role"] if "role" in part.columns else None
        found[_key(key)] = shared_label([show(t) for t in part["token"]], roles)[0]
    return found


def _tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _key(values: tuple) -> tuple:
    """A group key that finds itself again: NaN (a whole-site cell's head) as None, since NaN != NaN."""
    return tuple(None if pd.isna(v) else v for v in values)


def _where(cell: tuple, axes: list[str], token: str | None, by_role: bool = False) -> str:
    """A cell's place in words: 'position 8 (t35)', 'head 3', 'head 3, position 8'; with `by_role` (the position is
    a role's slot, `token` its name) 'last subject', 'head 3, last subject'."""
    if by_role and token:
        held = dict(zip(axes, cell, strict=True))
        head = held.get("head")
        return token if head is None or pd.isna(head) else f"head {int(head)}, {token}"
    parts = [f"{axis} {int(v)}" for axis, v in zip(axes, cell, strict=True) if not pd.isna(v)]
    parts = sorted(parts, key=lambda p: not p.startswith("head"))  # head first: the position qualifies it
    text = ", ".join(parts) or "every position"
    return f"{text} ({token})" if token else text


def summarise(paths: dict[str, Path], extra_values: dict[str, tuple[str, ...]] | None = None) -> None:
    """Log each table's per-layer means of its declared summary values (runner.tables.Presentation; `extra_values`
    adds columns per table, a method's `summary_values`), by layer and the declared keys, layers in model order; a
    table of cells (`is_cell_table`) by its peak cells (`peak_summary`)."""
    for table, path in paths.items():
        if table in RUN_SUMMARIES:  # a summary of its own (the top edges, the circuit's curve, ...)
            frame = pd.read_parquet(path)
            words, summary = RUN_SUMMARIES[table](frame)
            with pd.option_context("display.width", 200, "display.max_columns", 20, "display.precision", 4):
                log.info("%s (%d rows). %s\n%s", table, len(frame), words, summary.to_string(index=False))
            continue
        present = set(pq.read_schema(sorted(path.glob("part-*.parquet"))[0]).names)
        shown = presentation(table)
        keys = [k for k in ("layer", *shown.keys) if k in present]
        wanted = dict.fromkeys((*(extra_values or {}).get(table, ()), *shown.values))
        values = [v for v in wanted if v in present]
        if not values:
            log.info("%s: %d rows", table, sum(pq.read_metadata(p).num_rows for p in path.glob("part-*.parquet")))
            continue
        ordered = "layer_index" in present
        cells = is_cell_table(present)
        extra = [c for c in (*CELL_AXES, *PAIR_COLUMNS, "token", "role", "direction") if cells and c in present]
        columns = list(dict.fromkeys(keys + values + extra + (["layer_index"] if ordered else [])))
        frame = pd.read_parquet(path, columns=columns)
        with pd.option_context(
            "display.width", 200, "display.max_rows", 60, "display.max_columns", 20, "display.precision", 4
        ):
            if cells:
                extras = [v for v in values if v not in shown.values]  # a method's own: values of the pair
                peaks = [v for v in values if v not in extras]
                summary = peak_summary(with_layer_order(frame), keys, peaks, extras)
                words = PEAK_WORDS + (EFFECT_WORDS if f"{EFFECT} max" in summary.columns else "")
                log.info("%s (%d rows, per layer: the peak cells). %s\n%s", table, len(frame), words,
                         summary.to_string(index=False))  # fmt: skip
                continue
            summary = with_layer_order(frame).groupby(keys, observed=True)[values].mean()  # layers in model order
            log.info("%s (%d rows, per layer):\n%s", table, len(frame), summary)
