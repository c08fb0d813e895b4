"""torchvision's classification models by name, with their weights enum's members (downloaded once, cached)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from runner.errors import RunnerError, suggest
from runner.models.base import ModelBundle, ModelSource
from runner.schema import ModelConfig


def _zoo() -> Any:
    """torchvision.models, imported when a torchvision model is asked for (torchvision loads torch._dynamo)."""
    import torchvision.models

    return torchvision.models


class TorchvisionSource(ModelSource):
    accepts = "a torchvision classification model name"

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg._target_ is None and cfg.name in self.known_names()

    def known_names(self) -> list[str]:
        return _zoo().list_models(module=_zoo())

    def build(self, cfg: ModelConfig) -> ModelBundle:
        name, weights, kwargs = cfg.name, cfg.weights, cfg.kwargs
        available = self.known_names()
        if name not in available:  # reached with model.source=torchvision (else build_model names every source's)
            raise RunnerError(
                f"Unknown model '{name}'.{suggest(name, available)} model.source=torchvision takes a torchvision"
                " classification model name."
            )
        if weights is None:
            return ModelBundle(_zoo().get_model(name, weights=None, **kwargs), None, None)
        enum = _zoo().get_model_weights(name)
        try:
            member = enum[weights]
        except KeyError:
            valid = ["DEFAULT", *enum.__members__]
            raise RunnerError(
                f"Model '{name}' has no weights '{weights}'. Valid: {', '.join(valid)}, or null for random init."
            ) from None
        model = _zoo().get_model(name, weights=None, **kwargs)
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
