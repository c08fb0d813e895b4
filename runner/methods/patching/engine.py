"""Exact patching: the metric of every patched variant of one layer's activation, `chunk` variants per forward.

Each variant is base_act + mask_u * (source_act - base_act), stacked along the batch. With `reuse_prefix`,
the forward takes the base input at batch 1 and the session's replacement returns the n variants at the
patched layer, so the layers before it run once per chunk instead of n times (skip connections broadcast
the batch-1 tensors). A model that cannot (one that reshapes with the input's batch size, e.g.
`x.view(bs, -1)`) is detected on the first chunk and run with the base input repeated instead. With
`local_recompute`, a cell in a chain of local ops is carried through only its cone (cone.py), and the chain's
parent is not run at all in the variants' forward (its output is replaced).

A chunk costs a fixed number of operations, whatever its number of variants: the masks and the cone's index plans
depend only on the units, so they are made once (on the host, moved in one copy) and kept for every sample.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from runner.chunk_sizing import StackSizer
from runner.chunks import spans
from runner.hooks import Capture, HookSession, Replacement
from runner.methods.patching.cone import Cone, ConePlan
from runner.methods.patching.metric import metric
from runner.methods.patching.units import Units
from runner.options.method.patching import PatchingConfig, PatchUnit
from runner.progress import within_batch
from runner.runtime import Runtime

log = logging.getLogger(__name__)

# Variants per forward off CUDA when no chunk is set (on CUDA: sized from free memory, runner.chunk_sizing).
CPU_CHUNK = 64
# Masks and cone plans kept per engine (per (layer, units) set; a run's layers x chunks, usually a few).
KEPT_PLANS = 64


class ExactEngine:
    """Runs the patched variants of the session's target layers; remembers per layer whether the prefix broadcasts
    and which cone follows it."""

    def __init__(
        self, p: PatchingConfig, runtime: Runtime, session: HookSession, capture: Capture,
        replacements: dict[str, Replacement],
    ) -> None:  # fmt: skip
        self.p, self.runtime, self.session, self.capture, self.replacements = p, runtime, session, capture, replacements
        self.prefix_ok: dict[str, bool] = {}
        # (this call's index, calls in the batch) while a method reports its batch's progress chunk by chunk
        self.site: tuple[int, int] | None = None
        self.cones: dict[str, tuple[Cone, Replacement] | None] = {}
        self.stacks = StackSizer(p.chunk, "patched variant")
        self.plans: OrderedDict[tuple[Any, ...], Any] = OrderedDict()  # masks and cone plans, least recent first

    def _kept(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The mask or plan of `key`, made on first use and kept (the `KEPT_PLANS` most recent)."""
        if key in self.plans:
            self.plans.move_to_end(key)
            return self.plans[key]
        self.plans[key] = value = make()
        if len(self.plans) > KEPT_PLANS:
            self.plans.popitem(last=False)
        return value

    @torch.no_grad()
    def patched_metrics(
        self, model: nn.Module, name: str, base_input: torch.Tensor, base: torch.Tensor, source: torch.Tensor,
        units: Units, target: torch.Tensor, contrast: torch.Tensor, order: list[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Metric of each patched variant (units in `order`, default all), chunked, prefix reused where possible."""
        order = order if order is not None else list(range(units.count))
        diff = source - base
        out: list[torch.Tensor] = []
        cone = self._cone(model, name) if units.kind is PatchUnit.cell and self.p.local_recompute else None

        base_run: list[torch.Tensor] = []  # the base map through the cone's chain, run once for every chunk

        def metrics(picked: Sequence[int]) -> torch.Tensor:
            """(n,) the metric of the variants of units `picked`, in one forward."""
            key = (name, units.kind, units.shape, tuple(picked), base.device)
            if cone is not None:  # only the patched cell's cone is recomputed through the local chain
                chain, replacement = cone
                # under autocast as the model's own forward: bf16 activations meet the convs' fp32 weights
                with self.runtime.autocast():
                    if not base_run:
                        base_run.extend(chain.base_run(base))
                    plan: ConePlan = self._kept(
                        ("cone", *key, tuple(tuple(t.shape[1:]) for t in base_run)),
                        lambda: chain.plan([tuple(t.shape[1:]) for t in base_run], [units.cells[u] for u in picked],
                                           base.device),
                    )  # fmt: skip
                    variants = chain.propagate(base_run, source, plan)  # (n, ...)
                with _skipped(chain.parent, variants):
                    logits = self._run_variants(model, chain.parent_name, base_input, variants, replacement)
            else:
                masks = self._kept(("mask", *key), lambda: units.masks_of(list(picked), base.device))
                variants = torch.addcmul(base, masks, diff)  # (n, ...): base + mask * diff in one op
                logits = self._run_variants(model, name, base_input, variants, self.replacements[name])
            n = variants.shape[0]
            return metric(self.p.metric, logits, target.expand(n), contrast.expand(n))

        def forward(picked: Sequence[int]) -> None:
            out.append(metrics(picked))
            if self.site is not None:  # a long batch moves the run's bar chunk by chunk
                done, (site, sites) = sum(len(o) for o in out), self.site
                within_batch((site + done / len(order)) / sites, f"patching {name}: {done}/{len(order)} variants")

        key = f"{name} ({units.kind.value}{', cone' if cone else ''})"
        with self.capture.paused():  # the variants' forwards need no capture (nor the probes that size them)
            chunk = self.stacks.stack(key, base.device, len(order), lambda k: metrics(order[:k]), CPU_CHUNK)
            self.stacks.run((order[span.start : span.stop] for span in spans(len(order), chunk)), forward, key)
        return torch.cat(out)

    def _cone(self, model: nn.Module, name: str) -> tuple[Cone, Replacement] | None:
        """The local chain after `name` (with a replacement on its output), or None; found once per layer."""
        if name not in self.cones:
            chain = Cone.find(model, name)
            if chain is not None and self.p.call != 0:
                chain = None  # a module called several times: its calls are not one chain
            if chain is not None:
                inside = {n for n, m in model.named_modules() if any(m is c for c in chain.modules)}
                hooked = sorted((inside | {chain.parent_name}) & self.session.modified_modules)
                if hooked:  # the cone computes the chain with its modules' arithmetic, not their calls (and hooks)
                    log.info("patching at %s: hooks change %s, after it; full forwards, not its cone", name,
                             ", ".join(hooked))  # fmt: skip
                    chain = None
            replacement = (
                self.session.replace([(chain.parent_name, chain.parent)])[chain.parent_name] if chain else None
            )
            self.cones[name] = (chain, replacement) if chain else None
            if chain:
                log.info("patching at %s: recomputing only each cell's cone through %s", name, chain.parent_name)
        return self.cones[name]

    def _run_variants(
        self, model: nn.Module, name: str, base_input: torch.Tensor, variants: torch.Tensor, replacement: Replacement
    ) -> torch.Tensor:
        n = variants.shape[0]
        try:
            replacement.value = variants
            if self.p.reuse_prefix and self.prefix_ok.get(name, True):
                self.session.new_forward()
                try:
                    with self.runtime.autocast():
                        logits = model(base_input).float()  # prefix at batch 1, the layer returns n variants
                    if logits.shape[0] == n:
                        self.prefix_ok[name] = True
                        return logits
                except torch.cuda.OutOfMemoryError:
                    raise  # not a model that cannot broadcast: StackSizer.run halves the stack
                except RuntimeError:
                    pass
                if name not in self.prefix_ok or self.prefix_ok[name]:
                    log.info("patching at %s: the model cannot broadcast a batch-1 prefix; running full forwards", name)
                self.prefix_ok[name] = False
            self.session.new_forward()
            with self.runtime.autocast():
                return model(base_input.expand(n, *base_input.shape[1:])).float()
        finally:
            replacement.value = None


@contextmanager
def _skipped(module: nn.Module, output: torch.Tensor) -> Iterator[None]:
    """`module`'s forward returns `output` without computing: its output is replaced in the variants' forward (the
    hooks around it still run), so the batch-1 run of its children would be thrown away."""
    module.forward = lambda *args, **kwargs: output  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward
