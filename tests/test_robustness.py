"""Robustness: faults flagged not hidden, Ctrl-C stops cleanly and resumes, memory flat over 10x the
samples, identical tables from identical configs, no secrets in metadata (fuzzed overrides:
tests/test_fuzzed_overrides.py)."""

from __future__ import annotations

import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.interrupts import Interrupted, resume_command
from runner.methods.patching import CorruptionConfig, CorruptionKind
from runner.methods.patching.corruption import corrupt
from runner.results import load, read_metadata
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model._target_=tests.nets.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=6",
    "data.num_classes=5",
    "layers.include=[features.0,features.2]",
    "hooks=[{kind: forward, layers: [features.2]}]",
]


def without_run_id(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.drop(columns=["run_id"])
    if "map" in frame:
        frame["map"] = frame["map"].map(tuple)
    return frame


@pytest.mark.slow
def test_nan_and_inf_are_flagged(tmp_path: Path) -> None:
    config = make_config(
        *TINY[:-1],
        "hooks=[{kind: forward, action: scale, factor: 1e39, layers: [features.0]}, {kind: forward, layers: [features.2]}]",
    )
    result = app.run(config, tmp_path)
    hooks = pd.read_parquet(result.tables["hooks"])
    assert hooks["nonfinite"].dtype == bool and hooks["nonfinite"].all()
    assert pd.read_parquet(result.tables["cam"])["cam_nonfinite"].any()
    clean = pd.read_parquet(app.run(make_config(*TINY), tmp_path / "clean").tables["hooks"])
    assert not clean["nonfinite"].any()


@pytest.mark.slow
def test_same_config_same_tables(tmp_path: Path) -> None:
    config = [*TINY, "method.faithfulness.enabled=true", "method.faithfulness.steps=4",
              "hooks=[{kind: forward, action: add_noise, std: 0.1, layers: [features.0]}, {kind: backward, layers: [fc]}]"]  # fmt: skip
    first = app.run(make_config(*config), tmp_path / "a").tables
    second = app.run(make_config(*config), tmp_path / "b").tables
    for table in ("cam", "hooks"):
        pd.testing.assert_frame_equal(without_run_id(load(first[table])), without_run_id(load(second[table])))


def test_metadata_holds_no_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_TEST_SECRET", "hunter2-do-not-store")
    result = app.run(make_config(*TINY), tmp_path)
    assert "hunter2-do-not-store" not in str(read_metadata(result.tables["cam"]))
    assert "hunter2-do-not-store" not in (tmp_path / "manifest.json").read_text()


def test_patching_pair_of_another_shape_is_refused() -> None:
    class Other(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int):  # noqa: ANN204
            return torch.zeros(3, 16, 16), -1, "big"

    batch = Batch(torch.zeros(1, 3, 8, 8), torch.tensor([-1]), ["small"], 0)
    with pytest.raises(RunnerError, match="'big' has shape \\(3, 16, 16\\) but the clean inputs have \\(3, 8, 8\\)"):
        corrupt(batch, CorruptionConfig(kind=CorruptionKind.pair, pair_with="big"), Other())


@pytest.mark.slow
@pytest.mark.process
def test_ctrl_c_stops_after_the_batch_and_resumes(tmp_path: Path) -> None:
    args = [*TINY, "model._target_=tests.nets.SlowNet", "data.count=12", "data.batch_size=2",
            "output.shard_batches=1", "progress=false", "method.pictures=false", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    process = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((tmp_path / "run").glob("cam.parquet/part-*.parquet"))) < 2:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert "Interrupted." in stderr and "Traceback" not in stderr
    kept = len(list((tmp_path / "run").glob("cam.parquet/part-*.parquet")))
    assert 2 <= kept < 6 and not list((tmp_path / "run").rglob("*.tmp"))
    again = subprocess.run(
        [sys.executable, "-m", "runner", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr
    frame = load(tmp_path / "run", "cam")
    assert len(frame) == 12 * 2 and not frame.duplicated(["sample", "layer"]).any()


def test_a_sweeps_resume_command_is_its_overrides_on_its_folder() -> None:
    """What an interrupted sweep prints to resume it, and the error a joblib worker sends back (pickled)."""
    argv = ["-m", "method=gradcam,layercam", "layers.include=[a,b]", "hydra.sweep.dir=/old"]
    assert shlex.split(resume_command("/tmp/my sweep", argv)) == [
        "python", "-m", "runner", "-m", "method=gradcam,layercam", "layers.include=[a,b]", "hydra.sweep.dir=/tmp/my sweep",
    ]  # fmt: skip
    error = pickle.loads(pickle.dumps(Interrupted("Interrupted.", "2 kept.", "/d", "SIGTERM", "/s")))
    assert (error.signal_name, error.sweep, str(error)) == (
        "SIGTERM", "/s", "Interrupted. 2 kept. Run the same command with hydra.run.dir=/d to resume.",
    )  # fmt: skip


def peak_rss_kib(count: int, out: Path) -> int:
    """Peak resident memory of a whole CLI run over `count` samples, measured inside that process. No pictures (a
    single run's default draws the first 16 samples' in both runs alike: 10 s of PNGs, tested on their own)."""
    args = [*TINY[:3], "data.shape=[3,64,64]", f"data.count={count}", "data.batch_size=16", *TINY[5:],
            "progress=false", "method.pictures=false", f"hydra.run.dir={out}"]  # fmt: skip
    probe = (
        "import atexit, resource, runpy, sys\n"
        "atexit.register(lambda: print('PEAK_RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))\n"
        f"sys.argv = ['runner', *{args!r}]\n"
        "runpy.run_module('runner', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return int(done.stderr.rsplit("PEAK_RSS", 1)[1].split()[0])


@pytest.mark.slow
@pytest.mark.process
def test_memory_stays_flat_over_ten_times_the_samples(tmp_path: Path) -> None:
    small = peak_rss_kib(80, tmp_path / "small")
    large = peak_rss_kib(800, tmp_path / "large")
    assert len(load(tmp_path / "large", "cam")) == 800 * 2
    assert large < small * 1.10, f"peak RSS grew from {small} KiB to {large} KiB"
