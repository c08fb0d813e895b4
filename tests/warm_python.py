"""The tests' `python -m runner ...` processes, and the processes those start, forked from a warm interpreter instead
of started cold.

A `python -m runner` process spends about 4 s of CPU importing torch, torchvision, pandas, pyarrow and Hydra before
it runs anything: a tiny run takes 5.5 s started cold and 1.8 s forked from a process that imported them. Each pytest
process keeps one server (this file run as a script) that has imported those packages, none of the runner, and
forks one child per request. The child is a real process, with its own pid, stdio, working directory, environment,
signals and exit status; it imports what it runs from its own sys.path (its PYTHONPATH included) and runs it as
`python -m` (or the console script) does, exit code, atexit handlers and an uncaught KeyboardInterrupt included.

What is served (`served_command`):
- `[sys.executable, ("-u",) "-m", M, ...]` for M in SERVED_MODULES (the runner, torch's launcher) and the venv's
  `torchrun`, started by a Popen with the default process settings or a new session (no preexec_fn, pass_fds,
  process group, user, group or umask; close_fds and restore_signals left on): the tests' own (conftest's Popen) and
  those of served children (their subprocess.Popen is `ServedPopen` too), so torchrun's ranks are served;
- joblib's loky workers started by a served child (their `fork_exec`), with the descriptors they keep at the same
  numbers;
- only in a new session (torchrun's ranks) or when the asker is in the server's process group, where the child would
  be anyway: a sweep started in a session of its own has its workers in its group, and they start cold;
- only with an environment equal to the server's in every variable its packages read when they load (`SENSITIVE`),
  except a thread count (OMP_NUM_THREADS, ...) equal to the server's own, as joblib and torchrun set for their workers,
  and OpenMP's wait policy (`SPEED_ONLY`: how fast idle threads wake, not what they compute).
Anything else starts cold, as does everything with RUNNER_COLD_PROCESSES=1. What a served child shares with its
siblings: the hash seed and the packages' import-time state.

The server, not the process that asked, is a served child's parent, so the server waits for it and sends its wait
status over the connection the request came on; the asker's Popen (`ServedPopen`, loky's patched `poll`) waits and
polls on that connection.
"""

from __future__ import annotations

import fcntl
import importlib
import io
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# Read by the server's packages (OpenMP, MKL, OpenBLAS, torch, CUDA, Arrow, jemalloc) or by Python itself at start-up.
# (Hydra reads its HYDRA_* when it runs, not when it loads: the runner sets HYDRA_FULL_ERROR for its own run.)
SENSITIVE = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "ARROW", "JE_",
             "MALLOC", "LD_", "PYTHON")  # fmt: skip
# Read when they are used, not at load: the path, torchrun's ranks' settings, torch.hub's folder (torch.hub.get_dir).
RUN_TIME_ONLY = ("PYTHONPATH", "TORCHELASTIC_", "TORCH_NCCL_", "TORCH_HOME")
# Read at load, but they change how fast idle threads wake, never a value: a served child keeps the server's policy
# (runner/cpu_sharing.py sets it for a sweep's workers that share the CPUs; the tests' share is one CPU a worker).
SPEED_ONLY = ("OMP_WAIT_POLICY",)
# The environment as the running test began (conftest sets it before each test; first, as this module is imported):
# a server starts with it, not with what a test has set for the moment it happens to start one in, which would then
# be every later child's to match. It includes what the tests' imports set (cv2 adds to LD_LIBRARY_PATH, sklearn sets
# KMP_DUPLICATE_LIB_OK), which every process the tests start inherits, cold or served.
BASE_ENVIRONMENT = dict(os.environ)
# Pools sized at load: a child asking for the server's own thread count gets what a cold start would give it.
THREAD_COUNTS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PRELOADED = ("torch", "torchvision", "torchvision.models", "torchvision.transforms", "numpy", "pandas", "pyarrow",
             "pyarrow.parquet", "PIL.Image", "yaml", "omegaconf", "hydra", "hydra.main", "hydra.core.config_store",
             "hydra._internal.utils", "hydra._internal.instantiate._instantiate2", "joblib",
             "joblib.externals.loky.backend.fork_exec", "joblib.externals.loky.backend.popen_loky_posix")  # fmt: skip
SERVED_MODULES = ("runner", "torch.distributed.run")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")  # the console script: torch.distributed.run's main()
LOKY_WORKER = "joblib.externals.loky.backend.popen_loky_posix"

