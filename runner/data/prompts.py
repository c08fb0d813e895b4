"""Prompt pairs for a language model (`data=prompts`), tokenised and checked before the run.

A sample is one pair: its clean and corrupted token ids stacked (2, T), with its answer and distractor token sets.
The pairs' structure and ids are checked with the config (runner/options/data/prompts.py); here, with the model's
tokenizer: both prompts tokenise to the same length (patching position p of one into the other only means something
when the positions line up), no word becomes the tokenizer's unknown token (the model would read that token, not
the word), answers and distractors are one known token each, and the BOS policy (data.bos) is applied to both sides.
A pair without `corrupted` takes its clean prompt in its place (`corrupted_given` False): the corruptions that edit
the clean prompt do not read it, and the one that does (lm_patching's `pair`) refuses such a pair. A batch is
left-padded to its longest pair (the last token, where the answer is read, is at the same index for every pair);
the model gets the attention mask and `position_ids = cumsum(mask) - 1`, so a padded pair is computed as it would
be alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.data.base import Batch, to_batch, underlying
from runner.errors import RunnerError
from runner.options.data.prompts import (
    SHIPPED_PAIRS,
    Keep,
    PromptsConfig,
    TextDataConfig,
    checked_pairs,
    pair_id,
    read_pairs_file,
)
from runner.targets.tokens import set_mean

log = logging.getLogger(__name__)

NO_TOKEN = -1  # padding of the answer and distractor sets


@dataclass
class PromptPair:
    sample_id: str
    clean: list[int]  # token ids, BOS included when prepended
    corrupted: list[int]
    answers: list[int]
    distractors: list[int]
    tokens: list[str]  # the clean prompt's tokens as strings, by position
    answer_tokens: list[str]
    distractor_tokens: list[str]
    corrupted_given: bool = True  # False: the pair had no `corrupted` and its clean prompt stands in
    subject_span: tuple[int, int] | None = None  # [start, end) positions of its `subject`'s tokens (BOS counted)
    texts: list[str] | None = None  # each clean token decoded (" Jacob" for `ĠJacob` or `▁Jacob`), by position
    answer_texts: list[str] | None = None
    distractor_texts: list[str] | None = None
    roles: list[str | None] | None = None  # each position's role (IO, S1, S2, subject, end, ...; None: none)


class PromptPairs(Dataset):
    """Tokenised pairs; `collate` makes a batch (x (B, 2, T) left-padded ids, answers (B,), ids, extras)."""

    modality = "text"
    model_labels = False
    classes = None

    def __init__(self, pairs: list[PromptPair], pad_id: int, tokenizer: Any = None) -> None:
        self.pairs, self.pad_id = pairs, pad_id
        self.tokenizer = tokenizer  # names tokens a method finds (the logit lens' top token)
        self.by_id = {p.sample_id: p for p in pairs}

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        pair = self.pairs[i]
        return torch.tensor([pair.clean, pair.corrupted], dtype=torch.long), pair.answers[0], pair.sample_id

    def collate(self, samples: list[tuple[torch.Tensor, int, str]]) -> tuple[Any, ...]:
        """Left-pad a batch of pairs; the extras carry the attention mask and the answer and distractor sets."""
        length = max(x.shape[1] for x, _, _ in samples)
        b = len(samples)
        x = torch.full((b, 2, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, length), dtype=torch.long)
        pairs = [self.by_id[i] for _, _, i in samples]
        widest = max(max(len(p.answers), len(p.distractors)) for p in pairs)
        answers = torch.full((b, widest), NO_TOKEN, dtype=torch.long)
        distractors = torch.full((b, widest), NO_TOKEN, dtype=torch.long)
        for row, ((ids, _, _), pair) in enumerate(zip(samples, pairs, strict=True)):
            x[row, :, length - ids.shape[1] :] = ids
            mask[row, length - ids.shape[1] :] = 1
            answers[row, : len(pair.answers)] = torch.tensor(pair.answers)
            distractors[row, : len(pair.distractors)] = torch.tensor(pair.distractors)
        labels = torch.tensor([y for _, y, _ in samples], dtype=torch.long)
        extras = {"attention_mask": mask, "answers": answers, "distractors": distractors}
        return x, labels, [i for _, _, i in samples], extras


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens: a left-padded prompt gets the positions it would have alone."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def prompts_source(cfg: PromptsConfig, tokenizer: Any, seed: int) -> Dataset:
    """The configured pairs, tokenised with the model's tokenizer and checked."""
    if tokenizer is None or not callable(tokenizer):
        raise RunnerError("data=prompts is text for a language model: use model=hf_lm (it brings a tokenizer).")
    raw = _raw_pairs(cfg)
    if not raw:
        raise RunnerError(
            "data=prompts has no pairs: give data.pairs, data.file (data.file=induction: the pairs of the shipped"
            " induction model) or data.template with data.slots."
        )
    bos = _bos_id(tokenizer) if cfg.bos else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    pairs = [_tokenised(i, item, tokenizer, bos) for i, item in enumerate(raw)]
    return PromptPairs(pairs, int(pad), tokenizer)


