"""runner/dictionaries/formats.py: SAELens and Gemma Scope folders read and checked against reference
implementations written here from the published definitions (not from runner/dictionaries/dictionary.py), SAELens's
layout written back bit for bit, and every refusal raised before the weights are read where it can be.

The references follow SAELens 6.18 (github.com/jbloomAus/SAELens): sae_lens/saes/sae.py (SAE.process_sae_in,
_setup_activation_normalization), training/activation_scaler.py (ActivationScaler.scale/unscale), standard_sae.py StandardSAE.encode/decode,
jumprelu_sae.py JumpReLUSAE.encode, topk_sae.py TopK.forward / TopKSAE.encode/decode / _fold_norm_topk,
batchtopk_sae.py BatchTopKTrainingSAE.process_state_dict_for_saving_inference, transcoder.py Transcoder /
JumpReLUTranscoder; and Gemma Scope's JumpReLU (its tutorial's JumpReLUSAE: relu(pre) * (pre > threshold)).
Tolerance: float32, rtol 1e-5 and atol 1e-6 on values of order 1 (folded scales round differently in the last bits).
"""

from __future__ import annotations

import json
import math
import stat
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runner.dictionaries import formats
from runner.dictionaries.dictionary import Dictionary, DictionarySpec
from runner.dictionaries.formats import check_fits, load_dictionary, read_hook_names, read_spec, save_saelens
from runner.errors import RunnerError

D_IN, WIDTH, D_OUT, K = 16, 24, 20, 5
TOL = {"rtol": 1e-5, "atol": 1e-6}

# SAELens 6's config fields (sae.py SAEConfig; topk_sae.py TopKSAEConfig; transcoder.py TranscoderConfig): from_dict
# keeps these (util.py filter_valid_dataclass_fields) and needs d_in and d_sae, which have no default
SAELENS_CONFIG_FIELDS = {
    "d_in",
    "d_sae",
    "dtype",
    "device",
    "apply_b_dec_to_input",
    "normalize_activations",
    "reshape_activations",
    "metadata",
}
SAELENS_EXTRA_FIELDS = {"topk": {"k", "rescale_acts_by_decoder_norm"}, "transcoder": {"d_out"}}
# the parameters of each SAELens inference class, which load_state_dict (strict) wants exactly
SAELENS_PARAMETERS = {
    "standard": {"W_enc", "b_enc", "W_dec", "b_dec"},
    "topk": {"W_enc", "b_enc", "W_dec", "b_dec"},
    "transcoder": {"W_enc", "b_enc", "W_dec", "b_dec"},
    "jumprelu": {"W_enc", "b_enc", "W_dec", "b_dec", "threshold"},
    "jumprelu_transcoder": {"W_enc", "b_enc", "W_dec", "b_dec", "threshold"},
}


# --- references, from the published definitions --------------------------------------------------------------------


def _fold_norm_topk(w: dict[str, torch.Tensor]) -> None:
    """topk_sae.py _fold_norm_topk."""
    norm = w["W_dec"].norm(dim=-1)
    w["b_enc"] = w["b_enc"] * norm
    w["W_dec"] = w["W_dec"] / norm.unsqueeze(1)
    w["W_enc"] = w["W_enc"] * norm.unsqueeze(1).T


