"""The hook session: four kinds, actions that flow forward and backward, call indices, in-place safety, hygiene."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from runner import app
from runner.errors import RunnerError
from runner.hooks import BoundHook, HookSession, InplaceOff, TensorSaver, count_hooks
from runner.layers import resolve_layers
from runner.schema import HookAction, HookKind, HookSpec
from runner.stats import STAT_NAMES, per_sample_stats
from tests.conftest import SharedActivation, frozen, make_config


def bind(model: nn.Module, *specs: tuple[HookSpec, list[str]]) -> list[BoundHook]:
    return [BoundHook(spec, resolve_layers(model, layers)) for spec, layers in specs]


def rows(columns: dict) -> list[dict]:
    """Recorded columns as a list of row dicts (stats by name) for easy assertions."""
    stats = columns["stats"]
    return [
        {
            **{k: columns[k][i] for k in ("layer", "hook", "role", "call")},
            "sample_index": int(columns["sample_index"][i]),
            **dict(zip(STAT_NAMES, stats[i].tolist(), strict=True)),
        }
        for i in range(len(columns["layer"]))
    ]


def test_forward_record_keeps_pre_relu_values_on_vgg_inplace(vgg16: nn.Module) -> None:
    """features.28 is a conv followed by ReLU(inplace=True): the record must be the conv output."""
    x = torch.randn(2, 3, 32, 32)
    with HookSession(vgg16, bind(vgg16, (HookSpec(kind=HookKind.forward), ["features.28"]))) as session:
        session.begin_batch(2, 0)
        with torch.no_grad():
            vgg16(x)
        recorded = rows(session.end_batch())
    with torch.no_grad():
        direct = vgg16.features[:29](x)  # the sub-network up to and including the conv, run directly
    expected, _ = per_sample_stats(direct, 2)
    assert [r["sample_index"] for r in recorded] == [0, 1]
    assert all(r["min"] < 0 for r in recorded), "pre-ReLU values have negative entries"
    got = torch.tensor([[r[s] for s in STAT_NAMES] for r in recorded])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_backward_hook_on_vgg_does_not_crash_and_restores_inplace(vgg16: nn.Module) -> None:
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    specs = bind(vgg16, (HookSpec(kind=HookKind.backward), ["features.28"]))
    with HookSession(vgg16, specs) as session:
        session.begin_batch(2, 0)
        logits = vgg16(x)
        torch.autograd.grad(logits[:, 0].sum(), x)
        recorded = rows(session.end_batch())
    assert {r["role"] for r in recorded} == {"grad_input.0", "grad_output.0"}
    assert vgg16.features[29].inplace is True, "in-place flags are restored after the session"
    assert count_hooks(vgg16) == 0


def test_all_four_kinds_record(tiny: nn.Module) -> None:
    kinds = [HookKind.pre, HookKind.forward, HookKind.backward, HookKind.tensor]
    specs = bind(tiny, *[(HookSpec(kind=k), ["features.2"]) for k in kinds])
    x = torch.randn(3, 3, 8, 8, requires_grad=True)
    with HookSession(tiny, specs) as session:
        session.begin_batch(3, 0)
        torch.autograd.grad(tiny(x)[:, 1].sum(), x)
        recorded = rows(session.end_batch())
    roles = {(r["hook"], r["role"]) for r in recorded}
    assert roles == {
        ("pre", "input.0"),
        ("forward", "output"),
        ("backward", "grad_input.0"),
        ("backward", "grad_output.0"),
        ("tensor", "grad"),
    }
    assert len(recorded) == 5 * 3  # one row per sample per role
    grad_output = [r for r in recorded if r["role"] == "grad_output.0"]
    tensor_grad = [r for r in recorded if r["hook"] == "tensor"]
    for a, b in zip(grad_output, tensor_grad, strict=True):  # two routes to d(score)/d(output) agree
        assert a["l2_norm"] == pytest.approx(b["l2_norm"], rel=1e-5)


def test_forward_modification_flows_into_later_layers_and_backward() -> None:
    torch.manual_seed(0)
    model = frozen(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))
    x = torch.randn(2, 4, requires_grad=True)
    spec = HookSpec(kind=HookKind.forward, action=HookAction.scale, factor=3.0)
    with HookSession(model, bind(model, (spec, ["0"]))) as session:
        session.begin_batch(2, 0)
        patched = model(x)
        (grad_patched,) = torch.autograd.grad(patched[:, 0].sum(), x)
    expected = model[1](3.0 * model[0](x))
    torch.testing.assert_close(patched, expected)
    (grad_plain,) = torch.autograd.grad(model(x)[:, 0].sum(), x)
    torch.testing.assert_close(grad_patched, 3.0 * grad_plain)  # linear net: the gradient scales too


@pytest.mark.parametrize(
    ("kind", "layer"),
    [(HookKind.tensor, "1"), (HookKind.backward, "1")],
)
def test_gradient_scale_reaches_earlier_layers(kind: HookKind, layer: str) -> None:
    torch.manual_seed(0)
    model = frozen(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))
    x = torch.randn(2, 4, requires_grad=True)
    (plain,) = torch.autograd.grad(model(x)[:, 0].sum(), x)
    spec = HookSpec(kind=kind, action=HookAction.scale, factor=-2.0)
    with HookSession(model, bind(model, (spec, [layer]))) as session:
        session.begin_batch(2, 0)
        (scaled,) = torch.autograd.grad(model(x)[:, 0].sum(), x)
    torch.testing.assert_close(scaled, -2.0 * plain)


def test_pre_hook_zero_and_clamp_change_inputs() -> None:
    torch.manual_seed(0)
    model = frozen(nn.Sequential(nn.Linear(4, 3)))
    x = torch.randn(5, 4)
    with HookSession(model, bind(model, (HookSpec(kind=HookKind.pre, action=HookAction.zero), ["0"]))) as session:
        session.begin_batch(5, 0)
        out = model(x)
    torch.testing.assert_close(out, model[0].bias.expand(5, 3))
    clamp = HookSpec(kind=HookKind.pre, action=HookAction.clamp, min=0.0)
    with HookSession(model, bind(model, (clamp, ["0"]))) as session:
        session.begin_batch(5, 0)
        out = model(x)
    torch.testing.assert_close(out, model(x.clamp(min=0)))


def test_add_noise_is_seeded() -> None:
    model = frozen(nn.Sequential(nn.Identity()))
    x = torch.zeros(2, 10)
    outs = []
    for seed in (7, 7, 8):
        spec = HookSpec(kind=HookKind.forward, action=HookAction.add_noise, std=0.5, seed=seed)
        with HookSession(model, bind(model, (spec, ["0"]))) as session:
            session.begin_batch(2, 0)
            outs.append(model(x))
    torch.testing.assert_close(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
    assert 0.2 < float(outs[0].std()) < 0.8


def test_module_called_twice_gets_call_indices() -> None:
    torch.manual_seed(0)
    model = frozen(SharedActivation())
    x = torch.randn(2, 4, requires_grad=True)
    x0 = x[0].detach()
    specs = bind(model, (HookSpec(kind=HookKind.forward), ["act"]), (HookSpec(kind=HookKind.backward), ["act"]))
    with HookSession(model, specs) as session:
        session.begin_batch(2, 0)
        torch.autograd.grad(model(x).sum(), x)
        recorded = rows(session.end_batch())
    forward = {r["call"]: r for r in recorded if r["hook"] == "forward" and r["sample_index"] == 0}
    assert set(forward) == {0, 1}
    assert forward[0]["mean"] == pytest.approx(float(torch.tanh(x0).mean()), rel=1e-5)
    assert forward[1]["mean"] == pytest.approx(float(torch.tanh(model.a(torch.tanh(x0))).mean()), rel=1e-5)
    # Backward of call 1 fires first. d(sum of outputs)/d(call 1's output) is the column sum of b's weight,
    # so that is what the row labelled call 1 must hold.
    grad_out = {r["call"]: r for r in recorded if r["role"] == "grad_output.0" and r["sample_index"] == 0}
    assert set(grad_out) == {0, 1}
    expected = float(torch.linalg.vector_norm(model.b.weight.sum(0)))
    assert grad_out[1]["l2_norm"] == pytest.approx(expected, rel=1e-5)
    assert grad_out[0]["l2_norm"] != pytest.approx(expected, rel=1e-3)


def test_handles_removed_also_when_the_run_raises(tiny: nn.Module) -> None:
    specs = bind(tiny, *[(HookSpec(kind=k), ["features.0"]) for k in HookKind])
    with pytest.raises(RuntimeError, match="boom"):
        with HookSession(tiny, specs) as session:
            session.capture(resolve_layers(tiny, ["features.2"]))
            assert count_hooks(tiny) > 0
            raise RuntimeError("boom")
    assert count_hooks(tiny) == 0
    assert all(m.inplace for m in tiny.modules() if hasattr(m, "inplace"))


def test_state_is_per_batch(tiny: nn.Module) -> None:
    specs = bind(tiny, (HookSpec(kind=HookKind.forward), ["features.0"]))
    with HookSession(tiny, specs) as session:
        capture = session.capture(resolve_layers(tiny, ["features.2"]))
        for index in range(3):
            session.begin_batch(2, index)
            with torch.enable_grad():
                tiny(torch.randn(2, 3, 8, 8))
            assert len(capture.outputs["features.2"]) == 1
            columns = session.end_batch()
            assert len(columns["layer"]) == 2  # this batch's rows only
            assert capture.outputs["features.2"] == [], "captures are dropped at the end of each batch"


def test_saved_tensors_are_clones_of_pre_inplace_values(tiny: nn.Module, tmp_path) -> None:
    from safetensors.torch import load_file

    spec = HookSpec(kind=HookKind.forward, save_tensors=True)
    x = torch.randn(2, 3, 8, 8)
    with HookSession(tiny, bind(tiny, (spec, ["features.0"])), tensor_dir=tmp_path) as session:
        session.begin_batch(2, 0)
        with torch.no_grad():
            tiny(x)
        columns = session.end_batch()
    saved = load_file(str(tmp_path / columns["tensor_file"][0]))[columns["tensor_key"][0]]
    with torch.no_grad():
        torch.testing.assert_close(saved, tiny.features[0](x))
    assert float(saved.min()) < 0  # the in-place ReLU after it did not overwrite the saved copy


def test_every_public_name_imports_from_runner_hooks() -> None:
    """The package re-exports what callers imported from the old module, and the split pieces."""
    import runner.hooks as hooks

    names = {"HookSession", "BoundHook", "Capture", "Replacement", "map_tensors", "keyed_noise", "count_hooks",
             "disable_inplace", "restore_inplace", "inplace_disabled", "GRADIENT_KINDS", "HOOKS_SCHEMA",
             "STAT_NAMES", "InplaceOff", "SpecHooks", "TensorSaver"}  # fmt: skip
    assert names <= set(hooks.__all__)
    assert all(getattr(hooks, n) is not None for n in names)
    assert hooks.HOOKS_SCHEMA.names[:3] == ["layer", "layer_index", "module_type"]


def test_inplace_switch_is_a_handle_removed_once() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.ReLU(inplace=False), nn.ReLU(inplace=True))
    switch = InplaceOff(model)
    assert [m.inplace for m in model] == [False, False, False]
    switch.remove()
    assert [m.inplace for m in model] == [True, False, True], "only the modules it switched are switched back"
    model[0].inplace = False  # the caller's own choice after the switch is gone
    switch.remove()
    assert model[0].inplace is False, "a second remove() changes nothing"


def test_failed_start_removes_the_inplace_switch_with_the_hooks(tiny: nn.Module) -> None:
    """The in-place switch is one of the session's handles: a spec refused at `__enter__` undoes it with the hooks."""
    bad = HookSpec(kind=HookKind.forward, action=HookAction.clamp)  # a clamp without min or max
    specs = bind(tiny, (HookSpec(kind=HookKind.backward), ["features.0"]), (bad, ["features.2"]))
    with pytest.raises(RunnerError, match="clamp needs min, max or both"):
        with HookSession(tiny, specs):
            pass
    assert count_hooks(tiny) == 0
    assert tiny.features[1].inplace is True and tiny.features[3].inplace is True


