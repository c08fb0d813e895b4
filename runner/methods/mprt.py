"""Model parameter randomisation test (MPRT; Adebayo et al. 2018, as Quantus 0.6.0's `MPRT`), per target layer.

The model has its parameterised modules (those with `reset_parameters`, Quantus's set; `method.randomize`
narrows them) re-initialised one at a time, in reverse model order (`order=top_down`, cascading: each step keeps
the earlier steps' re-initialisations), in model order (`bottom_up`, cascading) or each alone on the trained weights
(`independent`). At every step one forward and one backward of the randomised model give the maps of *all* target layers
(the CAM method `method.inner`), and each is compared with the trained model's map of the same layer, sample and
class by each of `method.similarities`. A map that stays similar while the weights it claims to explain are
destroyed explains the input, not the model.

Maps are compared as Quantus compares them (its defaults abs=True, normalise=True): upsampled to the input size
(bilinear), absolute values, divided by their maximum; but each map by its own maximum, where Quantus divides a
batch by the batch's maximum, which makes its SSIM depend on which samples share a batch.
Similarities, each (B,) per layer and step, NaN where undefined; computed in torch (float64, on the device) for
all layers' maps as one stack per step, with the trained side (ranks, top pixels, SSIM windows) done once per batch:
  - spearman: Spearman's rho of the pixels, ties given average ranks (scipy's); NaN when either map is constant.
  - ssim: skimage's `structural_similarity` of the two (H, W) maps (7x7 uniform window, K1=0.01, K2=0.03, sample
    covariance, the mean over the windows that fit), with Quantus's data_range = max - min of both maps; NaN when
    both maps are constant (data_range 0).
  - ssim_flat: what Quantus's MPRT computes with `similarity_func=quantus.ssim`: it flattens each map to one row
    before the similarity, so skimage sees a 1-D signal (7-pixel windows along the rows, across row ends).
  - topk_intersection: the share of the top `topk_fraction` pixels of the trained map that are also among the top
    pixels of the randomised one (ties broken by pixel order); NaN when either map is constant.
Re-initialisation follows Quantus: each module is reset right after `torch.manual_seed(seed + 1)` (in a forked RNG:
the run's random state is untouched), so on the CPU the same seed gives Quantus's weights. The modules are
re-initialised in the run's own model, as reversible edits its hook session owns (runner/hooks/edits.py): undone
at the end of every batch, and by the session on an error, so the model is the trained one outside a batch.
`method=sanity` (runner/methods/sanity.py) keeps the old single-step check (listed layers at once, Spearman at the
layer's resolution).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from runner.data.base import Batch
from runner.errors import RunnerError, suggest
from runner.hooks import HookSession, Reinitialised
from runner.layers import Layer, resolve_layers
from runner.methods.base import (
    Method,
    as_frame,
    library_config,
    library_runtime,
    run_on_batch,
    select_targets,
    target_fields,
)
from runner.methods.cam import CamMethod, inner_cam
from runner.options.method.mprt import MprtConfig, MprtOrder
from runner.ranking import ranks_of_sorted
from runner.rows import BatchOutput, Columns
from runner.runtime import Runtime
from runner.schema import TargetMode
from runner.stats import constant_rows, uniform_rows
from runner.tables import Presentation, declare

log = logging.getLogger(__name__)

SSIM_WINDOW = 7  # skimage's default win_size (gaussian_weights=False)
SSIM_K1, SSIM_K2 = 0.01, 0.03

# The `mprt` table's own columns: one row per (sample, layer, call, step, similarity).
MPRT_SCHEMA = declare(
    "mprt",
    [
        pa.field("layer", pa.string()),  # the target layer whose map is compared
        pa.field("module_type", pa.string()),
        pa.field("call", pa.int32()),
        pa.field("target", pa.int64()),
        pa.field("order", pa.string()),  # top_down, bottom_up or independent
        pa.field("step", pa.int32()),  # 1 = the first module re-initialised
        pa.field("randomised_up_to", pa.string()),  # the module re-initialised at this step (cascading: and before)
        pa.field("randomised_type", pa.string()),
        pa.field("similarity", pa.string()),
        pa.field("value", pa.float32()),  # NaN where the similarity is undefined (a constant map)
        pa.field("degenerate", pa.bool_()),  # either map is constant at the layer's resolution or not finite: NaN
        pa.field("inner_method", pa.string()),
    ],
    Presentation(
        keys=("similarity", "step", "randomised_up_to"),
        values=("value",),
        figures="runner.viz.plots:mprt_figures",
        shown=("similarity", "step", "randomised_up_to"),
    ),
)


# ---- similarities: (N, H, W) float64 maps, each normalised to max 1 -> (N,) float64 ----------------------------
# Each similarity is split in two: what it needs of the trained maps (`reference`, computed once per batch) and
# the comparison with one step's maps (`compare`), so that every step redoes only the randomised side; all target
# layers' maps (at the input's size) are compared as one stack of rows.
def _descending(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of (N, ...) sorted from the largest, ties in pixel order: (values negated (N, D), indices (N, D)).
    One sort serves both the ranks (of the negated map) and the top pixels."""
    return (-maps.flatten(1).double()).sort(dim=1, stable=True)


