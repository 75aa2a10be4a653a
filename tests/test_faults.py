"""Fault injection: misuse is refused, hostile files stay confined, failures are the same on every rank.

Issue 13, classes 3-6 and 8-11. One 2-rank launch (real DeepSpeed ZeRO-2 engines on gloo) writes the
checkpoints and snapshots and runs every check that needs ranks (failed saves on a full tmpfs and a
read-only bind mount, injected EACCES and manifest write errors, bad tags, leftovers, a save and a load
called on one rank only); the offline checks then work on copies of what it wrote. Every check asserts
the error type, that the message names the thing (file, field, rank, errno) and that no file changed
(hashes before and after). ``CASES`` counts the cases per class (docs/reliability.md).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import functional_ema as fe
from functional_ema import _io, posthoc
from functional_ema import checkpoint as ck
from functional_ema._testing.files import hashes as _hashes

STEPS = 6
TAG = f"global_step{STEPS}"
TRACKED = (0.05, 0.10)
CASES: dict[str, int] = {}


def _count(cls: str, n: int = 1) -> None:
    CASES[cls] = CASES.get(cls, 0) + n


# --------------------------------------------------------------------------------- 2-rank worker


def _err(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the checks look at type and message
        return [type(e).__name__, str(e), getattr(e, "errno", None), isinstance(e, ck.CheckpointError)]
    return None


def _tensors_equal(a: fe.EmaState, b: fe.EmaState) -> bool:
    return all(torch.equal(x[n], y[n]) for x, y in zip(a.emas, b.emas) for n in x) and int(a.step) == int(b.step)


def _fill(directory: Path, leave: int) -> None:
    """Fill the filesystem of ``directory`` until a write fails, then give back ``leave`` bytes."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # unbuffered: nothing left to flush at close
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    if leave:
        with open(filler, "r+b") as f:
            f.truncate(max(0, filler.stat().st_size - leave))


