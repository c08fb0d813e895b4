"""The `runner` console command: subcommands (`ls`, `layers`), a help text, and otherwise the Hydra run.

`runner [overrides]` and `runner -m ...` are `python -m runner ...` (runner/__main__.py, run as `__main__`
so Hydra's job name, log file and config path are the same). Nothing here imports torch: `runner --help`,
`runner ls` and `runner --cfg job` answer without it (a subcommand imports what it needs itself).
"""

from __future__ import annotations

import importlib
import runpy
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from runner.errors import RunnerError

CONF = Path(__file__).resolve().parents[2] / "conf"  # the same folder as __main__'s config_path="../conf"

# name -> (module, function taking the remaining argv and returning an exit code, one line of help).
# Modules are imported only when their command runs (`runner layers` builds a model: torch).
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "ls": (
        "runner.commands.ls",
        "main",
        "runs and sweeps under DIR (default outputs/): status, resume command, tables",
    ),
    "layers": ("runner.commands.layers", "main", "every module of the configured model: name, type, shape, CAM use"),
    "report": ("runner.viz.report", "main", "DIR/report.html: one offline HTML page of a run or a sweep"),
    "plan": ("runner.commands.plan", "main", "a run's edges, forwards and peak memory, before any weight loads"),
}
# How each subcommand's help line shows its arguments.
SUBCOMMAND_ARGS = {"ls": "[DIR]", "layers": "[overrides]", "report": "DIR [--output FILE]",
                   "plan": "[--free GB] [overrides]"}  # fmt: skip
HELP_FLAGS = ("-h", "--help")
# Hydra flags after which Hydra composes and prints (or completes) without running the task.
PRINT_ONLY_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc")
GROUPS_SHOWN_LAST = ("hydra/launcher",)


def main(argv: Sequence[str] | None = None) -> int:
    """The console command; returns the exit code (0 done, 2 bad input, as `python -m runner`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    handled = dispatch(args)
    if handled is not None:
        return handled
    saved = sys.argv
    sys.argv = ["runner", *args]
    try:
        runpy.run_module("runner", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else _print_exit(done.code))
    finally:
        sys.argv = saved
    return 0


def _print_exit(code: object) -> int:
    print(code, file=sys.stderr)  # sys.exit("text"): as the interpreter would
    return 1


def dispatch(args: list[str]) -> int | None:
    """Run a subcommand or print the help, returning the exit code; None when the arguments are a Hydra run."""
    if args and args[0] in SUBCOMMANDS:
        return run_subcommand(args[0], args[1:])
    if any(a in HELP_FLAGS for a in args):
        print(help_text())
        return 0
    return None


def run_subcommand(name: str, args: list[str]) -> int:
    """Import the subcommand's module and run it; a RunnerError is one line on stderr and exit 2."""
    module_name, function_name, _ = SUBCOMMANDS[name]
    try:
        function: Callable[[list[str]], int | None] = getattr(importlib.import_module(module_name), function_name)
        return function(args) or 0
    except RunnerError as e:
        print(f"[ERROR] {e}", file=sys.stderr)
        return 2


def print_only(args: Sequence[str]) -> bool:
    """Whether Hydra will only compose and print (`--cfg job`, `--info`, ...) and never run the task."""
    return any(a.split("=", 1)[0] in PRINT_ONLY_FLAGS for a in args)


def register_schemas(args: Sequence[str]) -> None:
    """Register the config schemas for Hydra: the real ones, found by importing the option modules (no torch)."""
    from runner.options.compose import register_configs

    register_configs()


FOLDER_RESOLVER = "runner.folder"  # conf/hydra/default.yaml: `${runner.folder:${name}}` in the run folder's name


