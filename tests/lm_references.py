"""Independent references for activation patching on Hugging Face causal LMs (no runner code imported).

Two ways of computing the same layer x position / layer x head patching results, used to check the runner's LM
patching engine and as contenders in scripts/bench_lm_patching.py:
  - `loop_patching`: one full forward per cell, plain torch hooks on the HF modules (GPT-2 and Llama);
    `patched_metric` and `capture_all` do the same for every site of every family in FAMILIES, from the module
    paths in PARTS (written from each family's modeling file, not from the runner's adapters), and `gradients_all`
    gives each site's gradient for gradient x activation and attribution patching;
  - `tl_patching`: TransformerLens 4.3's `patching.get_act_patch_*` through its `TransformerBridge`.
`build_tiny_lm` makes the random-weight models both are run on, offline: GPT-2, Llama (grouped-query) and the
other families in FAMILIES.
`rank_correlations` compares attribution patching's estimates with exact patching's effects (Spearman, per site).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

SITES = ("resid_pre", "attn_out", "mlp_out", "head")
Metric = Callable[[torch.Tensor], torch.Tensor]  # logits (B, S, V) -> (B,)

# The tiny models' shape: 2 layers, 4 heads of 8 dims (Llama: 2 key/value heads, so grouped-query).
N_TOKENS = 20  # t00..t19
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0..3; <eos> given so TL's setup_tokenizer adds no token
INIT = 0.3  # weights std: the default 0.02 makes every logit difference ~0.01, too flat to check at 1e-5


def build_tokenizer(n_tokens: int = N_TOKENS) -> Any:
    """A WordLevel tokenizer over `<pad> <unk> <bos> <eos> t00..tNN`, whitespace-split, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i:02d}": len(SPECIALS) + i for i in range(n_tokens)})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


# The decoder families a tiny model is built for (a model_type, or a variant of one): the same small shape, each
# family's own config class. gpt_neox_seq and stablelm_par: the other residual form of a family that has both.
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt_neox_seq", "gemma", "gemma2", "olmo",
            "olmo2", "phi3", "stablelm", "stablelm_par", "gptj", "phi", "mixtral", "gemma3_text", "qwen2_moe",
            "qwen3_moe", "opt", "falcon", "falcon_seq", "falcon_new", "falcon_alibi")  # fmt: skip
VARIANTS = {"gpt_neox_seq": "gpt_neox", "stablelm_par": "stablelm", "falcon_seq": "falcon", "falcon_new": "falcon",
            "falcon_alibi": "falcon"}  # variant -> its model_type  # fmt: skip
SOFTCAP = 2.0  # Gemma 2 and 3's final-logit softcap: small, so that a readout without it is visibly wrong

# Config class and the family's own settings, beside the shared shape (2 layers, 32 wide, 4 heads of 8, MLP 64).
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 8}),
    "gemma": ("GemmaConfig", {"num_key_value_heads": 2, "head_dim": 8}),
    # sliding window shorter than the prompts, so that the sliding layer differs from a full one
    "gemma2": ("Gemma2Config", {"num_key_value_heads": 2, "head_dim": 8, "final_logit_softcapping": SOFTCAP,
                                "attn_logit_softcapping": 5.0, "query_pre_attn_scalar": 8, "sliding_window": 4}),
    "gemma3_text": ("Gemma3TextConfig", {"num_key_value_heads": 2, "head_dim": 8, "final_logit_softcapping": SOFTCAP,
                                         "query_pre_attn_scalar": 8, "sliding_window": 4,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo": ("OlmoConfig", {"num_key_value_heads": 2}),
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 2}),  # fused q|k|v of unequal sizes
    "stablelm": ("StableLmConfig", {"num_key_value_heads": 2, "use_parallel_residual": False,
                                    "partial_rotary_factor": 0.5}),
    "stablelm_par": ("StableLmConfig", {"num_key_value_heads": 2, "use_parallel_residual": True,
                                        "partial_rotary_factor": 0.5}),
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5}),
    "mixtral": ("MixtralConfig", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    # Falcon-7B: attention and MLP in parallel from one norm, one key-value head, rotary
    "falcon": ("FalconConfig", {"ffn_hidden_size": 64, "parallel_attn": True, "multi_query": True}),
    # sequential (a post-attention norm), one key-value head, rotary
    "falcon_seq": ("FalconConfig", {"ffn_hidden_size": 64, "parallel_attn": False, "multi_query": True}),
    # Falcon-40B/180B: the new decoder architecture, two norms (ln_attn, ln_mlp), 2 key-value heads of 4
    "falcon_new": ("FalconConfig", {"ffn_hidden_size": 64, "new_decoder_architecture": True, "num_kv_heads": 2}),
    # Falcon-RW: ALiBi, sequential, a key-value head per query head, biases
    "falcon_alibi": ("FalconConfig", {"ffn_hidden_size": 64, "alibi": True, "parallel_attn": False,
                                      "multi_query": False, "bias": True}),
}  # fmt: skip