def test_tensor_saver_writes_one_clone_file_per_batch(tmp_path) -> None:
    from safetensors.torch import load_file

    saver = TensorSaver(tmp_path / "tensors")
    saver.begin_batch(4)
    t = torch.arange(6.0).reshape(2, 3)  # (B, D)
    assert saver.keep("x|forward|output|0", t) == "batch-000004.safetensors"
    t.zero_()  # an in-place op after the hook must not reach the kept copy
    saver.flush()
    files = sorted(p.name for p in (tmp_path / "tensors").iterdir())
    assert files == ["batch-000004.safetensors"], "one file, named by the first sample; no .tmp left behind"
    saved = load_file(str(tmp_path / "tensors" / files[0]))["x|forward|output|0"]
    torch.testing.assert_close(saved, torch.arange(6.0).reshape(2, 3))
    saver.begin_batch(6)
    saver.flush()  # nothing kept: no empty file
    assert len(list((tmp_path / "tensors").iterdir())) == 1
    unsaved = TensorSaver(None)
    unsaved.begin_batch(0)
    assert unsaved.keep("k", t) == "batch-000000.safetensors"
    unsaved.flush()  # no directory: named for the rows, never written
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1


def test_recording_paused_keeps_nothing_but_modifications_still_apply(tiny: nn.Module) -> None:
    """The runner's own forwards (metrics, faithfulness, Score-CAM's masks, MPRT) run inside `recording_paused`:
    `record` hooks keep nothing, call counts are as before, and a modifying hook still changes the model."""
    specs = bind(
        tiny,
        (HookSpec(kind=HookKind.pre), ["features.0"]),
        (HookSpec(kind=HookKind.forward, action=HookAction.zero), ["features.2"]),
    )
    x = torch.randn(2, 3, 8, 8)
    with HookSession(tiny, specs) as session:
        session.begin_batch(2, 0)
        tiny(x)
        with session.recording_paused():
            paused = tiny(x)
            tiny(x)
        columns = session.end_batch()
    assert rows(columns) and {r["call"] for r in rows(columns)} == {0} and len(rows(columns)) == 2
    with torch.no_grad():
        torch.testing.assert_close(paused, tiny.fc(torch.zeros(2, 8)))  # features.2 zeroed inside the pause too


