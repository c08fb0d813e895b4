"""An activation cache read back: what a `method=lm_cache` run wrote (runner/methods/lm_cache.py), its index table
and its safetensors files, as one object a notebook indexes like TransformerLens' `ActivationCache`.

    from runner.results import load_activations
    cache = load_activations("outputs/2026-01-01/12-00-00_default")
    cache["resid_pre", 3]      # (N, T_max, d_model) float32, right-padded with zeros; cache.mask says where
    cache.get("head", 3)       # [(T_i, heads, head size)] one tensor per pair, no padding
    cache.pair(0)              # {(site, layer): (T_0, ...)} every tensor of the first pair
    cache.sites, cache.layers, cache.lengths, cache.sample_ids, cache.tokens(0), len(cache)

Pairs are in data-set order (`cache.samples[i]` is pair i's index in the data set). A site's tensors are read from the
files that hold them, only their keys (safetensors reads each tensor lazily), so one site of a large cache reads
that site alone. Only the shards the run committed are listed; an unfinished run is refused unless `partial=True`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from runner.errors import RunnerError
from runner.store.reader import load

TABLE = "lm_cache"


class ActivationCache:
    """The tensors of one lm_cache run, by (site, layer) and by pair; `index` is its table (one row per (pair,
    site, layer)), in pair order."""

    def __init__(self, run_dir: Path, index: pd.DataFrame) -> None:
        self.run_dir = run_dir
        index = index.assign(layer=index["layer"].astype("int64"), sample=index["sample"].astype("int64"))
        self.index = index.sort_values("sample", kind="stable").reset_index(drop=True)
        firsts = self.index.drop_duplicates("sample")
        self.samples: list[int] = firsts["sample"].tolist()  # each pair's index in the data set
        self.sample_ids: list[str] = firsts["sample_id"].tolist()
        self.sites: list[str] = list(dict.fromkeys(self.index["site"]))  # in the order the run chose them
        self.layers: list[int] = sorted(set(self.index["layer"]))
        # (N,) the positions stored per pair: its length with positions=all, 1 with last
        self.lengths = torch.tensor([int(shape[0]) for shape in firsts["shape"]], dtype=torch.long)
        self.prompt_lengths = torch.tensor(firsts["length"].tolist(), dtype=torch.long)  # (N,) the pairs' lengths
        self._rows = {
            (str(s), int(layer)): rows for (s, layer), rows in self.index.groupby(["site", "layer"], sort=False)
        }

    def __len__(self) -> int:
        return len(self.samples)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} pairs, sites {self.sites}, layers {self.layers}, {self.run_dir})"

    def keys(self) -> list[tuple[str, int]]:
        """Every (site, layer) the cache holds."""
        return list(self._rows)

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._rows  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):  # not a key at all (a tuple of three, a number)
            return False

    def __getitem__(self, key: tuple[str, int] | str) -> torch.Tensor:
        """(N, T_max, ...) float32: the site at one layer for every pair, right-padded with zeros on every axis that
        differs between pairs (the pattern's keys too); `mask` (N, T_max) marks the real positions. The key is
        (site, layer) or "site.layer"."""
        return pad(self.get(*self._key(key)))

    def get(self, site: str, layer: int) -> list[torch.Tensor]:
        """[(T_i, ...)] the site at one layer for each pair, in pair order, without padding."""
        rows = self._rows.get((site, int(layer)))
        if rows is None:
            raise KeyError(f"no ({site!r}, {layer}) in this cache: sites {self.sites}, layers {self.layers}")
        found = self._read(rows)
        return [found[key] for key in rows["key"]]  # the index is in pair order, and so are a site's rows

    @property
    def mask(self) -> torch.Tensor:
        """(N, T_max) bool: True on the stored positions of each pair (what `cache[site, layer]` pads after)."""
        return torch.arange(int(self.lengths.max()) if len(self) else 0)[None] < self.lengths[:, None]

    def pair(self, i: int) -> dict[tuple[str, int], torch.Tensor]:
        """{(site, layer): (T_i, ...)} every tensor of pair i (the i-th in data-set order, `samples[i]`)."""
        rows = self.index[self.index["sample"] == self.samples[i]]
        found = self._read(rows)
        return {(str(r.site), int(r.layer)): found[r.key] for r in rows.itertuples()}

    def tokens(self, i: int) -> list[str]:
        """Pair i's clean tokens at the stored positions (row t of its tensors is tokens[t])."""
        return list(self.index.loc[self.index["sample"] == self.samples[i], "tokens"].iloc[0])

    def _key(self, key: tuple[str, int] | str) -> tuple[str, int]:
        """(site, layer) of a key given as such or as "site.layer"; KeyError for another."""
        try:
            site, layer = key.rsplit(".", 1) if isinstance(key, str) else key
            return str(site), int(layer)
        except (TypeError, ValueError):
            raise KeyError(f"{key!r}: give (site, layer) or 'site.layer', e.g. ('resid_pre', 3)") from None

    def _read(self, rows: pd.DataFrame) -> dict[str, torch.Tensor]:
        """The tensors of `rows`, by key: each file opened once, only those keys read."""
        from safetensors import safe_open

        found: dict[str, torch.Tensor] = {}
        for file, keys in rows.groupby("file", sort=False)["key"]:
            with safe_open(str(self.run_dir / str(file)), framework="pt") as handle:
                for key in keys:
                    found[key] = handle.get_tensor(key)
        return found


def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(N, *max shape) the tensors (same number of axes) stacked, each right-padded with zeros to the largest size on
    every axis."""
    if not tensors:
        return torch.empty(0)
    size = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
    out = torch.zeros(len(tensors), *size, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[(i, *(slice(0, n) for n in t.shape))] = t
    return out


def load_activations(run_dir: str | Path, partial: bool = False) -> ActivationCache:
    """The activation cache of the `method=lm_cache` run in `run_dir` (no tensor read yet: each is read when asked
    for). An unfinished or damaged run is a RunnerError, unless `partial=True` (the committed shards only, with a
    warning); a file the index names that is missing (moved or deleted since) is one too."""
    run_dir = Path(run_dir)
    folder = run_dir / f"{TABLE}.parquet"
    if not folder.is_dir():
        raise RunnerError(
            f"{run_dir} holds no activation cache (no {TABLE}.parquet): give the directory of one method=lm_cache run"
            " (a sweep's job folder, not the sweep's)."
        )
    index = load(folder, partial=partial)
    missing = sorted(f for f in set(index["file"]) if not (run_dir / f).is_file())
    if missing:
        raise RunnerError(
            f"{run_dir}: the index names {len(missing)} file(s) that are not there ({missing[0]} ...): the cache was"
            " moved in part. Keep a run directory whole, or run it again."
        )
    return ActivationCache(run_dir, index)


__all__ = ["ActivationCache", "load_activations"]
