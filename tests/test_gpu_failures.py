"""GPU-path failures that the CPU can show (issue 12): each test fails without its fix."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from runner import app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.loop import run_with_backoff
from runner.methods import build_method
from runner.methods.base import Method
from runner.methods.patching import method as patching_method
from runner.methods.patching.engine import ExactEngine
from runner.methods.patching.units import enumerate_units
from runner.options.method.patching import PatchingConfig, PatchingMethodConfig, PatchMode, PatchUnit
from runner.rows import BatchOutput
from runner.runtime import Runtime
from runner.schema import Precision
from tests.conftest import make_config

VGG_TINY = ["model=vgg16", "model.weights=null", "data=synthetic", "data.count=2", "data.shape=[3,32,32]",
            "data.batch_size=2", "layers.include=[features.2]", "method=patching", "method.patching.grid=[2,2]", "method.target=fixed", "method.class_ids=[1]",
            "method.pictures=false", "progress=false", "hooks=[]"]  # fmt: skip


def test_bf16_cell_patching_through_the_cone_runs_and_matches_fp32(tmp_path: Path) -> None:
    """The cone recomputation (VGG's chain of local ops) runs under autocast as the forward does: bf16 used to
    fail with "Input type (c10::BFloat16) and bias type (float)"."""
    tables = {}
    for precision in ("fp32", "bf16"):
        result = app.run(make_config(*VGG_TINY, f"precision={precision}"), tmp_path / precision)
        tables[precision] = pd.read_parquet(result.tables["patching"]).sort_values(["sample", "y", "x"])
    fp32, bf16 = tables["fp32"], tables["bf16"]
    assert len(bf16) == len(fp32) == 2 * 4
    assert (bf16["target"].to_numpy() == 1).all()
    scale = fp32["patched"].abs().max()
    assert scale > 0
    assert abs(bf16["patched"].to_numpy() - fp32["patched"].to_numpy()).max() <= 0.05 * scale


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
    """The batch-1 prefix fallback caught every RuntimeError, CUDA out-of-memory included: it then ran n full
    forwards (more memory, not less) and switched the prefix off for the rest of the run."""
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
        with pytest.raises(torch.cuda.OutOfMemoryError):
            engine.patched_metrics(tiny, name, x[:1], base, source, units, target, contrast)
        assert engine.prefix_ok.get(name) is not False
        assert capture.active  # restored after the error
        metrics = engine.patched_metrics(tiny, name, x[:1], base, source, units, target, contrast)  # the retry
    assert metrics.shape == (6,)
    assert engine.prefix_ok[name] is True


class DeviceUnlessTold:
    """Stands in for `torch` in a module under test: a tensor made without a device lands on `meta`, so any tensor
    that would stay on the CPU beside CUDA rows shows up on a CPU-only machine."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: object, **kwargs: object) -> torch.Tensor:
        kwargs["device"] = kwargs.get("device") or "meta"
        return torch.tensor(*args, **kwargs)

    @staticmethod
    def full(*args: object, **kwargs: object) -> torch.Tensor:
        kwargs["device"] = kwargs.get("device") or "meta"
        return torch.full(*args, **kwargs)


@pytest.mark.parametrize("top_k", [1, 3])  # 1: rho undefined (a NaN tensor); 3: Spearman's rho
def test_attribution_topk_rows_stay_on_the_inputs_device(
    tiny: nn.Module, monkeypatch: pytest.MonkeyPatch, top_k: int
) -> None:
    """rank_correlation was made on the CPU (torch.tensor(nan), torch.full without a device) and concatenated with
    the CUDA rows: "Expected all tensors to be on the same device" on every GPU run of attribution_topk."""
    monkeypatch.setattr(patching_method, "torch", DeviceUnlessTold())
    cfg = PatchingMethodConfig(patching=PatchingConfig(units=PatchUnit.cell, grid=[2, 2], mode=PatchMode.attribution_topk, top_k=top_k))  # fmt: skip
    layers = resolve_layers(tiny, ["features.2"])
    method = build_method(cfg, layers, Runtime(torch.device("cpu"), Precision.fp32))
    x = torch.randn(2, 3, 8, 8)  # (2, 3, 8, 8)
    batch = Batch(x, torch.full((2,), -1), ["s0", "s1"], 0)
    with HookSession(tiny, []) as session:
        method.setup(session, 2)
        session.begin_batch(2, 0)
        columns = method.run_batch(tiny, batch, session).tables["patching"]
    tensors = {key: value for key, value in columns.items() if torch.is_tensor(value)}
    assert {key: value.device.type for key, value in tensors.items()} == {key: "cpu" for key in tensors}
    kinds = columns["patch_method"]
    assert kinds.count("attribution") == 2 * 4 and kinds.count("exact") == 2 * top_k
    exact_rho = columns["rank_correlation"][[k == "exact" for k in kinds]]
    assert exact_rho.isnan().all() if top_k == 1 else exact_rho.isfinite().all()


# ---- torchrun: processes and GPUs, the process group's timeout and its end -----------------------------------------
TINY_RUN = ["model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
            "data.count=8", "data.batch_size=2", "data.num_classes=5", "output.shard_batches=1",
            "layers.include=[features.0,features.2]", "hooks=[]", "progress=false"]  # fmt: skip


def torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """The environment torchrun gives rank `rank` of `world` processes on one machine."""
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("rank", [0, 3])  # a rank that has a GPU refuses too: every process exits the same way
def test_torchrun_with_more_processes_than_gpus_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """Four processes on a machine with two GPUs: rank 3 used to pick cuda:3 and fail inside CUDA."""
    import torch.distributed as dist

    torchrun_env(monkeypatch, rank, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # no GPU here: only the check may stop it

    def no_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group was joined before the check")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    with pytest.raises(RunnerError, match=r"4 processes .* only 2 CUDA GPU\(s\).*--nproc_per_node=2"):
        app.run(make_config(*TINY_RUN, "device=cuda"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_torchrun_within_the_gpus_gets_its_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check refuses only too many processes: rank 1 of 2 on two GPUs runs on cuda:1."""
    from runner import distributed

    torchrun_env(monkeypatch, 1, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.local_cuda_device() == torch.device("cuda", 1)


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """torchrun's environment for rank 0 of 2, with `init_process_group` joining a real gloo group of one process
    (an in-memory store): the run joins, broadcasts and waits at the barrier for real. Records each call's timeout."""
    import torch.distributed as dist

    torchrun_env(monkeypatch, 0, 2)
    timeouts: list[object] = []
    real_init = dist.init_process_group

    def join_alone(backend: str, timeout: object) -> None:
        timeouts.append(timeout)
        real_init(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    monkeypatch.setattr(dist, "init_process_group", join_alone)
    yield timeouts
    if dist.is_initialized():  # left behind by a failing test: later tests must not run inside it
        dist.destroy_process_group()


def test_process_group_has_the_configured_timeout_and_ends_with_the_run(
    tmp_path: Path, one_process_group: list[object]
) -> None:
    """init_process_group took NCCL's default timeout (10 minutes: a barrier after uneven shards failed the run),
    and the group was never destroyed."""
    from datetime import timedelta

    import torch.distributed as dist

    result = app.run(make_config(*TINY_RUN, "distributed_timeout_minutes=45"), tmp_path)
    assert one_process_group == [timedelta(minutes=45)]
    assert not dist.is_initialized()
    assert sorted(pd.read_parquet(result.tables["cam"])["sample"].unique()) == [0, 1, 4, 5]  # rank 0's shards: 0, 2


def test_process_group_ends_when_the_run_fails(
    tmp_path: Path, one_process_group: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    from runner.methods import cam_methods

    GradCAM = cam_methods()["gradcam"]

    def fail(*args: object) -> None:
        raise RuntimeError("a failure in the method (simulated)")

    monkeypatch.setattr(GradCAM, "run_batch", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        app.run(make_config(*TINY_RUN), tmp_path)
    assert len(one_process_group) == 1
    assert not dist.is_initialized()


def test_distributed_timeout_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="distributed_timeout_minutes=0"):
        app.run(make_config(*TINY_RUN, "distributed_timeout_minutes=0"), tmp_path)


@pytest.mark.slow
def test_torchrun_pictures_of_every_rank_go_to_the_shared_directory(tmp_path: Path) -> None:
    """Each rank's own Hydra run dir differs here (as timestamped ones may by a second): every rank's pictures must
    land in rank 0's directory, beside the tables, and rank 1's own directory gets none."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    ranks = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner",
         *TINY_RUN, "data.count=4", "device=cpu", "method.pictures=true", "method.pictures_max=4",
         f"hydra.run.dir={tmp_path}/rank${{oc.env:RANK}}"],
        cwd=root, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert ranks.returncode == 0, ranks.stderr
    shared, own = tmp_path / "rank0", tmp_path / "rank1"
    assert (shared / "manifest-rank1.json").exists()
    drawn = sorted(p.name.split("_")[0] for p in (shared / "pictures").glob("*.png"))
    assert drawn == ["000000", "000001", "000002", "000003"]  # samples 2, 3: shard 1, rank 1's
    assert not list(own.rglob("*.png")) and not list(own.rglob("*.parquet"))


# ---- sidecar tensors of an OOM split -------------------------------------------------------------------------------
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
