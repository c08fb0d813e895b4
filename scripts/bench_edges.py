"""Edge attribution patching (EAP): the runner vs TransformerLens 4.3's `attribution_patch` at edge granularity, checked
equal, then timed.

    python scripts/bench_edges.py                        # GPT-2-shaped random model, 6 layers x 8 heads, 4 pairs
    python scripts/bench_edges.py --layers 12 --heads 12 --width 768 --device cuda

The model is a random-weight GPT-2 (TransformerLens refuses grouped-query models at edge granularity), eval, fp32;
the pairs are random token sequences whose first half differs between clean and corrupted, metric = answer minus
distractor logit at the last position. Both compute every edge's score (writer's clean - corrupted write . the
gradient of the metric with respect to the reader's input at the corrupted run), TransformerLens per position and per
pair (summed over positions here), the runner batched over pairs and positions (`lm_edge_attribution`, mode=eap);
the scores are checked equal (5e-5 of the largest) before any timing. Each runs on its own copy of the model, checked
for foreign hooks before every call, timed interleaved and round-robin (scripts/benchtools.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from benchtools import Contender, close_all, interleaved, pick_device, report  # noqa: E402

from runner.hooks import count_hooks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references live beside the tests
from lm_references import build_tokenizer, tl_bridge, tl_edge_name  # noqa: E402

TOLERANCE = 5e-5  # of the largest |score|


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    import tempfile

    import transformers

    from runner.methods.lm_edges import lm_edge_attribution
    from runner.methods.lm_edges.graph import EdgeGraph
    from runner.models.lm_sites import layout_of

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                                     vocab_size=len(tokenizer), n_positions=max(64, args.tokens + 1),
                                     bos_token_id=2, eos_token_id=3, pad_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = Path(tempfile.mkdtemp(prefix="bench_edges_"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    model = model.to(device)
    words = [w for w in tokenizer.get_vocab() if w.startswith("t") and w[1:].isdigit()]
    generator = torch.Generator().manual_seed(1)
    pairs = []
    for _ in range(args.pairs):
        picked = [words[int(i)] for i in torch.randint(len(words), (args.tokens + 2,), generator=generator)]
        half = args.tokens // 2
        clean = " ".join(picked[: args.tokens])
        corrupted = " ".join(picked[args.tokens - half :][:half] + picked[half : args.tokens])
        pairs.append({"clean": clean, "corrupted": corrupted, "answer": picked[-1], "distractor": picked[-2]})
    edges = EdgeGraph.of(layout_of(model)).count
    print(f"GPT-2 {args.layers} layers x {args.heads} heads, width {args.width}; {args.pairs} pairs of"
          f" {args.tokens + 1} tokens; {edges} edges; device {device}")  # fmt: skip

    def run_runner() -> dict[str, float]:
        table = lm_edge_attribution(model, tokenizer, pairs, mode="eap", min_span=0.0)  # TL flags no pair
        return dict(zip(table.edge, table.score.astype(float), strict=True))

    started = time.perf_counter()
    bridge = tl_bridge(folder, tokenizer)
    bridge.to(device)
    print(f"TransformerBridge booted in {time.perf_counter() - started:.1f} s")
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch

    def ids(text: str) -> list[int]:
        return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]

    clean = torch.tensor([ids(p["clean"]) for p in pairs], device=device)
    corrupted = torch.tensor([ids(p["corrupted"]) for p in pairs], device=device)
    answers = [tokenizer.convert_tokens_to_ids(p["answer"]) for p in pairs]
    distractors = [tokenizer.convert_tokens_to_ids(p["distractor"]) for p in pairs]

    def run_tl() -> dict[str, float]:
        # one call per pair (TransformerLens runs its pairs one by one anyway), each with its own metric; the mean
        out: dict[str, float] = {}
        for i in range(len(pairs)):
            answer, distractor = answers[i], distractors[i]
            result = attribution_patch(
                bridge, clean[i : i + 1], corrupted[i : i + 1],
                lambda logits, a=answer, d=distractor: logits[0, -1, a] - logits[0, -1, d],
                EdgeAttributionConfig(granularity="edge"),
            )  # fmt: skip
            for (writer, reader), value in result.edge_scores.items():
                key = f"{tl_edge_name(writer)}->{tl_edge_name(reader)}"
                out[key] = out.get(key, 0.0) + float(value) / len(pairs)
        return out

    ours, theirs = run_runner(), run_tl()
    # the bridge keeps module hooks of its own after its first edge sweep: resident, its own, counted from there
    resident = count_hooks(bridge)
    contenders = [Contender("runner eap", run_runner, model),
                  Contender("transformerlens eap", run_tl, bridge, hooks=resident)]  # fmt: skip
    if set(ours) != set(theirs):
        raise SystemExit(f"different edges: {len(set(ours) ^ set(theirs))} differ")
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    scale = max(abs(v) for v in theirs.values())
    print(f"scores checked: {len(ours)} edges, worst |runner - TL| = {worst:.2e} (largest |score| {scale:.2e})")
    if worst > TOLERANCE * max(1.0, scale):
        raise SystemExit("the scores differ")
    if args.rounds:
        timings = interleaved(contenders, device, "transformerlens eap", rounds=args.rounds, warmup=0)
        report(timings, per_call=edges, unit="edges/s")
    close_all(contenders)


if __name__ == "__main__":
    main()
