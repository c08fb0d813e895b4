"""Sparse dictionaries spliced into a language model with an error term (runner/dictionaries/splice.py): the spliced
model computes what the model computes, the latents and the error are sites that patching and the gradient reach,
and patching them equals a plain-hooks reference written here (a latent's decoder row added to the stream)."""

from __future__ import annotations

import pytest
import torch
from lm_references import build_tiny_lm

from runner.dictionaries.dictionary import Dictionary, DictionarySpec
from runner.dictionaries.splice import Spliced, attach
from runner.hooks import HookSession, count_hooks
from runner.hooks.sites import Cell, SiteHooks
from runner.models.lm_sites import layout_of

pytestmark = pytest.mark.slow
WIDTH = 48
SITES = ("resid_pre", "resid_post", "attn_out", "mlp_out", "mlp")


def random_dictionary(d: int, architecture: str = "relu", seed: int = 0, width: int = WIDTH,
                      transcoder: bool = False) -> Dictionary:  # fmt: skip
    """A dictionary with random weights whose latents fire on about half of the inputs (relu) or k of them."""
    spec = DictionarySpec(architecture, d, width, d, k=6 if architecture == "topk" else 0,
                          apply_b_dec_to_input=True, transcoder=transcoder)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    dictionary = Dictionary(spec)
    with torch.no_grad():
        dictionary.W_enc.copy_(torch.randn(d, width, generator=g) / d**0.5)
        dictionary.W_dec.copy_(torch.randn(width, d, generator=g) / width**0.5)
        dictionary.b_enc.copy_(torch.randn(width, generator=g) * 0.1)
        dictionary.b_dec.copy_(torch.randn(d, generator=g) * 0.1)
        dictionary.threshold.copy_(torch.rand(width, generator=g) * 0.2)
    return dictionary.requires_grad_(False)


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A random two-layer model (Llama; Gemma 3: norms after each branch) and two prompts differing at position 2."""
    model, tokenizer, _ = build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(4, len(tokenizer), (2, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 5 - 4) % (len(tokenizer) - 4) + 4
    return model, clean, corrupted


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _spliced(model: torch.nn.Module, site: str, architecture: str = "relu", layer: int = 1) -> torch.nn.Module:
    """A copy of `model` with a random dictionary at `site` of `layer`."""
    import copy

    copied = copy.deepcopy(model)
    d = copied.config.hidden_size
    attach(
        copied, layout_of(copied), [Spliced(random_dictionary(d, architecture, transcoder=site == "mlp"), site, layer)]
    )
    return copied


def _written(site: str) -> str:
    """The model's own site that a dictionary at `site` writes (a transcoder: what the MLP adds)."""
    return "mlp_out" if site == "mlp" else site


@pytest.mark.parametrize("architecture", ["relu", "jumprelu", "topk"])
@pytest.mark.parametrize("site", SITES)
def test_the_spliced_model_computes_the_models_logits(tiny: tuple, site: str, architecture: str) -> None:
    model, clean, _ = tiny
    spliced = _spliced(model, site, architecture)
    layout = layout_of(spliced)
    assert [(p.site, p.layer, p.width) for p in layout.dictionaries] == [(site, 1, WIDTH)]
    with HookSession(spliced, []) as session:
        hooks = SiteHooks(spliced, [layout.site("error", 1), layout.site(_written(site), 1)], session)
        with hooks.keep():
            inside = _logits(spliced, clean)
        error, written = hooks.kept["error.1"], hooks.kept[f"{_written(site)}.1"]
    expected = _logits(model, clean)
    assert (inside - expected).abs().max() <= 1e-5 * expected.abs().max()
    # not a vacuous identity: a random dictionary reconstructs little, the error term carries the rest
    assert error.norm() > 0.3 * written.norm()
    assert count_hooks(spliced) == 0  # the session's close removed the splice's hooks too
    assert (_logits(spliced, clean) == expected).all()  # no session: the dictionary sits unused in its block


