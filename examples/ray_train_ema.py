"""Ray Train with an EMA of a DeepSpeed ZeRO-3 engine: each worker saves into its own folder, Ray merges them.

Every ``--every`` steps each worker writes DeepSpeed's checkpoint and its EMA shard (``fe.save(..., shared=False)``:
nothing is assumed shared between workers) into a temporary folder and reports it with ``ray.train.report``;
Ray uploads the workers' folders into one ``checkpoint_*`` in ``--storage``, which is an ordinary EMA checkpoint
(load it at any world size, ``consolidate`` or ``export`` it). A restarted worker group (a worker died, with
``--max-failures``) or a new run with the same ``--storage`` and ``--name`` resumes from
``ray.train.get_checkpoint()``, bitwise. See docs/many-nodes.md.

    pip install 'functional-ema[ray]'
    python examples/ray_train_ema.py --local --steps 8 --storage /tmp/fe-ray

``--local`` starts a Ray of its own on this machine (loopback only); without it, ``ray.init()`` joins the
cluster ``RAY_ADDRESS`` names, or starts one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

DECAY = 0.99


def _engine() -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,  # the client AdamW (no fused-Adam build)
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def train_func(config: dict[str, Any]) -> None:
    """What every Ray worker runs: Ray has initialised the process group (gloo on CPUs, nccl on GPUs)."""
    import deepspeed
    import ray.train
    import torch.distributed as dist

    import functional_ema as fe

    deepspeed.init_distributed()  # adopts Ray's process group
    engine = _engine()
    state, start = fe.init_ema(fe.local_shards(engine)), 0
    checkpoint = ray.train.get_checkpoint()  # the last checkpoint Ray committed (None in a fresh run)
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            engine.load_checkpoint(os.path.join(folder, "engine"), tag="t")
            state = fe.load(engine, os.path.join(folder, "ema"))  # the merged folder: any world size
        start = int(state.step)
    rank = dist.get_rank()
    for step in range(start + 1, config["steps"] + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.flip(1))
        engine.backward(loss)
        engine.step()
        state = fe.update(state, fe.local_shards(engine), step, decay=DECAY)  # no communication
        if step % config["every"] == 0 or step == config["steps"]:
            folder = tempfile.mkdtemp(prefix="ema_ray_")  # this worker's own folder
            engine.save_checkpoint(os.path.join(folder, "engine"), tag="t")
            fe.save(state, engine, os.path.join(folder, "ema"), f"step{step}", decay=DECAY, shared=False)
            metrics = {"step": step, "loss": loss.item()}
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
            shutil.rmtree(folder)  # uploaded (Ray's default upload leaves the folder to us)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="report a checkpoint every this many steps")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "fe-ray"), help="Ray's storage_path")
    p.add_argument("--name", default="ema_example")
    p.add_argument("--max-failures", type=int, default=1)
    p.add_argument("--local", action="store_true", help="start a Ray of its own on loopback (2 CPUs)")
    args = p.parse_args(argv)
    if args.local:  # before `import ray`: Ray would otherwise listen on the machine's routable address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import functional_ema as fe

    if args.local:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=args.workers)
    else:
        ray.init()
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"steps": args.steps, "every": args.every},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=torch.cuda.is_available()),
            run_config=RunConfig(
                storage_path=args.storage, name=args.name, failure_config=FailureConfig(max_failures=args.max_failures)
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    if result.error is not None:
        raise result.error
    last = Path(result.checkpoint.path) / "ema"
    full = fe.consolidate(last)  # offline, one process: the full EMA of the last checkpoint
    print(
        f"EMA of step {args.steps} in {last}: {len(full)} tensors, norm {sum(t.norm() ** 2 for t in full.values()) ** 0.5:.6f}"
    )
    return last


if __name__ == "__main__":
    main()
