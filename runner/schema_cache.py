"""The config groups' option schemas (runner/data/base.py's, runner/methods' dataclasses), kept as a JSON snapshot
so that commands that only compose the config (`runner --cfg job`, `--info`) need not import torch.

The schemas live beside their torch code; importing them costs `import torch` (2-3 s). Every full
registration (a run, a test) writes a snapshot of their fields, types and defaults, keyed by the runner's
source files (path, size, mtime); a print-only command rebuilds the same dataclasses from it (same names,
fields, types, defaults: Hydra refuses the same typos and wrong types) when the key still matches, and
otherwise imports the real schemas (and writes the snapshot). `RUNNER_CACHE_DIR` says where (default
`$XDG_CACHE_HOME/runner`, else `~/.cache/runner`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import json
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent
FORMAT = 2  # bump when the snapshot's layout changes
SHARED_MODULE = "runner.schema"  # its classes import without torch: snapshots name them instead of copying


class Unsupported(TypeError):
    """A field type the snapshot cannot describe: the snapshot is not written, the real schemas are used."""


def cache_dir() -> Path:
    """Where snapshots live: RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if os.environ.get("RUNNER_CACHE_DIR"):
        return Path(os.environ["RUNNER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "runner"


def source_key() -> str:
    """A hash of every runner source file's path, size and mtime: any edit makes a new key."""
    digest = hashlib.sha256(f"{FORMAT}".encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(PACKAGE)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def snapshot_prefix() -> str:
    """File-name prefix of this checkout's snapshots (several checkouts may share one cache folder)."""
    return f"schemas-{hashlib.sha256(str(PACKAGE).encode()).hexdigest()[:8]}-"


def snapshot_path() -> Path:
    return cache_dir() / f"{snapshot_prefix()}{source_key()}.json"


# ---- describing real dataclasses --------------------------------------------------------------------------------
def describe_type(tp: Any) -> dict[str, Any]:
    """A JSON description of a field type (the kinds OmegaConf accepts in these schemas)."""
    if tp in (int, float, str, bool):
        return {"t": tp.__name__}
    if tp is Any:
        return {"t": "any"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return {"t": "optional", "of": describe_type(rest[0])}
    if origin is list and len(args) == 1:
        return {"t": "list", "of": describe_type(args[0])}
    if origin is dict and len(args) == 2:
        return {"t": "dict", "key": describe_type(args[0]), "of": describe_type(args[1])}
    if isinstance(tp, type) and tp.__module__ == SHARED_MODULE:  # torch-free already: named, not copied
        return {"t": "ref", "name": tp.__name__}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"t": "enum", "name": tp.__name__, "members": {m.name: m.value for m in tp}}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return {"t": "dataclass", **describe_class(tp)}
    raise Unsupported(f"field type {tp!r}")


def encode(value: Any) -> Any:
    """A default value as JSON (enum members by name, dataclass instances by field)."""
    if isinstance(value, enum.Enum):
        return {"enum": value.name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"fields": {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {str(k): encode(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise Unsupported(f"default {value!r}")


def describe_class(cls: type) -> dict[str, Any]:
    """A dataclass's name and fields (inherited ones included, in order): type and default each."""
    hints = typing.get_type_hints(cls)
    # The nearest base defined in runner.schema (DataConfig, MethodConfig): RunConfig's fields are typed by it,
    # so the rebuilt class must subclass it for Hydra to accept it there.
    base = next((b.__name__ for b in cls.__mro__[1:] if b.__module__ == SHARED_MODULE), None)
    described = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "???"  # OmegaConf's MISSING
        described.append({"name": f.name, "type": describe_type(hints[f.name]), "default": encode(default)})
    return {"name": cls.__name__, "base": base, "fields": described}


# ---- rebuilding them --------------------------------------------------------------------------------------------
class _Builder:
    """Rebuilds classes from descriptions; one class per name, so that nested and shared types are one object."""

    def __init__(self) -> None:
        import runner.schema

        self.shared = runner.schema
        self.made: dict[str, type] = {}

    def type_of(self, d: dict[str, Any]) -> Any:
        kind = d["t"]
        if kind in ("int", "float", "str", "bool"):
            return {"int": int, "float": float, "str": str, "bool": bool}[kind]
        if kind == "any":
            return Any
        if kind == "optional":
            return typing.Optional[self.type_of(d["of"])]  # noqa: UP045 (OmegaConf 2.3 reads typing.Optional)
        if kind == "list":
            return list[self.type_of(d["of"])]  # type: ignore[misc]
        if kind == "dict":
            return dict[self.type_of(d["key"]), self.type_of(d["of"])]  # type: ignore[misc]
        if kind == "ref":
            return getattr(self.shared, d["name"])
        if kind == "enum":
            if d["name"] not in self.made:
                self.made[d["name"]] = enum.Enum(d["name"], d["members"], type=str, module=__name__)  # type: ignore[call-overload]
            return self.made[d["name"]]
        return self.dataclass(d)

    def value(self, tp: Any, encoded: Any) -> Any:
        if isinstance(encoded, dict) and "enum" in encoded:
            return self._enum_in(tp)[encoded["enum"]]
        if isinstance(encoded, dict) and "fields" in encoded:
            cls = self._dataclass_in(tp)
            hints = typing.get_type_hints(cls)
            return cls(**{k: self.value(hints[k], v) for k, v in encoded["fields"].items()})
        if isinstance(encoded, dict) and "dict" in encoded:
            inner = typing.get_args(self._strip_optional(tp))
            return {k: self.value(inner[1] if inner else Any, v) for k, v in encoded["dict"].items()}
        if isinstance(encoded, list):
            inner = typing.get_args(self._strip_optional(tp))
            return [self.value(inner[0] if inner else Any, v) for v in encoded]
        return encoded

    @staticmethod
    def _strip_optional(tp: Any) -> Any:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp

    def _enum_in(self, tp: Any) -> type[enum.Enum]:
        return self._strip_optional(tp)

    def _dataclass_in(self, tp: Any) -> type:
        return self._strip_optional(tp)

    def dataclass(self, d: dict[str, Any]) -> type:
        if d["name"] in self.made:
            return self.made[d["name"]]
        specs = []
        for f in d["fields"]:
            tp = self.type_of(f["type"])
            default = self.value(tp, f["default"])
            if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
                spec = dataclasses.field(default_factory=lambda v=default: copy.deepcopy(v))
            else:
                spec = dataclasses.field(default=default)
            specs.append((f["name"], tp, spec))
        bases = (getattr(self.shared, d["base"]),) if d.get("base") else ()
        cls = dataclasses.make_dataclass(d["name"], specs, bases=bases)
        cls.__module__ = __name__  # make_dataclass's `module=` is Python 3.12+
        self.made[d["name"]] = cls
        return cls


def describe_options(options: dict[str, dict[str, type]]) -> dict[str, dict[str, Any]]:
    """{group: {option: description}} for `runner.schema.option_schemas()`'s answer."""
    return {group: {name: describe_class(cls) for name, cls in schemas.items()} for group, schemas in options.items()}


def rebuild_options(described: dict[str, dict[str, Any]]) -> dict[str, dict[str, type]]:
    """The inverse of `describe_options`: dataclasses with the same names, fields, types and defaults."""
    builder = _Builder()
    return {group: {name: builder.dataclass(d) for name, d in opts.items()} for group, opts in described.items()}


def load() -> dict[str, dict[str, type]] | None:
    """The option schemas from a snapshot that matches today's sources, or None (then import the real ones)."""
    path = snapshot_path()
    try:
        described = json.loads(path.read_text())
        return rebuild_options(described)
    except FileNotFoundError:
        return None
    except Exception:  # a damaged or foreign file: ignore it, the real schemas are one import away
        log.debug("schema snapshot %s unusable", path, exc_info=True)
        return None


def save(options: dict[str, dict[str, type]]) -> None:
    """Write the snapshot of `options` (the real schemas) when today's is missing; never fails the caller."""
    try:
        path = snapshot_path()
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(describe_options(options)))
        tmp.replace(path)
        for old in path.parent.glob(f"{snapshot_prefix()}*.json"):  # this checkout's earlier sources: never read again
            if old != path:
                old.unlink(missing_ok=True)
    except Exception:  # read-only home, odd types: the snapshot is an optimisation only
        log.debug("schema snapshot not written", exc_info=True)
