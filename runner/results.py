"""Loading results for analysis, in one import: `load` reads a run's or a sweep's table as one frame,
`read_metadata` a shard's provenance, `summarise` and `paired_test` turn frames into intervals and tests,
`load_activations` an lm_cache run's tensors (runner/store/activations.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from runner.analysis import paired_test, summarise
from runner.store.reader import load, read_metadata

if TYPE_CHECKING:
    from runner.store.activations import ActivationCache


def load_activations(run_dir: str | Path, partial: bool = False) -> ActivationCache:
    """The activation cache of a `method=lm_cache` run: `cache["resid_pre", 3]` is (pairs, positions, d_model).
    Imported here on first use, so that `runner.results` loads without torch."""
    from runner.store.activations import load_activations as load_cache

    return load_cache(run_dir, partial)


__all__ = ["load", "load_activations", "paired_test", "read_metadata", "summarise"]
