"""How each mode estimates an edge's effect: one `Estimator` per method.edges.mode, saying the runs whose readers'
gradients it averages and where they are taken. The edge scores (scores.py) are then, for every mode,

    score(w -> r) = sum over positions of (write_w(clean) - write_w(corrupted)) . mean over the runs of dM/d(input of r)

  eap                 one run: the corrupted run (Syed et al. 2023; TransformerLens's `attribution_patch`)
  eap_clean           one run: the clean run (the EAP of Hanna et al.'s code, `get_scores_eap`, and so of the MIB
                      circuit track's tables; the corrupted run is made without gradients for its writes)
  eap_ig              `steps` runs of the corrupted prompt with its input embeddings moved k / steps of the way to
                      the clean ones, k = 0 .. steps - 1 (Hanna et al.'s `get_scores_eap_ig`; MIB's EAP-IG-inputs)
  clean_corrupted     two runs, the clean and the corrupted (their `get_scores_clean_corrupted`)
  eap_ig_activations  (1 + 2 layers) x steps runs (their `get_scores_ig_activations`; MIB's EAP-IG-activations):
                      for each writer group G (the embeddings: site resid_pre.0; each
                      layer's attention, all its heads together: site `head`, the heads' outputs z before the output
                      projection; each layer's MLP: `mlp_out`) and each k = 1 .. steps, the run of the clean prompt
                      with G's output set to a G(clean) + (1 - a) G(corrupted), a = k / steps (G's outputs in the
                      clean and in the corrupted run, constants), every other site computed by the forward. As in
                      theirs, the runs are of the clean prompt and a goes from 1/steps to 1: a = 1 (the clean run
                      itself, once per group) is among them, a = 0 is not.
  exact               no gradient: every edge patched (intervene.py), one intervention a unit
In a run where G is set nothing upstream reaches the metric through G: a reader of G's own block (the attention's
q, k, v inputs when G is that attention, the MLP's input when G is that MLP) has gradient 0 in that run, as in theirs.

Where these differ from their code:
  - the sign: they score (corrupted - clean) . g, here (clean - corrupted) . g: a positive score means that moving the
    edge toward its clean value raises the metric (MIB ranks by |score| for CMD and by the signed score for CPR, so
    the sign flips which end a signed ranking keeps, not which edges an absolute one does);
  - each pair is scored on its own, not the batch's mean (the run's mean over the discovery pairs comes later, as
    for every mode);
  - keys and values are read per key-value head (graph.py: one k and one v reader per key-value head, shared by its
    query heads), where their graph has a k and a v input per query head;
  - the embeddings' output is the first block's input (resid_pre.0), theirs TransformerLens's hook_embed, before a
    position embedding is added: the same runs (that embedding is the same in both runs of a pair); the attention's
    output is set before its output projection, theirs after it (hook_result): the same runs, the projection being
    linear;
  - the corrupted run is the run's corruption (method.edges.corruption: the pair's corrupted prompt, or the clean
    prompt with its embeddings edited); their mean-ablation `intervention` is not offered.

clean_corrupted's and eap_ig_activations' runs are stacked in the rows of traced forwards, RUN_ROWS rows at most (one
run at least), run j's pairs at rows j B .. (j + 1) B - 1: runs and pairs are independent, so one backward of the
metrics' sum gives every run's gradients, summed over the runs site by site as they come and handed to the edge
scores a chunk of layers at a time (scores.reader_gradients, ScoreSum). Memory grows with a forward's rows, not with
the runs; the forwards with the runs / (RUN_ROWS // B). eap_ig's runs go one a forward: memory does not grow with
`steps`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import forward_last
from runner.methods.lm.corruptions import Corrupted, Corruption, EmbeddingEdit
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.scores import Sink, reader_gradients
from runner.options.method.lm_edges import EdgeMode
from runner.progress import within_batch

RUN_ROWS = 64  # rows (runs x pairs) a traced forward of these estimators stacks at most (one run at least)


@dataclass
class Run:
    """One run of the batch's B pairs."""

    ids: torch.Tensor  # (B, T) its prompts
    edit: EmbeddingEdit | None = None  # its embeddings' edit (an embedding corruption's corrupted run)
    fixed: dict[str, torch.Tensor] = field(default_factory=dict)  # site name -> (B, T, ...) the value given there


