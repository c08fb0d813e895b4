"""Clean/corrupted prompt pairs for a language model: written in the YAML, read from a JSONL or CSV file, or filled
into a template's slots from lists; an answer and a distractor token (or token sets) per pair. Read and checked with
the config, before any model loads: each pair a mapping with its keys, each id its own, a file UTF-8 with one JSON
object per line (the checks that need the tokenizer are runner/data/prompts.py's)."""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Optional

from runner.errors import RunnerError
from runner.fingerprints import file_digest
from runner.options.registry import DATA
from runner.schema import DataConfig

# data.file names of the pair files that ship with the package: (package, path inside it).
SHIPPED_PAIRS: dict[str, tuple[str, str]] = {
    "induction": ("runner.models", "lm_induction/induction_pairs.jsonl"),  # the shipped induction model's pairs
    "facts": ("runner.data", "prompt_sets/facts.jsonl"),  # subject-relation-object prompts (factual recall)
}


class Keep(str, Enum):
    all = "all"  # every pair
    correct = "correct"  # the pairs whose clean prompt's top next token (the model's) is one of the answers
    preferred = "preferred"  # the pairs whose clean prompt gives the answers a higher logit than the distractors


@dataclass
class TextDataConfig(DataConfig):
    """What every source of prompt pairs shares: the BOS policy and which pairs the run keeps."""

    # Prepend the tokenizer's BOS token to both prompts of every pair (false: the text's own tokens only). Positions
    # in the tables count from the first token the model sees (the BOS, when prepended).
    bos: bool = True
    # Which pairs the run keeps, decided by one forward of the clean prompts before the run (the count is logged;
    # the tables hold only the kept pairs): all | correct | preferred.
    keep: Keep = Keep.all

    MODALITY: ClassVar[str] = "text"


@DATA.option("runner.data.prompts:prompts_source")
@dataclass
class PromptsConfig(TextDataConfig):
    name: str = "prompts"
    # Pairs in the YAML: [{clean: ..., corrupted: ..., answer: ..., distractor: ...}] (answer and distractor: a
    # string of one token, or a list of such strings: a token set); an optional `id` names the pair, an optional
    # `subject` (text of the clean prompt) the tokens that method.patching.corruption.span=subject edits.
    pairs: list[Any] = field(default_factory=list)
    # A JSONL (one pair per line) or CSV (columns clean, corrupted, answer, distractor[, id, subject]) file of pairs;
    # `induction`: the pairs shipped with the induction model; `facts`: the shipped factual-recall prompts.
    file: Optional[str] = None  # noqa: UP045 (OmegaConf)
    # A template with {slots}, filled from `slots` (lists of equal length, one pair per index) for the clean prompt
    # and from `corrupted_slots` (the slots that change; the others are kept) for the corrupted one.
    template: Optional[str] = None  # noqa: UP045 (OmegaConf)
    answer: Optional[str] = None  # the template's answer, e.g. " {IO}"  # noqa: UP045 (OmegaConf)
    distractor: Optional[str] = None  # e.g. " {S}"  # noqa: UP045 (OmegaConf)
    slots: dict[str, list[str]] = field(default_factory=dict)
    corrupted_slots: dict[str, list[str]] = field(default_factory=dict)

    def check(self) -> list[str]:
        bad = super().check()
        given = [k for k, v in (("pairs", self.pairs), ("file", self.file), ("template", self.template)) if v]
        if len(given) > 1:  # none given: the data set says so when it is built (a YAML may add them later)
            raise RunnerError(
                "data=prompts takes its pairs from exactly one of data.pairs (in the YAML), data.file (JSONL or CSV)"
                f" and data.template (with data.slots); given: {', '.join(given) or 'none'}."
            )
        if self.template and not (self.answer and self.distractor and self.slots):
            raise RunnerError(
                "data.template needs data.answer and data.distractor (templates such as ' {IO}') and data.slots"
                " (lists of values, one per pair)."
            )
        if given and self.file not in SHIPPED_PAIRS:  # before the model loads: what is wrong without its tokenizer
            checked_pairs(self.raw_pairs())
        return bad

    def raw_pairs(self) -> list[Any]:
        """The pairs as written (dicts of clean, corrupted, answer, distractor[, id]): the YAML's, a file's or the
        template's, unchecked. Not the shipped file's (runner/data/prompts.py reads it from the package)."""
        if self.pairs:
            return [dict(p) if isinstance(p, Mapping) else p for p in self.pairs]  # a non-mapping is refused by name
        if self.file:
            file = Path(self.file).expanduser()
            if not file.is_file():
                raise RunnerError(
                    f"data.file={self.file}: no such file. Give a JSONL or CSV file of pairs, or one of the shipped"
                    f" sets: data.file={' | '.join(SHIPPED_PAIRS)}."
                )
            return read_pairs_file(file, self.limit)
        return self._from_template() if self.template else []

    def _from_template(self) -> list[dict[str, Any]]:
        """One pair per index of the slot lists: the clean prompt from `slots`, the corrupted one with
        `corrupted_slots`' values in place of theirs (every other slot kept)."""
        assert self.template and self.answer and self.distractor
        sizes = {name: len(values) for name, values in {**self.slots, **self.corrupted_slots}.items()}
        if len(set(sizes.values())) != 1:
            raise RunnerError(
                f"data.slots and data.corrupted_slots must be lists of one length (one value per pair): {sizes}."
            )
        unknown = sorted(set(self.corrupted_slots) - set(self.slots))
        if unknown:
            raise RunnerError(f"data.corrupted_slots names slots data.slots lacks: {', '.join(unknown)}.")
        pairs = []
        for i in range(next(iter(sizes.values()))):
            clean = {name: values[i] for name, values in self.slots.items()}
            corrupted = {**clean, **{name: values[i] for name, values in self.corrupted_slots.items()}}
            try:
                pairs.append({
                    "clean": self.template.format(**clean), "corrupted": self.template.format(**corrupted),
                    "answer": self.answer.format(**clean), "distractor": self.distractor.format(**clean),
                })  # fmt: skip
            except KeyError as e:
                raise RunnerError(f"data.template names the slot {e} that data.slots lacks.") from None
        return pairs

    def fingerprint(self) -> dict[str, str]:
        """The pairs file's contents: a resume must find the same pairs."""
        if self.file and self.file not in SHIPPED_PAIRS:
            file = Path(self.file).expanduser()
            if file.is_file():
                return {"data.file (contents)": f"sha256:{file_digest(file)}"}
        return {}


