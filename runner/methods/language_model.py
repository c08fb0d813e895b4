"""What the language-model methods share (lm_patching, lm_grad_x_act, lm_logit_lens, lm_attention): they read prompt
pairs (data=prompts or ioi), choose their own layers and sites by name, and refuse what the model's layout alone shows
wrong before its weights load: `planned` is called by `check_layout` (the layout read from the model's config) and by
each method's `setup` (the loaded model's), so a check is written once."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.data.prompts import pair_strings
from runner.layers import Layer
from runner.methods.base import Method
from runner.runtime import Runtime
from runner.schema import MethodConfig


class LanguageModelMethod(Method):
    needs_layers = False
    modality = "text"

    def __init__(self, cfg: Any, layers: list[Layer], runtime: Runtime) -> None:
        self.cfg, self.runtime = cfg, runtime
        self.dataset: Dataset | None = None

    def prepare(self, dataset: Dataset) -> None:
        self.dataset = dataset

    @classmethod
    def planned(cls, cfg: Any, layout: Any, target: Any) -> Any:
        """What the method reads of a model of `layout` for the run's `target`; every refusal the layout alone earns
        is raised here."""
        raise NotImplementedError

    @classmethod
    def check_layout(cls, cfg: MethodConfig, layout: Any, target: Any) -> None:
        cls.planned(cfg, layout, target)

    def strings(self, batch: Batch) -> list[dict[str, Any]]:
        """Each pair's clean tokens as strings and its answer and distractor (empty without a data set of pairs)."""
        return [pair_strings(self.dataset, sample_id) for sample_id in batch.sample_ids]
