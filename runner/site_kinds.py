"""The language-model site vocabulary, one list that every LM method, option and `runner layers` reads (torch-free,
so that a config is checked before torch loads), and the one rule for choosing sites and layers: each named once.
Where each site sits in a family's modules is runner/models/lm_sites.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from runner.errors import RunnerError, suggest

SITE_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "head", "q", "k", "v", "pattern")
PER_HEAD = ("head", "q", "k", "v", "pattern", "latent")  # sites with a head axis (latent: one per latent, width 1)
# The sites of a sparse dictionary spliced into the model (model.dictionaries; runner/dictionaries/splice.py): its
# latents (one per latent and position) and its error term (what it fails to reconstruct, d_model wide).
DICTIONARY_KINDS = ("latent", "error")
# Where a dictionary reads: a stream or branch site (an SAE reconstructs it), or `mlp` (a transcoder: reads the MLP's
# input, writes what the MLP adds to the stream, mlp_out).
DICTIONARY_SITES = ("resid_pre", "resid_post", "attn_out", "mlp_out", "mlp")


class Positions(str, Enum):
    """Which positions of each pair a language-model method reads (lm_attention's queries, lm_dla's, lm_cache's)."""

    last = "last"  # the last position (where the answer is read)
    all = "all"  # every real position


def check_sites(key: str, sites: Sequence[str]) -> None:
    """RunnerError unless `sites` (set at `key`) names sites of SITE_KINDS (or a spliced dictionary's, DICTIONARY_KINDS),
    each once, at least one."""
    chosen = list(sites)
    known = (*SITE_KINDS, *DICTIONARY_KINDS)
    unknown = [s for s in chosen if s not in known]
    hint = suggest(unknown[0], known) if unknown else ""
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        raise RunnerError(f"{key}={chosen}: each one of {', '.join(known)}, once (at least one).{hint}")


def check_layers(key: str, layers: Sequence[int] | None) -> None:
    """RunnerError where `layers` (set at `key`; None: every layer) names a layer twice or none: a repeated layer
    would measure its cells twice. Their range needs the model's layout (LanguageModelLayout.block_layers)."""
    if layers is None:
        return
    chosen = list(layers)
    if not chosen:
        raise RunnerError(f"{key}=[]: give at least one layer (null: every layer).")
    if len(set(chosen)) != len(chosen):
        twice = sorted({layer for layer in chosen if chosen.count(layer) > 1})
        raise RunnerError(f"{key}={chosen} names layer(s) {twice} twice: give each layer once.")


@dataclass(frozen=True)
class SiteSelection:
    """What a language-model method's config chooses of the model's sites: where in the config (`key`:
    method.patching, method), the site kinds (every kind the method reads, the fixed ones included) and the layers
    (None: every layer). `runner layers` marks what it selects; the run checks it once (`check`)."""

    key: str
    sites: tuple[str, ...]
    layers: tuple[int, ...] | None
    sites_chosen: bool = True  # the sites are the user's `<key>.sites`; False: the method's own (checked as code)
    layers_chosen: bool = True  # the layers are the user's `<key>.layers`; False: every layer, always

    def settings(self) -> str:
        """The settings that choose what the method reads, in words: 'method.patching.layers and .sites' ('': none,
        the method reads every layer)."""
        chosen = [name for name, own in (("layers", self.layers_chosen), ("sites", self.sites_chosen)) if own]
        return f"{self.key}." + " and .".join(chosen) if chosen else ""

    def check(self) -> None:
        """The one rule for every LM method: known sites and layers, each named once."""
        if self.sites_chosen:
            check_sites(f"{self.key}.sites", self.sites)
        check_layers(f"{self.key}.layers", self.layers)
