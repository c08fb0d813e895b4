"""A sparse dictionary spliced into a language model: patching its latents against patching the site it reads, and
training one (method=train_sae), on SmolLM2-135M; figures are ratios and rates on this machine, not absolute claims.

    python scripts/bench_dictionaries.py                           # SmolLM2, a random TopK 4096/k=32: a few minutes
    python scripts/bench_dictionaries.py --dictionary RUN/dictionary   # a dictionary method=train_sae wrote
    python scripts/bench_dictionaries.py --quick                   # the induction model, tiny sizes: under a minute

1. Patching (`runner.methods.lm_patching.lm_activation_patching`, denoising, one batch of --pairs pairs of the model's
   experiment: IOI for SmolLM2 (experiment=ioi_smollm2's template), the shipped pairs for the induction model). A TopK
   SAE of --width latents, k = --k, reads resid_post of --layer (default the middle block); without --dictionary its
   weights are random (written with save_saelens and read back with load_dictionary, as a trained one is): a random
   TopK dictionary reconstructs nothing useful, but it fires exactly k latents per position, as a trained one does.
   What exact latent patching costs is how many latents differ between the clean and corrupted runs somewhere in the
   batch, and a random encoder's top k follow the stream's few large directions: on SmolLM2 a trained dictionary
   had about twice the random one's live latents (benchmarks/RESULTS.md), so prefer --dictionary. Contenders,
   each on its own copy of the model (the dictionary spliced into the copies that read its sites,
   runner.dictionaries.splice.attach), timed interleaved and round-robin (scripts/benchtools.py):
     site         exact patching of resid_post at the layer: one cell per position (the reference)
     latent       exact patching of the site `latent`: one cell per latent, all positions at once; a latent whose
                  value is the same in the clean and corrupted runs for every pair is not run and has no row
                  (unchanged_latents in runner/methods/lm_patching/exact.py): `live` latents cost forwards, the
                  others nothing
     error        exact patching of the site `error` (the SAE's error term): one cell per position
     attribution  mode=attribution on the latents: every latent estimated from one backward
   Checked before timing: the spliced copies' clean and corrupted metrics equal the plain model's, and the live
   latents are counted from the runs' latents (the same comparison the patcher makes).
2. Training (method=train_sae's own code, runner/methods/train_sae/): the site's activations collected over windows
   of the train experiment's text (experiment=train_sae_smollm2: python_docs, 128 tokens) with its SiteReader (the
   forward stopped after the site's block), and `train_dictionary` (TopK, Adam, AuxK) on them for --steps steps at
   each of --train-widths, timed interleaved. Then one whole `method=train_sae` run (runner.app.run, --cli-windows
   windows, --cli-steps steps, width --width; 0: skipped): its wall time against the training seconds its table reports.

Prints a table per part and the exact command.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from benchtools import Contender, Timings, close_all, interleaved, pick_device
from torch import nn

from runner.hooks import HookSession, count_hooks

ROOT = Path(__file__).resolve().parents[1]
# --model -> (the experiment whose data gives the patching pairs, the experiment method=train_sae runs)
EXPERIMENTS = {"smollm2-135m": ("ioi_smollm2", "train_sae_smollm2"), "induction": ("patching_lm_induction",
               "train_sae_induction")}  # fmt: skip
QUICK = {"model": "induction", "width": 256, "k": 8, "pairs": 4, "rounds": 1, "train_widths": [128, 256], "steps": 5,
         "windows": 16, "cli_windows": 16, "cli_steps": 5}  # fmt: skip
TOLERANCE = 1e-4  # |spliced - plain| clean and corrupted metrics, over the largest |metric| (float32 rounding)


# ----- set-up -----------------------------------------------------------------------------------------------------
def composed(*overrides: str) -> Any:
    """conf/ composed as the CLI composes it (its defaults, its schema), with overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.configure import to_run_config
    from runner.options.compose import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["progress=false", "method.pictures=false", *overrides])
    return to_run_config(cfg)


def pairs_of(data: Any, tokenizer: Any, seed: int) -> list[dict[str, Any]]:
    """The prompt pairs the experiment's data config makes ({clean, corrupted, answer, distractor}, as data=prompts)."""
    from runner.options.data.prompts import SHIPPED_PAIRS, read_pairs_file

    if data.name == "ioi":
        from runner.data.ioi import ioi_pairs, one_token_names

        return ioi_pairs(data, one_token_names(data.names, tokenizer), seed)
    if data.file in SHIPPED_PAIRS:
        package, path = SHIPPED_PAIRS[data.file]
        return read_pairs_file(Path(str(resources.files(package) / path)))
    return data.raw_pairs()


