"""What each latent of a dictionary is, as Neuronpedia shows a feature, from the held-out windows:

density          the share of the held-out positions at which it fires (f > 0);
mean_activation  its mean f over the positions at which it fires (NaN for a dead latent);
top contexts     the `contexts` positions where f is largest (f > 0 only), each as the text around the token
                 (CONTEXT_BEFORE tokens before it, CONTEXT_AFTER after, within its window) with the token marked,
                 `...the «if» statement...`, and its activation;
promoted, suppressed  the `logit_tokens` tokens with the largest and the smallest W_dec[i] @ W_U^T, the direct
                 effect of the latent's decoder direction on the logits through the unembedding W_U. No final norm
                 is applied (its scale depends on the position), so these rank tokens, they are not logit changes.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import torch

from runner.data.prompts import decoded
from runner.dictionaries.dictionary import Dictionary
from runner.methods.train_sae.evaluation import DENSE
from runner.tables import Presentation, declare

CONTEXT_BEFORE = 8  # tokens shown before a top-activating token
CONTEXT_AFTER = 3  # and after it
CHUNK = 4096  # positions encoded at once
LATENT_CHUNK = 256  # latents whose logit effects are computed at once
FEATURES_TABLE = "train_sae_features"

FEATURES = declare(
    FEATURES_TABLE,  # one row per latent, from the held-out windows (features.py)
    [
        pa.field("latent", pa.int64()),  # its index: row i of W_dec, column i of W_enc
        pa.field("density", pa.float64()),  # the share of the held-out positions at which it fires
        pa.field("mean_activation", pa.float32()),  # its mean f where it fires; NaN: dead
        pa.field("max_activation", pa.float32()),  # its largest f on the held-out positions (0: dead)
        pa.field("dead", pa.bool_()),  # it fires at no held-out position
        pa.field("dense", pa.bool_()),  # density above 0.1
        pa.field("top_activations", pa.list_(pa.float32())),  # its largest f, largest first
        pa.field("top_contexts", pa.list_(pa.string())),  # the text around each, the token marked «...»
        pa.field("top_windows", pa.list_(pa.string())),  # each one's window (its sample id)
        pa.field("top_positions", pa.list_(pa.int64())),  # and its position in the window (the BOS is 0)
        pa.field("promoted", pa.list_(pa.string())),  # the tokens of largest W_dec[i] @ W_U^T (no final norm)
        pa.field("promoted_logits", pa.list_(pa.float32())),  # their W_dec[i] @ W_U^T
        pa.field("suppressed", pa.list_(pa.string())),  # the tokens of smallest W_dec[i] @ W_U^T
        pa.field("suppressed_logits", pa.list_(pa.float32())),  # their W_dec[i] @ W_U^T
    ],
    Presentation(section="runner.viz.dictionary_report:features_section"),
    classes=False,
)


def top_activations(dictionary: Dictionary, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the `n` largest f of each latent (W, n), the positions of x (N, d) they are at (W, n), each latent's sum of
    f (W,)), over x in chunks; positions where f is not above 0 have value 0 (and are not contexts)."""
    width = dictionary.width
    values = torch.zeros(width, 0)
    where = torch.zeros(width, 0, dtype=torch.long)
    sums = torch.zeros(width, dtype=torch.float64)
    start = 0
    with torch.no_grad():
        for chunk in x.split(CHUNK):
            f = dictionary.encode(chunk).cpu()  # (C, W)
            sums += f.double().sum(0)
            top = f.t().topk(min(n, f.shape[0]), dim=1)  # (W, n): this chunk's best, then merged with the best so far
            values = torch.cat([values, top.values], dim=1)  # (W, <= 2n)
            where = torch.cat([where, top.indices + start], dim=1)
            best = values.topk(min(n, values.shape[1]), dim=1)
            values, where = best.values, where.gather(1, best.indices)
            start += f.shape[0]
    return values, where, sums


