"""Sparse dictionaries on disk: the two layouts released SAEs and transcoders come in, read (and SAELens's written)
with JSON and safetensors only. Nothing here unpickles, imports or downloads anything.

SAELens (github.com/jbloomAus/SAELens 6.x: `SAE.save_model` writes it, `SAE.load_from_disk` reads it):

    cfg.json                 architecture  "standard" (relu), "jumprelu", "topk", "transcoder" (relu),
                                           "jumprelu_transcoder"; "batchtopk" in a training checkpoint
                             d_in, d_sae   the input's width and the number of latents; d_out: a transcoder's output
                             apply_b_dec_to_input (default true), normalize_activations ("none",
                             "expected_average_only_in", "constant_norm_rescale"), reshape_activations,
                             k and rescale_acts_by_decoder_norm (topk, batchtopk),
                             metadata      {hook_name, hook_name_out, model_name, sae_lens_version, ...}
                             Before 6.0 the metadata sat at the top level, `hook_point` named the hook, `activation_fn`
                             (or `activation_fn_str`) "topk" with `activation_fn_kwargs: {k}` made a topk, and
                             normalize_activations could be a bool (loading/pretrained_sae_loaders.py
                             handle_pre_6_0_config); both are read.
    sae_weights.safetensors  W_enc (d_in, d_sae), b_enc (d_sae), W_dec (d_sae, d_out), b_dec (d_out),
                             threshold (d_sae; jumprelu). A batchtopk checkpoint holds topk_threshold (a scalar) instead.
    activation_scaler.json   {"scaling_factor": s}, beside a checkpoint trained with "expected_average_only_in"
                             (training/activation_scaler.py; the trainer folds s into the weights before its final save)

    What SAELens does at inference (saes/*.py), and so what the Dictionary is given here:
      - topk with rescale_acts_by_decoder_norm: the latents are h * |W_dec row| and decode divides them back out; the
        norms are folded into W_enc, b_enc and W_dec on loading, as SAELens does when it saves an inference model
        (topk_sae.py _fold_norm_topk): the same latents and output.
      - batchtopk: SAELens runs (and saves) a trained batchtopk as a jumprelu whose threshold is topk_threshold for
        every latent (batchtopk_sae.py process_state_dict_for_saving_inference); so does the Dictionary.
      - expected_average_only_in: x is multiplied by s and the output divided by it, as SAELens's trainer and evals
        run the checkpoint (training/activation_scaler.py ActivationScaler.scale / unscale); s is read from
        activation_scaler.json. SAELens's inference SAE does not scale at run time: it folds s into the weights
        (sae.py fold_activation_norm_scaling_factor: W_enc * s, W_dec / s, b_dec / s), the same function, and
        `save_saelens` writes it so. (On a rescaled topk that fold also divides the latents by s; the output is equal.)
      - a transcoder (transcoder.py) never subtracts b_dec from its input and does not undo constant_norm_rescale on
        its output, so a transcoder with that normalisation is refused rather than guessed at.

Gemma Scope (google/gemma-scope-*; Gemma Scope 2 ships params.safetensors, the first release params.npz):

    params.safetensors       W_enc (d_model, width), W_dec (width, d_model), b_enc, b_dec, threshold (`w_enc` and
                             `w_dec` are read as W_enc and W_dec, as SAELens's gemma loader does)
    encode: f = relu(x @ W_enc + b_enc) * (x @ W_enc + b_enc > threshold), no b_dec subtracted, no normalisation;
    decode: f @ W_dec + b_dec. A config.json or cfg.json beside it may name hook_name / hook_name_out / architecture.

`read_spec` answers from cfg.json and the safetensors file's JSON header alone (its first 8 bytes are the header's
length, little-endian), so a wrong width, a shape that disagrees with cfg.json or an unknown architecture is refused
before any weight is read; `load_dictionary` then reads the weights.
"""

from __future__ import annotations

import json
import math
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from runner.dictionaries.dictionary import NORMALISATIONS, Dictionary, DictionarySpec
from runner.errors import RunnerError, suggest

