"""GPU-path failures that the CPU can show (issue 12): each test fails without its fix."""

from __future__ import annotations

import weakref
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from runner import app
from runner.data import Batch
from runner.hooks import HookSession
from runner.layers import resolve_layers
from runner.loop import run_with_backoff
from runner.methods import BatchOutput, Method, build_method
from runner.methods.base import Runtime
from runner.methods.patching import method as patching_method
from runner.methods.patching.config import PatchingConfig, PatchingMethodConfig, PatchMode, PatchUnit
from runner.methods.patching.engine import ExactEngine
from runner.methods.patching.units import enumerate_units
from runner.schema import Precision
from tests.conftest import make_config

VGG_TINY = ["model=vgg16", "model.weights=null", "data=synthetic", "data.count=2", "data.shape=[3,32,32]",
            "data.batch_size=2", "layers.include=[features.2]", "method=patching", "method.patching.grid=[2,2]", "method.target=fixed", "method.class_ids=[1]",
            "method.pictures=false", "progress=false", "hooks=[]"]  # fmt: skip


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


class OomOnceWithActivations(Method):
    """Allocates a stand-in for its activations, then raises CUDA out-of-memory on the first (full) batch only;
    every later attempt notes whether that first tensor was already freed."""

    def __init__(self) -> None:
        self.first_attempt: weakref.ref[torch.Tensor] | None = None
        self.freed_when_halves_ran: list[bool] = []

    def run_batch(self, model: nn.Module, batch: Batch, session: HookSession) -> BatchOutput:
        activations = model(batch.x) * 1.0  # (B, K): held by this frame, as a real attempt's graph would be
        if self.first_attempt is None:
            self.first_attempt = weakref.ref(activations)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        self.freed_when_halves_ran.append(self.first_attempt() is None)
        return BatchOutput(predicted=activations.argmax(dim=1))


def test_oom_backoff_runs_the_halves_after_the_failed_attempt_is_freed(tiny: nn.Module) -> None:
    """The retry used to run inside the `except` block, where the traceback keeps the failed attempt's frames (and
    their tensors) alive: on a GPU the halves then ran short of that memory and failed again down to batch 1."""
    batch = Batch(torch.randn(4, 3, 16, 16), torch.full((4,), -1), [str(i) for i in range(4)], 0)  # (4, 3, 16, 16)
    method = OomOnceWithActivations()
    with HookSession(tiny, []) as session:
        parts = run_with_backoff(batch, tiny, method, session, make_config("data=synthetic"))
    assert [part[0].x.shape[0] for part in parts] == [2, 2]
    assert [part[0].first_index for part in parts] == [0, 2]
    assert method.freed_when_halves_ran == [True, True]


def test_oom_in_the_prefix_forward_reaches_the_backoff(tiny: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch-1 prefix fallback caught every RuntimeError, CUDA out-of-memory included: it then ran n full
    forwards (more memory, not less) and switched the prefix off for the rest of the run."""
    p = PatchingConfig(units=PatchUnit.channel, chunk=8)
    runtime = Runtime(torch.device("cpu"), Precision.fp32)
    name, layer = "features.0", tiny.features[0]
    x = torch.randn(2, 3, 8, 8)  # (2, 3, 8, 8)
    base, source = layer(x[:1])[0], layer(x[1:])[0]  # (6, 8, 8) each
    units = enumerate_units(name, tuple(base.shape), PatchUnit.channel, [1, 1], None)
    target, contrast = torch.tensor([1]), torch.tensor([0])
    calls = {"n": 0}
    original = tiny.fc.forward

    def oom_once(z: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(z)

    monkeypatch.setattr(tiny.fc, "forward", oom_once)
    with HookSession(tiny, []) as session:
        capture = session.capture([(name, layer)], differentiable=False)
        engine = ExactEngine(p, runtime, session, capture, session.replace([(name, layer)]))
        with pytest.raises(torch.cuda.OutOfMemoryError):
            engine.patched_metrics(tiny, name, x[:1], base, source, units, target, contrast)
        assert engine.prefix_ok.get(name) is not False
        assert capture.active  # restored after the error
        metrics = engine.patched_metrics(tiny, name, x[:1], base, source, units, target, contrast)  # the retry
    assert metrics.shape == (6,)
    assert engine.prefix_ok[name] is True


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
