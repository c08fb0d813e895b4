"""`runner ls [DIR]`: the runs and sweeps under a folder, one line each, with their state and what to do next."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.store.runs import RunInfo, SweepInfo, find


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
