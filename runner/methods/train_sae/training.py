"""Training a sparse autoencoder on activations held in memory: TopK (Gao et al. 2024) or JumpReLU (Rajamanoharan et
al. 2024, "Jumping Ahead"), with Adam, deterministic for a seed.

Both read the activations normalised as SAELens's `normalize_activations="expected_average_only_in"` does: x' = s x
with s = sqrt(d_in) / mean |x| over the training activations, so the settings (learning rate, L0 coefficient,
bandwidth, threshold) mean the same at any model's scale; the saved dictionary keeps s in its spec, and SAELens's
layout folds it into the weights (runner/dictionaries/formats.py).

    encode:  h = (x' - b_dec) @ W_enc + b_enc                     (SAELens's apply_b_dec_to_input)
             topk:     f = relu(h) at each row's k largest h, 0 elsewhere
             jumprelu: f = h * H(h - theta), theta = exp(log_theta) per latent
    decode:  x_hat' = f @ W_dec + b_dec
    loss:    topk:     |x' - x_hat'|^2 + aux_coefficient * AuxK
             jumprelu: |x' - x_hat'|^2 + l0_coefficient * |f|_0
(|.|^2 summed over the d_in values, then the mean over the batch, as SAELens's MSE loss.)

JumpReLU's step H has no useful derivative, so its gradient is the straight-through estimator of the paper, as
SAELens's `jumprelu_sae.py` implements it: in the backward pass H's derivative with respect to theta is the rectangle
kernel K(u) = 1 for |u| < 1/2 of width `bandwidth` (eps): d f / d theta = -(theta / eps) K((h - theta) / eps), and
d L0 / d theta = -(1 / eps) K((h - theta) / eps); f's derivative with respect to h is H(h - theta) (no kernel term).
TopK's derivative reaches only the k kept pre-activations. AuxK: the dead latents (no firing in `dead_steps` steps)
take the top k_aux = d_in / 2 of their pre-activations and predict the residual x' - x_hat' (its gradient stopped),
weighted by min(dead / k_aux, 1), as Gao et al. (Appendix B.1) and SAELens do; their prediction has no b_dec (the
residual has no offset).

Initialisation: decoder rows random unit vectors, W_enc = W_dec^T (so each latent first reads its own direction),
b_enc = 0, b_dec = the mean of the normalised training activations (not their geometric median). Decoder rows are
kept at unit norm (for both architectures): the gradient's component along each row is removed before a step and
the rows renormalised after it (Bricken et al. 2023, Gao et al.), so a latent's size is its activation, not its row.
The learning rate is constant, then decays linearly to 0 over the last fifth of the steps.

Determinism: the initial weights and the order of the activations (a new permutation each pass over them) come from
generators seeded by the run's seed (runner/randomness.py); on the CPU the same seed gives bit-equal weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from runner.dictionaries.dictionary import Dictionary, DictionarySpec
from runner.randomness import sample_generator
from runner.tables import Presentation, declare

log = logging.getLogger(__name__)

DECAY = 0.2  # the share of the steps at the end over which the learning rate decays to 0
STEPS_TABLE = "train_sae_steps"

STEPS = declare(
    STEPS_TABLE,  # one row per training step (the normalised activations' units)
    [
        pa.field("step", pa.int64()),  # counted from 0
        pa.field("loss", pa.float64()),  # mse + the auxiliary term
        pa.field("mse", pa.float64()),  # the batch's mean |x' - x_hat'|^2 (x' = s x)
        pa.field("fvu", pa.float64()),  # the batch's sum |x' - x_hat'|^2 / sum |x' - its mean|^2
        pa.field("l0", pa.float64()),  # the batch's mean latents with f > 0 per position
        pa.field("aux_loss", pa.float64()),  # topk: AuxK (before its weight); jumprelu: the L0 term's L0
        pa.field("dead", pa.int64()),  # latents that have not fired for method.dead_steps steps
        pa.field("lr", pa.float64()),  # the step's learning rate (its last fifth decays to 0)
    ],
    Presentation(section="runner.viz.dictionary_report:steps_section"),
    classes=False,
)


@dataclass(frozen=True)
class Training:
    """How a dictionary is trained (method=train_sae's settings, runner/options/method/train_sae.py)."""

    architecture: str  # topk | jumprelu
    width: int
    k: int | None = None  # topk
    l0_coefficient: float = 1.0  # jumprelu
    bandwidth: float = 0.05  # jumprelu
    threshold_init: float = 0.01  # jumprelu
    aux_coefficient: float = 1 / 32  # topk
    dead_steps: int = 200  # topk's AuxK: steps without firing that make a latent dead
    steps: int = 1000
    batch_tokens: int = 1024
    lr: float = 1e-3
    seed: int = 0

    @classmethod
    def of(cls, cfg: Any, seed: int) -> Training:
        """The training a train_sae config asks for, with the run's seed."""
        names = [f for f in cls.__dataclass_fields__ if f != "seed"]
        return cls(**{name: getattr(cfg, name) for name in names}, seed=seed)


@dataclass
class Trained:
    """A trained dictionary, its training curve (one value per step and column) and the time it took."""

    dictionary: Dictionary
    curve: dict[str, list[float]] = field(default_factory=dict)  # step, loss, mse, fvu, l0, aux_loss, dead, lr
    seconds: float = 0.0


class JumpReLU(torch.autograd.Function):
    """f = h * H(h - theta); backward: df/dh = H(h - theta), df/dtheta = -(theta / eps) K((h - theta) / eps)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(h, threshold)
        ctx.bandwidth = bandwidth
        return h * (h > threshold)  # (B, W)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        h, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_h = (h > threshold) * grad  # (B, W): no kernel term for h (straight through)
        grad_threshold = (-(threshold / eps) * rectangle((h - threshold) / eps) * grad).sum(0)  # (W,)
        return grad_h, grad_threshold, None


class Step(torch.autograd.Function):
    """H(h - theta); backward: dH/dtheta = -(1 / eps) K((h - theta) / eps), nothing for h (the L0's gradient)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(h, threshold)
        ctx.bandwidth = bandwidth
        return (h > threshold).to(h.dtype)  # (B, W)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        h, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        return None, (-(1.0 / eps) * rectangle((h - threshold) / eps) * grad).sum(0), None


def rectangle(u: torch.Tensor) -> torch.Tensor:
    """The rectangle kernel: 1 where |u| < 1/2, else 0."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


def norm_scale(acts: torch.Tensor) -> float:
    """s with mean |s x| = sqrt(d_in) over `acts` (N, d_in): SAELens's expected_average_only_in scaling factor."""
    mean_norm = float(acts.norm(dim=-1).mean())
    return math.sqrt(acts.shape[1]) / max(mean_norm, 1e-12)


class _Weights(nn.Module):
    """The parameters being trained (in the normalised space); `log_threshold` is used by jumprelu only."""

    def __init__(self, d: int, width: int, mean: torch.Tensor, threshold_init: float, generator: torch.Generator):
        super().__init__()
        rows = torch.randn(width, d, generator=generator)  # (W, d)
        rows = rows / rows.norm(dim=-1, keepdim=True)
        self.W_dec = nn.Parameter(rows)  # noqa: N815 (SAELens's names)
        self.W_enc = nn.Parameter(rows.t().clone())  # noqa: N815 (d, W)
        self.b_enc = nn.Parameter(torch.zeros(width))
        self.b_dec = nn.Parameter(mean.clone())  # (d,)
        self.log_threshold = nn.Parameter(torch.full((width,), math.log(threshold_init)))


def train_dictionary(
    acts: torch.Tensor, training: Training, report: Callable[[int, dict[str, float]], None] | None = None
) -> Trained:
    """A dictionary trained on `acts` (N, d_in) float32 (on the device it trains on) as `training` says; `report`
    is called with (step, the step's values) now and then (a tenth of the way each time)."""
    started = time.perf_counter()
    n, d = acts.shape
    scale = norm_scale(acts)
    batch = min(training.batch_tokens, n)
    device = acts.device
    weights = _Weights(d, training.width, acts.mean(0).cpu() * scale, training.threshold_init,
                       sample_generator(training.seed, 0, "train_sae.init")).to(device)  # fmt: skip
    used = [
        p for name, p in weights.named_parameters() if name != "log_threshold" or training.architecture == "jumprelu"
    ]
    optimiser = torch.optim.Adam(used, lr=training.lr)
    order = sample_generator(training.seed, 0, "train_sae.order")
    since_fired = torch.zeros(training.width, dtype=torch.long, device=device)  # (W,) steps since each latent fired
    curve: dict[str, list[float]] = {key: [] for key in ("step", "loss", "mse", "fvu", "l0", "aux_loss", "dead", "lr")}
    permutation, cursor = torch.randperm(n, generator=order), 0
    for step in range(training.steps):
        if cursor + batch > n:  # a new pass over the activations, in a new order
            permutation, cursor = torch.randperm(n, generator=order), 0
        x = acts[permutation[cursor : cursor + batch].to(device)] * scale  # (B, d)
        cursor += batch
        lr = training.lr * min(1.0, (training.steps - step) / (DECAY * training.steps))
        for group in optimiser.param_groups:
            group["lr"] = lr
        dead = since_fired > training.dead_steps  # (W,)
        loss, values, fired = _loss(weights, x, training, dead)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            rows, grad = weights.W_dec, weights.W_dec.grad  # (W, d) each
            grad -= (grad * rows).sum(-1, keepdim=True) * rows  # only changes of direction: rows stay unit norm
        optimiser.step()
        with torch.no_grad():
            weights.W_dec /= weights.W_dec.norm(dim=-1, keepdim=True)
            since_fired += 1
            since_fired[fired] = 0
        values.update(step=step, loss=float(loss.detach()), dead=float(dead.sum()), lr=lr)
        for key in curve:
            curve[key].append(values[key])
        if report is not None and (step + 1) % max(1, training.steps // 10) == 0:
            report(step, values)
    return Trained(_dictionary(weights, training, d, scale), curve, time.perf_counter() - started)


def _loss(
    weights: _Weights, x: torch.Tensor, training: Training, dead: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """(the loss, its parts as numbers, (W,) which latents fired) on the normalised batch `x` (B, d)."""
    h = (x - weights.b_dec) @ weights.W_enc + weights.b_enc  # (B, W)
    if training.architecture == "topk":
        assert training.k is not None
        top = h.topk(training.k, dim=-1)
        f = torch.zeros_like(h).scatter(-1, top.indices, top.values.relu())  # (B, W)
        x_hat = f @ weights.W_dec + weights.b_dec  # (B, d)
        mse = (x_hat - x).pow(2).sum(-1).mean()
        aux = _aux_k(weights, h, x - x_hat, dead)
        loss = mse + training.aux_coefficient * aux
    else:
        threshold = weights.log_threshold.exp()  # (W,)
        f = JumpReLU.apply(h, threshold, training.bandwidth)  # (B, W)
        x_hat = f @ weights.W_dec + weights.b_dec  # (B, d)
        mse = (x_hat - x).pow(2).sum(-1).mean()
        aux = Step.apply(h, threshold, training.bandwidth).sum(-1).mean()  # the L0, with its kernel gradient
        loss = mse + training.l0_coefficient * aux
    with torch.no_grad():
        active = f > 0  # (B, W)
        variance = (x - x.mean(0)).pow(2).sum()
        values = {"mse": float(mse), "fvu": float((x_hat - x).pow(2).sum() / variance), "aux_loss": float(aux),
                  "l0": float(active.sum(-1).float().mean())}  # fmt: skip
    return loss, values, active.any(0)


def _aux_k(weights: _Weights, h: torch.Tensor, residual: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """AuxK: the dead latents' top k_aux pre-activations predict the residual (B, d) of the live ones (its gradient
    stopped), weighted by min(dead / k_aux, 1); 0 when no latent is dead."""
    count = int(dead.sum())
    if count == 0:
        return h.new_zeros(())
    k_aux = max(1, weights.W_dec.shape[1] // 2)  # d_in / 2
    weight = min(count / k_aux, 1.0)
    top = h.masked_fill(~dead, float("-inf")).topk(min(k_aux, count), dim=-1)  # only dead latents compete
    f = torch.zeros_like(h).scatter(-1, top.indices, top.values.relu())  # (B, W)
    predicted = f @ weights.W_dec  # (B, d)
    return weight * (predicted - residual.detach()).pow(2).sum(-1).mean()


def _dictionary(weights: _Weights, training: Training, d: int, scale: float) -> Dictionary:
    """The trained weights as a Dictionary (on the CPU) that normalises its input by `scale` itself."""
    spec = DictionarySpec(training.architecture, d, training.width, d, k=training.k or 0, apply_b_dec_to_input=True,
                          normalize="expected_average_only_in", scale=scale)  # fmt: skip
    dictionary = Dictionary(spec)
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            getattr(dictionary, name).copy_(getattr(weights, name).detach().cpu())
        if training.architecture == "jumprelu":
            dictionary.threshold.copy_(weights.log_threshold.detach().exp().cpu())
    return dictionary.requires_grad_(False).eval()
