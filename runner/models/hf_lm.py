"""Hugging Face causal language models (`model=hf_lm`): AutoModelForCausalLM and its tokenizer from the shipped
induction model, a packaged pretrained model by its short name (converted once into the runner's cache), a folder
saved with save_pretrained, the Hugging Face cache (a hub id), or random weights from a config. The attention
implementation and the weights' dtype are set explicitly (and are part of the run's config); a device map spreads a
model larger than one device (accelerate)."""

from __future__ import annotations

import copy
import importlib.util
import logging
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.dictionaries.formats import check_fits, load_dictionary, read_spec
from runner.dictionaries.splice import Spliced, attach, placed_at
from runner.errors import RunnerError, suggest
from runner.models.base import ModelBundle, ModelSource
from runner.models.hf import (
    dtype_argument,
    from_hub,
    hub_errors,
    in_hub_cache,
    not_in_cache,
    refuse_remote_code,
    transformers_module,
)
from runner.models.lm_sites import LanguageModelLayout, layout_of, layout_of_config
from runner.models.packaged_lm import converted_folder
from runner.options.model.hf_lm import PACKAGED_LMS, SHIPPED_LM, DictionaryConfig, HfLmModelConfig
from runner.schema import ModelConfig

log = logging.getLogger(__name__)


def shipped_folder() -> Path:
    """The folder of the model that ships inside the package (config, safetensors weights, tokenizer)."""
    return Path(str(resources.files("runner.models") / "lm_induction"))


def model_folder(name: str) -> str:
    """What transformers loads for model.name: the shipped model's folder for `induction`, a packaged model's
    converted folder for its short name (converted first if it is not cached), else the name itself."""
    if name in PACKAGED_LMS:
        return str(converted_folder(name))
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
        return [SHIPPED_LM, *PACKAGED_LMS]

    def layout(self, cfg: ModelConfig) -> LanguageModelLayout:
        """The layout from the model's config.json alone (a packaged model is converted first, once)."""
        checked = _checked(cfg)
        transformers = transformers_module()
        name = _located(checked.name)
        config = _model_config(transformers, name, checked)
        layout = layout_of_config(config, checked.attn_implementation)
        return planned_dictionaries(layout, config, checked.dictionaries)

    def skeleton(self, cfg: ModelConfig) -> nn.Module:
        """The model built from its config.json on the meta device, in the run's dtype and attention."""
        checked = _checked(cfg)
        transformers = transformers_module()
        name = _located(checked.name)
        config = _model_config(transformers, name, checked)
        options = {"attn_implementation": checked.attn_implementation,
                   **dtype_argument(transformers, getattr(torch, checked.dtype))}  # fmt: skip
        with torch.device("meta"):
            model = _from_config(transformers, config, checked.config if checked.weights is None else {}, options)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    def tokenizer(self, cfg: ModelConfig) -> Any:
        checked = _checked(cfg)
        transformers = transformers_module()
        name = _located(checked.name)
        tokenizer_name = model_folder(checked.tokenizer) if checked.tokenizer else name
        with hub_errors(tokenizer_name):
            return load_tokenizer(transformers, tokenizer_name)

    def build(self, cfg: ModelConfig) -> ModelBundle:
        cfg = _checked(cfg)
        transformers = transformers_module()
        name = _located(cfg.name)
        dtype = getattr(torch, cfg.dtype)
        options: dict[str, Any] = {
            "attn_implementation": cfg.attn_implementation,
            **dtype_argument(transformers, dtype),
            **cfg.kwargs,
        }
        config = _model_config(transformers, name, cfg)
        with hub_errors(name):
            if cfg.weights is None:
                model = _from_config(transformers, config, cfg.config, options)
                log.info("model %s: random weights from its config (model.weights=null)", cfg.name)
            else:
                if cfg.device_map is not None:
                    _need_accelerate()
                    _check_device_map(transformers, config, cfg.device_map)
                    options["device_map"] = cfg.device_map
                model = from_hub(
                    name,
                    lambda local: transformers.AutoModelForCausalLM.from_pretrained(name, **local, **options),
                    download=False,
                )
                if cfg.name in PACKAGED_LMS and not _finite(model):  # bytes changed with the file's time kept
                    name = str(converted_folder(cfg.name, damaged="its weights hold NaN or infinite values"))
                    model = transformers.AutoModelForCausalLM.from_pretrained(name, **options)
            tokenizer_name = model_folder(cfg.tokenizer) if cfg.tokenizer else name
            tokenizer = load_tokenizer(transformers, tokenizer_name)
        _check_vocabulary(model, tokenizer, tokenizer_name)
        layout = layout_of(model)  # refuses an architecture without a site adapter, before any data loads
        if cfg.dictionaries:
            layout = spliced_dictionaries(model, layout, cfg.dictionaries)
        packaged = PACKAGED_LMS.get(cfg.name)
        weights = f", weights {packaged.quantisation}" if packaged and cfg.weights is not None else ""
        model_type = str(getattr(model.config, "model_type", layout.arch.family))
        family = model_type if model_type == layout.arch.family else f"{model_type} ({layout.arch.family}'s layout)"
        log.info("model %s: %s, %d layers, %d heads (%d key-value), attention %s, %s%s", cfg.name, family,
                 layout.layers, layout.heads, layout.kv_heads, layout.attn_implementation, cfg.dtype, weights)  # fmt: skip
        return ModelBundle(model, None, None, tokenizer=tokenizer)


