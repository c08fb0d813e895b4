"""The real CLI: exit codes, one clear message, `--cfg job`, and a real multirun.

Most tests run `python -m runner` in this process (tests.conftest.run_cli: the same __main__, argv and
stderr, without a second interpreter's start-up); a few run it in a subprocess, so that the process
boundary itself (the exit status, stderr) stays tested."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import runner.app as app
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
SMALL_VGG = ["experiment=gradcam_vgg16", "debug=tiny", "model.weights=null"]  # 32 px, chelsea and coffee

pytestmark = pytest.mark.slow


def process_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m runner ARGS progress=false` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "runner", *args, "progress=false"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


cli = run_cli  # in this process: see the module docstring


@pytest.mark.process
def test_gradcam_vgg16_writes_parquet_and_says_where(tmp_path: Path) -> None:
    done = process_cli(*SMALL_VGG, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert f"results: {tmp_path}" in done.stderr
    frame = pd.read_parquet(tmp_path / "cam.parquet")
    assert len(frame) == 2 * 13


def assert_one_clear_error(done: subprocess.CompletedProcess, out: Path, message: str) -> None:
    """Exit 2, the message on stderr, no traceback there, no results written."""
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(out.rglob("*.parquet*"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("layers.include=[features.99]", "Layer 'features.99' does not exist"),
        ("model.name=vgg61", "Unknown model 'vgg61'"),
        ("model.checkpoint=/nowhere/x.pt", "Checkpoint file not found: /nowhere/x.pt"),
        ("+model.nmae=vgg16", "Key 'nmae' not in 'ModelConfig'"),
        ("layers.include=[blocks.*]", "'blocks.*' matches no module"),
        ("layers.include=[classifier.0]", "needs spatial activations"),
        ("output.dir=/proc/runner-cannot-write", "Cannot write results to /proc/runner-cannot-write"),
        ("method.target=fixed", "method.target=fixed needs method.class_ids"),
    ],
)
def test_bad_input_exits_2_with_one_message(tmp_path: Path, override: str, message: str) -> None:
    done = cli(*SMALL_VGG, override, f"hydra.run.dir={tmp_path}")
    assert_one_clear_error(done, tmp_path, message)
    assert "Traceback" in (tmp_path / "__main__.log").read_text()  # the detail is kept in the run's log


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.bach_size=2", "bach_size"),  # misspelled key
        ("data.batch_size=four", "four"),  # wrong type
        ("hooks=[{kind: sideways}]", "sideways"),  # unknown hook kind
        ("hooks=[{kind: forward, action: explode}]", "explode"),  # unknown action
        ("model=vgg61", "vgg61"),  # no such config group option
    ],
)
def test_config_errors_exit_2_at_start(tmp_path: Path, override: str, message: str) -> None:
    assert_one_clear_error(cli(*SMALL_VGG, override, f"hydra.run.dir={tmp_path}"), tmp_path, message)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.bach_size=2", "bach_size"),  # Hydra's own error (its exit 1 becomes 2 in __main__)
        ("model.name=vgg61", "Unknown model 'vgg61'"),  # the runner's RunnerError
    ],
)
@pytest.mark.process
def test_bad_input_exits_2_in_a_real_process(tmp_path: Path, override: str, message: str) -> None:
    """The same as the in-process tests above, through the process boundary."""
    assert_one_clear_error(process_cli(*SMALL_VGG, override, f"hydra.run.dir={tmp_path}"), tmp_path, message)


@pytest.mark.parametrize("name", ["../../../../escaped", "nested/run", ".."])
def test_a_run_name_cannot_leave_the_output_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The run folder is outputs/<date>/<time>_<name>: a name with a path in it is refused before Hydra makes
    any folder or log file, wherever it would have led."""
    here = tmp_path / "a" / "b" / "c" / "d"  # deep enough that ../../../../ stays inside tmp_path
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    done = cli(*SMALL_VGG, f"name={name}")
    assert done.returncode == 2
    assert f"name={name!r} cannot name a run's folder" in done.stderr and "Traceback" not in done.stderr
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # nothing written, inside outputs/ or out of it