SAELENS_CFG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
SAELENS_SCALER = "activation_scaler.json"  # SAELens's constants.ACTIVATION_SCALER_CFG_FILENAME
GEMMA_SCOPE_WEIGHTS = "params.safetensors"
GEMMA_SCOPE_CONFIGS = ("config.json", "cfg.json")

# The config format written: SAELens reads a cfg whose sae_lens_version is under 6.0 the pre-6 way
# (loading/pretrained_sae_loaders.py handle_config_defaulting), so this is the format's version, not a SAELens install.
SAELENS_FORMAT_VERSION = "6.0.0"

# SAELens's architecture -> (DictionarySpec.architecture, transcoder)
SAELENS_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "standard": ("relu", False),
    "jumprelu": ("jumprelu", False),
    "topk": ("topk", False),
    "batchtopk": ("batchtopk", False),
    "transcoder": ("relu", True),
    "jumprelu_transcoder": ("jumprelu", True),
}
# SAELens architectures the Dictionary has no counterpart for, and what it lacks
UNSUPPORTED_ARCHITECTURES = {
    "gated": "separate gate path (b_gate, r_mag, b_mag)",
    "skip_transcoder": "skip connection (W_skip)",
    "matryoshka_batchtopk": "nested (matryoshka) decoders",
}

