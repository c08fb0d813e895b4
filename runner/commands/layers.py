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
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from runner.errors import RunnerError
from runner.layers import dry_forward, expand_auto, named_layers, probe_input, selected_layers
from runner.schema import RunConfig

log = logging.getLogger(__name__)

CONF = Path(__file__).resolve().parents[2] / "conf"
COLUMNS = ("layer_index", "layer", "type", "output_shape", "calls", "cam", "selected")


def layer_table(cfg: DictConfig | RunConfig) -> pd.DataFrame:
    """Every module of the configured model in model order, from one dry forward of one input of the configured
    size: layer_index, layer, type, output_shape, calls, cam (usable by CAM methods), selected (by the config).

    A selection that fails (a selector matching nothing) leaves `selected` all False and its message in
    `attrs["selection_error"]`; `attrs["input_shape"]` is the probe's shape."""
    from runner.configure import to_run_config
    from runner.models import build_model
    from runner.models.check import input_refused

    config = to_run_config(cfg)
    bundle = build_model(config.model)
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    model = bundle.model.to("cuda" if cuda else "cpu")
    if bundle.tokenizer is not None:
        return site_table(model, config)
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


def site_table(model: torch.nn.Module, config: RunConfig) -> pd.DataFrame:
    """A language model's named sites (runner/models/lm_sites.py) in block order, from one forward of a four-token
    prompt: the site (kind.layer), the module and side it is read from, its shape (per-head sites: batch, positions,
    heads, head size); `selected`: the sites the method's `sites` and `layers` choose."""
    from runner.hooks import HookSession
    from runner.hooks.sites import SiteHooks
    from runner.models.lm_sites import layout_of

    layout = layout_of(model)
    specs = [layout.site(kind, layer) for layer in range(layout.layers) for kind in layout.available(layer)]
    selection = config.method.selection()  # None: an image method on a language model selects no site
    kinds, layers = (set(selection.sites), selection.layers) if selection is not None else (set(), None)
    chosen = {s.name for s in specs if s.kind in kinds and (layers is None or s.layer in layers)}
    ids = torch.zeros((1, 4), dtype=torch.long, device=next(model.parameters()).device)
    with HookSession(model, []) as session, torch.no_grad():
        hooks = SiteHooks(model, specs, session)
        with hooks.keep():
            model(input_ids=ids, use_cache=False)
        kept = dict(hooks.kept)
    frame = pd.DataFrame(
        {
            "layer_index": [s.layer for s in specs],
            "layer": [s.name for s in specs],
            "type": [f"{s.module} ({s.where})" for s in specs],
            "output_shape": [str(list(kept[s.name].shape)) if s.name in kept else "-" for s in specs],
            "calls": [int(s.name in kept) for s in specs],
            "cam": [False] * len(specs),
            "selected": [s.name in chosen for s in specs],
        },
        columns=list(COLUMNS),
    )
    frame.attrs.update(input_shape=[1, 4], selection_error=None)
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

    from runner.options.compose import register_configs

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
