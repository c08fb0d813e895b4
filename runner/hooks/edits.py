"""Reversible model edits: modules re-initialised in place, their original values put back on `remove()`.

Randomisation tests (MPRT, sanity) explain the run's own model with some layers' weights destroyed. Rather than a
deep copy of the model (which would carry the session's hooks along, or need them torn off), the session
re-initialises the modules in place and holds the edit as one more removable handle: `remove()` (or the
session's `close`, also after an error) restores every parameter and buffer the edit touched, in place, so
references to them (the model's own, an optimiser's) stay valid. zennit's canonizers are the model for this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


class Reinitialised:
    """`modules` re-initialised, in order, after `torch.manual_seed(seed)` in a forked random state (the run's own
    random state is untouched); each module's `reset_parameters()` decides how. A module listed twice is reset
    twice (the seed is drawn once, before the first). `remove()` restores the values; it is idempotent."""

    def __init__(
        self, modules: Iterable[nn.Module], seed: int, on_remove: Callable[[Reinitialised], None] | None = None
    ) -> None:
        modules = list(modules)
        self._on_remove = on_remove
        # (owner, attribute, the tensor object, its values): parameters and buffers of every module (and below),
        # each once, so that a parent and its child listed together restore the child once, to its first values.
        self._saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for module in modules:
            for owner in module.modules():
                for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
                    if tensor is not None and id(tensor) not in seen:
                        seen.add(id(tensor))
                        self._saved.append((owner, name, tensor, tensor.detach().clone()))
        self.removed = False
        try:
            devices = sorted({t.device.index or 0 for _, _, t, _ in self._saved if t.device.type == "cuda"})
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed)
                for module in modules:
                    module.reset_parameters()  # type: ignore[operator]
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Put every touched parameter and buffer back: the same tensor objects, holding their original values."""
        if self.removed:
            return
        self.removed = True
        with torch.no_grad():
            for owner, name, tensor, values in reversed(self._saved):
                if getattr(owner, name) is not tensor:  # a reset_parameters that assigned a new tensor
                    setattr(owner, name, tensor)
                tensor.copy_(values)
        self._saved.clear()
        if self._on_remove is not None:
            self._on_remove(self)


def resettable(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every module in `modules` and below that can be re-initialised (has `reset_parameters`), in order."""
    return [sub for module in modules for sub in module.modules() if hasattr(sub, "reset_parameters")]