# Files that are code or pickles: the runner reads safetensors and JSON only, and a folder holding these is not one
# this reader should be pointed at (torch.load of a .pt or .bin runs whatever the pickle says).
REFUSED_SUFFIXES = frozenset(
    {".py", ".pyc", ".pyo", ".pyd", ".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".so", ".dll", ".dylib", ".sh"}
)
# Data and text files whose executable bit (set by some copies and mounts) says nothing: none of them is run
NOT_PROGRAMS = frozenset({".json", ".safetensors", ".md", ".txt", ".yaml", ".yml"})

# safetensors' float dtypes (header names); anything else (ints, bools) is not a weight of this format
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the header


@dataclass(frozen=True)
class _Found:
    """What the folder holds, read without its weights."""

    spec: DictionarySpec
    weights: Path
    names: dict[str, str]  # the Dictionary's tensor name -> its name in the weights file
    rescale_by_decoder_norm: bool = False  # SAELens topk's rescale_acts_by_decoder_norm: folded in on loading
    hook_name: str | None = None
    hook_name_out: str | None = None


def read_spec(folder: Path) -> DictionarySpec:
    """What the dictionary in `folder` is, read from its config and the weights file's header (no weight is read)."""
    return _inspect(Path(folder)).spec


def read_hook_names(folder: Path) -> tuple[str | None, str | None]:
    """The hooks the dictionary was trained on (SAELens's hook_name, and hook_name_out for a transcoder), if named."""
    found = _inspect(Path(folder))
    return found.hook_name, found.hook_name_out


def load_dictionary(folder: Path, device: str | torch.device = "cpu") -> Dictionary:
    """The dictionary in `folder`, float32, frozen, on `device`."""
    found = _inspect(Path(folder))
    spec = found.spec
    try:
        raw = load_file(found.weights)
    except Exception as err:  # safetensors' SafetensorError, an OSError: the file is not what its header says
        raise RunnerError(
            f"Could not read the weights in {found.weights}: {err}. The file is damaged or truncated."
        ) from err

    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs in found.names.items():
        tensor = raw[theirs]
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise RunnerError(
                f"{found.weights}: tensor {theirs} holds {bad} NaN or infinite value(s) of {tensor.numel()}; the "
                "dictionary's weights are broken: use another checkpoint."
            )
        tensors[ours] = tensor.to(torch.float32)

    scaling = tensors.pop("scaling_factor", None)
    if scaling is not None and not torch.equal(scaling, torch.ones_like(scaling)):
        # SAELens's finetuning_scaling_factor (pre-6 checkpoints): drop it only where it is all ones, as SAELens does
        raise RunnerError(
            f"{found.weights}: scaling_factor is not all ones (a SAELens finetuning scaling factor), which the runner "
            "does not apply: fold it into W_dec (each latent's row times its factor) and delete the tensor."
        )
    topk_threshold = tensors.pop("topk_threshold", None)
    if topk_threshold is not None:  # batchtopk_sae.py: every latent gets the one threshold
        tensors["threshold"] = torch.full((spec.width,), float(topk_threshold), dtype=torch.float32)
    if found.rescale_by_decoder_norm:  # topk_sae.py _fold_norm_topk
        norms = tensors["W_dec"].norm(dim=-1)  # (width,)
        tensors["b_enc"] = tensors["b_enc"] * norms
        tensors["W_enc"] = tensors["W_enc"] * norms  # (d_in, width) * (width,)
        tensors["W_dec"] = tensors["W_dec"] / norms[:, None]
    tensors.setdefault("threshold", torch.zeros(spec.width))  # relu and topk read none

    with torch.device("meta"):  # no zeros of the full size allocated only to be overwritten
        dictionary = Dictionary(spec)
    for name, param in list(dictionary.named_parameters()):
        tensor = tensors[name]
        if tensor.shape != param.shape:  # the header said otherwise: read_spec checked the header's shapes
            raise RunnerError(
                f"{found.weights}: {found.names.get(name, name)} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}."
            )
        setattr(dictionary, name, nn.Parameter(tensor.contiguous(), requires_grad=False))
    return dictionary.to(device).eval()


def save_saelens(
    dictionary: Dictionary, folder: Path, hook_name: str, model_name: str, extra: dict | None = None
) -> None:
    """Write `dictionary` as SAELens 6 writes an inference SAE (cfg.json + sae_weights.safetensors) in `folder`."""
    spec = dictionary.spec
    if spec.transcoder and spec.architecture == "topk":
        raise RunnerError(
            "SAELens has no topk transcoder (its transcoders are relu or jumprelu): save as another kind."
        )
    if spec.transcoder and spec.apply_b_dec_to_input:
        raise RunnerError("A SAELens transcoder cannot subtract b_dec from its input: set apply_b_dec_to_input false.")
    if spec.transcoder and spec.normalize == "constant_norm_rescale":
        raise RunnerError(
            "SAELens's transcoder does not undo constant_norm_rescale on its output, so it would not compute what this "
            "dictionary does: save a transcoder with normalize 'none' or 'expected_average_only_in'."
        )
    tensors = {
        name: p.detach().to("cpu", torch.float32).contiguous().clone() for name, p in dictionary.named_parameters()
    }
    if spec.architecture not in ("jumprelu", "batchtopk"):
        del tensors["threshold"]
    normalize = spec.normalize
    if normalize == "expected_average_only_in":
        # SAELens's inference SAE does not scale at run time: fold the scale in, as its trainer does before saving
        # (sae.py fold_activation_norm_scaling_factor); the threshold compares the same pre-activations, unchanged.
        tensors["W_enc"] = tensors["W_enc"] * spec.scale
        tensors["W_dec"] = tensors["W_dec"] / spec.scale
        tensors["b_dec"] = tensors["b_dec"] / spec.scale
        normalize = "none"

    # batchtopk saves as a jumprelu, as SAELens saves it; the metadata keeps what it was trained as, for read_spec
    architecture = "jumprelu" if spec.architecture == "batchtopk" else {"relu": "standard"}.get(spec.architecture)
    architecture = architecture or spec.architecture
    if spec.transcoder:
        architecture = "transcoder" if architecture == "standard" else f"{architecture}_transcoder"
    metadata: dict[str, Any] = {
        "sae_lens_version": SAELENS_FORMAT_VERSION,
        "sae_lens_training_version": None,  # not trained by SAELens
        "model_name": model_name,
        "hook_name": hook_name,
        "hook_head_index": None,
        "saved_by": "runner/dictionaries/formats.py save_saelens",
    }
    if spec.architecture == "batchtopk":
        metadata.update(trained_architecture="batchtopk", k=spec.k)
    clash = sorted(set(extra or {}) & set(metadata))
    if clash:
        raise RunnerError(f"save_saelens: extra metadata may not set {', '.join(clash)}: they are the arguments' own.")
    metadata.update(extra or {})
    cfg: dict[str, Any] = {
        "architecture": architecture,
        "d_in": spec.d_in,
        "d_sae": spec.width,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": spec.apply_b_dec_to_input,
        "normalize_activations": normalize,
        "reshape_activations": "none",
        "metadata": metadata,
    }
    if spec.architecture == "topk":
        cfg.update(k=spec.k, rescale_acts_by_decoder_norm=False)
    if spec.transcoder:
        cfg["d_out"] = spec.d_out

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / SAELENS_WEIGHTS))
    (folder / SAELENS_CFG).write_text(json.dumps(cfg, indent=2) + "\n")


