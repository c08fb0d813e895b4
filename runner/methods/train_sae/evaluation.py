"""How good a trained dictionary is, measured on the held-out windows, as SAELens's `evals.py` and the Gemma Scope
report measure it (x: the site's activation at a position, x_hat the dictionary's reconstruction, f its latents; every
position but the BOS):

    FVU       the fraction of variance unexplained, sum |x - x_hat|^2 / sum |x - mean(x)|^2, the mean over the
              held-out positions (1 - SAELens's `explained_variance`);
    massive   positions whose |x| is above 10 x the median |x| of the held-out positions: in SmolLM2's residual
              stream the first token of some windows has a norm near 100 x the median, and one such position can
              carry most of sum |x - mean(x)|^2; `fvu_without_massive` is the FVU of the other positions (about their
              own mean), reported beside the FVU rather than filtered out of it;
    L0        the mean over positions of the number of latents with f > 0;
    dead      latents with f > 0 at no held-out position (SAELens counts them over its evaluation tokens too);
    dense     latents with f > 0 at more than 10% of the positions (a density above 0.1);
    CE        the next-token cross-entropy (nats) of the predictions made from positions 1 .. T-2 of each window (the
              predictions after the BOS), the mean over every such prediction: CE_clean the model's own, CE_sae with
              the site replaced by x_hat at every position but the BOS (no error term: the model reads the
              reconstruction alone), CE_zero with it replaced by zeros there;
    recovered = (CE_zero - CE_sae) / (CE_zero - CE_clean), SAELens's `ce_loss_score`: 1 when splicing costs nothing,
              0 when it costs as much as removing the site. NaN, flagged `degenerate`, where zeroing the site changes
              the loss by less than 1e-6 nats (the ratio would divide by about nothing).
SAELens zero-ablates the BOS position too; here it keeps the model's value in every run, as the dictionary never saw it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.nn.functional as F

from runner.dictionaries.dictionary import Dictionary
from runner.methods.train_sae.activations import SiteReader
from runner.tables import Presentation, declare

DENSE = 0.1  # a latent firing at more than this share of the positions is dense
# A position whose |x| is above this many times the median is massive (Sun et al. 2024, "Massive activations": a
# few positions, often the first of a text, whose norm is tens to thousands of times the others')
MASSIVE = 10.0
DEGENERATE = 1e-6  # |CE_zero - CE_clean| below this (nats): no recovered share
CHUNK = 4096  # positions encoded at once
WINDOWS_TABLE = "train_sae_windows"

WINDOWS = declare(
    WINDOWS_TABLE,  # one row per window of the data: its part, and the held-out ones' losses
    [
        pa.field("split", pa.string()),  # train | held_out
        pa.field("positions", pa.int64()),  # the positions the dictionary reads (all but the BOS)
        pa.field("ce_clean", pa.float64()),  # held_out only: the mean CE of the window's predictions after the BOS
        pa.field("ce_sae", pa.float64()),
        pa.field("ce_zero", pa.float64()),
        pa.field("mse", pa.float64()),  # the mean |x - x_hat|^2 over the window's positions
        pa.field("l0", pa.float64()),  # the mean number of latents with f > 0 over the window's positions
    ],
    Presentation(section="runner.viz.dictionary_report:windows_section"),
    classes=False,
)


@dataclass(frozen=True)
class Reconstruction:
    """The reconstruction and sparsity of a dictionary on activations x (N, d)."""

    positions: int
    fvu: float
    mse: float  # the mean over positions of |x - x_hat|^2
    l0: float
    fires: torch.Tensor  # (W,) int64: positions at which each latent has f > 0
    massive: int = 0  # positions whose |x| is above MASSIVE x the median |x|
    fvu_without_massive: float = math.nan  # the FVU of the other positions (about their own mean)

    @property
    def density(self) -> torch.Tensor:
        """(W,) the share of the positions at which each latent fires."""
        return self.fires.double() / max(self.positions, 1)

    @property
    def dead(self) -> int:
        return int((self.fires == 0).sum())

    @property
    def dense(self) -> int:
        return int((self.density > DENSE).sum())


def reconstruction(dictionary: Dictionary, x: torch.Tensor) -> Reconstruction:
    """FVU, mean squared error, L0 and each latent's firing count of `dictionary` on `x` (N, d), in chunks; and the
    FVU without the massive positions."""
    norms = x.norm(dim=-1)  # (N,)
    massive = norms > MASSIVE * norms.median()  # (N,)
    means = x.double().mean(0).float(), x[~massive].double().mean(0).float()  # (d,) each: all, without massive
    sse = sst = sse_typical = sst_typical = active = 0.0
    fires = torch.zeros(dictionary.width, dtype=torch.long)
    with torch.no_grad():
        for chunk, big in zip(x.split(CHUNK), massive.split(CHUNK), strict=True):
            f = dictionary.encode(chunk)  # (C, W)
            error = (chunk - dictionary.decode(f, chunk)).double().pow(2).sum(-1)  # (C,)
            sse += float(error.sum())
            sst += float((chunk - means[0]).double().pow(2).sum())
            sse_typical += float(error[~big].sum())
            sst_typical += float((chunk[~big] - means[1]).double().pow(2).sum())
            on = f > 0
            active += float(on.sum())
            fires += on.sum(0).cpu()
    n = x.shape[0]
    return Reconstruction(n, _ratio(sse, sst), sse / max(n, 1), active / max(n, 1), fires, int(massive.sum()),
                          _ratio(sse_typical, sst_typical))  # fmt: skip


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """(B,) the mean next-token cross-entropy of the predictions from positions first .. T-2 of windows `ids` (B, T)."""
    predicted = logits[:, first:-1].float()  # (B, P, V)
    targets = ids[:, first + 1 :]  # (B, P)
    losses = F.cross_entropy(predicted.flatten(0, 1), targets.flatten(), reduction="none")  # (B x P,)
    return losses.view(targets.shape).mean(1)


@dataclass(frozen=True)
class WindowLosses:
    """One batch of held-out windows: each window's CE in the three runs, and the site's activations (B, T-first, d)
    at the positions the dictionary reads."""

    clean: torch.Tensor  # (B,)
    sae: torch.Tensor  # (B,)
    zero: torch.Tensor  # (B,)
    acts: torch.Tensor  # (B, T - first, d) float32


def spliced_losses(reader: SiteReader, dictionary: Dictionary, ids: torch.Tensor, first: int) -> WindowLosses:
    """The three forwards of windows `ids` (B, T): clean, the site replaced by the reconstruction, by zeros (from
    position `first` on: the BOS keeps its value)."""
    logits, site = reader.clean(ids)  # (B, T, V), (B, T, d)
    clean = next_token_ce(logits, ids, first)
    del logits
    acts = site[:, first:]  # (B, T - first, d)
    with torch.no_grad():
        x_hat = dictionary(acts.to(dictionary.W_enc.device)).to(site.device)  # (B, T - first, d)
    spliced = torch.cat([site[:, :first], x_hat], dim=1)  # (B, T, d)
    zeroed = torch.cat([site[:, :first], torch.zeros_like(acts)], dim=1)
    sae = next_token_ce(reader.replaced(ids, spliced), ids, first)
    zero = next_token_ce(reader.replaced(ids, zeroed), ids, first)
    return WindowLosses(clean.cpu(), sae.cpu(), zero.cpu(), acts.clone())


def recovered(ce_clean: float, ce_sae: float, ce_zero: float) -> tuple[float, bool]:
    """((CE_zero - CE_sae) / (CE_zero - CE_clean), degenerate): NaN and True where zeroing changes the loss by less
    than DEGENERATE."""
    gap = ce_zero - ce_clean
    if abs(gap) < DEGENERATE:
        return math.nan, True
    return (ce_zero - ce_sae) / gap, False
