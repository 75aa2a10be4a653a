"""More than one node: node-local checkpoint folders are found at save time, never at resume (issue 22).

Two launches of ``torchrun --nnodes 2`` on this machine, one per "node", each rank a DDP model on gloo.
Node-local storage is made real with mount namespaces: each node's launch runs under ``unshare -m`` with
its own folder bind-mounted at the same path, so both ranks save to ``<mnt>/ckpt`` and each sees only its
own node's files, as with node-local NVMe. ``fe.save`` and ``AsyncSaver.save`` must then fail on every
rank with an error that names the cause, and leave nothing that looks complete in either folder. The
same two launches with one shared folder save and load normally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from functional_ema._testing.multirank import ROOT, _free_port

SCRIPT = r"""
import json, os, sys, torch, torch.distributed as dist
import functional_ema as fe

out, result = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)))
state = fe.init_ema(fe.local_shards(model))
bufs = fe.buffers.init_buffers(model)
report = {"rank": dist.get_rank()}
for what, save in (("save", lambda: fe.save(state, model, out, "t", buffers=bufs, timeout=60)),
                   ("async", lambda: fe.AsyncSaver().save(state, model, out, "a", buffers=bufs, timeout=60).wait())):
    try:
        save()
        report[what] = None
    except Exception as e:
        report[what] = [type(e).__name__, str(e)]
if report["save"] is None:
    loaded = fe.load(model, out, "t")
    report["loaded"] = all(torch.equal(loaded.ema[n], t) for n, t in state.ema.items())
report["files"] = sorted(str(p.relative_to(out)) for p in __import__("pathlib").Path(out).rglob("*"))
dist.destroy_process_group()
with open(result, "w") as f:
    json.dump(report, f)
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown, as functional_ema/_testing/multirank.py does: gloo's native threads occasionally abort there
# ("terminate called without an active exception", SIGABRT) after all the work is done, and torchrun
# then reports the node as failed while the other node's agent waits for it.
os._exit(0)
"""


def _launch(tmp: Path, node_dirs: list[Path] | None, timeout: float = 240) -> list[dict]:
    """Two torchrun launches (one per node, one rank each); with ``node_dirs`` each runs in its own mount
    namespace with its folder bound at ``tmp/mnt``. Returns each node's report."""
    script = tmp / "node_script.py"
    script.write_text(SCRIPT)
    mnt = tmp / "mnt"
    mnt.mkdir(exist_ok=True)
    port = _free_port()
    procs = []
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp),  # torchrun's agent leaves its (empty) torchelastic_* log folders there, not in /tmp
    )
    for node in (0, 1):
        run = (
            f"{Path(sys.executable).parent / 'torchrun'} --nnodes 2 --nproc-per-node 1 --node-rank {node} "
            f"--master-addr 127.0.0.1 --master-port {port} {script} {mnt / 'ckpt'} {tmp / f'result{node}.json'}"
        )
        if node_dirs is not None:
            run = f"mount --bind {node_dirs[node]} {mnt} && exec {run}"
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", run]
        else:
            argv = ["sh", "-c", f"exec {run}"]
        with open(tmp / f"node{node}.log", "wb") as log:  # the child keeps its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    argv, env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):  # a node that fails ends the launch at once
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if any(p.poll() is None for p in procs) and not any(p.poll() not in (None, 0) for p in procs):
            raise subprocess.TimeoutExpired("torchrun", timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(
            "a node launch timed out:\n" + "\n".join((tmp / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
        )
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    reports = []
    for node, p in enumerate(procs):
        res = tmp / f"result{node}.json"
        assert p.returncode == 0 and res.exists(), (tmp / f"node{node}.log").read_text()[-4000:]
        reports.append(json.loads(res.read_text()))
    return reports


def test_node_local_folders_refused_at_save_time(tmp_path):
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("this test needs root to make mount namespaces (unshare -m)")
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for d in nodes:
        d.mkdir()
    reports = _launch(tmp_path, nodes)
    for r in reports:
        for what in ("save", "async"):
            name, msg = r[what]
            assert name == "CheckpointError" and "not shared by every rank (node-local storage?)" in msg, (what, msg)
    # neither node's folder holds anything that looks like a checkpoint: no manifest, no rank file
    for d in nodes:
        left = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        assert not any("manifest" in f or "_rank_" in f for f in left), left


def test_two_nodes_sharing_a_folder_save_and_load(tmp_path):
    reports = _launch(tmp_path, None)
    for r in reports:
        assert r["save"] is None and r["async"] is None and r["loaded"], r
    assert "t/ema_manifest.json" in reports[0]["files"] and "a/ema_manifest.json" in reports[0]["files"]
