"""Shared fixtures: Hydra composition of the real config tree, the CLI in-process, tiny offline models, small inputs."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import re
import runpy
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from torch import nn

from runner.configure import to_run_config
from runner.options.compose import register_configs
from runner.schema import RunConfig
from tests import warm_python
from tests.nets import SlowNet, TinyNet  # noqa: F401  (tests import them from here; subprocesses' targets from tests.nets)
from tests.suite_budget import (  # noqa: F401  (pytest's hooks: where the suite's time goes, and its tripwire)
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def _share_cpus_among_xdist_workers() -> None:
    """Under pytest-xdist (`-n N`), worker k runs on every Nth CPU from the k-th: N workers each computing with all
    the CPUs (a run's `threads: null` is the affinity mask) would oversubscribe them N times over, and torch's
    threads then wait on each other far longer than they compute. Subprocesses inherit the share."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, index, workers = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), int(count)
    share = cpus[index::workers] if workers <= len(cpus) else [cpus[index % len(cpus)]]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


_share_cpus_among_xdist_workers()


def committed_shards(run: Path) -> int:
    """The shards some manifest of `run` lists as complete: what a resume skips. Part files alone can run
    ahead of the manifest by a moment (they are renamed into place just before it is replaced)."""
    done: set[str] = set()
    for path in run.glob("manifest*.json"):
        try:
            done |= set(json.loads(path.read_text())["shards"])
        except (OSError, ValueError):
            continue  # replaced between the glob and the read
    return len(done)


def make_config(*overrides: str) -> RunConfig:
    """Compose conf/ exactly as the CLI does (same defaults, same schema), with overrides."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # Pictures off unless a test asks for them: they cost a second per sample and are tested on their own.
        cfg = compose(config_name="config", overrides=["progress=false", "method.pictures=false", *overrides])
    return to_run_config(cfg)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m runner ARGS progress=false` in this process: runner/__main__.py runs as `__main__` with
    sys.argv set, so exit codes and stderr are the CLI's own, without paying a second interpreter and a
    torch import (5-8 s a call). Tests of what only a real process shows (signals, launchers) use subprocess."""
    argv = [*args, "progress=false"]
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    # Hydra's job_logging reconfigures logging for the run (console to the current stderr, a file in the run
    # folder): put every logger back afterwards so later tests (caplog) see the logging they expect.
    saved = [(lg, lg.level, lg.handlers[:], lg.propagate, lg.disabled) for lg in loggers]
    hydra_config = HydraConfig.instance().cfg  # the run sets it; app.run in later tests must not see this run's
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with (
        mock.patch.object(sys, "argv", ["runner/__main__.py", *argv]),
        mock.patch.dict(os.environ),  # as a process's environment ends with it
        redirect_stdout(out),
        redirect_stderr(err),
    ):
        try:
            runpy.run_module("runner", run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = done.code
        except Exception:  # uncaught, as in a real process: the traceback on stderr, exit 1
            traceback.print_exc()
            code = 1
        finally:
            GlobalHydra.instance().clear()
            HydraConfig.instance().cfg = hydra_config
            for lg, level, handlers, propagate, disabled in saved:
                for handler in lg.handlers:
                    if handler not in handlers:
                        handler.close()  # the run's log file handler
                lg.setLevel(level)
                lg.handlers[:] = handlers
                lg.propagate, lg.disabled = propagate, disabled
            for lg in logging.Logger.manager.loggerDict.values():
                if isinstance(lg, logging.Logger) and lg not in loggers:  # made by the run's config: as if new
                    lg.setLevel(logging.NOTSET)
                    lg.handlers.clear()
                    lg.propagate, lg.disabled = True, False
    if isinstance(code, str):  # sys.exit("text"): the interpreter prints the text and exits 1
        err.write(f"{code}\n")
    returncode = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess(["python", "-m", "runner", *argv], returncode, out.getvalue(), err.getvalue())


# One stand-in per packaged model and process: the same seed makes the same folder.
_STAND_INS: dict[tuple[str, bool], Path] = {}


def stand_in_for(model: str, folder: Path, same_family: bool = False) -> Path:
    """A random two-layer stand-in for a packaged LM (`smollm2-135m`, `gemma3-270m`) with its tokenizer, built in
    `folder` the first time (tests/lm_references.py build_tokenizer_lm) and the same folder after: Gemma 3's
    tokenizer (262,144 tokens) takes seconds to load and to save, and the runner loads a folder's tokenizer once a
    process. `same_family`: the model's own architecture, two layers (Gemma 3's norms after each branch)."""
    from runner.models.packaged_lm import converted_folder
    from tests.lm_references import build_tokenizer_lm

    key = (model, same_family)
    if key not in _STAND_INS:
        _STAND_INS[key] = build_tokenizer_lm(converted_folder(model), folder, same_family=same_family)
    return _STAND_INS[key]


class SharedActivation(nn.Module):
    """One activation module called twice per forward (as EfficientNet's `_swish`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(self.act(x))))


def frozen(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """A test's changes to os.environ end with it, as a process's would, those of the packages it uses included
    (torch.compile sets LD_LIBRARY_PATH and KMP_DUPLICATE_LIB_OK for its compiler): later tests, and the processes
    they start, cold or served, see the session's environment."""
    before = dict(os.environ)
    warm_python.BASE_ENVIRONMENT = before  # what a warm server started during this test loads with
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def tiny() -> nn.Module:
    torch.manual_seed(0)
    return frozen(TinyNet())


@pytest.fixture(scope="session")
def vgg16() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return frozen(torchvision.models.vgg16(weights=None))


def tiny_vit() -> nn.Module:
    """A 2-layer ViT on 32x32 inputs (4x4 patches of 8 px, plus a class token); torchvision zero-inits
    the head, which would make every gradient zero, so the head gets random weights."""
    import torchvision

    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10
    )
    nn.init.normal_(vit.heads.head.weight)
    return vit


@pytest.fixture
def simulate_oom(monkeypatch: pytest.MonkeyPatch):
    """A call that makes GradCAM.run_batch raise CUDA out of memory for every batch of more than `largest` samples
    (default one)."""

    def apply(largest: int = 1) -> None:
        from runner.methods import cam_methods

        GradCAM = cam_methods()["gradcam"]

        original = GradCAM.run_batch

        def small_batches_only(self, model, batch, session):  # noqa: ANN001, ANN202
            if batch.x.shape[0] > largest:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return original(self, model, batch, session)

        monkeypatch.setattr(GradCAM, "run_batch", small_batches_only)

    return apply


# ---- markers that say what a test costs, checked --------------------------------------------------------------------
# `process`: the test starts a process (a subprocess, a launcher's workers, torchrun ranks): seconds each for the
# interpreter and torch. `real_model`: it loads a packaged pretrained LM's weights (SmolLM2-135M, Gemma 3 270M). Both
# are slow too, so `make test-fast` (-m "not slow") leaves them out; `-m "not process and not real_model"` leaves out
# only them. A test that does either unmarked fails, in every tier, saying which marker it lacks: the markers cannot
# go stale. Git is not a process here: every run records its commit (runner/provenance.py asks git, milliseconds).
ALLOWED_PROCESSES = {"git"}
REAL_MODEL_PARAMETERS = 50_000_000  # SmolLM2-135M, Gemma 3 270M; the shipped induction model and stand-ins: < 1M


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("process") or item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)


