"""The id columns every table's rows start with: which run, model and method (`run_columns`), which sample
(`sample_columns`); their declared types are runner/tables.py's `RUN_FIELDS` and `SAMPLE_FIELDS`.

A method hands over its rows with a `sample_index` column (the row's sample within the batch, -1 for a row
about the whole batch); `rows_for` turns it into the sample's id columns on the writer thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from runner.data import NO_LABEL, Batch
from runner.methods import BatchOutput
from runner.provenance import swept_columns
from runner.results import Block, to_host
from runner.schema import RunConfig
from runner.stats import STAT_NAMES


def run_columns(config: RunConfig, run_id: str) -> dict[str, Any]:
    """The id columns that are the same on every row of a run: run, experiment, model, method, swept keys."""
    return {
        "run_id": run_id,
        "experiment": config.name,
        "model": config.model._target_ or config.model.name,
        "method": config.method.name,
        **swept_columns(config),
    }


def rows_for(
    part: tuple[Batch, BatchOutput, dict[str, Any] | None], id_columns: dict[str, Any], categories: list[str] | None
) -> Callable[[], list[tuple[str, dict[str, Any]]]]:
    """The writer thread's job for one batch: move rows to the host and add the identifier columns."""
    batch, output, recorded = part

    def produce() -> list[tuple[str, dict[str, Any]]]:
        samples = sample_columns(batch, output.predicted, categories)
        rows = [(table, with_ids(id_columns, samples, to_host(columns))) for table, columns in output.tables.items()]
        if recorded is not None:
            recorded["stats"] = Block(recorded.pop("stats"), list(STAT_NAMES))
            rows.append(("hooks", with_ids(id_columns, samples, to_host(recorded))))
        return rows

    return produce


def sample_columns(batch: Batch, predicted: torch.Tensor, categories: list[str] | None) -> dict[str, np.ndarray]:
    """Per-sample identifiers of a batch, moved to the host in one transfer."""
    host = torch.stack([batch.labels.to(predicted.device), predicted]).cpu().numpy()  # (2, B)
    names = [categories[p] if categories and 0 <= p < len(categories) else None for p in host[1]]
    return {
        "sample": np.arange(batch.first_index, batch.first_index + len(batch.sample_ids)),
        "sample_id": np.array(batch.sample_ids, dtype=object),
        "label": np.array([None if y == NO_LABEL else int(y) for y in host[0]], dtype=object),
        "predicted": host[1],
        "predicted_name": np.array(names, dtype=object),
    }


def with_ids(id_columns: dict[str, Any], samples: dict[str, np.ndarray], columns: dict[str, Any]) -> dict[str, Any]:
    """Identifier columns first (run, experiment, model, method, sample...), then the table's own."""
    local = np.asarray(columns.pop("sample_index"))
    rows = len(local)
    per_batch = local >= 0  # -1: a row about the whole batch (a tensor without a batch dimension)
    picked = np.where(per_batch, local, 0)
    ids: dict[str, Any] = {k: [v] * rows for k, v in id_columns.items()}
    for name, values in samples.items():
        column = values[picked].astype(object)
        column[~per_batch] = None
        ids[name] = column
    return {**ids, **columns}
