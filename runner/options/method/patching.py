"""`method=patching`'s schema: what is patched (units, directions), against what (the corruption), measured how
(the metric), and how it runs (exact or attribution, chunking, prefix reuse); the range checks beside them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from runner.errors import RunnerError
from runner.options.registry import METHODS
from runner.schema import MethodConfig


class CorruptionKind(str, Enum):
    """How the corrupted input of a patching pair is made from the clean one."""

    noise = "noise"  # clean + Gaussian noise (std, seed)
    blur = "blur"  # Gaussian blur (sigma)
    occlusion = "occlusion"  # a box set to 0 (the data set's mean after normalisation)
    pair = "pair"  # another sample of the data set (pair_with: its sample id or index)
    none = "none"  # the clean input itself (an identity check)


class PatchDirection(str, Enum):
    denoising = "denoising"  # clean activations into the corrupted run: what restores the output?
    noising = "noising"  # corrupted activations into the clean run: what breaks it?


class PatchMetric(str, Enum):
    logit = "logit"
    prob = "prob"
    logit_diff = "logit_diff"  # logit(target) - logit(contrast)


class PatchUnit(str, Enum):
    layer = "layer"  # the whole output
    channel = "channel"
    cell = "cell"  # a cell of a spatial grid, all channels
    token = "token"  # a token of a (B, T, D) output (ViT)


class PatchMode(str, Enum):
    exact = "exact"
    attribution = "attribution"  # first-order estimate for every unit: (a_source - a_base) . dM/da
    attribution_topk = "attribution_topk"  # estimate all, patch the top_k exactly, report rank correlation


@dataclass
class CorruptionConfig:
    kind: CorruptionKind = CorruptionKind.noise
    std: float = 1.0  # noise, in normalised input units
    seed: int = 0
    sigma: float = 8.0  # blur, in pixels
    box: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.75, 0.75])  # occlusion: y0, x0, y1, x1 as fractions
    pair_with: str | None = None  # pair: the other sample's id (e.g. coffee) or data set index


@dataclass
class PatchingConfig:
    corruption: CorruptionConfig = field(default_factory=CorruptionConfig)
    directions: list[PatchDirection] = field(default_factory=lambda: [PatchDirection.denoising])
    metric: PatchMetric = PatchMetric.logit
    contrast_class: int | None = None  # logit_diff: the other class (default: the corrupted run's prediction)
    units: PatchUnit = PatchUnit.cell
    grid: list[int] = field(default_factory=lambda: [7, 7])  # cell: rows x columns of the layer's map
    cell_size: int | None = None  # cell: square cells of this many layer pixels instead of `grid`
    mode: PatchMode = PatchMode.exact
    top_k: int = 16  # attribution_topk: units patched exactly
    chunk: int | None = None  # patched variants per forward; null: automatic (64 on CPU, from free memory on GPU)
    reuse_prefix: bool = True  # run the unpatched prefix once per chunk, at batch 1 (falls back if the model can't)

    SPEED_KEYS: ClassVar[tuple[str, ...]] = ("chunk",)  # left out of the resume key
    local_recompute: bool = True  # cells in a chain of local ops (VGG features): recompute only each cell's cone
    call: int = 0  # which call of a module used several times per forward is patched
    # A pair whose |clean - corrupted| is below min_span x max(|clean|, |corrupted|) is flagged small_span and
    # its restoration is NaN: dividing by a near-zero difference makes any patch look like a huge restoration.
    min_span: float = 0.05


def is_valid_box(box: list[float]) -> bool:
    """Whether `box` is [y0, x0, y1, x1], fractions of the image in [0, 1], with y0 < y1 and x0 < x1."""
    return len(box) == 4 and all(0 <= v <= 1 for v in box) and box[0] < box[2] and box[1] < box[3]


@METHODS.option("runner.methods.patching.method:Patching", tables=("patching",))
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
            or not math.isfinite(p.min_span)
            or p.min_span < 0
            or (p.contrast_class is not None and p.contrast_class < 0)
        ):
            raise RunnerError(
                f"Out of range: method.patching.corruption.std={c.std} (finite, >= 0),"
                f" corruption.sigma={c.sigma} (finite, > 0), method.patching.call={p.call} (>= 0),"
                f" method.patching.min_span={p.min_span} (finite, >= 0),"
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
