"""`record`: no method of its own; runs the data through the model so the configured hooks fire."""

from __future__ import annotations

from dataclasses import dataclass

from runner.options.registry import METHODS
from runner.schema import MethodConfig


@METHODS.option("runner.methods.record:Record", tables=("hooks",))
@dataclass
class RecordConfig(MethodConfig):
    name: str = "record"
