"""Randomness keyed by (seed, sample index, purpose), never by batch position.

A sample's random draws (corruption noise, `add_noise` hook noise, random baseline maps) come from a
generator of its own, seeded from the run's seed, the sample's index in the data set and a purpose
string. So they do not depend on `data.batch_size`, on an OOM split of a batch, on which shard runs
first, or on a resume: sample 7 gets the same noise in every run with the same seed.

Draws are made on the CPU and then moved, so the same seed gives the same values on CPU and GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch


def sample_seed(seed: int, sample_index: int, purpose: str) -> int:
    """A 63-bit seed from (seed, sample index, purpose), stable across processes and platforms."""
    # hashlib, not hash(): Python's str hash is salted per process.
    key = f"{int(seed)}\x1f{int(sample_index)}\x1f{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def sample_generator(seed: int, sample_index: int, purpose: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded by (seed, sample index, purpose): one sample's own stream for one purpose."""
    return torch.Generator(device=device).manual_seed(sample_seed(seed, sample_index, purpose))


def _per_sample(
    draw,
    shape_per_sample: Sequence[int],
    seed: int,
    sample_indices: Iterable[int],
    purpose: str,
    device: torch.device | str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(n, *shape_per_sample) draws of `draw` (torch.randn or torch.rand), each sample's from its own generator.

    Drawn in float32 on the CPU, then moved to `device` and cast to `dtype`, so a sample's values are
    the same on every device, at every batch size and in every batch position.
    """
    draws = [
        draw(tuple(shape_per_sample), generator=sample_generator(seed, int(i), purpose)) for i in sample_indices
    ]  # each (*shape_per_sample)
    if not draws:
        return torch.empty((0, *shape_per_sample), device=device, dtype=dtype)
    return torch.stack(draws).to(device=device, dtype=dtype)  # (n, *shape_per_sample)


def per_sample_normal(
    shape_per_sample: Sequence[int],
    seed: int,
    sample_indices: Iterable[int],
    purpose: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(len(sample_indices), *shape_per_sample) standard normal draws, each sample's from its own generator."""
    return _per_sample(torch.randn, shape_per_sample, seed, sample_indices, purpose, device, dtype)


def per_sample_uniform(
    shape_per_sample: Sequence[int],
    seed: int,
    sample_indices: Iterable[int],
    purpose: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(len(sample_indices), *shape_per_sample) uniform [0, 1) draws, each sample's from its own generator."""
    return _per_sample(torch.rand, shape_per_sample, seed, sample_indices, purpose, device, dtype)
