"""runner/metrics: the `evaluation` table in a run, and each metric against Quantus 0.6.0 on the same maps.

Agreement tests feed Quantus and the runner the same maps (each scaled to max 1, as the runner's upsampled
maps are, so Quantus's batch-wide normalisation is the identity) and, for the model-based metrics, the real
embedded EfficientNet-Lite0 at 64 px on two photos. Tolerances are stated where each is asserted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from runner import app
from runner.errors import RunnerError
from runner.metrics import EvaluationConfig, MetricInputs, build_metrics, load_metrics
from runner.metrics import curves as faithfulness
from runner.metrics.faithfulness_family import (
    faithfulness_correlation_values,
    noisy_linear_imputation,
    region_curves,
    road_curves,
)
from runner.runtime import Runtime
from runner.schema import Precision
from runner.stats import upsample
from runner.tables import full_schema
from tests.conftest import make_config
from tests.test_reference import effnet, photos  # noqa: F401 (module-scoped fixtures)

quantus = pytest.importorskip("quantus", reason="the dev extra installs quantus")

CPU = Runtime(torch.device("cpu"), Precision.fp32)
TINY_RUN = [
    "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,16,16]",
    "data.count=6", "data.batch_size=4", "data.num_classes=5", "layers.include=[features.0,features.2]", "hooks=[]",
]  # fmt: skip


def scaled_maps(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """(n, h, w) non-negative maps without ties, each scaled to max 1 (as faithfulness.upsample scales them)."""
    g = torch.Generator().manual_seed(seed)
    maps = torch.rand(n, h, w, generator=g) ** 3
    return maps / maps.flatten(1).amax(dim=1)[:, None, None]


def inputs_for(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> MetricInputs:
    return MetricInputs(model, x, target, torch.arange(x.shape[0]), None, CPU, 0)


# ---- item 1: the table -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_evaluation_table_rows_columns_and_join(tmp_path: Path) -> None:
    result = app.run(make_config(*TINY_RUN, "method.evaluation.metrics=[sparseness,complexity]"), tmp_path / "out")
    evaluation = pd.read_parquet(result.tables["evaluation"])
    cam = pd.read_parquet(result.tables["cam"])
    assert list(evaluation.columns) == full_schema("evaluation").names
    assert len(evaluation) == 6 * 2 * 2  # samples x layers x metrics, one variant each
    key = ["run_id", "sample", "layer", "call", "target_rank"]
    joined = evaluation.merge(cam, on=key, how="left", validate="many_to_one", suffixes=("", "_cam"))
    assert joined["map"].notna().all() and (joined["target"] == joined["target_cam"]).all()
    # Each value is the metric of the cam row's own map, upsampled to the input: the join pairs the right rows.
    metrics = {m.name: m for m in build_metrics(EvaluationConfig(metrics=["sparseness", "complexity"]))}
    for _, row in joined.iterrows():
        small = torch.tensor(row["map"], dtype=torch.float32).reshape(1, int(row["map_height"]), int(row["map_width"]))
        up = upsample(small, (16, 16))
        expected = metrics[row["metric"]].compute(None, up)[""]  # type: ignore[arg-type]  # map statistics only
        assert row["value"] == pytest.approx(float(expected[0]), abs=1e-6)
    assert evaluation["random_value"].notna().all() and (evaluation["random_value"] != evaluation["value"]).any()


@pytest.mark.slow
def test_no_metrics_no_table(tmp_path: Path) -> None:
    result = app.run(make_config(*TINY_RUN), tmp_path / "out")
    assert "evaluation" not in result.tables and "cam" in result.tables


def test_unknown_metric_names_the_nearest() -> None:
    with pytest.raises(RunnerError, match="Unknown metric 'sparsenes'.*sparseness"):
        build_metrics(EvaluationConfig(metrics=["sparsenes"]))
    with pytest.raises(RunnerError, match="region_baseline='white'"):
        build_metrics(EvaluationConfig(metrics=["region_perturbation"], region_baseline="white"))


# ---- item 2: map statistics --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "peer"), [("sparseness", "Sparseness"), ("complexity", "Complexity")])
def test_map_statistics_match_quantus(name: str, peer: str) -> None:
    maps = scaled_maps(5, 24, 24)
    maps[1] = 0
    maps[1, 3, 4] = 1.0  # one pixel: sparseness about 1, complexity 0
    maps[2] = 1.0  # uniform: sparseness 0, complexity log(24 * 24)
    x = np.zeros((5, 3, 24, 24), dtype=np.float32)
    theirs = getattr(quantus, peer)(disable_warnings=True)(
        model=None, x_batch=x, y_batch=np.zeros(5, dtype=int), a_batch=maps[:, None].numpy().copy()
    )
    ours = load_metrics()[name](EvaluationConfig()).compute(None, maps)[""]  # type: ignore[arg-type]
    np.testing.assert_allclose(ours.numpy(), np.asarray(theirs, dtype=np.float64), atol=1e-5, rtol=0)
    # Per map, not per batch: a map's value does not change when the other maps (or its own scale) do.
    alone = load_metrics()[name](EvaluationConfig()).compute(None, maps[3:4] * 0.25)[""]  # type: ignore[arg-type]
    assert float(alone[0]) == pytest.approx(float(ours[3]), abs=1e-6)


# ---- item 3: ROAD -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["direct", "cg"])
@pytest.mark.parametrize("fraction", [0.3, 0.9])
def test_road_imputation_matches_quantus_spsolve(fraction: float, solver: str) -> None:
    """Both solvers (CG to a relative residual of 1e-10 in float64) vs Quantus's direct sparse solve: equal to 1e-6."""
    from quantus.functions.perturb_func import noisy_linear_imputation as peer

    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 20, 20, generator=g)
    removed = torch.rand(2, 20, 20, generator=g) < fraction
    ours, converged = noisy_linear_imputation(x, removed, None, tolerance=1e-10, max_iterations=5000, solver=solver)
    assert converged
    for b in range(2):
        indices = np.flatnonzero(removed[b].numpy())
        theirs = peer(x[b].numpy().astype(np.float64), indices, noise=0.0)
        np.testing.assert_allclose(ours[b].numpy(), theirs, atol=1e-6, rtol=0)
    assert not torch.equal(ours[removed[:, None].expand_as(x)], x[removed[:, None].expand_as(x)])


