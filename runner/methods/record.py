"""`record`: no method of its own; runs the data through the model so the configured hooks fire.

With backward or tensor hooks configured, it also takes the gradient of the target class's logit
down to the input, so that every gradient hook sees a real backward pass."""

from __future__ import annotations

from torch import nn

from runner.data.base import Batch
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.base import Method, check_targets, forward, gradients, select_targets
from runner.rows import BatchOutput
from runner.runtime import Runtime
from runner.schema import MethodConfig


class Record(Method):
    name = "record"
    table = "hooks"  # what the record hooks saw: the method writes no table of its own
    needs_layers = False  # the hooks name their own layers

    def __init__(self, cfg: MethodConfig, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.runtime = cfg, runtime

    def setup(self, session: HookSession, num_samples: int) -> None:
        check_targets(self.cfg, num_samples)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        logits, x = forward(model, batch, session, self.runtime, with_grad=False)
        if session.needs_input_grad:
            targets = select_targets(self.cfg, logits, batch)
            gradients(self.runtime.target.score(logits, targets, batch.masks), [], x, session)
        return BatchOutput(predicted=logits.argmax(dim=1))
