"""Throughput of EMA checkpoint save / load / consolidate against plain safetensors, same bytes, same run.

Usage::

    python benchmarks/bench_checkpoint.py [--world-size 2] [--stage 2] [--mib 192] [--repeat 8] [--plot PATH]

Real DeepSpeed engines on CPU ranks (the shared harness ``functional_ema/_testing/multirank.py``). Each operation is
timed as the slowest rank (the wall time of the collective save / load), best of ``--repeat``,
with the median ratio printed beside it; the order of the competing readers is rotated between
repeats (on a VM the first read after a burst of writes is often several times slower: rotating
gives every reader that slot equally) and dirty pages are synced between timings, untimed. On the
2-core VM these figures come from, a load into fresh memory often takes 2-4x its best time, with
the process's CPU time rising as much (the kernel faulting the memory in, not waiting); our
readers' huge-page buffers meet it more often than plain safetensors' 4 KiB pages (see
:func:`first_touch_probe`). GB/s = bytes moved / that time. Baselines over exactly the same tensors:

* save: ``safetensors.torch.save_file`` of this rank's pieces, with an fsync (our save fsyncs the
  file and the folder, since that is what makes it crash safe), and without one for reference.
* load into new memory: ``safetensors.torch.load_file`` plus a clone into fresh memory (our load
  returns a new state, so it allocates too), and plus a copy into one fresh buffer per EMA (what a
  state holds: the same memory our load fills); a diagnostic row does the latter into huge-page
  buffers like ours, which separates the memory's cost from the reader's. ``load_file`` alone only
  maps the file (the bytes are read on first touch), so it is never timed alone.
* load into a state (``load(..., out=state)``): ``load_file`` plus a copy into existing buffers.
* settled files: the same two loads again over the last repeat's files, read once already and
  not just written (the resume case), rotated among themselves.
* consolidate (rank 0, no process group): ``load_file`` of every rank's plain file, assembled into
  full tensors (in memory) / then ``save_file`` + fsync (to a file).

Numbers are with a warm page cache (files just written), so they measure the software path and
fsync, not the disk's read speed. Ours verifies XXH3-64 checksums of every byte read (``verify=True``).
``--plot PATH`` also writes the GB/s figures as a PNG chart, stamped with the machine and the commit
(needs matplotlib, the ``plot`` extra).

For one and for two EMAs: the async save's blocking time (the call, steady state with its buffer
reused; the first call also allocates it) against one ``copy_`` of this rank's bytes, and its total
time to ``wait()``; a breakdown of the load (open/validate, reading, checking; raw hash speed of
XXH3-64 and zlib's CRC-32); and the previous format (CRC-32 manifest) read from the same files.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def _to_format1(tag_dir: Path) -> None:
    """Rewrite a checkpoint's manifest as format 1 (CRC-32 integers), as the previous version wrote it."""
    import json

    from functional_ema import _io

    mpath = tag_dir / "ema_manifest.json"
    m = json.loads(mpath.read_text())
    for e in m["files"]:
        st = _io.SafetensorsFile(tag_dir / e["file"])
        data = memoryview((tag_dir / e["file"]).read_bytes())
        e.pop("header_checksum"), e.pop("chunk_checksums")
        e["header_crc32"] = st.header_checksum("crc32")
        e["tensor_crc32"] = {
            k: _io.chunk_crcs(data[st.header_size + t.start : st.header_size + t.end]) for k, t in st.tensors.items()
        }
    m.pop("checksum")
    m["format_version"] = 1
    mpath.write_text(json.dumps(m))


