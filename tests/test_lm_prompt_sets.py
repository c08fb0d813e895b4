"""Prompt sets for the language-model experiments: IOI pairs made from templates (data=ioi), a per-pair subject
span for causal tracing (`subject` in the data, corruption.span=subject), the shipped factual-recall prompts
(data.file=facts), and data.keep (the pairs the model gets right, judged before the run)."""

from __future__ import annotations

import copy
import importlib.resources
import json
import logging
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.data.ioi import ioi_pairs, ioi_source, one_token_names
from runner.data.prompts import kept_pairs, position_ids, prompts_source
from runner.errors import RunnerError
from runner.hooks import count_hooks
from runner.methods.lm_patching import lm_activation_patching
from runner.options.data.ioi import IoiConfig
from runner.options.data.prompts import PromptsConfig, read_pairs_file
from tests.lm_references import SPECIALS

INDUCTION = Path(str(importlib.resources.files("runner.models") / "lm_induction"))
FACTS = Path(str(importlib.resources.files("runner.data") / "prompt_sets" / "facts.jsonl"))
TEMPLATE = "When {name1} and {name2} went to the store, {S} gave a drink to"


def word_tokenizer(words: list[str]):
    """A whitespace-split WordLevel tokenizer over `words` (fast: it has character offsets)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({w: len(SPECIALS) + i for i, w in enumerate(sorted(set(words)))})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def ioi_tokenizer(names: list[str]):
    words = TEMPLATE.replace("{", " {").replace("}", "} ").split()
    return word_tokenizer([w for w in words if not w.startswith("{")] + names)


@pytest.fixture(scope="module")
def induction():
    model = AutoModelForCausalLM.from_pretrained(INDUCTION, attn_implementation="eager", local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(INDUCTION, local_files_only=True)


# ---- data=ioi ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("corruption", ["abc", "s2"])
def test_ioi_pairs_have_their_orders_names_and_corruption(corruption: str) -> None:
    cfg = IoiConfig(n_pairs=12, templates=[TEMPLATE], corruption=corruption)
    names = IoiConfig().names
    dataset = ioi_source(cfg, ioi_tokenizer(names), seed=3)
    assert len(dataset) == 12
    for k, pair in enumerate(dataset.pairs):
        order = "abba" if k % 2 == 0 else "baba"
        assert pair.sample_id == f"ioi-{k:04d}-{order}-t0"
        words = [t for t in pair.tokens[1:]]  # after BOS: When N1 and N2 went to the store, S gave a drink to
        first, second, subject = words[1], words[3], words[8]
        io, s = pair.answer_tokens[0], pair.distractor_tokens[0]
        assert (first, second) == ((io, s) if order == "abba" else (s, io))
        assert subject == s and io != s
        differing = [i for i, (a, b) in enumerate(zip(pair.clean, pair.corrupted, strict=True)) if a != b]
        corrupted_names = {dataset.tokenizer.convert_ids_to_tokens(pair.corrupted[i]) for i in differing}
        if corruption == "abc":  # three other names in the three slots, none of them IO or S
            assert differing == [2, 4, 9]
            assert len(corrupted_names) == 3 and not corrupted_names & {io, s}
        else:  # another name at S's second mention only
            assert differing == [9] and not corrupted_names & {io, s}


def test_ioi_pairs_are_the_same_for_a_seed_whatever_their_number() -> None:
    names = IoiConfig().names
    few, many = IoiConfig(n_pairs=4), IoiConfig(n_pairs=10)
    assert ioi_pairs(few, names, 0) == ioi_pairs(many, names, 0)[:4]
    assert ioi_pairs(few, names, 0) != ioi_pairs(few, names, 1)
    templates = {p["id"].rsplit("-t", 1)[1] for p in ioi_pairs(IoiConfig(n_pairs=16), names, 0)}
    assert templates == {str(t) for t in range(8)}  # the default templates take turns


def test_ioi_leaves_out_names_that_are_not_one_token_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = ioi_tokenizer(["Mary", "John", "Alice", "Bob", "Sarah", "Tom"])
    with caplog.at_level(logging.INFO, logger="runner.data.ioi"):
        kept = one_token_names(["Mary", "John", "Zebedee", "Alice", "Bob", "Sarah", "Tom"], tokenizer)
    assert kept == ["Mary", "John", "Alice", "Bob", "Sarah", "Tom"]
    assert "6 of 7 names" in caplog.text and "Zebedee" in caplog.text
    with pytest.raises(RunnerError, match="only 4 of data.names are one token"):
        one_token_names(["Mary", "John", "Alice", "Bob", "Zebedee"], tokenizer)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"templates": ["When {name1} went to the store, {S} gave a drink to"]}, "exactly {name1}"),
        ({"templates": ["When {name1} and {name2} met {IO}, {S} gave a drink to"]}, "exactly {name1}"),
        ({"names": ["Mary", "John", "Alice", "Bob"]}, "at least 5 distinct"),
        ({"names": ["Mary", "Mary", "John", "Alice", "Bob", "Tom"]}, "at least 5 distinct"),
        ({"orders": ["ABBA", "ABBA"]}, "each of ABBA, BABA at most once"),
    ],
)
def test_ioi_config_refuses_what_cannot_make_pairs(fields: dict, message: str) -> None:
    with pytest.raises(RunnerError, match=message.replace("{", r"\{")):
        IoiConfig(**fields).check()


# ---- per-pair subject span ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bos", [True, False])
def test_a_pairs_subject_span_covers_the_tokens_of_its_subject(bos: bool) -> None:
    pairs = [{"clean": "a b c d e", "subject": "b c", "answer": "x", "distractor": "y"},
             {"clean": "a b c d e f g", "subject": "f", "answer": "x", "distractor": "y"},
             {"clean": "c d", "subject": "c d", "answer": "x", "distractor": "y"}]  # fmt: skip
    dataset = prompts_source(PromptsConfig(pairs=pairs, bos=bos), word_tokenizer(list("abcdefgxy")), 0)
    spans = [p.subject_span for p in dataset.pairs]
    first = 1 if bos else 0
    assert spans == [(first + 1, first + 3), (first + 5, first + 6), (first, first + 2)]
    for pair, item in zip(dataset.pairs, pairs, strict=True):
        start, end = pair.subject_span
        assert " ".join(pair.tokens[start:end]) == item["subject"]


def test_a_subject_that_is_not_in_its_prompt_is_refused_with_the_config() -> None:
    pairs = [{"clean": "a b c", "subject": "b d", "answer": "x", "distractor": "y"}]
    with pytest.raises(RunnerError, match="its subject 'b d' is not text of its clean prompt"):
        PromptsConfig(pairs=pairs).check()


def test_noise_on_each_pairs_subject_equals_the_pair_alone_with_its_span(induction) -> None:
    """span=subject over pairs of different lengths and subject places, in one batch, gives each pair what an
    explicit span [start, end) gives it alone: the noise lands on its own subject's tokens. (The noise is drawn by
    the pair's index in the batch, so each pair is compared where it is first: the batch is rotated.)"""
    model, tokenizer = induction
    lines = [json.loads(line) for line in (INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[:3]]
    pairs = []
    for cut, (item, subject) in enumerate(zip(lines, ((2, 4), (0, 3), (5, 6)), strict=True)):
        words = item["clean"].split()[cut:]  # three lengths
        pairs.append({"clean": " ".join(words), "subject": " ".join(words[subject[0] : subject[1]]),
                      "answer": item["answer"], "distractor": item["distractor"], "id": f"p{cut}"})  # fmt: skip
    noise = {"kind": "noise", "std": 3.0, "seed": 0}
    sites = ["resid_pre", "attn_out"]
    columns = ["site", "layer", "position", "clean", "corrupted", "patched"]
    for k, pair in enumerate(pairs):
        rotated = pairs[k:] + pairs[:k]
        together = lm_activation_patching(
            model, tokenizer, rotated, sites=sites, corruption={**noise, "span": "subject"}
        )
        start = 1 + pair["clean"].split().index(pair["subject"].split()[0])  # BOS, then the words
        span = [start, start + len(pair["subject"].split())]
        alone = lm_activation_patching(model, tokenizer, [pair], sites=sites, corruption={**noise, "span": span})
        mine = together[together["sample_index"] == 0][columns].reset_index(drop=True)  # pair k, first
        alone = alone[columns].reset_index(drop=True)
        assert (mine[["site", "layer", "position"]] == alone[["site", "layer", "position"]]).all().all()
        for column in ("clean", "corrupted", "patched"):
            torch.testing.assert_close(torch.tensor(mine[column].to_numpy()), torch.tensor(alone[column].to_numpy()),
                                       atol=1e-5, rtol=0)  # fmt: skip
        assert (mine["corrupted"] != mine["clean"]).all()  # the noise moved the metric


def test_span_subject_is_refused_for_pairs_without_a_subject(induction) -> None:
    model, tokenizer = induction
    pair = json.loads((INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[0])
    with pytest.raises(RunnerError, match="span=subject edits each pair's subject tokens"):
        lm_activation_patching(model, tokenizer, [pair], sites=["resid_pre"],
                               corruption={"kind": "noise", "span": "subject"})  # fmt: skip


def test_the_shipped_facts_name_their_subject_in_their_prompt() -> None:
    facts = read_pairs_file(FACTS)
    assert len(facts) >= 50 and len({f["id"] for f in facts}) == len(facts)
    assert all(f["subject"] in f["clean"] and f["answer"].startswith(" ") for f in facts)
    assert PromptsConfig(file="facts").check() == []  # the shipped name resolves


# ---- data.keep ---------------------------------------------------------------------------------------------------


def _next_token_logits(model, tokenizer, clean: str) -> torch.Tensor:
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(clean, add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1]


@pytest.mark.parametrize("keep", ["correct", "preferred"])
def test_keep_leaves_out_the_pairs_the_model_gets_wrong(induction, keep: str, caplog) -> None:
    """Half the pairs have answer and distractor swapped: the kept ones are those a plain forward, one prompt at a
    time, says the model gets right (its top token; or the answer above the distractor)."""
    model, tokenizer = induction
    lines = [json.loads(line) for line in (INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[:10]]
    pairs = [{**p, "id": f"p{i}", **({"answer": p["distractor"], "distractor": p["answer"]} if i % 2 else {})}
             for i, p in enumerate(lines)]  # fmt: skip
    expected = []
    for p in pairs:
        logits = _next_token_logits(model, tokenizer, p["clean"])
        answer, distractor = (tokenizer.convert_tokens_to_ids(p[k]) for k in ("answer", "distractor"))
        right = int(logits.argmax()) == answer if keep == "correct" else logits[answer] > logits[distractor]
        expected += [p["id"]] if right else []
    assert 0 < len(expected) < len(pairs)  # the test means something: some kept, some left out
    cfg = PromptsConfig(pairs=pairs, keep=keep, batch_size=3)
    dataset = prompts_source(cfg, tokenizer, 0)
    with caplog.at_level(logging.INFO, logger="runner.data.prompts"):
        kept = kept_pairs(model, dataset, cfg, torch.device("cpu"))
    assert [p.sample_id for p in kept.pairs] == expected
    assert f"{len(expected)} of {len(pairs)} pairs kept" in caplog.text


def test_keep_that_keeps_nothing_is_an_error(induction) -> None:
    model, tokenizer = induction
    line = json.loads((INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[0])
    wrong = {**line, "answer": line["distractor"], "distractor": line["answer"]}
    cfg = PromptsConfig(pairs=[wrong], keep="correct")
    with pytest.raises(RunnerError, match="none of the 1 is such a pair"):
        kept_pairs(model, prompts_source(cfg, tokenizer, 0), cfg, torch.device("cpu"))


def test_position_ids_count_only_real_tokens() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]


# ---- method=lm_attention -----------------------------------------------------------------------------------------


def _attention_table(model, tokenizer, pairs: list[dict], **settings) -> pd.DataFrame:
    from runner.data.prompts import pairs_batch
    from runner.methods.base import as_frame, library_config, library_token_runtime, run_prepared
    from runner.methods.lm_saliency.attention import LmAttention
    from runner.options.method.lm_attention import LmAttentionConfig

    dataset, batch = pairs_batch(pairs, tokenizer, True, torch.device("cpu"))
    method = LmAttention(library_config(LmAttentionConfig, **settings), [], library_token_runtime(batch.x.device,
                         "token_logit_diff"))  # fmt: skip
    return as_frame(run_prepared(method, model, batch, dataset).tables["lm_attention"])


@pytest.mark.parametrize("query", ["last", "all"])
def test_attention_rows_are_each_prompts_own_weights_whatever_its_padding(induction, query: str) -> None:
    """A short pair beside a longer one (left-padded): its rows equal the weights of a plain forward of its prompt
    alone, at the table's positions, and each query's weights over the keys sum to 1."""
    model, tokenizer = induction
    lines = [json.loads(line) for line in (INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[:2]]
    short = {**lines[0], "clean": " ".join(lines[0]["clean"].split()[4:]), "corrupted": None}
    short.pop("corrupted")
    table = _attention_table(model, tokenizer, [short, lines[1]], query=query)
    assert count_hooks(model) == 0  # the run's hooks removed (and none of transformers' output_attentions hooks)
    sums = table.groupby(["sample_index", "layer", "head", "query_position"])["weight"].sum()
    torch.testing.assert_close(torch.tensor(sums.to_numpy()), torch.ones(len(sums)), atol=1e-5, rtol=0)
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(short["clean"], add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        # on a copy: transformers answers output_attentions with hooks that stay on the model
        alone = copy.deepcopy(model)(input_ids=ids, output_attentions=True).attentions  # (1, H, T, T) per layer
    mine = table[table["sample_index"] == 0]
    t = ids.shape[1]
    assert set(mine["query_position"]) == ({t - 1} if query == "last" else set(range(t)))
    assert (mine["position"] <= mine["query_position"]).all()
    expected = torch.tensor([float(alone[r.layer][0, r.head, r.query_position, r.position]) for r in mine.itertuples()])
    torch.testing.assert_close(torch.tensor(mine["weight"].to_numpy()), expected, atol=1e-6, rtol=0)
    assert len(mine) == 2 * 4 * (t if query == "last" else t * (t + 1) // 2)  # layers x heads x keys


def test_the_shipped_models_induction_head_attends_to_the_answer(induction) -> None:
    """On the induction pairs the answer is the token after the last token's first occurrence: the induction head
    (the layer-1 head with the highest induction score, tests/lm_circuits.py) puts most of its weight there."""
    from tests.lm_circuits import induction_scores

    model, tokenizer = induction
    head = int(induction_scores(copy.deepcopy(model), tokenizer)[1].argmax())  # output_attentions: on a copy
    pairs = [json.loads(line) for line in (INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[:8]]
    table = _attention_table(model, tokenizer, pairs, layers=[1])
    to_answer = table[(table["head"] == head) & (table["token"] == table["answer"])]
    per_pair = to_answer.groupby("sample_index")["weight"].sum()
    assert len(per_pair) == 8 and per_pair.min() > 0.5, per_pair


def test_attention_refuses_a_model_without_eager_attention(induction) -> None:
    model, tokenizer = induction
    pair = json.loads((INDUCTION / "induction_pairs.jsonl").read_text().splitlines()[0])
    model.config._attn_implementation = "sdpa"
    try:
        with pytest.raises(RunnerError, match="set model.attn_implementation=eager"):
            _attention_table(model, tokenizer, [pair])
    finally:
        model.config._attn_implementation = "eager"