def _bos_id(tokenizer: Any) -> int:
    bos = tokenizer.bos_token_id
    if bos is None:
        raise RunnerError(
            "data.bos=true prepends the tokenizer's BOS token, but this tokenizer has none: set data.bos=false."
        )
    return int(bos)


def _raw_pairs(cfg: PromptsConfig) -> list[dict[str, Any]]:
    """The configured pairs as dicts, checked for their structure and ids; a shipped file's from the package."""
    if cfg.file in SHIPPED_PAIRS:
        from importlib import resources

        package, path = SHIPPED_PAIRS[cfg.file]
        return checked_pairs(read_pairs_file(Path(str(resources.files(package) / path))))
    return checked_pairs(cfg.raw_pairs())


def _tokenised(index: int, item: dict[str, Any], tokenizer: Any, bos: int | None) -> PromptPair:
    sample_id = pair_id(index, item)
    given = bool(item.get("corrupted"))
    prefix = [bos] if bos is not None else []
    clean = prefix + _known_ids(tokenizer, str(item["clean"]), sample_id, "clean prompt")
    corrupted = prefix + _known_ids(tokenizer, str(item["corrupted"] if given else item["clean"]), sample_id,
                                    "corrupted prompt")  # fmt: skip
    if len(clean) != len(corrupted):
        raise RunnerError(
            f"Prompt pair {sample_id}: the clean prompt is {len(clean)} tokens and the corrupted one {len(corrupted)};"
            f" patching needs them aligned position by position. Clean: {_shown(tokenizer, clean)}; corrupted:"
            f" {_shown(tokenizer, corrupted)}. Choose values that tokenise to as many tokens."
        )
    answers = [_one_token(tokenizer, t, sample_id, "answer") for t in _listed(item["answer"])]
    distractors = [_one_token(tokenizer, t, sample_id, "distractor") for t in _listed(item["distractor"])]
    tokens = [tokenizer.convert_ids_to_tokens(t) for t in clean]
    subject = item.get("subject") or None
    text = str(item["clean"])
    span = _subject_span(tokenizer, text, str(subject), len(prefix), sample_id) if subject else None
    spans = dict(item.get("roles") or {})
    if subject:
        spans.setdefault("subject", [text.index(str(subject)), text.index(str(subject)) + len(str(subject))])
    roles = _roles(tokenizer, text, spans, len(prefix), len(clean), sample_id)
    answer_tokens, distractor_tokens = (
        tokenizer.convert_ids_to_tokens(answers),
        tokenizer.convert_ids_to_tokens(distractors),
    )
    return PromptPair(sample_id, clean, corrupted, answers, distractors, tokens, answer_tokens, distractor_tokens,
                      given, span, decoded(tokenizer, tokens), decoded(tokenizer, answer_tokens),
                      decoded(tokenizer, distractor_tokens), roles)  # fmt: skip


