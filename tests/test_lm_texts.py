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


def test_ioi_positions_carry_their_roles_and_the_summary_names_them(stand_in: Path, tmp_path: Path) -> None:
    """data=ioi: the IO, S1 and S2 names' positions and the last one carry their roles in every pair, ABBA and BABA
    alike (IO's token is the answer, S1's and S2's the distractor); where the pairs' tokens differ, the peak summary
    names the position by its roles."""
    from runner.viz.summary import peak_summary

    template = "'When {name1} and {name2} went to the store, {S} gave a drink to'"  # one: positions line up
    overrides = ["model=hf_lm", f"model.name={stand_in}", "data=ioi", "data.n_pairs=4", "data.keep=all",
                 f"data.templates=[{template}]", "method=lm_patching", "method.patching.sites=[resid_pre]", "progress=false", "report=false"]  # fmt: skip
    app.run(make_config(*overrides), tmp_path)
    table = load(tmp_path, "lm_patching")
    cells = table[table.layer == 0].drop_duplicates(["sample_id", "position"])
    for sample_id, pair in cells.groupby("sample_id"):
        roles = dict(zip(pair.role, pair.position, strict=False))
        assert set(pair.role.dropna()) == {"IO", "S1", "S2", "end"}, sample_id
        assert roles["end"] == pair.position.max()
        text = dict(zip(pair.position, pair.token_text, strict=True))
        assert text[roles["IO"]] == pair.answer_text.iloc[0]
        assert text[roles["S1"]] == text[roles["S2"]] == pair.distractor_text.iloc[0]
        assert (roles["IO"] < roles["S1"]) == ("abba" in sample_id)  # ABBA: IO first
    peaks = peak_summary(table, ["direction", "site"], ["restoration"])
    where = " ".join(peaks["restoration max at"]) + " ".join(peaks["restoration min at"])
    assert "*" not in where and ("IO/S1" in where or "S2" in where), where


def test_facts_carry_the_subjects_span_and_the_end(stand_in: Path, tmp_path: Path) -> None:
    overrides = ["model=hf_lm", f"model.name={stand_in}", "data=prompts", "data.file=facts", "data.limit=3",
                 "data.keep=all", "method=lm_logit_lens", "progress=false", "report=false"]  # fmt: skip
    app.run(make_config(*overrides), tmp_path)
    table = load(tmp_path, "lm_logit_lens")
    for sample_id, pair in table[table.layer == 0].groupby("sample_id"):
        subject = "".join(pair.sort_values("position").loc[pair.role == "subject", "token_text"]).strip()
        assert subject and subject.lower().replace(" ", "") in sample_id.replace("-", ""), (sample_id, subject)
        assert pair.loc[pair.position == pair.position.max(), "role"].item() == "end"


def test_roles_given_with_a_pair_are_checked() -> None:
    from runner.errors import RunnerError
    from runner.options.data.prompts import checked_pairs

    good = {"clean": "When Mary left", "answer": " x", "distractor": " y", "roles": {"IO": [5, 9]}}
    assert checked_pairs([good])
    for roles in ({"IO": [5, 99]}, {"IO": [9, 5]}, {"IO": "Mary"}, {"end": [0, 4]}):
        with pytest.raises(RunnerError, match=r"its roles .* are not \{name: \[start, end\]\} character spans"):
            checked_pairs([{**good, "roles": roles}])
