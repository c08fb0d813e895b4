"""What every method shares: the forward pass under the run's precision, target selection, and one
gradient pass that also drives the session's backward and tensor hooks."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import NO_LABEL, Batch
from runner.errors import RunnerError, suggest
from runner.hooks import HookSession
from runner.rows import BatchOutput, Columns, concat_columns, to_host
from runner.runtime import Runtime
from runner.schema import FIXED_TARGETS_NEED_CLASSES, MethodConfig, Precision, TargetMode

log = logging.getLogger(__name__)


class Method:
    """What the run loop asks of a method; each method subclasses this, and registers under its config type.

    `__init__(cfg, layers, runtime)`, then `prepare` and `setup` once, `run_batch` per batch, `finish`
    after the last. The class attributes say what the run must provide and what its console summary shows.
    """

    name: str
    needs_layers: bool = True  # False: runs without `layers.include` (the hooks alone say what is recorded)
    modality: str = "image"  # what its model takes: "image" (a classifier, a segmenter) or "text" (model=hf_lm)
    # Columns of the method's table that the console summary averages per layer (where present).
    summary_values: tuple[str, ...] = ()
    # The method's main table: what `runner.store.reader.load(dir)` returns when no table is named (kept in the manifest).
    table: str
    # Passes over the data (an lm_edges run scores every pair, then evaluates the run's circuits on every pair): each
    # pass is a set of shards (resumed as any shard), `begin_pass` between them.
    passes: int = 1
    # Folders of the run directory the method writes files into besides its tables (lm_cache: `activations`): like
    # `tensors/` and `pictures/`, removed again when a failed single-process run keeps no complete shard.
    side_folders: tuple[str, ...] = ()

    @classmethod
    def check_layout(cls, cfg: MethodConfig, layout: Any, target: Any) -> None:
        """Called before a language model's weights load, with its layout read from its config alone: raise the
        RunnerError that `setup` would raise for `cfg` and the run's `target` (a layer out of range, a site the
        model lacks, a target that scores no tokens). Methods of image models check nothing here."""

    def prepare(self, dataset: Dataset) -> None:
        """Called once before `setup` with the whole data set (patching pairs a sample with another one)."""

    def setup(self, session: HookSession, num_samples: int) -> None:
        """Called once before the first batch: register captures and replacements, check targets."""

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        """The method's rows for one batch."""
        raise NotImplementedError

    def begin_pass(self, number: int, read: Callable[[str], pd.DataFrame | None]) -> None:
        """Called before pass `number` (1 ...) of a method of several `passes` over the data, once the passes before it
        are written: `read(table)` gives their rows of a table (every shard's, also those of a run this one resumes)."""

    def final_tables(self, read: Callable[[str], pd.DataFrame | None]) -> dict[str, Columns]:
        """Called after the last pass: tables about the whole run (rows with sample_index -1), made from the passes'
        rows (`read` as in `begin_pass`). They are written as one shard of their own after the passes' shards."""
        return {}

    def finish(self, out: Path) -> None:
        """Called after every batch ran and the tables are written: raise RunnerError if the run failed a check."""


def run_on_batch(
    method: Method, model: nn.Module, x: torch.Tensor, labels: torch.Tensor | None = None,
    dataset: Dataset | None = None,
) -> BatchOutput:  # fmt: skip
    """A method's tables for one batch `x` (B, C, H, W) of `model`, as the run loop would make them but with no run
    directory, no Hydra and no hooks of the user's: a hook session opened around it and closed (also on an error),
    so the model comes back as it was. `labels` (B,) for target=label; `dataset` for methods that pair samples.
    What the library functions (cam_maps, mprt, activation_patching) run their method through."""
    b = x.shape[0]
    labels = torch.full((b,), NO_LABEL, dtype=torch.long) if labels is None else labels
    return run_prepared(method, model, Batch(x, labels, [str(i) for i in range(b)], 0), dataset)