def model_type(arch: str) -> str:
    """The model_type a family of FAMILIES (or a variant) is built as."""
    return VARIANTS.get(arch, arch)


def tiny_config(arch: str, vocab: int) -> Any:
    """The config of a 2-layer, 32-wide, 4-head random model of `arch` (key/value heads: 2 where the family has
    grouped-query attention)."""
    import transformers

    ids = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32, initializer_range=INIT, **ids
        )
    if arch == "gptj":
        return transformers.GPTJConfig(
            n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=vocab, n_positions=32, initializer_range=INIT,
            **ids,
        )  # fmt: skip
    if arch == "opt":
        return transformers.OPTConfig(
            num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=vocab,
            max_position_embeddings=32, word_embed_proj_dim=32, init_std=INIT, **ids,
        )  # fmt: skip
    if arch.startswith("gpt_neox"):
        return transformers.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=vocab,
            max_position_embeddings=32, initializer_range=INIT, use_parallel_residual=arch == "gpt_neox",
            rotary_pct=0.5, **ids,
        )  # fmt: skip
    if arch not in _CONFIGS:
        raise ValueError(f"unknown arch {arch!r}: one of {FAMILIES}")
    name, extra = _CONFIGS[arch]
    return getattr(transformers, name)(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=vocab,
        max_position_embeddings=32, initializer_range=INIT, **extra, **ids,
    )  # fmt: skip


NORM_NAMES = ("norm", "ln_attn", "ln_mlp")  # parameters of norms (Falcon-40B's two: ln_attn and ln_mlp)


