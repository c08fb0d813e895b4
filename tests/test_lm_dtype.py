"""`model.dtype` of model=hf_lm: the weights load in float32, bfloat16 or float16 (saved or random weights), every LM
method runs on them, another value or a second setting of the same thing (`model.kwargs.dtype`) is refused in one
line before the model loads, and patched metrics from bfloat16 and float16 weights agree with float32's within a
measured tolerance on the shipped induction model (the metrics themselves are computed in float32 from the final
logits)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from runner.errors import RunnerError
from runner.methods.lm_patching import lm_activation_patching
from runner.methods.lm_saliency import lm_grad_x_act, lm_logit_lens
from runner.models import build_model
from runner.models.hf_lm import shipped_folder
from tests.conftest import make_config

# Largest |restoration - float32's| over the shipped model's 32 pairs x 144 cells (resid_pre, attn_out, heads; both
# directions), measured: 0.028 with bfloat16 weights, 0.0092 with float16 (8 and 11 bits of mantissa). The clean and
# corrupted logit differences themselves (8-12 in size) move by at most 0.05 and 0.007.
RESTORATION_TOLERANCE = {"bfloat16": 0.05, "float16": 0.02}
METRIC_TOLERANCE = {"bfloat16": 0.1, "float16": 0.02}
KEYS = ["sample_index", "site", "layer", "head", "position", "direction"]


def _model(dtype: str, *overrides: str):
    bundle = build_model(make_config("model=hf_lm", f"model.dtype={dtype}", *overrides).model)
    return bundle.model.eval(), bundle.tokenizer


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, str]]:
    return [json.loads(line) for line in (shipped_folder() / "induction_pairs.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_weights_load_in_model_dtype(dtype: str) -> None:
    for overrides in ([], ["model.weights=null"]):  # saved weights, and random ones from the config
        model, _ = _model(dtype, *overrides)
        assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}, overrides


def test_the_default_is_float32() -> None:
    assert make_config("model=hf_lm").model.dtype == "float32"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.dtype=float64", "model.dtype=float64: use one of float32, bfloat16, float16 (the dtype the weights"),
        ("model.dtype=bf16", "model.dtype=bf16: use one of float32, bfloat16, float16"),
        ("+model.kwargs.dtype=bfloat16", "model.kwargs.dtype is model.dtype's setting: give model.dtype=bfloat16."),
        ("+model.kwargs.torch_dtype=float16", "model.kwargs.torch_dtype is model.dtype's setting: give model.dtype="),
    ],
)
def test_another_dtype_is_refused_in_one_line_before_the_model_loads(override: str, message: str) -> None:
    with pytest.raises(RunnerError) as refused:
        make_config("model=hf_lm", override)  # the config's checks: no model is built
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_lm_method_runs_on_half_precision_weights(dtype: str, pairs: list[dict[str, str]]) -> None:
    model, tokenizer = _model(dtype)
    few = pairs[:4]
    for settings in ({"corruption": {"kind": "noise"}}, {"corruption": {"kind": "mean"}}, {"mode": "attribution"}):
        table = lm_activation_patching(model, tokenizer, few, sites=["resid_pre", "mlp_out", "head"], **settings)
        assert table["patched"].notna().all(), settings
    for table in (lm_grad_x_act(model, tokenizer, few), lm_logit_lens(model, tokenizer, few)):
        assert table["value"].notna().all()


def _compare(full: pd.DataFrame, half: pd.DataFrame, dtype: str) -> pd.DataFrame:
    both = full.merge(half, on=KEYS, suffixes=("", "_half"), validate="one_to_one")
    assert len(both) == len(full) == len(half)
    for column in ("clean", "corrupted"):
        assert (both[column] - both[f"{column}_half"]).abs().max() < METRIC_TOLERANCE[dtype], column
    # The patched metric as a share of the pair's span: patched logit differences reach 28, so an absolute bound
    # would say little.
    gap = (both["restoration"] - both["restoration_half"]).abs()
    assert gap.max() < RESTORATION_TOLERANCE[dtype], gap.max()
    return both


def test_patched_metrics_from_bfloat16_weights_agree_with_float32(pairs: list[dict[str, str]]) -> None:
    settings = {"sites": ["resid_pre", "attn_out"], "directions": ["denoising"]}
    full = lm_activation_patching(*_model("float32"), pairs[:4], **settings)
    _compare(full, lm_activation_patching(*_model("bfloat16"), pairs[:4], **settings), "bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_patched_metrics_from_half_precision_weights_agree_with_float32_on_every_pair(
    dtype: str, pairs: list[dict[str, str]]
) -> None:
    settings = {"sites": ["resid_pre", "attn_out", "head"], "directions": ["denoising", "noising"]}
    full = lm_activation_patching(*_model("float32"), pairs, **settings)
    half = lm_activation_patching(*_model(dtype), pairs, **settings)
    assert len(_compare(full, half, dtype)) == 32 * 144
    # What the tolerance keeps: the same cells restore most (the answer's first occurrence, layer 1's attention).
    top = [frame.groupby(["site", "layer", "position"])["restoration"].mean().idxmax() for frame in (full, half)]
    assert top[0] == top[1]
