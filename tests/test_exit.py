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
