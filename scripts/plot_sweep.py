"""Load a whole sweep as one table and plot a per-layer comparison of the swept values.

    python -m runner -m experiment=gradcam_effnet method=gradcam,layercam,hirescam
    python scripts/plot_sweep.py outputs/multirun/2026-11-22/10-00-00 --value deletion_auc --by sweep.method

Writes <sweep>/per_layer_<value>.<format> (one panel per swept value on one y scale, layers in model order, the
95% bootstrap interval over samples as a band, grey below 5 samples; runner/viz/plots.py) and prints the per-layer
means with their intervals.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from runner.analysis import summarise
from runner.errors import RunnerError
from runner.frames import layers_in_model_order
from runner.schema import FigureFormat, FiguresConfig
from runner.store.reader import load
from runner.viz import figure_style
from runner.viz.plots import per_layer_figure


def main() -> None:
    """Parse the command line, print the per-layer summary, write the figure."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--table", default="cam")
    parser.add_argument(
        "--value", default="cam_frac_zero", help="the column to compare, e.g. deletion_auc, restoration"
    )  # the default is scale-free: a raw map's cam_max has each layer's own scale
    parser.add_argument("--by", default="method", help="the column whose values are compared, e.g. sweep.method")
    parser.add_argument("--format", default="png", choices=[f.value for f in FigureFormat])
    parser.add_argument("--dpi", type=int, default=FiguresConfig.dpi)
    args = parser.parse_args()

    try:
        frame = load(args.sweep, args.table)
        # The figure's lines, as a table: mean and interval per (by, layer); raises naming a missing column.
        summary = summarise(frame, args.value, by=[args.by, "layer"])
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None  # as the runner's CLI: one line, exit 2
    fig = per_layer_figure(frame, args.value, by=args.by)
    layers = layers_in_model_order(frame)
    summary["layer"] = pd.Categorical(summary["layer"], categories=layers, ordered=True)
    print(summary.sort_values(["layer", args.by]).round(4).to_string(index=False))
    figures = FiguresConfig(dpi=args.dpi, format=FigureFormat(args.format))
    out = figure_style.save(fig, args.sweep / f"per_layer_{args.value}", figures)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
