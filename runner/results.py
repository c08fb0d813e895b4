"""Loading results for analysis, in one import: `load` reads a run's or a sweep's table as one frame,
`read_metadata` a shard's provenance, `summarise` and `paired_test` turn frames into intervals and tests."""

from runner.analysis import paired_test, summarise
from runner.store.reader import load, read_metadata

__all__ = ["load", "paired_test", "read_metadata", "summarise"]
