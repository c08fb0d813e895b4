"""Named sites of every supported decoder family (runner/models/lm_sites.py), checked the same way on each: the
residual stream at the last layer's last position is all that reaches the logits, so patching it restores exactly
(resid_mid and resid_post); resid_mid is the stream itself (both the MLP's branch and the skip connection), equal to
a plain-hook loop, and its attribution estimate is the same intervention's whether the parameters are frozen or not;
the unembedding is found through get_output_embeddings()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runner.errors import RunnerError
from runner.methods.lm_patching import lm_activation_patching
from runner.methods.lm_saliency import lm_logit_lens
from runner.models.lm_sites import layout_of, unembedding
from tests.lm_references import FAMILIES, build_tiny_lm, logit_diff
from tests.test_lm_patching import PAIRS, _ids

LAST = 7  # the pairs' last position: BOS + 7 tokens


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, _ = build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))
    return request.param, model, tokenizer


def _stream_sites(model: nn.Module) -> list[str]:
    return [s for s in ("resid_mid", "resid_post") if s in layout_of(model).available()]


def test_the_last_layers_stream_at_the_last_position_restores_exactly(family) -> None:  # type: ignore[no-untyped-def]
    """Denoising: the clean stream patched in gives the clean metric (restoration 1); noising: the corrupted one
    gives the corrupted metric. resid_mid read at the mid norm's input and patched there reached only the MLP's
    branch (restoration 0.46 on GPT-2, 0.55 on Llama, 0.14 on sequential GPT-NeoX)."""
    arch, model, tokenizer = family
    sites = _stream_sites(model)
    assert ("resid_mid" in sites) == (arch != "gpt_neox")  # parallel attention and MLP: no resid_mid
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=sites, directions=["denoising", "noising"])
    last = table[(table.layer == layout_of(model).layers - 1) & (table.position == LAST)]
    assert len(last) == len(sites) * 2 * len(PAIRS)
    assert not last.degenerate.any() and last.restoration.notna().all()
    denoise, noise = last[last.direction == "denoising"], last[last.direction == "noising"]
    assert (denoise.restoration - 1).abs().max() < 1e-4, denoise[["site", "restoration"]]
    assert (denoise.patched - denoise.clean).abs().max() < 1e-4
    assert (noise.patched - noise.corrupted).abs().max() < 1e-4, noise[["site", "patched", "corrupted"]]


def _resid_mid_loop(model: nn.Module, receiver: torch.Tensor, source: torch.Tensor, layer: int, position: int,
                    metric: Any) -> torch.Tensor:  # fmt: skip
    """One forward of `receiver` with the stream between block `layer`'s attention and MLP replaced at `position`
    by the source run's, written with plain hooks: the block's input kept by a pre-hook, the attention's output set
    so that input + output is the source's stream there."""
    layout = layout_of(model)
    modules = dict(model.named_modules())
    block = modules[layout.module_name("", layer).rstrip(".")]
    attn = modules[layout.module_name(layout.arch.attn, layer)]
    captured: dict[str, torch.Tensor] = {}

    def keep_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["in"] = args[0] if args else kwargs["hidden_states"]

    def keep_stream(module: nn.Module, args: tuple, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        captured["mid"] = captured["in"] + out

    def write_stream(module: nn.Module, args: tuple, output: Any) -> Any:
        out = output[0] if isinstance(output, tuple) else output
        new = out.clone()
        new[:, position] = wanted[:, position] - captured["in"][:, position]
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handles = [block.register_forward_pre_hook(keep_input, with_kwargs=True), attn.register_forward_hook(keep_stream)]
    try:
        with torch.no_grad():
            model(input_ids=source, use_cache=False)
        wanted = captured["mid"].clone()
    finally:
        for h in handles:
            h.remove()
    handles = [block.register_forward_pre_hook(keep_input, with_kwargs=True), attn.register_forward_hook(write_stream)]
    try:
        with torch.no_grad():
            return metric(model(input_ids=receiver, use_cache=False).logits)
    finally:
        for h in handles:
            h.remove()


def test_resid_mid_equals_a_plain_hook_loop(family) -> None:  # type: ignore[no-untyped-def]
    arch, model, tokenizer = family
    if "resid_mid" not in _stream_sites(model):
        with pytest.raises(RunnerError, match="no resid_mid"):
            layout_of(model).site("resid_mid", 0)
        return
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_mid"], directions=["denoising"])
    clean = torch.tensor([_ids(tokenizer, p["clean"]) for p in PAIRS])
    corrupted = torch.tensor([_ids(tokenizer, p["corrupted"]) for p in PAIRS])
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(p["answer"]) for p in PAIRS])
    distractor = torch.tensor([tokenizer.convert_tokens_to_ids(p["distractor"]) for p in PAIRS])
    metric = logit_diff(answer, distractor)
    worst = 0.0
    for layer in range(layout_of(model).layers):
        for position in range(clean.shape[1]):
            want = _resid_mid_loop(model, corrupted, clean, layer, position, metric)
            got = table[(table.layer == layer) & (table.position == position)].sort_values("sample_index")
            worst = max(worst, float((torch.tensor(got.patched.to_numpy()) - want).abs().max()))
    assert worst <= 1e-5, worst


def test_resid_mid_attribution_is_the_same_with_frozen_or_trainable_parameters(family) -> None:  # type: ignore[no-untyped-def]
    """The estimate is d(metric)/d(stream) through both branches either way; with frozen parameters the first site
    of the forward used to become a leaf that only the MLP's branch read."""
    arch, model, tokenizer = family
    if "resid_mid" not in _stream_sites(model):
        return
    settings = {"sites": ["resid_mid"], "mode": "attribution", "directions": ["denoising"]}
    for p in model.parameters():
        p.requires_grad_(False)
    frozen = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        trainable = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    finally:
        model.zero_grad(set_to_none=True)
    assert (frozen.patched - trainable.patched).abs().max() < 1e-5


def test_the_logit_lens_finds_the_unembedding_of_every_family(family) -> None:  # type: ignore[no-untyped-def]
    """The last layer's lens is the model's own logits (GPT-NeoX's unembedding is `lm_head` in transformers 5,
    `embed_out` before: found through get_output_embeddings())."""
    arch, model, tokenizer = family
    assert unembedding(model) is model.get_output_embeddings()
    table = lm_logit_lens(model, tokenizer, PAIRS[:1])
    last = table[(table.layer == layout_of(model).layers - 1) & (table.position == LAST)]
    ids = torch.tensor([_ids(tokenizer, PAIRS[0]["clean"])])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    assert int(last.top_token_id.iloc[0]) == int(logits.argmax())
    assert abs(float(last.top_prob.iloc[0]) - float(logits.softmax(-1).max())) < 1e-5


def test_an_interrupt_inside_attention_leaves_no_pattern_mode_behind(family) -> None:  # type: ignore[no-untyped-def]
    """KeyboardInterrupt inside an attention module while the pattern site is active: torch's forward hooks with
    always_call see only Exception, so the torch function mode is left by the hook session's close."""
    from runner.hooks import count_hooks

    arch, model, tokenizer = family
    out_proj = dict(model.named_modules())[layout_of(model).module_name(layout_of(model).arch.out_proj, 0)]

    def interrupt(module: nn.Module, args: tuple) -> None:
        raise KeyboardInterrupt

    handle = out_proj.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            lm_activation_patching(model, tokenizer, PAIRS[:1], sites=["pattern"], layers=[0])
    finally:
        handle.remove()
    assert torch._C._len_torch_function_stack() == 0
    assert count_hooks(model) == 0
