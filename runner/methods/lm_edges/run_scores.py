"""The run's edge scores, read back from every discovery pair's (table lm_edge_pair_scores), and what is made of them:
one ranking for the run, its circuits, the checked edges, and the tables about the whole run.

Statistics over pairs (a score's mean and spread, the curve's means) are over the pairs not flagged (degenerate or
small span). The faithfulness curve is the MIB circuit track's: per size, f = (mean m(C) - mean m(empty)) /
(mean m(full) - mean m(empty)) over a part's pairs, m(empty) measured (every edge ablated), m(full) the clean run;
CPR and CMD are its areas (faithfulness.py). Stability: bootstrap resamples of the discovery pairs (stability.py).

Every statistic over pairs is taken in one canonical order of the pairs, their ids sorted (`sample_id`): the same
pairs in another order, or written in other batches or shards, give the same sums to the bit and the same bootstrap
draws. Calibration: the sign agreement counts an (edge, pair) only where the exact effect is above SIGN_TOLERANCE of
the pair's |clean - corrupted| (below it, an edge with no effect reads as 0 or as float rounding of either sign, as
the batch happens to round it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from runner.errors import RunnerError
from runner.methods.lm_edges.faithfulness import circuit_sizes, curve_areas, faithfulness, mib_size, top_edges
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.rows import STABILITY_MAX_EDGES, naming_keys, typed
from runner.methods.lm_edges.split import DISCOVERY, HELD_OUT
from runner.methods.lm_edges.stability import Stability, bootstrap
from runner.options.method.lm_edges import EdgeMode, EdgeRanking, LmEdgesConfig
from runner.rows import Columns

log = logging.getLogger(__name__)

# lm_edge_calibration.sign_agreement counts an (edge, pair) only where |exact| > SIGN_TOLERANCE x the pair's
# |clean - corrupted|: float32 rounding of an edge with no effect is ~1e-7 of the metric, a pair not flagged has a
# span of at least min_span (5%) of it, so its noise is ~1e-6 of the span; an effect under 0.1% of it has no sign
# worth checking.
SIGN_TOLERANCE = 1e-3


def canonical(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame`'s rows in the pairs' canonical order: by sample_id, and within a pair in the order written (a stable
    sort), whatever the order of the pairs in the data, the batches and the shards."""
    return frame.sort_values("sample_id", kind="stable").reset_index(drop=True)


def _read_canonical(read: Callable[[str], pd.DataFrame | None], table: str) -> pd.DataFrame | None:
    frame = read(table)
    return None if frame is None else canonical(frame)


def _flagged(frame: pd.DataFrame) -> np.ndarray:
    return (frame["degenerate"].astype(bool) | frame["small_span"].astype(bool)).to_numpy()


