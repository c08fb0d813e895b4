"""The `hooks` rows of one shard: statistics kept on the device batch by batch, copied to the host once a shard.

`record` hooks leave each batch's (rows, 7) statistics on the tensor's device (runner/hooks/spec_hooks.py). Copied
per batch, each copy waits for the batch's kernels; here they stay on the device until the shard's last batch, are
packed and copied in one transfer (runner/host_copy.py: into pinned memory, `non_blocking`, on CUDA), and the writer
thread waits for that copy alone. The rows' other columns (layer, role, call, sample ids) are known per batch on the host
and kept as they are; the rows are written batch by batch, so the table is the one the per-batch path writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from runner.host_copy import HostCopy
from runner.ids import with_ids
from runner.rows import Block, to_host
from runner.stats import STAT_NAMES

Rows = list[tuple[str, dict[str, Any]]]


class ShardStats:
    """Collects a shard's recorded rows (`add`, per batch) and hands the writer one job for all of them (`flush`)."""

    def __init__(self) -> None:
        self._stats: list[torch.Tensor] = []  # per batch (rows, 7), on the device
        self._columns: list[dict[str, Any]] = []  # per batch, the other columns (host)
        self._samples: list[dict[str, np.ndarray] | None] = []  # per batch, filled on the writer thread

    def add(self, recorded: dict[str, Any]) -> Callable[[dict[str, np.ndarray]], None]:
        """Keep one batch's recorded columns; returns where the writer thread puts the batch's sample ids."""
        slot, kept = len(self._stats), self._samples  # this shard's list: `flush` starts a new one for the next
        self._stats.append(recorded.pop("stats"))
        self._columns.append(recorded)
        kept.append(None)

        def note_samples(samples: dict[str, np.ndarray]) -> None:
            kept[slot] = samples

        return note_samples

    def flush(self, id_columns: dict[str, Any]) -> Callable[[], Rows] | None:
        """Start the shard's one copy to the host; the writer job that writes its rows (None if nothing recorded).

        The job runs on the writer thread after the shard's batch jobs (which note the sample ids): it waits for
        the copy, then writes one row group per batch."""
        if not self._stats:
            return None
        copy = HostCopy(self._stats)  # one copy instead of one per batch (pinned and non-blocking on CUDA)
        columns, samples = self._columns, self._samples
        self._stats, self._columns, self._samples = [], [], []

        def produce() -> Rows:
            host = copy.wait()  # the writer thread waits for this copy, never the main thread
            rows: Rows = []
            for batch_columns, stats, batch_samples in zip(columns, host, samples, strict=True):
                assert batch_samples is not None, "the batch's own job runs first on the writer thread"
                batch_columns["stats"] = Block(stats, list(STAT_NAMES))
                rows.append(("hooks", with_ids(id_columns, batch_samples, to_host(batch_columns))))
            return rows

        return produce
