"""Start-up checks of a model against the data's inputs: memory for a batch, channels, the smallest size; a
language model's number of positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.errors import RunnerError


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CUDA: the driver's figure; CPU: MemAvailable), or None when unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def check_input(model: nn.Module, sample: torch.Tensor, batch_size: int, device: torch.device) -> None:
    """Fail with a clear message, before the run, when the model cannot take the data's inputs: a batch that
    would not fit in memory, a wrong channel count, or an image too small for the model's downsampling.

    Runs one forward of one sample (no hooks are registered yet, no gradients).
    """
    batch_bytes = batch_size * sample.numel() * 4  # float32 inputs alone; activations need more
    free = available_bytes(device)
    if free is not None and batch_bytes > free:
        raise RunnerError(
            f"One batch of inputs ({batch_size} x {list(sample.shape)}) is {batch_bytes / 1e9:.1f} GB, more than the"
            f" {free / 1e9:.1f} GB free on {device}: lower data.batch_size or the input size (data.image_size,"
            " data.shape)."
        )
    was_training = model.training
    try:
        with torch.no_grad():
            model(sample.unsqueeze(0).to(device))  # (1, *sample.shape)
    except Exception as e:  # torch's RuntimeError, a model's own size check (ValueError, AssertionError), ...
        text = str(e).splitlines()[0] if str(e) else ""
        if "out of memory" in text.lower():
            raise RunnerError(
                f"One sample of shape {list(sample.shape)} does not fit on {device} ({text}): use a smaller input"
                " (data.image_size, data.shape)."
            ) from e
        raise input_refused(e, list(sample.shape)) from e
    finally:
        model.train(was_training)


def input_refused(error: Exception, shape: list[int]) -> RunnerError:
    """One message for a forward that fails on one input of `shape`: what the model said, and what to change."""
    text = str(error).splitlines()[0] if str(error) else ""
    said = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if "too small" in text:
        hint = (
            "The input is too small for the model's downsampling: use a larger data.image_size (ImageNet models: 224)."
        )
    elif "channel" in text:
        hint = "The first number of a sample's shape is its channel count: image models take 3 (data.shape=[3,H,W])."
    else:
        hint = (
            "Give the size the model takes: data.image_size=N for photos, data.shape=[3,N,N] for synthetic data"
            " (a fixed-size model built from a config or a `_target_` often takes its own size as an argument, e.g."
            " timm's +model.kwargs.img_size=N); with data.resize=none photos keep their aspect ratio, which"
            " fixed-size models refuse: use data.resize=pad."
        )
    return RunnerError(f"The model cannot take inputs of shape {shape} ({said}). {hint}")


def context_length(model: nn.Module) -> int | None:
    """The number of positions the model was built for (its config's max_position_embeddings, n_positions or
    n_ctx); None where the config states none."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_positions(model: nn.Module, dataset: Any) -> None:
    """RunnerError when a text sample (token ids (..., T), a pair's prompts stacked) is longer than the model's
    positions, named by its id: GPT-2 would fail with an index error mid-run, and a rotary model would silently run
    at positions it was never trained on."""
    limit = context_length(model)
    if limit is None or len(dataset) == 0:
        return
    length, sample_id = max((int(x.shape[-1]), str(i)) for x, _, i in (dataset[k] for k in range(len(dataset))))
    if length > limit:
        raise RunnerError(
            f"Prompt pair {sample_id} is {length} tokens (BOS included) but the model has {limit} positions: shorten"
            f" the prompts to at most {limit} tokens."
        )
