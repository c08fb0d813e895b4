"""Layer selection: (model, selectors) -> ordered list of (dotted name, module).

A selector is one of
  features.28          an exact dotted name (resolved with `get_submodule`)
  features.*           a glob over dotted names (`*` crosses dots)
  Conv2d               a module type: a bare name starting with an upper-case letter
  features.*:Conv2d    both: names matching the glob whose type is Conv2d
  auto                 a few evenly spaced blocks with spatial outputs, chosen per model from one dry forward
                       (runner/commands/layers.py `expand_auto`)
Exclusions use the same syntax. Every include selector must match something: a selector that
matches nothing fails before any data is loaded, with the nearest valid names and the config entry
that named it.

Own models first (`own_selection`): an experiment's layers and hooks name modules of the model it was
written for (`for_model`); a run of another model gets `auto` and no hooks instead.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re

from torch import nn

from runner.errors import RunnerError, closest, suggest
from runner.schema import AUTO, RunConfig

log = logging.getLogger(__name__)

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


def _matches(selector: str, model: nn.Module, where: str = "layers.include") -> list[str]:
    """Names of the model's submodules (root excluded) that a selector picks, in model order; an error names the
    config entry (`where`) that holds the selector."""
    if selector == AUTO:
        raise RunnerError(
            f"{where}: '{AUTO}' is chosen from a forward of the model (runner.commands.layers.expand_auto), not by name."
        )
    pattern, type_name = _split(selector)
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    types = sorted({type(m).__name__ for _, m in named})
    if type_name is not None and type_name not in types:
        raise RunnerError(
            f"Layer selector '{selector}': the model has no module of type '{type_name}'."
            f"{suggest(type_name, types)} Types in this model: {', '.join(types)}. (from {where})"
        )
    if pattern is not None and not (_GLOB_CHARS & set(pattern)):
        try:
            model.get_submodule(pattern)
        except AttributeError:
            raise RunnerError(
                f"Layer '{pattern}' does not exist in the model.{suggest(pattern, names)} Names are dotted module"
                f" paths as in model.named_modules(); globs ('features.*') work too. (from {where})"
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


def resolve_layers(
    model: nn.Module,
    include: list[str],
    exclude: list[str] | None = None,
    where: str = "layers.include",
    exclude_where: str = "layers.exclude",
) -> list[Layer]:
    """The modules the selectors pick, in the model's own order, without duplicates. An error names the config
    entry that holds the failing selector (`where`: layers.include, hooks[2].layers, method.randomize, ...)."""
    if not include:
        raise RunnerError(f"No layers selected by {where}: give selectors, e.g. [features.28], [Conv2d] or auto.")
    chosen: set[str] = set()
    for selector in include:
        hits = _matches(selector, model, where)
        if not hits:
            names = [n for n, _ in model.named_modules() if n]
            pattern = _split(selector)[0]
            if pattern is not None and _GLOB_CHARS & set(pattern):
                hint = _glob_hint(pattern, names)
            else:
                hint = suggest((pattern or selector).replace("*", ""), names)
            raise RunnerError(f"Layer selector '{selector}' matches no module.{hint} (from {where})")
        chosen.update(hits)
    for selector in exclude or []:
        chosen.difference_update(_matches(selector, model, exclude_where))
    if not chosen:
        selected = {n for s in include for n in _matches(s, model, where)}
        before = [n for n, _ in model.named_modules() if n in selected]
        shown = ", ".join(before[:10]) + (f", ... ({len(before)} in all)" if len(before) > 10 else "")
        raise RunnerError(
            f"The exclusions {list(exclude or [])} remove every layer that {list(include)} selects ({shown})."
            f" Narrow {exclude_where} (e.g. exclude one name, not a glob) or widen {where}."
        )
    return [(n, m) for n, m in model.named_modules() if n in chosen]


def layer_order(model: nn.Module) -> dict[str, int]:
    """Each submodule's position in model order (`named_modules()`, the root excluded): the `layer_index` column."""
    return {name: index for index, name in enumerate(n for n, _ in model.named_modules() if n)}


def own_selection(config: RunConfig) -> RunConfig:
    """`layers.include` and `hooks` as the run's own model gets them: what the user set wins; unset (null), the
    experiment's `for_model` selection where the run's model is the one it names, else `auto` and no hooks
    (a model change never inherits another model's module names). Each dropped part is logged."""
    include = config.layers.include
    if isinstance(include, str):  # layers.include=auto, or one selector without brackets
        include = [include]
    elif include is not None and not (
        isinstance(include, (list, tuple)) and all(isinstance(s, str) and s for s in include)
    ):
        raise RunnerError(
            f"layers.include={include!r}: give a list of layer selectors, e.g. layers.include=[features.28,Conv2d],"
            f" or {AUTO} (a few evenly spaced blocks chosen for the model)."
        )
    hooks = config.hooks
    own = config.for_model
    if include is None or hooks is None:
        label = _label(config)
        mine = own.model is None or own.model == label  # for_model.model null: written for any model
        if include is None:
            include = list(own.include) if mine and own.include else [AUTO]
            if not mine and own.include:
                log.info(
                    "layers.include: the experiment's layers (%s) are %s's; this run's model is %s: layers.include=%s"
                    " (set layers.include=[...] to choose; `runner layers` lists the modules)",
                    ", ".join(own.include), own.model, label, AUTO,
                )  # fmt: skip
        if hooks is None:
            hooks = list(own.hooks) if mine else []
            if not mine and own.hooks:
                log.info(
                    "hooks: the experiment's %d hook(s) name modules of %s, not of this run's model %s: none are"
                    " registered (set hooks=[...] to hook this model)",
                    len(own.hooks), own.model, label,
                )  # fmt: skip
    layers = dataclasses.replace(config.layers, include=list(include))
    return dataclasses.replace(config, layers=layers, hooks=list(hooks))


def _label(config: RunConfig) -> str | None:
    """The run's model as the tables' `model` column says it, or None when the config names no model the
    runner knows (building it fails later with the full message)."""
    from runner.models import model_label

    try:
        return model_label(config.model)
    except RunnerError:
        return None
