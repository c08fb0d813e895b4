"""Any nn.Module by its import path: `model._target_: my_pkg.MyNet`, called with `model.kwargs`."""

from __future__ import annotations

from torch import nn

from runner.errors import RunnerError
from runner.models.base import ModelBundle, ModelSource, model_source
from runner.schema import ModelConfig


@model_source("target")
class TargetSource(ModelSource):
    accepts = "`model._target_` for any nn.Module"

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg._target_ is not None

    def build(self, cfg: ModelConfig) -> ModelBundle:
        from hydra.utils import instantiate

        if not cfg._target_:
            raise RunnerError("model.source=target needs `model._target_`: the dotted import path of an nn.Module.")
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
        return ModelBundle(model, None, None)
