"""A rank that ends with an async EMA write in flight (``fe.AsyncSaver``): into a shared folder, it leaves a
complete checkpoint; with ``shared=False`` or to a URL (committed only by a collective call), it leaves the save
uncommitted, and says so.

* A script that exits normally (a real interpreter exit) right after ``AsyncSaver.save`` into a shared folder:
  Python joins the writer threads at exit, so the write finishes and the manifest is committed.
* A rank of the test harness (``run_ranks``), which ends with ``os._exit``: the harness waits for
  the rank's saves first (``functional_ema._testing.multirank._finish_async_saves``), as a real exit would.
* A ``shared=False`` save awaiting its commit when the script ends (rank 0 normally, rank 1 on an uncaught
  exception): the commit is collective, which cannot run at exit (the ranks exit at different times, a crashed
  one never); each rank warns once (a log record: with logging unconfigured, on stderr) naming the tag, its folder
  and the fix (``saver.wait()``), and the tag's previous checkpoint stays the complete one. Without a process
  group: said once on stderr whatever the warning filters (``-W ignore``, ``-W error``), and logged to a handler.

All: 2 ranks, gloo, a DDP model (no DeepSpeed: its native threads sometimes abort at interpreter
teardown). The first two: rank 0's file write held back ``DELAY`` seconds by a test-only hook, so that the write
is really in flight when the rank's last line runs: each rank records there that the manifest did
not exist yet and its save was not done. From the parent: the manifest reads and the consolidated
EMA equals the state that was saved, bitwise.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from functional_ema._testing.multirank import run_ranks, spawn_ranks, wait_ranks

DELAY = 1.5
TAG = "ema"


def save_and_return(out: str, delay: float) -> dict:
    """Save an EMA asynchronously and return at once (every rank); write what the last line saw."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import functional_ema as fe
    from functional_ema._checkpoint import writer
    from functional_ema.checkpoint import MANIFEST_NAME

    rank, out = dist.get_rank(), Path(out)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 3))
    )
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5)
    full = fe.gather_full(state, model)
    if rank == 0:
        save_file({n: t.contiguous() for n, t in full.items()}, str(out / "expected.safetensors"))
    dist.barrier()

    write = writer.write_rank_file  # the background thread's file write, held back (test only)

    def slow_write(*args, **kwargs):
        time.sleep(delay)
        return write(*args, **kwargs)

    writer.write_rank_file = slow_write
    handle = fe.AsyncSaver().save(state, model, out, TAG, decay=0.5)
    seen = {"manifest_existed": (out / TAG / MANIFEST_NAME).exists(), "save_done": handle.done(), "at": time.time()}
    (out / f"last_line_rank{rank}.json").write_text(json.dumps(seen))
    return seen


# A normal script: init, save, and the interpreter exits when the last line has run. Python's exit
# joins the save's writer threads first (threading._shutdown), then runs the atexit handlers; the one
# registered here then skips only the C++ teardown after them, where gloo's native threads abort now
# and then on CPU ("terminate called without an active exception"), unrelated to the save.
SCRIPT = (
    "import atexit, os, sys, torch.distributed as dist; dist.init_process_group('gloo'); "
    "atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0))); "
    "from tests.test_exit import save_and_return; save_and_return(sys.argv[1], float(sys.argv[2]))"
)


def _check_complete(out: Path) -> None:
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.checkpoint import read_manifest

    for rank in range(2):
        seen = json.loads((out / f"last_line_rank{rank}.json").read_text())
        assert seen["manifest_existed"] is False and seen["save_done"] is False, (rank, seen)  # really in flight
    manifest = read_manifest(out, TAG)
    assert manifest["step"] == 1 and manifest["world_size"] == 2, manifest
    want, got = load_file(str(out / "expected.safetensors")), fe.consolidate(out, TAG)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert not [
        p.name for p in (out / TAG).iterdir() if p.name.startswith("ema_async.")
    ]  # the commit's markers removed


def test_normal_exit_waits_for_async_save(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    t0 = time.monotonic()
    procs, logs = spawn_ranks([sys.executable, "-c", SCRIPT, str(out), str(DELAY)], 2, tmp_path)
    wait_ranks(procs, logs, "a script exiting with an async save in flight", timeout=120)
    elapsed = time.monotonic() - t0
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log.read_text()[-4000:]}"
    _check_complete(out)
    assert elapsed >= DELAY


