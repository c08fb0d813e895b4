"""`runner ls [DIR]`: every run and sweep under DIR (default outputs/), read from what runs leave on disk.

A run directory holds Hydra's `.hydra/` (config, overrides), the runner's manifests (`manifest*.json`:
the shards complete and each table's rows per shard) and the tables' part files; a sweep directory holds
`multirun.yaml` and one run directory per job. Status: complete; running (another process holds the
directory's lock); partial, k of n shards, with the command that resumes it; failed (the run's log has
an error), also with k of n and the resume command. Rows come from the part files' Parquet metadata
(no data read). Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import RunnerError
from runner.store.layout import LOCK_NAME, MANIFEST_FIX, expected_shards, read_manifest, read_yaml
from runner.store.sweeps import _sweep_jobs_total

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, so no `running` status
    fcntl = None  # type: ignore[assignment]


@dataclass
class RunInfo:
    """One run directory as `runner ls` shows it."""

    path: Path
    experiment: str
    overrides: list[str]
    status: str  # complete | running | partial | failed | refused (stopped before any work) | damaged
    shards_done: int
    shards_total: int | None  # None when no manifest says how many samples there are
    tables: dict[str, int] = field(default_factory=dict)  # table -> rows in its listed part files
    error: str = ""  # the run's last error line (failed) or what is wrong with its files (damaged)
    # A manifest that is not one (`read_manifest`): the run refuses to resume from it, and `tables` are then the part
    # files' rows as they are, unchecked.
    manifest_error: str = ""
    bad_manifest: Path | None = None  # that manifest
    method: str = "?"  # the config's method.name
    model: str = "?"  # the config's model (source:name), as runs are grouped by
    finished: float | None = None  # when its complete manifest was written (seconds since the epoch)

    @property
    def debug(self) -> str:
        """The debug preset it ran under (`debug=tiny`), or ""."""
        return next((o for o in self.overrides if o.split("=", 1)[0].lstrip("+") == "debug"), "")

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
    method = config.get("method") if isinstance(config, dict) else None
    info = RunInfo(directory, experiment, [str(o) for o in overrides], "partial", 0, None)
    info.method = str(method.get("name", "?")) if isinstance(method, dict) else "?"
    model = config.get("model") if isinstance(config, dict) else None
    if isinstance(model, dict):
        info.model = f"{model.get('source') or '?'}:{model.get('name', '?')}"
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
            info.finished = path.stat().st_mtime if complete else None
            details = manifest.get("resume_details") or {}
            if info.experiment == "?":  # a run from Python (no .hydra/): the config's name is in the manifest
                info.experiment = str(details.get("name", "?"))
            if info.method == "?":
                info.method = str(details.get("method.name", "?"))
            info.shards_total = expected_shards(manifest)
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
        # an error before any manifest: the config or the data refused, nothing done; running it again as it was
        # would stop there again, so it is not a run to resume
        refused = info.error and not manifests
        info.status = "refused" if refused else "failed" if info.error else "partial"
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
