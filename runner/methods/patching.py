"""Activation patching for vision models: layers x channels x spatial cells (or tokens), batched.

For each clean sample and its corrupted twin (runner/corruption.py), and each direction:
  denoising: run the corrupted input, put the clean activation of one unit in place at a layer;
  noising:   run the clean input, put the corrupted activation of one unit in place.
The metric (a logit, its probability, or a logit difference) of the patched run is reported raw
and as restoration = (patched - corrupted) / (clean - corrupted): 1 = the unit alone restores the
clean output, 0 = it changes nothing.

Execution. Clean and corrupted activations of every target layer come from one forward (batch 2B).
Each patched variant is base_act + mask_u * (source_act - base_act); `chunk` variants are stacked
along the batch and run in one forward. With `reuse_prefix`, that forward takes the base input at
batch 1 and the session's replacement returns the n variants at the patched layer, so the layers
before it run once per chunk instead of n times (skip connections broadcast the batch-1 tensors).
A model that cannot (one that reshapes with the input's batch size, e.g. `x.view(bs, -1)`) is
detected on the first chunk and run with the base input repeated instead.

Attribution patching (Nanda 2023): estimate_u = sum over u of (source_act - base_act) * dM/d(base_act),
every unit of every layer from one clean+corrupted forward and one backward per direction.
`attribution_topk` ranks units by the estimate, patches the top k exactly, and reports the Spearman
rank correlation between estimate and exact effect per (pair, direction, layer).

Degenerate set-ups are flagged per row (`degenerate`, `degenerate_reason`) and warned about once per
run in the log: `self_pair` (the corrupted input equals the clean one: corruption.kind=none, a sample
paired with itself, noise of std 0), `target_is_contrast` (logit_diff of a class with itself, 0 by
definition), `constant_logits` (every logit of the clean or corrupted run equal: an untrained head),
`zero_span` (clean metric == corrupted metric, or not finite, for another reason). Restoration
divides by clean - corrupted, so it is NaN, never a number from float noise, for self_pair,
target_is_contrast and zero_span rows; `patched` is still reported.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import pyarrow as pa
import torch
from torch import nn
from torch.utils.data import Dataset

from runner import pictures
from runner.cone import Cone
from runner.corruption import corrupt, is_valid_box
from runner.data import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession, Replacement
from runner.layers import Layer
from runner.methods.base import BatchOutput, Columns, Method, Runtime, check_targets, register, select_targets
from runner.methods.cam import concat_columns
from runner.methods.sanity import spearman
from runner.schema import (
    CorruptionKind,
    MethodConfig,
    PatchDirection,
    PatchingConfig,
    PatchMetric,
    PatchMode,
    PatchUnit,
)
from runner.tables import declare, optional

log = logging.getLogger(__name__)

# Why a pair's rows are degenerate, and the one-line warning for each (logged once per run).
DEGENERATE_WARNINGS = {
    "self_pair": "sample '{sample}' is paired with an identical input (corruption.kind=none, pair_with the sample"
    " itself, or a corruption that changes nothing): restoration is NaN. Pick another corruption or pair_with.",
    "target_is_contrast": "sample '{sample}': the target class {target} is also the contrast class, so logit_diff is 0"
    " by definition and restoration is NaN. Set method.patching.contrast_class, or check the weights (an untrained"
    " model predicts one class for every input).",
    "constant_logits": "sample '{sample}': every logit of the clean or corrupted run is equal (an untrained head, e.g."
    " model.weights=null): the target class is arbitrary.",
    "zero_span": "sample '{sample}': the clean and corrupted metric are equal (or not finite), so restoration"
    " (patched - corrupted) / (clean - corrupted) is NaN. Use a stronger corruption.",
}
# Reasons that leave restoration undefined (constant_logits alone leaves it a number, if a meaningless one).
UNDEFINED = ("self_pair", "target_is_contrast", "zero_span")


@dataclass
class Units:
    """The units of one layer: broadcastable masks on demand, and their identifier columns."""

    kind: PatchUnit
    shape: tuple[int, ...]  # one sample's activation shape
    count: int
    channel: list[int | None]
    y: list[int | None]
    x: list[int | None]
    token: list[int | None]
    cells: list[tuple[int, int, int, int]]  # cell bounds (y0, y1, x0, x1) for cell units
    grid: tuple[int, int] | None

    def masks(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """(n, *shape) bool masks of units start..stop, broadcastable (size 1 where a unit spans the dim)."""
        n = stop - start
        if self.kind is PatchUnit.layer:
            return torch.ones((1, *self.shape), dtype=torch.bool, device=device)
        if self.kind is PatchUnit.channel:
            dims = (n, self.shape[0]) + (1,) * (len(self.shape) - 1)
            mask = torch.zeros(dims, dtype=torch.bool, device=device)
            mask[torch.arange(n), torch.arange(start, stop)] = True
            return mask
        if self.kind is PatchUnit.token:
            mask = torch.zeros((n, self.shape[0], 1), dtype=torch.bool, device=device)
            mask[torch.arange(n), torch.arange(start, stop)] = True
            return mask
        mask = torch.zeros((n, 1, *self.shape[1:]), dtype=torch.bool, device=device)
        for i, (y0, y1, x0, x1) in enumerate(self.cells[start:stop]):
            mask[i, 0, y0:y1, x0:x1] = True
        return mask


def enumerate_units(
    name: str, shape: tuple[int, ...], kind: PatchUnit, grid: list[int], cell_size: int | None
) -> Units:
    """The units of a layer whose per-sample activation has `shape`."""
    if kind is PatchUnit.layer:
        return Units(kind, shape, 1, [None], [None], [None], [None], [], None)
    if kind is PatchUnit.channel:
        c = shape[0]
        return Units(kind, shape, c, list(range(c)), [None] * c, [None] * c, [None] * c, [], None)
    if kind is PatchUnit.token:
        if len(shape) != 2:
            raise RunnerError(f"units=token needs (batch, tokens, dim) outputs; layer '{name}' gives {(None, *shape)}.")
        t = shape[0]
        return Units(kind, shape, t, [None] * t, [None] * t, [None] * t, list(range(t)), [], None)
    if len(shape) != 3:
        raise RunnerError(
            f"units=cell needs spatial outputs (batch, channels, height, width); layer '{name}' gives {(None, *shape)}."
            " Use units=channel or token, or pick convolutional layers."
        )
    h, w = shape[1:]
    if cell_size:
        edges_y, edges_x = list(range(0, h, cell_size)) + [h], list(range(0, w, cell_size)) + [w]
    else:
        gh, gw = min(grid[0], h), min(grid[1], w)
        edges_y = [round(i * h / gh) for i in range(gh + 1)]
        edges_x = [round(j * w / gw) for j in range(gw + 1)]
    cells, ys, xs = [], [], []
    for i in range(len(edges_y) - 1):
        for j in range(len(edges_x) - 1):
            cells.append((edges_y[i], edges_y[i + 1], edges_x[j], edges_x[j + 1]))
            ys.append(i)
            xs.append(j)
    n = len(cells)
    return Units(kind, shape, n, [None] * n, ys, xs, [None] * n, cells, (len(edges_y) - 1, len(edges_x) - 1))


# The `patching` table's own columns (`Patching._columns`): one row per (pair, direction, layer, unit, patch method).
PATCHING_SCHEMA = declare(
    "patching",
    [
        pa.field("corrupted_id", pa.string()),
        pa.field("direction", pa.string()),  # denoising | noising
        pa.field("layer", pa.string()),
        pa.field("module_type", pa.string()),
        pa.field("unit", pa.string()),  # layer | channel | cell | token
        *(pa.field(n, pa.int64()) for n in ("channel", "y", "x", "token")),  # null where the unit has none
        *(pa.field(n, pa.int64()) for n in ("grid_h", "grid_w")),  # null unless units=cell
        pa.field("patch_method", pa.string()),  # exact | attribution
        pa.field("metric", pa.string()),
        pa.field("target", pa.int64()),
        pa.field("contrast", pa.int64()),
        *(pa.field(n, pa.float32()) for n in ("clean", "corrupted", "patched", "restoration")),
        pa.field("degenerate", pa.bool_()),
        pa.field("degenerate_reason", pa.string()),
        optional("rank_correlation", pa.float32(), "method.patching.mode=attribution_topk"),
    ],
)


@dataclass
class PatchingMethodConfig(MethodConfig):
    """`method=patching`: the what and how of patching sit under `method.patching` (PatchingConfig)."""

    name: str = "patching"
    patching: PatchingConfig = field(default_factory=PatchingConfig)

    def check(self) -> list[str]:
        bad = super().check()
        p = self.patching
        bad += [f"method.patching.top_k={p.top_k}"] if p.top_k < 1 else []
        for key, value in (("chunk", p.chunk), ("cell_size", p.cell_size)):
            if value is not None and value < 1:
                bad.append(f"method.patching.{key}={value}")
        if len(p.grid) != 2 or min(p.grid) < 1:
            bad.append(f"method.patching.grid={p.grid} (two positive numbers)")
        if not p.directions or len(set(p.directions)) != len(p.directions):
            raise RunnerError(
                f"method.patching.directions={[d.value for d in p.directions]}: give each direction at most once"
                " and at least one, e.g. method.patching.directions=[denoising] or [denoising,noising]."
            )
        c = p.corruption
        if (
            not math.isfinite(c.std)
            or c.std < 0
            or not math.isfinite(c.sigma)
            or c.sigma <= 0
            or p.call < 0
            or (p.contrast_class is not None and p.contrast_class < 0)
        ):
            raise RunnerError(
                f"Out of range: method.patching.corruption.std={c.std} (finite, >= 0),"
                f" corruption.sigma={c.sigma} (finite, > 0), method.patching.call={p.call} (>= 0),"
                f" method.patching.contrast_class={p.contrast_class} (null or a class id >= 0)."
            )
        if not is_valid_box(c.box):
            raise RunnerError(
                f"method.patching.corruption.box={c.box} must be [y0, x0, y1, x1], fractions of the image in [0, 1]"
                " with y0 < y1 and x0 < x1, e.g. [0.25, 0.25, 0.75, 0.75]."
            )
        if c.kind is CorruptionKind.pair and not c.pair_with:
            raise RunnerError(
                "method.patching.corruption.kind=pair needs corruption.pair_with=SAMPLE_ID (e.g. coffee)"
                " or a data set index."
            )
        return bad


@register(PatchingMethodConfig)
class Patching(Method):
    name = "patching"
    summary_values = ("restoration", "rank_correlation")

    def __init__(self, cfg: PatchingMethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.p, self.layers, self.runtime = cfg, cfg.patching, layers, runtime
        self.module_types = {n: type(m).__name__ for n, m in layers}
        self.dataset: Dataset | None = None
        self.prefix_ok: dict[str, bool] = {}
        self.cones: dict[str, tuple[Cone, Replacement] | None] = {}
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

    # ---- one batch of pairs --------------------------------------------------------------------
    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        b = batch.x.shape[0]
        corrupted, corrupted_ids = corrupt(batch, self.p.corruption, self.dataset)
        both = torch.cat([batch.x, corrupted])  # (2B, C, H, W)
        attribution = self.p.mode is not PatchMode.exact
        session.new_forward()
        self.capture.clear()
        with torch.set_grad_enabled(attribution), self.runtime.autocast():
            logits = model(both).float()  # (2B, K)
        acts = {}
        for name in self.capture.names:
            calls = self.capture.outputs[name]
            if len(calls) <= self.p.call:
                raise RunnerError(
                    f"Layer '{name}' was called {len(calls)} time(s) per forward; method.patching.call={self.p.call}."
                )
            acts[name] = calls[self.p.call]  # (2B, ...)
        clean_logits, corrupted_logits = logits[:b].detach(), logits[b:].detach()
        target = select_targets(self.cfg, clean_logits, batch)  # (B,)
        contrast = self._contrast(corrupted_logits, target)
        metric_clean = self.metric(clean_logits, target, contrast)
        metric_corrupted = self.metric(corrupted_logits, target, contrast)
        reasons = self._degenerate(batch, corrupted, logits.detach(), target, contrast, metric_clean, metric_corrupted)
        undefined = [any(r in UNDEFINED for r in rs.split(",")) for rs in reasons]  # per sample
        estimates = self._estimates(logits, acts, target, contrast, b) if attribution else {}
        self.capture.clear()
        parts: list[Columns] = []
        for direction in self.p.directions:
            for i in range(b):
                base_input = (corrupted if direction is PatchDirection.denoising else batch.x)[i : i + 1]
                for name, _ in self.layers:
                    clean_act, corrupted_act = acts[name][i].detach(), acts[name][b + i].detach()
                    base, source = (
                        (corrupted_act, clean_act)
                        if direction is PatchDirection.denoising
                        else (clean_act, corrupted_act)
                    )
                    units = enumerate_units(name, tuple(base.shape), self.p.units, self.p.grid, self.p.cell_size)
                    ids = (i, direction, name, units, target[i], contrast[i], metric_clean[i], metric_corrupted[i])
                    ids += (reasons[i], undefined[i])
                    parts += self._unit_rows(
                        model, base_input, base, source, ids, estimates.get((direction, name)), corrupted_ids[i]
                    )
        columns = concat_columns(parts)
        if self.runtime.pictures_dir is not None and self.p.units is PatchUnit.cell:
            pictures.write_patching_heatmaps(self.runtime.pictures_dir, batch, columns, self.cfg.pictures_max)
        return BatchOutput(predicted=clean_logits.argmax(dim=1), tables={self.name: columns})

    def metric(self, logits: torch.Tensor, target: torch.Tensor, contrast: torch.Tensor) -> torch.Tensor:
        """(n,) metric of logits (n, K) for the class `target` (and `contrast` for logit_diff), per row."""
        chosen = logits.gather(1, target[:, None]).squeeze(1)
        if self.p.metric is PatchMetric.logit:
            return chosen
        if self.p.metric is PatchMetric.prob:
            return logits.softmax(dim=1).gather(1, target[:, None]).squeeze(1)
        return chosen - logits.gather(1, contrast[:, None]).squeeze(1)

    def _degenerate(
        self, batch: Batch, corrupted: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
        contrast: torch.Tensor, m_clean: torch.Tensor, m_corrupted: torch.Tensor,
    ) -> list[str]:  # fmt: skip
        """Per sample, the comma-joined reasons its pair is degenerate ("" if none); warns once per reason per run."""
        b = batch.x.shape[0]
        constant = logits.amax(dim=1) == logits.amin(dim=1)  # (2B,): every logit of the run equal
        checks = {
            "self_pair": (batch.x == corrupted).flatten(1).all(dim=1),  # exact equality: float noise is no corruption
            "target_is_contrast": (target == contrast) & (self.p.metric is PatchMetric.logit_diff),
            "constant_logits": constant[:b] | constant[b:],
        }  # each (B,) bool
        # A zero span not already explained by the two above (they make it 0 by construction).
        zero = (m_clean == m_corrupted) | ~torch.isfinite(m_clean - m_corrupted)
        checks["zero_span"] = zero & ~checks["self_pair"] & ~checks["target_is_contrast"]
        flags = torch.stack(list(checks.values()), dim=1).cpu()  # (B, reasons): one transfer
        reasons = [",".join(r for r, hit in zip(checks, row, strict=True) if hit) for row in flags.tolist()]
        for k, reason in enumerate(checks):
            hit = flags[:, k].nonzero().flatten().tolist()
            if hit and reason not in self.warned:
                self.warned.add(reason)
                i = hit[0]
                message = DEGENERATE_WARNINGS[reason].format(sample=batch.sample_ids[i], target=int(target[i]))
                log.warning(
                    "patching: %s Such rows have degenerate=True, '%s' in degenerate_reason (warned once per run).",
                    message,
                    reason,
                )
        return reasons

    def _contrast(self, corrupted_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.p.contrast_class is not None:
            if not 0 <= self.p.contrast_class < corrupted_logits.shape[1]:
                raise RunnerError(f"patching.contrast_class={self.p.contrast_class} is outside the model's classes.")
            return torch.full_like(target, self.p.contrast_class)
        return corrupted_logits.argmax(dim=1)

    # ---- exact: batched variants ---------------------------------------------------------------
    def _chunk(self, base: torch.Tensor) -> int:
        if self.p.chunk:
            return self.p.chunk
        if base.device.type != "cuda":
            return 64
        free, _ = torch.cuda.mem_get_info(base.device)
        # A variant's forward keeps a few times the patched activation per later layer; a rough, safe budget.
        per_variant = base.numel() * base.element_size() * 64
        return int(max(1, min(1024, free // 4 // per_variant)))

    @torch.no_grad()
    def patched_metrics(
        self, model: nn.Module, name: str, base_input: torch.Tensor, base: torch.Tensor, source: torch.Tensor,
        units: Units, target: torch.Tensor, contrast: torch.Tensor, order: list[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Metric of each patched variant (units in `order`, default all), chunked, prefix reused where possible."""
        order = order if order is not None else list(range(units.count))
        diff = source - base
        out = []
        chunk = self._chunk(base)
        cone = self._cone(model, name) if units.kind is PatchUnit.cell and self.p.local_recompute else None
        with self.capture.paused():  # the variants' forwards need no capture
            for start in range(0, len(order), chunk):
                picked = order[start : start + chunk]
                if cone is not None:  # only the patched cell's cone is recomputed through the local chain
                    chain, replacement = cone
                    variants = chain.propagate(base, source, [units.cells[u] for u in picked])  # chain outputs (n, ...)
                    logits = self._run_variants(model, chain.parent_name, base_input, variants, replacement)
                else:
                    masks = (
                        torch.cat([units.masks(u, u + 1, base.device) for u in picked])
                        if units.kind is not PatchUnit.layer
                        else units.masks(0, 1, base.device)
                    )
                    variants = base + masks * diff  # (n, ...)
                    logits = self._run_variants(model, name, base_input, variants, self.replacements[name])
                n = variants.shape[0]
                out.append(self.metric(logits, target.expand(n), contrast.expand(n)))
        return torch.cat(out)

    def _cone(self, model: nn.Module, name: str) -> tuple[Cone, Replacement] | None:
        """The local chain after `name` (with a replacement on its output), or None; found once per layer."""
        if name not in self.cones:
            chain = Cone.find(model, name)
            if chain is not None and self.p.call != 0:
                chain = None  # a module called several times: its calls are not one chain
            replacement = (
                self.session.replace([(chain.parent_name, chain.parent)])[chain.parent_name] if chain else None
            )
            self.cones[name] = (chain, replacement) if chain else None
            if chain:
                log.info("patching at %s: recomputing only each cell's cone through %s", name, chain.parent_name)
        return self.cones[name]

    def _run_variants(
        self, model: nn.Module, name: str, base_input: torch.Tensor, variants: torch.Tensor, replacement
    ) -> torch.Tensor:
        n = variants.shape[0]
        try:
            replacement.value = variants
            if self.p.reuse_prefix and self.prefix_ok.get(name, True):
                self.session.new_forward()
                try:
                    with self.runtime.autocast():
                        logits = model(base_input).float()  # prefix at batch 1, the layer returns n variants
                    if logits.shape[0] == n:
                        self.prefix_ok[name] = True
                        return logits
                except RuntimeError:
                    pass
                if name not in self.prefix_ok or self.prefix_ok[name]:
                    log.info("patching at %s: the model cannot broadcast a batch-1 prefix; running full forwards", name)
                self.prefix_ok[name] = False
            self.session.new_forward()
            with self.runtime.autocast():
                return model(base_input.expand(n, *base_input.shape[1:])).float()
        finally:
            replacement.value = None

    # ---- attribution ---------------------------------------------------------------------------
    def _estimates(self, logits, acts, target, contrast, b) -> dict[tuple[PatchDirection, str], torch.Tensor]:
        """Per direction and layer: (B, *act shape) of (source - base) * dM/d(base), from one backward each."""
        out = {}
        names = [n for n, _ in self.layers]
        for k, direction in enumerate(self.p.directions):
            base_rows = slice(b, 2 * b) if direction is PatchDirection.denoising else slice(0, b)
            m = self.metric(logits[base_rows], target, contrast).sum()
            retain = k < len(self.p.directions) - 1
            grads = torch.autograd.grad(m, [acts[n] for n in names], retain_graph=retain, allow_unused=True)
            for name, g in zip(names, grads, strict=True):
                if g is None:
                    raise RunnerError(f"The metric does not depend on layer '{name}': nothing to patch there.")
                clean, corrupted = acts[name][:b].detach(), acts[name][b:].detach()
                diff = clean - corrupted if direction is PatchDirection.denoising else corrupted - clean
                out[(direction, name)] = (diff * g[base_rows]).float()
        return out

    def _unit_rows(self, model, base_input, base, source, ids, estimate_map, corrupted_id) -> list[Columns]:
        i, direction, name, units, target, contrast, m_clean, m_corrupted, reason, undefined = ids
        pair = (reason, undefined)
        m_base = m_corrupted if direction is PatchDirection.denoising else m_clean
        rows: list[Columns] = []
        estimates = None
        if estimate_map is not None:
            dg = estimate_map[i]
            estimates = torch.cat([
                (units.masks(s, min(s + 256, units.count), dg.device) * dg).flatten(1).sum(1)
                for s in range(0, units.count, 256)
            ])  # fmt: skip
            rows.append(self._columns(i, direction, name, units, list(range(units.count)), "attribution",
                                      m_base + estimates, target, contrast, m_clean, m_corrupted, corrupted_id,
                                      pair))  # fmt: skip
        if self.p.mode is PatchMode.attribution:
            return rows
        order = list(range(units.count))
        if self.p.mode is PatchMode.attribution_topk:
            assert estimates is not None
            order = estimates.argsort(descending=True)[: self.p.top_k].tolist()
        patched = self.patched_metrics(model, name, base_input, base, source, units, target, contrast, order)
        exact = self._columns(i, direction, name, units, order, "exact", patched, target, contrast, m_clean,
                              m_corrupted, corrupted_id, pair)  # fmt: skip
        if estimates is not None:
            # an undefined pair's effects are float noise around 0: their rank says nothing
            ranked = len(order) > 1 and not undefined
            rho = spearman(estimates[order], patched - m_base) if ranked else torch.tensor(float("nan"))
            exact["rank_correlation"] = rho.repeat(len(order))
            rows[0]["rank_correlation"] = torch.full((units.count,), float("nan"))
        rows.append(exact)
        return rows

    def _columns(
        self, i, direction, name, units, order, kind, patched, target, contrast, m_clean, m_corrupted, corrupted_id,
        pair: tuple[str, bool],
    ) -> Columns:  # fmt: skip
        n = len(order)
        reason, undefined = pair
        span = m_clean - m_corrupted
        restoration = (patched.detach().float() - m_corrupted) / span  # (n,)
        if undefined:  # a zero (or float-noise) span: NaN, not the +-inf or huge number the division gives
            restoration = torch.full_like(restoration, float("nan"))
        return {
            "sample_index": torch.full((n,), i),
            "corrupted_id": [corrupted_id] * n,
            "direction": [direction.value] * n,
            "layer": [name] * n,
            "module_type": [self.module_types[name]] * n,
            "unit": [units.kind.value] * n,
            "channel": [units.channel[u] for u in order],
            "y": [units.y[u] for u in order],
            "x": [units.x[u] for u in order],
            "token": [units.token[u] for u in order],
            "grid_h": [units.grid[0] if units.grid else None] * n,
            "grid_w": [units.grid[1] if units.grid else None] * n,
            "patch_method": [kind] * n,
            "metric": [self.p.metric.value] * n,
            "target": target.repeat(n),
            "contrast": contrast.repeat(n),
            "clean": m_clean.repeat(n),
            "corrupted": m_corrupted.repeat(n),
            "patched": patched.detach().float(),
            "restoration": restoration,
            "degenerate": torch.full((n,), bool(reason)),
            "degenerate_reason": [reason] * n,
        }
