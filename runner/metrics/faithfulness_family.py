"""Map statistics (sparseness, complexity) and perturbation metrics (ROAD, faithfulness correlation, region
perturbation), each batched over all maps of a batch (every layer's and every random map) on the device.

Definitions follow Quantus 0.6.0 (the agreement tests in tests/test_metrics.py feed both the same maps), with
two deliberate differences: draws come from per-sample generators (seed, sample index), so a value does not
depend on the batch; and ROAD's pixels and region perturbation's patches of equal value come in faithfulness's
seeded random order (`runner.metrics.curves.tie_keys`, keyed by (seed, sample index)), compared in float64, where
Quantus's `np.argsort` leaves ties to its quicksort (in effect favouring positions) and orders patch sums as
rounded in float32. On maps without ties the orders are the same.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
import torch.nn.functional as F
from torch import nn

from runner.chunks import chunked_forward, spans
from runner.errors import RunnerError
from runner.metrics.base import Metric, MetricInputs
from runner.metrics.curves import pixel_rank, tie_keys
from runner.options.metric.evaluation import EvaluationConfig
from runner.randomness import sample_generator
from runner.runtime import Runtime

log = logging.getLogger(__name__)

# ROAD's neighbour weights (Rong et al. 2022, tleemann/road_evaluation): 1/6 for the 4 direct, 1/12 for the
# 4 diagonal neighbours.
_ROAD_KERNEL = torch.tensor([[1 / 12, 1 / 6, 1 / 12], [1 / 6, 0.0, 1 / 6], [1 / 12, 1 / 6, 1 / 12]])
# The same weights as (row offset, column offset, weight), for the direct solve's sparse matrix.
_ROAD_OFFSETS = np.array(
    [(dy, dx, float(_ROAD_KERNEL[dy + 1, dx + 1])) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx]
)  # (8, 3)
_ROAD_ORDERING = "MMD_AT_PLUS_A"  # SuperLU's column ordering for the direct solve (see scripts/bench_metrics.py)
ROAD_SOLVERS = ("auto", "direct", "cg")


def _max_normalised(maps: torch.Tensor) -> torch.Tensor:
    """(N, H, W) maps divided by their own maximum |value| (Quantus's normalise_by_max, per map); zero maps as is."""
    top = maps.abs().flatten(1).amax(dim=1)[:, None, None]  # (N, 1, 1)
    return torch.where(top > 0, maps / torch.where(top > 0, top, 1), maps)


def _logits(model: nn.Module, images: torch.Tensor, runtime: Runtime, chunk: int) -> torch.Tensor:
    """(N, K) float32 logits of `images` (N, C, H, W), in forwards of at most `chunk` images."""
    return chunked_forward(model, images, chunk, runtime)


def _score(logits: torch.Tensor, target: torch.Tensor, softmax: bool) -> torch.Tensor:
    """(N,) the target's probability (softmax) or logit."""
    values = logits.softmax(dim=1) if softmax else logits
    return values.gather(1, target[:, None]).squeeze(1)


def pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) Pearson correlation of rows of a and b (N, R); NaN where either row is constant."""
    a = a.double() - a.double().mean(dim=1, keepdim=True)
    b = b.double() - b.double().mean(dim=1, keepdim=True)
    den = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(den > 0, (a * b).sum(dim=1) / den, torch.nan).float()


# ---- map statistics ---------------------------------------------------------------------------------------------
class Sparseness(Metric):
    """Gini index of the map (Chalasani et al. 2020; Quantus Sparseness): 1 when one pixel holds all the mass,
    about 0 for a uniform map. Defined for every map (a zero map is uniform: 0)."""

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        a = _max_normalised(maps).abs().flatten(1).double() + 1e-7  # (N, D) Quantus adds 1e-7 before sorting
        a = a.sort(dim=1).values
        d = a.shape[1]
        rank = torch.arange(1, d + 1, device=a.device, dtype=a.dtype)  # (D,)
        gini = ((2 * rank - d - 1) * a).sum(dim=1) / (d * a.sum(dim=1))
        return {"": gini.float()}


class Complexity(Metric):
    """Entropy of the map normalised to sum 1 (Bhatt et al. 2020; Quantus Complexity): log(H*W) for a uniform map,
    0 for one pixel. NaN for an all-zero map (no distribution), as Quantus's 0/0."""

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        a = _max_normalised(maps).abs().flatten(1).double()  # (N, D)
        p = a / a.sum(dim=1, keepdim=True)
        return {"": (-(p * torch.log(p + 1e-12)).sum(dim=1)).float()}


