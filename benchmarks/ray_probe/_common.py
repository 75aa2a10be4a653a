"""Driver-side helpers for the Ray Train probes (exploration for issue 37, not tests).

Run with the separate venv: ``/tmp/ray-venv/bin/python benchmarks/ray_probe/<probe>.py``. Only the driver
imports this module; the train functions are self-contained because Ray pickles them into worker processes
that cannot import a file from this folder.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import time
from pathlib import Path

# Before `import ray`: no usage report leaves the machine, and Ray stays on loopback. ray.init rewrites
# _node_ip_address="127.0.0.1" to the host's routable address (services.resolve_ip_for_localhost) unless
# this flag (named for Windows/macOS, read on Linux too) is 0; probe_network.py shows both. Set it to 1
# in the environment to see Ray's default.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(os.environ.get("RAY_PROBE_ROOT", "/tmp/ray-probe"))


def fresh(name: str) -> Path:
    """An empty folder under ROOT (storage paths and worker logs of one probe)."""
    path = ROOT / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def start_ray() -> float:
    """ray.init on loopback only, 2 CPUs, no dashboard; returns its wall time in seconds."""
    import ray

    t0 = time.perf_counter()
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2)
    return time.perf_counter() - t0


def versions() -> str:
    import ray
    import torch
    from ray.train.v2._internal.constants import is_v2_enabled

    env = {k: os.environ.get(k, "<unset>") for k in ("RAY_TRAIN_V2_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    return f"ray {ray.__version__}, torch {torch.__version__}, {env} -> train v2={is_v2_enabled()}"


def tree(path: str | Path) -> list[str]:
    """Every file under path: relative name, size, first 12 hex digits of its sha256, a byte summary."""
    out = []
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            data = f.read_bytes()
            sample = data[::65536]  # one byte per 64 KiB: a file torn between two writers shows several runs
            runs = 1 + sum(a != b for a, b in itertools.pairwise(sample))
            kinds = sorted(set(data[:: max(1, len(data) // 4096)]))
            summary = data[:24] if len(data) <= 64 else f"byte values {[hex(b) for b in kinds[:6]]}, {runs} runs"
            out.append(
                f"{f.relative_to(path)}  {len(data)} B  sha256={hashlib.sha256(data).hexdigest()[:12]}  {summary!r}"
            )
    return out
