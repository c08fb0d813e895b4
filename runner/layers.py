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
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.errors import RunnerError, closest, suggest
from runner.schema import AUTO, DataConfig, RunConfig

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
            f"{where}: '{AUTO}' is chosen from a forward of the model (runner.layers.expand_auto), not by name."
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
        # An experiment for an image model run on a language model (the default experiment with model=hf_lm), or
        # the reverse: its modules mean nothing to this run's model, and saying so would only name the other kind.
        other_kind = not mine and _modality(own.model) not in (None, getattr(type(config.model), "MODALITY", "image"))
        if include is None:
            include = list(own.include) if mine and own.include else [AUTO]
            if not mine and own.include and not other_kind:
                log.info(
                    "layers.include: the experiment's layers (%s) are %s's; this run's model is %s: layers.include=%s"
                    " (set layers.include=[...] to choose; `runner layers` lists the modules)",
                    ", ".join(own.include), own.model, label, AUTO,
                )  # fmt: skip
        if hooks is None:
            hooks = list(own.hooks) if mine else []
            if not mine and own.hooks and not other_kind:
                log.info(
                    "hooks: the experiment's %d hook(s) name modules of %s, not of this run's model %s: none are"
                    " registered (set hooks=[...] to hook this model)",
                    len(own.hooks), own.model, label,
                )  # fmt: skip
    layers = dataclasses.replace(config.layers, include=list(include))
    return dataclasses.replace(config, layers=layers, hooks=list(hooks))


def _modality(label: str | None) -> str | None:
    """What the model a `for_model.model` label names takes ("image", or "text": its source's schema's MODALITY);
    None for a label of no known source."""
    from runner.options.registry import MODELS

    try:
        schema = MODELS.get(str(label).partition(":")[0]).schema
    except RunnerError:
        return None
    return str(getattr(schema, "MODALITY", "image"))


def _label(config: RunConfig) -> str | None:
    """The run's model as the tables' `model` column says it, or None when the config names no model the
    runner knows (building it fails later with the full message)."""
    from runner.models import model_label

    try:
        return model_label(config.model)
    except RunnerError:
        return None


# How many layers `layers.include=auto` picks (all candidates when the model has fewer).
AUTO_LAYERS = 4


# Containers that only group modules: their instances are not the model's blocks.
_GENERIC = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class Probe:
    """What the dry forward saw of one module: its call count and its first call's output."""

    calls: int = 0
    output: str = "-"  # the first call's output shape, e.g. "1x64x56x56"; "-" when never called
    cam: bool = False  # a CAM method can use it: (N, C, H, W), or tokens (N, T, C) with T or T-1 square
    shape: tuple[int, ...] | None = None  # the first call's output shape when it is one tensor


def _describe(output: Any) -> tuple[str, bool]:
    """(shape text, CAM-usable) of a module's output: a tensor, or the tensors of a tuple/list/dict."""
    if torch.is_tensor(output):
        shape = tuple(output.shape)
        return "x".join(map(str, shape)) or "scalar", _cam_usable(shape)
    if isinstance(output, dict):  # also Hugging Face's ModelOutput
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        parts = [_describe(o)[0] if torch.is_tensor(o) else type(o).__name__ for o in output[:3]]
        more = ", ..." if len(output) > 3 else ""
        return f"({', '.join(parts)}{more})", False  # CAM methods capture a tensor output only
    return type(output).__name__, False


def _cam_usable(shape: tuple[int, ...]) -> bool:
    """Spatial maps (N, C, H, W), or a token grid (N, T, C) with T square (no prefix) or T-1 (a class token)."""
    if len(shape) == 4:
        return True
    if len(shape) == 3:
        tokens = shape[1]
        return any(t > 0 and math.isqrt(t) ** 2 == t for t in (tokens, tokens - 1))
    return False


