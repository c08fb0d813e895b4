"""Layer selection: (model, selectors) -> ordered list of (dotted name, module).

A selector is one of
  features.28          an exact dotted name (resolved with `get_submodule`)
  features.*           a glob over dotted names (`*` crosses dots)
  Conv2d               a module type: a bare name starting with an upper-case letter
  features.*:Conv2d    both: names matching the glob whose type is Conv2d
Exclusions use the same syntax. Every include selector must match something: a selector that
matches nothing fails before any data is loaded, with the nearest valid names.
"""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from runner.errors import RunnerError, closest, suggest

Layer = tuple[str, nn.Module]

_TYPE_NAME = re.compile(r"^[A-Z][A-Za-z0-9_]*$")
_GLOB_CHARS = set("*?[")


def _split(selector: str) -> tuple[str | None, str | None]:
    """(name pattern, type name) of a selector; either may be None."""
    if ":" in selector:
        pattern, type_name = selector.rsplit(":", 1)
        return pattern or None, type_name or None
    if _TYPE_NAME.match(selector):
        return None, selector
    return selector, None


def _matches(selector: str, model: nn.Module) -> list[str]:
    """Names of the model's submodules (root excluded) that a selector picks, in model order."""
    pattern, type_name = _split(selector)
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    types = sorted({type(m).__name__ for _, m in named})
    if type_name is not None and type_name not in types:
        raise RunnerError(
            f"Layer selector '{selector}': the model has no module of type '{type_name}'."
            f"{suggest(type_name, types)} Types in this model: {', '.join(types)}."
        )
    if pattern is not None and not (_GLOB_CHARS & set(pattern)):
        try:
            model.get_submodule(pattern)
        except AttributeError:
            raise RunnerError(
                f"Layer '{pattern}' does not exist in the model.{suggest(pattern, names)}"
                " Names are dotted module paths as in model.named_modules(); globs ('features.*') work too."
            ) from None
    picked = []
    for name, module in named:
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        if type_name is not None and type(module).__name__ != type_name:
            continue
        picked.append(name)
    return picked


def _glob_hint(pattern: str, names: list[str]) -> str:
    """'Did you mean' for a glob that matches nothing: the nearest modules at the level where the glob starts
    (as globs where they have submodules), or else every module at that level."""
    literal = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    parent = literal.rpartition(".")[0]  # the complete dotted segments before the first wildcard
    if parent and not any(n.startswith(parent + ".") for n in names):
        parent = ""  # a parent that does not exist: look at the top level
    depth = parent.count(".") + 1 if parent else 0  # the dots in a name at that level
    level = [n for n in names if n.count(".") == depth and (not parent or n.startswith(parent + "."))]
    candidates = [f"{n}.*" if any(m.startswith(n + ".") for m in names) else n for n in level]
    hits = closest(pattern, candidates) or closest(literal.rstrip("."), candidates)
    if hits:
        return f" Did you mean: {', '.join(hits)}? (`*` crosses dots: 'features.*' is every module under features.)"
    where = f"under '{parent}'" if parent else "at the top level"
    shown = ", ".join(candidates[:16]) + (f", ... ({len(candidates)} in all)" if len(candidates) > 16 else "")
    return f" Modules {where}: {shown}. (`*` crosses dots: 'features.*' is every module under features.)"


def resolve_layers(model: nn.Module, include: list[str], exclude: list[str] | None = None) -> list[Layer]:
    """The modules the selectors pick, in the model's own order, without duplicates."""
    if not include:
        raise RunnerError("No layers selected: set `layers.include`, e.g. layers.include=[features.28] or [Conv2d].")
    chosen: set[str] = set()
    for selector in include:
        hits = _matches(selector, model)
        if not hits:
            names = [n for n, _ in model.named_modules() if n]
            pattern = _split(selector)[0]
            if pattern is not None and _GLOB_CHARS & set(pattern):
                hint = _glob_hint(pattern, names)
            else:
                hint = suggest((pattern or selector).replace("*", ""), names)
            raise RunnerError(f"Layer selector '{selector}' matches no module.{hint}")
        chosen.update(hits)
    for selector in exclude or []:
        chosen.difference_update(_matches(selector, model))
    if not chosen:
        selected = {n for s in include for n in _matches(s, model)}
        before = [n for n, _ in model.named_modules() if n in selected]
        shown = ", ".join(before[:10]) + (f", ... ({len(before)} in all)" if len(before) > 10 else "")
        raise RunnerError(
            f"The exclusions {list(exclude or [])} remove every layer that {list(include)} selects ({shown})."
            " Narrow layers.exclude (e.g. exclude one name, not a glob) or widen layers.include."
        )
    return [(n, m) for n, m in model.named_modules() if n in chosen]


def layer_order(model: nn.Module) -> dict[str, int]:
    """Each submodule's position in model order (`named_modules()`, the root excluded): the `layer_index` column."""
    return {name: index for index, name in enumerate(n for n, _ in model.named_modules() if n)}