def check_fits(spec: DictionarySpec, d_model: int, where: str) -> None:
    """RunnerError unless the dictionary reads (and writes) `d_model` values per position, the width at `where`."""
    if spec.d_in != d_model:
        raise RunnerError(
            f"The {spec.kind} reads {spec.d_in} values per position, the model's {where} has {d_model}: it was trained "
            f"on another model (or another site); give a dictionary whose d_in is {d_model}."
        )
    if spec.d_out != d_model:
        raise RunnerError(
            f"The {spec.kind} writes {spec.d_out} values per position, the model's {where} has {d_model}: give a "
            f"dictionary whose d_out is {d_model}."
        )


# --- the folder ---------------------------------------------------------------------------------------------------


def _inspect(folder: Path) -> _Found:
    if not folder.exists():
        raise RunnerError(f"Dictionary folder {folder} does not exist: give the folder holding its weights.")
    if not folder.is_dir():
        raise RunnerError(f"Dictionary path {folder} is a file: give the folder that holds it.")
    _refuse_code(folder)
    if (folder / SAELENS_CFG).is_file() and (folder / SAELENS_WEIGHTS).is_file():
        return _saelens(folder)
    if (folder / GEMMA_SCOPE_WEIGHTS).is_file():
        return _gemma_scope(folder)
    hint = ""
    if (folder / SAELENS_CFG).is_file():
        hint = f" It has {SAELENS_CFG} but no {SAELENS_WEIGHTS}."
    elif (folder / "params.npz").is_file():
        hint = (
            " It has Gemma Scope's params.npz: convert it once with numpy and safetensors "
            "(save_file({k: torch.from_numpy(v) for k, v in np.load('params.npz').items()}, 'params.safetensors'))."
        )
    raise RunnerError(
        f"Dictionary folder {folder} holds neither layout the runner reads: SAELens's {SAELENS_CFG} + "
        f"{SAELENS_WEIGHTS}, or Gemma Scope's {GEMMA_SCOPE_WEIGHTS}.{hint}"
    )


