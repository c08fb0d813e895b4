"""Load a whole sweep as one table and plot a per-layer comparison of the swept values.

    python -m runner -m experiment=gradcam_effnet method=gradcam,layercam,hirescam
    python scripts/plot_sweep.py outputs/multirun/2026-11-22/10-00-00 --value deletion_auc --by sweep.method

Writes <sweep>/per_layer_<value>.png (one line per swept value, layers in model order) and prints the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from runner.results import load  # noqa: E402
from runner.summary import layers_in_model_order  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--table", default="cam")
    parser.add_argument("--value", default="cam_max", help="the column to compare, e.g. deletion_auc, restoration")
    parser.add_argument("--by", default="method", help="the column whose values are compared, e.g. sweep.method")
    args = parser.parse_args()

    frame = load(args.sweep, args.table)
    layers = layers_in_model_order(frame)  # by layer_index: features.2 before features.10
    per_layer = frame.groupby([args.by, "layer"])[args.value].mean().unstack(args.by).reindex(layers)
    print(per_layer.round(4).to_string())
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(layers)), 3.5))
    per_layer.plot(ax=ax, marker="o")
    ax.set_xticks(range(len(layers)), layers, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"mean {args.value}")
    ax.set_title(f"{args.value} per layer, by {args.by}")
    fig.tight_layout()
    out = args.sweep / f"per_layer_{args.value}.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
