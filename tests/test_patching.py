"""Activation patching: identities with known answers, batched + prefix-reusing == the plain loop,
attribution == exact where the model is linear after the patched layer, and the experiments."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pytest
import torch
import torchvision
from torch import nn

import runner.app as app
from runner.data.base import Batch
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import build_method
from runner.methods.patching import (
    CorruptionConfig,
    CorruptionKind,
    PatchDirection,
    PatchingConfig,
    PatchingMethodConfig,
    PatchMetric,
    PatchMode,
    PatchUnit,
    enumerate_units,
)
from runner.methods.patching.cone import Cone
from runner.methods.patching.corruption import NOISE_PURPOSE, corrupt
from runner.randomness import per_sample_normal
from runner.runtime import Runtime
from runner.schema import Precision, TargetMode
from tests.conftest import TinyNet, frozen, make_config

CPU = Runtime(torch.device("cpu"), Precision.fp32)


def patch(
    model: nn.Module, x: torch.Tensor, layers: list[str], method: PatchingMethodConfig | None = None,
    hooks: list | None = None, **p,
) -> dict:  # fmt: skip
    """The patching table's columns for one batch `x` (sample ids s0, s1, ...); `hooks`: the session's user hooks."""
    cfg = method or PatchingMethodConfig()
    cfg.patching = PatchingConfig(**p)
    runner_method = build_method(cfg, resolve_layers(model, layers), CPU)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{i}" for i in range(x.shape[0])], 0)
    with HookSession(model, hooks or []) as session:
        runner_method.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        return runner_method.run_batch(model, batch, session).tables["patching"]


def naive_loop(
    model: nn.Module, layer: str, base_input: torch.Tensor, variants: list[torch.Tensor], target: int
) -> torch.Tensor:
    """One full forward per patched variant, batch of one: what the transformer libraries' helpers do."""
    module = model.get_submodule(layer)
    out = []
    for v in variants:
        handle = module.register_forward_hook(lambda m, a, o, v=v: v)
        try:
            with torch.no_grad():
                out.append(model(base_input)[0, target])
        finally:
            handle.remove()
    return torch.stack(out)


@pytest.fixture(scope="module")
def small_vgg() -> nn.Module:
    torch.manual_seed(0)
    return frozen(torchvision.models.vgg16(weights=None))


@pytest.mark.slow
def test_identity_patch_leaves_logits_unchanged(small_vgg: nn.Module) -> None:
    x = torch.randn(2, 3, 32, 32)
    columns = patch(small_vgg, x, ["features.16", "features.23"], corruption=CorruptionConfig(kind=CorruptionKind.none))
    torch.testing.assert_close(columns["patched"], columns["clean"], rtol=1e-5, atol=1e-5)
    assert len(columns["layer"]) == 2 * (4 * 4 + 2 * 2)  # 8x8 and 4x4 maps: grids capped at the map size


def test_whole_last_feature_layer_restores_exactly_one(small_vgg: nn.Module) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    columns = patch(
        small_vgg,
        x,
        ["features.30"],
        units=PatchUnit.layer,
        directions=[PatchDirection.denoising, PatchDirection.noising],
    )
    assert not torch.allclose(columns["clean"], columns["corrupted"])
    torch.testing.assert_close(columns["restoration"][:2], torch.ones(2), rtol=0, atol=1e-5)  # denoising
    torch.testing.assert_close(
        columns["restoration"][2:], torch.zeros(2), rtol=0, atol=1e-5
    )  # noising: fully corrupted


