"""The sum of the logits of a set of labels (`labels: [ids]`): a multi-label model's evidence for all of them."""

from dataclasses import dataclass, field

from runner.errors import RunnerError
from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.classifier:MultiLabel")
@dataclass
class MultiLabelTargetConfig(TargetConfig):
    name: str = "multi_label"
    labels: list[int] = field(default_factory=list)  # the output ids whose logits are summed, the same for every sample

    def check(self) -> list[str]:
        if not self.labels:
            raise RunnerError(
                "target=multi_label needs target.labels=[ID, ...]: the output ids whose logits are summed."
            )
        return [f"target.labels={self.labels}"] if min(self.labels) < 0 else []