def worker(out_dir: str, mib: int, stage: int, repeat: int):
    import zlib

    import torch
    import torch.distributed as dist
    import xxhash
    from safetensors.torch import load_file, save_file

    import functional_ema as fe
    from functional_ema import _memory
    from functional_ema._checkpoint.reader import CheckpointReader
    from functional_ema._testing.multirank import make_engine

    rank = dist.get_rank()
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * (width + 1)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    engine = make_engine(stage, "fp32", model=model)
    shards = fe.local_shards(engine)
    result = {"params": sum(p.numel() for p in model.parameters()), "world": dist.get_world_size(), "runs": {}}
    for num_emas in (1, 2):
        state = fe.init_ema(shards, num_emas=num_emas)
        for k in range(1, num_emas):  # make the EMAs differ
            for t in state.emas[k].values():
                t.add_(k)
        local = {f"emas.{k}.{n}": t for k, e in enumerate(state.emas) for n, t in e.items()}
        local_bytes = sum(t.numel() * t.element_size() for t in local.values())
        d = Path(out_dir) / f"emas{num_emas}"
        d.mkdir(exist_ok=True)
        plain = d / f"plain_rank{rank}.safetensors"
        times: dict[str, list[float]] = {}

        def timed(name, fn, barrier=True, after=True):
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            r = fn()
            if barrier and after:
                dist.barrier()
            times.setdefault(name, []).append(time.perf_counter() - t0)
            return r

        def plain_save(fsync):
            save_file(local, str(plain))
            if fsync:
                _fsync(plain)

        dst = fe.init_ema(shards, num_emas=num_emas)
        dst_flat = {f"emas.{k}.{n}": t for k, e in enumerate(dst.emas) for n, t in e.items()}

        def plain_load_copy():
            for key, t in load_file(str(plain)).items():
                dst_flat[key].copy_(t)

        def plain_load_clone():
            return {key: t.clone() for key, t in load_file(str(plain)).items()}

        ema_numel = [sum(t.numel() for t in e.values()) for e in state.emas]

        def plain_load_flat(alloc=torch.empty):  # into one fresh buffer per EMA, as a state holds its EMAs
            loaded = load_file(str(plain))
            flats = [alloc(n) for n in ema_numel]
            for k, e in enumerate(state.emas):
                pos = 0
                for n, t in e.items():
                    flats[k][pos : pos + t.numel()].copy_(loaded[f"emas.{k}.{n}"].reshape(-1))
                    pos += t.numel()
            return flats

        # One copy_ of the same bytes (the async save's floor): between two touched buffers.
        src_flat = torch.cat([t.reshape(-1) for t in local.values()])
        copy_dst = torch.empty_like(src_flat).copy_(src_flat)
        saver = fe.AsyncSaver()
        layout = fe.shard_layout(engine)
        own = (layout.rank, layout.world_size, layout.stage)  # load opens this rank's file only
        for i in range(repeat):
            tag = f"bench{i}"
            timed("save", lambda: fe.save(state, engine, d, tag))
            timed("plain_save_fsync", lambda: plain_save(True))
            timed("plain_save_nofsync", lambda: plain_save(False))
            os.sync()  # untimed: no dirty pages left for the kernel to write back during the next timings
            timed("copy", lambda: copy_dst.copy_(src_flat), after=False)
            dist.barrier()
            t0 = time.perf_counter()
            h = saver.save(state, engine, d, f"async{i}")
            times.setdefault("async_block" if i else "async_block_first", []).append(time.perf_counter() - t0)
            h.wait()
            dist.barrier()
            times.setdefault("async_total", []).append(time.perf_counter() - t0)
            # The first read after the writes above is often several times slower on this VM (the
            # host still writing back); rotating the order gives each reader that slot equally.
            loads = [
                ("load", lambda: fe.load(engine, d, tag)),
                ("load_noverify", lambda: fe.load(engine, d, tag, verify=False)),
                ("plain_load_clone", plain_load_clone),
                ("plain_load_flat", plain_load_flat),
                ("plain_load_flat_huge", lambda: plain_load_flat(lambda n: _memory.empty(n, dtype=torch.float32))),
                ("load_into", lambda: fe.load(engine, d, tag, out=dst)),
                ("plain_load_copy", plain_load_copy),
            ]
            for name, fn in loads[i % len(loads) :] + loads[: i % len(loads)]:
                timed(name, fn)
            timed("open", lambda: CheckpointReader.open(d, tag, True, own=own).close())  # as load opens it
        # Settled files, as at a resume: the last repeat's files, read again (each reader already read
        # them once above), with no write just before. Right after a write, a reader that needs both
        # cores (ours: reading and hashing on two threads) pays for whatever the kernel still does then
        # on this VM; plain safetensors reads on one thread and is hit less.
        settled = [
            ("load_settled", lambda: fe.load(engine, d, tag)),
            ("plain_load_clone_settled", plain_load_clone),
            ("load_into_settled", lambda: fe.load(engine, d, tag, out=dst)),
            ("plain_load_copy_settled", plain_load_copy),
        ]
        for i in range(repeat):
            for name, fn in settled[i % len(settled) :] + settled[: i % len(settled)]:
                timed(name, fn)
        if repeat == 1:
            times["async_block"] = times["async_block_first"]
        # The previous format (CRC-32) on the same files, for the before/after.
        fe.save(state, engine, d, "v1")
        if rank == 0:
            _to_format1(d / "v1")
        for _ in range(repeat):
            timed("load_v1", lambda: fe.load(engine, d, "v1"))
        buf = memoryview(src_flat.view(torch.uint8).numpy())
        for _ in range(repeat):
            timed("hash_xxh3", lambda: xxhash.xxh3_64_intdigest(buf), barrier=False)
            timed("hash_crc32", lambda: zlib.crc32(buf), barrier=False)
        full_bytes = sum(s.full_numel for s in fe.shard_layout(engine).specs.values()) * 4
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
                ops = [
                    ("consolidate_file", lambda: fe.consolidate_to_file(d, out, tag, progress=False, overwrite=True)),
                    ("plain_consolidate_file", plain_to_file),
                ]
                for name, fn in ops if i % 2 == 0 else ops[::-1]:
                    timed(name, fn, barrier=False)
                    os.sync()
                ops = [
                    ("consolidate_mem", lambda: fe.consolidate(d, tag)),
                    ("plain_consolidate_mem", plain_assemble),
                    ("consolidate_mem_v1", lambda: fe.consolidate(d, "v1")),
                ]
                for name, fn in ops[i % 3 :] + ops[: i % 3]:
                    timed(name, fn, barrier=False)
            check = fe.consolidate(d, f"bench{repeat - 1}")
            same = all(torch.equal(check[n], t) for n, t in load_file(str(out)).items())
            same = same and all(torch.equal(check[n], t) for n, t in fe.consolidate(d, f"async{repeat - 1}").items())
            times["consolidate_matches"] = [float(same)]
        dist.barrier()
        result["runs"][num_emas] = {
            "times": {k: min(v) for k, v in times.items()},
            "medians": {k: statistics.median(v) for k, v in times.items()},
            "local_bytes": local_bytes,
            "full_bytes": full_bytes,
        }
        del saver
    return result


