"""The shipped induction LM (runner/models/lm_induction/, trained by scripts/train_induction_lm.py): it loads
offline with the Auto classes, has the circuit its docstring claims by independent attention-pattern scores
(tests/lm_circuits.py), its patching pairs are well formed and answered by induction, and activation patching finds
the same circuit."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_circuits import induction_scores, previous_token_scores
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.methods.lm_patching import lm_activation_patching

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
    random = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
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


def test_patching_ranks_first_the_head_the_attention_scores_call_the_induction_head(pairs, shipped):
    """Patching each head's clean output (all positions) into the corrupted run: the head that restores the answer
    most is the one whose attention pattern is the most induction-like, found by code that shares nothing with the
    patching engine."""
    model, tokenizer = shipped
    frame = lm_activation_patching(model, tokenizer, pairs, sites=["head"], directions=["denoising"])
    restoration = frame.groupby(["layer", "head"]).restoration.mean()  # mean over the 32 pairs
    scores = induction_scores(model, tokenizer)  # (layers, heads)
    assert restoration.idxmax() == divmod(int(scores.argmax()), scores.shape[1]), (restoration, scores)
    assert restoration.max() > 0.3  # one head carries a real share of the answer; layer 0's heads carry none
    assert restoration.loc[0].abs().max() < 0.05


def test_patching_locates_the_answers_first_occurrence(pairs, shipped):
    """The residual stream carries the answer from its first occurrence (position 8: the one token that differs and
    that induction copies) and layer 1's attention moves it to the last position: restoring either restores all."""
    model, tokenizer = shipped
    frame = lm_activation_patching(model, tokenizer, pairs, sites=["resid_pre", "attn_out"], directions=["denoising"])
    mean = frame.groupby(["site", "layer", "position"]).restoration.mean()
    last = int(frame.position.max())
    assert mean.loc[("resid_pre", 0, 8)] > 0.95 and mean.loc[("attn_out", 1, last)] > 0.95
    others = mean.drop([("resid_pre", 0, 8), ("resid_pre", 1, 8), ("attn_out", 1, last)])
    assert others.abs().max() < 0.1, others.sort_values().tail()


@pytest.mark.parametrize(("target", "directions"), [("token_logit_diff", ["denoising", "noising"]),
                                                    ("kl_to_clean", ["denoising"])])  # fmt: skip
def test_attribution_topk_repatches_the_cells_that_carry_the_effect(pairs, shipped, target, directions):
    """Top-k ranks cells by the estimated move toward the source run's metric, so in noising (the metric falls) and
    for kl_to_clean (clean < corrupted) the re-patched cells include the three that carry the whole effect:
    resid_pre at the answer's first occurrence (layers 0 and 1) and layer 1's attention at the last position.
    Ranked by the largest estimated patched metric, they were re-patched in 1, 1 and 0 of 32 pairs when noising.
    Noising is where first-order estimates are weakest (the logit difference falls by ~21): 31 of 32 is measured.
    (kl_to_clean when noising is at its minimum on the receiving run, so its gradient, and every estimate, is 0.)"""
    model, tokenizer = shipped
    frame = lm_activation_patching(model, tokenizer, pairs, target=target, sites=["resid_pre", "attn_out"],
                                   directions=directions, mode="attribution_topk", top_k=4)  # fmt: skip
    exact = frame[frame.patch_method == "exact"]
    last = int(frame.position.max())
    for direction in directions:
        rows = exact[exact.direction == direction]
        assert rows.sample_index.nunique() == len(pairs)
        for site, layer, position in (("resid_pre", 0, 8), ("resid_pre", 1, 8), ("attn_out", 1, last)):
            carried = rows[(rows.site == site) & (rows.layer == layer) & (rows.position == position)]
            assert len(carried) >= (len(pairs) if direction == "denoising" else len(pairs) - 2), (direction, site)
            # and each moves the metric most of the way to the source run's
            moved = (carried.patched - carried.corrupted) / (carried.clean - carried.corrupted)
            assert moved.median() > 0.9 if direction == "denoising" else moved.median() < 0.1


@pytest.mark.slow
@pytest.mark.process
def test_training_script_is_deterministic(tmp_path: Path):
    """A short run of scripts/train_induction_lm.py writes a loadable folder, and the same command the same weights."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_induction_lm.py"
    weights = []
    for run in ("a", "b"):
        out = tmp_path / run
        done = subprocess.run([sys.executable, str(script), "--out", str(out), "--steps", "8"], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert {"config.json", "model.safetensors", "tokenizer.json", "induction_pairs.jsonl"} <= {
            p.name for p in out.iterdir()
        }
        weights.append((out / "model.safetensors").read_bytes())
    assert weights[0] == weights[1]
    assert (tmp_path / "a" / "induction_pairs.jsonl").read_text() == (FOLDER / "induction_pairs.jsonl").read_text()
