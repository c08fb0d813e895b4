"""The console summary at the end of a run: per table, the mean of its measured columns per layer."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from runner.frames import with_layer_order

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