def build_tiny_lm(arch: str, seed: int, folder: str | Path | None = None) -> tuple[nn.Module, Any, Path]:
    """A random-weight causal LM of a family in FAMILIES, fp32, eval, eager attention, saved with its tokenizer;
    norm weights and biases randomised too (at their init, 1 and 0, a norm hides mistakes about where it sits).

    The tokenizer is reloaded from the folder: TransformerLens' bridge reloads it by its `name_or_path`.
    """
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer)), attn_implementation="eager")
    if arch not in ("gpt2", "llama"):  # gpt2 and llama keep the weights their tests were written against
        with torch.no_grad():
            for name, param in model.named_parameters():
                if any(norm in name for norm in NORM_NAMES) or name.endswith(".bias"):
                    param.add_(torch.randn_like(param) * 0.2)
    model.config._attn_implementation = "eager"
    model = model.float().eval()
    folder = Path(folder if folder is not None else tempfile.mkdtemp(prefix=f"tiny_{arch}_"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # the word-level tokenizer's own class (AutoTokenizer would pick a family's BPE class from config.json)
    return model, PreTrainedTokenizerFast.from_pretrained(folder), folder


def prompt_words(data: Any) -> list[str]:
    """Every whitespace-separated word a data=prompts template config can produce (template, answer, distractor
    and slot values), for a word-level tokenizer that covers them."""
    words = set(data.template.replace("{", " {").replace("}", "} ").split())
    for values in [*data.slots.values(), *data.corrupted_slots.values()]:
        words.update(str(v) for v in values)
    return sorted(w for w in words if not w.startswith("{"))


def build_tokenizer_lm(source: str | Path, folder: str | Path, seed: int = 0, same_family: bool = False) -> Path:
    """A random two-layer Llama (32 wide, grouped-query) saved in `folder` with the tokenizer of the model folder
    `source` and its vocabulary size: a fast stand-in for a large model whose tokenization a test needs.
    `same_family`: the source's own architecture instead (its config, made two layers and 32 wide), so that the
    stand-in runs the family's own blocks (Gemma 3's norms after each branch)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    torch.manual_seed(seed)
    small = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": len(tokenizer), "max_position_embeddings": 256,
             "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
             "initializer_range": INIT}  # fmt: skip
    folder = Path(folder)
    if same_family:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        for key, value in {**small, "head_dim": 8}.items():
            setattr(config, key, value)
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types[-2:])
        AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    else:
        LlamaForCausalLM(LlamaConfig(**small)).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_word_lm(words: list[str], folder: str | Path, seed: int = 0) -> Path:
    """A random two-layer GPT-2 saved in `folder` with a WordLevel tokenizer over `words` (plus the specials): a
    stand-in, offline, for a hub model whose tokenizer the machine lacks."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({w: len(SPECIALS) + i for i, w in enumerate(words)})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(vocab), n_positions=64,
                        initializer_range=INIT, bos_token_id=2, eos_token_id=3, pad_token_id=0)  # fmt: skip
    folder = Path(folder)
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def logit_diff(answer: torch.Tensor, distractor: torch.Tensor) -> Metric:
    """Per pair: logit of its answer token minus its distractor's, at the last position."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1, :]
        rows = torch.arange(last.shape[0], device=last.device)
        return last[rows, answer.to(last.device)] - last[rows, distractor.to(last.device)]

    metric.answer, metric.distractor = answer, distractor  # type: ignore[attr-defined]  # for contenders that take ids
    return metric


# ---------------------------------------------------------------------------------------------- the plain loop


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks: GPT-2's `transformer.h`, Llama's `model.layers`."""
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return list(model.model.layers)


def _attn(block: nn.Module) -> nn.Module:
    return block.attn if hasattr(block, "attn") else block.self_attn


def _out_proj(block: nn.Module) -> nn.Module:
    """The attention output projection, whose input holds the heads' outputs side by side."""
    attn = _attn(block)
    return attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj


def n_heads(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "n_head", None) or config.num_attention_heads)


def _site_module(model: nn.Module, site: str, layer: int) -> nn.Module:
    block = _blocks(model)[layer]
    return {
        "resid_pre": block,
        "attn_out": _attn(block),
        "mlp_out": block.mlp,
        "head": _out_proj(block),
    }[site]


def _is_pre(site: str) -> bool:
    """resid_pre is a block's input and head the out-projection's input: both read with a pre-hook."""
    return site in ("resid_pre", "head")