def random_topk(d: int, width: int, k: int, seed: int) -> Any:
    """A TopK dictionary with random weights: encoder columns N(0, 1/d), unit decoder rows, no biases (every
    position's top k pre-activations are positive almost surely: exactly k latents fire)."""
    from runner.dictionaries.dictionary import Dictionary, DictionarySpec

    g = torch.Generator().manual_seed(seed)
    dictionary = Dictionary(DictionarySpec("topk", d, width, d, k=k))
    with torch.no_grad():
        dictionary.W_enc.copy_(torch.randn(d, width, generator=g) / d**0.5)
        rows = torch.randn(width, d, generator=g)
        dictionary.W_dec.copy_(rows / rows.norm(dim=-1, keepdim=True))
    return dictionary.requires_grad_(False)


def placement(folder: Path, layer: int | None) -> tuple[str, int | None]:
    """(site, layer) a saved dictionary reads: method=train_sae's metadata, else SAELens's hook name
    blocks.<layer>.hook_<site>; the site defaults to resid_post, the layer to `layer`."""
    meta = json.loads((folder / "cfg.json").read_text()).get("metadata", {})
    site, found = meta.get("runner_site"), meta.get("runner_layer")
    named = re.fullmatch(r"blocks\.(\d+)\.hook_(\w+)", str(meta.get("hook_name", "")))
    if named:
        found = int(named.group(1)) if found is None else found
        site = site or named.group(2)
    return site or "resid_post", layer if layer is not None else found


def latents_live(spliced: nn.Module, pairs: list[dict[str, Any]], tokenizer: Any, layer: int) -> dict[str, float]:
    """How many latents differ between the clean and corrupted runs at some position of some pair (the ones exact
    patching runs), from the runs' `latent` sites (the tensors the patcher compares), and how many fire a position."""
    from runner.data.prompts import pairs_batch
    from runner.hooks.sites import SiteHooks
    from runner.models.lm_sites import layout_of

    device = next(spliced.parameters()).device
    _, batch = pairs_batch(pairs, tokenizer, True, device)
    mask = batch.extras["attention_mask"]
    layout = layout_of(spliced)
    name = f"latent.{layer}"
    kept = {}
    with HookSession(spliced, []) as session:
        hooks = SiteHooks(spliced, [layout.site("latent", layer)], session)
        for run in (0, 1):
            with torch.no_grad(), hooks.keep():
                spliced(input_ids=batch.x[:, run], attention_mask=mask, use_cache=False)
            kept[run] = hooks.kept[name][..., 0]  # (B, T, width)
    same = (kept[0] == kept[1]).all(dim=1)  # (B, width): equal at every position of that pair
    fires = (kept[0] != 0).sum(-1).float()[mask.bool()]  # latents firing per real position (clean run)
    width = same.shape[1]
    return {"live": width - int(same.all(dim=0).sum()), "width": width,
            "live_per_pair": float((~same).sum(1).float().mean()), "fires": float(fires.mean())}  # fmt: skip


def rank_agreement(exact: pd.DataFrame, estimated: pd.DataFrame) -> float:
    """Spearman's rho of attribution's estimated effect against the exact (patched - corrupted), per pair over the
    latents that moved in either, averaged over pairs (the unchanged latents, exactly 0 in both, left out)."""
    from scipy.stats import spearmanr

    keys = ["sample_index", "head"]
    both = exact.merge(estimated, on=keys, suffixes=("", "_est"), validate="one_to_one")
    both = both.assign(exact=both.patched - both.corrupted, estimate=both.patched_est - both.corrupted_est)
    both = both[(both.exact != 0) | (both.estimate != 0)]
    rhos = [spearmanr(g.exact, g.estimate).statistic for _, g in both.groupby("sample_index") if len(g) > 2]
    return float(statistics.mean(rhos)) if rhos else float("nan")


# ----- printing ---------------------------------------------------------------------------------------------------
def quartiles(values: list[float]) -> tuple[float, float]:
    v = sorted(values)
    if len(v) < 2:
        return v[0], v[0]
    q1, _, q3 = statistics.quantiles(v, n=4)
    return q1, q3


