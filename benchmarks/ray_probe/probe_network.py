"""Q4: the torch.distributed process group Ray sets up, and every TCP socket of the Ray processes we started.

Workers log dist.is_initialized(), backend, rank/world size, MASTER_ADDR/PORT and ray.util.get_node_ip_address(),
run an all_reduce, and rank 0 lists its own sockets with `ss -tnp`. Meanwhile the driver samples `ss -tanp`
every 0.5 s and keeps the sockets owned by processes descended from it (raylet, GCS, workers, ...).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path

from _common import fresh, start_ray, versions


def train_fn(config: dict) -> None:
    import json
    import os
    import subprocess
    import time

    import ray.train
    import torch
    import torch.distributed as dist

    rank = ray.train.get_context().get_world_rank()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    rec = {
        "rank": rank,
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "dist_rank": dist.get_rank(),
        "all_reduce": t.item(),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
        "MASTER_PORT": os.environ.get("MASTER_PORT"),
        "node_ip": ray.util.get_node_ip_address(),
    }
    out = subprocess.run(["ss", "-tnpH"], check=False, capture_output=True, text=True).stdout.splitlines()
    rec["own_sockets"] = [" ".join(line.split()[3:5]) for line in out if f"pid={os.getpid()}," in line]
    with open(os.path.join(config["log"], f"r{rank}.json"), "w") as f:
        json.dump(rec, f)
    time.sleep(3)  # keep the gloo connections open while the driver samples
    dist.barrier()
    ray.train.report({"ok": 1})


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, []))
    return out


def sample(stop: threading.Event, seen: set) -> None:
    while not stop.wait(0.5):
        ours = descendants(os.getpid())
        for line in subprocess.run(["ss", "-tanpH"], check=False, capture_output=True, text=True).stdout.splitlines():
            f = line.split()
            pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
            if len(f) >= 5 and pids & ours:
                name = re.search(r'\(\("([^"]+)"', line)
                seen.add((f[0], f[3], f[4], name.group(1) if name else "?"))


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    base = fresh("network")
    (base / "log").mkdir()
    print(versions())
    start_ray()
    seen: set = set()
    stop = threading.Event()
    thread = threading.Thread(target=sample, args=(stop, seen), daemon=True)
    thread.start()
    TorchTrainer(
        train_fn,
        train_loop_config={"log": str(base / "log")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(base / "storage"), name="network"),
    ).fit()
    stop.set()
    thread.join()
    for r in (0, 1):
        print("worker", json.loads((base / "log" / f"r{r}.json").read_text()))
    hosts = lambda addr: addr.rsplit(":", 1)[0]  # noqa: E731
    print("distinct (state, local host, peer host) over", len(seen), "sockets of our processes:")
    for key in sorted({(s, hosts(loc), hosts(peer)) for s, loc, peer, _ in seen}):
        names = sorted({n for s, loc, peer, n in seen if (s, hosts(loc), hosts(peer)) == key})
        print("   ", key, names)
    loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
    remote = sorted({(peer, n) for st, loc, peer, n in seen if st != "LISTEN" and not peer.startswith(loopback)})
    print("non-listening sockets whose peer is not loopback:", remote or "none")
    wild = sorted({(loc, n) for st, loc, peer, n in seen if st == "LISTEN" and not loc.startswith(loopback)})
    print("listening sockets not bound to loopback:", wild or "none")
    ray.shutdown()


if __name__ == "__main__":
    main()
