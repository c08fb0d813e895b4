"""A batch's tables cross to the host in one packed copy (runner/host_copy.py), and the tables written are the ones
the per-batch path writes; the `cam` rows' flags and maps as the method builds them on the device."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import runner.app as app
import runner.loop as loop
from runner.data.base import NO_LABEL, Batch
from runner.host_copy import HostCopy
from runner.ids import ClassNames, rows_for
from runner.layers import resolve_layers
from runner.methods.base import library_runtime
from runner.methods.cam import cam_method
from runner.metrics.curves import degenerate_maps
from runner.rows import BatchOutput, Block, Ragged
from tests.conftest import TinyNet, make_config
from tests.devices import DEVICES, counted_syncs

CAM_RUN = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=7",  # batches of 2, 2, 2, 1 in shards of 3 batches and 1
    "data.batch_size=2",
    "data.num_classes=5",
    "output.shard_batches=3",
    "method=gradcam",
    "method.target=topk",
    "method.top_k=2",  # two targets per batch: the rows of both cross in the batch's one copy
    "layers.include=[features.0,features.2]",
    "hooks=[{kind: forward, layers: [features.2]}]",  # the `hooks` table too (its statistics deferred a shard)
]


def tables(run: Path) -> dict[str, list]:
    """Every table's shard files without the run id: rows in file order and row group sizes."""
    out = {}
    for path in sorted(run.glob("*.parquet/part-*.parquet")):
        file = pq.ParquetFile(path)
        groups = [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)]
        out[f"{path.parent.name}/{path.name}"] = [file.read().drop(["run_id"]).to_pylist(), groups]
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_host_copy_gives_back_each_tensor_as_it_was(device: str) -> None:
    """Mixed dtypes, shapes that leave pieces unaligned, a 0-d, an empty and a strided tensor, and a CPU tensor beside
    the device's: each comes back on the host with its dtype, shape and values."""
    torch.manual_seed(0)
    tensors = [
        torch.randn(3, 5, device=device),
        torch.tensor([True, False, True], device=device),
        torch.arange(7, device=device),  # int64 after 3 bool bytes: its piece must start aligned
        torch.randn(5, device=device).half(),
        torch.randn(2, 3, device=device).bfloat16(),
        torch.tensor(2.5, device=device),
        torch.empty(0, 4, device=device),
        torch.randn(4, 6, device=device)[:, ::2],  # not contiguous
        torch.arange(3, dtype=torch.int32),  # on the CPU whatever the device: its own group
    ]
    host = HostCopy(tensors).wait()
    assert len(host) == len(tensors)
    for got, want in zip(host, tensors, strict=True):
        assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_a_packed_batch_starts_its_copy_without_a_host_sync(device: str) -> None:
    """`rows_for(pack=True)` on the main thread starts the copy and reads nothing back (on CUDA: no synchronising
    call at all); its job, run later, gives the rows the per-batch job gives."""
    torch.manual_seed(0)
    batch = Batch(torch.zeros(2, 1, device=device), torch.tensor([1, NO_LABEL], device=device), ["a", "b"], 4)
    columns = {
        "layer": ["l1", "l1", "l2", "l2"],
        "sample_index": torch.arange(2, device=device).repeat(2),
        "target": torch.tensor([3, 0, 3, 0], device=device),
        "cam": Block(torch.randn(4, 7, device=device), [f"cam_{i}" for i in range(6)] + ["cam_nonfinite"]),
        "degenerate": torch.tensor([False, True, False, False], device=device),
        "map": Ragged(torch.randn(2 * 9 + 2 * 4, device=device), [9, 9, 4, 4]),
    }
    output = BatchOutput(torch.tensor([3, 0], device=device), {"cam": columns})
    names = ClassNames(model=["w", "x", "y", "z"])
    ids = {"run_id": "r", "method": "gradcam"}
    reference = rows_for((batch, output, None), ids, names)()
    with counted_syncs(device) as syncs:
        produce = rows_for((batch, output, None), ids, names, pack=True)
    assert syncs == []
    (table, packed), ((_, expected),) = produce()[0], reference
    assert table == "cam" and list(packed) == list(expected)
    for name, value in expected.items():
        got = packed[name]
        assert got.equals(value) if hasattr(value, "equals") else list(got) == list(value), name


