"""docs/reference/*.md are what scripts/gen_reference.py makes from the registries and the declared table schemas:
a method, option, field or column added, removed or renamed without `make docs` fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def generator() -> ModuleType:
    """scripts/gen_reference.py as a module (scripts/ is not a package), imported in this process."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return generator()


@pytest.fixture(scope="module")
def pages(gen: ModuleType) -> dict[Path, str]:
    return gen.render()


def test_committed_reference_is_what_the_code_generates(gen: ModuleType, pages: dict[Path, str]) -> None:
    stale = [str(p.relative_to(ROOT)) for p in gen.stale(pages)]
    assert not stale, f"stale generated docs: {stale}; run `make docs` (python scripts/gen_reference.py) and commit"


def test_reference_lists_every_registered_option_and_table(pages: dict[Path, str]) -> None:
    from runner.options.registry import DATA, METHODS, METRICS, MODELS, TARGETS
    from runner.tables import declared

    methods, options, tables = (
        pages[ROOT / "docs" / "reference" / n] for n in ("methods.md", "options.md", "tables.md")
    )
    for option in METHODS:
        option.load()  # its module declares its table
        assert f"## `{option.name}`" in methods and f"### `method={option.name}`" in options
    for name in DATA.names():
        assert f"### `data={name}`" in options
    for name in TARGETS.names():
        assert f"### `target={name}`" in options
    for name in MODELS.names():
        assert f"| `{name}` |" in options
    for name in METRICS.names():
        assert f"### `{name}`" in options
    assert "`road_noise` | `float` | `0.01` |" in options  # a metric's own setting, with type and default
    for table, schema in declared().items():
        section = tables[tables.index(f"## `{table}`") :]
        for column in schema.names:
            assert f"| `{column}` |" in section, f"{table}.{column}"


def test_check_names_a_stale_file_and_exits_1(
    gen: ModuleType,
    pages: dict[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(gen, "REFERENCE", tmp_path)
    monkeypatch.setattr(gen, "ROOT", tmp_path.parent)
    monkeypatch.setattr(gen, "render", lambda: {tmp_path / p.name: text for p, text in pages.items()})
    assert gen.main([]) == 0  # writes all three
    assert gen.main(["--check"]) == 0
    (tmp_path / "tables.md").write_text("edited by hand\n")
    assert gen.main(["--check"]) == 1
    assert "tables.md" in capsys.readouterr().err
    assert (tmp_path / "tables.md").read_text() == "edited by hand\n"  # --check writes nothing


def test_reference_lists_every_language_model_family(pages: dict[Path, str]) -> None:
    """docs/reference/families.md has a row per model_type that has a site adapter, and docs/language_models.md
    points to it rather than keeping a list of its own."""
    from runner.models.lm_sites import FAMILIES

    families = pages[ROOT / "docs" / "reference" / "families.md"]
    for model_type in FAMILIES:
        assert f"| `{model_type}` |" in families
    assert "reference/families.md" in (ROOT / "docs" / "language_models.md").read_text()
