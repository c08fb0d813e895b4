"""Hugging Face image classifiers (`model=hf model.name=<hub id or local folder>`) through transformers'
AutoModelForImageClassification: logits from the output object, preprocessing from the saved image processor,
`id2label` as class names. transformers is imported only when a model is built."""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.errors import RunnerError
from runner.models.base import ModelBundle, ModelSource, Preprocess, hub_cache_dir, hub_offline, pickle_detail
from runner.schema import ModelConfig

log = logging.getLogger(__name__)


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise RunnerError(
            "model=hf needs the transformers package: pip install 'runner[models]' (or pip install transformers)."
        ) from e
    return transformers


def dtype_argument(transformers: Any, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword that sets the dtype weights load in: `dtype` since transformers 4.56, `torch_dtype` before."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


class HuggingFaceSource(ModelSource):
    accepts = "a Hugging Face hub id or folder with model=hf"

    def build(self, cfg: ModelConfig) -> ModelBundle:
        if not cfg.name:
            raise RunnerError("model=hf needs model.name=NAME: a Hugging Face hub id or a local folder.")
        if cfg.weights not in (None, "DEFAULT", "true", "True"):
            raise RunnerError(
                f"model=hf loads the weights saved with the model (model.weights=DEFAULT) or none (null: random"
                f" init from its config), not '{cfg.weights}': give another revision's folder as model.name."
            )
        refuse_remote_code(cfg.kwargs)
        transformers = transformers_module()
        with hub_errors(cfg.name):
            config = from_hub(cfg.name, lambda local: transformers.AutoConfig.from_pretrained(cfg.name, **local))
            if cfg.weights is None:
                model = transformers.AutoModelForImageClassification.from_config(config, **cfg.kwargs)
            else:
                model = from_hub(
                    cfg.name,
                    lambda local: transformers.AutoModelForImageClassification.from_pretrained(
                        cfg.name, **local, **cfg.kwargs
                    ),
                )
        model.__class__ = _logits_class(type(model))
        labels = getattr(model.config, "id2label", None) or {}
        names = [str(labels[i]) for i in range(len(labels))] if set(labels) == set(range(len(labels))) else None
        return ModelBundle(model, _preprocess(transformers, cfg.name), names)


# Every transformers load runs no code shipped with a model (a config's `auto_map`): configs and folders are data,
# as checkpoints are. Passed explicitly, so that transformers never asks on the terminal either.
NO_REMOTE_CODE = {"trust_remote_code": False}


def refuse_remote_code(kwargs: Any, where: str = "model.kwargs") -> None:
    """RunnerError for `trust_remote_code` in a model's arguments: it would run Python files shipped with the
    model, which the runner refuses as it refuses a pickle that runs code (weights_only=False)."""
    if "trust_remote_code" in kwargs:
        raise RunnerError(
            f"{where}.trust_remote_code is refused: it runs Python code shipped with the model folder, as"
            " weights_only=False would run a checkpoint's. Use a model that transformers implements (its config's"
            " model_type), or load yours in Python and pass it to the library functions."
        )


@contextmanager
def hub_errors(name: str) -> Iterator[None]:
    """transformers' failures to read a model folder's files, as one line each: a pickle the weights-only loader
    refuses (never torch's advice to load it with weights_only=False), a damaged safetensors file, a folder that
    needs its own code, a missing optional package."""
    try:
        yield
    except pickle.UnpicklingError as e:
        raise RunnerError(
            f"The weights in {name} are refused: a pickle (pytorch_model.bin) that holds more than tensors"
            f" ({pickle_detail(e)}), and reading it as a full pickle could run code named in the file. Save the model"
            " with save_pretrained (safetensors) from Python if you trust it."
        ) from None
    except ImportError as e:  # an attention implementation or a quantisation whose package is not installed
        raise RunnerError(f"Cannot load {name}: {_first_line(e)}") from e
    except Exception as e:
        if type(e).__name__ == "SafetensorError":  # safetensors' Rust error: the class is not importable by name
            raise RunnerError(
                f"The weights in {name} cannot be read ({_first_line(e)}): the .safetensors file is damaged or"
                " incomplete (an interrupted copy or download); copy or save it again."
            ) from e
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise RunnerError(
                f"{name} needs its own Python code to load (its config's auto_map, a model_type transformers does"
                " not implement): refused, since it would run code shipped with the folder. Use a model that"
                " transformers implements."
            ) from e
        raise


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def from_hub(name: str, load: Any, download: bool = True) -> Any:
    """`load({local_files_only, trust_remote_code=False})`: from the folder or the Hugging Face cache first, then
    downloaded into the cache (not with HF_HUB_OFFLINE=1, nor with download=False); a model found nowhere is one
    clear error."""
    try:
        return load({"local_files_only": True, **NO_REMOTE_CODE})
    except OSError as cached:
        if Path(name).expanduser().exists():  # a local folder that lacks a file: what transformers says is the fix
            raise RunnerError(
                f"Cannot load the Hugging Face model in {name}: {str(cached).splitlines()[0]}"
            ) from cached
        if not download:
            raise not_in_cache(name, _first_line(cached)) from cached
        error: Exception = cached
    if not hub_offline():
        try:
            return load({"local_files_only": False, **NO_REMOTE_CODE})
        except OSError as e:  # offline: a connection error after retries; a wrong id: not found
            error = e
    why = "HF_HUB_OFFLINE=1: no download tried" if hub_offline() else type(error).__name__
    raise RunnerError(
        f"Hugging Face model '{name}' is neither a local folder nor in the Hugging Face cache {hub_cache_dir()}"
        f" ({why}). With internet, `hf download {name}` fills the cache; offline, copy a folder saved with"
        " save_pretrained (config.json, the weights, preprocessor_config.json) and give its path as model.name."
    ) from error


def in_hub_cache(name: str) -> bool:
    """Whether `name` is a hub id whose config.json is in the Hugging Face cache (looked up on disk: no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a hub id at all (huggingface_hub's HFValidationError)
        return False


def not_in_cache(name: str, detail: str = "") -> RunnerError:
    """The one line for a model that is neither a local folder nor (completely) in the Hugging Face cache, where the
    runner does not download it."""
    found = f" ({detail})" if detail else ""
    return RunnerError(
        f"model.name={name} is no local folder, and no hub id of that name is in the Hugging Face cache"
        f" {hub_cache_dir()}{found}: the runner does not download language models. On a machine with internet,"
        f" `hf download {name}` fills its cache (copy it here, or point HF_HOME at it); or give a folder saved with"
        " save_pretrained as model.name."
    )


@functools.cache
def _logits_class(base: type[nn.Module]) -> type[nn.Module]:
    """A subclass of a transformers model class whose forward takes the images and returns the logits tensor.
    The instance's class is swapped rather than wrapped, so layer names and checkpoint keys stay its own."""

    def forward(self: Any, pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["return_dict"] = True
        return base.forward(self, pixel_values, *args, **kwargs).logits  # (B, num_labels)

    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})


