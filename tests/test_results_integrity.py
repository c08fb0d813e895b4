"""Results that cannot be lost, corrupted or hidden: one writer per output folder, a manifest checked
against its files (on resume and in `load`), temporary files that readers skip while a run is live,
SIGTERM and a second Ctrl-C, sidecar tensors after an OOM split, a resume key that covers the
checkpoint's and the image folder's contents, swept columns typed as Hydra types them, and write
failures that are one clear message."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import duckdb
import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import runner.app as app
import runner.store.provenance as provenance
from runner.errors import RunnerError
from runner.results import load
from runner.store.layout import check_output_arguments
from runner.store.writer import DirectoryLock
from tests.conftest import TinyNet, committed_shards, make_config

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model._target_=tests.nets.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=12",
    "data.batch_size=2",
    "data.num_classes=5",
    "output.shard_batches=1",
    "layers.include=[features.0,features.2]",
    "hooks=[{kind: forward, layers: [features.2]}]",
]
# The runs of other processes: no pictures (a single run's default; a second or more a sample, tested on their own).
SLOW = [*TINY, "model._target_=tests.nets.SlowNet", "progress=false", "method.pictures=false"]  # 0.25 s per forward
# 1 s per forward, 12 batches: long enough to signal twice in a batch.
SLEEPY = [*TINY, "model._target_=tests.nets.SleepyNet", "+model.kwargs.delay=1.0", "data.count=24", "progress=false",
          "method.pictures=false"]  # fmt: skip


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    """A table without what differs between runs of one config (run ids), in a fixed order."""
    frame = frame.drop(columns=["run_id"]).copy()
    for column in ("map",):
        if column in frame:
            frame[column] = frame[column].map(tuple)
    keys = [c for c in ("sample", "layer", "hook", "role", "call", "target_rank") if c in frame]
    return frame.sort_values(keys).reset_index(drop=True)


def cli(*args: str, wait: bool = True):
    command = [sys.executable, "-m", "runner", *args]
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def wait_for(condition, process: subprocess.Popen, seconds: float = 120) -> None:  # noqa: ANN001
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return
        if process.poll() is not None:
            raise AssertionError(f"the run ended first (exit {process.returncode}): {process.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the run")


def parts(run: Path, table: str = "cam") -> list[Path]:
    return sorted((run / f"{table}.parquet").glob("part-*.parquet"))


def temporaries(run: Path) -> list[Path]:
    return [p for p in run.rglob("*") if p.name.endswith(".tmp")]


def one_line_error(stderr: str, message: str) -> None:
    assert message in stderr, stderr
    assert "Traceback" not in stderr, stderr


# ---- one writer per output folder ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_writer_is_refused_in_process(tmp_path: Path) -> None:
    holder = DirectoryLock(tmp_path)
    holder.acquire()
    try:
        with pytest.raises(RunnerError, match="in use by another run \\(pid \\d+ on .*\\).*hydra.run.dir=NEW_DIR"):
            app.run(make_config(*TINY), tmp_path)
        assert not parts(tmp_path) and not (tmp_path / "manifest.json").exists()
    finally:
        holder.release()
    app.run(make_config(*TINY), tmp_path)  # released: the folder is free again, and no lock file is left
    assert len(load(tmp_path, "cam")) == 12 * 2 and not (tmp_path / ".runner.lock").exists()


@pytest.mark.slow
@pytest.mark.process
def test_two_writers_on_one_folder_second_refused_first_intact(tmp_path: Path) -> None:
    run, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    # Once its first shard is on disk, the first run waits in its next forward until `hold` is removed: it stays live,
    # holding the folder, for as long as the others take to start and be refused (no fixed time to outlast).
    held = [*TINY, "model._target_=tests.nets.HeldNet", f"+model.kwargs.hold={hold}", "data.count=24",
            f"+model.kwargs.after='{run}/cam.parquet/part-*.parquet'", "progress=false", "method.pictures=false"]  # fmt: skip
    first = cli(*held, f"hydra.run.dir={run}", wait=False)
    wait_for(lambda: len(parts(run)) >= 1, first)
    # Same config, then a different one, while the first runs: both refused by the lock (not blamed on a config
    # difference).
    seconds = [cli(*args, f"hydra.run.dir={run}", wait=False) for args in (held, [*held, "data.count=10"])]
    for second in seconds:
        _, stderr = second.communicate(timeout=300)
        assert second.returncode == 2
        one_line_error(stderr, "is in use by another run")
        assert "different run" not in stderr
    assert first.poll() is None, "the first run was still running when the others were refused"
    assert len(parts(run)) < 12, "the first run was held mid-way"
    hold.unlink()
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    frame = load(run, "cam")
    assert len(frame) == 24 * 2 and not frame.duplicated(["sample", "layer"]).any()
    assert frame["run_id"].nunique() == 1  # every shard written by the first run
    assert not temporaries(run)


# ---- the manifest checked against its files ---------------------------------------------------------------------
@pytest.mark.slow
def test_missing_and_truncated_shards_run_again_on_resume(tmp_path: Path) -> None:
    app.run(make_config(*TINY), tmp_path)
    whole = {t: comparable(load(tmp_path, t)) for t in ("cam", "hooks")}
    (tmp_path / "cam.parquet" / "part-000003.parquet").unlink()
    damaged = tmp_path / "hooks.parquet" / "part-000001.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated

    with pytest.raises(RunnerError, match="cam.parquet/part-000003.parquet is missing.*partial=True"):
        load(tmp_path, "cam")
    with pytest.raises(RunnerError, match="hooks.parquet/part-000001.parquet is unreadable"):
        load(tmp_path, "hooks")
    with pytest.warns(UserWarning, match="part-000003.parquet is missing"):
        assert len(load(tmp_path, "cam", partial=True)) == 10 * 2

    app.run(make_config(*TINY), tmp_path)  # the same command again: the damaged shards run again
    for table in ("cam", "hooks"):
        pd.testing.assert_frame_equal(comparable(load(tmp_path, table)), whole[table])
    assert pd.read_parquet(tmp_path / "cam.parquet")["run_id"].nunique() == 2  # shards 1 and 3 are new


@pytest.mark.slow
def test_every_shard_deleted_runs_everything_again(tmp_path: Path) -> None:
    app.run(make_config(*TINY), tmp_path)
    whole = comparable(load(tmp_path, "cam"))
    for part in parts(tmp_path) + parts(tmp_path, "hooks"):
        part.unlink()
    app.run(make_config(*TINY), tmp_path)
    pd.testing.assert_frame_equal(comparable(load(tmp_path, "cam")), whole)


@pytest.mark.slow
def test_a_shard_with_other_row_count_runs_again(tmp_path: Path) -> None:
    app.run(make_config(*TINY), tmp_path)
    whole = comparable(load(tmp_path, "cam"))
    shorter = tmp_path / "cam.parquet" / "part-000002.parquet"
    table = pq.read_table(shorter)
    pq.write_table(table.slice(0, 1).replace_schema_metadata(table.schema.metadata), shorter)
    with pytest.raises(RunnerError, match="part-000002.parquet has 1 rows, the manifest 4"):
        load(tmp_path, "cam")
    app.run(make_config(*TINY), tmp_path)
    pd.testing.assert_frame_equal(comparable(load(tmp_path, "cam")), whole)


def test_load_refuses_an_unfinished_run_unless_partial(tmp_path: Path) -> None:
    import json

    app.run(make_config(*TINY), tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shards"]["5"]
    manifest["complete"] = False
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "cam.parquet" / "part-000005.parquet").unlink()
    with pytest.raises(RunnerError, match="unfinished run \\(5 of 6 shards complete\\).*partial=True"):
        load(tmp_path, "cam")
    with pytest.warns(UserWarning, match="unfinished run"):
        assert len(load(tmp_path, "cam", partial=True)) == 5 * 2 * 2


@pytest.mark.slow
def test_load_returns_the_methods_main_table_beside_the_hooks_table(tmp_path: Path) -> None:
    import json

    app.run(make_config(*TINY), tmp_path / "cam")  # a CAM run that also records hooks: cam and hooks tables
    app.run(make_config(*TINY, "method=record"), tmp_path / "record")  # hooks only
    pd.testing.assert_frame_equal(load(tmp_path / "cam"), load(tmp_path / "cam", "cam"))
    assert set(load(tmp_path / "record")["hook"]) == {"forward"}
    manifest = json.loads((tmp_path / "cam" / "manifest.json").read_text())
    assert manifest["main_table"] == "cam"
    del manifest["main_table"]  # a run written before the manifest named it: the method in the tables' config says
    (tmp_path / "cam" / "manifest.json").write_text(json.dumps(manifest))
    assert "cam_max" in load(tmp_path / "cam").columns
    with pytest.raises(
        RunnerError, match=r"several tables \(cam, hooks\).*main tables differ \(cam, hooks\).*table=NAME"
    ):
        load(tmp_path)


@pytest.mark.slow
def test_load_of_a_sweep_with_a_failed_and_an_unstarted_job_raises_naming_them(tmp_path: Path) -> None:
    import shutil

    from tests.conftest import run_cli

    sweep = tmp_path / "sweep"
    # Job 1 fails on its layer; the basic launcher then stops, so job 2 never starts.
    done = run_cli("-m", *TINY, "data.count=2", "layers.include=[features.0],[nowhere],[features.2]",
                   f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert done.returncode == 2 and not (sweep / "2").exists()
    with pytest.raises(RunnerError, match="1 of 3 jobs complete") as raised:
        load(sweep)
    message = str(raised.value)
    assert "job #1 (layers.include=[nowhere]) failed: Layer 'nowhere' does not exist" in message
    assert "job #2 (layers.include=[features.2]) has not started" in message
    assert f"hydra.sweep.dir={sweep}" in message and "partial=True" in message
    with pytest.raises(RunnerError, match="job #2"):
        load(tmp_path, "cam")  # from a folder above the sweep too
    with pytest.warns(UserWarning, match="job #1 .*job #2"):
        assert len(load(sweep, partial=True)) == 2  # job 0's 2 samples at 1 layer
    # A job that has started but has no manifest yet (its first shard in progress, or killed in it).
    shutil.copytree(sweep / "1" / ".hydra", sweep / "2" / ".hydra")
    (sweep / "1" / "__main__.log").unlink()
    with pytest.raises(RunnerError, match="job #1 .* has no complete shard yet.*job #2 .* has no complete shard yet"):
        load(sweep)


def test_parts_no_manifest_lists_are_not_read_and_are_replaced_on_resume(tmp_path: Path) -> None:
    """A kill between a shard's renames and the manifest's replacement: its parts are visible but unlisted."""
    import json

    app.run(make_config(*TINY), tmp_path)
    whole = {t: comparable(load(tmp_path, t)) for t in ("cam", "hooks")}
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shards"]["4"]
    manifest["complete"] = False
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    orphan = tmp_path / "cam.parquet" / "part-000004.parquet"
    orphan.write_bytes((tmp_path / "cam.parquet" / "part-000000.parquet").read_bytes())  # not shard 4's rows
    with pytest.warns(UserWarning, match="unfinished run \\(5 of 6"):
        assert 4 not in set(load(tmp_path, "cam", partial=True)["sample"] // 2)  # samples 8, 9 are shard 4's
    app.run(make_config(*TINY), tmp_path)
    for table in ("cam", "hooks"):
        pd.testing.assert_frame_equal(comparable(load(tmp_path, table)), whole[table])
    assert committed_shards(tmp_path) == 6


@pytest.mark.slow
@pytest.mark.process
def test_a_manifest_that_is_not_json_is_a_clear_error(tmp_path: Path) -> None:
    app.run(make_config(*TINY), tmp_path)
    (tmp_path / "manifest.json").write_text('{"shards": {"0": ')
    with pytest.raises(RunnerError, match="manifest.json is not a readable runner manifest.*hydra.run.dir=NEW_DIR"):
        app.run(make_config(*TINY), tmp_path)
    with pytest.raises(RunnerError, match="not a readable runner manifest"):
        load(tmp_path, "cam")
    done = cli(*TINY, "progress=false", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    one_line_error(done.stderr, "not a readable runner manifest")


# Manifests that are not one, as a disk, an editor or another tool leaves them: (name, bytes).
MALFORMED_MANIFESTS = [
    ("truncated", b'{"config_hash": "ab", "shards": {"0": {"cam": 4'),
    ("binary", bytes(range(256))),
    ("empty", b""),
    ("list", b"[1, 2]"),
    ("null", b"null"),
    ("empty_object", b"{}"),
    ("foreign", b'{"name": "my-package", "version": "1.0", "files": ["a.js"]}'),
    ("shard_entry_a_string", b'{"shards": {"0": "x"}}'),
    ("rows_a_string", b'{"config_hash": "ab", "complete": true, "shards": {"0": {"cam": "4"}}}'),
    ("table_outside", b'{"config_hash": "ab", "complete": true, "shards": {"0": {"../../x": 4}}}'),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    app.run(make_config(*TINY), run)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("content", [c for _, c in MALFORMED_MANIFESTS], ids=[n for n, _ in MALFORMED_MANIFESTS])
def test_a_malformed_manifest_is_one_line_in_the_run_ls_and_report(
    content: bytes, finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from runner.commands import cli
    from runner.store import runs

    damaged, intact = tmp_path / "damaged", tmp_path / "intact"
    shutil.copytree(finished_run, damaged)
    shutil.copytree(finished_run, intact)
    (damaged / "manifest.json").write_bytes(content)
    before = {p: p.read_bytes() for p in damaged.rglob("part-*.parquet")}
    with pytest.raises(RunnerError, match="manifest.json is not a readable runner manifest.*move it away"):
        app.run(make_config(*TINY), damaged)
    with pytest.raises(RunnerError, match="not a readable runner manifest"):
        load(damaged, "cam", partial=True)
    assert {p: p.read_bytes() for p in damaged.rglob("part-*.parquet")} == before  # nothing removed or replaced

    capsys.readouterr()
    (info,) = [i for i in runs.find(tmp_path) if i.path == damaged]
    assert cli.main(["ls", str(tmp_path)]) == 2  # the short listing: the run that needs something, and what to do
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err.count("\n") == 1 and str(damaged / "manifest.json") in err
    assert "1 run [1 damaged manifest]" in out and f"{damaged}  [damaged manifest]" in out  # ?: no .hydra/
    assert info.redo_command in out and "resume:" not in out
    assert cli.main(["ls", "--all", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err.count("\n") == 1 and str(damaged / "manifest.json") in err
    assert f"{intact}  [complete]" in out  # the other runs are listed
    # The part files beside it, as what they are: 12 samples x 2 layers of cam rows, 12 of hooks.
    assert f"{damaged}  [damaged manifest]  ?: cam 24 rows, hooks 12 rows in its part files" in out  # ?: no .hydra/
    assert "not a readable runner manifest" in out and "resume:" not in out  # the run would refuse a resume
    assert info.redo_command in out

    assert cli.main(["report", str(damaged)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err.count("\n") == 1 and "not a readable runner manifest" in err


@pytest.mark.slow
def test_the_command_ls_gives_for_a_damaged_manifest_redoes_the_run(finished_run: Path, tmp_path: Path) -> None:
    import shlex
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    whole = comparable(load(run, "cam"))
    (run / "manifest.json").write_text('{"shards": {"0": "x"}}')
    from runner.store import runs

    (info,) = runs.find(tmp_path)
    move, _, command = info.redo_command.partition(" && ")
    argv = shlex.split(move)
    Path(argv[1]).rename(argv[2])
    assert shlex.split(command) == ["runner", f"hydra.run.dir={run}"]  # a run from Python: no saved overrides
    app.run(make_config(*TINY), run)  # the same command, in the same directory
    pd.testing.assert_frame_equal(comparable(load(run, "cam")), whole)
    assert runs.find(tmp_path)[0].status == "complete"


# ---- live runs, SIGTERM, a second Ctrl-C ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.process
def test_a_live_run_reads_with_pandas_pyarrow_and_duckdb_and_sigterm_stops_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Pictures drawn (a run's default): their second or so a batch keeps the run live while the test reads it.
    args = [*SLOW, "method.pictures=true", "output.shard_batches=2", f"hydra.run.dir={run}"]
    process = cli(*args, wait=False)
    folder = run / "cam.parquet"
    # A complete shard and the next one being written (a temporary file in the table folder).
    wait_for(lambda: parts(run) and any(p.name.endswith(".tmp") for p in folder.iterdir()), process)
    assert all(p.name.startswith(".") for p in folder.iterdir() if p.name.endswith(".tmp"))
    committed = sum(pq.read_metadata(p).num_rows for p in parts(run))
    assert committed >= 8  # every read below sees at least the committed rows, and the temporary file not at all
    assert len(pd.read_parquet(folder)) >= committed
    assert ds.dataset(folder).to_table().num_rows >= committed
    assert duckdb.sql(f"select count(*) from read_parquet('{folder}/*.parquet')").fetchall()[0][0] >= committed
    with pytest.raises(RunnerError, match="unfinished run"):
        load(run, "cam")

    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2  # the Ctrl-C convention: bad input or interrupted, resumable
    one_line_error(stderr, "Interrupted.")
    assert f"hydra.run.dir={run}" in stderr and "SIGTERM" in stderr
    assert not temporaries(run)
    with pytest.warns(UserWarning, match="unfinished run"):
        assert 8 <= len(load(run, "cam", partial=True)) < 12 * 2
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    frame = load(run, "cam")
    assert len(frame) == 12 * 2 and not frame.duplicated(["sample", "layer"]).any()


@pytest.mark.slow
@pytest.mark.process
def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    process = cli(*SLEEPY, f"hydra.run.dir={run}", wait=False)
    wait_for(lambda: len(parts(run)) >= 1, process)
    time.sleep(0.2)  # inside the next batch (1 s per forward)
    process.send_signal(signal.SIGINT)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    one_line_error(stderr, "Stopped at once.")
    assert f"hydra.run.dir={run}" in stderr and not temporaries(run)


@pytest.mark.slow
@pytest.mark.process
def test_kill_9_then_resume_with_a_noise_hook_equals_uninterrupted(tmp_path: Path) -> None:
    noisy = [*SLOW, "hooks=[{kind: forward, action: add_noise, std: 0.5, layers: [features.0]}, {kind: forward, layers: [features.2]}]"]  # fmt: skip
    killed = tmp_path / "killed"
    process = cli(*noisy, f"hydra.run.dir={killed}", wait=False)
    wait_for(lambda: committed_shards(killed) >= 2, process)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    written = committed_shards(killed)
    assert 2 <= written < 6, "killed mid-way"
    resumed = cli(*noisy, f"hydra.run.dir={killed}")  # the lock died with the process: not stuck
    assert resumed.returncode == 0, resumed.stderr
    assert f"{written} of 6 shards complete" in resumed.stderr
    whole = cli(*noisy, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr
    for table in ("cam", "hooks"):
        got, expected = comparable(load(killed, table)), comparable(load(tmp_path / "whole", table))
        assert len(got) == 12 * (2 if table == "cam" else 1) and not got.duplicated(["sample", "layer"]).any()
        pd.testing.assert_frame_equal(got, expected)
    assert not temporaries(killed)


# ---- sidecar tensors after an OOM split --------------------------------------------------------------------------
@pytest.mark.slow
def test_oom_split_halves_keep_their_own_sidecar_tensors(tmp_path: Path, simulate_oom) -> None:
    from safetensors.torch import load_file

    simulate_oom()
    config = [*TINY, "data.count=8", "data.batch_size=4", "hooks=[{kind: forward, layers: [features.2], save_tensors: true}]"]  # fmt: skip
    app.run(make_config(*config), tmp_path)
    hooks = load(tmp_path, "hooks")
    assert len(hooks) == 8 and hooks["tensor_file"].nunique() == 8  # 4 halves of 2, then 1: a file per part
    for row in hooks.itertuples():
        first = int(row.tensor_file.removeprefix("batch-").removesuffix(".safetensors"))
        tensor = load_file(str(tmp_path / "tensors" / row.tensor_file))[row.tensor_key]  # (part size, 8, 8, 8)
        assert first <= row.sample < first + tensor.shape[0]
        assert float(tensor[row.sample - first].mean()) == pytest.approx(row.mean, rel=1e-5, abs=1e-6)


# ---- the resume key -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.process
def test_overwritten_checkpoint_is_not_resumed(tmp_path: Path) -> None:
    checkpoint = tmp_path / "weights.pt"
    torch.manual_seed(1)
    torch.save(TinyNet().state_dict(), checkpoint)
    config = [*TINY, f"model.checkpoint={checkpoint}"]
    app.run(make_config(*config), tmp_path / "run")
    app.run(make_config(*config, "data.num_workers=1", "method.faithfulness.chunk=3"), tmp_path / "run")  # speed only
    app.run(make_config(*config, "figures.dpi=50", "figures.format=svg", "report=true"), tmp_path / "run")  # looks only
    torch.manual_seed(2)
    torch.save(TinyNet().state_dict(), checkpoint)  # the same path, other weights
    with pytest.raises(RunnerError, match='different run.*model.checkpoint \\(contents\\): "sha256:'):
        app.run(make_config(*config), tmp_path / "run")
    with pytest.raises(RunnerError, match='different run.*method.target: "predicted" -> "label"') as refused:
        app.run(make_config(*config, "method.target=label"), tmp_path / "run")
    assert "model.checkpoint (contents)" in str(refused.value)  # both differences named


@pytest.mark.slow
def test_changed_image_folder_is_not_resumed(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(images / f"{i}.png")
    config = [*TINY[:2], "data=image_folder", f"data.root={images}", "data.image_size=8", "data.resize=square",
              "data.batch_size=2", *TINY[7:]]  # fmt: skip
    app.run(make_config(*config), tmp_path / "run")
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(images / "2.png")  # replaced
    os.utime(images / "2.png", ns=(1, 1))
    with pytest.raises(RunnerError, match='data.root \\(contents\\): "4 files, '):
        app.run(make_config(*config), tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("side", ["masks.json", "0.mask.png"])
def test_changed_mask_side_file_is_not_resumed(tmp_path: Path, side: str) -> None:
    """A localisation mask edited in place (same size, same modification time) between a run and its resume."""
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(images / f"{i}.png")
    (images / "masks.json").write_text('{"1.png": {"boxes": [[1, 1, 5, 5]]}}')
    mask = np.zeros((8, 8), np.uint8)
    mask[2:6, 2:6] = 255
    Image.fromarray(mask).save(images / "0.mask.png")
    config = [*TINY[:2], "data=image_folder", f"data.root={images}", "data.image_size=8", "data.resize=square",
              "data.batch_size=2", *TINY[7:]]  # fmt: skip
    app.run(make_config(*config), tmp_path / "run")
    app.run(make_config(*config), tmp_path / "run")  # unchanged: resumes (nothing left to do)
    path = images / side
    stat = path.stat()
    if side == "masks.json":
        path.write_text('{"1.png": {"boxes": [[2, 2, 6, 6]]}}')  # another box, the same number of bytes
    else:
        mask[2:6, 2:6], mask[0:4, 0:4] = 0, 255
        Image.fromarray(mask).save(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as a copy that keeps times would leave it
    with pytest.raises(RunnerError, match='different run.*data.root masks \\(contents\\): "2 files, '):
        app.run(make_config(*config), tmp_path / "run")


# ---- swept columns typed by Hydra's grammar ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "column", "value"),
    [("seed=010", "sweep.seed", 10), ("name=yes", "sweep.name", "yes"), ("name=007", "sweep.name", "007"),
     ("method.target=label", "sweep.method.target", "label"), ("+model.kwargs.classes=5", "sweep.model.kwargs.classes", 5)],
)  # fmt: skip
def test_swept_columns_typed_as_the_run_used_them(override: str, column: str, value: object) -> None:
    config = make_config(*TINY, override)
    with mock.patch.object(provenance, "hydra_overrides", return_value=[override, "hydra.run.dir=x"]):
        columns = provenance.swept_columns(config)
    assert columns == {column: value} and type(columns[column]) is type(value)


# ---- write failures ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_disk_full_is_one_clear_error_and_a_rerun_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    original = pq.ParquetWriter.write_table

    def fills_the_disk(self, table, *args, **kwargs):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", fills_the_disk)
    with pytest.raises(RunnerError, match="Cannot write results to .*: No space left on device.*hydra.run.dir="):
        app.run(make_config(*TINY), tmp_path)
    assert not temporaries(tmp_path) and 1 <= len(parts(tmp_path)) < 6
    monkeypatch.setattr(pq.ParquetWriter, "write_table", original)
    app.run(make_config(*TINY), tmp_path)
    assert len(load(tmp_path, "cam")) == 12 * 2


def test_sidecar_disk_full_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, *args, **kwargs):  # noqa: ANN001, ANN202
        Path(filename).write_bytes(b"half")  # what a full disk leaves behind
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')  # fmt: skip

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    config = [*TINY, "hooks=[{kind: forward, layers: [features.2], save_tensors: true}]"]
    with pytest.raises(RunnerError, match="No space left on device"):
        app.run(make_config(*config), tmp_path)
    assert not temporaries(tmp_path)


@pytest.mark.slow
@pytest.mark.process
def test_run_dir_that_is_a_file_or_read_only_is_one_clear_error(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(RunnerError, match="it is a file, not a directory. Choose another hydra.run.dir=PATH"):
        check_output_arguments([f"hydra.run.dir={file}"])
    with pytest.raises(RunnerError, match="Not a directory.*hydra.sweep.dir=PATH"):
        check_output_arguments([f"hydra.sweep.dir={file}/sub"])
    denied = OSError(errno.EACCES, "Permission denied")
    with mock.patch.object(Path, "write_bytes", side_effect=denied):
        with pytest.raises(RunnerError, match="Permission denied.*writable directory with hydra.run.dir=PATH"):
            check_output_arguments([f"hydra.run.dir={tmp_path / 'ro'}"])
    done = cli(*TINY, f"hydra.run.dir={file}")
    assert done.returncode == 2
    one_line_error(done.stderr, "it is a file, not a directory")
