"""What the language-model methods share (lm_patching, lm_grad_x_act, lm_logit_lens, lm_attention): they read prompt
pairs (data=prompts or ioi), choose their own layers and sites by name, and refuse what the model's layout alone shows
wrong before its weights load: `planned` is called by `check_layout` (the layout read from the model's config) and by
each method's `setup` (the loaded model's), so a check is written once. Every forward they make reads the target at
the last position only (`forward_last`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.data.prompts import pair_strings, position_ids
from runner.errors import RunnerError
from runner.layers import Layer
from runner.methods.base import Method
from runner.methods.lm.corruptions import Corruption
from runner.runtime import Runtime
from runner.schema import MethodConfig


@dataclass
class TokenPairs:
    """A batch of prompt pairs as the LM methods read it (the saliency methods read only the clean prompts)."""

    clean: torch.Tensor  # (B, T) left-padded token ids
    corrupted: torch.Tensor  # (B, T), padded as `clean` (the pair's two prompts have the same length)
    mask: torch.Tensor  # (B, T) 1 on real tokens
    answers: torch.Tensor  # (B, A) token sets padded with -1
    distractors: torch.Tensor  # (B, A)

    @property
    def pads(self) -> torch.Tensor:
        """(B,) padding tokens on the left of each row: the table's position p is row index pads + p."""
        return self.mask.shape[1] - self.mask.sum(1)


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

    def prompts(self, batch: Batch) -> TokenPairs:
        """The batch's prompt pairs; refused: another kind of batch (these methods read token ids, not images)."""
        if batch.x.dim() != 3 or batch.extras is None:
            raise RunnerError(f"method={self.name} takes prompt pairs: use data=prompts.")
        extras = batch.extras
        return TokenPairs(batch.x[:, 0], batch.x[:, 1], extras["attention_mask"], extras["answers"],
                           extras["distractors"])  # fmt: skip

    def strings(self, batch: Batch) -> list[dict[str, Any]]:
        """Each pair's clean tokens as strings and its answer and distractor (empty without a data set of pairs)."""
        return [pair_strings(self.dataset, sample_id) for sample_id in batch.sample_ids]


def forward_last(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The model's output on left-padded prompts `ids` (B, T): positions counted from each row's first real token,
    no key/value cache, and logits at the last position only (the same index for every row: where the target is
    read), so no (B, T, vocabulary) tensor is made. The caller chooses gradient, autocast and hooks around it."""
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                 logits_to_keep=1)  # fmt: skip


def chosen_once(key: str, chosen: list[int] | None, every: list[int], first: str) -> list[int]:
    """`chosen` (None: all of `every`), refused unless it names each of `every` at most once and at least one;
    `first` says `every`'s first value in the message (a layer -1 is the embeddings)."""
    picked = list(every) if chosen is None else list(chosen)
    if not picked or len(set(picked)) != len(picked) or any(value not in every for value in picked):
        raise RunnerError(f"{key}={picked}: each of {first} .. {every[-1]}, once (at least one).")
    return picked


class CorruptedPairsMethod(LanguageModelMethod):
    """The base of the methods that run each pair's corrupted prompt beside its clean one (lm_patching, lm_edges):
    the corruption, made from the method's settings and prepared from the data set, and the flags already warned
    about in the run."""

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
