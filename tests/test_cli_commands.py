"""The `runner` console command: help, entry point, start-up without torch, the schema snapshot, `runner ls`."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from runner.commands import cli
from runner.commands import ls as ls_command
from runner.store import runs as listing
from runner.store.writer import DirectoryLock
from tests.conftest import CONF, run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,8,8]",
    "data.count=8",
    "data.batch_size=2",
    "data.num_classes=5",
    "output.shard_batches=1",
    "layers.include=[features.0]",
    "hooks=[{kind: forward, layers: [features.2]}]",
]
# Runs `python -m runner ARGV` as the console does, then says whether torch was imported.
PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['runner', *sys.argv[1:]]\n"
    "code = 0\n"
    "try:\n"
    "    runpy.run_module('runner', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    "print('TORCH_IMPORTED', 'torch' in sys.modules, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def probe(*argv: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip


def torch_imported(done: subprocess.CompletedProcess) -> bool:
    return done.stderr.rsplit("TORCH_IMPORTED", 1)[1].split()[0] == "True"


def group_block(text: str, group: str) -> str:
    """A config group's options as the help lists them: its line and the continuation lines below it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {group} "))
    block = [lines[start].split(None, 1)[1]]
    for line in lines[start + 1 :]:
        if not line.startswith("    "):  # the next group (two spaces) or the end of the list
            break
        block.append(line.strip())
    return ", ".join(part.strip(", ") for part in block)


# ---- help and the console entry point ---------------------------------------------------------------------------
def test_help_names_the_groups_their_options_and_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for group, options in {
        "experiment": ["gradcam_vgg16", "patching_effnet", "default*"],
        "method": ["gradcam*", "scorecam", "patching"],
        "model": ["vgg16", "efficientnet_lite0*"],
        "data": ["synthetic", "skimage_photos*"],
        "hydra/launcher": ["slurm_gpu"],
    }.items():
        for option in options:
            assert option in group_block(text, group).split(", "), (group, option)
    for pointer in ("runner ls [DIR]", "runner layers", "--cfg job", "hydra/launcher", "--hydra-help"):
        assert pointer in text
    assert "Powered by Hydra" not in text and "== Config ==" not in text


