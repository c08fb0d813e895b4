"""The id columns every table's rows start with: which run, model and method (`run_columns`), which sample
(`sample_columns`); their declared types are runner/tables.py's `RUN_FIELDS` and `SAMPLE_FIELDS`.

A method hands over its rows with a `sample_index` column (the row's sample within the batch, -1 for a row
about the whole batch); `rows_for` turns it into the sample's id columns on the writer thread, and names the
classes (`label_name`, `predicted_name`, and `target_name` in tables with a `target`) from `ClassNames`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import torch

from runner.data.base import NO_LABEL, Batch, label_classes
from runner.errors import RunnerError
from runner.host_copy import PLACEHOLDER, HostCopy, column_tensors, with_tensors
from runner.models import model_label
from runner.rows import BatchOutput, Block, to_host
from runner.schema import DataConfig, RunConfig
from runner.stats import STAT_NAMES
from runner.store.provenance import swept_columns
from runner.tables import SAMPLE_FIELDS, TARGET_NAME


@dataclass(frozen=True)
class ClassNames:
    """Names of classes by index: the model's outputs (predicted, target) and the data set's labels."""

    model: list[str] | None = None
    labels: list[str] | None = None

    @classmethod
    def of(cls, data: DataConfig, dataset: Any, model: list[str] | None) -> ClassNames:
        """`data.class_names`, else the data set's own (class folders), else the model's where labels are its classes."""
        own, model_labels = label_classes(dataset)
        if data.class_names is not None:
            given = list(data.class_names)
            if own is not None and len(given) != len(own):
                raise RunnerError(
                    f"data.class_names has {len(given)} names but the data set has {len(own)} classes"
                    f" ({', '.join(own[:10])}{', ...' if len(own) > 10 else ''}): give one name per class, in that order."
                )
            return cls(model, given)
        return cls(model, own if own is not None else model if model_labels else None)


def run_columns(config: RunConfig, run_id: str) -> dict[str, Any]:
    """The id columns that are the same on every row of a run: run, experiment, model, method, swept keys."""
    return {
        "run_id": run_id,
        "experiment": config.name,
        "model": model_label(config.model),  # timm:convnext_tiny, hf:<id>, torchvision:vgg16, target:pkg.Class
        "method": config.method.name,
        **swept_columns(config),
    }


def rows_for(
    part: tuple[Batch, BatchOutput, dict[str, Any] | None],
    id_columns: dict[str, Any],
    names: ClassNames,
    on_samples: Callable[[dict[str, np.ndarray]], None] | None = None,
    pack: bool = False,
) -> Callable[[], list[tuple[str, dict[str, Any]]]]:
    """The writer thread's job for one batch: move rows to the host and add the identifier columns.

    `pack`: every tensor of the batch (its tables' columns, labels and predictions) starts to the host here, in one
    copy (runner/host_copy.py), and the job waits for that copy; otherwise the job moves each column itself.
    `on_samples` gets the batch's sample id columns (on the writer thread), for rows written later
    (runner/shard_stats.py)."""
    batch, output, recorded = part
    first, sample_ids = batch.first_index, batch.sample_ids  # the job keeps these, not the batch's input
    tables = list(output.tables.items())
    if recorded is not None:
        recorded["stats"] = Block(recorded.pop("stats"), list(STAT_NAMES))
        tables.append(("hooks", recorded))
    tensors = [batch.labels, output.predicted, *(t for _, columns in tables for t in column_tensors(columns))]
    copy = None
    if pack:  # the job holds the host buffers and the columns' skeletons, not the batch's device tensors
        copy = HostCopy(tensors)
        tensors = []
        tables = [(table, with_tensors(columns, repeat(PLACEHOLDER))) for table, columns in tables]

    def produce() -> list[tuple[str, dict[str, Any]]]:
        host = iter(copy.wait() if copy is not None else tensors)
        labels, predicted = next(host), next(host)
        samples = sample_columns(first, sample_ids, labels, predicted, names)
        if on_samples is not None:
            on_samples(samples)
        return [
            (table, with_ids(id_columns, samples, with_target_names(to_host(with_tensors(columns, host)), names.model)))
            for table, columns in tables
        ]

    return produce


def run_rows(tables: dict[str, Any], id_columns: dict[str, Any]) -> Callable[[], list[tuple[str, dict[str, Any]]]]:
    """The writer thread's job for tables about the whole run (runner/methods/base.py `final_tables`): every row's
    sample_index is -1, so its sample columns are null."""
    none = {field.name: np.array([None], dtype=object) for field in SAMPLE_FIELDS}

    def produce() -> list[tuple[str, dict[str, Any]]]:
        return [(table, with_ids(id_columns, none, to_host(dict(columns)))) for table, columns in tables.items()]

    return produce


def sample_columns(
    first: int, sample_ids: Sequence[str], labels: torch.Tensor, predicted: torch.Tensor, names: ClassNames
) -> dict[str, np.ndarray]:
    """Per-sample identifiers of a batch whose first sample is `first` (`labels`, `predicted`: (B,) each), moved to
    the host in one transfer."""
    host = torch.stack([labels.to(predicted.device), predicted]).cpu().numpy()  # (2, B)
    return {
        "sample": np.arange(first, first + len(sample_ids)),
        "sample_id": np.array(sample_ids, dtype=object),
        "label": np.array([None if y == NO_LABEL else int(y) for y in host[0]], dtype=object),
        "label_name": name_column(host[0], names.labels),  # NO_LABEL (-1) is outside any list: null
        "predicted": host[1],
        "predicted_name": name_column(host[1], names.model),
    }


def name_column(indices: Sequence[int] | np.ndarray, names: list[str] | None) -> np.ndarray:
    """The name of each class index (object array); null without names or for an index outside them."""
    known = names or []
    return np.array([known[i] if 0 <= i < len(known) else None for i in np.asarray(indices).tolist()], dtype=object)


def with_target_names(columns: dict[str, Any], model_names: list[str] | None) -> dict[str, Any]:
    """A table's host columns with `target_name` (the model's name of each row's `target`) where it has a `target`."""
    if "target" in columns:
        columns[TARGET_NAME.name] = name_column(columns["target"], model_names)
    return columns


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