_ALL_SLOW = re.compile(r"^pytestmark = \[?pytest\.mark\.slow\b", re.MULTILINE)  # every test of the module is slow


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier (`-m "not slow"`) does not import a module whose pytestmark makes every test slow: it would
    deselect them all, after each worker paid for the module's imports (hypothesis alone: 1.2 s)."""
    if config.getoption("markexpr") != "not slow" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py" or not _ALL_SLOW.search(collection_path.read_text()):
        return None
    return True


_RUNNING: list[pytest.Item] = []  # the test being set up, run or torn down (its fixtures' work is its own)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _RUNNING.append(item)
    try:
        yield
    finally:
        _RUNNING.pop()


def _unmarked(marker: str, what: str) -> None:
    """Fail the running test unless it has `marker` (outside a test, as in collection, nothing is checked)."""
    if not _RUNNING or _RUNNING[-1].get_closest_marker(marker):
        return
    if os.environ.get("RUNNER_RECORD_MARKERS"):  # a survey of the suite: each unmarked test, in a file
        with open(os.environ["RUNNER_RECORD_MARKERS"], "a") as record:
            record.write(f"{marker} {_RUNNING[-1].nodeid}\n")
        return
    pytest.fail(f"{what}: mark the test @pytest.mark.{marker}", pytrace=False)