# ---- ROAD ---------------------------------------------------------------------------------------------------------
def noisy_linear_imputation(
    x: torch.Tensor,
    removed: torch.Tensor,
    noise: torch.Tensor | None = None,
    tolerance: float = 1e-5,
    max_iterations: int = 2000,
    solver: str = "auto",
) -> tuple[torch.Tensor, bool]:
    """(x with each removed pixel imputed, converged): ROAD's linear imputation, all images at once.

    x (N, C, H, W); removed (N, H, W) bool; noise (N, C, H, W) or None, added to the imputed pixels.
    Each removed pixel equals the weighted mean (`_ROAD_KERNEL`, weights of neighbours outside the image
    dropped) of its neighbours, kept or imputed: the sparse system Quantus and tleemann/road_evaluation solve
    with `spsolve` one image at a time. `solver` (ROAD_SOLVERS): "direct" builds that system vectorised and
    factorises it once per image (scipy SuperLU on the host; all channels one right-hand side; exact, so
    `tolerance` and `max_iterations` are unused); "cg" runs Jacobi-preconditioned conjugate gradients on every
    image and channel together on x's device (the system is symmetric positive definite while any pixel is
    kept), the operator a 3x3 convolution, until each system's residual is below `tolerance` times its
    right-hand side's norm, started from the same problem solved on a grid half as fine (recursively);
    "auto": direct on the CPU (about 10x faster there than the CG at 224 px), CG on an accelerator.
    """
    n, c, h, w = x.shape
    if road_solver_for(solver, x.device) == "direct":
        out, converged = _direct(x, removed), True  # (N, C, H, W)
    else:
        dtype = torch.float64 if x.device.type == "cpu" else torch.float32  # CPU: float64 costs little
        m = removed[:, None].to(dtype).expand(n, c, h, w).reshape(n * c, 1, h, w)  # (NC, 1, H, W) 1: to impute
        v = x.to(dtype).reshape(n * c, 1, h, w)
        out, converged = _harmonic(v, m, tolerance, max_iterations)  # (NC, 1, H, W)
        out = out.reshape(n, c, h, w).to(x.dtype)
    if noise is not None:
        out = out + removed[:, None] * noise
    return out, converged


def road_solver_for(solver: str, device: torch.device) -> str:
    """The imputation's solver, "direct" or "cg", for `solver` (one of ROAD_SOLVERS) on `device`."""
    if solver not in ROAD_SOLVERS:
        raise RunnerError(f"Unknown method.evaluation.road_solver={solver!r}: one of {', '.join(ROAD_SOLVERS)}.")
    if solver == "auto":
        return "direct" if device.type == "cpu" else "cg"  # SuperLU runs on the host only
    return solver


