"""How faithful is a map? Deletion/insertion AUC (Petsiuk et al. 2018, RISE) and average drop /
increase in confidence (Chattopadhay et al. 2018), each beside the same metric for a random map.

Deletion: remove pixels from most to least salient (replaced by 0, the data set's mean after
normalisation) and follow the target's probability; a faithful map makes it fall fast (low AUC).
Insertion: start from a blurred copy and put pixels back in the same order (high AUC is good). The
blur is RISE's by default (`insertion_blur`: an 11x11 Gaussian of sigma 5, zero padding).

Pixel order: saliency descending; pixels of equal saliency (17-38% of an upsampled mid-network map)
in a random order drawn per sample from (faithfulness.seed, sample index), through a stable sort.
So the order, and the AUCs, depend neither on the sort's implementation, the device, the batch size
nor the layer, and no region (the top rows, say) is favoured among ties.

A map that is constant (all zero, say) or not finite orders nothing: its metrics are NaN and its
row is flagged `degenerate`, never a number that looks like a measurement.

All steps of all samples go through the model as batched forwards of `chunk` images, never a
Python loop per image. The random map has the layer's own resolution, so both are equally coarse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from runner.chunks import chunked_forward, forward_chunk, indices, target_scores
from runner.errors import RunnerError
from runner.options.method.cam import BlurConfig, BlurPadding, FaithfulnessConfig
from runner.progress import within_batch
from runner.randomness import sample_generator
from runner.rows import Block
from runner.stats import constant_rows

METRICS = ("deletion_auc", "insertion_auc", "avg_drop", "increase")
COLUMNS = [*METRICS, *(f"random_{m}" for m in METRICS)]


def degenerate_maps(maps: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the map (B, ...) is constant (all zero, say) or holds a NaN/inf, so it ranks no pixel."""
    return constant_rows(maps)


def rise_kernel(kernel_size: int, sigma: float) -> torch.Tensor:
    """(kernel_size,) 1-D kernel of RISE's `gkern`: scipy's gaussian_filter (truncate 4, reflect) of a centred delta.

    The Gaussian's tails beyond the window are folded back in (scipy's `reflect` boundary), so the
    kernel sums to 1; the 2-D kernel is the outer product of this with itself.
    """
    radius = int(4.0 * sigma + 0.5)
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    weights = torch.exp(-0.5 * (offsets / sigma) ** 2)
    weights = weights / weights.sum()
    centre, period = kernel_size // 2, 2 * kernel_size
    kernel = torch.zeros(kernel_size, dtype=torch.float64)
    for i in range(kernel_size):  # out[i] = sum_j w[j] * delta[reflect(i + j)]
        for j, w in zip(range(-radius, radius + 1), weights.tolist(), strict=True):
            pos = (i + j) % period
            pos = pos if pos < kernel_size else period - 1 - pos  # scipy 'reflect': d c b a | a b c d | d c b a
            if pos == centre:
                kernel[i] += w
    return kernel.float()


def blurred(x: torch.Tensor, cfg: BlurConfig) -> torch.Tensor:
    """The insertion baseline (B, C, H, W): each channel convolved with RISE's Gaussian kernel, `cfg.padding` borders."""
    k = rise_kernel(cfg.kernel_size, cfg.sigma).to(x.device, x.dtype)
    channels, pad = x.shape[1], cfg.kernel_size // 2
    weight = (k[:, None] * k[None, :]).expand(channels, 1, -1, -1)  # (C, 1, k, k) depthwise
    if cfg.padding is BlurPadding.zero:
        return F.conv2d(x, weight, padding=pad, groups=channels)
    if cfg.padding is BlurPadding.reflect and pad >= min(x.shape[-2:]):
        raise RunnerError(
            f"method.faithfulness.insertion_blur: reflect padding of {pad} pixels needs inputs larger than"
            f" {tuple(x.shape[-2:])}; use a smaller kernel_size or padding=zero."
        )
    return F.conv2d(F.pad(x, [pad] * 4, mode=cfg.padding.value), weight, groups=channels)


def tie_keys(seed: int, sample_indices: Sequence[int], pixels: int, device: torch.device) -> torch.Tensor:
    """(B, P) a random permutation per sample, keyed by (seed, sample index): the order of equal-saliency pixels.

    The one tie rule of every pixel (or patch) order: faithfulness, ROAD and region perturbation use it, so with
    the same seed a map's pixels come in the same order in deletion and in ROAD. A sample listed several times
    (every layer's map of it) draws once."""
    drawn: dict[int, torch.Tensor] = {}
    for i in map(int, sample_indices):
        if i not in drawn:
            drawn[i] = torch.randperm(pixels, generator=sample_generator(seed, i, f"faithfulness_ties_{pixels}"))
    if not drawn:
        return torch.empty(0, pixels, dtype=torch.long, device=device)
    return torch.stack([drawn[int(i)] for i in sample_indices]).to(device)


