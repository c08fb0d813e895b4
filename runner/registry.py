"""One registry shape for every config group whose options have implementations: methods, data sources,
model sources. Each implementation registers itself under a key (its config type, or its source name);
a user's option name finds the key, and an unknown name fails with the nearest valid ones."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from runner.errors import RunnerError, suggest

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")


class Registry(Generic[K, V]):
    """The implementations of one config group's options, by key; `name_of(key)` is the option's name.

    Reads like a read-only dict (`registry[key]`, `get`, iteration over keys, `items()`); `register(key)`
    is the one way in, as a decorator beside the implementation.
    """

    def __init__(self, group: str, name_of: Callable[[K], str]) -> None:
        self.group = group  # how errors name an option: "Unknown <group> 'x'"
        self._name_of = name_of
        self._entries: dict[K, V] = {}

    def register(self, key: K) -> Callable[[T], T]:
        """Decorator: the decorated object implements option `key`; a second one for the same name is a bug."""

        def add(implementation: T) -> T:
            name = self._name_of(key)
            clash = [k for k in self._entries if self._name_of(k) == name and k != key]
            if clash:  # two implementations of one option: the later would silently win
                raise ValueError(f"{self.group} '{name}' is registered twice ({clash[0]!r} and {key!r}).")
            self._entries[key] = implementation  # type: ignore[assignment]  # T is the V the caller registers
            return implementation

        return add

    def key(self, name: str) -> K:
        """The key of the option called `name`; RunnerError with the nearest names when there is none."""
        for key in self._entries:
            if self._name_of(key) == name:
                return key
        names = self.names()
        raise RunnerError(f"Unknown {self.group} '{name}'.{suggest(name, names)} Available: {', '.join(names)}.")

    def for_config(self, config: Any, option: str) -> V:
        """The implementation registered under `config`'s type. A config of another type (the group's base class
        naming an option) is refused, not guessed: the message names the class to build (`option`: the config key)."""
        found = self._entries.get(type(config))  # type: ignore[arg-type]  # keyed by config type in these groups
        if found is None:
            expected: Any = self.key(config.name)  # raises for an unknown name
            raise RunnerError(
                f"{option}={config.name} needs its own config ({expected.__name__}), not a {type(config).__name__}:"
                f" build it with {expected.__name__}(...) or {option}_config('{config.name}', ...)."
            )
        return found

    def names(self) -> list[str]:
        """Every option's name, in registration order."""
        return [self._name_of(key) for key in self._entries]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._entries.get(key, default)

    def items(self) -> list[tuple[K, V]]:
        return list(self._entries.items())

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.group!r}: {', '.join(self.names())})"
