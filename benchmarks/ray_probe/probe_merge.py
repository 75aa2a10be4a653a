"""Q1: what lands in the persisted checkpoint folder when both workers report their own temp folder.

Each worker writes into its own tempfile.TemporaryDirectory: a file named per rank, `same.bin` (identical
bytes on both ranks), `diff_small.txt` and `diff_big.bin` (same names, bytes differ per rank: 0xA0 + rank),
`sub/rank{r}.txt`, and on rank 1 a 128 MiB `rank1_big.bin` (slow to copy). Modes (argv[1], default all):
  all        both ranks report their folder (default SYNC upload)
  rank0      rank 1 reports checkpoint=None
  async      both report with checkpoint_upload_mode=ASYNC
  no_upload  each rank writes straight into <experiment dir>/<name> and reports it with NO_UPLOAD
Right after report() returns, each rank lists the folder get_checkpoint() points to (is it complete yet?).
"""

from __future__ import annotations

import json
import sys
import time

from _common import fresh, start_ray, tree, versions


def train_fn(config: dict) -> None:
    import json
    import os
    import shutil
    import tempfile
    import time

    import ray.train
    from ray.train import CheckpointUploadMode

    ctx = ray.train.get_context()
    rank, mode = ctx.get_world_rank(), config["mode"]
    for i in range(config["reports"]):
        if mode == "no_upload":
            folder = os.path.join(ctx.get_storage().experiment_fs_path, f"direct_{i:03d}")
            os.makedirs(folder, exist_ok=True)
        else:
            folder = tempfile.mkdtemp(prefix=f"probe_r{rank}_")
        os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
        files = {
            f"only_rank{rank}.txt": f"rank {rank} report {i}\n".encode(),
            "same.bin": bytes(range(256)) * 4,
            "diff_small.txt": f"from rank {rank}\n".encode(),
            "diff_big.bin": bytes([0xA0 + rank]) * (32 << 20),
            f"sub/rank{rank}.txt": b"x",
        }
        if rank == 1:
            files["rank1_big.bin"] = b"\x5a" * (128 << 20)
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        ckpt = ray.train.Checkpoint.from_directory(folder)
        if mode == "rank0" and rank == 1:
            ckpt = None
        upload = {"async": CheckpointUploadMode.ASYNC, "no_upload": CheckpointUploadMode.NO_UPLOAD}.get(
            mode, CheckpointUploadMode.SYNC
        )
        t0 = time.perf_counter()
        ray.train.report({"i": i, "rank": rank}, checkpoint=ckpt, checkpoint_upload_mode=upload)
        took = time.perf_counter() - t0
        src_exists_after = os.path.exists(folder)
        if mode not in ("no_upload", "async"):  # ASYNC copies after report() returns, then deletes it itself
            shutil.rmtree(folder, ignore_errors=True)
        got = ray.train.get_checkpoint()
        seen = sorted(os.listdir(got.path)) if got is not None else None
        sizes = {n: os.path.getsize(os.path.join(got.path, n)) for n in seen or [] if n.endswith(".bin")}
        rec = {
            "rank": rank,
            "i": i,
            "report_s": round(took, 3),
            "src": folder,
            "src_exists_after": src_exists_after,
            "get_checkpoint": None if got is None else got.path,
            "listing_right_after_report": seen,
            "bin_sizes": sizes,
        }
        with open(os.path.join(config["log"], f"r{rank}_{i}.json"), "w") as f:
            json.dump(rec, f)


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    base = fresh(f"merge_{mode}")
    (base / "log").mkdir()
    print(versions())
    print(f"ray.init {start_ray():.2f}s")
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"mode": mode, "reports": 3, "log": str(base / "log")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(base / "storage"), name=f"merge_{mode}"),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    print(f"fit {time.perf_counter() - t0:.2f}s; result.checkpoint = {result.checkpoint}")
    for p in sorted((base / "log").glob("*.json")):
        print("worker", json.loads(p.read_text()))
    exp = base / "storage" / f"merge_{mode}"
    print("experiment folder:", sorted(x.name for x in exp.iterdir()))
    for d in sorted(x for x in exp.iterdir() if x.is_dir()):
        print(f"--- {d.name}")
        for line in tree(d):
            print("   ", line)
    ray.shutdown()


if __name__ == "__main__":
    main()
