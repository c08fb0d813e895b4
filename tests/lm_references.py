"""Independent references for activation patching on Hugging Face causal LMs (no runner code imported).

Two ways of computing the same layer x position / layer x head patching results, used to check the runner's LM
patching engine and as contenders in scripts/bench_lm_patching.py:
  - `loop_patching`: one full forward per cell, plain torch hooks on the HF modules;
  - `tl_patching`: TransformerLens 4.3's `patching.get_act_patch_*` through its `TransformerBridge`.
`build_tiny_lm` makes the random-weight models both are run on, offline: GPT-2, Llama (grouped-query) and the
other families in FAMILIES.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
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


# The decoder families a tiny model is built for (model_type, or a variant): the same small shape, each family's own
# config class. gpt_neox_seq: GPT-NeoX with attention and MLP in sequence (the only NeoX with a resid_mid).
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt_neox_seq")


def tiny_config(arch: str, vocab: int) -> Any:
    """The config of a 2-layer, 32-wide, 4-head random model of `arch` (key/value heads: 2 where the family has
    grouped-query attention)."""
    import transformers

    ids = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32, initializer_range=INIT, **ids
        )
    if arch.startswith("gpt_neox"):
        return transformers.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=vocab,
            max_position_embeddings=32, initializer_range=INIT, use_parallel_residual=arch == "gpt_neox",
            rotary_pct=0.5, **ids,
        )  # fmt: skip
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}: one of {FAMILIES}")
    extra = {"head_dim": 8} if arch == "qwen3" else {}
    return getattr(transformers, classes[arch])(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=32, initializer_range=INIT, **extra, **ids,
    )  # fmt: skip


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
                if "norm" in name or name.endswith(".bias"):
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


def tl_bridge(folder_or_model: str | Path | nn.Module, tokenizer: Any = None) -> Any:
    """A TransformerBridge on the model (a copy: the bridge swaps the HF model's submodules in place).

    The tokenizer must have been loaded from a folder: the bridge reloads it from its `name_or_path` with
    add_bos_token=True. It only matters for strings; patching here gets token tensors, which go in unchanged.
    """
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    if isinstance(folder_or_model, nn.Module):
        model = copy.deepcopy(folder_or_model)
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
