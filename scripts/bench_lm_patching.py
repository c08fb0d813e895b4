"""Layer x position `resid_pre` activation patching on a causal LM: a plain loop, TransformerLens, the runner.

    python scripts/bench_lm_patching.py                                  # GPT-2 small's shape, 4 layers, CPU
    python scripts/bench_lm_patching.py --layers 12 --seq 24 --pairs 4 --device cuda --threads 0

The model is a random-weight GPT-2 with GPT-2 small's widths (768 wide, 12 heads, MLP 3072, vocabulary 50257),
fewer layers by default so that a round takes seconds on one CPU thread; eager attention, fp32, eval. Every
contender computes the same table, the metric (answer minus distractor logit at the last position, per pair,
averaged over the pairs) at every (layer, position) with the clean run's `resid_pre` patched into the corrupted
run, including the clean run that supplies the activations:
  loop             one forward per cell, plain torch hooks on the HF blocks (tests/lm_references.py)
  transformerlens  TransformerLens 4.3's `patching.get_act_patch_resid_pre` through its TransformerBridge
  runner           runner.methods.lm_patching: the variants stacked in the batch, many cells per forward
Each runs on its own copy of the model, checked for foreign hooks before every call, timed interleaved and
round-robin (scripts/benchtools.py); the tables are checked equal before any timing. Prints seconds (median,
spread), cells/s and the ratios.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens draws a progress bar per call

import torch  # noqa: E402
from benchtools import Contender, close_all, interleaved, pick_device, report  # noqa: E402
from torch import nn  # noqa: E402

from runner.hooks import count_hooks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references live beside the tests
from lm_references import Metric, build_tokenizer, logit_diff, loop_patching, tl_bridge, tl_patching  # noqa: E402

SITE = "resid_pre"


def build_gpt2(layers: int, seed: int) -> nn.Module:
    """GPT-2 small's shape with `layers` blocks, random weights (GPT-2's own initialisation), eager attention."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config).float().eval()


def tokenizer_for(vocab: int, folder: Path) -> object:
    """A WordLevel tokenizer with the model's vocabulary size, reloaded from a folder (TL's bridge reloads it)."""
    from transformers import AutoTokenizer

    build_tokenizer(vocab - 4).save_pretrained(folder)  # 4 special tokens, then t0000...
    return AutoTokenizer.from_pretrained(folder)


def loop_contender(
    model: nn.Module, tokenizer: object, clean: torch.Tensor, corrupted: torch.Tensor, metric: Metric
) -> Contender:
    """One full forward per (layer, position), hooks registered and removed per forward."""
    return Contender("loop", lambda: loop_patching(model, clean, corrupted, SITE, metric), model)


def tl_contender(
    model: nn.Module, tokenizer: object, clean: torch.Tensor, corrupted: torch.Tensor, metric: Metric
) -> Contender:
    """TransformerLens' bridge (booted once, outside the timing) around its own copy of the model.

    The bridge installs resident capture hooks of its own (2 or 3 per block) on its first forward: lazy.
    """
    bridge = tl_bridge(model, tokenizer)
    run = lambda: tl_patching(bridge, tokenizer, clean, corrupted, SITE, metric)  # noqa: E731
    return Contender("transformerlens", run, bridge, lazy=True)


def runner_contender(
    model: nn.Module, tokenizer: object, clean: torch.Tensor, corrupted: torch.Tensor, metric: Metric
) -> Contender:
    """The runner's engine (runner.methods.lm_patching): the clean and corrupted runs, then every (layer, position)
    variant stacked in the batch, many per forward; hooks registered and removed per call."""
    from runner.methods.lm_patching import lm_patching_on_ids

    answer, distractor = metric.answer, metric.distractor  # type: ignore[attr-defined]
    layers, seq = model.config.n_layer, clean.shape[1]

    def run() -> torch.Tensor:
        rows = lm_patching_on_ids(model, clean, corrupted, answer, distractor, sites=[SITE])
        table = torch.zeros(layers, seq)
        means = rows.groupby(["layer", "position"]).patched.mean()
        for (layer, position), value in means.items():
            table[int(layer), int(position)] = float(value)
        return table

    return Contender("runner", run, model)


Factory = Callable[[nn.Module, object, torch.Tensor, torch.Tensor, Metric], Contender]

# ----- the contenders: each factory gets its OWN copy of the model (and the tokenizer, prompts, metric) and returns
# a Contender whose fn() returns the (layers, positions) table, batch-averaged, on the CPU.
CONTENDERS: dict[str, Factory] = {
    "runner": runner_contender,
    "loop": loop_contender,
    "transformerlens": tl_contender,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (GPT-2 small has 12)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per prompt: positions patched per layer")
    parser.add_argument("--pairs", type=int, default=2, help="clean/corrupted pairs, run as one batch")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each contender once per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per contender first")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of {list(CONTENDERS)}")
    args = parser.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    model = build_gpt2(args.layers, seed=0).to(device)
    vocab = model.config.vocab_size
    folder = Path(tempfile.mkdtemp(prefix="bench_lm_tok_"))
    tokenizer = tokenizer_for(vocab, folder)

    g = torch.Generator().manual_seed(1)
    clean = torch.randint(4, vocab, (args.pairs, args.seq), generator=g)
    corrupted = clean.clone()
    changed = args.seq // 2  # one token per pair swapped in the middle (the "subject" slot)
    corrupted[:, changed] = torch.randint(4, vocab, (args.pairs,), generator=g)
    answer, distractor = torch.randint(4, vocab, (2, args.pairs), generator=g)
    clean, corrupted = clean.to(device), corrupted.to(device)
    metric = logit_diff(answer.to(device), distractor.to(device))
    cells = args.layers * args.seq

    names = args.only or list(CONTENDERS)
    contenders = [CONTENDERS[n](copy.deepcopy(model), tokenizer, clean, corrupted, metric) for n in names]
    del model

    # The same table from every contender before any timing (the loop is the reference when it runs).
    tables = {c.name: torch.as_tensor(c.fn()).float().cpu() for c in contenders}
    ref_name = "loop" if "loop" in tables else names[0]
    for name, table in tables.items():
        if table.shape != (args.layers, args.seq):
            raise AssertionError(f"{name}: table of shape {tuple(table.shape)}, expected {(args.layers, args.seq)}")
        diff = float((table - tables[ref_name]).abs().max())
        scale = float(tables[ref_name].abs().max())
        print(f"{name}: max |difference| to {ref_name} {diff:.2e} (largest value {scale:.3f})")
        if diff > 1e-4 * max(1.0, scale):
            raise AssertionError(f"{name} disagrees with {ref_name} by {diff:.2e}")
    for c in contenders:  # the check's call was a lazy contender's first: what it registered is now its own
        if c.lazy:
            c.hooks = count_hooks(c.model)

    print(f"model=gpt2-shaped layers={args.layers} d_model=768 seq={args.seq} pairs={args.pairs} cells={cells} "
          f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")  # fmt: skip
    reference = "transformerlens" if "transformerlens" in names else names[0]
    try:
        timings = interleaved(contenders, device, reference=reference, rounds=args.rounds, warmup=args.warmup)
    finally:
        close_all(contenders)
    report(timings, per_call=cells, unit="cells/s")
    for name in names:  # each contender against the slower baselines (TL is not compared against the loop twice)
        for other in ("transformerlens", "loop"):
            if other in names and other != name and name != "transformerlens":
                print(f"{name}: {timings.median(other) / timings.median(name):.2f}x faster than {other} "
                      f"(paired {1 / timings.paired(name, other):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