def _wait_for(path: Path, limit: float = 120.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert time.monotonic() - t0 < limit, f"{path} never appeared"
        time.sleep(0.05)


def faults_worker(root: str, full_dir: str, ro_src: str, ro_dir: str, marks: str):
    import torch.distributed as dist

    from functional_ema import _io, schedules
    from functional_ema._testing.multirank import make_engine, train_step

    rank = dist.get_rank()
    root, full_dir, ro_src, ro_dir, marks = map(Path, (root, full_dir, ro_src, ro_dir, marks))
    out: dict = {}
    engine = make_engine(2)
    scheds = [schedules.power(sigma_rel=s) for s in TRACKED]
    state = fe.init_ema(fe.local_shards(engine), num_emas=2)
    ckdir, snaps = root / "ck", root / "snaps"
    for step in range(1, STEPS + 1):
        train_step(engine, step)
        state = fe.update(state, fe.local_shards(engine), step, decay=scheds)
        if step % 2 == 0:
            posthoc.save_snapshot(state, engine, snaps, scheds)
    fe.save(state, engine, ckdir, decay=scheds)
    engine.save_checkpoint(str(ckdir))
    dist.barrier()

    def later(s: fe.EmaState) -> fe.EmaState:  # another state to save (the EMA one step later); s unchanged
        copy = fe.EmaState(s.step.clone(), tuple({n: t.clone() for n, t in e.items()} for e in s.emas))
        return fe.update(copy, fe.local_shards(engine), int(s.step) + 1, decay=[0.5, 0.5])

    # -- class 9: tags that are refused, on every rank, before anything is written
    before = _hashes(root)
    bad_tags = [
        "latest",
        "LATEST",
        "latest_universal",
        "zero_to_fp32.py",
        "zero_to_torch.py",
        ck.MANIFEST_NAME,
        "ema_rank_00000_of_00002.safetensors",
        "x.tmp-123",
        "a b",
        " lead",
        "trail ",
        "tab\tx",
        "nl\nx",
        "nul\0x",
        "bell\x07",
        "zero\u200bwidth",
        "nbsp\u00a0x",
        "../escape",
        "a/b",
        "/abs",
        "back\\slash",
        "..",
        ".",
        "",
        "x" * 256,
        3.5,
        "x/",
    ]
    out["bad_tags"] = [repr(t) for t in bad_tags]
    out["tag_errors"] = [_err(lambda t=t: fe.save(state, engine, ckdir, tag=t)) for t in bad_tags]
    dist.barrier()
    out["tags_changed_nothing"] = _hashes(root) == before

    # -- ranks passing different schedules: refused on every rank (the manifest records one)
    other = [schedules.power(sigma_rel=s) for s in ((0.05, 0.10) if rank == 0 else (0.05, 0.11))]
    out["schedules_disagree"] = _err(lambda: fe.save(state, engine, root / "disagree", decay=other))

    # -- class 8: a full disk (1 MiB tmpfs), with a complete checkpoint of the same tag already there
    fe.save(state, engine, full_dir, tag="t", decay=scheds)
    dist.barrier()
    size = max(p.stat().st_size for p in (full_dir / "t").glob("ema_rank_*"))
    if rank == 0:
        _fill(full_dir, leave=size + 4096)  # room for about one rank file: one rank (or the manifest) fails
    dist.barrier()
    before = _hashes(full_dir / "t")
    s2 = later(state)
    out["enospc"] = _err(lambda: fe.save(s2, engine, full_dir, tag="t", decay=scheds))
    dist.barrier()
    out["enospc_unchanged"] = _hashes(full_dir / "t") == before
    out["enospc_files"] = sorted(p.name for p in (full_dir / "t").iterdir())
    out["enospc_previous_loads"] = _tensors_equal(fe.load(engine, full_dir, "t"), state)
    if rank == 0:
        _fill(full_dir, leave=0)  # now nothing fits: every writing rank fails
    dist.barrier()
    out["enospc_all"] = _err(lambda: fe.save(s2, engine, full_dir, tag="t2", decay=scheds))
    dist.barrier()
    out["enospc_all_leftovers"] = (
        sorted(p.name for p in (full_dir / "t2").iterdir()) if (full_dir / "t2").exists() else []
    )
    if rank == 0:
        (full_dir / "filler").unlink()
    dist.barrier()
    fe.save(s2, engine, full_dir, tag="t", decay=scheds)  # space again: the same tags save and load
    fe.save(s2, engine, full_dir, tag="t2", decay=scheds)
    out["enospc_then_saves"] = [_tensors_equal(fe.load(engine, full_dir, t), s2) for t in ("t", "t2")]
    dist.barrier()
    out["enospc_final_files"] = sorted(p.name for p in (full_dir / "t").iterdir())

    # -- class 8: a read-only folder (a read-only bind mount of a folder holding a checkpoint)
    fe.save(state, engine, ro_src, tag="r")
    dist.barrier()
    before = _hashes(ro_src)
    out["erofs_existing_tag"] = _err(lambda: fe.save(s2, engine, ro_dir, tag="r"))
    out["erofs_new_tag"] = _err(lambda: fe.save(s2, engine, ro_dir, tag="r2"))
    dist.barrier()
    out["erofs_unchanged"] = _hashes(ro_src) == before
    out["erofs_still_loads"] = _tensors_equal(fe.load(engine, ro_dir, "r"), state)

    # -- class 8: EACCES on rank 1 only (root ignores permission bits, so the error is injected)
    real_writer = _io.StreamingWriter
    if rank == 1:

        def refuse(path, *a, **k):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

        _io.StreamingWriter = refuse
    before = _hashes(ckdir)
    try:
        out["eacces"] = _err(lambda: fe.save(s2, engine, ckdir, decay=scheds))
    finally:
        _io.StreamingWriter = real_writer
    dist.barrier()
    out["eacces_unchanged"] = _hashes(ckdir) == before

    # -- class 8: the manifest write fails (injected ENOSPC at the last write point, rank 0)
    real_write = _io.atomic_write_bytes
    if rank == 0:

        def no_space(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        _io.atomic_write_bytes = no_space
    try:
        out["manifest_enospc"] = _err(lambda: fe.save(s2, engine, ckdir, decay=scheds))
    finally:
        _io.atomic_write_bytes = real_write
    dist.barrier()
    out["manifest_enospc_unchanged"] = _hashes(ckdir) == before
    out["manifest_enospc_previous_loads"] = _tensors_equal(fe.load(engine, ckdir), state)

    # -- class 8: leftovers of crashed saves (temporary manifest, orphan rank files) never block a save
    lt = root / "left" / "t"
    if rank == 0:
        lt.mkdir(parents=True)
        for name in (
            "ema_manifest.json.tmp-99999",
            "ema_rank_00001_of_00002.safetensors.tmp-4242",
            "ema_rank_00000_of_00004.safetensors",
            "ema_rank_00001_of_00002.gen9.safetensors",
            "ema_rank_00000_of_00002.safetensors",
        ):
            (lt / name).write_bytes(b"leftover of a crashed save")
    dist.barrier()
    out["leftover_save"] = _err(lambda: fe.save(state, engine, root / "left", tag="t"))
    dist.barrier()
    out["leftover_files"] = sorted(p.name for p in lt.iterdir())
    out["leftover_loads"] = _tensors_equal(fe.load(engine, root / "left", "t"), state)

    # -- a tampered manifest fails load on every rank (class 5 through the collective verb)
    tampered = root / "tampered"
    if rank == 0:
        shutil.copytree(ckdir, tampered)
        m = tampered / TAG / ck.MANIFEST_NAME
        d = json.loads(m.read_text())
        d["schedules"][1]["gamma"] /= 2
        m.write_text(json.dumps(d))
    dist.barrier()
    out["tampered_load"] = _err(lambda: fe.load(engine, tampered))
    dist.barrier()

    # -- class 13 (2 ranks): buffers saved with the EMA, each rank its own file, listed in the manifest
    from functional_ema._testing.multirank import MPU, BNSeq, pipeline_engine

    bn = make_engine(2, model=BNSeq(), seed=1)
    bstate = fe.init_ema(fe.local_shards(bn))
    bufs = fe.buffers.init_buffers(bn)
    for step in range(1, 4):
        train_step(bn, step)
        bstate = fe.update(bstate, fe.local_shards(bn), step, decay=0.5)
        bufs = fe.buffers.update_buffers(bufs, bn, step, decay=0.5)
    bdir = root / "bufs"
    fe.save(bstate, bn, bdir, tag="t", buffers=bufs, extra={"framework_step": 3})
    dist.barrier()

    def same_buffers(b):
        return (
            int(b.step) == int(bufs.step)
            and all(torch.equal(b.emas[0][n], t) for n, t in bufs.emas[0].items())
            and all(torch.equal(b.copied[n], t) for n, t in bufs.copied.items())
        )

    out["bufs_own"] = same_buffers(fe.buffers.load_buffers(bn, bdir, "t"))
    if rank == 0:  # a leftover of a world-1 save beside the world-2 files: never read
        shutil.copy(
            bdir / "t" / "buffers_rank_00001_of_00002.safetensors",
            bdir / "t" / "buffers_rank_00000_of_00001.safetensors",
        )
    dist.barrier()
    out["bufs_leftover_ignored"] = same_buffers(fe.buffers.load_buffers(bn, bdir, "t"))
    dist.barrier()
    if rank == 0:
        (bdir / "t" / "buffers_rank_00000_of_00001.safetensors").unlink()
        shutil.copytree(bdir, root / "bufs_gone")
        (root / "bufs_gone" / "t" / "buffers_rank_00001_of_00002.safetensors").unlink()
    dist.barrier()
    before = _hashes(root / "bufs_gone")
    out["bufs_gone"] = [
        _err(lambda: fe.buffers.load_buffers(bn, root / "bufs_gone", "t")),
        _err(lambda: fe.load(bn, root / "bufs_gone", "t")),
    ]
    dist.barrier()
    out["bufs_gone_unchanged"] = _hashes(root / "bufs_gone") == before
    # The buffer write fails (ENOSPC on rank 1, after its EMA file was written): the save fails on every rank,
    # the previous checkpoint of the tag is unchanged and loads, EMA and buffers at its step.
    later_b = fe.buffers.update_buffers(
        fe.buffers.BufferState(
            bufs.step.clone(), ({n: t.clone() for n, t in bufs.emas[0].items()},), dict(bufs.copied)
        ),
        bn,
        4,
        decay=0.5,
    )
    later_e = fe.update(
        fe.EmaState(bstate.step.clone(), ({n: t.clone() for n, t in bstate.emas[0].items()},)),
        fe.local_shards(bn),
        4,
        decay=0.5,
    )
    import functional_ema.checkpoint as ckmod

    real_bw = ckmod.write_buffer_file
    if rank == 1:

        def full_disk(path, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        ckmod.write_buffer_file = full_disk
    before = _hashes(bdir)
    try:
        out["bufs_enospc"] = _err(lambda: fe.save(later_e, bn, bdir, tag="t", buffers=later_b))
    finally:
        ckmod.write_buffer_file = real_bw
    dist.barrier()
    out["bufs_enospc_unchanged"] = _hashes(bdir) == before
    loaded = fe.checkpoint.load_checkpoint(bn, bdir, "t", buffers=True)
    out["bufs_enospc_previous"] = [int(loaded.state.step), int(loaded.buffers.step), same_buffers(loaded.buffers)]
    # The buffers' step must be the EMA's: refused on every rank before anything is written.
    out["bufs_step_mismatch"] = _err(lambda: fe.save(bstate, bn, bdir, tag="t2", buffers=later_b))
    out["bufs_step_mismatch_nothing"] = not (bdir / "t2").exists()
    dist.barrier()

    # -- class 16 (2 ranks): model-parallel DeepSpeed engines (an mpu= with tensor parallel 2, a PipelineEngine with
    # 2 stages) used to write the same file names from both model-parallel ranks: now each part has its own files
    mp_root = root / "mp"
    mpu_engine = make_engine(2, model=BNSeq(), seed=2, mpu=MPU(2))  # tensor-parallel 2 x data-parallel 1
    mstate = fe.init_ema(fe.local_shards(mpu_engine))
    fe.save(mstate, mpu_engine, mp_root / "mpu", tag="t")
    out["mpu_files"] = sorted(p.name for p in (mp_root / "mpu" / "t").iterdir() if p.name != ".ema_write.lock")
    out["mpu_load"] = _tensors_equal(fe.load(mpu_engine, mp_root / "mpu", "t"), mstate)
    pipe = pipeline_engine(2)
    pstate = fe.init_ema(fe.local_shards(pipe), num_emas=2, step=4)
    posthoc.save_snapshot(pstate, pipe, mp_root / "snaps", scheds)
    fe.AsyncSaver().save(pstate, pipe, mp_root / "pipe", tag="t").wait()
    dist.barrier()  # rank 0 gives the tag up after its background commit
    out["pipe_files"] = sorted(p.name for p in (mp_root / "pipe" / "t").iterdir() if p.name != ".ema_write.lock")
    out["pipe_load"] = _tensors_equal(fe.load(pipe, mp_root / "pipe", "t"), pstate)
    out["pipe_snapshot_load"] = _tensors_equal(fe.load(pipe, mp_root / "snaps"), pstate)
    dist.barrier()

    # -- class 10: a rank other than 0 alone in the barrier while rank 0 is alive elsewhere (waiting on a
    # file, its connections open) still stops at its own timeout. (torch's monitored_barrier bounded only
    # rank 0's wait: rank 1 waited for rank 0's reply up to the group's 30 min timeout, and the lone load
    # below ended early only when rank 0's own timeout had closed the connections first, a race that
    # load could lose.) On a side group, so that this timeout leaves the model's group usable.
    from functional_ema._checkpoint import collective

    side = dist.new_group([0, 1], backend="gloo")
    if rank == 1:
        t0 = time.monotonic()
        out["lonely_arrive"] = _err(lambda: collective.arrive("load", side, 2, 1, 3))
        out["lonely_arrive_s"] = time.monotonic() - t0
        (marks / "arrive_done").write_text("1")
    else:
        _wait_for(marks / "arrive_done", limit=60)

    # -- class 10 (last: a timed-out barrier leaves the process group unusable): a save called on rank
    # 0 only and a load called on rank 1 only fail after the timeout instead of hanging. The ranks
    # wait for each other through files, not collectives.
    if rank == 0:
        t0 = time.monotonic()
        out["lonely_save"] = _err(lambda: fe.save(state, engine, ckdir, tag="lonely", timeout=3))
        out["lonely_save_s"] = time.monotonic() - t0
        out["lonely_dir"] = (ckdir / "lonely").exists()
        (marks / "save_done").write_text("1")
        _wait_for(marks / "load_done")
    else:
        _wait_for(marks / "save_done")
        os.environ[ck.TIMEOUT_ENV] = "3"
        t0 = time.monotonic()
        out["lonely_load"] = _err(lambda: fe.load(engine, ckdir))
        out["lonely_load_s"] = time.monotonic() - t0
        (marks / "load_done").write_text("1")
    # -- class 16: a save after destroy_process_group is refused at once, on each rank, touching nothing
    # (it used to commit rank 0's file alone, removing rank 1's, and move ema_latest)
    _wait_for(marks / ("save_done" if rank else "load_done"))
    dist.destroy_process_group()
    before = _hashes(ckdir)
    out["destroyed_save"] = _err(lambda: fe.save(state, engine, ckdir, decay=scheds))
    out["destroyed_async"] = _err(lambda: fe.AsyncSaver().save(state, engine, ckdir, decay=scheds))
    out["destroyed_unchanged"] = _hashes(ckdir) == before
    return out


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """Runs the 2-rank worker once; yields (root, per-rank results)."""
    from functional_ema._testing.multirank import run_ranks

    base = tmp_path_factory.mktemp("faults")
    root, full, src, ro, marks = (base / n for n in ("root", "full", "ro_src", "ro", "marks"))
    for d in (root, full, src, ro, marks):
        d.mkdir()
    if not (_mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full))):
        pytest.fail("this test needs root to mount a 1 MiB tmpfs (the full-disk case); run it as root")
    mounted = [full]
    try:
        assert _mount("--bind", str(src), str(ro)), "bind mount failed"
        mounted.append(ro)
        assert _mount("-o", "remount,bind,ro", str(ro)), "read-only remount failed"
        results = run_ranks(
            "tests.test_faults:faults_worker",
            world_size=2,
            timeout=400,
            root=str(root),
            full_dir=str(full),
            ro_src=str(src),
            ro_dir=str(ro),
            marks=str(marks),
        )
    finally:
        for d in reversed(mounted):
            subprocess.run(["umount", str(d)], capture_output=True)
    yield root, results


# ------------------------------------------------------------------------------- 2-rank checks


def test_bad_tags_refused_on_every_rank(faults):
    """Class 9: reserved names (DeepSpeed's `latest`...), separators, whitespace, control characters."""
    _, results = faults
    for rank, r in enumerate(results):
        assert r["tags_changed_nothing"], rank
        for tag, e in zip(r["bad_tags"], r["tag_errors"]):
            assert e is not None, f"rank {rank}: tag {tag} was accepted"
            name, msg, _, is_ckpt = e
            assert name == "InvalidTagError" and is_ckpt, (rank, tag, e)
            assert "tag" in msg and ("global_step<N>" in msg or "str" in msg), (rank, tag, msg)
        disagree = r["schedules_disagree"]
        assert disagree[0] == "CheckpointMismatchError" and "ranks disagree on schedules" in disagree[1], disagree
    _count("9 tags", len(results[0]["bad_tags"]) + 1)


def test_integration_tags_named_like_the_frameworks_files_are_refused(tmp_path):
    """Class 9, the integrations: a tag naming a file or folder the framework writes beside the EMA folder of a
    checkpoint (the HF Trainer's checkpoint-N, Accelerate's save_state folder, a Lightning folder checkpoint) is
    refused when the callback is made, naming the tag, with nothing written; a plain folder name is taken as given, and
    an EMA saved under it loads back bitwise."""
    from accelerate import Accelerator

    from functional_ema._checkpoint.errors import InvalidTagError
    from functional_ema.integrations import EMAController
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.lightning import EMACallback as LightningEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    model = torch.nn.Linear(3, 2)
    accelerator = Accelerator(cpu=True)
    makers = {
        "transformers": lambda tag: HFEMA(decay=0.9, tag=tag),
        "accelerate": lambda tag: AcceleratorEMA(accelerator, model, decay=0.9, tag=tag).remove_hooks(),
        "lightning": lambda tag: LightningEMA(decay=0.9, tag=tag),
    }
    refused = {
        "transformers": ["model.safetensors", "trainer_state.json", "optimizer_0", "global_step8", "latest"],
        "accelerate": ["optimizer.bin", "random_states_0.pkl", "pytorch_model", "pytorch_model_fsdp_0"],
        "lightning": ["checkpoint", "meta.pt", "__0_0.distcp", "zero_to_fp32"],
    }
    before = sorted(os.listdir(tmp_path))
    for framework, tags in refused.items():
        for tag in tags:
            with pytest.raises(InvalidTagError, match=re.escape(repr(tag))):
                makers[framework](tag)
            _count("9 tags")
        for tag in ("ema.v2", "ema_0", "EMA-best"):
            makers[framework](tag)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written by a construction
    ctrl = EMAController(0.5, tag="ema.v2")
    ctrl.on_step(model, 1)
    ctrl.save(model, tmp_path / "ck", 1)
    back = EMAController(0.5, tag="ema.v2")
    back.load(model, tmp_path / "ck", framework_step=1)
    assert sorted(os.listdir(tmp_path / "ck")) == ["ema.v2", "ema_latest"]  # the tag folder and its pointer
    assert all(torch.equal(back.state.ema[n], t) for n, t in ctrl.state.ema.items())


def _assert_io_error(e, rank_names, errname: str, file_frag: str):
    assert e is not None, "the save did not fail"
    name, msg, code, is_ckpt = e
    assert name == "CheckpointIOError" and is_ckpt, e
    assert errname in msg and code == getattr(errno, errname), e
    assert any(f"rank {r} could not" in msg for r in rank_names), e
    assert file_frag in msg, e


def test_failed_saves_same_error_on_every_rank_and_no_leftovers(faults):
    """Class 8: full disk, read-only folder, EACCES, failed manifest write; leftovers of crashes."""
    _, (r0, r1) = faults
    for key, errname, frag in (
        ("enospc", "ENOSPC", "ema_"),
        ("enospc_all", "ENOSPC", "ema_rank_"),
        ("erofs_existing_tag", "EROFS", ".ema_write.lock"),
        ("erofs_new_tag", "EROFS", "r2"),
        ("eacces", "EACCES", "ema_rank_00001_of_00002"),
        ("manifest_enospc", "ENOSPC", ck.MANIFEST_NAME),
    ):
        e0, e1 = r0[key], r1[key]
        assert e0 is not None and e1 is not None, key
        assert e0[0] == e1[0] == "CheckpointIOError", (key, e0, e1)
        first = (
            1
            if key == "eacces"
            else (0 if key in ("manifest_enospc", "enospc_all", "erofs_existing_tag", "erofs_new_tag") else None)
        )
        ranks = [first] if first is not None else [0, 1]
        _assert_io_error(e0, ranks, errname, frag)
        _assert_io_error(e1, ranks, errname, frag)
        _count("8 failed saves")
    for r in (r0, r1):
        assert r["enospc_unchanged"] and r["enospc_previous_loads"], (
            "the previous checkpoint of the tag changed",
            r["enospc_files"],
        )
        assert r["enospc_all_leftovers"] == [], r["enospc_all_leftovers"]
        assert r["enospc_then_saves"] == [True, True]
        assert r["enospc_final_files"] == [
            "ema_manifest.json",
            "ema_rank_00000_of_00002.gen1.safetensors",
            "ema_rank_00001_of_00002.gen1.safetensors",
        ], r["enospc_final_files"]
        assert r["erofs_unchanged"] and r["erofs_still_loads"]
        assert r["eacces_unchanged"] and r["manifest_enospc_unchanged"] and r["manifest_enospc_previous_loads"]
        assert r["leftover_save"] is None, r["leftover_save"]
        assert r["leftover_files"] == [
            "ema_manifest.json",
            "ema_rank_00000_of_00002.safetensors",
            "ema_rank_00001_of_00002.safetensors",
        ], r["leftover_files"]
        assert r["leftover_loads"]
    _count("8 failed saves")  # the leftovers case


def test_tampered_manifest_fails_load_on_every_rank(faults):
    _, results = faults
    for r in results:
        name, msg, _, _ = r["tampered_load"]
        assert name == "CorruptCheckpointError" and "'schedules'" in msg and "ema_rank_" in msg, msg
    _count("5 manifest fields")


def test_collective_called_on_one_rank_times_out(faults):
    """Class 10: a save on rank 0 only fails after the timeout (3 s here) instead of hanging; then a
    load on rank 1 only fails too. (Gloo closes the connection when a barrier times out, so that second
    verb fails at once with "Connection closed by peer", or at its own timeout if it is first to wait:
    the group is unusable after a timeout, as the message says.) Before them, rank 1 alone in the
    barrier on a side group while rank 0 waits on a file stops at its own 3 s."""
    _, (r0, r1) = faults
    name, msg, _, _ = r0["lonely_save"]
    assert name == "CheckpointTimeoutError", r0["lonely_save"]
    for frag in ("functional_ema.save: rank 0 waited", "(limit 3 s)", "call it on every rank", ck.TIMEOUT_ENV):
        assert frag in msg, msg
    assert 2.5 < r0["lonely_save_s"] < 30, (r0["lonely_save_s"], msg)
    assert not r0["lonely_dir"], "the lone save wrote a tag folder"
    name, msg, _, _ = r1["lonely_load"]
    assert name == "CheckpointTimeoutError" and "functional_ema.load: rank 1 waited" in msg, r1["lonely_load"]
    assert r1["lonely_load_s"] < 30, (r1["lonely_load_s"], msg)
    # Rank 1 alone while rank 0 waits elsewhere: its own 3 s bound ends the wait (it used to wait for rank 0).
    name, msg, _, _ = r1["lonely_arrive"]
    assert name == "CheckpointTimeoutError", r1["lonely_arrive"]
    for frag in ("functional_ema.load: rank 1 waited", "(limit 3 s)", "no release from rank 0"):
        assert frag in msg, msg
    assert 2.5 < r1["lonely_arrive_s"] < 30, (r1["lonely_arrive_s"], msg)
    _count("10 one-rank collectives", 3)


# ------------------------------------------------------------------------------ offline helpers


def _copy(faults, tmp_path: Path, what: str = "ck") -> Path:
    root, _ = faults
    dst = tmp_path / what
    shutil.copytree(root / what, dst, symlinks=True)
    return dst


def _expect(cls, fragments, fn, *roots: Path, absent=()):
    """fn() raises cls (a CheckpointError) whose message holds every fragment and none of ``absent``;
    no file under ``roots`` changes."""
    before = [_hashes(r) for r in roots]
    with pytest.raises(cls) as info:
        fn()
    assert isinstance(info.value, ck.CheckpointError), type(info.value)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in: {msg}"
    for frag in absent:
        assert frag not in msg, f"{frag!r} leaked into: {msg}"
    assert [_hashes(r) for r in roots] == before, "an error path modified files"
    return msg


def _edit_manifest(tag_dir: Path, edit) -> None:
    m = tag_dir / ck.MANIFEST_NAME
    d = json.loads(m.read_text())
    edit(d)
    m.write_text(json.dumps(d))


def _forge_header(tag_dir: Path, rank: int, edit, kind: str = "ema") -> None:
    """Rewrite a rank file's (``kind="buffers"``: a buffer file's) safetensors header, and update the
    manifest's size and header checksum to match, as a deliberate forger would (so only validation, not
    a checksum, can catch it)."""
    f = tag_dir / f"{kind}_rank_{rank:05d}_of_00002.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header = edit(header) or header
    text = header if isinstance(header, (bytes, str)) else json.dumps(header, separators=(",", ":"))
    text = text.encode() if isinstance(text, str) else text
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text
    f.write_bytes(new + raw[8 + n :])

    def fix(d):
        e = next(e for e in d["files" if kind == "ema" else "buffer_files"] if e["rank"] == rank)
        e["bytes"] = len(new) + len(raw) - 8 - n
        e["header_checksum"] = _io.format_checksum(_io.CHECKSUM, _io.CHECKSUMS[_io.CHECKSUM](new))

    _edit_manifest(tag_dir, fix)


def _flip_hex(h: str) -> str:
    """A stored checksum with its lowest bit flipped (same width)."""
    return f"{int(h, 16) ^ 1:0{len(h)}x}"


def _meta_edit(key, fn):
    def edit(h):
        h["__metadata__"][key] = fn(h["__metadata__"][key])

    return edit


def _layout_edit(fn):
    def edit(h):
        lay = json.loads(h["__metadata__"]["layout"])
        fn(lay)
        h["__metadata__"]["layout"] = json.dumps(lay)

    return edit


def _first_tensor(h, pred=lambda info: True):
    return next(k for k, v in h.items() if k != "__metadata__" and pred(v))


@pytest.fixture
def no_big_alloc(monkeypatch):
    """Fail the test if anything asks torch for more than 4M elements (a forged size must be refused first)."""
    for fname in ("empty", "zeros"):
        real = getattr(torch, fname)

        def guarded(*size, _real=real, **kw):
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            numel = 1
            for d in dims:
                numel *= int(d)
            assert numel <= 4 << 20, f"torch.{_real.__name__}{tuple(dims)}: a large allocation from a forged size"
            return _real(*size, **kw)

        monkeypatch.setattr(torch, fname, guarded)


def _cli(*argv, capsys):
    from functional_ema.__main__ import main

    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# ---------------------------------------------------------------------- class 3: CLI outputs


def test_cli_never_overwrites_its_inputs(faults, tmp_path, capsys):
    d = _copy(faults, tmp_path)
    snaps = _copy(faults, tmp_path, "snaps")
    tdir = d / TAG
    want = fe.consolidate(d)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "to_rank0").symlink_to(tdir / "ema_rank_00000_of_00002.safetensors")
    (outside / "to_tag").symlink_to(tdir, target_is_directory=True)
    (outside / "to_latest").symlink_to(d / "latest")
    snap_tag = sorted(p.name for p in snaps.iterdir())[-1]
    refused = [
        (d, tdir / "ema_rank_00000_of_00002.safetensors"),
        (d, tdir / "ema_rank_00001_of_00002.safetensors"),
        (d, tdir / ck.MANIFEST_NAME),
        (d, d / "latest"),
        (d, tdir / "new.safetensors"),  # not an input, but inside the tag folder being read
        (d, tdir),
        (d, d),
        (d, d / "zero_to_fp32.py"),
        (d, d / "zero_to_torch.py"),
        (tdir, tdir / "ema_rank_00000_of_00002.safetensors"),  # the tag folder given as CHECKPOINT_DIR
        (d, outside / "to_rank0"),  # symlinks into the checkpoint are resolved
        (d, outside / "to_tag" / "x.safetensors"),
        (d, outside / "to_latest"),
        (d, tdir / "sub" / ".." / "ema_manifest.json"),
    ]
    before = _hashes(tmp_path)
    for src, out in refused:
        code, _, err = _cli("consolidate", src, out, capsys=capsys)
        # a usage error, before anything is read (the command line's own check, the library's rule)
        assert code == 2 and err.startswith("error: OUT: refusing to write"), (out, code, err)
        assert (
            str(out) in err
            and "Traceback" not in err
            and ("outside the checkpoint" in err or "directory" in err or "inside the checkpoint" in err)
        ), err
        _count("3 CLI outputs")
    for args in (
        ["posthoc", snaps, snaps / snap_tag / "ema_rank_00000_of_00002.safetensors", "--gamma", "6.94"],
        ["posthoc", snaps, snaps / snap_tag / "x.safetensors", "--sigma-rel", "0.1"],
    ):
        code, _, err = _cli(*args, capsys=capsys)
        assert code == 2 and "refusing to write" in err and "Traceback" not in err, err
        _count("3 CLI outputs")
    assert _hashes(tmp_path) == before, "a refused CLI call modified files"

    # An existing output is kept unless --overwrite; with it the file is replaced atomically (new inode).
    out = tmp_path / "ema.safetensors"
    out.write_bytes(b"precious")
    for cmd in (["consolidate", d, out], ["posthoc", snaps, out, "--sigma-rel", "0.1"]):
        code, _, err = _cli(*cmd, capsys=capsys)
        assert code == 2 and "refusing to replace the existing file" in err and "--overwrite" in err, err
        assert out.read_bytes() == b"precious"
        _count("3 CLI outputs")
    inode = out.stat().st_ino
    code, stdout, err = _cli("consolidate", d, out, "--overwrite", capsys=capsys)
    assert code == 0 and "wrote" in stdout, err
    from safetensors.torch import load_file

    got = load_file(str(out))
    assert all(torch.equal(got[n], want[n]) for n in want) and out.stat().st_ino != inode
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    _count("3 CLI outputs")
    # The real command line: a usage error (exit code 2), one line on stderr, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "functional_ema", "consolidate", str(d), str(d / "latest")],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: OUT: refusing") and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    assert (d / "latest").read_text().strip() == TAG
    _count("3 CLI outputs")


