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
    # The preprocessing its weights were trained with (torchvision weights' transforms), if known.
    preprocess: Callable[[Any], torch.Tensor] | None
    categories: list[str] | None


class ModelSource:
    """Where models come from: `build` makes the model a config names; `claims` says whether this source
    builds a config whose `model.source` is null (the YAMLs and the CLI of `model=vgg16` set no source).

    A source module subclasses this and registers an instance with `@model_source("name")` (the value of
    `model.source`); runner/models/__init__.py imports each module of the package to fill the registry.
    """

    # How the "unknown model" error describes what this source accepts (e.g. "a torchvision model name").
    accepts: str = ""

    def claims(self, cfg: ModelConfig) -> bool:
        """Whether this source builds `cfg` when `model.source` is null (False: only when named)."""
        return False

    def known_names(self) -> list[str]:
        """The model names this source knows, for 'did you mean' hints."""
        return []

    def build(self, cfg: ModelConfig) -> ModelBundle:
        """The model with its weights loaded (not yet frozen or in eval mode: build_model does that)."""
        raise NotImplementedError


S = TypeVar("S", bound=type[ModelSource])
# Every model source by its name (`model.source`).
MODEL_SOURCES: Registry[str, ModelSource] = Registry("model source", str)


def model_source(name: str) -> Callable[[S], S]:
    """Class decorator: an instance of the class builds the models of source `name`."""

    def add(source: S) -> S:
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
        raise RunnerError(f"Checkpoint {file} does not match the model; " + "; ".join(parts) + ".")
    model.load_state_dict(state)
    log.info("loaded checkpoint %s", file)
