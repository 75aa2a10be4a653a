"""Q5: wall time of import ray, ray.init, two fit()s of 2 workers that only report, ray.shutdown."""

from __future__ import annotations

import os
import time

from _common import ROOT, fresh, versions


def train_fn(config: dict) -> None:
    import ray.train

    ray.train.report({"ok": 1})


def main() -> None:
    t0 = time.perf_counter()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t_import = time.perf_counter() - t0
    print(versions())
    print(f"load average before: {os.getloadavg()}")
    base = fresh("timing")
    t = time.perf_counter()
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2)
    t_init = time.perf_counter() - t
    fits = []
    for i in range(2):
        t = time.perf_counter()
        TorchTrainer(
            train_fn,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=str(base), name=f"timing{i}"),
        ).fit()
        fits.append(time.perf_counter() - t)
    t = time.perf_counter()
    ray.shutdown()
    t_down = time.perf_counter() - t
    print(
        f"import ray+train {t_import:.2f}s, ray.init {t_init:.2f}s, fit #1 {fits[0]:.2f}s, fit #2 {fits[1]:.2f}s, "
        f"ray.shutdown {t_down:.2f}s, total {time.perf_counter() - t0:.2f}s (storage {ROOT})"
    )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
