"""The console summary at the end of a run: per table, the mean of its measured columns per layer."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from runner.frames import with_layer_order
from runner.tables import presentation

log = logging.getLogger(__name__)


def summarise(paths: dict[str, Path], extra_values: dict[str, tuple[str, ...]] | None = None) -> None:
    """Log each table's per-layer means of its declared summary values (runner.tables.Presentation; `extra_values`
    adds columns per table, a method's `summary_values`), by layer and the declared keys, layers in model order."""
    for table, path in paths.items():
        present = set(pq.read_schema(sorted(path.glob("part-*.parquet"))[0]).names)
        shown = presentation(table)
        keys = [k for k in ("layer", *shown.keys) if k in present]
        wanted = dict.fromkeys((*(extra_values or {}).get(table, ()), *shown.values))
        values = [v for v in wanted if v in present]
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
