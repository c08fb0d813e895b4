"""`runner ls [DIR]`: every run and sweep under DIR (default outputs/), read from what runs leave on disk.

A run directory holds Hydra's `.hydra/` (config, overrides), the runner's manifests (`manifest*.json`:
the shards complete and each table's rows per shard) and the tables' part files; a sweep directory holds
`multirun.yaml` and one run directory per job. Status: complete; running (another process holds the
directory's lock); partial, k of n shards, with the command that resumes it; failed (the run's log has
an error), also with k of n and the resume command. Rows come from the part files' Parquet metadata
(no data read). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import RunnerError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, so no `running` status
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".runner.lock"  # runner.results.DirectoryLock's file


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
    for name in ("num_samples", "shard_samples"):
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


@dataclass
class RunInfo:
    """One run directory as `runner ls` shows it."""

    path: Path
    experiment: str
    overrides: list[str]
    status: str  # complete | running | partial | failed | damaged
    shards_done: int
    shards_total: int | None  # None when no manifest says how many samples there are
    tables: dict[str, int] = field(default_factory=dict)  # table -> rows in its listed part files
    error: str = ""  # the run's last error line (failed) or what is wrong with its files (damaged)
    # A manifest that is not one (`read_manifest`): the run refuses to resume from it, and `tables` are then the part
    # files' rows as they are, unchecked.
    manifest_error: str = ""
    bad_manifest: Path | None = None  # that manifest

    @property
    def resume_command(self) -> str:
        """The command that finishes this run in its own directory (complete shards are skipped)."""
        return shlex.join(["runner", *self.overrides, f"hydra.run.dir={self.path}"])

    @property
    def redo_command(self) -> str:
        """With a damaged manifest: the command that moves it aside and runs every shard again in place (the run
        refuses to resume from a manifest it cannot read, and without one it replaces the unlisted part files)."""
        assert self.bad_manifest is not None
        aside = self.bad_manifest.with_name(self.bad_manifest.name + ".damaged")  # out of the `manifest*.json` glob
        return f"{shlex.join(['mv', str(self.bad_manifest), str(aside)])} && {self.resume_command}"


@dataclass
class SweepInfo:
    """A sweep directory (`multirun.yaml`) and its jobs' runs."""

    path: Path
    overrides: list[str]
    jobs: list[RunInfo]
    jobs_total: int | None  # from the sweep's saved overrides; None if they cannot be read


def read_yaml(path: Path) -> Any:
    import yaml  # PyYAML, Hydra's own dependency

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _locked(directory: Path) -> bool:
    """Whether a live process holds the run's lock (the lock file of a killed run is not held)."""
    lock = directory / LOCK_NAME
    if fcntl is None or not lock.exists():
        return False
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)


