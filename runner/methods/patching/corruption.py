"""The corrupted half of a patching pair, made from the clean batch: noise, blur, occlusion, or a
paired sample of the data set (the cat photo against the coffee photo)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.options.method.patching import CorruptionConfig, CorruptionKind, is_valid_box
from runner.randomness import per_sample_normal

NOISE_PURPOSE = "patching.corruption.noise"  # the randomness key's purpose for corruption noise


def corrupt(batch: Batch, cfg: CorruptionConfig, dataset: Dataset | None) -> tuple[torch.Tensor, list[str]]:
    """(corrupted inputs (B, C, H, W), a description of each corrupted input)."""
    x = batch.x
    kind = cfg.kind
    if kind is CorruptionKind.none:
        return x.clone(), list(batch.sample_ids)
    if kind is CorruptionKind.noise:
        # One generator per sample, keyed by its index in the data set: a sample's noise does not depend
        # on the batch size, its position in the batch, an OOM split or a resume.
        indices = range(batch.first_index, batch.first_index + x.shape[0])
        noise = per_sample_normal(x.shape[1:], cfg.seed, indices, NOISE_PURPOSE, x.device, x.dtype)  # (B, C, H, W)
        return x + cfg.std * noise, [f"{s}+noise(std={cfg.std:g})" for s in batch.sample_ids]
    if kind is CorruptionKind.blur:
        kernel = int(2 * round(3 * cfg.sigma) + 1)
        kernel = min(kernel, 2 * (min(x.shape[-2:]) // 2) - 1)  # reflect padding needs kernel < size
        from torchvision.transforms.functional import gaussian_blur  # imported when used: it loads torch._dynamo

        return gaussian_blur(x, [kernel, kernel], [cfg.sigma, cfg.sigma]), [
            f"{s}+blur(sigma={cfg.sigma:g})" for s in batch.sample_ids
        ]
    if kind is CorruptionKind.occlusion:
        if not is_valid_box(cfg.box):  # a library caller may skip the config's check
            raise RunnerError(
                f"corruption.box={cfg.box} must be [y0, x0, y1, x1] fractions of the image with y0<y1, x0<x1."
            )
        h, w = x.shape[-2:]
        y0, x0, y1, x1 = round(cfg.box[0] * h), round(cfg.box[1] * w), round(cfg.box[2] * h), round(cfg.box[3] * w)
        out = x.clone()
        out[..., y0:y1, x0:x1] = 0
        return out, [f"{s}+occlusion{cfg.box}" for s in batch.sample_ids]
    if kind is CorruptionKind.pair:
        other, other_id = _paired_sample(cfg, dataset)
        if other.shape != x.shape[1:]:
            raise RunnerError(
                f"Patching pair: '{other_id}' has shape {tuple(other.shape)} but the clean inputs have"
                f" {tuple(x.shape[1:])}; both must be preprocessed to the same size (data.image_size, data.resize)."
            )
        return other.to(x.device, x.dtype).expand_as(x).clone(), [other_id] * x.shape[0]
    raise RunnerError(f"Unknown corruption '{kind}'.")  # pragma: no cover - the schema's Enum


def _paired_sample(cfg: CorruptionConfig, dataset: Dataset | None) -> tuple[torch.Tensor, str]:
    if dataset is None or cfg.pair_with is None:
        raise RunnerError(
            "corruption.kind=pair needs corruption.pair_with=SAMPLE_ID (e.g. coffee) or a data set index."
        )
    size = len(dataset)  # type: ignore[arg-type]
    if cfg.pair_with.isdigit():
        index = int(cfg.pair_with)
        if index >= size:
            raise RunnerError(f"corruption.pair_with={index} is past the data set's {size} samples.")
        x, _, sample_id = dataset[index]
        return x, sample_id
    ids = []
    for i in range(size):
        x, _, sample_id = dataset[i]
        if sample_id == cfg.pair_with:
            return x, sample_id
        ids.append(sample_id)
    raise RunnerError(f"corruption.pair_with='{cfg.pair_with}' is not a sample of the data set: {', '.join(ids[:20])}.")
