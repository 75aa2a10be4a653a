"""The EMA saved and loaded through torch.distributed.checkpoint (``fe.dcp.EMAStateful``) against
``fe.save`` / ``fe.load`` / ``fe.AsyncSaver``, on the same EMA (CPU, gloo, 1 thread per rank).

    .venv/bin/python benchmarks/bench_dcp.py [--world-size 2] [--reps 5] [--quick]

Model: the 516-tensor transformer of ``bench_update.py`` (11.2M parameters) under FSDP2 (``fully_shard``
per block and on the root), one EMA (fp32, 45 MiB in all). Per approach, ``reps`` timed calls (a barrier
before each, the slowest rank's time counts; median and min over the reps), each into a fresh folder
on the local disk (the OS page cache absorbs the writes: these are CPU/serialisation costs, not disk
bandwidth):

* ``fe.save`` / ``fe.load``: this library's per-rank files (checksummed, manifest written last).
* ``fe.AsyncSaver().save``: the time the call blocks (the snapshot copy), then the wait for the commit.
* ``dcp.save`` / ``dcp.load``: DCP with the EMA as one ``Stateful`` (``{"ema": EMAStateful}``).
* ``dcp.async_save`` (``process_group=`` a gloo group of its own): the time the call blocks, then ``.result()``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(root: str, reps: int, quick: bool) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import functional_ema as fe
    from benchmarks.bench_update import _fsdp2_model

    torch.set_num_threads(1)
    model = _fsdp2_model("fsdp2", "transformer", quick)
    state = fe.init_ema(fe.local_shards(model))
    state = fe.update(state, fe.local_shards(model), 1, decay=0.9)
    n = [0]

    def fresh() -> str:
        n[0] += 1
        return os.path.join(root, f"c{n[0]}")

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    times: dict[str, list[float]] = {
        k: []
        for k in (
            "fe.save",
            "fe.load",
            "AsyncSaver.save (blocking)",
            "AsyncSaver commit wait",
            "dcp.save",
            "dcp.load",
            "dcp.async_save (blocking)",
            "dcp.async_save .result()",
        )
    }
    saver = fe.AsyncSaver()
    # DCP's async save runs collectives from its own thread: on a group of its own, as torch advises,
    # or they interleave with the main thread's (the barriers here) and deadlock
    side = dist.new_group(backend="gloo")
    for _ in range(reps):
        d = fresh()
        times["fe.save"].append(timed(lambda: fe.save(state, model, d, tag="t")))
        times["fe.load"].append(timed(lambda: fe.load(model, d, tag="t")))
        d2 = fresh()
        box = {}
        times["AsyncSaver.save (blocking)"].append(
            timed(lambda: box.setdefault("h", saver.save(state, model, d2, tag="t")))
        )
        times["AsyncSaver commit wait"].append(timed(box["h"].wait))
        d3 = fresh()
        ema = fe.dcp.EMAStateful(model, state)
        times["dcp.save"].append(timed(lambda: dcp.save({"ema": ema}, checkpoint_id=d3)))
        times["dcp.load"].append(timed(lambda: dcp.load({"ema": ema}, checkpoint_id=d3)))
        d4 = fresh()
        times["dcp.async_save (blocking)"].append(
            timed(lambda: box.__setitem__("f", dcp.async_save({"ema": ema}, checkpoint_id=d4, process_group=side)))
        )
        times["dcp.async_save .result()"].append(timed(box["f"].result))
    return {
        "times": times,
        "ema_mib": fe.ema_nbytes(state) * dist.get_world_size() / 2**20,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny model, a smoke test of the script")
    args = parser.parse_args(argv)
    from functional_ema._testing.multirank import run_ranks

    with tempfile.TemporaryDirectory(prefix="bench_dcp_") as root:
        r = run_ranks(
            "benchmarks.bench_dcp:worker",
            world_size=args.world_size,
            timeout=1800,
            env={"OMP_NUM_THREADS": "1"},
            root=root,
            reps=args.reps,
            quick=args.quick,
        )[0]
    t = r["times"]
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    print(
        f"### EMA through DCP vs fe.save/fe.load: FSDP2, {args.world_size} ranks, {r['params'] / 1e6:.1f}M params, "
        f"EMA {r['ema_mib']:.1f} MiB in all, {args.reps} reps\n"
    )
    print("| approach | ms, median (min) | DCP / functional_ema |")
    print("|---|---|---|")
    pairs = {
        "dcp.save": "fe.save",
        "dcp.load": "fe.load",
        "dcp.async_save (blocking)": "AsyncSaver.save (blocking)",
        "dcp.async_save .result()": "AsyncSaver commit wait",
    }
    for k, v in t.items():
        ratio = f"{med[k] / med[pairs[k]]:.2f}" if k in pairs else "-"
        print(f"| {k} | {med[k]:.1f} ({min(v) * 1e3:.1f}) | {ratio} |")
    print(
        f"\nCommand: `python benchmarks/bench_dcp.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({os.cpu_count()} CPU cores, 1 thread per rank)"
    )


if __name__ == "__main__":
    main()
