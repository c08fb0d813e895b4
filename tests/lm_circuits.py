"""Attention-pattern scores of a causal LM's heads, the standard way (Olsson et al. 2022), written with no runner code.

The model reads `<bos> S S` for random runs S of distinct content tokens and returns its attention patterns
(eager attention: fused kernels never materialise them). For a position i in the second copy, the token at i also sat
at i - L, so an induction head attends from i to i - L + 1, the token that followed it the first time; a
previous-token head attends from i to i - 1. A head's score is its mean attention to that target.
"""

from __future__ import annotations

import torch


def _repeated_runs(tokenizer, seed: int, n: int, length: int) -> torch.Tensor:
    """(n, 1 + 2 * length) ids: <bos>, a run of distinct non-special tokens, the same run again."""
    special = set(tokenizer.all_special_ids)
    content = torch.tensor(sorted(i for i in tokenizer.get_vocab().values() if i not in special))
    generator = torch.Generator().manual_seed(seed)
    runs = torch.stack([content[torch.randperm(len(content), generator=generator)[:length]] for _ in range(n)])
    return torch.cat([torch.full((n, 1), tokenizer.bos_token_id), runs, runs], dim=1)


@torch.no_grad()
def _patterns(model, ids: torch.Tensor) -> torch.Tensor:
    """(layers, n, heads, T, T) attention patterns of `model` on `ids`."""
    if model.config._attn_implementation != "eager":
        raise ValueError('load the model with attn_implementation="eager": fused attention returns no patterns')
    attentions = model(ids, output_attentions=True).attentions
    return torch.stack(attentions)


def induction_scores(model, tokenizer, seed: int = 0, n: int = 32, length: int = 20) -> torch.Tensor:
    """(layers, heads): mean attention from each second-copy position i to i - length + 1."""
    patterns = _patterns(model, _repeated_runs(tokenizer, seed, n, length))
    query = torch.arange(length + 1, 2 * length + 1)  # the second copy
    return patterns[:, :, :, query, query - length + 1].mean(dim=(1, 3))


def previous_token_scores(model, tokenizer, seed: int = 0, n: int = 32, length: int = 20) -> torch.Tensor:
    """(layers, heads): mean attention from each position i >= 2 to i - 1 (position 1's only choices are <bos> and
    itself, so it is left out)."""
    patterns = _patterns(model, _repeated_runs(tokenizer, seed, n, length))
    query = torch.arange(2, 2 * length + 1)
    return patterns[:, :, :, query, query - 1].mean(dim=(1, 3))
