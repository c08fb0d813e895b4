"""Model-randomisation sanity check (Adebayo et al. 2018), per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


@METHODS.option("runner.methods.sanity:Sanity", tables=("sanity",))
@dataclass
class SanityConfig(CamConfig):
    """The inner method's maps are made with this config's CAM fields (store_maps, token_prefix, ...); an inner
    method's own fields (scorecam's score_chunk, say) keep their defaults."""

    name: str = "sanity"
    inner: str = "gradcam"  # the CAM method whose maps are compared
    randomize: list[str] = field(default_factory=list)  # layers re-initialised in the copy