def test_patching_with_the_corrupted_runs_own_activation_gives_zero(small_vgg: nn.Module) -> None:
    torch.manual_seed(2)
    x = torch.randn(1, 3, 32, 32)
    cfg = PatchingMethodConfig(patching=PatchingConfig(units=PatchUnit.cell))
    method = build_method(cfg, resolve_layers(small_vgg, ["features.16"]), CPU)
    with HookSession(small_vgg, []) as session:
        method.setup(session, 1)
        session.begin_batch(1, 0)
        method.run_batch(small_vgg, Batch(x, torch.tensor([-1]), ["s"], 0), session)  # the corrupted run's metric
        corrupted_x = x + torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            act = small_vgg.features[:17](corrupted_x)[0]
            reference = small_vgg(corrupted_x)[0]
        from runner.methods.patching import enumerate_units

        units = enumerate_units("features.16", tuple(act.shape), PatchUnit.cell, [7, 7], None)
        target = reference.argmax()[None]
        patched = method.patched_metrics(small_vgg, "features.16", corrupted_x, act, act, units, target, target)
    torch.testing.assert_close(patched, reference[target].expand(units.count), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_name", "layer", "units", "local"),
    [
        ("vgg16", "features.4", PatchUnit.cell, True),  # cells carried as cones through VGG's local chain
        ("vgg16", "features.16", PatchUnit.cell, True),
        ("vgg16", "features.16", PatchUnit.cell, False),  # whole variants, prefix at batch 1
        ("resnet18", "layer2.0", PatchUnit.cell, True),  # not a local chain: whole variants; skips broadcast
        ("resnet18", "layer3.1.conv1", PatchUnit.channel, True),
    ],
)
def test_batched_prefix_reusing_equals_the_plain_loop(
    model_name: str, layer: str, units: PatchUnit, local: bool
) -> None:
    torch.manual_seed(3)
    model = frozen(torchvision.models.get_model(model_name, weights=None))
    x = torch.randn(1, 3, 32, 32)
    columns = patch(model, x, [layer], units=units, chunk=5, local_recompute=local)
    corrupted = x + per_sample_normal(x.shape[1:], 0, [0], NOISE_PURPOSE)  # sample 0's noise, seed 0, std 1
    acts = {}
    handle = model.get_submodule(layer).register_forward_hook(
        lambda m, a, o: acts.setdefault(len(acts), o.detach().clone())
    )
    with torch.no_grad():
        model(x), model(corrupted)
    handle.remove()
    clean_act, corrupted_act = acts[0][0], acts[1][0]
    from runner.methods.patching import enumerate_units

    unit_set = enumerate_units(layer, tuple(clean_act.shape), units, [7, 7], None)
    variants = [
        corrupted_act + unit_set.masks(u, u + 1, x.device)[0] * (clean_act - corrupted_act)
        for u in range(unit_set.count)
    ]
    expected = naive_loop(model, layer, corrupted, [v[None] for v in variants], int(columns["target"][0]))
    assert len(columns["patched"]) == unit_set.count
    torch.testing.assert_close(columns["patched"], expected, rtol=1e-4, atol=1e-4)


