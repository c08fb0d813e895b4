"""The `patching` table: its declared columns, why a pair's rows are degenerate, and the rows of one
(pair, direction, layer, patch method)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa
import torch

from runner.data.base import Batch
from runner.methods.patching.units import Units
from runner.options.method.patching import PatchDirection, PatchMetric
from runner.rows import Columns
from runner.tables import Presentation, declare, optional

log = logging.getLogger(__name__)

# The `patching` table's own columns (`unit_columns`): one row per (pair, direction, layer, unit, patch method).
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
        pa.field("small_span", pa.bool_()),  # |clean - corrupted| below method.patching.min_span: restoration NaN
        optional("rank_correlation", pa.float32(), "method.patching.mode=attribution_topk"),
    ],
    Presentation(
        keys=("direction", "patch_method", "unit", "metric"),
        values=("effect",),  # plots.patching_effects' rows
        figures="runner.viz.plots:patching_figures",
        section="runner.viz.report:patching_section",
    ),
)

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
SMALL_SPAN_WARNING = (
    "patching: sample '{sample}': clean and corrupted {metric} differ by {span:.3g}, below method.patching.min_span"
    " = {min_span} of their size, so restoration (patched - corrupted) / (clean - corrupted) divides by a near-zero"
    " difference; its restoration is NaN and its rows have small_span=True (warned once per run). Use a stronger"
    " corruption, or lower method.patching.min_span."
)


def small_spans(m_clean: torch.Tensor, m_corrupted: torch.Tensor, min_span: float) -> torch.Tensor:
    """(B,) bool: |clean - corrupted| below `min_span` x max(|clean|, |corrupted|), a relative threshold, so it
    means the same for a trained model's logits of 30 and an untrained one's of 0.01."""
    span = (m_clean - m_corrupted).abs()  # (B,)
    return span < min_span * torch.maximum(m_clean.abs(), m_corrupted.abs())


def degenerate_reasons(
    batch: Batch, corrupted: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, contrast: torch.Tensor,
    m_clean: torch.Tensor, m_corrupted: torch.Tensor, metric: PatchMetric, warned: set[str],
) -> list[str]:  # fmt: skip
    """Per sample, the comma-joined reasons its pair is degenerate ("" if none); warns once per reason per run
    (`warned` holds the reasons already warned about, and gains the new ones)."""
    args = batch, corrupted, logits, target, contrast, m_clean, m_corrupted, metric, warned
    return pair_flags(*args)[0]


def pair_flags(
    batch: Batch, corrupted: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, contrast: torch.Tensor,
    m_clean: torch.Tensor, m_corrupted: torch.Tensor, metric: PatchMetric, warned: set[str],
    min_span: float | None = None,
) -> tuple[list[str], list[bool]]:  # fmt: skip
    """Per sample, the comma-joined reasons its pair is degenerate ("" if none), and whether its span is below
    `min_span` (`small_spans`; all False without one): both moved to the host in one transfer (on CUDA one
    sync a batch, not one per flag set). Warns once per degenerate reason per run (`warned` holds the reasons
    already warned about, and gains the new ones)."""
    b = batch.x.shape[0]
    constant = logits.amax(dim=1) == logits.amin(dim=1)  # (2B,): every logit of the run equal
    checks = {
        "self_pair": (batch.x == corrupted).flatten(1).all(dim=1),  # exact equality: float noise is no corruption
        "target_is_contrast": (target == contrast) & (metric is PatchMetric.logit_diff),
        "constant_logits": constant[:b] | constant[b:],
    }  # each (B,) bool
    # A zero span not already explained by the two above (they make it 0 by construction).
    zero = (m_clean == m_corrupted) | ~torch.isfinite(m_clean - m_corrupted)
    checks["zero_span"] = zero & ~checks["self_pair"] & ~checks["target_is_contrast"]
    small = small_spans(m_clean, m_corrupted, min_span) if min_span is not None else torch.zeros_like(zero)
    flags = torch.stack([*checks.values(), small], dim=1).cpu()  # (B, reasons + 1): one transfer
    small_flags, flags = flags[:, -1].tolist(), flags[:, :-1]
    reasons = [",".join(r for r, hit in zip(checks, row, strict=True) if hit) for row in flags.tolist()]
    for k, reason in enumerate(checks):
        hit = flags[:, k].nonzero().flatten().tolist()
        if hit and reason not in warned:
            warned.add(reason)
            i = hit[0]
            message = DEGENERATE_WARNINGS[reason].format(sample=batch.sample_ids[i], target=int(target[i]))
            log.warning(
                "patching: %s Such rows have degenerate=True, '%s' in degenerate_reason (warned once per run).",
                message,
                reason,
            )
    return reasons, small_flags


@dataclass
class Site:
    """One (pair, direction, layer): what every row patched there shares."""

    sample_index: int  # the pair's position in the batch
    direction: PatchDirection
    layer: str
    module_type: str
    units: Units
    metric: PatchMetric
    target: torch.Tensor  # () class id
    contrast: torch.Tensor  # () class id
    clean: torch.Tensor  # () the clean run's metric
    corrupted: torch.Tensor  # () the corrupted run's metric
    corrupted_id: str
    reason: str  # degenerate reasons, comma-joined ("" if none)
    undefined: bool  # a reason that leaves restoration undefined
    small_span: bool = False  # |clean - corrupted| below method.patching.min_span: restoration NaN

    @property
    def base_metric(self) -> torch.Tensor:
        """() the metric of the run that is patched: the corrupted one when denoising, the clean one when noising."""
        return self.corrupted if self.direction is PatchDirection.denoising else self.clean


def unit_columns(site: Site, order: list[int], kind: str, patched: torch.Tensor) -> Columns:
    """The rows of the units `order` at `site`, patched by `kind` (exact | attribution) to the metrics `patched` (n,)."""
    n = len(order)
    units = site.units
    device = patched.device  # every tensor column on the rows' device: the table concatenates them
    span = site.clean - site.corrupted
    restoration = (patched.detach().float() - site.corrupted) / span  # (n,)
    if site.undefined or site.small_span:  # a zero or near-zero span: NaN, not the +-inf or huge number it gives
        restoration = torch.full_like(restoration, float("nan"))
    return {
        "sample_index": torch.full((n,), site.sample_index, device=device),
        "corrupted_id": [site.corrupted_id] * n,
        "direction": [site.direction.value] * n,
        "layer": [site.layer] * n,
        "module_type": [site.module_type] * n,
        "unit": [units.kind.value] * n,
        "channel": [units.channel[u] for u in order],
        "y": [units.y[u] for u in order],
        "x": [units.x[u] for u in order],
        "token": [units.token[u] for u in order],
        "grid_h": [units.grid[0] if units.grid else None] * n,
        "grid_w": [units.grid[1] if units.grid else None] * n,
        "patch_method": [kind] * n,
        "metric": [site.metric.value] * n,
        "target": site.target.repeat(n),
        "contrast": site.contrast.repeat(n),
        "clean": site.clean.repeat(n),
        "corrupted": site.corrupted.repeat(n),
        "patched": patched.detach().float(),
        "restoration": restoration,
        "degenerate": torch.full((n,), bool(site.reason), device=device),
        "degenerate_reason": [site.reason] * n,
        "small_span": torch.full((n,), site.small_span, device=device),
    }