def probe_input(data: DataConfig, preprocess: Any) -> torch.Tensor:
    """One sample of the size the data source makes (no data is loaded): a mid-grey photo through the
    photos' transform for image sources, zeros of `data.shape` for sources that say their sample's shape."""
    from runner.data.images import image_transform, sized_for_model
    from runner.options.data.images import ImageDataConfig

    data = sized_for_model(data, preprocess)  # the model's own input size, as the data set will make it
    shape = getattr(data, "shape", None)
    if shape is not None:
        return torch.zeros(list(shape))  # (*data.shape)
    from PIL import Image

    if isinstance(data, ImageDataConfig):
        transform, _ = image_transform(data, preprocess)
    else:  # a source of another kind: the standard size
        transform, _ = image_transform(ImageDataConfig(image_size=data.image_size), None)
    grey = Image.new("RGB", (data.image_size, data.image_size), (128, 128, 128))
    return transform(grey)  # (3, H, W)


def dry_forward(model: nn.Module, x: torch.Tensor, modules: Sequence[Layer]) -> dict[str, Probe]:
    """Forward `x` (one sample, no batch dimension) once under no_grad and eval; per module, what it output.

    The forward hooks are removed and the model's train/eval mode restored afterwards, also on error."""
    probes = {name: Probe() for name, _ in modules}

    def recorder(probe: Probe):  # noqa: ANN202
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            probe.calls += 1
            if probe.calls == 1:
                probe.output, probe.cam = _describe(output)
                probe.shape = tuple(output.shape) if torch.is_tensor(output) else None

        return hook

    was_training = model.training
    handles = []
    try:
        for name, module in modules:
            handles.append(module.register_forward_hook(recorder(probes[name])))
        model.eval()
        device = next((p.device for p in model.parameters()), x.device)
        with torch.no_grad():
            model(x.unsqueeze(0).to(device))  # (1, *x.shape)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return probes


def named_layers(model: nn.Module) -> list[Layer]:
    """Every submodule (the root excluded) in model order: the order of `layer_index`."""
    return [(name, module) for name, module in model.named_modules() if name]


def selected_layers(model: nn.Module, config: RunConfig) -> list[str]:
    """The names the run's `layers` and hooks' own `layers` select, in model order (RunnerError if a selector fails)."""
    picked: set[str] = set()
    if config.layers.include:
        picked.update(n for n, _ in resolve_layers(model, config.layers.include, config.layers.exclude))
    for i, spec in enumerate(config.hooks or []):
        if spec.layers:
            picked.update(n for n, _ in resolve_layers(model, spec.layers, where=f"hooks[{i}].layers"))
    return [n for n, _ in named_layers(model) if n in picked]


def check_selection(
    model: nn.Module, layers: Sequence[Layer], x: torch.Tensor, sources: dict[str, str] | None = None
) -> None:
    """Fail, before any data loads, when selected modules are never called in a forward of `x`, listing them.

    `layers`: every module the run hooks (target layers and hooks' own), in any order, repeats allowed;
    `sources`: the config entry that selected each module (layers.include, hooks[1].layers), for the message."""
    wanted = {name for name, _ in layers}
    layers = [(name, module) for name, module in named_layers(model) if name in wanted]  # model order, once each
    if not layers:
        return
    try:
        probes = dry_forward(model, x, layers)
    except Exception:  # the input check after data loading reports a shape the model refuses, with the real sample
        return
    idle = [name for name, _ in layers if probes[name].calls == 0]
    if not idle:
        return
    types = sorted({type(m).__name__ for n, m in layers if n in idle})
    shown = ", ".join(idle[:12]) + (f", ... ({len(idle)} in all)" if len(idle) > 12 else "")
    entries = sorted({sources[n] for n in idle if n in sources}) if sources else []
    named = f" Selected by {', '.join(entries)}." if entries else ""
    raise RunnerError(
        f"The layer selection picks {len(idle)} module(s) that are never called in the forward pass (one input of"
        f" shape {list(x.shape)}): {shown}.{named} Leave them out, e.g. layers.exclude=[{', '.join(types)}], or"
        " narrow layers.include; `runner layers` lists every module with its call count."
    )


def _auto_candidate(probe: Probe, module: nn.Module, token_prefix: int) -> bool:
    """Whether `auto` may pick a module: called once (a shared module's rows would need a call index), its output
    a spatial map larger than 1x1 or a square token grid after `token_prefix` tokens, and not a pass-through."""
    shape = probe.shape
    if probe.calls != 1 or shape is None or isinstance(module, (nn.Identity, nn.modules.dropout._DropoutNd)):
        return False
    if len(shape) == 4:
        return shape[2] * shape[3] > 1  # a 1x1 map says nothing about where
    if len(shape) == 3:
        grid = shape[1] - token_prefix
        return grid > 1 and math.isqrt(grid) ** 2 == grid
    return False


