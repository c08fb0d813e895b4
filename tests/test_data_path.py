"""The data path that keeps a GPU busy: one DataLoader per run, workers and pinning by default on GPUs,
picture work only while pictures are drawn, statistics without float64 copies of the recorded tensor."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

import runner.app as app
import runner.data.base as data
from runner.results import load
from runner.schema import DataConfig
from tests.conftest import make_config

TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=7",
    "data.batch_size=2",
    "data.num_classes=5",
    "layers.include=[features.0,features.2]",
    "hooks=[{kind: forward, layers: [features.2]}]",
]


def comparable(run: Path, table: str) -> pd.DataFrame:
    """A table without its run id, in a fixed row order (shards may be read in any order)."""
    frame = load(run, table).drop(columns=["run_id"])
    if "map" in frame:
        frame["map"] = frame["map"].map(tuple)
    keys = [c for c in ("sample", "layer", "hook", "role", "call", "target_rank") if c in frame]
    return frame.sort_values(keys).reset_index(drop=True)


@pytest.fixture
def loaders(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each DataLoader the runner builds, as the list of sample indices it serves."""
    built: list[list[int]] = []

    class CountingLoader(DataLoader):
        def __init__(self, dataset, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            super().__init__(dataset, *args, **kwargs)
            built.append([i for batch in self.batch_sampler for i in batch])

    monkeypatch.setattr(data, "DataLoader", CountingLoader)
    return built


# ---- 1. one DataLoader per run ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_loader_serves_every_shard(tmp_path: Path, loaders: list[list[int]]) -> None:
    app.run(make_config(*TINY, "output.shard_batches=1"), tmp_path / "shards")  # 4 shards of 1 batch
    assert loaders == [list(range(7))]
    loaders.clear()
    app.run(make_config(*TINY, "output.shard_batches=8"), tmp_path / "one")  # 1 shard
    assert len(loaders) == 1
    for table in ("cam", "hooks"):
        pd.testing.assert_frame_equal(comparable(tmp_path / "shards", table), comparable(tmp_path / "one", table))


def test_resume_loads_only_the_missing_shard(tmp_path: Path, loaders: list[list[int]]) -> None:
    config = make_config(*TINY, "output.shard_batches=1")
    app.run(config, tmp_path)
    whole = {t: comparable(tmp_path, t) for t in ("cam", "hooks")}
    (tmp_path / "cam.parquet" / "part-000002.parquet").unlink()  # shard 2: samples 4 and 5
    loaders.clear()
    app.run(config, tmp_path)
    assert loaders == [[4, 5]]  # one loader, over the shard that runs again only
    for table in ("cam", "hooks"):
        pd.testing.assert_frame_equal(comparable(tmp_path, table), whole[table])


def test_ranges_sampler_concatenates_in_order() -> None:
    sampler = data.RangesSampler([range(4, 6), range(0, 2), range(8, 9)])
    assert list(sampler) == [4, 5, 0, 1, 8] and len(sampler) == 5


# ---- 2. workers and pinned memory by default on GPUs ------------------------------------------------------------
def test_loader_settings_default_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "available_cpus", lambda: 16)
    assert data.loader_settings(DataConfig(), torch.device("cpu")) == (0, False)
    assert data.loader_settings(DataConfig(), torch.device("cuda")) == (4, True)
    assert data.loader_settings(DataConfig(), torch.device("cuda", 1)) == (4, True)
    monkeypatch.setattr(data, "available_cpus", lambda: 2)
    assert data.loader_settings(DataConfig(), torch.device("cuda")) == (2, True)  # never more than the CPUs


def test_loader_settings_keep_explicit_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "available_cpus", lambda: 16)
    cfg = DataConfig(num_workers=0, pin_memory=False)
    assert data.loader_settings(cfg, torch.device("cuda")) == (0, False)
    cfg = DataConfig(num_workers=3, pin_memory=True)
    assert data.loader_settings(cfg, torch.device("cpu")) == (3, True)


def test_the_config_default_is_null() -> None:
    config = make_config(*TINY)
    assert config.data.num_workers is None and config.data.pin_memory is None
    assert make_config(*TINY, "data.num_workers=2").data.num_workers == 2


