"""`hook_check`: are the values hooks capture the values the network computes?

For every selected layer and call, the inputs a forward pre-hook saw are fed to the module's own
`forward` directly (no hooks), and the result is compared with the output the forward hook saw.
A difference beyond `method.tolerance` fails the run after the table is written."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.base import Method, forward
from runner.options.method.hook_check import HookCheckConfig
from runner.rows import BatchOutput
from runner.runtime import Runtime
from runner.tables import Presentation, declare

# The `hook_check` table's own columns (`HookCheck.run_batch`): one row per (sample, layer, call).
HOOK_CHECK_SCHEMA = declare(
    "hook_check",
    [
        pa.field("layer", pa.string()),
        pa.field("module_type", pa.string()),
        pa.field("call", pa.int32()),
        pa.field("max_abs_diff", pa.float32()),
        pa.field("passed", pa.bool_()),  # max_abs_diff <= method.tolerance
    ],
    Presentation(keys=("call",), values=("max_abs_diff",)),
)


class HookCheck(Method):
    name = "hook_check"
    table = "hook_check"
    summary_values = ("max_abs_diff",)

    def __init__(self, cfg: HookCheckConfig, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.layers, self.runtime = cfg, layers, runtime
        self.modules = dict(layers)
        self.worst: dict[str, float] = {}

    def setup(self, session: HookSession, num_samples: int) -> None:
        self.capture = session.capture(self.layers, differentiable=False, inputs=True)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        logits, _ = forward(model, batch, session, self.runtime, with_grad=False)
        batch_size = logits.shape[0]
        layer, module_type, call, diffs = [], [], [], []
        with torch.no_grad(), self.runtime.autocast():
            for name in self.capture.names:
                module = self.modules[name]
                for i, (args, seen) in enumerate(
                    zip(self.capture.inputs[name], self.capture.outputs[name], strict=True)
                ):
                    direct = module.forward(*args)  # the module itself, bypassing every hook
                    diff = (direct.float() - seen.float()).abs().reshape(batch_size, -1).amax(dim=1)  # (B,)
                    diffs.append(diff)
                    layer += [name] * batch_size
                    module_type += [type(module).__name__] * batch_size
                    call += [i] * batch_size
                    self.worst[name] = max(self.worst.get(name, 0.0), float(diff.max()))
        max_abs_diff = torch.cat(diffs)
        columns = {
            "layer": layer,
            "module_type": module_type,
            "call": call,
            "sample_index": torch.arange(batch_size).repeat(len(diffs)),
            "max_abs_diff": max_abs_diff,
            "passed": max_abs_diff <= self.cfg.tolerance,
        }
        return BatchOutput(predicted=logits.argmax(dim=1), tables={self.table: columns})

    def finish(self, out: Path) -> None:
        """The run fails (after its table is written) when a layer's capture differs beyond the tolerance."""
        if self.failures():
            raise RunnerError(
                f"Hook check failed (max abs difference above {self.cfg.tolerance}): {self.failures()}; see {out}."
            )

    def failures(self) -> dict[str, float]:
        """Layers whose captured output differs from the direct computation beyond the tolerance."""
        return {n: d for n, d in self.worst.items() if d > self.cfg.tolerance}