def auto_layers(model: nn.Module, x: torch.Tensor, token_prefix: int = 1) -> list[str]:
    """`layers.include=auto`: up to AUTO_LAYERS evenly spaced blocks (the last one included) whose output is a
    spatial map or a square token grid in one forward of `x`. Blocks are the instances of the coarsest module
    class that repeats (EfficientNet's MBConvBlock, ResNet's BasicBlock, ConvNeXt's stages, ViT's layers); a
    model without repeated blocks (VGG's `features`) gets its most frequent layer type with parameters (Conv2d)."""
    modules = named_layers(model)
    try:
        probes = dry_forward(model, x, modules)
    except Exception as e:
        from runner.models.check import input_refused

        raise input_refused(e, list(x.shape)) from e
    usable = [(n, m) for n, m in modules if _auto_candidate(probes[n], m, token_prefix)]
    if not usable:
        raise RunnerError(
            f"layers.include=auto: no module of this model outputs a spatial map larger than 1x1 or a square token"
            f" grid in a forward of one input of shape {list(x.shape)}. Name the layers: layers.include=[...]"
            " (`runner layers` lists every module with its output shape), or use a larger data.image_size."
        )
    blocks: dict[str, list[str]] = {}  # module class -> its instances with a usable output, in model order
    for name, module in usable:
        if any(True for _ in module.children()) and not isinstance(module, _GENERIC):
            blocks.setdefault(type(module).__name__, []).append(name)
    chosen: list[str] = []
    for least in (AUTO_LAYERS, 2):  # prefer a class with enough instances to spread over the depth
        eligible = {t: names for t, names in blocks.items() if len(names) >= least}
        # The coarsest: no instance inside an instance of another eligible class (blocks, not their parts).
        outer = [
            names
            for t, names in eligible.items()
            if not any(n.startswith(o + ".") for u, others in eligible.items() if u != t for o in others for n in names)
        ]
        if outer:
            chosen = max(outer, key=len)
            break
    if not chosen:
        by_type: dict[str, list[str]] = {}
        for name, module in usable:
            if any(True for _ in module.parameters(recurse=False)):
                by_type.setdefault(type(module).__name__, []).append(name)
        chosen = max(by_type.values(), key=len) if by_type else [n for n, _ in usable]
    k = min(AUTO_LAYERS, len(chosen))
    return [chosen[math.ceil((i + 1) * len(chosen) / k) - 1] for i in range(k)]  # evenly spaced, ending at the last


def expand_auto(config: RunConfig, model: nn.Module, x: torch.Tensor) -> RunConfig:
    """`config` with the `auto` selector of `layers.include` and of hooks' `layers` replaced by the modules
    `auto_layers` chooses for this model from one forward of `x` (logged); unchanged when no entry says auto."""
    hooks = list(config.hooks or [])
    if AUTO not in config.layers.include and not any(AUTO in spec.layers for spec in hooks):
        return config
    chosen = auto_layers(model, x, getattr(config.method, "token_prefix", 1))
    types = sorted({type(model.get_submodule(n)).__name__ for n in chosen})
    log.info(
        "layers.include=auto: %s (%d evenly spaced %s with spatial outputs in one forward of %s; `runner layers`"
        " lists the others)", ", ".join(chosen), len(chosen), "/".join(types), "x".join(map(str, x.shape)),
    )  # fmt: skip

    def expand(selectors: list[str]) -> list[str]:
        out: list[str] = []
        for selector in selectors:
            out.extend(chosen if selector == AUTO else [selector])
        return list(dict.fromkeys(out))  # once each, in the order given

    layers = dataclasses.replace(config.layers, include=expand(config.layers.include))
    hooks = [dataclasses.replace(spec, layers=expand(spec.layers)) if AUTO in spec.layers else spec for spec in hooks]
    return dataclasses.replace(config, layers=layers, hooks=hooks)