def _roles(
    tokenizer: Any, text: str, spans: dict[str, list[int]], first: int, length: int, sample_id: str
) -> list[str | None]:
    """Each position's role: the role whose character span (`spans`, of `text`) the token overlaps, `end` for the
    last position; None elsewhere (BOS, positions no role names)."""
    roles: list[str | None] = [None] * length
    if spans:
        offsets = _offsets(tokenizer, text, sample_id, "roles")
        for name, (start, end) in spans.items():
            for i, (a, b) in enumerate(offsets):
                if a < end and b > start and b > a:
                    roles[first + i] = name
    roles[-1] = roles[-1] or "end"
    return roles


def _offsets(tokenizer: Any, text: str, sample_id: str, what: str) -> list[tuple[int, int]]:
    """Each token's [start, end) characters in `text`, from the (fast) tokenizer."""
    try:
        found = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, ValueError, KeyError):
        raise RunnerError(
            f"Prompt pair {sample_id} names {what}, whose tokens are found through the tokenizer's character"
            " offsets, and this (slow) tokenizer has none: use the model's fast tokenizer (tokenizer.json)."
        ) from None
    return [(int(a), int(b)) for a, b in found]


def decoded(tokenizer: Any, tokens: list[str]) -> list[str]:
    """Each token as the text it stands for, decoded alone by the tokenizer (`ĠJacob` and `▁Jacob` as " Jacob")."""
    return [tokenizer.convert_tokens_to_string([token]) for token in tokens]


