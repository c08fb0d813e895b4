"""A run's memory plan before its weights load: the model's config (its modules on the meta device), its tokenizer
and the data, the method's sizes and peak memory (a method that plans: lm_edges), and the free memory of the device.

On the CPU the plan is of the process's resident memory (what the system must have free for it): the method's
tensors as its plan's `resident` phases hold them (glibc's heap keeps the scoring pass's freed memory through the
evaluation), and the process before its weights load: Python with torch, transformers and the runner imported and
transformers' code for the model (PROCESS_BYTES), and the tokenizer (TOKENIZER_BYTES a vocabulary entry). The
weights load at their size (safetensors, no second copy; a packaged model's one-off conversion from GGUF, before the
plan, peaks higher: docs/language_models.md). On a GPU the plan is of the method's tensors alone.

`run_plan` makes it; `check_memory` refuses a run whose plan does not fit, naming the settings that would fit (a
smaller data.batch_size, a smaller method.edges.gradient_memory, model.dtype=bfloat16) with their planned peaks.
`runner plan [overrides]` prints it (runner/commands/plan.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from runner.data.base import build_dataset
from runner.errors import RunnerError
from runner.methods import method_class
from runner.models import model_layout, model_skeleton, model_tokenizer
from runner.models.check import available_bytes
from runner.models.lm_sites import LanguageModelLayout
from runner.models.memory import status_bytes
from runner.schema import RunConfig

log = logging.getLogger(__name__)

GB = 1e9
# Resident memory of a runner process before the weights load, beside its tokenizer: Python, torch 2.14 (a CUDA
# build), transformers 5.25, pandas and pyarrow imported (0.87 GB), and transformers' model code and the model built
# on meta (0.27 GB). Measured on Linux x86-64 (benchmarks/RESULTS.md); a CPU-only torch build holds less, so there
# the plan errs high.
PROCESS_BYTES = int(1.14 * GB)
# A loaded tokenizer's resident memory per vocabulary entry (the fast tokenizer's tables): SmolLM2's 49,152 entries
# 0.05 GB, Gemma 3's 262,144 0.33 GB.
TOKENIZER_BYTES = 1300


def size(count: int) -> str:
    """Bytes in MB below a gigabyte, else in GB."""
    return f"{count / 1e6:.1f} MB" if count < GB else f"{count / GB:.2f} GB"


@dataclass(frozen=True)
class RunPlan:
    """The plan of a run: the method's (EdgePlan: counts, phases of tensors), the device and its free bytes, and on
    the CPU the process's own memory (`process`: (name, bytes) terms, held through every phase), of which `held`
    bytes this process holds already (free memory is counted without them)."""

    method: Any
    device: torch.device
    free: int | None
    dtype: str
    batch_size: int
    process: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    held: int = 0

    @property
    def resident(self) -> bool:
        """Whether the plan is of the process's resident memory (the CPU), not of the method's tensors alone."""
        return self.device.type == "cpu"

    @property
    def phases(self) -> list[Any]:
        """The method's phases, as the resident memory holds them on the CPU (the tensors alone elsewhere)."""
        return list(self.method.resident().phases if self.resident else self.method.phases)

    @property
    def peak_phase(self) -> Any:
        return max(self.phases, key=lambda p: p.total)

    @property
    def tensors(self) -> int:
        """The method's own peak: what torch's allocator holds at once (the weights included)."""
        return int(self.method.peak.total)

    @property
    def peak(self) -> int:
        return int(self.peak_phase.total) + sum(size for _, size in self.process)

    @property
    def fits(self) -> bool:
        return self.free is None or self.peak - self.held <= self.free


def plans(config: RunConfig) -> bool:
    """Whether the run's method has a memory plan (language-model methods that define `memory_plan`)."""
    return hasattr(method_class(config.method), "memory_plan")


class Prepared(NamedTuple):
    """What every plan of a config and of its variants (batch, chunk, dtype) reads, made once: the model's layout
    and the model on the meta device (from its config.json), the data set (made with its tokenizer), and the
    tokenizer's vocabulary size."""

    layout: LanguageModelLayout
    skeleton: torch.nn.Module
    dataset: Any
    vocabulary: int = 0


def prepare(config: RunConfig) -> Prepared:
    """The model's layout and meta-device model, and the data set, for `config`'s plans (no weights load)."""
    if not plans(config):
        raise RunnerError(f"method={config.method.name} has no memory plan: lm_edges plans its memory.")
    layout = model_layout(config.model)
    if layout is None:
        raise RunnerError("A memory plan is made for language models (model=hf_lm).")
    skeleton = model_skeleton(config.model)
    tokenizer = model_tokenizer(config.model)
    dataset = build_dataset(config.data, tokenizer, config.seed)
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise RunnerError("The data has no pairs: nothing to plan.")
    return Prepared(layout, skeleton, dataset, len(tokenizer))


def process_terms(prepared: Prepared) -> list[tuple[str, int]]:
    """The process's resident memory before the weights load (the CPU's plan): the imports and the model's code,
    and the tokenizer."""
    return [("the process (Python, torch, transformers)", PROCESS_BYTES),
            ("the tokenizer", prepared.vocabulary * TOKENIZER_BYTES)]  # fmt: skip


def resident_bytes() -> int:
    """This process's resident memory now (0 where unknown)."""
    return status_bytes("VmRSS")