class LinearAfter(nn.Module):
    """conv -> ReLU -> conv ['mid'] -> flatten -> linear: linear after `mid`, so first order is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.mid = nn.Conv2d(4, 5, 3, padding=1)
        self.head = nn.Linear(5 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.stem(x)).flatten(1))


def test_attribution_equals_exact_when_linear_after_the_layer() -> None:
    torch.manual_seed(5)
    model = frozen(LinearAfter())
    x = torch.randn(2, 3, 6, 6)
    columns = patch(model, x, ["mid"], units=PatchUnit.cell, grid=[3, 3], mode=PatchMode.attribution_topk, top_k=9)
    kind = columns["patch_method"]
    estimate = columns["patched"][[k == "attribution" for k in kind]]
    exact = columns["patched"][[k == "exact" for k in kind]]
    # exact rows come in estimate-rank order: compare unit by unit through the (y, x) identifiers
    est = {
        (columns["sample_index"][i].item(), columns["y"][i], columns["x"][i]): columns["patched"][i]
        for i in range(len(kind))
        if kind[i] == "attribution"
    }
    for i in range(len(kind)):
        if kind[i] == "exact":
            key = (columns["sample_index"][i].item(), columns["y"][i], columns["x"][i])
            torch.testing.assert_close(columns["patched"][i], est[key], rtol=1e-4, atol=1e-4)
    assert len(estimate) == len(exact) == 2 * 9
    ranked = columns["rank_correlation"][[k == "exact" for k in kind]]
    torch.testing.assert_close(ranked, torch.ones_like(ranked), rtol=0, atol=1e-5)


def test_attribution_topk_keeps_the_units_that_move_the_metric_toward_the_source() -> None:
    """Per (sample, direction) the exact rows are the top_k units by estimated move toward the source run's metric:
    denoising up toward clean, noising down toward corrupted (ranked by the largest estimated patched metric,
    noising re-patched the units that change it least)."""
    torch.manual_seed(5)
    model = frozen(LinearAfter())
    x = torch.randn(2, 3, 6, 6)
    columns = patch(model, x, ["mid"], units=PatchUnit.cell, grid=[3, 3], mode=PatchMode.attribution_topk, top_k=3,
                    directions=[PatchDirection.denoising, PatchDirection.noising])  # fmt: skip
    rows = pd.DataFrame({k: (v.tolist() if torch.is_tensor(v) else v) for k, v in columns.items()})
    for (sample, direction), group in rows.groupby(["sample_index", "direction"]):
        estimates = group[group.patch_method == "attribution"]
        receiver, source = ("corrupted", "clean") if direction == "denoising" else ("clean", "corrupted")
        sign = 1.0 if float(estimates[source].iloc[0]) > float(estimates[receiver].iloc[0]) else -1.0
        toward = (estimates.patched - estimates[receiver]) * sign
        want = set(zip(estimates.y[toward.nlargest(3).index], estimates.x[toward.nlargest(3).index], strict=True))
        exact = group[group.patch_method == "exact"]
        assert set(zip(exact.y, exact.x, strict=True)) == want, (sample, direction)
        assert toward.nlargest(3).min() > toward.median()  # a real order, not ties


def test_cells_need_spatial_layers() -> None:
    with pytest.raises(RunnerError, match="units=cell needs spatial outputs"):
        patch(frozen(TinyNet()), torch.randn(1, 3, 8, 8), ["fc"], units=PatchUnit.cell)


@pytest.mark.slow
def test_patching_effnet_experiment_writes_table_and_heatmap(tmp_path: Path) -> None:
    config = make_config("experiment=patching_effnet", "data.image_size=96", "method.pictures=true")
    result = app.run(config, tmp_path)
    frame = pd.read_parquet(result.tables["patching"])
    assert (frame["sample_id"] == "chelsea").all() and (frame["direction"] == "denoising").all()
    per_layer = frame.groupby("layer", sort=False).agg(
        rows=("y", "size"), gh=("grid_h", "first"), gw=("grid_w", "first")
    )
    assert per_layer.index.tolist() == ["_blocks.2", "_blocks.5", "_blocks.10", "_blocks.15", "_conv_head"]
    assert (per_layer.rows == per_layer.gh * per_layer.gw).all()  # one row per cell, grids capped at the map size
    assert per_layer.gh.tolist() == [7, 6, 6, 3, 3]  # 96 px input: maps of 24, 6, 6, 3, 3 ... capped at 7
    assert {"channel", "y", "x", "token", "clean", "corrupted", "patched", "restoration"} <= set(frame.columns)
    assert (frame["clean"] > frame["corrupted"]).all()  # noise hurts the cat's logit
    assert list((tmp_path / "pictures").glob("*patching_denoising.png"))


@pytest.mark.slow
def test_pair_with_another_photo(tmp_path: Path) -> None:
    config = make_config(
        "experiment=patching_effnet", "data.photos=[chelsea,coffee]", "data.image_size=64", "data.batch_size=1",
        "method.patching.corruption={kind: pair, pair_with: coffee}", "method.patching.units=layer",
    )  # fmt: skip
    frame = pd.read_parquet(app.run(config, tmp_path).tables["patching"])
    chelsea = frame[frame.sample_id == "chelsea"]
    assert (chelsea["corrupted_id"] == "coffee").all()
    assert (chelsea["restoration"] - 1).abs().max() < 1e-4  # the whole layer output restores everything


@pytest.mark.slow
def test_pair_with_unknown_sample(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="'coffe' is not a sample"):
        app.run(
            make_config("experiment=patching_effnet", "method.patching.corruption={kind: pair, pair_with: coffe}"),
            tmp_path,
        )


# ---- the cone (local recomputation) and nn.Sequential subclasses -----------------------------------------------------
class Residual(nn.Sequential):
    """A Sequential whose forward is not the chain of its children: x + chain(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


class BlockNet(nn.Module):
    """stem -> block (Residual or plain Sequential of conv, ReLU, conv) -> pool -> linear."""

    def __init__(self, block: type[nn.Sequential]) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = block(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean(dim=(2, 3)))


def test_a_user_hook_that_changes_a_module_of_the_chain_turns_the_cone_off() -> None:
    """The cone computes the chain with its modules' arithmetic, not their calls: a hook halving block.2's output
    (after the patched block.0) would be skipped. With it, the cone is not used: local_recompute on = off."""
    from runner.hooks.spec_hooks import BoundHook
    from runner.schema import HookAction, HookKind, HookSpec

    torch.manual_seed(0)
    model = frozen(BlockNet(nn.Sequential))
    x = torch.randn(1, 3, 12, 12)
    spec = HookSpec(kind=HookKind.forward, action=HookAction.scale, factor=0.5)
    hooks = [BoundHook(spec, resolve_layers(model, ["block.2"]))]
    settings = {"units": PatchUnit.cell, "grid": [4, 4], "chunk": 5}
    on = patch(model, x, ["block.0"], hooks=hooks, local_recompute=True, **settings)
    off = patch(model, x, ["block.0"], hooks=hooks, local_recompute=False, **settings)
    unhooked = patch(model, x, ["block.0"], local_recompute=True, **settings)
    torch.testing.assert_close(on["patched"], off["patched"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(on["patched"], unhooked["patched"], atol=1e-4)  # the hook changes the metric


@pytest.mark.parametrize("block", [Residual, nn.Sequential])
def test_cone_on_equals_cone_off_equals_the_plain_loop(block: type[nn.Sequential]) -> None:
    torch.manual_seed(0)
    model = frozen(BlockNet(block))
    # The cone is used for the plain chain and refused for the subclass (its forward adds x).
    assert (Cone.find(model, "block.0") is None) == (block is Residual)
    x = torch.randn(1, 3, 12, 12)
    on = patch(model, x, ["block.0"], units=PatchUnit.cell, grid=[4, 4], chunk=5, local_recompute=True)
    off = patch(model, x, ["block.0"], units=PatchUnit.cell, grid=[4, 4], chunk=5, local_recompute=False)
    corrupted = x + per_sample_normal(x.shape[1:], 0, [0], NOISE_PURPOSE)  # the runner's noise for sample 0
    acts = []
    handle = model.block[0].register_forward_hook(lambda m, a, o: acts.append(o.detach().clone()))
    with torch.no_grad():
        model(x), model(corrupted)
    handle.remove()
    clean_act, corrupted_act = acts[0][0], acts[1][0]
    units = enumerate_units("block.0", tuple(clean_act.shape), PatchUnit.cell, [4, 4], None)
    variants = [
        (corrupted_act + units.masks(u, u + 1, x.device)[0] * (clean_act - corrupted_act))[None]
        for u in range(units.count)
    ]  # each (1, 8, 12, 12)
    expected = naive_loop(model, "block.0", corrupted, variants, int(on["target"][0]))  # (16,)
    # fp32, the same ops on the same values in another batch layout: agreement to float rounding.
    torch.testing.assert_close(on["patched"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off["patched"], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, expected[0].expand_as(expected))  # cells differ: the check has teeth


class Doubling(nn.ReLU):
    """An element-wise op whose subclass changes what it computes: the cone must not read its geometry."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_cone_refuses_chains_it_cannot_read() -> None:
    plain = frozen(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)))
    wrapper = nn.Module()
    wrapper.chain = plain
    assert Cone.find(wrapper, "chain.0") is not None
    plain[1] = Doubling().eval()  # an overridden forward further down the chain
    assert Cone.find(wrapper, "chain.0") is None
    plain[1] = nn.Dropout().train()  # a layer in training mode draws at random
    assert Cone.find(wrapper, "chain.0") is None


# ---- bf16 through the cone -------------------------------------------------------------------------------------------
VGG_TINY = ["model=vgg16", "model.weights=null", "data=synthetic", "data.count=2", "data.shape=[3,32,32]",
            "data.batch_size=2", "layers.include=[features.2]", "method=patching", "method.patching.grid=[2,2]", "method.target=fixed", "method.class_ids=[1]",
            "method.pictures=false", "progress=false", "hooks=[]"]  # fmt: skip


@pytest.mark.slow
def test_bf16_cell_patching_through_the_cone_runs_and_matches_fp32(tmp_path: Path) -> None:
    """The cone recomputation (VGG's chain of local ops) runs under autocast as the forward does: bf16 used to
    fail with "Input type (c10::BFloat16) and bias type (float)"."""
    tables = {}
    for precision in ("fp32", "bf16"):
        result = app.run(make_config(*VGG_TINY, f"precision={precision}"), tmp_path / precision)
        tables[precision] = pd.read_parquet(result.tables["patching"]).sort_values(["sample", "y", "x"])
    fp32, bf16 = tables["fp32"], tables["bf16"]
    assert len(bf16) == len(fp32) == 2 * 4
    assert (bf16["target"].to_numpy() == 1).all()
    scale = fp32["patched"].abs().max()
    assert scale > 0
    assert abs(bf16["patched"].to_numpy() - fp32["patched"].to_numpy()).max() <= 0.05 * scale


# ---- corruption noise keyed per sample -------------------------------------------------------------------------------
def test_a_samples_noise_does_not_depend_on_the_batch_size() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 3, 8, 8)
    cfg = CorruptionConfig(kind=CorruptionKind.noise, std=1.0, seed=7)
    per_batch_size = {}
    for size in (1, 3, 4):
        parts = []
        for start in range(0, 4, size):
            stop = min(start + size, 4)
            batch = Batch(x[start:stop], torch.full((stop - start,), -1), [f"s{i}" for i in range(start, stop)], start)
            parts.append(corrupt(batch, cfg, None)[0])
        per_batch_size[size] = torch.cat(parts)  # (4, 3, 8, 8)
    assert torch.equal(per_batch_size[1], per_batch_size[3]) and torch.equal(per_batch_size[1], per_batch_size[4])
    noise = per_batch_size[4] - x
    assert not torch.allclose(noise[0], noise[1])  # each sample its own noise, not one draw repeated
    other_seed = corrupt(Batch(x, torch.full((4,), -1), list("abcd"), 0), CorruptionConfig(seed=8), None)[0]
    assert not torch.allclose(other_seed, per_batch_size[4])  # the seed still matters


@pytest.mark.slow
def test_patching_run_gives_each_sample_the_same_corruption_at_batch_sizes_1_3_4(tmp_path: Path) -> None:
    corrupted = {}
    for size in (1, 3, 4):
        config = make_config(
            "experiment=patching_effnet", "data.photos=[chelsea,coffee,rocket,astronaut]", "data.image_size=32",
            f"data.batch_size={size}", "layers.include=[_conv_head]", "method.patching.units=layer",
        )  # fmt: skip
        frame = pd.read_parquet(app.run(config, tmp_path / f"b{size}").tables["patching"])
        corrupted[size] = frame.set_index("sample_id")["corrupted"].sort_index()
    # fp32 forwards of the same inputs at other batch sizes: equal to float rounding; noise drawn per
    # batch instead moves a sample's corrupted logit by units (5.119 vs 3.957).
    pd.testing.assert_series_equal(corrupted[1], corrupted[3], rtol=1e-4, atol=1e-4)
    pd.testing.assert_series_equal(corrupted[1], corrupted[4], rtol=1e-4, atol=1e-4)


# ---- degenerate set-ups: a flag, a warning, NaN where undefined; the run still finishes ------------------------------
LOGGER = "runner.methods.patching"


class CornerNet(nn.Module):
    """A 1x1 conv ['conv'] whose top-left pixel alone feeds the linear head: blind to the rest of the image."""

    def __init__(self, zero_head: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(4, 3)
        if zero_head:  # an untrained head (as ViT's zero-initialised one): every logit 0
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x)[:, :, 0, 0])


def _only(columns: dict, reason: str) -> None:
    """Every row is flagged with exactly `reason` and has NaN restoration."""
    assert set(columns["degenerate_reason"]) == {reason}
    assert bool(columns["degenerate"].all())
    assert bool(columns["restoration"].isnan().all())


def test_self_pair_is_flagged_with_nan_restoration(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        columns = patch(
            frozen(CornerNet()), torch.randn(2, 3, 4, 4), ["conv"], units=PatchUnit.cell, grid=[2, 2],
            corruption=CorruptionConfig(kind=CorruptionKind.none),
        )  # fmt: skip
    _only(columns, "self_pair")
    assert torch.isfinite(columns["patched"]).all()  # the measurement itself is still reported
    warnings = [r for r in caplog.records if "self_pair" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()  # one line, once, for both samples


def test_target_equal_to_contrast_is_flagged(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(3)
    method = PatchingMethodConfig(target=TargetMode.fixed, class_ids=[1])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        columns = patch(
            frozen(CornerNet()), torch.randn(1, 3, 4, 4), ["conv"], method, units=PatchUnit.layer,
            metric=PatchMetric.logit_diff, contrast_class=1,
            directions=[PatchDirection.denoising, PatchDirection.noising],
        )  # fmt: skip
    _only(columns, "target_is_contrast")
    assert any("target class 1 is also the contrast class" in r.getMessage() for r in caplog.records)


def test_constant_logits_are_flagged(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        columns = patch(frozen(CornerNet(zero_head=True)), torch.randn(1, 3, 4, 4), ["conv"], units=PatchUnit.layer)
    _only(columns, "constant_logits,zero_span")  # all logits 0: clean == corrupted as well
    assert any("every logit" in r.getMessage() for r in caplog.records)


def test_a_corruption_the_model_cannot_see_gives_zero_span() -> None:
    torch.manual_seed(5)
    occlude_away_from_the_corner = CorruptionConfig(kind=CorruptionKind.occlusion, box=[0.5, 0.5, 1.0, 1.0])
    columns = patch(
        frozen(CornerNet()), torch.randn(1, 3, 4, 4), ["conv"], units=PatchUnit.cell, grid=[2, 2],
        corruption=occlude_away_from_the_corner,
    )  # fmt: skip
    _only(columns, "zero_span")


def test_an_ordinary_pair_is_not_flagged() -> None:
    torch.manual_seed(6)
    columns = patch(frozen(CornerNet()), torch.randn(2, 3, 4, 4), ["conv"], units=PatchUnit.layer)
    assert set(columns["degenerate_reason"]) == {""} and not bool(columns["degenerate"].any())
    torch.testing.assert_close(columns["restoration"], torch.ones(2))  # the whole layer restores everything


def test_a_pair_whose_outputs_barely_differ_is_flagged_small_span(caplog: pytest.LogCaptureFixture) -> None:
    """Noise of std 1e-3 moves the logit by about 1e-3 of its size: below min_span (0.05) the restoration would
    divide by float noise, so it is NaN and flagged; the measurement (`patched`) is still reported."""
    torch.manual_seed(7)
    x = torch.randn(2, 3, 4, 4)
    faint = CorruptionConfig(kind=CorruptionKind.noise, std=1e-3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        columns = patch(frozen(CornerNet()), x, ["conv"], units=PatchUnit.cell, grid=[2, 2], corruption=faint)
    span = (columns["clean"] - columns["corrupted"]).abs()
    assert bool((span < 0.05 * columns["clean"].abs()).all()) and bool((span > 0).all())  # small, not zero
    assert bool(columns["small_span"].all()) and bool(columns["restoration"].isnan().all())
    assert torch.isfinite(columns["patched"]).all()
    assert set(columns["degenerate_reason"]) == {""}  # a weak corruption, not a degenerate set-up
    warnings = [r.getMessage() for r in caplog.records if "min_span" in r.getMessage()]
    assert len(warnings) == 1 and "'s0'" in warnings[0] and "\n" not in warnings[0]
    unflagged = patch(frozen(CornerNet()), x, ["conv"], units=PatchUnit.cell, grid=[2, 2], corruption=faint,
                      min_span=0.0)  # fmt: skip
    assert not bool(unflagged["small_span"].any()) and bool(torch.isfinite(unflagged["restoration"]).all())
    strong = patch(frozen(CornerNet()), x, ["conv"], units=PatchUnit.layer)  # noise of std 1: a real difference
    assert not bool(strong["small_span"].any())
    torch.testing.assert_close(strong["restoration"], torch.ones(2))


def test_min_span_is_checked_at_start_up() -> None:
    with pytest.raises(RunnerError, match=r"method.patching.min_span=-0.1 \(finite, >= 0\)"):
        PatchingMethodConfig(patching=PatchingConfig(min_span=-0.1)).check()


@pytest.mark.slow
def test_a_sample_paired_with_itself_among_others(tmp_path: Path) -> None:
    config = make_config(
        "experiment=patching_effnet", "data.photos=[chelsea,coffee]", "data.image_size=32",
        "method.patching.corruption={kind: pair, pair_with: coffee}", "method.patching.units=layer",
        "layers.include=[_blocks.5]",
    )  # fmt: skip
    frame = pd.read_parquet(app.run(config, tmp_path).tables["patching"]).set_index("sample_id")
    assert frame.loc["coffee", "degenerate_reason"] == "self_pair" and pd.isna(frame.loc["coffee", "restoration"])
    assert frame.loc["chelsea", "degenerate_reason"] == "" and not frame.loc["chelsea", "degenerate"]
    assert abs(frame.loc["chelsea", "restoration"] - 1) < 1e-4


@pytest.mark.parametrize(
    "overrides",
    [  # two runs whose every restoration is NaN, on small inputs (two of VGG's five layers, to keep the test short)
        "experiment=patching_vgg16 model.weights=null data.image_size=32 layers.include=[features.23,features.30]",
        "experiment=patching_effnet method.patching.corruption.kind=none layers.include=[_conv_head]"
        " data.image_size=64",
    ],
)
@pytest.mark.slow
def test_runs_whose_every_restoration_is_nan_finish_with_a_table(tmp_path: Path, overrides: str) -> None:
    result = app.run(make_config(*overrides.split(), "method.pictures=true"), tmp_path)
    frame = pd.read_parquet(result.tables["patching"])
    assert len(frame) and frame["restoration"].isna().all() and frame["degenerate"].all()
    assert list((tmp_path / "pictures").glob("*_patching_*.png"))


# ---- patching values checked at start-up -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.patching.directions=[]", "method.patching.directions=[]"),
        ("method.patching.directions=[noising,noising]", "give each direction at most once"),
        ("method.patching.corruption.std=-1", "corruption.std=-1.0"),
        ("method.patching.corruption.sigma=0", "corruption.sigma=0.0"),
        ("method.patching.corruption.box=[0.5,0.2,0.4,0.9]", "corruption.box=[0.5, 0.2, 0.4, 0.9] must be"),
        ("method.patching.corruption.box=[0,0,1]", "must be [y0, x0, y1, x1]"),
        ("method.patching.corruption.kind=pair", "kind=pair needs corruption.pair_with"),
        ("method.patching.contrast_class=-1", "contrast_class=-1"),
    ],
)
def test_patching_values_are_checked_at_start_up(override: str, message: str) -> None:
    with pytest.raises(RunnerError, match=None) as caught:
        make_config("experiment=patching_effnet", override)
    assert message in str(caught.value)