def _subject_span(tokenizer: Any, text: str, subject: str, first: int, sample_id: str) -> tuple[int, int]:
    """[start, end) positions of the tokens that carry the first occurrence of `subject` in `text`, counted from
    the first token the model sees (`first`: the positions before the text, a prepended BOS)."""
    spans = _offsets(tokenizer, text, sample_id, "a subject")
    start = text.index(subject)  # the option checked that it is there
    end = start + len(subject)
    inside = [i for i, (a, b) in enumerate(spans) if a < end and b > start and b > a]
    return first + inside[0], first + inside[-1] + 1


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _known_ids(tokenizer: Any, text: str, sample_id: str, what: str) -> list[int]:
    """`text`'s token ids, refused when a word of it is outside the vocabulary: it would become the unknown token,
    and the model would read that token where the prompt says the word."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, spans = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    except (NotImplementedError, ValueError, KeyError):  # a slow tokenizer has no offsets: the text as a whole
        ids = _ids(tokenizer, text)
        spans = [(0, len(text))] * len(ids)
    unk, unk_text = getattr(tokenizer, "unk_token_id", None), str(getattr(tokenizer, "unk_token", None))
    # the unknown token's own text written out is not unknown (GPT-2's is its end-of-text token)
    unknown = [text[a:b] for i, (a, b) in zip(ids, spans, strict=True) if i == unk and text[a:b] != unk_text]
    if unk is not None and unknown:
        raise RunnerError(
            f"Prompt pair {sample_id}: the {what} {text!r} has {', '.join(map(repr, unknown))} outside the tokenizer's"
            f" vocabulary (it would become {unk_text!r}): use words the model's tokenizer knows."
        )
    return ids


def _listed(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _one_token(tokenizer: Any, text: str, sample_id: str, what: str) -> int:
    ids = _known_ids(tokenizer, text, sample_id, what)
    if len(ids) != 1:
        raise RunnerError(
            f"Prompt pair {sample_id}: the {what} {text!r} is {len(ids)} tokens ({_shown(tokenizer, ids)}); an {what}"
            " must be one token (GPT-2-style tokenizers often need the leading space: ' Mary')."
        )
    return ids[0]


def _shown(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.convert_ids_to_tokens(ids))


def pair_strings(dataset: Dataset | None, sample_id: str) -> dict[str, Any]:
    """The pair's clean tokens as strings (by position), its answer and distractor as text; empty without a data
    set of pairs (a library call on token ids)."""
    dataset = underlying(dataset)
    pair = getattr(dataset, "by_id", {}).get(sample_id)
    if pair is None:
        return {"tokens": [], "texts": [], "roles": [], "answer": None, "distractor": None, "answer_text": None,
                "distractor_text": None}  # fmt: skip
    return {"tokens": pair.tokens, "texts": pair.texts or [], "roles": pair.roles or [],
            "answer": " ".join(pair.answer_tokens),
            "distractor": " ".join(pair.distractor_tokens), "answer_text": "|".join(pair.answer_texts or []),
            "distractor_text": "|".join(pair.distractor_texts or [])}  # fmt: skip


def pair_texts(strings: list[dict[str, Any]], rows: list[int], positions: list[int]) -> dict[str, list[Any]]:
    """The decoded columns beside the raw token ones: `token_text` (the clean token at each position), its `role`
    (IO, S1, S2, subject, end, ...), `answer_text` and `distractor_text` (" Mary"; a set's tokens joined by |)."""

    def at(key: str) -> list[Any]:
        return [strings[r][key][q] if q is not None and q < len(strings[r][key]) else None
                for r, q in zip(rows, positions, strict=True)]  # fmt: skip

    return {
        "token_text": at("texts"),
        "role": at("roles"),
        "answer_text": [strings[r]["answer_text"] for r in rows],
        "distractor_text": [strings[r]["distractor_text"] for r in rows],
    }


def tokenizer_of(dataset: Dataset | None) -> Any:
    """The tokenizer of a data set of pairs (under any Subset); None for another data set."""
    dataset = underlying(dataset)
    return getattr(dataset, "tokenizer", None)


def pairs_batch(pairs: list[dict[str, Any]], tokenizer: Any, bos: bool, device: torch.device) -> tuple[Dataset, Batch]:
    """A library call's pairs ([{clean, corrupted, answer, distractor}], as data.pairs takes them) as their data set
    and one batch of all of them on `device`, checked and left-padded as a run makes them."""
    dataset = prompts_source(PromptsConfig(pairs=pairs, bos=bos), tokenizer, 0)
    return dataset, to_batch(dataset.collate([dataset[i] for i in range(len(dataset))]), device, 0)


def kept_pairs(model: torch.nn.Module, dataset: Dataset, cfg: TextDataConfig, device: torch.device) -> Dataset:
    """The pairs of `dataset` (after data.limit) that `cfg.keep` keeps, judged on one forward of each clean prompt
    (batches of data.batch_size): `correct`, the model's top next token is one of the pair's answers; `preferred`,
    the answers' mean logit is above the distractors'. The count and the first ids left out are logged; none kept
    is an error (nothing to run). The kept pairs are the run's data source (a resample draws from them only)."""
    keep = Keep(cfg.keep)
    if keep is Keep.all:
        return dataset
    source: PromptPairs = underlying(dataset)  # type: ignore[assignment]
    samples = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
    pairs = [source.by_id[sample_id] for _, _, sample_id in samples]
    kept: list[PromptPair] = []
    left_out: list[str] = []
    for start in range(0, len(pairs), cfg.batch_size):
        part = pairs[start : start + cfg.batch_size]
        x, _, _, extras = source.collate(samples[start : start + cfg.batch_size])
        ids, mask = x[:, 0], extras["attention_mask"]
        with torch.no_grad():
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                        position_ids=position_ids(mask).to(device), use_cache=False, logits_to_keep=1)  # fmt: skip
        last = out.logits[:, -1].float().cpu()
        if keep is Keep.correct:
            good = (last.argmax(-1, keepdim=True) == extras["answers"]).any(-1)
        else:
            good = set_mean(last, extras["answers"]) > set_mean(last, extras["distractors"])
        for pair, right in zip(part, good.tolist(), strict=True):
            if right:
                kept.append(pair)
            else:
                left_out.append(pair.sample_id)
    what = {Keep.correct: "the model's top next token is the answer",
            Keep.preferred: "the model gives the answer a higher logit than the distractor"}[keep]  # fmt: skip
    if not kept:
        raise RunnerError(
            f"data.keep={keep.value} keeps the pairs where {what}, and none of the {len(pairs)} is such a pair:"
            " check the answers (and their leading space) against this model, or set data.keep=all."
        )
    shown = ", ".join(left_out[:8]) + (f" and {len(left_out) - 8} more" if len(left_out) > 8 else "")
    log.info("data.keep=%s: %d of %d pairs kept (%s); left out: %s", keep.value, len(kept), len(pairs), what,
             shown or "none")  # fmt: skip
    return PromptPairs(kept, source.pad_id, source.tokenizer)
