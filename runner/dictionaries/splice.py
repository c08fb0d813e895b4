"""A sparse dictionary spliced into a language model with an error term (Marks et al. 2024, "Sparse Feature Circuits"):
the site it reads is passed on as

    x  ->  decode(f) + e,   f = encode(x),   e = x - decode(encode(x))   (a transcoder: e = y - decode(encode(x)),
                                                                          x the MLP's input, y what it adds)

which equals x up to float rounding, so the spliced model computes what the model computes; but the latents f and
the error e are now tensors of their own that a method can read, patch or take the gradient at, as any other site:
`latent.<layer>` (B, T, width, 1: each latent a head of width 1) and `error.<layer>` (B, T, d_model). They are the
outputs of the splice's two identity submodules (`latents`, `error`), so the site hooks (runner/hooks/sites.py) find
them as they find a model's own modules. The output is decoded from whatever `latents` returns, so patching one latent
moves the stream by (new - old) x its decoder row, and the error stays the receiving run's unless it is patched too;
the gradient at f is W_dec's rows against the stream's, at e the stream's own, and the gradient upstream of the site
is the model's (decode(f) - decode(f) cancels).

A dictionary is a child module of its block (`<blocks>.<layer>.dictionary`), so it moves with the model and shows in
its module tree; the hooks that route the site through it are registered by every hook session over the model
(`splice_hooks`, runner/hooks/session.py) and removed with the session's other handles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from runner.dictionaries.dictionary import Dictionary
from runner.errors import RunnerError
from runner.models.lm_sites import SPLICED, LanguageModelLayout, Placement, read_site, with_site

CHILD = "dictionary"  # the splice's name in its block


class DictionarySplice(nn.Module):
    """One dictionary spliced at one site: `forward(x, y)` is what the model passes on in place of `y` (an SAE:
    y is x), computed in the dictionary's dtype and handed back in the model's."""

    def __init__(self, dictionary: Dictionary, placement: Placement) -> None:
        super().__init__()
        self.dictionary = dictionary
        self.latents = nn.Identity()  # its output is the site `latent.<layer>`
        self.error = nn.Identity()  # its output is the site `error.<layer>`
        setattr(self, SPLICED, placement)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = self.dictionary.W_dec.dtype
        x, wide = x.to(dtype), y.to(dtype)
        f = self.dictionary.encode(x)  # (B, T, width)
        reconstruction = self.dictionary.decode(f, x)  # (B, T, d)
        error = self.error(wide - reconstruction)  # (B, T, d)
        kept = self.latents(f)
        if kept is not f:  # patched or traced: decoded from what the hooks passed on
            reconstruction = self.dictionary.decode(kept, x)
        return (reconstruction + error).to(y.dtype)


@dataclass(frozen=True)
class Spliced:
    """A dictionary to splice: its weights and where it reads."""

    dictionary: Dictionary
    site: str  # runner/site_kinds.py DICTIONARY_SITES
    layer: int


def placed_at(layout: LanguageModelLayout, site: str, layer: int, width: int) -> Placement:
    """Where a dictionary of `width` latents reading `site` of block `layer` sits: its block's child `dictionary`."""
    return Placement(site, layer, width, f"{layout.arch.blocks}.{layer}.{CHILD}")


def attach(model: nn.Module, layout: LanguageModelLayout, dictionaries: list[Spliced]) -> LanguageModelLayout:
    """Add each dictionary to its block as a child module (on the model's device); the layout with them placed. The
    hooks that route the sites through them come with each hook session (`splice_hooks`)."""
    placed = []
    for item in dictionaries:
        block = model.get_submodule(f"{layout.arch.blocks}.{item.layer}")
        if hasattr(block, CHILD):
            raise RunnerError(f"model.dictionaries: layer {item.layer} has a dictionary already; give one per layer.")
        placement = placed_at(layout, item.site, item.layer, item.dictionary.width)
        device = next(block.parameters()).device
        block.add_module(CHILD, DictionarySplice(item.dictionary.to(device), placement))
        placed.append(placement)
    return replace(layout, dictionaries=tuple(placed))


Hook = tuple[nn.Module, Callable[..., Any], bool]  # (module, hook, pre)


def splice_hooks(model: nn.Module, layout: LanguageModelLayout) -> list[Hook]:
    """The hooks that pass each spliced site on through its dictionary: (module, hook, pre) to register, in order."""
    hooks: list[Hook] = []
    for placement in layout.dictionaries:
        splice = model.get_submodule(placement.module)
        hooks += _site_hooks(model, layout, placement, splice)
    return hooks


def _site_hooks(model: nn.Module, layout: LanguageModelLayout, placement: Placement, splice: nn.Module) -> list[Hook]:
    written = "mlp_out" if placement.site == "mlp" else placement.site
    spec = layout.site(written, placement.layer)
    if spec.stream is not None or spec.rows_of or spec.mutated:
        raise RunnerError(
            f"model.dictionaries: a dictionary at {written}.{placement.layer} of {layout.arch.family} is not supported"
            " (a stream sum, flattened rows or a tensor changed in place): place it at resid_pre, resid_post or a"
            " branch output."
        )
    target = model.get_submodule(spec.module)
    if placement.site != "mlp":

        def through(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any = None) -> Any:
            raw = read_site(spec, args, kwargs, output)
            return with_site(spec, args, kwargs, output, splice(raw, raw))

        if spec.where == "input":
            return [(target, lambda m, a, k: through(m, a, k), True)]
        return [(target, through, False)]
    # A transcoder reads the MLP's input and writes what the MLP's branch adds to the stream.
    mlp = model.get_submodule(layout.module_name(layout.arch.mlp, placement.layer))
    seen: dict[str, torch.Tensor] = {}

    def read_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    def write_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        raw = read_site(spec, args, kwargs, output)
        return with_site(spec, args, kwargs, output, splice(seen.pop("x"), raw))

    return [(mlp, read_input, True), (target, write_output, False)]
