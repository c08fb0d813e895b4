"""Grad-CAM (Selvaraju et al. 2017) at every target layer from one forward and one backward.

For a layer with activations A (B, C, H, W) and the target class's logit y:
    w_c = mean_{h,w} dy/dA_c            channel weights (what variants change)
    cam = ReLU(sum_c w_c * A_c)         (B, H, W), at the layer's own resolution

All layers' activations come from one forward pass; all their gradients from one
`torch.autograd.grad(y, [A_1 .. A_L])` with frozen parameters, so backward stops at the earliest
layer and no weight gradient is ever computed. The activations are the modules' true outputs: the
session hands the model a clone, so an in-place ReLU after a conv cannot overwrite them.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.data import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.base import BatchOutput, Columns, Runtime, check_targets, forward, gradients, select_targets
from runner.results import Block, Ragged
from runner.stats import STAT_NAMES, per_sample_stats


class CamMethod:
    """Shared by the CAM family: capture, one gradient pass, per-layer maps and rows."""

    name = "cam"

    def __init__(self, cfg, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.layers, self.runtime = cfg, layers, runtime
        self.module_types = {name: type(module).__name__ for name, module in layers}

    def setup(self, session: HookSession, num_samples: int) -> None:
        check_targets(self.cfg, num_samples)
        self.capture = session.capture(self.layers)

    def channel_weights(self, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """(B, C) weight of each channel; the one thing CAM variants change."""
        raise NotImplementedError

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        logits, x = forward(model, batch, session, self.runtime, with_grad=True)
        targets = select_targets(self.cfg, logits, batch)  # (B,)
        score = logits.gather(1, targets[:, None]).squeeze(1)  # (B,)
        entries = [
            (name, call, act) for name in self.capture.names for call, act in enumerate(self.capture.outputs[name])
        ]
        for name in self.capture.names:
            if not self.capture.outputs[name]:
                raise RunnerError(f"Layer '{name}' was never called in the forward pass; pick a layer the model uses.")
        grads = gradients(score, [act for _, _, act in entries], x, session)
        maps, rows = [], []
        for (name, call, act), grad in zip(entries, grads, strict=True):
            if act.dim() != 4:
                raise RunnerError(
                    f"{self.name} needs spatial activations (batch, channels, height, width), but layer '{name}'"
                    f" ({self.module_types[name]}) outputs shape {tuple(act.shape)}. Pick convolutional layers,"
                    " e.g. layers.include=[Conv2d]."
                )
            if grad is None:
                raise RunnerError(f"The target score does not depend on layer '{name}', so it has no gradient there.")
            weights = self.channel_weights(act.detach().float(), grad.float())  # (B, C)
            cam = torch.relu(torch.einsum("bc,bchw->bhw", weights, act.detach().float()))  # (B, H, W)
            maps.append(cam)
            rows.append((name, call, cam.shape[1], cam.shape[2]))
        batch_size = score.shape[0]
        columns: Columns = {
            "layer": [n for n, _, _, _ in rows for _ in range(batch_size)],
            "module_type": [self.module_types[n] for n, _, _, _ in rows for _ in range(batch_size)],
            "call": [c for _, c, _, _ in rows for _ in range(batch_size)],
            "sample_index": torch.arange(batch_size).repeat(len(rows)),
            "target": targets.repeat(len(rows)),
            "score": score.detach().repeat(len(rows)),
            "map_height": [h for _, _, h, _ in rows for _ in range(batch_size)],
            "map_width": [w for _, _, _, w in rows for _ in range(batch_size)],
            "cam": Block(
                torch.cat([per_sample_stats(m, batch_size)[0] for m in maps]), [f"cam_{s}" for s in STAT_NAMES]
            ),
        }
        if self.cfg.store_maps:
            columns["map"] = Ragged(
                torch.cat([m.reshape(-1) for m in maps]), [h * w for _, _, h, w in rows for _ in range(batch_size)]
            )
        return BatchOutput(predicted=logits.argmax(dim=1), tables={self.name: columns})


class GradCAM(CamMethod):
    name = "gradcam"

    def channel_weights(self, act: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad.mean(dim=(2, 3))  # (B, C): global-average-pooled gradients
