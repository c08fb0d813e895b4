"""Result frames in the model's order: a `layer` column as an ordered categorical, rows sorted by it. Foundation."""

from __future__ import annotations

import pandas as pd


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
