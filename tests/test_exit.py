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

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

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


# The command line's exit codes (``python -m functional_ema``): 0 written, 2 refused input (checked before anything
# is read, nothing written), 130 interrupted. Every path argument of every verb takes a leading ``~`` as the user's
# home, as a shell does unquoted (a quoted one made a folder ``~`` in the current directory); ``file://~/x`` names
# the host ``~`` and is refused. An OUT inside the checkpoint read, or in a folder not writable, is exit 2 for
# every verb.


def _cli_checkpoint(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint (tag ``t``, step 1) of a small model's EMA, and that EMA in plain torch (``lerp``: bitwise)."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    state = fe.update(state, fe.local_shards(model), 1, decay=0.75)
    fe.save(state, model, root / "ck", "t")
    return root / "ck", {n: before[n].lerp(p.detach(), 0.25) for n, p in model.named_parameters()}


def _cli_snapshots(folder: Path) -> None:
    """Power-EMA snapshots of a short random walk (steps 16 and 32) in ``folder``."""
    import functional_ema as fe
    from functional_ema import posthoc, schedules

    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    scheds = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    for step in range(1, 33):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        state = fe.update(state, fe.local_shards(model), step, decay=scheds)
        if step % 16 == 0:
            posthoc.save_snapshot(state, model, folder, scheds)


def _dcp_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """A one-process DCP checkpoint of an EMA (``EMAStateful``, key ``ema``); returns the EMA (the model's weights)."""
    import pytest
    from torch.distributed import checkpoint as dcp

    import functional_ema as fe

    model = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning):  # DCP's: no process group
        dcp.save(
            {"ema": fe.dcp.EMAStateful(model, fe.init_ema(fe.local_shards(model)))},
            checkpoint_id=str(folder),
            no_dist=True,
        )
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_cli_takes_a_leading_tilde_as_the_home_folder_in_every_path_argument(tmp_path, monkeypatch, capsys):
    """Review: a quoted ``'~/o.safetensors'`` (or one from a config file) reached the verbs unexpanded: refused as a
    missing folder ``./~`` at best, written into one at worst (``export`` made ``./~/hf``). Every path argument is now
    expanded where it enters (``os.path.expanduser``): the files land in the home folder, bitwise the EMA, and the
    current folder stays empty. ``file://~/x`` (the host ``~``) is refused, exit 2, nothing written."""
    from safetensors.torch import load_file

    from functional_ema.__main__ import main

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    _, expected = _cli_checkpoint(home)
    dcp_ema = _dcp_checkpoint(home / "dcp")
    _cli_snapshots(home / "snaps")
    assert main(["consolidate", "~/ck", "~/o.safetensors"]) == 0
    got = load_file(home / "o.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)
    assert main(["consolidate", "--dcp", "~/dcp", "~/d.safetensors"]) == 0
    got = load_file(home / "d.safetensors")
    assert sorted(got) == sorted(dcp_ema) and all(torch.equal(got[n], dcp_ema[n]) for n in dcp_ema)
    plot = ["--plot", "~/p.png"] if importlib.util.find_spec("matplotlib") else []
    assert main(["posthoc", "~/snaps", "~/p.safetensors", "--sigma-rel", "0.1", *plot]) == 0
    assert main(["posthoc", str(home / "snaps"), str(tmp_path / "p.safetensors"), "--sigma-rel", "0.1"]) == 0
    got, ref = load_file(home / "p.safetensors"), load_file(tmp_path / "p.safetensors")  # the same as spelt out
    assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    assert not plot or (home / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert list(work.iterdir()) == []
    capsys.readouterr()
    file_urls_of_a_host_named_tilde_are_refused(
        capsys,
        (["consolidate", "~/ck", "file://~/u.safetensors"], "OUT"),
        (["consolidate", "--dcp", "file://~/dcp", "~/u.safetensors"], "CHECKPOINT_DIR"),
        (["posthoc", "file://~/snaps", "~/u.safetensors", "--sigma-rel", "0.1"], "SNAPSHOT_DIR"),
    )
    assert list(work.iterdir()) == [] and not (home / "u.safetensors").exists()


def file_urls_of_a_host_named_tilde_are_refused(capsys: Any, *rows: tuple[list[str], str]) -> None:
    """Each ``(argv, argument)``: ``file://~/x`` names a host ``~``, not the home folder: a usage error naming the
    argument and the URL (``test_export.py`` uses it too)."""
    from functional_ema.__main__ import main

    for argv, what in rows:
        url = next(a for a in argv if a.startswith("file:"))
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == (
            f"error: {what}: {url!r} is not a local file URL: write file:///absolute/path (three slashes), or the "
            "path itself\n"
        ), argv


def test_cli_refuses_an_out_inside_the_checkpoint_it_reads_exit_2(tmp_path, capsys):
    """Review: ``consolidate`` wrote OUT into the checkpoint's root folder (a new file beside the tag folders, or beside
    the tag folder given as CHECKPOINT_DIR), and ``posthoc`` into the snapshot folder, where ``export`` refuses its
    OUT_DIR; a tag folder or a DCP folder was refused as exit 1, after the checkpoint was opened. Now every OUT (and
    ``--plot``) at or inside the checkpoint read is a usage error before anything is read: one line naming OUT and the
    checkpoint, exit 2, nothing written. Outside it, the file is bitwise the plain-torch EMA."""
    from safetensors.torch import load_file

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, expected = _cli_checkpoint(tmp_path)
    _dcp_checkpoint(tmp_path / "dcp")
    snaps = tmp_path / "snaps"
    _cli_snapshots(snaps)
    tag, snap = ck / "t", sorted(snaps.glob("snapshot_*"))[-1]
    before = hashes(tmp_path)
    cases = [
        (["consolidate", str(ck), str(ck / "o.safetensors")], "OUT", ck / "o.safetensors", "checkpoint", ck, "CHECKPOINT_DIR"),
        (["consolidate", str(tag), str(tag / "o.safetensors")], "OUT", tag / "o.safetensors", "checkpoint", tag, "CHECKPOINT_DIR"),
        (["consolidate", str(ck), str(tag / "o.safetensors"), "--overwrite"], "OUT", tag / "o.safetensors", "checkpoint", ck, "CHECKPOINT_DIR"),
        (["consolidate", str(ck), str(ck / "ema_latest"), "--overwrite"], "OUT", ck / "ema_latest", "checkpoint", ck, "CHECKPOINT_DIR"),
        (["consolidate", "--dcp", str(tmp_path / "dcp"), str(tmp_path / "dcp" / "o.safetensors")], "OUT",
         tmp_path / "dcp" / "o.safetensors", "DCP checkpoint", tmp_path / "dcp", "CHECKPOINT_DIR"),
        (["posthoc", str(snaps), str(snaps / "p.safetensors"), "--sigma-rel", "0.1"], "OUT", snaps / "p.safetensors",
         "snapshot folder", snaps, "SNAPSHOT_DIR"),
        (["posthoc", str(snaps), str(snap / "p.safetensors"), "--sigma-rel", "0.1"], "OUT", snap / "p.safetensors",
         "snapshot folder", snaps, "SNAPSHOT_DIR"),
    ]  # fmt: skip
    if importlib.util.find_spec("matplotlib"):
        cases.append(
            (["posthoc", str(snaps), str(tmp_path / "p.safetensors"), "--sigma-rel", "0.1", "--plot",
              str(snaps / "p.png")], "--plot", snaps / "p.png", "snapshot folder", snaps, "SNAPSHOT_DIR")
        )  # fmt: skip
    for argv, what, out, kind, folder, name in cases:
        assert main(argv) == 2, argv
        outside = folder.parent.parent if folder == tag else folder.parent
        assert capsys.readouterr().err == (
            f"error: {what}: refusing to write {out}: it is inside the {kind} {folder} ({name}) being read, and would "
            f"add to or replace its files. Write it outside, e.g. {outside / out.name}\n"
        ), argv
        assert hashes(tmp_path) == before, argv
    # a tag folder given: its root is read too; the root itself and its pointer files are refused, as the library does
    for out in (ck / "ema_latest", ck):
        assert main(["consolidate", str(tag), str(out), "--overwrite"]) == 2, out
        name = out.name if out != ck else "ck.safetensors"
        assert capsys.readouterr().err == (
            f"error: OUT: refusing to write {out}: it is inside the checkpoint directory {ck} being read (a tag "
            f"folder or a pointer file such as 'latest'). Write it outside the checkpoint, e.g. {tmp_path / name}\n"
        ), out
        assert hashes(tmp_path) == before, out
    assert main(["consolidate", str(tag), str(tmp_path / "o.safetensors")]) == 0
    got = load_file(tmp_path / "o.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def test_cli_out_in_a_folder_not_writable_is_exit_2_for_every_verb(tmp_path, monkeypatch, capsys):
    """Review: OUT (OUT_DIR) in a folder this user cannot write was exit 2 for ``consolidate`` and ``posthoc`` but exit
    1 for ``export``, refused only after its source was opened. Every verb now refuses it first (here the sources do
    not even exist), one line naming OUT and the folder, exit 2, nothing written."""
    from functional_ema.__main__ import main

    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    (tmp_path / "like").mkdir()
    access = os.access
    # the tests run as root, whom permissions do not stop: the folder is made unwritable for os.access alone
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw))
    no = tmp_path / "none"
    file_msg = (
        "error: OUT: the folder {} of {} is not writable by this user: choose another path, or make it writable\n"
    )
    dir_msg = (
        "error: out_dir: cannot write {0} (-> {0}): the folder {1} is not writable by this user; choose another "
        "place, or make it writable\n"
    )
    for argv, want in (
        (["consolidate", str(no), str(locked / "o.st")], file_msg.format(locked, locked / "o.st")),
        (["consolidate", "--dcp", str(no), str(locked / "o.st")], file_msg.format(locked, locked / "o.st")),
        (["posthoc", str(no), str(locked / "o.st"), "--sigma-rel", "0.1"], file_msg.format(locked, locked / "o.st")),
        (["export", str(no), str(locked / "hf"), "--like", "like"], dir_msg.format(locked / "hf", locked)),
        (["export", str(no), str(locked / "a" / "hf"), "--like", "like"], dir_msg.format(locked / "a" / "hf", locked)),
    ):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == want, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["like", "locked"] and list(locked.iterdir()) == []


def test_cli_a_tag_folder_given_holds_its_root_to_the_librarys_rule_only(tmp_path, capsys):
    """Review: with a tag folder as CHECKPOINT_DIR, the refusal of an OUT inside the checkpoint took the tag folder's
    whole parent as the checkpoint (``consolidate home/mytag home/sub/x.safetensors`` refused), then any file in it
    (``consolidate dl/mytag dl/mytag.safetensors``, ``consolidate ck/t ck/t2.safetensors``: exit 2, where they were
    written before). The parent is now held to the library's own rule (``check_output``) and no more: the parent
    itself, its pointer files, a tag-like folder of it are refused (exit 2, nothing changed), with the same message
    whether the tag is given as ``ck/t`` or ``ck --tag t`` (the folder given, ``ck``, refused whole); a new file or
    another subfolder is written, bitwise the plain-torch EMA."""
    import shutil

    from safetensors.torch import load_file

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, expected = _cli_checkpoint(tmp_path)
    home = tmp_path / "home"
    (home / "sub").mkdir(parents=True)
    shutil.copytree(ck / "t", home / "mytag")
    (ck / "exports").mkdir()
    for argv, out in (
        (["consolidate", str(home / "mytag"), str(home / "sub" / "x.safetensors")], home / "sub" / "x.safetensors"),
        (["consolidate", str(home / "mytag"), str(home / "mytag.safetensors")], home / "mytag.safetensors"),
        (["consolidate", str(ck / "t"), str(ck / "exports" / "c.safetensors")], ck / "exports" / "c.safetensors"),
        (["consolidate", str(ck / "t"), str(ck / "t2.safetensors")], ck / "t2.safetensors"),
    ):
        assert main(argv) == 0, argv
        got = load_file(out)
        assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected), argv
    shutil.copytree(ck / "t", home / "other")  # a second tag folder beside the one given
    before = hashes(tmp_path)
    capsys.readouterr()
    for argv, out, root in (
        (["consolidate", str(home / "mytag")], home / "other" / "x.safetensors", home),
        (["consolidate", str(home / "mytag")], home / "latest", home),
        (["consolidate", str(ck / "t")], ck / "ema_latest", ck),
    ):
        assert main([*argv, str(out)]) == 2, out
        assert capsys.readouterr().err == (
            f"error: OUT: refusing to write {out}: it is inside the checkpoint directory {root} being read (a tag "
            f"folder or a pointer file such as 'latest'). Write it outside the checkpoint, e.g. {tmp_path / out.name}\n"
        ), out
        assert hashes(tmp_path) == before, out
    assert main(["consolidate", str(ck), str(ck / "ema_latest"), "--tag", "t"]) == 2  # the folder given: refused whole
    assert capsys.readouterr().err == (
        f"error: OUT: refusing to write {ck / 'ema_latest'}: it is inside the checkpoint {ck} (CHECKPOINT_DIR) being "
        f"read, and would add to or replace its files. Write it outside, e.g. {tmp_path / 'ema_latest'}\n"
    )
    assert hashes(tmp_path) == before


