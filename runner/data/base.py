"""Data: the scikit-image photos (embedded default), any image folder, seeded synthetic tensors,
and torchvision data sets by name. Every sample is (image tensor, label or -1, sample id).

Each source is a config dataclass (its option's schema: conf/data/<name>.yaml names it first) and a
builder registered under that type with `@data_source(ItsConfig)`; a new source is one more pair here."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from runner.cpu_sharing import available_cpus
from runner.data.images import sized_for_model
from runner.errors import RunnerError
from runner.options.registry import DATA
from runner.schema import DataConfig, ResizeMode

log = logging.getLogger(__name__)

NO_LABEL = -1


def data_config_class(name: str) -> type[DataConfig]:
    """The config dataclass of the data source called `name` (RunnerError with the nearest names if none is)."""
    return DATA.get(name).schema


def data_config(name: str, **fields: Any) -> DataConfig:
    """The config of the data source called `name` with `fields` (a key of another source is a TypeError)."""
    return data_config_class(name)(**fields)


@dataclass
class Batch:
    """One batch on the device, with the identities of its samples."""

    x: torch.Tensor  # (B, C, H, W)
    labels: torch.Tensor  # (B,) int64, -1 where there is no label
    sample_ids: list[str]
    first_index: int  # position of the batch's first sample in the data set
    masks: torch.Tensor | None = None  # (B, H, W) bool localisation masks at input resolution; None: the data has none
    # Per-sample tensors a data source adds (prompt pairs: attention_mask, answers, distractors), batch first.
    extras: dict[str, torch.Tensor] | None = None

    def part(self, lo: int, hi: int) -> Batch:
        """Samples lo..hi-1 as a batch of their own (masks and extras included)."""
        masks = None if self.masks is None else self.masks[lo:hi]
        extras = None if self.extras is None else {k: v[lo:hi] for k, v in self.extras.items()}
        return Batch(self.x[lo:hi], self.labels[lo:hi], self.sample_ids[lo:hi], self.first_index + lo, masks, extras)


class ImageListDataset(Dataset):
    """Images produced by loaders, preprocessed on access."""

    def __init__(self, items: list[tuple[str, Callable[[], Image.Image], int]], transform: Callable) -> None:
        self.items = items
        self.transform = transform
        self.skipped: list[str] = []  # files left out because they could not be read
        self.classes: list[str] | None = None  # the labels' names by index, where the data set has them
        self.model_labels = False  # whether labels are the model's class indices (the photos' ImageNet ones)
        # A sample id's localisation mask (H, W) bool at input resolution (runner/data/composites.py); None: no masks.
        self.masks: Callable[[str], torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        sample_id, load, label = self.items[i]
        return self.transform(load()), label, sample_id


class SyntheticDataset(Dataset):
    """Seeded random tensors: the same seed gives the same samples, in any order of access."""

    model_labels = True  # labels are drawn from range(num_classes): class indices of the model, as target=label uses

    def __init__(self, shape: list[int], count: int, num_classes: int, seed: int) -> None:
        self.shape, self.count, self.num_classes, self.seed = shape, count, num_classes, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(self.shape, generator=g)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        return x, label, f"synthetic-{i}"


def build_dataset(cfg: DataConfig, preprocess: Callable | None, seed: int) -> Dataset:
    """The configured data set; `preprocess` (from the model's weights) wins over the standard transform, and
    the model's own input size over the configured one (`sized_for_model`). Unreadable image files are left
    out and listed by `skipped_files` (or fail the run when data.strict)."""
    cfg = sized_for_model(cfg, preprocess)
    build = DATA.for_config(cfg).load()
    dataset = build(cfg, preprocess, seed)
    if cfg.limit is not None:
        dataset = torch.utils.data.Subset(dataset, range(min(cfg.limit, len(dataset))))  # type: ignore[arg-type]
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise RunnerError(
            f"The data set '{cfg.name}' has no samples (limit={cfg.limit}): check data.root / data.dataset, or"
            " remove data.limit."
        )
    return dataset


def underlying(dataset: Dataset) -> Dataset:
    """The data source under any Subsets (data.limit, a shard) that wrap it: the object that holds its attributes."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return dataset


def skipped_files(dataset: Dataset) -> list[str]:
    """The input files the data set left out as unreadable (for the log and the tables' metadata)."""
    dataset = underlying(dataset)
    return list(getattr(dataset, "skipped", []))


def sample_masks(dataset: Dataset) -> Callable[[str], torch.Tensor] | None:
    """The data set's mask of a sample id ((H, W) bool at input resolution), or None when it has no masks."""
    dataset = underlying(dataset)
    return getattr(dataset, "masks", None)


def label_classes(dataset: Dataset) -> tuple[list[str] | None, bool]:
    """(the data set's own names of its labels by index, or None; whether its labels are the model's classes)."""
    dataset = underlying(dataset)
    classes = getattr(dataset, "classes", None)
    if not isinstance(classes, (list, tuple)) or not all(isinstance(c, str) for c in classes):
        classes = None  # e.g. torchvision's ImageNet: a tuple of synonyms per class
    return (list(classes) if classes else None), bool(getattr(dataset, "model_labels", False))


def own_collate(dataset: Dataset) -> Callable | None:
    """A data set's own batching (prompt pairs pad to the longest pair), or None: the loader's default."""
    dataset = underlying(dataset)
    return getattr(dataset, "collate", None)


def pad_collate(samples: list[tuple[torch.Tensor, int, str]]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Stack a batch; images of different sizes (data.resize=none) are padded at the bottom and right to the
    batch's largest height and width with 0, the mean colour once normalised (top-left pixels keep their place)."""
    images = [x for x, _, _ in samples]
    height = max(x.shape[-2] for x in images)
    width = max(x.shape[-1] for x in images)
    padded = [torch.nn.functional.pad(x, (0, width - x.shape[-1], 0, height - x.shape[-2])) for x in images]
    labels = torch.tensor([int(y) for _, y, _ in samples], dtype=torch.int64)  # (B,)
    return torch.stack(padded), labels, [i for _, _, i in samples]  # (B, C, height, width)


class MaskCollate:
    """A collate that appends the samples' masks (B, H, W) bool, looked up by sample id, to (x, labels, ids);
    masks are padded like their images (data.resize=none: bottom and right, outside the region)."""

    def __init__(self, collate: Callable, masks: Callable[[str], torch.Tensor]) -> None:
        self.collate, self.masks = collate, masks

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor]:
        x, labels, ids = self.collate(samples)
        height, width = x.shape[-2:]
        masks = []
        for sample_id, image in zip(ids, x, strict=True):
            mask = self.masks(sample_id)  # (h, w) bool
            if mask.shape[0] > height or mask.shape[1] > width:  # a data set bug: masks follow the photos' geometry
                raise RunnerError(f"The mask of {sample_id} is {tuple(mask.shape)}, its input {tuple(image.shape)}.")
            masks.append(torch.nn.functional.pad(mask, (0, width - mask.shape[1], 0, height - mask.shape[0])))
        return x, labels, list(ids), torch.stack(masks)  # masks (B, height, width)


class RangesSampler(Sampler[int]):
    """The indices of `ranges`, one range after another: one loader's order over a run's shards."""

    def __init__(self, ranges: list[range]) -> None:
        self.ranges = ranges

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.ranges)

    def __len__(self) -> int:
        return sum(len(r) for r in self.ranges)


