"""A run's memory plan before its weights load: the model's config (its modules on the meta device), its tokenizer
and the data, the method's sizes and peak memory (a method that plans: lm_edges), and the free memory of the device.

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
from runner.schema import RunConfig

log = logging.getLogger(__name__)

GB = 1e9


def size(count: int) -> str:
    """Bytes in MB below a gigabyte, else in GB."""
    return f"{count / 1e6:.1f} MB" if count < GB else f"{count / GB:.2f} GB"


@dataclass(frozen=True)
class RunPlan:
    """The plan of a run: the method's (EdgePlan: counts, phases, peak), the device and its free bytes."""

    method: Any
    device: torch.device
    free: int | None
    dtype: str
    batch_size: int

    @property
    def peak(self) -> int:
        return int(self.method.peak.total)

    @property
    def fits(self) -> bool:
        return self.free is None or self.peak <= self.free


def plans(config: RunConfig) -> bool:
    """Whether the run's method has a memory plan (language-model methods that define `memory_plan`)."""
    return hasattr(method_class(config.method), "memory_plan")


class Prepared(NamedTuple):
    """What every plan of a config and of its variants (batch, chunk, dtype) reads, made once: the model's layout
    and the model on the meta device (from its config.json), the data set (made with its tokenizer)."""

    layout: LanguageModelLayout
    skeleton: torch.nn.Module
    dataset: Any


def prepare(config: RunConfig) -> Prepared:
    """The model's layout and meta-device model, and the data set, for `config`'s plans (no weights load)."""
    if not plans(config):
        raise RunnerError(f"method={config.method.name} has no memory plan: lm_edges plans its memory.")
    layout = model_layout(config.model)
    if layout is None:
        raise RunnerError("A memory plan is made for language models (model=hf_lm).")
    skeleton = model_skeleton(config.model)
    dataset = build_dataset(config.data, model_tokenizer(config.model), config.seed)
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise RunnerError("The data has no pairs: nothing to plan.")
    return Prepared(layout, skeleton, dataset)


def run_plan(
    config: RunConfig, device: torch.device, free: int | None = None, prepared: Prepared | None = None
) -> RunPlan:
    """The plan of `config` on `device` (`free`: its free bytes, read from the device when None); `prepared`: what
    `prepare(config)` gave (made here when None), shared by the plans of one config's variants."""
    layout, skeleton, dataset = prepare(config) if prepared is None else prepared
    dtype = getattr(torch, config.model.dtype) if hasattr(config.model, "dtype") else torch.float32
    if next(skeleton.parameters()).dtype != dtype:
        skeleton = copy.deepcopy(skeleton).to(dtype)  # on meta: no memory; the shared skeleton keeps its dtype
    free = available_bytes(device) if free is None else free
    method = method_class(config.method).memory_plan(config.method, layout, skeleton, dataset, config.data.batch_size,
                                                     free)  # fmt: skip
    return RunPlan(method, device, free, str(dtype).removeprefix("torch."), config.data.batch_size)


def fitting(config: RunConfig, plan: RunPlan, prepared: Prepared) -> list[str]:
    """Settings that fit where `plan` does not, each with its planned peak: the largest data.batch_size that
    fits, method.edges.gradient_memory at one layer, model.dtype=bfloat16."""
    assert plan.free is not None
    found = []
    batch = plan.batch_size
    while batch > 1:
        batch //= 2
        smaller = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=batch))
        tried = run_plan(smaller, plan.device, plan.free, prepared)
        if tried.fits:
            found.append(f"data.batch_size={batch} ({size(tried.peak)})")
            break
    edges = getattr(config.method, "edges", None)
    if edges is not None and edges.gradient_memory != 0.001:
        lower = dataclasses.replace(config.method, edges=dataclasses.replace(edges, gradient_memory=0.001))
        tried = run_plan(dataclasses.replace(config, method=lower), plan.device, plan.free, prepared)
        if tried.fits:
            found.append(f"method.edges.gradient_memory=0.001 (a layer's gradients at a time: {size(tried.peak)})")
    if plan.dtype == "float32" and hasattr(config.model, "dtype"):
        half = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
        tried = run_plan(half, plan.device, plan.free, prepared)
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
    log.info("memory plan: peak %s (%s) on %s, %s free", size(plan.peak), plan.method.peak.name, device, free)
    if plan.fits:
        return
    assert plan.free is not None
    settings = fitting(config, plan, prepared)
    fix = (
        "Use " + ", or ".join(settings) + "."
        if settings
        else "No smaller batch, chunk or dtype fits: use a device with more memory."
    )
    raise RunnerError(
        f"This run needs about {size(plan.peak)} at its peak ({plan.method.peak.name}) but {device} has"
        f" {size(plan.free)} free (`runner plan` with the same overrides shows every term). {fix}"
    )


def plan_lines(plan: RunPlan) -> list[str]:
    """The plan as text: the counts, each phase's terms, the peak against the free memory."""
    counts = plan.method.counts
    lines = [", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in counts.items()), ""]
    for phase in plan.method.phases:
        lines.append(f"{phase.name}: {size(phase.total)}")
        lines += [f"  {name:<32}{size(bytes_):>12}" for name, bytes_ in phase.terms if bytes_]
    free = "unknown" if plan.free is None else size(plan.free)
    verdict = "fits" if plan.fits else "does not fit"
    lines += ["", f"peak {size(plan.peak)} ({plan.method.peak.name}), {plan.dtype} weights, batch {plan.batch_size};"
              f" {plan.device} has {free} free: {verdict}"]  # fmt: skip
    return lines