def planned_dictionaries(
    layout: LanguageModelLayout, config: Any, dictionaries: list[DictionaryConfig]
) -> LanguageModelLayout:
    """The layout with model.dictionaries placed, each read from its config alone (no weights) and refused where it
    does not fit the model: its layer, and the width it reads and writes against the model's."""
    d_model = int(getattr(config, "hidden_size", None) or config.n_embd)
    placed = []
    for i, item in enumerate(dictionaries):
        key = f"model.dictionaries[{i}]"
        layout.block_layers([item.layer], f"{key}.layer")
        folder = Path(item.path).expanduser()
        if not folder.is_dir():
            raise RunnerError(
                f"{key}.path={item.path} is no folder: give the dictionary's folder (a method=train_sae run writes"
                " one to <run>/dictionary)."
            )
        spec = read_spec(folder)
        if spec.transcoder != (item.site == "mlp"):
            raise RunnerError(
                f"{key}: {item.path} holds a {spec.kind}, placed at site={item.site}; a transcoder goes at site=mlp"
                " (it reads the MLP's input and writes its output), an SAE at a stream or branch site."
            )
        check_fits(spec, d_model, f"{key} ({item.site}.{item.layer})")
        placed.append(placed_at(layout, item.site, item.layer, spec.width))
    return replace(layout, dictionaries=tuple(placed))


def spliced_dictionaries(
    model: nn.Module, layout: LanguageModelLayout, dictionaries: list[DictionaryConfig]
) -> LanguageModelLayout:
    """model.dictionaries checked against the loaded model, their weights loaded and spliced in (splice.py)."""
    planned_dictionaries(layout, model.config, dictionaries)
    loaded = []
    for item in dictionaries:
        dictionary = load_dictionary(Path(item.path).expanduser())
        spec = dictionary.spec
        log.info("dictionary %s: %s %s of %d latents at %s.%d", item.path, spec.architecture, spec.kind, spec.width,
                 item.site, item.layer)  # fmt: skip
        loaded.append(Spliced(dictionary, item.site, item.layer))
    return attach(model, layout, loaded)


def _finite(model: nn.Module) -> bool:
    """Whether every weight is finite (a pretrained model's are; a damaged file's may not be). A tensor whose sum is
    finite holds no NaN or infinity (either makes the sum NaN or infinite): one read, no mask (isfinite over Gemma 3
    270M's weights took 1.3 s; benchmarks/RESULTS.md); only a sum that overflows is checked value by value."""
    return all(
        bool(torch.isfinite(p.sum())) or bool(torch.isfinite(p).all())
        for p in model.parameters()
        if p.is_floating_point()
    )


# Tokenizers loaded in this process, by folder and the size and time of each of its files: Gemma 3's (262,144
# tokens) takes 4.4 s to load, and a process that runs several experiments (a sweep's jobs, a notebook, the tests)
# would load it each time. Each run gets its own shallow copy: settings such as padding_side are its own.
_TOKENIZERS: dict[tuple, Any] = {}


def load_tokenizer(transformers: Any, name: str) -> Any:
    """AutoTokenizer for `name` (a folder or a hub id in the cache; never downloaded), a local folder's loaded once a
    process while its files are unchanged."""
    folder = Path(name).expanduser()
    key = None
    if folder.is_dir():
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".jinja", ".model", ".txt"))
        stats = [(p.name, p.stat()) for p in files]
        key = (str(folder.resolve()), *((name, st.st_size, st.st_mtime_ns) for name, st in stats))
    if key is None or key not in _TOKENIZERS:
        tokenizer = from_hub(name, lambda local: transformers.AutoTokenizer.from_pretrained(name, **local), False)
        if key is None:
            return tokenizer
        if len(_TOKENIZERS) >= 4:  # a few models at a time; a tokenizer can be hundreds of MB
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = tokenizer
    return copy.copy(_TOKENIZERS[key])


def _checked(cfg: ModelConfig) -> HfLmModelConfig:
    """`cfg` refused, before anything is read, where its values do not go together."""
    if not isinstance(cfg, HfLmModelConfig):
        raise RunnerError("model.source=hf_lm takes conf/model/hf_lm.yaml's keys: use model=hf_lm.")
    if not cfg.name:
        raise RunnerError("model=hf_lm needs model.name=NAME: induction (shipped), a local folder or a hub id.")
    if cfg.weights not in (None, "DEFAULT", "true", "True"):
        raise RunnerError(
            f"model=hf_lm loads the weights saved with the model (model.weights=DEFAULT) or none (null: random"
            f" weights from its config), not '{cfg.weights}'."
        )
    if cfg.weights is None and cfg.device_map is not None:
        raise RunnerError(
            "model.device_map places saved weights across devices as they load; random weights (model.weights="
            "null) are built in memory: leave model.device_map=null, or load saved weights."
        )
    if cfg.weights is not None and cfg.config:
        raise RunnerError(
            "model.config overrides a config for random weights: it needs model.weights=null (saved weights"
            " come with their own config)."
        )
    refuse_remote_code(cfg.kwargs)
    _check_attention(cfg.attn_implementation)
    return cfg


