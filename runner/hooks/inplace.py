"""In-place switching: `inplace=True` turned off on a model's modules, held as a removable handle.

Full backward hooks make torch refuse an in-place op on their module's output, so while they are registered the
session switches in-place ops off (same values, one more buffer each) and keeps the switch in its handle list:
`HookSession.close()` removes hooks and restores the flags on one path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def disable_inplace(model: nn.Module) -> list[nn.Module]:
    """Set `inplace=False` on every module that has it on; return them, for restoring."""
    switched = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for module in switched:
        module.inplace = False  # type: ignore[assignment]
    return switched


def restore_inplace(modules: list[nn.Module]) -> None:
    """Undo `disable_inplace`."""
    for module in modules:
        module.inplace = True  # type: ignore[assignment]


class InplaceOff:
    """In-place ops off on `model` until `remove()`, a handle like a hook's (removing it twice does nothing)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = disable_inplace(model)

    def remove(self) -> None:
        """Turn in-place back on where it was on; forget the modules, so a second call changes nothing."""
        restore_inplace(self.modules)
        self.modules = []


@contextmanager
def inplace_disabled(model: nn.Module) -> Iterator[None]:
    """In-place ops off inside the block (same values, one more buffer each), restored after, also on error."""
    handle = InplaceOff(model)
    try:
        yield
    finally:
        handle.remove()
