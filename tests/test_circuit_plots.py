"""The circuit graph (runner/viz/circuit_plots.py) is publishable: a title, legends for sign, magnitude and what the
reader reads, columns that are heads and the MLP (a key-value head between the query heads that share it, never at
a column of its own), one label per node, and no label overlapping another, on a SmolLM2-shaped graph (30 layers, 9
query heads sharing 3 key-value heads) where the top edges crowd."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.rows import edge_columns
from runner.models.lm_sites import layout_of_config
from runner.schema import FiguresConfig
from runner.viz.circuit_plots import TOP_EDGES, Shape, lm_edges_figures, overlapping_labels
from runner.viz.figure_style import pyplot


def _smollm2_edges(seed: int) -> pd.DataFrame:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=64, vocab_size=10)  # fmt: skip
    graph = EdgeGraph.of(layout_of_config(config))
    index = graph.edges.nonzero()
    columns = edge_columns(graph, index)
    frame = pd.DataFrame({k: columns[k] for k in ("edge", "upstream", "downstream")})
    rng = np.random.default_rng(seed)
    # heavy-tailed scores: the top edges cluster on a few late layers and heads, as on IOI
    scores = rng.standard_t(1.5, len(frame)) * np.where(frame.upstream.str.match(r"a2\d"), 5.0, 0.2)
    return frame.assign(score=scores, pairs=4, mode="eap_ig", metric="token_logit_diff")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_circuit_graph_has_a_title_legends_and_no_overlapping_labels(seed: int) -> None:
    frame = _smollm2_edges(seed)
    ((caption, fig),) = lm_edges_figures(frame, None, FiguresConfig())
    ax = fig.axes[0]
    try:
        assert ax.get_title().startswith("eap_ig circuit, top 40 edges")
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert {"positive score", "negative score", "key", "value"} <= set(legend)
        assert sum(t.startswith("|score| ") for t in legend) == 3
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks == [*(f"h{h}" for h in range(9)), "MLP"]  # heads, then the MLP: no fractional columns
        labels = [t.get_text() for t in ax.texts]
        assert len(labels) == len(set(labels)) > 10  # one label per node
        assert not any("<" in label for label in labels)  # readers are drawn at their head, not as nodes
        assert overlapping_labels(fig) == [], overlapping_labels(fig)
        assert "MLP on the right" in caption or "on the right, the MLP" in caption
    finally:
        pyplot().close(fig)


def test_a_key_value_head_sits_between_the_query_heads_that_share_it() -> None:
    shape = Shape(9, 3)
    assert shape.column("a4.g0<k>")[0] == 1.0 and shape.column("a4.g2<v>")[0] == 7.0  # heads 0-2 and 6-8
    assert shape.column("a4.h5<q>") == (5.0, "q", 4) and shape.column("m4") == (9.0, "", 4)
    assert Shape.of(_smollm2_edges(0).edge).heads == 9 and Shape.of(_smollm2_edges(0).edge).kv_heads == 3
    assert TOP_EDGES == 40


@pytest.mark.slow
def test_per_position_units_are_drawn_at_their_edges() -> None:
    """Units (edge@slot) of one edge are drawn as one line at that edge, their scores summed; the caption names the
    units and their slots."""
    edges = _smollm2_edges(0)
    slots = ["S2", "end"]
    frame = pd.concat([edges.assign(edge=edges.edge + f"@{s}", slot=s, score=edges.score * w)
                       for s, w in zip(slots, (0.25, 0.75), strict=True)], ignore_index=True)  # fmt: skip
    ((caption, fig),) = lm_edges_figures(frame, None, FiguresConfig())
    try:
        assert f"units (edge@slot) of largest |mean eap_ig score| (token_logit_diff) of {len(frame)}" in caption
        assert "their slots: end, S2" in caption
        # one line per edge among the 40 largest units (an edge's end and S2 units can both be among them)
        top = frame.assign(size=frame.score.abs()).nlargest(TOP_EDGES, "size")
        lines = [line for line in fig.axes[0].lines if len(line.get_xdata()) == 2]
        assert len(lines) == top.edge.str.split("@").str[0].nunique() < TOP_EDGES
    finally:
        pyplot().close(fig)