def _refuse_code(folder: Path) -> None:
    """RunnerError naming any file in `folder` that is code, a pickle or executable."""
    bad: list[str] = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        suffix = path.suffix.lower()
        executable = suffix not in NOT_PROGRAMS and bool(
            path.stat().st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        )
        if suffix in REFUSED_SUFFIXES or executable:
            bad.append(str(path.relative_to(folder)))
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise RunnerError(
            f"Dictionary folder {folder} holds code, pickles or executables ({shown}); the runner reads safetensors "
            f"and JSON only and will not read beside them: copy {SAELENS_CFG} + {SAELENS_WEIGHTS} (and "
            f"{SAELENS_SCALER}), or {GEMMA_SCOPE_WEIGHTS}, into a folder of their own."
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunnerError(f"Could not read {path} as JSON: {err}.") from err
    if not isinstance(data, dict):
        raise RunnerError(f"{path} holds a JSON {type(data).__name__}, not an object of settings.")
    return data


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' names and shapes from a safetensors file's header, reading nothing past it."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise RunnerError(f"{path} is not a safetensors file (its first 8 bytes do not give a header length).")
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunnerError(f"{path} is not a safetensors file (its header is not JSON: {err}).") from err
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            raise RunnerError(f"{path}: the header's entry for {name} has no shape; the file is damaged.")
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise RunnerError(f"{path}: tensor {name} is {entry.get('dtype')}, not floating point; not a dictionary's.")
        shapes[name] = tuple(int(n) for n in entry["shape"])
    return shapes


# --- SAELens ------------------------------------------------------------------------------------------------------


def _saelens(folder: Path) -> _Found:
    cfg_path, weights = folder / SAELENS_CFG, folder / SAELENS_WEIGHTS
    cfg = _read_json(cfg_path)
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}

    def setting(*names: str) -> Any:
        """A setting at cfg.json's top level or in its metadata (where SAELens 6 moved the hook and model names)."""
        for name in names:
            for source in (cfg, meta):
                if source.get(name) is not None:
                    return source[name]
        return None

    name = _saelens_architecture(cfg, cfg_path, meta)
    architecture, transcoder = SAELENS_ARCHITECTURES[name]
    d_in, width = (_count(cfg, key, cfg_path) for key in ("d_in", "d_sae"))
    shapes = _tensor_shapes(weights)
    d_out = d_in
    if transcoder:
        d_out = _count(cfg, "d_out", cfg_path) if "d_out" in cfg else _dim(shapes, "W_dec", 1, d_in)

    apply_b_dec = cfg.get("apply_b_dec_to_input", True)  # SAELens's default, before and after 6.0
    if not isinstance(apply_b_dec, bool):
        raise RunnerError(f"{cfg_path}: apply_b_dec_to_input is {apply_b_dec!r}; give true or false.")
    if transcoder and apply_b_dec:
        raise RunnerError(
            f"{cfg_path}: a transcoder with apply_b_dec_to_input true; SAELens refuses it (b_dec is the output's "
            "bias): set it to false."
        )
    if cfg.get("reshape_activations", "none") not in ("none", None):
        raise RunnerError(
            f"{cfg_path}: reshape_activations is {cfg['reshape_activations']!r}: this dictionary reads attention's "
            "per-head outputs (hook_z), which the runner does not splice; use one trained on a residual or MLP site."
        )
    normalize = _normalisation(cfg.get("normalize_activations"), cfg_path)
    if transcoder and normalize == "constant_norm_rescale":
        raise RunnerError(
            f"{cfg_path}: a transcoder with normalize_activations 'constant_norm_rescale': SAELens's transcoder leaves "
            "its output in the normalised scale, so what it predicts is not defined; the runner reads transcoders "
            "with 'none' or 'expected_average_only_in'."
        )
    scale = _scaling_factor(folder, cfg_path) if normalize == "expected_average_only_in" else 1.0

    k = 0
    if architecture in ("topk", "batchtopk"):
        kwargs = cfg.get("activation_fn_kwargs") if isinstance(cfg.get("activation_fn_kwargs"), dict) else {}
        raw_k = setting("k") if setting("k") is not None else kwargs.get("k")
        if isinstance(raw_k, bool) or not isinstance(raw_k, int | float) or not 0 < raw_k <= width:
            raise RunnerError(
                f"{cfg_path}: a {name} dictionary needs k, the latents kept per row (1..d_sae={width}); cfg.json gives "
                f'{raw_k!r}: add "k": N.'
            )
        if architecture == "topk" and raw_k != int(raw_k):
            raise RunnerError(f"{cfg_path}: a topk dictionary's k is {raw_k}; it must be a whole number.")
        k = round(raw_k)  # batchtopk's k is an average over a batch; at inference its threshold decides

    expected = {"W_enc": (d_in, width), "b_enc": (width,), "W_dec": (width, d_out), "b_dec": (d_out,)}
    names = {key: key for key in expected}
    if architecture == "jumprelu" or (architecture == "batchtopk" and "topk_threshold" not in shapes):
        expected["threshold"] = (width,)
        names["threshold"] = "threshold"
        if "threshold" not in shapes:
            raise RunnerError(
                f"{weights} has no threshold tensor, which a {name} dictionary needs (one per latent): the file is not "
                "a complete checkpoint of it."
            )
    elif architecture == "batchtopk":
        expected["topk_threshold"] = ()
        names["topk_threshold"] = "topk_threshold"
    if "scaling_factor" in shapes:  # pre-6 checkpoints: all ones, dropped on loading (else refused there)
        expected["scaling_factor"] = (width,)
        names["scaling_factor"] = "scaling_factor"
    _check_shapes(shapes, expected, weights, f"{cfg_path.name} (d_in {d_in}, d_sae {width}, d_out {d_out})")

    rescale = architecture in ("topk", "batchtopk") and bool(cfg.get("rescale_acts_by_decoder_norm", False))
    spec = DictionarySpec(architecture, d_in, width, d_out, k, apply_b_dec, normalize, scale, transcoder)
    return _Found(spec, weights, names, rescale, setting("hook_name", "hook_point"), setting("hook_name_out"))


