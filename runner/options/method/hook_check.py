"""`hook_check`: are the values hooks capture the values the network computes?"""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.registry import METHODS
from runner.schema import MethodConfig


@METHODS.option("runner.methods.hook_check:HookCheck", tables=("hook_check",))
@dataclass
class HookCheckConfig(MethodConfig):
    name: str = "hook_check"
    tolerance: float = 1e-5  # max abs difference allowed
