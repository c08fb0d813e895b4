"""`method=lm_edges`'s schema: edge attribution patching of a causal language model (EAP, EAP-IG): every edge of its
graph (runner/methods/lm_edges/graph.py) scored for the run's token target between each pair's clean and corrupted
prompt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from runner.errors import RunnerError
from runner.options.method.lm_patching import LmCorruptionConfig, check_corruption
from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig
from runner.site_kinds import SiteSelection


class EdgeMode(str, Enum):
    eap = "eap"  # the gradient at the corrupted run: two forwards and one backward a batch
    # the gradient at the clean run (Hanna et al.'s get_scores_eap: the EAP of the MIB circuit track's tables): two
    # forwards and one backward a batch
    eap_clean = "eap_clean"
    eap_ig = "eap_ig"  # the gradient averaged over `steps` runs from the corrupted toward the clean embeddings
    # the gradients at the clean and at the corrupted run averaged: two traced runs a batch (Hanna et al.'s
    # get_scores_clean_corrupted)
    clean_corrupted = "clean_corrupted"
    # the gradient averaged over (1 + 2 layers) x `steps` runs of the clean prompt, each with one writer group's output
    # (the embeddings, a layer's heads together, an MLP) k/steps of the way from corrupted to clean, k = 1 .. steps
    # (Hanna et al.'s get_scores_ig_activations)
    eap_ig_activations = "eap_ig_activations"
    exact = "exact"  # every edge patched: the corrupted run with the edge's reader given the writer's clean write


class EdgeAblation(str, Enum):
    corrupted = "corrupted"  # an edge outside the circuit carries its writer's output in the corrupted run
    mean = "mean"  # ... its writer's output averaged over the discovery pairs' clean prompts and real positions


class EdgeRanking(str, Enum):
    absolute = "absolute"  # a circuit of n edges: the n of largest |score|
    signed = "signed"  # ... the n of largest score (edges that work against the metric come last)
    # the circuits of both, each evaluated, in one run: the MIB circuit track's tables take CPR from the signed ranking
    # and CMD from the absolute one (the run's rank column and checked edges follow the absolute ranking)
    both = "both"


class PositionSlots(str, Enum):
    """How method.edges.per_position names a pair's positions (runner/methods/lm_edges/positions.py)."""

    auto = "auto"  # role where every pair names a role besides `end` (data=ioi: IO, S1, S2), else index
    role = "role"  # a role (IO, S1, S2, subject, end), the token after one (S1+1), the rest after it (after S1), start
    index = "index"  # counted back from the last token: end, end-1, end-2, ...


class HeldOutBy(str, Enum):
    pair = "pair"  # each pair by a seeded hash of its id
    template = "template"  # data=ioi: whole templates (the id's -t<k>), so no template is in both parts


MAX_STEPS = 1024  # method.edges.steps: more runs per batch than any published estimate uses (EAP-IG: 5 to 100)
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # the MIB circuit track's curve
# debug=light's curve: MIB's fractions one per decade, over the same span (each circuit is a forward of the model)
LIGHT_FRACTIONS = (0.001, 0.01, 0.1, 1.0)


@dataclass
class EdgePaths:
    """One path-patching set: the senders' clean writes reach the receivers through their direct edges only (node
    names of runner/methods/lm_edges/graph.py, or shell patterns of them: `a22.h*`, `a2[0-2].h*`, `a23.h3<q>`)."""

    senders: list[str] = field(default_factory=list)  # writers: input, a{l}.h{h}, m{l}
    receivers: list[str] = field(default_factory=list)  # readers: a{l}.h{h}<q>, a{l}.g{g}<k>, <v>, m{l}, logits
    name: Optional[str] = None  # the path's name in lm_paths; null: "senders -> receivers"  # noqa: UP045 (OmegaConf)


