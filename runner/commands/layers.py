"""`runner layers [overrides] [--grep PATTERN]`: the model's modules as one dry forward sees them.

One input of the configured size (a mid-grey photo through the data's own transform, or zeros of
`data.shape`) goes through the model once, without gradients, with a forward hook on every module: each
module in model order (`layer_index`, the position in `named_modules()`), its dotted name, type, output
shape, how many times it was called, whether a CAM method can use its output, and whether the configured
`layers.include` / hooks select it. The hooks are removed afterwards, also when the forward fails.

The same dry forward checks a run's layer selection before any data is loaded (`check_selection`) and
chooses the layers of `layers.include=auto` (`expand_auto`): a few evenly spaced blocks whose output is a
spatial map or a square token grid.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import DictConfig
from torch import nn

from runner.errors import RunnerError
from runner.layers import Layer, resolve_layers
from runner.schema import AUTO, DataConfig, RunConfig

log = logging.getLogger(__name__)

CONF = Path(__file__).resolve().parents[2] / "conf"
COLUMNS = ("layer_index", "layer", "type", "output_shape", "calls", "cam", "selected")
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
    from runner.data import ImageDataConfig, image_transform, sized_for_model

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


def layer_table(cfg: DictConfig | RunConfig) -> pd.DataFrame:
    """Every module of the configured model in model order, from one dry forward of one input of the configured
    size: layer_index, layer, type, output_shape, calls, cam (usable by CAM methods), selected (by the config).

    A selection that fails (a selector matching nothing) leaves `selected` all False and its message in
    `attrs["selection_error"]`; `attrs["input_shape"]` is the probe's shape."""
    from runner.models import build_model
    from runner.models.check import input_refused
    from runner.schema import to_run_config

    config = to_run_config(cfg)
    bundle = build_model(config.model)
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    model = bundle.model.to("cuda" if cuda else "cpu")
    x = probe_input(config.data, bundle.preprocess)
    modules = named_layers(model)
    try:
        probes = dry_forward(model, x, modules)
    except Exception as e:  # torch's RuntimeError, a model's own size check (ValueError, AssertionError)
        raise input_refused(e, list(x.shape)) from e
    error = None
    try:
        config = expand_auto(config, model, x)
        chosen = set(selected_layers(model, config))
    except RunnerError as e:
        chosen, error = set(), str(e)
    frame = pd.DataFrame(
        {
            "layer_index": range(len(modules)),
            "layer": [n for n, _ in modules],
            "type": [type(m).__name__ for _, m in modules],
            "output_shape": [probes[n].output for n, _ in modules],
            "calls": [probes[n].calls for n, _ in modules],
            "cam": [probes[n].cam for n, _ in modules],
            "selected": [n in chosen for n, _ in modules],
        },
        columns=list(COLUMNS),
    )
    frame.attrs.update(input_shape=list(x.shape), selection_error=error)
    return frame


def format_table(frame: pd.DataFrame, grep: str | None = None) -> str:
    """The table as text: one line a module, `*` marking the selected ones, then notes on the selection.

    `grep`: a case-insensitive regular expression that a row's name or type must contain."""
    rows = frame
    if grep:
        try:
            pattern = re.compile(grep, re.IGNORECASE)
        except re.error as e:
            raise RunnerError(f"--grep '{grep}' is not a regular expression ({e}).") from None
        hits = [
            bool(pattern.search(n) or pattern.search(t)) for n, t in zip(frame["layer"], frame["type"], strict=True)
        ]
        rows = frame[hits]
    ORDER = ("layer_index", "selected", "layer", "type", "output_shape", "calls", "cam")  # noqa: N806
    cells = [("#", "", "layer", "type", "output", "calls", "cam")] + [
        (str(i), "*" if s else "", n, t, o, str(c), "yes" if u else "")
        for i, s, n, t, o, c, u in zip(*(rows[k] for k in ORDER), strict=True)
    ]
    widths = [max(len(row[k]) for row in cells) for k in range(len(cells[0]))]
    lines = [" ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    if len(cells) == 1:
        lines.append("(no module matches)")
    selected = int(frame["selected"].sum())
    lines.append(
        f"{len(rows)} of {len(frame)} modules shown; one input of shape {frame.attrs.get('input_shape')};"
        f" {selected} selected (*) by layers.include / hooks; cam: usable by CAM methods."
    )
    idle = frame[frame["selected"] & (frame["calls"] == 0)]["layer"].tolist()
    if idle:
        lines.append(f"Selected but never called in the forward (a run would fail): {', '.join(idle)}")
    if frame.attrs.get("selection_error"):
        lines.append(f"Selection: {frame.attrs['selection_error']}")
    return "\n".join(lines)


def compose(overrides: Sequence[str]) -> DictConfig:
    """conf/ composed with `overrides` as the CLI composes it (a config Hydra cannot compose: RunnerError)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.schema import register_configs

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except Exception as e:  # Hydra's composition errors: several lines, the first says what is wrong
        lines = [line.strip() for line in str(e).split("Config search path")[0].splitlines() if line.strip()]
        raise RunnerError("Config error: " + " ".join(lines)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """`runner layers [key=value ...] [--grep PATTERN]`: print the table; exit 0, or 2 with one error line."""
    parser = argparse.ArgumentParser(
        prog="runner layers",
        description="List the configured model's modules from one dry forward of one input of the configured size:"
        " index, dotted name, type, output shape, call count, whether a CAM method can use it, and (*) which ones"
        " layers.include selects. Takes the run's overrides, e.g. `runner layers model=vgg16 model.weights=null"
        " layers.include=[Conv2d]`.",
    )
    parser.add_argument("--grep", metavar="PATTERN", help="show only modules whose name or type matches (regex)")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for a run (key=value)")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    # One input through the model: starting a pool of intra-op threads costs more than it saves (CPU, 2 cores
    # busy: 2 s with the default pool against 0.1 s on one thread for EfficientNet-Lite0 at 224 px).
    torch.set_num_threads(1)
    # What a run would log about the selection (layers a model change does not inherit, auto's choice, the
    # model's input size) goes to stderr, as a run's log does; the table to stdout.
    notes = logging.StreamHandler(sys.stderr)
    notes.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    runner_log = logging.getLogger("runner")
    level = runner_log.level
    runner_log.addHandler(notes)
    runner_log.setLevel(logging.INFO)
    try:
        print(format_table(layer_table(compose(args.overrides)), args.grep))
    except RunnerError as e:
        print(f"[ERROR] {e}", file=sys.stderr)
        return 2
    finally:
        runner_log.removeHandler(notes)
        runner_log.setLevel(level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
