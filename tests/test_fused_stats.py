"""The fused statistics (runner/fused_stats.py) equal runner/stats.py's per_sample_stats and a float64 reference."""

from __future__ import annotations

import pytest
import torch

from runner.fused_stats import MAX_BLOCK, MIN_BLOCK, block_size, fused_stats
from runner.stats import STAT_NAMES, per_sample_stats
from tests.test_data_path import reference_stats

MEAN = STAT_NAMES.index("mean")


def assert_same_stats(got: torch.Tensor, want: torch.Tensor, rms: torch.Tensor) -> None:
    """Equal within 1e-6 relative, NaN where NaN; the mean within 1e-6 of the row's RMS (a mean near 0 is a
    cancellation of +/- values, known only to the precision of the values themselves, in both paths)."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan())
    infinite = want.isinf()
    assert torch.equal(got[infinite], want[infinite])
    both = ~want.isnan() & ~infinite
    tol = 1e-6 * want.abs()
    tol[:, MEAN] = torch.maximum(tol[:, MEAN], 1e-6 * rms)
    excess = ((got - want).abs() - tol)[both]
    assert (excess <= 0).all(), f"off by more than the tolerance:\n{got}\n{want}"


def rows_rms(t: torch.Tensor, rows: int) -> torch.Tensor:
    x = t.double().reshape(rows, -1)
    return x.square().mean(dim=1).sqrt()


def cases() -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scale in (1.0, 1e20, 1e-25):
            if dtype is not torch.float32 and scale != 1.0:  # half formats hold neither magnitude
                continue
            t = (torch.randn(5, 6, 12, 12, generator=g) * scale).to(dtype)  # (B, C, H, W)
            out.append((f"{dtype}-{scale:g}", t, 5))
            shifted = ((1e4 + torch.randn(3, 7, 9, 11, generator=g)) * scale).to(dtype)  # mean >> std; D has no
            out.append((f"{dtype}-{scale:g}-offset", shifted, 3))  # divisor in [64, 1024]: one block
    mixed = torch.randn(6, 2000, generator=g)  # (B, D): blocks of 1000
    mixed[1] *= 1e20
    mixed[2] *= 1e-25
    mixed[3] = 0  # all zero: std 0, frac_zero 1
    mixed[4] = torch.relu(mixed[4]) + 3e33  # sums overflow float32: the midrange centre
    mixed[5, ::3] = 0
    out.append(("mixed-rows", mixed, 6))
    out.append(("int64", torch.randint(-5, 1 << 30, (2, 1000), generator=g), 2))
    out.append(("int32-small", torch.randint(-3, 4, (4, 3, 5), generator=g, dtype=torch.int32), 4))
    out.append(("uint8", torch.randint(0, 256, (3, 3, 32, 32), generator=g, dtype=torch.uint8), 3))
    out.append(("subnormal", torch.randn(2, 640, generator=g) * 1e-40, 2))
    return out


@pytest.mark.parametrize("name,t,rows", cases(), ids=[c[0] for c in cases()])
def test_fused_stats_equal_per_sample_stats_and_the_float64_reference(name: str, t: torch.Tensor, rows: int) -> None:
    got, per_sample = fused_stats(t, rows)
    want, want_per_sample = per_sample_stats(t, rows)
    assert per_sample == want_per_sample is True
    assert got.dtype == torch.float32 and got.shape == (rows, len(STAT_NAMES))
    assert_same_stats(got, want, rows_rms(t, rows))
    assert_same_stats(got, reference_stats(t, rows).float(), rows_rms(t, rows))


def test_fused_stats_of_non_finite_rows_match_today() -> None:
    t = torch.randn(4, 3, 10, 10)
    t[0, 0, 0, 0] = float("nan")
    t[1, 1, 2, 3] = float("inf")
    t[2, 0, 5, 5], t[2, 2, 1, 1] = float("inf"), -float("inf")
    got, _ = fused_stats(t, 4)
    want, _ = per_sample_stats(t, 4)
    assert got[:, STAT_NAMES.index("nonfinite")].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert torch.isfinite(got[3]).all()
    assert_same_stats(got, want, rows_rms(t[3:], 1).expand(4))


def test_fused_stats_of_a_tensor_without_the_batch_dimension() -> None:
    weight = torch.randn(7, 3, 3, 3) + 2.0  # a shared weight seen by a hook: first dimension is not the batch
    got, per_sample = fused_stats(weight, 4)
    want, want_per_sample = per_sample_stats(weight, 4)
    assert per_sample is want_per_sample is False and got.shape == (1, len(STAT_NAMES))
    assert_same_stats(got, want, rows_rms(weight, 1))


def test_fused_stats_chunks_samples_in_eager_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked over samples on the CPU (temporaries bounded as in stats.py), with the same values as one chunk."""
    import runner.fused_stats as fs

    t = torch.randn(5, 3, 10, 10)
    whole, _ = fused_stats(t, 5)
    seen: list[int] = []
    fused = fs._fused
    monkeypatch.setattr(fs, "CHUNK_ELEMENTS", 600)
    monkeypatch.setattr(fs, "_fused", lambda flat, b: seen.append(flat.numel()) or fused(flat, b))
    chunked, _ = fused_stats(t, 5)
    assert seen == [600, 600, 300]
    assert torch.equal(whole, chunked)


def test_block_size_divides_the_row() -> None:
    assert block_size(64 * 224 * 224) == MAX_BLOCK
    assert block_size(3 * 17 * 19) == 969  # the largest divisor <= 1024
    assert block_size(10007) == 10007  # a prime: one block
    assert block_size(10) == 10
    for n in (1000, 2 * 3 * 5 * 7 * 11, 4096 * 3, 7 * 9 * 11):
        b = block_size(n)
        assert n % b == 0 and (MIN_BLOCK <= b <= MAX_BLOCK or b == n)


def test_compile_failure_falls_back_to_eager_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import runner.fused_stats as fs

    def broken(fn, **kwargs):  # noqa: ANN001, ANN003 - torch.compile's signature
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fs, "_compiled", None)
    monkeypatch.setattr(fs, "_compile_failed", False)
    monkeypatch.setattr(torch, "compile", broken)
    t = torch.randn(3, 4, 8, 8)
    with caplog.at_level("WARNING", logger="runner.fused_stats"):
        first, _ = fused_stats(t, 3, compile=True)
        second, _ = fused_stats(t, 3, compile=True)
    assert [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()] == [
        "fused statistics: torch.compile failed (no compiler here); computing them eagerly"
    ]
    eager, _ = fused_stats(t, 3, compile=False)
    assert torch.equal(first, eager) and torch.equal(second, eager)


@pytest.mark.slow
@pytest.mark.process
def test_compiled_fused_stats_equal_the_eager_ones() -> None:
    """Under torch.compile (Inductor's CPU backend here, Triton on CUDA) the same values, two dtypes and shapes."""
    import runner.fused_stats as fs

    g = torch.Generator().manual_seed(3)
    for t in (torch.randn(4, 3, 16, 16, generator=g) * 1e20, torch.randn(3, 8, 8, 8, generator=g).bfloat16()):
        compiled, _ = fused_stats(t, t.shape[0], compile=True)
        assert not fs._compile_failed, "torch.compile failed: the fused path ran eagerly"
        eager, _ = fused_stats(t, t.shape[0], compile=False)
        want, _ = per_sample_stats(t, t.shape[0])
        assert_same_stats(compiled, eager, rows_rms(t, t.shape[0]))
        assert_same_stats(compiled, want, rows_rms(t, t.shape[0]))
