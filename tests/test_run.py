"""End to end through run(): composed configs in, Parquet tables out, no hook left behind."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

import runner.app as app
import runner.progress as progress
from runner.errors import RunnerError
from runner.hooks import count_hooks
from runner.results import read_metadata
from runner.schema import available_cpus
from tests.conftest import TinyNet, make_config
from tests.nets import ThreadsSeen  # noqa: F401  (TINY_TARGET names it here)
from tests.test_cli import SMALL_VGG

VGG_OFFLINE = ["debug=tiny", "model.weights=null", "data.limit=3"]  # 32 px, chelsea, coffee and rocket, batches of 2
ROOT = Path(__file__).resolve().parents[1]
TINY_NET = ["model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
            "data.num_classes=5", "layers.include=[features.0,features.2]", "hooks=[]"]  # fmt: skip


@pytest.fixture
def built_models(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every model a run builds, so tests can inspect it after the run."""
    seen: list = []
    original = app.build_model

    def spy(cfg):  # noqa: ANN001, ANN202
        bundle = original(cfg)
        seen.append(bundle.model)
        return bundle

    monkeypatch.setattr(app, "build_model", spy)
    return seen


@pytest.mark.slow
def test_gradcam_vgg16_one_row_per_sample_and_conv_layer(tmp_path: Path, built_models: list) -> None:
    result = app.run(make_config("experiment=gradcam_vgg16", *VGG_OFFLINE), tmp_path)
    frame = pd.read_parquet(result.tables["cam"])
    assert len(frame) == 3 * 13
    assert frame.groupby("layer").size().eq(3).all()
    assert set(frame["sample_id"]) == {"chelsea", "coffee", "rocket"}
    assert frame.loc[frame.sample_id == "chelsea", "label"].iloc[0] == 285
    for column in (
        "run_id",
        "experiment",
        "model",
        "method",
        "layer",
        "module_type",
        "predicted",
        "target",
        "score",
        "cam_mean",
        "cam_max",
        "map_height",
        "map_width",
        "map",
    ):
        assert column in frame.columns
    assert (frame["module_type"] == "Conv2d").all() and (frame["experiment"] == "gradcam_vgg16").all()
    assert (frame["map"].map(len) == frame["map_height"] * frame["map_width"]).all()
    assert (frame["target"] == frame["predicted"]).all()
    meta = read_metadata(result.tables["cam"])
    assert "name: gradcam_vgg16" in meta["config"] and meta["versions"]["torch"] and meta["git_commit"]
    assert count_hooks(built_models[0]) == 0
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow
def test_hooks_vgg16_rows_for_all_four_kinds(tmp_path: Path, built_models: list) -> None:
    result = app.run(make_config("experiment=hooks_vgg16", *VGG_OFFLINE), tmp_path)
    frame = pd.read_parquet(tmp_path / "hooks.parquet")
    assert set(frame["hook"]) == {"pre", "forward", "backward", "tensor"}
    conv28 = frame[(frame.layer == "features.28") & (frame.hook == "forward")]
    assert len(conv28) == 3 and (conv28["min"] < 0).all()  # the conv output before the in-place ReLU
    assert set(frame.loc[frame.hook == "backward", "role"]) == {"grad_input.0", "grad_output.0"}
    assert frame.groupby(["layer", "hook", "role", "call"]).size().eq(3).all()  # one row per sample
    assert "gradcam" not in result.tables
    assert count_hooks(built_models[0]) == 0
    relus = [m for m in built_models[0].modules() if type(m).__name__ == "ReLU"]
    assert relus and all(m.inplace for m in relus)  # turned off for the backward hooks, then restored


@pytest.mark.slow
def test_default_experiment_on_the_embedded_model(tmp_path: Path) -> None:
    """The real default: pretrained EfficientNet-Lite0, real photos, four hook kinds, Grad-CAM."""
    result = app.run(make_config("data.photos=[chelsea,coffee]"), tmp_path)
    cams = pd.read_parquet(result.tables["cam"])
    assert len(cams) == 2 * 5
    assert cams.set_index("sample_id")["predicted_name"].to_dict() == {"chelsea": "Egyptian cat", "coffee": "espresso"}
    hooks = pd.read_parquet(result.tables["hooks"])
    assert set(hooks["hook"]) == {"pre", "forward", "backward", "tensor"}
    swish = hooks[(hooks.layer == "_blocks.15._swish") & (hooks.hook == "forward")]
    assert sorted(swish["call"].unique()) == [0, 1]  # the shared activation, called twice per block