@dataclass
class RunScores:
    """Every discovery pair's scores (pairs x edges, in the pairs' canonical order: their ids sorted) and the ranking
    made of them."""

    p: LmEdgesConfig
    graph: EdgeGraph
    edge_index: torch.Tensor  # (E, 2) writer, reader
    pair_ids: list[str]
    scores: np.ndarray  # (N, E) float32
    kept: np.ndarray  # (N,) bool: the pairs the run's statistics are over
    frame: pd.DataFrame  # lm_edge_pair_scores' rows, in the canonical order (sample_id sorted)
    mean: np.ndarray = field(init=False)  # (E,) float64
    order: np.ndarray = field(init=False)  # edges, first kept first
    rank: np.ndarray = field(init=False)  # (E,) 1-based
    sizes: list[int] = field(init=False)  # circuit sizes evaluated (0 among them), ascending
    from_fractions: set[int] = field(init=False)  # the sizes of method.edges.fractions
    checked: list[int] = field(init=False)  # edges patched exactly in the evaluation
    chosen: list[str] = field(init=False)  # per checked edge: top | random
    stability: Stability | None = field(init=False, default=None)
    slots: int = 1  # per-position edges: position slots per edge (a unit is (edge, slot), edge-major); else 1

    @classmethod
    def read(
        cls, read: Callable[[str], pd.DataFrame | None], p: LmEdgesConfig, graph: EdgeGraph, edge_index: torch.Tensor,
        slots: int = 1,
    ) -> RunScores:  # fmt: skip
        frame = read("lm_edge_pair_scores")
        if frame is None or frame.empty:
            raise RunnerError("lm_edges: no discovery pair was scored, so no circuit can be chosen.")
        frame = canonical(frame)
        scores = np.stack([np.asarray(s, dtype=np.float32) for s in frame["scores"]])  # (N, units)
        if scores.shape[1] != len(edge_index) * slots:
            raise RunnerError(
                f"lm_edges: the scores kept in this directory have {scores.shape[1]} units a pair, this run"
                f" {len(edge_index) * slots} ({len(edge_index)} edges x {slots} position slots): they are another"
                " model's or another setting's. Use a new output directory."
            )
        return cls(p, graph, edge_index, list(frame["sample_id"]), scores, ~_flagged(frame), frame, slots=slots)

    def __post_init__(self) -> None:
        rows = self.scores[self.kept] if self.kept.any() else self.scores
        if not self.kept.any():
            log.warning("lm_edges: every discovery pair is flagged; the run's ranking is the mean over all of them")
        self.mean = rows.astype(np.float64).mean(0)
        absolute = self.p.ranking is EdgeRanking.absolute
        total = len(self.mean)
        self.order = top_edges(self.mean, total, absolute)
        self.rank = np.empty(total, dtype=np.int64)
        self.rank[self.order] = np.arange(1, total + 1)
        wanted = bool(self.p.fractions) or bool(self.p.circuit)
        self.sizes = circuit_sizes(total, self.p.circuit, self.p.fractions) if wanted else []
        self.from_fractions = {mib_size(f, total) for f in self.p.fractions}
        k = min(self.p.top_k, total) if self.p.mode is not EdgeMode.exact else 0
        rest = self.order[k:]
        drawn = np.random.default_rng(self.p.seed).choice(rest, size=min(k, len(rest)), replace=False) if k else []
        self.checked = [int(e) for e in self.order[:k]] + sorted(int(e) for e in drawn)
        self.chosen = ["top"] * k + ["random"] * (len(self.checked) - k)
        self._row = {sample: i for i, sample in enumerate(self.pair_ids)}

    @property
    def pairs(self) -> int:
        return int(self.kept.sum())

    def rankings(self) -> list[RunScores]:
        """The run's scores under each ranking it evaluates: itself, or with method.edges.ranking=both the signed
        ranking's and the absolute one's (the primary, last: its rank and checked edges are the run's)."""
        if self.p.ranking is not EdgeRanking.both:
            return [self]
        return [dataclasses.replace(self, p=dataclasses.replace(self.p, ranking=r))
                for r in (EdgeRanking.signed, EdgeRanking.absolute)]  # fmt: skip

    def circuit_masks(self, rows: list[int]) -> torch.Tensor:
        """(len(rows), writers, readers) bool: the run's circuit of each size self.sizes[row]; per-position edges:
        (len(rows), writers, readers, slots), its units."""
        chosen = [self.sizes[i] for i in rows]
        masks = torch.zeros(len(chosen), *self.graph.edges.shape, self.slots, dtype=torch.bool)
        for i, n in enumerate(chosen):
            units = torch.as_tensor(self.order[:n], dtype=torch.long)
            edges = self.edge_index[units // self.slots]
            masks[i, edges[:, 0], edges[:, 1], units % self.slots] = True
        return masks if self.p.per_position else masks[..., 0]

    def estimate(self, sample_id: str, edge: int) -> float:
        """A discovery pair's score of `edge` (NaN for a pair not scored)."""
        row = self._row.get(sample_id)
        return float("nan") if row is None else float(self.scores[row, edge])

    def means_like(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each writer's value (B, T, ...) as the mean of its clean output over the discovery pairs' real positions
        (lm_edge_pair_scores' writer_sums), broadcast to the shape of `views`' (mean ablation)."""
        if not hasattr(self, "_means"):
            sums = np.stack([np.asarray(s, dtype=np.float64) for s in self.frame["writer_sums"]]).sum(0)
            self._means = sums / float(self.frame["positions"].sum())
        out, at = {}, 0
        for name in self.graph.writer_sites():
            view = views[name]
            width = int(np.prod(view.shape[2:]))
            mean = torch.as_tensor(self._means[at : at + width], dtype=view.dtype, device=view.device)
            out[name] = mean.view(view.shape[2:]).expand_as(view)
            at += width
        return out

    def resample(self) -> Stability | None:
        """The bootstrap over the kept discovery pairs (method.edges.resamples; None without, or with one pair)."""
        if self.stability is None and self.p.resamples and self.pairs >= 2:
            sizes = [n for n in self.sizes if n > 0]
            ids = [i for i, kept in zip(self.pair_ids, self.kept.tolist(), strict=True) if kept]
            self.stability = bootstrap(self.scores[self.kept].T, sizes, self.p.resamples, self.p.seed,
                                       self.p.ranking is EdgeRanking.absolute, ids=ids)  # fmt: skip
        return self.stability


def final_tables(
    runs: list[RunScores], read: Callable[[str], pd.DataFrame | None], p: LmEdgesConfig,
    columns: dict[str, list[Any]], steps: int, metric: str,
) -> dict[str, Columns]:  # fmt: skip
    """The tables about the whole run (rows.py): lm_edges (of the primary ranking, `runs`' last), and with circuits
    the curve, its areas and stability of each ranking in `runs` (RunScores.rankings), and with checked edges the
    calibration."""
    run = runs[-1]
    stability = run.resample()
    exact_frame, circuit = (_read_canonical(read, table) for table in ("lm_edge_exact", "lm_circuit"))
    tables = {"lm_edges": _edge_rows(run, columns, steps, metric, stability, exact_frame)}
    if circuit is not None and run.sizes:
        curves, areas, kept = [], [], []
        for ranked in runs:
            resampled = ranked.resample()
            curve = _curve(ranked, circuit[circuit["ranking"] == ranked.p.ranking.value], resampled, metric)
            curves.append(curve)
            areas.append(_areas(ranked, curve, metric))
            if resampled is not None:
                kept.append(_stability_rows(ranked, resampled, columns))
        tables["lm_circuit_curve"] = joined(curves)
        tables["lm_circuit_scores"] = joined(areas)
        if kept:
            tables["lm_circuit_stability"] = joined(kept)
    if exact_frame is not None and not exact_frame.empty:
        tables["lm_edge_calibration"] = _calibration(exact_frame, metric, _spans(run))
    return {name: typed(name, columns) for name, columns in tables.items()}


def joined(parts: list[Columns]) -> Columns:
    """Columns of the same keys, one part's rows after another's."""
    if len(parts) == 1:
        return parts[0]
    out: Columns = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        if all(isinstance(v, list) for v in values):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = np.concatenate([np.asarray(v) for v in values])
    return out


def _edge_rows(
    run: RunScores, columns: dict[str, list[Any]], steps: int, metric: str, stability: Stability | None,
    exact_frame: pd.DataFrame | None,
) -> Columns:  # fmt: skip
    e = len(run.mean)
    kept = run.scores[run.kept].astype(np.float64)
    n = len(kept)
    nan = np.full(e, np.nan)
    exact = nan.copy()
    if run.p.mode is EdgeMode.exact:
        exact = run.mean.copy() if n else nan
    elif exact_frame is not None and not exact_frame.empty:
        usable = exact_frame[~_flagged(exact_frame)]
        by_edge = usable.groupby("edge")["exact"].mean()
        index = {name: i for i, name in enumerate(columns["edge"])}
        for name, value in by_edge.items():
            exact[index[name]] = value
    frame = run.frame[run.kept]
    return {
        "sample_index": [-1] * e, **columns,
        "mode": [run.p.mode.value] * e, "steps": [steps] * e, "metric": [metric] * e,
        "score": run.mean.astype(np.float32) if n else nan,
        "score_std": kept.std(0, ddof=1) if n > 1 else nan,
        "score_lo": stability.lo if stability is not None else nan,
        "score_hi": stability.hi if stability is not None else nan,
        "rank": run.rank, "exact": exact, "pairs": [n] * e,
        "clean": np.full(e, frame["clean"].mean() if n else np.nan),
        "corrupted": np.full(e, frame["corrupted"].mean() if n else np.nan),
        "degenerate": [n == 0] * e,
    }  # fmt: skip


def _curve(run: RunScores, circuit: pd.DataFrame, stability: Stability | None, metric: str) -> Columns:
    """Per (part, size): means over the part's pairs not flagged, MIB's f, the circuits' stability."""
    usable = circuit[~_flagged(circuit)]
    total = len(run.mean)
    rows: dict[str, list[Any]] = {k: [] for k in ("split", "edges", "fraction", "mib", "pairs", "circuit_metric",
                                                  "empty_metric", "clean", "faithfulness", "faithfulness_std",
                                                  "jaccard", "jaccard_lo", "jaccard_hi", "inclusion")}  # fmt: skip
    for split in (DISCOVERY, HELD_OUT):
        part = usable[usable["split"] == split]
        if circuit[circuit["split"] == split].empty:
            continue  # no pair in this part
        for n in run.sizes:
            at = part[part["edges"] == n]
            cm, empty, clean = (float(at[c].astype(float).mean()) if len(at) else np.nan
                                for c in ("circuit_metric", "empty_metric", "clean"))  # fmt: skip
            jaccard = stability.jaccard.get(n, (np.nan,) * 3) if stability is not None and n > 0 else (np.nan,) * 3
            inclusion = (float(stability.inclusion[n][run.order[:n]].mean())
                         if stability is not None and n > 0 and n in stability.inclusion else np.nan)  # fmt: skip
            rows["split"].append(split)
            rows["edges"].append(n)
            rows["fraction"].append(n / total)
            rows["mib"].append(n in run.from_fractions)
            rows["pairs"].append(len(at))
            rows["circuit_metric"].append(cm)
            rows["empty_metric"].append(empty)
            rows["clean"].append(clean)
            rows["faithfulness"].append(float(faithfulness(np.array([cm]), empty, clean)[0]))
            rows["faithfulness_std"].append(float(at["faithfulness"].astype(float).std()) if len(at) > 1 else np.nan)
            rows["jaccard"].append(jaccard[0])
            rows["jaccard_lo"].append(jaccard[1])
            rows["jaccard_hi"].append(jaccard[2])
            rows["inclusion"].append(inclusion)
    k = len(rows["split"])
    return {"sample_index": [-1] * k, **rows, "total_edges": [total] * k, **_settings(run.p, metric, k)}


def _settings(p: LmEdgesConfig, metric: str, rows: int) -> dict[str, list[Any]]:
    return {"scored_by": [p.mode.value] * rows, "ablation": [p.ablation.value] * rows,
            "ranking": [p.ranking.value] * rows, "metric": [metric] * rows}  # fmt: skip


def _areas(run: RunScores, curve: Columns, metric: str) -> Columns:
    """Per part: CPR and CMD over the curve's points at method.edges.fractions (extra sizes do not enter)."""
    frame = pd.DataFrame({k: curve[k] for k in ("split", "edges", "pairs", "faithfulness")})
    rows: dict[str, list[Any]] = {"split": [], "pairs": [], "cpr": [], "cmd": [], "points": []}
    for split, part in frame.groupby("split", sort=False):
        cpr, cmd = curve_areas(part["edges"].tolist(), len(run.mean), part["faithfulness"].to_numpy(float),
                               run.p.fractions)  # fmt: skip
        rows["split"].append(split)
        rows["pairs"].append(int(part["pairs"].max()))
        rows["cpr"].append(cpr)
        rows["cmd"].append(cmd)
        rows["points"].append(len(set(run.p.fractions)))
    k = len(rows["split"])
    return {"sample_index": [-1] * k, **rows, **_settings(run.p, metric, k)}


def _stability_rows(run: RunScores, stability: Stability, columns: dict[str, list[Any]]) -> Columns:
    """Per (size up to STABILITY_MAX_EDGES, edge in the run's circuit or in some resample's): its inclusion."""
    keys = naming_keys(columns)
    rows: dict[str, list[Any]] = {k: [] for k in ("edges", *keys, "rank", "in_circuit", "inclusion")}
    for n in run.sizes:
        if not 0 < n <= STABILITY_MAX_EDGES or n not in stability.inclusion:
            continue
        inclusion = stability.inclusion[n]
        listed = np.union1d(np.flatnonzero(inclusion > 0), run.order[:n])
        listed = listed[np.argsort(run.rank[listed], kind="stable")]
        for e in listed.tolist():
            rows["edges"].append(n)
            for key in keys:
                rows[key].append(columns[key][e])
            rows["rank"].append(int(run.rank[e]))
            rows["in_circuit"].append(bool(run.rank[e] <= n))
            rows["inclusion"].append(float(inclusion[e]))
    k = len(rows["edges"])
    return {"sample_index": [-1] * k, **rows, "resamples": [run.p.resamples] * k, "ranking": [run.p.ranking.value] * k}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN under 2 values or a constant side."""
    if len(a) < 2:
        return float("nan")
    ra, rb = pd.Series(a).rank().to_numpy(), pd.Series(b).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _spans(run: RunScores) -> pd.Series:
    """Each discovery pair's |clean - corrupted| (float64), by sample_id."""
    frame = run.frame
    span = (frame["clean"].astype(np.float64) - frame["corrupted"].astype(np.float64)).abs()
    return pd.Series(span.to_numpy(), index=frame["sample_id"].to_numpy())


def _calibration(exact: pd.DataFrame, metric: str, spans: pd.Series) -> Columns:
    """Per group of checked edges (top, random, all): the estimate against the exact effect. The sign agreement is
    over the (edge, pair) whose |exact| is above SIGN_TOLERANCE x the pair's span `spans` (by sample_id; their count:
    sign_counted); an estimate of 0 there disagrees."""
    usable = exact[~_flagged(exact)]
    rows: dict[str, list[Any]] = {k: [] for k in ("chosen", "edges", "pairs", "spearman", "sign_agreement",
                                                  "sign_counted", "mean_abs_error")}  # fmt: skip
    groups: Sequence[tuple[str, pd.DataFrame]] = [
        ("top", usable[usable["chosen"] == "top"]),
        ("random", usable[usable["chosen"] == "random"]),
        ("all", usable),
    ]
    for name, part in groups:
        est, ex = part["estimate"].to_numpy(float), part["exact"].to_numpy(float)
        tolerance = SIGN_TOLERANCE * spans.reindex(part["sample_id"].to_numpy()).to_numpy(float)
        signed = np.abs(ex) > tolerance  # NaN (a pair with no span): not counted
        means = part.groupby("edge")[["estimate", "exact"]].mean()
        rows["chosen"].append(name)
        rows["edges"].append(len(means))
        rows["pairs"].append(int(part["sample"].nunique()) if len(part) else 0)
        rows["spearman"].append(_spearman(means["estimate"].to_numpy(float), means["exact"].to_numpy(float)))
        agree = np.sign(est[signed]) == np.sign(ex[signed])
        rows["sign_agreement"].append(float(agree.mean()) if signed.any() else np.nan)
        rows["sign_counted"].append(int(signed.sum()))
        rows["mean_abs_error"].append(float(np.abs(est - ex).mean()) if len(part) else np.nan)
    k = len(rows["chosen"])
    mode = exact["mode"].iloc[0]
    return {"sample_index": [-1] * k, **rows, "mode": [mode] * k, "metric": [metric] * k}
