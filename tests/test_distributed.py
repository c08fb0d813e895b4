"""torchrun on one machine: processes and GPUs, the process group's timeout and its end, pictures of every rank in
the shared run directory. CUDA and the process group are stood in for on the CPU (a gloo group of one process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch

from runner import app
from runner.errors import RunnerError
from tests.conftest import make_config

TINY_RUN = ["model._target_=tests.nets.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
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
@pytest.mark.process
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
