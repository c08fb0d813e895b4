"""A language model's activations at one site over windows of text, read through the run's hook session, and the
forwards that replace the site (the reconstruction spliced in, or zeros).

The site is kept by the patching engine's hooks (runner/hooks/sites.py: the tensor lm_patching reads and replaces,
resid_mid as the block's input plus its attention's output), registered through the session. When only the site is
wanted, a hook on its block's output stops the forward there (TransformerLens's `stop_at_layer`): the blocks after it
and the unembedding are never computed, which halves the cost of collecting a middle layer.

Positions read: every position but the BOS the windows start with (data=text prepends one where the tokenizer has
it). The BOS's activation is not text: in the residual stream of most models its norm is many times every other
token's (an attention sink), and a dictionary trained with it spends latents and loss on reconstructing it. Splicing
leaves the BOS position as the model computed it, for the same reason. Activations are held as float32 whatever the
model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import Cell, SiteHooks
from runner.models.lm_sites import LanguageModelLayout, SiteSpec, layout_of

# The planned buffer may take at most this share of the device's free memory (the model, its forwards and the
# training's own tensors need the rest).
MEMORY_SHARE = 0.5


class _Stop(Exception):
    """Raised by the hook on the site's block when the forward is wanted only up to the site."""


class SiteReader:
    """Reads, and replaces, one site of `model` in forwards of whole windows (B, T)."""

    def __init__(self, model: nn.Module, layout: LanguageModelLayout, spec: SiteSpec, session: HookSession) -> None:
        self.model, self.spec = model, spec
        self.hooks = SiteHooks(model, [spec], session)  # registered first: they run before the stop below
        self.stopping = False
        block = dict(model.named_modules())[f"{layout.arch.blocks}.{spec.layer}"]
        session.add_hook(block, self._stop, pre=False)

    def _stop(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self.stopping:
            raise _Stop

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The site's activations (B, T, d) float32 on windows `ids` (B, T), the forward stopped after the site."""
        self.stopping = True
        try:
            with torch.no_grad(), self.hooks.keep():
                try:
                    self.model(input_ids=ids, use_cache=False)
                except _Stop:
                    pass
        finally:
            self.stopping = False
        return self._taken()

    def clean(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits (B, T, vocabulary), the site's activations (B, T, d) float32) of one whole forward."""
        with torch.no_grad(), self.hooks.keep():
            logits = self.model(input_ids=ids, use_cache=False).logits
        return logits, self._taken()

    def replaced(self, ids: torch.Tensor, site: torch.Tensor) -> torch.Tensor:
        """The logits (B, T, vocabulary) of a forward with the site's tensor replaced by `site` (B, T, d)."""
        self.hooks.plan([Cell(self.spec.kind, self.spec.layer, None, None)], ids.shape[0], {self.spec.name: site})
        try:
            with torch.no_grad():
                return self.model(input_ids=ids, use_cache=False).logits
        finally:
            self.hooks.clear()

    def _taken(self) -> torch.Tensor:
        kept, self.hooks.kept = self.hooks.kept, {}
        if self.spec.name not in kept:
            raise RunnerError(f"method=train_sae: the forward never reached {self.spec.name}.")
        return kept[self.spec.name].float()


def collect_activations(
    model: nn.Module, ids: torch.Tensor, site: str, layer: int, first: int = 1, batch_size: int = 8
) -> torch.Tensor:
    """A library call: the activations (N, d) float32 at `site` of block `layer` over windows `ids` (B, T), positions
    `first`.. of each window (1: not the BOS), window after window, `batch_size` windows per forward; the hooks are
    registered in a session of their own and removed again."""
    layout = layout_of(model)
    with HookSession(model, []) as session:
        reader = SiteReader(model, layout, layout.site(site, layer), session)
        parts = [reader.read(part)[:, first:].flatten(0, 1) for part in ids.split(batch_size)]  # each (b x T', d)
    return torch.cat(parts)


def check_buffer(tokens: int, d_in: int, width: int, batch_tokens: int, free: int | None) -> None:
    """Refuse, before any forward, activations of `tokens` positions (the training and the held-out windows') that with
    the training's tensors would take more than MEMORY_SHARE of the `free` bytes (None: unknown, not checked)."""
    buffer = tokens * d_in * 4  # float32
    # the parameters, their gradients and Adam's two moments, and a step's (batch, width) tensors
    training = 4 * (2 * width * d_in + width + d_in) * 4 + 6 * batch_tokens * width * 4
    if free is not None and buffer + training > MEMORY_SHARE * free:
        raise RunnerError(
            f"method=train_sae holds the activations of {tokens:,} positions x {d_in} values in memory"
            f" ({buffer / 1e9:.2f} GB as float32) and trains with {training / 1e9:.2f} GB more, above"
            f" {MEMORY_SHARE:.0%} of the {free / 1e9:.2f} GB free: use fewer windows (data.windows=N) or a smaller"
            " method.width / method.batch_tokens."
        )
