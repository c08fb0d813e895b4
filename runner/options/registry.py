"""The five extension points (model sources, data sources, targets, methods, metrics) and the one discovery that
fills them.

An option is one module in `runner/options/<group>/` (the same names as conf/'s groups): it defines its config
dataclass (its own settings, checked at start-up) and registers it with its group's point,

    @METHODS.option("runner.methods.gradcam:GradCAM")
    @dataclass
    class GradCamConfig(CamConfig):
        name: str = "gradcam"

naming its implementation by import path: the implementation (torch code) is imported only when a run uses
it, so `--cfg job`, `--help` and this discovery compose against the real schemas without importing torch.
A small option may hold its implementation in the same module, importing torch inside its functions.
Packages outside the runner add options through the `runner.options` entry-point group (a module to import).

What central code used to know about an option, the option declares: its schema's `SPEED_KEYS` (a ClassVar:
settings that change speed only, left out of the resume key), its schema's `fingerprint()` (the files a resume
must find unchanged: a data or model source's), and `tables` (the tables it writes, the main one first).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

from runner.errors import RunnerError, suggest

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One registered option: its name, schema and implementation, and what it declares about itself."""

    group: str  # model | data | target | method | metric
    name: str
    schema: type  # its config dataclass
    implementation: str | Any  # "module:attribute", imported on first use; or the object itself
    module: str  # the option module that registered it
    tables: tuple[str, ...] = ()  # the tables it writes, the main one first
    family: str | None = None  # options that share an implementation's contract: "cam" (maps from a layer)
    # A rule the implementation is made from (a CAM variant's weight rule): `implementation` is then a factory
    # called with this option, returning the implementation.
    rule: Any = None

    def load(self) -> Any:
        """The implementation (imported here the first time: an option's torch code loads only when it runs)."""
        found = resolve(self.implementation)
        return found(self) if self.rule is not None else found

    @property
    def doc(self) -> str:
        """The first paragraph of the option module's docstring (its one-line description in listings)."""
        module = importlib.import_module(self.module)
        return (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


# The `family` of the methods that take a language model (model=hf_lm, data=prompts).
LM_FAMILY = "lm"


def lm_method_names() -> list[str]:
    """The registered methods for language models, for messages that name them."""
    discover()
    return sorted(option.name for option in METHODS if option.family == LM_FAMILY)


def resolve(reference: Any) -> Any:
    """`module:attribute` imported; anything else as it is."""
    if not isinstance(reference, str):
        return reference
    module, _, attribute = reference.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split(".") if attribute else []:
        found = getattr(found, part)
    return found


class ExtensionPoint:
    """The options of one config group, by name and by schema; `option(...)` is the one way in."""

    def __init__(self, group: str, noun: str, package: str) -> None:
        self.group = group  # the config group (`method=gradcam`, conf/method/gradcam.yaml)
        self.noun = noun  # how errors name an option: "Unknown method 'x'"
        self.package = package  # where its option modules live
        self._options: dict[str, Option] = {}

    def option(
        self,
        implementation: str | Any,
        *,
        name: str | None = None,
        tables: tuple[str, ...] = (),
        family: str | None = None,
        rule: Any = None,
    ) -> Callable[[type[T]], type[T]]:
        """Class decorator on an option's config dataclass: register it. `name`: the option's name (default: the
        dataclass's `name` field's default). A second option of the same name is a bug, refused at import."""

        def add(schema: type[T]) -> type[T]:
            key = name if name is not None else _default_name(schema)
            if key in self._options and self._options[key].schema is not schema:
                raise ValueError(
                    f"{self.noun} '{key}' is registered twice ({self._options[key].module}, {schema.__module__})."
                )
            self._options[key] = Option(
                self.group, key, schema, implementation, schema.__module__, tables, family, rule
            )
            return schema

        return add

    def get(self, name: str) -> Option:
        """The option called `name`; RunnerError naming the nearest ones when there is none."""
        discover()
        if name in self._options:
            return self._options[name]
        names = self.names()
        raise RunnerError(f"Unknown {self.noun} '{name}'.{suggest(name, names)} Available: {', '.join(names)}.")

    def for_config(self, config: Any) -> Option:
        """The option whose schema `config` is. A config of another type (the group's base class naming an
        option) is refused, not guessed: the message names the class to build."""
        discover()
        for option in self._options.values():
            if type(config) is option.schema:
                return option
        expected = self.get(config.name)  # raises for an unknown name
        raise RunnerError(
            f"{self.group}={config.name} needs its own config ({expected.schema.__name__}), not a"
            f" {type(config).__name__}: build it with {expected.schema.__name__}(...) or"
            f" {self.group}_config('{config.name}', ...)."
        )

    def config(self, name: str, **values: Any) -> Any:
        """The config of option `name` with `values` (a key of another option is a TypeError)."""
        return self.get(name).schema(**values)

    def names(self) -> list[str]:
        discover()
        return list(self._options)

    def schemas(self) -> dict[str, type]:
        """{name: config dataclass}: what Hydra's ConfigStore holds as /schema/<group>/<name>."""
        discover()
        return {name: option.schema for name, option in self._options.items()}

    def __iter__(self) -> Iterator[Option]:
        discover()
        return iter(list(self._options.values()))

    def __contains__(self, name: object) -> bool:
        discover()
        return name in self._options

    def __len__(self) -> int:
        discover()
        return len(self._options)

    def __repr__(self) -> str:
        return f"ExtensionPoint({self.group!r}: {', '.join(self._options)})"


def _default_name(schema: type) -> str:
    if is_dataclass(schema):
        for field in fields(schema):
            if field.name == "name" and isinstance(field.default, str):
                return field.default
    raise TypeError(f"{schema.__name__}: give the option a name (`name=`) or a `name: str = '...'` field.")


MODELS = ExtensionPoint("model", "model source", "runner.options.model")
DATA = ExtensionPoint("data", "data source", "runner.options.data")
TARGETS = ExtensionPoint("target", "target", "runner.options.target")
METHODS = ExtensionPoint("method", "method", "runner.options.method")
METRICS = ExtensionPoint("metric", "metric", "runner.options.metric")
POINTS: dict[str, ExtensionPoint] = {point.group: point for point in (MODELS, DATA, TARGETS, METHODS, METRICS)}
ENTRY_POINT_GROUP = "runner.options"  # other packages' option modules: `[project.entry-points."runner.options"]`

_discovered = False


def discover() -> None:
    """Import every option module once: each module of runner/options/<group>/, then each entry point's module.
    Option modules import no torch (scripts/check_imports.py checks ours), so this costs milliseconds."""
    global _discovered
    if _discovered:
        return
    _discovered = True  # set first: an option module that asks a point for its options does not recurse
    for point in POINTS.values():
        package = importlib.import_module(point.package)
        for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
            importlib.import_module(f"{point.package}.{module}")
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        importlib.import_module(entry.value.partition(":")[0])


def option_schemas() -> dict[str, dict[str, type]]:
    """Each config group's options and their schemas (groups whose options have one: all five)."""
    return {group: point.schemas() for group, point in POINTS.items()}
