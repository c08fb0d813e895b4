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
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import RunnerError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, so no `running` status
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".runner.lock"  # runner.results.DirectoryLock's file


def read_manifest(path: Path) -> dict[str, Any]:
    """A run's manifest, or a RunnerError saying it is damaged and what to do."""
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
            raise ValueError("no 'shards' entry")
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RunnerError(
            f"{path} is not a readable runner manifest ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
            " It was damaged or replaced: move it away to redo the run in that directory, or use a new directory"
            " with hydra.run.dir=NEW_DIR."
        ) from None
    return manifest


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

    @property
    def resume_command(self) -> str:
        """The command that finishes this run in its own directory (complete shards are skipped)."""
        return shlex.join(["runner", *self.overrides, f"hydra.run.dir={self.path}"])


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
            problems.append(str(e).split(" It was")[0])
            continue
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
    info.shards_done = len(done)
    if _locked(directory):
        info.status = "running"
    elif problems:
        info.status, info.error = "damaged", "; ".join(problems)
    elif complete:
        info.status = "complete"
    else:
        info.error = _last_error(directory)
        info.status = "failed" if info.error else "partial"
    return info


def is_run(directory: Path) -> bool:
    return (directory / ".hydra").is_dir() or any(directory.glob("manifest*.json"))


def _sweep_jobs_total(directory: Path) -> int | None:
    """How many jobs the sweep has (its saved overrides expanded as the basic sweeper does), or None."""
    try:
        from runner.__main__ import _sweep_jobs

        return len(_sweep_jobs(directory / "multirun.yaml"))
    except Exception:  # an unreadable multirun.yaml or a sweeper of another kind: the count is a courtesy
        return None


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
    total = "?" if run.shards_total is None else run.shards_total
    return f"{run.status}, {run.shards_done} of {total} shards"


def _run_lines(run: RunInfo, indent: str, show_overrides: list[str]) -> list[str]:
    tables = ", ".join(f"{name} {rows} rows" for name, rows in sorted(run.tables.items())) or "no tables"
    lines = [f"{indent}{run.path}  [{_status(run)}]  {run.experiment}: {tables}"]
    if show_overrides:
        lines.append(f"{indent}  overrides: {' '.join(show_overrides)}")
    if run.error:
        lines.append(f"{indent}  {'error' if run.status == 'failed' else 'problem'}: {run.error}")
    if run.status in ("partial", "failed", "damaged"):
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
    print(format_listing(find(Path(args.dir))))
    return 0