@pytest.mark.slow
@pytest.mark.process
def test_python_m_runner_help_is_ours_and_hydra_help_is_hydras(tmp_path: Path) -> None:
    ours = subprocess.run([sys.executable, "-m", "runner", "-h"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and "Config groups" in ours.stdout
    hydras = probe("--hydra-help", cache=tmp_path)
    assert hydras.returncode == 0 and "Hydra (" in hydras.stdout and "Config groups" not in hydras.stdout


@pytest.mark.slow
@pytest.mark.process
def test_console_entry_point_exists_and_runs() -> None:
    (entry,) = entry_points(group="console_scripts", name="runner")
    assert entry.value == "runner.commands.cli:main" and entry.load() is cli.main
    script = Path(sys.executable).parent / "runner"
    done = subprocess.run([str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Config groups" in done.stdout


@pytest.mark.slow
def test_unknown_subcommand_like_word_is_a_hydra_override_error() -> None:
    done = run_cli("lss")  # not a subcommand: Hydra's own one-line error, exit 2 as before
    assert done.returncode == 2 and "lss" in done.stderr


# ---- start-up without torch ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.process
def test_help_and_ls_do_not_import_torch(tmp_path: Path) -> None:
    for argv in (["--help"], ["ls", str(tmp_path)]):
        done = probe(*argv, cache=tmp_path)
        assert done.returncode == 0, done.stderr
        assert not torch_imported(done), argv


@pytest.mark.slow
@pytest.mark.process
def test_cfg_job_composes_against_the_real_schemas_without_torch(tmp_path: Path) -> None:
    args = ["--cfg", "job", "experiment=patching_effnet", "method.patching.top_k=3", "data.batch_size=3"]
    done = probe(*args, cache=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not torch_imported(done)
    assert "    top_k: 3" in done.stdout and "batch_size: 3" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.bach_size=2", "Key 'bach_size' not in 'SkimagePhotosConfig'"),
        ("method.target=nope", "Invalid value 'nope', expected one of [predicted, label, fixed, topk]"),
        ("method=scorecam method.score_chunk=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
@pytest.mark.process
def test_cfg_job_refuses_with_the_option_schemas_without_torch(tmp_path: Path, override: str, message: str) -> None:
    """The schemas `--cfg job` composes with are the options' own classes (no snapshot, no torch)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        used = compose(config_name="config", overrides=["method=scorecam"])
        assert OmegaConf.get_type(used.method).__module__ == "runner.options.method.scorecam"
        with pytest.raises(ConfigCompositionException) as caught:
            compose(config_name="config", overrides=override.split())
    assert message in f"{caught.value} {caught.value.__cause__}"
    done = probe("--cfg", "job", *override.split(), cache=tmp_path)
    assert done.returncode != 0 and not torch_imported(done)
    assert message in done.stderr


# ---- runner ls ----------------------------------------------------------------------------------------------------
def ls(root: Path, full: bool = False) -> str:
    return ls_command.format_listing(listing.find(root), full=full)


def fake_run(path: str, experiment: str, method: str, status: str = "complete") -> listing.RunInfo:
    """A run as `find` reports it, without a folder: `status` complete, partial or failed."""
    error = "Layer 'nowhere' does not exist in the model." if status == "failed" else ""
    run = listing.RunInfo(Path(path), experiment, [f"experiment={experiment}"], status, 2, 4, {"cam": 8}, error)
    run.method = method
    return run


def test_ls_is_short_by_default_one_line_per_experiment_and_the_runs_that_need_something() -> None:
    """55 runs of 5 experiments, 2 of them not complete: 1 + 5 lines, and 3 for each run that needs something (its
    state, its error or nothing, the command that resumes it); `--all` lists every run."""
    experiments = [("gradcam_effnet", "gradcam"), ("patching_effnet", "patching"), ("mprt_effnet", "mprt"),
                   ("patching_lm_induction", "lm_patching"), ("causal_tracing_lm", "lm_patching")]  # fmt: skip
    found: list[listing.RunInfo | listing.SweepInfo] = []
    for i in range(55):
        experiment, method = experiments[i % 5]
        status = {7: "partial", 11: "failed"}.get(i, "complete")
        found.append(
            fake_run(f"outputs/2026-11-{10 + i // 5:02d}/10-00-{i:02d}_{experiment}", experiment, method, status)
        )
    text = ls_command.format_listing(found)
    lines = text.splitlines()
    assert len(lines) == 1 + 5 + 2 + 3, text  # header, experiments, partial (state, resume), failed (+ error)
    assert lines[0].startswith("55 runs and 0 sweeps") and "runner ls --all" in lines[0]
    gradcam = next(line for line in lines if line.startswith("gradcam_effnet (gradcam)"))
    assert "11 runs [complete]" in gradcam
    assert gradcam.endswith("latest complete: outputs/2026-11-20/10-00-50_gradcam_effnet")
    mprt = next(line for line in lines if line.startswith("mprt_effnet (mprt)"))
    assert "11 runs [10 complete, 1 partial]" in mprt
    assert "  outputs/2026-11-10/10-00-02_mprt_effnet" not in text  # a complete run is counted, not listed
    assert "  outputs/2026-11-11/10-00-07_mprt_effnet  [partial, 2 of 4 shards]" in lines
    assert "  outputs/2026-11-12/10-00-11_patching_effnet  [failed, 2 of 4 shards]" in lines
    assert sum(line.lstrip().startswith("resume: runner experiment=") for line in lines) == 2
    assert "    error: Layer 'nowhere' does not exist" in text
    full = ls_command.format_listing(found, full=True).splitlines()
    assert len(full) == 55 * 2 + 2 * 1 + 1  # each run and its overrides; both resume lines; the failed one's error


def test_ls_a_config_error_is_refused_not_resumable_and_the_latest_is_the_last_finished(tmp_path: Path) -> None:
    """A run stopped by a config error before any work is `refused`, with no resume command (it would stop there
    again); the latest complete run is the one that finished last, marked when it ran under a debug preset; runs of
    one experiment on two models are two groups."""
    refused = tmp_path / "refused"
    (refused / ".hydra").mkdir(parents=True)
    (refused / ".hydra" / "config.yaml").write_text("name: default\nmethod: {name: lm_patching}\n")
    (refused / ".hydra" / "overrides.yaml").write_text("- method=lm_patching\n- target=logit\n")
    (refused / "__main__.log").write_text("[ERROR] method=lm_patching measures a language model's answer: ...\n")
    info = listing.run_info(refused)
    assert info.status == "refused"
    text = ls_command.format_listing([info])
    assert "[refused: stopped before any work]" in text and "resume:" not in text and "run again" in text

    def done(path: str, finished: float, overrides: list[str], model: str) -> listing.RunInfo:
        run = fake_run(path, "ioi_smollm2", "lm_patching")
        run.overrides, run.finished, run.model = ["experiment=ioi_smollm2", *overrides], finished, model
        return run

    found: list[listing.RunInfo | listing.SweepInfo] = [
        done("outputs/a_long_run", 200.0, [], "hf_lm:smollm2-135m"),  # started first, finished last
        done("outputs/b_tiny_run", 100.0, ["debug=tiny"], "hf_lm:smollm2-135m"),
        done("outputs/c_own_model", 50.0, ["model.name=/my/model"], "hf_lm:/my/model"),
    ]
    lines = ls_command.format_listing(found).splitlines()
    smol = next(line for line in lines if line.startswith("ioi_smollm2 (hf_lm:smollm2-135m, lm_patching)"))
    assert "2 runs" in smol and smol.endswith("latest complete: outputs/a_long_run")
    own = next(line for line in lines if line.startswith("ioi_smollm2 (hf_lm:/my/model, lm_patching)"))
    assert "1 run " in own
    found[0].finished = 10.0  # now the tiny run finished last: named latest, and marked
    assert "latest complete: outputs/b_tiny_run (debug=tiny)" in ls_command.format_listing(found)


@pytest.mark.slow
def test_ls_complete_partial_and_the_resume_command_that_finishes_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert run_cli(*TINY, f"hydra.run.dir={run}").returncode == 0
    (info,) = listing.find(tmp_path)
    assert info.status == "complete" and info.shards_done == 4 and info.shards_total == 4
    assert info.tables == {"cam": 8, "hooks": 8}  # 8 samples x 1 layer; 8 samples x 1 hooked layer
    assert info.experiment == "default" and "data.count=8" in info.overrides
    assert re.search(r"^default \(\S+, gradcam\) +1 run \[complete\]", ls(tmp_path), flags=re.M)  # model, method
    assert "[complete]" in ls(tmp_path, full=True) and "resume:" not in ls(tmp_path, full=True)

    manifest = json.loads((run / "manifest.json").read_text())  # a run killed after 3 of its 4 shards
    del manifest["shards"]["3"]
    manifest["complete"] = False
    (run / "manifest.json").write_text(json.dumps(manifest))
    (info,) = listing.find(tmp_path)
    assert (info.status, info.shards_done, info.shards_total) == ("partial", 3, 4)
    text = ls(tmp_path)
    assert "[partial, 3 of 4 shards]" in text
    command = next(line for line in text.splitlines() if "resume:" in line).split("resume: ", 1)[1]
    assert command == info.resume_command and command.endswith(f"hydra.run.dir={run}")
    argv = shlex.split(command)
    assert argv[0] == "runner"
    assert run_cli(*argv[1:]).returncode == 0  # the printed command finishes the run in place
    (info,) = listing.find(tmp_path)
    assert info.status == "complete" and info.tables == {"cam": 8, "hooks": 8}


@pytest.mark.slow
def test_ls_failed_damaged_and_running(tmp_path: Path) -> None:
    failed = tmp_path / "failed"
    assert run_cli(*TINY, "layers.include=[nowhere]", f"hydra.run.dir={failed}").returncode == 2
    ok = tmp_path / "ok"
    assert run_cli(*TINY, f"hydra.run.dir={ok}").returncode == 0
    found = {info.path.name: info for info in listing.find(tmp_path)}
    # stopped by the config before any work: not a run to resume (as it was, it would stop there again)
    assert found["failed"].status == "refused" and "nowhere" in found["failed"].error
    assert "resume: runner" not in ls(tmp_path) and "[refused: stopped before any work]" in ls(tmp_path)
    (ok / "cam.parquet" / "part-000001.parquet").write_bytes(b"not parquet")
    (info,) = [i for i in listing.find(tmp_path) if i.path == ok]
    assert info.status == "damaged" and "part-000001.parquet: unreadable rows, the manifest 2" in info.error
    with DirectoryLock(ok):  # another process's run holds the directory
        (info,) = [i for i in listing.find(tmp_path) if i.path == ok]
        assert info.status == "running"


@pytest.mark.slow
def test_ls_a_sweep_lists_its_jobs_by_what_varies(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    assert run_cli("-m", *TINY, "seed=0,1", f"hydra.sweep.dir={sweep}").returncode == 0
    (item,) = listing.find(tmp_path)
    assert isinstance(item, listing.SweepInfo)
    assert item.jobs_total == 2 and [job.status for job in item.jobs] == ["complete", "complete"]
    text = ls(tmp_path)
    assert "[sweep: 2 of 2 jobs complete]" in text and "seed=0,1" in text
    assert len(text.splitlines()) == 2  # the count and the sweep: its jobs are complete
    text = ls(tmp_path, full=True)
    assert "    overrides: seed=1" in text  # a job shows only its own overrides


def test_ls_of_a_missing_directory_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["ls", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "no runs"
