"""The `evaluation` table: every configured metric per (sample, layer, call, target), beside the same metric on
the layer's random map (the per-sample uniform map of runner/metrics/curves.py's baseline, at the layer's own
resolution). One row per (sample, layer, call, target_rank, metric, variant); joined to the `cam` table on
(run_id, sample, layer, call, target_rank)."""

from __future__ import annotations

import logging

import pyarrow as pa
import torch
from torch import nn

from runner.chunks import forward_chunk
from runner.metrics.base import Metric, MetricInputs
from runner.progress import within_batch
from runner.rows import Columns
from runner.runtime import Runtime
from runner.tables import Presentation, declare

log = logging.getLogger(__name__)

EVALUATION_SCHEMA = declare(
    "evaluation",
    [
        pa.field("layer", pa.string()),
        pa.field("call", pa.int32()),
        pa.field("target", pa.int64()),
        pa.field("target_rank", pa.int64()),
        pa.field("metric", pa.string()),  # a name from runner.metrics.METRICS
        pa.field("variant", pa.string()),  # "" for a metric with one value; e.g. "morf"/"lerf" for ROAD
        pa.field("value", pa.float32()),  # NaN where the metric is undefined (its docstring says when) or degenerate
        pa.field("random_value", pa.float32()),  # the same metric on the layer's random map
        pa.field("degenerate", pa.bool_()),  # the map is constant at the layer's resolution or not finite: value NaN
    ],
    Presentation(
        keys=("metric", "variant"),
        values=("value", "random_value"),
        figures="runner.viz.plots:evaluation_figures",
        shown=("metric", "variant"),
    ),
)

_skipped: set[str] = set()  # metrics already reported as skipped for want of masks (one log line each)


def evaluation_rows(
    metrics: list[Metric],
    names: list[tuple[str, int]],
    saliency: list[torch.Tensor],
    random_saliency: list[torch.Tensor],
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    target_rank: int,
    first_index: int,
    runtime: Runtime,
    seed: int,
    masks: torch.Tensor | None = None,
    chunk: int | None = None,
    degenerate: list[torch.Tensor] | None = None,
    random_degenerate: list[torch.Tensor] | None = None,
) -> Columns:
    """Rows of the `evaluation` table for one batch and target: names[i] = (layer, call) of saliency[i] (B, H, W).

    The maps of all layers (and their random maps) go through each metric as one batch of L * B maps, so
    the model's perturbed forwards are batched across layers too. `model`'s capture and record hooks must be
    paused. `degenerate[i]` (B,) bool marks the maps of saliency[i] that are constant (or not finite) at the
    layer's resolution: every metric of such a map is NaN and its rows are flagged (the random map's stay, unless
    `random_degenerate[i]` (B,) says the random map is constant too: a 1x1 layer's).
    """
    b, n = target.shape[0], len(names)
    none = torch.zeros(n * b, dtype=torch.bool, device=target.device)
    flags = torch.cat(degenerate) if degenerate else none
    random_flags = torch.cat(random_degenerate) if random_degenerate else none
    index = torch.arange(first_index, first_index + b, device=target.device)  # (B,) global sample indices
    maps = torch.cat([*saliency, *random_saliency])  # (2 * L * B, H, W): real maps, then random maps
    inputs = MetricInputs(
        model=model,
        x=x.repeat(2 * n, 1, 1, 1),  # (2LB, C, H, W)
        target=target.repeat(2 * n),
        sample_index=index.repeat(2 * n),
        masks=None if masks is None else masks.repeat(2 * n, 1, 1),
        runtime=runtime,
        seed=seed,
        chunk=forward_chunk(chunk, x.device, x.shape[-2:]),
    )
    columns: dict[str, list] = {k: [] for k in ("layer", "call", "target", "target_rank", "metric", "variant")}
    values: list[torch.Tensor] = []
    randoms: list[torch.Tensor] = []
    local: list[torch.Tensor] = []
    flagged: list[torch.Tensor] = []
    for done, metric in enumerate(metrics):
        within_batch(done / len(metrics), f"metric {metric.name} ({done + 1}/{len(metrics)})")
        if metric.needs_masks and masks is None:
            if metric.name not in _skipped:
                _skipped.add(metric.name)
                log.warning("metric %s needs localisation masks and the data has none: skipped", metric.name)
            continue
        for variant, value in metric.compute(inputs, maps.float()).items():
            value = value.float().reshape(2, n * b)  # (2, L*B): real, random
            values.append(torch.where(flags, torch.nan, value[0]))  # a degenerate map ranks nothing: NaN
            flagged.append(flags)
            randoms.append(torch.where(random_flags, torch.nan, value[1]))
            local.append(torch.arange(b, device=target.device).repeat(n))
            columns["layer"] += [layer for layer, _ in names for _ in range(b)]
            columns["call"] += [call for _, call in names for _ in range(b)]
            columns["target"].append(target.repeat(n))
            columns["target_rank"] += [target_rank] * (n * b)
            columns["metric"] += [metric.name] * (n * b)
            columns["variant"] += [variant] * (n * b)
    out: Columns = {k: v for k, v in columns.items() if k != "target"}
    empty = torch.zeros(0, device=target.device)
    out["sample_index"] = torch.cat(local) if local else empty.long()
    out["target"] = torch.cat(columns["target"]) if local else empty.long()
    out["value"] = torch.cat(values) if values else empty
    out["random_value"] = torch.cat(randoms) if randoms else empty
    out["degenerate"] = torch.cat(flagged) if flagged else empty.bool()
    return out
