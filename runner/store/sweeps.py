"""A multirun sweep's jobs: the override lists Hydra expands, their folder names, a job folder's number. No torch."""

from __future__ import annotations

from pathlib import Path

from runner.store.layout import read_yaml


def sweep_jobs(directory: Path) -> list[list[str]] | None:
    """Every job's overrides in the sweep in `directory`, in job-number order (its saved multirun.yaml expanded as
    the basic sweeper does), or None when they cannot be known (an unreadable file, a sweeper of another kind)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        saved = OmegaConf.load(directory / "multirun.yaml")
        params = [f"{k}={v}" for k, v in (saved.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *saved.hydra.overrides.task])
        return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    except Exception:  # Hydra's parser raises several kinds; the caller then checks the jobs present only
        return None


def job_names(jobs: list[list[str]]) -> list[str]:
    """'#i (overrides)' per job, naming only the overrides that vary across the sweep (the others are all jobs')."""
    varying = [p for p in range(len(jobs[0])) if len({job[p] for job in jobs}) > 1] if jobs else []
    return [f"#{i} ({' '.join(job[p] for p in varying)})" if varying else f"#{i}" for i, job in enumerate(jobs)]


def job_number(directory: Path) -> int | None:
    """A sweep job's number: its folder's name (Hydra's default subdir), else the one its .hydra/hydra.yaml records."""
    if directory.name.isascii() and directory.name.isdigit():
        return int(directory.name)
    saved = read_yaml(directory / ".hydra" / "hydra.yaml")
    try:
        return int(saved["hydra"]["job"]["num"])
    except (TypeError, KeyError, ValueError):
        return None


def _sweep_jobs_total(directory: Path) -> int | None:
    """How many jobs the sweep has, or None."""
    jobs = sweep_jobs(directory)
    return None if jobs is None else len(jobs)
