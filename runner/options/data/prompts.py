"""Clean/corrupted prompt pairs for a language model: written in the YAML, read from a JSONL or CSV file, or filled
into a template's slots from lists; an answer and a distractor token (or token sets) per pair."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from runner.errors import RunnerError
from runner.fingerprints import file_digest
from runner.options.registry import DATA
from runner.schema import DataConfig

# data.file of the pairs that ship with the induction model (runner/models/lm_induction/induction_pairs.jsonl).
SHIPPED_PAIRS = "induction"


@DATA.option("runner.data.prompts:prompts_source")
@dataclass
class PromptsConfig(DataConfig):
    name: str = "prompts"
    # Pairs in the YAML: [{clean: ..., corrupted: ..., answer: ..., distractor: ...}] (answer and distractor: a
    # string of one token, or a list of such strings: a token set); an optional `id` names the pair.
    pairs: list[Any] = field(default_factory=list)
    # A JSONL (one pair per line) or CSV (columns clean, corrupted, answer, distractor[, id]) file of pairs;
    # `induction`: the pairs shipped with the induction model.
    file: Optional[str] = None  # noqa: UP045 (OmegaConf)
    # A template with {slots}, filled from `slots` (lists of equal length, one pair per index) for the clean prompt
    # and from `corrupted_slots` (the slots that change; the others are kept) for the corrupted one.
    template: Optional[str] = None  # noqa: UP045 (OmegaConf)
    answer: Optional[str] = None  # the template's answer, e.g. " {IO}"  # noqa: UP045 (OmegaConf)
    distractor: Optional[str] = None  # e.g. " {S}"  # noqa: UP045 (OmegaConf)
    slots: dict[str, list[str]] = field(default_factory=dict)
    corrupted_slots: dict[str, list[str]] = field(default_factory=dict)
    # Prepend the tokenizer's BOS token to both prompts of every pair (false: the text's own tokens only). Positions
    # in the tables count from the first token the model sees (the BOS, when prepended).
    bos: bool = True

    MODALITY: ClassVar[str] = "text"

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
        return bad

    def fingerprint(self) -> dict[str, str]:
        """The pairs file's contents: a resume must find the same pairs."""
        if self.file and self.file != SHIPPED_PAIRS:
            file = Path(self.file).expanduser()
            if file.is_file():
                return {"data.file (contents)": f"sha256:{file_digest(file)}"}
        return {}
