"""`method=train_sae`, the adapter that runs the library functions of this package in the run loop.

Two passes over the windows (runner/methods/base.py `passes`), then the tables about the whole run:
  1. collection: each training window's activations at the site (activations.py), the forward stopped after the
     site's block, kept in memory by sample index (no rows: the windows table is written by pass 2);
  then training (before pass 2, `begin_pass`): the activations in sample order, trained on (training.py), and the
     dictionary written to <run>/dictionary/ in SAELens's layout (runner/dictionaries/formats.py);
  2. evaluation: each held-out window's three forwards (clean, spliced, zeroed: evaluation.py), its CE values
     written as its row of train_sae_windows (every training window gets a row too, naming its part), its
     activations kept;
  then the final tables: the evaluation (train_sae), the training curve (train_sae_steps) and the latents
     (train_sae_features, features.py), from the held-out activations and the windows' rows read back.
A resumed run reads back the windows' rows its earlier process committed; what is only in memory (a skipped shard's
activations) is collected again, and the dictionary is trained again from the same activations and seed (on the CPU
bit-equal to the first time). A run that is complete trains nothing.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import torch
from torch import nn
from torch.utils.data import Dataset

from runner.data.base import Batch, underlying
from runner.data.text import TextWindows
from runner.dictionaries.formats import save_saelens
from runner.distributed import rank_and_world
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import Layer
from runner.methods.lm.base import LanguageModelMethod
from runner.methods.train_sae.activations import SiteReader, check_buffer
from runner.methods.train_sae.evaluation import WINDOWS_TABLE, reconstruction, recovered, spliced_losses
from runner.methods.train_sae.features import FEATURES_TABLE, feature_columns
from runner.methods.train_sae.training import STEPS_TABLE, Trained, Training, train_dictionary
from runner.models.check import available_bytes
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of, unembedding
from runner.options.method.train_sae import TrainSaeConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns
from runner.runtime import Runtime
from runner.tables import Presentation, declare

log = logging.getLogger(__name__)

FOLDER = "dictionary"  # the run directory's folder of the trained dictionary
COLLECT_BATCH = 8  # windows per forward when a resumed run collects what a skipped shard collected
# TransformerLens's names of the sites (SAELens's cfg.json `hook_name`)
HOOK_NAMES = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
              "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out"}  # fmt: skip


TABLE = "train_sae"  # the evaluation, one row per dictionary: the run's main table

EVALUATION = declare(
    TABLE,  # one row per dictionary: the run's main table
    [
        pa.field("site", pa.string()),  # resid_pre, resid_mid, resid_post, attn_out, mlp_out
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("hook_name", pa.string()),  # the site in TransformerLens's names, as SAELens's cfg.json says it
        pa.field("architecture", pa.string()),  # topk | jumprelu
        pa.field("width", pa.int64()),  # latents
        pa.field("k", pa.int64()),  # topk's latents per position; null for jumprelu
        pa.field("d_in", pa.int64()),  # the site's width
        pa.field("steps", pa.int64()),  # training steps (method.steps)
        pa.field("batch_tokens", pa.int64()),  # activations per step (at most the training set)
        pa.field("train_positions", pa.int64()),  # activations trained on (the training windows' positions)
        pa.field("heldout_positions", pa.int64()),  # activations evaluated on
        pa.field("scale", pa.float64()),  # s: the dictionary reads s x (mean |s x| = sqrt(d_in) over the training set)
        pa.field("fvu", pa.float64()),  # sum |x - x_hat|^2 / sum |x - mean x|^2 over the held-out positions
        pa.field("fvu_without_massive", pa.float64()),  # the FVU of the positions whose |x| is under 10 x the median
        pa.field("massive_positions", pa.int64()),  # held-out positions whose |x| is above 10 x the median |x|
        pa.field("mse", pa.float64()),  # the mean over held-out positions of |x - x_hat|^2 (the site's own units)
        pa.field("l0", pa.float64()),  # the mean number of latents with f > 0 per held-out position
        pa.field("dead", pa.int64()),  # latents that fire at no held-out position
        pa.field("dead_fraction", pa.float64()),  # dead / width
        pa.field("dense", pa.int64()),  # latents that fire at more than 10% of the held-out positions
        pa.field("dense_fraction", pa.float64()),  # dense / width
        pa.field("ce_clean", pa.float64()),  # the model's next-token CE (nats) on the held-out windows
        pa.field("ce_sae", pa.float64()),  # with the site replaced by the reconstruction (no error term)
        pa.field("ce_zero", pa.float64()),  # with the site replaced by zeros
        pa.field("ce_recovered", pa.float64()),  # (ce_zero - ce_sae) / (ce_zero - ce_clean); NaN where degenerate
        pa.field("degenerate", pa.bool_()),  # |ce_zero - ce_clean| < 1e-6: no recovered share
        pa.field("final_loss", pa.float64()),  # the training loss of the last step
        pa.field("train_seconds", pa.float64()),  # the training's wall time (not the collection's or evaluation's)
        pa.field("dictionary", pa.string()),  # its folder (SAELens's layout), relative to the run directory
    ],
    Presentation(
        keys=("site",), values=("fvu", "l0", "ce_recovered"), section="runner.viz.dictionary_report:evaluation_section"
    ),
    classes=False,
)


def hook_name(site: str, layer: int) -> str:
    """The site in TransformerLens's names: blocks.<layer>.hook_<site>."""
    return f"blocks.{layer}.{HOOK_NAMES[site]}"


