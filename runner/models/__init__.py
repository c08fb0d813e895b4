"""Models from their sources: torchvision classifiers by name, the embedded pretrained EfficientNet-Lite0, any
module by `_target_`, timm models by name, Hugging Face image classifiers. Each source is a `ModelSource` whose
option module (runner/options/model/<name>.py) registers it; a YAML in conf/model/ names a model of a source.

Trained weights are loaded or the run fails: nothing here falls back to random initialisation
unless the config says `weights: null`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from runner.errors import RunnerError, suggest
from runner.models.base import ModelBundle, ModelSource, load_checkpoint
from runner.models.check import check_input, check_positions
from runner.options.registry import MODELS
from runner.schema import ModelConfig

if TYPE_CHECKING:
    from runner.models.lm_sites import LanguageModelLayout

_SOURCES: dict[str, ModelSource] = {}


def model_sources() -> dict[str, ModelSource]:
    """One instance of every registered model source, by its name (`model.source`), in registration order."""
    for option in MODELS:
        if option.name not in _SOURCES:
            source = option.load()()
            source.name = option.name
            _SOURCES[option.name] = source
    return {option.name: _SOURCES[option.name] for option in MODELS}


log = logging.getLogger(__name__)


def model_source_of(cfg: ModelConfig) -> ModelSource:
    """The source that builds `cfg`: the one `model.source` names, or else the one source that claims it."""
    if cfg.source is not None:
        source = model_sources()[MODELS.get(cfg.source).name]  # raises for an unknown source
        if cfg._target_ is not None and not source.claims(cfg):  # else the `_target_` would be silently ignored
            raise RunnerError(
                f"model._target_ is set but model.source={cfg.source} does not build by `_target_`:"
                " drop one of them (model.source=null infers the source)."
            )
        return source
    claiming = [item for item in model_sources().items() if item[1].claims(cfg)]
    if len(claiming) == 1:
        return claiming[0][1]
    if claiming:  # two sources' rules overlap: a bug in a source, not the user's config
        raise RunnerError(
            f"Model '{cfg.name}' is claimed by the sources {', '.join(name for name, _ in claiming)}:"
            " choose one with model.source=NAME."
        )
    sources = list(model_sources().values())
    known = [name for source in sources for name in source.known_names()]
    accepts = [source.accepts for source in sources if source.accepts]
    raise RunnerError(
        f"Unknown model '{cfg.name}'.{suggest(cfg.name, known)} Use {', '.join(accepts[:-1])}, or {accepts[-1]}"
        f" (or model.source: {', '.join(MODELS.names())})."
    )


def model_label(cfg: ModelConfig) -> str:
    """The tables' `model` column: the source and the model (timm:convnext_tiny, hf:<id>, target:pkg.Class)."""
    return model_source_of(cfg).label(cfg)


def model_layout(cfg: ModelConfig) -> LanguageModelLayout | None:
    """The configured language model's layout from its config alone (no weights); None for an image model."""
    return model_source_of(cfg).layout(cfg)


def model_skeleton(cfg: ModelConfig) -> nn.Module | None:
    """The configured language model on the meta device (shapes, no memory, no weights); None for an image model."""
    return model_source_of(cfg).skeleton(cfg)


def model_tokenizer(cfg: ModelConfig) -> Any:
    """The configured language model's tokenizer, its weights not loaded; None for an image model."""
    return model_source_of(cfg).tokenizer(cfg)


def build_model(cfg: ModelConfig) -> ModelBundle:
    """Build the configured model, load its weights, freeze it (no weight gradients are ever needed)."""
    source = model_source_of(cfg)
    if cfg.checkpoint and cfg.weights is not None:
        # The strict load replaces every parameter and buffer: pretrained weights would be downloaded for nothing
        # (and their class names would not be the checkpoint's).
        log.info("model.checkpoint replaces every weight: model.weights=%s is not loaded", cfg.weights)
        cfg = dataclasses.replace(cfg, weights=None)
    bundle = source.build(cfg)
    if cfg.checkpoint:
        load_checkpoint(bundle.model, cfg.checkpoint)
    if cfg.class_names is not None:
        bundle.categories = _checked_class_names(bundle.model, list(cfg.class_names))
    bundle.model.eval()
    for p in bundle.model.parameters():
        p.requires_grad_(False)
    return bundle


def _checked_class_names(model: nn.Module, names: list[str]) -> list[str]:
    """`model.class_names`, refused when the model's last Linear layer has another number of outputs."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears and linears[-1].out_features != len(names):
        raise RunnerError(
            f"model.class_names has {len(names)} names but the model's last Linear layer has"
            f" {linears[-1].out_features} outputs: give one name per class, in class-index order."
        )
    return names


__all__ = [
    "ModelBundle",
    "ModelSource",
    "build_model",
    "check_input",
    "check_positions",
    "load_checkpoint",
    "model_label",
    "model_layout",
    "model_skeleton",
    "model_tokenizer",
    "model_source_of",
    "model_sources",
]
