"""Device-side work on the CPU: patching's unit masks and rows built where their inputs live (no host indices),
EigenCAM's first component without a full SVD, and the sync counter tests/test_gpu.py uses.

The GPU itself is tested in tests/test_gpu.py. Here, a factory call that forgets its device is caught by
making "meta" the default device while every input is on the CPU: such a call lands on "meta" (or fails
to mix with the CPU tensors), one that names the input's device does not.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torch import nn

from runner.data.base import Batch
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.methods import build_method
from runner.methods.cam import CamContext
from runner.methods.eigencam import EigenCAM, first_right_singular_vector
from runner.methods.patching import enumerate_units
from runner.methods.patching import method as patching_method
from runner.methods.patching.rows import PATCHING_SCHEMA, Site, unit_columns
from runner.methods.patching.units import Units
from runner.options.method.eigencam import EigenCamConfig
from runner.options.method.patching import (
    PatchDirection,
    PatchingConfig,
    PatchingMethodConfig,
    PatchMetric,
    PatchMode,
    PatchUnit,
)
from runner.runtime import Runtime
from runner.schema import Precision
from tests.conftest import frozen
from tests.devices import counted_syncs
from tests.test_patching import CPU, patch
from tests.test_reference import effnet, photos  # noqa: F401  (module fixtures: the real embedded model, 2 photos)


# ---- patching unit masks -----------------------------------------------------------------------
def old_masks(units: Units, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """The construction before issue 12, kept as the reference: index tensors made on the host (two
    host-to-device copies, each a sync, per channel on CUDA)."""
    n = stop - start
    if units.kind is PatchUnit.layer:
        return torch.ones((1, *units.shape), dtype=torch.bool, device=device)
    if units.kind is PatchUnit.channel:
        dims = (n, units.shape[0]) + (1,) * (len(units.shape) - 1)
        mask = torch.zeros(dims, dtype=torch.bool, device=device)
        mask[torch.arange(n), torch.arange(start, stop)] = True
        return mask
    if units.kind is PatchUnit.token:
        mask = torch.zeros((n, units.shape[0], 1), dtype=torch.bool, device=device)
        mask[torch.arange(n), torch.arange(start, stop)] = True
        return mask
    mask = torch.zeros((n, 1, *units.shape[1:]), dtype=torch.bool, device=device)
    for i, (y0, y1, x0, x1) in enumerate(units.cells[start:stop]):
        mask[i, 0, y0:y1, x0:x1] = True
    return mask


def old_masks_of(units: Units, order: list[int], device: torch.device) -> torch.Tensor:
    """The old masks of units `order`, one call per unit, as the engine built them."""
    if units.kind is PatchUnit.layer:
        return old_masks(units, 0, 1, device)
    return torch.cat([old_masks(units, u, u + 1, device) for u in order])


UNIT_SETS = {
    "channel": (PatchUnit.channel, (7, 5, 4), [7, 7], None),
    "channel_1d": (PatchUnit.channel, (9,), [7, 7], None),
    "token": (PatchUnit.token, (6, 3), [7, 7], None),
    "cell_grid": (PatchUnit.cell, (3, 9, 7), [3, 2], None),
    "cell_size": (PatchUnit.cell, (2, 8, 8), [7, 7], 3),
    "layer": (PatchUnit.layer, (4, 3, 3), [7, 7], None),
}


@pytest.mark.parametrize("key", sorted(UNIT_SETS))
def test_masks_equal_the_old_construction(key: str) -> None:
    kind, shape, grid, cell_size = UNIT_SETS[key]
    units = enumerate_units("x", shape, kind, grid, cell_size)
    cpu = torch.device("cpu")
    for start, stop in [(0, units.count), (0, 1), (units.count - 1, units.count), (1, max(2, units.count - 1))]:
        stop = min(stop, units.count)
        ours, theirs = units.masks(start, stop, cpu), old_masks(units, start, stop, cpu)
        assert ours.dtype == torch.bool and ours.shape == theirs.shape and torch.equal(ours, theirs), (start, stop)
    shuffled = torch.randperm(units.count, generator=torch.Generator().manual_seed(1)).tolist()
    for order in (shuffled, list(range(units.count)), shuffled[:2], [units.count - 1]):
        ours, theirs = units.masks_of(order, cpu), old_masks_of(units, order, cpu)
        assert ours.shape == theirs.shape and torch.equal(ours, theirs), order


@pytest.mark.parametrize("key", ["channel", "channel_1d", "token", "cell_grid"])
def test_masks_make_no_index_on_the_host(key: str) -> None:
    """Every tensor is made on the device asked for: with "meta" the default, CPU masks still come out."""
    kind, shape, grid, cell_size = UNIT_SETS[key]
    units = enumerate_units("x", shape, kind, grid, cell_size)
    cpu = torch.device("cpu")
    expected = old_masks(units, 0, units.count, cpu)
    with torch.device("meta"):
        for order in (range(units.count), list(range(units.count))[::-1]):
            got = units.masks_of(order, cpu)
            assert got.device == cpu
            assert torch.equal(got, expected[list(order)])
        if kind is not PatchUnit.cell:  # the sentinel catches the old construction's host-made indices
            try:
                out = old_masks(units, 0, units.count, cpu)
                caught = out.device != cpu or not torch.equal(out, expected)  # the "meta" indices set nothing
            except (RuntimeError, NotImplementedError):
                caught = True
            assert caught


@pytest.mark.parametrize("mode", [PatchMode.exact, PatchMode.attribution_topk])
def test_channel_patching_rows_equal_those_of_the_old_masks(mode: PatchMode, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rows, exactly, with the masks built the old way (contiguous blocks and a top-k order)."""
    torch.manual_seed(3)
    model = frozen(torchvision.models.resnet18(weights=None))
    x = torch.randn(1, 3, 32, 32)
    layers = ["layer1.0.conv1", "layer2.0.bn2"]  # 64 and 128 channels
    options = {"units": PatchUnit.channel, "chunk": 24, "mode": mode, "top_k": 9}
    ours = patch(model, x, layers, **options)
    monkeypatch.setattr(Units, "masks", old_masks)
    monkeypatch.setattr(Units, "masks_of", old_masks_of)
    theirs = patch(model, x, layers, **options)
    exact = [m == "exact" for m in ours["patch_method"]]
    assert sum(exact) == (64 + 128 if mode is PatchMode.exact else 2 * 9)
    if mode is PatchMode.attribution_topk:  # a top-k order is not a contiguous block
        channels = [c for c, e in zip(ours["channel"], exact, strict=True) if e][:9]
        assert channels != sorted(channels)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, equal_nan=True, msg=key)
        else:
            assert value == theirs[key], key