def table(timings: Timings, rows: dict[str, dict[str, str]], columns: list[str]) -> None:
    """One line per contender: median seconds, quartiles, the ratio to the reference (of medians, and paired),
    then `rows`' own columns."""
    head = f"{'contender':24s} {'median s':>9s} {'q1-q3 s':>15s} {'x ref':>6s} {'paired':>6s}"
    print(head + "".join(f" {c:>14s}" for c in columns) + f"   (ref: {timings.reference})")
    for name, seconds in timings.seconds.items():
        q1, q3 = quartiles(seconds)
        line = f"{name:24s} {timings.median(name):9.3f} {q1:7.3f}-{q3:<7.3f} {timings.ratio(name):6.2f}"
        line += f" {timings.paired(name):6.2f}" + "".join(f" {rows[name].get(c, ''):>14s}" for c in columns)
        print(line)


# ----- 1. patching ------------------------------------------------------------------------------------------------
def bench_patching(args: argparse.Namespace, model: nn.Module, tokenizer: Any, pairs: list[dict[str, Any]],
                   device: torch.device) -> tuple[int, nn.Module]:  # fmt: skip
    """Part 1; returns (the layer, the plain model copy, free again for part 2)."""
    from runner.dictionaries.formats import load_dictionary, read_spec, save_saelens
    from runner.dictionaries.splice import Spliced, attach
    from runner.methods.lm_patching import lm_activation_patching
    from runner.models.lm_sites import layout_of

    n_layers, d = model.config.num_hidden_layers, model.config.hidden_size
    if args.dictionary:
        folder = Path(args.dictionary)
        site, layer = placement(folder, args.layer)
        if layer is None:
            raise SystemExit(f"{folder}: its config names no layer: give --layer")
        spec = read_spec(folder)
        origin = f"{folder} ({spec.architecture}, width {spec.width}, k {spec.k})"
    else:
        site, layer = "resid_post", n_layers // 2 if args.layer is None else args.layer
        folder = Path(tempfile.mkdtemp(prefix="bench_dictionaries_"))
        random = random_topk(d, args.width, args.k, seed=0)
        save_saelens(random, folder, f"blocks.{layer}.hook_{site}", args.model)
        spec = random.spec
        origin = f"RANDOM weights (no --dictionary): topk, width {spec.width}, k {spec.k}, written to {folder}"
    print(f"dictionary: {origin}; spliced at {site}.{layer} of {n_layers} blocks (d_model {d})")

    def spliced_copy() -> nn.Module:
        copied = copy.deepcopy(model)
        attach(copied, layout_of(copied), [Spliced(load_dictionary(folder, device), site, layer)])
        return copied

    models = {"site": copy.deepcopy(model), "latent": spliced_copy(), "error": spliced_copy(),
              "attribution": spliced_copy()}  # fmt: skip
    settings = {"site": ([site], "exact"), "latent": (["latent"], "exact"), "error": (["error"], "exact"),
                "attribution": (["latent"], "attribution")}  # fmt: skip

    def call(name: str) -> Callable[[], pd.DataFrame]:
        sites, mode = settings[name]
        return lambda: lm_activation_patching(models[name], tokenizer, pairs, sites=sites, layers=[layer],
                                              directions=["denoising"], mode=mode)  # fmt: skip

    contenders = [Contender(name, call(name), models[name]) for name in models]
    # One untimed call each: the tables checked, the cells counted (and each contender warmed up).
    tables, first = {}, {}
    for c in contenders:
        started = time.perf_counter()
        tables[c.name] = c.fn()
        first[c.name] = time.perf_counter() - started
    plain = tables["site"].groupby("sample_index")[["clean", "corrupted"]].first()
    for name in ("latent", "error", "attribution"):
        ours = tables[name].groupby("sample_index")[["clean", "corrupted"]].first()
        diff = float((ours - plain).abs().to_numpy().max())
        if diff > TOLERANCE * max(1.0, float(plain.abs().to_numpy().max())):
            raise AssertionError(f"{name}: the spliced model's metrics differ from the model's by {diff:.2e}")
    live = latents_live(models["latent"], pairs, tokenizer, layer)
    rows_per_pair = {name: len(tables[name]) // len(pairs) for name in models}
    for name in ("latent", "attribution"):  # rows for the changed latents only (5325d55); before it, every latent's
        if rows_per_pair[name] not in (live["live"], live["width"]):
            raise AssertionError(f"{name}: {rows_per_pair[name]} latent rows per pair, {live['live']} latents live")
    # cells covered: every position of the site or the error, every latent of the dictionary
    cells = {**rows_per_pair, "latent": live["width"], "attribution": live["width"]}
    positions = cells["site"]
    rho = rank_agreement(tables["latent"], tables["attribution"])
    print(f"pairs: {len(pairs)} in one batch, {positions} positions; latents: {live['live']} of {live['width']} live "
          f"(differ between the clean and corrupted runs somewhere in the batch: run exactly), "
          f"{live['width'] - live['live']} skipped as unchanged; {live['live_per_pair']:.0f} live per pair on average; "
          f"{live['fires']:.1f} latents fire per position (clean run)")  # fmt: skip
    print(f"spliced copies' clean and corrupted metrics equal the model's (within {TOLERANCE:g}); attribution vs exact "
          f"on the latents that moved: Spearman rho {rho:.3f} (mean over pairs)")  # fmt: skip
    print("first (untimed) call, s: " + ", ".join(f"{k} {v:.2f}" for k, v in first.items()))
    timings = interleaved(contenders, device, reference="site", rounds=args.rounds, warmup=args.warmup)
    close_all(contenders)
    runs = {"site": positions, "latent": live["live"], "error": cells["error"], "attribution": 0}
    rows = {}
    for name in models:
        med = timings.median(name)
        rows[name] = {"cells": f"{cells[name]}", "cells run": f"{runs[name]}", "cells/s": f"{cells[name] / med:.1f}",
                      "s/cell run": f"{med / runs[name]:.4f}" if runs[name] else "-"}  # fmt: skip
    print(
        f"\n1. patching {site}.{layer} vs its dictionary's sites, {len(pairs)} pairs per batch, {args.rounds} rounds:"
    )
    table(timings, rows, ["cells", "cells run", "cells/s", "s/cell run"])
    per_live = timings.median("latent") / max(live["live"], 1)
    per_position = timings.median("site") / positions
    print(f"latent/site: {timings.ratio('latent'):.2f}x the time (paired {timings.paired('latent'):.2f}x) for "
          f"{cells['latent'] / positions:.0f}x the cells, {live['live'] / positions:.1f}x the cells run; a live latent "
          f"costs {per_live / per_position:.2f}x a position of the site")  # fmt: skip
    if args.profile:
        profile(call("latent"))
    del models["latent"], models["error"], models["attribution"]
    return layer, models["site"]


def profile(fn: Callable[[], object]) -> None:
    """Where one exact latent-patching call spends its time (cProfile, cumulative, the top functions)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    print("\nprofile of one latent call (cumulative seconds):")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(r"runner/|linear|topk", 25)


# ----- 2. training ------------------------------------------------------------------------------------------------
def bench_training(args: argparse.Namespace, model: nn.Module, tokenizer: Any, layer: int,
                   device: torch.device) -> None:  # fmt: skip
    from runner.data.text import text_source
    from runner.methods.train_sae.activations import SiteReader
    from runner.methods.train_sae.training import Training, train_dictionary
    from runner.models.lm_sites import layout_of

    cfg = composed(f"experiment={EXPERIMENTS[args.model][1]}", f"model.name={args.model}")
    data = copy.copy(cfg.data)
    data.windows = args.windows
    source = text_source(data, tokenizer, cfg.seed)
    windows, first = source.windows.to(device), int(source.bos)
    batch, (n, context) = cfg.data.batch_size, windows.shape
    layout = layout_of(model)
    session = HookSession(model, [])
    reader = SiteReader(model, layout, layout.site(cfg.method.site, layer), session)
    kept: list[torch.Tensor] = []

    def collect() -> None:
        kept.clear()
        for start in range(0, n, batch):
            kept.append(reader.read(windows[start : start + batch])[:, first:].reshape(-1, model.config.hidden_size))

    collect()
    acts = torch.cat(kept)  # (N, d): what train_dictionary trains on
    dummies: list[nn.Module] = []

    def trainer(width: int) -> Callable[[], object]:
        training = Training("topk", width, k=args.k, steps=args.steps, batch_tokens=cfg.method.batch_tokens,
                            lr=cfg.method.lr, seed=0)  # fmt: skip
        return lambda: train_dictionary(acts, training)

    contenders = [Contender("collect", collect, model, hooks=count_hooks(model))]
    for width in args.train_widths:
        dummies.append(nn.Identity())  # training owns no model: a module of its own for the harness's checks
        contenders.append(Contender(f"train w={width}", trainer(width), dummies[-1]))
    try:
        timings = interleaved(contenders, device, reference="collect", rounds=args.rounds, warmup=args.warmup)
    finally:
        session.close()
    tokens = n * context
    batch_tokens = min(cfg.method.batch_tokens, acts.shape[0])
    rows = {"collect": {"tokens/s": f"{tokens / timings.median('collect'):.0f}", "work": f"{n}x{context} tok"}}
    for width in args.train_widths:
        med = timings.median(f"train w={width}")
        rows[f"train w={width}"] = {"work": f"{args.steps} steps", "steps/s": f"{args.steps / med:.2f}",
                                    "latent-tok/s": f"{width * batch_tokens * args.steps / med:.3g}"}  # fmt: skip
    print(
        f"\n2. training: {cfg.method.site}.{layer} activations of {n} windows of {context} tokens "
        f"({acts.shape[0]} positions without the BOS), TopK k={args.k}, batch_tokens {batch_tokens}, Adam:"
    )
    table(timings, rows, ["work", "tokens/s", "steps/s", "latent-tok/s"])
    if len(args.train_widths) > 1:
        a, b = args.train_widths[0], args.train_widths[-1]
        slower = timings.median(f"train w={b}") / timings.median(f"train w={a}")
        print(f"width {a} -> {b} ({b / a:.1f}x): a step takes {slower:.2f}x the time (paired "
              f"{timings.paired(f'train w={b}', f'train w={a}'):.2f}x)")  # fmt: skip
    if args.cli_steps > 0:
        whole_run(args, layer)


def whole_run(args: argparse.Namespace, layer: int) -> None:
    """One `method=train_sae` run through runner.app.run: its wall time and the training seconds its table reports."""
    from runner.app import run

    width = args.width
    # the run's threads are this process's (a run's default is every CPU: two threads each on a loaded machine)
    overrides = [f"experiment={EXPERIMENTS[args.model][1]}", f"model.name={args.model}", f"method.layer={layer}",
                 f"method.width={width}", f"method.k={args.k}", f"method.steps={args.cli_steps}",
                 f"data.windows={args.cli_windows}", f"device={args.device}",
                 f"threads={torch.get_num_threads()}"]  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="bench_dictionaries_run_"))
    logging.getLogger("runner").setLevel(logging.WARNING)
    started = time.perf_counter()
    result = run(composed(*overrides), out)
    wall = time.perf_counter() - started
    row = pd.read_parquet(result.tables["train_sae"]).iloc[0]
    train = float(row.train_seconds)
    print(f"\nwhole run: python -m runner {' '.join(overrides)} -> {out}")
    print(f"  {wall:.1f} s wall, of which training {train:.1f} s ({args.cli_steps / train:.2f} steps/s, width {width});"
          f" the rest (load, collection, evaluation's 3 forwards per held-out window, feature table) {wall - train:.1f}"
          f" s; train positions {int(row.train_positions)}, held-out FVU {row.fvu:.3f}, L0 {row.l0:.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(EXPERIMENTS))
    parser.add_argument("--dictionary", default=None, help="a saved dictionary's folder (default: a random TopK one)")
    parser.add_argument("--layer", type=int, default=None, help="the block (default: the dictionary's, or the middle)")
    parser.add_argument("--width", type=int, default=4096, help="the random dictionary's latents")
    parser.add_argument("--k", type=int, default=32, help="latents kept per position (random dictionary, training)")
    parser.add_argument("--pairs", type=int, default=4, help="prompt pairs, run as one batch")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, each contender once per round")
    parser.add_argument("--warmup", type=int, default=0, help="untimed calls per contender (after the check's)")
    parser.add_argument("--train-widths", type=int, nargs="*", default=[4096, 8192], help="widths trained (part 2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed call")
    parser.add_argument("--windows", type=int, default=32, help="windows of text collected per timed call")
    parser.add_argument("--cli-windows", type=int, default=64, help="data.windows of the whole method=train_sae run")
    parser.add_argument("--cli-steps", type=int, default=100, help="method.steps of the whole run (0: no run)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["patching", "training"])
    parser.add_argument("--profile", action="store_true", help="cProfile one exact latent-patching call")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK} unless given")
    args = parser.parse_args()
    if args.quick:  # the quick sizes, except where the command line names its own
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    from runner.models import build_model

    cfg = composed(f"experiment={EXPERIMENTS[args.model][0]}", f"model.name={args.model}")
    started = time.perf_counter()
    bundle = build_model(cfg.model)
    model, tokenizer = bundle.model.to(device).eval(), bundle.tokenizer
    print(f"{args.model} loaded in {time.perf_counter() - started:.1f} s; device={device} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}")  # fmt: skip
    pairs = pairs_of(cfg.data, tokenizer, cfg.seed)[: args.pairs]
    layer = model.config.num_hidden_layers // 2 if args.layer is None else args.layer
    plain = model
    if "patching" not in args.skip:
        layer, plain = bench_patching(args, model, tokenizer, pairs, device)
        del model
    if "training" not in args.skip:
        bench_training(args, plain, tokenizer, layer, device)
    print(f"\ncommand: python scripts/bench_dictionaries.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
