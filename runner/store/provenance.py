"""What produced a table: the composed config, the overrides, package versions and the git commit."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.schema import RunConfig

PACKAGES = ("runner", "torch", "torchvision", "hydra-core", "omegaconf", "pandas", "pyarrow", "numpy", "captum")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_commit() -> str:
    """The commit of the runner's checkout, with '+dirty' for uncommitted changes; 'unknown' outside git."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hydra_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


# Keys that say how fast or where a run goes, or how its figures look, not what it computes: changing them does
# not block a resume.
def speed_keys(config: Any, prefix: str = "") -> list[str]:
    """The config's speed-only keys as flat `a.b.c` keys: each schema's `SPEED_KEYS` (a ClassVar: the settings that
    change how fast or where a run goes, never what it computes), under the schema's place in the tree."""
    keys = [f"{prefix}{key}" for key in getattr(type(config), "SPEED_KEYS", ())]
    if dataclasses.is_dataclass(config):
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if dataclasses.is_dataclass(value):
                keys += speed_keys(value, f"{prefix}{field.name}.")
    return keys


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat.update(_flatten(sub, f"{prefix}{key}."))
        return flat
    return {prefix.removesuffix("."): value}


def config_values(config: RunConfig) -> dict[str, Any]:
    """The config as flat `a.b.c` keys, without the speed-only keys (`speed_keys`)."""
    plain = OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
    flat = _flatten(plain)
    skip = speed_keys(config)
    return {k: v for k, v in flat.items() if not any(k == s or k.startswith(s + ".") for s in skip)}


def config_hash(config: RunConfig) -> str:
    """Identity of what a run computes: the config without the keys that only say how fast or where it runs."""
    return hashlib.sha256(json.dumps(config_values(config), sort_keys=True, default=str).encode()).hexdigest()[:16]


def input_fingerprints(config: RunConfig) -> dict[str, str]:
    """What the config names by path and a resume must find unchanged: each group's `fingerprint()` (a model's
    checkpoint contents, an image folder's files), keyed by what it describes."""
    return {**config.model.fingerprint(), **config.data.fingerprint()}


def resume_key(config: RunConfig, shard_samples: int, num_samples: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(key, details): what a directory's manifest must match for this run to resume it, and the flat
    values behind it, so that a refusal can name each key that differs."""
    inputs = input_fingerprints(config)
    key = {
        "config_hash": config_hash(config),
        "inputs": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16],
        "shard_samples": shard_samples,
        "num_samples": num_samples,
    }
    return key, {**config_values(config), **inputs}


def _typed_override(key: str, value: Any, config: DictConfig | None) -> Any:
    """An override's value as the run used it: the config's own typed value where the key is a plain config
    value (`seed=010` ran with seed 10), else the value as Hydra's override grammar types it."""
    if config is not None:
        used = OmegaConf.select(config, key, default=None, throw_on_missing=False)
        if isinstance(used, (bool, int, float, str)):
            return used.value if hasattr(used, "value") else used  # an Enum member (str subclass): its name
    return value


def swept_columns(config: RunConfig | None = None) -> dict[str, Any]:
    """The job's command-line overrides as typed columns (`sweep.method.target`, ...): a sweep's jobs
    then share one table that says which values produced each row.

    Overrides are parsed with Hydra's own grammar (not YAML 1.1: `name=yes` stays the string 'yes',
    `name=007` stays '007'); a plain config key takes the value the run used (`seed=010` gives 10).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    structured = None  # the config as OmegaConf's, made once (0.06 s a time) and only if an override needs it
    columns: dict[str, Any] = {}
    for text in hydra_overrides():
        try:
            override = parser.parse_override(text)
        except Exception:  # Hydra composed with it, so this does not happen; keep the text rather than fail
            key, _, raw = text.lstrip("+~").partition("=")
            if key and raw and not key.startswith(("hydra.", "hydra/")):
                columns[f"sweep.{key}"] = raw
            continue
        key = override.key_or_group
        if key.startswith(("hydra.", "hydra/")) or override.is_delete() or override.is_sweep_override():
            continue
        value = override.value()
        if structured is None and config is not None:
            structured = OmegaConf.structured(config)
        typed = _typed_override(key, value, structured)
        if isinstance(typed, (bool, int, float, str)):
            columns[f"sweep.{key}"] = typed
        else:  # lists, dicts, null: the override's text, one type per column
            columns[f"sweep.{key}"] = override.get_value_element_as_str()
    return columns


def provenance(config: RunConfig, run_id: str, skipped: list[str] | None = None) -> dict[str, Any]:
    """What goes into every table's metadata. Deliberately no environment variables: they hold secrets."""
    return {
        "skipped_inputs": list(skipped or []),
        "run_id": run_id,
        "config": OmegaConf.to_yaml(OmegaConf.structured(config)),
        "overrides": hydra_overrides(),
        "versions": package_versions(),
        "git_commit": git_commit(),
    }