def test_hook_check_passes_on_the_embedded_model(tmp_path: Path) -> None:
    result = app.run(
        make_config("experiment=check_hooks_effnet", "data.photos=[chelsea]", "data.image_size=64"), tmp_path
    )
    frame = pd.read_parquet(result.tables["hook_check"])
    assert frame["passed"].all()
    assert len(frame.query("layer == '_blocks.3._swish'")["call"].unique()) == 2
    assert frame["layer"].nunique() == 1 + 16 + 16 + 1 + 1


@pytest.mark.slow
def test_bf16_is_close_to_fp32(tmp_path: Path) -> None:
    overrides = ["data.photos=[chelsea]", "data.image_size=128", "hooks=[]"]
    fp32 = pd.read_parquet(app.run(make_config(*overrides), tmp_path / "a").tables["cam"])
    bf16 = pd.read_parquet(app.run(make_config(*overrides, "precision=bf16"), tmp_path / "b").tables["cam"])
    assert (fp32["predicted"] == bf16["predicted"]).all()
    assert ((fp32["score"] - bf16["score"]).abs() / fp32["score"].abs() < 0.05).all()


@pytest.mark.slow
def test_bad_layer_fails_before_data_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_data(*args: object) -> None:
        raise AssertionError("data was loaded before the layers were checked")

    monkeypatch.setattr(app, "build_dataset", no_data)
    with pytest.raises(RunnerError, match="features.99"):
        app.run(make_config("experiment=gradcam_vgg16", "layers.include=[features.99]", *VGG_OFFLINE), tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_failure_mid_run_leaves_no_results_and_no_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built_models: list
) -> None:
    from runner.methods import cam_methods

    GradCAM = cam_methods()["gradcam"]

    calls = {"n": 0}
    original = GradCAM.run_batch

    def fails_on_second_batch(self, *args):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk on fire")
        return original(self, *args)

    monkeypatch.setattr(GradCAM, "run_batch", fails_on_second_batch)
    with pytest.raises(RuntimeError, match="disk on fire"):
        app.run(make_config("experiment=gradcam_vgg16", "hooks=[{kind: backward}]", *VGG_OFFLINE), tmp_path)
    assert calls["n"] == 2
    assert list(tmp_path.iterdir()) == []  # no table, no temporary file, no tensor folder
    assert count_hooks(built_models[0]) == 0


@pytest.mark.slow
def test_saved_tensors_sidecar(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = make_config(
        "experiment=hooks_vgg16", *VGG_OFFLINE, "hooks=[{kind: forward, layers: [features.28], save_tensors: true}]"
    )
    app.run(config, tmp_path)
    frame = pd.read_parquet(tmp_path / "hooks.parquet")
    row = frame.iloc[0]
    tensor = load_file(str(tmp_path / "tensors" / row["tensor_file"]))[row["tensor_key"]]
    assert tensor.shape == (2, 512, 2, 2)
    assert float(tensor[0].min()) == pytest.approx(row["min"])


# ---- threads: one count per run, whoever launched it ----------------------------------------------------------------
def threads_seen(log: Path) -> set[int]:
    return {int(line) for line in log.read_text().split()}


TINY_TARGET = ["model._target_=tests.test_run.ThreadsSeen", "model.weights=null", "data=synthetic",
               "data.shape=[3,8,8]", "data.count=2", "data.num_classes=5", "layers.include=[features.0]", "hooks=[]"]  # fmt: skip


@pytest.mark.slow
def test_a_run_computes_with_its_configured_threads_and_restores_the_callers(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    assert make_config().threads == available_cpus()  # the default: the CPUs this process may use, resolved
    log = tmp_path / "threads.log"
    app.run(make_config(*TINY_TARGET, f"+model.kwargs.log={log}", "threads=3"), tmp_path / "run")
    assert threads_seen(log) == {3}  # every forward of the run (the dry ones before the data too)
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_threads_are_part_of_the_resume_key(tmp_path: Path) -> None:
    from runner.store.provenance import resume_key

    tiny = [*TINY_TARGET, f"+model.kwargs.log={tmp_path / 'threads.log'}"]
    key3, details3 = resume_key(make_config(*tiny, "threads=3"), 8, 2)
    key4, details4 = resume_key(make_config(*tiny, "threads=4"), 8, 2)
    assert (details3["threads"], details4["threads"]) == (3, 4) and key3 != key4
    app.run(make_config(*tiny, "threads=3"), tmp_path / "run")
    with pytest.raises(RunnerError, match="what differs: threads: 3 -> 4"):
        app.run(make_config(*tiny, "threads=4"), tmp_path / "run")


def test_threads_must_be_positive() -> None:
    with pytest.raises(RunnerError, match="Out of range: threads=0"):
        make_config("threads=0")


def drawn(stderr: str) -> list[str]:
    """Every state of the progress bar as drawn, in order (tqdm starts each redraw with a carriage return)."""
    return [part.strip() for line in stderr.split("\n") for part in line.split("\r") if "%|" in part]


def on_screen(stderr: str) -> list[str]:
    """The lines as a terminal shows them: a carriage return goes back to the line's start and overwrites."""
    lines = []
    for line in stderr.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part) :]
        lines.append(shown.rstrip())
    return lines