@pytest.mark.parametrize("site", SITES)
def test_patching_every_latent_and_the_error_equals_patching_the_site(tiny: tuple, site: str) -> None:
    model, clean, corrupted = tiny
    spliced = _spliced(model, site)
    layout = layout_of(spliced)
    names = ["latent.1", "error.1", f"{_written(site)}.1"]
    rows = torch.arange(clean.shape[0])
    with HookSession(spliced, []) as session:
        hooks = SiteHooks(spliced, [layout.site(*name.split(".")[:1], 1) for name in names], session)
        with hooks.keep():
            _logits(spliced, corrupted)
        source = dict(hooks.kept)
        with hooks.keep(fixed={n: (rows, source[n]) for n in names[:2]}):
            through_dictionary = _logits(spliced, clean)
        with hooks.keep(fixed={names[2]: (rows, source[names[2]])}):
            site_patched = _logits(spliced, clean)
    corrupted_logits = _logits(model, corrupted)
    assert (through_dictionary - site_patched).abs().max() <= 1e-5 * site_patched.abs().max()
    # the patch reaches the logits: position 2 onwards now read the corrupted run's site
    assert (through_dictionary - _logits(model, clean)).abs().max() > 1e-3
    if site in ("resid_pre", "resid_post"):  # the whole stream: the corrupted run's own logits from there on
        assert (through_dictionary[:, 2:] - corrupted_logits[:, 2:]).abs().max() <= 1e-4 * corrupted_logits.abs().max()


@pytest.mark.parametrize("site", ["resid_post", "mlp", "attn_out"])
def test_one_latent_patched_adds_its_decoder_row_times_the_change(tiny: tuple, site: str) -> None:
    """The patched latent's effect, against a plain forward hook on the unspliced model that adds
    (f_corrupted - f_clean) x W_dec[latent] to the site at that position."""
    model, clean, corrupted = tiny
    spliced = _spliced(model, site)
    layout = layout_of(spliced)
    dictionary = spliced.get_submodule(layout.dictionaries[0].module).dictionary
    spec = layout.site(_written(site), 1)
    module = model.get_submodule(spec.module)
    reads = model.get_submodule(layout.module_name(layout.arch.mlp, 1)) if site == "mlp" else module

    def latents_of(ids: torch.Tensor) -> torch.Tensor:
        seen = {}
        handle = reads.register_forward_hook(
            lambda m, a, o: seen.update(x=a[0] if site == "mlp" else (o[0] if isinstance(o, tuple) else o))
        )
        try:
            _logits(model, ids)
        finally:
            handle.remove()
        return dictionary.encode(seen["x"])  # (B, T, width)

    f_clean, f_corrupted = latents_of(clean), latents_of(corrupted)
    changed = (f_corrupted[:, 2] - f_clean[:, 2]).abs().sum(0)  # (width,)
    latent = int(changed.argmax())
    assert changed[latent] > 0
    with HookSession(spliced, []) as session:
        hooks = SiteHooks(spliced, [layout.site("latent", 1)], session)
        with hooks.keep():
            _logits(spliced, corrupted)
        hooks.plan([Cell("latent", 1, 2, latent)], clean.shape[0], dict(hooks.kept))
        patched = _logits(spliced, clean)
        hooks.clear()

    delta = (f_corrupted[:, 2, latent] - f_clean[:, 2, latent])[:, None] * dictionary.W_dec[latent]  # (B, d)

    def add_row(m: torch.nn.Module, a: tuple, o: object) -> object:
        out = o[0] if isinstance(o, tuple) else o
        out = out.clone()
        out[:, 2] += delta
        return (out, *o[1:]) if isinstance(o, tuple) else out

    handle = module.register_forward_hook(add_row)
    try:
        reference = _logits(model, clean)
    finally:
        handle.remove()
    assert (patched - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert (patched - _logits(model, clean)).abs().max() > 1e-4


@pytest.mark.parametrize("site", SITES)
def test_the_latents_and_the_errors_attributions_sum_to_the_sites(tiny: tuple, site: str) -> None:
    """grad . (corrupted - clean) at the site equals the sum over its latents plus the error's: the decoder is
    linear, f's gradient is W_dec's rows against the site's, the error's the site's own."""
    model, clean, corrupted = tiny
    spliced = _spliced(model, site)
    layout = layout_of(spliced)
    names = ["latent.1", "error.1", f"{_written(site)}.1"]
    with HookSession(spliced, []) as session:
        hooks = SiteHooks(spliced, [layout.site(n.split(".")[0], 1) for n in names], session)
        with hooks.keep():
            _logits(spliced, corrupted)
        source = dict(hooks.kept)
        with torch.enable_grad(), hooks.keep(grad=True):
            logits = spliced(input_ids=clean, use_cache=False).logits
            metric = (logits[:, -1, 5] - logits[:, -1, 7]).sum()
            views = [hooks.kept[n] for n in names]
            grads = torch.autograd.grad(metric, views)
    per_unit = [(g * (source[n] - v.detach())) for n, g, v in zip(names, grads, views, strict=True)]
    latents = per_unit[0].sum(dim=(2, 3))  # (B, T)
    error, whole = per_unit[1].sum(-1), per_unit[2].sum(-1)
    assert whole.abs().max() > 1e-4
    assert (latents + error - whole).abs().max() <= 1e-4 * whole.abs().max()
