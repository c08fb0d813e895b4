"""Patched variants per forward (runner/chunk_sizing.py): the sizing arithmetic on mocked CUDA memory readings, its
cap and floor; the configured chunk and the CPU constants; the out-of-memory halving, alone and inside the vision and
language-model engines (the same rows as a run that never ran out); a real sizing on a GPU (`make test-gpu`)."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
import torch

import runner.chunk_sizing as sizing
from runner.chunk_sizing import CAP, FRACTION, StackSizer, size_stack
from runner.errors import RunnerError
from runner.methods.patching import activation_patching
from tests.conftest import TinyNet, frozen
from tests.devices import DEVICES

MIB = 2**20
CUDA = torch.device("cuda", 0)


class FakeMemory:
    """CUDA memory readings for a probe whose forward of n variants peaks at `fixed` + n * `per_variant` bytes."""

    def __init__(self, fixed: int, per_variant: int, free: int, reserved: int = 0, allocated: int = 0) -> None:
        self.fixed, self.per_variant, self.free = fixed, per_variant, free
        self.reserved, self.allocated, self.peak = reserved, allocated, allocated
        self.probes: list[int] = []

    def probe(self, n: int) -> None:
        self.probes.append(n)
        self.peak = max(self.peak, self.allocated + self.fixed + n * self.per_variant)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeMemory:
        def reset(device: torch.device) -> None:
            self.peak = self.allocated

        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, 80 * 2**30))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        return self


# ---- sizing ---------------------------------------------------------------------------------------------------
def test_the_stack_is_the_largest_that_fits_the_fraction_of_usable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two probes (4 and 8 variants) give 3 MiB per variant and 10 MiB fixed; usable = free 1000 MiB + the allocator's
    unused 50 MiB; the stack is (0.7 x 1050 - 10) // 3 = 241 variants."""
    memory = FakeMemory(10 * MIB, 3 * MIB, 1000 * MIB, reserved=150 * MIB, allocated=100 * MIB).install(monkeypatch)
    got = size_stack(memory.probe, CUDA, total=10_000)
    assert memory.probes == [4, 8]
    assert (got.per_variant, got.fixed, got.usable) == (3 * MIB, 10 * MIB, 1050 * MIB)
    assert got.stack == int((FRACTION * 1050 * MIB - 10 * MIB) // (3 * MIB)) == 241
    assert got.measured and "241" in got.describe() and "3.00 MiB per variant" in got.describe()


def test_the_stack_is_capped_and_at_least_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ample memory: the cap (and never more variants than there are); too little for one: 1."""
    memory = FakeMemory(0, 1024, 70 * 2**30).install(monkeypatch)
    assert size_stack(memory.probe, CUDA, total=100_000).stack == CAP
    assert size_stack(memory.probe, CUDA, total=100_000, cap=300).stack == 300
    assert size_stack(memory.probe, CUDA, total=500).stack == 500
    tight = FakeMemory(900 * MIB, 200 * MIB, 1000 * MIB).install(monkeypatch)
    assert size_stack(tight.probe, CUDA, total=100).stack == 1


def test_few_variants_go_in_one_forward_without_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = FakeMemory(0, MIB, 1000 * MIB).install(monkeypatch)
    got = size_stack(memory.probe, CUDA, total=8)
    assert (got.stack, got.measured, memory.probes) == (8, False, [])


def test_a_probe_without_growth_charges_its_whole_peak_to_its_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal peaks at 4 and 8 variants (allocator rounding): 8 MiB / 8 per variant, nothing fixed."""
    memory = FakeMemory(8 * MIB, 0, 100 * MIB).install(monkeypatch)
    got = size_stack(memory.probe, CUDA, total=1000)
    assert (got.per_variant, got.fixed, got.stack) == (MIB, 0, 70)


def test_a_probe_out_of_memory_gives_half_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = FakeMemory(0, MIB, 100 * MIB).install(monkeypatch)

    def probe(n: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    got = size_stack(probe, CUDA, total=1000)
    assert (got.stack, got.measured) == (2, True) and memory.probes == []


# ---- the sizer: configured chunk, CPU constants, once per key -----------------------------------------------
def test_a_configured_chunk_wins_and_the_cpu_keeps_its_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = FakeMemory(0, MIB, 1000 * MIB).install(monkeypatch)
    assert StackSizer(16, "variant").stack("a", CUDA, 1000, memory.probe, otherwise=64) == 16
    assert StackSizer(None, "variant").stack("a", torch.device("cpu"), 1000, memory.probe, otherwise=64) == 64
    assert memory.probes == []


def test_cuda_sizes_once_per_key_and_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                               ) -> None:  # fmt: skip
    memory = FakeMemory(0, MIB, 100 * MIB).install(monkeypatch)
    stacks = StackSizer(None, "patched variant")
    with caplog.at_level(logging.INFO, logger="runner.chunk_sizing"):
        sizes = [stacks.stack(key, CUDA, 1000, memory.probe, otherwise=64) for key in ("a", "a", "b")]
    assert sizes == [70, 70, 70] and memory.probes == [4, 8, 4, 8]  # "a" probed once, "b" once
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "patched variants per forward at a: 70" in infos[0].getMessage()


# ---- out-of-memory halving -------------------------------------------------------------------------------------
def _forward_failing_above(limit: int, out: list[int], calls: list[int]):  # type: ignore[no-untyped-def]
    def forward(part) -> None:  # type: ignore[no-untyped-def]
        calls.append(len(part))
        if len(part) > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out.extend(x * x for x in part)

    return forward


def test_out_of_memory_halves_the_stack_and_keeps_every_variant(caplog: pytest.LogCaptureFixture) -> None:
    """Parts of 16 over 50 variants, a forward that fails above 5: every result once, in order, as an unhalved run;
    one failed forward of 16 and one of 8, then parts of at most 4 (also in the next run), one warning."""
    stacks = StackSizer(None, "patched variant")
    items = list(range(50))
    parts = [items[i : i + 16] for i in range(0, 50, 16)]
    with caplog.at_level(logging.INFO, logger="runner.chunk_sizing"):
        for _ in range(2):
            out: list[int] = []
            calls: list[int] = []
            stacks.run(parts, _forward_failing_above(5, out, calls), key="layer")
            assert out == [x * x for x in items]
    assert calls == [4] * 12 + [2]  # the second run: no failed forward
    assert stacks.limits == {"layer": 4}
    assert stacks.stack("layer", torch.device("cpu"), 50, lambda n: None, otherwise=64) == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "16 patched variants per forward" in warnings[0].getMessage()


def test_one_variant_out_of_memory_is_one_clear_message() -> None:
    with pytest.raises(RunnerError, match="CUDA out of memory with one patched cell per forward") as raised:
        StackSizer(None, "patched cell").run([[1, 2, 3]], _forward_failing_above(0, [], []), key="2 pairs x 7 tokens")
    assert "precision=bf16" in str(raised.value) and raised.value.__cause__ is None


class OomNet(TinyNet):
    """TinyNet whose forward raises CUDA's out-of-memory error with more than `limit` rows after `features`."""

    limit = 5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)  # (n, 8, H, W)
        if h.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return self.fc(self.pool(h).flatten(1))


