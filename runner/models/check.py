"""Start-up checks of a model against the data's inputs: memory for a batch, channels, the smallest size."""

from __future__ import annotations

import torch
from torch import nn

from runner.errors import RunnerError


def _available_bytes(device: torch.device) -> int | None:
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
    free = _available_bytes(device)
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
    except RuntimeError as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "out of memory" in text.lower():
            raise RunnerError(
                f"One sample of shape {list(sample.shape)} does not fit on {device} ({text}): use a smaller input"
                " (data.image_size, data.shape)."
            ) from e
        if "too small" in text:
            hint = "The input is too small for the model's downsampling: use a larger data.image_size (ImageNet models: 224)."
        elif "channel" in text:
            hint = (
                "The first number of a sample's shape is its channel count: image models take 3 (data.shape=[3,H,W])."
            )
        else:
            hint = "Check data.image_size / data.shape against the input the model expects."
        raise RunnerError(f"The model cannot take inputs of shape {list(sample.shape)} (torch: {text}). {hint}") from e
    finally:
        model.train(was_training)
