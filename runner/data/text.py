"""Windows of plain text for a language model (`data=text`; the source and its checks: runner/options/data/text.py).

The documents are joined with a blank line between them ("\\n\\n") and tokenised once, without special tokens; the
token stream is cut into consecutive windows of `context - 1` tokens, each with the tokenizer's BOS in front (or of
`context` tokens with data.bos=false, or where the tokenizer has no BOS), and the tail shorter than a window is left
out. `data.windows` draws that many of them by the run's seed, `data.limit` keeps the first of those; `data.holdout`
marks a share of what is kept (by the seed too, at least one) as held out: kept out of training, for evaluation.
Samples are listed in text order.

A sample is (token ids (context,), -1, "window-<its index in the text>"); every window has the same length, so a batch
(B, context) needs no padding. The batch's extras carry the attention mask (all ones) and `held_out` (B,) bool.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.errors import RunnerError
from runner.options.data.text import TextConfig, documents
from runner.randomness import sample_generator

log = logging.getLogger(__name__)

# More of the text than this as the tokenizer's unknown token: the tokenizer does not read this text (the shipped
# induction model's tokenizer knows only t00 .. t63), and the model would see one token over and over.
MAX_UNKNOWN = 0.5


class TextWindows(Dataset):
    """Token windows of one text; `collate` makes a batch (x (B, T) ids, labels (B,) -1, ids, extras)."""

    modality = "text"
    model_labels = False
    classes = None

    def __init__(self, windows: torch.Tensor, starts: list[int], held_out: set[int], bos: bool, tokenizer: Any,
                 seed: int) -> None:  # fmt: skip
        self.windows = windows  # (N, T) int64, in text order
        self.starts = starts  # each window's index in the whole text's windows (its sample id)
        self.held_out = held_out  # sample indices kept out of training
        self.bos = bos  # whether position 0 of every window is the BOS token
        self.tokenizer = tokenizer  # decodes the contexts a method shows
        self.seed = seed  # the run's seed, which drew the windows and the held-out ones
        self.index = {f"window-{start}": i for i, start in enumerate(starts)}  # sample id -> sample index

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        return self.windows[i], -1, f"window-{self.starts[i]}"

    def collate(self, samples: list[tuple[torch.Tensor, int, str]]) -> tuple[Any, ...]:
        """Stack a batch; the extras carry the attention mask and which windows are held out."""
        x = torch.stack([ids for ids, _, _ in samples])  # (B, T)
        held = torch.tensor([self.index[sample_id] in self.held_out for _, _, sample_id in samples])  # (B,) bool
        labels = torch.full((len(samples),), -1, dtype=torch.long)
        extras = {"attention_mask": torch.ones_like(x), "held_out": held}
        return x, labels, [sample_id for _, _, sample_id in samples], extras


def text_source(cfg: TextConfig, tokenizer: Any, seed: int) -> TextWindows:
    """The text of `cfg.source` as windows of `cfg.context` tokens of `tokenizer`, the held-out ones chosen by `seed`."""
    if tokenizer is None or not callable(tokenizer):
        raise RunnerError("data=text is text for a language model: use model=hf_lm (it brings a tokenizer).")
    stream = token_stream(documents(cfg.source), tokenizer, cfg.source)
    bos = tokenizer.bos_token_id if cfg.bos else None
    per = cfg.context - (1 if bos is not None else 0)  # text tokens per window
    count = len(stream) // per
    if count == 0:
        raise RunnerError(
            f"data.source={cfg.source} is {len(stream)} tokens, shorter than one window of data.context={cfg.context}:"
            " give more text or a smaller data.context."
        )
    chosen = list(range(count))
    if cfg.windows is not None and cfg.windows < count:
        order = torch.randperm(count, generator=sample_generator(seed, 0, "text.windows"))
        chosen = sorted(order[: cfg.windows].tolist())
    if cfg.limit is not None:  # the first of them, before the held-out ones are drawn (data.limit keeps only these)
        chosen = chosen[: cfg.limit]
    ids = torch.tensor(stream[: count * per], dtype=torch.long).view(count, per)[chosen]  # (N, per)
    if bos is not None:
        ids = torch.cat([torch.full((len(chosen), 1), int(bos), dtype=torch.long), ids], dim=1)  # (N, context)
    held_out = holdout_windows(len(chosen), cfg.holdout, seed)
    log.info("data=text: %d tokens of %s, %d windows of %d tokens (%d held out)", len(stream), cfg.source,
             len(chosen), cfg.context, len(held_out))  # fmt: skip
    return TextWindows(ids, chosen, held_out, bos is not None, tokenizer, seed)


def token_stream(texts: list[str], tokenizer: Any, source: str) -> list[int]:
    """The documents joined by blank lines, as one list of token ids without special tokens; refused when most of it
    is the tokenizer's unknown token."""
    stream = list(tokenizer("\n\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"])
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and stream:
        share = sum(1 for token in stream if token == unknown) / len(stream)
        if share > MAX_UNKNOWN:
            raise RunnerError(
                f"data.source={source}: {share:.0%} of its {len(stream)} tokens are the tokenizer's unknown token"
                f" {tokenizer.unk_token!r}: this model's tokenizer does not read this text. Give text in the model's"
                " vocabulary (the shipped induction model reads t00 .. t63)."
            )
    return stream


def holdout_windows(count: int, share: float, seed: int) -> set[int]:
    """The indices of round(share x count) of `count` windows (at least one when share > 0, at most count - 1),
    drawn by `seed`."""
    if share <= 0:
        return set()
    if count < 2:
        raise RunnerError(
            f"data.holdout={share} keeps windows out of training, and the text makes only {count} window: give more"
            " text, a smaller data.context, or data.holdout=0."
        )
    n = min(count - 1, max(1, round(share * count)))
    order = torch.randperm(count, generator=sample_generator(seed, 0, "text.holdout"))
    return set(order[:n].tolist())