def run_plan(
    config: RunConfig, device: torch.device, free: int | None = None, prepared: Prepared | None = None
) -> RunPlan:
    """The plan of `config` on `device` (`free`: its free bytes, read from the device when None); `prepared`: what
    `prepare(config)` gave (made here when None), shared by the plans of one config's variants. On the CPU with its
    free memory read here, the process's memory this process holds already (its imports, its tokenizer) is not
    counted twice: the system's free memory is without it."""
    prepared = prepare(config) if prepared is None else prepared
    layout, skeleton, dataset, _ = prepared
    dtype = getattr(torch, config.model.dtype) if hasattr(config.model, "dtype") else torch.float32
    if next(skeleton.parameters()).dtype != dtype:
        skeleton = copy.deepcopy(skeleton).to(dtype)  # on meta: no memory; the shared skeleton keeps its dtype
    read = free is None
    free = available_bytes(device) if free is None else free
    method = method_class(config.method).memory_plan(config.method, layout, skeleton, dataset, config.data.batch_size,
                                                     free)  # fmt: skip
    process = process_terms(prepared) if device.type == "cpu" else []
    held = min(resident_bytes(), sum(size for _, size in process)) if read and process else 0
    return RunPlan(method, device, free, str(dtype).removeprefix("torch."), config.data.batch_size, process, held)


def fitting(config: RunConfig, plan: RunPlan, prepared: Prepared) -> list[str]:
    """Settings that fit where `plan` does not, each with its planned peak: the largest data.batch_size that
    fits, method.edges.gradient_memory at one layer, model.dtype=bfloat16."""
    assert plan.free is not None

    def tried_with(changed: RunConfig) -> RunPlan:  # the same free memory, and the same part of it held already
        return dataclasses.replace(run_plan(changed, plan.device, plan.free, prepared), held=plan.held)

    found = []
    batch = plan.batch_size
    while batch > 1:
        batch //= 2
        smaller = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=batch))
        tried = tried_with(smaller)
        if tried.fits:
            found.append(f"data.batch_size={batch} ({size(tried.peak)})")
            break
    edges = getattr(config.method, "edges", None)
    if edges is not None and edges.gradient_memory != 0.001:
        lower = dataclasses.replace(config.method, edges=dataclasses.replace(edges, gradient_memory=0.001))
        tried = tried_with(dataclasses.replace(config, method=lower))
        if tried.fits:
            found.append(f"method.edges.gradient_memory=0.001 (a layer's gradients at a time: {size(tried.peak)})")
    if plan.dtype == "float32" and hasattr(config.model, "dtype"):
        half = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
        tried = tried_with(half)
        if tried.fits:
            found.append(f"model.dtype=bfloat16 ({size(tried.peak)}; scores still summed in float32)")
    return found


def check_memory(config: RunConfig, device: torch.device) -> None:
    """Refuse, before the weights load, a run whose planned peak exceeds the device's free memory (RunnerError
    naming the settings that fit); log the plan's peak otherwise. Methods without a plan, and models spread over
    devices (model.device_map), are not checked."""
    if not plans(config) or getattr(config.model, "device_map", None) is not None:
        return
    try:
        prepared = prepare(config)
    except RunnerError:
        return  # data the plan cannot read (empty, refused): the run refuses it itself, in its own words
    plan = run_plan(config, device, prepared=prepared)
    free = "unknown" if plan.free is None else size(plan.free)
    log.info("memory plan: peak %s (%s) on %s, %s free", size(plan.peak), plan.peak_phase.name, device, free)
    if plan.fits:
        return
    assert plan.free is not None
    settings = fitting(config, plan, prepared)
    fix = (
        "Use " + ", or ".join(settings) + "."
        if settings
        else "No smaller batch, chunk or dtype fits: use a device with more memory."
    )
    held = f", {size(plan.held)} of it held already by this process," if plan.held else ""
    raise RunnerError(
        f"This run needs about {size(plan.peak)} at its peak ({plan.peak_phase.name}){held} but {device} has"
        f" {size(plan.free)} free (`runner plan` with the same overrides shows every term). {fix}"
    )


def plan_lines(plan: RunPlan) -> list[str]:
    """The plan as text: the counts, each phase's terms, the peak against the free memory."""
    counts = plan.method.counts
    lines = [", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in counts.items()), ""]
    if plan.process:
        lines.append(f"held by the process throughout: {size(sum(b for _, b in plan.process))}")
        lines += [f"  {name:<44}{size(bytes_):>12}" for name, bytes_ in plan.process if bytes_]
    for phase in plan.phases:
        lines.append(f"{phase.name}: {size(phase.total)}")
        lines += [f"  {name:<44}{size(bytes_):>12}" for name, bytes_ in phase.terms if bytes_]
    free = "unknown" if plan.free is None else size(plan.free)
    verdict = "fits" if plan.fits else "does not fit"
    what = "resident memory" if plan.resident else "tensors"
    held = f"; this process holds {size(plan.held)} of it already" if plan.held else ""
    lines += ["", f"peak {size(plan.peak)} ({plan.peak_phase.name}, {what}; torch's allocations alone"
              f" {size(plan.tensors)}{held}), {plan.dtype} weights, batch {plan.batch_size}; {plan.device} has {free}"
              f" free: {verdict}"]  # fmt: skip
    return lines
