"""The tests' `python -m runner ...` processes, forked from a warm interpreter instead of started cold.

A `python -m runner` process spends about 4 s of CPU importing torch, torchvision, pandas, pyarrow and Hydra before
it runs anything: a tiny run takes 5.5 s started cold and 1.8 s forked from a process that imported them. Each pytest
process keeps one server (this file run as a script) that has imported those packages, none of the runner, and
forks one child per such Popen. The child is a real process, with its own pid, stdio, working directory,
environment, signals and exit status; it imports the runner from its own sys.path (its PYTHONPATH included) and runs
`runner.__main__` as `python -m` does, exit code, atexit handlers and an uncaught KeyboardInterrupt included.

Served only: `[sys.executable, "-m", "runner", ...]` with Popen's default process settings or a new session (no
preexec_fn, pass_fds, process group, user, group or umask; close_fds and restore_signals left on), and an environment equal
to the server's in every variable the imported packages read when they load (`SENSITIVE`). Anything else starts
cold, as does everything with RUNNER_COLD_PROCESSES=1. What a served child shares with its siblings: the hash seed
and the packages' import-time state.

The server, not the test, is a served child's parent, so the server waits for it and sends its wait status over a
socket of that child's own; `conftest`'s Popen (subprocess.Popen in the tests) waits and polls on that socket.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Read by the server's packages (OpenMP, MKL, OpenBLAS, torch, CUDA, Arrow, jemalloc) or by Python itself at start-up.
SENSITIVE = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "ARROW", "JE_",
             "MALLOC", "LD_", "PYTHON", "HYDRA")  # fmt: skip
PRELOADED = ("torch", "torchvision", "torchvision.models", "torchvision.transforms", "numpy", "pandas", "pyarrow",
             "pyarrow.parquet", "PIL.Image", "yaml", "omegaconf", "hydra", "hydra.main", "hydra.core.config_store",
             "hydra._internal.utils", "hydra._internal.instantiate._instantiate2")  # fmt: skip


def _sensitive(env: Any) -> dict[str, str]:
    pairs = ((os.fsdecode(k), os.fsdecode(v)) for k, v in env.items())
    return {k: v for k, v in pairs if k.startswith(SENSITIVE) and k != "PYTHONPATH"}


def runner_arguments(args: Any, settings: dict[str, Any]) -> list[str] | None:
    """The runner's arguments when this Popen (its args and _execute_child's settings) can be a served child."""
    if os.environ.get("RUNNER_COLD_PROCESSES") or isinstance(args, (str, bytes, os.PathLike)):
        return None
    argv = list(args)
    if len(argv) < 3 or not all(isinstance(a, str) for a in argv) or argv[:3] != [sys.executable, "-m", "runner"]:
        return None
    plain = {"executable": None, "preexec_fn": None, "close_fds": True, "pass_fds": (), "shell": False,
             "process_group": -1, "gid": None, "gids": None, "uid": None, "umask": -1,
             "restore_signals": True}  # fmt: skip
    if any(settings.get(key, value) != value for key, value in plain.items()):
        return None
    env = os.environ if settings.get("env") is None else settings["env"]
    if _sensitive(env) != Server.loaded_with():
        return None
    return argv[3:]


class Server:
    """This process's server, started on first use; one request at a time."""

    _lock = threading.Lock()
    _server: Server | None = None

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.process = subprocess.Popen(  # cold: this file, not the runner
            [sys.executable, __file__, str(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.control, self.sensitive = ours, _sensitive(env)
        if self.control.recv(16) != b"ready":
            raise RuntimeError("the warm Python server did not start")

    @classmethod
    def loaded_with(cls) -> dict[str, str]:
        """The variables its packages read when they loaded: the running server's, or those a server started now
        would read (this process's)."""
        running = cls._server is not None and cls._server.process.poll() is None
        return cls._server.sensitive if running else _sensitive(os.environ)  # type: ignore[union-attr]

    @classmethod
    def get(cls) -> Server:
        if cls._server is None or cls._server.process.poll() is not None:
            cls._server = cls()
        return cls._server

    def fork(self, request: dict[str, Any], stdio: list[int]) -> tuple[int, socket.socket]:
        """A served child's pid and the socket its wait status will come on."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self._lock:
            socket.send_fds(self.control, [json.dumps(request).encode()], [*stdio, theirs.fileno()])
        theirs.close()
        reply = ours.recv(64)
        if not reply:
            raise RuntimeError("the warm Python server did not fork")
        return int(reply), ours


def start(popen: subprocess.Popen, runner_args: list[str], cwd: Any, env: Any, new_session: bool, p2cread: int,
          c2pwrite: int, errwrite: int) -> None:  # fmt: skip
    """Popen._execute_child for a served child: its stdio is what a forked child would inherit (the parent's 0, 1, 2
    where Popen made no pipe), its cwd and environment those given or the parent's."""
    stdio = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
    where = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
    variables = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
    request = {"args": runner_args, "cwd": where, "env": variables, "new_session": new_session}
    popen.pid, popen.status_socket = Server.get().fork(request, stdio)
    popen._child_created = True


def wait_status(popen: subprocess.Popen, block: bool) -> tuple[int, int]:
    """(pid, wait status) of a served child, or (0, 0) while it runs and block is False (Popen._try_wait's contract)."""
    if not block and not select.select([popen.status_socket], [], [], 0)[0]:
        return 0, 0
    reply = popen.status_socket.recv(64)
    popen.status_socket.close()
    if not reply:
        raise ChildProcessError(f"the warm Python server ended before process {popen.pid}")
    return popen.pid, int(reply)


# ---- the server ------------------------------------------------------------------------------------------------------


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply = children.pop(pid, None)
        if reply is not None:
            try:
                reply.send(str(status).encode())
            except OSError:
                pass  # that Popen is gone
            reply.close()


def _exit_code(code: Any) -> int:
    """What Python exits with for SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request: dict[str, Any], stdio: list[int], inherited: list[int]) -> None:
    """In the forked child: become `python -m runner ARGS` started in its cwd with its environment; never returns."""
    import atexit
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    for fd in {*stdio, *inherited}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *BASE_PATH]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    sys.argv = ["-m", *request["args"]]
    code, interrupted = 0, False
    try:
        runpy.run_module("runner", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as Python's exit: wait for non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  # a closed pipe: nothing more to say
            pass
    if interrupted:  # as Python does on an uncaught KeyboardInterrupt: end by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def serve(control_fd: int) -> None:
    control = socket.socket(fileno=control_fd)
    for module in PRELOADED:
        importlib.import_module(module)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    control.send(b"ready")
    while True:
        readable = select.select([control, wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(children)
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
        if not message:
            return  # the tests' process ended
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            _child(request, fds[:3], [fds[3], control.fileno(), wake_read, wake_write,
                                      *(s.fileno() for s in children.values())])  # fmt: skip
        for fd in fds[:3]:
            os.close(fd)
        reply = socket.socket(fileno=fds[3])
        children[pid] = reply
        reply.send(str(pid).encode())
        _reap(children)


if __name__ == "__main__":
    BASE_PATH = [p for p in sys.path[1:]]  # without this file's folder, as `python -m` has the cwd there instead
    serve(int(sys.argv[1]))
