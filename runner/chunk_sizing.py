"""How many patched variants go into one forward: sized from free memory on a CUDA device, halved on out-of-memory.

Exact patching (vision and language models) stacks its variants along the batch. On a GPU a small forward is bound by
kernel launches, so the largest stack that fits runs fastest. `size_stack` measures it: the peak memory of a probe
forward of PROBE variants and of 2 x PROBE (torch.cuda.max_memory_allocated, its peak reset before each) gives what
each further variant takes (the slope) and what any stack takes (the intercept: a prefix run at batch 1, the
workspace); the stack is the largest whose forward fits in FRACTION of the memory this process can still use (the
driver's free memory plus what torch's caching allocator holds unused), at most a cap and at least 1. On the CPU the
callers keep their constants (measured: a large batch spills the caches there).

`StackSizer.run` runs a method's chunks in order; a chunk that raises torch.cuda.OutOfMemoryError is run again as
two halves (no variant is dropped, the order is kept), and later chunks at most that size. A single variant that
does not fit is one clear message. Imports only torch and runner.errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from runner.errors import RunnerError

log = logging.getLogger(__name__)

FRACTION = 0.7  # of the usable memory a stack's forward may take: the probes miss workspaces that grow with the batch
CAP = 4096  # rows per forward at most: beyond this a GPU gains nothing from a larger batch, and a probe error costs
PROBE = 4  # variants of the smaller probe forward (the larger one has twice as many)

T = TypeVar("T")


@dataclass(frozen=True)
class Sizing:
    """A stack size and the readings it came from (bytes); `measured` False when no probe ran (few variants)."""

    stack: int
    per_variant: int = 0
    fixed: int = 0
    usable: int = 0
    measured: bool = False

    def describe(self) -> str:
        """The numbers behind the size, for the log."""
        if not self.measured:
            return f"{self.stack} (all the variants; no probe)"
        if self.per_variant == 0:
            return f"{self.stack} (a probe forward ran out of memory)"
        mib = 2**20
        return (
            f"{self.stack} (probes: {self.per_variant / mib:.2f} MiB per variant + {self.fixed / mib:.1f} MiB;"
            f" {FRACTION:.0%} of {self.usable / mib:.0f} MiB usable)"
        )


def peak_bytes(probe: Callable[[int], object], variants: int, device: torch.device) -> int:
    """Bytes the forward `probe(variants)` allocates on `device` at its peak, above what was allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe(variants)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def usable_bytes(device: torch.device) -> int:
    """Memory this process can still allocate on `device`: the driver's free memory and the allocator's unused cache."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def size_stack(
    probe: Callable[[int], object], device: torch.device, total: int, cap: int = CAP, fraction: float = FRACTION,
    probe_size: int = PROBE,
) -> Sizing:  # fmt: skip
    """Variants per forward on the CUDA `device` for `total` variants: `probe(n)` runs a forward of n of them.

    per_variant = (peak(2p) - peak(p)) / p, fixed = peak(p) - p * per_variant, and the stack is
    (fraction * usable - fixed) // per_variant within [1, min(cap, total)]. With at most 2p variants no probe runs:
    they go in one forward (an out-of-memory there halves it, StackSizer.run)."""
    cap = max(1, min(cap, total))
    if total <= 2 * probe_size:
        return Sizing(stack=cap)
    try:
        small = peak_bytes(probe, probe_size, device)
        large = peak_bytes(probe, 2 * probe_size, device)
    except torch.cuda.OutOfMemoryError:
        small = -1  # a probe did not fit: the stack is smaller than the probe (handled out of this block, see run)
    if small < 0:
        torch.cuda.empty_cache()
        return Sizing(stack=max(1, probe_size // 2), measured=True)
    per_variant = (large - small) // probe_size
    if per_variant > 0:
        fixed = max(0, small - probe_size * per_variant)
    else:  # no growth seen (allocator rounding): charge the whole larger peak to its variants
        per_variant, fixed = max(1, large // (2 * probe_size)), 0
    usable = usable_bytes(device)
    stack = int((fraction * usable - fixed) // per_variant)
    return Sizing(max(1, min(cap, stack)), per_variant, fixed, usable, measured=True)


class StackSizer:
    """One method's variants per forward: its configured `chunk`, else a CPU constant, else sized on CUDA once per
    `key` (a layer, a prompt shape: what sets a variant's memory); lowered for that key when a forward runs out of
    memory. `what` names a variant in the log and the error ("patched variant")."""

    def __init__(self, chunk: int | None, what: str) -> None:
        self.chunk, self.what = chunk, what
        self.sizes: dict[Hashable, int] = {}  # sized on CUDA
        self.limits: dict[Hashable, int] = {}  # lowered by an out-of-memory error: holds for the run
        self.logged = self.halved = False

    def stack(
        self, key: Hashable, device: torch.device, total: int, probe: Callable[[int], object], otherwise: int,
        cap: int = CAP,
    ) -> int:  # fmt: skip
        """Variants per forward: the configured chunk; `otherwise` off CUDA; else sized by `probe` (size_stack); at
        most what an out-of-memory error left for `key`."""
        if self.chunk is not None:
            return self._within(key, self.chunk)
        if device.type != "cuda":
            return self._within(key, otherwise)
        if key in self.sizes:
            return self._within(key, self.sizes[key])
        sizing = size_stack(probe, device, total, cap)
        if not sizing.measured:  # all the variants in one forward: holds only for this many
            return self._within(key, sizing.stack)
        # once per run at info (the first key); the other keys' sizes at debug
        log.log(logging.DEBUG if self.logged else logging.INFO, "%ss per forward at %s: %s", self.what, key,
                sizing.describe())  # fmt: skip
        self.logged = True
        self.sizes[key] = sizing.stack
        return self._within(key, sizing.stack)

    def _within(self, key: Hashable, stack: int) -> int:
        return min(stack, self.limits.get(key, stack))

    def run(self, parts: Iterable[Sequence[T]], forward: Callable[[Sequence[T]], None], key: Hashable = None) -> None:
        """`forward(part)` for each part in order; a part that runs out of CUDA memory runs again as two halves, and
        the parts after it at most that size (also this key's later stacks). One variant that does not fit: a
        RunnerError."""
        limit = self.limits.get(key)
        for part in parts:
            pending = [part]
            while pending:
                piece = pending.pop(0)
                if limit is not None and len(piece) > limit:
                    pending[:0] = [piece[i : i + limit] for i in range(0, len(piece), limit)]
                    continue
                try:
                    forward(piece)
                    continue
                except torch.cuda.OutOfMemoryError:
                    # handled below, outside this block: the exception's traceback keeps the failed forward's
                    # tensors alive, so the halves would run short of that memory too
                    pass
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if len(piece) == 1:
                    raise RunnerError(
                        f"CUDA out of memory with one {self.what} per forward (at {key}): the model and method do not"
                        " fit this GPU. Try precision=bf16, a smaller data.batch_size, or fewer layers."
                    )
                limit = self.limits[key] = len(piece) // 2
                log.log(logging.DEBUG if self.halved else logging.WARNING,
                        "CUDA out of memory with %d %ss per forward (at %s): running them %d at a time", len(piece),
                        self.what, key, limit)  # fmt: skip
                self.halved = True
                pending[:0] = [piece[:limit], piece[limit:]]
