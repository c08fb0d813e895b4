"""Edge attribution patching for causal language models: which upstream component's write, read by which downstream
head's query, key or value input, MLP or the logits, carries the behaviour.

graph.py          the edge graph of a model, from its site layout (per key-value head for keys and values)
scores.py         each edge's first-order effect: the writers' clean - corrupted writes x the readers' gradients
estimators.py     one estimator per mode: the runs whose readers' gradients it averages, and where they are taken
intervene.py      edge interventions in one forward: exact edge patching, circuits, path patching
positions.py      position slots of per-position edges (IO, S1+1, S2, end, ...; or counted back from the end)
split.py          the pairs that find the circuit and those held out to test it
faithfulness.py   the MIB circuit track's curve sizes, faithfulness, CPR and CMD
stability.py      bootstrap resamples of the pairs: intervals, inclusion, Jaccard of circuits
run_scores.py     the run's scores read back, its ranking, and the tables about the whole run
rows.py           the tables' columns
export.py         the scores in the graph file the EAP-IG code and the MIB circuit track read
pair_runs.py      a batch's clean and corrupted runs, the pairs' metrics, and intervention forwards on the metric
scoring.py        pass 1: each discovery pair's score of every edge (and path patching)
evaluation.py     pass 2: the run's circuits on every pair, the checked edges patched exactly
method.py         `method=lm_edges`: the adapter that runs both passes over the data

`lm_edge_attribution` and `lm_path_patching` run it on a model and a list of pairs from a notebook, with no run
directory.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from torch import nn

from runner.data.prompts import pairs_batch
from runner.methods.base import as_frame, library_config, library_token_runtime, run_prepared
from runner.methods.lm_edges.faithfulness import mib_scores  # noqa: F401  (the MIB table of a sweep of both rankings)
from runner.methods.lm_edges.method import LmEdges
from runner.models.check import check_positions
from runner.options.method.lm_edges import LmEdgesMethodConfig


def lm_edge_attribution(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], target: str = "token_logit_diff",
    bos: bool = True, **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_edges` table of `model` (a Hugging Face causal LM in eval mode) on `pairs` ([{clean, corrupted, answer,
    distractor}]), all pairs in one batch: one row per edge, the mean over the discovery pairs (with per_pair=True,
    the `lm_edge_pairs` table instead: one row per (edge, pair)); `settings`: LmEdgesConfig's fields (mode, steps,
    corruption, per_pair, held_out, ...; circuits only where `fractions` or `circuit` are given). The model's hooks are
    removed before it returns."""
    settings.setdefault("fractions", [])
    dataset, batch = pairs_batch(pairs, tokenizer, bos, next(model.parameters()).device)
    check_positions(model, dataset)
    cfg = library_config(LmEdgesMethodConfig, edges=settings)
    method = LmEdges(cfg, [], library_token_runtime(batch.x.device, target))
    tables = run_prepared(method, model, batch, dataset).tables
    return as_frame(tables["lm_edge_pairs" if method.p.per_pair else "lm_edges"])


def lm_path_patching(
    model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]], paths: list[dict[str, Any]],
    target: str = "token_logit_diff", bos: bool = True, **settings: Any,
) -> pd.DataFrame:  # fmt: skip
    """The `lm_paths` table of `model` on `pairs`: per path set ({senders, receivers, name}: node names or patterns,
    as method.edges.paths) and pair, the corrupted run with the receivers reading the senders' clean writes through
    their direct edges; every pair in one batch, none held out. `settings`: LmEdgesConfig's other fields."""
    settings = {"fractions": [], "held_out": 0.0, "mode": "eap", "resamples": 0, "top_k": 0, **settings}
    dataset, batch = pairs_batch(pairs, tokenizer, bos, next(model.parameters()).device)
    check_positions(model, dataset)
    cfg = library_config(LmEdgesMethodConfig, edges={**settings, "paths": paths})
    method = LmEdges(cfg, [], library_token_runtime(batch.x.device, target))
    return as_frame(run_prepared(method, model, batch, dataset).tables["lm_paths"])


__all__ = ["lm_edge_attribution", "lm_path_patching"]
