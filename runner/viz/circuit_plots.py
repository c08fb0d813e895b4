"""Figures of the edge tables: the circuit found (lm_edges) and its faithfulness curve (lm_circuit_curve).

- `lm_edges_figures`: per (mode, metric), the graph of the TOP_EDGES edges of largest |mean score|: nodes placed by
  layer (rows: the layers the edges touch, the embeddings at the bottom, the logits at the top) and head (columns; a
  key-value head between the query heads that share it, the MLP on the right), each edge a line from its writer to
  its reader, its width the |score|, its colour the sign, its style what the reader reads (query, key, value); a
  title, legends for all three, and node labels moved until none overlaps another.
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
        names = part["edge"].astype(str)
        headline = f"the {len(top)} edges of largest |mean {mode} score| ({metric}) of {len(scored)}."
        if "slot" in part.columns and part["slot"].notna().any():  # per-position units: edge@slot
            names = names.str.rsplit("@", n=1).str[0]
            edge_slot = top.index.str.rsplit("@", n=1)
            slots = ", ".join(dict.fromkeys(edge_slot.str[1]))
            drawn = top.groupby(edge_slot.str[0], sort=False).sum()
            headline = (f"the {len(top)} per-position units (edge@slot) of largest |mean {mode} score| ({metric}) of"
                        f" {len(scored)}, drawn at their {len(drawn)} edges (the units of one edge summed); their"
                        f" slots: {slots}.")  # fmt: skip
            top = drawn
        shape = Shape.of(names)
        out.append((
            f"The circuit: {headline} Rows are"
            " the layers the edges touch (the embeddings at the bottom, the logits at the top), columns the heads and,"
            " on the right, the MLP; a key or value edge ends at its key-value head's marker (between the query heads"
            " that share it). Width: |score|; red: positive (moving the edge toward its clean value raises the"
            " metric), blue: negative; line style: what the reader reads (query, key, value; solid also for an MLP"
            " or the logits).",
            circuit_graph(top, shape, f"{mode} circuit, top {len(top)} edges ({metric})", figures),
        ))  # fmt: skip
    return out


NODE = re.compile(r"a(\d+)\.([hg])(\d+)(?:<([qkv])>)?|m(\d+)|input|logits")


class Shape:
    """The heads and key-value heads per layer, read from the edge names of a whole table (so that the columns do
    not depend on which edges are drawn)."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.heads, self.kv_heads = max(heads, 1), max(kv_heads, 1)

    @staticmethod
    def of(edges: pd.Series) -> Shape:
        names = edges.str.split("->").explode()
        heads = names.str.extract(r"^a\d+\.h(\d+)")[0].dropna().astype(int)
        groups = names.str.extract(r"^a\d+\.g(\d+)")[0].dropna().astype(int)
        return Shape(int(heads.max()) + 1 if len(heads) else 1, int(groups.max()) + 1 if len(groups) else 1)

    def column(self, node: str) -> tuple[float, str, int | None]:
        """(x, the reader's kind: q, k, v or "", its layer: None for input and logits) of a node name."""
        match = NODE.fullmatch(node)
        if match is None:
            raise ValueError(f"not a node of the edge graph: {node!r}")
        layer, kind, index, part, mlp = match.groups()
        if node in ("input", "logits"):
            return (self.heads - 1) / 2, "", None
        if mlp is not None:
            return float(self.heads), "", int(mlp)
        per_group = self.heads // self.kv_heads if kind == "g" else 1
        x = int(index) * per_group + (per_group - 1) / 2  # a key-value head: the middle of its query heads
        return float(x), part or "", int(layer)


LINE_STYLE = {"q": "-", "k": "--", "v": ":", "": "-"}