def test_progress_moves_batch_by_batch_within_a_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "MININTERVAL", 0)  # every move drawn, however fast the batches
    config = make_config(*TINY_NET, "data.count=6", "data.batch_size=2", "progress=true")
    assert config.output.shard_batches >= 3  # the run's three batches are one shard
    app.run(config, tmp_path)
    counts = [int(m.group(1)) for state in drawn(capsys.readouterr().err) if (m := re.search(r"\b(\d+)/3\b", state))]
    assert counts == sorted(counts) and set(counts) == {0, 1, 2, 3}  # 0, then each batch as it ends


def test_patching_moves_the_bar_chunk_by_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One long batch: the bar moves with each chunk of patched variants, naming the layer and the count."""
    monkeypatch.setattr(progress, "MININTERVAL", 0)
    app.run(make_config(*TINY_NET, "data.count=1", "data.batch_size=1", "method=patching",
                        "method.patching.grid=[2,2]", "method.patching.chunk=1", "progress=true"), tmp_path)  # fmt: skip
    states = drawn(capsys.readouterr().err)
    inside = [s for s in states if "0/1 batches, batch 1: patching" in s]
    moves = [re.search(r"patching (\S+): (\d/4) variants", s).groups() for s in inside]
    # tqdm's monitor thread may redraw a state once more on a loaded machine: repeats of one state count once
    assert [m for i, m in enumerate(moves) if i == 0 or m != moves[i - 1]] == [
        (layer, f"{i}/4") for layer in ("features.0", "features.2") for i in range(1, 5)
    ]  # 4 cells per layer, one per chunk
    shares = [int(re.search(r"(\d+)%\|", s).group(1)) for s in inside]
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] == 100
    assert "1/1 batches" in states[-1]


def test_a_cam_batch_shows_its_faithfulness_and_metric_stages_without_moving_back(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch whose time goes into faithfulness and the metrics: the bar names each stage as it runs, and its
    position never goes back when a later stage counts from 0."""
    monkeypatch.setattr(progress, "MININTERVAL", 0)
    app.run(make_config(*TINY_NET, "data.count=2", "data.batch_size=2", "method.faithfulness.enabled=true",
                        "method.faithfulness.steps=4", "method.evaluation.metrics=[sparseness,complexity]",
                        "progress=true"), tmp_path)  # fmt: skip
    inside = [s for s in drawn(capsys.readouterr().err) if "0/1 batches, batch 1: " in s]
    notes = [re.search(r"batch 1: (.*?) +\d+%\|", s).group(1) for s in inside]
    assert [n for i, n in enumerate(notes) if i == 0 or n != notes[i - 1]] == [
        "faithfulness: layer 1/2",
        "faithfulness: layer 2/2",
        "metric sparseness (1/2)",
        "metric complexity (2/2)",
    ]
    shares = [int(re.search(r"(\d+)%\|", s).group(1)) for s in inside]
    assert shares == sorted(shares) and shares[-1] == 50  # the metrics' stage starts at 0: the bar stays put