# Workers a GPU run gets when data.num_workers is null: enough to decode JPEGs ahead of the GPU, few enough
# not to crowd a shared node (each worker holds a copy of the data set's Python state).
GPU_DEFAULT_WORKERS = 4


def loader_settings(cfg: DataConfig, device: torch.device) -> tuple[int, bool]:
    """(num_workers, pin_memory) for `device`: explicit values as given; null workers are 0 on the CPU (the
    model competes with them for the same cores) and min(4, CPUs) on a GPU; null pinning is on for a GPU."""
    on_gpu = device.type == "cuda"
    workers = cfg.num_workers
    if workers is None:
        workers = min(GPU_DEFAULT_WORKERS, available_cpus()) if on_gpu else 0
    return workers, on_gpu if cfg.pin_memory is None else cfg.pin_memory


def make_loader(
    dataset: Dataset, cfg: DataConfig, device: torch.device, sampler: Sampler[int] | None = None
) -> DataLoader:
    """Batches in data set order (or `sampler`'s); workers and pinned memory as `loader_settings` resolves them."""
    num_workers, pin_memory = loader_settings(cfg, device)
    workers = num_workers > 0
    collate: Callable | None = pad_collate if getattr(cfg, "resize", None) is ResizeMode.none else None
    collate = own_collate(dataset) or collate
    masks = sample_masks(dataset)
    if masks is not None:  # localisation masks travel with their batch
        collate = MaskCollate(collate or torch.utils.data.default_collate, masks)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        collate_fn=collate,
        shuffle=False,  # sample order is part of the result's identity (and of resuming)
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=cfg.persistent_workers and workers,
    )


def to_batch(
    raw: tuple[Any, ...],
    device: torch.device,
    first_index: int,
    channels_last: bool = False,
) -> Batch:
    """The loader's (x, labels, ids[, masks]) on the device as a Batch."""
    x, labels, ids, *rest = raw
    non_blocking = device.type == "cuda"  # from pinned memory the copy overlaps with work already queued
    x = x.to(device, non_blocking=non_blocking)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    extras = rest[0] if rest and isinstance(rest[0], dict) else None  # a source's own per-sample tensors
    if extras is not None:
        extras = {k: v.to(device, non_blocking=non_blocking) for k, v in extras.items()}
        rest = []
    masks = rest[0].to(device, non_blocking=non_blocking) if rest else None  # (B, H, W) bool
    return Batch(x, labels.to(device, non_blocking=non_blocking), list(ids), first_index, masks, extras)
