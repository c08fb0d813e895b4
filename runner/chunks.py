"""Forwards over many inputs in chunks: the one helper that faithfulness, the metrics, Score-CAM and patching use.

Perturbed inputs (deletion steps, masked copies, imputed images, patched variants) far outnumber a batch: they go
through the model as forwards of at most `chunk` inputs, and the inputs of a chunk are often built only when it
runs (all of them at the input's size would not fit). `forward_chunk` picks the chunk when none is configured.
Imports nothing of runner: a model, tensors and something with an `autocast()` (the run's `Runtime`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

# Images per forward when scoring perturbed inputs and no chunk is set. On a CPU a large batch spills the caches:
# EfficientNet-Lite0 at 224 px on 2 cores ran 33-36 img/s at batch 1-8, 23 at 16, 14 at 64 (benchmarks/RESULTS.md,
# 2026-11-23), so a CPU chunk holds at most 8 images' worth of 224 px pixels; an accelerator
# gains from large batches.
CPU_CHUNK_PIXELS = 8 * 224 * 224
ACCELERATOR_CHUNK = 64


class Autocasting(Protocol):
    """What a chunked forward needs of the run's runtime: the precision to run the model under."""

    def autocast(self) -> AbstractContextManager[Any]: ...


def forward_chunk(chunk: int | None, device: torch.device, image_size: tuple[int, int] | torch.Size) -> int:
    """Images per batched forward: `chunk` when set, else by device (CPU: CPU_CHUNK_PIXELS of input)."""
    if chunk is not None:
        return chunk
    if device.type != "cpu":
        return ACCELERATOR_CHUNK
    return max(1, CPU_CHUNK_PIXELS // (int(image_size[0]) * int(image_size[1])))


def spans(total: int, chunk: int) -> Iterator[range]:
    """Consecutive index ranges of at most `chunk` that cover range(total), in order."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: at least 1 input per forward")
    for start in range(0, total, chunk):
        yield range(start, min(start + chunk, total))


def indices(span: range, device: torch.device) -> torch.Tensor:
    """(n,) int64 the indices of `span` on `device`."""
    return torch.arange(span.start, span.stop, device=device)


@torch.no_grad()
def chunked_forward(
    model: nn.Module,
    inputs: torch.Tensor | Callable[[range], torch.Tensor],
    chunk: int,
    runtime: Autocasting,
    reduce: Callable[[torch.Tensor, range], torch.Tensor] | None = None,
    total: int | None = None,
) -> torch.Tensor:
    """The model's float32 outputs for N inputs, in forwards of at most `chunk` under `runtime.autocast()`.

    `inputs`: the (N, ...) inputs, or a function that builds those of a range of indices (then `total` is N).
    `reduce(outputs (n, K), span)` keeps what is needed of each chunk's outputs (e.g. the target's probability),
    so N rows of K classes are never held; the chunks' results are concatenated along the first dimension."""
    if callable(inputs):
        if total is None:
            raise ValueError("chunked_forward: give `total` with an input builder")
        n = total
    else:
        n = inputs.shape[0]
    out = []
    for span in spans(n, chunk):
        x = inputs(span) if callable(inputs) else inputs[span.start : span.stop]
        with runtime.autocast():
            logits = model(x).float()  # (n, K)
        out.append(logits if reduce is None else reduce(logits, span))
    return torch.cat(out)


def target_scores(target: torch.Tensor, probability: bool = True) -> Callable[[torch.Tensor, range], torch.Tensor]:
    """A `reduce` for `chunked_forward`: each input's target class (`target` (N,)) softmax probability or logit."""

    def reduce(logits: torch.Tensor, span: range) -> torch.Tensor:
        scores = logits.softmax(dim=1) if probability else logits
        return scores.gather(1, target[span.start : span.stop, None]).squeeze(1)  # (n,)

    return reduce
