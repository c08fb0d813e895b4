"""Activation patching: identities with known answers, batched + prefix-reusing == the plain loop,
attribution == exact where the model is linear after the patched layer, and the experiments."""

from __future__ import annotations

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
from runner.methods import Runtime, build_method
from runner.methods.patching import (
    CorruptionConfig,
    CorruptionKind,
    PatchDirection,
    PatchingConfig,
    PatchingMethodConfig,
    PatchMode,
    PatchUnit,
)
from runner.methods.patching.corruption import NOISE_PURPOSE
from runner.randomness import per_sample_normal
from runner.schema import Precision
from tests.conftest import TinyNet, frozen, make_config

CPU = Runtime(torch.device("cpu"), Precision.fp32)


def patch(model: nn.Module, x: torch.Tensor, layers: list[str], **patching: object) -> dict:
    cfg = PatchingMethodConfig(patching=PatchingConfig(**patching))
    method = build_method(cfg, resolve_layers(model, layers), CPU)
    batch = Batch(x, torch.full((x.shape[0],), -1), [f"s{i}" for i in range(x.shape[0])], 0)
    with HookSession(model, []) as session:
        method.setup(session, x.shape[0])
        session.begin_batch(x.shape[0], 0)
        return method.run_batch(model, batch, session).tables["patching"]


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


def test_cells_need_spatial_layers() -> None:
    with pytest.raises(RunnerError, match="units=cell needs spatial outputs"):
        patch(frozen(TinyNet()), torch.randn(1, 3, 8, 8), ["fc"], units=PatchUnit.cell)


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


def test_pair_with_another_photo(tmp_path: Path) -> None:
    config = make_config(
        "experiment=patching_effnet", "data.photos=[chelsea,coffee]", "data.image_size=64", "data.batch_size=1",
        "method.patching.corruption={kind: pair, pair_with: coffee}", "method.patching.units=layer",
    )  # fmt: skip
    frame = pd.read_parquet(app.run(config, tmp_path).tables["patching"])
    chelsea = frame[frame.sample_id == "chelsea"]
    assert (chelsea["corrupted_id"] == "coffee").all()
    assert (chelsea["restoration"] - 1).abs().max() < 1e-4  # the whole layer output restores everything


def test_pair_with_unknown_sample() -> None:
    with pytest.raises(RunnerError, match="'coffe' is not a sample"):
        app.run(
            make_config("experiment=patching_effnet", "method.patching.corruption={kind: pair, pair_with: coffe}"),
            "/tmp/unused-out",
        )
