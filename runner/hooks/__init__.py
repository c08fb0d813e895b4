"""The hook session: the one owner of every hook handle in a run.

The runner and its methods register no hook themselves; they ask the session (`HookSession`), which
  - registers the four kinds from specs (pre, forward, backward, tensor), each with an action
    (record statistics, or modify the value in flight: scale, zero, add_noise, clamp), and turns what
    the `record` ones see into the `hooks` table's rows (spec_hooks.py; statistics in runner/stats.py);
  - counts calls per module per batch, so a module called twice per forward (EfficientNet's shared
    `_swish`) yields rows with call index 0 and 1 (session.py);
  - keeps what in-place ops would overwrite intact: statistics are taken inside the hook, saved
    tensors are cloned (tensors.py writes them to one safetensors file per batch), captured
    activations are handed on to the model as a clone;
  - turns `inplace=True` off on the model's modules while full backward hooks are registered
    (torch refuses an in-place op on their outputs), held as one more removable handle (inplace.py);
  - re-initialises modules in place for randomisation tests (MPRT, sanity) as a reversible edit, one more
    handle whose removal restores the original values (edits.py);
  - routes the sites of a language model with sparse dictionaries spliced in (model.dictionaries) through them,
    registering the splice's hooks before any other (runner/dictionaries/splice.py);
  - keeps state per batch only (`end_batch` returns it and drops it);
  - draws `add_noise` noise per sample, keyed by (hook seed, sample index, layer, role, call), so a sample's
    noise does not depend on the batch size, an OOM split or a resume (runner/randomness.py);
  - removes every handle in `__exit__`, also when the run raised.

One exception: `method=captum` hands a layer to captum, whose `attribute` call registers its own hooks
on it and removes them (in a `finally`) before it returns. Those hooks are not the session's, and none
outlives the call (tests/test_experiments.py checks with `count_hooks`).
"""

from __future__ import annotations

from runner.hooks.edits import Reinitialised, resettable
from runner.hooks.inplace import InplaceOff, disable_inplace, inplace_disabled, restore_inplace
from runner.hooks.session import Capture, HookSession, Replacement, count_hooks
from runner.hooks.spec_hooks import GRADIENT_KINDS, HOOKS_SCHEMA, BoundHook, SpecHooks, keyed_noise, map_tensors
from runner.hooks.tensors import TensorSaver
from runner.stats import STAT_NAMES

__all__ = [
    "GRADIENT_KINDS",
    "HOOKS_SCHEMA",
    "STAT_NAMES",
    "BoundHook",
    "Capture",
    "HookSession",
    "InplaceOff",
    "Reinitialised",
    "Replacement",
    "SpecHooks",
    "TensorSaver",
    "count_hooks",
    "disable_inplace",
    "inplace_disabled",
    "keyed_noise",
    "map_tensors",
    "resettable",
    "restore_inplace",
]
