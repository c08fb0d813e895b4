"""One exception type for every failure the user can fix: the CLI turns it into one message and exit 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class RunnerError(Exception):
    """A failure caused by the experiment's input (config, files, data), with a message that says how to fix it."""


def closest(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """The candidates nearest to `name`, for 'did you mean' hints."""
    pool = list(candidates)
    hits = difflib.get_close_matches(name, pool, n=n, cutoff=0.5)
    if not hits:  # fall back to a substring match so `conv` still finds `features.0` style names
        hits = [c for c in pool if name.lower() in c.lower()][:n]
    return hits


def suggest(name: str, candidates: Iterable[str]) -> str:
    """A ' Did you mean: a, b?' suffix, or '' when nothing is close."""
    hits = closest(name, candidates)
    return f" Did you mean: {', '.join(hits)}?" if hits else ""