# Set in the server, so in every served child: where to ask for a fork, what its packages loaded with, its group.
_ADDRESS: bytes | None = None
_LOADED: Loaded | None = None
_GROUP: int | None = None
_LOKY_STATUS: dict[int, socket.socket] = {}  # a served loky worker's pid: the connection its wait status comes on


class Loaded(NamedTuple):
    """What the server's packages loaded with: the variables they read (`SENSITIVE`) as they were before, torch's thread
    count, and those the loading itself set (torch sets KMP_INIT_AT_FORK, TORCHINDUCTOR_CACHE_DIR, ...), which a
    process that imported them has too, and a cold child given the same values reads as what it would set itself."""

    variables: dict[str, str]
    threads: int
    set_by_loading: dict[str, str]


class ServerGone(OSError):
    """No server answers: the served child's asker starts the process cold instead."""


def _sensitive(env: Any) -> dict[str, str]:
    pairs = ((os.fsdecode(k), os.fsdecode(v)) for k, v in env.items())
    return {k: v for k, v in pairs if k.startswith(SENSITIVE) and not k.startswith(RUN_TIME_ONLY + SPEED_ONLY)}


def _differing(env: Any) -> list[str]:
    """The variables in which a cold process with this environment would load the server's packages differently."""
    loaded = _LOADED if _LOADED is not None else Server.get().loaded
    wanted, before = _sensitive(env), loaded.variables
    differing = []
    for key in sorted({*wanted, *before}):
        if wanted.get(key) == before.get(key):
            continue
        if key not in before and wanted[key] == loaded.set_by_loading.get(key):
            continue
        if key in THREAD_COUNTS and key not in before and wanted[key] == str(loaded.threads):
            continue
        differing.append(key)
    return differing


def _same_as_loaded(env: Any) -> bool:
    """Whether the server's packages, loaded as they were, are what a cold process with this environment loads."""
    return not _differing(env)


def _in_the_servers_group() -> bool:
    """Whether a child that stays in its parent's process group would be in the server's, as a served one is: a
    signal to the asker's group (a terminal's Ctrl-C, a test's killpg) then reaches it either way."""
    return os.getpgrp() == (_GROUP if _GROUP is not None else Server.get().group)


def _may_serve(env: Any, new_session: bool) -> bool:
    """Whether a child with this environment, in a new session or its asker's group, can be forked by the server."""
    if os.environ.get("RUNNER_COLD_PROCESSES"):
        return False
    return (new_session or _in_the_servers_group()) and _same_as_loaded(env)


def why_cold(env: Any = None, new_session: bool = False) -> str:
    """Why a runner started now with this environment would start cold ('' if it would be served): for tests' messages."""
    env = os.environ if env is None else env
    if os.environ.get("RUNNER_COLD_PROCESSES"):
        return "RUNNER_COLD_PROCESSES is set"
    if not new_session and not _in_the_servers_group():
        return f"this process's group {os.getpgrp()} is not the server's"
    differing = _differing(env)
    return f"the environment differs from the server's in {differing}" if differing else ""


def served_command(args: Any, settings: dict[str, Any]) -> dict[str, Any] | None:
    """What a served child runs, when this Popen (its args and _execute_child's settings) can be one."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return None
    argv = list(args)
    if not argv or not all(isinstance(a, str) for a in argv):
        return None
    if argv[0] == TORCHRUN:
        command = {"entry": "torch.distributed.run:main", "argv0": TORCHRUN, "args": argv[1:], "unbuffered": False}
    elif argv[0] == sys.executable:
        unbuffered = argv[1:2] == ["-u"]
        rest = argv[2:] if unbuffered else argv[1:]
        if len(rest) < 2 or rest[0] != "-m" or rest[1] not in SERVED_MODULES:
            return None
        command = {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    else:
        return None
    plain = {"executable": None, "preexec_fn": None, "close_fds": True, "pass_fds": (), "shell": False,
             "process_group": -1, "gid": None, "gids": None, "uid": None, "umask": -1,
             "restore_signals": True}  # fmt: skip
    if any(settings.get(key, value) != value for key, value in plain.items()):
        return None
    env = os.environ if settings.get("env") is None else settings["env"]
    return command if _may_serve(env, bool(settings.get("start_new_session"))) else None


def request_fork(request: dict[str, Any], fds: list[int]) -> tuple[int, socket.socket]:
    """A served child's pid and the connection its wait status will come on. fds: its stdin, stdout, stderr, then
    those it keeps at the numbers request["fds"] gives."""
    address = _ADDRESS if _ADDRESS is not None else Server.get().address
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(address)
    except OSError as gone:
        connection.close()
        raise ServerGone(f"the warm Python server does not answer: {gone}") from gone
    socket.send_fds(connection, [json.dumps(request).encode()], fds)
    reply = connection.recv(64)
    if not reply:
        connection.close()
        raise RuntimeError("the warm Python server did not fork")
    return int(reply), connection


def _status(connection: socket.socket, block: bool) -> int | None:
    """A served child's wait status, or None while it runs and block is False."""
    if not block and not select.select([connection], [], [], 0)[0]:
        return None
    reply = connection.recv(64)
    connection.close()
    if not reply:
        raise ChildProcessError("the warm Python server ended before its child")
    return int(reply)


