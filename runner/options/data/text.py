"""Plain text for a language model (`data=text`), cut into windows of `data.context` tokens: what a sparse
autoencoder is trained on (method=train_sae), as SAELens trains on a corpus streamed in fixed-length contexts.

The text comes from `data.source`:
  - `python_docs` (the default): the documentation topics that ship with every Python (`pydoc_data.topics`, the text
    of `help('if')`, `help('with')`, ...: about 465,000 characters of English technical prose about the language,
    with its code examples). Real text with no download; it is technical prose, not a general web corpus, so what a
    dictionary learns from it is what this kind of text makes the model do.
  - `induction`: text for the shipped induction model (whose tokenizer reads only t00 .. t63): 500 documents, each a
    run of 8 random tokens written twice, as the model was trained on, made from a fixed seed (no file).
  - `ioi`: the indirect-object sentences of data=ioi, whole ("When Mary and John went to the store, John gave a drink
    to Mary."): every template of runner/options/data/ioi.py with names drawn from its list, both name orders, 8
    sentences a document, 400 documents from a fixed seed (no file): the text of a task, for a dictionary of the
    task's own activations (the worked example in docs/dictionaries.md).
  - a `.txt` file: paragraphs separated by blank lines;
  - a `.jsonl` file: one JSON object per line with a "text" field.
Each is read and checked with the config, before any model loads: a missing file, an empty one and a JSON line without
"text" are refused, one message each (runner/data/text.py tokenises it once the tokenizer is loaded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from runner.errors import RunnerError
from runner.fingerprints import file_digest
from runner.options.registry import DATA
from runner.schema import DataConfig

PYTHON_DOCS = "python_docs"  # data.source of the text that ships with Python
INDUCTION = "induction"  # data.source of the shipped induction model's text, made in code
IOI = "ioi"  # data.source of data=ioi's sentences, whole, made in code
BUILT_IN = (PYTHON_DOCS, INDUCTION, IOI)
SUFFIXES = (".txt", ".jsonl")
MAX_CONTEXT = 8192  # a bound that keeps a typo from making one window of a million tokens


@DATA.option("runner.data.text:text_source")
@dataclass
class TextConfig(DataConfig):
    """Windows of plain text: samples are token windows (B, context), not prompt pairs."""

    name: str = "text"
    # python_docs (CPython's documentation topics, shipped with Python), induction (repeated random runs of t00 .. t63
    # for the shipped induction model), ioi (data=ioi's sentences, whole), or a .txt (paragraphs) or .jsonl file (a
    # "text" field per line)
    source: str = PYTHON_DOCS
    context: int = 128  # tokens per window, the BOS included where one is prepended
    bos: bool = True  # prepend the tokenizer's BOS token to every window (where the tokenizer has one)
    holdout: float = 0.1  # the share of the windows kept out of training, chosen by the run's seed (at least one)
    # data.limit then keeps the first of these (in text order), and the held-out share is taken of what is kept
    windows: Optional[int] = None  # windows drawn by the seed from the whole text (null: all)  # noqa: UP045 (OmegaConf)

    MODALITY: ClassVar[str] = "text"
    SAMPLES: ClassVar[str] = "windows"  # what a sample is: a window of text (prompt sources give "pairs")

    def check(self) -> list[str]:
        bad = super().check()
        if not 2 <= self.context <= MAX_CONTEXT:
            bad.append(f"data.context={self.context} (2 .. {MAX_CONTEXT})")
        if not 0 <= self.holdout < 1:
            bad.append(f"data.holdout={self.holdout} (0 <= holdout < 1)")
        if self.windows is not None and self.windows < 1:
            bad.append(f"data.windows={self.windows}")
        if not bad:
            documents(self.source)  # before the model loads: a missing, empty or malformed file
        return bad

    def fingerprint(self) -> dict[str, str]:
        """The text file's contents: a resume must find the same text."""
        if self.source not in BUILT_IN:
            file = Path(self.source).expanduser()
            if file.is_file():
                return {"data.source (contents)": f"sha256:{file_digest(file)}"}
        return {}


def documents(source: str) -> list[str]:
    """The documents of `source` (a topic, a paragraph or a JSON line each), in order, without empty ones; one
    RunnerError for a source that is not python_docs or a readable .txt / .jsonl file with some text."""
    if source == PYTHON_DOCS:
        from pydoc_data.topics import topics  # CPython's own documentation text, in every Python installation

        return [topics[key] for key in sorted(topics)]
    if source == INDUCTION:
        return induction_documents()
    if source == IOI:
        return ioi_documents()
    file = Path(source).expanduser()
    if file.suffix.lower() not in SUFFIXES:
        raise RunnerError(
            f"data.source={source}: give {PYTHON_DOCS} (the documentation that ships with Python), {INDUCTION}, {IOI},"
            " a .txt file"
            ' (paragraphs separated by blank lines) or a .jsonl file (a "text" field per line).'
        )
    if not file.is_file():
        raise RunnerError(f"data.source={source}: no such file.")
    try:
        raw = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RunnerError(
            f"data.source={source} is not UTF-8 ({e.reason} at byte {e.start}): save it as UTF-8."
        ) from None
    except OSError as e:
        raise RunnerError(f"Cannot read data.source={source} ({e.strerror or e}).") from None
    if file.suffix.lower() == ".jsonl":
        found = _json_texts(file, raw)
    else:
        found = [part.strip() for part in raw.replace("\r\n", "\n").split("\n\n")]
    found = [text for text in found if text.strip()]
    if not found:
        raise RunnerError(f"data.source={source} has no text: it is empty (or blank).")
    return found


def induction_documents(count: int = 500, run: int = 8, seed: int = 0) -> list[str]:
    """`count` documents of the shipped induction model's kind: a run of `run` random tokens of t00 .. t63, twice."""
    import random

    draw = random.Random(seed)
    runs = [[f"t{draw.randrange(64):02d}" for _ in range(run)] for _ in range(count)]
    return [" ".join(tokens + tokens) for tokens in runs]


def ioi_documents(count: int = 400, sentences: int = 8, seed: int = 0) -> list[str]:
    """`count` documents of `sentences` IOI sentences each, whole: a template of data=ioi filled with two names drawn
    from its list (IO and S, in either order), then the indirect object and a full stop."""
    import random

    from runner.options.data.ioi import NAMES, TEMPLATES

    draw = random.Random(seed)
    out = []
    for _ in range(count):
        told = []
        for _ in range(sentences):
            io, s = draw.sample(NAMES, 2)
            first, second = (io, s) if draw.random() < 0.5 else (s, io)  # ABBA or BABA
            told.append(draw.choice(TEMPLATES).format(name1=first, name2=second, S=s) + f" {io}.")
        out.append(" ".join(told))
    return out


def _json_texts(file: Path, raw: str) -> list[str]:
    """The "text" field of each line of a JSONL file; a line that is not such an object is refused by its number."""
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunnerError(
                f'{file}:{number} is not JSON ({e.msg}): one object with a "text" field per line.'
            ) from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise RunnerError(
                f'{file}:{number} has no "text" string: each line must be an object like {{"text": "..."}}.'
            )
        texts.append(item["text"])
    return texts
