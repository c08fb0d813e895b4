"""What the benchmark scripts share: the device choice, and interleaved timing of contenders that each own a model.

A benchmark here cannot lie in the two ways earlier versions did:
  - one contender paying for another's hooks: every contender brings its OWN model copy, no module is shared
    between two contenders, and before each timed call the harness checks that the model carries exactly the
    hooks its contender declared (its own resident ones, often 0) and no global module hook is registered;
  - the machine's load drifting between contenders timed back to back: contenders are timed round-robin, one
    call each per round, the order rotated every round, so a slow minute hits all of them alike.
It prints each contender's median, its spread (quartiles and min-max) and its ratio to a named reference, both
as a ratio of medians and as the median of the per-round ratios (paired, steadier under load); on CUDA also how
busy the GPU was during one profiled call of each (`gpu_busy`, after the timed rounds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from runner.hooks import count_hooks


def pick_device(name: str) -> torch.device:
    """`auto`: the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def global_hooks() -> int:
    """Module hooks registered for every module at once (`register_module_forward_hook` and kin)."""
    names = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    return sum(len(getattr(torch_module, n, {})) for n in names)


def inplace_flags(model: nn.Module) -> tuple[bool, ...]:
    """Each module's `inplace` flag, in module order (a contender must not leave them switched)."""
    return tuple(bool(getattr(m, "inplace", False)) for m in model.modules())


@dataclass
class Contender:
    """One way of doing the work: a callable and the model it (alone) runs on.

    `hooks` is how many module hooks the model carries between calls: the contender's own resident ones
    (the runner's hook session, torchcam's extractor), 0 for contenders that register per call or none.
    `lazy`: it registers more resident hooks of its own during its first call (the runner's patching adds a
    replacement per cone on first use); the count is then fixed after the warm-up and checked from there on.
    """

    name: str
    fn: Callable[[], object]
    model: nn.Module
    hooks: int = 0
    close: Callable[[], None] | None = None
    lazy: bool = False
    flags: tuple[bool, ...] = field(default=(), init=False)  # the model's in-place flags at the first check

    def check(self, when: str) -> None:
        """Fail unless the model carries exactly its own hooks and its in-place flags are as they were."""
        found = count_hooks(self.model)
        if found != self.hooks:
            raise AssertionError(
                f"{self.name}: its model carries {found} module hooks {when}, expected its own {self.hooks}:"
                " another contender's hooks would be timed with it, or it leaks hooks."
            )
        if global_hooks():
            raise AssertionError(f"{self.name}: {global_hooks()} global module hooks are registered {when}.")
        flags = inplace_flags(self.model)
        if not self.flags:
            self.flags = flags
        elif flags != self.flags:
            raise AssertionError(f"{self.name}: its model's in-place flags changed {when}.")


def gpu_busy(calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, tuple[float, float]]:
    """Per call: (seconds of CUDA kernels, wall seconds) of one call under torch.profiler; {} off CUDA.

    Kernel time over wall time is the fraction of the call the GPU computed (copies and memsets are not kernels;
    overlapping kernels on two streams count twice). Made after the timed rounds, whose timings it leaves alone;
    the profiler's own per-op cost lengthens the wall time, so launch-bound code reads a little idler than it is."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    busy = {}
    for name, fn in calls.items():
        synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            fn()
            synchronize(device)
            wall = time.perf_counter() - start
        events = prof.events()
        kernels = [
            e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        ]
        busy[name] = (sum(e.time_range.elapsed_us() for e in kernels) / 1e6, wall)
    return busy


def busy_text(kernel_wall: tuple[float, float] | None) -> str:
    """'73% (12.1/16.6 ms)': the GPU's busy fraction of a profiled call; 'n/a (CPU)' without one."""
    if kernel_wall is None:
        return "n/a (CPU)"
    kernel, wall = kernel_wall
    return f"{kernel / wall:4.0%} ({kernel * 1e3:.1f}/{wall * 1e3:.1f} ms)"


