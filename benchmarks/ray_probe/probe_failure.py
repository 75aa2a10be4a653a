"""Q3: a worker SIGKILLs itself after checkpoints were reported; FailureConfig(max_failures=N) (argv[1], default 1).

Steps 0..5, each one a report with a merged checkpoint (rank{r}.txt = step). At step 3 rank 1 kills itself
(os.kill(os.getpid(), 9)) the first time only (a marker file). Every worker appends timestamped events to
log/r{rank}.jsonl: start (pid, get_checkpoint() and what it holds), each report, the kill.
"""

from __future__ import annotations

import json
import sys
import time

from _common import fresh, start_ray, versions


def train_fn(config: dict) -> None:
    import json
    import os
    import pathlib
    import shutil
    import tempfile
    import time

    import ray.train

    rank = ray.train.get_context().get_world_rank()
    log = os.path.join(config["log"], f"r{rank}.jsonl")

    def event(**kw) -> None:
        with open(log, "a") as f:
            f.write(json.dumps({"t": time.time(), "rank": rank, "pid": os.getpid(), **kw}) + "\n")

    ckpt, start = ray.train.get_checkpoint(), 0
    if ckpt is not None:
        held = {n: pathlib.Path(ckpt.path, n).read_text() for n in sorted(os.listdir(ckpt.path))}
        start = 1 + int(held[f"rank{rank}.txt"])
        event(what="start", checkpoint=ckpt.path, holds=held)
    else:
        event(what="start", checkpoint=None)
    for step in range(start, 6):
        time.sleep(0.2)  # "training"
        marker = os.path.join(config["log"], "killed")
        if step == 3 and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            event(what="kill", step=step)
            os.kill(os.getpid(), 9)
        tmp = tempfile.mkdtemp(prefix=f"probe_r{rank}_")
        with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
            f.write(str(step))
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        shutil.rmtree(tmp)
        event(what="reported", step=step, checkpoint=ray.train.get_checkpoint().path.rsplit("/", 1)[-1])


def main() -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    max_failures = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    base = fresh(f"failure_{max_failures}")
    (base / "log").mkdir()
    print(versions())
    start_ray()
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"log": str(base / "log")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            storage_path=str(base / "storage"), name="failure", failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    t0 = time.time()
    try:
        result = trainer.fit()
        print(f"fit returned after {time.time() - t0:.1f}s: metrics={result.metrics} error={result.error!r}")
        print("result.checkpoint:", result.checkpoint)
    except Exception as e:  # noqa: BLE001 - the probe prints whatever fit raises (max_failures=0)
        print(f"fit raised after {time.time() - t0:.1f}s: {type(e).__name__}: {str(e)[:300]}")
    events = sorted(
        (json.loads(line) for p in (base / "log").glob("*.jsonl") for line in p.read_text().splitlines()),
        key=lambda e: e["t"],
    )
    kill_t = next((e["t"] for e in events if e["what"] == "kill"), None)
    for e in events:
        since_kill = "" if kill_t is None else f" kill{e['t'] - kill_t:+6.2f}s"
        print(f"{e['t'] - t0:6.2f}s{since_kill}", {k: v for k, v in e.items() if k != "t"})
    ray.shutdown()


if __name__ == "__main__":
    main()
