"""Exact patching's dispatched operations do not grow with the units patched: a chunk of variants costs a fixed number
of aten operations (views included), whether it holds 4 cells or 49. On a GPU each operation is about one kernel
launch, so an engine with a per-variant Python loop is launch-bound; this is the CPU-side proxy that keeps it from
coming back (a per-cell loop of even one operation fails these tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runner.methods.patching import activation_patching
from runner.models import build_model
from runner.schema import ModelConfig


class _Count(TorchDispatchMode):
    """Counts every aten operation dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def dispatched(run: Callable[[], Any]) -> tuple[int, Any]:
    """(aten operations of one warm call of `run`, its result): a first call outside the count warms caches."""
    run()
    with _Count() as count:
        out = run()
    return count.n, out


@pytest.fixture(scope="module")
def vgg16() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="vgg16", weights=None)).model.eval()


# VGG16's pools and a conv: every cell of the first four is carried through its cone (a chain of 7-26 local ops)
LAYERS = ["features.4", "features.9", "features.16", "features.23", "features.30"]


@pytest.mark.slow
def test_cell_patching_costs_the_same_operations_for_4_cells_as_for_49(vgg16: torch.nn.Module) -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 3, 64, 64)

    def run(grid: list[int]) -> Callable[[], Any]:
        return lambda: activation_patching(
            vgg16, x, LAYERS, corrupted=x + 1, target=0, units="cell", grid=grid, directions=["denoising"]
        )

    few, few_rows = dispatched(run([2, 2]))
    many, many_rows = dispatched(run([7, 7]))
    assert (len(few_rows), len(many_rows)) == (20, 167)  # 4 cells a layer; 49, 49, 49, 4x4, 2x2 at 64 px
    extra = (many - few) / (len(many_rows) - len(few_rows))
    # measured: 0 (927 operations either way; 78.8 a cell with one loop step per variant)
    assert extra <= 0.1, f"{extra:.2f} operations per extra cell ({few} for 20 cells, {many} for 167)"
    assert many / len(many_rows) <= 6, f"{many / len(many_rows):.1f} operations per cell, set-up included"


@pytest.mark.slow
def test_channel_patching_costs_a_fixed_number_of_operations_per_chunk(vgg16: torch.nn.Module) -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 3, 32, 32)

    def run(chunk: int) -> Callable[[], Any]:
        return lambda: activation_patching(
            vgg16, x, ["features.28"], corrupted=x + 1, target=0, units="channel", chunk=chunk,
            directions=["denoising"],
        )  # fmt: skip

    one, rows = dispatched(run(512))  # 512 channels in one forward
    eight, _ = dispatched(run(64))  # in eight
    assert len(rows) == 512
    # measured: 204 operations for the call (set-up included), 52 for each further chunk: 0.4 a channel; one
    # operation per channel would make it 716
    assert one <= 256, f"{one} operations for one chunk of 512 channels: {one / 512:.2f} a channel"
    assert eight - one <= 7 * 64, f"a chunk of 64 channels costs {(eight - one) / 7:.0f} operations"


def test_lm_patching_costs_the_same_operations_for_6_positions_as_for_12() -> None:
    transformers = pytest.importorskip("transformers")
    from runner.methods.lm_patching import lm_activation_patching

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained("runner/models/lm_induction")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=67, bos_token_id=64, eos_token_id=64)
    model = transformers.GPT2LMHeadModel(config).eval()

    def run(tokens: int) -> Callable[[], Any]:
        clean = " ".join(f"t{i:02d}" for i in range(1, tokens + 1))
        corrupted = "t40 " + " ".join(f"t{i:02d}" for i in range(2, tokens + 1))
        pairs = [dict(clean=clean, corrupted=corrupted, answer="t20", distractor="t21")] * 2
        # every cell in one forward (no prefix tiles): what is left to grow with the cells is the engine's own work
        return lambda: lm_activation_patching(
            model, tokenizer, pairs, sites=["resid_pre", "attn_out", "head"], reuse_prefix=False, chunk=1024
        )

    short, short_rows = dispatched(run(6))
    long, long_rows = dispatched(run(12))
    assert len(long_rows) > len(short_rows) + 30
    extra = (long - short) / (len(long_rows) - len(short_rows))
    assert extra <= 0.1, (
        f"{extra:.2f} operations per extra row ({short} for {len(short_rows)}, {long} for {len(long_rows)})"
    )