# ----------------------------------------------------------------- class 4: paths stay inside


def test_paths_never_leave_the_checkpoint(faults, tmp_path, capsys):
    d = _copy(faults, tmp_path)
    tdir = d / TAG
    mpath = tdir / ck.MANIFEST_NAME
    good_manifest = mpath.read_text()
    # A second, valid checkpoint beside it: a path that escapes would load it without complaint.
    decoy = tmp_path / "decoy"
    shutil.copytree(d, decoy)
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:SECRET-CONTENT\n")
    leak = ["SECRET-CONTENT", "root:x", str(struct.unpack("<Q", secret.read_bytes()[:8])[0])]

    names = [
        "../../decoy/" + TAG + "/ema_rank_00000_of_00002.safetensors",
        str(secret),
        "/etc/passwd",
        str(decoy / TAG / "ema_rank_00000_of_00002.safetensors"),
        "../" + TAG + "/ema_rank_00000_of_00002.safetensors",
        "ema_rank_00000_of_00002.safetensors/../ema_rank_00000_of_00002.safetensors",
        "sub/ema_rank_00000_of_00002.safetensors",
        "ema_rank_00000_of_00002.safetensors\0.txt",
        "ema_rank_00001_of_00002.safetensors",
        "ema_rank_00000_of_00004.safetensors",
        "ema_rank_00000_of_00002.gen3.safetensors",
        "secret.txt",
        "",
        7,
        None,
    ]
    for name in names:
        mpath.write_text(good_manifest)
        _edit_manifest(tdir, lambda m, name=name: m["files"][0].__setitem__("file", name))
        _expect(ck.CorruptCheckpointError, [str(mpath), "files[0]"], lambda: fe.consolidate(d), d, decoy, absent=leak)
        _count("4 paths")
    mpath.write_text(good_manifest)

    # A rank file that is a link to a file elsewhere (even a valid one) is not followed.
    r0 = tdir / "ema_rank_00000_of_00002.safetensors"
    saved = r0.read_bytes()
    r0.unlink()
    r0.symlink_to(decoy / TAG / r0.name)
    _expect(ck.CorruptCheckpointError, [str(r0), "outside the tag folder"], lambda: fe.consolidate(d), d, decoy)
    r0.unlink()
    r0.symlink_to(secret)
    _expect(ck.CorruptCheckpointError, [str(r0), "outside the tag folder"], lambda: fe.consolidate(d), d, absent=leak)
    r0.unlink()
    r0.write_bytes(saved)
    _count("4 paths", 2)

    # A rank file replaced by foreign content: the error never quotes its bytes.
    r0.write_bytes(secret.read_bytes() * 3)
    _expect(ck.CorruptCheckpointError, [str(r0)], lambda: fe.consolidate(d), d, absent=leak)
    r0.write_bytes(saved)
    _count("4 paths")

    # `latest` names a tag only inside the checkpoint; its content is never echoed.
    latest = d / "latest"
    for content in [
        "../decoy/" + TAG,
        str(decoy / TAG),
        "a/b",
        "/etc",
        "..",
        TAG + " x",
        "tab\tx",
        "nul\0",
        "bell\x07",
        "x" * 300,
    ]:
        latest.write_bytes(content.encode())
        _expect(ck.InvalidTagError, [str(latest), "does not name a tag folder"], lambda: fe.consolidate(d), d, decoy)
        _count("4 paths")
    for raw in (b"\xff\xfe\x00garbage", b"g" * 10000):
        latest.write_bytes(raw)
        _expect(ck.InvalidTagError, [str(latest)], lambda: fe.consolidate(d), d)
        _count("4 paths")
    latest.unlink()
    latest.symlink_to(secret)
    _expect(ck.InvalidTagError, [str(latest), "outside"], lambda: fe.consolidate(d), d, absent=leak)
    latest.unlink()
    latest.write_text(TAG)
    _count("4 paths")

    # --tag / tag=: one path component.
    for tag in ["../decoy/" + TAG, str(decoy / TAG), "a/b", "..", ".", "", "x\ty", "x\0y", " " + TAG]:
        _expect(ck.InvalidTagError, ["tag", "plain folder name"], lambda tag=tag: fe.consolidate(d, tag), d, decoy)
        _count("4 paths")
    code, _, err = _cli("consolidate", d, tmp_path / "o.safetensors", "--tag", "../decoy/" + TAG, capsys=capsys)
    assert code == 1 and "path separator" in err and not (tmp_path / "o.safetensors").exists(), err
    _count("4 paths")
    # And the untampered checkpoint still reads.
    assert fe.consolidate(d).keys() == fe.consolidate(decoy).keys()


