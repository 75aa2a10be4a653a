"""Per-update cost of an EMA of a selection of the parameters (``local_shards(x, include=/exclude=)``) on real ranks.

One command (from the repository root; about a minute on 2 cores):

    .venv/bin/python benchmarks/bench_selection.py [--engines zero3 fsdp2 fsdp2_flat] [--rounds 20]

Launched like ``bench_update.py``: ``functional_ema._testing.multirank.run_ranks``, 2 ranks on CPU (gloo),
``OMP_NUM_THREADS=1``. The model is ``bench_update``'s 516-tensor transformer shape (32 blocks of 16 tensors,
an embedding, a final norm and a head), trained one bf16 step under DeepSpeed ZeRO-3 (fp32 masters) or FSDP2
(``fully_shard`` per block and on the root, bf16 ``MixedPrecisionPolicy``; ``fsdp2_flat``: then
``flatten_local_shards``, the opt-in one-buffer layout, where a selection's neighbours share segments as in
ZeRO-3's partitions). Two selections of about half the
parameters' bytes:

* ``first half``: ``include="blocks.*"``, ``exclude=["blocks.1[6-9].*", "blocks.2?.*", "blocks.3?.*"]``
  (blocks 0-15: neighbours in ZeRO-3's flat partitions, so one segment);
* ``every other block``: a predicate, ``name.startswith("blocks.")`` and an even block number (16 runs apart
  in ZeRO-3's partitions, each one segment).

Per selection, timed per update, each next to its roofline (one flat ``lerp_`` over as many fp32 elements as
the selected local pieces) in the order roofline, X, X, roofline (reversed every other round), in batches of 5
back-to-back calls after a barrier:

* ``fe.update(state, fe.local_shards(x, include=..., exclude=...))``: the per-step pair on the selection;
* ``torch._foreach_lerp_`` over prebuilt lists of the same selected local tensors;
* a flat ``copy_`` of the same bytes (8 bytes per element against the lerp's 12: below 1 is expected);
* and the full EMA (``fe.update(state, fe.local_shards(x))``) against its own roofline, for the per-byte cost
  without a selection.

``update alone`` (on the cached ``Shards``) and ``local_shards alone`` split the pair: the second is a constant
cost per step whatever the bytes (its ``x roofline`` is only its time over the roofline's), the same with and
without a selection.

``x roofline``: per round the slowest rank's time for X over the slowest rank's for its roofline, median over
rounds (paired timings cancel the machine's drift). A smaller roofline is itself faster per byte (more of it
stays in cache), so ``x roofline`` alone overstates a selection's cost; ``per element / full`` compares the
update's own time per fp32 element with the full EMA's, in the same round: 1.00 is the full EMA's speed per byte.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DECAY = 0.999
FIRST_HALF = {"include": "blocks.*", "exclude": ["blocks.1[6-9].*", "blocks.2?.*", "blocks.3?.*"]}


def even_blocks(name: str) -> bool:
    """Every other block (a module-level predicate: the same object at every call, so the selection is cached)."""
    return name.startswith("blocks.") and int(name.split(".")[1]) % 2 == 0


SELECTIONS = {"first half": FIRST_HALF, "every other block": {"include": even_blocks}}


class Block(nn.Module):
    """``bench_update``'s block: pre-LN, separate q/k/v, 16 parameter tensors."""

    def __init__(self, d: int, ff: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """32 blocks x 16 + embedding, final norm, head = 516 tensors (``bench_update``'s ``SmallTransformer``)."""

    def __init__(self, vocab: int = 4096, d: int = 160, ff: int = 640, layers: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, engine: nn.Module, step: int) -> torch.Tensor:
        tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(step))
        logits = engine(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def _trained(engine: str):
    """The object the verbs take, after one bf16 training step (``fsdp2_flat``: FSDP2, then
    ``flatten_local_shards``, the opt-in one-buffer layout)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Transformer()
    if engine == "zero3":
        from functional_ema._testing.multirank import make_engine

        eng = make_engine(3, "bf16", model=model, lr=1e-3)
        eng.backward(model.loss(eng, 1))
        eng.step()
        return eng
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.loss(model, 1).backward()
    opt.step()
    if engine == "fsdp2_flat":
        from functional_ema.engines.fsdp2 import flatten_local_shards

        flatten_local_shards(model)
    return model


def _batch(fn, n: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _flat(numel: int):
    src, ema = torch.randn(numel), torch.randn(numel)
    return lambda: ema.lerp_(src, 1 - DECAY)


def worker(engine: str, rounds: int, inner: int) -> dict:
    """This rank's paired timings (seconds per call) for every selection; see the module docstring."""
    import functional_ema as fe

    torch.set_num_threads(1)
    x = _trained(engine)
    full = fe.local_shards(x)
    full_state = fe.init_ema(full)
    n_full = sum(t.numel() for t in full.values())
    roof_full = _flat(n_full)
    approaches = {
        "full EMA": (lambda: fe.update(full_state, fe.local_shards(x), decay=DECAY), roof_full),
        "full EMA: local_shards alone": (lambda: fe.local_shards(x), roof_full),
    }
    info = {"full EMA": {"tensors": len(full), "segments": len(full.segments), "numel": n_full}}
    for label, sel in SELECTIONS.items():
        shards = fe.local_shards(x, **sel)
        state = fe.init_ema(shards)
        numel = sum(t.numel() for t in shards.values())
        tensors = list(shards.values())  # prebuilt lists of the same selected local tensors
        emas = [t.clone() for t in tensors]
        src, dst = torch.randn(numel), torch.empty(numel)
        roof = _flat(numel)
        approaches[f"{label}: update"] = (
            lambda s=state, sel=sel: fe.update(s, fe.local_shards(x, **sel), decay=DECAY),
            roof,
        )
        approaches[f"{label}: update alone"] = (lambda s=state, sh=shards: fe.update(s, sh, decay=DECAY), roof)
        approaches[f"{label}: local_shards alone"] = (lambda sel=sel: fe.local_shards(x, **sel), roof)
        approaches[f"{label}: _foreach_lerp_"] = (
            lambda e=emas, t=tensors: torch._foreach_lerp_(e, t, 1 - DECAY),
            roof,
        )
        approaches[f"{label}: copy_"] = (lambda d=dst, s=src: d.copy_(s), roof)
        assert fe.update_info(state, fe.local_shards(x, **sel)).fused
        info[label] = {"tensors": len(shards), "segments": len(shards.segments), "numel": numel}
    for fn, roof in approaches.values():  # warm up
        fn()
        roof()
    pairs: dict[str, list[list[float]]] = {k: [] for k in approaches}
    order = random.Random(0)
    for r in range(rounds):
        names = list(approaches)
        order.shuffle(names)
        for name in names:
            fn, roof = approaches[name]
            seq = [roof, fn, fn, roof] if r % 2 == 0 else [fn, roof, roof, fn]
            t = {"x": 0.0, "roof": 0.0}
            for f in seq:
                t["roof" if f is roof else "x"] += _batch(f, inner)
            pairs[name].append([t["x"], t["roof"]])
    return {"engine": engine, "info": info, "pairs": pairs}


def _slowest(per_rank: list[dict], name: str) -> list[float]:
    """Per round, the slowest rank's time for approach ``name`` (two batches)."""
    return [max(x for x, _ in rnd) for rnd in zip(*(r["pairs"][name] for r in per_rank))]


def report(per_rank: list[dict]) -> str:
    """The table: per approach its ``x roofline``, its fastest time, and for the selections' updates the time per
    fp32 element over the full EMA's (``per element / full``: per round the selection's update time over its
    elements, divided by the full EMA's over all the elements, median over rounds)."""
    engine, info = per_rank[0]["engine"], per_rank[0]["info"]
    lines = [f"{engine}, 2 ranks (local pieces of rank 0: tensors / segments / fp32 elements)"]
    for label, i in info.items():
        lines.append(f"  {label:18s} {i['tensors']:4d} tensors {i['segments']:4d} segments {i['numel']:>10,d} elements")
    lines.append(
        f"  {'approach':38s} {'x roofline (median)':>20s} {'ms/update':>10s} {'ns/element':>11s} {'per element / full':>19s}"
    )
    full = [t / info["full EMA"]["numel"] for t in _slowest(per_rank, "full EMA")]
    for name in per_rank[0]["pairs"]:
        rounds = zip(*(r["pairs"][name] for r in per_rank))
        ratios = [max(x for x, _ in rnd) / max(f for _, f in rnd) for rnd in rounds]
        fastest = max(min(x for x, _ in r["pairs"][name]) for r in per_rank) / 2  # two batches per round
        label = name.split(":")[0]
        per_el, vs_full = "", ""
        if label in info and (name == label or name.endswith(": update")):
            numel = info[label]["numel"]
            per_el = f"{fastest / numel * 1e9:.3f}"
            mine = [t / numel for t in _slowest(per_rank, name)]
            vs_full = f"{statistics.median(m / f for m, f in zip(mine, full)):.2f}"
        lines.append(
            f"  {name:38s} {statistics.median(ratios):20.2f} {fastest * 1e3:10.2f} {per_el:>11s} {vs_full:>19s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from functional_ema._testing.multirank import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--engines", nargs="+", default=["zero3", "fsdp2", "fsdp2_flat"], choices=["zero3", "fsdp2", "fsdp2_flat"]
    )
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args(argv)
    for engine in args.engines:
        t0 = time.time()
        per_rank = run_ranks(
            "benchmarks.bench_selection:worker",
            world_size=2,
            timeout=1800,
            env={"OMP_NUM_THREADS": "1"},
            engine=engine,
            rounds=args.rounds,
            inner=args.inner,
        )
        print(report(per_rank), flush=True)
        print(f"[{engine} done in {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
