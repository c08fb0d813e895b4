"""Hugging Face causal language models (AutoModelForCausalLM) and their tokenizers: the shipped induction model, a
folder saved with save_pretrained, a hub id from the local cache, or random weights from a config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runner.errors import RunnerError
from runner.fingerprints import listing_digest
from runner.options.registry import MODELS
from runner.schema import ModelConfig

# model.name of the model that ships inside the package (runner/models/lm_induction/).
SHIPPED_LM = "induction"
ATTENTION = ("eager", "sdpa", "flash_attention_2")


@MODELS.option("runner.models.hf_lm:HfLmSource", name="hf_lm")
@dataclass
class HfLmModelConfig(ModelConfig):
    # `induction` (shipped in runner/models/lm_induction/: a two-layer attention-only Llama trained on repeated random
    # tokens), a local folder (save_pretrained), or a hub id from the Hugging Face cache.
    name: str = SHIPPED_LM
    source: Optional[str] = "hf_lm"  # noqa: UP045 (OmegaConf)
    # DEFAULT: the saved weights; null: random weights from the model's config (and `config`'s overrides).
    weights: Optional[str] = "DEFAULT"  # noqa: UP045 (OmegaConf)
    # How attention is computed, chosen here and recorded with the run: eager materialises the attention pattern
    # (needed for the `pattern` site); sdpa and flash_attention_2 are faster and never do.
    attn_implementation: str = "eager"
    # Overrides of the model's config for random weights (weights=null), e.g. {n_layer: 2}; with `model_type`
    # and name=null-like `config`, a model built from the config alone (its tokenizer still comes from `name`).
    config: dict[str, Any] = field(default_factory=dict)
    # accelerate's device map for a model larger than one device: "auto", or {module prefix: device}; null: the
    # run's device. Every captured or patched tensor stays on its module's device.
    device_map: Any = None
    # The tokenizer's folder or hub id; null: the model's own (`name`).
    tokenizer: Optional[str] = None  # noqa: UP045 (OmegaConf)

    def check(self) -> list[str]:
        if self.attn_implementation not in ATTENTION:
            raise RunnerError(
                f"model.attn_implementation={self.attn_implementation}: use one of {', '.join(ATTENTION)}"
                " (eager materialises the attention pattern; the others are faster)."
            )
        return []

    def fingerprint(self) -> dict[str, str]:
        """A local folder's files (names, sizes, modification times): the weights a resume must find unchanged."""
        found = super().fingerprint()
        folder = Path(self.name).expanduser()
        if folder.is_dir():
            count, digest = listing_digest(folder, lambda p: p.suffix in (".safetensors", ".bin", ".json"))
            found["model.name (folder)"] = f"{count} files, {digest}"
        return found
