"""The run's edge scores as the graph file of the EAP-IG code (hannamw/EAP-IG, src/eap/graph.py), which the MIB circuit
track reads for a submitted circuit (`Graph.from_json`, run_evaluation.py --circuit-files).

The file is what `Graph.to_json` writes:
    {"cfg": {"n_layers", "n_heads", "parallel_attn_mlp", "d_model"},
     "nodes": {name: {"in_graph": bool}},            input, a{l}.h{h}, m{l}, logits (always in the graph)
     "edges": {name: {"score": float, "in_graph": bool}}}
with edge names `{upstream}->{downstream}`: `a3.h1->a7.h2<q>`, `input->a0.h0<k>`, `m2->m5`, `m2->logits`.

EAP-IG's graph has key and value inputs per query head (MIB loads grouped-query models with TransformerLens's
`ungroup_grouped_query_attention`). This graph has them per key-value head, so each edge into `a{l}.g{g}<k|v>` becomes
one edge into `a{l}.h{h}<k|v>` for every query head h of group g (h // (heads // kv_heads) == g, as Hugging Face's
`repeat_kv`), each with the group's score: the effect through the key or value input that the group's heads share,
which does not split per query head. Scores are as in the table (NaN stays NaN, which Python's json reads back).

`eap_ig_graph(..., in_circuit=...)` marks a circuit's edges `in_graph`, and a node is in the graph when an edge of
`in_circuit` touches it (logits always); EAP-IG's own circuits also drop edges that do not connect input to logits
(`Graph.prune`), which this does not. The run's file (`lm_edges.eap_ig.json`, method.py) is written with no circuit:
every edge's `in_graph` is false and only `logits` is in the graph, as the MIB circuit track wants of a file of
scores, from which it chooses its own circuits (`Graph.apply_topn`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pandas as pd


def _node_names(layers: int, heads: int) -> list[str]:
    """EAP-IG's nodes in its order (`Graph.from_model`): input, each layer's heads and MLP, logits."""
    names = ["input"]
    for layer in range(layers):
        names += [f"a{layer}.h{h}" for h in range(heads)] + [f"m{layer}"]
    return names + ["logits"]


def eap_ig_graph(
    edges: pd.DataFrame, layers: int, heads: int, kv_heads: int, d_model: int, parallel: bool,
    in_circuit: Collection[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """The EAP-IG graph dict of the lm_edges rows `edges` (columns edge, upstream, downstream, input,
    downstream_layer, downstream_head, score), key-value edges ungrouped; `in_circuit`: lm_edges edge names."""
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"eap_ig_graph: {heads} heads do not split into {kv_heads} key-value groups")
    unknown = set(in_circuit) - set(edges["edge"])
    if unknown:
        raise ValueError(f"eap_ig_graph: in_circuit names edges not in the table: {sorted(unknown)[:5]}")
    group = heads // kv_heads
    chosen = set(in_circuit)
    out: dict[str, dict[str, Any]] = {}
    touched: set[str] = {"logits"}
    for row in edges.itertuples(index=False):
        kept = row.edge in chosen
        if row.input in ("k", "v"):  # one edge per query head of the group, each with the group's score
            layer, g = int(row.downstream_layer), int(row.downstream_head)
            readers = [(f"a{layer}.h{h}<{row.input}>", f"a{layer}.h{h}") for h in range(g * group, (g + 1) * group)]
        else:
            readers = [(row.downstream, row.downstream.split("<")[0])]
        for reader, node in readers:
            out[f"{row.upstream}->{reader}"] = {"score": float(row.score), "in_graph": kept}
            if kept:
                touched |= {row.upstream, node}
    nodes = {name: {"in_graph": name in touched} for name in _node_names(layers, heads)}
    cfg = {"n_layers": layers, "n_heads": heads, "parallel_attn_mlp": parallel, "d_model": d_model}
    return {"cfg": cfg, "nodes": nodes, "edges": out}


def write_eap_ig_graph(
    path: str | Path, edges: pd.DataFrame, layers: int, heads: int, kv_heads: int, d_model: int, parallel: bool,
    in_circuit: Collection[str] = (),
) -> Path:  # fmt: skip
    """Write `eap_ig_graph(...)` as JSON at `path` (whole or not at all: written beside it, then renamed); returns the
    path."""
    path = Path(path)
    graph = eap_ig_graph(edges, layers, heads, kv_heads, d_model, parallel, in_circuit)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: every rank of a torchrun writes it
    try:
        with tmp.open("w") as fh:  # streamed: the text of a 1.5M-edge graph is not held whole
            json.dump(graph, fh)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