@pytest.mark.parametrize("method", ["method=scorecam", "method=captum", "method=gradcam"])
def test_metrics_and_score_cam_forwards_do_not_reach_record_hooks(tmp_path, method: str) -> None:
    """A `record` pre-hook on the first conv: one row per sample and call 0, not one per perturbed forward of
    Score-CAM's masks, captum's integrated-gradient steps, faithfulness and the evaluation metrics."""
    import pandas as pd

    from runner import app
    from tests.conftest import make_config

    config = make_config(
        "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,16,16]",
        "data.count=3", "data.batch_size=2", "data.num_classes=5", "layers.include=[features.2]", method,
        "hooks=[{kind: pre, layers: [features.0]}]", "method.faithfulness.enabled=true", "method.faithfulness.steps=4",
        "method.evaluation.metrics=[faithfulness_correlation]", "method.evaluation.faithfulness_correlation_runs=4",
    )  # fmt: skip
    result = app.run(config, tmp_path / "out")
    hooks = pd.read_parquet(result.tables["hooks"])
    assert len(hooks) == 3 and hooks["call"].tolist() == [0, 0, 0] and sorted(hooks["sample"]) == [0, 1, 2]
    assert len(pd.read_parquet(result.tables["evaluation"])) == 3  # the metric ran


def test_mprt_forwards_do_not_reach_record_hooks(tmp_path) -> None:
    """MPRT with Score-CAM inside: the trained model's masked forwards and the copy's steps are the method's own."""
    import pandas as pd

    from runner import app
    from tests.conftest import make_config

    config = make_config(
        "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,16,16]",
        "data.count=2", "data.batch_size=2", "data.num_classes=5", "layers.include=[features.2]", "method=mprt",
        "method.inner=scorecam", "method.max_steps=2", "method.similarities=[spearman]",
        "hooks=[{kind: forward, layers: [features.0]}]",
    )  # fmt: skip
    result = app.run(config, tmp_path / "out")
    hooks = pd.read_parquet(result.tables["hooks"])
    assert len(hooks) == 2 and hooks["call"].tolist() == [0, 0]