def _located(name: str) -> str:
    """What transformers loads for `name` (model_folder), refused in one line where it is neither a folder saved
    with save_pretrained nor a hub id in the Hugging Face cache: nothing is downloaded (offline, a download would
    retry for half a minute before it failed)."""
    folder = model_folder(name)
    _check_folder(folder)
    if not Path(folder).expanduser().exists() and not in_hub_cache(folder):
        raise not_in_cache(folder)
    return folder


def _model_config(transformers: Any, name: str, cfg: HfLmModelConfig) -> Any:
    """The model's transformers config (no weights), with model.config's overrides for random weights."""
    with hub_errors(name):
        config = from_hub(name, lambda local: transformers.AutoConfig.from_pretrained(name, **local), download=False)
    return _with_overrides(config, cfg.config) if cfg.weights is None else config


def _check_attention(implementation: str) -> None:
    """flash_attention_2 needs the flash-attn package: refused here in one line, before the model loads."""
    if implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise RunnerError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package (pip install flash-attn, on"
            " a CUDA machine), which is not installed: use model.attn_implementation=sdpa or eager."
        )


def _check_folder(name: str) -> None:
    """A local folder that is not a saved model (no config.json), named as such rather than as transformers'
    "Unrecognized model"."""
    folder = Path(name).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        found = sorted(p.name for p in folder.iterdir())[:8]
        raise RunnerError(
            f"model.name={name} is a folder without config.json ({'holds ' + ', '.join(found) if found else 'empty'}):"
            " give a folder saved with save_pretrained (config.json, the weights and the tokenizer's files)."
        )


def _with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """`config` with model.config's overrides, each key checked against the config's own."""
    for key, value in overrides.items():
        if not hasattr(config, key):  # setattr would add it silently, and nothing would read it
            raise RunnerError(
                f"model.config.{key}: {type(config).__name__} has no such key.{suggest(key, config.to_dict())}"
            )
        try:
            setattr(config, key, value)
        except Exception as e:  # the config class validates its fields (huggingface_hub's strict dataclasses)
            raise RunnerError(f"model.config.{key}={value!r} is refused by {type(config).__name__}: {_first(e)}") from e
    return config


def _from_config(transformers: Any, config: Any, overrides: dict[str, Any], options: dict[str, Any]) -> Any:
    """Random weights from `config` (model.config's `overrides` already applied: they are named in an error)."""
    try:
        return transformers.AutoModelForCausalLM.from_config(config, **options)
    except (ValueError, TypeError, AssertionError) as e:  # sizes that do not fit together (heads, dimensions)
        given = f" with model.config {dict(overrides)}" if overrides else ""
        raise RunnerError(f"Cannot build the model from its config{given}: {_first(e)}") from e


def _first(error: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


DEVICE_MAP_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_device_map(transformers: Any, config: Any, device_map: Any) -> None:
    """model.device_map checked before anything loads: a strategy or a device, or {module prefix: device} whose
    every prefix names a module of the model (accelerate would silently ignore one that names none)."""
    if isinstance(device_map, str) and device_map in DEVICE_MAP_NAMES:
        return
    if not isinstance(device_map, dict):
        _check_device(device_map, f"model.device_map={device_map}", strategies=True)
        return
    from accelerate import init_empty_weights

    with init_empty_weights():  # the module tree only, no memory for the weights
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    names = [name for name, _ in skeleton.named_modules() if name]
    for prefix, device in device_map.items():
        if prefix != "" and prefix not in names:
            raise RunnerError(
                f"model.device_map names '{prefix}', which is no module of the model.{suggest(str(prefix), names)}"
                " Keys are module names (`runner layers` lists them) or '' for the whole model."
            )
        _check_device(device, f"model.device_map.{prefix}={device}", strategies=False)


def _check_device(device: Any, where: str, strategies: bool) -> None:
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return
    if isinstance(device, str) and device == "disk":
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        choices = f"{', '.join(DEVICE_MAP_NAMES)}, a device" if strategies else "a device"
        raise RunnerError(
            f"{where}: not a device map. Give {choices} (cpu, cuda:0, 0, disk) or {{module prefix: device}}."
        ) from None


def _check_vocabulary(model: Any, tokenizer: Any, tokenizer_name: str) -> None:
    """A tokenizer with ids beyond the embedding's rows would index past it (an error mid-run on one device, silent
    garbage on another)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise RunnerError(
            f"The tokenizer of {tokenizer_name} has {len(tokenizer)} tokens but the model's embedding has {rows} rows:"
            " ids past the last row cannot be embedded. Use the model's own tokenizer (model.tokenizer=null) or one"
            " of its vocabulary."
        )
