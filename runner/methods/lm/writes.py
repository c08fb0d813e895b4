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


def frozen_scale(norm: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """(..., D) float32: the factor an RMS norm multiplies `y` (..., D) by, gain / RMS(y), with the RMS of `y` itself:
    norm(y) = frozen_scale(norm, y) * y. The gain is read from the module's own forward on a vector of ones
    (Gemma's 1 + weight, OLMo 2's weight), its epsilon from the module."""
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0)))
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
