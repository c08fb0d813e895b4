"""Any function `(output, classes) -> (B,) score` by its import path: `target._target_: my_pkg.scores.margin`."""

from dataclasses import dataclass
from typing import Optional

from runner.errors import RunnerError
from runner.options.registry import TARGETS
from runner.schema import TargetConfig


@TARGETS.option("runner.targets.function:Function")
@dataclass
class CallableTargetConfig(TargetConfig):
    name: str = "callable"
    # A dotted import path of a function (output (B, ...), classes (B,) int64) -> (B,) score, differentiable.
    _target_: Optional[str] = None  # noqa: UP045 (OmegaConf)

    def check(self) -> list[str]:
        if not self._target_:
            raise RunnerError(
                "target=callable needs `target._target_`: the dotted import path of a function"
                " (output, classes) -> (B,) score, e.g. target._target_=my_pkg.scores.margin."
            )
        return []
