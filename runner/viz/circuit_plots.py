"""Figures of the edge tables: the circuit found (lm_edges) and its faithfulness curve (lm_circuit_curve).

- `lm_edges_figures`: per (mode, metric), the graph of the TOP_EDGES edges of largest |mean score|: writers and
  readers placed by layer (rows, the embeddings at the bottom, the logits at the top) and head (columns; an MLP to the
  right of the heads), each edge a line from its writer to its reader, its width the |score|, its colour the sign.
- `lm_circuit_curve_figures`: per (metric, mode), the faithfulness of the run's circuits against the fraction of
  edges kept, on the discovery and the held-out pairs, beside the bootstrap Jaccard overlap of the circuits.
Scores are averaged over rows weighted by each row's pairs (one row per edge in a run's lm_edges).
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


def lm_circuit_curve_figures(frame: pd.DataFrame, by: str | None, figures: FiguresConfig) -> list[tuple[str, Figure]]:
    """Per (metric, scoring mode): the faithfulness curve of each part (discovery, held out) against the fraction of
    edges kept, and the bootstrap Jaccard overlap of the circuits of each size."""
    if not {"split", "fraction", "faithfulness", "scored_by", "metric", "jaccard", "edges"} <= set(frame.columns):
        return []
    plt = style.pyplot()
    out = []
    for (metric, mode), part in frame.groupby(["metric", "scored_by"], observed=True):
        part = part[part["edges"] > 0].sort_values("fraction")
        if part.empty:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(style.full_width(figures), 3.4), layout="constrained")
        for split, rows in part.groupby("split", observed=True, sort=False):
            left.plot(
                rows["fraction"], rows["faithfulness"].astype(float), marker="o", label=str(split).replace("_", " ")
            )
        left.set_xscale("log")
        left.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        left.axhline(0.0, color="grey", linewidth=0.8)
        left.set_xlabel("fraction of edges kept", fontsize=style.PANEL_TITLE_SIZE)
        left.set_ylabel("faithfulness f", fontsize=style.PANEL_TITLE_SIZE)
        left.legend(fontsize=style.TICK_SIZE, title="pairs", title_fontsize=style.TICK_SIZE)
        once = part.drop_duplicates("edges")
        jaccard = once["jaccard"].astype(float)
        right.plot(once["fraction"], jaccard, marker="o", color="black")
        right.fill_between(once["fraction"], once["jaccard_lo"].astype(float), once["jaccard_hi"].astype(float),
                           color="grey", alpha=0.25)  # fmt: skip
        right.axhline(0.8, color="grey", linewidth=0.8, linestyle=":")
        right.set_xscale("log")
        right.set_ylim(0, 1.05)
        right.set_xlabel("fraction of edges kept", fontsize=style.PANEL_TITLE_SIZE)
        right.set_ylabel("Jaccard of resampled circuits", fontsize=style.PANEL_TITLE_SIZE)
        pairs = ", ".join(
            f"{s.replace('_', ' ')} {int(r['pairs'].max())}" for s, r in part.groupby("split", sort=False)
        )
        out.append((
            f"The run's circuits ({mode} scores, {metric}), chosen once on the discovery pairs. Left: faithfulness f ="
            " (m(circuit) - m(empty)) / (m(model) - m(empty)), means over each part's pairs (" + pairs + "), against"
            " the fraction of the model's edges kept; 1 (dashed) is the model's behaviour. Right: the mean Jaccard"
            " overlap of the circuits of each size found on bootstrap resamples of the discovery pairs (band: 5-95 %;"
            " dotted: 0.8).",
            fig,
        ))  # fmt: skip
        if not np.isfinite(jaccard).any():
            right.set_visible(False)
    return out
