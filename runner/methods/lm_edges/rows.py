"""The tables of `method=lm_edges`, declared once, and the edge identifier columns they share.

Written per pass over the data (runner/methods/base.py `passes`):
  scoring     lm_edge_pair_scores  one row per discovery pair: every edge's score for it (a list, in lm_edges' order)
              lm_edge_pairs        per (edge, discovery pair), with method.edges.per_pair
  evaluation  lm_circuit           per (circuit size, pair), every pair of both parts
              lm_edge_exact        per (checked edge, discovery pair), with method.edges.top_k
  the run     lm_edges             one row per edge: its score over the discovery pairs, interval, rank, exact effect
              lm_circuit_curve     per (part, size): the faithfulness curve, with the circuits' stability
              lm_circuit_scores    per part: the curve's areas, CPR and CMD (the MIB circuit track's scores)
              lm_circuit_stability per (size, edge) for sizes up to STABILITY_MAX_EDGES: how often a resample keeps it
              lm_edge_calibration  with top_k: estimate against exact effect, over the top edges and random others
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch

from runner.methods.lm_edges.graph import EdgeGraph
from runner.rows import Columns
from runner.tables import Presentation, declare, optional, own_columns

STABILITY_MAX_EDGES = 1000  # lm_circuit_stability lists edges for circuits up to this size (larger: the Jaccard only)

EDGE_FIELDS = [
    pa.field("edge", pa.string()),  # upstream->downstream, e.g. a3.h1->a7.h2<q>, m2->logits, input->a0.g1<k>
    pa.field("upstream", pa.string()),  # input | a{layer}.h{head} | m{layer}
    pa.field("downstream", pa.string()),  # a{layer}.h{head}<q> | a{layer}.g{kv head}<k|v> | m{layer} | logits
    pa.field("input", pa.string()),  # what the downstream node reads with: q | k | v | mlp | logits
    pa.field("upstream_layer", pa.int64()),  # null for input
    pa.field("upstream_head", pa.int64()),  # null for input and MLPs
    pa.field("downstream_layer", pa.int64()),  # null for logits
    pa.field("downstream_head", pa.int64()),  # the head (q), the key-value head (k, v); null otherwise
]
# method.edges.per_position: the unit's position slot (positions.py), its `edge` then edge@slot (a3.h1->a7.h2<q>@S2)
SLOT_FIELD = optional("slot", pa.string(), "method.edges.per_position=true")
PAIR_FLAGS = [
    pa.field("degenerate", pa.bool_()),  # as in lm_patching: a pair whose restoration is undefined
    pa.field("small_span", pa.bool_()),  # |clean - corrupted| below method.edges.min_span
]

LM_EDGES_SCHEMA = declare(
    "lm_edges",
    [
        *EDGE_FIELDS,
        SLOT_FIELD,
        pa.field("mode", pa.string()),  # the estimator: eap | eap_ig | ... | exact
        pa.field("steps", pa.int64()),  # the gradient's runs (eap: 1)
        pa.field("metric", pa.string()),  # the run's target
        # the edge's effect on the metric, the mean over the discovery pairs not flagged, and their spread
        pa.field("score", pa.float32()),
        pa.field("score_std", pa.float32()),
        # the bootstrap interval of the mean (method.edges.resamples; NaN without)
        pa.field("score_lo", pa.float32()),
        pa.field("score_hi", pa.float32()),
        pa.field("rank", pa.int64()),  # 1 = the first edge a circuit keeps (method.edges.ranking)
        # the exact effect (mean over the discovery pairs): the corrupted run with the edge's reader reading the
        # writer's clean write, minus the corrupted run (mode=exact: = score; else the edges top_k checked, NaN others)
        pa.field(
            "exact", pa.float32()
        ),  # the edge's exact effect (lm_edges: mean over the discovery pairs, NaN where not patched)
        pa.field("pairs", pa.int64()),  # discovery pairs behind the score (flagged pairs left out)
        pa.field("clean", pa.float32()),  # the clean and corrupted runs' metrics, means over those pairs
        pa.field("corrupted", pa.float32()),
        pa.field("degenerate", pa.bool_()),  # no pair behind the score
    ],
    Presentation(
        keys=("mode", "input", "metric"),
        values=("score",),
        shown=("metric",),
        figures="runner.viz.circuit_plots:lm_edges_figures",
    ),
    classes=False,
)
LM_EDGE_PAIR_SCORES_SCHEMA = declare(
    "lm_edge_pair_scores",
    [
        pa.field("mode", pa.string()),
        pa.field("steps", pa.int64()),
        pa.field("metric", pa.string()),
        pa.field("clean", pa.float32()),
        pa.field("corrupted", pa.float32()),
        *PAIR_FLAGS,
        pa.field("scores", pa.list_(pa.float32())),  # every edge's score for the pair, in lm_edges' row order
        # the pair's clean writes summed over its real positions (embeddings, each layer's heads' outputs and MLP),
        # and how many positions: the means a mean-ablated circuit's left-out edges carry
        optional("writer_sums", pa.list_(pa.float32()), "method.edges.ablation=mean"),
        optional("positions", pa.int64(), "method.edges.ablation=mean"),
    ],
    Presentation(keys=("mode", "metric"), values=("clean", "corrupted"), shown=("metric",)),
    classes=False,
)
LM_EDGE_PAIRS_SCHEMA = declare(
    "lm_edge_pairs",
    [
        *EDGE_FIELDS,
        SLOT_FIELD,
        pa.field("mode", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("score", pa.float32()),  # the edge's score for the pair
        pa.field("clean", pa.float32()),
        pa.field("corrupted", pa.float32()),
        *PAIR_FLAGS,
    ],
    Presentation(keys=("mode", "input", "metric"), values=("score",), shown=("metric",)),
    classes=False,
)
LM_CIRCUIT_SCHEMA = declare(
    "lm_circuit",
    [
        pa.field("edges", pa.int64()),  # the circuit's size: the run's first `edges` edges by rank
        pa.field("fraction", pa.float64()),  # edges / total_edges
        pa.field("total_edges", pa.int64()),
        pa.field("scored_by", pa.string()),  # the mode that ranked the edges
        pa.field("ablation", pa.string()),  # what the left-out edges carry: corrupted | mean
        pa.field("ranking", pa.string()),  # absolute | signed (a run of ranking=both has rows of each)
        pa.field("split", pa.string()),  # discovery (the pairs the circuit was found on) | held_out
        pa.field("metric", pa.string()),
        # the clean run with every other edge given its ablated value (its corrupted one, or its writer's mean)
        pa.field("circuit_metric", pa.float32()),
        pa.field("empty_metric", pa.float32()),  # m(empty): every edge ablated (= corrupted for ablation=corrupted)
        pa.field("clean", pa.float32()),  # m(full): the clean run
        pa.field("corrupted", pa.float32()),
        # (circuit_metric - empty_metric) / (clean - empty_metric); NaN if flagged
        pa.field("faithfulness", pa.float32()),
        *PAIR_FLAGS,
    ],
    Presentation(keys=("split", "scored_by", "edges", "metric"), values=("faithfulness",), shown=("metric",)),
    classes=False,
)
LM_EDGE_EXACT_SCHEMA = declare(
    "lm_edge_exact",
    [
        *EDGE_FIELDS[:4],
        SLOT_FIELD,
        pa.field("chosen", pa.string()),  # top (the run's top_k) | random (as many others, drawn with the seed)
        pa.field("rank", pa.int64()),
        pa.field("mode", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("estimate", pa.float32()),  # the pair's score by `mode`
        pa.field(
            "exact", pa.float32()
        ),  # the edge's exact effect (lm_edges: mean over the discovery pairs, NaN where not patched)
        *PAIR_FLAGS,
    ],
    Presentation(keys=("chosen", "mode", "metric"), values=("estimate", "exact"), shown=("metric",)),
    classes=False,
)
LM_CIRCUIT_CURVE_SCHEMA = declare(
    "lm_circuit_curve",
    [
        pa.field("split", pa.string()),
        pa.field("edges", pa.int64()),
        pa.field("fraction", pa.float64()),
        pa.field("total_edges", pa.int64()),
        pa.field("mib", pa.bool_()),  # one of the MIB circuit track's fractions (the points CPR and CMD are over)
        pa.field("scored_by", pa.string()),
        pa.field("ablation", pa.string()),
        pa.field("ranking", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("pairs", pa.int64()),  # the part's pairs not flagged
        pa.field("circuit_metric", pa.float32()),  # means over those pairs
        pa.field("empty_metric", pa.float32()),
        pa.field("clean", pa.float32()),
        # MIB's f: (mean circuit_metric - mean empty_metric) / (mean clean - mean empty_metric)
        pa.field("faithfulness", pa.float32()),
        pa.field("faithfulness_std", pa.float32()),  # the spread of the pairs' own faithfulness
        # the circuits of this size in the bootstrap resamples of the discovery pairs: their mean Jaccard overlap
        # and its 5-95 % range; `inclusion`: how often a resample keeps this circuit's edges, on average (NaN: no
        # resamples, or size 0)
        pa.field("jaccard", pa.float32()),
        pa.field("jaccard_lo", pa.float32()),
        pa.field("jaccard_hi", pa.float32()),
        pa.field("inclusion", pa.float32()),
    ],
    Presentation(
        keys=("split", "scored_by", "metric"),
        values=("faithfulness", "jaccard"),
        shown=("metric",),
        figures="runner.viz.circuit_plots:lm_circuit_curve_figures",
    ),
    classes=False,
)
LM_CIRCUIT_SCORES_SCHEMA = declare(
    "lm_circuit_scores",
    [
        pa.field("split", pa.string()),
        pa.field("scored_by", pa.string()),
        pa.field("ablation", pa.string()),
        pa.field("ranking", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("pairs", pa.int64()),
        pa.field("cpr", pa.float64()),  # area under f over the fraction of edges (higher is better; can pass 1)
        pa.field("cmd", pa.float64()),  # area under |1 - f| (lower is better)
        pa.field("points", pa.int64()),  # the curve's points the areas are over (MIB's fractions)
    ],
    Presentation(keys=("split", "scored_by", "ablation", "metric"), values=("cpr", "cmd"), shown=("metric",)),
    classes=False,
)
LM_CIRCUIT_STABILITY_SCHEMA = declare(
    "lm_circuit_stability",
    [
        pa.field("edges", pa.int64()),  # the circuit's size
        *EDGE_FIELDS[:4],
        SLOT_FIELD,
        pa.field("rank", pa.int64()),  # the edge's rank in the run, under this row's ranking
        pa.field("in_circuit", pa.bool_()),  # in the run's circuit of this size
        pa.field("inclusion", pa.float32()),  # the fraction of resamples whose circuit of this size holds it
        pa.field("resamples", pa.int64()),
        pa.field("ranking", pa.string()),  # absolute | signed (a run of ranking=both has rows of each)
    ],
    Presentation(keys=("ranking", "edges"), values=("inclusion",)),
    classes=False,
)
LM_EDGE_CALIBRATION_SCHEMA = declare(
    "lm_edge_calibration",
    [
        pa.field("chosen", pa.string()),  # top | random | all (both)
        pa.field("mode", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("edges", pa.int64()),
        pa.field("pairs", pa.int64()),
        pa.field("spearman", pa.float64()),  # rank correlation of the edges' mean estimate and mean exact effect
        # the sign agreement is over the (edge, pair) whose exact effect is above float rounding (run_scores.py
        # SIGN_TOLERANCE): an edge with no effect would otherwise agree or not as the batch happens to round it
        pa.field("sign_agreement", pa.float64()),  # the fraction of sign_counted whose estimate has the exact's sign
        pa.field("sign_counted", pa.int64()),  # the (edge, pair) with |exact| > 1e-3 x the pair's |clean - corrupted|
        pa.field("mean_abs_error", pa.float64()),  # mean |estimate - exact| over (edge, pair)
    ],
    Presentation(keys=("chosen", "mode", "metric"), values=("spearman", "sign_agreement", "mean_abs_error")),
    classes=False,
)
LM_PATHS_SCHEMA = declare(
    "lm_paths",
    [
        pa.field("path", pa.string()),  # the set's name (method.edges.paths[i].name), else "senders -> receivers"
        pa.field("senders", pa.string()),  # the writers the set's edges leave, joined by spaces
        pa.field("receivers", pa.string()),  # the readers they reach, joined by spaces
        pa.field("edges_patched", pa.int64()),  # the set's edges: senders x receivers joined by an edge
        pa.field("metric", pa.string()),
        *(pa.field(n, pa.float32()) for n in ("clean", "corrupted", "patched")),
        pa.field("effect", pa.float32()),  # patched - corrupted
        pa.field("restoration", pa.float32()),  # (patched - corrupted) / (clean - corrupted); NaN for a flagged pair
        *PAIR_FLAGS,
    ],
    Presentation(keys=("path", "metric"), values=("effect", "restoration"), shown=("metric",)),
    classes=False,
)


def typed(table: str, columns: Columns) -> Columns:
    """`columns` with every float column of `table` as its declared width (the run's statistics are float64)."""
    schema = own_columns(table)
    out = dict(columns)
    for field in schema:
        if field.name in out and field.type == pa.float32() and not isinstance(out[field.name], torch.Tensor):
            out[field.name] = np.asarray(out[field.name], dtype=np.float32)
    return out


def naming_keys(columns: dict[str, list[Any]]) -> tuple[str, ...]:
    """The columns that name an edge (or a unit, with its slot) in the tables that list checked or kept edges
    (lm_edge_exact, lm_circuit_stability), of the identifier columns `columns` (unit_columns)."""
    return ("edge", "upstream", "downstream", "input", *(("slot",) if "slot" in columns else ()))


def unit_columns(graph: EdgeGraph, index: Any, slots: list[str] | None) -> dict[str, list[Any]]:
    """The identifier columns of the edges `index` (E, 2), or with `slots` (per-position edges) of their units, edge
    by edge and each edge's slots in order: `edge` named edge@slot, and the column `slot`."""
    edges = edge_columns(graph, index)
    if slots is None:
        return edges
    n = len(slots)
    out = {key: [v for v in values for _ in range(n)] for key, values in edges.items()}
    out["edge"] = [f"{edge}@{slot}" for edge in edges["edge"] for slot in slots]
    out["slot"] = list(slots) * len(edges["edge"])
    return out


def edge_columns(graph: EdgeGraph, index: Any) -> dict[str, list[Any]]:
    """The identifier columns of the edges `index` (E, 2) (writer, reader), in that order."""
    out: dict[str, list[Any]] = {f.name: [] for f in EDGE_FIELDS}
    for w, r in index.tolist():
        up, down = graph.writers[w], graph.readers[r]
        out["edge"].append(f"{up.name}->{down.name}")
        out["upstream"].append(up.name)
        out["downstream"].append(down.name)
        out["input"].append(down.kind)
        out["upstream_layer"].append(None if up.kind == "input" else up.layer)
        out["upstream_head"].append(up.head)
        out["downstream_layer"].append(None if down.kind == "logits" else down.layer)
        out["downstream_head"].append(down.head)
    return out