def _direct(x: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """x (N, C, H, W) with its removed (N, H, W) pixels imputed by ROAD's sparse system, solved exactly per image."""
    images = x.detach().to("cpu", torch.float64).numpy()  # (N, C, H, W)
    masks = removed.detach().cpu().numpy()  # (N, H, W)
    out = images.copy()
    for b in range(images.shape[0]):
        rows, cols = np.nonzero(masks[b])  # (K,) the unknowns, in pixel order
        if rows.size:
            out[b][:, rows, cols] = _solve_road_system(images[b], masks[b], rows, cols).T  # (C, K)
    return torch.from_numpy(out).to(x.device, x.dtype)


def _solve_road_system(image: np.ndarray, mask: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """(K, C) values of the K removed pixels (rows, cols) of image (C, H, W), mask (H, W): the system of
    noisy_linear_imputation, in Quantus's form up to sign (diagonal: the in-image neighbours' weights; off the
    diagonal: minus a removed neighbour's weight; right-hand side: the kept neighbours' weighted values)."""
    h, w = mask.shape
    k = rows.size
    unknown = np.full((h, w), -1, dtype=np.int64)
    unknown[rows, cols] = np.arange(k)
    ny = rows[None] + _ROAD_OFFSETS[:, :1].astype(np.int64)  # (8, K) each neighbour's row
    nx = cols[None] + _ROAD_OFFSETS[:, 1:2].astype(np.int64)  # (8, K)
    inside = (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w)  # (8, K)
    ny, nx = ny.clip(0, h - 1), nx.clip(0, w - 1)
    weight = np.where(inside, _ROAD_OFFSETS[:, 2:3], 0.0)  # (8, K) 0 for neighbours outside the image
    neighbour = np.where(inside, unknown[ny, nx], -1)  # (8, K) the neighbour's unknown, -1 when kept or outside
    coupled = neighbour >= 0
    own = np.broadcast_to(np.arange(k), neighbour.shape)  # (8, K)
    matrix = sp.csc_matrix(
        (
            np.concatenate([-weight[coupled], weight.sum(axis=0)]),
            (np.concatenate([own[coupled], np.arange(k)]), np.concatenate([neighbour[coupled], np.arange(k)])),
        ),
        shape=(k, k),
    )
    rhs = np.einsum("ok,cok->kc", np.where(coupled, 0.0, weight), image[:, ny, nx])  # (K, C) kept neighbours
    # Symmetric: a symmetric fill-reducing ordering and no pivoting (diagonally dominant) keep SuperLU's
    # factors small; one factorisation serves all C channels.
    lu = spla.splu(matrix, permc_spec=_ROAD_ORDERING, options={"SymmetricMode": True}, diag_pivot_thresh=0.0)
    return lu.solve(rhs)


def _harmonic(v: torch.Tensor, m: torch.Tensor, tolerance: float, max_iterations: int) -> tuple[torch.Tensor, bool]:
    """(v with its m == 1 pixels imputed, converged) for v, m (NC, 1, H, W): see noisy_linear_imputation."""
    h, w = v.shape[-2:]
    kernel = _ROAD_KERNEL.to(v.device, v.dtype)[None, None]  # (1, 1, 3, 3)
    weight = F.conv2d(torch.ones(1, 1, h, w, device=v.device, dtype=v.dtype), kernel, padding=1)  # (1, 1, H, W)
    kept = 1 - m
    u = torch.zeros_like(v)
    if min(h, w) >= 16 and bool(m.any()):
        # Initial guess: the coarse problem (2x2 blocks; a block is removed when all its pixels are), upsampled.
        share = F.avg_pool2d(kept, 2, ceil_mode=True)  # (NC, 1, H/2, W/2) kept fraction of each block
        coarse_v = F.avg_pool2d(v * kept, 2, ceil_mode=True) / share.clamp_min(1e-12)
        coarse, _ = _harmonic(coarse_v, (share == 0).to(v.dtype), tolerance, max_iterations)
        u = m * F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)

    def apply(p: torch.Tensor) -> torch.Tensor:
        return m * (weight * p - F.conv2d(p, kernel, padding=1))  # p is 0 off the removed pixels

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).flatten(1).sum(dim=1)[:, None, None, None]  # (NC, 1, 1, 1)

    b = m * F.conv2d(v * kept, kernel, padding=1)  # the kept neighbours' weighted values
    limit = tolerance * b.flatten(1).norm(dim=1)  # (NC,)
    r = b - apply(u)
    z = r / weight
    p = z.clone()
    rz = dot(r, z)
    converged = bool((r.flatten(1).norm(dim=1) <= limit).all())
    for _ in range(max_iterations):
        if converged:
            break
        ap = apply(p)
        pap = dot(p, ap)
        alpha = torch.where(pap > 0, rz / torch.where(pap > 0, pap, 1), 0)
        u = u + alpha * p
        r = r - alpha * ap
        converged = bool((r.flatten(1).norm(dim=1) <= limit).all())
        z = r / weight
        rz_new = dot(r, z)
        beta = torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1), 0)
        p = z + beta * p
        rz = rz_new
    return v * kept + u * m, converged