def test_reinitialise_is_a_reversible_edit_the_session_owns() -> None:
    """Re-initialised in place from a forked seed; `remove()` and the session's close restore the same tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 6, 6))  # materialise the lazy layer, move the batch-norm statistics
    conv, bn = model[0], model[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight, running_mean = conv.weight, bn.running_mean
    rng = torch.get_rng_state()
    with HookSession(model, []) as session:
        edit = session.reinitialise([conv, bn], seed=5)
        assert torch.equal(torch.get_rng_state(), rng)  # a forked random state
        expected = nn.Conv2d(3, 4, 3)
        torch.manual_seed(5)
        expected.reset_parameters()
        assert torch.equal(conv.weight, expected.weight) and (bn.running_mean == 0).all()
        edit.remove()
        edit.remove()  # idempotent
        assert conv.weight is weight and bn.running_mean is running_mean  # the same tensors, values put back
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        with pytest.raises(RuntimeError, match="boom"):
            with HookSession(model, []) as inner:
                inner.reinitialise([conv], seed=1)
                inner.reinitialise([conv], seed=2)  # stacked edits come off last first
                raise RuntimeError("boom")
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        session.reinitialise([model[3]], seed=3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # closed: restored
    assert session._handles == []


# ---- add_noise: noise keyed per sample, not per batch ----------------------------------------------------------------
def test_add_noise_is_the_same_per_sample_at_batch_sizes_1_3_4() -> None:
    model = frozen(nn.Sequential(nn.Identity()))
    x = torch.zeros(12, 5)  # 12 samples; the output is exactly the noise
    spec = HookSpec(kind=HookKind.forward, action=HookAction.add_noise, std=1.0, seed=3)
    by_size = {}
    for size in (1, 3, 4):
        outs = []
        with HookSession(model, [BoundHook(spec, resolve_layers(model, ["0"]))]) as session:
            for first in range(0, 12, size):
                session.begin_batch(size, first)
                outs.append(model(x[first : first + size]))
        by_size[size] = torch.cat(outs)  # (12, 5)
    torch.testing.assert_close(by_size[1], by_size[3], rtol=0, atol=0)
    torch.testing.assert_close(by_size[1], by_size[4], rtol=0, atol=0)
    assert len({tuple(r.tolist()) for r in by_size[1]}) == 12  # each sample has its own noise
    # A resumed run starts at a later batch with a fresh session: sample 8 gets the same noise.
    with HookSession(model, [BoundHook(spec, resolve_layers(model, ["0"]))]) as session:
        session.begin_batch(4, 8)
        torch.testing.assert_close(model(x[8:12]), by_size[1][8:12], rtol=0, atol=0)


@pytest.mark.slow
def test_add_noise_rows_do_not_depend_on_batch_size_in_a_run(tmp_path: Path) -> None:
    tiny = [
        "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,5,5]",
        "data.count=6", "data.num_classes=5", "method=record", "output.shard_batches=1", "layers.include=[features.0]",
        "hooks=[{kind: forward, action: add_noise, std: 0.5, layers: [features.0]}, {kind: forward, layers: [features.0]}]",
    ]  # fmt: skip
    tables = {}
    for size in (1, 4):
        result = app.run(make_config(*tiny, f"data.batch_size={size}"), tmp_path / str(size))
        frame = pd.read_parquet(result.tables["hooks"]).sort_values(["sample", "role"])
        tables[size] = frame[["sample", "mean", "std", "min", "max"]].reset_index(drop=True)
    # (5x5 inputs: 150 values a sample, a size at which torch's old one-generator draws differed by batch size)
    pd.testing.assert_frame_equal(tables[1], tables[4])