class Server:
    """This process's server, started on first use."""

    _server: Server | None = None

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in BASE_ENVIRONMENT.items() if k != "PYTHONPATH"}
        self.process = subprocess.Popen(  # cold: this file, not the runner
            [sys.executable, __file__, str(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.control = ours  # the server ends when this process does, and with it this socket
        ready = self.control.recv(1 << 16)
        if not ready:
            raise RuntimeError("the warm Python server did not start")
        started = json.loads(ready)
        self.address: bytes = bytes.fromhex(started["address"])
        self.loaded = Loaded(started["sensitive"], started["threads"], started["set_by_loading"])
        self.group: int = started["group"]

    @classmethod
    def get(cls) -> Server:
        if cls._server is None or cls._server.process.poll() is not None:
            cls._server = cls()
        return cls._server

    def fork(self, request: dict[str, Any], stdio: list[int]) -> tuple[int, socket.socket]:
        return request_fork(request, stdio)


class ServedPopen(subprocess.Popen):
    """subprocess.Popen that asks the server for what it can serve (`served_command`) and starts the rest cold."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,  # noqa: ANN001, ANN202
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,  # noqa: ANN001
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # noqa: ANN001  # fmt: skip
        settings = {"executable": executable, "preexec_fn": preexec_fn, "close_fds": close_fds,
                    "pass_fds": tuple(pass_fds), "shell": shell, "process_group": process_group, "gid": gid,
                    "gids": gids, "uid": uid, "umask": umask, "restore_signals": restore_signals, "env": env,
                    "start_new_session": start_new_session}  # fmt: skip
        command = served_command(args, settings)
        # its stdio as a forked child would inherit it: the parent's 0, 1, 2 where Popen made no pipe
        stdio = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        if command is not None and all(_is_open(fd) for fd in stdio):
            where = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
            variables = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
            request = {**command, "cwd": where, "env": variables, "new_session": bool(start_new_session)}
            try:
                self.pid, self.status_socket = request_fork(request, stdio)
            except ServerGone:
                pass
            else:
                self._child_created = True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
        super()._execute_child(
            args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell, p2cread,
            p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
            process_group,
        )  # fmt: skip

    def _try_wait(self, wait_flags):  # noqa: ANN001, ANN202
        if getattr(self, "status_socket", None) is None:
            return super()._try_wait(wait_flags)
        status = _status(self.status_socket, block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if getattr(self, "status_socket", None) is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):  # as Popen's: one waiter at a time
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except ChildProcessError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def serve_loky_workers() -> None:
    """In the tests' process and served children: joblib's loky workers forked by the server, waited on through
    its connection."""
    from joblib.externals.loky.backend import fork_exec as launching
    from joblib.externals.loky.backend import popen_loky_posix

    cold_fork_exec, cold_poll = launching.fork_exec, popen_loky_posix.Popen.poll

    def fork_exec(cmd: list[Any], keep_fds: Any, env: dict[str, str] | None = None) -> int:
        argv = [os.fsdecode(arg) for arg in cmd]
        variables = {**os.environ, **(env or {})}
        keep = sorted(map(int, keep_fds))
        if (argv[:3] != [sys.executable, "-m", LOKY_WORKER] or not _may_serve(variables, new_session=False)
                or not all(_is_open(fd) for fd in (0, 1, 2))):  # fmt: skip
            return cold_fork_exec(cmd, keep_fds, env)
        request = {"module": LOKY_WORKER, "args": argv[3:], "unbuffered": False, "cwd": os.getcwd(),
                   "env": variables, "new_session": False, "fds": keep}  # fmt: skip
        try:
            pid, connection = request_fork(request, [0, 1, 2, *keep])
        except ServerGone:
            return cold_fork_exec(cmd, keep_fds, env)
        _LOKY_STATUS[pid] = connection
        return pid

    def poll(self: Any, flag: int = os.WNOHANG) -> int | None:
        connection = _LOKY_STATUS.get(self.pid)
        if connection is None or self.returncode is not None:
            return cold_poll(self, flag)
        status = _status(connection, block=flag == 0)
        if status is None:
            return None
        del _LOKY_STATUS[self.pid]
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    launching.fork_exec = fork_exec
    popen_loky_posix.Popen.poll = poll


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
                pass  # its asker is gone
            reply.close()


def _exit_code(code: Any) -> int:
    """What Python exits with for SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _place(received: list[int], targets: list[int], server_fds: list[int]) -> None:
    """received[i] at targets[i]; the server's own descriptors closed."""
    above = max([*received, *targets, *server_fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in received]  # out of the targets' way
    for fd in {*received, *server_fds}:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)
    for fd in moved:
        os.close(fd)


_KEPT: list[Any] = []  # the server's stdio objects, replaced under -u: their collection would close fds 1 and 2


def _unbuffered() -> None:
    """sys.stdout and sys.stderr as `python -u` makes them: no buffer under the text layer, written through."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        _KEPT.append(old)
        new = io.TextIOWrapper(io.FileIO(old.fileno(), "w", closefd=False), encoding=old.encoding,
                               errors=old.errors, write_through=True)  # fmt: skip
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _child(request: dict[str, Any], received: list[int], server_fds: list[int]) -> None:
    """In the forked child: become the process asked for, started in its cwd with its environment; never returns."""
    import atexit
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    _place(received, [0, 1, 2, *request.get("fds", [])], server_fds)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["unbuffered"]:
        _unbuffered()
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = request["cwd"] if "module" in request else os.path.dirname(request["argv0"])
    sys.path[:] = [first, *extra, *BASE_PATH]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    code, interrupted = 0, False
    try:
        if "module" in request:
            sys.argv = ["-m", *request["args"]]
            sys.modules.pop(request["module"], None)  # preloaded here, run as __main__ there
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["argv0"], *request["args"]]
            module, function = request["entry"].split(":")
            sys.exit(getattr(importlib.import_module(module), function)())
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
    global _ADDRESS, _LOADED, _GROUP
    control = socket.socket(fileno=control_fd)
    sensitive = _sensitive(os.environ)  # before the imports: torch sets KMP_INIT_AT_FORK and others as it loads
    for module in PRELOADED:
        importlib.import_module(module)
    import torch

    after = _sensitive(os.environ)
    set_by_loading = {k: v for k, v in after.items() if sensitive.get(k) != v}
    _LOADED, _GROUP = Loaded(sensitive, torch.get_num_threads(), set_by_loading), os.getpgrp()
    subprocess.Popen = ServedPopen  # type: ignore[misc]  # in every child: what it starts is served where it can be
    serve_loky_workers()
    _ADDRESS = f"\0runner-warm-python-{os.getpid()}-{secrets.token_hex(8)}".encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(_ADDRESS)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    started = {"address": _ADDRESS.hex(), "sensitive": _LOADED.variables, "threads": _LOADED.threads,
               "set_by_loading": _LOADED.set_by_loading, "group": _GROUP}  # fmt: skip
    control.send(json.dumps(started).encode())
    while True:
        readable = select.select([control, listener, wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(children)
        if control in readable:
            return  # the tests' process ended: nothing else comes on this socket
        if listener not in readable:
            continue
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 64)
        if not message:
            connection.close()
            continue
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            ours = [control, listener, connection, *children.values()]
            _child(request, fds, [*(s.fileno() for s in ours), wake_read, wake_write])
        for fd in fds:
            os.close(fd)
        children[pid] = connection
        connection.send(str(pid).encode())
        _reap(children)


if __name__ == "__main__":
    BASE_PATH = [p for p in sys.path[1:]]  # without this file's folder, as `python -m` has the cwd there instead
    serve(int(sys.argv[1]))