# ------------------------------------------------------------ class 5: fields that change results


def test_manifest_fields_cross_checked(faults, tmp_path, capsys):
    d = _copy(faults, tmp_path)
    snaps = _copy(faults, tmp_path, "snaps")
    tdir = d / TAG
    mpath = tdir / ck.MANIFEST_NAME
    good = mpath.read_text()
    m0 = json.loads(good)
    name0, shape0 = next((n, s) for n, s in m0["params"].items() if len(s) == 2 and s[0] != s[1])

    def gamma_half(m):
        m["schedules"][1]["gamma"] /= 2

    edits = {
        "step": lambda m: m.__setitem__("step", m["step"] + 1),
        "num_emas": lambda m: (m.__setitem__("num_emas", 1), m.__setitem__("schedules", m["schedules"][:1])),
        "dtype": lambda m: m.__setitem__("dtype", "float64"),
        "zero_stage": lambda m: m.__setitem__("zero_stage", 3),
        "world_size": lambda m: m.__setitem__("world_size", 3),
        "generation": lambda m: m.__setitem__("generation", 1),
        "tag": lambda m: m.__setitem__("tag", "global_step7"),
        "schedules": gamma_half,
        "params": lambda m: m["params"].__setitem__(name0, shape0[::-1]),
        "rank": lambda m: [e.__setitem__("rank", 1 - e["rank"]) for e in m["files"]],
        "bytes": lambda m: m["files"][0].__setitem__("bytes", m["files"][0]["bytes"] + 8),
        "header": lambda m: m["files"][1].__setitem__("header_checksum", _flip_hex(m["files"][1]["header_checksum"])),
    }
    for field, edit in edits.items():
        mpath.write_text(good)
        _edit_manifest(tdir, edit)
        msg = _expect(ck.CorruptCheckpointError, [field], lambda: fe.consolidate(d), d)
        assert str(tdir) in msg, msg
        _count("5 manifest fields")
    # A changed tensor checksum: caught when the bytes are read.
    mpath.write_text(good)
    st0 = _io.SafetensorsFile(tdir / m0["files"][0]["file"])
    key = min(st0.tensors, key=lambda k: st0.tensors[k].start)  # the first 16 digits: its first chunk's checksum
    st0.close()
    _edit_manifest(
        tdir,
        lambda m: m["files"][0].__setitem__(
            "chunk_checksums", _flip_hex(m["files"][0]["chunk_checksums"][:16]) + m["files"][0]["chunk_checksums"][16:]
        ),
    )
    _expect(ck.CorruptCheckpointError, ["checksum", key], lambda: fe.consolidate(d, index=int(key.split(".")[1])), d)
    mpath.write_text(good)
    _count("5 manifest fields")

    # Post-hoc: halving one gamma in one snapshot manifest no longer gives silently wrong weights.
    stag = sorted(p.name for p in snaps.iterdir())[-1]
    _edit_manifest(snaps / stag, gamma_half)
    msg = _expect(
        ck.CorruptCheckpointError,
        ["'schedules'", stag, "edited"],
        lambda: posthoc.posthoc_offline(snaps, sigma_rel=0.1),
        snaps,
    )
    code, _, err = _cli("posthoc", snaps, tmp_path / "p.safetensors", "--sigma-rel", "0.1", capsys=capsys)
    assert code == 1 and "'schedules'" in err and not (tmp_path / "p.safetensors").exists(), err
    _count("5 manifest fields", 2)
    # The gammas live in the rank files' headers too; forging both (and the CRC) is the only way round.


# ------------------------------------------------------- class 6: malformed manifests and headers


def test_malformed_manifests_refused_before_use(faults, tmp_path, no_big_alloc):
    d = _copy(faults, tmp_path)
    tdir = d / TAG
    mpath = tdir / ck.MANIFEST_NAME
    good = mpath.read_text()
    m0 = json.loads(good)
    name0 = next(iter(m0["params"]))
    bad_values = {
        "step": ["6", 6.0, True, -1, 2**64, None, [6]],
        "num_emas": [0, -2, 10**9, "2", 2.0, False],
        "dtype": [5, "int32", "float8_e4m3fn", "torch.float32", "", None],
        "world_size": [0, -2, 2**40, "2", 2.5],
        "zero_stage": [7, -1, "2", None],
        "generation": [-1, "0", 0.5],
        "tag": [5, "../x", "a b", ""],
        "params": [
            [],
            "x",
            {name0: [-3, 4]},
            {name0: "ab"},
            {name0: [2**40, 2**40, 2**40]},
            {name0: [2.5]},
            {name0: [[1]]},
            {name0: [True]},
        ],
        "files": [{}, [], ["x"], "x", [None], [{"rank": 0}]],
        "schedules": ["x", [1, 2], [{}], {}],
        "format_version": [True, "1", 0, 1.0],
        # The piece index (which rank holds which elements): type-confused, not covering, a rank without a file.
        "piece_index": ["x", [], {}]
        + [
            {**m0["piece_index"], name0: bad}
            for bad in (0, -1, 2.5, True, None, "1", [0, 0], [0, 0, 0], [len(m0["files"]), 0, 1], [[0], 0, 1])
        ],
    }
    for field, values in bad_values.items():
        for v in values:
            mpath.write_text(good)
            _edit_manifest(tdir, lambda m, f=field, v=v: m.__setitem__(f, v))
            _expect(ck.CorruptCheckpointError, [str(mpath), field], lambda: fe.consolidate(d), d)
            _count("6 malformed manifests")
    file_values = {
        "bytes": ["12", -1, None, 1.5],
        "header_checksum": [2**33, -1, "x", "1" * 17],
        "rank": [-1, 2, "0", None],
        "chunk_checksums": [[], None, 5, {"k": "x"}, "x" * 16, "0" * 15, "0" * 16, "0" * 160000],
    }
    for key, values in file_values.items():
        for v in values:
            mpath.write_text(good)
            _edit_manifest(tdir, lambda m, k=key, v=v: m["files"][1].__setitem__(k, v))
            _expect(
                ck.CorruptCheckpointError,
                [str(mpath), f"files[1].{key}" if key != "rank" else "files[1]"],
                lambda: fe.consolidate(d),
                d,
            )
            _count("6 malformed manifests")
    for field in ("tag", "generation", "step", "num_emas", "dtype", "world_size", "zero_stage", "params", "files"):
        mpath.write_text(good)
        _edit_manifest(tdir, lambda m, f=field: m.pop(f))
        _expect(ck.CorruptCheckpointError, [str(mpath), field], lambda: fe.consolidate(d), d)
        _count("6 malformed manifests")
    deep = good.replace('"params": {', '"params": ' + "[" * 200000 + "]" * 200000 + ', "x": {', 1)
    for text, frag in (
        (deep, "nested too deeply"),
        ("[" * 200000 + "]" * 200000, "nested too deeply"),
        ("[]", "not a functional_ema manifest"),
        ("null", "not a functional_ema manifest"),
        ('{"format": 1', "not valid JSON"),
        ("", "not valid JSON"),
    ):
        mpath.write_text(text)
        _expect(ck.CorruptCheckpointError, [str(mpath), frag], lambda: fe.consolidate(d), d)
        _count("6 malformed manifests")
    mpath.write_text(good)
    with open(mpath, "r+b") as f:  # a sparse 300 MiB manifest: refused by its size, never read
        f.truncate(300 << 20)
    _expect(ck.CorruptCheckpointError, [str(mpath), "bytes"], lambda: fe.consolidate(d), d)
    mpath.write_text(good)
    _count("6 malformed manifests")
    assert fe.consolidate(d).keys() == set(m0["params"])


