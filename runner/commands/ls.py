"""`runner ls [DIR] [--all]`: the runs and sweeps under a folder with their state and what to do next.

By default one line per experiment (its method, how many runs in each state, the latest complete run's folder) and
one per sweep; below them, each run or job that needs something (partial, failed, damaged, running) with the command that
resumes or redoes it, so a folder of many finished runs reads at a glance. `--all` lists every run: its tables and
row counts, its overrides, and a sweep's jobs each by the overrides that set it apart.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from runner.store.runs import RunInfo, SweepInfo, find

MAX_ERROR = 160  # characters of a run's error in the short listing (`--all` shows it whole)


def _status(run: RunInfo) -> str:
    if run.status in ("complete", "running"):
        return run.status + (f", {run.debug}" if run.debug else "")
    if run.status == "refused":
        return "refused: stopped before any work"
    if run.manifest_error:
        return "damaged manifest"
    total = "?" if run.shards_total is None else run.shards_total
    return f"{run.status}, {run.shards_done} of {total} shards"


def _todo_lines(run: RunInfo, indent: str, short: bool = False) -> list[str]:
    """What to do about a run that is not complete: its error and the command that resumes or redoes it."""
    lines = []
    if run.error:
        error = run.error if not short or len(run.error) <= MAX_ERROR else run.error[: MAX_ERROR - 3] + "..."
        lines.append(f"{indent}  {'error' if run.status in ('failed', 'refused') else 'problem'}: {error}")
    if run.manifest_error and run.status != "running":
        if run.tables:
            first = run.path / f"{min(run.tables)}.parquet"
            lines.append(f"{indent}  read: the part files read as they are, e.g. pandas.read_parquet({str(first)!r})")
        lines.append(f"{indent}  redo (the run does not resume from a damaged manifest): {run.redo_command}")
    elif run.status in ("partial", "failed", "damaged"):
        lines.append(f"{indent}  resume: {run.resume_command}")
    elif run.status == "refused":
        lines.append(f"{indent}  nothing was written: change what the error names and run again (as it was, it would"
                     " stop there again)")  # fmt: skip
    return lines


def _run_lines(run: RunInfo, indent: str, show_overrides: list[str]) -> list[str]:
    tables = ", ".join(f"{name} {rows} rows" for name, rows in sorted(run.tables.items())) or "no tables"
    if run.manifest_error and run.tables:
        tables += " in its part files (unchecked: the manifest is damaged)"
    lines = [f"{indent}{run.path}  [{_status(run)}]  {run.experiment}: {tables}"]
    if show_overrides:
        lines.append(f"{indent}  overrides: {' '.join(show_overrides)}")
    return lines + _todo_lines(run, indent)


def _sweep_header(sweep: SweepInfo) -> str:
    complete = sum(job.status == "complete" for job in sweep.jobs)
    total = "?" if sweep.jobs_total is None else sweep.jobs_total
    return f"{sweep.path}  [sweep: {complete} of {total} jobs complete]  overrides: {' '.join(sweep.overrides)}"


def _job_overrides(sweep: SweepInfo) -> list[list[str]]:
    """Each job's overrides that set it apart (those every job shares are the sweep's)."""
    shared = set.intersection(*(set(job.overrides) for job in sweep.jobs)) if sweep.jobs else set()
    return [[o for o in job.overrides if o not in shared] for job in sweep.jobs]


def full_listing(found: list[RunInfo | SweepInfo]) -> str:
    """`runner ls --all`: every run with its tables and overrides, every sweep with all its jobs."""
    lines: list[str] = []
    for item in found:
        if isinstance(item, RunInfo):
            lines += _run_lines(item, "", item.overrides)
            continue
        lines.append(_sweep_header(item))
        for job, own in zip(item.jobs, _job_overrides(item), strict=True):
            lines += _run_lines(job, "  ", own)
    return "\n".join(lines) if lines else "no runs"


def _counts(runs: list[RunInfo]) -> str:
    """'[complete]' when every run is, else '[3 complete, 1 partial]' (the states in a fixed order)."""
    states = Counter("damaged manifest" if run.manifest_error else run.status for run in runs)
    if set(states) == {"complete"}:
        return "[complete]"
    order = ("complete", "running", "partial", "failed", "refused", "damaged", "damaged manifest")
    return "[" + ", ".join(f"{states[s]} {s}" for s in order if states[s]) + "]"


def _group_name(experiment: str, model: str, method: str) -> str:
    """'ioi_smollm2 (hf_lm:smollm2-135m, lm_patching)': what a group of runs is, the unknown parts left out."""
    known = [part for part in (model, method) if part not in ("?", "?:?")]
    return f"{experiment} ({', '.join(known)})" if known else experiment


def short_listing(found: list[RunInfo | SweepInfo], root: Path | None = None) -> str:
    """`runner ls`: one line per experiment and per sweep, and below them only the runs and jobs that need
    something, each with what to do."""
    runs = [item for item in found if isinstance(item, RunInfo)]
    sweeps = [item for item in found if isinstance(item, SweepInfo)]
    if not found:
        return "no runs"
    groups: dict[tuple[str, str, str], list[RunInfo]] = {}
    for run in runs:
        groups.setdefault((run.experiment, run.model, run.method), []).append(run)
    names = {key: _group_name(*key) for key in groups}
    width = max((len(n) for n in names.values()), default=0)
    lines = []
    for key, members in sorted(groups.items()):
        count = f"{len(members)} run{'s' if len(members) != 1 else ''}"
        complete = [r for r in members if r.status == "complete"]
        latest = max(complete, key=lambda r: (r.finished or 0.0, str(r.path))) if complete else None  # last finished
        shown = f"  latest complete: {latest.path}" if latest is not None else ""
        if latest is not None and latest.debug:
            shown += f" ({latest.debug})"
        lines.append(f"{names[key]:<{width}}  {count:>8} {_counts(members)}{shown}")
        for run in members:
            if run.status != "complete":
                lines.append(f"  {run.path}  [{_status(run)}]")
                lines += _todo_lines(run, "  ", short=True)
    for sweep in sweeps:
        lines.append(_sweep_header(sweep))
        for job, own in zip(sweep.jobs, _job_overrides(sweep), strict=True):
            if job.status != "complete":
                lines.append(f"  {job.path}  [{_status(job)}]  {' '.join(own)}".rstrip())
                lines += _todo_lines(job, "  ", short=True)
    jobs = sum(len(s.jobs) for s in sweeps)
    where = f" under {root}" if root is not None else ""
    head = f"{len(runs)} run{'s' if len(runs) != 1 else ''} and {len(sweeps)} sweep{'s' if len(sweeps) != 1 else ''}"
    head += (f" ({jobs} jobs){where}, by experiment (model, method); `runner ls --all` lists each run's tables and"
             " overrides.")  # fmt: skip
    return "\n".join([head, *lines])


def format_listing(found: list[RunInfo | SweepInfo], full: bool = False, root: Path | None = None) -> str:
    """The text `runner ls` prints: the short listing, or every run (`full`)."""
    return full_listing(found) if full else short_listing(found, root)


def main(argv: list[str]) -> int:
    """`runner ls [DIR] [--all]`."""
    parser = argparse.ArgumentParser(
        prog="runner ls",
        description="Runs and sweeps under DIR: one line per experiment and per sweep, and the runs that need"
        " something (partial, failed, damaged, running) with the command that resumes them.",
    )
    parser.add_argument("dir", nargs="?", default="outputs", help="where to look (default: outputs/)")
    parser.add_argument(
        "--all", "-a", action="store_true", help="every run: its tables and row counts, overrides, a sweep's jobs"
    )
    args = parser.parse_args(argv)
    found = find(Path(args.dir))
    print(format_listing(found, full=args.all, root=Path(args.dir)))
    runs = [job for item in found for job in (item.jobs if isinstance(item, SweepInfo) else [item])]
    damaged = [str(run.bad_manifest) for run in runs if run.bad_manifest is not None]
    if damaged:  # listed above with what to do; the exit status says that something needs fixing
        print(f"[ERROR] damaged manifest(s), see 'redo:' above: {', '.join(damaged)}", file=sys.stderr)
        return 2
    return 0
