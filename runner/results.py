"""Result rows -> Parquet.

Methods hand over columns per batch, still on the device. The writer moves them to the host once
per batch, adds the identifier columns, and appends them to one Parquet file per table as a row
group, so memory stays flat in the data set's size. Files are written under a temporary name and
renamed only when the run completes: a failed or killed run leaves no half table behind.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

log = logging.getLogger(__name__)

# Identifier columns whose type must not depend on the first batch's values (nulls, small ints).
ID_TYPES = {
    "run_id": pa.string(),
    "experiment": pa.string(),
    "model": pa.string(),
    "method": pa.string(),
    "layer": pa.string(),
    "module_type": pa.string(),
    "hook": pa.string(),
    "role": pa.string(),
    "call": pa.int32(),
    "sample": pa.int64(),
    "sample_id": pa.string(),
    "label": pa.int64(),
    "predicted": pa.int64(),
    "predicted_name": pa.string(),
    "target": pa.int64(),
    "shape": pa.string(),
    "tensor_file": pa.string(),
    "tensor_key": pa.string(),
}
METADATA_KEY = b"runner"


@dataclass
class Block:
    """A (rows, k) tensor that becomes k named columns."""

    values: torch.Tensor
    names: list[str]


@dataclass
class Ragged:
    """A list column from one flat tensor: row i holds the next lengths[i] values."""

    values: torch.Tensor
    lengths: list[int]


def to_host(columns: dict[str, Any]) -> dict[str, Any]:
    """Move every tensor column to the host (numpy); expand blocks into named columns."""
    out: dict[str, Any] = {}
    for name, value in columns.items():
        if isinstance(value, Block):
            array = value.values.detach().cpu().numpy()
            for i, sub in enumerate(value.names):
                out[sub] = array[:, i]
        elif isinstance(value, Ragged):
            offsets = np.concatenate([[0], np.cumsum(value.lengths)]).astype(np.int32)
            out[name] = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(value.values.detach().float().cpu().numpy())
            )
        elif torch.is_tensor(value):
            out[name] = value.detach().cpu().numpy()
        else:
            out[name] = value
    return out


def _arrow(name: str, value: Any) -> pa.Array:
    if isinstance(value, pa.Array):
        return value
    return pa.array(value, type=ID_TYPES.get(name))


class TableWriter:
    """One Parquet file, appended by row groups, published by an atomic rename on `commit`."""

    def __init__(self, path: Path, metadata: dict[str, Any]) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.metadata = {METADATA_KEY: json.dumps(metadata, default=str).encode()}
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, columns: dict[str, Any]) -> None:
        table = pa.table({name: _arrow(name, value) for name, value in columns.items()})
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.tmp, table.schema.with_metadata(self.metadata))
        table = table.cast(self._writer.schema)  # later batches take the first batch's types
        self._writer.write_table(table)
        self.rows += table.num_rows

    def commit(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self.tmp.replace(self.path)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.tmp.unlink(missing_ok=True)


class ResultWriter:
    """All tables of a run, committed together when the run ends well, discarded when it fails."""

    def __init__(self, directory: Path, metadata: dict[str, Any]) -> None:
        self.directory = directory
        self.metadata = metadata
        self.tables: dict[str, TableWriter] = {}

    def write(self, table: str, columns: dict[str, Any]) -> None:
        if table not in self.tables:
            self.tables[table] = TableWriter(self.directory / f"{table}.parquet", self.metadata)
        self.tables[table].write(columns)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for writer in self.tables.values():
            writer.commit() if exc_type is None else writer.abort()

    @property
    def paths(self) -> dict[str, Path]:
        return {name: w.path for name, w in self.tables.items()}


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The run's provenance stored in a table: composed config, overrides, versions, git commit."""
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}


def load(path: str | Path, table: str | None = None) -> pd.DataFrame:
    """A results table as a DataFrame: a .parquet file, or every `<table>.parquet` under a folder."""
    path = Path(path)
    if path.is_file():
        return pd.read_parquet(path)
    pattern = f"{table}.parquet" if table else "*.parquet"
    files = sorted(path.rglob(pattern))
    if not files:
        raise FileNotFoundError(f"No {pattern} under {path}")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
