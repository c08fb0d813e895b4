"""The GPU path on a real GPU: the same run on CUDA and on the CPU gives the same numbers.

Every test here is marked `gpu` and skips cleanly without CUDA (`make test` on a CPU machine); `make
test-gpu` runs them on a GPU. The embedded pretrained EfficientNet-Lite0 on real scikit-image photos,
64 px, so each run takes seconds. Tolerances: TF32 is switched off for every test (the GPU's
convolutions use other kernels than the CPU's, so values agree to 1e-4 relative, not bit for bit); the draws keyed by sample
(`runner.randomness`) are made on the CPU and so agree exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import runner.app as app
import runner.loop
from runner.hooks import count_hooks
from tests.conftest import make_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on one)"),
]

PHOTOS = "data.photos=[chelsea,coffee,rocket,astronaut]"
# CPU vs CUDA parity is checked to 1e-4 relative with TF32 off (the `_fp32_exact` fixture below).
PARITY = 1e-4


@pytest.fixture(autouse=True)
def _fp32_exact():
    """TF32 off for each test (cuDNN enables it for convolutions by default), the flags restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


SMALL = ["data.image_size=64", PHOTOS, "data.batch_size=2"]
# The text of the warning torch.cuda.set_sync_debug_mode("warn") gives at each synchronizing CUDA call.
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextmanager
def counted_syncs() -> Iterator[list[str]]:
    """The host-device syncs made inside, one entry each, filled on exit (none without CUDA: nothing to sync with).

    Counted under set_sync_debug_mode("warn"), which warns at every sync (a `.item()`, a `.cpu()`, a copy from
    pageable host memory to the device); other warnings are passed on, not counted; the previous mode is restored.
    """
    syncs: list[str] = []
    cuda = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each sync warns from the same place: keep every one
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if SYNC_WARNING in str(w.message):
            syncs.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _run_both(tmp_path: Path, table: str, *overrides: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The same config run on the CPU and on CUDA, each table sorted into the same row order."""
    frames = []
    for device in ("cpu", "cuda"):
        result = app.run(make_config(*overrides, f"device={device}"), tmp_path / device)
        frames.append(pd.read_parquet(result.tables[table]))
    return frames[0], frames[1]


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference relative to the larger magnitude of the two."""
    scale = max(np.abs(a).max(), np.abs(b).max(), 1e-12)
    return float(np.abs(a - b).max() / scale)


def test_gradcam_maps_on_cuda_equal_the_cpu_maps(tmp_path: Path) -> None:
    cpu, gpu = _run_both(tmp_path, "cam", "experiment=gradcam_effnet", "method.faithfulness.enabled=false", *SMALL)
    keys = ["sample_id", "layer"]
    cpu, gpu = cpu.sort_values(keys).reset_index(drop=True), gpu.sort_values(keys).reset_index(drop=True)
    assert len(cpu) == len(gpu) == 4 * 7
    assert (cpu["predicted"].to_numpy() == gpu["predicted"].to_numpy()).all()
    for a, b in zip(cpu["map"], gpu["map"], strict=True):
        assert _relative(np.asarray(a), np.asarray(b)) < PARITY


def test_faithfulness_on_cuda_equals_the_cpu(tmp_path: Path) -> None:
    """Item 3 of issue 10: the pixel order of equal-saliency pixels is keyed by sample, so the AUCs agree."""
    cpu, gpu = _run_both(tmp_path, "cam", "experiment=gradcam_effnet", "method.faithfulness.steps=10", *SMALL)
    keys = ["sample_id", "layer"]
    cpu, gpu = cpu.sort_values(keys).reset_index(drop=True), gpu.sort_values(keys).reset_index(drop=True)
    for column in ("deletion_auc", "insertion_auc", "random_deletion_auc", "random_insertion_auc"):
        a, b = cpu[column].to_numpy(float), gpu[column].to_numpy(float)
        assert (np.isnan(a) == np.isnan(b)).all(), column
        # Near-ties that TF32 rounding reorders move an AUC by a step's worth at most; exact ties are keyed.
        assert np.nanmax(np.abs(a - b)) < 0.02, column


def test_patching_on_cuda_equals_the_cpu(tmp_path: Path) -> None:
    overrides = [
        "experiment=patching_effnet",
        "layers.include=[_blocks.10,_conv_head]",
        "method.patching.grid=[4,4]",
        "data.image_size=64",
        "data.photos=[chelsea,coffee]",
    ]
    cpu, gpu = _run_both(tmp_path, "patching", *overrides)
    keys = ["sample", "direction", "layer", "y", "x"]
    cpu, gpu = cpu.sort_values(keys).reset_index(drop=True), gpu.sort_values(keys).reset_index(drop=True)
    assert len(cpu) == len(gpu) > 0
    # The corruption noise is drawn per sample on the CPU: the corrupted logits agree up to the GPU's kernels.
    assert _relative(cpu["corrupted"].to_numpy(), gpu["corrupted"].to_numpy()) < PARITY
    assert _relative(cpu["patched"].to_numpy(), gpu["patched"].to_numpy()) < PARITY


def test_recording_memory_is_flat_across_batches_on_cuda(tmp_path: Path) -> None:
    """Hook state is per batch: the peak GPU memory of 8 batches is that of 2, and nothing stays behind."""
    # A first CUDA run allocates what stays for the process (cuBLAS workspaces, cuDNN plans): not per batch.
    app.run(make_config("method=record", "device=cuda", "data.image_size=64", "data.photos=[chelsea]"), tmp_path / "w")
    peaks = []
    for photos in ("[chelsea,coffee]", "[chelsea,coffee,rocket,astronaut,motorcycle,horse,chelsea,coffee]"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        app.run(
            make_config(
                "method=record", "device=cuda", "data.image_size=64", "data.batch_size=1", f"data.photos={photos}"
            ),
            tmp_path / str(len(peaks)),
        )
        peaks.append(torch.cuda.max_memory_allocated() - before)
        assert torch.cuda.memory_allocated() - before < 1 << 20  # the model and every hook's tensors released
    assert peaks[1] <= peaks[0] * 1.05 + (1 << 20)


def test_bf16_on_cuda_agrees_with_fp32(tmp_path: Path) -> None:
    frames = []
    for precision in ("fp32", "bf16"):
        config = make_config(
            "experiment=gradcam_effnet",
            "method.faithfulness.enabled=false",
            "device=cuda",
            f"precision={precision}",
            *SMALL,
        )
        frames.append(
            pd.read_parquet(app.run(config, tmp_path / precision).tables["cam"]).sort_values(["sample_id", "layer"])
        )
    fp32, bf16 = frames
    assert (bf16["map"].map(lambda m: np.isfinite(np.asarray(m)).all())).all()
    # bf16 keeps 8 bits of mantissa: the maps are the same picture, not the same numbers.
    correlations = [
        np.corrcoef(np.asarray(a), np.asarray(b))[0, 1]
        for a, b in zip(fp32["map"], bf16["map"], strict=True)
        if np.ptp(np.asarray(a)) > 0
    ]
    assert np.median(correlations) > 0.95


def _float_columns_agree(cpu: pd.DataFrame, gpu: pd.DataFrame, tolerance: float) -> list[str]:
    """Sort both tables by their scalar non-float columns; the float columns compared; their names returned."""
    keys = [c for c in cpu.columns if cpu[c].dtype.kind in "iubOU" and cpu[c].map(np.isscalar).all()]
    cpu, gpu = cpu.sort_values(keys).reset_index(drop=True), gpu.sort_values(keys).reset_index(drop=True)
    assert len(cpu) == len(gpu) > 0
    floats = [c for c in cpu.columns if cpu[c].dtype.kind == "f"]
    for column in floats:
        a, b = cpu[column].to_numpy(float), gpu[column].to_numpy(float)
        assert (np.isnan(a) == np.isnan(b)).all(), column
        assert _relative(np.nan_to_num(a), np.nan_to_num(b)) < tolerance, column
    return floats


def test_recorded_statistics_on_cuda_equal_the_cpu(tmp_path: Path) -> None:
    """method=record: every float column of every table (per-sample mean, std, min, max, norm...) to 1e-4."""
    results = [app.run(make_config("method=record", f"device={d}", *SMALL), tmp_path / d) for d in ("cpu", "cuda")]
    assert results[0].tables.keys() == results[1].tables.keys()
    compared = []
    for name in results[0].tables:
        cpu, gpu = (pd.read_parquet(r.tables[name]) for r in results)
        compared += _float_columns_agree(cpu, gpu, PARITY)
    assert compared, "no float column recorded"


def test_real_out_of_memory_halves_the_batch_and_gives_the_same_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A memory cap between the peaks of batch 4 and batch 8: batch 8 hits a real CUDA OOM, the halves fit, and
    the table equals the unconstrained run's."""
    photos = "data.photos=[chelsea,coffee,rocket,astronaut,motorcycle,horse,chelsea,coffee]"
    common = ["experiment=gradcam_effnet", "method.faithfulness.enabled=false", "device=cuda"]
    common += ["data.image_size=224", photos]
    peaks, tables = {}, {}
    for batch in (4, 8):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result = app.run(make_config(*common, f"data.batch_size={batch}"), tmp_path / f"free{batch}")
        peaks[batch] = torch.cuda.max_memory_reserved()
        tables[batch] = pd.read_parquet(result.tables["cam"])
    assert peaks[8] > peaks[4] * 1.2, peaks  # enough room between the two for a cap
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((peaks[4] + peaks[8]) / 2 / total)
    try:
        with caplog.at_level("WARNING"):
            result = app.run(make_config(*common, "data.batch_size=8"), tmp_path / "capped")
        capped = pd.read_parquet(result.tables["cam"])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert "CUDA out of memory at batch size 8" in caplog.text  # the OOM was real, and the back-off took it
    keys = ["sample_id", "layer"]
    free = tables[8].sort_values(keys).reset_index(drop=True)
    capped = capped.sort_values(keys).reset_index(drop=True)
    assert len(free) == len(capped) == 8 * 7
    assert (free["predicted"].to_numpy() == capped["predicted"].to_numpy()).all()
    for a, b in zip(free["map"], capped["map"], strict=True):
        assert _relative(np.asarray(a), np.asarray(b)) < PARITY  # batch 4 and batch 8 may pick other kernels


@pytest.mark.slow
def test_cli_default_run_on_cuda_exits_0_and_leaves_no_hook(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "device=cuda",
            "data.image_size=64",
            PHOTOS,
            "progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tables = list(tmp_path.rglob("*.parquet"))
    assert tables, "no Parquet written"


def test_no_hook_left_after_a_cuda_run_fails_mid_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    original_build, original_rows = app.build_model, runner.loop.rows_for

    def spy(cfg):  # noqa: ANN001, ANN202
        bundle = original_build(cfg)
        seen.append(bundle.model)
        return bundle

    def fail_on_second_batch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if fail_on_second_batch.calls == 1:
            raise RuntimeError("planted failure after the first batch")
        fail_on_second_batch.calls += 1
        return original_rows(*args, **kwargs)

    fail_on_second_batch.calls = 0
    monkeypatch.setattr(app, "build_model", spy)
    monkeypatch.setattr(runner.loop, "rows_for", fail_on_second_batch)  # where the batch loop looks it up
    with pytest.raises(RuntimeError, match="planted failure"):
        app.run(make_config("device=cuda", "data.image_size=64", PHOTOS, "data.batch_size=2"), tmp_path)
    assert fail_on_second_batch.calls == 1 and len(seen) == 1
    assert count_hooks(seen[0]) == 0


def test_attribution_topk_on_cuda_runs_and_equals_the_cpu(tmp_path: Path) -> None:
    """rank_correlation used to be made on the CPU and concatenated with the CUDA rows (issue 12)."""
    overrides = [
        "experiment=patching_effnet",
        "layers.include=[_conv_head]",
        "method.patching.grid=[2,2]",
        "method.patching.mode=attribution_topk",
        "method.patching.top_k=3",
        "data.image_size=64",
        "data.photos=[chelsea,coffee]",
    ]
    cpu, gpu = _run_both(tmp_path, "patching", *overrides)
    keys = ["sample", "direction", "patch_method", "y", "x"]
    cpu, gpu = cpu.sort_values(keys).reset_index(drop=True), gpu.sort_values(keys).reset_index(drop=True)
    assert (gpu["patch_method"] == "attribution").sum() == 2 * 4 and (gpu["patch_method"] == "exact").sum() == 2 * 3
    attribution = cpu["patch_method"] == "attribution"
    assert gpu.loc[attribution, "rank_correlation"].isna().all()
    assert _relative(cpu.loc[attribution, "patched"].to_numpy(), gpu.loc[attribution, "patched"].to_numpy()) < PARITY


# ---- host syncs per batch (issue 12, item 5) ----------------------------------------------------
def _syncs_per_batch(
    model: torch.nn.Module, layers: list[str], cfg: object, x: torch.Tensor
) -> tuple[list[int], dict[str, dict]]:
    """Host syncs of each of 3 calls of the method's run_batch on `x` (already on CUDA), after a warm-up batch
    (the first batch gives the once-per-run warnings, whose lines name samples: syncs of their own); and the
    last batch's tables."""
    from runner.data.base import Batch
    from runner.hooks import HookSession
    from runner.layers import resolve_layers
    from runner.methods import build_method
    from runner.runtime import Runtime
    from runner.schema import Precision

    method = build_method(cfg, resolve_layers(model, layers), Runtime(torch.device("cuda"), Precision.fp32))
    labels = torch.full((x.shape[0],), -1, device=x.device)
    batch = Batch(x, labels, [f"s{i}" for i in range(x.shape[0])], 0)
    counts = []
    with HookSession(model, []) as session:
        method.setup(session, x.shape[0])
        for _ in range(4):
            session.begin_batch(x.shape[0], 0)
            with counted_syncs() as syncs:
                out = method.run_batch(model, batch, session)
            counts.append(len(syncs))
    return counts[1:], out.tables


def test_gradcam_makes_at_most_two_host_syncs_per_batch() -> None:
    """Expected <= 2, whatever the number of layers: the two once-per-run warning checks of cam.py `_rows`
    (`bool(flags.any())` for constant logits and for degenerate maps; none once each has warned). The forward,
    the one autograd.grad, the maps and the rows' tensors stay on the device; the loop moves them to the host."""
    from runner.methods import method_config
    from tests.conftest import TinyNet, frozen

    torch.manual_seed(0)
    model = frozen(TinyNet()).cuda()
    x = torch.randn(4, 3, 16, 16, device="cuda")
    for layers in (["features.0"], ["features.0", "features.2"]):
        counts, _ = _syncs_per_batch(model, layers, method_config("gradcam"), x)
        assert max(counts) <= 2, (layers, counts)


def test_channel_patching_makes_at_most_two_host_syncs_per_batch() -> None:
    """Expected <= 2 per batch, none per channel, layer or sample: the corruption noise's copy to the device
    (drawn on the CPU per sample, so every device gets the same noise) and the degenerate flags' one `.cpu()`
    (rows.py `degenerate_reasons`). The channel masks used to take two syncs per channel (CPU index tensors):
    here 2 x (64 + 128) x 2 samples of them."""
    import torchvision

    from runner.methods.patching import PatchingConfig, PatchingMethodConfig
    from runner.options.method.patching import PatchUnit
    from tests.conftest import frozen

    torch.manual_seed(3)
    model = frozen(torchvision.models.resnet18(weights=None)).cuda()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    cfg = PatchingMethodConfig(patching=PatchingConfig(units=PatchUnit.channel, chunk=32))
    counts, tables = _syncs_per_batch(model, ["layer1.0.conv1", "layer2.0.conv1"], cfg, x)
    assert max(counts) <= 2, counts
    columns = tables["patching"]
    assert len(columns["channel"]) == 2 * (64 + 128)
    for key, value in columns.items():  # every tensor column on the rows' device (rows.py `unit_columns`)
        if torch.is_tensor(value):
            assert value.device.type == "cuda", key


# ---- bf16 patching (issue 12, item 5) ----------------------------------------------------------
def test_bf16_patching_agrees_with_fp32(tmp_path: Path) -> None:
    """bf16 keeps 8 bits of mantissa (about 0.4% per rounding, accumulated over the layers after the patch): the
    effects (patched minus the patched run's own metric) rank the cells the same (Spearman >= 0.99) and differ
    by at most 5% of their fp32 range. The same comparison under CPU autocast gave 0.998 and 2.1%."""
    from scipy.stats import spearmanr

    overrides = [
        "experiment=patching_effnet",
        "layers.include=[_blocks.10,_conv_head]",
        "method.patching.grid=[4,4]",
        "method.patching.directions=[denoising,noising]",
        "data.image_size=64",
        "data.photos=[chelsea,coffee]",
        "device=cuda",
    ]
    keys = ["sample", "direction", "layer", "y", "x"]
    effects = {}
    for precision in ("fp32", "bf16"):
        result = app.run(make_config(*overrides, f"precision={precision}"), tmp_path / precision)
        frame = pd.read_parquet(result.tables["patching"]).sort_values(keys).reset_index(drop=True)
        base = np.where(frame["direction"] == "denoising", frame["corrupted"], frame["clean"])
        effects[precision] = frame["patched"].to_numpy(float) - base
        assert len(frame) == 2 * 2 * (16 + 4)  # samples x directions x cells (4x4 at _blocks.10, 2x2 at _conv_head)
    fp32, bf16 = effects["fp32"], effects["bf16"]
    assert np.isfinite(bf16).all()
    assert spearmanr(fp32, bf16).statistic >= 0.99
    assert np.abs(fp32 - bf16).max() <= 5e-2 * np.ptp(fp32)


# ---- the shipped experiments on CUDA (issue 12, item 5) ----------------------------------------
def _experiments() -> list[str]:
    from tests.test_experiments import EXPERIMENTS

    return EXPERIMENTS


@pytest.mark.parametrize("name", _experiments())
def test_experiment_runs_at_tiny_size_on_cuda(tmp_path: Path, name: str) -> None:
    """Each conf/experiment/*.yaml at debug=tiny (32 px, two samples) on CUDA writes its tables, with rows."""
    from tests.test_experiments import ONE_PHOTO, TABLES, offline

    result = app.run(make_config(f"experiment={name}", "debug=tiny", "device=cuda", *offline(name)), tmp_path)
    assert set(result.tables) == TABLES[name]
    for table, path in result.tables.items():
        frame = pd.read_parquet(path)
        assert len(frame) > 0, table
        assert set(frame["sample"]) == ({0} if name in ONE_PHOTO else {0, 1}), table


def test_road_imputation_and_curves_on_cuda_equal_the_cpu() -> None:
    """ROAD's imputation (road_solver=auto: float32 CG on CUDA to a relative residual of 1e-5, the exact direct
    solve on the CPU) agrees to 1e-3 absolute on [0, 1] images (the residual bound times the system's condition
    number at 32 px); solver="direct" on CUDA inputs solves on the host and returns to CUDA, equal to the CPU's;
    ROAD's probability curves on the embedded EfficientNet-Lite0 (noise drawn on the CPU, so the same) to 1e-3."""
    from runner.metrics import EvaluationConfig, MetricInputs
    from runner.metrics.faithfulness_family import noisy_linear_imputation, road_curves
    from runner.models import build_model
    from runner.runtime import Runtime
    from runner.schema import ModelConfig, Precision

    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 32, 32, generator=g)
    removed = torch.rand(4, 32, 32, generator=g) < torch.tensor([0.05, 0.5, 0.9, 0.95])[:, None, None]
    cpu, ok_cpu = noisy_linear_imputation(x, removed, None, 1e-5)
    gpu, ok_gpu = noisy_linear_imputation(x.cuda(), removed.cuda(), None, 1e-5)
    assert ok_cpu and ok_gpu
    assert not torch.equal(cpu, x)  # something was imputed
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-3, rtol=0)
    direct, _ = noisy_linear_imputation(x.cuda(), removed.cuda(), None, solver="direct")
    assert direct.is_cuda and torch.equal(direct.cpu(), cpu)

    model = build_model(ModelConfig(name="efficientnet_lite0", weights="embedded")).model.eval()
    photos = torch.nn.functional.interpolate(x, size=(64, 64)) * 2 - 1  # (4, 3, 64, 64)
    maps = torch.rand(4, 64, 64, generator=g)
    target = model(photos).argmax(dim=1)
    cfg = EvaluationConfig(road_percentages=[10.0, 50.0, 90.0])
    curves = {}
    for device in ("cpu", "cuda"):
        runtime = Runtime(torch.device(device), Precision.fp32)
        m = model.to(device)
        inputs = MetricInputs(m, photos.to(device), target.to(device), torch.arange(4, device=device), None, runtime, 0)
        prob, _, converged = road_curves(inputs, maps.to(device), cfg)
        assert converged
        curves[device] = prob.cpu()  # (4, 2, 3)
    torch.testing.assert_close(curves["cuda"], curves["cpu"], atol=1e-3, rtol=0)
    assert curves["cpu"].std() > 0  # the curves move: not two constant curves
