"""The `patching` method: pairs a batch with its corruption, measures both runs, and patches each unit of each
target layer in each direction (exactly through engine.py, estimated through attribution.py) into rows.py's table."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import NO_LABEL, Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer, resolve_layers
from runner.methods.base import (
    Method,
    as_frame,
    check_targets,
    library_config,
    library_runtime,
    run_on_batch,
    select_targets,
    target_fields,
)
from runner.methods.patching.attribution import estimate_maps, unit_estimates
from runner.methods.patching.corruption import corrupt
from runner.methods.patching.engine import ExactEngine
from runner.methods.patching.metric import metric
from runner.methods.patching.rows import (
    SMALL_SPAN_WARNING,
    UNDEFINED,
    Site,
    pair_flags,
    unit_columns,
)
from runner.methods.patching.units import Units, enumerate_units
from runner.options.method.patching import (
    PatchDirection,
    PatchingMethodConfig,
    PatchMode,
    PatchUnit,
)
from runner.ranking import spearman, toward_source
from runner.rows import BatchOutput, Columns, concat_columns
from runner.runtime import Runtime
from runner.viz import pictures

log = logging.getLogger(__name__)


class Patching(Method):
    name = "patching"
    table = "patching"
    summary_values = ("restoration", "rank_correlation")

    def __init__(self, cfg: PatchingMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.p, self.layers, self.runtime = cfg, cfg.patching, layers, runtime
        self.module_types = {n: type(m).__name__ for n, m in layers}
        self.dataset: Dataset | None = None
        self.warned: set[str] = set()  # degenerate reasons already warned about in this run

    def prepare(self, dataset: Dataset) -> None:
        """Keep the data set: corruption.kind=pair takes a sample's partner from it."""
        self.dataset = dataset

    bind_dataset = prepare  # the name callers outside the run loop (tests) use

    def setup(self, session: HookSession, num_samples: int) -> None:
        check_targets(self.cfg, num_samples)
        self.session = session
        self.capture = session.capture(self.layers, differentiable=self.p.mode is not PatchMode.exact)
        self.replacements = session.replace(self.layers, call=self.p.call)
        self.engine = ExactEngine(self.p, self.runtime, session, self.capture, self.replacements)

    # ---- one batch of pairs --------------------------------------------------------------------
    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        corrupted, corrupted_ids = corrupt(batch, self.p.corruption, self.dataset)
        return self.run_pairs(model, batch, corrupted, corrupted_ids, session)

    def run_pairs(
        self, model: nn.Module, batch: Batch, corrupted: torch.Tensor, corrupted_ids: list[str], session: HookSession
    ) -> BatchOutput:
        """The `patching` rows of the pairs (batch.x[i], corrupted[i]) (`corrupted_ids` name the corrupted inputs)."""
        b = batch.x.shape[0]
        if corrupted.shape != batch.x.shape:
            raise RunnerError(
                f"Patching pairs: the corrupted inputs are {tuple(corrupted.shape)}, the clean ones"
                f" {tuple(batch.x.shape)}; give one corrupted input per clean one, of the same size."
            )
        both = torch.cat([batch.x, corrupted])  # (2B, C, H, W)
        attribution = self.p.mode is not PatchMode.exact
        session.new_forward()
        self.capture.clear()
        with torch.set_grad_enabled(attribution), self.runtime.autocast():
            logits = model(both).float()  # (2B, K)
        acts = self.capture.call_outputs(self.p.call, "method.patching.call")  # each (2B, ...)
        clean_logits, corrupted_logits = logits[:b].detach(), logits[b:].detach()
        target = select_targets(self.cfg, clean_logits, batch)  # (B,)
        contrast = self._contrast(corrupted_logits, target)
        metric_clean = self.metric(clean_logits, target, contrast)
        metric_corrupted = self.metric(corrupted_logits, target, contrast)
        reasons, spans = pair_flags(
            batch, corrupted, logits.detach(), target, contrast, metric_clean, metric_corrupted, self.p.metric,
            self.warned, self.p.min_span,
        )  # fmt: skip
        undefined = [any(r in UNDEFINED for r in rs.split(",")) for rs in reasons]  # per sample
        small = self._small_spans(batch, metric_clean, metric_corrupted, spans, undefined)  # per sample
        names = [n for n, _ in self.layers]
        estimates = (
            estimate_maps(self.p.metric, self.p.directions, logits, acts, names, target, contrast, b)
            if attribution
            else {}
        )
        self.capture.clear()
        parts: list[Columns] = []
        sites = itertools.count()  # (direction, sample, layer) sites: the share of the batch for its progress bar
        for direction in self.p.directions:
            for i in range(b):
                base_input = (corrupted if direction is PatchDirection.denoising else batch.x)[i : i + 1]
                for name, _ in self.layers:
                    self.engine.site = (next(sites), len(self.p.directions) * b * len(self.layers))
                    clean_act, corrupted_act = acts[name][i].detach(), acts[name][b + i].detach()
                    base, source = (
                        (corrupted_act, clean_act)
                        if direction is PatchDirection.denoising
                        else (clean_act, corrupted_act)
                    )
                    units = enumerate_units(name, tuple(base.shape), self.p.units, self.p.grid, self.p.cell_size)
                    site = Site(
                        i, direction, name, self.module_types[name], units, self.p.metric, target[i], contrast[i],
                        metric_clean[i], metric_corrupted[i], corrupted_ids[i], reasons[i], undefined[i], small[i],
                    )  # fmt: skip
                    parts += self._unit_rows(model, base_input, base, source, site, estimates.get((direction, name)))
        self.engine.site = None
        columns = concat_columns(parts)
        if self.runtime.pictures_dir is not None and self.p.units is PatchUnit.cell:
            pictures.write_patching_heatmaps(
                self.runtime.pictures_dir,
                batch,
                columns,
                self.cfg.pictures_max,
                self.runtime.class_names,
                self.runtime.figures,
            )
        return BatchOutput(predicted=clean_logits.argmax(dim=1), tables={self.table: columns})

    def metric(self, logits: torch.Tensor, target: torch.Tensor, contrast: torch.Tensor) -> torch.Tensor:
        """(n,) metric of logits (n, K) for the class `target` (and `contrast` for logit_diff), per row."""
        return metric(self.p.metric, logits, target, contrast)

    def _small_spans(
        self, batch: Batch, m_clean: torch.Tensor, m_corrupted: torch.Tensor, flags: list[bool], undefined: list[bool]
    ) -> list[bool]:
        """Per sample, whether its pair's span is below `min_span` (`flags`, from `pair_flags`'s one transfer;
        undefined pairs are flagged as such instead); warns once per run."""
        small = [bool(f) and not u for f, u in zip(flags, undefined, strict=True)]
        if any(small) and "small_span" not in self.warned:
            self.warned.add("small_span")
            i = small.index(True)
            span = float((m_clean[i] - m_corrupted[i]).abs())
            log.warning(SMALL_SPAN_WARNING.format(
                sample=batch.sample_ids[i], metric=self.p.metric.value, span=span, min_span=self.p.min_span,
            ))  # fmt: skip
        return small

    def _contrast(self, corrupted_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.p.contrast_class is not None:
            if not 0 <= self.p.contrast_class < corrupted_logits.shape[1]:
                raise RunnerError(f"patching.contrast_class={self.p.contrast_class} is outside the model's classes.")
            return torch.full_like(target, self.p.contrast_class)
        return corrupted_logits.argmax(dim=1)

    def patched_metrics(
        self, model: nn.Module, name: str, base_input: torch.Tensor, base: torch.Tensor, source: torch.Tensor,
        units: Units, target: torch.Tensor, contrast: torch.Tensor, order: list[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Metric of each patched variant (units in `order`, default all): the exact engine's (engine.py)."""
        return self.engine.patched_metrics(model, name, base_input, base, source, units, target, contrast, order)

    def _unit_rows(
        self, model: nn.Module, base_input: torch.Tensor, base: torch.Tensor, source: torch.Tensor, site: Site,
        estimate_map: torch.Tensor | None,
    ) -> list[Columns]:  # fmt: skip
        """The rows of every unit at `site`: attribution estimates (if any), then exact patches (unless attribution)."""
        units = site.units
        rows: list[Columns] = []
        estimates = None
        if estimate_map is not None:
            estimates = unit_estimates(units, estimate_map[site.sample_index])
            rows.append(unit_columns(site, list(range(units.count)), "attribution", site.base_metric + estimates))
        if self.p.mode is PatchMode.attribution:
            return rows
        order = list(range(units.count))
        if self.p.mode is PatchMode.attribution_topk:
            assert estimates is not None
            # the units estimated to move the metric furthest toward the source run's (in noising, usually down)
            aim = site.clean if site.direction is PatchDirection.denoising else site.corrupted  # the source's metric
            toward = toward_source(site.base_metric + estimates, site.base_metric, aim.to(estimates.device))
            order = toward.argsort(descending=True)[: self.p.top_k].tolist()
        patched = self.engine.patched_metrics(
            model, site.layer, base_input, base, source, units, site.target, site.contrast, order
        )
        exact = unit_columns(site, order, "exact", patched)
        if estimates is not None:
            # an undefined pair's effects are float noise around 0: their rank says nothing
            ranked = len(order) > 1 and not site.undefined
            # every part of a column on the rows' device: the table concatenates them (CPU with CUDA fails)
            device = patched.device
            nan = torch.tensor(float("nan"), device=device)
            rho = spearman(estimates[order], patched - site.base_metric) if ranked else nan
            exact["rank_correlation"] = rho.repeat(len(order))  # (len(order),)
            rows[0]["rank_correlation"] = torch.full((units.count,), float("nan"), device=device)
        rows.append(exact)
        return rows


def activation_patching(
    model: nn.Module,
    clean: torch.Tensor,
    layers: list[str],
    corrupted: torch.Tensor | None = None,
    target: int | list[int] | torch.Tensor | None = None,
    **settings: Any,
) -> pd.DataFrame:
    """Activation patching of `model` (in eval mode) on the clean batch `clean` (B, C, H, W), with no run directory:
    the `patching` table's rows, one per (direction, sample, layer, unit): `patched` is the metric with that unit's
    activation patched in, `restoration` = (patched - corrupted) / (clean - corrupted), `clean` and `corrupted`
    the unpatched runs' metrics.

    `corrupted`: the corrupted half of each pair (B, C, H, W); None: made from `clean` by `settings`'
    `corruption` (CorruptionConfig, default Gaussian noise). `target`: None for each sample's predicted class, a
    class id for all, or (B,) ids. `settings`: PatchingConfig's fields (units, grid, metric, directions, mode, ...).
    The model's hooks are removed before it returns."""
    cfg = library_config(PatchingMethodConfig, patching=settings, **target_fields(target))
    method = Patching(cfg, resolve_layers(model, list(layers)), library_runtime(clean))
    if corrupted is None:
        return as_frame(run_on_batch(method, model, clean).tables["patching"])
    b = clean.shape[0]
    batch = Batch(clean, torch.full((b,), NO_LABEL, dtype=torch.long), [str(i) for i in range(b)], 0)
    with HookSession(model, []) as session:
        method.setup(session, b)
        session.begin_batch(b, 0)
        out = method.run_pairs(model, batch, corrupted, [f"corrupted {i}" for i in range(b)], session)
        session.end_batch()
    return as_frame(out.tables["patching"])
