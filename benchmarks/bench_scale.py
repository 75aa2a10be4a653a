"""Checkpoint metadata work at scale, simulated in one process: N ranks' files of a Llama-70B-shaped model.

Usage::

    python benchmarks/bench_scale.py [--ranks 8 64 512 4096] [--layouts zero3 fsdp2 tp_pp_dp]

Every file is written through the library's own code (``writer.plan_save``, ``write_rank_file``,
``part_record``, ``build_manifest``, ``commit_manifest``) from the :class:`~functional_ema.ShardLayout`
each of the N ranks would have. The parameter list is Llama-3-70B's (723 tensors, their names and
row counts: 80 layers of q/k/v/o, gate/up/down and two norms, the embedding, the head, the final
norm), with one element per row instead of the row's width (two for row-parallel weights under
tensor parallelism, which split their columns): 8.3M elements (33 MB) in all whatever N, so the
pieces, specs, checksums, headers and manifest entries are the real ones while the data stays small.

Layouts: ``zero3`` (DeepSpeed ZeRO-3: every parameter flattened and cut into N equal pieces, the last
ones padded), ``fsdp2`` (dim-0 rows, ``ceil(rows / N)`` per rank), ``tp_pp_dp`` (tensor parallel 8
(2 for N = 8), pipeline stages of whole layers, the remaining ranks ZeRO-3 data parallel over each
part). Then, per layout and N:

* save: the N rank files and the manifest (time, file count, manifest bytes);
* load at another world size (N/2, ZeRO-3 cut): rank 0's reshard plan and reads, verified
  (``open_checkpoint(layout=...)`` + ``fill_all``, what ``fe.load`` runs on each rank);
* consolidate: the full tensors in memory (``fe.consolidate``), and export to one safetensors file
  (``fe.consolidate_to_file``).

Each step runs in a fresh process so its peak resident memory (``ru_maxrss``) is its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Llama-3-70B: hidden 8192, 80 layers, 64 heads / 8 KV heads of 128, MLP 28672, vocab 128256.
HIDDEN, LAYERS, KV, MLP, VOCAB = 8192, 80, 1024, 28672, 128256


def llama70b() -> list[tuple[str, int, int | None]]:
    """``(name, rows, tensor-parallel split dim)`` of every parameter, in model order (None: replicated)."""
    out: list[tuple[str, int, int | None]] = [("model.embed_tokens.weight", VOCAB, 0)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", HIDDEN, 0),
            (p + "self_attn.k_proj.weight", KV, 0),
            (p + "self_attn.v_proj.weight", KV, 0),
            (p + "self_attn.o_proj.weight", HIDDEN, 1),
            (p + "mlp.gate_proj.weight", MLP, 0),
            (p + "mlp.up_proj.weight", MLP, 0),
            (p + "mlp.down_proj.weight", HIDDEN, 1),
            (p + "input_layernorm.weight", HIDDEN, None),
            (p + "post_attention_layernorm.weight", HIDDEN, None),
        ]
    return [*out, ("model.norm.weight", HIDDEN, None), ("lm_head.weight", VOCAB, 0)]


def _stand_in_shape(rows: int, dim: int | None, norm: bool, tp: int) -> tuple[int, ...]:
    """The stand-in full shape: one element per row (norms are 1-D); row-parallel weights get ``tp``
    columns so each tensor-parallel rank holds one."""
    if norm:
        return (rows,)
    return (rows, tp if dim == 1 else 1)


def _zero3(shape: tuple[int, ...], rank: int, world: int):
    from functional_ema import ShardSpec

    numel = math.prod(shape)
    per = -(-numel // world)
    lo = min(rank * per, numel)
    return ShardSpec(shape, lo, max(0, min(per, numel - lo)))


def _fsdp2(shape: tuple[int, ...], rank: int, world: int):
    from functional_ema import ShardSpec

    row = math.prod(shape[1:])
    per = -(-shape[0] // world)
    r0 = min(rank * per, shape[0])
    return ShardSpec(shape, r0 * row, max(0, min(per, shape[0] - r0)) * row)


def grid(layout: str, n: int) -> tuple[int, int, int]:
    """(tensor parallel, pipeline stages, data parallel) of ``n`` ranks."""
    if layout != "tp_pp_dp":
        return 1, 1, n
    tp = 2 if n <= 8 else 8
    pp = max(1, min(8, n // tp // 2))
    return tp, pp, n // (tp * pp)


def rank_layout(layout: str, n: int, rank: int):
    """The :class:`ShardLayout` rank ``rank`` of ``n`` would report."""
    from functional_ema import ModelPart, ShardLayout

    params = llama70b()
    tp, pp, dp = grid(layout, n)
    if layout != "tp_pp_dp":
        cut = _zero3 if layout == "zero3" else _fsdp2
        specs = {
            name: cut(_stand_in_shape(rows, d, name.endswith("norm.weight"), 1), rank, n) for name, rows, d in params
        }
        return ShardLayout(rank, n, 3, specs, "deepspeed" if layout == "zero3" else "fsdp2")
    # Megatron order: tp fastest, then dp, then pp.
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    per_stage = -(-LAYERS // pp)
    mine = []
    for name, rows, dim in params:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        stage = 0 if name.startswith("model.embed") else pp - 1 if layer is None else layer // per_stage
        if stage == p:
            mine.append((name, rows, dim))
    specs, tp_dims = {}, {}
    for name, rows, dim in mine:
        full = _stand_in_shape(rows, dim, name.endswith("norm.weight"), tp)
        local = full if dim is None else tuple(s // tp if i == dim else s for i, s in enumerate(full))
        specs[name] = _zero3(local, d, dp)
        tp_dims[name] = dim
    return ShardLayout(d, dp, 3, specs, "deepspeed", ModelPart(t, tp, p, pp), tp_dims)


def step_save(layout: str, n: int, d: Path) -> dict:
    import torch

    from functional_ema._testing.files import write_simulated

    def pieces(lay) -> tuple:  # tiny values that differ per rank and parameter
        return (
            {
                name: torch.full((s.numel,), float(lay.rank % 7) + i * 1e-3)
                for i, (name, s) in enumerate(lay.specs.items())
            },
        )

    # A real rank holds only its own record until rank 0 gathers them; here they pile up in one process,
    # and the cyclic GC's full passes over the pile made the loop quadratic (22 s against 43 s at
    # N = 256): each rank's record is taken out of the collector's reach (gc.freeze).
    layouts = (rank_layout(layout, n, rank) for rank in range(n))
    write_simulated(d, "t", layouts, pieces, after_rank=gc.freeze)
    tag_dir = d / "t"
    files = [f for f in os.listdir(tag_dir) if f.endswith(".safetensors")]
    return {
        "files": len(files),
        "manifest_bytes": (tag_dir / "ema_manifest.json").stat().st_size,
        "data_bytes": sum((tag_dir / f).stat().st_size for f in files),
    }


def step_load(layout: str, n: int, d: Path) -> dict:
    """Rank 0 of a world of n // 2 (ZeRO-3 cut of the whole model, or of part 0 under model parallelism)."""
    import torch

    from functional_ema._checkpoint.reader import fill_all, open_checkpoint

    target = max(1, n // 2)
    if layout == "tp_pp_dp":
        tp, pp, dp = grid(layout, n)
        lay = rank_layout(layout, tp * pp * max(1, dp // 2), 0)
    else:
        lay = rank_layout("zero3", target, 0)
    with open_checkpoint(d, "t", True, lay) as ckpt:
        readers = ckpt.joined.readers if hasattr(ckpt, "joined") else [ckpt]  # a re-cut of model-parallel parts
        opened = sum(len(r.files) for r in readers)
        out = {name: torch.empty(s.numel) for name, s in lay.specs.items()}
        jobs = [(out[name], 0, name, s.offset, s.numel) for name, s in lay.specs.items()]
        fill_all(ckpt, jobs, True)
    return {"files_opened": opened, "elements": sum(s.numel for s in lay.specs.values())}


def step_consolidate(layout: str, n: int, d: Path) -> dict:
    import functional_ema as fe

    full = fe.consolidate(d, "t")
    return {"tensors": len(full), "elements": sum(t.numel() for t in full.values())}


def step_export(layout: str, n: int, d: Path) -> dict:
    import functional_ema as fe

    out = d / "export.safetensors"
    fe.consolidate_to_file(d, out, "t", progress=False)
    size = out.stat().st_size
    out.unlink()
    return {"bytes": size}


STEPS = {"save": step_save, "load": step_load, "consolidate": step_consolidate, "export": step_export}


def child(step: str, layout: str, n: int, d: str) -> None:
    """One step in this process; prints its figures as one JSON line."""
    import torch  # noqa: F401 - imported before the clock starts

    import functional_ema  # noqa: F401

    t0 = time.perf_counter()
    figures = STEPS[step](layout, n, Path(d))
    figures["seconds"] = time.perf_counter() - t0
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(figures), flush=True)


def run_step(step: str, layout: str, n: int, d: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", step, layout, str(n), d]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "FUNCTIONAL_EMA_IO_THREADS": os.environ.get("FUNCTIONAL_EMA_IO_THREADS", "2"),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    ap.add_argument("--layouts", nargs="+", default=["zero3", "fsdp2", "tp_pp_dp"])
    ap.add_argument("--steps", nargs="+", default=list(STEPS))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per step")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", nargs=4, metavar=("STEP", "LAYOUT", "N", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        step, layout, n, d = args.child
        child(step, layout, int(n), d)
        return
    params = llama70b()
    print(
        f"Llama-3-70B parameter list ({len(params)} tensors), one element per row; one process simulates every rank; "
        f"{os.cpu_count()} CPU cores"
    )
    print(f"{'layout':9s} {'N':>5s} {'tp,pp,dp':>9s} {'step':12s} {'seconds':>8s} {'peak MiB':>9s}  figures")
    for layout in args.layouts:
        for n in args.ranks:
            with tempfile.TemporaryDirectory(prefix="fe_scale_", dir=args.dir) as d:
                for step in args.steps:
                    r = run_step(step, layout, n, d, args.timeout)
                    if "error" in r:
                        print(f"{layout:9s} {n:5d} {grid(layout, n)!s:>9s} {step:12s} failed: {r['error']}", flush=True)
                        break
                    secs, peak = r.pop("seconds"), r.pop("peak_rss_mib")
                    print(
                        f"{layout:9s} {n:5d} {','.join(map(str, grid(layout, n))):>9s} {step:12s} {secs:8.2f} {peak:9.0f}  {r}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
