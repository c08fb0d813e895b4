"""The shipped induction LM (runner/models/lm_induction/, trained by scripts/train_induction_lm.py): it loads
offline with the Auto classes, has the circuit its docstring claims by independent attention-pattern scores
(tests/lm_circuits.py), and its patching pairs are well formed and answered by induction."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest
import torch
from lm_circuits import induction_scores, previous_token_scores
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

FOLDER = Path(str(importlib.resources.files("runner.models") / "lm_induction"))


@pytest.fixture(scope="module")
def shipped():
    """The shipped model (eager attention, so patterns exist) and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(FOLDER, attn_implementation="eager", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(FOLDER, local_files_only=True)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, str]]:
    return [json.loads(line) for line in (FOLDER / "induction_pairs.jsonl").read_text().splitlines()]


def test_folder_ships_inside_the_package():
    names = {p.name for p in FOLDER.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "induction_pairs.jsonl"} <= names
    assert (FOLDER / "model.safetensors").stat().st_size < 4 * 2**20


def test_tokenizer_gives_one_id_per_token_and_no_bos(shipped):
    _, tokenizer = shipped
    ids = tokenizer("t01 t02 t63")["input_ids"]
    assert ids == tokenizer.convert_tokens_to_ids(["t01", "t02", "t63"])
    assert tokenizer.bos_token_id not in ids and tokenizer.unk_token_id not in ids
    assert tokenizer.pad_token is not None


def test_layer_1_holds_the_induction_head(shipped):
    scores = induction_scores(*shipped)  # (layers, heads)
    layer, head = divmod(int(scores.argmax()), scores.shape[1])
    assert layer == 1, scores
    # A random-weight model of the same config scores about 1 / (context length) ~ 0.03 everywhere.
    assert scores[layer, head] > 0.5, scores


def test_layer_0_holds_the_previous_token_head(shipped):
    scores = previous_token_scores(*shipped)
    layer, head = divmod(int(scores.argmax()), scores.shape[1])
    assert layer == 0, scores
    assert scores[layer, head] > 0.5, scores


def test_random_weights_fail_the_thresholds(shipped):
    model, tokenizer = shipped
    torch.manual_seed(0)
    random = GPT2LMHeadModel(model.config).eval()
    assert induction_scores(random, tokenizer).max() < 0.5
    assert previous_token_scores(random, tokenizer).max() < 0.5


def test_pairs_have_equal_lengths_and_no_bos(pairs, shipped):
    _, tokenizer = shipped
    assert len(pairs) == 32
    for pair in pairs:
        clean, corrupted = tokenizer(pair["clean"])["input_ids"], tokenizer(pair["corrupted"])["input_ids"]
        assert len(clean) == len(corrupted)
        assert tokenizer.bos_token_id not in clean + corrupted and "<bos>" not in pair["clean"]
        assert pair["answer"] != pair["distractor"]


@torch.no_grad()
def test_induction_answers_the_pairs(pairs, shipped):
    model, tokenizer = shipped
    answer = torch.tensor(tokenizer.convert_tokens_to_ids([p["answer"] for p in pairs]))
    distractor = torch.tensor(tokenizer.convert_tokens_to_ids([p["distractor"] for p in pairs]))
    rows = torch.arange(len(pairs))
    means = {}
    for side in ("clean", "corrupted"):
        ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(p[side])["input_ids"] for p in pairs])
        last = model(ids).logits[:, -1]  # (N, V)
        means[side] = float((last[rows, answer] - last[rows, distractor]).mean())
    assert means["clean"] > 3 and means["corrupted"] < 0, means