def _get(site: str, args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    if _is_pre(site):
        return args[0] if args else kwargs["hidden_states"]  # transformers 5 passes it either way
    return output[0] if isinstance(output, tuple) else output


def _register(module: nn.Module, site: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> Any:
    """Hook `fn(activation) -> replacement or None` on the site's tensor (input or output of `module`)."""
    if _is_pre(site):

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            new = fn(_get(site, args, kwargs, None))
            if new is None:
                return None
            if args:
                return (new, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": new}

        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def post(mod: nn.Module, args: tuple, output: Any) -> Any:
        new = fn(_get(site, args, {}, output))
        if new is None:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new

    return module.register_forward_hook(post)


def _forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def capture(model: nn.Module, ids: torch.Tensor, site: str) -> list[torch.Tensor]:
    """The site's activation at every layer from one forward, cloned (B, S, d)."""
    kept: list[torch.Tensor] = []
    handles = [
        _register(_site_module(model, site, layer), site, lambda a: kept.append(a.detach().clone()))
        for layer in range(len(_blocks(model)))
    ]
    try:
        _forward(model, ids)
    finally:
        for h in handles:
            h.remove()
    return kept


@torch.no_grad()
def run_patched(
    model: nn.Module,
    ids: torch.Tensor,
    site: str,
    layer: int,
    source: torch.Tensor,
    positions: slice | list[int] | int = slice(None),
    head: int | None = None,
) -> torch.Tensor:
    """Logits of `ids` with the site's activation at `layer` replaced by `source` at the positions (and head)."""
    if head is not None:
        d_head = source.shape[-1] // n_heads(model)
        channels = slice(head * d_head, (head + 1) * d_head)
    else:
        channels = slice(None)

    def patch(act: torch.Tensor) -> torch.Tensor:
        new = act.clone()
        new[:, positions, channels] = source[:, positions, channels]
        return new

    handle = _register(_site_module(model, site, layer), site, patch)
    try:
        return _forward(model, ids)
    finally:
        handle.remove()


def _reduce(values: torch.Tensor, reduce: str) -> torch.Tensor:
    if reduce == "mean":
        return values.mean(-1)
    if reduce == "none":
        return values
    raise ValueError(f"reduce must be 'mean' or 'none', got {reduce!r}")


@torch.no_grad()
def loop_patching(
    model: nn.Module,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    site: str,
    metric: Metric,
    direction: str = "denoise",
    reduce: str = "mean",
) -> torch.Tensor:
    """One forward per cell: (layers, positions) for resid_pre/attn_out/mlp_out, (layers, heads) for `head`.

    denoise: the corrupted prompt run with the clean activation patched in at the cell; noise: the clean prompt
    with the corrupted one. reduce="mean" averages the metric over the batch, "none" keeps a last axis (B,).
    """
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}: one of {SITES}")
    if clean_ids.shape != corrupted_ids.shape:
        raise ValueError(f"clean {tuple(clean_ids.shape)} and corrupted {tuple(corrupted_ids.shape)} differ")
    if direction == "denoise":
        source_ids, target_ids = clean_ids, corrupted_ids
    elif direction == "noise":
        source_ids, target_ids = corrupted_ids, clean_ids
    else:
        raise ValueError(f"direction must be 'denoise' or 'noise', got {direction!r}")
    sources = capture(model, source_ids, site)
    n_layers = len(sources)
    cells = n_heads(model) if site == "head" else target_ids.shape[1]
    out = torch.zeros(n_layers, cells, target_ids.shape[0])
    for layer in range(n_layers):
        for c in range(cells):
            if site == "head":
                logits = run_patched(model, target_ids, site, layer, sources[layer], head=c)
            else:
                logits = run_patched(model, target_ids, site, layer, sources[layer], positions=[c])
            out[layer, c] = metric(logits).float().cpu()
    return _reduce(out, reduce)


# ------------------------------------------------------------------------------------------- TransformerLens 4.3


def tl_bridge(folder_or_model: str | Path | nn.Module, tokenizer: Any = None, last_logits_only: bool = False) -> Any:
    """A TransformerBridge on the model (a copy: the bridge swaps the HF model's submodules in place).

    The tokenizer must have been loaded from a folder: the bridge reloads it from its `name_or_path` with
    add_bos_token=True. It only matters for strings; patching here gets token tensors, which go in unchanged.
    `last_logits_only` (a model only): the copy's unembedding reads the last position alone, so its logits are
    (B, 1, vocab), for a metric that reads only `logits[:, -1]`: its values up to rounding, and a forward without the
    unembedding of every other position (Gemma 3's 262,144 rows were 40% of its forward at 16 tokens).
    """
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    if isinstance(folder_or_model, nn.Module):
        model = copy.deepcopy(folder_or_model)
        if last_logits_only:
            model.get_output_embeddings().register_forward_pre_hook(lambda _, args: (args[0][:, -1:], *args[1:]))
        name = str(getattr(tokenizer, "name_or_path", "") or model.config.name_or_path or "local")
        bridge = TransformerBridge.boot_transformers(name, hf_model=model, tokenizer=tokenizer, device="cpu")
    else:
        folder = str(folder_or_model)
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(folder)
        bridge = TransformerBridge.boot_transformers(folder, tokenizer=tok, device="cpu")
    bridge.eval()
    return bridge


TL_FUNCTIONS = {
    "resid_pre": "get_act_patch_resid_pre",
    "attn_out": "get_act_patch_attn_out",
    "mlp_out": "get_act_patch_mlp_out",
    "head": "get_act_patch_attn_head_out_all_pos",
}


@torch.no_grad()
def tl_patching(
    folder_or_model: Any,
    tokenizer: Any,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    site: str,
    metric: Metric,
    direction: str = "denoise",
    reduce: str = "mean",
) -> torch.Tensor:
    """The same table through TransformerLens' `patching.get_act_patch_*` (a bridge, a model or a folder).

    TL patches the clean cache into the corrupted run (denoise); noise is the same call with the roles swapped.
    """
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    bridge = (
        folder_or_model if isinstance(folder_or_model, TransformerBridge) else tl_bridge(folder_or_model, tokenizer)
    )
    if direction == "denoise":
        source_ids, target_ids = clean_ids, corrupted_ids
    elif direction == "noise":
        source_ids, target_ids = corrupted_ids, clean_ids
    else:
        raise ValueError(f"direction must be 'denoise' or 'noise', got {direction!r}")
    _, cache = bridge.run_with_cache(source_ids)
    fn = getattr(patching, TL_FUNCTIONS[site])
    result = fn(bridge, target_ids, cache, metric, reduce="none")
    return _reduce(result.values.detach().float().cpu(), reduce)


# ------------------------------------------------------------------- the plain loop over every site, per family
# Written from each family's modeling file (transformers 5), not from the runner's adapters: where a block's parts
# are, what it adds onto the stream after attention and after the MLP, and how a fused q/k/v projection is laid out.


@dataclass(frozen=True)
class Parts:
    blocks: str  # the ModuleList of blocks, from the model
    attn: str  # the attention module (its eager forward computes the pattern's softmax), from a block
    attn_add: str  # the module whose output the block adds onto the stream after attention
    mlp_add: str  # the same after the MLP
    out_proj: str  # its input: the heads' outputs side by side
    qkv: tuple[str, str, str] | str
    fused: str = ""  # "thirds" (q | k | v, equal), "per_head" (q k v of head 0, of head 1, ...), "gqa" (q | k | v
    # with k and v of the key-value heads), "per_group" (per key-value head: the query heads sharing it, its k, its v)
    sequential: bool = True  # attention then MLP (a stream between them); False: both read the block's input


_SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_PARTS = Parts("model.layers", "self_attn", "self_attn", "mlp", "self_attn.o_proj", _SEPARATE)
_POST_NORMED = replace(_LLAMA_PARTS, attn_add="post_attention_layernorm", mlp_add="post_feedforward_layernorm")
_FALCON = Parts("transformer.h", "self_attention", "self_attention", "mlp", "self_attention.dense",
                "self_attention.query_key_value", "gqa", sequential=False)  # fmt: skip
PARTS: dict[str, Parts] = {
    "gpt2": Parts("transformer.h", "attn", "attn", "mlp", "attn.c_proj", "attn.c_attn", "thirds"),
    **{arch: _LLAMA_PARTS for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "stablelm", "mixtral",
                                       "qwen2_moe", "qwen3_moe")},
    "gpt_neox": Parts("gpt_neox.layers", "attention", "attention", "mlp", "attention.dense",
                      "attention.query_key_value", "per_head", sequential=False),
    "gpt_neox_seq": Parts("gpt_neox.layers", "attention", "attention", "mlp", "attention.dense",
                          "attention.query_key_value", "per_head"),
    "gemma2": _POST_NORMED,
    "gemma3_text": _POST_NORMED,
    "olmo2": _POST_NORMED,
    "phi3": replace(_LLAMA_PARTS, qkv="self_attn.qkv_proj", fused="gqa"),
    "stablelm_par": replace(_LLAMA_PARTS, sequential=False),
    "phi": replace(_LLAMA_PARTS, out_proj="self_attn.dense", sequential=False),
    # OPT: fc1/fc2 on the positions flattened, (B x T, d): mlp_out is fc2's output viewed back
    "opt": Parts("model.decoder.layers", "self_attn", "self_attn", "fc2", "self_attn.out_proj", ("self_attn.q_proj",
                 "self_attn.k_proj", "self_attn.v_proj")),
    "gptj": Parts("transformer.h", "attn", "attn", "mlp", "attn.out_proj", ("attn.q_proj", "attn.k_proj",
                  "attn.v_proj"), sequential=False),
    # Falcon (FalconAttention._split_heads): multi-query q | k | v with one key-value head; the new decoder
    # architecture per key-value group (its query heads, then k, then v); otherwise per head q k v. Its parallel
    # blocks change the MLP's output in place (`mlp_output += attention_output`): the hooks here clone what they keep.
    "falcon": _FALCON,
    "falcon_seq": replace(_FALCON, sequential=True),
    "falcon_new": replace(_FALCON, fused="per_group"),
    "falcon_alibi": replace(_FALCON, fused="per_head", sequential=True),
}  # fmt: skip
ALL_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "head", "q", "k", "v", "pattern")
HEAD_SITES = ("head", "q", "k", "v", "pattern")


