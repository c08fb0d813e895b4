"""Activation patching for vision models: layers x channels x spatial cells (or tokens), batched.

For each clean sample and its corrupted twin (corruption.py), and each direction:
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

The option's schema (PatchingMethodConfig, PatchingConfig, CorruptionConfig, the enums) is
runner/options/method/patching.py. The package, one concern a module:
  corruption.py   the corrupted half of each pair
  units.py        a layer's units and their masks
  metric.py       what a run is measured by
  engine.py       exact patched runs: chunking, prefix reuse, a cell's cone recomputed locally
  cone.py         that cone: a cell carried through a chain of local ops (VGG's features) as crops
  attribution.py  first-order estimates of every unit
  rows.py         the `patching` table: its declared columns, degenerate flags, row building
  method.py       the method class (its option: runner/options/method/patching.py): one batch of pairs
"""

from __future__ import annotations

from runner.methods.patching.method import Patching, activation_patching
from runner.methods.patching.rows import PATCHING_SCHEMA
from runner.methods.patching.units import Units, enumerate_units
from runner.options.method.patching import (
    CorruptionConfig,
    CorruptionKind,
    PatchDirection,
    PatchingConfig,
    PatchingMethodConfig,
    PatchMetric,
    PatchMode,
    PatchUnit,
)

__all__ = [
    "PATCHING_SCHEMA",
    "activation_patching",
    "CorruptionConfig",
    "CorruptionKind",
    "PatchDirection",
    "PatchMetric",
    "PatchMode",
    "PatchUnit",
    "Patching",
    "PatchingConfig",
    "PatchingMethodConfig",
    "Units",
    "enumerate_units",
]
