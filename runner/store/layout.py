"""A run folder on disk: where each table's shards go, the manifest and its checks, the lock file's name. Imports no
torch (`runner ls` reads it)."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from runner.errors import RunnerError

METADATA_KEY = b"runner"


def temp_name(final: Path) -> Path:
    """A temporary path beside `final`, unique per writer; the leading '.' makes pyarrow, pandas and DuckDB's
    `*.parquet` glob skip it, and '.tmp' keeps it out of every `part-*.parquet` pattern."""
    return final.with_name(f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def part_path(directory: Path, table: str, shard: int) -> Path:
    """Where shard `shard` of `table` lives in a run directory."""
    return directory / f"{table}.parquet" / f"part-{shard:06d}.parquet"


LOCK_NAME = ".runner.lock"  # runner.store.writer.DirectoryLock's file


TABLE_NAME = re.compile(r"[A-Za-z0-9_]+")  # a table's folder is `<name>.parquet` beside the manifest, never elsewhere


def manifest_problem(manifest: Any) -> str | None:
    """What makes parsed JSON not a runner manifest (None when it is one): the shape every reader relies on,
    `{"config_hash": str, "shards": {"<shard>": {"<table>": rows}}, "complete": bool, ...}`."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__ if manifest is not None else 'null'}, not an object"
    if "shards" not in manifest:
        return f"no 'shards' entry ({', '.join(map(repr, list(manifest)[:4])) or 'an empty object'}): not a runner manifest"
    shards = manifest["shards"]
    if not isinstance(shards, dict):
        return f"'shards' is {json.dumps(shards)[:40]}, not an object"
    for key, entry in shards.items():
        if not (key.isascii() and key.isdigit()):
            return f"shard {key!r} is not a shard number"
        if not isinstance(entry, dict):
            return f"shard {key}'s entry is {json.dumps(entry)[:40]}, not {{table: rows}}"
        for table, rows in entry.items():
            if not TABLE_NAME.fullmatch(table):
                return f"shard {key} names a table {table!r}"
            if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
                return f"shard {key}'s {table} rows are {json.dumps(rows)[:40]}, not a row count"
    for name in ("num_samples", "shard_samples", "shards_total"):
        value = manifest.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            return f"'{name}' is {json.dumps(value)[:40]}, not a count"
    if not isinstance(manifest.get("config_hash"), str):
        return "no 'config_hash' entry: not a runner manifest"
    if not isinstance(manifest.get("complete", False), bool):
        return f"'complete' is {json.dumps(manifest['complete'])[:40]}, not true or false"
    main = manifest.get("main_table")
    if main is not None and not (isinstance(main, str) and TABLE_NAME.fullmatch(main)):
        return f"'main_table' is {json.dumps(main)[:40]}, not a table name"
    if not isinstance(manifest.get("resume_details", {}), dict):
        return "'resume_details' is not an object"
    return None


def expected_shards(manifest: dict[str, Any]) -> int | None:
    """How many shards the run writes: `shards_total` where the manifest says (a method of several passes over the
    data, runner/app.py, writes a set of shards per pass and one of its own), else one set over the samples."""
    total = manifest.get("shards_total")
    if isinstance(total, int):
        return total
    samples, per_shard = manifest.get("num_samples"), manifest.get("shard_samples")
    if isinstance(samples, int) and isinstance(per_shard, int) and per_shard > 0:
        return -(-samples // per_shard)
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """A run's manifest, checked to be one (`manifest_problem`); else a RunnerError saying it is damaged and what
    to do. The one reader of manifests: the run (resume), `load`, `runner ls` and `runner report` all use it."""
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem: str | None = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    else:
        problem = manifest_problem(manifest)
    if problem is not None:
        raise RunnerError(f"{path} is not a readable runner manifest ({problem}). {MANIFEST_FIX}")
    return manifest


def check_manifests(directory: Path) -> None:
    """Raise `read_manifest`'s RunnerError when a manifest of the run in `directory` is damaged."""
    for path in sorted(directory.glob("manifest*.json")):
        read_manifest(path)


# What to do about a damaged manifest (the run refuses to resume from it: its shards cannot be trusted).
MANIFEST_FIX = (
    "It was damaged or replaced: move it away to redo the run in that directory (every shard runs again),"
    " or use a new directory with hydra.run.dir=NEW_DIR."
)


def read_yaml(path: Path) -> Any:
    import yaml  # PyYAML, Hydra's own dependency

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def shard_problems(directory: Path, shard: int, entry: dict[str, int]) -> list[str]:
    """What is wrong with a shard's files against its manifest entry ({table: rows}): missing, unreadable,
    or another row count. Empty when the shard is intact."""
    problems = []
    for table, rows in entry.items():
        path = part_path(directory, table, shard)
        name = f"{path.parent.name}/{path.name}"
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        try:
            found = pq.read_metadata(path).num_rows  # the footer: a truncated file fails here
        except (OSError, ValueError, pa.ArrowException) as e:
            problems.append(f"{name} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            continue
        if found != rows:
            problems.append(f"{name} has {found} rows, the manifest {rows}")
    return problems


def check_output_arguments(argv: list[str]) -> None:
    """`hydra.run.dir=` / `hydra.sweep.dir=` on the command line that is a file or not writable: a RunnerError
    before Hydra trips on it (Hydra makes the directory and its log file before the run starts)."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        value = value.strip().strip("'\"")
        if sep and key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            check_writable(Path(value).expanduser(), key.lstrip("+"))


def check_writable(out: Path, key: str = "hydra.run.dir") -> None:
    """Fail before any work when results could not be written."""
    if out.exists() and not out.is_dir():
        raise RunnerError(f"Cannot write results to {out}: it is a file, not a directory. Choose another {key}=PATH.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-check-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunnerError(
            f"Cannot write results to {out} ({e.strerror or e}). Choose a writable directory with"
            f" {key}=PATH{' (or output.dir=PATH)' if key == 'hydra.run.dir' else ''}."
        ) from None
