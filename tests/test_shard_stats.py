"""The `hooks` table's statistics cross to the host once a shard (runner/shard_stats.py), in the rows the
per-batch path writes."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import runner.app as app
import runner.loop as loop
from runner.hooks import BoundHook, HookSession
from runner.layers import resolve_layers
from runner.schema import HookKind, HookSpec
from runner.shard_stats import ShardStats
from tests.conftest import TinyNet, make_config
from tests.devices import DEVICES, counted_syncs

TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=7",  # batches of 2, 2, 2, 1
    "data.batch_size=2",
    "data.num_classes=5",
    "output.shard_batches=3",  # shards of 3 batches and 1: a boundary inside the run, a short last shard
    "layers.include=[features.0,features.2]",
    "hooks=[{kind: forward, layers: [features.0,features.2]},{kind: backward, layers: [features.2]}]",
]


def part_tables(run: Path) -> dict[str, list]:
    """Each shard file of the hooks table, without the run id: its rows in file order and its row groups' sizes."""
    out = {}
    for path in sorted((run / "hooks.parquet").glob("part-*.parquet")):
        file = pq.ParquetFile(path)
        groups = [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)]
        out[path.name] = [file.read().drop(["run_id"]).to_pylist(), groups]
    return out


def test_hooks_table_written_once_a_shard_equals_the_per_batch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushes: list[int] = []
    flush = ShardStats.flush

    def counting_flush(self: ShardStats, id_columns: dict) -> object:
        flushes.append(len(self._stats))  # batches whose statistics cross in this one copy
        return flush(self, id_columns)

    monkeypatch.setattr(ShardStats, "flush", counting_flush)
    config = make_config(*TINY)
    app.run(config, tmp_path / "deferred")
    assert flushes == [3, 1]  # one copy per shard, not one per batch
    monkeypatch.setattr(loop, "DEFER_HOOK_STATS", False)
    app.run(config, tmp_path / "per_batch")
    assert flushes == [3, 1]
    deferred, per_batch = part_tables(tmp_path / "deferred"), part_tables(tmp_path / "per_batch")
    assert list(deferred) == ["part-000000.parquet", "part-000001.parquet"]
    rows, groups = deferred["part-000000.parquet"]
    assert groups == [2 * 4] * 3  # a row group per batch: 2 samples x 4 tensors (2 outputs, grad_output, grad_input)
    assert {r["sample"] for r in rows} == set(range(6)) and len({r["mean"] for r in rows}) > 1
    assert deferred == per_batch  # the same rows, values and row groups, bit for bit


def test_nothing_recorded_flushes_nothing() -> None:
    assert ShardStats().flush({"run_id": "x"}) is None


@pytest.mark.gpu
@pytest.mark.parametrize("device", DEVICES)
def test_recorded_batches_make_no_host_sync(device: str) -> None:
    """Record hooks over several batches; on CUDA under set_sync_debug_mode("error"): any host sync raises; the
    shard's one copy (flush) is pinned and non-blocking, so it makes none either; the writer job then waits for it.
    On the CPU the stand-in (tests/devices.py `counted_syncs`) sees no read of a tensor's value either."""
    cuda = device == "cuda"
    torch.manual_seed(0)
    model = TinyNet().to(device).eval()
    layers = resolve_layers(model, ["features.*"])
    spec = HookSpec(kind=HookKind.forward)
    xs = [torch.randn(4, 3, 8, 8, device=device) for _ in range(3)]
    shard = ShardStats()
    with HookSession(model, [BoundHook(spec, layers)]) as session, torch.no_grad():
        model(xs[0])  # warm-up: first-use allocations and any compilation of the fused statistics
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with counted_syncs("cpu") if not cuda else nullcontext([]) as reads:
                for i, x in enumerate(xs):
                    session.begin_batch(4, 4 * i)
                    model(x)
                    recorded = session.end_batch()
                    assert recorded is not None and recorded["stats"].device.type == device
                    shard.add(recorded)(
                        {"sample": torch.arange(4 * i, 4 * i + 4).numpy(), "sample_id": torch.arange(4).numpy()}
                    )
                produce = shard.flush({"run_id": "gpu"})
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    assert reads == []
    assert produce is not None
    rows = produce()
    assert len(rows) == 3 and all(table == "hooks" for table, _ in rows)
    assert list(rows[1][1]["sample"]) == [4, 5, 6, 7] * len(layers)