# ---- patching rows -----------------------------------------------------------------------------
def _site(units: Units, reason: str = "") -> Site:
    """A site whose tensors are on the CPU (the rows' device)."""
    t = torch.tensor
    return Site(
        1, PatchDirection.denoising, "features.2", "Conv2d", units, PatchMetric.logit_diff, t(3), t(1), t(2.0),
        t(0.5), "s1+noise", reason, bool(reason),
    )  # fmt: skip


@pytest.mark.parametrize("reason", ["", "zero_span"])
def test_unit_columns_are_made_on_the_rows_device(reason: str) -> None:
    units = enumerate_units("features.2", (4, 6, 6), PatchUnit.cell, [3, 3], None)
    patched = torch.linspace(0.0, 1.0, 5)  # (5,) on the CPU
    site = _site(units, reason)
    with torch.device("meta"):  # a column made without the rows' device would land here
        columns = unit_columns(site, [0, 2, 4, 6, 8], "exact", patched)
    tensors = {k: v for k, v in columns.items() if torch.is_tensor(v)}
    assert {"sample_index", "degenerate", "patched", "restoration", "target"} <= tensors.keys()
    for key, value in tensors.items():
        assert value.device == patched.device, key
        assert value.shape == (5,), key
    assert tensors["sample_index"].dtype == torch.int64 and tensors["sample_index"].tolist() == [1] * 5
    assert tensors["degenerate"].dtype == torch.bool and tensors["degenerate"].tolist() == [bool(reason)] * 5
    assert tensors["patched"].dtype == tensors["restoration"].dtype == torch.float32
    assert columns["y"] == [0, 0, 1, 2, 2] and columns["x"] == [0, 2, 1, 0, 2]
    assert set(columns) - {"sample_index"} <= set(PATCHING_SCHEMA.names)