def test_forged_headers_refused_before_allocation(faults, tmp_path, no_big_alloc):
    """Rank-file headers rewritten with the manifest's size and CRC updated to match (a forger):
    negative, huge or fractional shapes, pieces outside their parameter, unknown dtypes, deep nesting."""
    base = _copy(faults, tmp_path)

    def big(info):
        return info["shape"][0] > 1

    forgeries = {
        "negative shape": (lambda h: h[_first_tensor(h, big)].__setitem__("shape", [-65536, -4096]), ["shape"]),
        "fractional shape": (lambda h: h[_first_tensor(h, big)].__setitem__("shape", [2.5]), ["shape"]),
        "huge shape": (lambda h: h[_first_tensor(h, big)].__setitem__("shape", [2**40, 2**40]), ["shape"]),
        "string shape": (lambda h: h[_first_tensor(h)].__setitem__("shape", "12"), ["shape"]),
        "unknown dtype": (lambda h: h[_first_tensor(h)].__setitem__("dtype", "F8_E4M3"), ["dtype"]),
        "int dtype": (lambda h: h[_first_tensor(h)].__setitem__("dtype", "I32"), ["dtype"]),
        "offsets": (lambda h: h[_first_tensor(h)].__setitem__("data_offsets", [0, 2**50]), ["data_offsets"]),
        "negative offsets": (lambda h: h[_first_tensor(h)].__setitem__("data_offsets", [-8, 0]), ["data_offsets"]),
        "entry type": (lambda h: h.__setitem__(_first_tensor(h), [1, 2]), ["entry"]),
        "deep header": (lambda h: '{"x":' + "[" * 200000 + "]" * 200000 + "}", ["nested too deeply"]),
        "header not object": (lambda h: "[1, 2]", ["not a JSON object"]),
        "layout negative": (
            _layout_edit(lambda lay: lay["specs"][next(iter(lay["specs"]))].__setitem__(0, [-65536, -4096])),
            ["layout", "shape"],
        ),
        "layout huge": (
            _layout_edit(lambda lay: lay["specs"][next(iter(lay["specs"]))].__setitem__(0, [2**31, 2**31])),
            ["layout", "shape"],
        ),
        "layout offset beyond": (
            _layout_edit(lambda lay: lay["specs"][next(iter(lay["specs"]))].__setitem__(1, 10**9)),
            ["layout", "offset"],
        ),
        "layout negative numel": (
            _layout_edit(lambda lay: lay["specs"][next(iter(lay["specs"]))].__setitem__(2, -5)),
            ["layout", "offset, numel"],
        ),
        "layout rank": (_layout_edit(lambda lay: lay.__setitem__("rank", 0)), ["layout", "'rank'"]),
        "layout stage": (_layout_edit(lambda lay: lay.__setitem__("stage", 3)), ["layout", "'stage'"]),
        "layout specs type": (_layout_edit(lambda lay: lay.__setitem__("specs", [1])), ["layout", "specs"]),
        "layout extra param": (_layout_edit(lambda lay: lay["specs"].__setitem__("ghost", [[4], 0, 0])), ["ghost"]),
        "layout deep": (_meta_edit("layout", lambda s: "[" * 200000 + "]" * 200000), ["layout"]),
        "layout not json": (_meta_edit("layout", lambda s: s[:-3]), ["layout"]),
        "schedules deep": (_meta_edit("schedules", lambda s: "[" * 200000 + "]" * 200000), ["schedules"]),
        "schedules forged": (_meta_edit("schedules", lambda s: s.replace('gamma": ', 'gamma": 1')), ["schedules"]),
        "metadata type": (lambda h: h["__metadata__"].__setitem__("step", 6), ["__metadata__"]),
        "step": (_meta_edit("step", lambda s: str(int(s) + 1)), ["step"]),
    }
    for _what, (edit, frags) in forgeries.items():
        d = tmp_path / "case"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        _forge_header(d / TAG, 1, edit)
        where = str(d / TAG / "ema_rank_00001_of_00002.safetensors")
        _expect(ck.CorruptCheckpointError, [where, *frags], lambda: fe.consolidate(d), d)
        _count("6 forged headers")
    # A forger who also edits the manifest's shape to the huge one: still refused before allocating.
    d = tmp_path / "case"
    shutil.rmtree(d)
    shutil.copytree(base, d)
    m = json.loads((d / TAG / ck.MANIFEST_NAME).read_text())
    name = next(iter(m["params"]))
    for r in (0, 1):
        _forge_header(d / TAG, r, _layout_edit(lambda lay: lay["specs"][name].__setitem__(0, [2**20, 2**20])))
    _edit_manifest(d / TAG, lambda m: m["params"].__setitem__(name, [2**20, 2**20]))
    # The manifest's piece index no longer covers the parameter: refused when the manifest is read.
    _expect(
        ck.CorruptCheckpointError,
        [str(d / TAG / ck.MANIFEST_NAME), f"piece_index['{name}']"],
        lambda: fe.consolidate(d),
        d,
    )
    _count("6 forged headers")
    # Without the index (as an older manifest): the pieces read from the headers cover too little.
    _edit_manifest(d / TAG, lambda m: m.pop("piece_index"))
    _expect(
        ck.IncompleteCheckpointError,
        [str(d / TAG / ck.MANIFEST_NAME), name, "cover only"],
        lambda: fe.consolidate(d),
        d,
    )
    _count("6 forged headers")


# ------------------------------------------------------------ class 13: buffers files (issue 21)


def test_buffers_belong_to_the_checkpoint_on_every_rank(faults):
    """2 ranks: each rank reads its own listed buffer file; a leftover of another world size beside them is
    never read; a missing listed file makes the tag incomplete for every reader; a buffer write that fails
    after the EMA file leaves the previous checkpoint (EMA and buffers at one step) as it was."""
    _, results = faults
    for rank, r in enumerate(results):
        assert r["bufs_own"] and r["bufs_leftover_ignored"], rank
        for e in r["bufs_gone"]:
            assert e is not None and e[0] == "IncompleteCheckpointError", (rank, e)
            assert "buffers_rank_00001_of_00002.safetensors" in e[1] and "missing" in e[1], e
        assert r["bufs_gone_unchanged"]
        name, msg, code, _ = r["bufs_enospc"]
        assert (
            name == "CheckpointIOError" and "rank 1 could not write" in msg and "buffers_rank_00001_of_00002" in msg
        ), msg
        assert code == errno.ENOSPC and r["bufs_enospc_unchanged"], r["bufs_enospc"]
        assert r["bufs_enospc_previous"] == [3, 3, True], r["bufs_enospc_previous"]
        name, msg, _, _ = r["bufs_step_mismatch"]
        assert name == "CheckpointMismatchError" and "buffer state is at step 4 but the EMA state at step 3" in msg, msg
        assert r["bufs_step_mismatch_nothing"]
    _count("13 buffers files", 5)


def _buffers_read(d: Path, rank: int = 0):
    """What rank ``rank`` of the saved world of 2 reads (load_buffers' reader), and rank 0's for consolidate."""
    from functional_ema._checkpoint.reader import open_checkpoint

    with open_checkpoint(d, "t") as ckpt:
        return ckpt.read_buffers(rank, 2)


def test_damaged_buffer_files_refused(faults, tmp_path, no_big_alloc):
    """Flipped bytes, a changed dtype (with and without the checksums forged to match), another rank's,
    step's or generation's file in its place, a pickle, a truncated file, a link out of the folder,
    extra and missing tensors, malformed manifest records: all refused naming the file, nothing changed."""
    base = _copy(faults, tmp_path, "bufs")
    good = {
        k: [t.clone() for t in (v.values() if isinstance(v, dict) else [])]
        for k, v in zip(("emas", "copied"), (_buffers_read(base)[1][0], _buffers_read(base)[2]))
    }
    assert good["emas"] and good["copied"]
    f0 = "buffers_rank_00000_of_00002.safetensors"
    f1 = "buffers_rank_00001_of_00002.safetensors"

    def case():
        d = tmp_path / "case"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d, symlinks=True)
        return d

    def flip_data(d):
        p = d / "t" / f0
        raw = bytearray(p.read_bytes())
        raw[-3] ^= 0x10
        p.write_bytes(bytes(raw))

    def header_dtype(d):  # F32 -> I32 in the header, same size: the header checksum no longer matches
        p = d / "t" / f0
        p.write_bytes(p.read_bytes().replace(b'"dtype":"F32"', b'"dtype":"I32"', 1))

    def other_rank(d):
        shutil.copy(d / "t" / f1, d / "t" / f0)

    def pickled(d):
        torch.save({"x": torch.zeros(3)}, d / "t" / f0)

    def truncated(d):
        p = d / "t" / f0
        p.write_bytes(p.read_bytes()[:-8])

    def link_out(d):
        (tmp_path / "elsewhere.safetensors").write_bytes((d / "t" / f0).read_bytes())
        (d / "t" / f0).unlink()
        (d / "t" / f0).symlink_to(tmp_path / "elsewhere.safetensors")

    readers = {"consolidate": lambda d: fe.buffers.consolidate(d, "t"), "rank 1": lambda d: _buffers_read(d, 1)}
    plain = {
        "flipped data byte": (flip_data, ["checksum mismatch", f0]),
        "dtype F32->I32": (header_dtype, ["header does not match the checksum", f0]),
        "another rank's file": (other_rank, [f0]),
        "a pickle": (pickled, [f0, "pickle"]),
        "truncated": (truncated, [f0, "truncated"]),
        "a link out of the folder": (link_out, [f0, "outside the tag folder"]),
    }
    for _what, (damage, frags) in plain.items():
        d = case()
        damage(d)
        _expect(ck.CorruptCheckpointError, frags, lambda: readers["consolidate"](d), d)
        _count("13 buffers files")
    # Forgers who also fix the manifest's size and header checksum: the fields themselves are checked.
    forged = {
        "dtype F32->I32, checksums forged": (
            lambda h: h[_first_tensor(h, lambda v: v["dtype"] == "F32")].__setitem__("dtype", "I32"),
            ["is int32", "manifest's field 'buffers'"],
        ),
        "step": (_meta_edit("step", lambda v: str(int(v) + 2)), ["step=", "does not belong"]),
        "generation": (_meta_edit("generation", lambda v: "7"), ["generation=", "does not belong"]),
        "rank": (_meta_edit("rank", lambda v: "0"), ["rank=", "does not belong"]),
        "world size": (_meta_edit("world_size", lambda v: "1"), ["world_size=", "does not belong"]),
        "tag": (_meta_edit("tag", lambda v: "other"), ["tag=", "does not belong"]),
        "extra tensor": (
            lambda h: h.__setitem__("copied.ghost", dict(h[_first_tensor(h)], data_offsets=[0, 0], shape=[0])),
            ["other tensors", "ghost"],
        ),
        "shape": (
            lambda h: h[
                _first_tensor(h, lambda v: v["dtype"] == "F32" and len(v["shape"]) == 1 and v["shape"][0] > 1)
            ].__setitem__(
                "shape",
                [
                    1,
                    h[_first_tensor(h, lambda v: v["dtype"] == "F32" and len(v["shape"]) == 1 and v["shape"][0] > 1)][
                        "shape"
                    ][0],
                ],
            ),
            ["manifest's field 'buffers'"],
        ),
    }
    for _what, (edit, frags) in forged.items():
        d = case()
        _forge_header(d / "t", 1, edit, kind="buffers")
        _expect(ck.CorruptCheckpointError, [f1, *frags], lambda: readers["rank 1"](d), d)
        _count("13 buffers files")
    # Malformed manifest records of the buffers.
    m0 = json.loads((base / "t" / ck.MANIFEST_NAME).read_text())
    bad = {
        "buffers": [
            None,
            [],
            {"num_emas": 0},
            dict(m0["buffers"], dtype="int32"),
            dict(m0["buffers"], floating={"x": [-1]}),
            dict(m0["buffers"], copied={"x": ["float8", [1]]}),
        ],
        "buffer_files": [
            [],
            "x",
            [{"rank": 0}],
            [dict(m0["buffer_files"][0], file="../../etc/passwd")],
            [dict(m0["buffer_files"][0], file="buffers_rank_00000_of_00001.safetensors")],
            [dict(m0["buffer_files"][0], bytes=-1)],
        ],
    }
    for field, values in bad.items():
        for v in values:
            d = case()
            _edit_manifest(d / "t", lambda m, f=field, v=v: m.__setitem__(f, v))
            _expect(ck.CorruptCheckpointError, [field], lambda: fe.buffers.consolidate(d, "t"), d)
            _count("13 buffers files")
    # The EMA alone reads nothing of the buffers, but a tag is complete only with every listed file.
    d = case()
    (d / "t" / f1).unlink()
    _expect(ck.IncompleteCheckpointError, [f1, "missing"], lambda: fe.consolidate(d, "t"), d)
    _count("13 buffers files")
    # Untouched, everything reads, and rank 0's buffers are the ones consolidate returns.
    sd = fe.buffers.consolidate(base, "t")
    assert all(torch.equal(sd[n], t) for n, t in _buffers_read(base)[1][0].items())


# ------------------------------------------------------ class 14: integration state (issue 21)


def _bn_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3))


