"""CAM vs patching agreement: does a map's mass predict the causal effect of the same spatial cell?"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.errors import RunnerError, suggest
from runner.options.method.cam import cam_method_names
from runner.options.method.patching import (
    PatchingConfig,
    PatchingMethodConfig,
    PatchMode,
    PatchUnit,
)
from runner.options.registry import METHODS
from runner.schema import MethodConfig, TargetMode

DEFAULT_CAM_METHODS = ["gradcam", "gradcampp", "xgradcam", "hirescam", "layercam"]


@METHODS.option("runner.methods.cam_vs_patching:CamVsPatching", tables=("cam_vs_patching",))
@dataclass
class CamVsPatchingConfig(MethodConfig):
    """`method=cam_vs_patching`: the CAM methods compared, and the exact patching sweep they are compared with
    (a PatchingConfig under `exact_patching`, with units=cell and mode=exact)."""

    name: str = "cam_vs_patching"
    cam_methods: list[str] = field(default_factory=lambda: list(DEFAULT_CAM_METHODS))
    token_prefix: int = 1  # as CamConfig's: token models' leading tokens (cells need spatial layers anyway)
    exact_patching: PatchingConfig = field(default_factory=PatchingConfig)

    def check(self) -> list[str]:
        bad = super().check()
        p = self.exact_patching
        unknown = [m for m in self.cam_methods if m not in cam_method_names()]
        if not self.cam_methods or unknown or len(set(self.cam_methods)) != len(self.cam_methods):
            raise RunnerError(
                f"method.cam_methods={self.cam_methods}: give each of {', '.join(cam_method_names())} at most once, and at"
                f" least one.{suggest(unknown[0], cam_method_names()) if unknown else ''}"
            )
        if p.units is not PatchUnit.cell or p.mode is not PatchMode.exact:
            raise RunnerError(
                f"method=cam_vs_patching compares CAM mass with exact patching of spatial cells:"
                f" method.exact_patching.units must be cell (is {p.units.value}) and mode exact (is {p.mode.value})."
            )
        if self.target is TargetMode.topk:
            raise RunnerError(
                "method=cam_vs_patching explains one class per sample: use target predicted, label or fixed."
            )
        bad += [f"method.token_prefix={self.token_prefix}"] if self.token_prefix < 0 else []
        # The sweep's own rules are patching's (corruption, directions, grid, chunk), named under this option's key.
        try:
            inner = PatchingMethodConfig(patching=p).check()
        except RunnerError as e:
            raise RunnerError(str(e).replace("method.patching.", "method.exact_patching.")) from None
        bad += [b.replace("method.patching.", "method.exact_patching.") for b in inner]
        return bad
