"""Train the shipped tiny language model whose circuit is known: a previous-token head and an induction head.

    python scripts/train_induction_lm.py                      # writes runner/models/lm_induction/ (a few CPU minutes)
    python scripts/train_induction_lm.py --out /tmp/lm --steps 500

A two-layer attention-only Llama (rotary positions; 64 wide, 4 heads; its MLPs are zero and frozen, since Llama
has no attention-only switch) is trained on sequences that hold a random run of content tokens repeated once, amid
random filler. The only predictable tokens are those of the second copy, and a two-layer transformer learns them the
way Olsson et al. (2022) describe: a previous-token head in layer 0 writes "the token before me was A" into each
position, and an induction head in layer 1 attends from a later A to the token that followed the earlier A and
copies it; tests/lm_circuits.py's attention-pattern scores confirm it. (A GPT-2 of the same size, with learned
absolute positions, reaches the same accuracy with a diffuse, position-smeared circuit instead: rotary positions
make the one-token offset easy to learn.)

Vocabulary: 64 content tokens `t00`..`t63` (ids 0..63), then `<bos>`, `<pad>`, `<unk>`. The tokenizer is a
word-level one (one id per whitespace-separated token) that adds no BOS itself: whoever feeds the model prepends it.

Everything is seeded (model initialisation, every batch, the held-out set, the patching pairs) and runs on one CPU
thread, so the same command writes the same weights. Besides the model and tokenizer the folder gets
`induction_pairs.jsonl`: clean/corrupted prompt pairs for activation patching. A clean prompt is a run S of 8
distinct tokens followed by S again up to, not including, its last token: induction predicts S[-1] (the answer).
The corrupted prompt replaces the first copy by a run S' of other tokens that shares only S[-2], at the same place,
so induction there attends to S'[-1] (the distractor) instead; the second halves are identical.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
# The attention-pattern scores are defined once, in the tests' helper module, so the figures printed here are the
# ones the tests assert on.
sys.path.insert(0, str(ROOT / "tests"))
from lm_circuits import induction_scores, previous_token_scores  # noqa: E402

log = logging.getLogger("train_induction_lm")

N_CONTENT = 64
BOS, PAD, UNK = N_CONTENT, N_CONTENT + 1, N_CONTENT + 2
SEQ_LEN = 48  # training sequence length, <bos> included
RUN_LENGTHS = (8, 20)  # length of the repeated run, inclusive
PAIR_RUN = 8  # run length in the patching pairs
N_PAIRS = 32


def content_token(i: int) -> str:
    """The string of content token `i`."""
    return f"t{i:02d}"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `t00`..`t63` and the three special tokens; no BOS added, no post-processor."""
    vocab = {content_token(i): i for i in range(N_CONTENT)} | {"<bos>": BOS, "<pad>": PAD, "<unk>": UNK}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner,
        bos_token="<bos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=64,
        padding_side="left",
    )


def build_model(seed: int, heads: int) -> LlamaForCausalLM:
    """The two-layer attention-only Llama, initialised from `seed` (no dropout: training is a function of the seed)."""
    config = LlamaConfig(vocab_size=N_CONTENT + 3, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=BOS, pad_token_id=PAD)  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Llama has no switch for attention-only blocks: zero MLP weights that never train give a zero MLP output.
    for block in model.model.layers:
        for parameter in block.mlp.parameters():
            parameter.data.zero_()
            parameter.requires_grad_(False)
    return model