def _train_controller(c, net, steps, save=None):
    """Steps 1..steps of SGD on ``net`` with ``c.on_step`` after each; ``save(step)`` after each step."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        opt.zero_grad()
        net(torch.randn(8, 5, generator=g)).square().mean().backward()
        opt.step()
        c.on_step(net, step)
        if save is not None:
            save(step)


def test_resume_checks_the_integration_record(tmp_path):
    """The framework's step and the EMA's step must agree by the controller's rules; the record beside a
    not-started EMA is checksummed; nothing unchecked discards or restarts a verified EMA."""
    from functional_ema._checkpoint.format import RECORD_NAME, record_bytes
    from functional_ema.integrations import EMAController

    net = _bn_net()
    c = EMAController(0.9, buffers="average", start_step=3)
    ckpts = tmp_path / "ck"

    def save(step):
        c.save(net, ckpts / f"checkpoint-{step}", step)

    _train_controller(c, net, 6, save)
    new = lambda **k: EMAController(0.9, buffers="average", start_step=3, **k)  # noqa: E731
    # Handled correctly: each checkpoint resumes at its own step (not started before step 3).
    for step in range(1, 7):
        r = new()
        assert r.load(net, ckpts / f"checkpoint-{step}", framework_step=step) == step
        assert (r.state is None) == (step < 3) and (r.state is None or int(r.state.step) == step)
    _count("14 integration state", 2)
    cases = []

    def refused(cls, frags, fn, folder):
        _expect(cls, frags, fn, folder)
        cases.append(1)

    # An EMA from another checkpoint (two steps behind the framework's), through the framework's own step.
    refused(
        ck.CheckpointMismatchError,
        ["framework step 4, but the training resumed at step 6"],
        lambda: new().load(net, ckpts / "checkpoint-4", framework_step=6),
        ckpts,
    )
    # The record of a not-started EMA: damaged, edited, or contradicted by the rules.
    rec = ckpts / "checkpoint-2" / "ema" / RECORD_NAME
    good = rec.read_bytes()
    for damage, frags in (
        (lambda b: b[:-5], ["not a readable JSON record"]),
        (lambda b: b"[]", ["not a functional_ema record"]),
        (lambda b: b.replace(b'"started": false', b'"started": true'), ["checksum does not match"]),
        (lambda b: b.replace(b'"framework_step": 2', b'"framework_step": 9'), ["checksum does not match"]),
        (lambda b: b"[" * 30000, ["not a readable JSON record", "nested too deeply"]),
        (lambda b: b"{" * 100000, ["far more than a record"]),
        (lambda b: b"\xff\xfe" + b, ["not a readable"]),
    ):
        rec.write_bytes(damage(good))
        refused(
            ck.CorruptCheckpointError,
            [str(rec), *frags],
            lambda: new().load(net, ckpts / "checkpoint-2", framework_step=2),
            ckpts,
        )
    # A forged record (checksum recomputed) that says "not started" at a step where the rules say it must be.
    forged = json.loads(good)
    forged.update(framework_step=5)
    rec.write_bytes(record_bytes(forged))
    refused(
        ck.CheckpointMismatchError,
        ["had not started at framework step 5", "must be at step 5"],
        lambda: new().load(net, ckpts / "checkpoint-2", framework_step=5),
        ckpts,
    )
    rec.write_bytes(good)
    # A not-started record dropped beside a complete, verified EMA (older than it): the EMA is kept.
    (ckpts / "checkpoint-5" / "ema" / RECORD_NAME).write_bytes(
        record_bytes(dict(forged, framework_step=5, supersedes_generation=-1))
    )
    r = new()
    assert r.load(net, ckpts / "checkpoint-5", framework_step=5) == 5 and int(r.state.step) == 5
    cases.append(1)
    # ... and one that claims to be newer: the rules still refuse a not-started EMA at step 5.
    (ckpts / "checkpoint-5" / "ema" / RECORD_NAME).write_bytes(
        record_bytes(dict(forged, framework_step=5, supersedes_generation=0))
    )
    refused(
        ck.CheckpointMismatchError,
        ["had not started at framework step 5"],
        lambda: new().load(net, ckpts / "checkpoint-5", framework_step=5),
        ckpts,
    )
    (ckpts / "checkpoint-5" / "ema" / RECORD_NAME).unlink()
    # The manifest's record (the framework step the EMA was saved at), edited: its copy in the rank file's
    # header (covered by the checksums) disagrees.
    m = ckpts / "checkpoint-6" / "ema" / ck.MANIFEST_NAME
    saved = m.read_text()
    _edit_manifest(m.parent, lambda d: d["extra"].__setitem__("framework_step", 100))
    refused(
        ck.CorruptCheckpointError,
        ["'extra'", "edited"],
        lambda: new().load(net, ckpts / "checkpoint-6", framework_step=None),
        ckpts,
    )
    m.write_text(saved)
    # An EMA whose step is behind its own record (saved at framework step 6 with the EMA of step 4).
    e4 = new()
    e4.load(net, ckpts / "checkpoint-4", framework_step=4)
    with pytest.raises(ValueError, match=r"framework_step=6: .* put the EMA at step 6 .* but it is at step 4"):
        e4.save(net, tmp_path / "behind", 6)  # refused at the save now, before anything is written
    assert not (tmp_path / "behind").exists()
    # ... so the mismatched checkpoint is forged with fe.save and the controller's record, as an older save wrote it
    fe.save(e4.state, net, tmp_path / "behind", e4.tag, decay=e4.decay, buffers=e4.buffer_state, extra=e4._record(6))
    refused(
        ck.CheckpointMismatchError,
        ["EMA is at step 4, but at framework step 6", "put it at step 6"],
        lambda: new().load(net, tmp_path / "behind", framework_step=6),
        tmp_path / "behind",
    )
    refused(
        ck.CheckpointMismatchError,
        ["EMA is at step 4, but at framework step 6"],
        lambda: new().load(net, tmp_path / "behind", framework_step=None),
        tmp_path / "behind",
    )
    # Other settings than the run that saved it: named.
    refused(
        ck.CheckpointMismatchError,
        ["saved by a run with start_step=3, every_n_steps=1"],
        lambda: EMAController(0.9, buffers="average", start_step=3, every_n_steps=4).load(
            net, ckpts / "checkpoint-6", 6
        ),
        ckpts,
    )
    # No EMA at all where the rules say there must be one.
    (tmp_path / "empty" / "ema").mkdir(parents=True)
    refused(
        ck.IncompleteCheckpointError,
        ["no complete EMA checkpoint", "must have started"],
        lambda: new().load(net, tmp_path / "empty", framework_step=4),
        tmp_path / "empty",
    )
    r = new()
    assert (
        r.load(net, tmp_path / "empty", framework_step=2) == 2 and r.state is None
    )  # before the start: nothing to read
    cases.append(1)
    _count("14 integration state", len(cases))


def test_a_failed_save_leaves_no_part_of_the_tag_newer(tmp_path):
    """The EMA, buffers and record of one controller save succeed or fail together: a failure of the
    buffer write after the EMA's leaves the previous checkpoint of the same folder, at one step."""
    import functional_ema.checkpoint as ckmod
    from functional_ema.integrations import EMAController

    net = _bn_net()
    c = EMAController(0.9, buffers="average")
    _train_controller(c, net, 2)
    c.save(net, tmp_path, 2)
    before = _hashes(tmp_path)
    with torch.no_grad():  # the weights of step 3
        for p in net.parameters():
            p.mul_(0.5)
    c.state = fe.update(c.state, fe.local_shards(net), 3, decay=0.9)
    c.buffer_state = fe.buffers.update_buffers(c.buffer_state, net, 3, decay=0.9)
    real = ckmod.write_buffer_file

    def full_disk(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    ckmod.write_buffer_file = full_disk
    try:
        _expect(
            ck.CheckpointIOError,
            ["ENOSPC", "buffers_rank_00000_of_00001.gen1"],
            lambda: c.save(net, tmp_path, 3),
            tmp_path,
        )
    finally:
        ckmod.write_buffer_file = real
    assert _hashes(tmp_path) == before
    r = EMAController(0.9, buffers="average")
    assert r.load(net, tmp_path, framework_step=2) == 2 and int(r.state.step) == 2 and int(r.buffer_state.step) == 2
    _count("14 integration state")


#: Accelerate's save record (``<tag>_save_state.json``, functional_ema.integrations.accelerate): a write of it fails
#: (errno) while marking a ``save_state`` unfinished (before Accelerate writes anything, into the folder used at step 3)
#: or finished (after, into a new folder).
SAVE_RECORD_FAULTS = (
    ("unfinished mark", errno.ENOSPC),
    ("unfinished mark", errno.EIO),
    ("finished mark", errno.ENOSPC),
    ("finished mark", errno.EIO),
)


def test_accelerate_save_record_write_failures(tmp_path):
    """Each row of :data:`SAVE_RECORD_FAULTS` (the write fails half-way, its temporary file written): the save raises
    a ``CheckpointIOError`` naming the record's file and the errno, no temporary file is left, and the previous
    complete save (step 3) loads, resuming the run's state bitwise; an unfinished mark that failed left its folder
    as it was (hashed), a finished mark that failed leaves its folder refused as unfinished."""
    pytest.importorskip("accelerate")
    import functional_ema.integrations.accelerate as fe_accelerate
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from tests.test_integrations_accelerate import _load_refused, _load_whole, _own, _prepared, _train

    real = fe_accelerate.atomic_write_bytes
    for phase, code in SAVE_RECORD_FAULTS:
        d = tmp_path / f"{phase.split()[0]}_{errno.errorcode[code]}"
        acc, model, optimizer = _prepared()
        ema = AcceleratorEMA(acc, model, decay=0.5)
        _train(acc, model, optimizer, (ema,), steps=3)
        at3 = _own(model), fe.gather_full(ema.state, model)
        acc.save_state(str(d / "ckpt"))
        before = _hashes(d / "ckpt")
        _train(acc, model, optimizer, (ema,), steps=3)

        def failing(final, data, phase=phase, code=code):
            if Path(final).name == "ema_save_state.json" and json.loads(data)["complete"] == (phase == "finished mark"):
                with _io.atomic_open(final) as f:
                    f.write(data[: len(data) // 2])
                    raise OSError(code, os.strerror(code), str(final))
            return real(final, data)

        target = d / ("ckpt" if phase == "unfinished mark" else "next")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fe_accelerate, "atomic_write_bytes", failing)
            with pytest.raises(ck.CheckpointIOError) as failed:
                acc.save_state(str(target))
        ema.remove_hooks()
        message = str(failed.value)
        assert str(target / "ema_save_state.json") in message and errno.errorcode[code] in message, (phase, message)
        assert failed.value.errno == code, (phase, message)
        leftovers = [p for p in d.rglob("*") if _io.is_tmp_name(p.name)]
        assert not leftovers, (phase, leftovers)
        assert _hashes(d / "ckpt") == before, phase  # an unfinished mark fails before anything of the save is written
        if phase == "finished mark":
            _load_refused(target, r"save_state of optimizer step 6 into this folder did not finish")
        _load_whole(d / "ckpt", *at3, 3)
        _count("14 integration state")


# ----------------------------------------------------------------------- class 15: exports (issue 21)


def test_exports_never_land_on_a_checkpoint(tmp_path):
    """``export_path`` onto a rank, buffer or manifest file, a record, a pointer file, a tag folder, DeepSpeed's
    files, a link into a checkpoint: refused before anything is gathered; the metadata names the EMA asked
    for; ``copy_to_model`` refuses a model that does not fit, skipping nothing silently."""
    from safetensors import safe_open

    from functional_ema.integrations import EMAController

    net = _bn_net()
    c = EMAController([0.9, 0.5], buffers="average")
    _train_controller(c, net, 3)
    c.save(net, tmp_path / "ck", 3)
    fe.save(c.state, net, tmp_path / "plain", "global_step3")
    tag = tmp_path / "ck" / "ema"
    (tmp_path / "ds" / "global_step3").mkdir(parents=True)
    (tmp_path / "ds" / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"deepspeed")
    (tmp_path / "ds" / "latest").write_text("global_step3")
    (tmp_path / "link").symlink_to(tag / "ema_manifest.json")
    targets = [
        tag / "ema_rank_00000_of_00001.safetensors",
        tag / "buffers_rank_00000_of_00001.safetensors",
        tag / ck.MANIFEST_NAME,
        tag / "integration.json",
        tag / "new.safetensors",
        tag,
        tmp_path / "plain" / "ema_latest",
        tmp_path / "plain" / "global_step3" / "x.safetensors",
        tmp_path / "ds" / "latest",
        tmp_path / "ds" / "global_step3" / "mp_rank_00_model_states.pt",
        tmp_path / "ds" / "global_step3" / "ema.safetensors",
        tmp_path / "link",
        tmp_path / "ck" / "ema" / ".." / "ema" / "w",
    ]
    for t in targets:
        _expect(ck.OutputPathError, ["refusing to write", str(t)], lambda t=t: c.export(net, t), tmp_path)
        _count("15 exports")
    out = c.export(net, tmp_path / "ema1.safetensors", index=1)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["ema_index"] == "1" and json.loads(meta["schedule"]) == {"kind": "constant", "decay": 0.5}, meta
    assert torch.equal(f_tensor(out, "0.weight"), c.state.emas[1]["0.weight"].view(7, 5))
    _count("15 exports")
    # copy_to_model: a model where a parameter with an EMA is frozen (its EMA would be skipped silently)
    frozen = _bn_net()
    frozen[0].weight.requires_grad_(False)
    before = {n: p.clone() for n, p in frozen.state_dict().items()}
    with pytest.raises(
        fe.StateMismatchError, match=r"the state has EMAs of '0.weight', which this model does not train"
    ):
        c.copy_to_model(frozen)
    assert all(torch.equal(before[n], p) for n, p in frozen.state_dict().items())
    other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 4))
    with pytest.raises(fe.StateMismatchError, match=r"2\.weight"):
        c.copy_to_model(other)
    with pytest.raises(ValueError, match="index=2 is not one of the 2"):
        c.export(net, tmp_path / "x.safetensors", index=2)
    _count("15 exports", 3)


