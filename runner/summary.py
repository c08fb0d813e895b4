"""The console summary at the end of a run: per table, the mean of its measured columns per layer."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

# What the console summary reports: per layer (and hook, role, call), the mean of these columns where present:
# the hooks table's, and those the method declares (`Method.summary_values`).
SUMMARY_KEYS = ("direction", "patch_method", "layer", "hook", "role", "call", "metric", "variant")
# A metric table's own measured columns (the evaluation table: a metric's value and its random-map baseline).
METRIC_SUMMARY_VALUES = ("value", "random_value")
HOOK_SUMMARY_VALUES = ("mean", "std", "frac_zero")


def summarise(paths: dict[str, Path], summary_values: tuple[str, ...]) -> None:
    """Log each table's per-layer means of `summary_values` (those the table has), layers in model order."""
    for table, path in paths.items():
        present = set(pq.read_schema(sorted(path.glob("part-*.parquet"))[0]).names)
        keys = [k for k in SUMMARY_KEYS if k in present]
        values = [v for v in (*summary_values, *METRIC_SUMMARY_VALUES) if v in present]
        if not values:
            log.info("%s: %d rows", table, sum(pq.read_metadata(p).num_rows for p in path.glob("part-*.parquet")))
            continue
        ordered = "layer_index" in present
        frame = pd.read_parquet(path, columns=keys + values + (["layer_index"] if ordered else []))
        summary = with_layer_order(frame).groupby(keys, observed=True)[values].mean()  # layers in model order
        with pd.option_context(
            "display.width", 200, "display.max_rows", 60, "display.max_columns", 20, "display.precision", 4
        ):
            log.info("%s (%d rows, per layer):\n%s", table, len(frame), summary)


def in_model_order(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """`frame` sorted stably by `keys`, `layer` in model order by `layer_index` (features.2 before features.10), so
    that `groupby(keys, sort=False)` lists groups in that order; as it is when it has no `layer_index` (older runs)."""
    if "layer" not in keys or "layer_index" not in frame.columns:
        return frame
    return frame.sort_values(["layer_index" if k == "layer" else k for k in keys], kind="stable", na_position="last")


def layers_in_model_order(frame: pd.DataFrame) -> list[str]:
    """The frame's distinct layers in model order: an ordered categorical's order (`with_layer_order`), else by
    `layer_index`. Across runs whose layer sets differ, the union by position in the model; where models differ
    (a sweep over models), a name's smallest position, equal positions in order of first appearance. Layers
    without a position come last, and a table without `layer_index` (older runs) keeps its order of appearance."""
    layers = frame["layer"]
    if isinstance(layers.dtype, pd.CategoricalDtype) and layers.cat.ordered:
        present = set(layers.dropna().unique())
        return [name for name in layers.cat.categories if name in present]
    names = list(pd.unique(layers.dropna()))  # in order of first appearance
    if "layer_index" not in frame.columns:
        return names
    position = frame.groupby("layer", sort=False, observed=True)["layer_index"].min()  # NaN: not a module
    first = {name: i for i, name in enumerate(names)}
    return sorted(names, key=lambda n: (pd.isna(position[n]), 0 if pd.isna(position[n]) else position[n], first[n]))


def with_layer_order(frame: pd.DataFrame, order: list[str] | None = None) -> pd.DataFrame:
    """`frame` with `layer` an ordered categorical in model order (`layers_in_model_order`, or `order`), so that
    groupby, sort_values and pivot list features.2 before features.10; as it is when it has no `layer`."""
    if "layer" not in frame.columns:
        return frame
    order = layers_in_model_order(frame) if order is None else order
    return frame.assign(layer=pd.Categorical(frame["layer"], categories=order, ordered=True))
