"""The benchmark scripts still run: each one's quick mode (tiny sizes on the shipped induction model), as a process.
Their figures are not checked here (benchmarks/RESULTS.md has them, from a quiet machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.slow
@pytest.mark.process
def test_bench_dictionaries_quick_runs_every_part() -> None:
    """scripts/bench_dictionaries.py --quick: latent, error and site patching and attribution, the training's
    collection and steps at two widths, and one whole method=train_sae run, on the induction model."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_dictionaries.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for line in ("1. patching resid_post", "latent/site:", "2. training:", "train w=256", "whole run:", "command:"):
        assert line in out, out[-3000:]
    assert "RANDOM weights" in out  # no --dictionary: it says so