def f_tensor(path: Path, key: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))[key]


# ---------------------------------------------------------- class 16: one writer per file (issue 21)


def test_one_writer_per_tag(tmp_path):
    """Two AsyncSavers, an AsyncSaver and fe.save, two processes: on one tag they take turns (each save
    complete, the last one's content loaded); a save that cannot get the tag in time is refused naming
    the holder, nothing changed; temporary names are unique per write."""
    import functional_ema._checkpoint.writer as ckwriter

    net = _bn_net()
    s1 = fe.init_ema(fe.local_shards(net))
    s2 = fe.init_ema(fe.local_shards(net))
    with torch.no_grad():
        for t in s2.ema.values():
            t.add_(1.0)
    a, b = fe.AsyncSaver(), fe.AsyncSaver()
    slow = _slow_writes(0.3)
    try:
        h1 = a.save(s1, net, tmp_path, "t")
        h2 = b.save(s2, net, tmp_path, "t")  # waits for h1's commit before taking the tag
        fe.save(s1, net, tmp_path, "t")  # and this one for h2's
    finally:
        slow()
    h1.wait(), h2.wait()
    assert _tensors_equal(fe.load(net, tmp_path, "t"), s1)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [
        ck.MANIFEST_NAME,
        "ema_rank_00000_of_00001.gen2.safetensors",
    ]
    _count("16 one writer", 2)
    # Another process writing the tag: this save waits for it.
    code = (
        "import sys, time, torch, functional_ema as fe\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from tests.test_faults import _bn_net, _slow_writes\n"
        "net = _bn_net(); s = fe.init_ema(fe.local_shards(net)); _slow_writes(1.0)\n"
        f"fe.save(s, net, {str(tmp_path)!r}, 't')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for(tmp_path / "t" / ".ema_write.lock", 60)  # the other process holds the tag
        fe.save(s2, net, tmp_path, "t")
    finally:
        assert proc.wait(60) == 0
    assert _tensors_equal(fe.load(net, tmp_path, "t"), s2)
    _count("16 one writer")
    # A holder that does not finish in time: refused, naming it, nothing changed.
    lock = ckwriter.TagLock.acquire(tmp_path / "t", 5, "test")
    before = _hashes(tmp_path)
    try:
        _expect(
            ck.CheckpointError,
            ["being written by another save", f"pid {os.getpid()}", "1 s"],
            lambda: fe.save(s1, net, tmp_path, "t", timeout=1),
            tmp_path,
        )
    finally:
        lock.release()
    assert _hashes(tmp_path) == {k: v for k, v in before.items() if not k.endswith(".ema_write.lock")}
    _count("16 one writer")
    names = {_io.tmp_name(tmp_path / "x").name for _ in range(100)}
    assert len(names) == 100 and all(_io.is_tmp_name(n) for n in names)
    _count("16 one writer")


def _slow_writes(seconds: float):
    """Make every rank-file write of this process take ``seconds`` longer (a save then stays in flight);
    returns the undo."""
    import functional_ema._checkpoint.writer as ckwriter

    real = ckwriter.write_rank_file

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    ckwriter.write_rank_file = slow
    import functional_ema.checkpoint as ckmod

    real_ck = ckmod.write_rank_file
    ckmod.write_rank_file = slow

    def undo():
        ckwriter.write_rank_file = real
        ckmod.write_rank_file = real_ck

    return undo


def test_model_parallel_parts_write_their_own_files_and_unreachable_groups_refused(faults):
    """2 ranks: DeepSpeed engines with an mpu= (tensor parallel 2) or a PipelineEngine (2 stages), whose
    two model-parallel ranks used to write the same file names, write one file per part (named by it) and
    load their own. A save after destroy_process_group is refused before touching anything (it used to
    commit rank 0's file alone)."""
    _, results = faults
    for rank, r in enumerate(results):
        assert r["mpu_files"] == [
            ck.MANIFEST_NAME,
            "ema_tp000of002_pp000of001_rank_00000_of_00001.safetensors",
            "ema_tp001of002_pp000of001_rank_00000_of_00001.safetensors",
        ], r["mpu_files"]
        assert r["pipe_files"] == [
            ck.MANIFEST_NAME,
            "ema_tp000of001_pp000of002_rank_00000_of_00001.safetensors",
            "ema_tp000of001_pp001of002_rank_00000_of_00001.safetensors",
        ], r["pipe_files"]
        assert r["mpu_load"] and r["pipe_load"] and r["pipe_snapshot_load"], rank
        for key in ("destroyed_save", "destroyed_async"):
            name, msg, _, _ = r[key]
            assert name == "CheckpointError" and "spans 2 ranks but torch.distributed is not initialized" in msg, (
                key,
                msg,
            )
        assert r["destroyed_unchanged"], rank
    _count("16 one writer", 5)


def test_manifest_claiming_another_part_refused(faults, tmp_path):
    """A manifest edited to give a part another tensor-parallel rank or stage: refused naming the field, whether
    the file names are left (they no longer match) or renamed to match (the files' checksummed headers say
    which part they hold)."""
    for what, key in (("mpu", "tp"), ("pipe", "pp")):
        d = _copy(faults, tmp_path, f"mp/{what}")
        tdir = d / "t"
        good = (tdir / ck.MANIFEST_NAME).read_text()

        def swap(m):
            a, b = m["parts"][0]["part"], m["parts"][1]["part"]
            a[key], b[key] = b[key], a[key]

        _edit_manifest(tdir, swap)
        _expect(
            ck.CorruptCheckpointError,
            ["parts[0].files[0].file", "rank 0 of world_size 1"],
            lambda: fe.consolidate(d, "t"),
            d,
        )
        # the forger also renames the files to the claimed parts
        names = [e["file"] for p in json.loads(good)["parts"] for e in p["files"]]
        for n in names:
            (tdir / n).rename(tdir / (n + ".x"))
        for n, m in zip(names, reversed(names)):
            (tdir / (n + ".x")).rename(tdir / m)

        def fix(m):
            for p in m["parts"]:
                for e in p["files"]:
                    e["file"] = names[1 - names.index(e["file"])]

        _edit_manifest(tdir, fix)
        _expect(ck.CorruptCheckpointError, ["layout metadata field 'part'"], lambda: fe.consolidate(d, "t"), d)
        (tdir / ck.MANIFEST_NAME).write_text(good)
        for n in names:
            (tdir / n).rename(tdir / (n + ".x"))
        for n, m in zip(names, reversed(names)):
            (tdir / (n + ".x")).rename(tdir / m)
        _count("16 one writer", 2)
    # Untouched, the pipeline's stages consolidate into one file of both stages' parameters.
    d = _copy(faults, tmp_path / "again", "mp/pipe")
    assert sorted(fe.consolidate(d, "t")) == ["0.bias", "0.weight", "2.bias", "2.weight"]


# ------------------------------------------------------------------- class 17: fork (issue 21)


def test_forked_child_neither_hangs_nor_drops_the_parents_save(tmp_path):
    """A child forked while an async save is in flight: its wait() and save() raise a clear error (once),
    then its own saves work; the parent's save completes in the parent."""
    net = _bn_net()
    state = fe.init_ema(fe.local_shards(net))
    saver = fe.AsyncSaver()
    report = tmp_path / "child.json"
    undo = _slow_writes(1.0)
    try:
        handle = saver.save(state, net, tmp_path, "parent")
        pid = os.fork()
        if pid == 0:  # the child: never returns
            out = {}
            try:
                t0 = time.monotonic()
                out["handle_wait"] = _err(lambda: handle.wait(timeout=30))
                out["saver_wait"] = _err(saver.wait)  # already raised through the handle: nothing more
                out["own_save"] = _err(lambda: saver.save(state, net, tmp_path, "child").wait(timeout=60))
                out["seconds"] = time.monotonic() - t0
            finally:
                report.write_text(json.dumps(out))
                os._exit(0)
        assert handle.wait(timeout=60) == tmp_path / "parent"
        os.waitpid(pid, 0)
        handle2 = saver.save(state, net, tmp_path, "parent2")
        pid = os.fork()  # a second child, forked while a save is in flight, that calls save() first
        if pid == 0:
            out = {}
            try:
                out["save_first"] = _err(lambda: saver.save(state, net, tmp_path, "child2"))
                out["save_again"] = _err(lambda: saver.save(state, net, tmp_path, "child2").wait(timeout=60))
            finally:
                (tmp_path / "child2.json").write_text(json.dumps(out))
                os._exit(0)
        os.waitpid(pid, 0)
        handle2.wait(timeout=60)
    finally:
        undo()
    child = json.loads(report.read_text())
    name, msg, _, _ = child["handle_wait"]
    assert name == "CheckpointError" and "was forked from pid" in msg and "written by the parent" in msg, msg
    assert child["saver_wait"] is None and child["own_save"] is None and child["seconds"] < 30, child
    child2 = json.loads((tmp_path / "child2.json").read_text())
    name, msg, _, _ = child2["save_first"]
    assert name == "CheckpointError" and "was forked from pid" in msg, child2
    assert child2["save_again"] is None, child2
    for tag in ("parent", "parent2", "child", "child2"):
        assert _tensors_equal(fe.load(net, tmp_path, tag), state), tag
    _count("17 fork", 3)


# --------------------------------------------------------------- class 11: the harness reports hangs


def hang_worker():
    """Rank 0 returns; rank 1 blocks in a collective that rank 0 never joins."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.barrier()
    else:
        time.sleep(60)
    return None


def test_run_ranks_reports_which_rank_waited_where():
    """Class 11: a hung launch fails at its timeout with every waiting rank's Python stacks."""
    from functional_ema._testing.multirank import run_ranks

    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks("tests.test_faults:hang_worker", world_size=2, timeout=15, env={"FE_DIST_INIT": "torch"})
    msg = str(info.value)
    assert time.monotonic() - t0 < 35
    assert "timeout after 15 s" in msg and "rank(s) [0, 1] of 2 still running" in msg, msg[:500]
    r1 = msg[msg.index("--- rank 1") :]
    assert "in hang_worker" in r1 and "barrier" in r1, r1[-3000:]
    assert "time.sleep" in msg or "in hang_worker" in msg[: msg.index("--- rank 1")]
    _count("11 harness")


def fail_then_hang_worker():
    """Rank 0 fails at once; rank 1 is stuck in something that never notices (a long sleep)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    raise RuntimeError("rank 0 failed early")


def test_run_ranks_ends_soon_after_a_rank_fails(monkeypatch):
    """Class 11: a rank that fails ends the launch FAILED_RANK_GRACE_S later, not at the timeout, and the
    report carries that rank's error and the waiting rank's stacks (the grace cut to 5 s here)."""
    from functional_ema._testing import multirank
    from functional_ema._testing.multirank import run_ranks

    grace = 5.0
    monkeypatch.setattr(multirank, "FAILED_RANK_GRACE_S", grace)
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks("tests.test_faults:fail_then_hang_worker", world_size=2, timeout=600, env={"FE_DIST_INIT": "torch"})
    msg = str(info.value)
    assert time.monotonic() - t0 < grace + 30, time.monotonic() - t0
    assert "after rank 0 failed" in msg and "rank(s) [1] of 2 still running" in msg, msg[:500]
    assert "rank 0 failed early" in msg and "in fail_then_hang_worker" in msg[msg.index("--- rank 1") :], msg[-3000:]
    _count("11 harness")


# ---------------------------------------------------------- class 12: odd API values (issue 21, item 5)


def test_odd_api_values_refused_before_anything_moves():
    """Class 12: odd values for init_ema / update and the buffers' init_buffers / update_buffers
    (hand-made step counters, steps past the counter, dtype and num_emas of the wrong type or an
    unsupported dtype, decay callables giving no real number, meta tensors) are refused with an
    error naming the argument, before any tensor of the state moves: the step and every EMA tensor
    (segments and copied buffers included) are compared with ``torch.equal`` before and after.
    In process, no ranks."""
    import warnings

    from torch import nn

    def weights(fused: bool = True):
        buf = torch.randn(16, generator=torch.Generator().manual_seed(0))
        views = {"w.a": buf[1:6], "w.b": buf[8:14]}
        return fe.Shards.from_views(views) if fused else dict(views)

    def state_and_weights(fused: bool = True, counter=None, meta_ema: bool = False):
        w = weights(fused)
        state = fe.init_ema(w)
        emas = state.emas
        if meta_ema:
            emas = (
                w.mirror(torch.float32, device="meta", fill=False)
                if fused
                else {n: torch.empty(t.shape, device="meta") for n, t in w.items()},
            )
        state = fe.EmaState(state.step if counter is None else counter, emas)
        with torch.no_grad():
            for t in w.values():
                t.add_(1.0)  # new weights: an update that went through would move the EMA
        return state, w

    def meta_weights(fused: bool):
        w = weights(True)
        if fused:
            return w.mirror(torch.float32, device="meta", fill=False)  # the same layout: the fused path
        return {n: torch.empty(t.shape, device="meta") for n, t in w.items()}

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))

    def buffers_and_net(counter=None):
        m = net()
        b = fe.buffers.init_buffers(m)
        m(torch.randn(8, 3))  # the live buffers move; the buffer state must not
        return fe.buffers.BufferState(b.step if counter is None else counter, b.emas, b.copied), m

    def update_case(counter=None, fused=True, meta_ema=False, step=None, **kw):
        def make():
            state, w = state_and_weights(fused, counter, meta_ema)
            return state, lambda: fe.update(state, w, step, **kw)

        return make

    def init_case(fused=True, meta=False, **kw):
        def make():
            w = meta_weights(fused) if meta else weights(fused)
            return w, lambda: fe.init_ema(w, **kw)

        return make

    def meta_update_case(fused):
        def make():
            state, _ = state_and_weights(fused)
            return state, lambda: fe.update(state, meta_weights(fused))

        return make

    def update_buffers_case(counter=None, step=None, **kw):
        def make():
            b, m = buffers_and_net(counter)
            return b, lambda: fe.buffers.update_buffers(b, m, step, **kw)

        return make

    def init_buffers_case(**kw):
        def make():
            m = net()
            return m, lambda: fe.buffers.init_buffers(m, **kw)

        return make

    def at_max_step():
        state, w = state_and_weights()
        state.step.fill_(2**63 - 1)
        return state, lambda: fe.update(state, w, decay=0.5)

    i32 = torch.tensor(2**31 - 1, dtype=torch.int32)
    counter = "state.step must be an int64 scalar tensor"
    unsupported = "is not a supported EMA dtype"
    callable_ = "the decay callable 'test_odd_api_values_refused_before_anything_moves.<locals>.<lambda>'"
    table = [
        # (what, expected error, fragment(s) naming the argument, case)
        ("update: state.step a Python int (Shards)", TypeError, counter, update_case(0)),
        ("update: state.step a Python int (dict)", TypeError, counter, update_case(0, fused=False)),
        ("update: state.step int32 at 2**31 - 1", TypeError, counter, update_case(i32)),
        ("update: state.step float", TypeError, counter, update_case(torch.tensor(0.0))),
        ("update: state.step two elements", ValueError, counter, update_case(torch.tensor([0, 0]))),
        ("update: state.step on meta", ValueError, counter, update_case(torch.tensor(0, device="meta"))),
        ("update: state.step negative", ValueError, "state.step must be >= 0", update_case(torch.tensor(-2))),
        ("update: step=None past the int64 counter", ValueError, "update(step=None)", at_max_step),
        ("update: step=2**63", ValueError, "update(step=9223372036854775808) does not fit", update_case(step=2**63)),
        ("init_ema: dtype='float32'", TypeError, "dtype must be a torch.dtype", init_case(dtype="float32")),
        (
            "init_ema: dtype=float8_e4m3fn",
            TypeError,
            f"dtype=torch.float8_e4m3fn {unsupported}",
            init_case(dtype=torch.float8_e4m3fn),
        ),
        (
            "init_ema: dtype=float8_e5m2",
            TypeError,
            f"dtype=torch.float8_e5m2 {unsupported}",
            init_case(dtype=torch.float8_e5m2),
        ),
        ("init_ema: dtype=int32", TypeError, f"dtype=torch.int32 {unsupported}", init_case(dtype=torch.int32)),
        ("init_ema: dtype=bool", TypeError, f"dtype=torch.bool {unsupported}", init_case(dtype=torch.bool)),
        (
            "init_ema: dtype=complex64",
            TypeError,
            f"dtype=torch.complex64 {unsupported}",
            init_case(dtype=torch.complex64),
        ),
        ("init_ema: num_emas='2'", TypeError, "num_emas must be an int >= 1", init_case(num_emas="2")),
        ("init_ema: num_emas=2.0", TypeError, "num_emas must be an int >= 1", init_case(num_emas=2.0)),
        ("init_ema: num_emas=True", TypeError, "num_emas must be an int >= 1", init_case(num_emas=True)),
        (
            "update: decay callable gives None",
            TypeError,
            (callable_, "gave None at step 1"),
            update_case(decay=lambda s: None),
        ),
        (
            "update: decay callable gives a str",
            TypeError,
            (callable_, "gave '0.5' (a str) at step 1"),
            update_case(decay=lambda s: "0.5"),
        ),
        (
            "update: decay callable gives 2 elements",
            TypeError,
            (callable_, "shape (2,)", "at step 1"),
            update_case(decay=lambda s: torch.ones(2)),
        ),
        (
            "update: decay callable gives complex",
            TypeError,
            (callable_, "gave 0.5j (a complex) at step 1"),
            update_case(fused=False, decay=lambda s: 0.5j),
        ),
        ("init_ema: meta Shards", ValueError, "shards['w.a'] is on the meta device", init_case(meta=True)),
        ("init_ema: meta dict", ValueError, "shards['w.a'] is on the meta device", init_case(fused=False, meta=True)),
        ("init_ema: device='meta'", ValueError, "device='meta'", init_case(device="meta")),
        ("update: meta Shards (fused path)", ValueError, "shards['w.a'] is on the meta device", meta_update_case(True)),
        ("update: meta dict", ValueError, "shards['w.a'] is on the meta device", meta_update_case(False)),
        (
            "update: EMA state on meta (Shards)",
            ValueError,
            "state.emas[0]['w.a'] is on the meta device",
            update_case(meta_ema=True),
        ),
        (
            "update: EMA state on meta (dict)",
            ValueError,
            "state.emas[0]['w.a'] is on the meta device",
            update_case(fused=False, meta_ema=True),
        ),
        ("init_buffers: dtype='float32'", TypeError, "dtype must be a torch.dtype", init_buffers_case(dtype="float32")),
        (
            "init_buffers: dtype=float8_e4m3fn",
            TypeError,
            f"dtype=torch.float8_e4m3fn {unsupported}",
            init_buffers_case(dtype=torch.float8_e4m3fn),
        ),
        ("init_buffers: num_emas='2'", TypeError, "num_emas must be an int >= 1", init_buffers_case(num_emas="2")),
        ("init_buffers: num_emas=2.0", TypeError, "num_emas must be an int >= 1", init_buffers_case(num_emas=2.0)),
        ("init_buffers: step='5'", TypeError, "step must be an int", init_buffers_case(step="5")),
        ("update_buffers: bstate.step a Python int", TypeError, "b" + counter, update_buffers_case(0)),
        ("update_buffers: bstate.step int32", TypeError, "b" + counter, update_buffers_case(i32)),
        ("update_buffers: step=2.7", TypeError, "step must be an int", update_buffers_case(step=2.7)),
        (
            "update_buffers: decay callable gives None",
            TypeError,
            (callable_, "gave None at step 1"),
            update_buffers_case(decay=lambda s: None),
        ),
    ]

    def tensors(obj) -> list:
        if isinstance(obj, nn.Module):
            return list(obj.buffers())
        if isinstance(obj, (fe.EmaState, fe.buffers.BufferState)):
            out = [obj.step] + [t for ema in obj.emas for t in ema.values()]
            out += [t for ema in obj.emas if isinstance(ema, fe.Shards) for t in ema.segments]
            return out + (list(obj.copied.values()) if isinstance(obj, fe.buffers.BufferState) else [])
        return list(obj.values())

    def frozen(obj) -> list:
        return [t.clone() if isinstance(t, torch.Tensor) and not t.is_meta else t for t in tensors(obj)]

    def same(before: list, after: list) -> bool:
        def eq(a, b):
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                return type(a) is type(b) and a == b
            if a.is_meta or b.is_meta:
                return a.is_meta and b.is_meta and a.shape == b.shape
            return a.dtype == b.dtype and torch.equal(a, b)

        return len(before) == len(after) and all(eq(a, b) for a, b in zip(before, after))

    failures = []
    for what, err, fragment, make in table:
        watched, call = make()
        before = frozen(watched)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the type and message are checked below
                got = e
            else:
                got = None
        fragments = (fragment,) if isinstance(fragment, str) else fragment
        if type(got) is not err or not all(f in str(got) for f in fragments):
            failures.append(f"{what}: expected {err.__name__} with {fragments}, got {type(got).__name__}: {got}")
        elif not same(before, frozen(watched)):
            failures.append(f"{what}: refused, but the state changed")
    assert not failures, "\n".join(failures)
    _count("12 API values", len(table))


def test_zz_case_counts(capsys):
    """Prints the number of cases per class (for docs/reliability.md)."""
    with capsys.disabled():
        print("\nfault cases per class:", json.dumps(CASES, sort_keys=True), "total", sum(CASES.values()))