@dataclass
class LmEdgesConfig:
    mode: EdgeMode = EdgeMode.eap_ig
    # eap_ig's and eap_ig_activations' interpolation steps (read by those two only: eap is one run, the corrupted run;
    # clean_corrupted two)
    steps: int = 5
    corruption: LmCorruptionConfig = field(default_factory=LmCorruptionConfig)
    # The run's top_k edges (by the run's ranking) and as many others drawn at random, patched exactly on every
    # discovery pair (table lm_edge_exact, column `exact`, and the estimate's calibration, lm_edge_calibration); 0: none
    top_k: int = 0
    # The circuits evaluated (tables lm_circuit, lm_circuit_curve): the run's top edges at these fractions of the
    # model's edges (MIB's by default; [] for none) and at these edge counts (`circuit`), each on every pair
    fractions: list[float] = field(default_factory=lambda: list(MIB_FRACTIONS))
    circuit: list[int] = field(default_factory=list)
    ablation: EdgeAblation = EdgeAblation.corrupted  # what the circuit's left-out edges carry
    ranking: EdgeRanking = EdgeRanking.absolute  # which edges a circuit of n keeps
    # The fraction of pairs held out of discovery (their circuit curve is the held-out one); null: 0.5 when the data
    # has at least 8 pairs, else none (the log says which); 0: none
    held_out: Optional[float] = None  # noqa: UP045 (OmegaConf)
    held_out_by: HeldOutBy = HeldOutBy.pair
    # Bootstrap resamples of the discovery pairs: each edge's interval (score_lo, score_hi), how often it is in the
    # top-n circuit, the Jaccard overlap of the resamples' circuits (lm_circuit_stability, lm_circuit_curve); 0: none
    resamples: int = 200
    seed: int = 0  # the held-out split, the bootstrap, the random edges of the calibration
    per_pair: bool = False  # also table lm_edge_pair_scores' rows per (edge, discovery pair); false: one row per pair
    # A pair whose |clean - corrupted| is below min_span x max(|clean|, |corrupted|) is flagged small_span (as in
    # lm_patching); flagged pairs are left out of the run's means.
    min_span: float = 0.05
    # Path patching (table lm_paths), on the discovery pairs: per set, the corrupted run with each receiver reading
    # + the clean - corrupted write of each of its senders (Wang et al. 2022); [] for none
    paths: list[EdgePaths] = field(default_factory=list)
    # Score, rank and keep each edge at each position (a unit: edge x position slot, where the reader reads the write:
    # the reader's own position for a query, an MLP and the logits, the key's position for a key or a value), not
    # summed over positions; circuits are sets of units. `positions`: how the slots are named across pairs
    per_position: bool = False
    positions: PositionSlots = PositionSlots.auto
    # GiB of the readers' gradients held at once while scoring (whole layers' readers, at least one layer); null: a
    # quarter of the device's free memory. Scores are the same for any value (to float rounding)
    gradient_memory: Optional[float] = None  # noqa: UP045 (OmegaConf)


@METHODS.option(
    "runner.methods.lm_edges.method:LmEdges",
    tables=(
        "lm_edges",
        "lm_circuit",
        "lm_circuit_curve",
        "lm_circuit_scores",
        "lm_circuit_stability",
        "lm_edge_pair_scores",
        "lm_edge_pairs",
        "lm_edge_exact",
        "lm_edge_calibration",
        "lm_paths",
    ),
    family=LM_FAMILY,
)
@dataclass
class LmEdgesMethodConfig(MethodConfig):
    """`method=lm_edges`: the mode and corruption sit under `method.edges`; the metric is the run's `target`
    (target=token_logit_diff, token_prob_diff, answer_logprob or kl_to_clean)."""

    name: str = "lm_edges"
    edges: LmEdgesConfig = field(default_factory=LmEdgesConfig)

    def check(self) -> list[str]:
        bad = super().check()
        e = self.edges
        if not 1 <= e.steps <= MAX_STEPS:
            raise RunnerError(f"method.edges.steps={e.steps}: interpolation runs per batch, 1 to {MAX_STEPS}.")
        if e.top_k < 0:
            raise RunnerError(f"method.edges.top_k={e.top_k}: edges re-patched exactly, >= 0 (0: none).")
        if any(n < 0 for n in e.circuit) or len(set(e.circuit)) != len(e.circuit):
            raise RunnerError(
                f"method.edges.circuit={list(e.circuit)}: circuit sizes are edge counts, each >= 0 and given once."
            )
        if any(not 0 < f <= 1 for f in e.fractions) or len(set(e.fractions)) != len(e.fractions):
            raise RunnerError(
                f"method.edges.fractions={list(e.fractions)}: fractions of the model's edges, each in (0, 1] and given"
                " once ([] for none)."
            )
        if e.held_out is not None and not 0 <= e.held_out < 1:
            raise RunnerError(f"method.edges.held_out={e.held_out}: the fraction of pairs held out, in [0, 1).")
        if e.gradient_memory is not None and not e.gradient_memory > 0:
            raise RunnerError(
                f"method.edges.gradient_memory={e.gradient_memory}: GiB of gradients held at once, > 0 (null: a quarter"
                " of the device's free memory)."
            )
        if e.resamples < 0 or e.resamples == 1:
            raise RunnerError(f"method.edges.resamples={e.resamples}: bootstrap resamples, 0 (none) or >= 2.")
        for i, path in enumerate(e.paths):
            if not path.senders or not path.receivers:
                raise RunnerError(
                    f"method.edges.paths[{i}]: give senders (writers: input, a3.h2, m3, or patterns: a3.h*) and"
                    " receivers (readers: a5.h1<q>, a5.g0<k>, a5.g0<v>, m5, logits)."
                )
        check_corruption(e.corruption, e.min_span, "method.edges")
        return bad

    def selection(self) -> SiteSelection:
        """Every layer's writers and readers (runner/methods/lm_edges/graph.py `sites`)."""
        kinds = ("resid_pre", "head", "q", "k", "v", "mlp_out")
        return SiteSelection("method.edges", kinds, None, sites_chosen=False, layers_chosen=False)

    def lightened(self, layers: int) -> LmEdgesMethodConfig:
        """Every edge is still scored (a circuit needs them all): fewer interpolation steps, resamples, edges
        re-patched exactly, and circuits on MIB's curve (fractions given on the command line are kept)."""
        e = self.edges
        fractions = list(LIGHT_FRACTIONS) if tuple(e.fractions) == MIB_FRACTIONS else e.fractions
        light = dataclasses.replace(
            e, steps=min(e.steps, 2), resamples=min(e.resamples, 20), top_k=min(e.top_k, 10), fractions=fractions
        )
        return dataclasses.replace(self, edges=light)
