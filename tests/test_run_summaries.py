"""What a run's console summary and report say of the tables that are not cells of layers (runner/viz/run_summaries.py):
the top edges with their exact effects, the circuit's faithfulness by size and the smallest circuit keeping 80%,
CPR and CMD, the heads that attend most to the answer; the LM report's figures before its tables; the row counts
naming only what a table has."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pandas as pd
import pytest

from runner import app
from runner.results import load
from runner.viz.report import write_report
from runner.viz.run_summaries import KEEPS, attending_heads, circuit_curve, top_edges
from tests.conftest import make_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edges_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """edges_lm_induction on 16 pairs, top 4 re-patched, with its console log."""
    out = tmp_path_factory.mktemp("edges")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logging.getLogger("runner").addHandler(handler)
    previous = logging.getLogger("runner").level
    logging.getLogger("runner").setLevel(logging.INFO)
    try:
        app.run(make_config("experiment=edges_lm_induction", "data.limit=16", "method.edges.top_k=4",
                            "method.edges.resamples=20", "progress=false", "report=false"), out)  # fmt: skip
    finally:
        logging.getLogger("runner").removeHandler(handler)
        logging.getLogger("runner").setLevel(previous)
    return out, "\n".join(records)


def test_the_console_lists_the_top_edges_with_their_exact_effects(edges_run: tuple[Path, str]) -> None:
    out, log = edges_run
    edges = load(out, "lm_edges")
    block = log[log.index("lm_edges (") :].split("\n\n")[0]
    listed = re.findall(r"^\s*(\S+->\S+)\s+(-?\d\.\d+)", block, flags=re.M)
    best = edges.assign(size=edges.score.abs()).nlargest(len(listed), "size")
    assert len(listed) >= 10 and [e for e, _ in listed] == best.edge.tolist()
    assert [float(s) for _, s in listed] == pytest.approx(best.score.astype(float).tolist(), abs=1e-4)
    assert "exact" in block.splitlines()[1]  # the header: the re-patched edges' exact effects are shown
    assert "per layer" not in block


def test_the_console_states_the_smallest_circuit_that_keeps_80_percent(edges_run: tuple[Path, str]) -> None:
    out, log = edges_run
    curve = load(out, "lm_circuit_curve")
    for split in curve.split.unique():
        part = curve[(curve.split == split) & (curve.faithfulness >= KEEPS)]
        assert f"{split} {int(part.edges.min())} edges" in log
    assert "CPR" in log and "cmd" in log


def test_the_lm_report_shows_figures_first_and_counts_only_what_a_table_has(edges_run: tuple[Path, str]) -> None:
    out, _ = edges_run
    page = write_report(out).read_text()
    section = page[page.index('id="table-lm-edges"') :]
    section = section[: section.index("<h2 ", 10)] if "<h2 " in section[10:] else section
    assert "0 layers" not in page and "0 samples" not in page
    assert f"hydra.run.dir={out}" in page  # the recorded command reproduces the run in its own folder
    assert "a0.h" in section or "input->" in section  # the top edges are listed
    if "<figure" in section:
        assert section.index("<figure") < section.index("<table")


def test_attending_heads_are_the_ones_with_most_weight_on_the_answer() -> None:
    """Two heads, two pairs: head (1, 0) puts 0.7 and 0.5 on the answer from the last position, head (0, 1) 0.1 and
    0.3; an earlier query position's weights are not counted."""
    rows = []
    for pair, (a, b) in enumerate(((0.7, 0.1), (0.5, 0.3))):
        for layer, head, w in ((1, 0, a), (0, 1, b)):
            rows += [{"sample_id": f"p{pair}", "layer": layer, "head": head, "query_position": 4, "position": 1,
                      "token": "Mary", "answer": "Mary", "distractor": "John", "weight": w},
                     {"sample_id": f"p{pair}", "layer": layer, "head": head, "query_position": 3, "position": 1,
                      "token": "Mary", "answer": "Mary", "distractor": "John", "weight": 0.9}]  # fmt: skip
    _, heads = attending_heads(pd.DataFrame(rows))
    assert heads[["layer", "head"]].values.tolist() == [[1, 0], [0, 1]]
    assert heads["to answer"].tolist() == pytest.approx([0.6, 0.2])


def test_the_summaries_of_a_hand_made_curve_and_edges() -> None:
    curve = pd.DataFrame({"split": ["discovery"] * 3 + ["held_out"] * 3, "edges": [0, 10, 20] * 2,
                          "fraction": [0, 0.5, 1.0] * 2, "faithfulness": [0, 0.85, 1.0, 0, 0.5, 1.0]})  # fmt: skip
    words, table = circuit_curve(curve)
    assert "discovery 10 edges; held_out 20 edges" in words and len(table) == 3
    edges = pd.DataFrame({"edge": ["a", "b", "c"], "score": [0.1, -3.0, 2.0], "exact": [float("nan")] * 3})
    _, top = top_edges(edges)
    assert top.edge.tolist() == ["b", "c", "a"] and "exact" not in top.columns  # none re-patched: no column
