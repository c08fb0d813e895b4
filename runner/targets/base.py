"""The Target protocol and how a run's target config becomes one."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from runner.errors import RunnerError
from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@runtime_checkable
class Target(Protocol):
    """What score stands for the class explained: `score(output, classes)` is (B,), differentiable in `output`.

    output: the model's output ((B, K) logits for a classifier, (B, K, H, W) for a segmentation model); classes:
    (B,) int64, the class `method.target` chose per sample; masks: the data's localisation masks (B, H, W) at the
    input's size where the data has them (a segmentation region may use them), else None."""

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor: ...


def build_target(config: TargetConfig) -> Target:
    """The target that `config` (a target's own config) describes; RunnerError for an unknown name or a base config."""
    option = TARGETS.for_config(config)
    bad = config.check()  # a run's config was checked at start-up; a library caller's is checked here
    if bad:
        raise RunnerError(f"Out of range: {', '.join(bad)}.")
    return option.load()(config)


def class_scores(output: torch.Tensor, target: str) -> torch.Tensor:
    """`output` when it is (B, K) class scores; else RunnerError naming the target that needs them."""
    if output.dim() != 2:
        raise RunnerError(
            f"target={target} takes a classifier's (batch, classes) output; the model returned {tuple(output.shape)}."
            " A segmentation model's (batch, classes, height, width) output takes target=segmentation_region."
        )
    return output
