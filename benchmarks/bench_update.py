"""Per-update cost of EMA approaches on real multi-rank DeepSpeed ZeRO (CPU, gloo, 1 thread per rank).

One command (from the repository root; ~5 minutes on 2 cores, most of it building engines):

    .venv/bin/python benchmarks/bench_update.py

It launches real ranks with the test harness (``functional_ema._testing.multirank.run_ranks``: one process per rank,
wired like ``torchrun``, ``OMP_NUM_THREADS=1``), trains one bf16 step, then times, per update:

* ``functional_ema``: ``fe.update(state, fe.local_shards(engine))``, the per-step pair, in place;
  also with K=2 EMAs in one state, and ``update`` alone on cached shards.
* ``per-param gather (DeepSpeed-Chat)``: ``moving_average`` of DeepSpeed-Chat, over a second,
  ZeRO-3-partitioned EMA model: per parameter ``GatheredParameters([p, p_ema], modifier_rank=0)`` and
  ``p_ema.data.copy_(torch.lerp(p.data, p_ema.data, decay))`` on rank 0. DeepSpeed-Chat itself passes
  no ``modifier_rank``, which under ZeRO-3 discards the update on exit (checked and printed below);
  ``modifier_rank=0`` is the variant that works. On ZeRO-2 nothing is partitioned: a per-tensor lerp
  of a full 16-bit EMA copy.
* ``gather everything (diffusers / DSEma)``: gather all parameters, lerp a full fp32 EMA held on
  every rank.
* ``LitEma formula on local shards``: ``ema.sub_((1 - decay) * (ema - p))`` per local fp32 shard.
* ``roofline``: one flat ``lerp_`` over as many fp32 elements as this rank's shards (12 bytes per
  element). For K=2 EMAs the roofline moves (4 + 8K) = 20 bytes per element: a flat ``lerp_`` over
  20/12 as many elements, timed (not scaled: see ``roofline_k2`` in ``worker``).

Timing: every timing is a barrier, then a batch of 5 back-to-back calls timed together (one call
for the gathering approaches): all ranks update at once, as in training, so a batch measures the
steady state with the ranks sharing the memory bandwidth. Each fast approach is timed next to its
roofline, in the order roofline, approach, approach, roofline (reversed every other round), 25
rounds. ``x roofline``: per round the slowest rank's time for the approach's two batches over the
slowest rank's time for the roofline's two (a step waits for the slowest rank), median over rounds
(the machine's speed drifts over seconds; paired timings cancel it). The same roofline timed on
other buffers ("noise check") shows how far from 1.00 the method itself lands.
``ms/update``: per rank the minimum (median) over batches of the per-call time, then the slowest
rank. Bytes communicated: every call into
``torch.distributed`` and DeepSpeed's comm backend is wrapped and counts, per collective, its largest
tensor argument (the full buffer of an all-gather, the tensor of a broadcast). Memory: ``EMA`` is the
persistent EMA storage per rank; ``peak transient`` is the most extra CPU memory allocated through
PyTorch during one update (torch.profiler memory events).

FSDP2 (2 ranks, the 516-tensor transformer, ``fully_shard`` per block and on the root, bf16
``MixedPrecisionPolicy``): ``local_shards + update`` and ``update`` alone against the same flat
roofline and against ``torch._foreach_lerp_`` over the parameters' local shards, timed the same way.

The default path against the simplest alternative (issue 38): for FSDP2 and the plain module, ``local_shards +
update`` and ``update`` alone are also timed directly against ``torch._foreach_lerp_`` over prebuilt lists of the
same tensors (the state's EMA tensors and the weights, so both sides touch the very same memory), interleaved
(foreach, X, X, foreach, reversed every other round, twice the rounds); the report gives the median of the
per-round ratios, the ratio of the minima, the spread, and the load average before and after (the CI machine is
shared: run it twice before trusting a ratio).

FSDP2 over tensor parallelism (4 ranks, ``--engines fsdp2_tp``): the same transformer on a (dp 2, tp 2)
mesh, each block's MLP tensor parallel (``fc1`` colwise, ``fc2`` rowwise), then ``fully_shard`` over dp.

Options: ``--engines zero fsdp2 fsdp2_tp module`` (all by default), ``--world-sizes 2 4``, ``--rounds 25``, ``--quick`` (small models, for a smoke test),
``--json PATH`` (the raw per-rank results), ``--plot PATH`` (a PNG chart of the "x roofline" figures, one panel per
engine configuration, stamped with the machine and the commit; needs matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DECAY = 0.999

# --------------------------------------------------------------------------------------------- models


class Block(nn.Module):
    """Pre-LN transformer block with separate q/k/v: 16 parameter tensors."""

    def __init__(self, d: int, ff: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class SmallTransformer(nn.Module):
    """Many tensors: 32 blocks x 16 + embedding, final norm, head = 516 tensors."""

    def __init__(self, vocab=4096, d=160, ff=640, layers=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def example_loss(self, engine, step):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, self.emb.num_embeddings, (2, 16), generator=g)
        logits = engine(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))


class WideMLP(nn.Module):
    """Few large tensors: 3 square layers with biases = 6 tensors."""

    def __init__(self, d=1920, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.gelu(layer(x))
        return x

    def example_loss(self, engine, step):
        g = torch.Generator().manual_seed(step)
        d = self.layers[0].in_features
        x = torch.randn(4, d, generator=g).to(torch.bfloat16)
        return engine(x).float().pow(2).mean()


def build_model(name: str, quick: bool) -> nn.Module:
    if name == "transformer":
        return SmallTransformer(d=32, ff=64, vocab=256) if quick else SmallTransformer()
    return WideMLP(d=256) if quick else WideMLP()


# ------------------------------------------------------------------------------- measuring helpers

_COLLECTIVES = [
    "all_reduce",
    "inference_all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
]


def _arg_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_arg_bytes(t) for t in x)
    return 0


class CommCounter:
    """Counts collectives and their bytes through torch.distributed and DeepSpeed's comm backend.

    Only the outermost wrapped call counts (DeepSpeed's backend calls torch.distributed itself).
    """

    def __init__(self):
        self.calls = 0
        self.bytes = 0
        self.active = False
        self._depth = threading.local()
        self._saved = []

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from deepspeed.comm import comm as ds_comm

        targets = [dist, c10d]
        if getattr(ds_comm, "cdb", None) is not None:
            targets.append(ds_comm.cdb)
        for obj in targets:
            for name in _COLLECTIVES:
                fn = getattr(obj, name, None)
                if fn is None or not callable(fn):
                    continue
                self._saved.append((obj, name, obj.__dict__.get(name, None) if hasattr(obj, "__dict__") else None))
                setattr(obj, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self.active:
                self.calls += 1
                self.bytes += max([_arg_bytes(a) for a in (*args, *kwargs.values())] or [0])
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return wrapped

    @contextlib.contextmanager
    def counting(self):
        self.calls = self.bytes = 0
        self.active = True
        try:
            yield self
        finally:
            self.active = False


def peak_transient_bytes(fn) -> int:
    """Most extra memory allocated through PyTorch's CPU allocator while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    totals = [e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]"]
    return max([0, *totals])


# ---------------------------------------------------------------------------------------- worker


def _train_step(engine, step):
    loss = engine.module.example_loss(engine, step)
    engine.backward(loss)
    engine.step()


def _ema_engine(model: nn.Module, stage: int):
    """DeepSpeed-Chat keeps its EMA model in a second engine (no optimizer): ZeRO-3-partitioned."""
    import deepspeed

    from functional_ema._testing.multirank import ds_config

    if stage != 3:
        return model.to(torch.bfloat16)  # ZeRO-2 does not partition parameters: a full 16-bit copy
    cfg = ds_config(3, "bf16")
    cfg.pop("zero_allow_untested_optimizer", None)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine.module


def timed_batch(fn, n: int, synchronize: bool = True) -> float:
    """Seconds per call of ``n`` back-to-back calls of ``fn``, after a barrier across the ranks
    (all ranks update at the same time, as in training)."""
    if synchronize:
        import torch.distributed as dist

        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def overhead_table(sizes=(16, 516, 5000), reps: int = 60) -> list[dict]:
    """Cost of one ``fe.update`` call beyond the arithmetic, by number of tensors (one process).

    The shards are 1-element views of one buffer, so the lerp itself is negligible. "same Shards":
    the ``Shards`` object of the last call again (what ``update(state, local_shards(engine))``
    passes every step: one identity check, then one fused lerp); "plain dict": a dict of the same
    tensors (the per-tensor path: every name and shape checked each call). "cold": right after a
    32 MiB lerp_ has flushed the CPU caches, as after an optimizer step.
    """
    import functional_ema as fe

    torch.set_num_threads(1)
    flush_src = torch.randn(8 << 20)
    flush_dst = flush_src.clone()
    rows = []
    for n in sizes:
        buf = torch.zeros(2 * n)
        views = {f"p{i:05d}": buf[2 * i : 2 * i + 1] for i in range(n)}
        shards = fe.Shards.from_views(views)
        state = fe.init_ema(shards)
        dict_state = fe.init_ema(views)
        ema_buf = buf.clone()
        row = {"tensors": n}
        calls = (
            ("same", lambda: shards, lambda arg: fe.update(state, arg, decay=DECAY)),
            ("new", lambda: views, lambda arg: fe.update(dict_state, arg, decay=DECAY)),
            ("lerp", lambda: None, lambda arg: ema_buf.lerp_(buf, 1 - DECAY)),  # the floor: one bare lerp_
        )
        for label, make, call in calls:
            for cold in (False, True):
                times = []
                for _ in range(reps):
                    arg = make()
                    if cold:
                        flush_dst.lerp_(flush_src, 0.5)
                    t0 = time.perf_counter()
                    call(arg)
                    times.append(time.perf_counter() - t0)
                row[f"{label}_{'cold' if cold else 'warm'}"] = statistics.median(times) * 1e6
        rows.append(row)
    return rows


def plain_module_table(rounds: int = 25, inner: int = 5, quick: bool = False) -> dict:
    """A plain (or DDP: the same per-rank work) module, one process: ``local_shards + update``
    against ``torch._foreach_lerp_`` over the parameters (lists built once, outside the timing)
    and one flat ``lerp_`` over the same number of elements. Paired rounds, as for the engines."""
    import functional_ema as fe

    torch.set_num_threads(1)
    model = build_model("transformer", quick)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    state = fe.init_ema(fe.local_shards(model))
    ema_list = [p.detach().clone() for p in params]
    src_list = [p.detach() for p in params]
    flat_src, flat_ema = torch.randn(numel), torch.randn(numel)
    w = 1 - DECAY

    def batch(fn):
        return timed_batch(fn, inner, synchronize=False)

    # The opt-in layout (functional_ema.engines.module.flatten_parameters): the same model with
    # every trainable parameter a view of one flat buffer, so update is one lerp_.
    from functional_ema.engines.module import flatten_parameters

    flat_model = build_model("transformer", quick)
    flatten_parameters(flat_model)
    flat_state = fe.init_ema(fe.local_shards(flat_model))

    shards = fe.local_shards(model)
    lib = lambda: fe.update(state, fe.local_shards(model), decay=DECAY)  # noqa: E731
    lib_update_only = lambda: fe.update(state, shards, decay=DECAY)  # noqa: E731
    lib_flat = lambda: fe.update(flat_state, fe.local_shards(flat_model), decay=DECAY)  # noqa: E731
    foreach = lambda: torch._foreach_lerp_(ema_list, src_list, w)  # noqa: E731
    roof = lambda: flat_ema.lerp_(flat_src, w)  # noqa: E731
    for fn in (lib, lib_update_only, lib_flat, foreach, roof):
        batch(fn)  # warm up
    load_before = os.getloadavg()
    pairs = {"lib": [], "lib_flat": [], "foreach": []}
    times = {"lib": [], "lib_flat": [], "foreach": [], "roofline": []}
    for r in range(rounds):
        for key, fn in (("lib", lib), ("lib_flat", lib_flat), ("foreach", foreach)):
            order = (roof, fn, fn, roof) if r % 2 == 0 else (fn, roof, roof, fn)
            got = [batch(f) for f in order]
            t_fn = sum(g for f, g in zip(order, got) if f is fn)
            t_roof = sum(g for f, g in zip(order, got) if f is roof)
            pairs[key].append(t_fn / t_roof)
            times[key] += [g for f, g in zip(order, got) if f is fn]
            times["roofline"] += [g for f, g in zip(order, got) if f is roof]
    # The direct comparison runs the foreach over the state's own EMA tensors, so both sides touch the very
    # same memory: equal-sized buffer sets placed differently by the allocator ran up to 15% apart here.
    same_emas = list(state.ema.segments)
    foreach_same = lambda: torch._foreach_lerp_(same_emas, src_list, w)  # noqa: E731
    direct = _direct_pairs({"lib": lib, "lib_update_only": lib_update_only}, foreach_same, 2 * rounds, batch)
    return {
        "direct": direct,
        "load": [load_before, os.getloadavg()],
        "tensors": len(params),
        "params": numel,
        "ms_min": {k: min(v) * 1e3 for k, v in times.items()},
        "ms_median": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "x_roofline": {k: statistics.median(v) for k, v in pairs.items()},
        "ema_bytes": fe.ema_nbytes(state),
        "fused": fe.update_info(state, fe.local_shards(model)).fused,
        "flat_segments": len(fe.local_shards(flat_model).segments),
    }


def _direct_pairs(approaches: dict, foreach, rounds: int, batch) -> dict:
    """Each approach timed next to ``torch._foreach_lerp_`` over prebuilt lists, interleaved: per round
    foreach, X, X, foreach (reversed every other round), one batch each. Returns per approach the rounds'
    ``[time of X's two batches, time of foreach's two]`` (the report takes ratios, medians and minima)."""
    out: dict = {k: [] for k in approaches}
    for r in range(rounds):
        for key, fn in approaches.items():
            order = (foreach, fn, fn, foreach) if r % 2 == 0 else (fn, foreach, foreach, fn)
            got = [batch(f) for f in order]
            out[key].append(
                [sum(g for f, g in zip(order, got) if f is fn), sum(g for f, g in zip(order, got) if f is foreach)]
            )
    return out


def _direct_summary(rounds_of: list[list[float]]) -> tuple[float, float, float]:
    """(median over rounds of X / foreach, the same ratio of the minima of X's and foreach's rounds, its
    25th-75th percentile spread)."""
    ratios = sorted(x / f for x, f in rounds_of)
    n = len(ratios)
    mins = min(x for x, _ in rounds_of) / min(f for _, f in rounds_of)
    return statistics.median(ratios), mins, ratios[(3 * n) // 4] - ratios[n // 4]


def worker(configs, rounds=25, inner=5, quick=False):
    import torch.distributed as dist

    torch.set_num_threads(1)
    counter = CommCounter().install()
    results = []
    for stage, model_name in configs:
        bench = _bench_fsdp2 if str(stage).startswith("fsdp2") else _bench_config
        results.append(bench(stage, model_name, rounds, inner, quick, counter))
        dist.barrier()
    return results


def _fsdp2_model(stage: str, model_name: str, quick: bool):
    """The benchmark model under FSDP2 (``stage="fsdp2"``: a 1-D mesh over every rank), or over tensor
    parallelism (``"fsdp2_tp"``: a (dp, tp=2) mesh, each block's MLP ``fc1`` colwise and ``fc2`` rowwise)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = build_model(model_name, quick)
    blocks = getattr(model, "blocks", getattr(model, "layers", []))
    if stage == "fsdp2_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh2 = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        for blk in blocks:
            parallelize_module(blk, mesh2["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        mesh = mesh2["dp"]
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for blk in blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _bench_fsdp2(stage, model_name, rounds, inner, quick, counter):
    """FSDP2 (``fully_shard`` per block and on the root, bf16 ``MixedPrecisionPolicy``; ``fsdp2_tp``:
    over tensor parallelism, see :func:`_fsdp2_model`): the library vs one flat ``lerp_`` over as many
    elements and vs ``torch._foreach_lerp_`` over the local shards (``p._local_tensor``: what a
    hand-written sharded EMA would run)."""
    import torch.distributed as dist

    import functional_ema as fe

    rank = dist.get_rank()
    model = _fsdp2_model(stage, model_name, quick)
    n_tensors = sum(1 for _ in model.parameters())
    n_full = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.example_loss(model, 1).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    shards = fe.local_shards(model)
    n_local = sum(t.numel() for t in shards.values())
    state = fe.init_ema(shards)

    def lib():
        fe.update(state, fe.local_shards(model), decay=DECAY)

    def lib_update_only():
        fe.update(state, shards, decay=DECAY)

    def local_shards_only():
        fe.local_shards(model)

    src_flat = torch.cat([t.reshape(-1) for t in shards.values()])
    ema_flat = src_flat.clone()
    src_flat2, ema_flat2 = src_flat.clone(), src_flat.clone()

    def roofline():
        ema_flat.lerp_(src_flat, 1 - DECAY)

    def roofline_again():
        ema_flat2.lerp_(src_flat2, 1 - DECAY)

    locals_ = [p._local_tensor for p in model.parameters()]
    foreach_ema = [t.clone() for t in locals_]

    def foreach():
        torch._foreach_lerp_(foreach_ema, locals_, 1 - DECAY)

    # The opt-in layout (functional_ema.engines.fsdp2.flatten_local_shards): the same model with
    # FSDP2's per-parameter shard buffers moved into one flat buffer, so local_shards finds one
    # segment and update is one lerp_.
    from functional_ema.engines.fsdp2 import flatten_local_shards

    flat_model = _fsdp2_model(stage, model_name, quick)
    flatten_local_shards(flat_model)  # the opt-in one-buffer layout
    flat_opt = torch.optim.AdamW(flat_model.parameters(), lr=1e-3)
    flat_model.example_loss(flat_model, 1).backward()
    flat_opt.step()
    flat_shards = fe.local_shards(flat_model)
    flat_state = fe.init_ema(flat_shards)
    # FSDP2 replaced the second model's local tensors above (flatten_local_shards, lazy init), which makes every
    # FSDP2 reading of this process stale once: read `model` again, so "update alone" passes the Shards that
    # local_shards returns from now on (passing the first one would make each update alternate between two
    # Shards objects and rebuild its plan, as it did in the figures before 2026-12-06).
    shards = fe.local_shards(model)
    assert fe.local_shards(model) is shards

    def lib_one_buffer():
        fe.update(flat_state, fe.local_shards(flat_model), decay=DECAY)

    def lib_one_buffer_update_only():
        fe.update(flat_state, flat_shards, decay=DECAY)

    approaches = {
        "lib": lib,
        "lib_update_only": lib_update_only,
        "local_shards_only": local_shards_only,
        "foreach": foreach,
        "lib_one_buffer": lib_one_buffer,
        "lib_one_buffer_update_only": lib_one_buffer_update_only,
        "roofline": roofline,
        "roofline_again": roofline_again,
    }
    for fn in approaches.values():  # warm up
        dist.barrier()
        fn()

    batch = timed_batch
    load_before = os.getloadavg()

    # The same paired method as _bench_config: per round roofline, X, X, roofline (or reversed).
    samples = {k: [] for k in approaches}
    rounds_of = {k: [] for k in approaches}
    order = random.Random(0)
    for r in range(rounds):
        names = [k for k in approaches if k != "roofline"]
        order.shuffle(names)
        for name in names:
            seq = ["roofline", name, name, "roofline"] if r % 2 == 0 else [name, "roofline", "roofline", name]
            t = {"roofline": 0.0, name: 0.0}
            for k in seq:
                dt = batch(approaches[k], inner)
                samples[k].append(dt)
                t[k] += dt
            rounds_of[name].append([t[name], t["roofline"]])
    rounds_of["roofline"] = [[1.0, 1.0]]
    # The default path against the simplest alternative, interleaved directly (issue 38): foreach, X, X,
    # foreach, every rank at once (each batch after a barrier).
    # Over the state's own EMA tensors (one per local shard, in the same order), so both sides touch the very
    # same memory (see plain_module_table).
    same_emas = list(state.ema.segments)
    assert [t.shape for t in same_emas] == [t.shape for t in locals_]

    def foreach_same():
        torch._foreach_lerp_(same_emas, locals_, 1 - DECAY)

    direct = _direct_pairs(
        {"lib": lib, "lib_update_only": lib_update_only}, foreach_same, 2 * rounds, lambda f: batch(f, inner)
    )
    comm = {}
    for name, fn in approaches.items():
        dist.barrier()
        with counter.counting():
            fn()
        comm[name] = [counter.calls, counter.bytes]
    return {
        "stage": stage,
        "model": model_name,
        "world_size": dist.get_world_size(),
        "rank": rank,
        "tensors": n_tensors,
        "params": n_full,
        "local_numel": n_local,
        "segments": len(shards.segments),
        "local_tensors": len(locals_),
        "one_buffer_segments": len(flat_shards.segments),
        "distinct_storages": len({t.untyped_storage().data_ptr() for t in locals_}),
        "min_ms": {k: min(v) * 1e3 for k, v in samples.items()},
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
        "comm": comm,
        "ema_bytes": {"lib": fe.ema_nbytes(state)},
        "rounds": rounds_of,
        "direct": direct,
        "load": [load_before, os.getloadavg()],
    }


def _bench_config(stage, model_name, rounds, inner, quick, counter):
    """All approaches on one (stage, model); returns this rank's figures."""
    import copy

    import deepspeed
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema._testing.multirank import make_engine

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model(model_name, quick)
    ema_model = copy.deepcopy(model)
    n_tensors = sum(1 for _ in model.parameters())
    n_full = sum(p.numel() for p in model.parameters())
    engine = make_engine(stage, "bf16", model=model, lr=1e-3)
    _train_step(engine, 1)
    ema_module = _ema_engine(ema_model, stage)
    params = list(engine.module.parameters())
    ema_params = list(ema_module.parameters())
    z3 = stage == 3

    # --- this library
    shards = fe.local_shards(engine)
    n_local = sum(t.numel() for t in shards.values())
    state = fe.init_ema(shards)
    state2 = fe.init_ema(shards, num_emas=2)

    def lib():
        fe.update(state, fe.local_shards(engine), decay=DECAY)

    def lib_k2():
        fe.update(state2, fe.local_shards(engine), decay=(DECAY, 0.9999))

    def lib_update_only():
        fe.update(state, shards, decay=DECAY)

    # --- the same with the NaN/inf guard: one more read of the weights and a 256-byte all-reduce per update
    state_g = fe.init_ema(shards)
    guard_step = iter(range(1, 1 << 62))

    def lib_guard():
        fe.update(state_g, fe.local_shards(engine), next(guard_step), decay=DECAY, nonfinite="skip")

    # --- roofline: one flat lerp_ over the same number of fp32 elements
    src_flat = torch.cat([t.reshape(-1) for t in shards.values()])
    ema_flat = src_flat.clone()

    def roofline():
        ema_flat.lerp_(src_flat, 1 - DECAY)

    # --- the same roofline on other buffers: its ratio to `roofline` is the noise of the method
    src_flat2, ema_flat2 = src_flat.clone(), src_flat.clone()

    def roofline_again():
        ema_flat2.lerp_(src_flat2, 1 - DECAY)

    # --- roofline for K=2 EMAs: 4 + 8K = 20 bytes per element, i.e. a flat lerp_ (12 bytes per
    # element) over 20/12 as many elements. Timed, not scaled from `roofline`: with other
    # processes on the cores a longer call is interrupted more often, and a scaled figure would
    # flatter the roofline.
    src_k2 = torch.cat([src_flat, src_flat[: (src_flat.numel() * 2) // 3]])
    ema_k2 = src_k2.clone()

    def roofline_k2():
        ema_k2.lerp_(src_k2, 1 - DECAY)

    # --- LitEma's formula on the local shards, one EMA tensor per shard
    lit = {n: t.clone() for n, t in shards.items()}

    def litema():
        with torch.no_grad():
            local = fe.local_shards(engine)
            for n, e in lit.items():
                e.sub_((1 - DECAY) * (e - local[n]))

    # --- DeepSpeed-Chat moving_average, working variant (modifier_rank=0)
    def ds_chat(modifier_rank=0, subset=None):
        with torch.no_grad():
            for p, pe in list(zip(params, ema_params))[:subset]:
                with deepspeed.zero.GatheredParameters([p, pe], modifier_rank=modifier_rank, enabled=z3):
                    if rank == 0 or not z3:
                        pe.data.copy_(torch.lerp(p.data, pe.data, DECAY))

    # --- gather everything, lerp a full fp32 EMA on every rank
    full_ema = [p.detach().float().clone() if not z3 else torch.zeros(p.ds_shape) for p in params]
    if z3:
        with deepspeed.zero.GatheredParameters(params):
            for e, p in zip(full_ema, params):
                e.copy_(p.data)

    def gather_all():
        with torch.no_grad(), deepspeed.zero.GatheredParameters(params, enabled=z3):
            for e, p in zip(full_ema, params):
                e.lerp_(p.data.float(), 1 - DECAY)

    approaches = {
        "lib": lib,
        "lib_update_only": lib_update_only,
        "lib_k2": lib_k2,
        "lib_guard": lib_guard,
        "roofline": roofline,
        "roofline_k2": roofline_k2,
        "roofline_again": roofline_again,
        "litema": litema,
        "ds_chat": ds_chat,
        "gather_all": gather_all,
    }
    fast = ["lib", "lib_update_only", "lib_k2", "lib_guard", "roofline", "roofline_k2", "roofline_again", "litema"]
    for fn in approaches.values():  # warm up (plans, page faults)
        dist.barrier()
        fn()
    # All ranks update at the same time, as in training: each timing is a barrier, then a batch of
    # back-to-back calls timed together, so it measures the steady state with the ranks sharing
    # the memory bandwidth. (Timing single calls after a barrier measures, at the minimum, a call
    # that happened to run alone while the other rank was late, and ratios of such minima swing
    # with that luck.) The machine's speed drifts over seconds (other processes, other VMs), so
    # each fast approach is compared with its roofline in the same moment: per round, batches in
    # the order roofline, approach, approach, roofline (or the reverse, alternating), and the
    # round's ratio is the approach's two batches over the roofline's two.
    batch = timed_batch

    samples = {k: [] for k in approaches}  # seconds per call, one entry per batch
    # per round: [this approach's seconds, its roofline's seconds]; the report takes the slowest
    # rank of each (the step waits for it), then the ratio, then the median over rounds
    rounds_of = {k: [] for k in approaches}
    order = random.Random(0)  # the same order on every rank: the collectives must match
    for r in range(rounds):
        names = [k for k in fast if k not in ("roofline", "roofline_k2")]
        order.shuffle(names)
        for name in names:
            ref = "roofline_k2" if name == "lib_k2" else "roofline"
            seq = [ref, name, name, ref] if r % 2 == 0 else [name, ref, ref, name]
            t = {ref: 0.0, name: 0.0}
            for k in seq:
                dt = batch(approaches[k], inner)
                samples[k].append(dt)
                t[k] += dt
            rounds_of[name].append([t[name], t[ref]])
    for _ in range(3):  # the gathering approaches: milliseconds to seconds a call
        for name in ("ds_chat", "gather_all"):
            samples[name].append(batch(approaches[name], 1))
            samples["roofline"].append(batch(roofline, inner))
            rounds_of[name].append([samples[name][-1], samples["roofline"][-1]])
    rounds_of["roofline"] = [[1.0, 1.0]]
    rounds_of["roofline_k2"] = [[statistics.median(samples["roofline_k2"]), statistics.median(samples["roofline"])]]
    comm, peak = {}, {}
    for name, fn in approaches.items():
        dist.barrier()
        with counter.counting():
            fn()
        comm[name] = [counter.calls, counter.bytes]
        dist.barrier()
        peak[name] = peak_transient_bytes(fn)

    # DeepSpeed-Chat as published (no modifier_rank): does the EMA change under ZeRO-3?
    noop = None
    if z3:
        pe = ema_params[0]
        with deepspeed.zero.GatheredParameters([pe]):
            before = pe.data.clone()
        with torch.no_grad(), deepspeed.zero.GatheredParameters([params[0], pe], enabled=True):
            pe.data.copy_(torch.lerp(params[0].data, pe.data, 0.5))
        with deepspeed.zero.GatheredParameters([pe]):
            noop = bool(torch.equal(before, pe.data))

    ema_bytes = {
        "lib": fe.ema_nbytes(state),
        "lib_update_only": fe.ema_nbytes(state),
        "lib_k2": fe.ema_nbytes(state2),
        "lib_guard": fe.ema_nbytes(state_g),
        "roofline": ema_flat.numel() * 4,
        "roofline_k2": ema_k2.numel() * 4,
        "roofline_again": ema_flat2.numel() * 4,
        "litema": sum(t.numel() * 4 for t in lit.values()),
        "ds_chat": sum((p.ds_tensor.numel() if z3 else p.numel()) * p.element_size() for p in ema_params),
        "gather_all": sum(t.numel() * 4 for t in full_ema),
    }
    return {
        "stage": stage,
        "model": model_name,
        "world_size": dist.get_world_size(),
        "rank": rank,
        "tensors": n_tensors,
        "params": n_full,
        "local_numel": n_local,
        "min_ms": {k: min(v) * 1e3 for k, v in samples.items()},
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
        "comm": comm,
        "peak_transient": peak,
        "ema_bytes": ema_bytes,
        "ds_chat_without_modifier_is_noop": noop,
        "rounds": rounds_of,
    }


# ------------------------------------------------------------------------------------------ report

LABELS = {
    "lib": "functional_ema: local_shards + update",
    "lib_update_only": "functional_ema: update alone",
    "lib_k2": "functional_ema: K=2 EMAs, one pass",
    "lib_guard": 'functional_ema: local_shards + update(nonfinite="skip")',
    "roofline": "roofline: one flat lerp_",
    "roofline_k2": "roofline for K=2: flat lerp_ moving 20 B/element",
    "roofline_again": "noise check: the roofline on other buffers",
    "litema": "LitEma formula on local shards",
    "ds_chat": "per-param gather (DS-Chat, modifier_rank=0)",
    "gather_all": "gather everything (diffusers / DSEma)",
}


FSDP2_LABELS = {
    "lib": "functional_ema: local_shards + update",
    "lib_update_only": "functional_ema: update alone",
    "local_shards_only": "functional_ema: local_shards alone",
    "foreach": "torch._foreach_lerp_ over the local shards",
    "lib_one_buffer": "functional_ema after `flatten_local_shards(model)`: local_shards + update",
    "lib_one_buffer_update_only": "functional_ema after `flatten_local_shards(model)`: update alone",
    "roofline": "roofline: one flat lerp_",
    "roofline_again": "noise check: the roofline on other buffers",
}


def report_fsdp2(w: int, model: str, reps: list[dict]) -> list[str]:
    r0 = next(r for r in reps if r["rank"] == 0)
    how = (
        "fully_shard per block + root over dp, each block's MLP tensor parallel 2 (fc1 colwise, fc2 rowwise)"
        if r0["stage"] == "fsdp2_tp"
        else "fully_shard per block + root"
    )
    t_min = {k: max(r["min_ms"][k] for r in reps) for k in FSDP2_LABELS}
    t_med = {k: max(r["median_ms"][k] for r in reps) for k in FSDP2_LABELS}
    ratio = {k: _paired_ratio([r["rounds"][k] for r in reps]) for k in FSDP2_LABELS}
    local = max(r["local_numel"] for r in reps)
    lines = [
        f"\n### FSDP2 ({how}, bf16 MixedPrecisionPolicy), {w} ranks, {model}: {r0['tensors']} "
        f"tensors, {r0['params'] / 1e6:.1f}M params, <= {local / 1e6:.2f}M fp32 elements per rank in "
        f"{r0['distinct_storages']} separate storages ({r0['segments']} segments in local_shards; "
        f"{r0['one_buffer_segments']} after `flatten_local_shards`)",
        "",
        "| approach | ms/update, min (median) over rounds | x roofline | bytes communicated |",
        "|---|---|---|---|",
    ]
    for k, label in FSDP2_LABELS.items():
        lines.append(
            f"| {label} | {t_min[k]:.3f} ({t_med[k]:.3f}) | {ratio[k]:.2f} | {max(r['comm'][k][1] for r in reps):,} |"
        )
    if "direct" in r0:
        # Per round the slowest rank's time for each side (a step waits for the slowest rank).
        direct = {
            k: [[max(r["direct"][k][i][0] for r in reps), max(r["direct"][k][i][1] for r in reps)] for i in range(n)]
            for k in r0["direct"]
            for n in [len(r0["direct"][k])]
        }
        lines += _direct_lines(
            direct,
            "`torch._foreach_lerp_` over the local shards (`p._local_tensor`) and the state's EMA tensors, prebuilt",
        )
        lines.append(f"\nLoad average (1, 5, 15 min) before / after, rank 0: {_loads(r0['load'])}")
    return lines


def _loads(load: list) -> str:
    return " / ".join(", ".join(f"{x:.2f}" for x in one) for one in load)


def _direct_lines(direct: dict, what: str) -> list[str]:
    """The report's table of approaches timed against ``what`` directly (see :func:`_direct_pairs`)."""
    labels = {"lib": "`local_shards` + `update` (the default path)", "lib_update_only": "`update` alone"}
    lines = [
        f"\nAgainst {what}, interleaved (foreach, X, X, foreach per round, {len(next(iter(direct.values())))} "
        "rounds; target <= 1.05 for the default path):",
        "",
        "| functional_ema | X / foreach, median over rounds | ratio of the minima | spread (25th-75th percentile) |",
        "|---|---|---|---|",
    ]
    for k, rounds_of in direct.items():
        med, mins, spread = _direct_summary(rounds_of)
        lines.append(f"| {labels.get(k, k)} | {med:.3f} | {mins:.3f} | {spread:.3f} |")
    return lines


def _paired_ratio(per_rank: list[list[list[float]]]) -> float:
    """Median over rounds of (slowest rank's time for the approach) / (slowest rank's roofline)."""
    return statistics.median(
        max(r[i][0] for r in per_rank) / max(r[i][1] for r in per_rank) for i in range(len(per_rank[0]))
    )


def _mb(b: int) -> str:
    return f"{b / 2**20:.1f}"


def _grouped(all_results) -> tuple[dict, dict]:
    """The per-rank reports by (world size, stage, model): DeepSpeed configs, then FSDP2 configs."""
    groups: dict = {}
    fsdp2_groups: dict = {}
    for per_world in all_results:
        for rep in (rep for per_rank in per_world for rep in per_rank):
            into = fsdp2_groups if str(rep["stage"]).startswith("fsdp2") else groups
            into.setdefault((rep["world_size"], rep["stage"], rep["model"]), []).append(rep)
    return groups, fsdp2_groups


def report(all_results, command: str, overhead_rows: list[dict], plain: dict | None = None) -> str:
    lines, checks = [], []
    groups, fsdp2_groups = _grouped(all_results)
    order = sorted(groups, key=lambda g: (g[0], -g[1], g[2]))
    for w, stage, model in order:
        reps = groups[(w, stage, model)]
        r0 = next(r for r in reps if r["rank"] == 0)
        # Per rank the minimum (and median) over samples; the slowest rank sets the pace.
        t_min = {k: max(r["min_ms"][k] for r in reps) for k in LABELS}
        t_med = {k: max(r["median_ms"][k] for r in reps) for k in LABELS}
        local = max(r["local_numel"] for r in reps)
        lines.append(
            f"\n### ZeRO-{stage}, {w} ranks, {model}: {r0['tensors']} tensors, {r0['params'] / 1e6:.1f}M params, "
            f"<= {local / 1e6:.2f}M fp32 elements per rank"
        )
        lines.append("")
        lines.append(
            "| approach | ms/update, min (median) over rounds | x roofline | speedup vs per-param gather | bytes communicated | EMA MiB/rank | peak transient MiB/rank |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        ratio = {k: _paired_ratio([r["rounds"][k] for r in reps]) for k in LABELS}
        for k, label in LABELS.items():
            ratio_s = f"{ratio[k]:.2f}" + (" of K=2 roofline" if k == "lib_k2" else "")
            lines.append(
                f"| {label} | {t_min[k]:.2f} ({t_med[k]:.2f}) | {ratio_s} | {t_min['ds_chat'] / t_min[k]:.1f}x | "
                f"{max(r['comm'][k][1] for r in reps):,} | {_mb(max(r['ema_bytes'][k] for r in reps))} | "
                f"{_mb(max(r['peak_transient'][k] for r in reps))} |"
            )
        noop = r0["ds_chat_without_modifier_is_noop"]
        if noop is not None:
            lines.append(
                f"\nDeepSpeed-Chat's pattern without modifier_rank left the EMA unchanged (silent no-op): {noop}"
            )
        checks.append(
            (
                (w, stage, model),
                [
                    f"{ratio['lib']:.2f} ({ratio['lib_update_only']:.2f})",
                    f"{ratio['lib_k2']:.2f}",
                    f"{t_min['ds_chat'] / t_min['lib']:.0f}x ({t_med['ds_chat'] / t_med['lib']:.0f}x)",
                    f"{max(r['comm']['lib'][1] for r in reps)}",
                    f"{max(r['ema_bytes']['lib'] / max(4 * r['local_numel'], 1) for r in reps):.4f}",
                    f"{ratio['roofline_again']:.2f}",
                ],
            )
        )
    for (w, stage, model), reps in sorted(fsdp2_groups.items()):
        lines.extend(report_fsdp2(w, model, reps))
        ratio = {k: _paired_ratio([r["rounds"][k] for r in reps]) for k in FSDP2_LABELS}
        checks.append(
            (
                (w, stage, model),
                [
                    f"{ratio['lib']:.2f} ({ratio['lib_update_only']:.2f})",
                    "-",
                    "-",
                    f"{max(r['comm']['lib'][1] for r in reps)}",
                    f"{max(r['ema_bytes']['lib'] / max(4 * r['local_numel'], 1) for r in reps):.4f}",
                    f"{ratio['roofline_again']:.2f}",
                ],
            )
        )
        checks.append(
            (
                (w, f"{stage} after flatten_local_shards", model),
                [
                    f"{ratio['lib_one_buffer']:.2f} ({ratio['lib_one_buffer_update_only']:.2f})",
                    "-",
                    "-",
                    f"{max(r['comm']['lib_one_buffer'][1] for r in reps)}",
                    "-",
                    f"{ratio['roofline_again']:.2f}",
                ],
            )
        )
    lines.append("\n### Targets")
    lines.append("")
    lines.append(
        "| config | local_shards + update (update alone) / roofline (<= 1.10) | K=2 / (4+8K) roofline (<= 1.15) "
        "| vs per-param gather, min (median) (>= 50x, ZeRO-3, 2 ranks) | bytes communicated (0) "
        "| EMA bytes / (4 x local) (<= 1.01) | noise check: roofline / roofline (1.00) |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for (w, stage, model), vals in checks:
        engine = (
            stage.replace("fsdp2_tp", "FSDP2 over tensor parallel 2").replace("fsdp2", "FSDP2")
            if str(stage).startswith("fsdp2")
            else f"ZeRO-{stage}"
        )
        lines.append(f"| {engine}, {w} ranks, {model} | " + " | ".join(vals) + " |")
    if plain is not None:
        lines.append(
            f"\n### Plain module (one process; DDP does the same work per rank): {plain['tensors']} tensors, "
            f"{plain['params'] / 1e6:.1f}M params"
        )
        lines.append("")
        lines.append("| approach | ms/update, min (median) | x roofline |")
        lines.append("|---|---|---|")
        rows = (
            ("functional_ema: `local_shards(model)` + `update`", "lib"),
            ("functional_ema after `flatten_parameters(model)`: `local_shards(model)` + `update`", "lib_flat"),
            ("`torch._foreach_lerp_` over the parameters (lists prebuilt)", "foreach"),
        )
        for label, k in rows:
            lines.append(
                f"| {label} | {plain['ms_min'][k]:.2f} ({plain['ms_median'][k]:.2f}) | {plain['x_roofline'][k]:.2f} |"
            )
        lines.append(
            f"| roofline: one flat `lerp_` over as many elements | {plain['ms_min']['roofline']:.2f} ({plain['ms_median']['roofline']:.2f}) | 1.00 |"
        )
        xr = plain["x_roofline"]
        lines.append(
            f"\nfunctional_ema / `_foreach_lerp_` from the roofline pairs above: {xr['lib'] / xr['foreach']:.2f} with each "
            f"parameter in its own memory, {xr['lib_flat'] / xr['foreach']:.2f} after `flatten_parameters` "
            f"({plain['flat_segments']} segment); EMA bytes / (4 x params) = "
            f"{plain['ema_bytes'] / (4 * plain['params']):.4f}; fused: {plain['fused']}"
        )
        if "direct" in plain:
            lines += _direct_lines(
                plain["direct"],
                "`torch._foreach_lerp_` over the parameters and the state's EMA tensors (lists prebuilt)",
            )
            lines.append(f"\nLoad average (1, 5, 15 min) before / after: {_loads(plain['load'])}")
    lines.append("\n### Cost of one `update` call beyond the arithmetic (one process, 1-element views)")
    lines.append("")
    lines.append(
        "| tensors | same `Shards`, warm (cold) us | a plain dict of the same tensors, warm (cold) us | one bare lerp_, warm (cold) us |"
    )
    lines.append("|---|---|---|---|")
    for row in overhead_rows:
        lines.append(
            f"| {row['tensors']} | {row['same_warm']:.0f} ({row['same_cold']:.0f}) | {row['new_warm']:.0f} ({row['new_cold']:.0f}) "
            f"| {row['lerp_warm']:.0f} ({row['lerp_cold']:.0f}) |"
        )
    lines.append(
        "\nCold: right after a 32 MiB lerp_ has flushed the CPU caches, as after an optimizer step. A `Shards` "
        "(what `local_shards` returns) costs the same whatever the number of tensors: one identity check of its "
        "layout against the state's, then one lerp per segment; a plain dict is checked name by name every call."
    )
    lines.append(f"\nCommand: `{command}` (torch {torch.__version__}, {os.cpu_count()} CPU cores, 1 thread per rank)")
    return "\n".join(lines)


# Bars of the chart (``--plot``): key, short label, kind (see benchmarks/_charts.py), per engine family.
CHART_BARS = {
    "zero": [
        ("lib", "functional_ema: local_shards + update", "ours"),
        ("lib_update_only", "functional_ema: update alone", "ours"),
        ("lib_k2", "functional_ema: K=2 EMAs (vs the K=2 roofline)", "ours"),
        ("litema", "LitEma formula on local shards", "peer"),
        ("gather_all", "gather everything (diffusers / DSEma)", "peer"),
        ("ds_chat", "per-param gather (DeepSpeed-Chat)", "peer"),
        ("roofline_again", "noise check: the roofline again", "reference"),
    ],
    "fsdp2": [
        ("lib", "functional_ema: local_shards + update", "ours"),
        ("lib_update_only", "functional_ema: update alone", "ours"),
        ("lib_one_buffer", "after flatten_local_shards: local_shards + update", "ours"),
        ("lib_one_buffer_update_only", "after flatten_local_shards: update alone", "ours"),
        ("foreach", "torch._foreach_lerp_ over the local shards", "peer"),
        ("roofline_again", "noise check: the roofline again", "reference"),
    ],
}


def _config_order(item) -> tuple:
    """The report's order: by world size, ZeRO-3 before ZeRO-2, then FSDP2, then FSDP2 over TP."""
    (w, stage, model), _ = item
    return (w, -stage if isinstance(stage, int) else 0, str(stage), model)


def chart_panels(all_results, plain: dict | None = None) -> list:
    """The "x roofline" figures of :func:`report` as chart panels, one per engine configuration."""
    from benchmarks._charts import Bar, Panel

    groups, fsdp2_groups = _grouped(all_results)
    panels = []
    for family, grouped in (("zero", groups), ("fsdp2", fsdp2_groups)):
        for (w, stage, model), reps in sorted(grouped.items(), key=_config_order):
            r0 = reps[0]
            engine = {"fsdp2": "FSDP2", "fsdp2_tp": "FSDP2 over tensor parallel 2"}.get(
                str(stage), f"DeepSpeed ZeRO-{stage}"
            )
            bars = [
                Bar(label, _paired_ratio([r["rounds"][k] for r in reps]), kind) for k, label, kind in CHART_BARS[family]
            ]
            panels.append(
                Panel(f"{engine}, {w} ranks, {model} ({r0['tensors']} tensors, {r0['params'] / 1e6:.1f}M params)", bars)
            )
    if plain is not None:
        xr = plain["x_roofline"]
        panels.append(
            Panel(
                f"plain module, one process, transformer ({plain['tensors']} tensors, {plain['params'] / 1e6:.1f}M params)",
                [
                    Bar("functional_ema: local_shards + update", xr["lib"], "ours"),
                    Bar("after flatten_parameters: local_shards + update", xr["lib_flat"], "ours"),
                    Bar("torch._foreach_lerp_ over the parameters", xr["foreach"], "peer"),
                ],
            )
        )
    return panels


def write_chart(path: str, all_results, plain: dict | None, rounds: int):
    """Write the "x roofline" chart of this run to ``path`` (skipped with one line without matplotlib)."""
    from benchmarks._charts import write_bar_chart

    return write_bar_chart(
        path,
        chart_panels(all_results, plain),
        title="EMA update time / roofline (one flat lerp_ over the same bytes), lower is better",
        note=f"CPU, gloo, 1 thread per rank; median over {rounds} paired rounds of the slowest rank's ratio",
        xlabel="x roofline (log scale)",
        value_format="{:.2f}x".format,
        log=True,
        reference=(1.0, "roofline = 1.0"),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="tiny models, a smoke test of the script")
    parser.add_argument("--json", type=str, default=None, help="also write the raw per-rank results here")
    parser.add_argument(
        "--plot",
        type=str,
        default=None,
        metavar="PATH",
        help="also write a PNG chart of the x-roofline figures here (needs matplotlib)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["zero", "fsdp2", "fsdp2_tp", "module"],
        choices=["zero", "fsdp2", "fsdp2_tp", "module"],
        help="ZeRO-2/3 configs, the FSDP2 config (2 ranks, transformer), FSDP2 over tensor parallel "
        "(4 ranks: dp 2 x tp 2, transformer), the plain-module table",
    )
    args = parser.parse_args(argv)
    from functional_ema._testing.multirank import run_ranks

    command = " ".join(
        ["python", "benchmarks/bench_update.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    all_results = []
    for w in args.world_sizes:
        # ZeRO-3 at every world size (how the gap to per-parameter gathering grows); ZeRO-2 at 2 ranks.
        configs = [(3, "transformer"), (3, "mlp")] + ([(2, "transformer"), (2, "mlp")] if w == 2 else [])
        configs = configs if "zero" in args.engines else []
        if "fsdp2" in args.engines and w == 2:  # FSDP2: the 516-tensor transformer at 2 ranks
            configs.append(("fsdp2", "transformer"))
        if "fsdp2_tp" in args.engines and w == 4:  # and over tensor parallelism at 4 ranks
            configs.append(("fsdp2_tp", "transformer"))
        if not configs:
            continue
        t0 = time.time()
        all_results.append(
            run_ranks(
                "benchmarks.bench_update:worker",
                world_size=w,
                timeout=1800,
                env={"OMP_NUM_THREADS": "1"},
                configs=configs,
                rounds=args.rounds,
                quick=args.quick,
            )
        )
        print(f"[{w} ranks done in {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1))
    plain = plain_module_table(args.rounds, quick=args.quick) if "module" in args.engines else None
    print(report(all_results, command, overhead_table(), plain), flush=True)
    if args.plot:
        write_chart(args.plot, all_results, plain, args.rounds)


if __name__ == "__main__":
    main()
