"""CLI: `python -m runner [experiment=NAME] [key=value ...]`; `-m` for sweeps; `--cfg job` prints the config;
`ls`, `layers` and `--help` as the `runner` command (runner/commands/cli.py).

Exit codes: 0 done; 2 bad input (config, files, data) or an interrupted run, with one message on
stderr and the traceback in the run's log; anything else is a bug in the runner.
Torch is imported by the task only (runner.app): composing and printing the config does without it.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import suppress
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner import interrupts
from runner.commands.cli import register_resolvers, register_schemas
from runner.cpu_sharing import rank_waits_asleep_where_shared
from runner.errors import RunnerError
from runner.interrupts import (
    Interrupted,
    end_workers,
    guard_sweep,
    interrupted_line,
    parallel_sweep_job,
    resume_command,
    sweep_dir,
)
from runner.options.compose import typed_config

log = logging.getLogger("runner")

_started = False  # whether Hydra got as far as calling the task: if not, it failed on the config


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _started
    _started = True
    try:
        typed = typed_config(cfg)  # a config the schemas or the method refuse stops here, before torch is imported
        rank_waits_asleep_where_shared(typed.threads)  # torchrun's ranks of one machine share its CPUs
        from runner.app import run  # here, not at the top: `--cfg job` composes without importing torch

        if parallel_sweep_job() and interrupts.received.name is not None:  # this worker got the sweep's stop signal
            out = HydraConfig.get().runtime.output_dir
            raise Interrupted("Not started.", "The sweep was stopping.", out, interrupts.received.name, sweep_dir())
        run(cfg)
    except Interrupted as e:
        log.debug("interrupted", exc_info=True)
        if parallel_sweep_job():  # the sweep's own process prints one line for all its workers' jobs
            raise  # to the launcher: the job ends as interrupted, and the other workers' jobs go on
        log.error("%s", _sweep_interrupted_line(e) if sweep_dir() else e)
        sys.exit(2)
    except RunnerError as e:
        log.debug("failure detail", exc_info=True)  # the full traceback goes to the run's log file only
        log.error("%s%s", e, _sweep_stop_note())
        sys.exit(2)


def _sweep_interrupted_line(e: Interrupted) -> str:
    """A sequential sweep's job stopped by a signal: what it keeps, the jobs not run, the one resume command."""
    this, rest = f"#{HydraConfig.get().job.num}", []
    with suppress(Exception):  # naming the jobs is a courtesy: the line and its command come regardless
        this, rest = _named_jobs()
    not_run = f" {len(rest)} job(s) not run: {', '.join(rest)}." if rest else ""
    return (
        f"Interrupted ({e.signal_name}) in job {this} of the sweep: {e.detail}{not_run} Resume the sweep with:"
        f" {resume_command(e.sweep or str(HydraConfig.get().sweep.dir), sys.argv[1:])} (finished jobs and complete"
        " shards are skipped)."
    )


def _named_jobs() -> tuple[str, list[str]]:
    """This job and the jobs after it in a sequential sweep, each named by the overrides that set it apart."""
    from runner.store.sweeps import job_names, sweep_jobs

    hc = HydraConfig.get()
    this = int(hc.job.num)
    jobs = sweep_jobs(Path(hc.sweep.dir))
    if jobs is None:
        raise ValueError(f"cannot expand the sweep saved in {hc.sweep.dir}/multirun.yaml")
    named = job_names(jobs)  # each by the overrides that vary across the sweep
    return (named[this] if this < len(named) else f"#{this} ({' '.join(hc.overrides.task)})"), named[this + 1 :]


