"""The run's progress bar: a step per batch and, inside a long batch, the share of it done, with an ETA.

While the bar is shown, log records and warnings are written above it, each on its own line, never into the
bar's line (tqdm's `logging_redirect_tqdm`, and stderr itself through `tqdm.write` for warnings). Code deep inside
a batch (patching's variant chunks) reports with `within_batch`, which does nothing when no run shows a bar.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile
from tqdm.contrib.logging import logging_redirect_tqdm

# The batch count and what the current batch is doing lead; then the share done, the time spent and the ETA.
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]"
MININTERVAL = 0.1  # seconds between redraws at most (tqdm's default); every move past it redraws


class RunProgress:
    """The bar of one run over `total` batches (`enabled` false: nothing is drawn, the calls cost nothing)."""

    def __init__(self, total: int, name: str, enabled: bool) -> None:
        self.name, self.total, self.done = name, total, 0
        self.bar = tqdm(
            total=total, desc=self._label(""), bar_format=BAR_FORMAT, mininterval=MININTERVAL, miniters=0,
            disable=not enabled,
        )  # fmt: skip

    def _label(self, note: str) -> str:
        label = f"{self.name}: {self.done}/{self.total} batches"
        return f"{label}, batch {self.done + 1}: {note}" if note else label

    def _move(self, position: float, note: str) -> None:
        self.bar.set_description_str(self._label(note), refresh=False)
        # tqdm's rate (and so the ETA) follows the fractional position; update() redraws at most every MININTERVAL
        self.bar.update(position - self.bar.n)

    def batch_done(self) -> None:
        """One more batch of the run is done."""
        self.done += 1
        self._move(self.done, "")

    def within_batch(self, fraction: float, note: str) -> None:
        """`fraction` (0..1) of the current batch is done; `note` says of what ("patching x: 64/512 variants").
        The bar never moves back: a batch's stages (faithfulness, then the metrics) each count from 0, and a later
        stage's note shows while its fraction catches up."""
        self._move(max(self.bar.n, self.done + min(max(fraction, 0.0), 1.0)), note)

    def close(self) -> None:
        self.bar.close()


_active: RunProgress | None = None  # the bar of the run in progress in this process, for `within_batch`


def within_batch(fraction: float, note: str) -> None:
    """Report `fraction` of the current batch done to the running run's bar, if there is one."""
    if _active is not None:
        _active.within_batch(fraction, note)


@dataclass(frozen=True)
class Stage:
    """A share of the current batch, from `start` to `start + span`, named `label` on the bar: a part of a batch
    that counts its own steps (`report(done, total, note)`) without knowing what else the batch does."""

    start: float = 0.0
    span: float = 1.0
    label: str = ""

    def report(self, done: int, total: int, note: str) -> None:
        within_batch(self.start + self.span * done / max(total, 1), f"{self.label}: {note}" if self.label else note)


WHOLE_BATCH = Stage()  # the whole batch, unnamed: the default of code that reports its own steps


@contextmanager
def run_progress(total: int, name: str, enabled: bool) -> Iterator[RunProgress]:
    """The run's bar over `total` batches; while it is shown, log records and warnings print above it, each on a
    line of its own."""
    global _active
    stream = sys.stderr  # where tqdm draws the bar
    progress = RunProgress(total, name, enabled)
    previous, _active = _active, progress
    try:
        with _lines_above_the_bar(stream) if enabled else nullcontext():
            yield progress
    finally:
        _active = previous
        progress.close()


@contextmanager
def _lines_above_the_bar(stream: TextIO) -> Iterator[None]:
    """Console log handlers, and whatever else writes to stderr (warnings), go through tqdm.write: it clears the
    bar, prints the line and draws the bar again below it."""
    with logging_redirect_tqdm(loggers=[logging.getLogger()]):  # handlers writing to the stderr of now
        sys.stderr = DummyTqdmFile(stream)  # type: ignore[assignment]  # read at each write: warnings' default
        try:
            yield
        finally:
            sys.stderr = stream
