"""Sweeps and resuming: a joblib multirun read back as one table, kill -9 and resume, two torchrun ranks."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from runner.results import load, read_metadata
from runner.schema import available_cpus
from tests.conftest import committed_shards

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = [
    "model._target_=tests.nets.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.num_classes=5",
    "layers.include=[features.0,features.2]",
    "hooks=[]",
    "progress=false",
    "method.pictures=false",  # a single run's default draws them (a second or more a sample): tested on their own
]


def cli(*args: str, env: dict | None = None, wait: bool = True):
    command = [sys.executable, "-m", "runner", *args]
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    """A table without what differs between runs of one config (ids, times), in a fixed order."""
    frame = frame.drop(columns=["run_id"]).copy()
    frame["map"] = frame["map"].map(tuple)
    return frame.sort_values(["sample", "layer", "call", "target_rank"]).reset_index(drop=True)


@pytest.mark.process
def test_joblib_sweep_reads_back_as_one_table(tmp_path: Path) -> None:
    done = cli(
        "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY, "data.count=6",
        "method=gradcam,layercam", "method.target=predicted,topk", "method.top_k=2", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    frame = load(tmp_path)
    assert set(frame["sweep.method"]) == {"gradcam", "layercam"}
    assert set(frame["sweep.method.target"]) == {"predicted", "topk"}
    assert (frame["method"] == frame["sweep.method"]).all()
    per_job = frame.groupby(["sweep.method", "sweep.method.target"]).size()
    assert per_job.to_dict() == {
        ("gradcam", "predicted"): 12, ("gradcam", "topk"): 24, ("layercam", "predicted"): 12, ("layercam", "topk"): 24,
    }  # fmt: skip
    meta = read_metadata(next(tmp_path.rglob("cam.parquet")))
    assert any(o.startswith("method=") for o in meta["overrides"]) and meta["versions"]["torch"]

    # Started again on the same sweep directory, every job finds its run complete and writes nothing.
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("part-*.parquet")}
    again = cli(
        "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY, "data.count=6",
        "method=gradcam,layercam", "method.target=predicted,topk", "method.top_k=2", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("part-*.parquet")} == before
    assert "0 to run here" in again.stderr


@pytest.mark.process
def test_a_joblib_worker_computes_what_a_plain_run_does(tmp_path: Path) -> None:
    """joblib's workers get one thread from their launcher; the run sets its own count (the CPUs it may use), so a sweep's job
    and a plain run of the same config write equal tables, and a resume under either launcher is consistent."""
    args = [*TINY, "model._target_=tests.nets.SumNet", "data.count=6"]
    plain = cli(*args, f"+model.kwargs.log={tmp_path / 'plain.log'}", f"hydra.run.dir={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr
    swept = cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *args, "method=gradcam,layercam",
                f"+model.kwargs.log={tmp_path / 'joblib.log'}", f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert swept.returncode == 0, swept.stderr
    threads = {int(n) for log in ("plain.log", "joblib.log") for n in (tmp_path / log).read_text().split()}
    assert threads == {available_cpus()}  # 2 or more on the machines this runs on: a one-thread worker differs
    job, single = load(tmp_path / "sweep").query("`sweep.method` == 'gradcam'"), load(tmp_path / "plain")
    job, single = (frame.drop(columns=[c for c in frame.columns if c.startswith("sweep.")]) for frame in (job, single))
    pd.testing.assert_frame_equal(comparable(job), comparable(single), check_exact=True)  # overrides aside


@pytest.mark.process
def test_sigkill_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    slow = [
        *TINY,
        "model._target_=tests.nets.SlowNet",
        "data.count=12",
        "data.batch_size=2",
        "output.shard_batches=1",
    ]
    killed = tmp_path / "killed"
    process = cli(*slow, f"hydra.run.dir={killed}", wait=False)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once at least one shard is on disk and the run is not finished
        if committed_shards(killed) >= 2:
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    written = committed_shards(killed)
    assert 2 <= written < 6, "killed mid-way"
    # What a reader sees meanwhile is the complete shards only (a half-written shard is a hidden temp file,
    # never read), with a warning that the run is unfinished.
    with pytest.warns(UserWarning, match="unfinished run"):
        assert len(load(killed, partial=True)) == written * 2 * 2  # 2 samples x 2 layers per shard

    resumed = cli(*slow, f"hydra.run.dir={killed}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{written} of 6 shards complete" in resumed.stderr
    whole = cli(*slow, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr
    got, expected = comparable(load(killed)), comparable(load(tmp_path / "whole"))
    assert len(got) == 12 * 2 and not got.duplicated(["sample", "layer"]).any()
    pd.testing.assert_frame_equal(got, expected)


@pytest.mark.process
def test_torchrun_two_ranks_equal_one_process(tmp_path: Path) -> None:
    args = [*TINY, "data.count=10", "data.batch_size=2", "output.shard_batches=1"]
    single = cli(*args, f"hydra.run.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    ranks = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner", *args,
         f"hydra.run.dir={tmp_path / 'ranks'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert ranks.returncode == 0, ranks.stderr
    assert (tmp_path / "ranks" / "manifest.json").exists() and (tmp_path / "ranks" / "manifest-rank1.json").exists()
    pd.testing.assert_frame_equal(comparable(load(tmp_path / "ranks")), comparable(load(tmp_path / "single")))


def process_group(pgid: int) -> set[int]:
    """The live processes of process group `pgid` (Linux: the fifth field of /proc/PID/stat)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # pgrp; a zombie has ended
            pids.add(int(stat.parent.name))
    return pids


