"""`method=lm_cache`: an activation cache of a causal language model. One forward without gradient per batch of pairs
keeps every chosen site at every chosen layer (the patching engine's hooks, runner/hooks/sites.py: the very tensors
`lm_patching` reads and replaces) on each pair's clean prompt, and writes them to disk before the next batch runs.

Files: one safetensors file per batch, `activations/batch-<its first sample index>.safetensors` in the run directory
(an out-of-memory split's halves, and each rank's batches, get their own), one tensor per (pair, site, layer) under
the key `<site>.<layer>/<sample>` (sample: the pair's index in the data set). Each tensor holds the pair's real
positions only, the batch's left padding removed on every position axis: (T, d_model) for the stream and branch
sites, (T, heads, head size) for `head`, `q`, `k`, `v` (`k`, `v`: the key-value heads), (T, heads, T) for `pattern`
(query, head, key); T is the pair's length, its BOS included (`positions: last`: 1, the last position, and the
pattern's every key). Always float32: a bfloat16 or float16 model's activations widen exactly.

The index table `lm_cache` has one row per (pair, site, layer): the file (relative to the run directory), the key,
the shape, the pair's tokens at the stored positions. A file is complete (written under a temporary name, then
renamed) before its rows are handed to the table writer, which commits them with their shard: a stopped or killed
run leaves no row that names a missing or partial file (at most files that no row names yet, which the resumed run
writes again). `runner.results.load_activations(run_dir)` reads the cache back (runner/store/activations.py).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import LanguageModelMethod, forward_last
from runner.methods.lm.cells import taken_views
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of
from runner.options.method.lm_cache import LmCacheConfig
from runner.progress import within_batch
from runner.rows import BatchOutput, Columns
from runner.site_kinds import Positions
from runner.store.layout import temp_name
from runner.tables import Presentation, declare

FOLDER = "activations"  # the run directory's folder of tensor files

LM_CACHE_SCHEMA = declare(
    "lm_cache",
    [
        pa.field("site", pa.string()),  # resid_pre, attn_out, mlp_out, head, q, k, v, pattern, ...
        pa.field("layer", pa.int64()),  # the block's index
        pa.field("file", pa.string()),  # the safetensors file, relative to the run directory
        pa.field("key", pa.string()),  # the tensor's key in it: <site>.<layer>/<sample>
        pa.field("shape", pa.list_(pa.int64())),  # the stored tensor's shape: (T, ...), T the stored positions
        pa.field("length", pa.int64()),  # the pair's real tokens (its clean prompt's length, BOS included)
        pa.field("first_position", pa.int64()),  # the position of the tensor's first row: 0, or length - 1 (last)
        pa.field("tokens", pa.list_(pa.string())),  # the clean prompt's tokens at the stored positions
        pa.field("token_texts", pa.list_(pa.string())),  # those tokens decoded alone (" Mary")
        pa.field("token_ids", pa.list_(pa.int64())),  # their ids
        pa.field("roles", pa.list_(pa.string())),  # their roles (IO, S1, S2 with data=ioi; subject; end), null: none
        pa.field("answer", pa.string()),
        pa.field("distractor", pa.string()),
        pa.field("answer_text", pa.string()),
        pa.field("distractor_text", pa.string()),
        pa.field("rms", pa.float32()),  # the root mean square of the stored tensor's values (a quick check of scale)
    ],
    Presentation(keys=("site",), values=("rms",)),
    classes=False,
)


class LmCache(LanguageModelMethod):
    name = "lm_cache"
    table = "lm_cache"
    summary_values = ("rms",)
    side_folders = (FOLDER,)
    cfg: LmCacheConfig

    @classmethod
    def planned(cls, cfg: LmCacheConfig, layout: LanguageModelLayout, target: Any) -> list[SiteSpec]:
        """Each (site, layer)'s spec (the target is not used); refused: a layer out of range, a site the family lacks
        or its attention never materialises."""
        layers = layout.block_layers(cfg.layers, "method.layers")
        return [layout.site(kind, layer) for kind in cfg.sites for layer in layers]

    def setup(self, session: HookSession, num_samples: int) -> None:
        if self.runtime.output_dir is None:
            raise RunnerError("method=lm_cache writes its tensors into a run directory: run it with python -m runner.")
        self.folder = self.runtime.output_dir / FOLDER
        self.specs = self.planned(self.cfg, layout_of(session.model), self.runtime.target)
        self.hooks = SiteHooks(session.model, self.specs, session)
        self.last = Positions(self.cfg.positions) is Positions.last

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        prompts = self.prompts(batch)
        ids = prompts.clean
        within_batch(0.0, f"lm_cache: the forward of {ids.shape[0]} prompts")
        with torch.no_grad(), self.runtime.autocast(), self.hooks.keep():
            out = forward_last(model, ids, prompts.mask)
        views = taken_views(self.hooks, self.specs, self.name)
        within_batch(0.5, f"lm_cache: {len(self.specs)} sites to {FOLDER}/")
        name = f"batch-{batch.first_index:06d}.safetensors"
        tensors, columns = self._tensors(batch, views, prompts.pads.tolist(), ids.cpu(), f"{FOLDER}/{name}")
        write_tensors(self.folder / name, tensors)  # complete on disk before its rows reach the writer
        return BatchOutput(predicted=out.logits[:, -1].float().argmax(dim=1), tables={self.table: columns})

    def _tensors(self, batch: Batch, views: dict[str, torch.Tensor], pads: list[int], ids: torch.Tensor,
                 file: str) -> tuple[dict[str, torch.Tensor], Columns]:  # fmt: skip
        """Each (site, pair)'s tensor without padding, by key, and the index rows naming them in `file`."""
        t = ids.shape[1]
        strings = self.strings(batch)
        tensors: dict[str, torch.Tensor] = {}
        rows: dict[str, list[Any]] = defaultdict(list)  # column -> values (the writer orders them as declared)
        for spec in self.specs:
            host = views[spec.name].cpu()  # (B, T, ...); pattern (B, T query, H, T key): one copy to the host a site
            for b, pad in enumerate(pads):
                start = t - 1 if self.last else pad  # the first stored row of the padded batch
                part = host[b, start:]
                if spec.kind == "pattern":
                    part = part[..., pad:]  # the keys: padding removed there too
                # its own storage (safetensors refuses tensors that share one), contiguous, float32
                stored = part.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
                key = f"{spec.name}/{batch.first_index + b}"
                tensors[key] = stored
                first, n = start - pad, t - start  # the position of the first row, the rows stored
                at = strings[b]
                rows["sample_index"].append(b)  # the pair's row in the batch: the writer adds the first index
                rows["site"].append(spec.kind)
                rows["layer"].append(spec.layer)
                rows["file"].append(file)
                rows["key"].append(key)
                rows["shape"].append(list(stored.shape))
                rows["length"].append(t - pad)
                rows["first_position"].append(first)
                rows["tokens"].append(_span(at["tokens"], first, n))
                rows["token_texts"].append(_span(at["texts"], first, n))
                rows["token_ids"].append(ids[b, start:].tolist())
                rows["roles"].append(_span(at["roles"], first, n))
                for name in ("answer", "distractor", "answer_text", "distractor_text"):
                    rows[name].append(at[name])
                rows["rms"].append(float(stored.pow(2).mean().sqrt()) if stored.numel() else float("nan"))
        columns: Columns = dict(rows)
        for name in ("tokens", "token_texts", "roles"):  # typed: a list of nulls only would have no type
            columns[name] = pa.array(rows[name], pa.list_(pa.string()))
        columns["rms"] = pa.array(rows["rms"], pa.float32())
        return tensors, columns


def _span(values: list[Any], first: int, n: int) -> list[Any]:
    """`values[first : first + n]`, None where `values` is shorter (a pair whose strings are not known)."""
    return [values[i] if i < len(values) else None for i in range(first, first + n)]


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` as the safetensors file `path`, written under a temporary name and renamed: the file is whole or
    absent, also when the write fails (the temporary is removed) or the process is killed (a stale temporary of the
    same file is removed by the next write of it: one writer per file, the batch's rank)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    tmp = temp_name(path)
    try:
        save_file(tensors, str(tmp))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
