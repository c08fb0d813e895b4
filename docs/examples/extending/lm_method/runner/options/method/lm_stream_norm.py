"""`method=lm_stream_norm` (an example language-model method): the L2 norm of the residual stream at the last position
of each pair's clean and of its corrupted prompt, per layer, and their ratio."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig
from runner.site_kinds import SiteSelection


@METHODS.option("runner.methods.lm_stream_norm:LmStreamNorm", tables=("lm_stream_norm",), family=LM_FAMILY)
@dataclass
class LmStreamNormConfig(MethodConfig):
    """The sites and layers read (whole sites: a per-head site is refused); the run's `target` is not used."""

    name: str = "lm_stream_norm"
    sites: list[str] = field(default_factory=lambda: ["resid_post"])
    layers: Optional[list[int]] = None  # null: every layer  # noqa: UP045 (OmegaConf)

    def selection(self) -> SiteSelection:
        """Known sites and layers, each named once: checked with the config, before anything loads."""
        return SiteSelection("method", tuple(self.sites), None if self.layers is None else tuple(self.layers))
