"""Model parameter randomisation test (MPRT; Adebayo et al. 2018, as Quantus 0.6.0's `MPRT`), per target layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from runner.options.method.cam import CamConfig
from runner.options.registry import METHODS


class MprtOrder(str, Enum):
    """Which modules a step re-initialises: Quantus's `layer_order` values."""

    top_down = "top_down"  # cascading from the output: step s re-initialises the last s modules
    bottom_up = "bottom_up"  # cascading from the input
    independent = "independent"  # step s re-initialises module s alone, on the trained weights (model order)


@METHODS.option("runner.methods.mprt:Mprt", tables=("mprt",))
@dataclass
class MprtConfig(CamConfig):
    """The inner method's maps are made with this config's CAM fields (token_prefix, ...)."""

    name: str = "mprt"
    inner: str = "gradcam"  # the CAM method whose maps are compared
    order: MprtOrder = MprtOrder.top_down
    randomize: list[str] = field(default_factory=list)  # layer selectors narrowing the modules re-initialised; []: all
    max_steps: int | None = None  # stop after this many steps (null: every module)
    similarities: list[str] = field(default_factory=lambda: ["spearman", "ssim", "topk_intersection"])
    topk_fraction: float = 0.1  # topk_intersection: the share of the input's pixels taken as the top
    seed: int = 42  # Quantus's default: each module is reset after torch.manual_seed(seed + 1)

    def check(self) -> list[str]:
        bad = super().check()
        if self.max_steps is not None and self.max_steps < 1:
            bad.append(f"method.max_steps={self.max_steps}")
        if not 0.0 < self.topk_fraction <= 1.0:
            bad.append(f"method.topk_fraction={self.topk_fraction}")
        return bad
