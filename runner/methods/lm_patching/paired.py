"""The base of the language-model methods that run each pair's corrupted prompt beside its clean one (lm_patching,
lm_edges): the corruption, made from the method's settings and prepared from the data set, and the flags already
warned about in the run."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from runner.layers import Layer
from runner.methods.language_model import LanguageModelMethod
from runner.methods.lm_patching.corruptions import Corruption
from runner.runtime import Runtime


class CorruptedPairsMethod(LanguageModelMethod):
    def __init__(self, cfg: Any, layers: list[Layer], runtime: Runtime, settings: Any, key: str) -> None:
        """`settings`: the method's own block of the config, with its `corruption`; `key`: where that block sits
        (method.patching, method.edges), as messages name it."""
        super().__init__(cfg, layers, runtime)
        self.p, self.key = settings, key
        self.warned: set[str] = set()  # flags (degenerate, small_span) already warned about in this run
        self.corruption = Corruption(settings.corruption, f"{key}.corruption")

    def prepare(self, dataset: Dataset) -> None:
        super().prepare(dataset)
        self.corruption.prepare(dataset)
