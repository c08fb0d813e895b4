"""Figures of the edge tables: the circuit found (lm_edges) and its faithfulness against its size (lm_circuit).

- `lm_edges_figures`: per (mode, metric), the graph of the TOP_EDGES edges of largest |mean score|: writers and
  readers placed by layer (rows, the embeddings at the bottom, the logits at the top) and head (columns; an MLP to the
  right of the heads), each edge a line from its writer to its reader, its width the |score|, its colour the sign.
- `lm_circuit_figures`: per metric, the faithfulness (mean over pairs, with its spread) against the circuit's size
  (edges kept, log scale), one curve per scoring mode.
Scores are averaged over batches weighted by each row's pairs (a batch's row is already its pairs' mean).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from runner.schema import FiguresConfig
from runner.viz import figure_style as style

Figure = Any  # matplotlib.figure.Figure
TOP_EDGES = 40  # edges drawn in the circuit graph


def lm_edges_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    if not {"edge", "upstream", "downstream", "score", "pairs", "mode", "metric"} <= set(frame.columns):
        return []
    out = []
    for (mode, metric), part in frame.groupby(["mode", "metric"], observed=True):
        weights = part["pairs"].astype(float).clip(lower=1e-12)
        scored = (part["score"].astype(float) * weights).groupby(part["edge"]).sum() / weights.groupby(
            part["edge"]
        ).sum()
        top = scored.dropna().reindex(scored.abs().sort_values(ascending=False).index).head(TOP_EDGES)
        if top.empty:
            continue
        layers = int(pd.to_numeric(part["upstream_layer"], errors="coerce").max() + 1)
        out.append((
            f"The circuit: the {len(top)} edges of largest |mean {mode} score| ({metric}) of {len(scored)}; width"
            " |score|, red positive (moving the edge toward its clean value raises the metric), blue negative. Rows"
            " are layers (the embeddings at the bottom, the logits at the top), columns heads (q, k, v readers at"
            " their head or key-value head; an MLP to the right).",
            _graph(top, layers, figures),
        ))  # fmt: skip
    return out


def _place(node: str, layers: int) -> tuple[float, float]:
    """(x, y) of a node named as the table names it: y the layer (input -1, logits `layers`), x the head."""
    if node == "input":
        return 0.0, -1.0
    if node == "logits":
        return 0.0, float(layers)
    match = re.fullmatch(r"a(\d+)\.([hg])(\d+)(?:<([qkv])>)?", node)
    if match:
        layer, kind, index, part = match.groups()
        offset = {"q": -0.25, "k": 0.0, "v": 0.25, None: 0.0}[part]
        return int(index) + offset, int(layer) - (0.3 if part else 0.0)  # a head reads below where it writes
    layer = int(node[1:])
    return -1.5, layer + 0.3  # an MLP: left of the heads, above the layer's attention


def _graph(top: pd.Series, layers: int, figures: FiguresConfig) -> Figure:
    plt = style.pyplot()
    fig, ax = plt.subplots(figsize=(style.full_width(figures), max(3.0, 0.35 * (layers + 2) + 1.0)),
                           layout="constrained")  # fmt: skip
    largest = float(top.abs().max()) or 1.0
    for edge, value in top.items():
        up, down = str(edge).split("->")
        (x0, y0), (x1, y1) = _place(up, layers), _place(down, layers)
        ax.plot([x0, x1], [y0, y1], color="#c0392b" if value > 0 else "#2c7fb8",
                linewidth=0.5 + 4.0 * abs(value) / largest, alpha=0.8)  # fmt: skip
    nodes = {n for edge in top.index for n in str(edge).split("->")}
    for node in nodes:
        x, y = _place(node, layers)
        ax.scatter([x], [y], s=14, color="black", zorder=3)
        ax.annotate(node, (x, y), fontsize=style.TICK_SIZE, xytext=(3, 2), textcoords="offset points")
    ax.set_yticks(range(-1, layers + 1), ["emb", *[str(i) for i in range(layers)], "logits"], fontsize=style.TICK_SIZE)
    ax.set_ylabel("layer", fontsize=style.PANEL_TITLE_SIZE)
    ax.set_xlabel("head (MLP at -1.5)", fontsize=style.PANEL_TITLE_SIZE)
    return fig


def lm_circuit_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    if not {"edges", "faithfulness", "scored_by", "metric"} <= set(frame.columns):
        return []
    plt = style.pyplot()
    out = []
    for metric, part in frame.groupby("metric", observed=True):
        fig, ax = plt.subplots(figsize=(min(8.0, style.full_width(figures)), 3.6), layout="constrained")
        for mode, rows in part.groupby("scored_by", observed=True):
            stats = rows.groupby("edges")["faithfulness"].agg(["mean", "std", "count"])
            x = np.maximum(stats.index.to_numpy(float), 0.5)  # 0 edges drawn at 0.5 on the log scale
            ax.plot(x, stats["mean"], marker="o", label=str(mode))
            ax.fill_between(x, stats["mean"] - stats["std"].fillna(0), stats["mean"] + stats["std"].fillna(0),
                            alpha=0.2)  # fmt: skip
        ax.set_xscale("log")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel("edges kept", fontsize=style.PANEL_TITLE_SIZE)
        ax.set_ylabel("faithfulness", fontsize=style.PANEL_TITLE_SIZE)
        ax.legend(fontsize=style.TICK_SIZE)
        pairs = part.groupby("edges")["faithfulness"].count().max()
        out.append((
            f"Faithfulness ({metric}): (circuit - corrupted) / (clean - corrupted) of the clean run with only the n"
            f" best-scored edges kept and every other edge given its corrupted value; mean over {pairs} pairs, band"
            " one standard deviation; 1 (dashed): the whole model's behaviour, 0: none of it.",
            fig,
        ))  # fmt: skip
    return out