@pytest.mark.parametrize("percent", [5, 50, 95])
def test_road_direct_equals_cg(percent: int) -> None:
    """The direct solve (SuperLU) and the CG (to 1e-12) give the same imputation to 1e-6 at 48 px, on removed sets
    shaped as ROAD's (the top p% of a smooth map: large connected blobs, image borders included) and scattered."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(3, 3, 48, 48, generator=g)
    yy, xx = torch.meshgrid(torch.arange(48.0), torch.arange(48.0), indexing="ij")
    blob = -((yy - 10) ** 2 + (xx - 40) ** 2)  # (48, 48) highest at a corner-near point
    scores = torch.stack([blob, blob.T, torch.rand(48, 48, generator=g)])  # (3, 48, 48)
    k = int(48 * 48 * percent / 100)
    rank = scores.flatten(1).argsort(dim=1, descending=True).argsort(dim=1)  # (3, D)
    removed = (rank < k).reshape(3, 48, 48)
    direct, ok_direct = noisy_linear_imputation(x, removed, None, solver="direct")
    cg, ok_cg = noisy_linear_imputation(x, removed, None, tolerance=1e-12, max_iterations=5000, solver="cg")
    assert ok_direct and ok_cg
    assert direct.dtype == x.dtype and torch.equal(
        direct[~removed[:, None].expand_as(x)], x[~removed[:, None].expand_as(x)]
    )
    torch.testing.assert_close(direct, cg, atol=1e-6, rtol=0)
    assert (direct - x).abs().amax() > 1e-3  # the removed pixels did change: not two copies of x


def test_road_solver_setting_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """method.evaluation.road_solver picks the imputation: direct on the CPU by default, CG when asked (and, for
    "auto", on an accelerator); an unknown name fails when the metric is built."""
    from runner.metrics import faithfulness_family as ff

    assert ff.road_solver_for("auto", torch.device("cpu")) == "direct"
    assert ff.road_solver_for("auto", torch.device("cuda")) == "cg"
    assert ff.road_solver_for("direct", torch.device("cuda")) == "direct"
    calls: list[str] = []
    direct, harmonic = ff._direct, ff._harmonic
    monkeypatch.setattr(ff, "_direct", lambda *a: calls.append("direct") or direct(*a))
    monkeypatch.setattr(ff, "_harmonic", lambda *a: calls.append("cg") or harmonic(*a))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4)).eval()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    maps = scaled_maps(2, 16, 16)
    results = {}
    for solver in ["auto", "cg", "direct"]:
        calls.clear()
        cfg = EvaluationConfig(metrics=["road"], road_percentages=[50.0], road_noise=0.0, road_solver=solver)
        results[solver] = build_metrics(cfg)[0].compute(inputs_for(model, x, torch.tensor([0, 1])), maps)
        assert set(calls) == {"cg" if solver == "cg" else "direct"}
    for variant in results["auto"]:  # same system, same scores
        torch.testing.assert_close(results["cg"][variant], results["auto"][variant], atol=1e-5, rtol=0)
    with pytest.raises(RunnerError, match="road_solver='lu'"):
        build_metrics(EvaluationConfig(metrics=["road"], road_solver="lu"))


class Gray(torch.nn.Module):
    """A one-channel model: the image repeated into the three channels of the wrapped one."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.expand(-1, 3, -1, -1))  # (B, 1, H, W) -> (B, 3, H, W)


