"""The schemas as Hydra sees them: the run's and every option's in Hydra's ConfigStore, a DictConfig merged into
the typed tree with each group's chosen option's own schema, and the one-line message for a key a schema refuses.
Imports no torch: `--cfg job` and `--help` compose against these real schemas."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import RunnerError
from runner.options.registry import POINTS, lm_method_names, option_schemas
from runner.options.target.default import DEFAULT, IMAGE_DEFAULT, LANGUAGE_MODEL_DEFAULT
from runner.schema import RunConfig


def register_configs(schemas: dict[str, dict[str, type]] | None = None) -> None:
    """Make the schemas available to Hydra: the run's as `run_schema` (the primary config's defaults list),
    each option's as `/schema/<group>/<option>` (the first entry of conf/<group>/<option>.yaml's defaults).
    `schemas`: {group: {option: dataclass}} to register instead of the discovered ones (tests)."""
    store = ConfigStore.instance()
    schemas = option_schemas() if schemas is None else schemas
    wanted = {(group, option, schema) for group, options in schemas.items() for option, schema in options.items()}
    if wanted == _registered:  # the CLI and the tests' conftest both register: the second time is a no-op
        return
    _share_the_store(store)
    store.store(name="run_schema", node=RunConfig)
    for group, option, schema in sorted(wanted, key=lambda entry: entry[:2]):
        store.store(group=f"schema/{group}", name=option, node=_with_open_dicts(schema))
    _registered.clear()
    _registered.update(wanted)


_registered: set[tuple[str, str, type]] = set()  # what register_configs stored last


def _share_the_store(store: ConfigStore) -> None:
    """Hydra deep-copies its config repository once per composition (and once per config group for
    `--hydra-help`: 125 times), and the ConfigStore singleton with it: 0.07 s a copy with these schemas, 9 s of
    `runner --hydra-help`. The copy guards the repository's search path, not the store, whose `load` copies
    each node it hands out; the singleton is shared as it is."""
    # copy.deepcopy looks on the instance; a partial of a module function pickles (launchers send the store)
    store.__deepcopy__ = functools.partial(_itself, store)  # type: ignore[attr-defined]


def _itself(store: ConfigStore, memo: dict) -> ConfigStore:
    return store


def _with_open_dicts(schema: type) -> DictConfig:
    """The schema as a config whose dict-typed fields (data.slots, model.config, model.kwargs, ...) take new keys
    from a plain override (`data.slots={IO: [...]}`): their keys are free by design, and Hydra's struct mode, which
    rightly refuses an unknown key of a dataclass, would refuse every key of such a dict without a `+`."""
    node = OmegaConf.structured(schema)
    _open_dicts(schema, node)
    return node


def _open_dicts(schema: type, node: Any) -> None:
    hints = typing.get_type_hints(schema)
    for field in fields(schema):
        kind = typing.get_origin(hints[field.name]) or hints[field.name]
        value = node.get(field.name)
        if not isinstance(value, DictConfig):
            continue
        if kind is dict:
            OmegaConf.set_struct(value, False)
        elif dataclasses.is_dataclass(kind):
            _open_dicts(kind, value)


def config_error_line(error: BaseException) -> str:
    """One line for a key or value the schema refuses, naming the key, and the option that owns it if another does."""
    message = str(getattr(error, "msg", error)).splitlines()[0]
    full_key = getattr(error, "full_key", None) or ""
    line = f"Config error{f' (key: {full_key})' if full_key else ''}: {message}."
    group, _, rest = full_key.partition(".")
    key = rest.split(".")[0]
    options = option_schemas().get(group, {})
    if key and "not in" in message:
        owners = [name for name, schema in options.items() if key in {f.name for f in fields(schema)}]
        chosen = [name for name, schema in options.items() if schema is getattr(error, "object_type", None)]
        if owners:
            here = f"{group}={chosen[0]}" if chosen else f"the {group} chosen"
            line += f" `{group}.{key}` belongs to {group}={' / '.join(owners)}, not to {here}."
    return line + " `python -m runner --cfg job` prints every valid key."


def typed_config(cfg: DictConfig) -> RunConfig:
    """The typed config of a composed DictConfig, each group's node merged into its chosen option's own schema.

    Through a plain container: a key added with `+key=...` bypasses Hydra's check, and OmegaConf's to_object
    would silently drop it; merging plain values into the schema refuses it instead. The schema's method, data and
    target are the named options' own, so a key of another option is refused too."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    try:
        schema = OmegaConf.structured(RunConfig)
        assert isinstance(plain, dict)
        _resolve_default_target(plain)
        for group in ("method", "data", "target"):
            name = (plain.get(group) or {}).get("name")
            schema[group] = OmegaConf.structured(POINTS[group].get(str(name)).schema)  # raises for an unknown name
        source = (plain.get("model") or {}).get("source")  # null: inferred from the name, with the shared schema
        if source is not None:
            schema["model"] = OmegaConf.structured(POINTS["model"].get(str(source)).schema)
        merged = OmegaConf.merge(schema, plain)
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise RunnerError(config_error_line(e)) from None
    _check_lm_target(config)
    return config


def _resolve_default_target(plain: dict[str, Any]) -> None:
    """target=default (none chosen) as the target the method measures: the answer's logit minus the distractor's for
    a language-model method, the class's logit otherwise."""
    target = plain.get("target")
    if not isinstance(target, dict) or target.get("name") != DEFAULT:
        return
    method = (plain.get("method") or {}).get("name")
    target["name"] = LANGUAGE_MODEL_DEFAULT if method in lm_method_names() else IMAGE_DEFAULT


def _check_lm_target(config: RunConfig) -> None:
    """A language-model method with a target that scores no tokens, refused here, before torch is imported."""
    if config.method.name in lm_method_names() and getattr(type(config.target), "MODALITY", "image") != "text":
        targets = POINTS["target"]
        text = [n for n in targets.names() if getattr(targets.get(n).schema, "MODALITY", "") == "text"]
        text = sorted(text, key=lambda n: (n != LANGUAGE_MODEL_DEFAULT, n))
        raise RunnerError(
            f"method={config.method.name} measures a language model's answer: use target={', '.join(text)}"
            f" (target={config.target.name} scores an image model's class)."
        )
