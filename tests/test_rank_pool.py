"""The warm rank pool (``functional_ema._testing.rank_pool``): a rank forked from it is the rank a fresh
interpreter would be (environment, session, working directory, import path, threads, output, exit status),
and the launcher's failure paths (a raising rank, a killed rank, a rank's children) work on it as before.

Each check runs the same launch pooled and with ``FE_RANK_POOL=0`` (fresh interpreters) and compares.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from functional_ema._testing import rank_pool
from functional_ema._testing.multirank import ROOT, run_ranks

FAST = {"FE_DIST_INIT": "torch"}  # plain gloo, no DeepSpeed init: the harness, not an engine


def describe_worker(extra: str) -> dict:
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "FE_EXTRA", "OMP_NUM_THREADS", "FE_RANK_POOL")},
        "extra": extra,
        "own_session": os.getsid(0) == os.getpid(),
        "cwd": os.getcwd(),
        "root_on_path": str(ROOT) in sys.path,
        "threads": torch.get_num_threads(),
        "all_reduce": _all_reduce(dist),
        "hub_offline": _hub_offline(),
        "fsspec_s3": _fsspec_s3(),
    }


def _fsspec_s3() -> dict | None:
    """fsspec's configuration for s3, read from ``FSSPEC_S3_*`` (the pool's server imported fsspec before)."""
    try:
        import fsspec
    except ImportError:
        return None
    return fsspec.config.conf.get("s3")


def _hub_offline() -> bool | None:
    """What huggingface_hub read at import (the pool's server imported it before the launch's environment)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return constants.HF_HUB_OFFLINE


def _all_reduce(dist) -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def failing_worker(how: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "raise":
            raise ValueError("rank 1 was told to fail")
        os.kill(os.getpid(), signal.SIGKILL)


def grandchild_worker(pid_file: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
    time.sleep(600)


@pytest.mark.parametrize("pool", ["1", "0"])
def test_pooled_rank_is_the_fresh_rank(pool: str, monkeypatch) -> None:
    monkeypatch.setenv("FE_RANK_POOL", pool)
    results = run_ranks(
        "tests.test_rank_pool:describe_worker",
        world_size=3,
        timeout=120,
        # the server itself runs one thread, and read fsspec's configuration without these variables
        env={**FAST, "FE_EXTRA": "x", "OMP_NUM_THREADS": "2", "FSSPEC_S3_KEY": "k", "FSSPEC_S3_ENDPOINT_URL": "e"},
        extra="kw",
    )
    for rank, r in enumerate(results):
        assert r == {
            "rank": rank,
            "world": 3,
            "env": {
                "RANK": str(rank),
                "WORLD_SIZE": "3",
                "FE_EXTRA": "x",
                "OMP_NUM_THREADS": "2",
                "FE_RANK_POOL": pool,
            },
            "extra": "kw",
            "own_session": True,
            "cwd": str(ROOT),
            "root_on_path": True,
            "threads": 2,
            "all_reduce": 6.0,
            "hub_offline": True if importlib.util.find_spec("huggingface_hub") else None,
            "fsspec_s3": {"key": "k", "endpoint_url": "e"} if importlib.util.find_spec("fsspec") else None,
        }, (rank, r)


@pytest.mark.parametrize("pool", ["1", "0"])
def test_failed_and_killed_ranks_are_reported(pool: str, monkeypatch) -> None:
    monkeypatch.setenv("FE_RANK_POOL", pool)
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed \(exit 1\).*ValueError: rank 1 was told to fail"):
        run_ranks("tests.test_rank_pool:failing_worker", world_size=2, timeout=60, env=FAST, how="raise")
    # Killed: rank 0 may finish or wait in teardown; either way rank 1's SIGKILL is what is reported.
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed \(exit -9\)|exit codes of the others: \{1: -9\}"):
        run_ranks("tests.test_rank_pool:failing_worker", world_size=2, timeout=60, env=FAST, how="kill")


def test_a_rank_s_children_die_with_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FE_RANK_POOL", "1")
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(AssertionError, match="timeout after 4 s"):
        run_ranks("tests.test_rank_pool:grandchild_worker", world_size=2, timeout=4, env=FAST, pid_file=str(pid_file))
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), f"the rank's child {grandchild} outlived the killed rank"


def test_pool_is_off_with_fe_rank_pool_0() -> None:
    assert rank_pool.enabled({}) and rank_pool.enabled({"FE_RANK_POOL": "1"})
    assert not rank_pool.enabled({"FE_RANK_POOL": "0"})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, awaiting its reaper
    except FileNotFoundError:
        return False


def test_a_launch_with_other_hub_settings_is_refused_when_pooled(monkeypatch) -> None:
    """The server imported huggingface_hub under the launches' HF_HUB_OFFLINE; a launch with another value
    would see the server's, so its pooled ranks refuse, naming the variable; fresh ranks run."""
    monkeypatch.setenv("FE_RANK_POOL", "1")
    run_ranks("tests.test_rank_pool:describe_worker", world_size=2, timeout=120, env=FAST, extra="")  # a server up
    with pytest.raises(AssertionError, match=r"this launch sets HF_HUB_OFFLINE='0'.*FE_RANK_POOL=0"):
        run_ranks(
            "tests.test_rank_pool:describe_worker",
            world_size=2,
            timeout=120,
            env={**FAST, "HF_HUB_OFFLINE": "0"},
            extra="",
        )
    monkeypatch.setenv("FE_RANK_POOL", "0")
    fresh = run_ranks(
        "tests.test_rank_pool:describe_worker", world_size=2, timeout=120, env={**FAST, "HF_HUB_OFFLINE": "0"}, extra=""
    )
    assert [r["hub_offline"] for r in fresh] == [False, False] or not importlib.util.find_spec("huggingface_hub")


def test_preload_refuses_a_module_that_starts_a_thread(tmp_path) -> None:
    """The server forks single-threaded or not at all; an optional package that is missing is skipped,
    a required one is not."""
    (tmp_path / "fe_starts_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    script = (
        "from functional_ema._testing import rank_pool as p\n"
        "p.PRELOAD_OPTIONAL = ('fe_not_installed',)\n"
        "p._preload(('json', 'fe_not_installed'))\n"
        "try:\n"
        "    p._preload(('fe_not_installed_required',))\n"
        "except ImportError as e:\n"
        "    print('required:', e.name)\n"
        "p._preload(('json', 'fe_starts_thread'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "required: fe_not_installed_required" in run.stdout, run.stdout
    assert "has 2 threads after importing fe_starts_thread; it forks ranks single-threaded" in run.stderr, run.stderr


def test_a_clean_server_leaves_no_log() -> None:
    """A test process whose server ended cleanly leaves no ``fe_rank_pool_<pid>.log`` behind."""
    script = (
        "from functional_ema._testing import rank_pool\n"
        "from functional_ema._testing.multirank import run_ranks\n"
        "r = run_ranks('tests.test_rank_pool:describe_worker', world_size=2, timeout=120, "
        "env={'FE_DIST_INIT': 'torch'}, extra='')\n"
        "assert [x['rank'] for x in r] == [0, 1], r\n"
        "print('log while running:', rank_pool._log_path().exists())\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "FE_RANK_POOL": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    assert "log while running: True" in out.decode(), out
    assert not (Path(tempfile.gettempdir()) / f"fe_rank_pool_{proc.pid}.log").exists()
