"""The LM patching references agree: a plain one-forward-per-cell loop with torch hooks on the HF modules, and
TransformerLens 4.3's `patching.get_act_patch_*` through its TransformerBridge, on random GPT-2 and Llama
(grouped-query) models; plus identity checks on the loop that need no second implementation."""

from __future__ import annotations

import pytest
import torch

# transformers and transformer-lens are dev dependencies: missing, these tests fail at import rather than skip.
from lm_references import (
    SITES,
    _register,
    build_tiny_lm,
    capture,
    logit_diff,
    loop_patching,
    n_heads,
    run_patched,
    tl_bridge,
    tl_patching,
)

pytestmark = pytest.mark.slow  # each builds or runs models for a second or more
ARCHS = ("gpt2", "llama")
CHANGED = 2  # the one position where the corrupted prompts differ from the clean ones


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> object:
    """Models this small run a forward in about a millisecond on one thread; two threads on a loaded machine wait
    on each other for a hundred times that."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHS)
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny model, its tokenizer and bridge, and two clean/corrupted pairs differing at position CHANGED."""
    arch = request.param
    model, tokenizer, folder = build_tiny_lm(arch, seed=0, folder=tmp_path_factory.mktemp(arch))
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(4, len(tokenizer), (2, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, CHANGED] = (clean[:, CHANGED] - 4 + 7) % (len(tokenizer) - 4) + 4  # another ordinary token
    metric = logit_diff(torch.tensor([5, 6]), torch.tensor([7, 8]))
    with torch.no_grad():
        clean_m = metric(model(input_ids=clean, use_cache=False).logits)
        corrupted_m = metric(model(input_ids=corrupted, use_cache=False).logits)
    return {
        "arch": arch,
        "model": model,
        "tokenizer": tokenizer,
        "bridge": tl_bridge(model, tokenizer),
        "clean": clean,
        "corrupted": corrupted,
        "metric": metric,
        "clean_m": clean_m,
        "corrupted_m": corrupted_m,
    }


@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.parametrize("site", SITES)
def test_loop_equals_transformerlens(lm: dict, site: str, direction: str) -> None:
    """Every cell of the loop's table equals TransformerLens' within 1e-5, per pair (GPT-2 and grouped-query Llama)."""
    args = (lm["clean"], lm["corrupted"], site, lm["metric"], direction)
    ours = loop_patching(lm["model"], *args, reduce="none")
    theirs = tl_patching(lm["bridge"], lm["tokenizer"], *args, reduce="none")
    cells = n_heads(lm["model"]) if site == "head" else lm["clean"].shape[1]
    assert ours.shape == theirs.shape == (2, cells, 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # Not vacuous: some cell moves the metric well away from the unpatched target run.
    target = lm["corrupted_m"] if direction == "denoise" else lm["clean_m"]
    assert (ours - target).abs().max() > 0.05


def test_tl_patching_from_a_folder_equals_the_loop(lm: dict, tmp_path: pytest.TempPathFactory) -> None:
    """The bridge booted from the saved folder (not the in-memory model) gives the same table."""
    _, tokenizer, folder = build_tiny_lm(lm["arch"], seed=0, folder=tmp_path)
    args = (lm["clean"], lm["corrupted"], "resid_pre", lm["metric"])
    torch.testing.assert_close(
        tl_patching(folder, tokenizer, *args), loop_patching(lm["model"], *args), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("site", SITES)
def test_loop_clean_into_clean_is_the_clean_metric(lm: dict, site: str) -> None:
    """Patching the clean run's own activation into it changes nothing, at every cell, and leaves no hook."""
    table = loop_patching(lm["model"], lm["clean"], lm["clean"], site, lm["metric"], reduce="none")
    torch.testing.assert_close(table, lm["clean_m"].expand_as(table), rtol=0, atol=1e-6)
    assert _hooks(lm["model"]) == 0


def test_loop_resid_pre_layer0_every_position_is_the_clean_metric(lm: dict) -> None:
    """resid_pre at layer 0 patched at all positions at once is the whole clean input: the clean metric."""
    model, metric = lm["model"], lm["metric"]
    clean_act = capture(model, lm["clean"], "resid_pre")[0]
    corrupted_act = capture(model, lm["corrupted"], "resid_pre")[0]
    denoised = metric(run_patched(model, lm["corrupted"], "resid_pre", 0, clean_act))
    noised = metric(run_patched(model, lm["clean"], "resid_pre", 0, corrupted_act))
    torch.testing.assert_close(denoised, lm["clean_m"], rtol=0, atol=1e-6)
    torch.testing.assert_close(noised, lm["corrupted_m"], rtol=0, atol=1e-6)
    assert (lm["clean_m"] - lm["corrupted_m"]).abs().max() > 0.05  # the pairs do differ


def test_loop_resid_pre_layer0_only_the_changed_position_matters(lm: dict) -> None:
    """Layer 0's residual differs only where the tokens do: that cell restores the clean metric, the rest none."""
    table = loop_patching(lm["model"], lm["clean"], lm["corrupted"], "resid_pre", lm["metric"], reduce="none")
    row = table[0]  # (positions, pairs)
    torch.testing.assert_close(row[CHANGED], lm["clean_m"], rtol=0, atol=1e-6)
    others = torch.cat([row[:CHANGED], row[CHANGED + 1 :]])
    torch.testing.assert_close(others, lm["corrupted_m"].expand_as(others), rtol=0, atol=1e-6)


def test_bridge_prepends_bos_to_strings_not_to_token_tensors(lm: dict) -> None:
    """TL's bridge reloads the tokenizer with add_bos_token=True: strings gain a BOS the HF tokenizer does not add;
    token tensors go in unchanged, so its logits on them equal the HF model's."""
    tokenizer, bridge = lm["tokenizer"], lm["bridge"]
    assert tokenizer("t01 t02").input_ids == [5, 6]
    assert bridge.to_tokens("t01 t02").tolist() == [[tokenizer.bos_token_id, 5, 6]]
    with torch.no_grad():
        hf = lm["model"](input_ids=lm["clean"], use_cache=False).logits
        tl = bridge(lm["clean"])
    torch.testing.assert_close(tl, hf, rtol=0, atol=1e-5)
    assert _hooks(lm["model"]) == 0  # the bridge wraps a copy: the HF model keeps its modules and no hooks


def test_resid_pre_hook_takes_hidden_states_by_position_or_keyword(tmp_path: pytest.TempPathFactory) -> None:
    """transformers 5 calls blocks with hidden_states positionally; a block called by keyword is patched alike
    (GPT-2's block: it takes hidden_states alone, where Llama's needs its rotary embeddings passed in)."""
    model, _, _ = build_tiny_lm("gpt2", seed=0, folder=tmp_path)
    block = model.transformer.h[0]
    x = torch.randn(1, 4, model.config.n_embd)
    seen: list[torch.Tensor] = []

    def swap(act: torch.Tensor) -> torch.Tensor:
        seen.append(act)
        return torch.zeros_like(act)

    with torch.no_grad():
        expected = block(torch.zeros_like(x))
        handle = _register(block, "resid_pre", swap)
        try:
            by_position, by_keyword = block(x), block(hidden_states=x)
        finally:
            handle.remove()
    assert len(seen) == 2 and all(torch.equal(a, x) for a in seen)
    torch.testing.assert_close(by_position, expected, rtol=0, atol=0)
    torch.testing.assert_close(by_keyword, expected, rtol=0, atol=0)
