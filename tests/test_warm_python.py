"""The tests' `python -m runner` processes forked from a warm interpreter (tests/warm_python.py): a served child
writes what a cold process writes, in its own working directory with its own environment (PYTHONPATH included),
exits with the runner's status, is polled and signalled as a process of the test's own; what the server cannot
reproduce starts cold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_python

ROOT = Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, "-m", "runner"]
TINY = ["model._target_=tests.nets.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,8,8]",
        "data.num_classes=5", "debug=tiny", "progress=false", "method.pictures=false"]  # fmt: skip


def finished(command: list[str], **kwargs: object) -> tuple[subprocess.Popen, str, str]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    out, err = process.communicate(timeout=300)
    return process, out, err


@pytest.mark.process
def test_a_served_process_says_what_a_cold_one_says(monkeypatch: pytest.MonkeyPatch) -> None:
    served, out, err = finished([*RUNNER, "-h"], cwd=ROOT)
    assert getattr(served, "status_socket", None) is not None, warm_python.why_cold()  # forked by the server
    monkeypatch.setenv("RUNNER_COLD_PROCESSES", "1")
    cold, cold_out, cold_err = finished([*RUNNER, "-h"], cwd=ROOT)
    assert getattr(cold, "status_socket", None) is None
    assert (served.returncode, out, err) == (cold.returncode, cold_out, cold_err) and "Config groups" in out


@pytest.mark.process
def test_a_served_run_has_its_cwd_its_environment_and_its_exit_status(tmp_path: Path) -> None:
    """tests.nets is importable from tmp_path only through the PYTHONPATH given; the run's relative folder is
    tmp_path's; a bad override exits 2 with one message, as in a cold process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done, _, err = finished([*RUNNER, *TINY, "hydra.run.dir=relative"], cwd=tmp_path, env=env)
    assert getattr(done, "status_socket", None) is not None, warm_python.why_cold(env)
    assert done.returncode == 0, err
    assert list((tmp_path / "relative" / "cam.parquet").glob("part-*.parquet"))
    bad, _, err = finished([*RUNNER, *TINY, "data.bach_size=2"], cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "bach_size" in err and "Traceback" not in err


@pytest.mark.process
def test_a_served_process_is_polled_and_killed_as_a_child(tmp_path: Path) -> None:
    """While it runs, poll() says so and its parent is the server, not this process; SIGKILL ends it with -9."""
    slow = [*TINY, "model._target_=tests.nets.SlowNet", "data.count=400", f"hydra.run.dir={tmp_path}"]
    process = subprocess.Popen([*RUNNER, *slow], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert process.poll() is None
        parent = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == warm_python.Server.get().process.pid != os.getpid()
        time.sleep(0.5)
        assert process.poll() is None
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        if process.returncode is None:
            os.kill(process.pid, signal.SIGKILL)


def parents(log: Path) -> dict[int, int]:
    """Each ParentSeen process's pid: its parent's."""
    return dict(tuple(map(int, line.split())) for line in log.read_text().splitlines())  # type: ignore[misc]


@pytest.mark.process
def test_a_served_sweeps_joblib_workers_are_served_too(tmp_path: Path) -> None:
    """The loky workers of a served runner are the server's children, not the runner's, and the sweep's jobs finish as
    in a cold sweep. The thread counts joblib gives its workers are the server's own (under xdist, joblib's default)."""
    log = tmp_path / "log"
    seen = [*TINY, "model._target_=tests.nets.ParentSeen", f"+model.kwargs.log={log}"]
    sweep = [*RUNNER, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *seen, "seed=0,1",
             f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    server = warm_python.Server.get()
    threads = dict.fromkeys(warm_python.THREAD_COUNTS, str(server.loaded.threads))
    done, _, err = finished(sweep, cwd=ROOT, env={**os.environ, **threads})
    assert done.returncode == 0, err
    assert getattr(done, "status_socket", None) is not None, warm_python.why_cold({**os.environ, **threads})
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]
    workers = parents(log)
    assert len(workers) == 2 and done.pid not in workers
    assert set(workers.values()) == {server.process.pid}


@pytest.mark.process
def test_torchruns_ranks_are_served_too(tmp_path: Path) -> None:
    """torchrun started by a test is served, and so are its ranks (`-u -m runner`, a new session each); both finish
    and their parent is the server."""
    log = tmp_path / "log"
    seen = [*TINY, "model._target_=tests.nets.ParentSeen", f"+model.kwargs.log={log}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner",
                *seen, f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    threads = dict.fromkeys(
        warm_python.THREAD_COUNTS, str(warm_python.Server.get().loaded.threads)
    )  # else torchrun's 1
    done, _, err = finished(launcher, cwd=ROOT, env={**os.environ, **threads})
    assert done.returncode == 0, err
    assert getattr(done, "status_socket", None) is not None, warm_python.why_cold({**os.environ, **threads})
    ranks = parents(log)
    assert len(ranks) == 2 and set(ranks.values()) == {warm_python.Server.get().process.pid}


def test_what_the_server_cannot_reproduce_starts_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = {"executable": None, "preexec_fn": None, "close_fds": True, "pass_fds": (), "shell": False,
             "process_group": -1, "gid": None, "gids": None, "uid": None, "umask": -1, "restore_signals": True}  # fmt: skip
    loaded = warm_python.Loaded(warm_python._sensitive(os.environ), 1, {"KMP_INIT_AT_FORK": "FALSE"})
    running = type("Running", (), {"loaded": loaded, "process": None, "group": os.getpgrp()})
    monkeypatch.setattr(warm_python.Server, "_server", running)
    monkeypatch.setattr(warm_python.Server, "get", classmethod(lambda cls: cls._server))

    def served(args: object, **settings: object) -> dict[str, object] | None:
        return warm_python.served_command(args, {**plain, **settings})

    assert served([*RUNNER, "a=1"]) == {"module": "runner", "args": ["a=1"], "unbuffered": False}
    assert served([sys.executable, "-u", "-m", "runner", "a=1"])["unbuffered"] is True  # type: ignore[index]
    assert served([warm_python.TORCHRUN, "-m", "runner"])["entry"] == "torch.distributed.run:main"  # type: ignore[index]
    assert served([*RUNNER, "a=1"], env={**os.environ, "X": "1", "TORCHELASTIC_RUN_ID": "r", "TORCH_HOME": "/t"})
    assert served([*RUNNER, "a=1"], env={**os.environ, "OMP_NUM_THREADS": "1"}) is not None  # the server's count
    assert served([*RUNNER, "a=1"], env={**os.environ, "KMP_INIT_AT_FORK": "FALSE"}) is not None  # as torch sets it
    assert served([*RUNNER, "a=1"], env={**os.environ, "KMP_INIT_AT_FORK": "TRUE"}) is None
    assert served([sys.executable, "-c", "pass"]) is None
    assert served([sys.executable, "-m", "pytest"]) is None
    assert served(" ".join(RUNNER)) is None
    for key, value in [("preexec_fn", print), ("pass_fds", (5,)), ("close_fds", False), ("process_group", 0),
                       ("umask", 0o22), ("env", {**os.environ, "OMP_NUM_THREADS": "7"}),
                       ("env", {**os.environ, "TORCH_LOGS": "dynamo"})]:  # fmt: skip
        assert served([*RUNNER, "a=1"], **{key: value}) is None, key
    monkeypatch.setattr(running, "group", os.getpgrp() + 1)  # this process in a group of its own: its child too
    assert served([*RUNNER, "a=1"]) is None
    assert served([*RUNNER, "a=1"], start_new_session=True) is not None
    monkeypatch.setattr(running, "group", os.getpgrp())
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert served([*RUNNER, "a=1"]) is None  # the parent's own environment, changed since the server started
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("RUNNER_COLD_PROCESSES", "1")
    assert served([*RUNNER, "a=1"]) is None


def test_the_exit_code_of_system_exit_is_pythons(capsys: pytest.CaptureFixture[str]) -> None:
    assert [warm_python._exit_code(code) for code in (None, 0, 2, 256 + 3)] == [0, 0, 2, 3]
    assert warm_python._exit_code("stopped") == 1 and capsys.readouterr().err == "stopped\n"
