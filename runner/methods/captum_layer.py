"""captum's layer attribution methods through the runner's tables (`method=captum method.captum=NAME`).

captum takes one layer per call, so L layers cost L calls (the runner's CAM methods need one pass);
what this adds is captum's breadth: LayerGradientXActivation, LayerIntegratedGradients,
LayerConductance, LayerGradCam, ... Each layer's attribution (B, C, H, W) (or ViT tokens) is summed
over channels into a signed map at the layer's resolution; rows are those of the CAM family.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError, suggest
from runner.hooks import HookSession, inplace_disabled
from runner.methods.base import check_targets, forward, select_target_sets
from runner.methods.cam import CamMethod, to_spatial
from runner.rows import BatchOutput, Columns, concat_columns
from runner.targets import Target
from runner.targets.classifier import Logit

SUPPORTED = (
    "LayerGradientXActivation",
    "LayerIntegratedGradients",
    "LayerConductance",
    "LayerGradCam",
    "LayerActivation",
)


class CaptumLayer(CamMethod):
    name = "captum"
    needs_gradients = False

    def setup(self, session: HookSession, num_samples: int) -> None:
        import captum.attr

        check_targets(self.cfg, num_samples)
        if self.cfg.captum not in SUPPORTED:
            raise RunnerError(
                f"method.captum='{self.cfg.captum}' is not supported.{suggest(self.cfg.captum, SUPPORTED)}"
                f" Use one of: {', '.join(SUPPORTED)}."
            )
        self.attribution = getattr(captum.attr, self.cfg.captum)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        logits, _ = forward(model, batch, session, self.runtime, with_grad=False)
        target_sets = select_target_sets(self.cfg, logits, batch)  # (B, K)
        probs = logits.softmax(dim=1)
        entries = [(name, 0, None) for name, _ in self.layers]
        parts = []
        # Past the user's forward: captum's own forwards (n_steps of them for integrated gradients), faithfulness
        # and the metrics are the method's, which the user's `record` hooks must not see.
        with session.recording_paused():
            for k in range(target_sets.shape[1]):
                parts.append(self._target_rows(model, batch, session, logits, probs, entries, target_sets[:, k], k))
        columns = concat_columns(parts)
        columns["captum_method"] = [self.cfg.captum] * len(columns["layer"])
        return BatchOutput(predicted=logits.argmax(dim=1), tables=self._tables(columns))

    def _target_rows(
        self, model: nn.Module, batch: Batch, session: HookSession, logits: torch.Tensor, probs: torch.Tensor,
        entries: list, target: torch.Tensor, k: int,
    ) -> Columns:  # fmt: skip
        """The rows of every layer for the k-th target of each sample (`target`, (B,)): one captum call per layer."""
        maps = []
        scored = self._scored(model, batch, target)
        for name, module in self.layers:
            method = self.attribution(scored.forward if scored else model, module)
            # captum replaces layer outputs with leaf tensors; an in-place op after the layer would fail.
            with self.runtime.autocast(), inplace_disabled(model):
                if scored is None:  # the logit: captum picks the class's output itself
                    attr = method.attribute(batch.x, target=target, **self.cfg.captum_kwargs)
                else:  # any other target: captum differentiates the target's score, one per sample
                    attr = method.attribute(batch.x, additional_forward_args=scored.args, **self.cfg.captum_kwargs)
            attr = attr[0] if isinstance(attr, tuple) else attr
            spatial = to_spatial(attr.detach().float(), name, self.module_types[name], self.name, self.cfg.token_prefix)
            maps.append(spatial.sum(dim=1))  # (B, h, w), signed
        score = self.runtime.target.score(logits, target, batch.masks)  # (B,) the run's target
        return self.consume(model, batch, session, entries, maps, target, k, score, probs)

    def _scored(self, model: nn.Module, batch: Batch, target: torch.Tensor) -> _Scored | None:
        """The forward captum differentiates when the run's target is not the logit (None when it is)."""
        if isinstance(self.runtime.target, Logit):
            return None
        args = (target,) if batch.masks is None else (target, batch.masks)
        return _Scored(model, self.runtime.target, args)


class _Scored:
    """model(x) -> the target's (B,) score; the classes (and masks) go in captum's `additional_forward_args`, which
    captum repeats as it repeats the inputs (integrated gradients' steps), so each copy keeps its sample's class."""

    def __init__(self, model: nn.Module, target: Target, args: tuple[torch.Tensor, ...]) -> None:
        self.model, self.target, self.args = model, target, args

    def forward(self, x: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        return self.target.score(self.model(x).float(), classes, masks)