SWEEP = [*TINY, "model._target_=tests.nets.SlowNet", "data.count=8", "data.batch_size=2", "output.shard_batches=1",
         "method=gradcam,layercam", "seed=0,1"]  # fmt: skip
JOBLIB = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]


@pytest.mark.parametrize(
    ("launcher", "to"),
    [([], "group"), (JOBLIB, "group"), (JOBLIB, "main")],
    ids=["basic-group", "joblib-group", "joblib-main-only"],
)
@pytest.mark.process
def test_sigterm_stops_a_sweep_with_one_resume_command(tmp_path: Path, launcher: list[str], to: str) -> None:
    """SIGTERM to the whole process group (timeout, SLURM) or to the sweep's process alone (docker stop): the
    sweep stops with one line, which calls it interrupted and gives the one command that resumes it; no worker
    outlives it; that command then finishes the sweep."""
    args = ["-m", *launcher, *SWEEP, f"hydra.sweep.dir={tmp_path}"]
    process = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 180
        while time.time() < deadline and sum(committed_shards(job) for job in tmp_path.glob("[0-9]")) < 2:
            time.sleep(0.05)
        running = process_group(process.pid)  # the sweep's process, and its workers with the joblib launcher
        assert len(running) > (1 if launcher else 0)
        if to == "group":
            os.killpg(process.pid, signal.SIGTERM)
        else:
            os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=180)
        assert process.returncode == 2, stderr
        deadline = time.time() + 30  # the multiprocessing resource trackers end a moment after the last worker
        while time.time() < deadline and process_group(process.pid) & running:
            time.sleep(0.2)
        assert not process_group(process.pid) & running, "a process of the sweep outlived it"
    finally:  # whatever failed above, leave no process of this test behind
        for pid in process_group(process.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    lines = [line for line in stderr.splitlines() if "hydra.sweep.dir=" in line]
    assert len(lines) == 1 and lines[0].startswith("[ERROR] Interrupted (SIGTERM)"), stderr
    assert "hydra.run.dir" not in stderr and "failed" not in stderr and "Traceback" not in stderr
    command = lines[0].split("Resume", 1)[1].split("with: ", 1)[1].split(" (finished jobs", 1)[0]
    assert shlex.split(command) == ["python", "-m", "runner", *args]  # the same overrides, this sweep's folder

    if launcher and to == "group":  # the command finishes the sweep: every job's rows, none twice
        resumed = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        frame = load(tmp_path)
        assert len(frame) == 4 * 8 * 2 and not frame.duplicated(["sweep.method", "sweep.seed", "sample", "layer"]).any()