class TrainSae(LanguageModelMethod):
    name = "train_sae"
    table = TABLE
    summary_values = ("fvu", "l0", "ce_recovered")
    passes = 2  # collection, then evaluation (module docstring)
    samples = "windows"  # windows of plain text (data=text), not prompt pairs
    side_folders = (FOLDER,)
    cfg: TrainSaeConfig

    def __init__(self, cfg: TrainSaeConfig, layers: list[Layer], runtime: Runtime) -> None:
        super().__init__(cfg, layers, runtime)
        self.train_acts: dict[int, torch.Tensor] = {}  # sample index -> (T - first, d) of a training window
        self.heldout_acts: dict[int, torch.Tensor] = {}  # the same of a held-out window
        self.trained: Trained | None = None
        self.complete = False  # the run resumed was complete: nothing is trained or evaluated again

    @classmethod
    def planned(cls, cfg: TrainSaeConfig, layout: LanguageModelLayout, target: Any) -> SiteSpec:
        """The site read; refused: a layer out of range, a site the family lacks (resid_mid of parallel blocks)."""
        layer = layout.block_layers([cfg.layer], "method.layer")[0]
        return layout.site(cfg.site, layer)

    def prepare(self, dataset: Dataset) -> None:
        super().prepare(dataset)
        source = underlying(dataset)
        if not isinstance(source, TextWindows):
            raise RunnerError("method=train_sae trains on windows of plain text: use data=text.")
        self.source, self.first = source, int(source.bos)
        count = len(dataset)  # type: ignore[arg-type]
        self.heldout = [i for i in range(count) if i in source.held_out]
        self.training = [i for i in range(count) if i not in source.held_out]
        if not self.heldout or not self.training:
            raise RunnerError(
                f"method=train_sae trains on some windows and evaluates on others; these {count} windows give"
                f" {len(self.training)} to train on and {len(self.heldout)} held out: set data.holdout between 0 and 1"
                " (0.1: a tenth held out) and give at least two windows."
            )

    def setup(self, session: HookSession, num_samples: int) -> None:
        if rank_and_world()[1] > 1:
            raise RunnerError("method=train_sae trains one dictionary in one process: run it without torchrun.")
        if self.runtime.output_dir is None:
            raise RunnerError(
                "method=train_sae writes its dictionary into a run directory: run it with python -m runner."
            )
        model = session.model
        self.model, self.layout = model, layout_of(model)
        self.spec = self.planned(self.cfg, self.layout, self.runtime.target)
        self.reader = SiteReader(model, self.layout, self.spec, session)
        self.d_in = int(model.get_input_embeddings().weight.shape[1])
        positions = len(self.dataset) * (self.source.windows.shape[1] - self.first)  # type: ignore[arg-type]
        check_buffer(positions, self.d_in, self.cfg.width, self.cfg.batch_tokens, available_bytes(self.runtime.device))

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        ids, held = batch.x, self._held(batch)
        predicted = torch.full((ids.shape[0],), -1, dtype=torch.long)  # no class: the windows' rows have none
        if self.trained is None:  # pass 1: collect the training windows
            rows = [b for b in range(ids.shape[0]) if not held[b]]
            if rows:
                with self.runtime.autocast():
                    acts = self.reader.read(ids[rows])  # (R, T, d)
                for r, b in enumerate(rows):
                    self.train_acts[batch.first_index + b] = acts[r, self.first :].clone()
            return BatchOutput(predicted=predicted)
        return BatchOutput(predicted=predicted, tables={WINDOWS_TABLE: self._evaluated(batch, held)})

    def _held(self, batch: Batch) -> list[bool]:
        if batch.x.dim() != 2 or batch.extras is None or "held_out" not in batch.extras:
            raise RunnerError("method=train_sae takes windows of text: use data=text.")
        return batch.extras["held_out"].tolist()

    def _evaluated(self, batch: Batch, held: list[bool]) -> Columns:
        """The batch's rows of train_sae_windows: the held-out windows' losses (their activations kept), the part of
        every window."""
        ids = batch.x
        rows = [b for b in range(ids.shape[0]) if held[b]]
        found: dict[int, dict[str, float]] = {}
        if rows:
            assert self.trained is not None
            within_batch(0.0, f"train_sae: 3 forwards of {len(rows)} held-out windows")
            with self.runtime.autocast():
                losses = spliced_losses(self.reader, self.dictionary, ids[rows], self.first)
            for r, b in enumerate(rows):
                acts = losses.acts[r]  # (T - first, d)
                self.heldout_acts[batch.first_index + b] = acts
                with torch.no_grad():
                    f = self.dictionary.encode(acts)  # (T - first, W)
                    error = (acts - self.dictionary.decode(f, acts)).pow(2).sum(-1).mean()
                found[b] = {"ce_clean": float(losses.clean[r]), "ce_sae": float(losses.sae[r]),
                            "ce_zero": float(losses.zero[r]), "mse": float(error),
                            "l0": float((f > 0).sum(-1).float().mean())}  # fmt: skip
        count = ids.shape[0]
        columns: Columns = {
            "sample_index": torch.arange(count),
            "split": ["held_out" if held[b] else "train" for b in range(count)],
            "positions": torch.full((count,), ids.shape[1] - self.first),
        }
        for key in ("ce_clean", "ce_sae", "ce_zero", "mse", "l0"):
            columns[key] = pa.array([found[b][key] if b in found else None for b in range(count)], pa.float64())
        return columns

    def begin_pass(self, number: int, read: Callable[[str], pd.DataFrame | None]) -> None:
        """Before the evaluation: the training activations (those of skipped shards collected again) trained on, and
        the dictionary written."""
        if read(self.table) is not None:  # the final tables are committed: the run was complete
            self.complete = True
            return
        self._collect(self.training, self.train_acts)
        acts = torch.cat([self.train_acts.pop(i) for i in self.training])  # (N, d) in sample order
        training = Training.of(self.cfg, self.source.seed)
        log.info("train_sae: %s of width %d on %d activations of %s (d_in %d), %d steps of %d", self.cfg.architecture,
                 self.cfg.width, acts.shape[0], self.spec.name, acts.shape[1], training.steps,
                 min(training.batch_tokens, acts.shape[0]))  # fmt: skip
        self.trained = train_dictionary(acts, training, self._report)
        del acts
        self.dictionary = self.trained.dictionary.to(self.runtime.device)
        self._write(self.trained)
        log.info("train_sae: trained in %.1f s; the dictionary is in %s", self.trained.seconds,
                 self.runtime.output_dir / FOLDER if self.runtime.output_dir else FOLDER)  # fmt: skip

    def _report(self, step: int, values: dict[str, float]) -> None:
        note = (f"train_sae: step {step + 1}/{self.cfg.steps}, loss {values['loss']:.4g}, fvu {values['fvu']:.3f},"
                f" l0 {values['l0']:.1f}, dead {int(values['dead'])}")  # fmt: skip
        within_batch(0.0, note)
        log.info(note)

    def _collect(self, indices: list[int], into: dict[int, torch.Tensor]) -> None:
        """The activations of the windows `indices` that `into` lacks (a resumed run's skipped shards), collected."""
        missing = [i for i in indices if i not in into]
        if missing:
            log.info("train_sae: collecting the activations of %d windows an earlier process ran", len(missing))
        for start in range(0, len(missing), COLLECT_BATCH):
            part = missing[start : start + COLLECT_BATCH]
            ids = torch.stack([self.dataset[i][0] for i in part]).to(self.runtime.device)  # type: ignore[index]
            with self.runtime.autocast():
                acts = self.reader.read(ids)  # (B, T, d)
            for r, i in enumerate(part):
                into[i] = acts[r, self.first :].clone()

    def _write(self, trained: Trained) -> None:
        """The dictionary in SAELens's layout, at <run>/dictionary (written beside it, then renamed into place)."""
        out = self.runtime.output_dir
        assert out is not None
        extra = {"runner_site": self.spec.kind, "runner_layer": self.spec.layer, "trained_by": "runner method=train_sae",
                 "context_size": int(self.source.windows.shape[1]), "prepend_bos": bool(self.source.bos),
                 "exclude_special_tokens": bool(self.source.bos), "seed": self.source.seed,
                 "normalisation_scale": trained.dictionary.spec.scale}  # fmt: skip
        model_name = Path(str(getattr(self.model.config, "_name_or_path", "") or "model")).name
        temporary = out / f".{FOLDER}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            save_saelens(trained.dictionary, temporary, hook_name(self.spec.kind, self.spec.layer), model_name, extra)
            shutil.rmtree(out / FOLDER, ignore_errors=True)
            temporary.rename(out / FOLDER)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)

    def final_tables(self, read: Callable[[str], pd.DataFrame | None]) -> dict[str, Columns]:
        if self.complete:
            return {}
        assert self.trained is not None
        self._collect(self.heldout, self.heldout_acts)
        x = torch.cat([self.heldout_acts[i] for i in self.heldout])  # (N_held, d) in sample order
        rec = reconstruction(self.dictionary, x)
        windows = read(WINDOWS_TABLE)
        held = windows[windows["split"] == "held_out"] if windows is not None else pd.DataFrame()
        weights = held["positions"] - 1 if len(held) else pd.Series(dtype=float)  # predictions per window
        ce = {key: float((held[key] * weights).sum() / weights.sum()) if len(held) else float("nan")
              for key in ("ce_clean", "ce_sae", "ce_zero")}  # fmt: skip
        share, degenerate = recovered(ce["ce_clean"], ce["ce_sae"], ce["ce_zero"])
        if degenerate:
            log.warning("train_sae: zeroing %s changes the loss by less than 1e-6 nats: ce_recovered is NaN",
                        self.spec.name)  # fmt: skip
        curve = self.trained.curve
        evaluation = {
            "site": [self.spec.kind], "layer": [self.spec.layer], "hook_name": [hook_name(self.spec.kind, self.spec.layer)],
            "architecture": [self.cfg.architecture], "width": [self.cfg.width],
            "k": pa.array([self.cfg.k if self.cfg.architecture == "topk" else None], pa.int64()),
            "d_in": [self.d_in], "steps": [self.cfg.steps], "batch_tokens": [self.cfg.batch_tokens],
            "train_positions": [len(self.training) * (self.source.windows.shape[1] - self.first)],
            "heldout_positions": [rec.positions], "scale": [self.trained.dictionary.spec.scale],
            "fvu": [rec.fvu], "fvu_without_massive": [rec.fvu_without_massive],
            "massive_positions": [rec.massive], "mse": [rec.mse], "l0": [rec.l0], "dead": [rec.dead],
            "dead_fraction": [rec.dead / self.cfg.width], "dense": [rec.dense],
            "dense_fraction": [rec.dense / self.cfg.width], **{key: [value] for key, value in ce.items()},
            "ce_recovered": [share], "degenerate": [degenerate], "final_loss": [curve["loss"][-1]],
            "train_seconds": [self.trained.seconds], "dictionary": [FOLDER],
        }  # fmt: skip
        log.info("train_sae: held out, fvu %.4f (%.4f without %d massive positions), l0 %.1f, dead %d, dense %d, CE"
                 " clean %.4f, spliced %.4f, zeroed %.4f: %.1f%% recovered", rec.fvu, rec.fvu_without_massive,
                 rec.massive, rec.l0, rec.dead, rec.dense, ce["ce_clean"], ce["ce_sae"], ce["ce_zero"],
                 100 * share)  # fmt: skip
        steps = {key: pa.array(values, pa.int64() if key in ("step", "dead") else pa.float64())
                 for key, values in curve.items()}  # fmt: skip
        windows_ids = [self.dataset[i][0].tolist() for i in self.heldout]  # type: ignore[index]
        sample_ids = [self.dataset[i][2] for i in self.heldout]  # type: ignore[index]
        features = feature_columns(self.dictionary, x, windows_ids, sample_ids, self.first, self.source.tokenizer,
                                   unembedding(self.model).weight, rec.fires, self.cfg.contexts,
                                   self.cfg.logit_tokens)  # fmt: skip
        every = {TABLE: evaluation, STEPS_TABLE: steps, FEATURES_TABLE: features}
        return {
            table: {"sample_index": torch.full((_rows(columns),), -1), **columns} for table, columns in every.items()
        }


def _rows(columns: Columns) -> int:
    first = next(iter(columns.values()))
    return len(first)