def kv_heads(model: nn.Module) -> int:
    config = model.config
    if config.model_type == "falcon":  # FalconAttention: num_kv_heads in the new architecture, 1 for multi-query
        if config.new_decoder_architecture:
            return int(config.num_kv_heads)
        return 1 if config.multi_query else n_heads(model)
    return int(getattr(config, "num_key_value_heads", None) or n_heads(model))


def _channels(model: nn.Module, parts: Parts, site: str, width: int, head: int) -> slice:
    """The last-axis slice of head `head` in the raw tensor of a per-head site (width: that tensor's last size)."""
    h, kv = n_heads(model), kv_heads(model)
    if site == "head" or isinstance(parts.qkv, tuple) and site == "q":
        d = width // h
        return slice(head * d, (head + 1) * d)
    part = "qkv".index(site)
    if isinstance(parts.qkv, tuple):  # k or v of their own projection
        d = width // kv
        return slice(head * d, (head + 1) * d)
    if parts.fused == "thirds":
        d = width // 3 // h
        start = part * width // 3 + head * d
    elif parts.fused == "per_head":
        d = width // 3 // h
        start = (head * 3 + part) * d
    elif parts.fused == "per_group":  # group g: query heads g*q..(g+1)*q-1, then k, then v; q = h / kv
        d, q = width // (h + 2 * kv), h // kv
        group, slot = (head // q, head % q) if part == 0 else (head, q + part - 1)
        start = (group * (q + 2) + slot) * d
    else:  # gqa
        d = width // (h + 2 * kv)
        start = [0, h * d, (h + kv) * d][part] + head * d
    return slice(start, start + d)


class _Softmax:
    """The one softmax of an attention module's eager forward, kept or replaced by `fn(pattern) -> new or None`:
    torch.nn.functional.softmax is swapped while the module runs."""

    def __init__(self, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        self.fn, self.original = fn, torch.nn.functional.softmax
        self.handles = [module.register_forward_pre_hook(self._enter),
                        module.register_forward_hook(self._leave, always_call=True)]  # fmt: skip

    def _wrapped(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.original(*args, **kwargs)
        new = self.fn(out)
        return out if new is None else new

    def _enter(self, module: nn.Module, args: tuple) -> None:
        torch.nn.functional.softmax = self._wrapped

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        torch.nn.functional.softmax = self.original

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _hook_raw(model: nn.Module, arch: str, site: str, layer: int,
              fn: Callable[[torch.Tensor], torch.Tensor | None]) -> list[Any]:  # fmt: skip
    """Hooks that give `fn` the raw tensor of a site (resid_mid: the block's input plus the attention's added
    output) and put its return value (if not None) in its place."""
    parts = PARTS[arch]
    modules = dict(model.named_modules())
    block = f"{parts.blocks}.{layer}"
    if site == "pattern":
        return [_Softmax(modules[f"{block}.{parts.attn}"], fn)]
    if site == "resid_mid":
        if not parts.sequential:
            raise ValueError(f"{arch} has no resid_mid")
        kept: dict[str, torch.Tensor] = {}

        def keep_input(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            kept["in"] = args[0] if args else kwargs["hidden_states"]

        def branch(mod: nn.Module, args: tuple, output: Any) -> Any:
            out = output[0] if isinstance(output, tuple) else output
            new = fn(kept["in"] + out)  # the stream
            if new is None:
                return None
            new = new - kept["in"]
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return [modules[block].register_forward_pre_hook(keep_input, with_kwargs=True),
                modules[f"{block}.{parts.attn_add}"].register_forward_hook(branch)]  # fmt: skip
    name = {"resid_pre": block, "resid_post": block, "attn_out": f"{block}.{parts.attn_add}",
            "mlp_out": f"{block}.{parts.mlp_add}", "head": f"{block}.{parts.out_proj}"}.get(site)  # fmt: skip
    if name is None:  # q, k, v
        qkv = parts.qkv
        name = f"{block}.{qkv['qkv'.index(site)] if isinstance(qkv, tuple) else qkv}"
    pre = site in ("resid_pre", "head")
    return [_register(modules[name], "resid_pre" if pre else "attn_out", fn)]


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


@torch.no_grad()
def capture_all(model: nn.Module, arch: str, ids: torch.Tensor, site: str) -> list[torch.Tensor]:
    """The raw tensor of `site` at every layer from one forward of `ids`, cloned."""
    layers = int(model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer)
    kept: dict[int, torch.Tensor] = {}
    handles = []
    for layer in range(layers):

        def keep(raw: torch.Tensor, layer: int = layer) -> None:
            kept[layer] = raw.detach().clone()

        handles += _hook_raw(model, arch, site, layer, keep)
    try:
        _forward(model, ids)
    finally:
        _remove(handles)
    return [kept[layer] for layer in range(layers)]


def _cell(model: nn.Module, arch: str, site: str, width: int, position: int | None, head: int | None) -> tuple:
    """The index of one cell in a site's (B, T, d) rows or the pattern's (B, H, T query, T key): the position (None:
    every one; the pattern: the query position, all keys) and the head (None: the whole tensor); width: d."""
    where = slice(None) if position is None else position
    if site == "pattern":
        return slice(None), slice(None) if head is None else head, where
    return slice(None), where, slice(None) if head is None else _channels(model, PARTS[arch], site, width, head)


def _put(new: torch.Tensor, source: torch.Tensor, model: nn.Module, arch: str, site: str, position: int | None,
         head: int | None) -> None:  # fmt: skip
    """Write `source` into `new` (one forward's rows, as `_rows` gives them) at one cell (`_cell`)."""
    cell = _cell(model, arch, site, new.shape[-1], position, head)
    new[cell] = source[cell]


def _rows(raw: torch.Tensor, batch: int) -> torch.Tensor:
    """The site's tensor as (B, T, d); OPT's MLP runs on (B x T, d) rows. The pattern stays (B, H, T, T)."""
    return raw if raw.dim() == 4 else raw.reshape(batch, -1, raw.shape[-1])


@torch.no_grad()
def patched_metric(model: nn.Module, arch: str, ids: torch.Tensor, site: str, layer: int, source: torch.Tensor,
                   position: int | None, head: int | None, metric: Metric) -> torch.Tensor:  # fmt: skip
    """(B,) the metric of one forward of `ids` with the site's raw tensor at `layer` taken from `source` at
    `position` (None: every position; the pattern: the query position) and head (None: the whole tensor)."""
    batch = ids.shape[0]

    def patch(raw: torch.Tensor) -> torch.Tensor:
        new = _rows(raw.clone(), batch)
        _put(new, _rows(source, batch), model, arch, site, position, head)
        return new.view(raw.shape)

    handles = _hook_raw(model, arch, site, layer, patch)
    try:
        return metric(_forward(model, ids)).float().cpu()
    finally:
        _remove(handles)


@torch.no_grad()
def patched_metrics(model: nn.Module, arch: str, ids: torch.Tensor, site: str, layer: int, source: torch.Tensor,
                    cells: list[tuple[int | None, int | None]], metric: Metric) -> torch.Tensor:  # fmt: skip
    """(C, B): `patched_metric` of each (position, head) cell, from one forward of C copies of `ids` in which copy
    c is patched at cell c only (rows are independent); equal to one forward per cell (test_lm_sites checks it)."""
    batch, copies = ids.shape[0], len(cells)

    def patch(raw: torch.Tensor) -> torch.Tensor:
        new = _rows(raw.clone(), batch * copies)
        new = new.view(copies, batch, *new.shape[1:])
        src = _rows(source, batch)
        for index, (position, head) in enumerate(cells):
            _put(new[index], src, model, arch, site, position, head)
        return new.view(raw.shape)

    handles = _hook_raw(model, arch, site, layer, patch)
    try:
        logits = _forward(model, ids.repeat(copies, 1))
    finally:
        _remove(handles)
    return torch.stack([metric(rows) for rows in logits.split(batch)]).float().cpu()


def cell_sum(model: nn.Module, arch: str, site: str, values: torch.Tensor, batch: int, position: int | None,
             head: int | None) -> torch.Tensor:  # fmt: skip
    """(B,) the sum of `values` (shaped as the site's raw tensor) over one cell's elements: the position (None:
    every one; the pattern: the query position, all keys) and the head (None: the whole tensor)."""
    values = _rows(values, batch)
    return values[_cell(model, arch, site, values.shape[-1], position, head)].flatten(1).sum(-1)


def gradients_all(model: nn.Module, arch: str, ids: torch.Tensor, site: str,
                  metric: Metric) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per layer, the raw tensor of `site` in a forward of `ids` and the gradient of the metric (summed over the
    rows, which are independent) with respect to it: one forward per layer, the tensor replaced by a leaf that the
    rest of the forward reads through a copy (a block may change what it is given in place: Falcon's
    `mlp_output += attention_output`)."""
    layers = int(model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer)
    found = []
    for layer in range(layers):
        leaf: dict[str, torch.Tensor] = {}

        def substitute(raw: torch.Tensor, leaf: dict[str, torch.Tensor] = leaf) -> torch.Tensor:
            leaf["x"] = raw.detach().clone().requires_grad_(True)
            return leaf["x"].clone()

        handles = _hook_raw(model, arch, site, layer, substitute)
        try:
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(metric(_forward(model, ids)).sum(), [leaf["x"]], allow_unused=True)
        finally:
            _remove(handles)
        found.append((leaf["x"].detach(), torch.zeros_like(leaf["x"]) if grad is None else grad))
    return found


def rank_correlations(exact: Any, estimated: Any) -> Any:
    """Per site and pair: Spearman's rho between attribution patching's estimated effect and exact patching's
    (patched - corrupted) over the site's cells, from two `lm_patching` tables with the same cells; one row per site,
    a column per pair (`sample_index`) and their `mean`."""
    from scipy.stats import spearmanr

    keys = ["sample_index", "site", "layer", "head", "position"]
    both = exact.merge(estimated, on=keys, suffixes=("", "_est"), validate="one_to_one")
    if len(both) != len(exact):
        raise ValueError(f"{len(exact)} exact rows, {len(both)} with an estimate")
    rho = both.groupby(["site", "sample_index"]).apply(
        lambda g: spearmanr(g.patched - g.corrupted, g.patched_est - g.corrupted_est).statistic, include_groups=False
    )
    return rho.unstack("sample_index").assign(mean=lambda d: d.mean(axis=1))


def tl_edge_name(node: Any) -> str:
    """A node of TransformerLens 4.3's edge attribution (`attribution_patching.Node`) as the lm_edges table names it."""
    kind = node.kind
    if kind == "embed":
        return "input"
    if kind == "attn_head_out":
        return f"a{node.layer}.h{node.head}"
    if kind in ("mlp_out", "mlp_in"):
        return f"m{node.layer}"
    if kind == "logits":
        return "logits"
    return f"a{node.layer}.{'h' if kind[0] == 'q' else 'g'}{node.head}<{kind[0]}>"
