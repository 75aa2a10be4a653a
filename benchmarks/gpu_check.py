"""The CUDA paths, checked against the same references as the CPU tests, with figures. One GPU.

    python benchmarks/gpu_check.py            # about 2-3 minutes on one GPU; exits at once without CUDA

Checks (each PASS/FAIL, exit status 1 if any fails):

1. ``update`` on CUDA shards (views of one flat fp32 buffer, K = 1 and 2) is bitwise equal to a
   per-tensor ``lerp_``.
2. A pinned CPU EMA of CUDA weights (``init_ema(..., device="cpu", pin_memory=True)``): chunks are
   copied on a side stream while the CPU updates the previous chunk. Bitwise equal to lerping a
   ``.cpu()`` copy; timed against that naive copy-then-lerp.
3. DeepSpeed ZeRO-2 and ZeRO-3 bf16 with fp32 masters on the GPU, and ZeRO-2 with the optimizer
   offloaded to the CPU (world 1, client AdamW): the EMA equals an EMA of
   ``safe_get_full_fp32_param`` bitwise, and ``swapped`` computes like a plain model loaded with
   the EMA.
4. FSDP2 (``fully_shard``, bf16 ``MixedPrecisionPolicy``, world 1): the same two checks against
   ``full_tensor()``.

5. ``update(..., blocking=False)`` of a pinned CPU EMA (24M and 500M fp32 elements): bitwise equal
   to the blocking update, the weights zeroed in place right after the call; blocking time of the
   call against the blocking update, and when the current stream and the worker are done.
6. Checkpoint figures (``bench_checkpoint.py --device cuda``, 1 GiB EMA on the GPU): save, load and
   ``load(out=)`` GB/s against safetensors, round trip bitwise.
7. The CUDA tests of ``tests/test_offload.py`` and ``tests/test_core.py`` (pytest ``-k cuda``).

Timings: ``update`` over 400 and 1000 CUDA tensors against ``torch._foreach_lerp_`` and a
per-tensor ``lerp_`` loop over the same tensors, each as a ratio of one flat ``lerp_`` over the
same bytes (the memory-bandwidth roofline).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import functional_ema as fe  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []  # (check, passed, figures)  -- filled by main() only
TIMINGS: list[tuple[str, dict[str, float]]] = []  # (panel title, {approach: x roofline}) -- for the chart


def record(name: str, ok: bool, figures: str = "") -> None:
    RESULTS.append((name, bool(ok), figures))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {figures}" if figures else ""), flush=True)


def cuda_time(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` with CUDA events (after a warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def wall_time(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def flat_shards(n_tensors: int = 400, per: int = 60_000, gap: int = 7) -> tuple[torch.Tensor, fe.Shards]:
    buf = torch.randn(n_tensors * (per + gap), device="cuda")
    views = {f"p{i:04d}": buf.narrow(0, i * (per + gap), per - (i % 5)) for i in range(n_tensors)}
    return buf, fe.Shards.from_views(views)


def check_core() -> None:
    buf, shards = flat_shards()
    numel = sum(t.numel() for t in shards.values())
    for k, decays in ((1, 0.999), (2, (0.999, 0.9999))):
        state = fe.init_ema(shards, num_emas=k)
        ref = [{n: t.clone() for n, t in shards.items()} for _ in range(k)]
        ok = True
        for step in range(1, 4):
            buf.add_(torch.randn_like(buf) * 0.01)
            fe.update(state, shards, step, decay=decays)
            for j, d in enumerate(decays if k > 1 else (decays,)):
                for n in ref[j]:
                    ref[j][n].lerp_(shards[n], 1 - d)
            ok &= all(torch.equal(state.emas[j][n], ref[j][n]) for j in range(k) for n in shards)
        record(
            f"CUDA update, K={k}, {len(shards)} tensors, {numel / 1e6:.1f}M elements: bitwise vs per-tensor lerp_", ok
        )
    for n_tensors, per in ((400, 60_000), (1000, 500_000)):
        time_update_against_peers(n_tensors, per)


def time_update_against_peers(n_tensors: int, per: int) -> None:
    """K = 1 update against the peers over the same tensors, and against one flat ``lerp_`` of the same bytes."""
    _buf, shards = flat_shards(n_tensors, per)
    numel = sum(t.numel() for t in shards.values())
    state = fe.init_ema(shards)
    names = list(shards)
    emas, weights = [state.emas[0][n] for n in names], [shards[n] for n in names]
    flat_e, flat_s = torch.randn(numel, device="cuda"), torch.randn(numel, device="cuda")

    def per_tensor_lerp():
        for e, w in zip(emas, weights):
            e.lerp_(w, 0.001)

    t_lib = cuda_time(lambda: fe.update(state, shards, decay=0.999))
    t_roof = cuda_time(lambda: flat_e.lerp_(flat_s, 0.001))
    t_foreach = cuda_time(lambda: torch._foreach_lerp_(emas, weights, 0.001))
    t_loop = cuda_time(per_tensor_lerp)
    gbs = numel * 12 / (t_lib * 1e-3) / 1e9
    TIMINGS.append(
        (
            f"{n_tensors} fp32 tensors, {numel / 1e6:.0f}M elements ({numel * 12 / 1e9:.2f} GB moved per update)",
            {
                "fe.update": t_lib / t_roof,
                "torch._foreach_lerp_": t_foreach / t_roof,
                "per-tensor lerp_ loop": t_loop / t_roof,
            },
        )
    )
    record(
        f"CUDA update timing, {n_tensors} tensors, {numel / 1e6:.0f}M elements (fp32, K=1)",
        True,
        f"fe.update {t_lib:.3f} ms ({gbs:.0f} GB/s) = {t_lib / t_roof:.2f}x one flat lerp_ ({t_roof:.3f} ms); "
        f"_foreach_lerp_ {t_foreach:.3f} ms ({t_foreach / t_roof:.2f}x); per-tensor lerp_ loop {t_loop:.3f} ms ({t_loop / t_roof:.2f}x)",
    )


def check_pinned_cpu_ema() -> None:
    buf, shards = flat_shards(200, 100_000)
    state = fe.init_ema(shards, num_emas=2, device="cpu", pin_memory=True)
    ok_pinned = all(t.is_pinned() for t in state.ema.segments)
    ref = [{n: t.cpu() for n, t in shards.items()} for _ in range(2)]
    ok = True
    for step in range(1, 4):
        buf.add_(torch.randn_like(buf) * 0.01)
        fe.update(state, shards, step, decay=(0.99, 0.999))
        host = {n: t.cpu() for n, t in shards.items()}
        for j, d in enumerate((0.99, 0.999)):
            for n in ref[j]:
                ref[j][n].lerp_(host[n], 1 - d)
        ok &= all(torch.equal(state.emas[j][n], ref[j][n]) for j in range(2) for n in shards)
    info = fe.update_info(state, shards)
    t_lib = wall_time(lambda: fe.update(state, shards, decay=(0.99, 0.999)))
    naive = [{n: t.cpu() for n, t in shards.items()} for _ in range(2)]

    def copy_then_lerp():
        host = {n: t.cpu() for n, t in shards.items()}
        for j, d in enumerate((0.99, 0.999)):
            for n in naive[j]:
                naive[j][n].lerp_(host[n], 1 - d)

    t_naive = wall_time(copy_then_lerp)
    record(
        "pinned CPU EMA of CUDA weights (side-stream staging): bitwise vs .cpu() + lerp_",
        ok and ok_pinned and info.staged_spans > 0,
        f"{t_lib:.2f} ms vs {t_naive:.2f} ms for copy-then-lerp ({t_naive / t_lib:.2f}x), staged spans {info.staged_spans}, pinned {ok_pinned}",
    )


def check_offloaded_update(sizes: tuple[int, ...] = (24_000_000, 500_000_000), reps: int = 5) -> None:
    """``update(..., blocking=False)`` of a pinned CPU EMA of CUDA weights, against the blocking update.

    Bitwise: after each queued update (and ``wait_update``) the EMA equals the blocking path's, with the
    weights zeroed in place on the current stream right after the queued call (the copy must have read
    them first: the current stream waits for it). Timings (median of ``reps``, wall clock): the
    blocking update; the queued call alone (what the training loop waits for); the call until the
    current stream is free again (the GPU's wait for the copy); the call until the worker is done.
    """
    for numel in sizes:
        pieces = 8
        per = numel // pieces
        buf = torch.randn(per * pieces, device="cuda")
        shards = fe.Shards.from_views({f"p{i}": buf.narrow(0, i * per, per - 3) for i in range(pieces)})
        queued = fe.init_ema(shards, device="cpu", pin_memory=True)
        blocking = fe.init_ema(shards, device="cpu", pin_memory=True)
        ok = True
        for step in range(1, 4):
            buf.add_(torch.randn_like(buf), alpha=0.01)
            keep = buf.clone()
            fe.update(queued, shards, step, decay=0.99, blocking=False)
            buf.zero_()  # in place, on the current stream, right after the call: must not leak into the EMA
            fe.wait_update(queued)
            buf.copy_(keep)
            fe.update(blocking, shards, step, decay=0.99)
            ok &= all(torch.equal(a, b) for a, b in zip(queued.ema.segments, blocking.ema.segments))
            del keep
        ok &= getattr(queued.step, "_fe_pending", None) is None and int(queued.step) == 3
        step = 3
        t_block, t_call, t_free, t_done = [], [], [], []
        for _ in range(reps):
            step += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fe.update(blocking, shards, step, decay=0.99)
            t_block.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fe.update(queued, shards, step, decay=0.99, blocking=False)
            t1 = time.perf_counter()
            torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter()
            fe.wait_update(queued)
            t3 = time.perf_counter()
            t_call.append(t1 - t0), t_free.append(t2 - t0), t_done.append(t3 - t0)
        ok &= all(torch.equal(a, b) for a, b in zip(queued.ema.segments, blocking.ema.segments))
        gb = numel * 4 / 1e9
        record(
            f"queued update (blocking=False) of a pinned CPU EMA, {numel / 1e6:.0f}M fp32 elements: bitwise vs blocking, "
            "in-place change after the call not leaking",
            ok,
            f"blocking update {med(t_block):.1f} ms ({gb / med(t_block) * 1e3:.1f} GB/s of weights); queued call "
            f"{med(t_call):.2f} ms ({med(t_block) / med(t_call):.0f}x less); current stream free after "
            f"{med(t_free):.1f} ms; worker done after {med(t_done):.1f} ms",
        )
        del queued, blocking, shards, buf
        torch.cuda.empty_cache()


def med(xs: list[float]) -> float:
    """Median of seconds, in milliseconds."""
    return sorted(xs)[len(xs) // 2] * 1e3


def check_checkpoint_figures(mib: int = 1024, repeat: int = 3) -> None:
    """Save / load / load(out=) of an EMA held on the GPU against safetensors (``bench_checkpoint --device cuda``)."""
    from benchmarks.bench_checkpoint import print_device_checkpoint

    r = print_device_checkpoint("cuda", mib, repeat)
    record(
        "checkpoint of an EMA on the GPU (save / load / load(out=) round trip bitwise)",
        bool(r["bitwise"]),
        f"save {r['save']:.2f} GB/s ({r['save'] / r['plain_save']:.2f}x safetensors), load {r['load']:.2f} GB/s "
        f"({r['load'] / r['plain_load']:.2f}x), load into held buffers {r['load_into']:.2f} GB/s "
        f"({r['load_into'] / r['plain_load_into']:.2f}x)",
    )


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 257)
        self.mid = nn.Linear(257, 129)
        self.out = nn.Linear(129, 16)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _data(step: int, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(step)
    return torch.randn(8, 64, device="cuda", generator=g).to(dtype), torch.randn(8, 16, device="cuda", generator=g).to(
        dtype
    )


def check_deepspeed(stage: int = 3, offload: bool = False) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = Net()
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    where = "CPU (offload)" if offload else "GPU"
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    shards = fe.local_shards(engine)
    on_expected = all(t.device.type == ("cpu" if offload else "cuda") for t in shards.values())
    state = fe.init_ema(shards)
    params = dict(engine.module.named_parameters())
    ref = {n: safe_get_full_fp32_param(params[n]).detach().clone() for n in shards}
    for step in range(1, 6):
        x, y = _data(step, torch.bfloat16)
        loss = ((engine(x).float() - y.float()) ** 2).mean()
        engine.backward(loss)
        engine.step()
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.9)
        for n in ref:
            ref[n].lerp_(safe_get_full_fp32_param(params[n]).detach(), 0.1)
    full = fe.gather_full(state, engine)
    ok = all(torch.equal(full[n].cpu(), ref[n].cpu()) for n in ref)
    twin = Net().cuda()
    twin.load_state_dict({n: t.to(torch.bfloat16).float() for n, t in full.items()})
    twin = twin.to(torch.bfloat16)
    x, _ = _data(99, torch.bfloat16)
    engine.eval()
    with torch.no_grad(), fe.swapped(engine, state):
        out = engine(x)
    with torch.no_grad():
        same = torch.equal(out, twin(x))
    t_upd = cuda_time(lambda: fe.update(state, fe.local_shards(engine), decay=0.9))
    with tempfile.TemporaryDirectory() as d:
        fe.save(state, engine, d, tag="sync")
        saver = fe.AsyncSaver()
        saver.save(state, engine, d, tag="async")
        saver.wait()
        back = [fe.load(engine, d, tag=t) for t in ("sync", "async")]
    same_files = all(
        b.step == state.step and all(torch.equal(b.emas[0][n], state.emas[0][n]) for n in shards) for b in back
    )
    same_device = all(b.emas[0][n].device == state.emas[0][n].device for b in back for n in shards)
    record(
        f"DeepSpeed ZeRO-{stage} ({where}): save / AsyncSaver / load round trip bitwise, on the state's device",
        same_files and same_device,
    )
    record(
        f"DeepSpeed ZeRO-{stage} bf16, fp32 masters on {where}: EMA bitwise vs safe_get_full_fp32_param EMA",
        ok and on_expected,
        f"local_shards + update {t_upd:.3f} ms for {sum(t.numel() for t in shards.values()):,} elements",
    )
    record(f"DeepSpeed ZeRO-{stage} ({where}) swapped forward == plain bf16 model loaded with the EMA", same)


def check_fsdp2() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Net().cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (model.inp, model.mid, model.out):
        fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    for step in range(1, 6):
        x, y = _data(step)
        loss = ((model(x).float() - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = fe.update(state, fe.local_shards(model), step, decay=0.9)
        for n, p in model.named_parameters():
            ref[n].lerp_(p.full_tensor().detach(), 0.1)
    full = fe.gather_full(state, model)
    ok = all(torch.equal(full[n], ref[n]) for n in ref)
    twin = Net().cuda()
    twin.load_state_dict(full)
    x, _ = _data(99)
    with torch.no_grad(), fe.swapped(model, state):
        out = model(x)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = twin.to(torch.bfloat16)(x.to(torch.bfloat16))
    t_upd = cuda_time(lambda: fe.update(state, fe.local_shards(model), decay=0.9))
    record("FSDP2 bf16 mixed precision: EMA bitwise vs full_tensor() EMA", ok, f"local_shards + update {t_upd:.3f} ms")
    record(
        "FSDP2 swapped forward == plain bf16 model loaded with the EMA (max abs diff shown)",
        torch.allclose(out.float(), want.float(), atol=1e-2),
        f"max abs diff {(out.float() - want.float()).abs().max().item():.2e}",
    )


def run_cuda_tests() -> None:
    """The test files' CUDA-only tests (skipped on CPU machines), here where CUDA is."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("pytest") is None:
        print("[SKIP] pytest -k cuda: pytest is not installed here (pip install pytest to run the CUDA tests)")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_offload.py", "tests/test_core.py", "-k", "cuda"]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-300:]]
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-2000:])
    record("pytest -k cuda (tests/test_offload.py, tests/test_core.py)", done.returncode == 0, tail[0])


