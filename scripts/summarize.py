"""Per-layer summary of a run's (or a sweep's) tables.

python scripts/summarize.py outputs/2026-11-22/10-00-00_default
python scripts/summarize.py outputs/multirun/2026-11-22/10-00-00 --table gradcam
python scripts/summarize.py RUN --intervals                    # each mean with its bootstrap 95% interval
python scripts/summarize.py RUN --paired method gradcam layercam --value deletion_auc   # a paired test per layer
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from runner.analysis import paired_test, summarise
from runner.frames import in_model_order
from runner.store.reader import load

VALUES = {
    "cam": ["score", "cam_mean", "cam_max", "cam_frac_zero"],
    "hooks": ["mean", "std", "min", "max", "frac_zero"],
    "hook_check": ["max_abs_diff"],
    "patching": ["clean", "corrupted", "patched", "restoration"],
    "sanity": ["spearman"],
    "cam_vs_patching": ["spearman"],
}
KEYS = {
    "cam": ["method", "layer"],
    "hooks": ["layer", "hook", "role", "call"],
    "hook_check": ["layer", "call"],
    "patching": ["direction", "patch_method", "layer"],
    "sanity": ["layer"],
    "cam_vs_patching": ["direction", "layer", "cam_method"],
}


def summarize(path: Path, table: str) -> pd.DataFrame:
    """Mean of each value column per layer (and per hook/role/call for hooks), over samples and runs."""
    keys = ["experiment", *KEYS[table]]
    frame = in_model_order(load(path, table), keys)  # layers in model order: features.2 before features.10
    return frame.groupby(keys, sort=False, observed=True)[VALUES[table]].mean()


def summarize_intervals(path: Path, table: str, n_boot: int, seed: int) -> pd.DataFrame:
    """Per layer (as `summarize`): each value's mean over samples, its bootstrap 95% interval, and n samples."""
    keys = ["experiment", *KEYS[table]]
    frame = in_model_order(load(path, table), keys)
    out = None
    for value in VALUES[table]:
        part = summarise(frame, value, by=keys, n_boot=n_boot, seed=seed).set_index(keys)
        part = part.rename(columns={"mean": value, "ci_low": f"{value}_low", "ci_high": f"{value}_high"})
        out = part if out is None else out.join(part.drop(columns="n"))
    return out


def paired(path: Path, table: str, between: list[str], value: str, n_boot: int, seed: int) -> pd.DataFrame:
    """Per layer: a - b of `between` = COLUMN A B on the samples that have both (mean, interval, p-values)."""
    column, a, b = between
    frame = load(path, table)
    kind = frame[column].dtype
    a, b = (pd.Series([a, b]).astype(kind).tolist()) if pd.api.types.is_numeric_dtype(kind) else (a, b)
    by = [k for k in ["experiment", *KEYS[table]] if k != column]
    return paired_test(frame, value, (column, a, b), by=by, n_boot=n_boot, seed=seed).set_index(by)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run directory, a sweep directory, or one .parquet file")
    parser.add_argument("--table", choices=sorted(VALUES), default="cam")
    parser.add_argument("--intervals", action="store_true", help="bootstrap 95%% intervals over samples")
    parser.add_argument("--paired", nargs=3, metavar=("COLUMN", "A", "B"), help="paired test of A - B per layer")
    parser.add_argument("--value", help="the column --paired compares (default: the table's first value)")
    parser.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the resamples' seed")
    args = parser.parse_args()
    with pd.option_context(
        "display.width", 200, "display.max_rows", 200, "display.max_columns", 20, "display.precision", 4
    ):
        if args.paired:
            value = args.value or VALUES[args.table][0]
            print(paired(args.path, args.table, args.paired, value, args.n_boot, args.seed))
        elif args.intervals:
            print(summarize_intervals(args.path, args.table, args.n_boot, args.seed))
        else:
            print(summarize(args.path, args.table))


if __name__ == "__main__":
    main()
