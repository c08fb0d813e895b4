"""`method=lm_edges`'s schema: edge attribution patching of a causal language model (EAP, EAP-IG): every edge of its
graph (runner/methods/lm_edges/graph.py) scored for the run's token target between each pair's clean and corrupted
prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from runner.errors import RunnerError
from runner.options.method.lm_patching import LmCorruptionConfig, check_corruption
from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig


class EdgeMode(str, Enum):
    eap = "eap"  # the gradient at the corrupted run: two forwards and one backward a batch
    eap_ig = "eap_ig"  # the gradient averaged over `steps` runs from the corrupted toward the clean embeddings
    exact = "exact"  # every edge patched: the corrupted run with the edge's reader given the writer's clean write


class EdgeAblation(str, Enum):
    corrupted = "corrupted"  # an edge outside the circuit carries its writer's output in the corrupted run
    mean = "mean"  # ... its writer's output averaged over the batch's clean prompts and real positions


@dataclass
class LmEdgesConfig:
    mode: EdgeMode = EdgeMode.eap_ig
    steps: int = 5  # eap_ig's interpolation steps (read by eap_ig only: eap is one step, the corrupted run)
    corruption: LmCorruptionConfig = field(default_factory=LmCorruptionConfig)
    # eap, eap_ig: per batch, the top_k edges (by |mean score|) also patched exactly (column `exact`), with the rank
    # correlation of estimate and exact effect over them (column rank_correlation); 0: none
    top_k: int = 0
    # Circuit evaluation (table lm_circuit): for each n, the batch's n edges of largest |mean score| kept, every other
    # edge given its corrupted value; [] for none
    circuit: list[int] = field(default_factory=list)
    ablation: EdgeAblation = EdgeAblation.corrupted  # what the circuit's left-out edges carry
    per_pair: bool = False  # one row per (edge, pair); false: per (edge, batch), the mean over its pairs and spread
    # A pair whose |clean - corrupted| is below min_span x max(|clean|, |corrupted|) is flagged small_span (as in
    # lm_patching); flagged pairs are left out of a batch's mean.
    min_span: float = 0.05


@METHODS.option("runner.methods.lm_edges.method:LmEdges", tables=("lm_edges", "lm_circuit"), family=LM_FAMILY)
@dataclass
class LmEdgesMethodConfig(MethodConfig):
    """`method=lm_edges`: the mode and corruption sit under `method.edges`; the metric is the run's `target`
    (target=token_logit_diff, token_prob_diff, answer_logprob or kl_to_clean)."""

    name: str = "lm_edges"
    edges: LmEdgesConfig = field(default_factory=LmEdgesConfig)

    def check(self) -> list[str]:
        bad = super().check()
        e = self.edges
        if e.steps < 1:
            bad.append(f"method.edges.steps={e.steps}")
        if e.top_k < 0:
            raise RunnerError(f"method.edges.top_k={e.top_k}: edges re-patched exactly, >= 0 (0: none).")
        if any(n < 0 for n in e.circuit):
            raise RunnerError(f"method.edges.circuit={list(e.circuit)}: circuit sizes are edge counts, each >= 0.")
        check_corruption(e.corruption, e.min_span, "method.edges")
        return bad