# ---- 3. picture work only while pictures are drawn --------------------------------------------------------------
def test_pictures_upsample_only_the_maps_drawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runner.viz.pictures as pictures

    upsampled: list[int] = []  # the samples of each upsample call
    upsample = pictures.upsample

    def counting_upsample(m: torch.Tensor, size: torch.Size) -> torch.Tensor:
        upsampled.append(m.shape[0])
        return upsample(m, size)

    drawn: list[tuple[int, list[int]]] = []  # (batch's first sample, samples of each map handed over)
    monkeypatch.setattr(pictures, "upsample", counting_upsample)
    monkeypatch.setattr(
        pictures,
        "write_overlays",
        lambda d, batch, layers, sal, *a: drawn.append((batch.first_index, [len(s) for s in sal])),
    )
    # 7 samples in 4 batches of 2, 2 layers, a picture for the first sample only, no faithfulness.
    config = make_config(*TINY, "method.pictures=true", "method.pictures_max=1", "method.faithfulness.enabled=false")
    app.run(config, tmp_path)
    assert drawn == [(0, [1, 1])]
    assert upsampled == [1, 1]  # one map a layer, of the one sample drawn; none for the 3 later batches


# ---- 4. statistics in the tensor's precision, float64 accumulators only -----------------------------------------
def reference_stats(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, 7) float64 statistics, two-pass over a float64 copy: what per_sample_stats must equal."""
    x = t.double().reshape(rows, -1)  # (N, D)
    mean = x.mean(dim=1)
    std = ((x - mean[:, None]) ** 2).mean(dim=1).sqrt()
    l2 = x.square().sum(dim=1).sqrt()
    zero = (x == 0).double().mean(dim=1)
    nonfinite = (~torch.isfinite(x).all(dim=1)).double()
    return torch.stack([mean, std, x.amin(dim=1), x.amax(dim=1), l2, zero, nonfinite], dim=1)


def assert_stats_equal(t: torch.Tensor, rows: int) -> None:
    from runner.stats import per_sample_stats

    got, per_sample = per_sample_stats(t, rows)
    assert per_sample and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_stats(t, rows), rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk", [1 << 22, 100])  # one chunk; chunks of one sample each
def test_stats_exact_with_a_large_offset(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    import runner.stats as stats

    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    t = 1e4 + torch.randn(5, 8, 40, 40, generator=g)  # (B, C, H, W) float32, mean 1e4, std 1
    t[1] = torch.relu(t[1] - 1e4)  # half zeros: frac_zero, and a skewed row
    t[2] = 3.25  # a constant row: std exactly 0
    t[3] *= 1e-24  # gradients this small: their squares underflow float32 unless scaled
    t[4] *= 1e16  # and this large: their squares overflow it
    assert_stats_equal(t, 5)


def test_stats_of_bf16_and_integer_input() -> None:
    g = torch.Generator().manual_seed(1)
    t = (1e2 + torch.randn(3, 16, 30, 30, generator=g)).bfloat16()  # (B, C, H, W): bf16 values near 100
    assert_stats_equal(t, 3)
    assert_stats_equal(torch.randint(-5, 1 << 30, (2, 1000), generator=g), 2)  # int64


def test_stats_flag_non_finite_rows() -> None:
    from runner.stats import per_sample_stats

    t = torch.randn(3, 100)
    t[0, 5], t[2, 7] = float("nan"), float("inf")
    got, _ = per_sample_stats(t, 3)
    assert got[:, 6].tolist() == [1.0, 0.0, 1.0]
    assert torch.isfinite(got[1]).all()


def test_stats_intermediates_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No intermediate as large as the tensor: every chunk is at most CHUNK_ELEMENTS (here one sample)."""
    import runner.stats as stats

    seen: list[int] = []
    chunk_stats = stats._chunk_stats
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 2 * 300)
    monkeypatch.setattr(stats, "_chunk_stats", lambda flat: seen.append(flat.numel()) or chunk_stats(flat))
    stats.per_sample_stats(torch.randn(5, 3, 10, 10), 5)  # (B, C, H, W): 300 elements a sample
    assert seen == [600, 600, 300]


PEAK_MEMORY = """
import resource, sys, torch
from runner.stats import per_sample_stats
t = torch.randn(64, 256, 28, 28)  # (B, C, H, W) float32, 49 MiB
per_sample_stats(t[:2], 2)  # warm-up: the allocator's and the kernels' own first-use memory
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
per_sample_stats(t, 64)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / (t.numel() * 4))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="ru_maxrss in KiB: Linux")
@pytest.mark.process
def test_stats_add_far_less_memory_than_the_tensor() -> None:
    """A fresh process's peak resident memory: a float64 copy of the tensor would add 2x its size, bounded
    chunks add a fixed ~20 MiB."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", PEAK_MEMORY], cwd=root, capture_output=True, text=True, check=True)
    assert float(done.stdout.strip()) < 0.6