def _preprocess(transformers: Any, name: str) -> Preprocess | None:
    """The saved image processor as a PIL -> (C, H, W) transform, or None when the model has none."""
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(name, local_files_only=True, **NO_REMOTE_CODE)
    except (OSError, ValueError) as e:  # no preprocessor_config.json: the runner's standard transform
        log.info("no image processor saved with %s (%s): data.image_size and ImageNet's mean and std apply", name, e)
        return None
    if getattr(processor, "do_normalize", True):
        mean = getattr(processor, "image_mean", None) or [0.485, 0.456, 0.406]
        std = getattr(processor, "image_std", None) or [0.229, 0.224, 0.225]
    else:  # the processor only rescales to [0, 1]: so do data.resize=pad and none
        mean, std = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
    cropped = getattr(processor, "do_center_crop", False)
    size = _size_text(getattr(processor, "size", None))
    crop = _size_text(getattr(processor, "crop_size", None)) if cropped else size
    side = _square_side(getattr(processor, "crop_size", None) if cropped else getattr(processor, "size", None))
    return Preprocess(_ProcessorTransform(processor), mean, std, size, crop, side)


def _size_text(size: Any) -> Any:
    """An image processor's size for the log: 224, or 224x224."""
    if isinstance(size, dict) or hasattr(size, "get"):
        if size.get("height") and size.get("width"):
            return f"{size['height']}x{size['width']}"
        return size.get("shortest_edge") or size.get("longest_edge") or size
    return size


def _square_side(size: Any) -> int | None:
    """The square side an image processor's size says (height = width, or a shortest edge: ConvNeXt's processor
    crops to it), the size the runner's own geometry (data.resize=pad, none) then makes; None: not square."""
    if isinstance(size, int):
        return size
    if isinstance(size, dict) or hasattr(size, "get"):
        height, width = size.get("height"), size.get("width")
        if height and height == width:
            return int(height)
        if size.get("shortest_edge") and not height and not width:
            return int(size["shortest_edge"])
    return None


class _ProcessorTransform:
    """A transformers image processor applied to one PIL image: (C, H, W) float tensor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, image: Any) -> torch.Tensor:
        return self.processor(images=image, return_tensors="pt")["pixel_values"][0]  # (C, H, W)
