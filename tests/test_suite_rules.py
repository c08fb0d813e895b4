"""The suite's own rules (tests/conftest.py): a test that starts a process or loads a real model without its marker
fails, naming the marker, before the process starts (git is allowed); each pytest-xdist worker computes on its own
share of the CPUs, one torch thread per CPU of it; the fast tier does not import a module whose every test is slow; a
random torchvision model built again from the same generator state is a copy of the first build, to the bit; the
suite's tripwire fails only a passing whole suite over it (tests/suite_budget.py)."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import make_config


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_marker() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"started a process \(true\): mark the test @pytest.mark.process"):
        subprocess.run(["true"], check=True)
    with pytest.raises(pytest.fail.Exception, match="started a worker process.*@pytest.mark.process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert subprocess.run(["git", "--version"], capture_output=True, text=True).stdout.startswith("git version")


@pytest.mark.process
def test_a_marked_test_starts_its_process() -> None:
    assert subprocess.run(["true"]).returncode == 0


def test_an_unmarked_test_that_loads_a_real_model_fails_naming_the_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped induction model counts as real here, with the threshold below its size."""
    from runner.models import build_model
    from runner.models.hf_lm import HfLmSource

    # the check pytest's conftest installed (this module imports the file again, as tests.conftest)
    monkeypatch.setitem(HfLmSource.build.__globals__, "REAL_MODEL_PARAMETERS", 1000)
    with pytest.raises(
        pytest.fail.Exception, match="loaded induction's weights: mark the test @pytest.mark.real_model"
    ):
        build_model(make_config("model=hf_lm").model)
    assert build_model(make_config("model=hf_lm", "model.weights=null").model)  # random weights: not a real model


def test_process_and_real_model_tests_are_slow_too() -> None:
    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, *names: str) -> None:
            self.names = list(names)

        def get_closest_marker(self, name: str) -> str | None:
            return name if name in self.names else None

        def add_marker(self, mark: pytest.MarkDecorator) -> None:
            self.names.append(mark.name)

    items = [Item("process"), Item("real_model"), Item(), Item("slow")]
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [bool(i.get_closest_marker("slow")) for i in items] == [True, True, False, True]


def test_each_xdist_worker_computes_on_its_share_of_the_cpus_one_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import _share_cpus_among_xdist_workers

    given: dict = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: given.update(cpus=list(cpus)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: given.update(threads=n))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    _share_cpus_among_xdist_workers()
    assert given == {"cpus": [1, 3], "threads": 2}
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")  # more workers than CPUs: one CPU each, shared
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw6")
    _share_cpus_among_xdist_workers()
    assert given == {"cpus": [1], "threads": 1}


def test_the_fast_tier_does_not_import_a_module_whose_every_test_is_slow(tmp_path: Path) -> None:
    from tests.conftest import pytest_ignore_collect

    class Config:
        def __init__(self, markexpr: str) -> None:
            self.markexpr = markexpr

        def getoption(self, name: str) -> str:
            return self.markexpr

    slow = tmp_path / "test_slow.py"
    slow.write_text("import pytest\n\npytestmark = [pytest.mark.slow, pytest.mark.process]\n")
    mixed = tmp_path / "test_mixed.py"
    mixed.write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_a() -> None:\n    pass\n")
    fast, everything = Config("not slow"), Config("")
    assert pytest_ignore_collect(slow, fast) is True  # type: ignore[arg-type]
    assert pytest_ignore_collect(mixed, fast) is None  # type: ignore[arg-type]  # its other tests may be fast
    assert pytest_ignore_collect(slow, everything) is None  # type: ignore[arg-type]


def test_a_random_torchvision_model_built_again_is_what_torchvision_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's builds of resnet18 with random weights: from one generator state, the second is the memo's copy
    (not the first's module), and both equal, to the bit, the model torchvision builds from that state; after each,
    the generator is where torchvision's build leaves it. A copy changed in place leaves the memo as it was; another
    state builds anew."""
    import torchvision.models

    from runner.models import torchvision_zoo

    zoo = torchvision_zoo._zoo()
    assert type(zoo).__name__ == "_MemoisedZoo"  # the memo conftest installed
    monkeypatch.setitem(type(zoo).get_model.__globals__, "MEMO_PARAMETERS", 0)
    source, cfg = torchvision_zoo.TorchvisionSource(), make_config("model.name=resnet18", "model.weights=null").model

    def built(seed: int, build: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor, nn.Module]:
        torch.manual_seed(seed)
        model = build()
        return model.state_dict(), torch.get_rng_state(), model

    reference, after, _ = built(1234, lambda: torchvision.models.resnet18(weights=None))
    hits = type(zoo).hits
    first, first_after, first_model = built(1234, lambda: source.build(cfg).model)
    second, second_after, second_model = built(1234, lambda: source.build(cfg).model)
    assert type(zoo).hits == hits + 1 and second_model is not first_model
    for state, rng in ((first, first_after), (second, second_after)):
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference)
        assert torch.equal(rng, after)
    with torch.no_grad():
        second_model.conv1.weight.add_(1.0)
    third, _, _ = built(1234, lambda: source.build(cfg).model)
    assert torch.equal(third["conv1.weight"], reference["conv1.weight"])
    other, _, _ = built(5, lambda: source.build(cfg).model)
    assert type(zoo).hits == hits + 2 and not torch.equal(other["conv1.weight"], reference["conv1.weight"])


def test_a_tests_environment_changes_end_with_it_1_set() -> None:
    os.environ["RUNNER_SUITE_RULES_LEFT_BEHIND"] = "1"  # as torch.compile sets LD_LIBRARY_PATH, without undoing it


def test_a_tests_environment_changes_end_with_it_2_gone() -> None:
    """The test above ran first, in this process (one file stays on one worker, in order)."""
    assert "RUNNER_SUITE_RULES_LEFT_BEHIND" not in os.environ


def test_the_tripwire_fails_only_a_passing_suite_over_it() -> None:
    """Over the tripwire, a passing suite is failed; at or under it, or failing already, or with none set, not."""
    from tests.suite_budget import over_tripwire

    assert over_tripwire(1801.0, True, "1800") == 1800.0
    assert over_tripwire(1800.0, True, "1800") is None
    assert over_tripwire(5000.0, False, "1800") is None
    assert over_tripwire(5000.0, True, None) is None
    assert over_tripwire(5000.0, True, "") is None


@pytest.mark.process
def test_a_whole_suite_over_its_tripwire_fails_saying_so(tmp_path: Path) -> None:
    """The hooks end to end, in a pytest of its own: a whole suite (no selection) that passes but takes longer than
    RUNNER_SUITE_TRIPWIRE_S exits 1 with one red line saying so; its summary line gives the wall time and the CPU
    seconds. A selection of tests is not held to it."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (tests / "conftest.py").write_text(
        "from tests.suite_budget import pytest_runtest_logreport, pytest_sessionfinish, "
        "pytest_terminal_summary  # noqa: F401\n"
    )
    (tests / "test_passes.py").write_text("def test_passes() -> None:\n    pass\n")
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RUNNER_SUITE_TRIPWIRE_S": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout
    assert re.search(r"suite over its tripwire: \d+ s wall > RUNNER_SUITE_TRIPWIRE_S=0", done.stdout), done.stdout
    assert re.search(r"suite: \d+ s wall, \d+ CPU-seconds on \d+ CPUs, \d+ test-seconds", done.stdout), done.stdout
    selected = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "tests/test_passes.py"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert selected.returncode == 0, selected.stdout + selected.stderr
    assert "tripwire" not in selected.stdout