def _saelens_architecture(cfg: dict[str, Any], cfg_path: Path, meta: dict[str, Any]) -> str:
    """SAELens's architecture name for cfg.json, old configs included (handle_pre_6_0_config)."""
    name = cfg.get("architecture") or "standard"
    activation = cfg.get("activation_fn_str", cfg.get("activation_fn"))
    if name == "standard" and activation == "topk":
        name = "topk"
    elif name == "standard" and activation not in (None, "relu"):
        raise RunnerError(
            f"{cfg_path}: activation function {activation!r} is not one the runner reads; SAELens's standard SAE "
            "uses relu, or topk with activation_fn_kwargs {k: N}."
        )
    if name == "jumprelu" and meta.get("trained_architecture") == "batchtopk":
        name = "batchtopk"  # written by save_saelens: a batchtopk saved, as SAELens saves it, as a jumprelu
    if not isinstance(name, str) or name not in SAELENS_ARCHITECTURES:
        supported = ", ".join(SAELENS_ARCHITECTURES)
        lacks = UNSUPPORTED_ARCHITECTURES.get(str(name))
        why = f" The runner's dictionary has no {lacks}." if lacks else suggest(str(name), SAELENS_ARCHITECTURES)
        raise RunnerError(
            f"{cfg_path}: architecture {name!r} is not supported.{why} Supported (SAELens's names): {supported}."
        )
    return name


def _normalisation(raw: Any, cfg_path: Path) -> str:
    if raw is None or raw is False:  # SAELens: None and a pre-6 false mean none, a pre-6 true the average scaling
        return "none"
    if raw is True:
        return "expected_average_only_in"
    if raw not in NORMALISATIONS:
        hint = (
            " (SAELens's layer_norm is not supported here.)"
            if raw == "layer_norm"
            else suggest(str(raw), NORMALISATIONS)
        )
        raise RunnerError(
            f"{cfg_path}: normalize_activations {raw!r} is not one the runner reads.{hint} "
            f"Give one of: {', '.join(NORMALISATIONS)}."
        )
    return raw


def _scaling_factor(folder: Path, cfg_path: Path) -> float:
    """s of expected_average_only_in: SAELens keeps it in activation_scaler.json beside the checkpoint."""
    path = folder / SAELENS_SCALER
    fix = (
        f'write {SAELENS_SCALER} holding {{"scaling_factor": s}} (for a released SAE, s is its norm_scaling_factor '
        "in SAELens's pretrained_saes.yaml), or, if s is already folded into the weights, set normalize_activations "
        'to "none"'
    )
    if not path.is_file():
        raise RunnerError(
            f"{cfg_path} says normalize_activations 'expected_average_only_in' but {path} is missing: {fix}."
        )
    value = _read_json(path).get("scaling_factor")
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise RunnerError(f"{path}: scaling_factor is {value!r}, not a positive number: {fix}.")
    return float(value)


# --- Gemma Scope --------------------------------------------------------------------------------------------------


