"""Edge scores with bfloat16 weights against float32: the same random grouped-query Llama, the same pairs, every edge
scored by `lm_edge_attribution` once with the model in float32 and once in bfloat16 (the forward and the gradients
in bf16; the writes, the readers' gradients and the scores summed in float32: runner/methods/lm_edges/scores.py).

    python scripts/edges_bf16.py                           # 6 layers, 8 query heads sharing 2 key-value heads, eap_ig
    python scripts/edges_bf16.py --layers 12 --width 512 --mode eap

Prints the largest |bf16 - fp32| relative to the largest |fp32 score|, the median relative error of the edges whose
|fp32 score| is in the top 1%, Spearman's rank correlation over all edges and the overlap of the top-1% sets.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references live beside the tests
from lm_references import build_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--mode", default="eap_ig")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from runner.methods.lm_edges import lm_edge_attribution

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.width, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=2 * args.width, vocab_size=len(tokenizer),
        max_position_embeddings=256,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    words = [t for t in tokenizer.get_vocab() if t.startswith("t")][:60]
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(args.pairs):
        clean = list(rng.choice(words, args.tokens))
        corrupted = list(clean)
        half = args.tokens // 2
        corrupted[:half] = rng.choice(words, half)
        answer, distractor = rng.choice(words, 2, replace=False)
        pairs.append({"clean": " ".join(clean), "corrupted": " ".join(corrupted), "answer": str(answer),
                      "distractor": str(distractor)})  # fmt: skip
    full = lm_edge_attribution(model, tokenizer, pairs, mode=args.mode, steps=3).set_index("edge").score
    half_model = model.to(torch.bfloat16)
    low = lm_edge_attribution(half_model, tokenizer, pairs, mode=args.mode, steps=3).set_index("edge").score
    low = low[full.index].astype(float)
    full = full.astype(float)
    scale = float(full.abs().max())
    k = max(1, len(full) // 100)
    top = full.abs().nlargest(k).index
    relative = ((low[top] - full[top]).abs() / full[top].abs()).median()
    spearman = pd.Series(full).rank().corr(pd.Series(low).rank())
    overlap = len(set(top) & set(low.abs().nlargest(k).index)) / k
    print(f"{len(full)} edges, {args.pairs} pairs, mode {args.mode}: largest |bf16 - fp32| = "
          f"{float((low - full).abs().max()) / scale:.2e} of the largest |score| ({scale:.3g}); top 1% ({k} edges): "
          f"median relative error {relative:.2e}, {overlap:.0%} shared; Spearman over every edge {spearman:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