# Test modules import this file as tests.conftest, a second module beside pytest's conftest: the checks are installed
# once, by the first (whose hooks pytest calls, so whose _RUNNING is the test's).
def _check_processes() -> None:
    import multiprocessing.process

    if getattr(subprocess.Popen, "checks_markers", False):
        return

    # `python -m runner ...` and what it starts forked from a warm interpreter where they can be
    # (tests/warm_python.py): ~4 s less each
    class Checked(warm_python.ServedPopen):
        checks_markers = True

        def __init__(self, args, *rest, **kwargs) -> None:  # noqa: ANN001
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            program = Path(os.fsdecode(argv[0]).split()[0]).name if argv else ""
            if program not in ALLOWED_PROCESSES:
                _unmarked("process", f"this test started a process ({' '.join(map(os.fsdecode, argv))[:200]})")
            super().__init__(args, *rest, **kwargs)

    start = multiprocessing.process.BaseProcess.start

    def checked_start(self: multiprocessing.process.BaseProcess) -> None:
        _unmarked("process", f"this test started a worker process ({type(self).__name__})")
        start(self)

    subprocess.Popen = Checked  # type: ignore[misc]
    warm_python.serve_loky_workers()  # a sweep run in this process (run_cli) has its joblib workers served too
    multiprocessing.process.BaseProcess.start = checked_start  # type: ignore[method-assign]


def _check_real_models() -> None:
    """A language model of more than REAL_MODEL_PARAMETERS built with its saved weights through the runner."""
    from runner.models.hf_lm import HfLmSource

    build = HfLmSource.build
    if getattr(build, "checks_markers", False):
        return

    def checked_build(self: HfLmSource, cfg: Any) -> Any:
        bundle = build(self, cfg)
        if cfg.weights is not None and sum(p.numel() for p in bundle.model.parameters()) > REAL_MODEL_PARAMETERS:
            _unmarked("real_model", f"this test loaded {cfg.name}'s weights")
        return bundle

    checked_build.checks_markers = True  # type: ignore[attr-defined]
    HfLmSource.build = checked_build  # type: ignore[method-assign]


# torchvision draws a random VGG16 in 2.6 s on one core (138M weights, drawn twice: by each layer as it is made, then
# by VGG's own init), and the suite's runs in this process build one about 50 times. A build is a function of the
# model's name and arguments, torch's default dtype and the CPU generator's state: a build with the same inputs as an
# earlier one gets a copy of that one's module, and the generator is left where that build left it, so the weights
# and every later draw are those a new build gives (tests/test_suite_rules.py).
MEMO_PARAMETERS = 10_000_000  # smaller models build faster than they copy
MEMO_ENTRIES = 3


class _MemoisedZoo:
    """torchvision.models as the runner's torchvision source sees it, with get_model memoised as above."""

    builds: dict[tuple, tuple[nn.Module, torch.Tensor]] = {}
    hits = 0

    def __init__(self, zoo: Any) -> None:
        self.zoo = zoo

    def __getattr__(self, name: str) -> Any:
        return getattr(self.zoo, name)

    def get_model(self, name: str, **kwargs: Any) -> nn.Module:
        if kwargs.get("weights") is not None:
            return self.zoo.get_model(name, **kwargs)
        rng = torch.get_rng_state()
        key = (name, repr(sorted(kwargs.items())), torch.get_default_dtype(), hashlib.sha1(rng.numpy()).hexdigest())
        if key in self.builds:
            module, after = self.builds[key]
            type(self).hits += 1
            torch.set_rng_state(after)
            return copy.deepcopy(module)
        model = self.zoo.get_model(name, **kwargs)
        if sum(p.numel() for p in model.parameters()) >= MEMO_PARAMETERS:
            while len(self.builds) >= MEMO_ENTRIES:
                del self.builds[next(iter(self.builds))]  # the oldest
            self.builds[key] = (copy.deepcopy(model), torch.get_rng_state())
        return model


def _memoise_random_torchvision_models() -> None:
    from runner.models import torchvision_zoo

    zoo = torchvision_zoo._zoo
    if getattr(zoo, "memoised", False):
        return

    def memoised_zoo() -> Any:
        return _MemoisedZoo(zoo())

    memoised_zoo.memoised = True  # type: ignore[attr-defined]
    torchvision_zoo._zoo = memoised_zoo


_check_processes()
_check_real_models()
_memoise_random_torchvision_models()