def _last_error(directory: Path) -> str:
    """The last error line of the run's log files (Hydra names them after the job), or ''."""
    found = ""
    for log in sorted(directory.glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        errors = [line for line in lines if "][ERROR]" in line or line.startswith("[ERROR]")]
        if errors:
            found = errors[-1].split("[ERROR]", 1)[1].strip()
    return found


def _parquet_rows(path: Path) -> int | None:
    """A part file's row count from its footer, or None when it is missing or unreadable."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # missing (OSError), damaged (pyarrow's ArrowInvalid), or anything else: not countable
        return None


def run_info(directory: Path) -> RunInfo:
    """What `runner ls` says about one run directory."""
    config = read_yaml(directory / ".hydra" / "config.yaml") or {}
    overrides = read_yaml(directory / ".hydra" / "overrides.yaml") or []
    experiment = str(config.get("name", "?")) if isinstance(config, dict) else "?"
    info = RunInfo(directory, experiment, [str(o) for o in overrides], "partial", 0, None)
    manifests = sorted(directory.glob("manifest*.json"))
    complete = False
    done: set[str] = set()
    problems: list[str] = []
    for path in manifests:
        try:
            manifest = read_manifest(path)
        except RunnerError as e:
            info.manifest_error, info.bad_manifest = str(e).split(f" {MANIFEST_FIX}")[0], path
            break
        if path.name == "manifest.json":
            complete = bool(manifest.get("complete"))
            if info.experiment == "?":  # a run from Python (no .hydra/): the config's name is in the manifest
                info.experiment = str((manifest.get("resume_details") or {}).get("name", "?"))
            samples, per_shard = manifest.get("num_samples"), manifest.get("shard_samples")
            if isinstance(samples, int) and isinstance(per_shard, int) and per_shard > 0:
                info.shards_total = -(-samples // per_shard)
        for shard, tables in manifest["shards"].items():
            done.add(shard)
            for table, rows in tables.items():
                part = directory / f"{table}.parquet" / f"part-{int(shard):06d}.parquet"
                found = _parquet_rows(part)
                if found != rows:
                    problems.append(f"{table}.parquet/{part.name}: {'unreadable' if found is None else found} rows,"
                                    f" the manifest {rows}")  # fmt: skip
                info.tables[table] = info.tables.get(table, 0) + (found or 0)
    if info.manifest_error:  # nothing the manifests say can be trusted: the part files as they are
        problems = []  # row counts checked against the other manifests: moot without this one
        info.tables, info.shards_total, done = _part_files(directory, problems), None, set()
    info.shards_done = len(done)
    if _locked(directory):
        info.status = "running"
    elif problems or info.manifest_error:
        info.status, info.error = "damaged", "; ".join(p for p in [info.manifest_error, *problems] if p)
    elif complete:
        info.status = "complete"
    else:
        info.error = _last_error(directory)
        info.status = "failed" if info.error else "partial"
    return info


def _part_files(directory: Path, problems: list[str]) -> dict[str, int]:
    """Every table's rows in its part files (from their footers), unchecked by any manifest; unreadable parts
    are added to `problems`."""
    tables: dict[str, int] = {}
    for folder in sorted(directory.glob("*.parquet")):
        if not folder.is_dir():
            continue
        table = folder.name.removesuffix(".parquet")
        for part in sorted(folder.glob("part-*.parquet")):
            rows = _parquet_rows(part)
            if rows is None:
                problems.append(f"{folder.name}/{part.name} is unreadable")
            tables[table] = tables.get(table, 0) + (rows or 0)
    return tables


def is_run(directory: Path) -> bool:
    return (directory / ".hydra").is_dir() or any(directory.glob("manifest*.json"))


def sweep_jobs(directory: Path) -> list[list[str]] | None:
    """Every job's overrides in the sweep in `directory`, in job-number order (its saved multirun.yaml expanded as
    the basic sweeper does), or None when they cannot be known (an unreadable file, a sweeper of another kind)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        saved = OmegaConf.load(directory / "multirun.yaml")
        params = [f"{k}={v}" for k, v in (saved.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *saved.hydra.overrides.task])
        return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    except Exception:  # Hydra's parser raises several kinds; the caller then checks the jobs present only
        return None


def job_names(jobs: list[list[str]]) -> list[str]:
    """'#i (overrides)' per job, naming only the overrides that vary across the sweep (the others are all jobs')."""
    varying = [p for p in range(len(jobs[0])) if len({job[p] for job in jobs}) > 1] if jobs else []
    return [f"#{i} ({' '.join(job[p] for p in varying)})" if varying else f"#{i}" for i, job in enumerate(jobs)]


def job_number(directory: Path) -> int | None:
    """A sweep job's number: its folder's name (Hydra's default subdir), else the one its .hydra/hydra.yaml records."""
    if directory.name.isascii() and directory.name.isdigit():
        return int(directory.name)
    saved = read_yaml(directory / ".hydra" / "hydra.yaml")
    try:
        return int(saved["hydra"]["job"]["num"])
    except (TypeError, KeyError, ValueError):
        return None


def _sweep_jobs_total(directory: Path) -> int | None:
    """How many jobs the sweep has, or None."""
    jobs = sweep_jobs(directory)
    return None if jobs is None else len(jobs)