def folder_name(value: object) -> str:
    """`value` as one folder's name in an output path: a name that would leave the output root (`../x`, `a/b`)
    is refused when Hydra resolves the run folder, before it makes any folder or log file."""
    text = str(value)
    if text in ("", ".", "..") or any(c in text for c in "/\\\0"):
        raise RunnerError(
            f"name={text!r} cannot name a run's folder under outputs/: a run name is one folder name, without '/',"
            " '\\' or '..'. Choose another name=, or give the folder itself with hydra.run.dir=PATH."
        )
    return text


def register_resolvers() -> None:
    """The resolvers conf/hydra/default.yaml uses (before Hydra composes: it resolves the run folder first)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(FOLDER_RESOLVER, folder_name, replace=True)


# ---- help -------------------------------------------------------------------------------------------------------
def config_groups(conf: Path = CONF) -> dict[str, list[str]]:
    """Each config group under conf/ (a folder, `hydra/launcher` included) and its options (the YAML files)."""
    groups: dict[str, list[str]] = {}
    for folder in sorted(p for p in conf.rglob("*") if p.is_dir()):
        group = folder.relative_to(conf).as_posix()
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        if options and group != "hydra":  # hydra/default.yaml is the output layout, not a choice
            groups[group] = options
    return groups


def defaults(conf: Path = CONF) -> dict[str, str]:
    """The primary config's default option per group (conf/config.yaml's defaults list), read as text."""
    chosen: dict[str, str] = {}
    for line in (conf / "config.yaml").read_text().splitlines():
        entry = line.split("#")[0].strip()
        if entry.startswith("- ") and ":" in entry:
            group, _, option = entry[2:].partition(":")
            chosen[group.strip()] = option.strip()
    return chosen


def help_text(conf: Path = CONF) -> str:
    """What `runner --help` prints: what the tool does, the commands, the groups and their options, pointers."""
    groups = config_groups(conf)
    chosen = defaults(conf)
    order = [g for g in groups if g not in GROUPS_SHOWN_LAST] + [g for g in GROUPS_SHOWN_LAST if g in groups]
    width = max(len(g) for g in groups) + 2
    lines = [
        "runner: declared interpretability experiments on PyTorch models. A Hydra config names the model, the",
        "data, the target layers and the hooks; the runner attaches the hooks, runs Grad-CAM-style attribution or",
        "activation patching, and writes per-layer tables to Parquet (pd.read_parquet, groupby('layer')).",
        "",
        "Usage:",
    ]
    usages = [
        ("runner [GROUP=OPTION ...] [key=value ...]", "one run (python -m runner is the same)"),
        ("runner -m GROUP=A,B key=1,2 ...", "a sweep: one job per combination"),
    ]
    usages += [(f"runner {name} {SUBCOMMAND_ARGS.get(name, '')}".rstrip(), summary)
               for name, (_, _, summary) in SUBCOMMANDS.items()]  # fmt: skip
    lines += [f"  {usage:<44}{summary}" for usage, summary in usages]
    lines += ["", "Config groups (GROUP=OPTION; * the default):"]
    for group in order:
        options = [f"{o}*" if chosen.get(group) == o else o for o in groups[group]]
        wrapped = textwrap.wrap(", ".join(options), 110 - width - 2) or [""]
        lines.append(f"  {group:<{width}}{wrapped[0]}")
        lines += [f"  {'':<{width}}{more}" for more in wrapped[1:]]
    lines += [
        "",
        "Examples:",
        "  runner experiment=gradcam_vgg16 model.weights=null debug=tiny",
        "  runner -m experiment=gradcam_effnet method=gradcam,layercam",
        "  runner experiment=patching_effnet hydra.run.dir=DIR        (resumes an unfinished run in DIR)",
        "",
        "More:",
        "  runner --cfg job [overrides]     the composed config: every key and its value",
        "  runner -m hydra/launcher=joblib  sweep jobs in parallel (hydra/launcher=slurm_gpu: on a cluster)",
        "  runner --hydra-help              Hydra's own flags (--info, --multirun, --config-dir, ...)",
        "  README.md                        layer selectors, the tables' columns, resuming",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
