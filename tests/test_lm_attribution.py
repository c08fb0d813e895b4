"""Attribution patching of language models (method=lm_patching, mode attribution / attribution_topk) against autograd
references written plainly here (hidden states and module hooks with retain_grad), on random-weight GPT-2 and
grouped-query Llama models; its sign and direction against exact patching of a tiny perturbation; the top-k
re-check against mode=exact; the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.methods.lm_patching import lm_activation_patching
from runner.options.method.lm_patching import LmPatchingConfig, LmPatchingMethodConfig
from tests.conftest import run_cli
from tests.lm_references import _attn, _blocks, _out_proj, build_tiny_lm, logit_diff, n_heads
from tests.test_lm_patching import PAIRS, _ids

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model, tokenizer, folder = build_tiny_lm(request.param, seed=0, folder=tmp_path_factory.mktemp(request.param))
    return request.param, model, tokenizer, folder


def _tensors(tokenizer, pairs: list[dict]) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    clean = torch.tensor([_ids(tokenizer, p["clean"]) for p in pairs])
    corrupted = torch.tensor([_ids(tokenizer, p["corrupted"]) for p in pairs])
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(p["answer"]) for p in pairs])
    distractor = torch.tensor([tokenizer.convert_tokens_to_ids(p["distractor"]) for p in pairs])
    return clean, corrupted, answer, distractor


def _reference_resid_pre(model: nn.Module, receiver: torch.Tensor, source: torch.Tensor, metric) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(L, T, B) metric(receiver) + (h_source - h_receiver) . dM/dh_receiver at each block's input and position,
    from `output_hidden_states` (hidden_states[l] is block l's input) and retain_grad."""
    with torch.no_grad():
        h_source = model(source, output_hidden_states=True).hidden_states
    out = model(receiver, output_hidden_states=True)
    layers = len(_blocks(model))
    hidden = out.hidden_states[:layers]
    for h in hidden:
        h.retain_grad()
    m = metric(out.logits)
    m.sum().backward()
    terms = torch.stack([((h_source[i] - h.detach()) * h.grad).sum(-1) for i, h in enumerate(hidden)])  # (L, B, T)
    model.zero_grad(set_to_none=True)
    return (m.detach()[None, None, :] + terms.transpose(1, 2)).detach()


@contextmanager
def _kept(module: nn.Module, where: str, store: list[torch.Tensor]) -> Iterator[None]:
    """Keep `module`'s input (where="input") or first output, in the graph (retain_grad), in `store`."""

    def pre(mod: nn.Module, args: tuple) -> None:
        args[0].retain_grad() if args[0].requires_grad else None
        store.append(args[0])

    def post(mod: nn.Module, args: tuple, output) -> None:  # type: ignore[no-untyped-def]
        first = output[0] if isinstance(output, tuple) else output
        first.retain_grad() if first.requires_grad else None
        store.append(first)

    handle = module.register_forward_pre_hook(pre) if where == "input" else module.register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


def _reference_module(model: nn.Module, module: nn.Module, where: str, receiver: torch.Tensor, source: torch.Tensor,
                      metric) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]  # fmt: skip
    """metric(receiver) (B,) and (a_source - a_receiver) * dM/da_receiver (B, T, D) at one module's input or output."""
    kept: list[torch.Tensor] = []
    with _kept(module, where, kept), torch.no_grad():
        model(source)
    a_source = kept.pop().detach()
    with _kept(module, where, kept):
        m = metric(model(receiver).logits)
    m.sum().backward()
    a = kept.pop()
    product = (a_source - a.detach()) * a.grad
    model.zero_grad(set_to_none=True)
    return m.detach(), product


@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_resid_pre_estimates_equal_an_autograd_reference(tiny, direction: str) -> None:  # type: ignore[no-untyped-def]
    """Every resid_pre estimate (layer x position x pair) equals metric(receiver) + (source - receiver) . gradient
    from hidden states with retain_grad, 1e-5; the same with the weights frozen (as the CLI loads them)."""
    _, model, tokenizer, _ = tiny
    clean, corrupted, answer, distractor = _tensors(tokenizer, PAIRS)
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre"], directions=[direction],
                                   mode="attribution")  # fmt: skip
    assert set(table.patch_method) == {"attribution"} and "rank_correlation" not in table
    receiver, source = (corrupted, clean) if direction == "denoising" else (clean, corrupted)
    want = _reference_resid_pre(model, receiver, source, logit_diff(answer, distractor))
    assert len(table) == want.numel()
    got = torch.tensor(table.patched.to_numpy().copy())
    expected = want[table.layer.to_numpy(), table.position.astype(int).to_numpy(), table.sample_index.to_numpy()]
    worst = float((got - expected).abs().max())
    print(f"worst |estimate - reference| = {worst:.2e}")
    assert worst <= TOLERANCE, worst
    # position 0 is BOS on both sides: nothing to move there
    bos = table[table.position == 0]
    assert (bos.patched - (bos.corrupted if direction == "denoising" else bos.clean)).abs().max() <= TOLERANCE
    model.requires_grad_(False)
    try:
        frozen = lm_activation_patching(model, tokenizer, PAIRS, sites=["resid_pre"], directions=[direction],
                                        mode="attribution")  # fmt: skip
    finally:
        model.requires_grad_(True)
    assert (frozen.patched - table.patched).abs().max() <= 1e-6