def circuit_graph(top: pd.Series, shape: Shape, title: str, figures: FiguresConfig) -> Figure:
    """The edges `top` (edge name -> score) drawn on a grid of the layers they touch (rows) and heads (columns), with
    a title and legends for colour, width and line style; node labels placed so that none overlaps another."""
    plt = style.pyplot()
    ends = [(str(e).split("->")[0], str(e).split("->")[1]) for e in top.index]
    used = sorted({layer for pair in ends for node in pair if (layer := shape.column(node)[2]) is not None})
    row = {layer: i + 1 for i, layer in enumerate(used)}
    top_row = len(used) + 1

    def place(node: str) -> tuple[float, float]:
        x, _, layer = shape.column(node)
        if layer is None:
            return x, 0.0 if node == "input" else float(top_row)
        return x, row[layer] - (0.28 if ".g" in node else 0.0)  # a key-value head just below its query heads

    width = style.full_width(figures)
    fig, ax = plt.subplots(figsize=(width, max(3.2, 0.55 * (top_row + 1) + 1.6)), layout="constrained")
    largest = float(top.abs().max()) or 1.0
    for (up, down), value in zip(ends, top.to_numpy(float), strict=True):
        (x0, y0), (x1, y1) = place(up), place(down)
        kind = shape.column(down)[1]
        ax.plot([x0, x1], [y0, y1], color=POSITIVE if value > 0 else NEGATIVE, linestyle=LINE_STYLE[kind],
                linewidth=0.6 + 4.0 * abs(value) / largest, alpha=0.8, zorder=2)  # fmt: skip
    # one marker per node: a head's q reader is the head, a key-value head's k and v readers one marker
    nodes = sorted({n.split("<")[0] for pair in ends for n in pair}, key=lambda n: place(n)[::-1])
    labels = []
    for node in nodes:
        x, y = place(node)
        group = ".g" in node
        ax.scatter([x], [y], s=22 if not group else 18, marker="o" if not group else "D", zorder=3,
                   facecolor="black" if not group else "white", edgecolor="black")  # fmt: skip
        labels.append(ax.annotate(_short(node), (x, y), fontsize=style.TICK_SIZE - 1, xytext=(4, 3),
                                  textcoords="offset points", zorder=4))  # fmt: skip
    ax.set_yticks(range(top_row + 1), ["emb", *[str(layer) for layer in used], "logits"], fontsize=style.TICK_SIZE)
    ax.set_xticks(range(shape.heads + 1), [*(f"h{h}" for h in range(shape.heads)), "MLP"], fontsize=style.TICK_SIZE)
    ax.set_xlim(-0.7, shape.heads + 0.9)
    ax.set_ylim(-0.6, top_row + 0.6)
    ax.set_ylabel("layer (those the edges touch)", fontsize=style.PANEL_TITLE_SIZE)
    ax.set_xlabel("head, then the layer's MLP", fontsize=style.PANEL_TITLE_SIZE)
    ax.set_title(title, fontsize=style.PANEL_TITLE_SIZE)
    _legends(ax, largest)
    separate_labels(fig, labels)
    return fig


POSITIVE, NEGATIVE = "#c0392b", "#2c7fb8"


def _short(node: str) -> str:
    """A node's label: `23.h3` (a head), `23.g1 k/v` (a key-value head), `m23`, `input`, `logits`."""
    match = NODE.fullmatch(node)
    if match is None or node in ("input", "logits") or match.group(5) is not None:
        return node
    layer, kind, index, part, _ = match.groups()
    return f"{layer}.{kind}{index}" + (" k/v" if kind == "g" else "")


def _legends(ax: Any, largest: float) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=POSITIVE, linewidth=2, label="positive score"),
               Line2D([], [], color=NEGATIVE, linewidth=2, label="negative score"),
               *(Line2D([], [], color="grey", linewidth=0.6 + 4.0 * f, label=f"|score| {f * largest:.3g}")
                 for f in (1.0, 0.5, 0.1)),
               Line2D([], [], color="black", linestyle="-", label="query (or MLP, logits)"),
               Line2D([], [], color="black", linestyle="--", label="key"),
               Line2D([], [], color="black", linestyle=":", label="value")]  # fmt: skip
    ax.legend(handles=handles, fontsize=style.TICK_SIZE - 1, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)  # fmt: skip


def separate_labels(fig: Figure, labels: list[Any], rounds: int = 8) -> None:
    """Move each label that overlaps an earlier one to its next place around its point (right-above, right-below,
    left-above, left-below, then further out) until none overlaps, or `rounds` rounds."""
    places = [(4, 3), (4, -12), (-30, 3), (-30, -12), (4, 12), (4, -21), (-30, 12), (-30, -21)]
    tried = [0] * len(labels)
    renderer = fig.canvas.get_renderer()
    for _ in range(rounds):
        boxes = [label.get_window_extent(renderer) for label in labels]
        moved = False
        for i in range(len(labels)):
            if any(boxes[i].overlaps(boxes[j]) for j in range(len(labels)) if j != i and j < i):
                tried[i] = (tried[i] + 1) % len(places)
                labels[i].xyann = places[tried[i]]
                boxes[i] = labels[i].get_window_extent(renderer)
                moved = True
        if not moved:
            return


def overlapping_labels(fig: Figure) -> list[tuple[str, str]]:
    """The pairs of node labels (the axes' annotations) whose boxes overlap, as drawn."""
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        texts = list(ax.texts)
        boxes = [t.get_window_extent(renderer) for t in texts]
        for i in range(len(texts)):
            for j in range(i):
                if boxes[i].overlaps(boxes[j]):
                    found.append((texts[j].get_text(), texts[i].get_text()))
    return found


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