def test_harness_rank_waits_for_async_save(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    res = run_ranks(
        "tests.test_exit:save_and_return",
        world_size=2,
        timeout=120,
        env={"FE_DIST_INIT": "torch"},
        out=str(out),
        delay=DELAY,
    )
    assert [r["save_done"] for r in res] == [False, False], res
    _check_complete(out)


def private_save_and_end(out: str):
    """A complete private save of tag ``ema``, then an async private save of it (step 2) that nobody waits for;
    rank 1 then raises. Returns the saver (kept alive until exit by the script)."""
    import torch.distributed as dist

    import functional_ema as fe

    rank, own = dist.get_rank(), Path(out) / f"own{dist.get_rank()}"
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
    fe.save(state, model, own, TAG, decay=0.5, shared=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = fe.update(state, fe.local_shards(model), 2, decay=0.5)
    saver = fe.AsyncSaver()
    saver.save(state, model, own, TAG, decay=0.5, shared=False)
    saver._pending[0].write.result(timeout=60)  # written, not committed
    if rank == 1:
        raise RuntimeError("rank 1 ends on an uncaught exception")
    return saver


# As SCRIPT, but the os._exit handler registered first, so that it runs last: after the exit handler of
# weakref.finalize (which torch's import may register), where the saver's check runs.
PRIVATE_SCRIPT = (
    "import atexit, os, sys; atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(0))); "
    "import torch.distributed as dist; dist.init_process_group('gloo'); "
    "from tests.test_exit import private_save_and_end; saver = private_save_and_end(sys.argv[1])"
)


def test_exit_with_a_private_save_awaiting_its_commit_warns_and_keeps_the_previous_checkpoint(tmp_path):
    """It left the save uncommitted silently (``ema_latest`` naming the old save, the new files beside it, nothing
    said). Now each rank warns at exit; the tag's previous checkpoint is untouched and consolidates to the step-1
    EMA, bitwise."""
    import functional_ema as fe

    procs, logs = spawn_ranks([sys.executable, "-c", PRIVATE_SCRIPT, str(tmp_path)], 2, tmp_path)
    wait_ranks(procs, logs, "a script exiting with a private async save awaiting its commit", timeout=120)
    for rank, log in enumerate(logs):
        text = log.read_text()
        own = tmp_path / f"own{rank}"
        said = (
            f"functional_ema: the async EMA save of step 2 into {own / TAG} (tag {TAG!r}) was never committed: the "
            "process is ending"
        )
        assert text.count(said) == 1, text[-4000:]  # the log record, not also a warning of it (it was both)
        assert "RuntimeWarning" not in text and "Call saver.wait() on every rank before exiting" in text, text[-4000:]
        assert ("rank 1 ends on an uncaught exception" in text) == (rank == 1), text[-4000:]
        assert (own / "ema_latest").read_text() == f"{TAG}\n"
        assert fe.checkpoint.read_manifest(own, TAG)["step"] == 1
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    want = {n: t.detach().clone() for n, t in model.named_parameters()}  # step 1 from init: the weights
    for rank in range(2):
        got = fe.consolidate(tmp_path / f"own{rank}", TAG)
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


# One process, no process group: a private save written, never committed, when the script ends.
SOLO_SCRIPT = (
    "import sys, torch, functional_ema as fe; torch.manual_seed(0); model = torch.nn.Linear(4, 3); "
    "state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5); "
    "saver = fe.AsyncSaver(); saver.save(state, model, sys.argv[1], 't', shared=False); "
    "saver._pending[0].write.result(timeout=60)"
)


def test_exit_warning_is_logged_once_whatever_the_warning_filters(tmp_path, caplog):
    """The exit check (``_async._warn_uncommitted``, run at exit by ``weakref.finalize``) of a private save written,
    not committed, is a log record: it reaches logging handlers (a cluster's log collection), and with logging
    unconfigured it is printed once on stderr. It was a warning as well (said twice), then a warning only, which
    ``-W ignore`` (or a blanket ``filterwarnings("ignore")``) silenced and logging handlers never saw."""
    import subprocess
    import warnings

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._testing.multirank import ROOT

    said = "the async EMA save of step 1 into {} (tag 't') was never committed"
    runs = {}
    for flags in (("-W", "ignore"), ("-W", "error")):  # without flags: the two-rank test above
        out = tmp_path / ("solo" + "".join(flags).replace("-W", "_"))
        runs[flags] = (
            out,
            subprocess.Popen(
                [sys.executable, *flags, "-c", SOLO_SCRIPT, str(out)],
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ),
        )
    for flags, (out, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, (flags, stderr[-4000:])
        assert (stdout + stderr).count(said.format(out / "t")) == 1, (flags, stdout[-2000:], stderr[-4000:])
        assert "RuntimeWarning" not in stderr and "Call saver.wait() on every rank" in stderr, (flags, stderr[-4000:])
        assert not (out / "t" / "ema_manifest.json").exists() and not (out / "ema_latest").exists(), flags

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
    saver = fe.AsyncSaver()
    saver.save(state, model, tmp_path, "t", shared=False)
    saver._pending[0].write.result(timeout=60)
    for action in ("default", "ignore", "error"):  # the filters change nothing: one record, at WARNING, no warning
        caplog.clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter(action)
            _async._warn_uncommitted(saver._pending)
        assert not seen, (action, [str(w.message) for w in seen])
        records = [(r.name, r.levelname, r.getMessage().count(said.format(tmp_path / "t"))) for r in caplog.records]
        assert records == [("functional_ema", "WARNING", 1)], (action, records)
    saver.wait()  # committed after all: the check says nothing of it
    caplog.clear()
    _async._warn_uncommitted(saver._pending)
    assert not caplog.records and fe.checkpoint.read_manifest(tmp_path, "t")["step"] == 1