def test_cli_a_linked_tag_folder_is_held_to_the_root_the_reader_takes(tmp_path, monkeypatch, capsys):
    """Review: a symlinked tag folder (``ln -s ck/t taglink``) was checked against its target's parent (``ck``),
    while the reader and ``to_hf`` take the parent of the path as typed (the current folder): ``consolidate taglink
    latest`` passed the check, then failed exit 1 after reading; ``export taglink hf`` likewise. Both are now exit 2
    before anything is read, naming the root the reader takes, nothing written; the target's root is refused too."""
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    work = tmp_path / "w"
    work.mkdir()
    ck, _ = _cli_checkpoint(work)
    (work / "taglink").symlink_to(ck / "t", target_is_directory=True)
    monkeypatch.chdir(work)
    before = hashes(tmp_path)
    capsys.readouterr()
    for out, root in (("latest", work), ("ck/ema_latest", ck)):
        assert main(["consolidate", "taglink", out]) == 2, out
        assert capsys.readouterr().err == (
            f"error: OUT: refusing to write {out}: it is inside the checkpoint directory {root} being read (a tag "
            f"folder or a pointer file such as 'latest'). Write it outside the checkpoint, e.g. "
            f"{root.parent / Path(out).name}\n"
        ), out
        assert hashes(tmp_path) == before, out
    assert main(["export", "taglink", "hf", "--like", "nolike"]) == 2  # refused before --like is read
    assert capsys.readouterr().err == (
        f"error: out_dir: refusing to write hf (-> {work / 'hf'}): it is inside {work}, which this export reads. "
        f"Write it elsewhere, e.g. {tmp_path / 'hf'}\n"
    )
    assert hashes(tmp_path) == before