# ---- EigenCAM ----------------------------------------------------------------------------------
def old_eigencam(act: torch.Tensor) -> torch.Tensor:
    """EigenCAM before issue 12 (full SVD), kept as the reference: (B, C, H, W) -> (B, H, W)."""
    b, c, h, w = act.shape
    points = act.reshape(b, c, h * w).transpose(1, 2)  # (B, HW, C)
    centred = points - points.mean(dim=1, keepdim=True)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # vh: (B, k, C)
    projection = (centred @ vh[:, 0, :, None]).squeeze(2)  # (B, HW)
    reference = points.sum(dim=2) - points.sum(dim=2).mean(dim=1, keepdim=True)  # (B, HW)
    sign = torch.sign((projection * reference).sum(dim=1, keepdim=True))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return torch.relu(projection * sign).reshape(b, h, w)


def eigencam(act: torch.Tensor) -> torch.Tensor:
    """The runner's EigenCAM map of activations (B, C, H, W)."""
    method = EigenCAM(EigenCamConfig(), [], CPU)
    return method.cam(act, None, CamContext(nn.Identity(), torch.zeros(act.shape[0], 3, 8, 8), torch.zeros(1), CPU))


def captured(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Each layer's output (a clone: in-place ReLUs follow VGG's convs) from one forward."""
    acts: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: acts.__setitem__(n, o.clone()))
               for n in names]  # fmt: skip
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return acts


def assert_same_map(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal to `rel` of each sample's maximum."""
    scale = theirs.flatten(1).abs().amax(dim=1).clamp_min(1e-12)  # (B,)
    assert bool((theirs.flatten(1).amax(dim=1) > 0).all()), "an all-zero reference compares nothing"
    error = (ours - theirs).flatten(1).abs().amax(dim=1) / scale
    assert float(error.max()) <= rel, error


# 64 px: 8x8 (40 channels, C < HW), 4x4 (112, C > HW), 2x2 (1280): both branches of the Gram choice.
EFFNET_LAYERS = ["_blocks.3", "_blocks.10", "_conv_head"]


def test_eigencam_equals_the_full_svd_on_efficientnet(effnet: nn.Module, photos: torch.Tensor) -> None:  # noqa: F811
    acts = captured(effnet, photos, EFFNET_LAYERS)
    for layer in EFFNET_LAYERS:
        assert_same_map(eigencam(acts[layer].float()), old_eigencam(acts[layer].float()))


@pytest.mark.slow
def test_eigencam_equals_the_full_svd_and_pytorch_grad_cam_on_vgg16(vgg16: nn.Module) -> None:
    """VGG16 (random init), 64 px: features.5 is 32x32 with 128 channels, .21 8x8 with 512, .28 4x4 with 512."""
    pytest.importorskip("pytorch_grad_cam", reason="the dev extra installs grad-cam")
    from pytorch_grad_cam.utils.svd_on_activations import get_2d_projection

    torch.manual_seed(5)
    x = torch.randn(2, 3, 64, 64)
    layers = ["features.5", "features.21", "features.28"]
    acts = captured(vgg16, x, layers)
    for layer in layers:
        act = acts[layer]
        ours = eigencam(act)
        assert_same_map(ours, old_eigencam(act))
        # pytorch-grad-cam keeps LAPACK's sign (and ReLUs it): flip its component by the runner's rule.
        projection = torch.from_numpy(get_2d_projection(act.numpy())).flatten(1)  # (B, HW), before its ReLU
        total = act.sum(dim=1).flatten(1)
        sign = torch.sign(((total - total.mean(1, keepdim=True)) * projection).sum(1, keepdim=True))
        theirs = torch.relu(projection * sign).reshape(ours.shape)
        assert_same_map(ours, theirs, 1e-4)  # numpy's float32 SVD against torch's float32 Gram


