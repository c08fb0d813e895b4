"""TODO docstring."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from typing import ClassVar, Optional, TypeVar

from runner.errors import RunnerError
from runner.options.metric.evaluation import EvaluationConfig
from runner.options.registry import METHODS
from runner.schema import MethodConfig


class BlurPadding(str, Enum):
    """How the insertion blur fills the border: 0 (RISE's choice), mirrored pixels, or the edge pixel."""

    zero = "zero"
    reflect = "reflect"
    replicate = "replicate"


class MapDtype(str, Enum):
    """The precision the `map` column's values are kept in: float16 halves the bytes copied to the host."""

    float32 = "float32"
    float16 = "float16"


T = TypeVar("T")


@dataclass
class BlurConfig:
    """The insertion baseline's Gaussian blur; the defaults are RISE's (Petsiuk et al. 2018, eclique/RISE)."""

    kernel_size: int = 11  # odd
    sigma: float = 5.0
    padding: BlurPadding = BlurPadding.zero


@dataclass
class FaithfulnessConfig:
    """Deletion/insertion AUC and average drop/increase per map, each beside a random-map baseline."""

    enabled: bool = False
    steps: int = 20  # deletion/insertion curve points (plus the start)
    chunk: Optional[int] = None  # noqa: UP045 (OmegaConf) images per forward of perturbed inputs; null: forward_chunk
    SPEED_KEYS: ClassVar[tuple[str, ...]] = ("chunk",)  # left out of the resume key
    seed: int = 0  # the random-map baseline and the random order of equal-saliency pixels
    insertion_blur: BlurConfig = field(default_factory=BlurConfig)


# A bound that keeps a typo from running for days: each step costs about 4 forwards per sample and layer.
MAX_FAITHFULNESS_STEPS = 1000


@dataclass
class CamConfig(MethodConfig):
    """What every map-making method shares (the CAM variants, captum, sanity): maps, tokens, faithfulness."""

    store_maps: bool = True  # put each map (at the layer's resolution) in its row
    # the maps' values as stored: float16 rounds them on the device (half the bytes to copy; the column stays float32)
    map_dtype: MapDtype = MapDtype.float32
    token_prefix: int = 1  # token models (ViT): leading tokens (the class token) dropped before the patch grid
    faithfulness: FaithfulnessConfig = field(default_factory=FaithfulnessConfig)
    feature_grid_layer: str | None = None  # also a grid of this layer's first feature maps per sample
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)  # metrics -> the `evaluation` table

    def check(self) -> list[str]:
        bad = super().check()
        self.evaluation.check()
        f = self.faithfulness
        bad += [
            f"method.faithfulness.{key}={value}"
            for key, value in (("steps", f.steps), ("chunk", f.chunk))
            if value is not None and value < 1
        ]
        blur = f.insertion_blur
        if blur.kernel_size < 1 or blur.kernel_size % 2 == 0 or blur.sigma <= 0:
            raise RunnerError(
                f"Out of range: method.faithfulness.insertion_blur.kernel_size={blur.kernel_size} (odd, >= 1),"
                f" sigma={blur.sigma} (> 0). RISE's blur, the default: kernel_size=11, sigma=5."
            )
        if self.token_prefix < 0:
            bad.append(f"method.token_prefix={self.token_prefix}")
        if f.steps > MAX_FAITHFULNESS_STEPS:
            raise RunnerError(
                f"method.faithfulness.steps={f.steps} is above the bound of {MAX_FAITHFULNESS_STEPS}: each step costs"
                " about 4 forwards per sample and layer. 20 to 100 steps resolve a deletion curve; use e.g. steps=50."
            )
        return bad


def cam_method_names() -> list[str]:
    """The CAM variants' names (options of family "cam"), in registration order."""
    return [option.name for option in METHODS if option.family == "cam"]


def cam_variant(rule: type[T]) -> type[T]:
    """Class decorator: register a CAM variant given by its rule alone. The class has a `name` and either
    `channel_weights(self, act, grad) -> (B, C)` (the map is ReLU(sum_c w_c A_c)) or `cam(self, act, grad, ctx)
    -> (B, H, W)`; act and grad are (B, C, H, W) tensors (use tensor methods, or import torch inside the function).
    Its schema is CamConfig under its name (`rule.config`); the shared CAM pass runs it (runner/methods/cam.py)."""
    name = rule.name  # type: ignore[attr-defined]
    schema = make_dataclass(f"{rule.__name__}Config", [("name", str, field(default=name))], bases=(CamConfig,))
    schema.__module__ = rule.__module__
    schema.__doc__ = f"method={name}: CamConfig's settings, none of its own."
    # An attribute of the rule's module, as a written dataclass is: pickle (joblib's and submitit's workers) then
    # refers to it by name instead of copying the class, whose copy would carry copies of dataclasses.MISSING.
    setattr(sys.modules[rule.__module__], schema.__name__, schema)
    METHODS.option("runner.methods.cam:variant_method", tables=("cam",), family="cam", rule=rule)(schema)
    rule.config = schema  # type: ignore[attr-defined]
    return rule