def test_road_matches_quantus_on_effnet(effnet: torch.nn.Module, photos: torch.Tensor) -> None:  # noqa: F811
    """Quantus ROAD (MoRF, noise 0) reports argmax == target per percentage averaged over samples; the runner's
    `morf_accuracy` curve must equal it exactly (0/1 outcomes of the same images; the imputations agree to
    1e-6, far from a decision flip on these photos). On one-channel inputs: Quantus 0.6.0's ROAD indexes a
    one-channel map broadcast over C channels as C*H*W pixels and fails on RGB (IndexError in
    noisy_linear_imputation), so both get the photos in grey through a model that repeats the channel."""
    model = Gray(effnet).eval()
    x = photos.mean(dim=1, keepdim=True)  # (2, 1, 64, 64)
    target = model(x).argmax(dim=1)
    maps = scaled_maps(2, 64, 64, seed=3)
    percentages = [10.0, 30.0, 50.0, 70.0, 90.0]
    cfg = EvaluationConfig(road_percentages=percentages, road_noise=0.0, road_tolerance=1e-8)
    _, correct, converged = road_curves(inputs_for(model, x, target), maps, cfg)
    assert converged
    theirs = quantus.ROAD(percentages=percentages, noise=0.0, disable_warnings=True)(
        model=model, x_batch=x.numpy(), y_batch=target.numpy(), a_batch=maps[:, None].numpy().copy(), device="cpu"
    )
    assert [theirs[p] for p in percentages] == correct[:, 0].mean(dim=0).tolist()
    assert 0 < correct[:, 0].mean() < 1  # the curve moves: the comparison is not of two constant curves


