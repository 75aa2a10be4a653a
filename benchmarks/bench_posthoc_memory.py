"""Peak memory of the post-hoc synthesis, per verb, against what the docstrings state.

A model shaped like a 2-layer Llama (vocabulary 16000, hidden 1024, MLP 2816; the embedding tied to the output,
20 parameters, 160.5 MiB in fp32, the largest 62.5 MiB) tracks two power EMAs; two snapshots are saved. Each verb
then runs in a fresh process, and its peak is that process's peak resident size (VmHWM, kept by the kernel: no
sampling) over its resident size just before the call (the high-water mark is reset first, through
/proc/self/clear_refs), with glibc's large blocks mapped on their own (MALLOC_MMAP_THRESHOLD_) so that freed ones
leave the resident size. Linux only.

    python benchmarks/bench_posthoc_memory.py

The stated bound (docstrings of posthoc_to_file, posthoc_offline, posthoc_local, synthesize):
float64 accumulators of one group (at most buffer_bytes; at least the largest parameter's, 8 bytes an element)
+ one parameter in the snapshots' dtype (or in the result's, while it is cast) + 4 MiB of scratch; plus the result
for posthoc_offline / posthoc_local, and for synthesize/reconstruct the accumulators of the whole tree.
"""

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

MiB = 1 << 20
SHAPES = {"embed": (16000, 1024), "norm": (1024,)}
for _i in range(2):
    SHAPES.update({f"l{_i}.{p}": (1024, 1024) for p in ("q", "k", "v", "o")})
    SHAPES.update({f"l{_i}.gate": (2816, 1024), f"l{_i}.up": (2816, 1024), f"l{_i}.down": (1024, 2816)})
    SHAPES.update({f"l{_i}.norm1": (1024,), f"l{_i}.norm2": (1024,)})


TINY = {"w": (8, 8)}


def model(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    m = torch.nn.Module()
    for n, s in shapes.items():
        m.register_parameter(n.replace(".", "_"), torch.nn.Parameter(torch.randn(s)))
    return m


def prepare(snap: str, shapes: dict[str, tuple[int, ...]]) -> None:
    import functional_ema as fe

    m = model(shapes)
    scheds = [fe.schedules.power(sigma_rel=s) for s in (0.05, 0.10)]
    state = fe.init_ema(fe.local_shards(m), num_emas=2)
    for step in range(1, 5):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.001)
        state = fe.update(state, fe.local_shards(m), step, decay=scheds)
        if step % 2 == 0:
            fe.posthoc.save_snapshot(state, m, snap, scheds)


def _mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def verb_call(verb: str, buffer_bytes: int, snap: str, shapes: dict[str, tuple[int, ...]]) -> Any:
    """A call of ``verb`` on the snapshots in ``snap`` (of a model of ``shapes``), ready to run."""
    import functional_ema as fe
    from functional_ema import posthoc

    kw: dict[str, Any] = dict(sigma_rel=0.08, max_profile_error=None)
    if verb == "reconstruct":
        snaps = [
            posthoc.Snapshot(s, (1.0, 2.0), tuple({n: torch.randn(t) for n, t in shapes.items()} for _ in range(2)))
            for s in (2, 4)
        ]
        return lambda: posthoc.reconstruct(snaps, **kw)
    if verb == "posthoc_to_file":
        out = os.path.join(os.path.dirname(snap), "out.safetensors")
        return lambda: posthoc.posthoc_to_file(snap, out, buffer_bytes=buffer_bytes, overwrite=True, **kw)
    if verb == "posthoc_local":
        specs = {n.replace(".", "_"): fe.ShardSpec(s, 0, torch.Size(s).numel()) for n, s in shapes.items()}
        layout = fe.ShardLayout(0, 1, 0, specs)
        return lambda: posthoc.posthoc_local(snap, layout, buffer_bytes=buffer_bytes, **kw)
    return lambda: posthoc.posthoc_offline(snap, buffer_bytes=buffer_bytes, **kw)


def child(verb: str, buffer_bytes: int, snap: str) -> None:
    # The same verb on a tiny model first: its first call's imports and caches (~4 MiB) are not the synthesis'.
    verb_call(verb, buffer_bytes, os.path.join(os.path.dirname(snap), "tiny"), TINY)()
    call = verb_call(verb, buffer_bytes, snap, SHAPES)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from VmRSS
    base = _mib("VmRSS")
    call()
    print(json.dumps({"peak_MiB": round(_mib("VmHWM") - base, 1)}))


def main() -> None:
    sizes = [4 * torch.Size(s).numel() / MiB for s in SHAPES.values()]
    total, largest = sum(sizes), max(sizes)
    print(f"model: {len(sizes)} parameters, {total:.1f} MiB fp32, largest {largest:.1f} MiB; 2 EMAs, 2 snapshots")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    with tempfile.TemporaryDirectory() as tmp:
        snap = os.path.join(tmp, "snaps")
        prepare(snap, SHAPES)
        prepare(os.path.join(tmp, "tiny"), TINY)
        runs = [(v, b) for v in ("posthoc_to_file", "posthoc_offline", "posthoc_local") for b in (32 * MiB, 1 << 30)]
        for verb, bb in [*runs, ("reconstruct", 0)]:
            args = [sys.executable, __file__, "--child", verb, str(bb), snap]
            out = subprocess.run(args, capture_output=True, text=True, env=env, check=True).stdout
            peak = json.loads(out.strip().splitlines()[-1])["peak_MiB"]
            if verb == "reconstruct":
                bound, what = 2 * total + largest + 4, "accumulators of the whole tree + one result leaf + 4 MiB"
            else:
                acc = max(2 * largest, min(bb / MiB, 2 * total))  # groups are whole parameters
                bound = acc + largest + 4 + (total if verb != "posthoc_to_file" else 0)
                what = "group accumulators + one parameter + 4 MiB" + (" + result" if verb != "posthoc_to_file" else "")
            label = f"{verb} buffer_bytes={bb // MiB} MiB" if bb else verb
            print(f"{label:42s} peak {peak:7.1f} MiB   stated bound <= {bound:7.1f} MiB ({what})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
