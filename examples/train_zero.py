"""Train a small model with DeepSpeed ZeRO and keep an fp32 EMA of its weights with functional_ema.

    python examples/train_zero.py --nproc 2 --stage 3 --steps 200     # what `make demo` runs

With ``--nproc N`` the script launches itself on N ranks through ``torch.distributed.run`` (CPU and
gloo by default, CUDA and nccl when GPUs are present). Every step it updates the EMA from this
rank's local fp32 master partitions (no communication), every ``--eval-every`` steps it prints the
held-out loss of the raw weights and of the EMA weights (swapped in, no second model), and at the
end it saves DeepSpeed's checkpoint with the EMA beside it and rebuilds the full EMA weights from
the files alone. With matplotlib installed (the ``plot`` extra) it also draws the two held-out loss
curves into ``val_loss.png`` in the ``--out`` folder.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored when already launched)")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="training precision")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--decay", type=float, default=0.99, help="EMA decay after warm-up")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="runs/demo", help="checkpoint folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --out (weights, optimizer and EMA)",
    )
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


class Mlp(nn.Module):
    """A small regression network (odd sizes, so ZeRO partitions are uneven)."""

    def __init__(self, d_in=31, hidden=257, d_out=7):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, d_out)
        )

    def forward(self, x):
        return self.net(x)


def make_data(n, seed, d_in=31, d_out=7, noise=0.5):
    """A fixed random teacher plus label noise: noisy gradients, where weight averaging pays off."""
    teacher = torch.Generator().manual_seed(0)
    w1 = torch.randn(d_in, 64, generator=teacher) / math.sqrt(d_in)
    w2 = torch.randn(64, d_out, generator=teacher) / 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.tanh(x @ w1) @ w2 + noise * torch.randn(n, d_out, generator=g)
    return x, y


def main(args) -> None:
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    import deepspeed

    import functional_ema as fe

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    model = Mlp()
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = next(engine.module.parameters()).dtype

    x_train, y_train = make_data(4096, seed=1 + rank)
    x_val, y_val = make_data(2048, seed=10_000)
    x_val, y_val = x_val.to(engine.device, dtype), y_val.to(engine.device)

    # The EMA: fp32, 1/world_size of the model per rank, from the fp32 master partitions.
    schedule = fe.schedules.warmup(max_decay=args.decay, power=3 / 4)
    state = fe.init_ema(fe.local_shards(engine))
    if args.resume and (Path(args.out) / "latest").exists():
        engine.load_checkpoint(args.out)
        state = fe.load(engine, args.out)  # this rank's EMA pieces, resharded if the world size changed
        if rank == 0:
            print(f"resumed from {args.out} at step {engine.global_steps} (EMA step {int(state.step)})")
    n_local = sum(t.numel() for t in state.ema.values())
    n_total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    if rank == 0:
        print(
            f"ZeRO-{args.stage} {args.dtype} on {world} rank(s) ({'cuda' if cuda else 'cpu'}): "
            f"{n_total:,} parameters, rank 0 keeps an EMA of {n_local:,} ({fe.ema_nbytes(state) / 2**20:.2f} MiB fp32)"
        )
        print(f"{'step':>6} {'train loss':>11} {'val raw':>9} {'val EMA':>9}")

    def val_loss() -> float:
        with torch.no_grad():
            return float(((engine(x_val).float() - y_val) ** 2).mean())

    g = torch.Generator().manual_seed(100 + rank)
    history = []  # (step, raw, EMA) held-out losses, for the plot
    t0 = time.perf_counter()
    update_time = 0.0
    last = engine.global_steps + args.steps
    for _ in range(args.steps):
        idx = torch.randint(0, x_train.shape[0], (16,), generator=g)
        x, y = x_train[idx].to(engine.device, dtype), y_train[idx].to(engine.device)
        loss = ((engine(x).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        u0 = time.perf_counter()
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=schedule)
        update_time += time.perf_counter() - u0
        step = engine.global_steps
        if step % args.eval_every == 0 or step == last:
            engine.eval()
            raw = val_loss()
            with fe.swapped(engine, state):
                ema = val_loss()
            engine.train()
            history.append((step, raw, ema))
            if rank == 0:
                print(f"{step:>6} {float(loss.detach()):>11.4f} {raw:>9.4f} {ema:>9.4f}")
    if rank == 0:
        elapsed = time.perf_counter() - t0
        print(
            f"{args.steps} steps in {elapsed:.1f}s; EMA update {1e3 * update_time / args.steps:.3f} ms/step "
            f"({100 * update_time / elapsed:.2f}% of the loop)"
        )

    finish(engine, state, args, schedule, rank)
    if rank == 0 and history:
        plot_losses(
            history,
            Path(args.out) / "val_loss.png",
            f"Held-out loss, ZeRO-{args.stage} {args.dtype} on {world} rank(s)",
        )
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # All work is done and flushed. Skip interpreter teardown: DeepSpeed's native threads abort
    # there now and then on CPU ("terminate called without an active exception", ~1 run in 8).
    os._exit(0)


def finish(engine, state, args, schedule, rank) -> None:
    """Save DeepSpeed's checkpoint with the EMA beside it; rebuild the full EMA from the files."""
    import functional_ema as fe

    if not hasattr(fe, "save"):
        return
    out = Path(args.out)
    tag = f"global_step{engine.global_steps}"
    fe.save(state, engine, out, tag, decay=schedule)
    engine.save_checkpoint(str(out), tag=tag)
    torch.distributed.barrier()
    if rank == 0:
        full = fe.consolidate(out)  # offline: no process group needed
    full_live = fe.gather_full(state, engine)
    if rank == 0:
        same = all(torch.equal(full[n].cpu(), full_live[n].cpu()) for n in full_live)
        print(f"saved {out / tag}; offline consolidate == online gather_full: {same}")
        print(f"rebuild the EMA weights any time: python -m functional_ema consolidate {out} ema.safetensors")


def plot_losses(history: list[tuple[int, float, float]], path: Path, title: str) -> None:
    """Draw the held-out loss of the raw and of the EMA weights against the step into a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # write a file, open no window
        import matplotlib.pyplot as plt
    except ImportError:
        print("validation loss plot skipped: matplotlib is not installed (pip install 'functional-ema[plot]')")
        return
    steps, raw, ema = zip(*history)
    fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    ax.plot(steps, raw, marker="o", label="raw weights")
    ax.plot(steps, ema, marker="o", label="EMA weights")
    ax.set(xlabel="step", ylabel="held-out loss (MSE)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"validation loss curves: {path}")


def launch(args) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__]
    argv, skip = [], False
    for a in sys.argv[1:]:  # forward everything but --nproc
        if skip or a.startswith("--nproc"):
            skip = a == "--nproc"
            continue
        argv.append(a)
    cmd += argv
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # DeepSpeed JIT-builds a CPU op into ~/.cache/torch_extensions, shared by every environment on the
    # machine: one build folder per virtual environment avoids rebuilding it when switching between them.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    # torchrun's agent makes a log folder in the temp directory and leaves it there: the job gets a temp
    # directory of its own, removed when the run ends.
    with tempfile.TemporaryDirectory(prefix="train_zero_") as tmp:
        code = subprocess.call(cmd, env=dict(env, TMPDIR=tmp))
    raise SystemExit(code)


if __name__ == "__main__":
    a = parse_args()
    if "RANK" in os.environ:
        main(a)
    else:
        launch(a)
