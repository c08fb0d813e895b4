"""What every model source shares: the bundle it hands back, the registry it joins, strict checkpoint loading."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from runner.errors import RunnerError
from runner.registry import Registry
from runner.schema import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class ModelBundle:
    """A model in eval mode with frozen parameters, and what the data needs to know about it."""

    model: nn.Module
    # The preprocessing its weights were trained with (torchvision weights' transforms, timm's data config, a
    # Hugging Face image processor), if known: PIL image -> (C, H, W) tensor.
    preprocess: Callable[[Any], torch.Tensor] | None
    # The name of each output class, by index (the weights' ImageNet names, timm's, `id2label`, or
    # `model.class_names`); None when unknown (random init, a `_target_` or checkpoint without names).
    categories: list[str] | None

    @property
    def class_names(self) -> list[str] | None:
        """The output classes' names by index (the same list as `categories`)."""
        return self.categories


class Preprocess:
    """A model's own photo preprocessing with what runner.data reads from it: the square input side it makes
    (`input_size`: every data source's inputs take it), the mean and std (data.resize=pad or none keep the
    runner's geometry and use only these) and the sizes it says in the log."""

    def __init__(
        self,
        transform: Callable[[Any], torch.Tensor],
        mean: Any,
        std: Any,
        resize_size: Any,
        crop_size: Any,
        input_size: int | None = None,
    ) -> None:
        self.transform = transform
        self.mean, self.std = list(mean), list(std)
        self.resize_size, self.crop_size = resize_size, crop_size
        self.input_size = input_size  # None: the model's inputs are not square (the configured size is used)

    def __call__(self, image: Any) -> torch.Tensor:
        return self.transform(image)  # (C, H, W)


class ModelSource:
    """Where models come from: `build` makes the model a config names; `claims` says whether this source
    builds a config whose `model.source` is null (the YAMLs and the CLI of `model=vgg16` set no source).

    A source module subclasses this and registers an instance with `@model_source("name")` (the value of
    `model.source`); runner/models/__init__.py imports each module of the package to fill the registry.
    """

    # How the "unknown model" error describes what this source accepts (e.g. "a torchvision model name").
    accepts: str = ""
    # The source's registered name (`model.source`), set by @model_source.
    name: str = ""

    def claims(self, cfg: ModelConfig) -> bool:
        """Whether this source builds `cfg` when `model.source` is null (False: only when named)."""
        return False

    def known_names(self) -> list[str]:
        """The model names this source knows, for 'did you mean' hints."""
        return []

    def label(self, cfg: ModelConfig) -> str:
        """What the tables' `model` column says: `<source>:<name>` (e.g. timm:convnext_tiny)."""
        return f"{self.name}:{cfg.name}"

    def build(self, cfg: ModelConfig) -> ModelBundle:
        """The model with its weights loaded (not yet frozen or in eval mode: build_model does that)."""
        raise NotImplementedError


S = TypeVar("S", bound=type[ModelSource])
# Every model source by its name (`model.source`).
MODEL_SOURCES: Registry[str, ModelSource] = Registry("model source", str)


def model_source(name: str) -> Callable[[S], S]:
    """Class decorator: an instance of the class builds the models of source `name`."""

    def add(source: S) -> S:
        source.name = name
        MODEL_SOURCES.register(name)(source())
        return source

    return add


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
        raise RunnerError(
            f"Checkpoint {file} does not match the model; " + "; ".join(parts) + "." + _head_hint(state, own)
        )
    model.load_state_dict(state)
    log.info("loaded checkpoint %s", file)


def _last_linear(state: dict[str, Any]) -> tuple[str, int] | None:
    """The last 2-D `*.weight` of a state dict (its classifier head, by the usual order) and its out_features."""
    heads = [
        (k, int(v.shape[0])) for k, v in state.items() if k.endswith("weight") and torch.is_tensor(v) and v.ndim == 2
    ]
    return heads[-1] if heads else None


def _head_hint(state: dict[str, Any], own: dict[str, Any]) -> str:
    """' The checkpoint's head has N classes: ...' when its classifier's size differs from the model's, else ''."""
    theirs, mine = _last_linear(state), _last_linear(own)
    if theirs is None or mine is None or theirs[1] == mine[1]:
        return ""
    return (
        f" The checkpoint's classifier ({theirs[0]}) has {theirs[1]} classes and the model's ({mine[0]}) {mine[1]}:"
        f" build the model with {theirs[1]} classes (torchvision and timm: +model.kwargs.num_classes={theirs[1]};"
        f" a `_target_`: the argument of its class that sets them)."
    )


def hub_offline() -> bool:
    """Whether Hugging Face Hub downloads are off (HF_HUB_OFFLINE=1, read now, not at huggingface_hub's import)."""
    value = os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str:
    """The Hugging Face Hub cache folder that downloads go to and offline runs read from."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
