"""What every model source shares: the bundle it hands back, the registry it joins, strict checkpoint loading."""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.errors import RunnerError
from runner.schema import ModelConfig

if TYPE_CHECKING:
    from runner.models.lm_sites import LanguageModelLayout

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
    # A language model's tokenizer (model=hf_lm); None for an image model. Its data is text (data=prompts).
    tokenizer: Any = None

    @property
    def class_names(self) -> list[str] | None:
        """The output classes' names by index (the same list as `categories`)."""
        return self.categories


class Preprocess:
    """A model's own photo preprocessing with what runner.data.base reads from it: the square input side it makes
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

    A source subclasses this; its option module (runner/options/model/<name>.py) registers it under the value of
    `model.source`, and runner/models/__init__.py makes one instance of each.
    """

    # How the "unknown model" error describes what this source accepts (e.g. "a torchvision model name").
    accepts: str = ""
    # The source's registered name (`model.source`), set when runner.models makes the instance.
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

    def layout(self, cfg: ModelConfig) -> LanguageModelLayout | None:
        """A language model's layout read from its config alone, no weights loaded (what a run checks a method's
        sites and layers against before the model loads); None for a source of image models."""
        return None

    def skeleton(self, cfg: ModelConfig) -> nn.Module | None:
        """A language model's modules on the meta device, from its config alone: every shape, no memory, no weights
        read (what a memory plan measures); None for a source of image models."""
        return None

    def tokenizer(self, cfg: ModelConfig) -> Any:
        """A language model's tokenizer alone, no weights loaded (a memory plan tokenizes the data with it); None
        for a source of image models."""
        return None


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
            # weights_only: a checkpoint is data; a pickle that would run code is refused, not executed. The
            # weights-only unpickler's warnings (e.g. on a protocol-4 pickle) would only precede the refusal.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", module=r"torch\._weights_only_unpickler")
                state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise RunnerError(_refused_pickle(file, e)) from None
    except Exception as e:
        raise RunnerError(
            f"Cannot read checkpoint {file} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
            f" {CHECKPOINT_FORMATS}"
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


CHECKPOINT_FORMATS = (
    "A checkpoint must be a state dict saved with torch.save(model.state_dict(), path) (tensors only) or a"
    " .safetensors file."
)


def pickle_detail(error: pickle.UnpicklingError) -> str:
    """What the weights-only unpickler found in a refused pickle: the global it names, or its unsupported operand."""
    named = re.search(r"GLOBAL ([\w.]+)", str(error))  # the callable or class the pickle would import
    operand = re.search(r"Unsupported operand \d+", str(error))
    return f"it names {named.group(1)}" if named else operand.group(0) if operand else "not a tensors-only pickle"


def _refused_pickle(file: Path, error: pickle.UnpicklingError) -> str:
    """One line for a checkpoint the weights-only unpickler refused: what it holds, never torch's advice to load it
    with weights_only=False (that runs the file's code)."""
    return (
        f"Checkpoint {file} is refused: it holds more than tensors ({pickle_detail(error)}), and reading it as a full"
        f" pickle could run code named in the file. {CHECKPOINT_FORMATS} If you trust the file, load it in Python and"
        " save its state dict."
    )


# Callables that turn a file into Python objects by running what the file names (pickle and the libraries built
# on it) or that load code (TorchScript, torch.hub, torch.package), by the module that defines them: as a model's
# `_target_` they would make a data file code, which checkpoints refuse.
PICKLE_LOADER_MODULES = (
    "pickle", "_pickle", "cPickle", "shelve", "dill", "cloudpickle", "joblib", "multiprocessing.reduction",
    "torch.serialization", "torch.jit._serialization", "torch.package", "torch.hub", "pandas.io.pickle",
)  # fmt: skip
# Arguments that open the pickle door of a loader outside those modules (numpy.load's allow_pickle=True, a
# wrapper forwarding weights_only=False to torch.load): refused at these values.
PICKLE_ARGUMENTS = {"allow_pickle": True, "weights_only": False}


def _resolved(target: str) -> Any:
    """The object a `_target_` names, or None when it cannot be imported (the model source says so itself)."""
    try:
        from hydra.utils import get_object

        return inspect.unwrap(get_object(target))
    except Exception:
        return None


def _defining_modules(target: str, found: Any) -> set[str]:
    """The modules a `_target_` belongs to: its dotted path's own, and where the object it names is defined
    (numpy and pandas re-export their loaders under the package's name)."""
    modules = {target.rpartition(".")[0]}
    for obj in (found, getattr(found, "__func__", None)):
        modules.add(str(getattr(obj, "__module__", "") or ""))
        modules.add(str(getattr(obj, "__globals__", {}).get("__name__", "")))
    return modules - {""}


def _pickle_arguments(found: Any, arguments: dict[str, Any]) -> list[str]:
    """The `name=value` arguments of a call (positional ones bound to their names) that make a loader read pickles."""
    named = {k: v for k, v in arguments.items() if k != "_args_"}
    try:
        named = dict(inspect.signature(found).bind_partial(*arguments.get("_args_", []), **named).arguments)
    except (TypeError, ValueError):  # no signature, or the call does not fit it: Hydra's call will say
        pass
    return [f"{name}={value}" for name, value in named.items()
            if name in PICKLE_ARGUMENTS and bool(value) is PICKLE_ARGUMENTS[name]]  # fmt: skip


MODEL_TARGET_FIX = (
    "Name the model's class as `_target_` and give its weights with model.checkpoint=PATH (a state dict, read with"
    " weights_only=True, or a .safetensors file)."
)


def refuse_unsafe_targets(target: str, kwargs: dict[str, Any], where: str = "model._target_",
                          kwargs_at: str = "model.kwargs", fix: str = MODEL_TARGET_FIX) -> None:  # fmt: skip
    """RunnerError when `target` (the config entry `where`, called with `kwargs`, the entry `kwargs_at`), or a
    `_target_` nested in its arguments (Hydra builds those too), loads a pickle or TorchScript (such a callable runs
    code stored in a file, which checkpoints refuse) or is on Hydra's list of targets a config may not call
    (os.system, shutil.rmtree, eval, ...). `fix`: what to give instead."""
    found = _resolved(target)
    modules = _defining_modules(target, found)
    loader = any(m == p or m.startswith(p + ".") for m in modules for p in PICKLE_LOADER_MODULES)
    opened = _pickle_arguments(found, kwargs)
    if loader or opened:
        how = f" with {', '.join(opened)}" if opened and not loader else ""
        raise RunnerError(
            f"{where}={target}{how} loads a pickle (or TorchScript), which runs code stored in the file: refused,"
            f" as a checkpoint with code is. {fix}"
        )
    _refuse_blocked(target, where)
    for key, value in kwargs.items():
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, dict) and isinstance(item.get("_target_"), str):
                place = f"{kwargs_at}.{key}" + (f"[{index}]" if isinstance(value, list) else "")
                nested = {k: v for k, v in item.items() if k != "_target_"}
                refuse_unsafe_targets(item["_target_"], nested, f"{place}._target_", place, fix)


def _refuse_blocked(target: str, where: str) -> None:
    """Hydra's own refusal of a target (its instantiate policy, hydra-core >= 1.3.8: commands, file removal, code
    evaluation), asked without calling anything (`_partial_`), in one line and without the environment variable
    that would lift it."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate({"_target_": target, "_partial_": True})
    except InstantiationException as e:
        if "blocklisted" in str(e):
            raise RunnerError(
                f"{where}={target} is refused: Hydra blocks it in configs, since it can run commands, evaluate code"
                " or change files."
            ) from None
    except Exception:  # not importable, or not callable: the caller's own import says so in its words
        pass


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
