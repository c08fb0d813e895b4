"""Models from a local torch.hub repository (an example model source): `model=hub_local model.repo=DIR
model.entry=NAME`, the nn.Module that DIR/hubconf.py's function NAME returns (called with `model.kwargs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.options.registry import MODELS
from runner.schema import ModelConfig


class HubLocalSource:
    """Builds a `model.source=hub_local` config (duck-typed as runner.models.base.ModelSource)."""

    name = "hub_local"
    accepts = "model.source=hub_local with model.repo and model.entry"

    def claims(self, cfg: Any) -> bool:
        return False  # only when named by model.source

    def known_names(self) -> list[str]:
        return []

    def label(self, cfg: Any) -> str:
        return f"hub_local:{cfg.entry}"

    def build(self, cfg: Any) -> Any:
        import torch

        from runner.errors import RunnerError
        from runner.models.base import ModelBundle

        try:
            model = torch.hub.load(cfg.repo, cfg.entry, source="local", **cfg.kwargs)
        except (OSError, RuntimeError, AttributeError, TypeError) as e:
            raise RunnerError(f"model.repo={cfg.repo} model.entry={cfg.entry}: torch.hub.load failed ({e}).") from e
        return ModelBundle(model, None, None)


@MODELS.option(HubLocalSource, name="hub_local")
@dataclass
class HubLocalConfig(ModelConfig):
    source: str | None = "hub_local"
    repo: str = ""  # a folder with a hubconf.py
    entry: str = ""  # the function of hubconf.py that returns the model
