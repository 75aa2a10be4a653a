"""Q2: what get_checkpoint() gives each worker when a run resumes.

Run A (name "resume") reports 2 merged checkpoints (each rank writes rank{r}.txt with the step). Then:
  B: a new TorchTrainer with the same storage_path and name (does v2 pick the run up again?),
  C: a new name with resume_from_checkpoint=<A's result.checkpoint> (refused by v2: printed), then
  D: a new name with A's checkpoint path in train_loop_config (the v2 migration guide's replacement:
     the loop takes get_checkpoint(), else ray.train.Checkpoint(<that path>)).
At start every worker logs pid, get_checkpoint() (path, filesystem), as_directory() and its listing.
"""

from __future__ import annotations

import json

from _common import fresh, start_ray, versions


def train_fn(config: dict) -> None:
    import json
    import os
    import pathlib
    import shutil
    import tempfile

    import ray.train

    rank = ray.train.get_context().get_world_rank()
    ckpt = ray.train.get_checkpoint()
    rec: dict = {"phase": config["phase"], "rank": rank, "pid": os.getpid(), "get_checkpoint_is_none": ckpt is None}
    if ckpt is None and config.get("initial"):
        ckpt = ray.train.Checkpoint(config["initial"])
    start = 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            listing = sorted(os.listdir(d))
            start = 1 + max(int(pathlib.Path(d, f"rank{r}.txt").read_text()) for r in (0, 1))
            rec["checkpoint"] = {
                "type": type(ckpt).__name__,
                "path": ckpt.path,
                "fs": type(ckpt.filesystem).__name__,
                "as_directory": d,
                "as_directory_is_path": d == ckpt.path,
                "listing": listing,
                "resume_step": start,
            }
    for step in range(start, start + 2):
        tmp = tempfile.mkdtemp(prefix=f"probe_r{rank}_")
        with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
            f.write(str(step))
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        shutil.rmtree(tmp)
    with open(os.path.join(config["log"], f"{config['phase']}_r{rank}.json"), "w") as f:
        json.dump(rec, f)


def fit(base, phase: str, name: str, resume_from=None, initial=None):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"phase": phase, "log": str(base / "log"), "initial": initial},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(base / "storage"), name=name),
        resume_from_checkpoint=resume_from,
    )
    result = trainer.fit()
    print(f"{phase}: result.checkpoint={result.checkpoint.path} metrics={result.metrics}")
    for r in (0, 1):
        print(f"  {phase} rank {r}:", json.loads((base / "log" / f"{phase}_r{r}.json").read_text()))
    return result


def main() -> None:
    import ray

    base = fresh("resume")
    (base / "log").mkdir()
    print(versions())
    start_ray()
    a = fit(base, "A", "resume")
    fit(base, "B_same_name", "resume")
    try:
        fit(base, "C_resume_from", "resume_explicit", resume_from=a.checkpoint)
    except DeprecationWarning as e:
        print("C_resume_from: refused:", repr(e)[:160])
    fit(base, "D_initial_path", "resume_initial", initial=a.checkpoint.path)
    for exp in ("resume", "resume_initial"):
        print(exp, sorted(p.name for p in (base / "storage" / exp).iterdir()))
    ray.shutdown()


if __name__ == "__main__":
    main()