@dataclass
class Timings:
    """Seconds per call of each contender, one entry per round (round r of every contender ran in the same round)."""

    seconds: dict[str, list[float]]
    reference: str
    busy: dict[str, tuple[float, float]] = field(default_factory=dict)  # CUDA only: `gpu_busy` of each contender

    def median(self, name: str) -> float:
        """Median seconds per call."""
        return statistics.median(self.seconds[name])

    def ratio(self, name: str, reference: str | None = None) -> float:
        """Median of `name` over median of the reference."""
        return self.median(name) / self.median(reference or self.reference)

    def paired(self, name: str, reference: str | None = None) -> float:
        """Median over rounds of (this round's time / the reference's time in the same round)."""
        ref = self.seconds[reference or self.reference]
        return statistics.median(s / r for s, r in zip(self.seconds[name], ref, strict=True))


def check_separate(contenders: list[Contender]) -> None:
    """Fail if two contenders share a model or any module of one (hooks on it would be timed with both)."""
    owner: dict[int, str] = {}
    for c in contenders:
        for module in c.model.modules():
            other = owner.setdefault(id(module), c.name)
            if other != c.name:
                raise AssertionError(
                    f"'{c.name}' and '{other}' share a module ({type(module).__name__}): give each its own model copy."
                )


def interleaved(
    contenders: list[Contender], device: torch.device, reference: str, rounds: int = 25, warmup: int = 2
) -> Timings:
    """Time every contender round-robin: `warmup` untimed calls each, then `rounds` rounds, order rotated."""
    names = [c.name for c in contenders]
    if reference not in names:
        raise ValueError(f"reference '{reference}' is not a contender: {names}")
    check_separate(contenders)
    seconds: dict[str, list[float]] = {c.name: [] for c in contenders}
    for c in contenders:
        c.check("before its warm-up")
        for _ in range(max(warmup, 1 if c.lazy else 0)):  # allocations, cudnn autotuning, lazy imports
            c.fn()
        if c.lazy:  # its model is its own (check_separate), so what it gained in the warm-up is its own
            c.hooks = count_hooks(c.model)
        c.check("after its warm-up")
    for r in range(rounds):
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            c.check("before a timed call")
            synchronize(device)
            start = time.perf_counter()
            c.fn()
            synchronize(device)
            seconds[c.name].append(time.perf_counter() - start)
        for c in contenders:  # the last one of the round has not been checked after its call yet
            c.check("after a round")
    return Timings(seconds, reference, gpu_busy({c.name: c.fn for c in contenders}, device))


def close_all(contenders: list[Contender]) -> None:
    """Let go of each contender's resident hooks (sessions, extractors)."""
    for c in contenders:
        if c.close is not None:
            c.close()


def report(timings: Timings, per_call: int = 1, unit: str = "img/s", divide: float = 1.0) -> None:
    """Print median seconds (over `divide`), quartiles, min-max, `per_call` items per second, ratios to the reference."""
    ref = timings.reference
    print(
        f"{'contender':44s} {'median s':>9s} {'q1-q3 s':>15s} {'min-max s':>15s} {unit:>9s}"
        f" {'x ref':>7s} {'paired':>7s}{'   GPU busy (kernels/wall)' if timings.busy else ''}"
        f"   (ref: {ref}; {len(timings.seconds[ref])} rounds)"
    )
    for name, values in timings.seconds.items():
        v = sorted(s / divide for s in values)
        q1, _, q3 = statistics.quantiles(v, n=4) if len(v) > 1 else (v[0], v[0], v[0])
        med = statistics.median(v)
        print(
            f"{name:44s} {med:9.4f} {q1:7.4f}-{q3:<7.4f} {v[0]:7.4f}-{v[-1]:<7.4f} {per_call / med:9.1f}"
            f" {timings.ratio(name):7.2f} {timings.paired(name):7.2f}"
            + (f"   {busy_text(timings.busy.get(name))}" if timings.busy else "")
        )
