"""Asynchronous EMA save (functional_ema._async) on real multi-rank DeepSpeed engines (gloo, CPU).

Two launches, many checks each (assertions run here, in the parent):

* ``world2``: async saves at ZeRO 0/2/3 equal the state at the call (load and consolidate); the
  snapshot buffer is reused; updates (and training collectives) during the background write do
  not change what is written; a second call waits for the first; a write failure on rank 1 or on
  rank 0 reaches ``wait()`` on every rank, and the next call on every rank when nobody waited; the
  format-1 checkpoint in tests/data/ckpt_v1 loads (same layout and resharded) and re-saves.
* ``world1``: a forked process SIGKILLed at every fsync / rename / unlink / tensor write of the
  background part leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from functional_ema._testing.multirank import (
    ROOT,
    advance,
    checkpoint_decays,
    current_rank,
    diff_emas,
    error_of,
    fork_and_kill,
    gather_all,
    make_engine,
    run_ranks,
    unflat,
)

V1 = ROOT / "tests" / "data" / "ckpt_v1"


def _clone(state) -> list:
    return [{n: t.detach().clone() for n, t in e.items()} for e in state.emas]


def _markers(tag_dir: Path) -> list:
    return sorted(p for p in os.listdir(tag_dir) if p.startswith("ema_async."))


class _Gate:
    """Holds every background StreamingWriter.write until opened (the training thread goes on)."""

    def __init__(self):
        from functional_ema import _io

        self.io, self.orig = _io, _io.StreamingWriter.write
        self.entered, self.open = threading.Event(), threading.Event()
        gate = self

        def write(w, key, tensor):
            gate.entered.set()
            gate.open.wait(120)
            return gate.orig(w, key, tensor)

        _io.StreamingWriter.write = write

    def release(self):
        self.open.set()
        self.io.StreamingWriter.write = self.orig


class _Failing:
    """StreamingWriter.write raises ENOSPC on ``rank`` (the background write fails there)."""

    def __init__(self, rank: int):
        from functional_ema import _io

        self.io, self.orig = _io, _io.StreamingWriter.write
        me, orig = current_rank(), self.orig

        def write(w, key, tensor):
            if me == rank:
                raise OSError(28, "No space left on device (simulated)")
            return orig(w, key, tensor)

        _io.StreamingWriter.write = write

    def restore(self):
        self.io.StreamingWriter.write = self.orig


# ------------------------------------------------------------------------------ world 2 worker


def world2_worker(root):
    import torch.distributed as dist

    import functional_ema as fe

    rank, out = current_rank(), {}
    root = Path(root)

    # 1. Async saves at ZeRO 0 / 2 / 3 equal the state at the call.
    for stage in (0, 2, 3):
        d = root / f"basic_s{stage}"
        engine = make_engine(stage, "fp32")
        state = advance(engine, fe.init_ema(fe.local_shards(engine), num_emas=2), 2)
        want = gather_all(state, engine)
        saver = fe.AsyncSaver()
        h = saver.save(state, engine, d, decay=checkpoint_decays())
        tag_dir = h.wait()
        dist.barrier()  # rank 0 removes the markers after its manifest; list after every rank is done
        loaded = fe.load(engine, d, tag_dir.name)
        rep = {
            "files": sorted(f for f in os.listdir(tag_dir)),
            "tag": tag_dir.name,
            "loaded": diff_emas(list(loaded.emas), list(state.emas)),
            "step": int(loaded.step),
        }
        if rank == 0:
            rep["consolidated"] = diff_emas([fe.consolidate(d, tag_dir.name, index=i) for i in range(2)], want)
            rep["manifest"] = {
                k: v
                for k, v in fe.checkpoint.read_manifest(d, tag_dir.name).items()
                if k in ("format_version", "checksum", "save_id", "generation", "schedules")
            }
        out[f"basic_s{stage}"] = rep
        if stage != 2:
            engine = None  # drop this configuration's engine before the next one is built
            continue

        # 2. The snapshot buffer is reused; saving into the same tag again swaps generations.
        ptr = h._buffer.data_ptr()  # still held by the finished handle; the next save takes it over
        state = advance(engine, state, 1)
        h2 = saver.save(state, engine, d, tag_dir.name)
        reused = h2._buffer.data_ptr() == ptr
        h2.wait()
        dist.barrier()
        again = fe.load(engine, d, tag_dir.name)
        out["same_tag"] = {
            "reused": reused,
            "files": sorted(os.listdir(tag_dir)),
            "loaded": diff_emas(list(again.emas), list(state.emas)),
            "step": int(again.step),
        }

        # 3. Updates (with DeepSpeed's collectives) while the write is held: the file has the state at the call.
        at_call = _clone(state)
        gate = _Gate()
        try:
            t0 = time.perf_counter()
            h3 = saver.save(state, engine, d, "t_upd")
            returned_in = time.perf_counter() - t0
            gate.entered.wait(60)
            state = advance(engine, state, 3)
            changed = bool(diff_emas(list(state.emas), at_call))
            pending = not h3.done()
        finally:
            gate.release()
        h3.wait()
        got = fe.load(engine, d, "t_upd")
        out["update_during_save"] = {
            "changed": changed,
            "pending": pending,
            "returned_in": returned_in,
            "loaded": diff_emas(list(got.emas), at_call),
            "step": int(got.step),
        }

        # 4. A second call waits for the first (one save in flight by default).
        gate = _Gate()
        h4 = saver.save(state, engine, d, "t_a")
        gate.entered.wait(60)
        threading.Timer(0.5, gate.release).start()
        t0 = time.perf_counter()
        h5 = saver.save(state, engine, d, "t_b")
        waited = time.perf_counter() - t0
        out["second_call"] = {"waited": waited, "first_done": h4.done(), "second_ok": str(h5.wait())}

        # 5. A background failure on one rank reaches wait() on every rank; nothing is marked complete.
        for bad in (1, 0):
            s2 = fe.AsyncSaver()
            fail = _Failing(bad)
            try:
                h = s2.save(state, engine, d, f"t_err{bad}")
                h._event.wait(120)
            finally:
                fail.restore()
            first, second = error_of(h.wait), error_of(h.wait)
            dist.barrier()
            out[f"error_rank{bad}"] = {
                "wait": first,
                "wait_again": second == first,
                "files": sorted(os.listdir(d / f"t_err{bad}")),
                "previous_loads": error_of(lambda: fe.load(engine, d, "t_upd")),
                "next_call_after_wait": error_of(lambda: s2.save(state, engine, d, f"t_fine{bad}").wait()),
            }

        # 6. Nobody waited: the next call raises the failure on every rank; the one after it works.
        s3 = fe.AsyncSaver()
        fail = _Failing(1)
        try:
            h = s3.save(state, engine, d, "t_err_next")
            h._event.wait(120)
        finally:
            fail.restore()
        out["error_next_call"] = {
            "next": error_of(lambda: s3.save(state, engine, d, "t_after")),
            "after": error_of(lambda: s3.save(state, engine, d, "t_after").wait()),
            "loads": diff_emas(list(fe.load(engine, d, "t_after").emas), list(state.emas)),
            "wait_raises": error_of(h.wait) is not None,
        }
        s3.wait()
        engine = None  # drop this configuration's engine before the next one is built

    # 7. The format-1 checkpoint (CRC-32, written by the previous code) loads, resharded too, and re-saves.
    ref = unflat(torch_load_ref())
    for stage in (2, 3):
        engine = make_engine(stage, "fp32", seed=5)
        st = fe.load(engine, V1)
        rep = {"loaded": diff_emas(gather_all(st, engine), ref), "step": int(st.step)}
        h = fe.AsyncSaver().save(st, engine, root / f"v1_resaved_s{stage}", "global_step3")
        h.wait()
        dist.barrier()
        if rank == 0:
            rep["resaved"] = diff_emas(
                [fe.consolidate(root / f"v1_resaved_s{stage}", "global_step3", index=i) for i in range(2)], ref
            )
            rep["resaved_version"] = fe.checkpoint.read_manifest(root / f"v1_resaved_s{stage}", "global_step3")[
                "format_version"
            ]
        out[f"v1_s{stage}"] = rep
        engine = None  # drop this configuration's engine before the next one is built
    return out


def torch_load_ref():
    from safetensors.torch import load_file

    return load_file(str(V1 / "reference_full.safetensors"))


# ------------------------------------------------------------------------------ world 1 worker


def _fork_async_save(state, engine, save_dir, tag, kill_at: int, count_file: Path | None = None) -> int:
    """AsyncSaver.save + wait in a forked child that SIGKILLs itself at its ``kill_at``-th fsync, rename,
    unlink or tensor write (all of them in the background thread: the call itself makes none)."""
    import functional_ema as fe
    from functional_ema import _io

    main = threading.get_ident()

    def only_in_background():
        if threading.get_ident() == main:
            os.write(2, b"I/O call from the calling thread\n")
            os._exit(4)

    def install(hook):
        os.fsync, os.replace, os.unlink = hook(os.fsync), hook(os.replace), hook(os.unlink)
        _io.StreamingWriter.write = hook(_io.StreamingWriter.write)

    return fork_and_kill(
        lambda: fe.AsyncSaver().save(state, engine, save_dir, tag).wait(),
        install,
        kill_at,
        count_file,
        on_call=only_in_background,
    )


def world1_kill_worker(root):
    import functional_ema as fe
    from functional_ema.checkpoint import IncompleteCheckpointError

    d = Path(root) / "ckpt"
    engine = make_engine(2, "fp32")
    state = advance(engine, fe.init_ema(fe.local_shards(engine), num_emas=2), 2)
    fe.save(state, engine, d, "t1")
    (d / "latest").write_text("t1")
    old = _clone(state)
    pristine = Path(root) / "pristine"
    shutil.copytree(d, pristine)
    state = advance(engine, state, 1)
    new = _clone(state)

    def loaded(tag=None):
        return list(fe.load(engine, d, tag).emas)

    report = {}
    for scenario, tag in (("new_tag", "t2"), ("same_tag", "t1")):
        count_file = Path(root) / "count.txt"
        status = _fork_async_save(state, engine, d, tag, kill_at=-1, count_file=count_file)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        n_calls = int(count_file.read_text())
        outcomes = []
        for i in range(1, n_calls + 1):
            shutil.rmtree(d)
            shutil.copytree(pristine, d)
            status = _fork_async_save(state, engine, d, tag, kill_at=i)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            if scenario == "new_tag":
                previous_ok = not diff_emas(loaded(), old)
                try:
                    got = "new" if not diff_emas(loaded("t2"), new) else "wrong"
                except IncompleteCheckpointError:
                    got = "incomplete"
            else:
                now = loaded()
                got = "new" if not diff_emas(now, new) else ("old" if not diff_emas(now, old) else "wrong")
                previous_ok = got in ("old", "new")
            leftovers = sorted(os.listdir(d / tag))
            fe.AsyncSaver().save(state, engine, d, tag).wait()  # a later save succeeds and clears the debris
            outcomes.append(
                {
                    "i": i,
                    "killed": killed,
                    "previous_ok": previous_ok,
                    "state": got,
                    "leftovers": leftovers,
                    "after": sorted(os.listdir(d / tag)),
                    "after_loads_new": not diff_emas(loaded(tag), new),
                }
            )
        report[scenario] = {"calls": n_calls, "outcomes": outcomes}
    return report


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_ranks("tests.test_async_save:world2_worker", world_size=2, root=str(tmp_path_factory.mktemp("async2")))


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return run_ranks(
        "tests.test_async_save:world1_kill_worker", world_size=1, root=str(tmp_path_factory.mktemp("async1"))
    )[0]


# --------------------------------------------------------------------------------------- tests


def test_async_save_equals_state_at_call(world2):
    for rank, rep in enumerate(world2):
        for stage in (0, 2, 3):
            r = rep[f"basic_s{stage}"]
            where = f"stage {stage} rank {rank}"
            assert r["loaded"] == [] and r["step"] == 2, (where, r["loaded"][:5])
            ours = [f for f in r["files"] if f.startswith("ema_")]
            n_files = 1 if stage == 0 else 2
            assert ours == ["ema_manifest.json"] + [f"ema_rank_{i:05d}_of_00002.safetensors" for i in range(n_files)], (
                where,
                r["files"],
            )
            if rank == 0:
                assert r["consolidated"] == [], where
                m = r["manifest"]
                assert m["format_version"] == 5 and m["checksum"] == "xxh3_64" and len(m["save_id"]) == 16, m
                assert m["schedules"][0] == {"kind": "constant", "decay": 0.8}


def test_snapshot_buffer_reused_and_same_tag_swaps_generation(world2):
    for rank, rep in enumerate(world2):
        r = rep["same_tag"]
        assert r["reused"], rank
        assert r["loaded"] == [] and r["step"] == 3, r
        ours = [f for f in r["files"] if f.startswith("ema_")]
        assert ours == [
            "ema_manifest.json",
            "ema_rank_00000_of_00002.gen1.safetensors",
            "ema_rank_00001_of_00002.gen1.safetensors",
        ], r["files"]  # old generation and markers removed


def test_update_during_async_save_does_not_change_what_is_written(world2):
    for rank, rep in enumerate(world2):
        r = rep["update_during_save"]
        assert r["pending"], "the write was not held while updating"
        assert r["changed"], "the updates did not change the EMA: the check would be vacuous"
        assert r["loaded"] == [], f"rank {rank}: saved EMA != state at the call: {r['loaded'][:5]}"
        assert r["step"] == 3


def test_second_call_waits_for_the_first(world2):
    for rep in world2:
        r = rep["second_call"]
        assert r["waited"] >= 0.4 and r["first_done"], r
        assert r["second_ok"].endswith("t_b")


def test_background_error_reaches_every_rank(world2):
    for bad in (1, 0):
        for rank, rep in enumerate(world2):
            r = rep[f"error_rank{bad}"]
            name, msg, mro = r["wait"]
            if rank == bad:
                assert name == "OSError" and "No space left on device" in msg, r["wait"]
            else:
                assert "CheckpointError" in mro and f"failed on rank {bad}" in msg and "No space left" in msg, r["wait"]
            assert r["wait_again"], "wait() must raise the failure every time"
            assert "ema_manifest.json" not in r["files"], r["files"]
            assert r["previous_loads"] is None, r["previous_loads"]
            assert r["next_call_after_wait"] is None, r["next_call_after_wait"]  # wait() raised it: the next save works


def test_background_error_raised_by_next_call_when_nobody_waited(world2):
    for _rank, rep in enumerate(world2):
        r = rep["error_next_call"]
        _name, msg, mro = r["next"]
        assert "CheckpointError" in mro and "No space left on device" in msg, r["next"]
        assert "previous async EMA save" in msg or "failed on rank" in msg, msg
        assert r["after"] is None and r["loads"] == [] and r["wait_raises"], r


def test_format1_checkpoint_loads_and_resaves(world2):
    for rank, rep in enumerate(world2):
        for stage in (2, 3):
            r = rep[f"v1_s{stage}"]
            assert r["loaded"] == [] and r["step"] == 3, (rank, stage, r["loaded"][:5])
            if rank == 0:
                assert r["resaved"] == [] and r["resaved_version"] == 5, r  # every save writes format 5


def test_sigkill_during_background_write_keeps_previous(world1):
    for scenario, rep in world1.items():
        # per rank file: 18 tensors x 2 EMAs written + fsync, rename, dir fsync; then the manifest's 3
        assert rep["calls"] >= 10, rep["calls"]
        seen = set()
        for o in rep["outcomes"]:
            where = f"{scenario}, killed at call {o['i']} of {rep['calls']}"
            assert o["killed"], where
            assert o["previous_ok"], f"{where}: the previous checkpoint no longer loads"
            assert o["state"] in (("incomplete", "new") if scenario == "new_tag" else ("old", "new")), where
            seen.add(o["state"])
            assert o["after_loads_new"], where
            assert not any(".tmp-" in f or f.startswith("ema_async.") for f in o["after"]), o["after"]
            assert sum(f.startswith("ema_rank_") for f in o["after"]) == 1, o["after"]
        assert seen == ({"incomplete", "new"} if scenario == "new_tag" else {"old", "new"}), (scenario, seen)


def test_ranks_find_their_save_id_in_the_manifest_head(tmp_path):
    """The ranks other than 0 learn that rank 0 committed their async save from the manifest's head: its
    ``save_id`` is written before the parameter and file records, which grow with world size x parameters."""
    import torch

    from functional_ema import ShardLayout, ShardSpec, _async
    from functional_ema._testing.files import write_simulated

    shapes = {f"layer{i}.weight": (64,) for i in range(300)}
    world = 32

    def layout(rank: int) -> ShardLayout:
        return ShardLayout(rank, world, 3, {n: ShardSpec(s, rank * 2, 2) for n, s in shapes.items()})

    def pieces(lay: ShardLayout) -> tuple:
        return ({n: torch.full((s.numel,), float(lay.rank)) for n, s in lay.specs.items()},)

    token = "0123456789abcdef"
    write_simulated(tmp_path, "t", [layout(r) for r in range(world)], pieces, save_id=token)
    mpath = tmp_path / "t" / "ema_manifest.json"
    raw = mpath.read_bytes()
    assert len(raw) > 2 * _async._SAVE_ID_WITHIN and raw.index(b'"save_id"') < 4096, len(raw)
    assert _async._is_save(mpath, token) and not _async._is_save(mpath, "fedcba9876543210")