def read_pairs_file(file: Path, limit: int | None = None) -> list[Any]:
    """A JSONL (one object per line) or CSV file of pairs, read as UTF-8 line by line, up to its first `limit` pairs
    (data.limit: the rest of a large file is never read); a line that is no JSON object is refused by its number."""
    try:
        with file.open(encoding="utf-8", newline="") as handle:
            if file.suffix.lower() == ".csv":
                return [dict(row) for row in itertools.islice(csv.DictReader(handle), limit)]
            return _json_lines(file, handle, limit)
    except UnicodeDecodeError:
        raw = file.read_bytes()  # where the bad byte is, in the whole file (only on this error)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise RunnerError(
                f"{file}:{line} is not UTF-8 (byte 0x{raw[e.start]:02x}): save the file as UTF-8."
            ) from None
        raise
    except OSError as e:
        raise RunnerError(f"Cannot read data.file={file} ({e.strerror or e}).") from None


def _json_lines(file: Path, handle: Any, limit: int | None) -> list[Any]:
    pairs: list[Any] = []
    for number, line in enumerate(handle, 1):
        if limit is not None and len(pairs) >= limit:
            break
        if line.strip():
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunnerError(f"{file}:{number} is not a JSON object ({e.msg}): one pair per line.") from None
            if not isinstance(item, dict):  # a list, a string, a number or null: no pair's keys
                raise RunnerError(
                    f"{file}:{number} is a JSON {_json_kind(item)}, not an object: one pair per line, as"
                    ' {"clean": ..., "corrupted": ..., "answer": ..., "distractor": ...}.'
                )
            pairs.append(item)
    return pairs


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def pair_id(index: int, item: dict[str, Any]) -> str:
    """A pair's sample id: its own `id`, else pair-INDEX."""
    return str(item.get("id") or f"pair-{index}")


def checked_pairs(raw: list[Any]) -> list[dict[str, Any]]:
    """The pairs, each a mapping with clean, answer and distractor (corrupted: where the corruption reads it), and
    each id its own: rows find their pair by id, so two pairs of one id would score one on the other's answer."""
    seen: dict[str, int] = {}
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RunnerError(f"Prompt pair {index} (counted from 0) is {item!r}, not a mapping of clean, answer and"
                              " distractor (and corrupted).")  # fmt: skip
        sample_id = pair_id(index, item)
        missing = [k for k in ("clean", "answer", "distractor") if not item.get(k)]
        if missing:
            raise RunnerError(f"Prompt pair {sample_id} lacks {', '.join(missing)}: each pair needs clean, answer and"
                              " distractor (and corrupted, for corruption.kind=pair).")  # fmt: skip
        subject = item.get("subject")
        if subject is not None and (not isinstance(subject, str) or not subject or subject not in str(item["clean"])):
            raise RunnerError(
                f"Prompt pair {sample_id}: its subject {subject!r} is not text of its clean prompt"
                f" {str(item['clean'])!r}: give `subject` as it is written in the prompt (or leave it out)."
            )
        _check_roles(sample_id, item)
        if sample_id in seen:
            raise RunnerError(
                f"Prompt pairs {seen[sample_id]} and {index} (counted from 0) share the id {sample_id!r}: give each"
                " pair its own `id` (or none: pair-N is its index)."
            )
        seen[sample_id] = index
    return raw


def _check_roles(sample_id: str, item: dict[str, Any]) -> None:
    """A pair's optional `roles`: {name: [start, end)} character spans of its clean prompt (IOI's IO, S1, S2)."""
    roles = item.get("roles")
    if roles is None:
        return
    length = len(str(item["clean"]))
    spans_ok = isinstance(roles, dict) and all(
        isinstance(name, str) and name and isinstance(span, (list, tuple)) and len(span) == 2
        and all(isinstance(v, int) for v in span) and 0 <= span[0] < span[1] <= length
        for name, span in roles.items()
    )  # fmt: skip
    if not spans_ok or "end" in roles:
        raise RunnerError(
            f"Prompt pair {sample_id}: its roles {roles!r} are not {{name: [start, end]}} character spans of its clean"
            f' prompt ({length} characters), e.g. {{"IO": [9, 14]}}; `end` is the last position\'s own role.'
        )
