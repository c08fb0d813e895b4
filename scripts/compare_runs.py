"""Whether two folders of runs wrote the same tables, bit for bit: every Parquet table of every run folder under A
against the same run's under B (the provenance columns that differ between any two runs left out), and the EAP-IG
graph files byte for byte. For a refactor that must not move a number: run the same commands before and after into
two folders, then

    .venv/bin/python scripts/compare_runs.py BEFORE AFTER

prints each table that differs (its run, name and columns) and exits 1 if any does."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

PROVENANCE = ("run_id", "created", "elapsed", "seconds")  # columns that differ between any two runs


def same_column(x: pd.Series, y: pd.Series) -> bool:
    """Equal values in order, NaN equal to NaN, list cells compared element by element."""
    if x.equals(y):
        return True
    for u, v in zip(x, y, strict=True):
        if isinstance(u, np.ndarray | list) or isinstance(v, np.ndarray | list):
            if not np.array_equal(np.asarray(u), np.asarray(v), equal_nan=True):
                return False
        elif not (u == v or (isinstance(u, float) and isinstance(v, float) and np.isnan(u) and np.isnan(v))):
            return False
    return True


def differences(before: Path, after: Path) -> list[str]:
    """One line per table (or graph file) of `before`'s runs that `after` does not reproduce."""
    found = []
    for run in sorted(p for p in before.iterdir() if p.is_dir()):
        for table in sorted(run.glob("*.parquet")):
            other = after / run.name / table.name
            if not other.exists():
                found.append(f"{run.name}/{table.name}: missing after")
                continue
            a, b = (pd.read_parquet(t) for t in (table, other))
            a, b = (f.drop(columns=[c for c in PROVENANCE if c in f.columns]) for f in (a, b))
            if list(a.columns) != list(b.columns) or len(a) != len(b):
                found.append(f"{run.name}/{table.name}: shape {a.shape} against {b.shape}")
                continue
            columns = [c for c in a.columns if not same_column(a[c], b[c])]
            if columns:
                found.append(f"{run.name}/{table.name}: {', '.join(columns)}")
        for graph in sorted(run.glob("*.json")):
            other = after / run.name / graph.name
            if graph.name != "manifest.json" and (not other.exists() or graph.read_bytes() != other.read_bytes()):
                found.append(f"{run.name}/{graph.name}: differs")
    return found


if __name__ == "__main__":
    before, after = (Path(a) for a in sys.argv[1:3])
    lines = differences(before, after)
    print("\n".join(lines) or f"every table of {before}'s runs equal in {after}, bit for bit")
    sys.exit(1 if lines else 0)
