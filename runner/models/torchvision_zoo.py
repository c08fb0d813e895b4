"""torchvision's classification models by name, with their weights enum's members (downloaded once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torchvision

from runner.errors import RunnerError, suggest
from runner.models.base import ModelBundle, ModelSource
from runner.schema import ModelConfig


class TorchvisionSource(ModelSource):
    accepts = "a torchvision classification model name"

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg._target_ is None and cfg.name in self.known_names()

    def known_names(self) -> list[str]:
        return torchvision.models.list_models(module=torchvision.models)

    def build(self, cfg: ModelConfig) -> ModelBundle:
        name, weights, kwargs = cfg.name, cfg.weights, cfg.kwargs
        available = self.known_names()
        if name not in available:  # reached with model.source=torchvision (else build_model names every source's)
            raise RunnerError(
                f"Unknown model '{name}'.{suggest(name, available)} model.source=torchvision takes a torchvision"
                " classification model name."
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