def run_prepared(method: Method, model: nn.Module, batch: Batch, dataset: Dataset | None = None) -> BatchOutput:
    """`run_on_batch` for a batch already made (the language-model methods' pairs, with their extras); a method of
    several passes runs each on the batch, and its tables are every pass's and its final ones."""
    b = batch.x.shape[0]
    if dataset is not None:
        method.prepare(dataset)
    written: dict[str, list[Columns]] = {}

    def read(table: str) -> pd.DataFrame | None:
        """A table's rows so far, with the sample columns the store would add (sample, sample_id)."""
        parts = [as_frame(dict(columns)) for columns in written.get(table, [])]
        if not parts:
            return None
        frame = pd.concat(parts, ignore_index=True)
        local = frame.pop("sample_index").to_numpy() if "sample_index" in frame else np.full(len(frame), -1)
        frame["sample"] = pd.array([i if i >= 0 else None for i in local], dtype="Int64")
        frame["sample_id"] = [batch.sample_ids[i] if i >= 0 else None for i in local]
        return frame

    with HookSession(model, []) as session:
        method.setup(session, b)
        for number in range(method.passes):
            if number:
                method.begin_pass(number, read)
            session.begin_batch(b, 0)
            out = method.run_batch(model, batch, session)
            session.end_batch()
            for table, columns in out.tables.items():
                written.setdefault(table, []).append(columns)
        final = method.final_tables(read)
    tables = {table: concat_columns(parts) for table, parts in written.items()}
    return BatchOutput(predicted=out.predicted, tables={**tables, **final})


def target_fields(target: int | Sequence[int] | torch.Tensor | None) -> dict[str, Any]:
    """A library caller's `target` as method config fields: None the predicted class (the default), a class id
    for every sample, or one class id per sample."""
    if target is None:
        return {}
    ids = torch.as_tensor(target).reshape(-1).tolist()
    return {"target": TargetMode.fixed, "class_ids": [int(i) for i in ids]}


C = TypeVar("C", bound=MethodConfig)


def library_config(config: type[C], **fields: Any) -> C:
    """A method's config from a library caller's keyword fields, checked as a run checks it: strings become their
    enums, a key the config lacks or an out-of-range value is one RunnerError naming it."""
    try:
        built = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config), fields))
    except OmegaConfBaseException as e:
        raise RunnerError(f"{config.__name__}: {str(e).splitlines()[0]}") from None
    bad = built.check()  # type: ignore[union-attr]
    if bad:
        raise RunnerError(f"Out of range: {', '.join(bad)}.")
    return built  # type: ignore[return-value]


def library_runtime(x: torch.Tensor) -> Runtime:
    """How a library call runs: on the input's device, in float32, with no pictures."""
    return Runtime(x.device, Precision.fp32)


def library_token_runtime(device: torch.device, target: str) -> Runtime:
    """`library_runtime` for a language-model method: on `device`, in float32, scoring with the token target named
    `target` (token_logit_diff, ...)."""
    from runner.options.registry import TARGETS
    from runner.targets import build_target

    runtime = Runtime(device, Precision.fp32)
    runtime.target = build_target(TARGETS.get(target).schema())  # type: ignore[attr-defined, call-arg]
    return runtime


def as_frame(columns: Columns) -> pd.DataFrame:
    """A method's columns (tensors, lists, blocks) as a pandas frame on the host, one row per table row."""
    return pd.DataFrame(to_host(columns))


class OnceWarnings:
    """One log line per run and key, naming the first samples concerned (a flag column marks every row)."""

    def __init__(self, method: str, logger: logging.Logger = log) -> None:
        self.method, self.log = method, logger
        self.given: set[str] = set()

    def __call__(self, key: str, flags: torch.Tensor, batch: Batch, message: str) -> None:
        """Warn with `message` the first time `key`'s `flags` (B,) has a sample set."""
        if key in self.given or not bool(flags.any()):
            return
        self.given.add(key)
        ids = [s for s, f in zip(batch.sample_ids, flags.tolist(), strict=False) if f]
        self.log.warning("%s: %s (first: %s)", self.method, message, ", ".join(ids[:5]))


def targets_by_name(cfg: MethodConfig, model_names: list[str] | None) -> MethodConfig:
    """`cfg` with `method.class_names` turned into target=fixed and their class ids (itself when none are given)."""
    if not cfg.class_names:
        return cfg
    if cfg.class_ids:
        raise RunnerError("Give method.class_names or method.class_ids, not both: they both pick the target classes.")
    if cfg.target not in (TargetMode.predicted, TargetMode.fixed):
        raise RunnerError(
            f"method.class_names picks fixed targets; it does not combine with method.target={cfg.target.value}."
        )
    if not model_names:
        raise RunnerError(
            "method.class_names needs the model's class names, and this model has none (random init, a checkpoint"
            " or a `_target_`): set model.class_names=[...] (one per output), or give indices with method.class_ids."
        )
    ids = [_class_id(str(name), model_names) for name in cfg.class_names]
    fixed = copy.copy(cfg)  # the run's config keeps the names (provenance, resume key); the method gets the ids
    fixed.target, fixed.class_ids = TargetMode.fixed, ids
    return fixed


