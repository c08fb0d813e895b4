"""`run(cfg)`: the whole experiment as a plain function (the CLI and the tests both call it).

config -> model, layers, hooks, method (all checked before any data is loaded) -> data -> per batch:
hooks fire, the method computes rows -> Parquet tables in the output dir -> a per-layer summary.

This module holds the run plan: the device, the output directory and its lock, the shards this process
runs and those a resume skips, and what a failure keeps. The batch loop with its Ctrl-C and out-of-memory
handling is runner/loop.py; the id columns on every row, runner/ids.py; the console summary, runner/viz/summary.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from runner import distributed
from runner.configure import to_run_config
from runner.data.base import build_dataset, skipped_files
from runner.data.images import sized_for_model
from runner.data.prompts import kept_pairs
from runner.errors import RunnerError
from runner.hooks import BoundHook, HookSession
from runner.ids import ClassNames, run_columns, run_rows
from runner.layers import Layer, check_selection, expand_auto, layer_order, probe_input, resolve_layers
from runner.loop import ShardLoop, interrupted, run_loader, run_shard, shard_batches, stop_on_signals
from runner.methods import Runtime, build_method, method_class
from runner.models import build_model, check_input, check_positions, model_layout
from runner.options.registry import DATA, lm_method_names
from runner.plan import check_memory
from runner.progress import run_progress
from runner.schema import RunConfig
from runner.store.layout import check_writable
from runner.store.provenance import provenance, resume_key
from runner.store.reader import committed
from runner.store.writer import DirectoryLock, ShardedWriter, write_failure
from runner.targets import build_target
from runner.viz.summary import summarise

if TYPE_CHECKING:  # the run drives any method through the protocol; it imports none
    from runner.methods.base import Method

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """Where a run wrote its results, and each table's folder of shard files."""

    output_dir: Path
    tables: dict[str, Path]


