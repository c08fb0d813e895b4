"""Named sites of every supported decoder family (runner/models/lm_sites.py), checked the same way on each, on a
random 2-layer model with eager attention (tests/lm_references.py FAMILIES; an adapter without one fails here):
every site in both directions, per-head sites at all positions and at each, equals a plain one-forward-per-cell loop
that reads the family's modules directly (lm_references.PARTS), and so do grad x activation and attribution patching's
estimates against plain autograd on those modules; clean patched into clean is flagged degenerate; the
answer-only readout and the logit lens equal the model's own logits (final softcap included); the noise corruption
is scaled as what the first block receives. The residual stream at the last layer's last position is all that
reaches the logits, so patching it restores exactly (resid_mid and resid_post); resid_mid's attribution estimate is
the same intervention's whether the parameters are frozen or not; the unembedding is found through
get_output_embeddings()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runner.errors import RunnerError
from runner.methods.lm_patching import lm_activation_patching
from runner.methods.lm_saliency import lm_grad_x_act, lm_logit_lens
from runner.models import lm_sites
from runner.models.lm_sites import layout_of, unembedding
from tests.lm_references import (
    ALL_SITES,
    FAMILIES,
    HEAD_SITES,
    PARTS,
    build_tiny_lm,
    capture_all,
    cell_sum,
    gradients_all,
    kv_heads,
    logit_diff,
    model_type,
    n_heads,
    patched_metric,
    patched_metrics,
)
from tests.test_lm_patching import PAIRS, _ids, full_vocabulary_readout

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
    assert ("resid_mid" in sites) == PARTS[arch].sequential  # parallel attention and MLP: no resid_mid
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=sites, directions=["denoising", "noising"])
    last = table[(table.layer == layout_of(model).layers - 1) & (table.position == LAST)]
    assert len(last) == len(sites) * 2 * len(PAIRS)
    assert not last.degenerate.any() and last.restoration.notna().all()
    denoise, noise = last[last.direction == "denoising"], last[last.direction == "noising"]
    assert (denoise.restoration - 1).abs().max() < 1e-4, denoise[["site", "restoration"]]
    assert (denoise.patched - denoise.clean).abs().max() < 1e-4
    assert (noise.patched - noise.corrupted).abs().max() < 1e-4, noise[["site", "patched", "corrupted"]]


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


# ------------------------------------------------------------------------------------ every family's adapter


def test_every_adapter_has_a_tiny_model_and_a_plain_loop() -> None:
    """A model_type given an adapter without a tiny config here (and so without the checks of this module) fails."""
    built = {model_type(arch) for arch in FAMILIES}
    assert set(lm_sites.FAMILIES) <= built, sorted(set(lm_sites.FAMILIES) - built)
    assert set(lm_sites.FAMILIES.values()) == set(lm_sites.ARCHITECTURES)  # every adapter is some model_type's
    assert set(PARTS) == set(FAMILIES)


def test_a_model_type_without_an_adapter_is_refused_naming_those_that_exist() -> None:
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16))
    with pytest.raises(RunnerError, match="No site adapter for model_type 'bert'") as info:
        layout_of(model)
    assert "gemma2" in str(info.value) and "layers.include" not in str(info.value)


def _tokens(tokenizer: Any, pairs: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    clean = torch.tensor([_ids(tokenizer, p["clean"]) for p in pairs])
    corrupted = torch.tensor([_ids(tokenizer, p["corrupted"]) for p in pairs])
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(p["answer"]) for p in pairs])
    distractor = torch.tensor([tokenizer.convert_tokens_to_ids(p["distractor"]) for p in pairs])
    return clean, corrupted, logit_diff(answer, distractor)


def _worst_against_the_loop(arch: str, model: nn.Module, tokenizer: Any, direction: str,
                            only: tuple[str, ...] = ALL_SITES) -> tuple[float, int]:  # fmt: skip
    """The largest |runner - plain loop| over every row of every site of the family (per-head sites at all positions
    and at each), and how many rows were compared."""
    sites = [s for s in only if s in layout_of(model).available()]
    clean, corrupted, metric = _tokens(tokenizer, PAIRS)
    source, receiver = (clean, corrupted) if direction == "denoising" else (corrupted, clean)
    worst, compared = 0.0, 0
    for head_positions in ("all", "each"):
        asked = sites if head_positions == "all" else [s for s in sites if s in HEAD_SITES]
        if not asked:
            continue
        table = lm_activation_patching(model, tokenizer, PAIRS, sites=asked, directions=[direction],
                                       head_positions=head_positions)  # fmt: skip
        for site in asked:
            sources = capture_all(model, arch, source, site)
            rows = table[table.site == site]
            per_head = site in HEAD_SITES
            for layer, at_layer in rows.groupby("layer"):
                cells = list(at_layer.groupby(["head", "position"], dropna=False))
                wants = patched_metrics(
                    model, arch, receiver, site, int(layer), sources[int(layer)],
                    [(None if p != p else int(p), int(h) if per_head else None) for (h, p), _ in cells], metric,
                )  # fmt: skip
                for (_, cell), want in zip(cells, wants, strict=True):
                    got = torch.tensor(cell.sort_values("sample_index").patched.to_numpy().copy())
                    assert len(got) == len(PAIRS)
                    worst = max(worst, float((got - want).abs().max()))
                    compared += len(got)
    return worst, compared


def test_the_batched_loop_equals_one_forward_per_cell(family) -> None:  # type: ignore[no-untyped-def]
    """The plain loop below patches every cell of a site and layer in one forward of as many copies of the pairs
    (lm_references.patched_metrics); each copy's metric equals that cell's own forward (patched_metric), for
    every kind of cell: a position, every position, a head at a position, a head at every position (1e-5: a batch
    of another size rounds differently, 1.4e-6 on qwen2_moe)."""
    arch, model, tokenizer = family
    clean, corrupted, metric = _tokens(tokenizer, PAIRS)
    sites = [s for s in ("resid_pre", "mlp_out", "head", "k", "pattern") if s in layout_of(model).available()]
    for site in sites:
        per_head, heads = site in HEAD_SITES, kv_heads(model) if site in ("k", "v") else n_heads(model)
        cells = [(LAST, None), (None, None), (1, None)]
        if per_head:
            cells = [(LAST, heads - 1), (None, 0), (2, 0), (None, heads - 1)]
        source = capture_all(model, arch, clean, site)[1]
        batched = patched_metrics(model, arch, corrupted, site, 1, source, cells, metric)
        one_each = torch.stack(
            [patched_metric(model, arch, corrupted, site, 1, source, p, h, metric) for p, h in cells]
        )
        assert batched.shape == (len(cells), len(PAIRS))
        assert (batched - one_each).abs().max() <= 1e-5, (site, batched, one_each)
        assert (one_each - one_each[0]).abs().max() > 1e-4, site  # cells differ: copies patched alike would fail


# The runner and the plain loop run a cell in batches of different sizes. A mixture-of-experts layer multiplies each
# expert's tokens as one matrix whose row count is how many were routed to it, so its rounding moves with the batch
# more than a dense layer's: qwen2_moe's worst gap is 1.1e-5 on a 2-core AVX2 EPYC (metric 2.3, float32), 1.4e-6 on
# an earlier machine. Dense families stay within 1e-5 (2.4e-6 the largest seen); a wrong cell is off by 1e-3 or more.
MIXTURE_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.mark.slow  # a few dozen forwards per family and direction
@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_every_site_equals_the_plain_loop(family, direction: str) -> None:  # type: ignore[no-untyped-def]
    """Every row of every site the family has (resid_mid where it has one; pattern with eager attention), per-head
    sites at all positions and at each, equals one forward per cell with plain hooks: 1e-5, 3e-5 for the
    mixture-of-experts families (MIXTURE_OF_EXPERTS says why)."""
    arch, model, tokenizer = family
    worst, compared = _worst_against_the_loop(arch, model, tokenizer, direction)
    print(f"{arch} {direction}: worst |runner - loop| = {worst:.2e} over {compared} rows")
    assert compared > 0
    assert worst <= (3e-5 if arch in MIXTURE_OF_EXPERTS else 1e-5), worst


def _worst_gradient_gap(arch: str, model: nn.Module, tokenizer: Any, only: tuple[str, ...] = ALL_SITES,
                        attribution: bool = True) -> tuple[float, int]:  # fmt: skip
    """The largest gap, over every row of every site, between plain autograd (lm_references.gradients_all) and
    lm_grad_x_act's values, then lm_patching's attribution estimates in both directions; run with the parameters
    frozen, as a run loads the model (every site's tensor then a leaf, or a tensor read after the embeddings')."""
    sites = [s for s in only if s in layout_of(model).available()]
    clean, corrupted, metric = _tokens(tokenizer, PAIRS)
    model.requires_grad_(False)
    try:
        saliency = lm_grad_x_act(model, tokenizer, PAIRS, sites=sites)
        assert (saliency.value.abs() > 1e-3).any()  # not a comparison of zeros
        directions = ["denoising", "noising"] if attribution else []
        estimates = lm_activation_patching(model, tokenizer, PAIRS, sites=sites, mode="attribution",
                                           directions=directions) if directions else None  # fmt: skip
    finally:
        model.requires_grad_(True)
    batch, worst, compared = len(PAIRS), 0.0, 0

    def gap(rows: Any, column: str, want: torch.Tensor) -> float:
        got = torch.tensor(rows.sort_values("sample_index")[column].to_numpy().copy())
        assert len(got) == batch
        return float((got - want).abs().max())

    for site in sites:
        per_head = site in HEAD_SITES
        taken = {"clean": gradients_all(model, arch, clean, site, metric)}
        runs = {} if estimates is None else {"denoising": (clean, corrupted), "noising": (corrupted, clean)}
        for direction, (source, receiver) in runs.items():
            taken[direction] = gradients_all(model, arch, receiver, site, metric)
            sources = capture_all(model, arch, source, site)
            with torch.no_grad():
                base = metric(model(input_ids=receiver, use_cache=False).logits)
            rows = estimates[(estimates.site == site) & (estimates.direction == direction)]
            for (layer, head, position), cell in rows.groupby(["layer", "head", "position"], dropna=False):
                act, grad = taken[direction][int(layer)]
                terms = (sources[int(layer)] - act) * grad
                want = base + cell_sum(model, arch, site, terms, batch, None if position != position else int(position),
                                       int(head) if per_head else None)  # fmt: skip
                worst, compared = max(worst, gap(cell, "patched", want)), compared + batch
        rows = saliency[saliency.site == site]
        for (layer, head, position), cell in rows.groupby(["layer", "head", "position"], dropna=False):
            act, grad = taken["clean"][int(layer)]
            want = cell_sum(model, arch, site, act * grad, batch, int(position), int(head) if per_head else None)
            worst, compared = max(worst, gap(cell, "value", want)), compared + batch
    return worst, compared


@pytest.mark.slow  # a forward and a backward per site, layer and run
def test_grad_x_act_and_attribution_estimates_equal_plain_autograd(family) -> None:  # type: ignore[no-untyped-def]
    """Every row of lm_grad_x_act and of attribution patching, every site the family has, equals gradient x
    activation from plain autograd on the family's modules, 1e-5: the kept tensors are what the forward read
    (Falcon's parallel blocks change the MLP's output in place after its hook)."""
    arch, model, tokenizer = family
    worst, compared = _worst_gradient_gap(arch, model, tokenizer)
    print(f"{arch}: worst |runner - autograd| = {worst:.2e} over {compared} rows")
    assert compared > 0
    assert worst <= 1e-5, worst


def test_clean_into_clean_is_flagged_degenerate(family) -> None:  # type: ignore[no-untyped-def]
    arch, model, tokenizer = family
    same = [{**p, "corrupted": p["clean"]} for p in PAIRS[:2]]
    table = lm_activation_patching(model, tokenizer, same, sites=["resid_pre", "head"], layers=[0])
    assert len(table) > 0 and table.degenerate.all()
    assert table.restoration.isna().all()


def _readout_gap(model: nn.Module, tokenizer: Any) -> float:
    """The largest |answer-only readout - full-vocabulary readout| over the rows of a patching run."""
    from runner.methods.lm.readout import Readout
    from runner.targets.tokens import TokenLogitDiff

    assert Readout(model, layout_of(model), TokenLogitDiff()).compact
    settings = {"sites": ["resid_pre", "head"], "directions": ["denoising", "noising"]}
    compact = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    with full_vocabulary_readout():
        whole = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    assert len(compact) == len(whole) > 0
    return float(max((compact.patched - whole.patched).abs().max(), (compact.clean - whole.clean).abs().max()))


def test_the_answer_readout_equals_the_full_vocabulary(family) -> None:  # type: ignore[no-untyped-def]
    """The answer-only readout (the answer and distractor columns of the unembedding, then the family's softcap)
    gives the rows of a run that computes the whole vocabulary's logits through the model, 1e-5."""
    arch, model, tokenizer = family
    assert _readout_gap(model, tokenizer) <= 1e-5


def _lens_gap(model: nn.Module, tokenizer: Any) -> float:
    """The largest |lens logit of the last layer - the model's logit| of the answer and the distractor, over every
    position of one prompt."""
    table = lm_logit_lens(model, tokenizer, PAIRS[:1])
    last = table[table.layer == layout_of(model).layers - 1].sort_values("position")
    ids = torch.tensor([_ids(tokenizer, PAIRS[0]["clean"])])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]
    assert len(last) == ids.shape[1]
    gaps = []
    for column, token in (("answer_logit", PAIRS[0]["answer"]), ("distractor_logit", PAIRS[0]["distractor"])):
        lens = torch.tensor(last[column].to_numpy().copy())
        gaps.append(float((lens - logits[:, tokenizer.convert_tokens_to_ids(token)]).abs().max()))
    return max(gaps)


