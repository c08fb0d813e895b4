"""Throughput switches keep results: channels_last, DataLoader workers, batch halving on CUDA OOM,
and the background writer (bounded queue, errors handed back)."""

from __future__ import annotations

import threading
from pathlib import Path

import pandas as pd
import pytest
import torch

import runner.app as app
from runner.errors import RunnerError
from runner.methods import cam_methods
from runner.store.writer import ShardedWriter
from tests.conftest import make_config

GradCAM = cam_methods()["gradcam"]

TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=7",
    "data.batch_size=4",
    "data.num_classes=5",
    "layers.include=[features.0,features.2]",
    "hooks=[{kind: forward, layers: [features.2]}]",
]


def table(path: Path, name: str = "cam") -> pd.DataFrame:
    frame = pd.read_parquet(path / f"{name}.parquet").drop(columns=["run_id"])
    if "map" in frame:
        frame["map"] = frame["map"].map(tuple)
    return frame.sort_values(list(frame.columns[:8])).reset_index(drop=True)


def test_channels_last_gives_the_same_maps(tmp_path: Path) -> None:
    vgg = ["experiment=gradcam_vgg16", "debug=tiny", "model.weights=null"]
    app.run(make_config(*vgg), tmp_path / "a")
    app.run(make_config(*vgg, "channels_last=true"), tmp_path / "b")
    a, b = table(tmp_path / "a"), table(tmp_path / "b")
    assert (a["predicted"] == b["predicted"]).all()
    assert ((a["cam_max"] - b["cam_max"]).abs() <= 1e-4 * a["cam_max"].abs().max()).all()


def test_workers_give_the_same_rows(tmp_path: Path) -> None:
    app.run(make_config(*TINY), tmp_path / "a")
    app.run(make_config(*TINY, "data.num_workers=2", "data.prefetch_factor=2"), tmp_path / "b")
    pd.testing.assert_frame_equal(table(tmp_path / "a"), table(tmp_path / "b"))
    pd.testing.assert_frame_equal(table(tmp_path / "a", "hooks"), table(tmp_path / "b", "hooks"))


def test_out_of_memory_halves_the_batch(tmp_path: Path, simulate_oom, caplog) -> None:
    app.run(make_config(*TINY), tmp_path / "plain")
    simulate_oom()
    app.run(make_config(*TINY), tmp_path / "halved")
    pd.testing.assert_frame_equal(table(tmp_path / "plain"), table(tmp_path / "halved"))
    pd.testing.assert_frame_equal(table(tmp_path / "plain", "hooks"), table(tmp_path / "halved", "hooks"))
    assert "retrying as 2 + 2" in caplog.text


def test_out_of_memory_at_batch_one_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never_fits(self, model, batch, session):  # noqa: ANN001, ANN202
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(GradCAM, "run_batch", never_fits)
    with pytest.raises(RunnerError, match="out of memory with a batch of 1"):
        app.run(make_config(*TINY), tmp_path)


def test_writer_queue_is_bounded(tmp_path: Path) -> None:
    writer = ShardedWriter(tmp_path, {}, {"config_hash": "x"}, queue_size=1)
    writer.begin_shard(0)
    gate = threading.Event()
    writer.submit(lambda: (gate.wait(5), [])[1])  # the writer thread takes it and waits
    writer.submit(lambda: [])  # fills the queue
    third = threading.Thread(target=writer.submit, args=(lambda: [],))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a full queue makes submit wait instead of growing memory"
    gate.set()
    third.join(5)
    assert not third.is_alive()
    writer.commit_shard()
    writer.close()


def test_writer_errors_reach_the_main_thread(tmp_path: Path) -> None:
    writer = ShardedWriter(tmp_path, {}, {"config_hash": "x"})
    writer.begin_shard(0)

    def broken() -> list:
        raise ValueError("cannot convert")

    writer.submit(broken)
    with pytest.raises(ValueError, match="cannot convert"):
        writer.commit_shard()
    writer.close()
    assert not (tmp_path / "manifest.json").exists()
