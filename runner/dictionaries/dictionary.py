"""A sparse dictionary: an SAE (it reconstructs the activation it reads) or a transcoder (it reads one activation, the
MLP's input, and predicts another, the MLP's output), written from the published definitions (SAELens's `SAE`
classes, Gemma Scope's JumpReLU), with no dependency on SAELens.

    encode:  h = (x' - b_dec [if apply_b_dec_to_input]) @ W_enc + b_enc,  x' = x normalised (`normalize`)
             relu:      f = relu(h)
             jumprelu:  f = relu(h) * (h > threshold)
             topk:      f = relu(h) at the k largest h of each row, 0 elsewhere
             batchtopk: at inference as SAELens runs it once trained: jumprelu with its saved threshold
    decode:  x_hat = (f @ W_dec + b_dec), the normalisation undone

Normalisation (SAELens's `normalize_activations`): "none"; "expected_average_only_in" (x' = x * scale, a constant
found in training, the output divided by it); "constant_norm_rescale" (x' = x * sqrt(d_in) / |x| per row, the output
multiplied back by |x| / sqrt(d_in)). A transcoder's output is undone with the input's own scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ARCHITECTURES = ("relu", "jumprelu", "topk", "batchtopk")
NORMALISATIONS = ("none", "expected_average_only_in", "constant_norm_rescale")


@dataclass(frozen=True)
class DictionarySpec:
    """What a dictionary is, without its weights: read from its config file before any weight loads."""

    architecture: str  # one of ARCHITECTURES
    d_in: int
    width: int  # the number of latents (SAELens's d_sae)
    d_out: int  # = d_in for an SAE; the predicted activation's width for a transcoder
    k: int = 0  # topk / batchtopk: latents kept per row
    apply_b_dec_to_input: bool = False
    normalize: str = "none"  # one of NORMALISATIONS
    scale: float = 1.0  # expected_average_only_in: the constant x is multiplied by
    transcoder: bool = False

    @property
    def kind(self) -> str:
        return "transcoder" if self.transcoder else "SAE"


class Dictionary(nn.Module):
    """A sparse dictionary's weights and its encode/decode (the module docstring gives the formulas)."""

    def __init__(self, spec: DictionarySpec) -> None:
        super().__init__()
        self.spec = spec
        self.W_enc = nn.Parameter(torch.zeros(spec.d_in, spec.width))  # noqa: N815 (SAELens's names)
        self.b_enc = nn.Parameter(torch.zeros(spec.width))
        self.W_dec = nn.Parameter(torch.zeros(spec.width, spec.d_out))  # noqa: N815
        self.b_dec = nn.Parameter(torch.zeros(spec.d_out))
        self.threshold = nn.Parameter(torch.zeros(spec.width))  # jumprelu and batchtopk only

    @property
    def width(self) -> int:
        return self.spec.width

    def _scale(self, x: torch.Tensor) -> torch.Tensor | float:
        """What x is multiplied by before encoding ((..., 1) per row, or a constant)."""
        if self.spec.normalize == "constant_norm_rescale":
            return (self.spec.d_in**0.5) / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        if self.spec.normalize == "expected_average_only_in":
            return self.spec.scale
        return 1.0

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """h: (..., d_in) -> (..., width), before the activation function."""
        x = x * self._scale(x)
        if self.spec.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The latents f of input x: (..., d_in) -> (..., width)."""
        h = self.pre_activations(x)
        arch = self.spec.architecture
        if arch == "relu":
            return torch.relu(h)
        if arch in ("jumprelu", "batchtopk"):
            return torch.relu(h) * (h > self.threshold)
        top = torch.topk(h, self.spec.k, dim=-1)  # topk
        return torch.zeros_like(h).scatter(-1, top.indices, torch.relu(top.values))

    def decode(self, f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction from latents f (..., width) -> (..., d_out); `x` is the input the latents were encoded
        from, whose normalisation the output undoes."""
        return (f @ self.W_dec + self.b_dec) / self._scale(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x)
