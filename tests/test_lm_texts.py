"""Every language-model table carries the decoded text beside each raw token column (`token_text` beside `token`,
`answer_text` beside `answer`, ...): the form the docs and the figures use, `" Jacob"` for SmolLM2's `ĠJacob`, so that
`table[table.token_text == " Jacob"]` finds the rows. A two-layer stand-in with SmolLM2's tokenizer (byte-level BPE)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import app
from runner.models.packaged_lm import converted_folder
from runner.results import load
from tests.conftest import make_config
from tests.lm_references import build_tokenizer_lm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_lm(converted_folder("smollm2-135m"), tmp_path_factory.mktemp("smollm2_tokenizer"))


def _bpe(token: str) -> str:
    """A byte-level BPE token as text, written here: Ġ is the space before a word."""
    return token.replace("Ġ", " ").replace("Ċ", "\n")


@pytest.mark.parametrize(
    ("method", "pairs"),
    [("lm_patching", ("token", "answer", "distractor")), ("lm_grad_x_act", ("token", "answer", "distractor")),
     ("lm_logit_lens", ("token", "answer", "distractor", "top_token")),
     ("lm_attention", ("token", "query_token", "answer", "distractor"))],
)  # fmt: skip
def test_each_raw_token_column_has_its_decoded_text_beside_it(
    stand_in: Path, tmp_path: Path, method: str, pairs: tuple[str, ...]
) -> None:
    overrides = ["model=hf_lm", f"model.name={stand_in}", "data=ioi", "data.n_pairs=2", "data.keep=all",
                 f"method={method}", "progress=false", "report=false"]  # fmt: skip
    app.run(make_config(*overrides), tmp_path)
    table = load(tmp_path, method)
    for raw in pairs:
        text = table[f"{raw}_text"]
        assert (text.notna() == table[raw].notna()).all(), raw  # a head at every position has no token
        words = table[raw].str.fullmatch(r"Ġ?[A-Za-z,.]+")  # the tokens this test decodes by hand
        assert words.fillna(False).mean() > 0.4, raw
        wrong = table.loc[
            words.fillna(False) & (text != table[raw].map(_bpe, na_action="ignore")), [raw, f"{raw}_text"]
        ]
        assert wrong.empty, wrong
    assert table["token"].str.startswith("Ġ").any()  # not vacuous: words with their space
    answer = table["answer_text"].iloc[0]
    assert answer.startswith(" ") and len(table[table.token_text == answer]) > 0  # the answer's rows, by its text