def saelens_reference(
    cfg: dict[str, Any], weights: dict[str, torch.Tensor], x: torch.Tensor, scaling_factor: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, output) of SAELens 6 at inference for this cfg.json and these weights."""
    w = {name: t.to(torch.float32) for name, t in weights.items()}
    arch = cfg.get("architecture", "standard")
    rescale = bool(cfg.get("rescale_acts_by_decoder_norm", False))
    if arch == "batchtopk":  # saved for inference as a jumprelu: norms folded, topk_threshold for every latent
        if rescale:
            _fold_norm_topk(w)
        w["threshold"] = torch.ones_like(w["b_enc"]) * w.pop("topk_threshold").item()
        arch, rescale = "jumprelu", False
    transcoder = arch in ("transcoder", "jumprelu_transcoder")
    norm = cfg["normalize_activations"]
    # expected_average_only_in: the trainer's ActivationScaler.scale on the way in and .unscale on the way out
    # (training/activation_scaler.py, evals.py), the definition the checkpoint was trained with
    scale = scaling_factor if norm == "expected_average_only_in" else 1.0
    coeff = (cfg["d_in"] ** 0.5) / x.norm(dim=-1, keepdim=True) if norm == "constant_norm_rescale" else None
    sae_in = x * coeff if coeff is not None else x * scale
    if not transcoder:  # SAE.process_sae_in; Transcoder.process_sae_in skips b_dec
        sae_in = sae_in - w["b_dec"] * cfg["apply_b_dec_to_input"]
    hidden_pre = sae_in @ w["W_enc"] + w["b_enc"]
    if arch == "topk":
        if rescale:
            hidden_pre = hidden_pre * w["W_dec"].norm(dim=-1)
        values, indices = torch.topk(hidden_pre, k=cfg["k"], dim=-1, sorted=False)
        latents = torch.zeros_like(hidden_pre).scatter_(-1, indices, values.relu())
    elif arch in ("jumprelu", "jumprelu_transcoder"):
        latents = torch.relu(hidden_pre) * (hidden_pre > w["threshold"]).to(hidden_pre.dtype)
    else:
        latents = torch.relu(hidden_pre)
    acts = latents / w["W_dec"].norm(dim=-1) if arch == "topk" and rescale else latents
    out = acts @ w["W_dec"] + w["b_dec"]
    if coeff is not None and not transcoder:  # run_time_activation_norm_fn_out; Transcoder.decode has none
        out = out / coeff
    return latents, out / scale


def gemma_scope_reference(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma Scope's JumpReLU SAE: no b_dec subtracted, no normalisation."""
    pre_acts = x @ params["W_enc"] + params["b_enc"]
    acts = (pre_acts > params["threshold"]) * torch.relu(pre_acts)
    return acts, acts @ params["W_dec"] + params["b_dec"]


# --- folders --------------------------------------------------------------------------------------------------------


def random_weights(seed: int, d_in: int = D_IN, width: int = WIDTH, d_out: int = D_IN) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "W_enc": torch.randn(d_in, width, generator=g) / math.sqrt(d_in),
        "b_enc": torch.randn(width, generator=g) * 0.1,
        "W_dec": torch.randn(width, d_out, generator=g) * (0.5 + torch.rand(width, 1, generator=g)) / math.sqrt(width),
        "b_dec": torch.randn(d_out, generator=g) * 0.3,
        "threshold": torch.rand(width, generator=g) * 0.3,
    }


def saelens_cfg(architecture: str, normalize: str = "none", **more: Any) -> dict[str, Any]:
    """A cfg.json as SAELens 6's SAEConfig.to_dict writes it."""
    return {
        "architecture": architecture,
        "d_in": D_IN,
        "d_sae": WIDTH,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": normalize,
        "reshape_activations": "none",
        "metadata": {"sae_lens_version": "6.18.0", "model_name": "tiny", "hook_name": "blocks.1.hook_resid_post"},
        **more,
    }


def write_saelens(
    folder: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], scaling_factor: float | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "sae_weights.safetensors"))
    if scaling_factor is not None:
        (folder / "activation_scaler.json").write_text(json.dumps({"scaling_factor": scaling_factor}))
    return folder


