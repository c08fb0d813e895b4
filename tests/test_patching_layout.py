"""Issue 11, patching as a package: one concern a module, as its docstring lists them, and no helper taken
from a sibling method (shared helpers live outside runner/methods: runner/ranking.py, runner/rows.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import runner.methods.patching as patching

PACKAGE = Path(patching.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """The absolute module names `path` imports from."""
    tree = ast.parse(path.read_text())
    names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return names | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}


def test_patching_takes_nothing_from_a_sibling_method() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        for module in imported_modules(path):
            if module.startswith("runner.methods."):
                assert module == "runner.methods.base" or module.startswith("runner.methods.patching."), (
                    f"{path.name} imports {module}"
                )


def test_the_package_docstring_lists_each_module() -> None:
    listed = set(re.findall(r"^  (\w+)\.py ", patching.__doc__ or "", flags=re.M))
    assert listed == {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