def test_the_logit_lens_of_the_last_layer_is_the_models_logits(family) -> None:  # type: ignore[no-untyped-def]
    """At every position, the answer's and the distractor's lens logits of the last layer are the model's (after
    its final softcap, where it has one)."""
    arch, model, tokenizer = family
    assert _lens_gap(model, tokenizer) <= 1e-5


@pytest.mark.slow
def test_a_gemma2_adapter_missing_one_of_its_differences_fails_these_checks(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2 on Llama's layout plus the embedding scale (its final softcap left out; resid_mid written at the
    attention's own output, before the post-attention norm the block applies): the readout, the lens and the loop
    comparison above each fail, by far more than their tolerance."""
    from dataclasses import replace

    model, tokenizer, _ = build_tiny_lm("gemma2", seed=0, folder=tmp_path_factory.mktemp("gemma2_broken"))
    right = lm_sites.ARCHITECTURES["gemma2"]
    monkeypatch.setitem(lm_sites.ARCHITECTURES, "gemma2", replace(right, logit_softcap=lambda config: None))
    assert _readout_gap(model, tokenizer) > 1e-2
    assert _lens_gap(model, tokenizer) > 1e-2
    monkeypatch.setitem(lm_sites.ARCHITECTURES, "gemma2", replace(right, attn_branch=""))
    worst, _ = _worst_against_the_loop("gemma2", model, tokenizer, "denoising", only=("resid_mid",))
    assert worst > 1e-2


@pytest.mark.slow
def test_a_falcon_adapter_that_forgets_the_in_place_add_fails_these_checks(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Falcon-7B's parallel block adds the attention's output into the MLP's output tensor in place after the MLP's
    hook: the adapter without `mutated` keeps a tensor that changes afterwards (exact patching's sources, grad x
    activation's activations, off by more than 1), and traces a leaf the block then changes (attribution patching
    with frozen parameters: autograd refuses)."""
    from dataclasses import replace

    model, tokenizer, _ = build_tiny_lm("falcon", seed=0, folder=tmp_path_factory.mktemp("falcon_broken"))
    monkeypatch.setitem(
        lm_sites.ARCHITECTURES, "falcon", replace(lm_sites.ARCHITECTURES["falcon"], mutated=lambda config: ())
    )
    worst, _ = _worst_against_the_loop("falcon", model, tokenizer, "denoising", only=("mlp_out",))
    assert worst > 0.5, worst
    worst, _ = _worst_gradient_gap("falcon", model, tokenizer, only=("mlp_out",), attribution=False)
    assert worst > 0.5, worst
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
        _worst_gradient_gap("falcon", model, tokenizer, only=("mlp_out",))


def test_the_noise_is_scaled_as_what_the_first_block_receives(family) -> None:  # type: ignore[no-untyped-def]
    """The noise corruption's std is the std of the embedding module's output over the vocabulary (Gemma's modules
    multiply their rows by sqrt(d_model)), and the embedding module's output is what block 0 receives."""
    from runner.hooks import HookSession
    from runner.methods.lm.corruptions import Corruption
    from runner.options.method.lm_patching import LmCorruptionConfig

    arch, model, tokenizer = family
    layout = layout_of(model)
    modules = dict(model.named_modules())
    embed = modules[layout.arch.embed]
    ids = torch.arange(embed.weight.shape[0])
    with torch.no_grad():
        rows = embed(ids)
    corruption = Corruption(LmCorruptionConfig(kind="noise"))
    with HookSession(model, []) as session:
        corruption.setup(session, model, layout)
    assert abs(corruption.embed_std - float(rows.std())) <= 1e-5 * float(rows.std())
    received: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        received["x"] = args[0] if args else kwargs["hidden_states"]

    handle = modules[layout.module_name("", 0).rstrip(".")].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids[None, :8], use_cache=False)
    finally:
        handle.remove()
    if arch not in ("gpt2", "opt"):  # GPT-2 and OPT add learned position embeddings after the module
        assert (received["x"][0] - rows[:8]).abs().max() <= 1e-6


def test_a_post_norm_opt_is_refused_with_the_reason() -> None:
    """OPT-350m's blocks normalise the stream after each branch (do_layer_norm_before false): no adapter fits it."""
    from transformers import AutoModelForCausalLM

    from tests.lm_references import tiny_config

    config = tiny_config("opt", 24)
    config.do_layer_norm_before = False
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(RunnerError, match="do_layer_norm_before=false"):
        layout_of(model)