# ---- item 4: faithfulness correlation, region perturbation ---------------------------------------------------------
def test_faithfulness_correlation_matches_quantus(
    effnet: torch.nn.Module,  # noqa: F811
    photos: torch.Tensor,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same subsets (recorded from Quantus's np.random.choice): Pearson equal to 1e-4 (float32 forwards of
    different batch compositions differ by ~1e-6 in the logits)."""
    target = effnet(photos).argmax(dim=1)
    maps = scaled_maps(2, 64, 64, seed=4)
    runs, size = 12, 300
    drawn: list[np.ndarray] = []
    choice = np.random.choice

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = choice(*args, **kwargs)
        drawn.append(out)
        return out

    monkeypatch.setattr(np.random, "choice", recording)
    theirs = quantus.FaithfulnessCorrelation(
        nr_runs=runs, subset_size=size, return_aggregate=False, disable_warnings=True
    )(
        model=effnet, x_batch=photos.numpy(), y_batch=target.numpy(), a_batch=maps[:, None].numpy().copy(),
        device="cpu",
    )  # fmt: skip
    subsets = torch.from_numpy(np.stack(drawn)).reshape(runs, 2, size).transpose(0, 1)  # (N, R, S)
    cfg = EvaluationConfig(faithfulness_correlation_runs=runs, faithfulness_correlation_subset_size=size)
    ours = faithfulness_correlation_values(inputs_for(effnet, photos, target), maps, subsets, cfg)
    np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), atol=1e-4, rtol=0)


def test_region_perturbation_matches_quantus(effnet: torch.nn.Module, photos: torch.Tensor) -> None:  # noqa: F811
    """Quantus RegionPerturbation (MoRF, black baseline, 8 px patches): the same curve to 1e-5 (probabilities
    from float32 forwards of different batch compositions)."""
    maps = scaled_maps(2, 60, 60, seed=5)  # 60 px: Quantus pads to 64, so the padding is compared too
    x = torch.nn.functional.interpolate(photos, size=(60, 60), mode="bilinear")
    target = effnet(x).argmax(dim=1)
    steps = 10
    theirs = quantus.RegionPerturbation(patch_size=8, regions_evaluation=steps, disable_warnings=True)(
        model=effnet, x_batch=x.numpy(), y_batch=target.numpy(), a_batch=maps[:, None].numpy().copy(), device="cpu"
    )
    cfg = EvaluationConfig(region_size=8, region_steps=steps)
    ours = region_curves(inputs_for(effnet, x, target), maps, cfg)
    np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), atol=1e-5, rtol=0)


# ---- degenerate maps: NaN and flagged ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_constant_layer_map_is_nan_and_flagged_in_the_evaluation_table(tmp_path: Path) -> None:
    """TinyNet's `pool` outputs 1x1: its map is constant at its own resolution. Every metric of it is NaN and its
    rows are flagged as in the cam table; so is its 1x1 random map's; the conv's maps stay measurements."""
    run = [*TINY_RUN[:-2], "layers.include=[features.2,pool]", "hooks=[]"]
    metrics = "method.evaluation.metrics=[sparseness,complexity,region_perturbation]"
    result = app.run(make_config(*run, metrics, "method.evaluation.region_size=4"), tmp_path / "out")
    evaluation = pd.read_parquet(result.tables["evaluation"])
    cam = pd.read_parquet(result.tables["cam"])
    pool, conv = evaluation[evaluation.layer == "pool"], evaluation[evaluation.layer == "features.2"]
    assert len(pool) == 6 * 3 and pool["degenerate"].all() and pool["value"].isna().all()
    assert pool["random_value"].isna().all()  # its random map is 1x1 too: constant, no order either
    assert not conv["degenerate"].any() and conv["value"].notna().all() and conv["random_value"].notna().all()
    key = ["run_id", "sample", "layer", "call", "target_rank"]
    joined = evaluation.merge(cam, on=key, suffixes=("", "_cam"), validate="many_to_one")
    assert (joined["degenerate"] == joined["degenerate_cam"]).all()


def test_road_orders_tied_pixels_by_the_seeded_tie_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A map of one salient pixel and 255 tied zeros: ROAD removed the top rows first (pixel order). It follows
    faithfulness's order: saliency, then `tie_keys` (seed, sample index), whatever the batch."""
    import runner.metrics.faithfulness_family as ff

    removed: list[torch.Tensor] = []
    impute = ff.noisy_linear_imputation
    monkeypatch.setattr(ff, "noisy_linear_imputation", lambda x, r, *a: removed.append(r.clone()) or impute(x, r, *a))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4)).eval()
    maps = torch.zeros(2, 16, 16)
    maps[:, 3, 5] = 1.0
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    cfg = EvaluationConfig(road_percentages=[50.0], road_noise=0.0, seed=3)
    inputs = MetricInputs(model, x, torch.tensor([0, 1]), torch.tensor([7, 9]), None, CPU, cfg.seed, chunk=8)
    road_curves(inputs, maps, cfg)
    keys = faithfulness.tie_keys(3, [7, 9], 256, torch.device("cpu"))
    rank = faithfulness.pixel_rank(maps.flatten(1).double(), keys).reshape(2, 16, 16)
    morf, lerf = removed[0][[0, 2]], removed[0][[1, 3]]  # jobs: (sample, order) = (0, MoRF), (0, LeRF), (1, ...)
    assert torch.equal(morf, rank < 128) and torch.equal(lerf, rank >= 128)
    assert morf[:, 3, 5].all() and not lerf[:, 3, 5].any()
    assert (
        morf[:, :8].sum(dim=(1, 2)) < 0.75 * 128
    ).all()  # not the top half of the image (by position: all 128 there)
    removed.clear()
    alone = MetricInputs(model, x[1:], torch.tensor([1]), torch.tensor([9]), None, CPU, cfg.seed, chunk=8)
    road_curves(alone, maps[1:], cfg)
    assert torch.equal(removed[0][0], morf[1])  # keyed by the sample, not its place in the batch