def write_gemma_scope(folder: Path, params: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in params.items()}, str(folder / "params.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def inputs(seed: int, d: int = D_IN) -> torch.Tensor:
    return torch.randn(2, 3, d, generator=torch.Generator().manual_seed(seed)) * 4  # (B, T, d): norms far from sqrt(d)


def assert_matches(dictionary: Dictionary, x: torch.Tensor, latents: torch.Tensor, out: torch.Tensor) -> None:
    """encode and decode agree with the reference, and the case is not degenerate (some latents on, some off)."""
    active = latents > 0
    assert active.any() and not active.all(), "the case tests nothing: every latent on, or none"
    torch.testing.assert_close(dictionary.encode(x), latents, **TOL)
    torch.testing.assert_close(dictionary.decode(latents, x), out, **TOL)
    torch.testing.assert_close(dictionary(x), out, **TOL)


# --- SAELens, every architecture and normalisation ------------------------------------------------------------------

ARCHITECTURES = {
    "standard": ({}, ("threshold",)),
    "jumprelu": ({}, ()),
    "topk": ({"k": K, "rescale_acts_by_decoder_norm": False}, ("threshold",)),
    "topk_rescaled": ({"k": K, "rescale_acts_by_decoder_norm": True}, ("threshold",)),
    "batchtopk": ({"k": float(K), "rescale_acts_by_decoder_norm": True, "topk_threshold_lr": 0.01}, ("threshold",)),
}
EXPECTED_ARCHITECTURE = {"standard": "relu", "topk_rescaled": "topk"}


@pytest.mark.parametrize("normalize", ["none", "expected_average_only_in", "constant_norm_rescale"])
@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_saelens_folder_computes_what_saelens_does(tmp_path: Path, case: str, normalize: str) -> None:
    architecture = case.removesuffix("_rescaled")
    more, dropped = ARCHITECTURES[case]
    cfg = saelens_cfg(architecture, normalize, **more)
    weights = {n: t for n, t in random_weights(1).items() if n not in dropped}
    if architecture == "batchtopk":  # a training checkpoint (BatchTopKTrainingSAE.save_model): one float64 threshold
        weights["topk_threshold"] = torch.tensor(0.2, dtype=torch.float64)
    scaling_factor = 0.37 if normalize == "expected_average_only_in" else None
    folder = write_saelens(tmp_path / case, cfg, weights, scaling_factor)

    spec = read_spec(folder)
    assert (spec.architecture, spec.d_in, spec.width, spec.d_out) == (
        EXPECTED_ARCHITECTURE.get(case, architecture),
        D_IN,
        WIDTH,
        D_IN,
    )
    assert (spec.normalize, spec.scale, spec.apply_b_dec_to_input, spec.transcoder) == (
        normalize,
        scaling_factor or 1.0,
        True,
        False,
    )
    assert spec.k == (K if architecture in ("topk", "batchtopk") else 0)
    dictionary = load_dictionary(folder)
    x = inputs(2)
    assert_matches(dictionary, x, *saelens_reference(cfg, weights, x, scaling_factor))


@pytest.mark.parametrize(("old", "normalize"), [(False, "none"), (None, "none"), (True, "expected_average_only_in")])
def test_pre_6_cfg_with_activation_fn_kwargs_reads_as_topk(tmp_path: Path, old: bool | None, normalize: str) -> None:
    """SAELens 5's keys: activation_fn_str, activation_fn_kwargs {k}, hook_point, normalize_activations a bool (or
    null), apply_b_dec_to_input absent (true)."""
    cfg = {
        "d_in": D_IN,
        "d_sae": WIDTH,
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": K},
        "normalize_activations": old,
        "hook_point": "blocks.0.hook_resid_pre",
        "sae_lens_training_version": "3.5.0",
    }
    weights = {n: t for n, t in random_weights(3).items() if n != "threshold"}
    scaling_factor = 1.7 if old else None
    folder = write_saelens(tmp_path / "old", cfg, weights, scaling_factor)
    spec = read_spec(folder)
    assert (spec.architecture, spec.k, spec.normalize, spec.apply_b_dec_to_input) == ("topk", K, normalize, True)
    assert read_hook_names(folder) == ("blocks.0.hook_resid_pre", None)
    x = inputs(4)
    reference_cfg = {"architecture": "topk", "k": K, "d_in": D_IN, "normalize_activations": normalize}
    reference_cfg["apply_b_dec_to_input"] = True
    assert_matches(load_dictionary(folder), x, *saelens_reference(reference_cfg, weights, x, scaling_factor))


def test_loaded_dictionary_is_float32_frozen_and_drops_an_all_ones_scaling_factor(tmp_path: Path) -> None:
    weights = {n: t.to(torch.bfloat16) for n, t in random_weights(5).items()}
    weights["scaling_factor"] = torch.ones(WIDTH, dtype=torch.bfloat16)  # pre-6 checkpoints carried one, all ones
    folder = write_saelens(tmp_path / "bf16", saelens_cfg("jumprelu"), weights)
    dictionary = load_dictionary(folder)
    assert {n for n, _ in dictionary.named_parameters()} == {"W_enc", "b_enc", "W_dec", "b_dec", "threshold"}
    for name, param in dictionary.named_parameters():
        assert param.dtype == torch.float32 and not param.requires_grad and param.device.type == "cpu"
        assert torch.equal(param, weights[name].to(torch.float32))
    assert read_hook_names(folder) == ("blocks.1.hook_resid_post", None)


# --- Gemma Scope ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowercase", [False, True])
def test_gemma_scope_params_compute_the_published_jumprelu(tmp_path: Path, lowercase: bool) -> None:
    params = random_weights(6)
    on_disk = {("w_" + n[2:] if lowercase and n.startswith("W_") else n): t for n, t in params.items()}
    folder = write_gemma_scope(tmp_path / "gs", on_disk)
    spec = read_spec(folder)
    assert spec == DictionarySpec("jumprelu", D_IN, WIDTH, D_IN)  # apply_b_dec_to_input False, no normalisation
    x = inputs(7)
    assert_matches(load_dictionary(folder), x, *gemma_scope_reference(params, x))


# --- transcoders ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["transcoder", "jumprelu_transcoder"])
def test_saelens_transcoder_reads_one_width_and_writes_another(tmp_path: Path, architecture: str) -> None:
    cfg = saelens_cfg(architecture, d_out=D_OUT, apply_b_dec_to_input=False)
    cfg["metadata"]["hook_name_out"] = "blocks.1.hook_mlp_out"
    weights = random_weights(8, d_out=D_OUT)
    if architecture == "transcoder":
        del weights["threshold"]
    folder = write_saelens(tmp_path / architecture, cfg, weights)
    spec = read_spec(folder)
    assert (spec.transcoder, spec.d_in, spec.d_out, spec.kind) == (True, D_IN, D_OUT, "transcoder")
    assert read_hook_names(folder) == ("blocks.1.hook_resid_post", "blocks.1.hook_mlp_out")
    x = inputs(9)
    dictionary = load_dictionary(folder)
    assert dictionary.decode(dictionary.encode(x), x).shape == (2, 3, D_OUT)
    assert_matches(dictionary, x, *saelens_reference(cfg, weights, x))


def test_gemma_scope_transcoder(tmp_path: Path) -> None:
    params = random_weights(10, d_out=D_OUT)
    folder = write_gemma_scope(tmp_path / "gst", params, {"hook_name": "blocks.2.ln2.hook_normalized"})
    spec = read_spec(folder)
    assert (spec.transcoder, spec.d_in, spec.d_out) == (True, D_IN, D_OUT)
    assert read_hook_names(folder) == ("blocks.2.ln2.hook_normalized", None)
    x = inputs(11)
    assert_matches(load_dictionary(folder), x, *gemma_scope_reference(params, x))


# --- writing SAELens's layout ---------------------------------------------------------------------------------------


def make_dictionary(spec: DictionarySpec, seed: int) -> Dictionary:
    dictionary = Dictionary(spec)
    with torch.no_grad():
        for name, tensor in random_weights(seed, spec.d_in, spec.width, spec.d_out).items():
            getattr(dictionary, name).copy_(tensor)
    return dictionary


ROUND_TRIPS = [
    DictionarySpec("relu", D_IN, WIDTH, D_IN, apply_b_dec_to_input=True),
    DictionarySpec("jumprelu", D_IN, WIDTH, D_IN, normalize="constant_norm_rescale"),
    DictionarySpec("topk", D_IN, WIDTH, D_IN, k=K, apply_b_dec_to_input=True),
    DictionarySpec("batchtopk", D_IN, WIDTH, D_IN, k=K),
    DictionarySpec("relu", D_IN, WIDTH, D_OUT, transcoder=True),
    DictionarySpec("jumprelu", D_IN, WIDTH, D_OUT, transcoder=True),
]


@pytest.mark.parametrize("spec", ROUND_TRIPS, ids=lambda s: f"{s.architecture}-{s.kind}-{s.normalize}")
def test_save_saelens_round_trips_bit_for_bit(tmp_path: Path, spec: DictionarySpec) -> None:
    original = make_dictionary(spec, 12)
    save_saelens(original, tmp_path / "saved", "blocks.3.hook_resid_post", "tiny", extra={"note": "test"})
    assert read_spec(tmp_path / "saved") == spec
    loaded = load_dictionary(tmp_path / "saved")
    kept = {"W_enc", "b_enc", "W_dec", "b_dec"} | (
        {"threshold"} if spec.architecture in ("jumprelu", "batchtopk") else set()
    )
    for name, param in original.named_parameters():
        assert torch.equal(getattr(loaded, name), param if name in kept else torch.zeros_like(param)), name
    x = inputs(13)
    assert torch.equal(loaded(x), original(x))


@pytest.mark.parametrize("spec", ROUND_TRIPS, ids=lambda s: f"{s.architecture}-{s.kind}-{s.normalize}")
def test_saved_cfg_has_what_saelens_6_load_from_disk_needs(tmp_path: Path, spec: DictionarySpec) -> None:
    save_saelens(make_dictionary(spec, 14), tmp_path / "saved", "blocks.3.hook_resid_post", "tiny")
    cfg = json.loads((tmp_path / "saved" / "cfg.json").read_text())
    with safe_open(str(tmp_path / "saved" / "sae_weights.safetensors"), framework="pt") as f:
        names = set(f.keys())
    architecture = cfg["architecture"]
    family = "transcoder" if "transcoder" in architecture else architecture
    # SAE.load_from_disk: handle_config_defaulting reads a version >= 6.0 as the 6.x format; get_sae_class needs the
    # architecture; the config dataclass needs d_in and d_sae; the defaults (apply_b_dec_to_input true, k 100, d_out
    # 768) must not stand in for ours; HookedSAETransformer attaches at metadata.hook_name
    assert tuple(int(p) for p in cfg["metadata"]["sae_lens_version"].split(".")[:2]) >= (6, 0)
    assert architecture in SAELENS_PARAMETERS
    required = {"architecture", "d_in", "d_sae", "dtype", "apply_b_dec_to_input", "normalize_activations", "metadata"}
    required |= {"k"} if architecture == "topk" else set()
    required |= {"d_out"} if family == "transcoder" else set()
    assert required <= set(cfg)
    assert set(cfg) - {"architecture"} <= SAELENS_CONFIG_FIELDS | SAELENS_EXTRA_FIELDS.get(family, set())
    assert {"hook_name", "model_name"} <= set(cfg["metadata"])
    assert cfg["dtype"] == "float32" and cfg["normalize_activations"] == spec.normalize
    assert names == SAELENS_PARAMETERS[architecture]


def test_saving_folds_the_average_scale_into_the_weights_as_saelens_does(tmp_path: Path) -> None:
    """SAELens's inference SAE does not scale at run time, so the scale goes into the weights and the cfg says none."""
    spec = DictionarySpec("jumprelu", D_IN, WIDTH, D_IN, True, normalize="expected_average_only_in", scale=0.37)
    original = make_dictionary(spec, 15)
    save_saelens(original, tmp_path / "saved", "blocks.0.hook_resid_post", "tiny")
    loaded = load_dictionary(tmp_path / "saved")
    assert loaded.spec.normalize == "none" and loaded.spec.scale == 1.0
    assert torch.equal(loaded.W_enc, original.W_enc * 0.37) and torch.equal(loaded.b_dec, original.b_dec / 0.37)
    x = inputs(16)
    torch.testing.assert_close(loaded.encode(x), original.encode(x), **TOL)
    torch.testing.assert_close(loaded(x), original(x), **TOL)


# --- refusals -------------------------------------------------------------------------------------------------------


def saelens_folder(tmp_path: Path, cfg: dict[str, Any] | None = None, **weights: torch.Tensor) -> Path:
    tensors = {**{n: t for n, t in random_weights(20).items() if n != "threshold"}, **weights}
    return write_saelens(tmp_path / "sae", cfg or saelens_cfg("standard"), tensors)


def test_refuses_a_missing_or_foreign_folder(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="does not exist"):
        read_spec(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "params.npz").write_bytes(b"")
    with pytest.raises(RunnerError, match=r"neither layout.*cfg.json \+ sae_weights.safetensors.*params.safetensors"):
        load_dictionary(tmp_path / "empty")


@pytest.mark.parametrize("name", ["gated", "skip_transcoder", "jumprelo", "matryoshka_batchtopk"])
def test_refuses_an_unsupported_architecture_naming_the_supported(tmp_path: Path, name: str) -> None:
    folder = saelens_folder(tmp_path, saelens_cfg(name))
    hint = {"jumprelo": "Did you mean: jumprelu", "gated": "gate path", "skip_transcoder": "W_skip"}.get(name, "")
    with pytest.raises(RunnerError, match=rf"architecture '{name}' is not supported.*{hint}.*standard, jumprelu, topk"):
        read_spec(folder)


@pytest.mark.parametrize("value", ["constant_norm", "layer_norm", "batch"])
def test_refuses_an_unknown_normalisation(tmp_path: Path, value: str) -> None:
    folder = saelens_folder(tmp_path, saelens_cfg("standard", value))
    with pytest.raises(RunnerError, match=rf"normalize_activations '{value}'.*none, expected_average_only_in"):
        read_spec(folder)


def test_refuses_the_average_normalisation_without_its_scaling_factor(tmp_path: Path) -> None:
    folder = saelens_folder(tmp_path, saelens_cfg("standard", "expected_average_only_in"))
    with pytest.raises(RunnerError, match=r"activation_scaler.json is missing.*scaling_factor"):
        read_spec(folder)
    (folder / "activation_scaler.json").write_text('{"scaling_factor": null}')
    with pytest.raises(RunnerError, match="scaling_factor is None, not a positive number"):
        read_spec(folder)


@pytest.mark.parametrize("name", [".py", ".pyc", ".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".so", ".sh"])
def test_refuses_a_folder_with_code_or_pickles(tmp_path: Path, name: str) -> None:
    folder = saelens_folder(tmp_path)
    (folder / "sparsity.safetensors").write_bytes(b"")  # another safetensors file is fine
    read_spec(folder)
    (folder / f"trainer_state{name}").write_bytes(b"")
    with pytest.raises(RunnerError, match=rf"trainer_state\{name}.*reads safetensors and JSON only"):
        read_spec(folder)


def test_refuses_an_executable_file(tmp_path: Path) -> None:
    folder = saelens_folder(tmp_path)
    tool = folder / "convert"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RunnerError, match=r"code, pickles or executables \(convert\)"):
        load_dictionary(folder)


def test_refuses_weights_whose_shapes_disagree_with_the_cfg(tmp_path: Path) -> None:
    folder = saelens_folder(tmp_path, saelens_cfg("standard", d_sae=WIDTH + 8))
    with pytest.raises(
        RunnerError, match=rf"disagree with cfg.json.*W_enc \({D_IN}, {WIDTH}\) \(expected \({D_IN}, 32\)"
    ):
        read_spec(folder)


@pytest.mark.parametrize("tensor", ["W_dec", "b_enc", "threshold"])
def test_refuses_nan_or_infinite_weights_naming_the_tensor(tmp_path: Path, tensor: str) -> None:
    weights = random_weights(21)
    weights[tensor].view(-1)[3] = float("nan") if tensor != "threshold" else float("inf")
    folder = write_saelens(tmp_path / "bad", saelens_cfg("jumprelu"), weights)
    read_spec(folder)  # the header is sound
    with pytest.raises(RunnerError, match=rf"tensor {tensor} holds 1 NaN or infinite value"):
        load_dictionary(folder)


def test_refuses_topk_without_k_and_jumprelu_without_threshold(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="a topk dictionary needs k"):
        read_spec(saelens_folder(tmp_path / "a", saelens_cfg("topk")))
    with pytest.raises(RunnerError, match="a batchtopk dictionary needs k"):
        read_spec(saelens_folder(tmp_path / "b", saelens_cfg("batchtopk"), topk_threshold=torch.tensor(0.1)))
    with pytest.raises(RunnerError, match="no threshold tensor, which a jumprelu dictionary needs"):
        read_spec(saelens_folder(tmp_path / "c", saelens_cfg("jumprelu")))
    params = {n: t for n, t in random_weights(22).items() if n != "threshold"}
    with pytest.raises(RunnerError, match="no threshold tensor, which a Gemma Scope"):
        read_spec(write_gemma_scope(tmp_path / "d", params))


def test_refuses_tensors_it_has_no_place_for_and_a_non_unit_scaling_factor(tmp_path: Path) -> None:
    folder = saelens_folder(tmp_path / "a", W_skip=torch.zeros(D_IN, D_IN))
    with pytest.raises(RunnerError, match=r"no place for \(W_skip\)"):
        read_spec(folder)
    folder = saelens_folder(tmp_path / "b", scaling_factor=torch.full((WIDTH,), 2.0))
    with pytest.raises(RunnerError, match="scaling_factor is not all ones"):
        load_dictionary(folder)


def test_check_fits_names_both_widths() -> None:
    check_fits(DictionarySpec("relu", 576, 8, 576), 576, "resid_post")
    with pytest.raises(RunnerError, match="reads 512 values per position, the model's resid_post has 576"):
        check_fits(DictionarySpec("relu", 512, 8, 512), 576, "resid_post")
    with pytest.raises(RunnerError, match="transcoder writes 512 values per position, the model's mlp_out has 576"):
        check_fits(DictionarySpec("relu", 576, 8, 512, transcoder=True), 576, "mlp_out")


def _garble_after_header(path: Path) -> None:
    """Every byte after the safetensors header set to 0xFF (NaN as float32): only the header still says anything."""
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    data[start:] = b"\xff" * (len(data) - start)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["saelens", "gemma_scope"])
def test_a_wrong_width_is_refused_from_the_header_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    weights = random_weights(23, d_in=512, width=8, d_out=512)
    if layout == "saelens":
        folder = write_saelens(tmp_path / layout, {**saelens_cfg("jumprelu"), "d_in": 512, "d_sae": 8}, weights)
        path = folder / "sae_weights.safetensors"
    else:
        folder = write_gemma_scope(tmp_path / layout, weights)
        path = folder / "params.safetensors"
    _garble_after_header(path)

    def no_weights(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the weights were read")

    with monkeypatch.context() as patch:
        patch.setattr(formats, "load_file", no_weights)
        spec = read_spec(folder)
        assert (spec.d_in, spec.width) == (512, 8)
        with pytest.raises(RunnerError, match="reads 512 values per position, the model's resid_post has 576"):
            check_fits(spec, 576, "resid_post")
    with pytest.raises(RunnerError, match="NaN or infinite"):  # the garbage is there: loading would have found it
        load_dictionary(folder)


def test_refuses_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    folder = saelens_folder(tmp_path)
    (folder / "sae_weights.safetensors").write_bytes(b"PK\x03\x04 a zip, not safetensors")
    with pytest.raises(RunnerError, match="is not a safetensors file"):
        read_spec(folder)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"reshape_activations": "hook_z"}, "per-head outputs"),
        ({"architecture": "transcoder", "apply_b_dec_to_input": True}, "apply_b_dec_to_input true"),
        (
            {
                "architecture": "transcoder",
                "apply_b_dec_to_input": False,
                "normalize_activations": "constant_norm_rescale",
            },
            "transcoder with normalize_activations 'constant_norm_rescale'",
        ),
        ({"activation_fn_str": "tanh-relu"}, "activation function 'tanh-relu'"),
        ({"d_sae": "24"}, "d_sae is '24'"),
    ],
)
def test_refuses_what_the_dictionary_cannot_compute(tmp_path: Path, change: dict[str, Any], words: str) -> None:
    with pytest.raises(RunnerError, match=words):
        read_spec(saelens_folder(tmp_path, {**saelens_cfg("standard"), **change}))


def test_refuses_a_gemma_scope_config_of_another_dictionary(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match=f"gives d_sae 99 but .* have {WIDTH}"):
        read_spec(write_gemma_scope(tmp_path / "a", random_weights(24), {"d_sae": 99}))
    with pytest.raises(RunnerError, match="architecture 'topk' beside Gemma Scope"):
        read_spec(write_gemma_scope(tmp_path / "b", random_weights(24), {"architecture": "topk"}))


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (DictionarySpec("topk", D_IN, WIDTH, D_OUT, k=K, transcoder=True), "no topk transcoder"),
        (
            DictionarySpec("relu", D_IN, WIDTH, D_OUT, transcoder=True, normalize="constant_norm_rescale"),
            "does not undo",
        ),
    ],
)
def test_save_saelens_refuses_what_saelens_would_compute_otherwise(
    tmp_path: Path, spec: DictionarySpec, words: str
) -> None:
    with pytest.raises(RunnerError, match=words):
        save_saelens(make_dictionary(spec, 25), tmp_path / "saved", "blocks.0.hook_mlp_in", "tiny")
    assert not (tmp_path / "saved").exists()