def test_attn_out_and_head_estimates_equal_an_autograd_reference(tiny) -> None:  # type: ignore[no-untyped-def]
    """attn_out (per position) and head (all positions, and each position) estimates equal a plain hook reference
    on the attention's output and the output projection's input, both layers, 1e-5."""
    _, model, tokenizer, _ = tiny
    clean, corrupted, answer, distractor = _tensors(tokenizer, PAIRS)
    metric = logit_diff(answer, distractor)
    heads = n_heads(model)
    table = lm_activation_patching(model, tokenizer, PAIRS, sites=["attn_out", "head"], mode="attribution")
    each = lm_activation_patching(model, tokenizer, PAIRS, sites=["head"], mode="attribution", head_positions="each")
    checked = 0
    for layer, block in enumerate(_blocks(model)):
        m, product = _reference_module(model, _attn(block), "output", corrupted, clean, metric)
        rows = table[(table.site == "attn_out") & (table.layer == layer)]
        want = m[rows.sample_index.to_numpy()] + product.sum(-1)[rows.sample_index.to_numpy(),
                                                                 rows.position.astype(int).to_numpy()]  # fmt: skip
        assert float((torch.tensor(rows.patched.to_numpy().copy()) - want).abs().max()) <= TOLERANCE
        m, product = _reference_module(model, _out_proj(block), "input", corrupted, clean, metric)
        per_head = product.unflatten(-1, (heads, -1)).sum(-1)  # (B, T, H)
        rows = table[(table.site == "head") & (table.layer == layer)]
        assert rows.position.isna().all() and len(rows) == heads * len(PAIRS)
        want = m[rows.sample_index.to_numpy()] + per_head.sum(1)[rows.sample_index.to_numpy(),
                                                                 rows["head"].astype(int).to_numpy()]  # fmt: skip
        assert float((torch.tensor(rows.patched.to_numpy().copy()) - want).abs().max()) <= TOLERANCE
        rows = each[each.layer == layer]
        b, p, h = (rows[c].astype(int).to_numpy() for c in ("sample_index", "position", "head"))
        assert float((torch.tensor(rows.patched.to_numpy().copy()) - (m[b] + per_head[b, p, h])).abs().max()) <= 1e-5
        checked += 1
    assert checked == 2


@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_estimates_match_exact_patching_of_a_tiny_perturbation(tiny, direction: str) -> None:  # type: ignore[no-untyped-def]
    """Noise of 0.001 embedding standard deviations: each exact effect is first order, so the estimated effects
    equal the exact ones within 2% of the largest; a swapped sign (receiver - source) or direction (the other run's
    metric and gradient) would be off by twice the effect."""
    _, model, tokenizer, _ = tiny
    settings = {"sites": ["resid_pre", "attn_out", "mlp_out", "head"], "directions": [direction],
                "corruption": {"kind": "noise", "std": 0.001}, "min_span": 0.0}  # fmt: skip
    estimated = lm_activation_patching(model, tokenizer, PAIRS, mode="attribution", **settings)
    exact = lm_activation_patching(model, tokenizer, PAIRS, **settings)
    key = ["direction", "site", "layer", "head", "position", "sample_index"]
    both = estimated.merge(exact, on=key, suffixes=("_est", "_exact"))
    assert len(both) == len(exact) == len(estimated)
    base = both.corrupted_exact if direction == "denoising" else both.clean_exact
    effect_est, effect_exact = both.patched_est - base, both.patched_exact - base
    scale = float(effect_exact.abs().max())
    assert scale > 1e-4  # the perturbation moves the metric
    worst = float((effect_est - effect_exact).abs().max())
    print(f"{direction}: largest exact effect {scale:.3g}, worst |estimated - exact| {worst:.3g}")
    assert worst <= 0.02 * scale, (worst, scale)


