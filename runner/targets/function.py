"""A target given by `_target_`: any function (output, classes) -> (B,) score, imported by its dotted path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.errors import RunnerError
from runner.models.base import refuse_unsafe_targets
from runner.options.target.callable import CallableTargetConfig


def import_function(path: str) -> Callable[..., torch.Tensor]:
    """The function at dotted `path` (module.function or module.Class.method); one-line RunnerError otherwise."""
    import importlib

    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:end])
        try:
            found: object = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # not a module: the path's tail may be attributes of a shorter prefix
            raise RunnerError(f"Importing `{module}` for target._target_={path} failed: {e}.") from e
        except Exception as e:  # the user's module fails while importing
            raise RunnerError(
                f"Importing `{module}` for target._target_={path} failed ({type(e).__name__}: {e})."
            ) from e
        for name in parts[end:]:
            if not hasattr(found, name):
                raise RunnerError(f"target._target_={path}: module `{module}` has no `{'.'.join(parts[end:])}`.")
            found = getattr(found, name)
        if not callable(found):
            raise RunnerError(f"target._target_={path} is a {type(found).__name__}, not a function.")
        return found  # type: ignore[return-value]
    raise RunnerError(
        f"Cannot import `{path}` for target._target_: give module.function with the module on the Python path"
        " (PYTHONPATH=/path/to/dir, or pip install -e . for your package)."
    )


TARGET_FIX = "Give a function of your own: (output, classes) -> (B,) score."


class Function:
    """`fn(output, classes)`, checked to give one score per sample."""

    def __init__(self, config: CallableTargetConfig) -> None:
        self.path = str(config._target_)  # CallableTargetConfig.check refuses a config without one
        # the list model._target_ is held to: a config never names a command, code evaluation or a pickle loader
        refuse_unsafe_targets(self.path, {}, "target._target_", "target", fix=TARGET_FIX)
        self.fn = import_function(self.path)

    def score(self, output: torch.Tensor, classes: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        score = self.fn(output, classes)
        if not torch.is_tensor(score) or tuple(score.shape) != (output.shape[0],):
            raise RunnerError(
                f"target._target_={self.path} returned {getattr(score, 'shape', type(score).__name__)}; a target"
                f" returns one score per sample, a tensor of shape ({output.shape[0]},)."
            )
        return score