def resolve_device(name: str) -> torch.device:
    """The torch device for `device=` (auto: CUDA when there is one); a CUDA device without a GPU is refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunnerError(f"device={name} was asked for, but no CUDA GPU is available. Use device=auto or device=cpu.")
    try:
        return torch.device(name)
    except RuntimeError:
        raise RunnerError(f"Unknown device '{name}'. Use auto, cpu, cuda or cuda:N.") from None


def _pictures_on(config: RunConfig) -> bool:
    """Pictures as configured; by default on for a single run, off in a sweep (one PNG per sample per job adds up)."""
    if config.method.pictures is not None:
        return config.method.pictures
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN)


def _default_output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise RunnerError("No output directory: pass output_dir to run(), or set output.dir=PATH.")
    return Path(HydraConfig.get().runtime.output_dir)


def _bind_hooks(model: torch.nn.Module, config: RunConfig, target_layers: list[Layer] | None) -> list[BoundHook]:
    bound = []
    for i, spec in enumerate(config.hooks or []):
        if spec.layers:
            layers = resolve_layers(model, spec.layers, where=f"hooks[{i}].layers")
        elif target_layers is not None:
            layers = target_layers
        else:
            raise RunnerError(
                f"hooks[{i}] names no layers and `layers.include` is empty: give the hook `layers: [...]`."
            )
        bound.append(BoundHook(spec, layers))
    return bound


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads at `count` inside, the caller's count restored after (a notebook, a test session)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(cfg: DictConfig | RunConfig, output_dir: str | Path | None = None) -> RunResult:
    """Run one experiment into `output_dir` (default: Hydra's run dir); resume it if that holds an unfinished
    run of the same config and inputs. Bad input raises RunnerError before anything is written; a failure
    later keeps only complete shards. One run writes a directory at a time: a second one is refused."""
    config = to_run_config(cfg)
    # The configured thread count, whoever started this process: joblib's workers and torchrun's ranks are given
    # one thread by their launchers, and sums split another way round differently (results would then depend on it).
    with torch_threads(config.threads):
        return _run(config, output_dir)


def _run(config: RunConfig, output_dir: str | Path | None) -> RunResult:
    """`run` with the config typed and its thread count set."""
    out = Path(output_dir or config.output.dir or _default_output_dir())
    check_writable(out)
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    if device.type == "cuda" and distributed.rank_and_world()[1] > 1:
        device = distributed.local_cuda_device()  # torchrun: one GPU per process (more processes: refused here)
        torch.cuda.set_device(device)
    with distributed.process_group(device, config.distributed_timeout_minutes):  # left also on a failure
        out = distributed.shared_directory(out)
        lock = DirectoryLock(out)
        refusal = None
        if distributed.rank_and_world()[0] == 0:  # rank 0 holds the lock for all ranks of a torchrun
            try:
                lock.acquire()
            except RunnerError as e:
                refusal = str(e)
        refusal = distributed.from_rank0(refusal)
        if refusal is not None:
            raise RunnerError(refusal)
        try:
            result = _run_locked(config, out, device)
        finally:
            lock.release()
        if config.report and distributed.rank_and_world()[0] == 0:  # after the lock: the page says "complete"
            from runner.viz.report import write_after_run

            write_after_run(out)  # a failure here only warns: the results are committed
        if distributed.rank_and_world()[0] == 0:
            _say_where(out, report_written=config.report)
        return result


def _say_where(out: Path, report_written: bool) -> None:
    """The run's last lines: where its results are, and how to open its report and load its tables (in a sweep's
    job, the sweep's: one report and one table for every job)."""
    sweep = out.parent if (out.parent / "multirun.yaml").is_file() else None
    log.info("results: %s%s", out, f" (sweep {sweep})" if sweep else "")
    where, whose = (sweep, " (every job's)") if sweep else (out, "")
    if not report_written:  # report=true has just said where its page is
        log.info("report%s: runner report %s", whose, shlex.quote(str(where)))
    log.info("tables%s: from runner.results import load; load(%s)", whose, json.dumps(str(where)))


def _run_locked(config: RunConfig, out: Path, device: torch.device) -> RunResult:
    """`run` once this process (or its rank 0) holds the output directory's lock."""
    runtime = Runtime(device, config.precision, out / "pictures" if _pictures_on(config) else None, config.figures,
                      output_dir=out)  # fmt: skip
    runtime.target = build_target(config.target)  # a `_target_` function that does not import fails here
    if method_class(config.method).modality == "text":  # before the model's weights load
        _refuse_layer_selection(config)
        _check_samples(config)
        config = _lightened(config)
        _check_layout(config, runtime.target)
        check_memory(config, device)  # a run whose planned peak exceeds the free memory: refused here

    bundle = build_model(config.model)
    runtime.class_names = bundle.categories  # pictures title the class explained by its name
    text = bundle.tokenizer is not None  # a language model: its data is prompt pairs, its layers named sites
    _check_modality(config, "text" if text else "image")
    if text and getattr(bundle.model, "hf_device_map", None):
        model = bundle.model  # spread over devices by model.device_map: each part stays where accelerate put it
    else:
        model = bundle.model.to(device)
    if config.channels_last and not text:
        model = model.to(memory_format=torch.channels_last)
    if text:
        return _run_text(config, out, device, runtime, bundle.tokenizer, model)
    # The model's own input size where it has one (an image processor's, timm's data config): every source's.
    config = dataclasses.replace(config, data=sized_for_model(config.data, bundle.preprocess))
    probe = probe_input(config.data, bundle.preprocess)  # one input of the run's size, no data loaded
    config = expand_auto(config, model, probe)  # layers.include=auto: chosen for this model, logged
    target_layers = (
        resolve_layers(model, config.layers.include, config.layers.exclude) if config.layers.include else None
    )
    if target_layers is None and method_class(config.method).needs_layers:
        raise RunnerError(f"method={config.method.name} needs target layers: set layers.include=[...] or auto.")
    hooks = _bind_hooks(model, config, target_layers)
    # One dry forward: a selected module the forward never calls fails now, named with the entry that chose it.
    sources = {name: f"hooks[{i}].layers" for i, bound in enumerate(hooks) for name, _ in bound.layers}
    sources.update({name: "layers.include" for name, _ in target_layers or []})
    hooked = [*(target_layers or []), *(layer for bound in hooks for layer in bound.layers)]
    check_selection(model, hooked, probe, sources)
    # Targets by name (method.class_names) become class ids here, before any data loads.
    method = build_method(config.method, target_layers or [], runtime, bundle.categories)

    dataset = build_dataset(config.data, bundle.preprocess, config.seed)
    class_names = ClassNames.of(config.data, dataset, bundle.categories)  # label_name, predicted_name, target_name
    # One forward: a shape the model refuses fails here.
    check_input(model, dataset[0][0], config.data.batch_size, device)
    return _run_prepared(config, out, device, runtime, model, hooks, method, dataset, class_names)


def _run_prepared(
    config: RunConfig, out: Path, device: torch.device, runtime: Runtime, model: torch.nn.Module,
    hooks: list[BoundHook], method: Method, dataset: Dataset, class_names: ClassNames,
) -> RunResult:  # fmt: skip
    """The shards of a run whose model, hooks, method and data are built and checked: resumed, run, written."""
    method.prepare(dataset)
    rank, world = distributed.rank_and_world()
    shard_samples = config.output.shard_batches * config.data.batch_size
    num_shards = -(-len(dataset) // shard_samples)  # per pass over the data
    passes = method.passes
    # A method of several passes: pass p's shards are numbered after the passes' before it, then one shard of the
    # tables about the whole run (`final_tables`), written by rank 0.
    final_shard = passes * num_shards if passes > 1 else None
    run_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    id_columns = run_columns(config, run_id)
    key, details = resume_key(config, shard_samples, len(dataset))
    writer = ShardedWriter(out, provenance(config, run_id, skipped_files(dataset)), key, rank, details=details,
                           layer_order=layer_order(model), main_table=method.table,
                           shards_total=None if final_shard is None else final_shard + 1)  # fmt: skip
    done = writer.resume()  # complete shards whose files are intact; a damaged one runs again
    mine = [s for s in range(num_shards) if s % world == rank and s not in done]
    later = [[p * num_shards + s for s in range(num_shards) if s % world == rank and p * num_shards + s not in done]
             for p in range(1, passes)]  # fmt: skip
    if done:
        log.info("resuming %s: %d of %d shards complete, %d to run here", out, len(done),
                 num_shards if final_shard is None else final_shard + 1, len(mine) + sum(map(len, later)))  # fmt: skip
    log.info(
        "run %s: %s on %s, %d samples, device %s", run_id, config.method.name, id_columns["model"], len(dataset), device
    )
    # A method's own folders only in a single process: another rank may still be writing into them.
    own = [out / folder for folder in method.side_folders] if world == 1 else []
    side_dirs = [d for d in (out / "tensors", runtime.pictures_dir, *own) if d is not None and not d.exists()]
    try:
        with HookSession(model, hooks, out / "tensors") as session, stop_on_signals() as stop:
            method.setup(session, len(dataset))
            total = sum(
                shard_batches(s % num_shards, shard_samples, len(dataset), config) for s in mine + sum(later, [])
            )
            with run_progress(total, config.name, config.progress) as progress:  # a step per batch
                for number, shards in enumerate([mine, *later]):
                    if number:
                        distributed.barrier()  # every rank's shards of the pass before are written
                        method.begin_pass(number, lambda table: committed(out, table))
                    local = [s % num_shards for s in shards]  # the data set's shards this pass runs
                    batches = iter(run_loader(dataset, local, shard_samples, config, device))  # one loader a pass
                    loop = ShardLoop(config, device, dataset, shard_samples, model, method, session, writer,
                                     id_columns, class_names, stop, batches, progress)  # fmt: skip
                    for shard in shards:
                        writer.begin_shard(shard)
                        run_shard(shard % num_shards, loop)
                        writer.commit_shard()
            if final_shard is not None:
                distributed.barrier()
                tables = method.final_tables(lambda table: committed(out, table))
                if rank == 0 and final_shard not in done:
                    writer.begin_shard(final_shard)
                    writer.submit(run_rows(tables, id_columns))
                    writer.commit_shard()
            writer.finish()
            writer.close()
    except BaseException as error:
        writer.abort_shard()
        writer.close()
        if world == 1:  # a sidecar half-written when the run failed (one writer per directory: none is live)
            for stale in (out / "tensors").glob("*.tmp"):
                stale.unlink(missing_ok=True)
        kept = _complete_shards(writer)
        if not kept:  # nothing to resume: leave nothing behind
            for directory in side_dirs:
                shutil.rmtree(directory, ignore_errors=True)
        clear = write_failure(error, out)
        if clear is not None:
            raise clear from None
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C or SIGTERM: stopped at once, one line
            raise interrupted(
                "Stopped at once.", f"{len(kept)} complete shard(s) are kept in {out}; the shard in progress is discarded.",
                out,
            ) from None  # fmt: skip
        raise
    method.finish(out)  # a method's final check (hook_check's tolerance) fails the run after its tables are written
    distributed.barrier()
    tables = writer.tables()
    if rank == 0:
        summarise(tables, {method.table: method.summary_values})
    return RunResult(out, tables)


def _refuse_layer_selection(config: RunConfig) -> None:
    """A language-model method picks its own layers and sites: a layers.include/exclude would be silently unused."""
    include, exclude = list(config.layers.include), list(config.layers.exclude)
    if include in ([], ["auto"]) and not exclude:
        return
    chosen = f"layers.exclude={exclude}" if include in ([], ["auto"]) else f"layers.include={include}"
    selection = config.method.selection()
    settings = selection.settings() if selection is not None else ""
    own = f"its own sites, chosen by {settings}" if settings else "its own sites, in every layer"
    raise RunnerError(
        f"{chosen} selects modules for image methods; method={config.method.name} reads {own}."
        " Leave layers.include at its default."
    )


def _lightened(config: RunConfig) -> RunConfig:
    """debug=light (config.light): the method made light for the model's layer count, read from its config alone."""
    if not config.light:
        return config
    layout = model_layout(config.model)
    if layout is None:
        return config
    method = config.method.lightened(layout.layers)
    if method != config.method:
        log.info("debug=light: %s", _changed(config.method, method))
    return dataclasses.replace(config, method=method)


def _changed(before: Any, after: Any, prefix: str = "method") -> str:
    """The fields of two configs of one dataclass that differ, `key=new` each (nested configs by their path)."""
    parts = []
    for f in dataclasses.fields(before):
        old, new = getattr(before, f.name), getattr(after, f.name)
        if old == new:
            continue
        if dataclasses.is_dataclass(old):
            parts.append(_changed(old, new, f"{prefix}.{f.name}"))
        else:
            parts.append(f"{prefix}.{f.name}={new}")
    return ", ".join(parts)


def _check_layout(config: RunConfig, target: Any) -> None:
    """A language-model method's layers, sites and target checked against the model's layout, read from its config
    alone: the same checks as the method's setup, before any weights load (an image model: checked once built)."""
    layout = model_layout(config.model)
    if layout is not None:
        method_class(config.method).check_layout(config.method, layout, target)


def _check_modality(config: RunConfig, model_kind: str) -> None:
    """One message when the model, the method and the data are not all image or all text."""
    method_kind = method_class(config.method).modality
    data_kind = getattr(type(config.data), "MODALITY", "image")
    if method_kind == model_kind == data_kind:
        return
    if model_kind == "text":
        raise RunnerError(
            f"model.source={config.model.source} is a language model: it takes a method for language models"
            f" (method={' | '.join(lm_method_names())}) and data=prompts (not method={config.method.name},"
            f" data={config.data.name})."
        )
    raise RunnerError(
        f"method={config.method.name} and data={config.data.name} need "
        f"{'a language model (model=hf_lm)' if 'text' in (method_kind, data_kind) else 'an image model'}; the run's"
        f" model is an image model, so use an image method and data (e.g. method=gradcam data=skimage_photos)."
    )


def _samples(source: type) -> str:
    """What a sample of a text source is: "pairs" (prompt pairs, where the source says nothing) or "windows"."""
    return getattr(source, "SAMPLES", "pairs")


def _check_samples(config: RunConfig) -> None:
    """Before the weights load: a language-model method reads prompt pairs (the default) or windows of plain text
    (its class's `samples`), and the run's text data must give that kind (its schema's `SAMPLES`)."""
    if getattr(type(config.data), "MODALITY", "image") != "text":
        return  # image data: `_check_modality` says so once the model is known
    wanted = getattr(method_class(config.method), "samples", "pairs")
    given = _samples(type(config.data))
    if wanted != given:
        sources = [
            o.name for o in DATA if getattr(o.schema, "MODALITY", "image") == "text" and _samples(o.schema) == wanted
        ]
        raise RunnerError(
            f"method={config.method.name} reads {wanted} of text (data={' | '.join(sources)}), and data={config.data.name}"
            f" gives {given}."
        )


def _run_text(
    config: RunConfig, out: Path, device: torch.device, runtime: Runtime, tokenizer: Any, model: torch.nn.Module
) -> RunResult:
    """`_run_locked` for a language model: prompt pairs from its tokenizer, no image checks, the same store."""
    hooks = _bind_hooks(model, config, None) if config.hooks else []
    method = build_method(config.method, [], runtime, None)
    dataset = build_dataset(config.data, tokenizer, config.seed)
    check_positions(model, dataset)  # before any forward: a prompt longer than the model's positions
    if _samples(type(config.data)) == "pairs":
        dataset = kept_pairs(model, dataset, config.data, device)  # data.keep: the pairs the model gets right
    class_names = ClassNames.of(config.data, dataset, None)
    return _run_prepared(config, out, device, runtime, model, hooks, method, dataset, class_names)


def _complete_shards(writer: ShardedWriter) -> set[int]:
    """The shards the manifests list, or none when a manifest cannot be read (the run is failing anyway)."""
    try:
        return writer.completed_shards()
    except RunnerError:
        return set()
