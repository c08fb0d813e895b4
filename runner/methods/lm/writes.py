"""Each writer's write into a language model's residual stream, shared by the methods that split the stream into
its writers (lm_edges' edges, lm_dla's direct logit attribution): a head's write is its output through the attention's
output projection alone, o(z_h) - o(0); where the family norms the attention's output after the heads are summed
(Gemma 2 and 3, OLMo 2), that write times the norm's gain over the summed output's RMS in the same run (`HeadWrites`),
so that a run's head writes sum to what its attention adds to the stream."""

from __future__ import annotations

import torch
from torch import nn

from runner.errors import RunnerError
from runner.models.lm_sites import LanguageModelLayout


def each_head_alone(x: torch.Tensor) -> torch.Tensor:
    """(H, ..., H, d): copy h of a per-head tensor `x` (..., H, d) with every head but h zeroed."""
    heads = x.shape[-2]
    one_head = torch.eye(heads, dtype=x.dtype, device=x.device).view(heads, *(1,) * (x.dim() - 2), heads, 1)
    return x[None] * one_head


def head_writes(out_proj: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """(H, ..., D): each head's write of `z` (..., H, d) through the output projection alone: o(z with only head h)
    - o(0), the projection's own forward (not its hooks)."""
    alone = each_head_alone(z).flatten(-2)  # (H, ..., H x d)
    return out_proj.forward(alone) - out_proj.forward(torch.zeros_like(alone.flatten(0, -2)[:1]))


def epsilon(norm: nn.Module) -> float:
    """A norm module's epsilon, by either name transformers gives it (`eps`, `variance_epsilon`); 0 without one."""
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0)) or 0.0)


def frozen_scale(norm: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """(..., D) float32: the factor an RMS norm multiplies `y` (..., D) by, gain / RMS(y), with the RMS of `y` itself:
    norm(y) = frozen_scale(norm, y) * y. The gain is read from the module's own forward on a vector of ones
    (Gemma's 1 + weight, OLMo 2's weight), its epsilon from the module."""
    eps = epsilon(norm)
    ones = torch.ones(1, y.shape[-1], dtype=y.dtype, device=y.device)
    gain = norm.forward(ones)[0].float() * (1.0 + eps) ** 0.5
    return gain * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + eps)


class HeadWrites:
    """Each head's write into the residual stream, per layer: its output through the attention's output projection
    (head_writes); in a family that norms the attention's output after the heads are summed (the layout's
    `attn_branch`), times that norm's factor at the run's own summed output (frozen_scale): the linear share of the
    norm's output that is the head's, so that a run's head writes sum to what its attention adds to the stream,
    exactly. Refused: a projection with a bias under such a norm (the bias's share would be nobody's write)."""

    def __init__(self, model: nn.Module, layout: LanguageModelLayout, layers: int, method: str = "lm_edges") -> None:
        modules = dict(model.named_modules())
        self.out_proj = [modules[layout.site("head", layer).module] for layer in range(layers)]
        branch = layout.arch.attn_branch
        self.norm = [modules[layout.site("attn_out", layer).module] if branch else None for layer in range(layers)]
        if branch and any(getattr(o, "bias", None) is not None for o in self.out_proj):
            raise RunnerError(
                f"method={method}: this {layout.arch.family} model's attention output projection has a bias, which"
                f" {branch} norms with the heads' sum: a head's write would not account for it. Load the model"
                " without attention biases (attention_bias=false), or use method=lm_patching."
            )

    @property
    def post_norm(self) -> bool:
        return self.norm[0] is not None if self.norm else False

    def __call__(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """(H, ..., D) the heads' writes of the run whose layer-`layer` heads output `z` (..., H, d)."""
        writes = head_writes(self.out_proj[layer], z)
        norm = self.norm[layer]
        if norm is None:
            return writes
        summed = self.out_proj[layer].forward(z.flatten(-2))  # the run's attention output before the norm
        return (writes.float() * frozen_scale(norm, summed)[None]).to(writes.dtype)


class FrozenNorm:
    """A norm (LayerNorm or RMSNorm, any family's form: Gemma's 1 + weight, OLMo's weightless LayerNorm) made linear
    by freezing its scale at a run's stream `x` (..., D): `self(c)` = gain * centred(c) / scale(x), the share of
    norm(x) - bias that is c's when x is a sum of such c (TransformerLens' `apply_ln_to_stack` with the cached scale).
    Read from the module's own forward, not from its weights' names: `bias` = norm(0); the norm centres when norm(c + 1)
    = norm(c); then norm(c) - bias = gain * centred(c) / scale(c) gives each c's share at x's scale."""

    def __init__(self, norm: nn.Module, x: torch.Tensor) -> None:
        self.norm = norm
        self.eps = epsilon(norm)
        d = x.shape[-1]
        probe = torch.linspace(-2.0, 3.0, d, dtype=torch.float32, device=x.device)[None].sin() * 3.0
        with torch.no_grad():
            self.bias = self._forward(torch.zeros(1, d, device=x.device))[0]  # (D,)
            self.centres = bool(torch.allclose(self._forward(probe), self._forward(probe + 1.0), atol=1e-4, rtol=1e-4))
        self.scale = self.spread(x.float())  # (..., 1)

    def _forward(self, v: torch.Tensor) -> torch.Tensor:
        """The module's own forward in float32 (not its hooks)."""
        weight = next(self.norm.parameters(), None)
        dtype = weight.dtype if weight is not None else torch.float32
        return self.norm.forward(v.to(dtype)).float()

    def spread(self, v: torch.Tensor) -> torch.Tensor:
        """(..., 1) the norm's denominator for `v` (..., D): sqrt(mean of (centred) squares + eps)."""
        centred = v - v.mean(-1, keepdim=True) if self.centres else v
        return (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def __call__(self, c: torch.Tensor) -> torch.Tensor:
        """(..., D) float32 share of each `c` (W, ..., D), at x's scale (broadcast over the leading W)."""
        c = c.float()
        spread = self.spread(c)
        normed = (self._forward(c) - self.bias) * spread
        return torch.where(spread > 0, normed, torch.zeros_like(normed)) / self.scale