def test_region_perturbation_orders_patches_in_float64_and_ties_by_the_seeded_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Patch A holds 1 + 63 * 1e-8, patch B 1 + 5e-7: A is the larger, but float32 average pooling rounds A to 1.0
    and put B first. Equal patches follow `tie_keys`, not their position."""
    import runner.metrics.faithfulness_family as ff

    seen: list[torch.Tensor] = []
    logits = ff._logits
    monkeypatch.setattr(ff, "_logits", lambda m, images, *a: seen.append(images.clone()) or logits(m, images, *a))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 16, 2)).eval()
    a = torch.full((8, 8), 1e-8)
    a[0, 0] = 1.0
    b = torch.zeros(8, 8)
    b[0, 0], b[0, 1] = 1.0, 5e-7
    maps = torch.cat([b, a], dim=1)[None]  # (1, 8, 16): B left, A right
    x = torch.rand(1, 3, 8, 16, generator=torch.Generator().manual_seed(1)) + 1  # the baseline (min) is below
    cfg = EvaluationConfig(region_size=8, region_steps=1)
    region_curves(MetricInputs(model, x, torch.tensor([0]), torch.tensor([0]), None, CPU, 0, chunk=8), maps, cfg)
    gone = seen[1][0, 0] != x[0, 0]  # (8, 16) the pixels replaced at step 1
    assert gone[:, 8:].all() and not gone[:, :8].any()  # A, the larger sum
    # Ties: 4 equal patches (a constant map) come in each sample's own seeded order.
    firsts = set()
    for index in range(8):
        seen.clear()
        inputs = MetricInputs(model, x, torch.tensor([0]), torch.tensor([index]), None, CPU, 0, chunk=8)
        region_curves(inputs, torch.ones(1, 8, 16), cfg)
        firsts.add(int((seen[1][0, 0] != x[0, 0])[:, 8:].all()))
        keys = faithfulness.tie_keys(0, [index], 2, torch.device("cpu"))
        assert bool((seen[1][0, 0] != x[0, 0])[:, 8:].all()) == (int(keys[0].argmin()) == 1)
    assert firsts == {0, 1}  # by position the left patch always went first
