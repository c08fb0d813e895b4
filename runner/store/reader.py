"""Result rows -> Parquet: each table a folder of shard files (`<table>.parquet/part-<shard>.parquet`), and a manifest.

Methods hand over columns per batch, still on the device. The writer moves them to the host once
per batch (on a background thread), adds the identifier columns, holds them to the table's declared
schema (runner/tables.py: a missing, undeclared or mistyped column raises), and appends them as a row
group to the table's part file of the shard in progress, so memory stays flat in the data set's size.
A shard is a fixed range of samples: its part files are written under temporary names and renamed
together when it completes, and only then is it listed in the run's manifest (`manifest.json`, one per
rank, replaced atomically). A failed or killed run loses at most the shard in progress and leaves no
half table behind; run again on the same directory, it skips every listed shard whose files are intact.
A kill between the renames and the manifest's replacement leaves parts that no manifest lists: `load`
reads listed parts only, and the resumed run removes them before it runs their shard again.

Temporary files start with '.', so pandas, pyarrow.dataset and DuckDB (`read_parquet('DIR/t.parquet/*.parquet')`)
skip them while a run is live. One process writes a directory at a time (`DirectoryLock`). The manifest
is checked against the files on resume and in `load`: a missing or damaged shard is re-run, never dropped.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from runner.errors import RunnerError
from runner.frames import with_layer_order
from runner.store.layout import METADATA_KEY, expected_shards, part_path, read_manifest, shard_problems
from runner.store.runs import RunInfo  # torch-free there, for `runner ls`
from runner.tables import pandas_integer

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; the run goes on unlocked, with a warning
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


def read_part(path: Path) -> pd.DataFrame:
    """One part file as a DataFrame, each integer column pandas' nullable integer type (runner.tables
    `pandas_metadata`; also for files written before they said so), so that every run's columns have one type."""
    return pq.read_table(path).to_pandas(types_mapper=_nullable_integer)


def _nullable_integer(type_: pa.DataType) -> pd.api.extensions.ExtensionDtype | None:
    name = pandas_integer(type_)
    return pd.api.types.pandas_dtype(name) if name else None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The run's provenance stored in a table (a .parquet file or table folder): config, overrides, versions, commit."""
    path = Path(path)
    if path.is_dir():
        path = sorted(path.glob("part-*.parquet"))[0]
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}


def _checked_parts(folder: Path) -> tuple[list[Path], str | None]:
    """A table folder's part files, each checked against its run's manifests; and why the table is not the
    whole run (damaged or missing shards, or a run not finished), or None."""
    run_dir, table = folder.parent, folder.name.removesuffix(".parquet")
    manifests = sorted(run_dir.glob("manifest*.json"))
    if not manifests:
        return sorted(folder.glob("part-*.parquet")), f"{run_dir} has no manifest.json: its shards cannot be checked"
    entries: dict[int, dict[str, int]] = {}
    expected: int | None = None
    flags = []
    for path in manifests:
        manifest = read_manifest(path)
        flags.append(bool(manifest.get("complete")))
        expected = expected_shards(manifest) if expected is None else expected
        for key, entry in manifest["shards"].items():
            entries.setdefault(int(key), entry)
    parts, problems = [], []
    for shard in sorted(entries):
        if table not in entries[shard]:
            continue  # a complete shard without rows for this table
        bad = shard_problems(run_dir, shard, {table: entries[shard][table]})
        problems += bad
        if not bad:
            parts.append(part_path(run_dir, table, shard))
    finished = set(range(expected)) <= set(entries) if expected is not None else all(flags)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        return parts, f"{run_dir}: {shown}. Run the same command with hydra.run.dir={run_dir} to re-run those shards"
    if not finished:
        return parts, (
            f"{run_dir} holds an unfinished run ({len(entries)} of {expected if expected is not None else '?'} shards"
            f" complete): it is still running, or it stopped. Run the same command with hydra.run.dir={run_dir}"
            " to finish it"
        )
    return parts, None


def committed(run_dir: Path, table: str) -> pd.DataFrame | None:
    """The rows of `table` in the shards the run in `run_dir` has committed so far (every rank's), or None when it has
    none: what a method of several passes reads back between them (runner/app.py)."""
    folder = run_dir / f"{table}.parquet"
    parts = _checked_parts(folder)[0] if folder.is_dir() else []
    return pd.concat([read_part(p) for p in parts], ignore_index=True) if parts else None


def main_table(run_dir: Path) -> str | None:
    """The main table of the method that wrote the run in `run_dir` (its `Method.table`, kept in the manifest);
    for a run written before the manifest kept it, found from the method named in the tables' config; else None."""
    manifest_path = run_dir / "manifest.json"
    if manifest_path.is_file():
        named = read_manifest(manifest_path).get("main_table")
        if isinstance(named, str):
            return named
    try:
        import yaml  # PyYAML, Hydra's own dependency

        config = yaml.safe_load(read_metadata(next(run_dir.glob("*.parquet"))).get("config") or "{}")
        method = str(config["method"]["name"])
        from runner.options.registry import METHODS

        return METHODS.get(method).tables[0]
    except Exception:  # no table, no config, or a method this installation does not have: not known
        return None