def road_curves(
    inputs: MetricInputs, maps: torch.Tensor, cfg: EvaluationConfig
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(probability, correct, converged): (N, 2, P) float32 target probability and argmax == target after removing
    the top (order 0, MoRF) or bottom (order 1, LeRF) p% of each map's pixels, p in cfg.road_percentages.
    Pixels of equal value come in the seeded random order of `tie_keys` (seed, sample index), not by position."""
    n, c, h, w = inputs.x.shape
    d = h * w
    percentages = cfg.road_percentages
    keys = tie_keys(inputs.seed, inputs.sample_index.tolist(), d, maps.device)  # (N, D)
    rank = pixel_rank(maps.flatten(1).double(), keys)  # (N, D) 0 = most relevant
    jobs = [(i, o, j) for i in range(n) for o in range(2) for j in range(len(percentages))]
    sample = inputs.sample_index.tolist()  # one host copy, not one device sync per job
    prob = torch.empty(n, 2, len(percentages), device=inputs.x.device)
    correct = torch.empty_like(prob)
    converged = True
    for span in spans(len(jobs), inputs.chunk):
        part = jobs[span.start : span.stop]
        i = torch.tensor([job[0] for job in part], device=inputs.x.device)
        k = torch.tensor([int(d * percentages[job[2]] / 100) for job in part], device=inputs.x.device)[:, None]
        lerf = torch.tensor([job[1] == 1 for job in part], device=inputs.x.device)[:, None]
        r = rank[i]  # (J, D)
        removed = torch.where(lerf, r >= d - k, r < k).reshape(-1, h, w)  # (J, H, W)
        noise = None
        if cfg.road_noise > 0:
            noise = (
                torch.stack(
                    [
                        torch.randn(
                            (c, h, w),
                            generator=sample_generator(inputs.seed, sample[job[0]], f"road.noise.{job[1]}.{job[2]}"),
                        )
                        for job in part
                    ]
                ).to(inputs.x.device, inputs.x.dtype)
                * cfg.road_noise
            )  # (J, C, H, W)
        imputed, ok = noisy_linear_imputation(
            inputs.x[i], removed, noise, cfg.road_tolerance, cfg.road_max_iterations, cfg.road_solver
        )  # (J, C, H, W)
        converged &= ok
        logits = _logits(inputs.model, imputed, inputs.runtime, inputs.chunk)  # (J, K)
        t = inputs.target[i]
        o = torch.tensor([job[1] for job in part], device=i.device)
        j = torch.tensor([job[2] for job in part], device=i.device)
        prob[i, o, j] = _score(logits, t, softmax=True)
        correct[i, o, j] = (logits.argmax(dim=1) == t).float()
    return prob, correct, converged


class Road(Metric):
    """ROAD (Rong et al. 2022): remove the most (MoRF) or least (LeRF) relevant p% of pixels, impute them by noisy
    linear imputation, and follow the target. Variants: `morf`, `lerf` (the curve's mean target probability; a
    faithful map: low MoRF, high LeRF), `morf_accuracy`, `lerf_accuracy` (mean of argmax == target: Quantus ROAD's
    curve, which is MoRF only). Pixels of equal value in a seeded random order (`road_curves`); a constant map's
    value is set to NaN by the evaluation table (its rows flagged degenerate)."""

    def __init__(self, cfg: EvaluationConfig, settings: Any = None) -> None:
        super().__init__(cfg, settings)
        bad = [p for p in cfg.road_percentages if not 0 <= p < 100]
        if not cfg.road_percentages or bad or cfg.road_noise < 0 or cfg.road_tolerance <= 0:
            raise RunnerError(
                f"Out of range: method.evaluation.road_percentages={cfg.road_percentages} (each in [0, 100)),"
                f" road_noise={cfg.road_noise} (>= 0), road_tolerance={cfg.road_tolerance} (> 0)."
            )
        road_solver_for(cfg.road_solver, torch.device("cpu"))  # an unknown solver fails before the run starts
        self._warned = False

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        prob, correct, converged = road_curves(inputs, maps, self.cfg)
        if not converged and not self._warned:
            self._warned = True
            log.warning(
                "road: the imputation stopped after road_max_iterations=%d before reaching road_tolerance=%g",
                self.cfg.road_max_iterations, self.cfg.road_tolerance,
            )  # fmt: skip
        mean_prob, accuracy = prob.mean(dim=2), correct.mean(dim=2)  # (N, 2)
        return {
            "morf": mean_prob[:, 0], "lerf": mean_prob[:, 1],
            "morf_accuracy": accuracy[:, 0], "lerf_accuracy": accuracy[:, 1],
        }  # fmt: skip


# ---- faithfulness correlation -------------------------------------------------------------------------------------
def _baseline(x: torch.Tensor, kind: str, option: str) -> torch.Tensor:
    """(N,) one replacement value per image: its minimum ("black") or its mean."""
    if kind == "black":
        return x.flatten(1).amin(dim=1)
    if kind == "mean":
        return x.flatten(1).mean(dim=1)
    raise RunnerError(f"method.evaluation.{option}={kind!r}: use 'black' (the image's minimum) or 'mean'.")


def faithfulness_correlation_values(
    inputs: MetricInputs, maps: torch.Tensor, subsets: torch.Tensor, cfg: EvaluationConfig,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """(N,) Pearson over runs between the map's sum on a random subset and the target's drop when the subset is
    replaced by the baseline. subsets (N, R, S): flat indices into C*H*W (the map counts once per channel, as
    Quantus broadcasts it); uniform (N, R): the values of the "uniform" baseline."""
    n, c, h, w = inputs.x.shape
    runs = subsets.shape[1]
    flat_maps = maps.flatten(1).float()  # (N, HW)
    sums = flat_maps.gather(1, (subsets % (h * w)).flatten(1)).reshape(n, runs, -1).sum(dim=2)  # (N, R)
    base = _score(_logits(inputs.model, inputs.x, inputs.runtime, inputs.chunk), inputs.target,
                  cfg.faithfulness_correlation_softmax)  # fmt: skip  # (N,)
    drops = torch.empty(n, runs, device=inputs.x.device)
    kind = cfg.faithfulness_correlation_baseline
    jobs = [(i, r) for i in range(n) for r in range(runs)]
    for span in spans(len(jobs), inputs.chunk):
        part = jobs[span.start : span.stop]
        i = torch.tensor([a for a, _ in part], device=inputs.x.device)
        r = torch.tensor([b for _, b in part], device=inputs.x.device)
        images = inputs.x[i].flatten(1).clone()  # (J, CHW)
        if kind == "uniform":
            assert uniform is not None
            value = uniform[i, r].to(images.dtype)  # (J,)
        else:
            value = _baseline(images, kind, "faithfulness_correlation_baseline")
        idx = subsets[i, r]  # (J, S)
        images.scatter_(1, idx, value[:, None].expand_as(idx).to(images.dtype))
        logits = _logits(inputs.model, images.reshape(-1, c, h, w), inputs.runtime, inputs.chunk)
        drops[i, r] = base[i] - _score(logits, inputs.target[i], cfg.faithfulness_correlation_softmax)
    return pearson(sums, drops)


class FaithfulnessCorrelation(Metric):
    """Faithfulness correlation (Bhatt et al. 2020; Quantus FaithfulnessCorrelation): Pearson, over random subsets
    of features, between the map's sum on the subset and the target's drop when it is replaced by the baseline.
    Subsets are drawn per sample from (seed, sample index). NaN when either side is constant over the subsets
    (a constant map, or a model indifferent to every subset)."""

    def __init__(self, cfg: EvaluationConfig, settings: Any = None) -> None:
        super().__init__(cfg, settings)
        if cfg.faithfulness_correlation_baseline not in ("black", "mean", "uniform"):
            raise RunnerError(
                f"method.evaluation.faithfulness_correlation_baseline={cfg.faithfulness_correlation_baseline!r}:"
                " use 'black' (the image's minimum), 'mean' (its mean) or 'uniform' (a U(0, 1) value)."
            )
        if cfg.faithfulness_correlation_runs < 2 or cfg.faithfulness_correlation_subset_size < 1:
            raise RunnerError(
                f"Out of range: method.evaluation.faithfulness_correlation_runs={cfg.faithfulness_correlation_runs}"
                f" (>= 2), faithfulness_correlation_subset_size={cfg.faithfulness_correlation_subset_size} (>= 1)."
            )

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        n, c, h, w = inputs.x.shape
        runs, size = self.cfg.faithfulness_correlation_runs, self.cfg.faithfulness_correlation_subset_size
        if size > c * h * w:
            raise RunnerError(
                f"method.evaluation.faithfulness_correlation_subset_size={size} is larger than the input ({c * h * w}"
                " values)."
            )
        draws: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sample index -> its subsets, uniform values
        for index in inputs.sample_index.tolist():
            if index not in draws:
                g = sample_generator(self.cfg.seed, index, "faithfulness_correlation.subsets")
                subsets = torch.stack([torch.randperm(c * h * w, generator=g)[:size] for _ in range(runs)])
                draws[index] = (subsets, torch.rand(runs, generator=g))
        subsets = torch.stack([draws[i][0] for i in inputs.sample_index.tolist()]).to(inputs.x.device)  # (N, R, S)
        uniform = torch.stack([draws[i][1] for i in inputs.sample_index.tolist()]).to(inputs.x.device)  # (N, R)
        return {"": faithfulness_correlation_values(inputs, maps, subsets, self.cfg, uniform)}


# ---- region perturbation -----------------------------------------------------------------------------------------
def region_curves(inputs: MetricInputs, maps: torch.Tensor, cfg: EvaluationConfig) -> torch.Tensor:
    """(N, steps) the target's drop after replacing the 1..steps most relevant patches (MoRF, cumulative).

    Patches: a non-overlapping grid of region_size pixels on the image padded (as Quantus: half on each side,
    the map with 0) to a multiple of region_size; ranked by the map's sum in float64 (float32 rounding would
    order near-equal sums at random), equal sums in the seeded random order of `tie_keys` (seed, sample index)."""
    n, c, h, w = inputs.x.shape
    size = cfg.region_size
    pad_h, pad_w = (-h) % size, (-w) % size
    top, left = pad_h // 2, pad_w // 2
    padded = F.pad(maps.double(), (left, pad_w - left, top, pad_h - top))  # (N, Hp, Wp)
    gh, gw = padded.shape[1] // size, padded.shape[2] // size
    sums = padded.reshape(n, gh, size, gw, size).sum(dim=(2, 4))  # (N, gh, gw) the map's mass per patch
    keys = tie_keys(inputs.seed, inputs.sample_index.tolist(), gh * gw, maps.device)  # (N, G)
    rank = pixel_rank(sums.flatten(1), keys)  # (N, G) 0 = the most relevant patch
    patch_rank = rank.reshape(n, gh, gw).repeat_interleave(size, 1).repeat_interleave(size, 2)  # (N, Hp, Wp)
    patch_rank = patch_rank[:, top : top + h, left : left + w]  # (N, H, W)
    steps = min(cfg.region_steps, gh * gw)
    base_value = _baseline(inputs.x, cfg.region_baseline, "region_baseline")  # (N,)
    base = _score(_logits(inputs.model, inputs.x, inputs.runtime, inputs.chunk), inputs.target, cfg.region_softmax)
    drops = torch.empty(n, steps, device=inputs.x.device)
    jobs = [(i, k) for i in range(n) for k in range(1, steps + 1)]
    for span in spans(len(jobs), inputs.chunk):
        part = jobs[span.start : span.stop]
        i = torch.tensor([a for a, _ in part], device=inputs.x.device)
        k = torch.tensor([b for _, b in part], device=inputs.x.device)
        gone = (patch_rank[i] < k[:, None, None])[:, None]  # (J, 1, H, W)
        images = torch.where(gone, base_value[i, None, None, None].to(inputs.x.dtype), inputs.x[i])
        logits = _logits(inputs.model, images, inputs.runtime, inputs.chunk)
        drops[i, k - 1] = base[i] - _score(logits, inputs.target[i], cfg.region_softmax)
    return drops


class RegionPerturbation(Metric):
    """Region perturbation (Samek et al. 2016; Quantus RegionPerturbation, order MoRF): patches replaced by the
    baseline in order of the map's mass. Variant `aopc`: the mean drop of the target over the steps (the area over
    the perturbation curve; high: faithful). Equal patch sums in a seeded random order (`region_curves`)."""

    def __init__(self, cfg: EvaluationConfig, settings: Any = None) -> None:
        super().__init__(cfg, settings)
        _baseline(torch.zeros(1, 1), cfg.region_baseline, "region_baseline")  # an unknown baseline fails now
        if cfg.region_size < 1 or cfg.region_steps < 1:
            raise RunnerError(
                f"Out of range: method.evaluation.region_size={cfg.region_size}, region_steps={cfg.region_steps}"
                " (each >= 1)."
            )

    def compute(self, inputs: MetricInputs, maps: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"aopc": region_curves(inputs, maps, self.cfg).mean(dim=1)}