@pytest.mark.parametrize("device", DEVICES)
def test_packed_rows_write_the_tables_of_the_per_batch_path(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run with each batch's columns packed into one copy and with each column moved by itself: the same
    files, rows, values and row groups, bit for bit (the `cam` table with its maps, and the `hooks` table)."""
    config = make_config(*CAM_RUN, f"device={device}")
    monkeypatch.setattr(loop, "PACK_ROWS", True)
    app.run(config, tmp_path / "packed")
    monkeypatch.setattr(loop, "PACK_ROWS", False)
    app.run(config, tmp_path / "per_batch")
    packed, per_batch = tables(tmp_path / "packed"), tables(tmp_path / "per_batch")
    assert sorted({name.split("/")[0] for name in packed}) == ["cam.parquet", "hooks.parquet"]
    rows, groups = packed["cam.parquet/part-000000.parquet"]
    assert groups == [2 * 2 * 2] * 3  # a row group per batch: 2 targets x 2 layers x 2 samples
    assert all(len(r["map"]) == r["map_height"] * r["map_width"] for r in rows)
    assert packed == per_batch


def tiny_cam(device: str, **settings: object) -> tuple:
    """A gradcam method set up on TinyNet's two convs, and a batch of 3 for `rows`."""
    model = TinyNet().to(device).eval()
    x = torch.randn(3, 3, 8, 8, device=device)
    cam = cam_method("gradcam", resolve_layers(model, ["features.0", "features.2"]), library_runtime(x), **settings)
    batch = Batch(x, torch.full((3,), NO_LABEL), ["a", "b", "c"], 0)
    return cam, batch


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_flags_read_off_the_statistics_are_the_maps_own(device: str) -> None:
    """`degenerate` comes from the maps' statistics (min == max, or not finite): the rows flag exactly the maps that
    runner.metrics.curves.degenerate_maps flags: constant, all zero, NaN or inf anywhere; not a varied map."""
    cam, batch = tiny_cam(device)
    first = torch.rand(3, 4, 4, device=device)  # (B, h, w)
    first[0] = 0.0
    first[1, 2, 3] = float("nan")
    second = torch.rand(3, 2, 2, device=device)
    second[1] = 7.0
    second[2, 0, 0] = float("inf")
    maps = [first, second]
    entries = [("features.0", 0, None), ("features.2", 0, None)]
    target = torch.tensor([1, 2, 3], device=device)
    probs = torch.rand(3, 5, device=device).softmax(dim=1)
    columns = cam.rows(entries, maps, target, 0, torch.zeros(3, device=device), probs, batch)
    expected = torch.cat([degenerate_maps(m) for m in maps])
    assert columns["degenerate"].tolist() == expected.tolist() == [True, True, False, False, True, True]


@pytest.mark.parametrize("device", DEVICES)
def test_float16_maps_are_the_float32_maps_rounded(device: str) -> None:
    """method.map_dtype=float16: the `map` column holds each value rounded to float16, everything else as float32."""
    torch.manual_seed(0)
    cam, batch = tiny_cam(device)
    half, _ = tiny_cam(device, map_dtype="float16")
    maps = [torch.rand(3, 4, 4, device=device) * 100, torch.rand(3, 2, 2, device=device)]
    entries = [("features.0", 0, None), ("features.2", 0, None)]
    args = (torch.tensor([1, 2, 3], device=device), 0, torch.zeros(3, device=device), torch.rand(3, 5, device=device))
    full, rounded = cam.rows(entries, maps, *args, batch), half.rows(entries, maps, *args, batch)
    assert full["map"].values.dtype == torch.float32 and rounded["map"].values.dtype == torch.float16
    assert torch.equal(rounded["map"].values, full["map"].values.half())
    assert full["map"].lengths == rounded["map"].lengths
    assert torch.equal(full["cam"].values, rounded["cam"].values)  # statistics of the maps as computed