def pixel_rank(saliency: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, P) position of each pixel in the order: saliency (B, P) descending, then `keys` (B, P) ascending.

    The same order as numpy's `lexsort((keys, -saliency))`: a stable sort by saliency of the pixels
    laid out in key order keeps equal-saliency pixels in key order.
    """
    by_key = keys.argsort(dim=1, stable=True)  # (B, P) pixels in key order
    _, idx = saliency.gather(1, by_key).sort(dim=1, descending=True, stable=True)
    order = by_key.gather(1, idx)  # (B, P) pixel ids, most salient first
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return rank


def probabilities(model: nn.Module, images: torch.Tensor, target: torch.Tensor, chunk: int, runtime) -> torch.Tensor:
    """Softmax probability of `target` (N,) for images (N, C, H, W), in batched forwards of `chunk`."""
    return chunked_forward(model, images, chunk, runtime, target_scores(target))


@torch.no_grad()
def curve_aucs(
    model: nn.Module,
    x: torch.Tensor,
    saliency: torch.Tensor,
    target: torch.Tensor,
    keys: torch.Tensor,
    cfg: FaithfulnessConfig,
    runtime,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(deletion AUC, insertion AUC), each (B,), for saliency maps (B, H, W) of inputs x (B, C, H, W).

    `keys` (B, H*W) orders pixels of equal saliency (see `pixel_rank`); `cfg` gives the steps, the
    chunk and the insertion blur.
    """
    b, c, h, w = x.shape
    steps, chunk = cfg.steps, cfg.chunk
    pixels = h * w
    rank = pixel_rank(saliency.flatten(1), keys)  # (B, P) 0 = most salient
    fractions = torch.linspace(0, 1, steps + 1, device=x.device)  # (S,)
    counts = (fractions * pixels).round().long()  # pixels changed at each step
    zeros, blur = torch.zeros_like(x), blurred(x, cfg.insertion_blur)
    curves = {}
    for mode in ("deletion", "insertion"):

        def images(span: range, mode: str = mode) -> torch.Tensor:  # a chunk's perturbed inputs, built as it runs
            idx = indices(span, x.device)
            sample, step = idx // (steps + 1), idx % (steps + 1)
            changed = (rank[sample] < counts[step][:, None]).reshape(-1, 1, h, w)  # (n, 1, H, W)
            if mode == "deletion":
                return torch.where(changed, zeros[sample], x[sample])
            return torch.where(changed, x[sample], blur[sample])

        per_image = target.repeat_interleave(steps + 1)  # (B*S,) the target of each perturbed input
        probs = chunked_forward(model, images, chunk, runtime, target_scores(per_image), total=b * (steps + 1))
        curve = probs.reshape(b, steps + 1)  # (B, S)
        curves[mode] = torch.trapezoid(curve, fractions, dim=1)
    return curves["deletion"], curves["insertion"]


@torch.no_grad()
def drop_increase(
    model: nn.Module,
    x: torch.Tensor,
    saliency: torch.Tensor,
    target: torch.Tensor,
    clean: torch.Tensor,
    chunk: int,
    runtime,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(average drop, increase), each (B,): the input kept only where the map is high."""
    masked = x * saliency[:, None]
    kept = probabilities(model, masked, target, chunk, runtime)
    drop = torch.relu(clean - kept) / clean.clamp_min(1e-12)
    return drop, (kept > clean).float()


def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    saliency: list[torch.Tensor],
    random_saliency: list[torch.Tensor],
    target: torch.Tensor,
    probs: torch.Tensor,
    cfg: FaithfulnessConfig,
    runtime,
    sample_indices: Sequence[int],
    degenerate: list[torch.Tensor],
    undefined: torch.Tensor,
    random_degenerate: list[torch.Tensor] | None = None,
) -> Block:
    """All metrics for each layer's maps and for the random maps, as a (L*B, 8) block in row order.

    NaN where undefined: a `degenerate` (B,) map's own four metrics; the four `random_*` where the random map is
    constant too (`random_degenerate` (B,): a 1x1 layer's); all eight for samples whose target is `undefined` (B,)
    (all logits equal: the class explained is arbitrary).
    """
    if random_degenerate is None:
        random_degenerate = [torch.zeros_like(flat) for flat in degenerate]
    cfg = replace(cfg, chunk=forward_chunk(cfg.chunk, x.device, x.shape[-2:]))
    clean = probs.gather(1, target[:, None]).squeeze(1)  # (B,)
    keys = tie_keys(cfg.seed, sample_indices, x.shape[-2] * x.shape[-1], x.device)  # (B, H*W)
    nan = torch.tensor(float("nan"), device=x.device)
    rows = []
    for layer, (maps, random_maps, flat, random_flat) in enumerate(
        zip(saliency, random_saliency, degenerate, random_degenerate, strict=True)
    ):
        within_batch(layer / len(saliency), f"faithfulness: layer {layer + 1}/{len(saliency)}")
        values = []
        for m in (maps, random_maps):
            deletion, insertion = curve_aucs(model, x, m, target, keys, cfg, runtime)
            drop, increase = drop_increase(model, x, m, target, clean, cfg.chunk, runtime)
            values += [deletion, insertion, drop, increase]
        block = torch.stack(values, dim=1)  # (B, 8)
        own = torch.zeros_like(block, dtype=torch.bool)
        own[:, : len(METRICS)] = flat[:, None]
        own[:, len(METRICS) :] = random_flat[:, None]
        block = torch.where(own | undefined[:, None], nan, block)
        rows.append(block)
    return Block(torch.cat(rows), COLUMNS)
