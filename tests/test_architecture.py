"""The import graph's contract (scripts/check_imports.py, run by `make lint` and `make test`): layers pointing down,
no cycle, function-local imports counted, the forbidden arrows named, option modules and the CLI free of torch."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_imports.py"


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def scratch_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "runner"
    shutil.copytree(ROOT / "runner", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n\n" + line + "\n")


def test_main_has_no_cycle_and_no_broken_rule() -> None:
    problems, counts = checker().check(ROOT / "runner")
    assert problems == [] and counts["cycles"] == 0
    assert counts["modules"] > 100  # the whole package was read, not an empty folder


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        # a function-local import that closes a circle: foundation -> app -> ... -> foundation
        ("errors.py", "def _late() -> None:\n    from runner.app import run  # noqa: F401", "import cycle"),
        ("errors.py", "def _late() -> None:\n    from runner.app import run  # noqa: F401", "a layer above it"),
        ("viz/plots.py", "def _late() -> None:\n    import runner.methods.cam  # noqa: F401", "forbidden (viz draws"),
        ("store/layout.py", "import torch  # noqa: F401", "runner.store.layout imports torch"),
        ("options/method/gradcam.py", "import torch  # noqa: F401", "runner.options.method.gradcam imports torch"),
        ("schema.py", "def _late() -> None:\n    from runner.methods import method_config  # noqa: F401", "above it"),
    ],
)
def test_a_broken_rule_in_a_scratch_copy_fails_the_check(tmp_path: Path, module: str, line: str, expected: str) -> None:
    copy = scratch_copy(tmp_path)
    add_line(copy / module, line)
    problems, _ = checker().check(copy)
    assert any(expected in p for p in problems), problems


def test_an_option_may_import_torch_inside_a_function(tmp_path: Path) -> None:
    """An option's implementation may live in its module, importing torch when it runs."""
    copy = scratch_copy(tmp_path)
    add_line(copy / "options" / "method" / "gradcam.py", "def _weights() -> None:\n    import torch  # noqa: F401")
    problems, _ = checker().check(copy)
    assert problems == []


def test_annotations_under_type_checking_do_not_count(tmp_path: Path) -> None:
    copy = scratch_copy(tmp_path)
    add_line(copy / "errors.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runner.app import run")
    problems, _ = checker().check(copy)
    assert problems == []


@pytest.mark.slow
@pytest.mark.process
def test_the_script_exits_1_on_a_cycle_and_0_on_main(tmp_path: Path) -> None:
    clean = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0 and "0 cycles" in clean.stdout and "0 problems" in clean.stdout
    copy = scratch_copy(tmp_path)
    add_line(copy / "rows.py", "def _late() -> None:\n    from runner.loop import run_shard  # noqa: F401")
    broken = subprocess.run([sys.executable, str(SCRIPT), str(copy)], capture_output=True, text=True, timeout=120)
    assert broken.returncode == 1 and "import cycle" in broken.stdout
