"""Throughput of EMA checkpoint save / load / consolidate against plain safetensors, same bytes, same run.

Usage::

    python benchmarks/bench_checkpoint.py [--world-size 2] [--stage 2] [--mib 192] [--num-emas 2] [--repeat 3]

Real DeepSpeed engines on CPU ranks (the shared harness ``tests/_multirank.py``). Each operation is
timed as the slowest rank (the wall time of the collective save / load), best of ``--repeat``;
GB/s = bytes moved / that time. Baselines over exactly the same tensors:

* save: ``safetensors.torch.save_file`` of this rank's pieces, with an fsync (our save fsyncs the
  file and the folder, since that is what makes it crash safe), and without one for reference.
* load: ``safetensors.torch.load_file`` plus a clone into fresh memory (our load returns a new
  state, so it allocates too), and plus a copy into existing buffers; ``load_file`` alone only
  maps the file (the bytes are read on first touch), shown for reference.
* consolidate (rank 0, no process group): ``load_file`` of every rank's plain file, assembled into
  full tensors (in memory) / then ``save_file`` + fsync (to a file).

Numbers are with a warm page cache (files just written), so they measure the software path and
fsync, not the disk's read speed. Ours verifies CRC-32s of every byte read (``verify=True``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(out_dir: str, mib: int, num_emas: int, stage: int, repeat: int):
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    import functional_ema as fe
    from tests._multirank import make_engine

    rank = dist.get_rank()
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * (width + 1)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    engine = make_engine(stage, "fp32", model=model)
    shards = fe.local_shards(engine)
    state = fe.init_ema(shards, num_emas=num_emas)
    for k in range(1, num_emas):  # make the EMAs differ
        for t in state.emas[k].values():
            t.add_(k)
    local = {f"emas.{k}.{n}": t for k, e in enumerate(state.emas) for n, t in e.items()}
    local_bytes = sum(t.numel() * t.element_size() for t in local.values())
    d = Path(out_dir)
    plain = d / f"plain_rank{rank}.safetensors"
    times: dict[str, list[float]] = {}

    def timed(name, fn, barrier=True):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if barrier:
            dist.barrier()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    def plain_save(fsync):
        save_file(local, str(plain))
        if fsync:
            _fsync(plain)

    dst = fe.init_ema(shards, num_emas=num_emas)
    dst_flat = {f"emas.{k}.{n}": t for k, e in enumerate(dst.emas) for n, t in e.items()}

    def plain_load_copy():
        loaded = load_file(str(plain))
        for key, t in loaded.items():
            dst_flat[key].copy_(t)

    def plain_load_clone():
        return {key: t.clone() for key, t in load_file(str(plain)).items()}

    for i in range(repeat):
        tag = f"bench{i}"
        timed("save", lambda: fe.save(state, engine, d, tag))
        timed("plain_save_fsync", lambda: plain_save(True))
        timed("plain_save_nofsync", lambda: plain_save(False))
        timed("load", lambda: fe.load(engine, d, tag))
        timed("plain_load_clone", plain_load_clone)
        timed("plain_load_copy", plain_load_copy)
        timed("plain_load_lazy", lambda: load_file(str(plain)))
    full_bytes = sum(t.numel() * t.element_size() for t in state.ema.values())
    if rank == 0:  # offline tools: one process, no collectives
        world = dist.get_world_size()
        paths = [d / f"plain_rank{r}.safetensors" for r in range(world)]
        layout = fe.shard_layout(engine)
        out = d / "consolidated.safetensors"
        plain_out = d / "plain_consolidated.safetensors"
        specs = _all_specs(d, world)

        def plain_assemble():
            full = {n: torch.empty(s.full_numel) for n, s in layout.specs.items()}
            for r, p in enumerate(paths):
                loaded = load_file(str(p))
                for n, (off, numel) in specs[r].items():
                    if numel:
                        full[n][off : off + numel].copy_(loaded[f"emas.0.{n}"])
            return {n: full[n].view(layout.specs[n].shape) for n in full}

        def plain_to_file():
            save_file(plain_assemble(), str(plain_out))
            _fsync(plain_out)

        for i in range(repeat):
            tag = f"bench{i}"
            timed("consolidate_file", lambda: fe.consolidate_to_file(d, out, tag, progress=False), barrier=False)
            timed("plain_consolidate_file", plain_to_file, barrier=False)
            timed("consolidate_mem", lambda: fe.consolidate(d, tag), barrier=False)
            timed("plain_consolidate_mem", plain_assemble, barrier=False)
        check = fe.consolidate(d, f"bench{repeat - 1}")
        same = all(torch.equal(check[n], t) for n, t in load_file(str(out)).items())
        times["consolidate_matches"] = [float(same)]
    dist.barrier()
    return {"times": {k: min(v) for k, v in times.items()}, "local_bytes": local_bytes, "full_bytes": full_bytes,
            "params": sum(p.numel() for p in model.parameters()), "world": dist.get_world_size()}


def _all_specs(d: Path, world: int) -> list[dict]:
    """Each rank's (offset, numel) per parameter, from our own checkpoint's metadata."""
    import json

    from safetensors import safe_open

    import functional_ema as fe

    m = fe.checkpoint.read_manifest(d, "bench0")
    tag_dir = Path(m["tag_dir"])
    out = [dict() for _ in range(world)]
    for entry in m["files"]:
        with safe_open(str(tag_dir / entry["file"]), framework="pt") as f:
            layout = json.loads(f.metadata()["layout"])
        out[entry["rank"]] = {n: (v[1], v[2]) for n, v in layout["specs"].items()}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--mib", type=int, default=192, help="model size (fp32 MiB); each EMA is this big in total")
    ap.add_argument("--num-emas", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed afterwards)")
    args = ap.parse_args(argv)

    from tests._multirank import run_ranks

    with tempfile.TemporaryDirectory(prefix="fe_bench_", dir=args.dir) as tmp:
        results = run_ranks("benchmarks.bench_checkpoint:worker", world_size=args.world_size,
                            out_dir=tmp, mib=args.mib,
                            num_emas=args.num_emas, stage=args.stage, repeat=args.repeat)
    t = {k: max(r["times"].get(k, 0.0) for r in results) for k in results[0]["times"]}
    total = sum(r["local_bytes"] for r in results)
    full = results[0]["full_bytes"]
    gbs = lambda nbytes, sec: nbytes / sec / 1e9  # noqa: E731
    print(
        f"EMA checkpoint benchmark: world_size={args.world_size}, ZeRO stage {args.stage}, fp32 EMA x{args.num_emas}, "
        f"{results[0]['params'] / 1e6:.1f}M parameters; {total / 2**20:.0f} MiB of EMA pieces in all "
        f"({total / args.world_size / 2**20:.0f} MiB per rank); best of {args.repeat}; warm page cache; "
        f"{os.cpu_count()} CPU cores"
    )
    rows = [
        ("save (all ranks)", total, "save", "plain_save_fsync", "save_file + fsync, per rank"),
        ("", total, "save", "plain_save_nofsync", "save_file, no fsync"),
        ("load (all ranks, verified)", total, "load", "plain_load_clone", "load_file + clone (fresh memory, as a new state)"),
        ("", total, "load", "plain_load_copy", "load_file + copy into existing buffers"),
        ("", total, "load", "plain_load_lazy", "load_file alone (lazy mmap: reads nothing)"),
        ("consolidate -> file (rank 0)", full, "consolidate_file", "plain_consolidate_file", "load_file all ranks + assemble + save_file + fsync"),
        ("consolidate -> memory (rank 0)", full, "consolidate_mem", "plain_consolidate_mem", "load_file all ranks + assemble"),
    ]
    print(f"{'operation':32s} {'ours GB/s':>10s} {'plain GB/s':>11s} {'ours/plain':>11s}   baseline")
    for label, nbytes, ours, base, what in rows:
        a, b = gbs(nbytes, t[ours]), gbs(nbytes, t[base])
        print(f"{label:32s} {a:10.2f} {b:11.2f} {a / b:11.2f}   {what}")
    print(f"consolidated file equals consolidate(): {bool(t['consolidate_matches'])}")


if __name__ == "__main__":
    main()