def _main_folders(path: Path, folders: list[Path]) -> list[Path]:
    """Of the table folders under `path`, those of the runs' main table, when all runs have the same one."""
    names = sorted({f.name.removesuffix(".parquet") for f in folders})
    if len(names) <= 1:
        return folders
    mains = {main_table(run_dir) for run_dir in sorted({f.parent for f in folders})}
    if len(mains) == 1 and None not in mains:
        (main,) = mains
        return [f for f in folders if f.name == f"{main}.parquet"]
    known = sorted(m for m in mains if m is not None)
    why = f"its runs' main tables differ ({', '.join(known)})" if len(known) > 1 else "its runs' method is not known"
    raise RunnerError(f"{path} holds several tables ({', '.join(names)}) and {why}: pass table=NAME.")


def _sweep_notes(path: Path, noted: set[Path]) -> list[str]:
    """For every sweep at or under `path`, the jobs that are not complete: not started, failed, stopped or running
    (`runner ls`'s status of the job's folder), named by the overrides that set them apart; those in `noted` (whose
    tables' notes say it already) are named only."""
    from runner.store.runs import SweepInfo, find
    from runner.store.sweeps import job_names, job_number, sweep_jobs

    notes = []
    sweeps = [path] if (path / "multirun.yaml").is_file() else sorted(p.parent for p in path.rglob("multirun.yaml"))
    for sweep in sweeps:
        jobs = sweep_jobs(sweep)
        if jobs is None:
            continue  # a sweeper that is not the basic one: its jobs cannot be listed, only those present are checked
        names = job_names(jobs)
        found = {job_number(job.path): job for item in find(sweep) if isinstance(item, SweepInfo) for job in item.jobs}
        missing = []
        for number, name in enumerate(names):
            job = found.get(number)
            if job is None:
                missing.append(f"job {name} has not started")
            elif job.status != "complete":
                missing.append(f"job {name} {_job_state(job) if job.path not in noted else '(above)'}")
        if missing:
            complete = len(names) - len(missing)
            notes.append(
                f"sweep {sweep}: {complete} of {len(names)} jobs complete; {'; '.join(missing)}. Run the sweep's command"
                f" again with hydra.sweep.dir={sweep} to finish it (complete jobs are skipped)"
            )
    return notes


def _job_state(job: RunInfo) -> str:
    """How a sweep job that is not complete stands, in a few words (its error's first sentence)."""
    if job.status == "running":
        return "is still running"
    if job.status == "partial":
        total = "?" if job.shards_total is None else job.shards_total
        return f"stopped after {job.shards_done} of {total} shards" if job.shards_done else "has no complete shard yet"
    # The error without the sweep's own note on the failure (the jobs it left unrun: named here anyway).
    error = (job.manifest_error or job.error).split(" [sweep:")[0].rstrip(".")
    state = "failed" if job.status == "refused" else job.status  # refused: failed before writing anything
    return f"{state}: {error if len(error) <= 160 else error[:157] + '...'}"


def load(path: str | Path, table: str | None = None, partial: bool = False) -> pd.DataFrame:
    """One table as one DataFrame, from a run, a sweep, or a folder of sweeps.

    `path` may be a part file, a table folder (`cam.parquet/`), a run directory or any folder
    above runs; `table` picks the table, by default the runs' main table (their method's: `cam` for the CAM
    family, `patching`, `mprt`, ...). Parts are read one by one and concatenated by column name, so jobs whose
    swept columns differ still form one table (missing values are null). Every part is checked against its run's
    manifest, and a sweep's jobs against the jobs the sweep has: a run that is unfinished or has a missing or
    damaged shard, or a sweep job that failed, has not started or is still running, raises RunnerError naming
    them, unless `partial=True`, which reads what is complete and warns naming the rest.
    `layer` is an ordered categorical in model order (runner/viz/summary.py `with_layer_order`).
    """
    path = Path(path)
    if path.is_file():
        return with_layer_order(read_part(path))
    if path.name.endswith(".parquet") and path.is_dir():
        folders = [path]
    else:
        folders = sorted(p for p in path.rglob(f"{table or '*'}.parquet") if p.is_dir())
        if table is None:
            folders = _main_folders(path, folders)
    parts: list[Path] = []
    notes, noted = [], set()
    for folder in folders:
        found, note = _checked_parts(folder)
        if note:
            notes.append(note)
            noted.add(folder.parent)
        parts += found
    if path.is_dir() and not path.name.endswith(".parquet"):
        notes += _sweep_notes(path, noted)
    if notes and not partial:
        raise RunnerError(f"{'; '.join(notes)}; or pass partial=True to read what is complete.")
    if notes:
        warnings.warn(f"{'; '.join(notes)}; reading the complete shards only.", stacklevel=2)
    if not parts:
        raise FileNotFoundError(f"No {table or ''} results under {path}")
    return with_layer_order(pd.concat([read_part(p) for p in parts], ignore_index=True))