def _class_id(name: str, model_names: list[str]) -> int:
    """The index of the model's class called `name` (exact, else the one case-insensitive match)."""
    hits = [i for i, n in enumerate(model_names) if n == name]
    if not hits:
        hits = [i for i, n in enumerate(model_names) if n.lower() == name.lower()]
    if len(hits) == 1:
        return hits[0]
    if hits:  # ImageNet names 'crane' (the bird and the machine) twice, for one
        raise RunnerError(
            f"method.class_names: '{name}' names {len(hits)} of the model's classes (ids {hits}); pick one with"
            " method.class_ids."
        )
    raise RunnerError(f"method.class_names: the model has no class '{name}'.{suggest(name, model_names)}")


def check_targets(cfg: MethodConfig, num_samples: int) -> None:
    """Fail before any data is loaded when fixed targets cannot match the data set."""
    if cfg.target is TargetMode.fixed:
        if not cfg.class_ids:
            raise RunnerError(FIXED_TARGETS_NEED_CLASSES)
        if len(cfg.class_ids) not in (1, num_samples):
            raise RunnerError(
                f"method.class_ids (or class_names) has {len(cfg.class_ids)} ids but the data set has {num_samples}"
                " samples: give one id for all samples or exactly one per sample."
            )


def select_targets(cfg: MethodConfig, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The class each sample's score is taken for, (B,) int64 on the logits' device."""
    num_classes = logits.shape[1]
    if cfg.target in (TargetMode.predicted, TargetMode.topk):
        return logits.argmax(dim=1)
    if cfg.target is TargetMode.label:
        targets = batch.labels
        if bool((targets == NO_LABEL).any()):
            missing = [s for s, y in zip(batch.sample_ids, targets.tolist(), strict=True) if y == NO_LABEL]
            raise RunnerError(f"method.target=label, but these samples have no label: {', '.join(missing)}.")
    else:
        ids = cfg.class_ids
        if len(ids) == 1:
            targets = torch.full((logits.shape[0],), ids[0], dtype=torch.long, device=logits.device)
        else:
            start = batch.first_index
            targets = torch.tensor(ids[start : start + logits.shape[0]], dtype=torch.long, device=logits.device)
    if bool(((targets < 0) | (targets >= num_classes)).any()):
        raise RunnerError(f"Target class ids {targets.tolist()} are outside the model's {num_classes} classes.")
    return targets


def select_target_sets(cfg: MethodConfig, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(B, K) classes to explain per sample: the top k for target=topk, else one."""
    if cfg.target is TargetMode.topk:
        if not 1 <= cfg.top_k <= logits.shape[1]:
            raise RunnerError(f"method.top_k={cfg.top_k} must be between 1 and the model's {logits.shape[1]} classes.")
        return logits.topk(cfg.top_k, dim=1).indices
    return select_targets(cfg, logits, batch)[:, None]


def forward(
    model: nn.Module, batch: Batch, session: HookSession, runtime: Runtime, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits as float32 (B, K), input x). The input requires grad only when gradient hooks must fire everywhere."""
    x = batch.x
    if session.needs_input_grad:
        x = x.detach().requires_grad_(True)
    grad_mode = torch.enable_grad() if (with_grad or session.needs_input_grad) else torch.no_grad()
    with grad_mode, runtime.autocast():
        logits = model(x)
    if not torch.is_tensor(logits) or logits.dim() != 2:
        raise RunnerError(
            f"The model must return logits of shape (batch, classes); it returned {getattr(logits, 'shape', type(logits))}."
        )
    return logits.float(), x


def gradients(
    score: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    x: torch.Tensor,
    session: HookSession,
    retain_graph: bool = False,
) -> list[torch.Tensor]:
    """d(score)/d(tensors) in one autograd pass, parameters untouched (no .grad is written anywhere).

    When the session holds backward or tensor hooks, the pass continues down to the input so that
    they fire on every hooked module; otherwise it stops at the earliest requested tensor.
    """
    wanted = list(tensors) + ([x] if session.needs_input_grad else [])
    if not wanted:
        return []
    grads = torch.autograd.grad(score.sum(), wanted, allow_unused=True, retain_graph=retain_graph)
    return list(grads[: len(tensors)])
