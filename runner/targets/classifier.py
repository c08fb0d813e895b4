"""The classifier targets: the class's logit or probability, a logit difference, a binary output, all outputs, a set
of labels. Each `score` is (B,) and matches pytorch-grad-cam's target of the same meaning per sample."""

from __future__ import annotations

import torch

from runner.errors import RunnerError
from runner.options.target.binary import BinaryTargetConfig
from runner.options.target.logit_difference import LogitDifferenceTargetConfig
from runner.options.target.multi_label import MultiLabelTargetConfig
from runner.schema import TargetConfig
from runner.targets.base import class_scores


def _check_ids(ids: list[int], num_classes: int, key: str) -> None:
    bad = [i for i in ids if not 0 <= i < num_classes]
    if bad:
        raise RunnerError(f"{key}: ids {bad} are outside the model's {num_classes} outputs (0 to {num_classes - 1}).")


class Logit:
    """The class's logit (ClassifierOutputTarget): every method's score when no target is named."""

    def __init__(self, config: TargetConfig | None = None) -> None:
        pass

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        return class_scores(output, "logit").gather(1, classes[:, None]).squeeze(1)


class Probability:
    """The class's softmax probability (ClassifierOutputSoftmaxTarget)."""

    def __init__(self, config: TargetConfig | None = None) -> None:
        pass

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        return class_scores(output, "probability").softmax(dim=1).gather(1, classes[:, None]).squeeze(1)


class LogitDifference:
    """The class's logit minus `other`'s, or minus the largest logit of any other class (`other` None)."""

    def __init__(self, config: LogitDifferenceTargetConfig) -> None:
        self.other = config.other

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        logits = class_scores(output, "logit_difference")
        chosen = logits.gather(1, classes[:, None]).squeeze(1)
        if self.other is not None:
            _check_ids([self.other], logits.shape[1], "target.other")
            return chosen - logits[:, self.other]
        if logits.shape[1] < 2:
            raise RunnerError("target=logit_difference with other=null needs at least two classes.")
        others = logits.scatter(1, classes[:, None], float("-inf"))  # the explained class out of the running
        return chosen - others.amax(dim=1)


class Binary:
    """A one-output classifier's output for category 1, its negation for 0 (BinaryClassifierOutputTarget)."""

    def __init__(self, config: BinaryTargetConfig) -> None:
        self.category = config.category

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        b = output.shape[0]
        if output.numel() != b:
            raise RunnerError(
                f"target=binary takes a one-output classifier's (batch,) or (batch, 1) output; the model returned"
                f" {tuple(output.shape)}. A classifier with a column per class takes target=logit or probability."
            )
        category = classes if self.category is None else torch.full_like(classes, self.category)
        sign = torch.where(category == 1, 1.0, -1.0).to(output.dtype)
        return output.reshape(b) * sign


class Raw:
    """The sum of every output, whatever the class (RawScoresOutputTarget, summed as pytorch-grad-cam's loss does)."""

    def __init__(self, config: TargetConfig | None = None) -> None:
        pass

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        return output.flatten(1).sum(dim=1)


class MultiLabel:
    """The sum of the logits of `labels`, the same ids for every sample."""

    def __init__(self, config: MultiLabelTargetConfig) -> None:
        self.labels = list(config.labels)

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        logits = class_scores(output, "multi_label")
        _check_ids(self.labels, logits.shape[1], "target.labels")
        return logits[:, self.labels].sum(dim=1)
