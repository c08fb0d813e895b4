"""Named sites of a Hugging Face causal language model, from one adapter per architecture family.

A site is a tensor of one block that a method reads or replaces: `resid_pre` (the block's input), `resid_mid` (the
residual stream between attention and MLP, where the block has one: what both the MLP's branch and the skip connection
around it read), `resid_post` (the block's output), `attn_out`,
`mlp_out` (the attention's and the MLP's outputs), `head` (each head's output before the output projection), `q`,
`k`, `v` (per head, before rotary embeddings), `pattern` (each head's attention pattern after the softmax; eager
attention only). Each is found as a module's input or output (`SiteSpec.module`, `where`) and, for per-head sites,
viewed as (batch, positions, heads, head size) by `get` and written back by `put`; so a site works with hooks alone,
on transformers 4.x (blocks return tuples) and 5.x (tensors) alike. `pattern` is the one site inside a module's
forward (`where="softmax"`): the attention module's only softmax, which eager attention computes in every family and
version (runner/hooks/sites.py reads it there); fused kernels (sdpa, flash) never materialise it.

`resid_mid` is the stream where the MLP's branch reads it (the input of `Architecture.mid_norm`); but a replacement
given there would reach only the MLP's branch (the skip connection keeps the tensor it already holds). So the site
also names how it is written (`SiteSpec.stream`): the block's input plus the attention's branch output (the
attention's, or its post-norm's where the family applies one: Gemma 2 and 3, OLMo 2), a replacement written into
that output as (new - stream), so that every reader of the stream gets the new value. `attn_out` and `mlp_out` are
the same branch outputs: what each branch adds onto the stream.

A family's differences (parallel attention and MLP, fused q/k/v layouts, post-norms, the final logits' softcap, a
branch output the block changes in place) are fields of its `Architecture`; a model_type without one is refused,
naming those that exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from runner.errors import RunnerError, suggest
from runner.site_kinds import DICTIONARY_KINDS, SITE_KINDS


# The functions of a config that some fields of an Architecture are; each docstring's first line is what
# docs/reference/families.md says of it (scripts/gen_reference.py).
def _never(config: Any) -> bool:
    """never"""
    return False


def _neox_parallel(config: Any) -> bool:
    """config.use_parallel_residual (default true)"""
    return bool(getattr(config, "use_parallel_residual", True))


def _stablelm_parallel(config: Any) -> bool:
    """config.use_parallel_residual"""
    return bool(config.use_parallel_residual)


def _always(config: Any) -> bool:
    """always"""
    return True


def _falcon_parallel(config: Any) -> bool:
    """config.parallel_attn or config.new_decoder_architecture"""
    return bool(config.parallel_attn or config.new_decoder_architecture)


def _key_value_heads(config: Any) -> int | None:
    """config.num_key_value_heads (none: as many as the query heads)"""
    return getattr(config, "num_key_value_heads", None)


def _falcon_key_value_heads(config: Any) -> int | None:
    """config.num_kv_heads with new_decoder_architecture, else 1 with multi_query, else as many as the query heads"""
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else None


def _nothing_mutated(config: Any) -> tuple[str, ...]:
    """none"""
    return ()


def _falcon_mutated(config: Any) -> tuple[str, ...]:
    """`mlp` where the block is parallel (`mlp_output += attention_output`)"""
    return ("mlp",) if _falcon_parallel(config) else ()


def _accepted(config: Any) -> str | None:
    """none"""
    return None


def _opt_refusal(config: Any) -> str | None:
    """post-norm OPT (do_layer_norm_before false, OPT-350m) and a projected embedding"""
    if not getattr(config, "do_layer_norm_before", True):
        return "OPT with do_layer_norm_before=false (OPT-350m) normalises the stream after each branch"
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return "OPT with word_embed_proj_dim != hidden_size projects its embeddings in and out"
    return None


def _no_softcap(config: Any) -> float | None:
    """none"""
    return None


def _final_softcap(config: Any) -> float | None:
    """c * tanh(x / c), c = config.final_logit_softcapping"""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


@dataclass(frozen=True)
class Architecture:
    """Where a family keeps its parts (module paths relative to the model or to a block) and what its forward does
    differently; every difference between families is a field here, none is a special case in the methods."""

    family: str
    blocks: str  # the ModuleList of blocks
    attn: str  # a block's attention module
    mlp: str  # a block's MLP (a sparse MoE block where the family has one)
    out_proj: str  # the attention's output projection: its input is the heads' outputs side by side
    mid_norm: str | None  # the module whose input is the residual stream between attention and MLP (resid_mid):
    # the norm before the MLP, or the MLP itself where no norm precedes it (OLMo 2); None: no resid_mid
    final_norm: str
    embed: str
    qkv: tuple[str, str, str] | str  # separate q, k, v projections, or one fused module
    fused_layout: str = ""  # a fused qkv's layout: "gpt2" (q | k | v, equal thirds), "neox" (per head: q k v),
    # "gqa" (q | k | v, q of the query heads, k and v of the key-value heads), "grouped" (per key-value head: the
    # query heads that share it, then its k, then its v; "neox" is its case of one query head per key-value head,
    # "gqa" its case of one key-value head)
    attn_branch: str = ""  # the module whose output the block adds onto the stream after attention ("": attn);
    # a post-attention norm where the family applies one to the branch (Gemma 2 and 3, OLMo 2)
    mlp_branch: str = ""  # the same after the MLP ("": mlp)
    parallel: Callable[[Any], bool] = _never  # config -> attention and MLP read the same input (no resid_mid;
    # mid_norm None: always)
    logit_softcap: Callable[[Any], float | None] = _no_softcap  # config -> c of the final logits' c*tanh(x/c)
    mlp_rows: bool = False  # the MLP runs on the positions flattened, (batch x positions, d) rows (OPT's fc1/fc2)
    kv_heads: Callable[[Any], int | None] = _key_value_heads  # config -> the key-value heads (None: the query heads)
    mutated: Callable[[Any], tuple[str, ...]] = _nothing_mutated  # config -> the parts of a block whose output the
    # block itself changes in place afterwards (Falcon's parallel blocks: `mlp_output += attention_output`): a site
    # there is kept as a copy, and a copy is passed on where the kept tensor is the one the forward reads
    # (SiteSpec.mutated)
    refuse: Callable[[Any], str | None] = _accepted  # config -> why this adapter does not fit it (None: it does)


_LLAMA = {"blocks": "model.layers", "attn": "self_attn", "mlp": "mlp", "out_proj": "self_attn.o_proj",
          "mid_norm": "post_attention_layernorm", "final_norm": "model.norm", "embed": "model.embed_tokens",
          "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}  # fmt: skip
# Gemma 2 and 3: a norm before and after each branch; the stream between them is the pre-MLP norm's input.
_SANDWICH = {**_LLAMA, "mid_norm": "pre_feedforward_layernorm", "attn_branch": "post_attention_layernorm",
             "mlp_branch": "post_feedforward_layernorm"}  # fmt: skip

ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture("gpt2", "transformer.h", "attn", "mlp", "attn.c_proj", "ln_2", "transformer.ln_f",
                         "transformer.wte", "attn.c_attn", "gpt2"),
    # Llama's layout: one norm before attention and one before the MLP, each branch's output added to the stream.
    "llama": Architecture("llama", **_LLAMA),
    "gpt_neox": Architecture("gpt_neox", "gpt_neox.layers", "attention", "mlp", "attention.dense",
                             "post_attention_layernorm", "gpt_neox.final_layer_norm", "gpt_neox.embed_in",
                             "attention.query_key_value", "neox",
                             parallel=_neox_parallel),
    "gemma": Architecture("gemma", **_LLAMA),
    "gemma2": Architecture("gemma2", **_SANDWICH, logit_softcap=_final_softcap),
    "gemma3_text": Architecture("gemma3_text", **_SANDWICH, logit_softcap=_final_softcap),
    # OLMo 2: no norm before either branch, one after each; the MLP reads the stream itself.
    "olmo2": Architecture("olmo2", **{**_LLAMA, "mid_norm": "mlp", "attn_branch": "post_attention_layernorm",
                                      "mlp_branch": "post_feedforward_layernorm"}),
    "phi3": Architecture("phi3", **{**_LLAMA, "qkv": "self_attn.qkv_proj", "fused_layout": "gqa"}),
    "stablelm": Architecture("stablelm", **_LLAMA, parallel=_stablelm_parallel),
    "phi": Architecture("phi", **{**_LLAMA, "out_proj": "self_attn.dense", "mid_norm": None,
                                  "final_norm": "model.final_layernorm", "parallel": _always}),
    "gptj": Architecture("gptj", "transformer.h", "attn", "mlp", "attn.out_proj", None, "transformer.ln_f",
                         "transformer.wte", ("attn.q_proj", "attn.k_proj", "attn.v_proj"), parallel=_always),
    # Falcon: fused q/k/v per key-value group in all three forms (7B's multi-query, 40B/180B's new decoder
    # architecture, RW's one key-value head per query head); parallel blocks add the attention's output into the MLP's.
    "falcon": Architecture("falcon", "transformer.h", "self_attention", "mlp", "self_attention.dense",
                           "post_attention_layernorm", "transformer.ln_f", "transformer.word_embeddings",
                           "self_attention.query_key_value", "grouped", parallel=_falcon_parallel,
                           kv_heads=_falcon_key_value_heads, mutated=_falcon_mutated),
    # OPT: no `mlp` module; the block flattens the positions before fc1 and fc2 (mlp_out: fc2's output).
    "opt": Architecture("opt", "model.decoder.layers", "self_attn", "fc2", "self_attn.out_proj", "final_layer_norm",
                        "model.decoder.final_layer_norm", "model.decoder.embed_tokens",
                        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), mlp_rows=True,
                        refuse=_opt_refusal),
}  # fmt: skip
# model_type (config.json) -> family. Mistral, Qwen2/3, OLMo and the sparse-MoE Mixtral and Qwen2/3-MoE have Llama's
# layout (their `mlp` is the MoE block, whose output is what the block adds to the stream).
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
            "olmo": "llama", "mixtral": "llama", "qwen2_moe": "llama", "qwen3_moe": "llama",
            "gpt_neox": "gpt_neox", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3_text",
            "olmo2": "olmo2", "phi3": "phi3", "stablelm": "stablelm", "phi": "phi", "gptj": "gptj", "opt": "opt",
            "falcon": "falcon"}  # fmt: skip


@dataclass(frozen=True)
class StreamSum:
    """How a residual-stream site that no module's input carries alone is written: it is the input of `base` plus
    the output of `branch` (resid_mid: the block's input plus its attention's output)."""

    base: str  # dotted name of the module whose input is the stream before the branch (the block)
    branch: str  # dotted name of the module whose output the block adds onto it (the attention)


@dataclass(frozen=True)
class SiteSpec:
    """One site of one block: the module whose input (`where="input"`) or output holds it, and its view."""

    kind: str
    layer: int
    module: str  # dotted name in the model
    where: str  # "input": the first positional argument (or hidden_states); "output": the first output;
    # "softmax": the one softmax computed inside the module's forward (the attention pattern)
    # the raw tensor -> the site's view (B, T, D) or (B, T, H, d); pattern: (B, T_query, H, T_key)
    get: Callable[[torch.Tensor], torch.Tensor]
    put: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (raw, new view) -> the raw tensor to pass on
    heads: int = 0  # per-head sites: how many heads the view has (k and v: the key-value heads)
    stream: StreamSum | None = None  # a stream site written as a sum (resid_mid); None: written where it is read
    rows_of: str = ""  # the raw tensor is (batch x positions, ...) rows of this module's (B, T, D) input (the block:
    # OPT's MLP); "": it has the batch and position axes
    mutated: bool = False  # the forward changes the raw tensor in place after the hook has run (Architecture.mutated):
    # what is kept of it must be a copy, and what is passed on must not be the kept tensor

    @property
    def name(self) -> str:
        return f"{self.kind}.{self.layer}"


def _same(raw: torch.Tensor) -> torch.Tensor:
    return raw


def _replace(raw: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new


def _split_heads(heads: int) -> tuple[Callable, Callable]:
    def get(raw: torch.Tensor) -> torch.Tensor:
        return raw.unflatten(-1, (heads, -1))  # (B, T, H, d)

    def put(raw: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new.flatten(-2)

    return get, put


def _query_first(raw: torch.Tensor) -> torch.Tensor:
    return raw.transpose(1, 2)  # (B, H, Tq, Tk) -> (B, Tq, H, Tk): positions second, as every site's view


def _heads_first(raw: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new.transpose(1, 2)


def _fused_part(layout: str, part: int, heads: int, kv_heads: int) -> tuple[Callable, Callable]:
    """q (0), k (1) or v (2) of a fused projection's output, per head (`heads` query heads, `kv_heads` key-value)."""
    own = heads if part == 0 else kv_heads
    groups = heads if layout == "neox" else kv_heads  # grouped layouts: per key-value head, its queries, k, v
    share = heads // groups  # the query heads of one group

    def sizes(raw: torch.Tensor) -> list[int]:
        if layout == "gpt2":  # [q | k | v], equal thirds
            return [raw.shape[-1] // 3] * 3
        size = raw.shape[-1] // (heads + 2 * kv_heads)  # gqa: [q | k | v], q of the query heads, k and v of the kv
        return [heads * size, kv_heads * size, kv_heads * size]

    def slots(raw: torch.Tensor) -> tuple[torch.Tensor, slice | int]:
        """The raw tensor as (..., groups, share + 2, d), and this part's slots in it."""
        return raw.unflatten(-1, (groups, share + 2, -1)), slice(0, share) if part == 0 else share + part - 1

    def get(raw: torch.Tensor) -> torch.Tensor:
        if layout in ("neox", "grouped"):
            grouped, slot = slots(raw)
            return grouped[..., slot, :].flatten(-3, -2) if part == 0 else grouped[..., slot, :]
        return raw.split(sizes(raw), dim=-1)[part].unflatten(-1, (own, -1))

    def put(raw: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if layout not in ("neox", "grouped"):
            parts = list(raw.split(sizes(raw), dim=-1))
            parts[part] = new.flatten(-2)
            return torch.cat(parts, dim=-1)
        grouped, slot = slots(raw)
        out = grouped.clone()
        out[..., slot, :] = new.unflatten(-2, (groups, share)) if part == 0 else new
        return out.flatten(-3)

    return get, put


@dataclass(frozen=True)
class Placement:
    """Where a sparse dictionary is spliced into the model (model.dictionaries; runner/dictionaries/splice.py): the
    site it reads (runner/site_kinds.py DICTIONARY_SITES) at block `layer`, its latents' count, and the dotted name of
    its splice module, whose submodules `latents` and `error` output its latents (B, T, width) and error (B, T, d)."""

    site: str
    layer: int
    width: int
    module: str


def _per_latent(raw: torch.Tensor) -> torch.Tensor:
    return raw.unsqueeze(-1)  # (B, T, width) -> (B, T, width, 1): each latent a "head" of width 1


def _latents_back(raw: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new.squeeze(-1)


@dataclass(frozen=True)
class LanguageModelLayout:
    """A causal LM's family, sizes and parts, read from its config and module tree."""

    arch: Architecture
    layers: int
    heads: int
    kv_heads: int
    attn_implementation: str
    logit_softcap: float | None = None  # the final logits are c * tanh(x / c) (Gemma 2 and 3); None: as they are
    mutated: tuple[str, ...] = ()  # parts of a block whose output the block changes in place (Architecture.mutated)
    dictionaries: tuple[Placement, ...] = ()  # the sparse dictionaries spliced in (sites `latent` and `error`)

    def dictionary_at(self, layer: int) -> Placement | None:
        """The dictionary spliced at block `layer` (None: none)."""
        return next((p for p in self.dictionaries if p.layer == layer), None)

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The model's logits from its unembedding's output: the final softcap applied where the family has one."""
        if self.logit_softcap is None:
            return raw
        return torch.tanh(raw / self.logit_softcap) * self.logit_softcap

    def block_layers(self, layers: list[int] | None, key: str) -> list[int]:
        """The blocks `key` (a config key) selects: every block for None; RunnerError for one out of range. (A layer
        named twice is refused with the config, runner/site_kinds.py `check_layers`.)"""
        chosen = list(range(self.layers)) if layers is None else list(layers)
        bad = [layer for layer in chosen if not 0 <= layer < self.layers]
        if bad:
            raise RunnerError(f"{key}={bad}: the model has layers 0..{self.layers - 1}.")
        return chosen

    def module_name(self, part: str, layer: int) -> str:
        return f"{self.arch.blocks}.{layer}.{part}"

    def site(self, kind: str, layer: int) -> SiteSpec:
        """The site `kind` of block `layer`; RunnerError for a kind this family lacks or a layer out of range."""
        spec = self._site(kind, layer)
        changed = {self.module_name(part, layer) for part in self.mutated}
        return replace(spec, mutated=True) if spec.where == "output" and spec.module in changed else spec

    def _site(self, kind: str, layer: int) -> SiteSpec:
        known = (*SITE_KINDS, *DICTIONARY_KINDS)
        if kind not in known:
            raise RunnerError(f"Unknown site '{kind}'.{suggest(kind, list(known))} Sites: {', '.join(known)}.")
        if not 0 <= layer < self.layers:
            raise RunnerError(f"Layer {layer} of site {kind}: the model has layers 0..{self.layers - 1}.")
        if kind in DICTIONARY_KINDS:
            return self._dictionary_site(kind, layer)
        a = self.arch
        block = f"{a.blocks}.{layer}"
        if kind == "resid_pre":
            return SiteSpec(kind, layer, block, "input", _same, _replace)
        if kind == "resid_post":
            return SiteSpec(kind, layer, block, "output", _same, _replace)
        if kind == "resid_mid":
            if a.mid_norm is None:
                raise RunnerError(f"{a.family} runs attention and MLP in parallel: it has no resid_mid site.")
            stream = StreamSum(block, f"{block}.{a.attn_branch or a.attn}")
            return SiteSpec(kind, layer, f"{block}.{a.mid_norm}", "input", _same, _replace, stream=stream)
        if kind == "attn_out":  # what the block adds onto the stream: after the post-attention norm, if any
            return SiteSpec(kind, layer, f"{block}.{a.attn_branch or a.attn}", "output", _same, _replace)
        if kind == "mlp_out":
            return SiteSpec(kind, layer, f"{block}.{a.mlp_branch or a.mlp}", "output", _same, _replace,
                            rows_of=block if a.mlp_rows else "")  # fmt: skip
        if kind == "head":
            get, put = _split_heads(self.heads)
            return SiteSpec(kind, layer, f"{block}.{a.out_proj}", "input", get, put, self.heads)
        if kind == "pattern":
            if self.attn_implementation != "eager":
                raise RunnerError(
                    f"Site pattern needs the attention pattern, which attn_implementation={self.attn_implementation}"
                    " never materialises (a fused kernel): load the model with model.attn_implementation=eager."
                )
            return SiteSpec(kind, layer, f"{block}.{a.attn}", "softmax", _query_first, _heads_first, self.heads)
        part = "qkv".index(kind)
        heads = self.heads if kind == "q" else self.kv_heads
        if isinstance(a.qkv, tuple):
            get, put = _split_heads(heads)
            return SiteSpec(kind, layer, f"{block}.{a.qkv[part]}", "output", get, put, heads)
        get, put = _fused_part(a.fused_layout, part, self.heads, self.kv_heads)
        return SiteSpec(kind, layer, f"{block}.{a.qkv}", "output", get, put, heads)

    def _dictionary_site(self, kind: str, layer: int) -> SiteSpec:
        """A spliced dictionary's latents (per latent: a head axis of `width` heads, each of width 1) or error."""
        placed = self.dictionary_at(layer)
        if placed is None:
            where = sorted(p.layer for p in self.dictionaries)
            have = (
                f"layers {where}"
                if where
                else "no layer: give model.dictionaries=[{path: FOLDER, site: ..., layer: ...}]"
            )
            raise RunnerError(f"Site {kind}.{layer} is a spliced dictionary's; the model has one at {have}.")
        if kind == "latent":
            return SiteSpec(kind, layer, f"{placed.module}.latents", "output", _per_latent, _latents_back, placed.width)
        return SiteSpec(kind, layer, f"{placed.module}.error", "output", _same, _replace)

    def available(self, layer: int | None = None) -> list[str]:
        """The site kinds this model has (pattern: with eager attention only); at block `layer`, also latent and error
        where a dictionary is spliced there (None: at any block)."""
        lacks = {"resid_mid"} if self.arch.mid_norm is None else set()
        if self.attn_implementation != "eager":
            lacks.add("pattern")
        spliced = bool(self.dictionaries) if layer is None else self.dictionary_at(layer) is not None
        return [k for k in SITE_KINDS if k not in lacks] + (list(DICTIONARY_KINDS) if spliced else [])


# The attribute by which a module spliced into the model says it is a sparse dictionary, and where (its Placement).
SPLICED = "spliced_dictionary"


def layout_of(model: nn.Module) -> LanguageModelLayout:
    """The layout of a Hugging Face causal LM, with the dictionaries spliced into it; RunnerError naming the supported
    families for another model."""
    layout = layout_of_config(getattr(model, "config", None))
    placed = tuple(getattr(m, SPLICED) for m in model.modules() if hasattr(m, SPLICED))
    return replace(layout, dictionaries=placed) if placed else layout


def layout_of_config(config: Any, attn_implementation: str | None = None) -> LanguageModelLayout:
    """The layout of the causal LM that transformers config `config` describes, read from the config alone (no
    weights: what a run checks its sites and layers against before the model loads); `attn_implementation`: the one
    the model will be loaded with (None: the config's own). RunnerError naming the supported families for another."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise RunnerError(
            f"No site adapter for model_type '{model_type}': sites are known for {', '.join(sorted(FAMILIES))}."
        )
    arch = ARCHITECTURES[family]
    refused = arch.refuse(config)
    if refused:
        raise RunnerError(f"No site adapter fits this model: {refused}.")
    if arch.mid_norm is not None and arch.parallel(config):
        arch = replace(arch, mid_norm=None)
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)  # type: ignore[union-attr]
    kv_heads = int(arch.kv_heads(config) or heads)
    layers = int(getattr(config, "num_hidden_layers", None) or config.n_layer)  # type: ignore[union-attr]
    implementation = attn_implementation or str(getattr(config, "_attn_implementation", None) or "eager")
    return LanguageModelLayout(
        arch, layers, heads, kv_heads, implementation, arch.logit_softcap(config), arch.mutated(config)
    )


def unembedding(model: nn.Module) -> nn.Module:
    """The model's unembedding (the map from the final hidden state to the logits), found as transformers itself
    finds it, not by a name that changes between versions (GPT-NeoX: `embed_out` in 4.x, `lm_head` in 5.x)."""
    found = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if found is None:
        raise RunnerError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None).")
    return found


def read_site(spec: SiteSpec, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any = None) -> torch.Tensor:
    """The raw tensor of a site from a hook's arguments (input sites) or output (output sites)."""
    if spec.where == "input":
        return args[0] if args else kwargs["hidden_states"]
    return output[0] if isinstance(output, tuple) else output


def with_site(spec: SiteSpec, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, raw: torch.Tensor) -> Any:
    """The hook's return value that passes `raw` on in the site's place: (args, kwargs) for input sites (a
    forward pre-hook registered with kwargs), the output (its first element replaced, for tuples) otherwise."""
    if spec.where == "input":
        if args:
            return (raw, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": raw}
    return with_output(output, raw)


def with_output(output: Any, raw: torch.Tensor) -> Any:
    """A module's output with `raw` in the place of its first tensor (the whole output, or a tuple's first element)."""
    if isinstance(output, tuple):
        return (raw, *output[1:])
    return raw
