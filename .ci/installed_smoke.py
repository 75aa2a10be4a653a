"""The installed package at 2 ranks: FSDP2 EMA, save, load, offline consolidate and the CLI.

Run by .ci/wheel.sh with the python of a fresh venv holding only the built wheel and its
dependencies, from a folder outside the checkout: it imports nothing from the checkout (no tests/,
no functional_ema._testing) and checks that ``functional_ema`` is the installed one. The EMA is
checked against a reference computed in plain torch from the full weights.

    python installed_smoke.py WORKDIR
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard

import functional_ema as fe

STEPS, DECAY = 4, 0.75


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def full_weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}


def worker(rank: int, port: int, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    m = model()
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    state = fe.init_ema(fe.local_shards(m))
    reference = full_weights(m)
    for step in range(1, STEPS + 1):
        torch.manual_seed(step)
        loss = m(torch.randn(4, 6)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = fe.update(state, fe.local_shards(m), step, decay=DECAY)
        reference = {n: DECAY * reference[n] + (1 - DECAY) * w for n, w in full_weights(m).items()}
    gathered = fe.gather_full(state, m)
    for n, ref in reference.items():
        torch.testing.assert_close(gathered[n], ref, rtol=1e-6, atol=1e-7, msg=lambda s, n=n: f"{n}: {s}")
    fe.save(state, m, work, decay=DECAY)
    loaded = fe.load(m, work)
    assert int(loaded.step) == STEPS
    for n in state.ema:
        assert torch.equal(loaded.ema[n], state.ema[n]), f"rank {rank}: {n} not bitwise after load"
    dist.barrier()
    if rank == 0:
        torch.save(gathered, Path(work) / "gathered.pt")
    dist.destroy_process_group()
    # gloo's native threads can abort the interpreter's teardown ("terminate called without an active
    # exception", torch issue 179291); everything is written and flushed, so leave without it, as the
    # examples do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    here = Path(fe.__file__).resolve()
    assert "site-packages" in here.parts, f"functional_ema comes from {here}, not an installed wheel"
    assert fe.__version__ != "0.0.0", fe.__version__
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, str(work / "ckpt")), nprocs=2, join=True)
    gathered = torch.load(work / "ckpt" / "gathered.pt", weights_only=True)
    full = fe.consolidate(work / "ckpt")
    assert sorted(full) == sorted(gathered) and all(torch.equal(full[n], gathered[n]) for n in full)
    out = work / "ema.safetensors"
    cli = Path(sys.executable).with_name("functional-ema")
    subprocess.run([str(cli), "consolidate", str(work / "ckpt"), str(out), "--no-progress"], check=True)
    from_cli = load_file(out)
    assert sorted(from_cli) == sorted(gathered) and all(torch.equal(from_cli[n], gathered[n]) for n in from_cli)
    print(f"installed functional_ema {fe.__version__} from {here.parent}: 2-rank FSDP2 EMA == reference, ", end="")
    print(f"save/load bitwise, consolidate and the CLI == gather_full ({len(full)} tensors)")


if __name__ == "__main__":
    main()