def test_topk_rows_equal_exact_mode_and_carry_the_rank_correlation(tiny) -> None:  # type: ignore[no-untyped-def]
    """attribution_topk: per (pair, direction, site) the top_k cells by estimated move toward the source run's metric, patched exactly, equal mode=exact's
    rows for those cells (within 4e-6: float32 rounding of other batch makeups and prefix lengths, on values about 2);
    rank_correlation in [-1, 1] on them, NaN on the estimates' rows and for a self
    pair."""
    _, model, tokenizer, _ = tiny
    pairs = [*PAIRS, {**PAIRS[0], "corrupted": PAIRS[0]["clean"]}]  # the last one is a self pair
    settings = {"sites": ["resid_pre", "mlp_out", "head"], "directions": ["denoising", "noising"]}
    topk = lm_activation_patching(model, tokenizer, pairs, mode="attribution_topk", top_k=3, **settings)
    exact = lm_activation_patching(model, tokenizer, pairs, **settings)
    estimates = topk[topk.patch_method == "attribution"]
    checked = topk[topk.patch_method == "exact"]
    assert estimates.rank_correlation.isna().all()
    assert len(estimates) == len(exact)
    key = ["direction", "site", "layer", "head", "position", "sample_index"]
    for (direction, site, sample), group in checked.groupby(["direction", "site", "sample_index"]):
        assert len(group) == 3
        mine = estimates[(estimates.direction == direction) & (estimates.site == site)
                         & (estimates.sample_index == sample)]  # fmt: skip
        # the cells estimated to move the metric furthest toward the source run's (noising: usually down)
        receiver, source = (mine.corrupted, mine.clean) if direction == "denoising" else (mine.clean, mine.corrupted)
        sign = (source - receiver).apply(lambda x: (x > 0) - (x < 0))
        toward = ((mine.patched - receiver) * sign).where(sign != 0, (mine.patched - receiver).abs())
        top = mine.assign(toward=toward).nlargest(3, "toward")
        assert set(map(tuple, group[key].astype(str).to_numpy())) == set(map(tuple, top[key].astype(str).to_numpy()))
    both = checked.merge(exact, on=key, suffixes=("", "_exact"))
    assert len(both) == len(checked)
    # the same engine on the same cells; only the variants stacked beside them differ (a pair's own cells here, every
    # pair's there), which moves a float32 matmul's last bit at most
    assert (both.patched - both.patched_exact).abs().max() <= 4e-6
    assert ((both.restoration - both.restoration_exact).abs() <= 4e-6).sum() == both.restoration_exact.notna().sum()
    self_pair = checked.sample_index == len(PAIRS)
    assert checked[self_pair].rank_correlation.isna().all()
    rho = checked[~self_pair].rank_correlation
    assert rho.notna().all() and rho.between(-1, 1).all()
    assert rho.groupby([checked.direction, checked.site, checked.sample_index]).nunique().eq(1).all()


def test_padding_positions_get_no_estimate(tiny) -> None:  # type: ignore[no-untyped-def]
    """A shorter pair left-padded beside a longer one: no rows at its padding, and each estimate equals the pair's
    estimate run alone, 1e-5."""
    _, model, tokenizer, _ = tiny
    pairs = [PAIRS[0], {"clean": "t11 t12 t13 t11 t12", "corrupted": "t15 t16 t17 t11 t12", "answer": "t13",
                        "distractor": "t17"}]  # fmt: skip
    settings = {"sites": ["resid_pre", "head"], "mode": "attribution_topk", "top_k": 2}
    together = lm_activation_patching(model, tokenizer, pairs, **settings)
    for i, pair in enumerate(pairs):
        alone = lm_activation_patching(model, tokenizer, [pair], **settings)
        mine = together[together.sample_index == i].reset_index(drop=True)
        assert mine[["patch_method", "site", "layer", "head", "position"]].equals(
            alone[["patch_method", "site", "layer", "head", "position"]]
        )
        assert (mine.patched - alone.patched).abs().max() <= TOLERANCE
    short = together[(together.sample_index == 1) & (together.site == "resid_pre")]
    assert short.position.max() == 5 and len(short[short.patch_method == "attribution"]) == 2 * 6


def test_top_k_is_checked() -> None:
    bad = LmPatchingMethodConfig(patching=LmPatchingConfig(top_k=0)).check()
    assert "method.patching.top_k=0" in bad


@pytest.mark.slow
def test_cli_writes_patch_method_and_rank_correlation(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, _, folder = tiny
    file = tmp_path / "pairs.jsonl"
    file.write_text("\n".join(json.dumps(p) for p in PAIRS))
    done = run_cli("model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={file}", "method=lm_patching",
                   "target=token_logit_diff", "debug=tiny", "method.patching.mode=attribution_topk",
                   "method.patching.top_k=2", "method.patching.sites=[resid_pre,head]",
                   f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    from runner.results import load

    table = load(tmp_path / "run")
    assert set(table.patch_method) == {"attribution", "exact"}
    exact = table[table.patch_method == "exact"]
    assert len(exact) == 2 * 2 * len(set(table.sample_id))  # top 2 per (pair, site)
    assert exact.rank_correlation.between(-1, 1).all()  # NaN is not between
    assert table[table.patch_method == "attribution"].rank_correlation.isna().all()
    refused = run_cli("model=hf_lm", f"model.name={folder}", "data=prompts", f"data.file={file}",
                      "method=lm_patching", "method.patching.top_k=0", f"hydra.run.dir={tmp_path / 'bad'}")  # fmt: skip
    assert refused.returncode == 2 and "method.patching.top_k=0" in refused.stderr
    assert "Traceback" not in refused.stderr
