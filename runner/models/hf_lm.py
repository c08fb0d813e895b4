"""Hugging Face causal language models (`model=hf_lm`): AutoModelForCausalLM and its tokenizer from the shipped
induction model, a folder saved with save_pretrained, the Hugging Face cache (a hub id), or random weights from a
config. The attention implementation is set explicitly (and is part of the run's config); a device map spreads a
model larger than one device (accelerate)."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.models.base import ModelBundle, ModelSource
from runner.models.hf import from_hub, transformers_module
from runner.models.lm_sites import layout_of
from runner.options.model.hf_lm import SHIPPED_LM, HfLmModelConfig
from runner.schema import ModelConfig

log = logging.getLogger(__name__)


def shipped_folder() -> Path:
    """The folder of the model that ships inside the package (config, safetensors weights, tokenizer)."""
    return Path(str(resources.files("runner.models") / "lm_induction"))


def model_folder(name: str) -> str:
    """What transformers loads for model.name: the shipped model's folder for `induction`, else the name itself."""
    if name != SHIPPED_LM:
        return name
    folder = shipped_folder()
    if not (folder / "config.json").is_file():
        raise RunnerError(
            f"model.name=induction names the model shipped in {folder}, which this installation lacks: train it with"
            " `python scripts/train_induction_lm.py`, or give model.name=FOLDER."
        )
    return str(folder)


def _need_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise RunnerError(
            "model.device_map spreads the model with accelerate, which is not installed: pip install accelerate"
            " (or `pip install -e '.[models]'`), or leave model.device_map=null."
        ) from None


class HfLmSource(ModelSource):
    accepts = "a Hugging Face causal LM folder or hub id with model=hf_lm"

    def known_names(self) -> list[str]:
        return [SHIPPED_LM]

    def build(self, cfg: ModelConfig) -> ModelBundle:
        if not isinstance(cfg, HfLmModelConfig):
            raise RunnerError("model.source=hf_lm takes conf/model/hf_lm.yaml's keys: use model=hf_lm.")
        if not cfg.name:
            raise RunnerError("model=hf_lm needs model.name=NAME: induction (shipped), a local folder or a hub id.")
        if cfg.weights not in (None, "DEFAULT", "true", "True"):
            raise RunnerError(
                f"model=hf_lm loads the weights saved with the model (model.weights=DEFAULT) or none (null: random"
                f" weights from its config), not '{cfg.weights}'."
            )
        transformers = transformers_module()
        name = model_folder(cfg.name)
        options: dict[str, Any] = {"attn_implementation": cfg.attn_implementation, **cfg.kwargs}
        if cfg.weights is None and cfg.device_map is not None:
            raise RunnerError(
                "model.device_map places saved weights across devices as they load; random weights (model.weights="
                "null) are built in memory: leave model.device_map=null, or load saved weights."
            )
        if cfg.weights is None:
            config = from_hub(name, lambda local: transformers.AutoConfig.from_pretrained(name, **local))
            for key, value in cfg.config.items():
                setattr(config, key, value)
            model = transformers.AutoModelForCausalLM.from_config(config, **options)
            log.info("model %s: random weights from its config (model.weights=null)", cfg.name)
        else:
            if cfg.config:
                raise RunnerError(
                    "model.config overrides a config for random weights: it needs model.weights=null (saved weights"
                    " come with their own config)."
                )
            if cfg.device_map is not None:
                _need_accelerate()
                options["device_map"] = cfg.device_map
            model = from_hub(
                name, lambda local: transformers.AutoModelForCausalLM.from_pretrained(name, **local, **options)
            )
        tokenizer_name = model_folder(cfg.tokenizer) if cfg.tokenizer else name
        tokenizer = from_hub(
            tokenizer_name, lambda local: transformers.AutoTokenizer.from_pretrained(tokenizer_name, **local)
        )
        layout = layout_of(model)  # refuses an architecture without a site adapter, before any data loads
        log.info("model %s: %s, %d layers, %d heads (%d key-value), attention %s", cfg.name, layout.arch.family,
                 layout.layers, layout.heads, layout.kv_heads, layout.attn_implementation)  # fmt: skip
        return ModelBundle(model, None, None, tokenizer=tokenizer)