def test_fixed_targets_without_classes_are_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decided by the config alone, so no model is built: the spy on build_model must stay unused."""
    built: list[object] = []
    monkeypatch.setattr(app, "build_model", lambda cfg: built.append(cfg))
    done = cli(*SMALL_VGG, "method.target=fixed", f"hydra.run.dir={tmp_path}")
    assert_one_clear_error(done, tmp_path, "method.target=fixed needs method.class_ids=[ID]")
    assert built == []


def test_cfg_job_prints_the_composed_config() -> None:
    done = cli("--cfg", "job", "experiment=gradcam_vgg16")
    assert done.returncode == 0
    assert "name: vgg16" in done.stdout and "features.*:Conv2d" in done.stdout


def test_multirun_sweep(tmp_path: Path) -> None:
    done = cli(
        "-m",
        *SMALL_VGG,
        "data.photos=[chelsea]",
        "method.target=predicted,fixed",
        "method.class_ids=[7]",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert done.returncode == 0, done.stderr
    frames = [pd.read_parquet(tmp_path / str(i) / "cam.parquet") for i in (0, 1)]
    assert (frames[1]["target"] == 7).all()
    assert len(frames[0]) == len(frames[1]) == 13


# ---- bad inputs: one clear message, exit 2 ---------------------------------------------------------------------------
def assert_one_line(done: subprocess.CompletedProcess, out: Path, message: str) -> None:
    assert_one_clear_error(done, out, message)
    errors = [line for line in done.stderr.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1 and message in errors[0], done.stderr


SYNTHETIC = ["data=synthetic", "data.count=2", "data.batch_size=1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["device=meta"], "device=meta: use auto, cpu"),
        ([*SYNTHETIC, "data.shape=[3,32]"], "one sample of an image model is [channels, height, width]"),
        (["data.image_size=16"], "too small for the model's downsampling"),
        ([*SYNTHETIC, "data.shape=[3,60000,60000]"], "43.2 GB per sample"),
        (["hooks=[{kind: forward, action: clamp, min: 1, max: 0}]"], "min=1.0 is above max=0.0"),
        (["hooks=[{kind: forward, action: add_noise, std: -1}]"], "std=-1.0"),
        (["method.faithfulness.enabled=true", "method.faithfulness.steps=1000000"], "above the bound of 1000"),
        (["data.photos=[]"], "data.photos is empty"),
        (["data.photos=[chelseaa]"], "Photos shipped with scikit-image: astronaut"),
        (["layers.exclude=[features.*]"], "Narrow layers.exclude"),
        (
            [
                "model=resnet18",
                "model.weights=null",
                "layers.include=[layer4]",
                "hooks=[{kind: backward, layers: [layer1.0.bn2]}]",
            ],
            "A `backward` hook on 'layer1.0.bn2' (BatchNorm2d) cannot run",
        ),  # fmt: skip
    ],
)
def test_bad_inputs_give_one_clear_message(tmp_path: Path, overrides: list[str], message: str) -> None:
    assert_one_line(run_cli(*SMALL_VGG, *overrides, f"hydra.run.dir={tmp_path}"), tmp_path, message)


@pytest.mark.slow
def test_sweep_that_stops_at_a_bad_job_names_the_jobs_not_run(tmp_path: Path) -> None:
    done = run_cli(
        "-m", *SMALL_VGG, "data.photos=[chelsea]", "method.target=fixed,predicted,label", f"hydra.sweep.dir={tmp_path}"
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1
    assert "job #0 (method.target=fixed) failed" in errors[0]
    assert "2 job(s) not run: #1 (method.target=predicted), #2 (method.target=label)" in errors[0]
    assert f"hydra.sweep.dir={tmp_path}" in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["a: b: c", "@v2", "*best"])
def test_override_values_that_are_not_plain_yaml_run(tmp_path: Path, name: str) -> None:
    done = run_cli(*SMALL_VGG, "data.photos=[chelsea]", "layers.include=[features.28]", f"name={name}",
               f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert set(pd.read_parquet(tmp_path / "cam.parquet")["sweep.name"]) == {name}
