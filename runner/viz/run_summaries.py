"""Summaries of the tables whose rows are not cells of layers, written for what a reader of the run asks of them:
the top edges (`lm_edges`), the circuit's faithfulness by size and the smallest circuit that keeps 80%
(`lm_circuit_curve`), CPR and CMD (`lm_circuit_scores`), the heads that attend most to the answer (`lm_attention`), the writers of largest direct logit
attribution (`lm_dla`).
The console summary and the report both show them (runner/viz/summary.py, runner/viz/report.py)."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

TOP_EDGES = 12  # edges listed
TOP_HEADS = 8  # heads listed
KEEPS = 0.8  # the share of the metric a circuit must keep to be called enough


def top_edges(frame: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """The run's edges of largest |score|, with their bootstrap interval and exact effect where re-patched."""
    ranked = frame.assign(_size=frame["score"].abs()).nlargest(TOP_EDGES, "_size")
    columns = [c for c in ("edge", "score", "score_lo", "score_hi", "exact", "rank") if c in frame.columns]
    shown = ranked[columns].reset_index(drop=True)
    if "exact" in shown.columns and shown["exact"].isna().all():
        shown = shown.drop(columns="exact")
    words = (
        f"The {len(shown)} edges of largest |score| of {len(frame)}: score (the mean over the discovery pairs),"
        " its bootstrap interval (score_lo, score_hi), the exact effect where the edge was re-patched (top_k) and"
        " its rank by the run's ranking."
    )
    return words, shown


def circuit_curve(frame: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """Faithfulness per circuit size and split, and the smallest size that keeps KEEPS of the metric per split."""
    curve = frame.pivot_table(index=["edges", "fraction"], columns="split", values="faithfulness", observed=True)
    curve.columns = [f"faithfulness ({split})" for split in curve.columns]
    enough = []
    for split in sorted(frame["split"].dropna().unique()):
        part = frame[(frame["split"] == split) & (frame["faithfulness"] >= KEEPS)]
        enough.append(f"{split} {int(part['edges'].min())} edges" if len(part) else f"{split} none measured")
    words = (
        f"The circuit's faithfulness by size (the mean over the split's pairs; 1: the clean run, 0: every edge"
        f" corrupted). The smallest circuit that keeps {KEEPS:.0%}: {'; '.join(enough)}."
    )
    return words, curve.round(4).reset_index()


def circuit_scores(frame: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    columns = [c for c in ("split", "scored_by", "ranking", "ablation", "pairs", "cpr", "cmd", "points") if c in frame]
    words = "MIB's circuit performance ratio (CPR, higher is better) and circuit-model distance (CMD, lower is better)."
    return words, frame[columns].reset_index(drop=True)


def attending_heads(frame: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """From each pair's last query position: the heads with the most attention on the answer's tokens, with their
    attention on the distractor's."""
    pair = "sample_id" if "sample_id" in frame.columns else "sample"
    last = frame[frame["query_position"] == frame.groupby(pair)["query_position"].transform("max")]
    weights = {}
    for name, column in (("to answer", "answer"), ("to distractor", "distractor")):
        on = last[last["token"] == last[column]]
        per_pair = on.groupby(["layer", "head", pair], observed=True)["weight"].sum()
        weights[name] = per_pair.groupby(["layer", "head"], observed=True).mean()
    heads = pd.DataFrame(weights).fillna(0.0)
    shown = heads.nlargest(TOP_HEADS, "to answer").reset_index()
    words = (
        f"The {len(shown)} heads that attend most to the answer from the last position: the mean over pairs of"
        " their attention on the answer's tokens and on the distractor's."
    )
    return words, shown


def top_writers(frame: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """At each pair's last position: the writers of largest |mean contribution|, with their mean share of the total."""
    pair = "sample_id" if "sample_id" in frame.columns else "sample"
    last = frame[frame["position"] == frame.groupby(pair)["position"].transform("max")]
    writers = last[last["kind"] != "accumulated"]
    parts = [c for c in ("value", "answer_value", "distractor_value") if c in writers.columns]
    means = writers.groupby(["writer", "kind"], observed=True)[parts].mean()
    total = float(last.drop_duplicates(pair)["total"].mean())
    means["share of total"] = means["value"] / total if total else float("nan")
    shown = means.assign(_size=means["value"].abs()).nlargest(TOP_EDGES, "_size").drop(columns="_size").reset_index()
    words = (
        f"The {len(shown)} writers of largest |contribution| at the last position, mean over pairs (total: the logit"
        f" difference they sum to, mean {total:.4g}); positive: toward the answer. answer_value and distractor_value:"
        " its parts on the answer's and the distractor's logit (value = answer_value - distractor_value)."
    )
    return words, shown


RUN_SUMMARIES: dict[str, Callable[[pd.DataFrame], tuple[str, pd.DataFrame]]] = {
    "lm_edges": top_edges,
    "lm_circuit_curve": circuit_curve,
    "lm_circuit_scores": circuit_scores,
    "lm_attention": attending_heads,
    "lm_dla": top_writers,
}
