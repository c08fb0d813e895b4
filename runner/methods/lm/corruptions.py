"""What the corrupted run of a pair is (method.patching.corruption.kind).

  pair      the pair's own corrupted prompt;
  resample  another pair's clean prompt of the same token length, from the whole data source (per pair, chosen by
            its index with corruption.seed); the answer and distractor stay the pair's own;
  noise     the clean prompt, Gaussian noise of std x the embedding output's std added to the embedding output on
            `span` (causal tracing, Meng et al. 2022): the embedding matrix's std times the scale the embedding
            module applies to its rows (Gemma's: sqrt(d_model)), so that the noise is on the scale of what it edits;
            `span: subject` is each pair's own subject tokens (its `subject` in the data), as in ROME;
  zero      the clean prompt, the embedding output on `span` replaced by zeros;
  mean      the clean prompt, the embedding output on `span` replaced by its mean over the data source's clean-prompt
            tokens.
The last three edit the embedding module's output (one hook, `EmbeddingEdit`), before any position embedding a model
adds after it; Gemma's scale is applied inside its embedding module (transformers 5), so the edit is of what the
first block receives. `span` null is every position but a leading BOS token (the model's bos_token_id), which is the
same in every prompt and the position most models park their attention on: editing it breaks the model rather than
removing what the prompt says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from runner.data.base import Batch, underlying
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.models.lm_sites import LanguageModelLayout
from runner.options.method.lm_patching import SUBJECT_SPAN, LmCorruption, LmCorruptionConfig
from runner.randomness import per_sample_normal, sample_generator

EMBEDDING_KINDS = (LmCorruption.noise, LmCorruption.zero, LmCorruption.mean)


@dataclass
class EmbeddingEdit:
    """The embedding output of a run becomes output * scale + shift: scale (rows, T, 1), shift (rows, T, D)."""

    scale: torch.Tensor
    shift: torch.Tensor

    def repeat(self, times: int) -> EmbeddingEdit:
        """The same edit for `times` copies of the batch stacked along the rows (a patched run's variants)."""
        return EmbeddingEdit(self.scale.repeat(times, 1, 1), self.shift.repeat(times, 1, 1))

    def suffix(self, start: int) -> EmbeddingEdit:
        """The edit of positions `start`.. (a run whose prefix is reused reads only those)."""
        return EmbeddingEdit(self.scale[:, start:], self.shift[:, start:])

    def rows(self, row: int) -> EmbeddingEdit:
        """The edit of one pair (row `row` of the batch) alone."""
        return EmbeddingEdit(self.scale[row : row + 1], self.shift[row : row + 1])

    def apply(self, output: torch.Tensor) -> torch.Tensor:
        return output * self.scale.to(output.device, output.dtype) + self.shift.to(output.device, output.dtype)


@dataclass
class Corrupted:
    """A batch's corrupted run: its token ids (B, T), the edit of its embeddings (None: none) and, per pair, what
    the `corrupted_id` column names."""

    ids: torch.Tensor
    edit: EmbeddingEdit | None
    names: list[str]


class Corruption:
    """Makes the corrupted run of each batch, as `corruption.kind` says; `active` is the edit the embedding hook
    applies to the forward running now (the method sets it around the runs that take it)."""

    def __init__(self, cfg: LmCorruptionConfig, key: str = "method.patching.corruption") -> None:
        self.cfg, self.key = cfg, key  # key: where the config sits, as messages name it
        self.kind = LmCorruption(cfg.kind)
        self.active: EmbeddingEdit | None = None
        self.pairs: list[Any] = []  # the data source's PromptPair list (resample, mean); empty: no data set
        self.index: dict[str, int] = {}  # sample id -> its index in `pairs`
        self.by_length: dict[int, list[int]] = {}  # token length -> the indices of the pairs that long

    def prepare(self, dataset: Dataset) -> None:
        """Read the data source's pairs (from under any Subset: a subset or a shard resamples from the same pool)
        and refuse a resample that some pair of this run cannot have."""
        self.pairs = list(getattr(underlying(dataset), "pairs", []))
        self.index = {p.sample_id: i for i, p in enumerate(self.pairs)}
        self.by_length = {}
        for i, pair in enumerate(self.pairs):
            self.by_length.setdefault(len(pair.clean), []).append(i)
        self._refuse_what_the_pairs_lack()
        if self.kind is LmCorruption.resample:
            alone = [self.pairs[self.index[i]] for i in _sample_ids(dataset) if i in self.index]
            alone = [p for p in alone if len(self.by_length[len(p.clean)]) < 2]
            if alone:
                shown = ", ".join(f"{p.sample_id} ({len(p.clean)} tokens)" for p in alone[:5])
                raise RunnerError(
                    f"{self.key}.kind=resample takes another pair's clean prompt of the same token"
                    f" length, and no other pair has the length of {shown}: add pairs of that length, or use"
                    " corruption.kind=pair."
                )

    def _refuse_what_the_pairs_lack(self) -> None:
        """A pair without its own corrupted prompt under kind=pair (the clean one stood in: every cell would patch a
        run into itself), and a span past a prompt's end (nothing, or less than asked, would be edited)."""
        if self.kind is LmCorruption.pair:
            lacking = [p.sample_id for p in self.pairs if not getattr(p, "corrupted_given", True)]
            if lacking:
                raise RunnerError(
                    f"{self.key}.kind=pair runs each pair's own corrupted prompt, and pair(s)"
                    f" {', '.join(lacking[:5])} have none: give them `corrupted`, or use corruption.kind=noise, zero,"
                    " mean or resample (which edit or replace the clean prompt)."
                )
        if self.kind in EMBEDDING_KINDS and self.cfg.span == SUBJECT_SPAN:
            lacking = [p.sample_id for p in self.pairs if getattr(p, "subject_span", None) is None]
            if lacking or not self.pairs:
                raise RunnerError(
                    f"{self.key}.span=subject edits each pair's subject tokens, and"
                    f" {'pair(s) ' + ', '.join(lacking[:5]) + ' have' if lacking else 'these prompts have'} no"
                    " `subject`: give each pair its subject (text of its clean prompt) in the data, or a span"
                    " [start, end)."
                )
        elif self.kind in EMBEDDING_KINDS and self.cfg.span is not None and self.pairs:
            start, end = self.cfg.span
            short = min(self.pairs, key=lambda p: len(p.clean))
            if len(short.clean) < end:
                raise RunnerError(
                    f"{self.key}.span=[{start}, {end}] reaches past pair {short.sample_id}, which has"
                    f" {len(short.clean)} tokens (positions 0-{len(short.clean) - 1}, BOS included): the span is"
                    f" [start, end) in the table's positions; give end <= {len(short.clean)}."
                )

    def setup(
        self, session: HookSession, model: nn.Module, layout: LanguageModelLayout, interpolated: bool = False
    ) -> None:
        """Hook the embedding module (embedding corruptions, or any corruption when the runs are `interpolated`
        between the corrupted and clean embeddings: lm_edges' EAP-IG) and compute what they need from the model."""
        self.bos = getattr(model.config, "bos_token_id", None)
        if self.kind in (LmCorruption.resample, LmCorruption.mean) and not self.pairs:
            raise RunnerError(
                f"{self.key}.kind={self.kind.value} draws on the data set's prompts: run it with"
                " data=prompts (or lm_activation_patching), not on bare token ids."
            )
        if self.kind in EMBEDDING_KINDS and self.cfg.span == SUBJECT_SPAN and not self.pairs:
            raise RunnerError(
                f"{self.key}.span=subject reads each pair's subject from the data: run it with"
                " data=prompts (or lm_activation_patching), not on bare token ids."
            )
        if self.kind not in EMBEDDING_KINDS and not interpolated:
            return
        embed = dict(model.named_modules())[layout.arch.embed]
        session.add_hook(embed, self._edit, pre=False)
        if self.kind not in EMBEDDING_KINDS:
            return
        self.embed_std = float(embed.weight.detach().float().std()) * _output_scale(embed)
        self.dim = int(embed.weight.shape[1])
        if self.kind is LmCorruption.mean:
            self.mean = self._mean_embedding(embed)

    def _edit(self, module: nn.Module, args: Any, kwargs: Any, output: torch.Tensor) -> Any:
        return None if self.active is None else self.active.apply(output)

    def _mean_embedding(self, embed: nn.Module) -> torch.Tensor:
        """(D,) the embedding output averaged over every token of the data source's clean prompts, a leading BOS
        left out (as the default span leaves it out); the pairs are unpadded, so no padding counts."""
        ids = [t for p in self.pairs for t in p.clean[1 if p.clean[:1] == [self.bos] else 0 :]]
        if not ids:
            raise RunnerError(f"{self.key}.kind=mean: the prompts have no token besides BOS to average.")
        weight = embed.weight
        with torch.no_grad():
            out = embed(torch.tensor(ids, dtype=torch.long, device=weight.device))  # no edit is active here
        return out.float().mean(0).cpu()

    # ---- one batch ------------------------------------------------------------------------------------
    def corrupt(self, batch: Batch, clean: torch.Tensor, corrupted: torch.Tensor, mask: torch.Tensor) -> Corrupted:
        """The corrupted run of `batch` (clean and corrupted ids (B, T), left-padded as `mask` says)."""
        ids = list(batch.sample_ids)
        if self.kind is LmCorruption.pair:
            return Corrupted(corrupted, None, [f"{i} (corrupted)" for i in ids])
        if self.kind is LmCorruption.resample:
            return self._resample(ids, corrupted)
        where = self.span_mask(clean, mask, ids)  # (B, T)
        b, t = where.shape
        keep = (~where).float()[..., None]
        if self.kind is LmCorruption.noise:
            c = self.cfg
            shift = torch.zeros((b, t, self.dim))
            for row, length in enumerate(mask.sum(1).tolist()):
                # Drawn at the pair's own length and placed after its padding: position p of the pair gets row p
                # of its own draw, whatever the batch it shares (and so whatever padding it gets).
                noise = per_sample_normal([length, self.dim], c.seed, [batch.first_index + row], "lm_noise")[0]
                shift[row, t - length :] = noise * (c.std * self.embed_std)
            shift *= where[..., None].to(shift.dtype)
            edit = EmbeddingEdit(torch.ones((b, t, 1)), shift)
        elif self.kind is LmCorruption.zero:
            edit = EmbeddingEdit(keep, torch.zeros((b, t, self.dim)))
        else:
            edit = EmbeddingEdit(keep, where[..., None].float() * self.mean)
        return Corrupted(clean, edit, [f"{i} ({self.kind.value})" for i in ids])

    def span_mask(self, clean: torch.Tensor, mask: torch.Tensor, sample_ids: list[str]) -> torch.Tensor:
        """(B, T) True on the span's positions: [start, end) counted as the table's positions (a left-padded row's
        position p is its index pads + p); span null: every position but a leading BOS; span subject: the row's
        pair's own subject tokens."""
        b, t = mask.shape
        pads = (t - mask.sum(1)).tolist()
        where = torch.zeros((b, t), dtype=torch.bool)
        for row in range(b):
            lead = pads[row]
            if self.cfg.span is None:
                start = 1 if self.bos is not None and lead < t and int(clean[row, lead]) == self.bos else 0
                where[row, lead + start :] = True
                continue
            if self.cfg.span == SUBJECT_SPAN:
                start, end = self.pairs[self.index[sample_ids[row]]].subject_span
            else:
                start, end = self.cfg.span
            where[row, min(t, lead + start) : min(t, lead + end)] = True
        return where

    def _resample(self, ids: list[str], corrupted: torch.Tensor) -> Corrupted:
        """Each pair's corrupted prompt: the clean prompt of a pair of the same length drawn by (seed, the pair's
        index in the data source), never the pair itself."""
        out = corrupted.clone()
        names = []
        for row, sample_id in enumerate(ids):
            own = self.index[sample_id]
            length = len(self.pairs[own].clean)
            others = [i for i in self.by_length[length] if i != own]
            pick = others[int(torch.randint(len(others), (1,), generator=sample_generator(self.cfg.seed, own,
                                                                                         "lm_resample")))]  # fmt: skip
            partner = self.pairs[pick]
            out[row, out.shape[1] - length :] = torch.tensor(partner.clean, dtype=out.dtype)
            names.append(partner.sample_id)
        return Corrupted(out, None, names)


def _output_scale(embed: nn.Module) -> float:
    """What the embedding module multiplies its rows by (1, or Gemma's sqrt(d_model) in transformers 5), measured on
    its largest row: the module's own output is what the noise is added to."""
    weight = embed.weight.detach()
    row = int(weight.float().norm(dim=1).argmax())
    with torch.no_grad():
        out = embed(torch.tensor([row], device=weight.device))
    return float(out.float().norm() / weight[row].float().norm())


def _sample_ids(dataset: Dataset) -> list[str]:
    """The sample ids a data set (a PromptPairs, possibly inside Subsets) holds, in order."""
    indices = list(range(len(dataset)))  # type: ignore[arg-type]
    while isinstance(dataset, Subset):
        indices = [int(dataset.indices[i]) for i in indices]
        dataset = dataset.dataset
    pairs = getattr(dataset, "pairs", [])
    return [pairs[i].sample_id for i in indices] if pairs else []