def _unit_ranks(descending: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(N, D) average ranks of each row, centred and divided by their norm (NaN for a constant row), from
    `_descending`: the ranks of the negated map are D + 1 minus the map's, so its centred ranks are negated."""
    ranks = ranks_of_sorted(*descending)  # (N, D) ranks of -map
    ranks = ranks.mean(dim=1, keepdim=True) - ranks  # centred ranks of the map
    return ranks / ranks.norm(dim=1, keepdim=True)


def _top(descending: tuple[torch.Tensor, torch.Tensor], k: int) -> torch.Tensor:
    """(N, D) bool: each row's k largest entries, ties to the lower index, from `_descending`."""
    order = descending[1]
    return torch.zeros(order.shape, dtype=torch.bool, device=order.device).scatter_(1, order[:, :k], True)


def _ssim_shape(maps: torch.Tensor, flat: bool) -> torch.Tensor:
    """(N, H, W) -> (N, 1, H, W) float64, or (N, 1, H*W) with `flat`; at least a window a side."""
    maps = maps.double()
    shaped = maps.flatten(1)[:, None] if flat else maps[:, None]
    if min(shaped.shape[2:]) < SSIM_WINDOW:
        raise RunnerError(
            f"ssim needs maps of at least {SSIM_WINDOW} pixels a side; the input is {tuple(shaped.shape[2:])}."
        )
    return shaped


def _window_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean over each 7-pixel (1-D) or 7x7 (2-D) window that fits: (N, C, ...) -> (N, C, ...smaller).
    Separable (columns, then rows) as skimage's uniform filter: 14 additions a pixel instead of 49."""
    if t.dim() == 3:
        return F.avg_pool1d(t, SSIM_WINDOW, stride=1)
    return F.avg_pool2d(F.avg_pool2d(t, (SSIM_WINDOW, 1), stride=1), (1, SSIM_WINDOW), stride=1)


@dataclass
class Reference:
    """The trained maps (N, H, W) float64 and, once, what each similarity needs of them."""

    maps: torch.Tensor
    constant: torch.Tensor  # (N,) bool: no order (constant or not finite)
    ranks: torch.Tensor | None = None  # (N, H*W) centred unit ranks (spearman)
    top: torch.Tensor | None = None  # (N, H*W) bool top pixels (topk_intersection)
    top_k: int = 0
    window: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # window[flat]: (the map shaped for SSIM and centred on its mean, that mean, the centred map's window means,
    # its windows' mean squares)


def reference(maps: torch.Tensor, similarities: list[str], topk_fraction: float) -> Reference:
    """What `similarities` need of the trained maps (N, H, W), computed once for all the steps of a batch."""
    maps = maps.double()
    ref = Reference(maps, constant_rows(maps))
    descending = _descending(maps)  # one sort for the ranks and the top pixels
    if "spearman" in similarities:
        ref.ranks = _unit_ranks(descending)
    if "topk_intersection" in similarities:
        ref.top_k = max(1, round(topk_fraction * maps[0].numel()))
        ref.top = _top(descending, ref.top_k)
    for flat in {s == "ssim_flat" for s in similarities if s in ("ssim", "ssim_flat")}:
        a, shift = _centred(_ssim_shape(maps, flat))
        ref.window[flat] = (a, shift, _window_mean(a), _window_mean(a * a))
    return ref


def _centred(shaped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the map (N, 1, ...) minus its mean, the mean (N, 1, 1...)): SSIM's (co)variances are E[xy] - E[x]E[y] per
    window, which cancels catastrophically on a map far from 0 with little spread (a map near 1 everywhere:
    errors of 1e-16 against a constant c2 of (0.03 * spread)^2), and took SSIM to -16 and +11. On the centred map
    the rounding is relative to the spread, far below c2, and the luminance term adds the mean back."""
    shift = shaped.flatten(1).mean(dim=1).view(-1, *([1] * (shaped.dim() - 1)))  # (N, 1, 1...)
    return shaped - shift, shift


def compare(ref: Reference, maps: torch.Tensor, similarities: list[str]) -> torch.Tensor:
    """(K, N) float64: each of `similarities` between the reference's maps and `maps` (N, H, W), row by row;
    NaN where undefined (see the module's docstring)."""
    maps = maps.double()
    undefined = ref.constant | constant_rows(maps)  # (N,)
    descending = _descending(maps) if {"spearman", "topk_intersection"} & set(similarities) else None
    out = []  # (N,) per similarity
    for name in similarities:
        if name == "spearman":
            assert ref.ranks is not None and descending is not None
            rho = (ref.ranks * _unit_ranks(descending)).sum(dim=1)  # (N,) Pearson's r of the ranks
            out.append(torch.where(undefined, torch.nan, rho.clamp(-1.0, 1.0)))
        elif name == "topk_intersection":
            assert ref.top is not None and descending is not None
            share = (ref.top & _top(descending, ref.top_k)).sum(dim=1).double() / ref.top_k
            out.append(torch.where(undefined, torch.nan, share))
        elif name in ("ssim", "ssim_flat"):
            out.append(_ssim(ref, maps, name == "ssim_flat"))
        else:
            raise RunnerError(f"Unknown similarity '{name}': one of {', '.join(SIMILARITIES)}.")
    return torch.stack(out)


def _ssim(ref: Reference, maps: torch.Tensor, flat: bool) -> torch.Tensor:
    """(N,) skimage `structural_similarity` (sample covariance, K1, K2, the mean over the windows that fit, which is
    skimage's cropped mean of its uniform filter), data_range as Quantus's: max - min of both maps."""
    a, shift_a, ux, uxx = ref.window[flat]  # a centred, ux its window means
    b, shift_b = _centred(_ssim_shape(maps, flat))
    both = torch.cat([ref.maps.flatten(1), maps.flatten(1)], dim=1)  # (N, 2D)
    data_range = (both.amax(dim=1) - both.amin(dim=1)).view(-1, *([1] * (a.dim() - 1)))
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    pooled = _window_mean(torch.cat([b, b * b, a * b], dim=1))  # (N, 3, ...): one pooling for the three
    uy, uyy, uxy = pooled[:, :1], pooled[:, 1:2], pooled[:, 2:]
    points = SSIM_WINDOW if flat else SSIM_WINDOW**2
    cov_norm = points / (points - 1)  # skimage's use_sample_covariance=True
    # Shift-free (co)variances from the centred maps; a variance is never negative (rounding could make it so).
    vx = (cov_norm * (uxx - ux * ux)).clamp_min(0)
    vy = (cov_norm * (uyy - uy * uy)).clamp_min(0)
    vxy = cov_norm * (uxy - ux * uy)
    mx, my = ux + shift_a, uy + shift_b  # the windows' means of the maps themselves, for the luminance term
    s = ((2 * mx * my + c1) * (2 * vxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.flatten(1).mean(dim=1)


def spearman_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) Spearman's rho of each row pair of (N, ...) tensors; NaN where a side is constant or not finite."""
    return compare(reference(a, ["spearman"], 1.0), b, ["spearman"])[0]


def ssim_rows(a: torch.Tensor, b: torch.Tensor, flat: bool = False) -> torch.Tensor:
    """(N,) skimage `structural_similarity` of each (H, W) pair (a 1-D signal of H*W with `flat`)."""
    name = "ssim_flat" if flat else "ssim"
    return compare(reference(a, [name], 1.0), b, [name])[0]


def topk_intersection_rows(a: torch.Tensor, b: torch.Tensor, fraction: float) -> torch.Tensor:
    """(N,) share of a's top `fraction` pixels also in b's top; ties by pixel order; NaN where a side is constant."""
    return compare(reference(a, ["topk_intersection"], fraction), b, ["topk_intersection"])[0]


SIMILARITIES = ("spearman", "ssim", "ssim_flat", "topk_intersection")


def prepare(maps: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """(B, h, w) maps -> (B, H, W) float64 at the input size: bilinear, absolute, each divided by its maximum
    (an all-zero map stays zero), as Quantus's abs=True, normalise=True (per sample). A map constant at its own
    resolution stays exactly constant (float32 bilinear weights would leave 1-ulp ripples, which the ranks and
    the normalisation turn into an order)."""
    up = F.interpolate(maps[:, None].float(), size=tuple(size), mode="bilinear", align_corners=False)[:, 0].double()
    constant = uniform_rows(maps)[:, None, None]  # (B, 1, 1); a non-finite map keeps its NaN
    up = torch.where(constant, maps.detach().flatten(1)[:, :1, None].double().expand_as(up), up)
    up = up.abs()  # (B, H, W)
    top = up.flatten(1).amax(dim=1)[:, None, None]
    return torch.where(top > 0, up / torch.where(top > 0, top, 1.0), up)


def parameterised_modules(model: nn.Module, selectors: list[str]) -> list[Layer]:
    """The modules MPRT re-initialises, in model order: those with `reset_parameters` (Quantus's rule), the
    root excluded, narrowed to `selectors` (layer selectors, as layers.include) when given."""
    found = [(name, m) for name, m in model.named_modules() if name and hasattr(m, "reset_parameters")]
    if selectors:
        chosen = {name for name, _ in resolve_layers(model, selectors, where="method.randomize")}
        found = [(name, m) for name, m in found if name in chosen]
        if not found:
            raise RunnerError(
                f"method.randomize={selectors} selects no module with parameters to re-initialise"
                " (e.g. [_fc, Conv2d, _blocks.15])."
            )
    if not found:
        raise RunnerError("method=mprt: the model has no module with parameters to re-initialise (reset_parameters).")
    return found


class Mprt(Method):
    name = "mprt"
    table = "mprt"

    def __init__(self, cfg: MprtConfig, layers: list[Layer], runtime: Runtime) -> None:
        if cfg.target is TargetMode.topk:
            raise RunnerError("method=mprt compares one map per sample: use target predicted, label or fixed.")
        unknown = [s for s in cfg.similarities if s not in SIMILARITIES]
        if unknown or not cfg.similarities:
            hint = suggest(unknown[0], list(SIMILARITIES)) if unknown else ""
            raise RunnerError(
                f"method.similarities={list(cfg.similarities)}: each must be one of {', '.join(SIMILARITIES)}.{hint}"
            )
        try:
            self.order = MprtOrder(cfg.order)  # a plain string where code builds the config
        except ValueError:
            raise RunnerError(f"method.order={cfg.order}: one of {', '.join(o.value for o in MprtOrder)}.") from None
        self.cfg, self.layers, self.runtime = cfg, layers, runtime
        self.inner: CamMethod = inner_cam(cfg, cfg.inner, layers, runtime)

    def setup(self, session: HookSession, num_samples: int) -> None:
        self.inner.setup(session, num_samples)  # one capture: the same layers give the trained and randomised maps
        steps = parameterised_modules(session.model, self.cfg.randomize)
        if self.order is MprtOrder.top_down:
            steps = steps[::-1]
        self.steps = steps[: self.cfg.max_steps]
        log.info("mprt: %d steps (%s) from %s", len(self.steps), self.order.value, self.steps[0][0])

    def _maps(
        self, model: nn.Module, batch: Batch, session: HookSession, targets: torch.Tensor | None
    ) -> tuple[list[tuple[str, int]], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(entries (layer, call), their maps each (B, H, W) prepared, degenerate (E*B,) bool: a map constant or not
        finite at the layer's resolution, the targets, the predicted classes) from one forward and one backward."""
        fwd = self.inner.forward(model, batch, session)
        if targets is None:
            targets = select_targets(self.cfg, fwd.logits, batch)  # (B,)
        small = self.inner.maps(fwd, targets, model, batch.x, session)  # each (B, h, w)
        size = batch.x.shape[-2:]
        degenerate = torch.cat([constant_rows(m) for m in small])  # (E*B,) decided before upsampling
        maps = [prepare(m, size) for m in small]
        self.inner.capture.clear()  # the step's activations and graph go now, not at the next step
        return [(n, c) for n, c, _ in fwd.entries], maps, degenerate, targets, fwd.logits.argmax(dim=1)

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        entries, trained, flat, targets, predicted = self._maps(model, batch, session, None)
        b, sims = targets.shape[0], list(self.cfg.similarities)
        # All layers' maps as one (E*B, H, W) stack: each step compares them in one call, against a reference
        # computed once per batch (the trained maps' ranks, top pixels and SSIM windows).
        ref = reference(torch.cat(trained), sims, self.cfg.topk_fraction)
        values: list[torch.Tensor] = []  # per step: (E, K, B)
        degenerate: list[torch.Tensor] = []  # per step: (E, K, B) bool
        # The steps re-initialise the run's model in place, as edits the session owns: cascading, each step's edit
        # stays on top of the earlier ones; independent, the previous step's is undone first. All are undone
        # before the batch ends (and by the session, should this raise), so every batch starts from the trained
        # weights. Quantus seeds seed + 1 before each module.
        edits: list[Reinitialised] = []
        try:
            with session.recording_paused():  # the randomised forwards are the method's own, not the user's
                for _, module in self.steps:
                    if self.order is MprtOrder.independent and edits:
                        edits.pop().remove()
                    edits.append(session.reinitialise([module], self.cfg.seed + 1))
                    _, randomised, flat_random, _, _ = self._maps(model, batch, session, targets)
                    # A constant map (either side) ranks nothing: every similarity NaN, the row flagged.
                    undefined = (flat | flat_random)[None].expand(len(sims), -1)  # (K, E*B)
                    scores = torch.where(undefined, torch.nan, compare(ref, torch.cat(randomised), sims))  # (K, E*B)
                    values.append(scores.view(len(sims), len(entries), b).transpose(0, 1))
                    degenerate.append(undefined.reshape(len(sims), len(entries), b).transpose(0, 1))
        finally:
            for edit in reversed(edits):
                edit.remove()
            self.inner.capture.clear()
        n_steps, n_layers, n_sims = len(self.steps), len(entries), len(self.cfg.similarities)
        per_step = n_layers * n_sims * b  # rows of one step, ordered (layer, similarity, sample)
        module_types = {name: type(m).__name__ for name, m in self.layers}
        columns: Columns = {
            "layer": [n for n, _ in entries for _ in range(n_sims * b)] * n_steps,
            "module_type": [module_types[n] for n, _ in entries for _ in range(n_sims * b)] * n_steps,
            "call": [c for _, c in entries for _ in range(n_sims * b)] * n_steps,
            "sample_index": torch.arange(b, device=targets.device).repeat(n_steps * n_layers * n_sims),
            "target": targets.repeat(n_steps * n_layers * n_sims),
            "order": [self.order.value] * (n_steps * per_step),
            "step": [s + 1 for s in range(n_steps) for _ in range(per_step)],
            "randomised_up_to": [name for name, _ in self.steps for _ in range(per_step)],
            "randomised_type": [type(m).__name__ for _, m in self.steps for _ in range(per_step)],
            "similarity": [s for _ in range(n_steps * n_layers) for s in self.cfg.similarities for _ in range(b)],
            "value": torch.stack(values).reshape(-1).float(),  # (S, L, K, B) flattened
            "degenerate": torch.stack(degenerate).reshape(-1),
            "inner_method": [self.cfg.inner] * (n_steps * per_step),
        }
        return BatchOutput(predicted=predicted, tables={self.table: columns})


def mprt(
    model: nn.Module,
    x: torch.Tensor,
    layers: list[str],
    method: str = "gradcam",
    target: int | list[int] | torch.Tensor | None = None,
    **settings: object,
) -> pd.DataFrame:
    """MPRT of `model` (in eval mode) on the batch `x` (B, C, H, W), with no run directory: the `mprt` table's rows,
    one per (layer, call, step, similarity, sample): `value` is the similarity between the trained model's map of
    `layer` and its map after `step` re-initialisations (`randomised_up_to` names the module of that step).

    `method`: the CAM variant whose maps are compared; `target`: None for each sample's predicted class, a class id
    for all, or (B,) ids; `settings`: MprtConfig's fields (order, randomize, max_steps, similarities, seed, ...).
    The model's weights are re-initialised in place only while it runs, and restored (also on an error)."""
    cfg = library_config(MprtConfig, inner=method, **target_fields(target), **settings)
    out = run_on_batch(Mprt(cfg, resolve_layers(model, list(layers)), library_runtime(x)), model, x)
    return as_frame(out.tables["mprt"])
