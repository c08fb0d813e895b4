"""What produced a table: the composed config, the overrides, package versions and the git commit."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

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


def config_hash(config: RunConfig) -> str:
    """Identity of what a run computes: the config without the keys that only say how or where it runs."""
    plain = OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
    for key in ("progress", "output", "device"):
        plain.pop(key, None)  # type: ignore[union-attr]
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def swept_columns() -> dict[str, Any]:
    """The job's command-line overrides as typed columns (`sweep.method.target`, ...): a sweep's jobs
    then share one table that says which values produced each row."""
    columns: dict[str, Any] = {}
    for override in hydra_overrides():
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("hydra.") or key.startswith("hydra/") or not value:
            continue
        parsed = yaml.safe_load(value)
        columns[f"sweep.{key}"] = parsed if isinstance(parsed, (bool, int, float, str)) else value
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
