"""Result rows -> Parquet.

Methods hand over columns per batch, still on the device. The writer moves them to the host once
per batch, adds the identifier columns, and appends them to one Parquet file per table as a row
group, so memory stays flat in the data set's size. Files are written under a temporary name and
renamed only when the run completes: a failed or killed run leaves no half table behind.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
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
                # flags travel as 0/1 with the other statistics; they are stored as booleans
                out[sub] = array[:, i].astype(bool) if sub.endswith("nonfinite") else array[:, i]
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
        if self.path.parent.is_dir() and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()  # a table folder this run made and filled with nothing


class ShardedWriter:
    """A run's tables as folders of shard files, `<table>.parquet/part-<shard>.parquet`, written on a
    background thread.

    The main thread hands over a batch's rows as a function (`submit`); the writer thread calls it
    (moving the tensors to the host there, so the device never waits on the copy or the disk) and
    appends the rows. The queue holds at most `queue_size` batches: when the disk is slower than
    the device, `submit` blocks instead of letting memory grow.

    A shard is a fixed range of samples. Its tables are written under temporary names and renamed
    together when the shard is complete; only then is the shard added to the manifest (itself
    replaced atomically). A killed run therefore loses at most the shard in progress, and a run
    started again on the same directory skips every shard the manifests list. Each rank of a
    multi-process run keeps its own manifest, so ranks never write the same file.
    """

    def __init__(
        self, directory: Path, metadata: dict[str, Any], identity: dict[str, Any], rank: int = 0, queue_size: int = 4
    ) -> None:
        self.directory = directory
        self.metadata = metadata
        self.identity = identity  # what must match to resume: config hash, shard size, sample count
        self.rank = rank
        self.manifest_path = directory / ("manifest.json" if rank == 0 else f"manifest-rank{rank}.json")
        self._open: dict[str, TableWriter] = {}
        self._shard: int | None = None
        self._manifest = {**identity, "shards": {}, "complete": False}
        if self.manifest_path.exists():
            self._manifest = self._load(self.manifest_path)
        self._queue: queue.Queue[tuple[int, Callable[[], list[tuple[str, dict[str, Any]]]]] | None] = queue.Queue(
            maxsize=queue_size
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="runner-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                shard, produce = item
                if self._error is None:
                    for table, columns in produce():
                        self._write(shard, table, columns)
            except BaseException as e:  # handed to the main thread at its next submit or commit
                self._error = e
            finally:
                self._queue.task_done()

    def submit(self, produce: Callable[[], list[tuple[str, dict[str, Any]]]]) -> None:
        """Queue one batch: `produce()` returns (table, columns) pairs; it runs on the writer thread."""
        assert self._shard is not None, "begin_shard first"
        self._raise_if_failed()
        self._queue.put((self._shard, produce))  # blocks while the queue is full: memory stays bounded

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Stop the writer thread (after what is queued)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _load(self, path: Path) -> dict[str, Any]:
        manifest = json.loads(path.read_text())
        mismatched = [k for k, v in self.identity.items() if manifest.get(k) != v]
        if mismatched:
            from runner.errors import RunnerError

            raise RunnerError(
                f"{self.directory} holds results of a different run ({', '.join(mismatched)} differ), so it cannot be"
                " resumed. Use a new output directory, or the same config to finish that run."
            )
        return manifest

    def completed_shards(self) -> set[int]:
        """Shards complete in any rank's manifest."""
        done: set[int] = set()
        for path in sorted(self.directory.glob("manifest*.json")):
            done |= {int(s) for s in self._load(path)["shards"]}
        return done

    def begin_shard(self, shard: int) -> None:
        self._shard = shard
        self._open = {}

    def _write(self, shard: int, table: str, columns: dict[str, Any]) -> None:
        if table not in self._open:
            path = self.directory / f"{table}.parquet" / f"part-{shard:06d}.parquet"
            self._open[table] = TableWriter(path, self.metadata)
        self._open[table].write(columns)

    def commit_shard(self) -> None:
        self._queue.join()  # everything of this shard is written
        self._raise_if_failed()
        for writer in self._open.values():
            writer.commit()
        self._manifest["shards"][str(self._shard)] = {name: w.rows for name, w in self._open.items()}
        self._save()
        self._open, self._shard = {}, None

    def abort_shard(self) -> None:
        self._queue.join()
        self._error = None
        for writer in self._open.values():
            writer.abort()
        self._open, self._shard = {}, None

    def finish(self) -> None:
        self._manifest["complete"] = True
        self._save()

    def _save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._manifest, indent=1))
        tmp.replace(self.manifest_path)

    def tables(self) -> dict[str, Path]:
        """Every table folder in the directory (of this run and of the runs it resumed)."""
        return {p.name.removesuffix(".parquet"): p for p in sorted(self.directory.glob("*.parquet")) if p.is_dir()}


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The run's provenance stored in a table (a .parquet file or table folder): config, overrides, versions, commit."""
    path = Path(path)
    if path.is_dir():
        path = sorted(path.glob("part-*.parquet"))[0]
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}


def load(path: str | Path, table: str | None = None) -> pd.DataFrame:
    """One table as one DataFrame, from a run, a sweep, or a folder of sweeps.

    `path` may be a part file, a table folder (`cam.parquet/`), a run directory or any folder
    above runs; `table` picks the table (needed when the runs hold more than one kind). Parts are
    read one by one and concatenated by column name, so jobs whose swept columns differ still form
    one table (missing values are null).
    """
    path = Path(path)
    if path.is_file():
        return pd.read_parquet(path)
    if path.name.endswith(".parquet"):
        parts = sorted(path.glob("part-*.parquet"))
    else:
        folders = sorted(p for p in path.rglob(f"{table or '*'}.parquet") if p.is_dir())
        names = {f.name for f in folders}
        if len(names) > 1:
            raise ValueError(f"{path} holds several tables ({', '.join(sorted(names))}): pass table=NAME.")
        parts = [part for folder in folders for part in sorted(folder.glob("part-*.parquet"))]
    if not parts:
        raise FileNotFoundError(f"No {table or ''} results under {path}")
    return pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)