@dataclass
class Runs:
    """What a batch's runs need of the method: the model, its site hooks (on the graph's sites), the embedding edit's
    hook, the autocast, the graph, the prompts' mask (B, T), the metric of a run's last logits (B, V) -> (B,), where
    the readers' gradients go (scores.reader_gradients' sink, `chunk_bytes` at a time), where the corrupted run's
    views and last logits (B, V) go as soon as they are made (`kept`, `kept_logits`: before any gradient reaches the
    sink, which reads them), and the embeddings module (`embed`)."""

    model: nn.Module
    hooks: SiteHooks
    corruption: Corruption
    autocast: Callable[[], AbstractContextManager[Any]]
    graph: EdgeGraph
    mask: torch.Tensor
    metric: Callable[[torch.Tensor], torch.Tensor]
    sink: Sink
    kept: dict[str, torch.Tensor]
    kept_logits: list[torch.Tensor]
    chunk_bytes: int | None = None
    embed: nn.Module | None = None  # the embeddings (eap, eap_ig: their output is what the runs move)

    def views(self, run: Run) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`run` without gradients: its sites' views and its last logits (B, V)."""
        return self._forward([run], grad=False)

    def gradients(
        self, run: Callable[[int], Run], count: int, keep: int | None = None, per_forward: int | None = None
    ) -> None:  # fmt: skip
        """The readers' gradients of the runs `run(0)` .. `run(count - 1)` into the sink (their sum), the runs stacked
        `per_forward` a forward (None: RUN_ROWS rows, one run at least), each made when its forward comes; with
        `keep`, that run's views and logits go to `kept` and `kept_logits` first."""
        pairs = self.mask.shape[0]
        step = per_forward or max(1, RUN_ROWS // pairs)
        for start in range(0, count, step):
            within_batch(0.5 * start / count, f"lm_edges: gradient runs {start}/{count}")
            chunk = [run(j) for j in range(start, min(start + step, count))]
            views, logits = self._forward(chunk, grad=True)
            if keep is not None and start <= keep < start + len(chunk):
                rows = slice((keep - start) * pairs, (keep - start + 1) * pairs)
                # a copy of the run's rows where the forward stacks others (their memory is freed), else the views
                held = (lambda x: x.detach().clone()) if len(chunk) > 1 else torch.Tensor.detach
                self.kept.update({name: held(view[rows]) for name, view in views.items()})
                self.kept_logits.append(held(logits[rows]))
            metric = torch.cat([self.metric(part) for part in logits.split(pairs)])  # (runs x B,)
            reader_gradients(self.graph, views, metric, self.sink, runs=len(chunk), chunk_bytes=self.chunk_bytes)
            del views, logits, metric

    def _forward(self, chunk: list[Run], grad: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The runs `chunk` stacked in one forward (kept, traced where `grad`): its views and last logits."""
        pairs = self.mask.shape[0]
        fixed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in dict.fromkeys(name for r in chunk for name in r.fixed):
            at = [j for j, r in enumerate(chunk) if name in r.fixed]
            rows = torch.cat([torch.arange(j * pairs, (j + 1) * pairs) for j in at])
            fixed[name] = (rows, torch.cat([chunk[j].fixed[name] for j in at]))
        ids = torch.cat([r.ids for r in chunk])  # (runs x B, T)
        self.corruption.active = _stacked([r.edit for r in chunk])
        try:
            with torch.enable_grad() if grad else torch.no_grad(), self.autocast(), self.hooks.keep(grad, fixed):
                logits = forward_last(self.model, ids, self.mask.repeat(len(chunk), 1)).logits[:, -1].float()
        finally:
            self.corruption.active = None
        views, self.hooks.kept = self.hooks.kept, {}
        return views, logits


def _stacked(edits: list[EmbeddingEdit | None]) -> EmbeddingEdit | None:
    """The edit of runs stacked in the rows, from each run's (None: none, an identity edit among edited runs)."""
    given = [e for e in edits if e is not None]
    if not given:
        return None
    if len(edits) == 1:
        return given[0]
    none = EmbeddingEdit(torch.ones_like(given[0].scale), torch.zeros_like(given[0].shift))
    chosen = [none if e is None else e for e in edits]
    return EmbeddingEdit(torch.cat([e.scale for e in chosen]), torch.cat([e.shift for e in chosen]))


class Estimator:
    """A mode's estimate of the edges' effects: the runs whose readers' gradients it averages (`runs`, of `steps` and
    the model's `layers`), where they are taken (`gradient_point`), the runs a traced forward stacks at most
    (`stacked`, of the batch's pairs), the runs' views held besides the traced forward's (`kept_views`: the corrupted
    run's for the writes, and the clean run's where the runs interpolate toward it), and `gradients`, which puts the
    readers' gradients of the runs into `runs.sink` and the corrupted run's views and logits into `runs.kept` and
    `runs.kept_logits` before any gradient goes to the sink. `traced`: False for a mode of no gradient (exact)."""

    mode: EdgeMode
    gradient_point: str
    traced = True
    kept_views = 1

    def runs(self, steps: int, layers: int) -> int:
        return 1

    def stacked(self, steps: int, layers: int, pairs: int) -> int:
        """The most runs one traced forward holds."""
        return min(self.runs(steps, layers), max(1, RUN_ROWS // pairs))

    def gradients(self, runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> None:
        raise NotImplementedError


class Integrated(Estimator):
    """eap_ig: the runs of the corrupted prompt with its embeddings moved k / steps of the way to the clean ones,
    k = 0 .. steps - 1, one a forward (the first, k = 0, is the corrupted run itself: its views are the kept ones)."""

    mode = EdgeMode.eap_ig
    gradient_point = "the corrupted run, its input embeddings moved k/steps of the way to the clean ones"

    def runs(self, steps: int, layers: int) -> int:
        return steps

    def stacked(self, steps: int, layers: int, pairs: int) -> int:
        return 1

    def gradients(self, runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> None:
        assert runs.embed is not None, "eap and eap_ig move the embeddings' output: Runs.embed"
        with torch.no_grad():
            # the embedding outputs the interpolation runs between (the edit hook sits on this module)
            clean_embedding = runs.embed(clean)
        count = self.runs(steps, 0)

        def run(k: int) -> Run:
            return Run(corrupted.ids, _toward(corrupted.edit, clean_embedding, k / count, corrupted.ids.shape))

        runs.gradients(run, count, keep=0, per_forward=1)


class AtCorrupted(Integrated):
    """eap: the corrupted run alone (eap_ig of one step)."""

    mode = EdgeMode.eap
    gradient_point = "the corrupted run"
    kept_views = 0  # its one traced run is the corrupted run: the views kept are that run's

    def runs(self, steps: int, layers: int) -> int:
        return 1


class AtClean(Estimator):
    """eap_clean: the clean run alone; the corrupted run is made without gradients, for its writes and metric."""

    mode = EdgeMode.eap_clean
    gradient_point = "the clean run"

    def gradients(self, runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> None:
        corrupted_views, corrupted_logits = runs.views(Run(corrupted.ids, corrupted.edit))
        runs.kept.update(corrupted_views)
        runs.kept_logits.append(corrupted_logits)
        runs.gradients(lambda j: Run(clean), 1)


class CleanCorrupted(Estimator):
    """clean_corrupted: the corrupted and the clean run, stacked in one forward where the rows allow."""

    mode = EdgeMode.clean_corrupted
    gradient_point = "the clean and the corrupted run, averaged"

    def runs(self, steps: int, layers: int) -> int:
        return 2

    def gradients(self, runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> None:
        both = [Run(corrupted.ids, corrupted.edit), Run(clean)]
        runs.gradients(both.__getitem__, len(both), keep=0)


class IgActivations(Estimator):
    """eap_ig_activations: the runs of the clean prompt with one writer group's output at a = k / steps of the way
    from its corrupted to its clean value, k = 1 .. steps (module docstring); the clean and the corrupted run are
    made without gradients first, for the values the runs interpolate between."""

    mode = EdgeMode.eap_ig_activations
    gradient_point = "the clean run, one writer group's output moved from its corrupted toward its clean value"
    kept_views = 2

    def runs(self, steps: int, layers: int) -> int:
        return (1 + 2 * layers) * steps

    def gradients(self, runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> None:
        clean_views, _ = runs.views(Run(clean))
        corrupted_views, corrupted_logits = runs.views(Run(corrupted.ids, corrupted.edit))
        runs.kept.update(corrupted_views)
        runs.kept_logits.append(corrupted_logits)
        groups = runs.graph.writer_sites()  # the embeddings, then per layer its attention and its MLP

        def run(j: int) -> Run:
            group, alpha = groups[j // steps], (j % steps + 1) / steps
            value = alpha * clean_views[group] + (1 - alpha) * corrupted_views[group]  # theirs: a = 1 is clean
            return Run(clean, None, {group: value})

        runs.gradients(run, len(groups) * steps)


class Exact(Estimator):
    """exact: no gradient; every unit patched in turn (the scoring pass's intervention forwards)."""

    mode = EdgeMode.exact
    gradient_point = "none: each edge patched"
    traced = False  # no gradient run: its runs and stacking are not read


ESTIMATORS: dict[EdgeMode, Estimator] = {
    e.mode: e for e in (AtCorrupted(), AtClean(), Integrated(), CleanCorrupted(), IgActivations(), Exact())
}


def _toward(
    edit: EmbeddingEdit | None, clean: torch.Tensor, alpha: float, shape: torch.Size
) -> EmbeddingEdit | None:  # fmt: skip
    """The edit that makes the corrupted run's embedding output E_c (edited by `edit`: E_c * s + t) into
    (1 - alpha) (E_c * s + t) + alpha * clean; `edit` itself at alpha = 0."""
    if alpha == 0:
        return edit
    b, t = shape
    scale = torch.ones(b, t, 1, device=clean.device) if edit is None else edit.scale.to(clean.device)
    shift = torch.zeros_like(clean) if edit is None else edit.shift.to(clean.device, clean.dtype)
    return EmbeddingEdit(scale * (1 - alpha), shift * (1 - alpha) + clean * alpha)