@pytest.mark.parametrize("layer", ["features.0", "features.2"])  # features.0: each cell's cone (cone.py)
def test_vision_patching_out_of_memory_gives_the_rows_of_a_run_that_fits(layer: str) -> None:
    """49 cells in chunks of 16 through a model that fails above 5 rows: the plain model's table at chunk=4 (the
    same forwards), and at chunk=16 within 1e-6."""
    torch.manual_seed(0)
    plain = frozen(TinyNet())
    failing = frozen(OomNet())
    failing.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 16, 16)
    settings = {"grid": [7, 7], "chunk": 16, "directions": ["denoising", "noising"]}
    want = activation_patching(plain, x, [layer], **settings)
    same = activation_patching(plain, x, [layer], **{**settings, "chunk": 4})
    got = activation_patching(failing, x, [layer], **settings)
    assert len(got) == len(want) == 2 * 2 * 49
    pd.testing.assert_frame_equal(got, same)
    pd.testing.assert_frame_equal(got, want, rtol=1e-6, atol=1e-6)


def test_lm_patching_out_of_memory_gives_the_rows_of_a_run_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cells of 3 pairs in chunks of 8 (24 rows) through a readout that fails above 6 rows: the rows of chunk=2 (the
    same forwards), and of chunk=8 within 1e-5 (other prefix starts and batch sizes round differently)."""
    from runner.methods.lm.readout import Readout
    from runner.methods.lm_patching import lm_patching_on_ids
    from tests.lm_references import build_tiny_lm

    model, _, _ = build_tiny_lm("gpt2", seed=0)
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    clean, corrupted = torch.randint(vocab, (3, 6)), torch.randint(vocab, (3, 6))
    answers, distractors = torch.randint(vocab, (3,)), torch.randint(vocab, (3,))
    settings = {"sites": ["resid_pre", "attn_out"], "chunk": 8, "directions": ["denoising", "noising"]}
    want = lm_patching_on_ids(model, clean, corrupted, answers, distractors, **settings)
    same = lm_patching_on_ids(model, clean, corrupted, answers, distractors, **{**settings, "chunk": 2})
    rows: list[int] = []
    original = Readout.metric

    def failing(self, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append(inputs["input_ids"].shape[0])
        if rows[-1] > 6:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(Readout, "metric", failing)
    got = lm_patching_on_ids(model, clean, corrupted, answers, distractors, **settings)
    assert max(rows) == 24 and 6 in rows and len(got) == len(want) > 0
    pd.testing.assert_frame_equal(got, same)
    pd.testing.assert_frame_equal(got, want, rtol=1e-5, atol=1e-5)


def test_both_engines_keep_their_cpu_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA with no chunk: 64 variants per forward for vision, 32 rows (32 // B cells) for language models."""
    from runner.methods.lm_patching import lm_patching_on_ids
    from tests.lm_references import build_tiny_lm

    seen: list[int] = []
    original = StackSizer.stack

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(original(self, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(StackSizer, "stack", spy)
    monkeypatch.setattr(sizing, "size_stack", lambda *a, **k: pytest.fail("sized on the CPU"))
    torch.manual_seed(0)
    activation_patching(frozen(TinyNet()), torch.randn(1, 3, 16, 16), ["features.2"], grid=[7, 7])
    assert seen == [64]
    seen.clear()
    model, _, _ = build_tiny_lm("gpt2", seed=0)
    ids = torch.randint(model.config.vocab_size, (3, 5))
    lm_patching_on_ids(model, ids, ids.flip(1), ids[:, 0], ids[:, 1], sites=["resid_pre"])
    assert seen == [32 // 3]


# ---- on a device ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_real_sizing_fits_and_patching_gives_the_rows_of_a_fixed_chunk(device: str) -> None:
    """On CUDA the probes read real peaks: a positive memory per variant, a stack within [1, cap] whose forward's
    peak stays within the usable memory. On the CPU (no allocator to read) the stack is the fixed CPU_CHUNK,
    unprobed. Either way the automatic chunk's table equals chunk=8's (TF32 off)."""
    import torchvision

    from runner.methods.patching.engine import CPU_CHUNK

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = frozen(torchvision.models.vgg11(weights=None)).to(device)
        x = torch.randn(1, 3, 64, 64, device=device)
        on = x.device

        def probe(n: int) -> None:
            with torch.no_grad():
                model(x.expand(n, -1, -1, -1))

        if on.type == "cuda":
            got = size_stack(probe, on, total=10_000, cap=512)
            assert got.measured and got.per_variant > 0 and 1 <= got.stack <= 512, got
            usable = sizing.usable_bytes(on)
            assert sizing.peak_bytes(probe, got.stack, on) <= usable
        else:
            never = lambda n: pytest.fail("probed off CUDA")  # noqa: E731
            assert StackSizer(None, "variant").stack("k", on, 10_000, never, CPU_CHUNK) == CPU_CHUNK
        auto = activation_patching(model, x, ["features.3"], grid=[7, 7])
        fixed = activation_patching(model, x, ["features.3"], grid=[7, 7], chunk=8)
        pd.testing.assert_frame_equal(auto, fixed, rtol=1e-4, atol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