def training_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, SEQ_LEN) ids: <bos>, filler, a run S, S again, filler (run length and offset drawn per row), every
    content token at most once apart from the repeat, so that each second-copy token has one earlier match; and the
    labels: the ids where the second copy makes them predictable, -100 (ignored) elsewhere."""
    rows = torch.full((batch_size, SEQ_LEN), BOS)
    labels = torch.full_like(rows, -100)
    lo, hi = RUN_LENGTHS
    for row, label in zip(rows, labels, strict=True):
        length = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        start = 1 + int(torch.randint(0, SEQ_LEN - 2 * length, (1,), generator=generator))
        tokens = torch.randperm(N_CONTENT, generator=generator)
        run, filler = tokens[:length], tokens[length : length + SEQ_LEN - 1 - 2 * length]
        row[1:] = torch.cat([filler[: start - 1], run, run, filler[start - 1 :]])
        # The second copy's first token is unpredictable (nothing marks where the copy starts); the rest is.
        label[start + length + 1 : start + 2 * length] = run[1:]
    return rows, labels


@torch.no_grad()
def induction_accuracy(model: LlamaForCausalLM, generator: torch.Generator, n: int = 256) -> float:
    """Top-1 accuracy on the second copy of held-out `<bos> S S` rows (all of it but its unpredictable first token)."""
    lo, hi = 10, 20
    correct = total = 0
    for length in range(lo, hi + 1):
        runs = torch.stack([torch.randperm(N_CONTENT, generator=generator)[:length] for _ in range(n // (hi - lo + 1))])
        ids = torch.cat([torch.full((len(runs), 1), BOS), runs, runs], dim=1)  # (B, 1 + 2L)
        predicted = model(ids).logits.argmax(-1)  # (B, 1 + 2L)
        # Position p predicts token p + 1; the second copy's tokens 1.. sit at L + 2 .. 2L.
        hits = predicted[:, length + 1 : 2 * length] == ids[:, length + 2 :]
        correct += int(hits.sum())
        total += hits.numel()
    return correct / total


def patching_pairs(generator: torch.Generator) -> list[dict[str, str]]:
    """`N_PAIRS` clean/corrupted prompts of equal length whose induction answers differ (see the module docstring)."""
    pairs = []
    for _ in range(N_PAIRS):
        order = torch.randperm(N_CONTENT, generator=generator).tolist()
        run, other = order[:PAIR_RUN], order[PAIR_RUN : 2 * PAIR_RUN]
        other[-2] = run[-2]  # the token the last position matches on, at the same place in both first copies
        clean = run + run[:-1]
        corrupted = other + run[:-1]
        pairs.append(
            {
                "clean": " ".join(map(content_token, clean)),
                "corrupted": " ".join(map(content_token, corrupted)),
                "answer": content_token(run[-1]),
                "distractor": content_token(other[-1]),
            }
        )
    return pairs


@torch.no_grad()
def logit_differences(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, pairs: list[dict]) -> tuple:
    """Mean logit(answer) - logit(distractor) at the last position, over the clean and over the corrupted prompts."""
    means = []
    for side in ("clean", "corrupted"):
        ids = torch.tensor([[BOS] + tokenizer(p[side])["input_ids"] for p in pairs])  # (N, 1 + 2 * PAIR_RUN - 1)
        last = model(ids).logits[:, -1]  # (N, V)
        answer = torch.tensor(tokenizer.convert_tokens_to_ids([p["answer"] for p in pairs]))
        distractor = torch.tensor(tokenizer.convert_tokens_to_ids([p["distractor"] for p in pairs]))
        rows = torch.arange(len(pairs))
        means.append(float((last[rows, answer] - last[rows, distractor]).mean()))
    return tuple(means)


def format_scores(name: str, scores: torch.Tensor) -> str:
    """A (layers, heads) table as text."""
    lines = [f"{name}: " + " ".join(f"   h{h}" for h in range(scores.shape[1]))]
    for layer, row in enumerate(scores.tolist()):
        lines.append(f"{'layer ' + str(layer):>{len(name)}}: " + " ".join(f"{v:5.3f}" for v in row))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runner" / "models" / "lm_induction")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    tokenizer = build_tokenizer()
    model = build_model(args.seed, args.heads)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    data = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels = training_batch(args.batch_size, data)
        loss = model(ids, labels=labels).loss  # the model shifts the labels itself
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 250 == 0 or step == args.steps:
            log.info("step %5d  loss %.4f  %.0f s", step, loss.item(), time.perf_counter() - started)
    model.eval()
    log.info("trained in %.1f s", time.perf_counter() - started)

    held_out = torch.Generator().manual_seed(args.seed + 1)
    pairs = patching_pairs(torch.Generator().manual_seed(args.seed + 2))
    clean, corrupted = logit_differences(model, tokenizer, pairs)
    log.info("induction accuracy (second copy, held out): %.4f", induction_accuracy(model, held_out))
    log.info(
        "logit(answer) - logit(distractor), mean over %d pairs: clean %.3f, corrupted %.3f", N_PAIRS, clean, corrupted
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    with open(args.out / "induction_pairs.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    log.info("wrote %s", args.out)

    # Scored on the saved folder, with eager attention, as the tests do.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(args.out, attn_implementation="eager")
    saved_tokenizer = AutoTokenizer.from_pretrained(args.out)
    for name, scores in (
        ("induction", induction_scores(saved, saved_tokenizer)),
        ("previous-token", previous_token_scores(saved, saved_tokenizer)),
    ):
        log.info("%s", format_scores(name, scores))


if __name__ == "__main__":
    main()