def test_lm_patching_moves_the_bar_inside_its_one_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All pairs in one batch (as ioi_smollm2 runs them): the bar names the receiving runs, then each chunk of patched
    cells with its count, sites and layers, per direction, and only moves forward, to 100% of the batch."""
    monkeypatch.setattr(progress, "MININTERVAL", 0)
    app.run(make_config("experiment=patching_lm_induction", "data.batch_size=8", "data.limit=2",
                        "method.patching.chunk=2", "method.patching.directions=[denoising,noising]",
                        "progress=true"), tmp_path)  # fmt: skip
    inside = [s for s in drawn(capsys.readouterr().err) if "0/1 batches, batch 1: " in s]
    notes = [re.search(r"batch 1: (.*?) +\d+%\|", s).group(1) for s in inside]
    assert notes[0] == "lm_patching: the clean and corrupted runs"
    counts = {d: [re.search(r"(\d+)/(\d+) cells", n).groups() for n in notes if f"lm_patching {d}: " in n]
              for d in ("denoising", "noising")}  # fmt: skip
    for direction, seen in counts.items():
        done = [int(k) for k, _ in seen]
        total = int(seen[0][1])
        assert done == sorted(done) and done[0] == 0 and done[-1] == total and len(set(done)) > 3, direction
    assert any(re.search(r"cells \([a-z_, ]*resid_pre[a-z_, ]*, layer 1\)", n) for n in notes), notes
    shares = [int(re.search(r"(\d+)%\|", s).group(1)) for s in inside]
    assert shares == sorted(shares) and shares[-1] == 100


@pytest.mark.parametrize(
    ("method", "stages"),
    [("lm_grad_x_act", ["the forward of 2 prompts", "the backward to", "the rows"]),
     ("lm_logit_lens", ["the forward of 2 prompts", "the lens at 3 layers"]),
     ("lm_attention", ["the forward of 2 prompts", "the rows of 2 layers"])],
)  # fmt: skip
def test_every_lm_method_names_its_stages_inside_a_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, method: str, stages: list[str]
) -> None:
    monkeypatch.setattr(progress, "MININTERVAL", 0)
    app.run(make_config("model=hf_lm", "data=prompts", "data.file=induction", "data.limit=2", "data.batch_size=2",
                        f"method={method}", "progress=true"), tmp_path)  # fmt: skip
    inside = [s for s in drawn(capsys.readouterr().err) if "0/1 batches, batch 1: " in s]
    notes = list(dict.fromkeys(re.search(r"batch 1: (.*?) +\d+%\|", s).group(1) for s in inside))
    assert [n.split(": ", 1)[0] for n in notes] == [method] * len(notes)
    for stage, note in zip(stages, notes, strict=True):
        assert note.split(": ", 1)[1].startswith(stage), notes


class NoisyNet(TinyNet):
    """TinyNet that logs a line in the run's second batch and warns in its third, each right after a redraw."""

    calls = 0

    def forward(self, x):  # noqa: ANN001, ANN201
        import logging
        import time

        NoisyNet.calls += 1  # forwards: a probe, the input check, then one per batch
        if NoisyNet.calls == 4:
            logging.getLogger("runner").warning("a log line from inside the run")
        if NoisyNet.calls == 5:
            warnings.warn("a warning from inside the run", UserWarning, stacklevel=1)
        time.sleep(0.15)  # longer than the bar's redraw interval: every batch is drawn
        return super().forward(x)


@pytest.mark.slow
@pytest.mark.process
def test_bar_warnings_and_last_lines_in_a_real_process(tmp_path: Path) -> None:
    """A real process's stderr: the bar moves per batch, a warning and a log line from mid-run each get a line of
    their own (not glued to the bar's), and the last lines say how to open the report and load the tables."""
    done = subprocess.run(
        [sys.executable, "-m", "runner", *TINY_NET, "model._target_=tests.test_run.NoisyNet", "data.count=8",
         "data.batch_size=2", "output.shard_batches=8", "progress=true", "method.pictures=false", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    counts = {int(m.group(1)) for state in drawn(done.stderr) if (m := re.search(r"\b(\d+)/4\b", state))}
    assert counts == {0, 1, 2, 3, 4}
    screen = on_screen(done.stderr)
    warning = [line for line in screen if "UserWarning: a warning from inside the run" in line]
    assert len(warning) == 1 and re.fullmatch(
        r"/\S*test_run\.py:\d+: UserWarning: a warning from inside the run", warning[0]
    )
    assert "[WARNING] a log line from inside the run" in screen
    last = [line for line in screen if line][-3:]
    assert last == [
        f"[INFO] results: {tmp_path}",
        f"[INFO] report: runner report {tmp_path}",
        f'[INFO] tables: from runner.results import load; load("{tmp_path}")',
    ]


# ---- an input the model cannot take is refused before anything is written --------------------------------------------
@pytest.mark.slow
def test_probe_rejects_an_input_the_model_cannot_take(tmp_path: Path) -> None:
    config = make_config(*SMALL_VGG, "data.image_size=16")
    with pytest.raises(RunnerError, match="too small for the model's downsampling"):
        app.run(config, tmp_path)
    assert not list(tmp_path.rglob("*.parquet*"))
