"""Sparse dictionaries spliced into the real SmolLM2-135M and Gemma 3 270M (slow tier, real weights): the spliced
model's logits are the model's to float rounding, and patching every latent and the error of a dictionary equals
patching the site it reads. Random dictionaries: they reconstruct little, so the error term carries most of the
site, the hardest case for the identity (a trained one's error is small)."""

from __future__ import annotations

import copy

import pytest
import torch

from runner.dictionaries.splice import Spliced, attach
from runner.hooks import HookSession, count_hooks
from runner.hooks.sites import SiteHooks
from runner.models.lm_sites import layout_of
from tests.test_dictionary_splice import random_dictionary
from tests.test_packaged_lm import packaged_ioi

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
# |spliced - model| over the largest |logit|: float32 rounding of decode(f) + (x - decode(f)) carried through the
# later layers. Measured: 1.1e-6 (SmolLM2), 9.0e-7 (Gemma 3), random TopK dictionaries of 256 latents.
TOLERANCE = 1e-5
PLACES = {"smollm2-135m": [("resid_post", 14), ("mlp", 20), ("attn_out", 5)],
          "gemma3-270m": [("resid_post", 8), ("mlp", 12), ("mlp_out", 3)]}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(PLACES))
def real(request: pytest.FixtureRequest) -> dict:
    found = packaged_ioi(request.param)
    model = found["model"]
    spliced = copy.deepcopy(model)
    d = model.config.hidden_size
    dictionaries = [Spliced(random_dictionary(d, "topk", seed=i, width=256, transcoder=site == "mlp"), site, layer)
                    for i, (site, layer) in enumerate(PLACES[request.param])]  # fmt: skip
    attach(spliced, layout_of(spliced), dictionaries)
    return {**found, "name": request.param, "spliced": spliced}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_the_spliced_real_model_computes_the_models_logits(real: dict) -> None:
    spliced = real["spliced"]
    with HookSession(spliced, []):
        inside = _logits(spliced, real["clean"])
    expected = _logits(real["model"], real["clean"])
    error = float((inside - expected).abs().max() / expected.abs().max())
    print(f"{real['name']}: spliced vs model, max |difference| / max |logit| = {error:.2e}")
    assert error <= TOLERANCE
    assert count_hooks(spliced) == 0
    ioi = real["metric"](inside)
    assert (ioi > 0).all()  # still prefers the indirect object, as the model does


def test_patching_every_latent_and_the_error_equals_patching_the_site_on_real_weights(real: dict) -> None:
    spliced = real["spliced"]
    layout = layout_of(spliced)
    site, layer = PLACES[real["name"]][0]
    names = [f"latent.{layer}", f"error.{layer}", f"{site}.{layer}"]
    rows = torch.arange(real["clean"].shape[0])
    with HookSession(spliced, []) as session:
        hooks = SiteHooks(spliced, [layout.site(n.split(".")[0], layer) for n in names], session)
        with hooks.keep():
            _logits(spliced, real["clean"])
        source = dict(hooks.kept)
        with hooks.keep(fixed={n: (rows, source[n]) for n in names[:2]}):
            through = real["metric"](_logits(spliced, real["corrupted"]))
        with hooks.keep(fixed={names[2]: (rows, source[names[2]])}):
            whole = real["metric"](_logits(spliced, real["corrupted"]))
        with hooks.keep():
            corrupted = real["metric"](_logits(spliced, real["corrupted"]))
    print(f"{real['name']}: every latent + error {through.tolist()}, the site {whole.tolist()}")
    assert (through - whole).abs().max() <= 1e-4 * whole.abs().max()
    assert (whole - corrupted).abs().max() > 0.1  # the patch moves the metric