def device_checkpoint(device: str, mib: int = 512, repeat: int = 3) -> dict[str, float]:
    """One process, a plain module's fp32 EMA held on ``device``: save / load / ``load(out=)`` against
    safetensors on the same tensors. Returns GB/s per operation (best of ``repeat``) and ``nbytes``.

    Baselines: ``save_file`` + fsync of the EMA tensors (safetensors copies CUDA tensors to the host
    itself); ``load_file(device=device)`` (new memory on the device); ``load_file`` + ``copy_`` into
    tensors already held on the device (``load(out=)``'s job: no allocation). Checksums verified.
    """
    import torch
    from safetensors.torch import load_file, save_file

    import functional_ema as fe

    width = 2048
    layers = max(1, mib * 2**20 // (4 * width * (width + 1)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    state = fe.init_ema(fe.local_shards(model))
    held = fe.init_ema(fe.local_shards(model))
    local = dict(state.ema)
    held_plain = {n: torch.empty_like(t) for n, t in local.items()}
    nbytes = sum(t.numel() * t.element_size() for t in local.values())
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fe_bench_dev_") as d:
        plain = Path(d) / "plain.safetensors"

        def plain_save():
            save_file(local, str(plain))
            _fsync(plain)

        def plain_load():  # on the CPU load_file only maps the file: clone, as our load fills new memory
            loaded = load_file(str(plain), device=str(device))
            return loaded if torch.device(device).type != "cpu" else {n: t.clone() for n, t in loaded.items()}

        def plain_load_into():
            for n, t in load_file(str(plain)).items():
                held_plain[n].copy_(t)

        ops = [
            ("save", lambda: fe.save(state, model, d, "t")),
            ("plain_save", plain_save),
            ("load", lambda: fe.load(model, d, "t")),
            ("plain_load", plain_load),
            ("load_into", lambda: fe.load(model, d, "t", out=held)),
            ("plain_load_into", plain_load_into),
        ]
        for i in range(repeat):
            for name, fn in ops[i % len(ops) :] + ops[: i % len(ops)] if i else ops:  # saves first on the first pass
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            os.sync()
        back = fe.load(model, d, "t")
        same = all(torch.equal(back.ema[n], t) for n, t in local.items()) and all(
            torch.equal(held.ema[n], t) for n, t in local.items()
        )
    out = {k: nbytes / v / 1e9 for k, v in best.items()}
    out.update(nbytes=float(nbytes), bitwise=float(same))
    return out


def first_touch_probe(mib: int, tries: int = 3) -> dict[tuple[str, str], float]:
    """Milliseconds to fill a fresh ``mib`` MiB buffer (median of ``tries``), with 4 KiB pages and with
    the huge pages our readers ask for, right after freeing an equal buffer and after a 3 s pause.

    Where a VM hands memory freed a while ago back to its host (virtio-balloon free page
    reporting reports free 2 MiB blocks), a buffer built from such blocks is faulted in again on
    first touch; 4 KiB pages come from recently freed ones first.
    """
    import torch

    from functional_ema import _memory

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = torch.ones(mib << 18)
    out = {}
    for pages in ("4 KiB", "huge"):
        for pause in ("right after a free", "after a 3 s pause"):
            ts = []
            for _ in range(tries):
                if pause != "right after a free":
                    time.sleep(3.0)
                t0 = time.perf_counter()
                t = torch.empty_like(src)
                if pages == "huge":
                    _memory.advise_huge_pages(t)
                t.copy_(src)
                ts.append(time.perf_counter() - t0)
                del t
            out[(pages, pause)] = statistics.median(ts) * 1e3
    torch.set_num_threads(threads)
    return out


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


# The printed table: (operation, bytes counted: "total" = every rank's EMA pieces / "full" = the
# consolidated model, our timing's key, the plain baseline's key, the baseline).
ROWS = [
    ("save, blocking (all ranks)", "total", "save", "plain_save_fsync", "save_file + fsync, per rank"),
    ("", "total", "save", "plain_save_nofsync", "save_file, no fsync"),
    ("async save, total to wait()", "total", "async_total", "plain_save_fsync", "save_file + fsync, per rank"),
    (
        "load (all ranks, verified)",
        "total",
        "load",
        "plain_load_clone",
        "load_file + clone (fresh memory, as a new state)",
    ),
    ("", "total", "load", "plain_load_flat", "load_file + copy into one fresh buffer per EMA (a state's layout)"),
    ("", "total", "load", "plain_load_flat_huge", "the same into huge-page buffers, as ours (diagnostic)"),
    ("load into a state (out=)", "total", "load_into", "plain_load_copy", "load_file + copy into existing buffers"),
    (
        "load, settled files",
        "total",
        "load_settled",
        "plain_load_clone_settled",
        "load_file + clone (files not just written, as at a resume)",
    ),
    (
        "load into a state, settled",
        "total",
        "load_into_settled",
        "plain_load_copy_settled",
        "load_file + copy into existing buffers (the same files)",
    ),
    (
        "consolidate -> file (rank 0)",
        "full",
        "consolidate_file",
        "plain_consolidate_file",
        "load_file all ranks + assemble + save_file + fsync",
    ),
    (
        "consolidate -> memory (rank 0)",
        "full",
        "consolidate_mem",
        "plain_consolidate_mem",
        "load_file all ranks + assemble",
    ),
]


def _summary(results: list[dict], num_emas: int) -> dict:
    """One EMA count's figures over the ranks: best times of the slowest rank (``t``), medians (``med``),
    bytes of every rank's pieces (``total``), of the full model (``full``), of the largest rank (``per_rank``)."""
    runs = [r["runs"][str(num_emas)] if str(num_emas) in r["runs"] else r["runs"][num_emas] for r in results]
    return {
        "t": {k: max(r["times"].get(k, 0.0) for r in runs) for k in runs[0]["times"]},  # slowest rank
        "med": {k: max(r["medians"].get(k, 0.0) for r in runs) for k in runs[0]["medians"]},
        "total": sum(r["local_bytes"] for r in runs),
        "full": runs[0]["full_bytes"],
        "per_rank": max(r["local_bytes"] for r in runs),
    }


# Chart labels (``--plot``) of our timings and of the baselines, by key.
CHART_OURS = {
    "save": "ours: save, blocking (fsynced)",
    "async_total": "ours: AsyncSaver.save, total to wait()",
    "load": "ours: load into new memory (verified)",
    "load_into": "ours: load into a state (out=, verified)",
    "consolidate_file": "ours: consolidate -> file (rank 0)",
    "consolidate_mem": "ours: consolidate -> memory (rank 0)",
}
CHART_BASELINES = {
    "plain_save_fsync": "save_file + fsync",
    "plain_save_nofsync": "save_file, no fsync",
    "plain_load_clone": "load_file + clone",
    "plain_load_flat": "load_file + copy into fresh buffers",
    "plain_load_flat_huge": "the same into huge pages (diagnostic)",
    "plain_load_copy": "load_file + copy into existing buffers",
    "plain_consolidate_file": "load_file all + assemble + save_file + fsync",
    "plain_consolidate_mem": "load_file all + assemble",
}


# The chart's groups: our timings, then the plain baselines they are compared with, and which bytes count.
CHART_GROUPS = [
    (["save", "async_total"], ["plain_save_fsync", "plain_save_nofsync"], "total"),
    (["load"], ["plain_load_clone", "plain_load_flat", "plain_load_flat_huge"], "total"),
    (["load_into"], ["plain_load_copy"], "total"),
    (["consolidate_file"], ["plain_consolidate_file"], "full"),
    (["consolidate_mem"], ["plain_consolidate_mem"], "full"),
]


def chart_panels(results: list[dict]) -> list:
    """The GB/s of the printed table as chart panels, one per EMA count: each of our operations
    followed by its plain-safetensors baselines, then the async save's blocking call against one
    ``copy_`` of the same bytes (its floor)."""
    from benchmarks._charts import Bar, Panel

    panels = []
    for num_emas in (1, 2):
        s = _summary(results, num_emas)
        t, bars = s["t"], []
        for ours, bases, which in CHART_GROUPS:
            bars += [Bar(CHART_OURS[k], s[which] / t[k] / 1e9, "ours") for k in ours]
            bars += [Bar("plain: " + CHART_BASELINES[k], s[which] / t[k] / 1e9, "peer") for k in bases]
        bars.append(Bar("ours: AsyncSaver.save, blocking call", s["per_rank"] / t["async_block"] / 1e9, "ours"))
        bars.append(Bar("one copy_ of this rank's bytes (floor)", s["per_rank"] / t["copy"] / 1e9, "reference"))
        panels.append(
            Panel(
                f"{num_emas} EMA{'s' if num_emas > 1 else ''}: {s['total'] / 2**20:.0f} MiB of EMA pieces in all, "
                f"{s['per_rank'] / 2**20:.0f} MiB per rank",
                bars,
            )
        )
    return panels


def write_chart(path: str, results: list[dict], args: argparse.Namespace):
    """Write the throughput chart of this run to ``path`` (skipped with one line without matplotlib)."""
    from benchmarks._charts import write_bar_chart

    return write_bar_chart(
        path,
        chart_panels(results),
        title="EMA checkpoint throughput against plain safetensors on the same tensors, higher is better",
        note=(
            f"{args.world_size} ranks, ZeRO-{args.stage}, fp32 EMAs of a {results[0]['params'] / 1e6:.1f}M-parameter "
            f"model; slowest rank, best of {args.repeat}; warm page cache"
        ),
        xlabel="GB/s (log scale)",
        value_format="{:.2f} GB/s".format,
        log=True,
    )


def print_device_checkpoint(device: str, mib: int, repeat: int) -> dict[str, float]:
    """Run :func:`device_checkpoint` and print its table; return its figures."""
    r = device_checkpoint(device, mib, repeat)
    print(
        f"EMA checkpoint on {device}: one process, {r['nbytes'] / 2**20:.0f} MiB fp32 EMA held on {device}, best of "
        f"{repeat}, warm page cache; ours verifies XXH3-64 checksums. Round trip bitwise: {bool(r['bitwise'])}"
    )
    print(f"{'operation':34s} {'ours GB/s':>10s} {'plain GB/s':>11s} {'ours/plain':>11s}")
    for label, ours, base in (
        ("save (+fsync)", "save", "plain_save"),
        ("load into new memory on the device", "load", "plain_load"),
        ("load into held buffers (out=)", "load_into", "plain_load_into"),
    ):
        print(f"{label:34s} {r[ours]:10.2f} {r[base]:11.2f} {r[ours] / r[base]:11.2f}")
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--mib", type=int, default=192, help="model size (fp32 MiB); each EMA is this big in total")
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu (default): DeepSpeed ranks on the CPU, as above. cuda: one process, a plain module's EMA on the GPU "
        "(save / load / load(out=) against safetensors; see device_checkpoint)",
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed afterwards)")
    ap.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also write a PNG chart of the GB/s figures here (needs matplotlib, the plot extra)",
    )
    args = ap.parse_args(argv)
    if args.device != "cpu":
        print_device_checkpoint(args.device, args.mib, args.repeat)
        return

    from functional_ema._testing.multirank import run_ranks

    with tempfile.TemporaryDirectory(prefix="fe_bench_", dir=args.dir) as tmp:
        results = run_ranks(
            "benchmarks.bench_checkpoint:worker",
            world_size=args.world_size,
            out_dir=tmp,
            mib=args.mib,
            stage=args.stage,
            repeat=args.repeat,
        )
    gbs = lambda nbytes, sec: nbytes / sec / 1e9  # noqa: E731
    print(
        f"EMA checkpoint benchmark: world_size={args.world_size}, ZeRO stage {args.stage}, fp32 EMAs, "
        f"{results[0]['params'] / 1e6:.1f}M parameters ({args.mib} MiB per EMA); best of {args.repeat}; warm page cache; "
        f"{os.cpu_count()} CPU cores. Ours verifies XXH3-64 checksums of every byte read (format 2 and later)."
    )
    for num_emas in (1, 2):
        s = _summary(results, num_emas)
        t, med, total, full, per_rank = s["t"], s["med"], s["total"], s["full"], s["per_rank"]
        if num_emas == 1:
            probe_bytes = per_rank  # the first-touch probe fills one EMA's share of a rank
        print(
            f"\n== {num_emas} EMA(s): {total / 2**20:.0f} MiB of EMA pieces in all ({per_rank / 2**20:.0f} MiB per rank) =="
        )
        print(
            f"{'operation':32s} {'ours GB/s':>10s} {'plain GB/s':>11s} {'ours/plain':>11s} {'(medians)':>10s}   baseline"
        )
        for label, which, ours, base, what in ROWS:
            nbytes = s[which]
            a, b = gbs(nbytes, t[ours]), gbs(nbytes, t[base])
            print(f"{label:32s} {a:10.2f} {b:11.2f} {a / b:11.2f} {med[base] / med[ours]:10.2f}   {what}")
        print(
            f"async save, blocking: {t['async_block'] * 1e3:.1f} ms per call (first call, allocating its buffer: "
            f"{t['async_block_first'] * 1e3:.1f} ms); one copy_ of this rank's {per_rank / 2**20:.0f} MiB: "
            f"{t['copy'] * 1e3:.1f} ms; ratio {t['async_block'] / t['copy']:.2f}x (target <= 1.5x)"
        )
        # Where the load time goes (slowest rank; the parts are measured separately).
        mine = per_rank
        print(
            f"load breakdown per rank ({mine / 2**20:.0f} MiB): open + validate the manifest and this rank's header "
            f"{t['open'] * 1e3:.1f} ms; read into fresh memory, no checks {t['load_noverify'] * 1e3:.1f} ms; "
            f"checks on top {max(0.0, t['load'] - t['load_noverify']) * 1e3:.1f} ms "
            f"(verified load {t['load'] * 1e3:.1f} ms)"
        )
        print(
            f"  one thread hashing the same bytes in memory: XXH3-64 {t['hash_xxh3'] * 1e3:.1f} ms "
            f"({gbs(mine, t['hash_xxh3']):.1f} GB/s), zlib CRC-32 {t['hash_crc32'] * 1e3:.1f} ms "
            f"({gbs(mine, t['hash_crc32']):.1f} GB/s)"
        )
        print(
            f"  previous format (CRC-32) on the same files: load {gbs(total, t['load_v1']):.2f} GB/s "
            f"({gbs(total, t['load_v1']) / gbs(total, t['plain_load_clone']):.2f}x plain), consolidate -> memory "
            f"{gbs(full, t['consolidate_mem_v1']):.2f} GB/s "
            f"({gbs(full, t['consolidate_mem_v1']) / gbs(full, t['plain_consolidate_mem']):.2f}x plain)"
        )
        print(f"consolidated file and async save equal consolidate(): {bool(t['consolidate_matches'])}")
    mib = probe_bytes >> 20
    probe = first_touch_probe(mib)
    print(
        f"\nfirst touch of a fresh {mib} MiB buffer (one process, one thread, median of 3; copy into it): "
        + "; ".join(f"{pages} pages {pause} {ms:.0f} ms" for (pages, pause), ms in probe.items()),
        flush=True,
    )
    if args.plot:
        write_chart(args.plot, results, args)


if __name__ == "__main__":
    main()
