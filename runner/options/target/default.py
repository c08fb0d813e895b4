"""No target chosen: the class's logit for image methods, the answer's logit minus the distractor's
(token_logit_diff) for language-model methods. Resolved when the config is typed (runner/options/compose.py), so a
run's typed config, record and tables name the target it measured, never `default`."""

from dataclasses import dataclass

from runner.options.registry import TARGETS
from runner.schema import TargetConfig

DEFAULT = "default"
IMAGE_DEFAULT = "logit"
LANGUAGE_MODEL_DEFAULT = "token_logit_diff"


@TARGETS.option("runner.targets.classifier:Logit")  # what an image method measures, were it ever built as it is
@dataclass
class DefaultTargetConfig(TargetConfig):
    name: str = DEFAULT
