"""Any nn.Module by its import path: `model._target_: my_pkg.MyNet`, called with `model.kwargs`."""

from __future__ import annotations

import importlib
import os
import sys

from torch import nn

from runner.errors import RunnerError
from runner.models.base import ModelBundle, ModelSource, refuse_unsafe_targets
from runner.schema import ModelConfig

# The model YAMLs' own `weights` values: a `_target_` has no weights of its own, so these say nothing about it.
DEFAULT_WEIGHTS = (None, "DEFAULT", "embedded")


class TargetSource(ModelSource):
    accepts = "`model._target_` for any nn.Module"

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg._target_ is not None

    def label(self, cfg: ModelConfig) -> str:
        # A factory's model name says which model it built (timm.create_model(model_name=resnet18)).
        named = cfg.kwargs.get("model_name") or cfg.kwargs.get("name")
        return f"target:{cfg._target_}" + (f":{named}" if isinstance(named, str) else "")

    def build(self, cfg: ModelConfig) -> ModelBundle:
        from hydra.utils import instantiate

        if not cfg._target_:
            raise RunnerError("model.source=target needs `model._target_`: the dotted import path of an nn.Module.")
        if cfg.weights not in DEFAULT_WEIGHTS:
            raise RunnerError(
                f"model.weights={cfg.weights} does not apply to a `_target_` (it has no weights of its own):"
                " use model.checkpoint=PATH, or pass the factory's own argument in model.kwargs."
            )
        _import_target(cfg._target_)
        refuse_unsafe_targets(cfg._target_, dict(cfg.kwargs))  # no pickle loader, nothing Hydra blocks
        try:
            model = instantiate({"_target_": cfg._target_, **cfg.kwargs})
        except Exception as e:  # hydra wraps the call's errors (a wrong kwarg, a failing __init__)
            raise RunnerError(f"Could not build model `_target_: {cfg._target_}`: {' '.join(str(e).split())}") from e
        if not isinstance(model, nn.Module):
            raise RunnerError(f"`_target_: {cfg._target_}` built a {type(model).__name__}, not a torch.nn.Module.")
        return ModelBundle(model, None, None)


def _launch_directory() -> str:
    """The directory the command was started in (Hydra's original cwd when a Hydra app runs, else the cwd)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return str(HydraConfig.get().runtime.cwd)
    except Exception:  # no Hydra run: the plain working directory
        pass
    return os.getcwd()


def _import_target(target: str) -> None:
    """Import the module of `target` (a.b.Class: a.b, else a), with the launch directory importable as
    `python -m` makes it (the `runner` console command does not), or fail with one line saying how to fix it."""
    here = _launch_directory()
    if here not in sys.path and os.path.abspath(here) not in sys.path:
        sys.path.append(here)  # after the installed packages: a local file never shadows one
    parts = target.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:end])
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is no module (`a.b.Class` may be class `b.Class` of `a`): try a shorter one
            # the module exists but imports a package that is not installed
            raise RunnerError(
                f"Importing `{module}` for model._target_={target} failed: {e}. Install the missing package"
                f" (pip install {e.name.split('.')[0] if e.name else '...'})."
            ) from e
        except Exception as e:  # the user's module itself fails while importing
            raise RunnerError(
                f"Importing `{module}` for model._target_={target} failed ({type(e).__name__}: {e})."
            ) from e
        if _has_path(imported, parts[end:]):
            return
        raise RunnerError(f"model._target_={target}: module `{module}` has no `{'.'.join(parts[end:])}`.")
    raise RunnerError(
        f"Cannot import `{parts[0]}` for model._target_={target}: it is not on the Python path. Run from the"
        f" directory that holds {parts[0]}.py or {parts[0]}/ (it is added to the path: {here}), add that directory"
        f" to PYTHONPATH (PYTHONPATH=/path/to/dir runner ...), or install your package (pip install -e .)."
    )


def _has_path(obj: object, names: list[str]) -> bool:
    """Whether obj.names[0].names[1]... exists."""
    for name in names:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True