def test_first_right_singular_vector_is_the_svds_up_to_sign() -> None:
    torch.manual_seed(0)
    for shape in [(3, 50, 7), (3, 7, 50), (2, 9, 9)]:
        x = torch.randn(shape, dtype=torch.float64)
        v = first_right_singular_vector(x)  # (B, C)
        expected = torch.linalg.svd(x, full_matrices=False).Vh[:, 0]  # (B, C)
        sign = torch.sign((v * expected).sum(dim=1, keepdim=True))
        torch.testing.assert_close(v * sign, expected, rtol=0, atol=1e-10)
    zero = first_right_singular_vector(torch.zeros(1, 3, 5))  # constant activations: a finite vector, a zero map
    assert torch.isfinite(zero).all()


# ---- the sync counter of tests/test_gpu.py -----------------------------------------------------
def test_sync_counter_counts_scalar_reads_and_passes_other_warnings_on() -> None:
    """On the CPU the counter sees each read of a tensor's value into Python (what would sync on CUDA): one
    `.item()` is one, the tensor ops around it none; other warnings reach the caller."""
    with pytest.warns(UserWarning, match="an unrelated warning"), counted_syncs("cpu") as syncs:
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        torch.randn(4).mul(2).sum().item()
    assert len(syncs) == 1
    if torch.cuda.is_available():  # pragma: no cover - the CPU machines have no CUDA
        with pytest.warns(UserWarning, match="an unrelated warning"), counted_syncs("cuda") as syncs:
            warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
            torch.ones(2, device="cuda").sum().item()
        assert len(syncs) == 1
        assert torch.cuda.get_sync_debug_mode() == 0


# ---- attribution_topk rows on the inputs' device ---------------------------------------------------------------------
class DeviceUnlessTold:
    """Stands in for `torch` in a module under test: a tensor made without a device lands on `meta`, so any tensor
    that would stay on the CPU beside CUDA rows shows up on a CPU-only machine."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: object, **kwargs: object) -> torch.Tensor:
        kwargs["device"] = kwargs.get("device") or "meta"
        return torch.tensor(*args, **kwargs)

    @staticmethod
    def full(*args: object, **kwargs: object) -> torch.Tensor:
        kwargs["device"] = kwargs.get("device") or "meta"
        return torch.full(*args, **kwargs)


@pytest.mark.parametrize("top_k", [1, 3])  # 1: rho undefined (a NaN tensor); 3: Spearman's rho
def test_attribution_topk_rows_stay_on_the_inputs_device(
    tiny: nn.Module, monkeypatch: pytest.MonkeyPatch, top_k: int
) -> None:
    """rank_correlation was made on the CPU (torch.tensor(nan), torch.full without a device) and concatenated with
    the CUDA rows: "Expected all tensors to be on the same device" on every GPU run of attribution_topk."""
    monkeypatch.setattr(patching_method, "torch", DeviceUnlessTold())
    cfg = PatchingMethodConfig(patching=PatchingConfig(units=PatchUnit.cell, grid=[2, 2], mode=PatchMode.attribution_topk, top_k=top_k))  # fmt: skip
    layers = resolve_layers(tiny, ["features.2"])
    method = build_method(cfg, layers, Runtime(torch.device("cpu"), Precision.fp32))
    x = torch.randn(2, 3, 8, 8)  # (2, 3, 8, 8)
    batch = Batch(x, torch.full((2,), -1), ["s0", "s1"], 0)
    with HookSession(tiny, []) as session:
        method.setup(session, 2)
        session.begin_batch(2, 0)
        columns = method.run_batch(tiny, batch, session).tables["patching"]
    tensors = {key: value for key, value in columns.items() if torch.is_tensor(value)}
    assert {key: value.device.type for key, value in tensors.items()} == {key: "cpu" for key in tensors}
    kinds = columns["patch_method"]
    assert kinds.count("attribution") == 2 * 4 and kinds.count("exact") == 2 * top_k
    exact_rho = columns["rank_correlation"][[k == "exact" for k in kinds]]
    assert exact_rho.isnan().all() if top_k == 1 else exact_rho.isfinite().all()
