"""Per-layer summary of a run's (or a sweep's) tables.

python scripts/summarize.py outputs/2026-11-22/10-00-00_default
python scripts/summarize.py outputs/multirun/2026-11-22/10-00-00 --table gradcam
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from runner.results import load
from runner.summary import in_model_order

VALUES = {
    "cam": ["score", "cam_mean", "cam_max", "cam_frac_zero"],
    "hooks": ["mean", "std", "min", "max", "frac_zero"],
    "hook_check": ["max_abs_diff"],
    "patching": ["clean", "corrupted", "patched", "restoration"],
    "sanity": ["spearman"],
}
KEYS = {
    "cam": ["method", "layer"],
    "hooks": ["layer", "hook", "role", "call"],
    "hook_check": ["layer", "call"],
    "patching": ["direction", "patch_method", "layer"],
    "sanity": ["layer"],
}


def summarize(path: Path, table: str) -> pd.DataFrame:
    """Mean of each value column per layer (and per hook/role/call for hooks), over samples and runs."""
    keys = ["experiment", *KEYS[table]]
    frame = in_model_order(load(path, table), keys)  # layers in model order: features.2 before features.10
    return frame.groupby(keys, sort=False)[VALUES[table]].mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run directory, a sweep directory, or one .parquet file")
    parser.add_argument("--table", choices=sorted(VALUES), default="cam")
    args = parser.parse_args()
    with pd.option_context(
        "display.width", 200, "display.max_rows", 200, "display.max_columns", 20, "display.precision", 4
    ):
        print(summarize(args.path, args.table))


if __name__ == "__main__":
    main()