def _init_world_of_one() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    torch.cuda.set_device(0)


def write_chart(path: str) -> None:
    """The update timings as an "x roofline" PNG (skipped with one line without matplotlib)."""
    from benchmarks._charts import Bar, Panel, write_bar_chart

    panels = [
        Panel(title, [Bar(k, v, "ours" if k == "fe.update" else "peer") for k, v in figures.items()])
        for title, figures in TIMINGS
    ]
    write_bar_chart(
        path,
        panels,
        title="EMA update time / roofline (one flat lerp_ over the same bytes), lower is better",
        note=f"CUDA events, median of 20 after warm-up; torch {torch.__version__}",
        xlabel="x roofline (log scale)",
        value_format="{:.2f}x".format,
        log=True,
        reference=(1.0, "roofline = 1.0"),
        device=f"{torch.cuda.get_device_name(0)} (one GPU)",
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", metavar="PATH", default=None, help="also write the update timings as a PNG chart")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here (torch " + torch.__version__ + "); nothing to check. "
            "Run it on a machine with a GPU and a CUDA build of torch."
        )
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    _init_world_of_one()
    checks = [
        ("core", check_core),
        ("pinned CPU EMA", check_pinned_cpu_ema),
        ("queued update", check_offloaded_update),
        ("checkpoint figures", check_checkpoint_figures),
        ("CPU tests of the queued update on CUDA", run_cuda_tests),
        ("ZeRO-2", lambda: check_deepspeed(2)),
        ("ZeRO-2 offload", lambda: check_deepspeed(2, offload=True)),
        ("ZeRO-3", lambda: check_deepspeed(3)),
        ("FSDP2", check_fsdp2),
    ]
    for name, check in checks:
        try:
            check()
        except Exception as e:  # noqa: BLE001 - report every check, then fail
            traceback.print_exc()
            record(f"{name} raised {type(e).__name__}: {e}", False)
    if args.plot and TIMINGS:
        write_chart(args.plot)
    failed = [r for r in RESULTS if not r[1]]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