def _gemma_scope(folder: Path) -> _Found:
    weights = folder / GEMMA_SCOPE_WEIGHTS
    shapes = _tensor_shapes(weights)
    names = {("W_" + key[2:] if key.startswith("w_") else key): key for key in shapes}  # as SAELens's gemma loader
    if "threshold" not in names:
        raise RunnerError(
            f"{weights} has no threshold tensor, which a Gemma Scope (jumprelu) dictionary needs: the file is not "
            "a complete Gemma Scope checkpoint."
        )
    for key in ("W_enc", "W_dec"):
        if len(shapes.get(names.get(key, ""), ())) != 2:
            raise RunnerError(f"{weights} has no 2-D {key} (it holds {', '.join(shapes)}): not a Gemma Scope file.")
    d_in, width = shapes[names["W_enc"]]
    d_out = shapes[names["W_dec"]][1]
    expected = {"W_enc": (d_in, width), "b_enc": (width,), "W_dec": (width, d_out), "b_dec": (d_out,)}
    expected["threshold"] = (width,)
    _check_shapes({ours: shapes[theirs] for ours, theirs in names.items()}, expected, weights, "W_enc's shape")

    config: dict[str, Any] = {}
    config_path = next((folder / n for n in GEMMA_SCOPE_CONFIGS if (folder / n).is_file()), None)
    if config_path is not None:
        config = _read_json(config_path)
        config = {**config, **(config.get("metadata") if isinstance(config.get("metadata"), dict) else {})}
        architecture = config.get("architecture", "jumprelu")
        if architecture not in ("jumprelu", "jumprelu_transcoder"):
            raise RunnerError(
                f"{config_path}: architecture {architecture!r} beside Gemma Scope's {GEMMA_SCOPE_WEIGHTS}, whose "
                'dictionaries are jumprelu: give "jumprelu" or "jumprelu_transcoder", or no architecture.'
            )
        for key, have in (("d_in", d_in), ("d_sae", width), ("width", width), ("d_out", d_out)):
            if key in config and config[key] != have:
                raise RunnerError(
                    f"{config_path} gives {key} {config[key]!r} but {weights}'s tensors have {have}: the config is "
                    "another dictionary's."
                )
    hook_name_out = config.get("hook_name_out")
    transcoder = d_in != d_out or bool(hook_name_out) or config.get("architecture") == "jumprelu_transcoder"
    spec = DictionarySpec("jumprelu", d_in, width, d_out, transcoder=transcoder)
    return _Found(
        spec, weights, {ours: names[ours] for ours in expected}, False, config.get("hook_name"), hook_name_out
    )


# --- shared -------------------------------------------------------------------------------------------------------


def _count(cfg: dict[str, Any], key: str, cfg_path: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RunnerError(f"{cfg_path}: {key} is {value!r}; it must be a positive whole number.")
    return value


def _dim(shapes: dict[str, tuple[int, ...]], name: str, axis: int, default: int) -> int:
    shape = shapes.get(name, ())
    return shape[axis] if len(shape) > axis else default


def _check_shapes(
    shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], weights: Path, source: str
) -> None:
    """RunnerError naming each tensor missing, extra or of another shape than `source` implies."""
    missing = [n for n in expected if n not in shapes]
    extra = [n for n in shapes if n not in expected]
    wrong = [f"{n} {shapes[n]} (expected {expected[n]})" for n in expected if n in shapes and shapes[n] != expected[n]]
    if missing or wrong:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([", ".join(wrong)] if wrong else [])
        raise RunnerError(
            f"{weights}: the weights' shapes disagree with {source}: {'; '.join(parts)}. The config and the weights "
            "are of different dictionaries: give the pair saved together."
        )
    if extra:
        raise RunnerError(
            f"{weights} holds tensors the runner's dictionary has no place for ({', '.join(extra)}): it is another "
            "architecture (a skip connection, a gate), which the runner does not read."
        )


__all__ = ["check_fits", "load_dictionary", "read_hook_names", "read_spec", "save_saelens"]