def logit_tokens(dictionary: Dictionary, unembedding: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """(promoted ids (W, n), their values, suppressed ids (W, n), their values): the top and bottom `n` entries of
    each decoder row times the unembedding (V, d), W_dec[i] @ W_U^T, computed LATENT_CHUNK latents at a time."""
    found: list[list[torch.Tensor]] = [[], [], [], []]
    weights = unembedding.detach().float()
    with torch.no_grad():
        for rows in dictionary.W_dec.detach().float().to(weights.device).split(LATENT_CHUNK):
            effect = rows @ weights.t()  # (chunk, V)
            up, down = effect.topk(n, dim=1), effect.topk(n, dim=1, largest=False)
            for part, tensor in zip(found, (up.indices, up.values, down.indices, down.values), strict=True):
                part.append(tensor.cpu())
    return tuple(torch.cat(part) for part in found)


def marked_context(tokenizer: Any, ids: list[int], position: int, first: int) -> str:
    """The text of `ids` around `position` (from `first` on: the BOS is not text), the token there marked «...» with
    its leading space outside the marks; line breaks shown as ↵."""
    lo, hi = max(first, position - CONTEXT_BEFORE), min(len(ids), position + 1 + CONTEXT_AFTER)
    # decoded as spans, so the spaces a tokenizer puts between tokens (a word-level one) or inside them (BPE) stay
    before, through, whole = (tokenizer.decode(ids[lo:end]) for end in (position, position + 1, hi))
    if through.startswith(before) and whole.startswith(through):
        token, after = through[len(before) :], whole[len(through) :]
    else:  # a tokenizer whose decoding changes across the cut: each piece decoded alone
        token, after = tokenizer.decode(ids[position : position + 1]), tokenizer.decode(ids[position + 1 : hi])
    lead = token[: len(token) - len(token.lstrip())]
    text = f"{'...' if lo > first else ''}{before}{lead}«{token.strip()}»{after}{'...' if hi < len(ids) else ''}"
    return text.replace("\r\n", "↵").replace("\n", "↵")


def token_texts(tokenizer: Any, ids: torch.Tensor) -> list[list[str]]:
    """Each row of token ids (W, n) as the text each token stands for (" if" for `Ġif`)."""
    return [decoded(tokenizer, tokenizer.convert_ids_to_tokens(row)) for row in ids.tolist()]


def feature_columns(
    dictionary: Dictionary,
    x: torch.Tensor,
    windows: list[list[int]],
    window_ids: list[str],
    first: int,
    tokenizer: Any,
    unembedding: torch.Tensor,
    fires: torch.Tensor,
    contexts: int,
    logit_count: int,
) -> dict[str, Any]:
    """One row per latent: `x` (N, d) are the held-out windows' activations at positions first.. of each window in
    `windows` (token ids, in the order of x's rows, `window_ids` their sample ids); `fires` (W,) each latent's firing
    count on x (evaluation.py)."""
    width, n = dictionary.width, x.shape[0]
    per = len(windows[0]) - first if windows else 0  # positions each window gives x
    values, where, sums = top_activations(dictionary, x, contexts)
    up, up_values, down, down_values = logit_tokens(dictionary, unembedding, logit_count)
    density = fires.double() / max(n, 1)
    mean = [float(s) / int(c) if int(c) else math.nan for s, c in zip(sums.tolist(), fires.tolist(), strict=True)]
    shown_values, shown_contexts, shown_windows, shown_positions = [], [], [], []
    for row_values, row_where in zip(values.tolist(), where.tolist(), strict=True):
        kept = [(v, w) for v, w in zip(row_values, row_where, strict=True) if v > 0]
        shown_values.append([v for v, _ in kept])
        shown_windows.append([window_ids[w // per] for _, w in kept])
        shown_positions.append([first + w % per for _, w in kept])
        shown_contexts.append([marked_context(tokenizer, windows[w // per], first + w % per, first) for _, w in kept])
    return {
        "latent": torch.arange(width),
        "density": pa.array(density.tolist(), pa.float64()),
        "mean_activation": pa.array(mean, pa.float32()),
        "max_activation": pa.array(values[:, 0].tolist() if values.shape[1] else [0.0] * width, pa.float32()),
        "dead": pa.array((fires == 0).tolist()),
        "dense": pa.array((density > DENSE).tolist()),
        "top_activations": pa.array(shown_values, pa.list_(pa.float32())),
        "top_contexts": pa.array(shown_contexts, pa.list_(pa.string())),
        "top_windows": pa.array(shown_windows, pa.list_(pa.string())),
        "top_positions": pa.array(shown_positions, pa.list_(pa.int64())),
        "promoted": pa.array(token_texts(tokenizer, up), pa.list_(pa.string())),
        "promoted_logits": pa.array(up_values.tolist(), pa.list_(pa.float32())),
        "suppressed": pa.array(token_texts(tokenizer, down), pa.list_(pa.string())),
        "suppressed_logits": pa.array(down_values.tolist(), pa.list_(pa.float32())),
    }
