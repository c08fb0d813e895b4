"""What a patched run is measured by: the target's logit, its probability, or a logit difference."""

from __future__ import annotations

import torch

from runner.options.method.patching import PatchMetric


def metric(kind: PatchMetric, logits: torch.Tensor, target: torch.Tensor, contrast: torch.Tensor) -> torch.Tensor:
    """(n,) metric of logits (n, K) for the class `target` (and `contrast` for logit_diff), per row."""
    chosen = logits.gather(1, target[:, None]).squeeze(1)
    if kind is PatchMetric.logit:
        return chosen
    if kind is PatchMetric.prob:
        return logits.softmax(dim=1).gather(1, target[:, None]).squeeze(1)
    return chosen - logits.gather(1, contrast[:, None]).squeeze(1)
