"""Writing a run's tables: the directory lock, one Parquet file per (table, shard) published by an atomic rename,
the manifest that says which shards are complete, and the one-line message for a disk that refuses a write."""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from runner.errors import RunnerError
from runner.store.layout import LOCK_NAME, METADATA_KEY, part_path, read_manifest, shard_problems, temp_name
from runner.tables import SchemaError, conform, pandas_metadata, presentation

try:
    import fcntl
except ImportError:  # pragma: no cover  (Windows: no advisory locks)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# Write failures that the user fixes (free space, permissions), reported as one message instead of a traceback.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def write_failure(error: BaseException, directory: Path) -> RunnerError | None:
    """A clear error for a write that failed for a reason the user can fix (disk full, quota, read-only,
    permissions; from pyarrow, safetensors or Python), else None."""
    text = str(error)
    filename = getattr(error, "filename", None)
    elsewhere = filename is not None and not Path(os.fsdecode(filename)).resolve().is_relative_to(directory.resolve())
    if isinstance(error, OSError) and elsewhere:
        return None  # e.g. an input file that became unreadable: not a write failure
    if isinstance(error, OSError) and error.errno in WRITE_ERRNOS:
        reason = error.strerror or os.strerror(error.errno)
    elif isinstance(error, OSError) and any(os.strerror(e) in text for e in WRITE_ERRNOS):
        reason = next(os.strerror(e) for e in WRITE_ERRNOS if os.strerror(e) in text)  # pyarrow: errno only in text
    elif type(error).__name__ == "SafetensorError" and ("StorageFull" in text or "No space left" in text):
        reason = os.strerror(errno.ENOSPC)
    elif type(error).__name__ == "SafetensorError" and ("PermissionDenied" in text or "ReadOnly" in text):
        reason = "read-only or not writable"
    else:
        return None
    return RunnerError(
        f"Cannot write results to {directory}: {reason}. No temporary file is left; the complete shards are kept."
        f" Free space (or fix the permissions) and run the same command with hydra.run.dir={directory} to resume."
    )