def find(root: Path) -> list[RunInfo | SweepInfo]:
    """Every run and sweep below `root` (root itself included), sorted by path."""
    if not root.is_dir():
        raise RunnerError(f"{root} is not a directory: `runner ls DIR` lists the runs under DIR (default outputs/).")
    found: list[RunInfo | SweepInfo] = []
    for current, folders, _ in os.walk(root):
        here = Path(current)
        folders[:] = sorted(f for f in folders if not f.startswith(".") and not f.endswith(".parquet"))
        if (here / "multirun.yaml").is_file():
            saved = read_yaml(here / "multirun.yaml") or {}
            overrides = (((saved.get("hydra") or {}).get("overrides") or {}).get("task") or []) if saved else []
            jobs = [run_info(here / f) for f in folders if is_run(here / f)]
            jobs.sort(
                key=lambda job: (not job.path.name.isdigit(), int(job.path.name) if job.path.name.isdigit() else 0)
            )
            found.append(SweepInfo(here, [str(o) for o in overrides], jobs, _sweep_jobs_total(here)))
            folders[:] = []
        elif is_run(here):
            found.append(run_info(here))
            folders[:] = []
    return found


def _status(run: RunInfo) -> str:
    if run.status in ("complete", "running"):
        return run.status
    if run.manifest_error:
        return "damaged manifest"
    total = "?" if run.shards_total is None else run.shards_total
    return f"{run.status}, {run.shards_done} of {total} shards"


def _run_lines(run: RunInfo, indent: str, show_overrides: list[str]) -> list[str]:
    tables = ", ".join(f"{name} {rows} rows" for name, rows in sorted(run.tables.items())) or "no tables"
    if run.manifest_error and run.tables:
        tables += " in its part files (unchecked: the manifest is damaged)"
    lines = [f"{indent}{run.path}  [{_status(run)}]  {run.experiment}: {tables}"]
    if show_overrides:
        lines.append(f"{indent}  overrides: {' '.join(show_overrides)}")
    if run.error:
        lines.append(f"{indent}  {'error' if run.status == 'failed' else 'problem'}: {run.error}")
    if run.manifest_error and run.status != "running":
        if run.tables:
            first = run.path / f"{min(run.tables)}.parquet"
            lines.append(f"{indent}  read: the part files read as they are, e.g. pandas.read_parquet({str(first)!r})")
        lines.append(f"{indent}  redo (the run does not resume from a damaged manifest): {run.redo_command}")
    elif run.status in ("partial", "failed", "damaged"):
        lines.append(f"{indent}  resume: {run.resume_command}")
    return lines


def format_listing(found: list[RunInfo | SweepInfo]) -> str:
    """The text `runner ls` prints."""
    lines: list[str] = []
    for item in found:
        if isinstance(item, RunInfo):
            lines += _run_lines(item, "", item.overrides)
            continue
        complete = sum(job.status == "complete" for job in item.jobs)
        total = "?" if item.jobs_total is None else item.jobs_total
        lines.append(
            f"{item.path}  [sweep: {complete} of {total} jobs complete]  overrides: {' '.join(item.overrides)}"
        )
        shared = set.intersection(*(set(job.overrides) for job in item.jobs)) if item.jobs else set()
        for job in item.jobs:  # each job by what sets it apart (the overrides all jobs share are the sweep's)
            lines += _run_lines(job, "  ", [o for o in job.overrides if o not in shared])
    return "\n".join(lines) if lines else "no runs"


def main(argv: list[str]) -> int:
    """`runner ls [DIR]`."""
    parser = argparse.ArgumentParser(prog="runner ls", description="Runs and sweeps under DIR: status, resume, tables.")
    parser.add_argument("dir", nargs="?", default="outputs", help="where to look (default: outputs/)")
    args = parser.parse_args(argv)
    found = find(Path(args.dir))
    print(format_listing(found))
    runs = [job for item in found for job in (item.jobs if isinstance(item, SweepInfo) else [item])]
    damaged = [str(run.bad_manifest) for run in runs if run.bad_manifest is not None]
    if damaged:  # listed above with what to do; the exit status says that something needs fixing
        print(f"[ERROR] damaged manifest(s), see 'redo:' above: {', '.join(damaged)}", file=sys.stderr)
        return 2
    return 0