def test_cli_out_refusals_suggest_a_file_outside_not_a_folder_or_the_same_path(tmp_path, monkeypatch, capsys):
    """Review: the "e.g." of a refused OUT was the same name beside the checkpoint, so ``consolidate . .`` (in the
    checkpoint) suggested the folder above it and ``consolidate ck/t ck/t/..`` a path ending in ``..``. OUT given
    as ``.``, ``..`` or a folder now gets the checkpoint's own name with ``.safetensors`` beside it; exit 2, nothing
    written."""
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, _ = _cli_checkpoint(tmp_path)
    before = hashes(tmp_path)
    capsys.readouterr()
    monkeypatch.chdir(ck)
    assert main(["consolidate", ".", "."]) == 2
    assert capsys.readouterr().err == (
        "error: OUT: refusing to write .: it is inside the checkpoint . (CHECKPOINT_DIR) being read, and would add to "
        f"or replace its files. Write it outside, e.g. {tmp_path / 'ck.safetensors'}\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["consolidate", "ck/t", "ck/t/.."]) == 2
    assert capsys.readouterr().err == (
        f"error: OUT: refusing to write ck/t/.. (-> {ck}): it is inside the checkpoint directory {ck} being read (a tag "
        f"folder or a pointer file such as 'latest'). Write it outside the checkpoint, e.g. {tmp_path / 'ck.safetensors'}\n"
    )
    assert hashes(tmp_path) == before


def test_cli_a_tilde_path_that_exists_literally_gets_no_tilde_hint(tmp_path, monkeypatch, capsys):
    """Review: with a file ``~nosuchuser`` in the current folder (so the argument is taken literally),
    ``consolidate ck '~nosuchuser/o.safetensors'`` was refused with the hint "'~' is not expanded here ... e.g.
    ~nosuchuser/o.safetensors", the very path. The hint is now left out where the path's first part exists as
    typed: exit 2, one line, nothing written."""
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    _cli_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    user = "~nosuchuser-functional-ema"
    (tmp_path / user).write_text("a file, not a folder")
    before = hashes(tmp_path)
    capsys.readouterr()
    assert main(["consolidate", "ck", f"{user}/o.safetensors"]) == 2
    assert capsys.readouterr().err == (
        f"error: OUT: the folder {user} of {user}/o.safetensors does not exist (or is not a folder): create it first, "
        "or choose another path\n"
    )
    assert hashes(tmp_path) == before


def test_cli_a_tilde_of_no_user_is_said_to_name_no_user(tmp_path, monkeypatch, capsys):
    """Review: ``~nosuchuser/x`` stays as it is after ``expanduser``, and the refusal then hinted "'~' is not expanded
    here: write the path out, e.g. ~nosuchuser/x", the same path. The command line now says there is no such user
    (exit 2, nothing written), for OUT and the checkpoint alike; a file or folder of that very name in the current
    folder is used, as a shell leaves the word; the API keeps its hint (nothing there expands ``~``)."""
    import pytest
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.__main__ import main
    from functional_ema._checkpoint.errors import OutputPathError

    ck, expected = _cli_checkpoint(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    user = "nosuchuser-functional-ema"
    for argv, arg in (
        (["consolidate", str(ck), f"~{user}/x.safetensors"], "out"),
        (["consolidate", f"~{user}/ck", "x.safetensors"], "checkpoint_dir"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        path = next(a for a in argv if a.startswith("~"))
        assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
            f"error: argument {arg}: {path!r}: there is no user {user!r} (a leading ~{user} is that user's home); "
            "write the path out"
        ), argv
    assert list(work.iterdir()) == []
    with pytest.raises(OutputPathError, match=r"'~' is not expanded here: write the path out"):
        fe.consolidate_to_file(ck, f"~{user}/x.safetensors")
    (work / f"~{user}").mkdir()
    assert main(["consolidate", str(ck), f"~{user}/x.safetensors"]) == 0
    got = load_file(work / f"~{user}" / "x.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def test_cli_out_inside_a_linked_tag_folder_of_the_root_is_exit_2(tmp_path, capsys):
    """Review: with a tag folder of the checkpoint given that is a link to another checkpoint's (``ck2/t ->
    ck/t``), ``consolidate ck2 ck2/t/x.safetensors`` passed the check of an OUT inside the checkpoint (it compared
    resolved paths only), read the checkpoint, then failed exit 1 with the library's message. An OUT inside a tag
    folder of the root as typed is now refused with the other usage errors, before anything is read: exit 2, one line
    naming OUT, nothing written; the same for a linked tag folder beside a tag folder given. A linked folder that is no
    tag (``ck2/exports``, another disk) stays open, and the file is bitwise the plain-torch EMA."""
    from safetensors.torch import load_file

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, expected = _cli_checkpoint(tmp_path)
    ck2, elsewhere = tmp_path / "ck2", tmp_path / "elsewhere"
    ck2.mkdir()
    elsewhere.mkdir()
    (ck2 / "t").symlink_to(ck / "t", target_is_directory=True)
    (ck2 / "ema_latest").write_text("t\n")
    (tmp_path / "o").mkdir()
    other, _ = _cli_checkpoint(tmp_path / "o")  # another checkpoint, its tag folder linked as one of ck's
    (ck / "u").symlink_to(other / "t", target_is_directory=True)  # beside the tag folder given ck/t: in its root
    (ck2 / "exports").symlink_to(elsewhere, target_is_directory=True)
    before = hashes(tmp_path)
    capsys.readouterr()
    for argv, out, folder, target, root in (
        (["consolidate", str(ck2)], ck2 / "t" / "x.safetensors", ck2 / "t", ck / "t", ck2),
        (["consolidate", str(ck2), "--overwrite"], ck2 / "t" / "sub" / "x.safetensors", ck2 / "t", ck / "t", ck2),
        (["consolidate", str(ck / "t")], ck / "u" / "x.safetensors", ck / "u", other / "t", ck),
    ):
        (ck / "t" / "sub").mkdir(exist_ok=True)
        assert main([argv[0], argv[1], str(out), *argv[2:]]) == 2, out
        assert capsys.readouterr().err == (
            f"error: OUT: refusing to write {out}: it is inside the tag folder {folder} (a link to {target}) of the "
            f"checkpoint {root} being read, and would add to or replace that checkpoint's files. Write it outside the "
            f"checkpoint, e.g. {root.parent / 'x.safetensors'}\n"
        ), out
        (ck / "t" / "sub").rmdir()
        assert hashes(tmp_path) == before, out
    assert main(["consolidate", str(ck2), str(ck2 / "exports" / "o.safetensors")]) == 0
    got = load_file(elsewhere / "o.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def test_cli_a_malformed_tp_dim_is_a_usage_error_exit_2(tmp_path, capsys):
    """Review: a malformed ``--tp-dim`` (``x``, ``x=-1``) exited 1 (``SystemExit`` of a string), where every other
    malformed option is a usage error, exit 2; ``x=²`` (a digit to ``str.isdigit``, not to ``int``) was a traceback.
    Each is now one ``error:`` line naming the flag and the value, exit 2, nothing written."""
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, _ = _cli_checkpoint(tmp_path)
    before = hashes(tmp_path)
    capsys.readouterr()
    for value in ("x", "x=-1", "=0", "w=", "w=1.5", "w=\u00b2"):
        assert (
            main(["consolidate", str(ck), str(tmp_path / "o.safetensors"), "--tp-dim", "0.weight=0", "--tp-dim", value])
            == 2
        )
        assert capsys.readouterr().err == (
            f"error: --tp-dim takes NAME=DIM (DIM an int >= 0 or 'none'), got {value!r}\n"
        ), value
        assert hashes(tmp_path) == before, value


def test_cli_an_existing_out_is_a_usage_error_exit_2_before_anything_is_read(tmp_path, monkeypatch, capsys):
    """Review: an existing OUT without ``--overwrite`` was exit 1 for ``consolidate``, ``consolidate --dcp`` and
    ``posthoc`` (refused by the library once the source was read), while posthoc's ``--plot`` was exit 2, and
    posthoc.md says both follow one rule: a usage error. OUT a folder was exit 1 too, with ``--overwrite`` as well.
    Each is now exit 2 before the source is read (the source ``none`` does not exist; ``consolidate`` without
    ``--dcp``: its manifest read, which says whether OUT or one file per tensor-parallel rank is written), one line
    naming OUT and the fix, nothing changed; the files named per tensor-parallel rank are refused so too, before
    either is written. With
    ``--overwrite`` an existing file is replaced: bitwise the plain-torch EMA."""
    from safetensors.torch import load_file

    from functional_ema import checkpoint
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, expected = _cli_checkpoint(tmp_path)
    mine, folder, none = tmp_path / "mine.safetensors", tmp_path / "folder", str(tmp_path / "none")
    mine.write_text("mine")
    folder.mkdir()
    before = hashes(tmp_path)
    capsys.readouterr()
    exists = "error: OUT: refusing to replace the existing file {}: pass --overwrite to replace it (atomically), or choose another name\n"
    is_folder = "error: OUT: refusing to write {}: it is a folder; name the .safetensors file to write\n"
    for verb, extra in (
        (["consolidate", str(ck)], []),
        (["consolidate", none], ["--tp-dim", "0.weight=0"]),
        (["consolidate", "--dcp", none], []),
        (["posthoc", none], ["--sigma-rel", "0.1"]),
    ):
        for out, flags, want in ((mine, [], exists), (folder, [], is_folder), (folder, ["--overwrite"], is_folder)):
            argv = [*verb, str(out), *extra, *flags]
            assert main(argv) == 2, argv
            assert capsys.readouterr().err == want.format(out), argv
            assert hashes(tmp_path) == before, argv
    # a tag saved by two tensor-parallel ranks with no recorded split: one file per rank, named from the manifest
    two = checkpoint.SavedParts(**{**checkpoint.saved_parts(ck)._asdict(), "tp_size": 2, "tp_split_known": False})
    monkeypatch.setattr(checkpoint, "saved_parts", lambda *a, **k: two)
    tp1 = tmp_path / "o.tp1of2.safetensors"
    tp1.write_text("mine")
    assert main(["consolidate", str(ck), str(tmp_path / "o.safetensors")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == exists.format(tp1).rstrip("\n")
    assert not (tmp_path / "o.tp0of2.safetensors").exists() and tp1.read_text() == "mine"
    monkeypatch.undo()
    assert main(["consolidate", str(ck), str(mine), "--overwrite"]) == 0
    got = load_file(mine)
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


# A child running the command line with every file write held in flight: StreamingWriter.write (every verb's) writes,
# then says so and waits, so that the temporary file is there when SIGTERM comes. SIGTERM's default action is reset
# first: a job may inherit it ignored, and the command then leaves it so.
_TERM_SCRIPT = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    "from functional_ema import _io, __main__ as m\n"
    "write, started = _io.StreamingWriter.write, pathlib.Path(sys.argv.pop(1))\n"
    "def held(self, key, tensor):\n"
    "    crcs = write(self, key, tensor)\n"
    "    if not started.exists():\n"
    "        started.touch()\n"
    "        time.sleep(120)\n"
    "    return crcs\n"
    "_io.StreamingWriter.write = held\n"
    "m.cli()\n"
)


def sigterm_leaves_no_temporary_file(tmp_path: Path, runs: list[tuple[str, list[str], Path]]) -> None:
    """Each ``(verb, argv, out)`` run in a child (all at once) and sent SIGTERM while its output is in flight (its
    temporary file beside ``out``): it says in one line that ``out`` is not written, then is killed by SIGTERM (a
    parent sees -15, a shell 143), and the folder of
    ``out`` holds what it held before (``test_export.py`` uses it too)."""
    import signal
    import subprocess

    from functional_ema._testing.multirank import ROOT

    children = []
    for i, (verb, argv, out) in enumerate(runs):
        started, listed = tmp_path / f"started{i}", sorted(p.name for p in out.parent.iterdir())
        child = subprocess.Popen(
            [sys.executable, "-c", _TERM_SCRIPT, str(started), *argv],
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append((verb, out, started, listed, child))
    try:
        for verb, out, started, listed, child in children:
            deadline = time.monotonic() + 120
            while not started.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            in_flight = [p.name for p in out.parent.iterdir() if p.name not in listed]
            assert in_flight and all(".tmp-" in n for n in in_flight), (verb, in_flight, child.poll())
            child.send_signal(signal.SIGTERM)
            _, err = child.communicate(timeout=60)
            assert child.returncode == -signal.SIGTERM, (verb, child.returncode, err[-4000:])
            assert err == f"error: {verb} terminated (SIGTERM): {out} is not written (no partial file left)\n", err
            assert sorted(p.name for p in out.parent.iterdir()) == listed, verb
    finally:
        for *_, child in children:
            if child.poll() is None:
                child.kill()


def test_sigterm_removes_the_temporary_file_as_ctrl_c_does(tmp_path):
    """Review: SIGTERM (what ``timeout``, Slurm and Kubernetes send) ended a command at once and left
    ``OUT.tmp-<pid>-<token>`` beside OUT, up to the full output's size, which no later run removed; Ctrl-C was
    cleaned up. SIGTERM now takes Ctrl-C's path: the temporary file is removed, one line says OUT is not written,
    then killed by SIGTERM (status 143 in a shell), for ``consolidate``, ``consolidate --dcp`` and ``posthoc`` (``export``: test_export.py)."""
    import pytest

    ck, _ = _cli_checkpoint(tmp_path)
    dcp = tmp_path / "dcp"
    _dcp_checkpoint(dcp)
    _cli_snapshots(tmp_path / "snaps")
    outs = [tmp_path / name / "o.safetensors" for name in ("c", "d", "p")]
    for out in outs:
        out.parent.mkdir()
    (outs[0].parent / "kept.txt").write_text("mine")  # the folder's other files stay
    if not hasattr(__import__("signal"), "SIGTERM"):
        pytest.skip("no SIGTERM on this platform")
    sigterm_leaves_no_temporary_file(
        tmp_path,
        [
            ("consolidate", ["consolidate", str(ck), str(outs[0])], outs[0]),
            ("consolidate", ["consolidate", "--dcp", str(dcp), str(outs[1])], outs[1]),
            ("posthoc", ["posthoc", str(tmp_path / "snaps"), str(outs[2]), "--sigma-rel", "0.1"], outs[2]),
        ],
    )


# A child calling main() as another program would, SIGTERM raised at a point named by argv[1]: "run" while the verb
# runs (a second one during the cleanup, ignored), "install" right after the handler is installed, "except" while an
# except branch formats its message. Then the caller's own code, which must not run: the process ends by SIGTERM.
_TERM_CALLER = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    "from functional_ema import checkpoint, __main__ as m\n"
    "where = sys.argv.pop(1)\n"
    "class Late(checkpoint.CheckpointError):\n"
    "    def __str__(self):\n"
    "        signal.raise_signal(signal.SIGTERM)\n"
    "        return 'late'\n"
    "def writer(*args, **kwargs):\n"
    "    if where == 'except':\n"
    "        raise Late()\n"
    "    try:\n"
    "        signal.raise_signal(signal.SIGTERM)\n"
    "    finally:\n"
    "        signal.raise_signal(signal.SIGTERM)\n"
    "        print('cleaned up', flush=True)\n"
    "checkpoint.consolidate_to_file = writer\n"
    "install = m._OnSigterm.install\n"
    "def install_then_term(self):\n"
    "    install(self)\n"
    "    signal.raise_signal(signal.SIGTERM)\n"
    "if where == 'install':\n"
    "    m._OnSigterm.install = install_then_term\n"
    "rc = m.main(sys.argv[1:])\n"
    "print('caller goes on with', rc, signal.getsignal(signal.SIGTERM), flush=True)\n"
)


def test_sigterm_ends_a_calling_program_too_from_any_point_of_main(tmp_path):
    """Review: ``main()`` called as a function by another program returned 143 on SIGTERM and the program went on
    (before the handler, SIGTERM ended it); a SIGTERM right after the handler was installed, or while an except branch
    printed, escaped main and left the handler installed with later SIGTERMs ignored. Now in each case main does its
    cleanup (its line where it reaches it), restores SIGTERM's default action and sends it again: the process is killed
    by SIGTERM (the parent sees -15) and the caller's next line never runs; nothing is written."""
    import signal
    import subprocess

    from functional_ema._testing.multirank import ROOT

    ck, _ = _cli_checkpoint(tmp_path)
    out = tmp_path / "o.safetensors"
    line = f"error: consolidate terminated (SIGTERM): {out} is not written (no partial file left)\n"
    early = "error: consolidate terminated (SIGTERM): the output it was writing is not in place (its temporary file was removed)\n"
    for where, stdout, stderr in (("run", "cleaned up\n", line), ("install", "", early), ("except", "", "")):
        child = subprocess.run(
            [sys.executable, "-c", _TERM_CALLER, where, "consolidate", str(ck), str(out)],
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == -signal.SIGTERM, (where, child.returncode, child.stdout, child.stderr[-4000:])
        assert (child.stdout, child.stderr) == (stdout, stderr), where
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"], where


def test_main_leaves_sigterm_as_it_found_it_on_every_return_or_raise(tmp_path, monkeypatch, capsys):
    """``main`` handles SIGTERM only while it runs and only where SIGTERM has its default action: after it returns
    (0, a usage error 2, an error 1) or raises (an unexpected exception), ``signal.getsignal(SIGTERM)`` is what it was
    before, its default action, a caller's own handler, or SIGTERM ignored; the latter two stay in place during the
    call (checked from inside the verb)."""
    import signal

    import pytest

    from functional_ema import checkpoint
    from functional_ema.__main__ import main

    ck, _ = _cli_checkpoint(tmp_path)
    seen: list[Any] = []

    def custom(signum: int, frame: Any) -> None:
        pass

    def verb(*args: Any, **kwargs: Any) -> Path:
        seen.append(signal.getsignal(signal.SIGTERM))
        if kwargs.get("index") == 3:
            raise checkpoint.CheckpointError("an error")
        if kwargs.get("index") == 4:
            raise RuntimeError("unexpected")
        return real(*args, **{**kwargs, "overwrite": True})

    real = checkpoint.consolidate_to_file
    monkeypatch.setattr(checkpoint, "consolidate_to_file", verb)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    out = str(tmp_path / "o.safetensors")
    try:
        for disposition in (signal.SIG_DFL, custom, signal.SIG_IGN):
            signal.signal(signal.SIGTERM, disposition)
            seen.clear()
            assert main(["consolidate", str(ck), out, "--overwrite"]) == 0
            assert main(["consolidate", str(ck), out, "--index", "-1"]) == 2
            assert main(["consolidate", str(ck), out, "--index", "3", "--overwrite"]) == 1
            with pytest.raises(RuntimeError, match="unexpected"):
                main(["consolidate", str(ck), out, "--index", "4", "--overwrite"])
            assert signal.getsignal(signal.SIGTERM) is disposition, disposition
            assert len(seen) == 3, seen
            if disposition is signal.SIG_DFL:  # main's own handler while it runs
                assert all(callable(s) and s is not custom for s in seen), seen
            else:
                assert seen == [disposition] * 3, seen
    finally:
        signal.signal(signal.SIGTERM, previous)
    capsys.readouterr()


def test_cli_a_tag_folder_given_as_the_root_is_said_to_be_one(tmp_path, capsys):
    """Review: ``consolidate ck/t OUT --tag t`` said "no tag 't' in ck/t. Tags here with a complete EMA: []", and a
    tag folder whose manifest is missing (a save in progress or interrupted), given directly, was said to lack
    'latest' files. The first now says the folder given is itself the tag folder of that tag (drop --tag, or give its
    root), or another tag's (give the root); the second that it holds EMA rank files but no manifest, as the refusal
    through its root says. Exit 1 (the checkpoint read), one line, nothing written; the tag folder without --tag, or
    its root with it, is bitwise the plain-torch EMA."""
    import shutil

    from safetensors.torch import load_file

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, expected = _cli_checkpoint(tmp_path)
    tag, part = ck / "t", tmp_path / "part" / "t2"
    shutil.copytree(tag, part)
    (part / "ema_manifest.json").unlink()
    ranks = sorted(p.name for p in part.iterdir() if p.name.startswith("ema_rank_"))
    before = hashes(tmp_path)
    capsys.readouterr()
    out = str(tmp_path / "o.safetensors")
    for argv, want in (
        (
            [str(tag), out, "--tag", "t"],
            f"no tag 't' in {tag}: the folder given is itself the tag folder of that tag, not a checkpoint directory "
            f"holding tag folders; drop tag=... (--tag) to read it, or give its root {ck} with --tag t (tag='t')",
        ),
        (
            [str(tag), out, "--tag", "t9"],
            f"no tag 't9' in {tag}: the folder given is itself a tag folder (of tag 't'), not a checkpoint directory "
            f"holding tag folders; give the checkpoint's root {ck} with --tag t9 (tag='t9')",
        ),
        (
            [str(part), out],
            f"{part} is a tag folder with no complete EMA checkpoint: found {len(ranks)} EMA rank file(s) {ranks} but "
            f"the manifest, written last, is missing (the save of tag 't2' is in progress or was interrupted). Load "
            f"another tag; tags beside it in {part.parent} with a complete EMA: []",
        ),
    ):
        assert main(["consolidate", *argv]) == 1, argv
        assert capsys.readouterr().err == f"error: {want}\n", argv
        assert hashes(tmp_path) == before, argv
    for argv in ([str(tag), out], [str(ck), out, "--tag", "t", "--overwrite"]):
        assert main(["consolidate", *argv]) == 0, argv
        got = load_file(out)
        assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def test_cli_an_existing_out_does_not_block_the_one_file_per_rank_split(tmp_path, monkeypatch, capsys):
    """Review: with the existing-OUT refusal, a tag saved tensor-parallel with no recorded split (one file per rank,
    ``OUT.tp<r>of<n>.safetensors``, OUT itself never written) was refused exit 2 when OUT existed, e.g. a file joined
    by an earlier ``--tp-dim`` run. OUT is now checked only where it is the file written: the split runs, exit 0, OUT is
    unchanged and each rank's file is bitwise the plain-torch EMA (the tag is TP=1 here, each rank read whole)."""
    from safetensors.torch import load_file

    from functional_ema import checkpoint
    from functional_ema.__main__ import main

    ck, expected = _cli_checkpoint(tmp_path)
    out = tmp_path / "ema.safetensors"
    out.write_text("joined earlier")
    real = checkpoint.consolidate_to_file
    two = checkpoint.SavedParts(**{**checkpoint.saved_parts(ck)._asdict(), "tp_size": 2, "tp_split_known": False})
    monkeypatch.setattr(checkpoint, "saved_parts", lambda *a, **k: two)
    monkeypatch.setattr(checkpoint, "consolidate_to_file", lambda *a, **k: real(*a, **{**k, "tp_rank": None}))
    assert main(["consolidate", str(ck), str(out)]) == 0, capsys.readouterr().err
    assert out.read_text() == "joined earlier"
    for t in (0, 1):
        got = load_file(tmp_path / f"ema.tp{t}of2.safetensors")
        assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected), t
    # the split's own names still refused when they exist, none written; OUT itself refused with --tp-dim
    (tmp_path / "ema.tp0of2.safetensors").unlink()
    assert main(["consolidate", str(ck), str(out)]) == 2
    assert capsys.readouterr().err.endswith(
        f"refusing to replace the existing file {tmp_path / 'ema.tp1of2.safetensors'}: "
        "pass --overwrite to replace it (atomically), or choose another name\n"
    )
    assert not (tmp_path / "ema.tp0of2.safetensors").exists()
    assert main(["consolidate", str(ck), str(out), "--tp-dim", "0.weight=0"]) == 2
    assert f"refusing to replace the existing file {out}:" in capsys.readouterr().err


def test_cli_out_inside_a_linked_tag_folder_is_refused_however_it_is_spelled(tmp_path, capsys):
    """Review: the refusal of an OUT inside a tag folder of the root that is a link (``ck/u -> other/t``) compared the
    paths as typed, so ``consolidate ck cklink/u/x.safetensors`` (``cklink -> ck``), or OUT named by the link's target
    itself, was exit 0 and wrote into the other checkpoint's tag folder, which the reader reads as tag ``u``. Now exit
    2 for every spelling, one line naming OUT and the linked tag folder, nothing written; an OUT beside it is bitwise
    the plain-torch EMA."""
    from safetensors.torch import load_file

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ck, expected = _cli_checkpoint(tmp_path)
    (tmp_path / "o").mkdir()
    other, _ = _cli_checkpoint(tmp_path / "o")
    (ck / "u").symlink_to(other / "t", target_is_directory=True)
    (tmp_path / "cklink").symlink_to(ck, target_is_directory=True)
    before = hashes(tmp_path)
    capsys.readouterr()
    for out in (
        tmp_path / "cklink" / "u" / "x.safetensors",
        other / "t" / "x.safetensors",
        tmp_path / "o" / "ck" / "." / "t" / "sub" / ".." / "x.safetensors",
    ):
        (other / "t" / "sub").mkdir()
        assert main(["consolidate", str(ck), str(out)]) == 2, out
        assert capsys.readouterr().err == (
            f"error: OUT: refusing to write {out}: it is inside the tag folder {ck / 'u'} (a link to {other / 't'}) of "
            f"the checkpoint {ck} being read, and would add to or replace that checkpoint's files. Write it outside "
            f"the checkpoint, e.g. {tmp_path / 'x.safetensors'}\n"
        ), out
        (other / "t" / "sub").rmdir()
        assert hashes(tmp_path) == before, out
    assert main(["consolidate", str(ck), str(tmp_path / "cklink" / ".." / "x.safetensors")]) == 0
    got = load_file(tmp_path / "x.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)
