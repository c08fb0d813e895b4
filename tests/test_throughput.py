"""Throughput switches keep results: channels_last, DataLoader workers, batch halving on CUDA OOM,
and the background writer (bounded queue, errors handed back)."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.loop import run_with_backoff
from runner.methods import cam_methods
from runner.methods.base import Method
from runner.methods.patching.engine import ExactEngine
from runner.methods.patching.units import enumerate_units
from runner.options.method.patching import PatchingConfig, PatchUnit
from runner.rows import BatchOutput
from runner.runtime import Runtime
from runner.schema import Precision
from runner.store.writer import ShardedWriter
from tests.conftest import make_config
from tests.test_distributed import TINY_RUN

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


@pytest.mark.slow
def test_channels_last_gives_the_same_maps(tmp_path: Path) -> None:
    vgg = ["experiment=gradcam_vgg16", "debug=tiny", "model.weights=null"]
    app.run(make_config(*vgg), tmp_path / "a")
    app.run(make_config(*vgg, "channels_last=true"), tmp_path / "b")
    a, b = table(tmp_path / "a"), table(tmp_path / "b")
    assert (a["predicted"] == b["predicted"]).all()
    assert ((a["cam_max"] - b["cam_max"]).abs() <= 1e-4 * a["cam_max"].abs().max()).all()


@pytest.mark.slow
@pytest.mark.process
def test_workers_give_the_same_rows(tmp_path: Path) -> None:
    app.run(make_config(*TINY), tmp_path / "a")
    app.run(make_config(*TINY, "data.num_workers=2", "data.prefetch_factor=2"), tmp_path / "b")
    pd.testing.assert_frame_equal(table(tmp_path / "a"), table(tmp_path / "b"))
    pd.testing.assert_frame_equal(table(tmp_path / "a", "hooks"), table(tmp_path / "b", "hooks"))


@pytest.mark.slow
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


# ---- CUDA out of memory: the halves run after the failed attempt is freed, and write only their own tensors ----------
class OomOnceWithActivations(Method):
    """Allocates a stand-in for its activations, then raises CUDA out-of-memory on the first (full) batch only;
    every later attempt notes whether that first tensor was already freed."""

    def __init__(self) -> None:
        self.first_attempt: weakref.ref[torch.Tensor] | None = None
        self.freed_when_halves_ran: list[bool] = []

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        activations = model(batch.x) * 1.0  # (B, K): held by this frame, as a real attempt's graph would be
        if self.first_attempt is None:
            self.first_attempt = weakref.ref(activations)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        self.freed_when_halves_ran.append(self.first_attempt() is None)
        return BatchOutput(predicted=activations.argmax(dim=1))


def test_oom_backoff_runs_the_halves_after_the_failed_attempt_is_freed(tiny: nn.Module) -> None:
    """The retry used to run inside the `except` block, where the traceback keeps the failed attempt's frames (and
    their tensors) alive: on a GPU the halves then ran short of that memory and failed again down to batch 1."""
    batch = Batch(torch.randn(4, 3, 16, 16), torch.full((4,), -1), [str(i) for i in range(4)], 0)  # (4, 3, 16, 16)
    method = OomOnceWithActivations()
    with HookSession(tiny, []) as session:
        parts = run_with_backoff(batch, tiny, method, session, make_config("data=synthetic"))
    assert [part[0].x.shape[0] for part in parts] == [2, 2]
    assert [part[0].first_index for part in parts] == [0, 2]
    assert method.freed_when_halves_ran == [True, True]


def test_oom_in_the_prefix_forward_reaches_the_backoff(tiny: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch-1 prefix fallback must not catch CUDA out-of-memory (it would run n full forwards, more memory, not
    less, and switch the prefix off for the rest of the run): out-of-memory goes to the stack's backoff, and the
    results equal a run that fits."""
    p = PatchingConfig(units=PatchUnit.channel, chunk=8)
    runtime = Runtime(torch.device("cpu"), Precision.fp32)
    name, layer = "features.0", tiny.features[0]
    x = torch.randn(2, 3, 8, 8)  # (2, 3, 8, 8)
    base, source = layer(x[:1])[0], layer(x[1:])[0]  # (6, 8, 8) each
    units = enumerate_units(name, tuple(base.shape), PatchUnit.channel, [1, 1], None)
    target, contrast = torch.tensor([1]), torch.tensor([0])
    calls = {"n": 0}
    original = tiny.fc.forward

    def oom_once(z: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(z)

    monkeypatch.setattr(tiny.fc, "forward", oom_once)
    with HookSession(tiny, []) as session:
        capture = session.capture([(name, layer)], differentiable=False)
        engine = ExactEngine(p, runtime, session, capture, session.replace([(name, layer)]))
        # The out-of-memory error reaches the stack's backoff (runner/chunk_sizing.py: half the variants, again),
        # not the prefix fallback: the prefix stays on and every unit is measured.
        metrics = engine.patched_metrics(tiny, name, x[:1], base, source, units, target, contrast)
        assert capture.active
    assert calls["n"] > 1 and metrics.shape == (6,) and torch.isfinite(metrics).all()
    assert engine.prefix_ok[name] is True
    monkeypatch.setattr(tiny.fc, "forward", original)
    with HookSession(tiny, []) as session:
        capture = session.capture([(name, layer)], differentiable=False)
        engine = ExactEngine(p, runtime, session, capture, session.replace([(name, layer)]))
        expected = engine.patched_metrics(tiny, name, x[:1], base, source, units, target, contrast)
    assert torch.allclose(metrics, expected, atol=1e-6)


def test_oom_split_writes_only_the_halves_sidecar_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed whole batch's kept tensors (its forward ran, then the OOM came, as in a backward) were written to
    its sidecar file before the halves ran, then replaced by the first half's: a host copy and a write of a batch
    that failed. Only the halves' tensors may be written, and the tables equal an unsplit run's."""
    from safetensors.torch import load_file

    from runner.hooks.tensors import TensorSaver
    from runner.methods import cam_methods

    GradCAM = cam_methods()["gradcam"]
    from runner.results import load

    config = [*TINY_RUN, "data.count=4", "data.batch_size=4", "output.shard_batches=8",
              "hooks=[{kind: forward, layers: [features.2], save_tensors: true}]"]  # fmt: skip
    unsplit = app.run(make_config(*config), tmp_path / "unsplit")

    original_run, original_write = GradCAM.run_batch, TensorSaver._write
    written: list[tuple[str, int]] = []

    def oom_after_the_pass(self, model, batch, session):  # noqa: ANN001, ANN202
        output = original_run(self, model, batch, session)  # the hooks have fired and kept their tensors
        if batch.x.shape[0] > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return output

    def spy(self: TensorSaver, path: Path) -> None:
        written.append((path.name, next(iter(self._saved.values())).shape[0]))
        original_write(self, path)

    monkeypatch.setattr(GradCAM, "run_batch", oom_after_the_pass)
    monkeypatch.setattr(TensorSaver, "_write", spy)
    split = app.run(make_config(*config), tmp_path / "split")

    names = [f"batch-{i:06d}.safetensors" for i in range(4)]
    assert written == [(name, 1) for name in names]  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1; never the failed 4 or 2
    assert sorted(p.name for p in (tmp_path / "split" / "tensors").iterdir()) == names
    hooks = load(tmp_path / "split", "hooks").sort_values("sample")
    assert hooks["tensor_file"].tolist() == names
    for row in hooks.itertuples():
        tensor = load_file(str(tmp_path / "split" / "tensors" / row.tensor_file))[row.tensor_key]  # (1, 8, 8, 8)
        assert tensor.shape[0] == 1
        assert float(tensor.mean()) == pytest.approx(row.mean, rel=1e-5, abs=1e-6)
    for table in ("cam", "hooks"):
        keep = ["sample", "layer", "call"]
        a = load(unsplit.output_dir, table).drop(columns=["run_id", "tensor_file"], errors="ignore")
        b = load(split.output_dir, table).drop(columns=["run_id", "tensor_file"], errors="ignore")
        sort = [c for c in (*keep, "target_rank", "kind", "role") if c in a.columns]
        a, b = (f.sort_values(sort).reset_index(drop=True) for f in (a, b))
        if "map" in a.columns:
            a["map"], b["map"] = a["map"].map(tuple), b["map"].map(tuple)
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-5)