class DirectoryLock:
    """One writer per output directory: an exclusive `flock` on `DIR/.runner.lock`.

    The operating system drops the lock when the process ends, however it ends (kill -9 too), so a
    killed run never leaves the directory stuck. The file names its holder, for the refusal message.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunnerError naming the run that holds it."""
        if fcntl is None:  # pragma: no cover
            log.warning("no file locking on this platform: make sure only one run writes to %s", self.directory)
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunnerError(
                        f"{self.directory} is in use by another run ({self._holder()}); two runs writing one"
                        " directory would corrupt its results. Wait for that run to finish (then run this command"
                        " again to resume or check it), or give this run its own directory with hydra.run.dir=NEW_DIR."
                    ) from None
                log.warning("cannot lock %s (%s): make sure only one run writes to it", self.directory, e.strerror)
                return
            # The holder removes the file on release; a lock taken on a file just removed locks nothing.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode())
        self._fd = fd

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip() or "a process"
        except OSError:
            return "a process"

    def release(self) -> None:
        """Drop the lock and remove the file (the directory is left as the run left it)."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: a waiting run then retries on a new file
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TableWriter:
    """One Parquet file of table `table`, appended by row groups, published by an atomic rename on `commit`.

    Every batch is held to the table's declared schema (`runner.tables.conform`); the first batch fixes which
    optional and swept columns the file has, and every later batch must have the same."""

    def __init__(self, path: Path, metadata: dict[str, Any], table: str) -> None:
        self.path = path
        self.table = table
        self.tmp = temp_name(path)
        self.metadata = {METADATA_KEY: json.dumps(metadata, default=str).encode()}
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, columns: dict[str, Any]) -> None:
        table = conform(self.table, columns)  # the declared types, or SchemaError naming the column
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            metadata = {**pandas_metadata(table.schema), **self.metadata}  # integer columns read as pandas Int64
            self._writer = pq.ParquetWriter(self.tmp, table.schema.with_metadata(metadata))
        elif not table.schema.equals(self._writer.schema):
            first, now = self._writer.schema, table.schema
            differ = sorted(set(first.names) ^ set(now.names)) or [
                n for n in now.names if now.field(n).type != first.field(n).type
            ]
            raise SchemaError(
                f"table '{self.table}': a batch's columns differ from the first batch's in {', '.join(differ)}"
                " (an optional or swept column must be in every batch or in none)"
            )
        self._writer.write_table(table)
        self.rows += table.num_rows

    def commit(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
                self.tmp.replace(self.path)
            except BaseException:
                self.tmp.unlink(missing_ok=True)
                raise
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError:
                pass  # a full disk fails the close too; the file is removed below either way
            self._writer = None
        self.tmp.unlink(missing_ok=True)
        if self.path.parent.is_dir() and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()  # a table folder this run made and filled with nothing


class ShardedWriter:
    """A run's tables as folders of shard files, `<table>.parquet/part-<shard>.parquet`, written on a
    background thread.

    The main thread hands over a batch's rows as a function (`submit`); the writer thread calls it
    (which moves the tensors to the host there, or on CUDA waits for the batch's one copy that the
    main thread started, runner/host_copy.py: the device never waits on the copy or the disk) and
    appends the rows. The queue holds at most `queue_size` batches: when the disk is slower than
    the device, `submit` blocks instead of letting memory grow.

    A shard is a fixed range of samples. Its tables are written under temporary names and renamed
    together when the shard is complete; only then is the shard added to the manifest (itself
    replaced atomically). A killed run therefore loses at most the shard in progress, and a run
    started again on the same directory skips every shard the manifests list whose files are intact
    (`resume`). Each rank of a multi-process run keeps its own manifest, so ranks never write the
    same file.
    """

    def __init__(
        self,
        directory: Path,
        metadata: dict[str, Any],
        resume_key: dict[str, Any],
        rank: int = 0,
        queue_size: int = 4,
        details: dict[str, Any] | None = None,
        layer_order: dict[str, int] | None = None,
        main_table: str | None = None,
        shards_total: int | None = None,
    ) -> None:
        self.directory = directory
        # Module name -> position in model order (runner.layers.layer_order): the `layer_index` of rows with a `layer`.
        self.layer_order = layer_order or {}
        self.metadata = metadata
        self.resume_key = resume_key  # what must match to resume: config hash, inputs, shard size, sample count
        # The values behind the resume key (flat config keys, input fingerprints), kept in the manifest so that
        # a refused resume can name the keys that differ.
        self.details = json.loads(json.dumps(details or {}, default=str))
        self.rank = rank
        self.manifest_path = directory / ("manifest.json" if rank == 0 else f"manifest-rank{rank}.json")
        self._open: dict[str, TableWriter] = {}
        self._shard: int | None = None
        self._manifest = {**resume_key, "resume_details": self.details, "shards": {}, "complete": False}
        if self.manifest_path.exists():
            self._manifest = self._load(self.manifest_path)
        if shards_total is not None:  # a method of several passes: more shards than one set over the samples
            self._manifest["shards_total"] = shards_total
        if main_table is not None:  # the method's main table (`Method.table`): what `load(dir)` returns by default
            self._manifest["main_table"] = main_table
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
        manifest = read_manifest(path)
        mismatched = [k for k, v in self.resume_key.items() if manifest.get(k) != v]
        if mismatched:
            raise RunnerError(
                f"{self.directory} holds results of a different run, so it cannot be resumed; what differs:"
                f" {self._differences(manifest, mismatched)}. Use a new output directory (hydra.run.dir=NEW_DIR),"
                " or the same config and inputs to finish that run."
            )
        return manifest

    def _differences(self, manifest: dict[str, Any], mismatched: list[str]) -> str:
        """'key: old -> new' for each differing config key or input (the resume key's names for old manifests)."""
        old = manifest.get("resume_details")
        if not isinstance(old, dict) or not self.details:
            return ", ".join(mismatched)
        missing = object()
        keys = sorted(k for k in {*old, *self.details} if old.get(k, missing) != self.details.get(k, missing))
        keys += [k for k in mismatched if k not in ("config_hash", "inputs") and k not in keys]
        if not keys:
            return ", ".join(mismatched)

        def show(value: Any) -> str:
            text = "(unset)" if value is missing else json.dumps(value, default=str)
            return text if len(text) <= 40 else text[:37] + "..."

        def value(source: dict[str, Any], key: str) -> Any:
            return source.get(key, manifest.get(key, missing) if source is old else self.resume_key.get(key, missing))

        shown = [f"{k}: {show(value(old, k))} -> {show(value(self.details, k))}" for k in keys[:8]]
        return "; ".join(shown) + (f"; and {len(keys) - 8} more" if len(keys) > 8 else "")

    def completed_shards(self) -> set[int]:
        """Shards listed as complete in any rank's manifest (without checking their files: see `resume`)."""
        done: set[int] = set()
        for path in sorted(self.directory.glob("manifest*.json")):
            done |= {int(s) for s in self._load(path)["shards"]}
        return done

    def resume(self) -> set[int]:
        """The shards complete in any rank's manifest whose files are intact (present, readable, the row count
        the manifest says). A damaged shard of this rank's manifest is dropped from it and its files removed,
        so it runs again; it is never silently left out of the table."""
        done: set[int] = set()
        changed = False
        for path in sorted(self.directory.glob("manifest*.json")):
            manifest = self._manifest if path == self.manifest_path else self._load(path)
            for key, entry in list(manifest["shards"].items()):
                problems = shard_problems(self.directory, int(key), entry)
                if not problems:
                    done.add(int(key))
                    continue
                log.warning("shard %s of %s is damaged (%s): it runs again", key, self.directory, "; ".join(problems))
                if path == self.manifest_path:
                    del self._manifest["shards"][key]
                    self._manifest["complete"] = False
                    for table in entry:
                        part_path(self.directory, table, int(key)).unlink(missing_ok=True)
                    changed = True
        if changed:
            self._save()
        return done

    def begin_shard(self, shard: int) -> None:
        # Left by a killed run (one writer per directory, so none is live): temporaries, and part files renamed
        # into place just before the kill but never listed in a manifest. Readers skip both; the shard runs anew.
        for stale in self.directory.glob(f"*.parquet/.part-{shard:06d}.parquet.*.tmp"):
            stale.unlink(missing_ok=True)
        for orphan in self.directory.glob(f"*.parquet/part-{shard:06d}.parquet"):
            orphan.unlink(missing_ok=True)
        self._shard = shard
        self._open = {}

    def _write(self, shard: int, table: str, columns: dict[str, Any]) -> None:
        if "layer" in columns and "layer_index" not in columns:  # added here once, for every table with a layer
            names = columns["layer"]
            names = names.to_pylist() if isinstance(names, (pa.Array, pa.ChunkedArray)) else names
            columns["layer_index"] = pa.array([self.layer_order.get(name) for name in names], pa.int64())
        if table not in self._open:
            self._open[table] = TableWriter(part_path(self.directory, table, shard), self.metadata, table)
        self._open[table].write(columns)

    def commit_shard(self) -> None:
        self._queue.join()  # everything of this shard is written
        self._raise_if_failed()
        committed: list[Path] = []
        try:
            for writer in self._open.values():
                writer.commit()
                committed.append(writer.path)
            self._manifest["shards"][str(self._shard)] = {name: w.rows for name, w in self._open.items()}
            # How each table is summarised and drawn (declared with it): `runner report` reads it from here.
            presented = self._manifest.setdefault("tables", {})
            presented.update({name: presentation(name).as_dict() for name in self._open if name not in presented})
            self._save()
        except BaseException:
            for path in committed:  # a shard is all of its tables or none of them
                path.unlink(missing_ok=True)
            self._manifest["shards"].pop(str(self._shard), None)
            raise
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
        tmp = temp_name(self.manifest_path)
        try:
            tmp.write_text(json.dumps(self._manifest, indent=1))
            tmp.replace(self.manifest_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def tables(self) -> dict[str, Path]:
        """Every table folder in the directory (of this run and of the runs it resumed)."""
        return {p.name.removesuffix(".parquet"): p for p in sorted(self.directory.glob("*.parquet")) if p.is_dir()}
