"""Two more estimators of the readers' gradients that the edge scores take (scores.py:
score(w -> r) = sum over positions of (write_w(clean) - write_w(corrupted)) . g_r), after Hanna et al. (2024)'s code
(github.com/hannamw/EAP-IG, src/eap/attribute.py):

  clean_corrupted     g_r = (dM/d(input of r) at the clean run + the same at the corrupted run) / 2: two traced runs
                      (their `get_scores_clean_corrupted`);
  eap_ig_activations  g_r = the mean of dM/d(input of r) over (1 + 2 layers) x steps runs (their
                      `get_scores_ig_activations`): for each writer group G (the embeddings: site resid_pre.0; each
                      layer's attention, all its heads together: site `head`, the heads' outputs z before the output
                      projection; each layer's MLP: `mlp_out`) and each k = 1 .. steps, the run of the clean prompt
                      with G's output set to a G(clean) + (1 - a) G(corrupted), a = k / steps (G's outputs in the
                      clean and in the corrupted run, constants), every other site computed by the forward. As in
                      theirs, the runs are of the clean prompt and a goes from 1/steps to 1: a = 1 (the clean run
                      itself, once per group) is among them, a = 0 is not.
In a run where G is set nothing upstream reaches the metric through G: a reader of G's own block (the attention's
q, k, v inputs when G is that attention, the MLP's input when G is that MLP) has gradient 0 in that run, as in theirs.

Where this differs from their code:
  - the sign: they score (corrupted - clean) . g, here (clean - corrupted) . g, as eap and eap_ig here: a positive
    score means that moving the edge toward its clean value raises the metric;
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

A batch's runs are stacked in the rows of traced forwards, RUN_ROWS rows at most (one run at least), run j's pairs at
rows j B .. (j + 1) B - 1: runs and pairs are independent, so one backward of the metrics' sum gives every run's
gradients, summed over the runs site by site as they come and handed to the edge scores a chunk of layers at a time
(scores.reader_gradients, ScoreSum). Memory grows with a forward's rows, not with the runs; the forwards with the
runs / (RUN_ROWS // B).
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
    the readers' gradients go (scores.reader_gradients' sink, `chunk_bytes` at a time), and where the corrupted run's
    views and last logits (B, V) go as soon as they are made (`kept`, `kept_logits`: before any gradient reaches the
    sink, which reads them)."""

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

    def views(self, run: Run) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`run` without gradients: its sites' views and its last logits (B, V)."""
        return self._forward([run], grad=False)

    def gradients(self, run: Callable[[int], Run], count: int, keep: int | None = None) -> None:
        """The readers' gradients of the runs `run(0)` .. `run(count - 1)` into the sink (their sum), the runs stacked
        RUN_ROWS rows a forward (each made when its forward comes); with `keep`, that run's views and logits go to
        `kept` and `kept_logits` first."""
        pairs = self.mask.shape[0]
        step = max(1, RUN_ROWS // pairs)
        for start in range(0, count, step):
            within_batch(0.5 * start / count, f"lm_edges: gradient runs {start}/{count}")
            chunk = [run(j) for j in range(start, min(start + step, count))]
            views, logits = self._forward(chunk, grad=True)
            if keep is not None and start <= keep < start + len(chunk):
                rows = slice((keep - start) * pairs, (keep - start + 1) * pairs)
                self.kept.update({name: view[rows].detach().clone() for name, view in views.items()})
                self.kept_logits.append(logits[rows].detach().clone())
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


def clean_corrupted(runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> int:
    """The readers' gradients at the corrupted and at the clean run (`clean`: the clean prompts' ids) into the sink;
    their mean is the sum / the runs returned. `steps` unread."""
    both = [Run(corrupted.ids, corrupted.edit), Run(clean)]
    runs.gradients(both.__getitem__, len(both), keep=0)
    return len(both)


def ig_activations(runs: Runs, clean: torch.Tensor, corrupted: Corrupted, steps: int) -> int:
    """The readers' gradients of the runs of the clean prompt with one writer group's output at a = k / steps of the
    way from its corrupted to its clean value, k = 1 .. steps (module docstring), into the sink; their mean is the
    sum / the runs returned."""
    clean_views, _ = runs.views(Run(clean))
    corrupted_views, corrupted_logits = runs.views(Run(corrupted.ids, corrupted.edit))
    runs.kept.update(corrupted_views)
    runs.kept_logits.append(corrupted_logits)
    groups = runs.graph.writer_sites()  # the embeddings, then per layer its attention and its MLP

    def run(j: int) -> Run:
        group, alpha = groups[j // steps], (j % steps + 1) / steps
        value = alpha * clean_views[group] + (1 - alpha) * corrupted_views[group]  # theirs: a = 1 is the clean value
        return Run(clean, None, {group: value})

    count = len(groups) * steps
    runs.gradients(run, count)
    return count


ESTIMATORS: dict[EdgeMode, Callable[[Runs, torch.Tensor, Corrupted, int], int]] = {
    EdgeMode.clean_corrupted: clean_corrupted,
    EdgeMode.eap_ig_activations: ig_activations,
}
