"""Rank processes forked from a warm server that has imported torch, DeepSpeed and the library once.

The test suite starts a few hundred rank processes; each fresh interpreter spends 2-3 CPU seconds importing
torch and DeepSpeed before its first line of test code, and as much again importing torch._dynamo and inductor
(its first optimizer, DeepSpeed's engine) and transformers, on a machine with 2 cores. Here the ranks of
:func:`functional_ema._testing.multirank.run_ranks` are forked instead from one server process per test
process, whose interpreter imported them once (and is single-threaded then, so the fork is safe).

A pooled rank behaves like the fresh interpreter it replaces: its own session (so ``killpg`` ends whatever it
started), its environment replaced by the one the launch computed, its output in the launch's log file, its
working directory and ``sys.path`` from that environment. Its exit status is written by the server, which
reaps it, to a file beside the log. What a fresh interpreter would do at start-up from the environment
(``PYTHONPATH``'s ``sitecustomize``, e.g. ``make mutate``'s hit recorder) happens once, in the server, which
is started under the first launch's environment; ``FE_RANK_POOL=0`` starts fresh interpreters as before.

The server reads one JSON request a line on its stdin, forks, answers the rank's pid on its stdout, and
exits when its stdin closes (the test process ended).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

#: What the server imports before it forks any rank: the costly imports every DeepSpeed rank makes. A
#: rank's first torch optimizer imports torch._dynamo, and DeepSpeed's engine (its Muon check calls
#: ``torch.compile``) inductor's compile_fx: 2-3 CPU seconds a rank, as much as torch itself.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "deepspeed",
    "functional_ema",
    "functional_ema._testing.multirank",
)
#: Imported where installed (the optional extras), for the integrations' ranks. Not ``transformers.trainer``:
#: importing it starts a thread, and the server must be single-threaded when it forks.
PRELOAD_OPTIONAL = ("transformers", "diffusers", "peft", "lightning.pytorch")
#: What those packages read from the environment once, at import. The server imports them under the first
#: launch's values (``multirank.spawn_ranks`` sets them for every rank); a later launch with other values is
#: refused, since its ranks would see the server's.
PRELOAD_ENV = ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")

# reason: test harness only (the library never imports it): each process's server, by the pid that started it,
# so a forked process (make mutate runs each mutant in a fork) starts its own, under its own environment.
_SERVERS: dict[int, subprocess.Popen[bytes]] = {}  # reason: test harness only; each process's own server


def enabled(env: dict[str, str]) -> bool:
    """Whether a launch with environment ``env`` (the ranks' whole environment) may use the pool."""
    return env.get("FE_RANK_POOL", "1") != "0"


class PooledRank:
    """A forked rank with the part of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int, exit_path: Path) -> None:
        self.pid = pid
        self._exit_path = exit_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_path.exists():
            self.returncode = int(self._exit_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        gone_since = None
        while self.poll() is None and (deadline is None or time.monotonic() < deadline):
            if _exists(self.pid):
                gone_since = None
            elif gone_since is None:  # reaped: the server writes its status next, unless the server is gone
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since > 2.0:  # no server wrote it (init reaped the rank)
                self.returncode = -signal.SIGKILL
                break
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the rank's session, or the rank alone if it has not made its session yet."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def start(child: str, args_path: str, env: dict[str, str], log_path: Path, cwd: str) -> PooledRank:
    """Fork one rank that runs ``child`` ("module:function") of ``args_path`` from this process's server
    (started on first use). The function ends the process itself."""
    server = _server(env)
    exit_path = log_path.with_suffix(".exit")
    request = {"child": child, "args": args_path, "env": env, "log": str(log_path), "cwd": cwd, "exit": str(exit_path)}
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps(request).encode() + b"\n")
    server.stdin.flush()
    answer = server.stdout.readline()
    if not answer:
        raise RuntimeError(f"the rank pool's server (pid {server.pid}) exited {server.wait()}; see {_log_path()}")
    return PooledRank(int(answer), exit_path)


def _server(env: dict[str, str]) -> subprocess.Popen[bytes]:
    server = _SERVERS.get(os.getpid())
    if server is not None and server.poll() is None:
        return server
    # A fresh interpreter under the launch's PYTHONPATH: a sitecustomize there (make mutate's hit recorder)
    # runs in the server, and its forked ranks inherit what it installed.
    # One OpenMP thread: torch starts a second thread at import otherwise, and the server must fork single-threaded
    # (each rank then sets its launch's thread count).
    server_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": env["PYTHONPATH"]}
    for key in PRELOAD_ENV:
        server_env.pop(key, None)
        if key in env:
            server_env[key] = env[key]
    with open(_log_path(), "ab") as log:
        server = _SERVERS[os.getpid()] = subprocess.Popen(
            [sys.executable, "-c", "from functional_ema._testing.rank_pool import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=server_env,
            start_new_session=True,
        )
    atexit.register(_stop_server)  # once per server started: rare (one, unless one died)
    return server


def _stop_server() -> None:
    """At exit: close this process's server's stdin (it then exits) and reap it. Its log is removed when it
    ended cleanly and holds no traceback (of it, or of a server of this process that died before it)."""
    server = _SERVERS.pop(os.getpid(), None)
    if server is None:
        return
    for pipe in (server.stdin, server.stdout):
        if pipe is not None:
            pipe.close()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log = _log_path()
    with contextlib.suppress(OSError):
        if server.returncode == 0 and b"Traceback" not in log.read_bytes():
            log.unlink()


def _log_path() -> Path:
    return Path(tempfile.gettempdir()) / f"fe_rank_pool_{os.getpid()}.log"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve() -> None:
    """The server's loop: preload, then fork a rank per request and record each one's exit status."""
    # The answers get a descriptor of their own: whatever the imports print to stdout goes to the log.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _preload()
    requests = sys.stdin.buffer
    exits: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        _reap(exits)
        if not readable:
            continue
        line = requests.readline()
        if not line:  # the test process is gone
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _become_rank(request)
        exits[pid] = request["exit"]
        answers.write(f"{pid}\n".encode())
        answers.flush()


def _preload(names: tuple[str, ...] = PRELOAD + PRELOAD_OPTIONAL) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            if name not in PRELOAD_OPTIONAL:
                raise
        threads = _threads()
        if threads > 1:  # a fork would copy a lock some thread holds: refuse to serve
            raise RuntimeError(
                f"the rank pool's server has {threads} threads after importing {name}; it forks ranks single-threaded"
            )


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's own threads only
        import threading

        return threading.active_count()


def _reap(exits: dict[int, str]) -> None:
    for pid in list(exits):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            path = Path(exits.pop(pid))
            with contextlib.suppress(OSError):  # the launch's folder may be gone (its launcher ended)
                path.with_suffix(".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
                path.with_suffix(".tmp").replace(path)


def _reread_fsspec_config() -> None:
    """fsspec reads its configuration (``FSSPEC_*`` variables, its config folder) once, at import, and the server
    imported it (under Lightning) in its own environment: read it again in the launch's, in place (modules hold
    the ``conf`` dict itself), as a fresh interpreter would have."""
    config = sys.modules.get("fsspec.config")
    if config is not None:
        config.conf.clear()
        config.set_conf_files(os.environ.get("FSSPEC_CONFIG_DIR", config.default_conf_dir), config.conf)
        config.set_conf_env(config.conf, os.environ)


def _become_rank(request: dict[str, Any]) -> None:
    """In the forked child: become what ``Popen(..., start_new_session=True)`` of a fresh rank would be."""
    try:
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        env: dict[str, str] = request["env"]
        for key in PRELOAD_ENV:
            if env.get(key) != os.environ.get(key):
                raise RuntimeError(
                    f"this launch sets {key}={env.get(key)!r}, but the rank pool's server imported the packages that "
                    f"read it under {key}={os.environ.get(key)!r}; launch with FE_RANK_POOL=0 for fresh ranks"
                )
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.argv = ["-c", request["args"]]
        import torch

        # The server imported torch under its own environment; the launch's thread count is the rank's.
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        _reread_fsspec_config()
        module, function = request["child"].split(":")
        getattr(importlib.import_module(module), function)(request["args"])  # ends the process itself
    except BaseException:  # noqa: BLE001 - the rank's log is where its parent looks
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)  # the child function ends the process itself; here it raised