def _sweep_stop_note() -> str:
    """In a sequential sweep, which jobs the failure leaves unrun (exit 2 ends the sweep at this job)."""
    try:
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return ""
        hc = HydraConfig.get()
        this = int(hc.job.num)
        here = f" [sweep: job #{this} ({' '.join(hc.overrides.task)}) failed"
        resume = f"; fix it and run the same command with hydra.sweep.dir={hc.sweep.dir} (finished jobs are skipped)]"
        if "BasicLauncher" not in str(hc.launcher.get("_target_", "")):
            return here + "; other jobs run by the launcher are not affected" + resume
        name, rest = _named_jobs()
        here = f" [sweep: job {name} failed"
        if not rest:
            return here + "; it was the last job" + resume
        return here + f"; the sweep stops here: {len(rest)} job(s) not run: {', '.join(rest)}" + resume
    except Exception:  # the note is a courtesy: never let it hide the error itself
        log.debug("could not list the sweep's remaining jobs", exc_info=True)
        return ""


def config_error(error: Exception) -> str:
    """Hydra's report of a config it cannot compose (several lines, some of them internals), as one line."""
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    from runner.options.compose import config_error_line

    cause = error.__cause__
    if isinstance(error, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        return config_error_line(cause)  # names the key, and the option it belongs to
    text = str(error).split("Config search path")[0]  # Hydra's search path: internals
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    hint = _option_suggestion(text)
    return "Config error: " + " ".join(lines) + (f".{hint}" if hint else "")


def _option_suggestion(text: str) -> str:
    """' Did you mean: x?' for Hydra's "Could not find 'group/name'" among the options it lists ('' otherwise)."""
    import re

    from runner.errors import suggest

    missing = re.search(r"Could not find '[^'/]+/([^']+)'", text)
    listed = re.search(r"Available options in '[^']+':\s*(.*)", text, re.DOTALL)
    return suggest(missing.group(1), listed.group(1).split()) if missing and listed else ""


def resolver_error(error: BaseException) -> str | None:
    """The message of a RunnerError that one of our resolvers raised while Hydra resolved the config (OmegaConf
    keeps only its text, as 'RunnerError raised while resolving interpolation: MESSAGE'), else None."""
    marker = f"{RunnerError.__name__} raised while resolving interpolation: "
    seen: BaseException | None = error
    while seen is not None:
        text = str(seen)
        if marker in text:
            return text.split(marker, 1)[1].splitlines()[0]
        seen = seen.__cause__ or seen.__context__
    return None


def _check_output_arguments(argv: list[str]) -> None:
    """The check of `hydra.run.dir=` / `hydra.sweep.dir=` (runner/store/layout.py: no torch is imported for it)."""
    from runner.store.layout import check_output_arguments

    check_output_arguments(argv)


if __name__ == "__main__":
    from runner.commands.cli import dispatch

    handled = dispatch(sys.argv[1:])  # `ls`, `layers`, `--help`: not a Hydra run
    if handled is not None:
        sys.exit(handled)
    register_schemas(sys.argv[1:])  # before Hydra composes: the options' schemas (without torch when it only prints)
    register_resolvers()  # `${runner.folder:${name}}` in the run folder
    try:
        _check_output_arguments(sys.argv[1:])  # Hydra would fail on such a directory with a traceback
    except RunnerError as e:
        print(f"[ERROR] {e}", file=sys.stderr)
        sys.exit(2)
    # Hydra prints a config it cannot compose (unknown key, wrong type, missing group option) as several
    # lines and exits 1; with HYDRA_FULL_ERROR it raises instead, so that it becomes one line and exit 2.
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    multirun = any(a in ("-m", "--multirun") for a in sys.argv[1:])
    try:
        with guard_sweep(multirun):  # a stop signal stops the whole sweep, its workers included
            main()
    except BaseException as error:
        if (
            multirun
            and not isinstance(error, SystemExit)
            and (interrupts.received.name or isinstance(error, Interrupted))
        ):
            end_workers()  # none outlives the sweep
            log.debug("sweep interrupted", exc_info=True)
            print(f"[ERROR] {interrupted_line(error, sys.argv[1:])}", file=sys.stderr)
            sys.exit(2)
        if multirun and interrupts.received.name:
            end_workers()
        if not isinstance(error, Exception) or _started or full_error == "1":
            raise  # failed in the run itself (a bug), exited, or the user asked for the traceback
        print(f"[ERROR] {resolver_error(error) or config_error(error)}", file=sys.stderr)
        sys.exit(2)
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error
