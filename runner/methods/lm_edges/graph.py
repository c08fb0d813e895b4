"""The edge graph of a causal LM, read from its site layout (runner/models/lm_sites.py).

Nodes write into the residual stream (writers) or read from it (readers):
  writers  `input` (the embedding output), `a{l}.h{h}` (head h of layer l: its output through the attention's output
           projection), `m{l}` (the MLP of layer l);
  readers  `a{l}.h{h}<q>` (head h's query input), `a{l}.g{g}<k>` and `a{l}.g{g}<v>` (key-value head g's key and value
           input: with grouped-query attention one key-value head is read by heads//kv_heads query heads, and its
           edge is one, shared by them), `m{l}` (the MLP's input), `logits` (the final residual stream).
An edge joins a writer to every reader after it: a reader of layer l reads every writer of layers < l; the MLP of a
sequential block also reads its own layer's heads (a parallel block's MLP does not); `logits` reads every writer.
This is the graph of Syed et al. (2023) and Hanna et al. (2024) (EAP-IG's `Graph`), with key and value inputs per
key-value head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from runner.errors import RunnerError, suggest
from runner.models.lm_sites import LanguageModelLayout

INPUT_KINDS = ("q", "k", "v", "mlp", "logits")  # what a reader reads with


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # writers: input | head | mlp; readers: q | k | v | mlp | logits
    layer: int  # -1 for `input`; the layer count for `logits`
    head: int | None  # the head (q), the key-value head (k, v), None otherwise


@dataclass(frozen=True)
class EdgeGraph:
    """Writers and readers in model order, and which (writer, reader) pairs are edges."""

    layers: int
    heads: int
    kv_heads: int
    parallel: bool  # attention and MLP read the same stream (no same-layer head -> MLP edge)
    writers: list[Node]
    readers: list[Node]
    edges: torch.Tensor  # (writers, readers) bool

    @staticmethod
    def of(layout: LanguageModelLayout) -> EdgeGraph:
        layers, heads, kv_heads = layout.layers, layout.heads, layout.kv_heads
        parallel = layout.arch.mid_norm is None
        writers = [Node("input", "input", -1, None)]
        readers: list[Node] = []
        for layer in range(layers):
            readers += [Node(f"a{layer}.h{h}<q>", "q", layer, h) for h in range(heads)]
            readers += [Node(f"a{layer}.g{g}<{kind}>", kind, layer, g) for kind in "kv" for g in range(kv_heads)]
            readers.append(Node(f"m{layer}", "mlp", layer, None))
            writers += [Node(f"a{layer}.h{h}", "head", layer, h) for h in range(heads)]
            writers.append(Node(f"m{layer}", "mlp", layer, None))
        readers.append(Node("logits", "logits", layers, None))
        w_layer = torch.tensor([w.layer for w in writers])
        r_layer = torch.tensor([r.layer for r in readers])
        edges = w_layer[:, None] < r_layer[None, :]
        if not parallel:  # a sequential block's MLP reads its own layer's heads
            w_head = torch.tensor([w.kind == "head" for w in writers])
            r_mlp = torch.tensor([r.kind == "mlp" for r in readers])
            edges |= (w_layer[:, None] == r_layer[None, :]) & w_head[:, None] & r_mlp[None, :]
        return EdgeGraph(layers, heads, kv_heads, parallel, writers, readers, edges)

    @property
    def count(self) -> int:
        return int(self.edges.sum())

    def readers_of(self, layer: int, kind: str) -> list[int]:
        """The indices of layer `layer`'s readers of `kind` (q, k, v: one per head; mlp: one)."""
        return [i for i, r in enumerate(self.readers) if r.layer == layer and r.kind == kind]

    def writer_sites(self) -> list[str]:
        """The views that hold the writers' outputs, in writer order: the embeddings (resid_pre.0), then per layer
        its heads' outputs (head: each head's z before the output projection) and its MLP's (mlp_out)."""
        return ["resid_pre.0", *(f"{kind}.{layer}" for layer in range(self.layers) for kind in ("head", "mlp_out"))]

    def sites(self) -> list[tuple[str, int]]:
        """The (site, layer) pairs its writers and readers live at: writers' outputs (resid_pre.0 for the
        embeddings, head, mlp_out), readers' inputs and outputs (resid_pre, resid_mid, q, k, v, mlp_out), and the
        final stream (resid_post of the last layer)."""
        kinds = ["resid_pre", "head", "q", "k", "v", "mlp_out"] + ([] if self.parallel else ["resid_mid"])
        return [(kind, layer) for layer in range(self.layers) for kind in kinds] + [("resid_post", self.layers - 1)]

    def path_mask(self, senders: Sequence[str], receivers: Sequence[str], key: str) -> torch.Tensor:
        """(writers, readers) bool: the edges from the writers `senders` to the readers `receivers` name (names or
        shell patterns: `a22.h*`); RunnerError for a pattern that names no node, or sets joined by no edge."""
        sent = self._matching(self.writers, senders, f"{key}.senders", "writers")
        received = self._matching(self.readers, receivers, f"{key}.receivers", "readers")
        mask = self.edges & sent[:, None] & received[None, :]
        if not bool(mask.any()):
            raise RunnerError(
                f"{key}: no edge joins senders {list(senders)} to receivers {list(receivers)}: a reader reads the writers"
                " of earlier layers (and an MLP its own layer's heads), so give senders before the receivers."
            )
        return mask

    @staticmethod
    def _matching(nodes: list[Node], patterns: Sequence[str], key: str, what: str) -> torch.Tensor:
        names = [n.name for n in nodes]
        chosen = torch.zeros(len(nodes), dtype=torch.bool)
        for pattern in patterns:
            hits = torch.tensor([fnmatchcase(name, pattern) for name in names])
            if not bool(hits.any()):
                raise RunnerError(
                    f"{key}: '{pattern}' names none of the model's {what}.{suggest(pattern, names)} {what.capitalize()}:"
                    f" {', '.join(names[:4])}, ..., {names[-1]} (`runner layers` lists the layers and heads)."
                )
            chosen |= hits
        return chosen
