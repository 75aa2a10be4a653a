"""Asynchronous EMA save (functional_ema._async) on real multi-rank DeepSpeed engines (gloo, CPU).

Two launches, many checks each (assertions run here, in the parent):

* ``world2``: async saves at ZeRO 0/2/3 equal the state at the call (load and consolidate); the
  snapshot buffer is reused; updates (and training collectives) during the background write do
  not change what is written; a second call waits for the first; a write failure on rank 1 or on
  rank 0 reaches ``wait()`` on every rank, and the next call on every rank when nobody waited; the
  format-1 checkpoint in tests/data/ckpt_v1 loads (same layout and resharded) and re-saves.
* ``world1``: a forked process SIGKILLed at every fsync / rename / unlink / tensor write of the
  background part leaves the previous checkpoint loadable.

Without a process group (a plain module is a world of one; fast, and what ``make mutate`` reruns per
mutant): the written state is the state at the call, bitwise; argument checks and their messages; the
handle's states; errors and their messages (next call, ``wait``, the context manager, a forked child);
the in-flight limit, the tag lock and generations; markers and temporary files cleaned up; and the
commit between ranks (marker files, polling, timeouts) with ``_run`` of two simulated ranks in threads.

``test_async_ranks_*`` (plain torch.distributed, DDP models): the rank-dependent checks, batched into
one launch of 2 ranks and one of 4 (two groups of one job).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
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
    kept = {}  # the ZeRO-2 and ZeRO-3 engines, reused by 7 (a load needs only their layout)
    for stage in (0, 2, 3):
        d = root / f"basic_s{stage}"
        engine = make_engine(stage, "fp32")
        if stage:
            kept[stage] = engine
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
        engine = kept.pop(stage)
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
            # The later save removes every temporary but a marker's; the killed save's markers stay (rank 0 died before
            # writing its error marker: nothing says no rank of it still reads them), no marker of the later save
            assert not any(".tmp-" in f and not f.startswith("ema_async.") for f in o["after"]), o["after"]
            assert {f for f in o["after"] if f.startswith("ema_async.")} <= set(o["leftovers"]), o
            assert ".ema_generation" not in o["after"], o["after"]
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


# ------------------------------------------------------------------ single process (no process group)
#
# A plain module is a world of one: AsyncSaver.save runs its whole protocol in this process (rank 0
# takes the tag lock, snapshots, writes and commits in the background thread). The commit between
# ranks (marker files, polling) is exercised by running ``_run`` for two simulated ranks in threads.

ENOSPC = "[Errno 28] No space left on device (simulated)"


def _model(seed: int = 0, width: int = 3):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width))


def _state(model, dtype=None, num_emas: int = 2, step: int = 3, shards: bool = True):
    """An EMA state of ``model`` whose EMAs differ from the weights and from each other."""
    import torch

    import functional_ema as fe

    tree = fe.local_shards(model) if shards else {n: p.detach() for n, p in model.named_parameters()}
    state = fe.init_ema(tree, num_emas=num_emas, dtype=dtype or torch.float32, step=step)
    with torch.no_grad():
        for e in state.emas:
            for t in e.values():
                t.copy_(torch.randn_like(t))
    return state


def _buffers(model, step: int = 3):
    import torch

    from functional_ema.buffers import init_buffers

    b = init_buffers(model, num_emas=2, step=step)
    with torch.no_grad():
        for e in b.emas:
            for t in e.values():
                t.copy_(torch.randn_like(t))
        for t in b.copied.values():
            t.fill_(7)
    return b


def _bump(tensors) -> None:
    """Change every tensor in place (the caller's state after the call)."""
    import torch

    with torch.no_grad():
        for t in tensors:
            t.add_(1)


def _same_trees(got, want) -> bool:
    import torch

    return len(got) == len(want) and all(
        sorted(g) == sorted(w) and all(g[n].dtype == w[n].dtype and torch.equal(g[n], w[n]) for n in w)
        for g, w in zip(got, want)
    )


def _wait_done(h, limit: float = 20.0) -> None:
    """Wait for a handle through done() only (its failure stays unraised on this rank)."""
    deadline = time.monotonic() + limit
    while not h.done():
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.005)


class _Hold:
    """Holds every background rank-file write until released (at most ``limit`` s), recording the
    writing threads' names: the training thread goes on while the save is in flight."""

    def __init__(self, monkeypatch, limit: float = 5.0):
        from functional_ema._checkpoint import writer

        self.entered, self.open, self.threads = threading.Event(), threading.Event(), []
        orig = writer.write_rank_file

        def write(*args, **kwargs):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            self.open.wait(limit)
            return orig(*args, **kwargs)

        monkeypatch.setattr(writer, "write_rank_file", write)

    def release(self, after: float = 0.0) -> None:
        if after:
            threading.Timer(after, self.open.set).start()
        else:
            self.open.set()


def _fail_writes(monkeypatch, message: str = "No space left on device (simulated)", where: str = "write_rank_file"):
    from functional_ema._checkpoint import writer

    def fail(*args, **kwargs):
        raise OSError(28, message)

    monkeypatch.setattr(writer, where, fail)


def _token_of(name: str) -> str:
    m = re.fullmatch(r"ema_async\.([0-9a-f]{16})\.rank(\d{5})\.(done|error)", name)
    assert m, name
    return m.group(1)


def test_async_saver_arguments_and_defaults(tmp_path):
    import math

    import functional_ema as fe

    s = fe.AsyncSaver()
    assert (s.max_in_flight, s.commit_timeout, s.pin_memory) == (1, 1800.0, True)
    s = fe.AsyncSaver(3, commit_timeout=0.5, pin_memory=False)
    assert (s.max_in_flight, s.commit_timeout, s.pin_memory) == (3, 0.5, False)
    assert fe.AsyncSaver(commit_timeout=math.inf).commit_timeout == math.inf
    refused = [
        (dict(max_in_flight=0), ValueError, "max_in_flight must be >= 1, got 0"),
        (dict(max_in_flight=True), TypeError, "max_in_flight must be an int, got a bool (True)"),
        (dict(commit_timeout=0), ValueError, "commit_timeout must be a number in (0.0, inf], got 0.0"),
        (dict(commit_timeout=-1), ValueError, "commit_timeout must be a number in (0.0, inf], got -1.0"),
        (dict(commit_timeout="x"), TypeError, "commit_timeout must be a real number, got str 'x'"),
        (dict(pin_memory=1), TypeError, "pin_memory must be True or False, got int 1"),
    ]
    for kwargs, cls, msg in refused:
        with pytest.raises(cls) as e:
            fe.AsyncSaver(**kwargs)
        assert str(e.value) == msg, (kwargs, str(e.value))

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver()
    assert saver._writer_threads() is saver._writer_threads()  # started once per process
    with pytest.raises(TypeError) as e:
        saver.save(state, model, 3)
    assert str(e.value) == "save_dir must be a path (a str or os.PathLike), got int 3"
    h = saver.save(state, model, tmp_path, decay=[0.5, 0.25])  # no tag: the adapter's default
    assert h.wait() == tmp_path / "global_step3" and h.step == 3 and h.tag_dir == tmp_path / "global_step3"
    assert fe.checkpoint.read_manifest(tmp_path, "global_step3")["schedules"] == [
        {"kind": "constant", "decay": 0.5},
        {"kind": "constant", "decay": 0.25},
    ]
    assert (tmp_path / "ema_latest").read_text() == "global_step3\n"


def test_bad_timeout_is_refused_before_waiting_for_a_save_in_flight(tmp_path, monkeypatch):
    import functional_ema as fe

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver()
    hold = _Hold(monkeypatch)
    h = saver.save(state, model, tmp_path, "t")
    hold.entered.wait(10)
    hold.release(after=1.0)  # a saver that waited first would return after this
    with pytest.raises(ValueError) as e:
        saver.save(state, model, tmp_path, "t", timeout=-1)
    refused_in_flight = not h.done()
    assert str(e.value) == "timeout= must be a positive number of seconds, got -1"
    assert refused_in_flight, "the bad timeout was refused only after the save in flight finished"
    h.wait()


def test_async_save_writes_the_state_at_the_call(tmp_path, monkeypatch):
    """What is written is the state (EMAs and buffers) at the call, bitwise, however it changes while the
    write is in flight; the handle's states; the files left (no lock, marker or temporary file)."""
    import torch

    import functional_ema as fe
    from functional_ema.buffers import load_buffers

    model = _model()
    state, bufs = _state(model, dtype=torch.float64), _buffers(model)
    want = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    want_bufs = (
        [{n: t.clone() for n, t in e.items()} for e in bufs.emas],
        {n: t.clone() for n, t in bufs.copied.items()},
    )
    saver = fe.AsyncSaver()
    hold = _Hold(monkeypatch)
    h = saver.save(state, model, tmp_path, "t", decay=[0.9, 0.99], buffers=bufs, extra={"run": "a"})
    hold.entered.wait(10)
    _bump([t for e in state.emas for t in e.values()])
    _bump([t for e in bufs.emas for t in e.values()] + list(bufs.copied.values()))
    in_flight = {
        "done": h.done(),
        "exception": h.exception(),
        "files": sorted(os.listdir(tmp_path / "t")),
        "thread": hold.threads,
    }
    with pytest.raises(TimeoutError) as e:
        h.wait(0.05)
    hold.release()
    assert str(e.value) == f"async EMA save into {tmp_path / 't'} still running after 0.05 s"
    assert in_flight == {"done": False, "exception": None, "files": [".ema_write.lock"], "thread": ["fe_async_save_0"]}
    assert h.wait() == tmp_path / "t" and h.done() and h.exception() is None and h.step == 3
    assert sorted(os.listdir(tmp_path / "t")) == [
        "buffers_rank_00000_of_00001.safetensors",
        "ema_manifest.json",
        "ema_rank_00000_of_00001.safetensors",
    ]
    loaded = fe.load(model, tmp_path, "t")
    assert int(loaded.step) == 3 and _same_trees(list(loaded.emas), want)
    lb = load_buffers(model, tmp_path, "t")
    assert int(lb.step) == 3 and _same_trees(list(lb.emas), want_bufs[0]) and _same_trees([lb.copied], [want_bufs[1]])
    m = fe.checkpoint.read_manifest(tmp_path, "t")
    assert re.fullmatch(r"[0-9a-f]{16}", m["save_id"]), m["save_id"]
    assert (m["generation"], m["step"], m["dtype"], m["extra"]) == (0, 3, "float64", {"run": "a"})
    assert m["schedules"] == [{"kind": "constant", "decay": 0.9}, {"kind": "constant", "decay": 0.99}]
    assert [(f["rank"], f["file"]) for f in m["buffer_files"]] == [(0, "buffers_rank_00000_of_00001.safetensors")]


def test_snapshot_buffers_are_reused_only_when_they_fit(tmp_path):
    """Dict-tree EMAs as well as Shards; the host buffer of a finished save is taken by the next save
    of the same size, dtype and pinning, never by another (each file holds its own state, bitwise)."""
    import torch

    import functional_ema as fe

    model, big = _model(), _model(seed=1, width=5)
    saver = fe.AsyncSaver()
    runs = [
        ("dict", model, _state(model, shards=False)),
        ("dict_again", model, _state(model, shards=False)),
        ("f64", model, _state(model, dtype=torch.float64)),  # the same size, another dtype
        ("big", big, _state(big, dtype=torch.float64)),  # another size
        ("big_again", big, _state(big, dtype=torch.float64)),
    ]
    handles, ptrs = [], []
    for tag, m, st in runs:
        h = saver.save(st, m, tmp_path, tag)
        h.wait()
        handles.append(h)
        ptrs.append(h._buffer.data_ptr())
        assert all(p._buffer is None for p in handles[:-1]), tag  # given back to the saver by this save
    assert [ptrs[1] == ptrs[0], ptrs[2] == ptrs[1], ptrs[4] == ptrs[3]] == [True, False, True]
    assert [handles[i]._buffer is None for i in range(5)] == [True] * 4 + [False]
    for tag, m, st in runs:
        assert _same_trees(list(fe.load(m, tmp_path, tag).emas), [dict(e.items()) for e in st.emas]), tag


def test_saves_in_flight_are_limited_and_a_tag_waits_for_its_own_save(tmp_path, monkeypatch):
    import functional_ema as fe

    model = _model()
    state = _state(model)

    # One in flight (the default): a second call, of another tag, returns once the first is done.
    saver = fe.AsyncSaver()
    hold = _Hold(monkeypatch)
    ha = saver.save(state, model, tmp_path, "a")
    hold.entered.wait(10)
    hold.release(after=0.5)
    t0 = time.perf_counter()
    hb = saver.save(state, model, tmp_path, "b")
    waited, first_done = time.perf_counter() - t0, ha.done()
    assert first_done and waited >= 0.4, (first_done, waited)
    saver.wait()

    # Two in flight: the second (another tag) goes at once, and the snapshot of the first is its own
    # while both are in flight, although the state changed in between.
    saver = fe.AsyncSaver(2)
    hold = _Hold(monkeypatch)
    at_a = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    ha = saver.save(state, model, tmp_path, "c")
    hold.entered.wait(10)
    _bump([t for e in state.emas for t in e.values()])
    at_b = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    hb = saver.save(state, model, tmp_path, "d")
    both_pending = not ha.done() and not hb.done()
    hold.release()
    saver.wait()
    assert both_pending and ha.done() and hb.done()
    assert _same_trees(list(fe.load(model, tmp_path, "c").emas), at_a)
    assert _same_trees(list(fe.load(model, tmp_path, "d").emas), at_b)

    # Two in flight, the same tag: the second call waits for the first save of it (not for the tag's
    # lock, which it would give up after its timeout).
    hold = _Hold(monkeypatch)
    ha = saver.save(state, model, tmp_path, "e")
    hold.entered.wait(10)
    hold.release(after=1.0)
    hb = saver.save(state, model, tmp_path, "e", timeout=0.3)
    first_done = ha.done()
    hb.wait()
    assert first_done
    assert sorted(os.listdir(tmp_path / "e")) == ["ema_manifest.json", "ema_rank_00000_of_00001.gen1.safetensors"]


def test_as_many_saves_write_at_once_as_max_in_flight(tmp_path, monkeypatch):
    """One writer thread per save allowed in flight: more than a default thread pool's (min(32, CPUs + 4))."""
    import functional_ema as fe

    model = _model()
    state = _state(model)
    n = min(32, (os.cpu_count() or 1) + 4) + 1
    saver = fe.AsyncSaver(n)
    hold = _Hold(monkeypatch)
    handles = [saver.save(state, model, tmp_path, f"t{i}") for i in range(n)]
    deadline = time.monotonic() + 10
    while len(hold.threads) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    writing = sorted(hold.threads)
    hold.release()
    saver.wait()
    assert writing == sorted(f"fe_async_save_{i}" for i in range(n)), writing
    assert all(h.exception() is None for h in handles)


def test_tag_lock_excludes_another_saver_and_the_next_save_swaps_generation(tmp_path, monkeypatch):
    import functional_ema as fe

    model = _model()
    state = _state(model)
    first, second = fe.AsyncSaver(), fe.AsyncSaver()
    hold = _Hold(monkeypatch)
    h = first.save(state, model, tmp_path, "t")
    hold.entered.wait(10)
    with pytest.raises(fe.checkpoint.CheckpointError) as e:
        second.save(state, model, tmp_path, "t", timeout=0.3)
    hold.release()
    pattern = (
        rf"AsyncSaver\.save: tag 't' in {re.escape(str(tmp_path))} is being written by another save \(pid {os.getpid()} "
        r"on .+, thread MainThread\) and it did not finish within 0\.3 s\. One save writes a tag at a time: wait for "
        r"the other one \(AsyncSaver\.wait\(\)\), or save under another tag"
    )
    assert re.fullmatch(pattern, str(e.value)), str(e.value)
    h.wait()
    _bump([t for e in state.emas for t in e.values()])
    second.save(state, model, tmp_path, "t").wait()  # the complete checkpoint there stays until this one is
    assert sorted(os.listdir(tmp_path / "t")) == ["ema_manifest.json", "ema_rank_00000_of_00001.gen1.safetensors"]
    assert fe.checkpoint.read_manifest(tmp_path, "t")["generation"] == 1
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), [dict(e.items()) for e in state.emas])


def test_refused_save_leaves_no_folder(tmp_path):
    import functional_ema as fe

    model, other = _model(), _model(width=5)
    saver = fe.AsyncSaver()
    with pytest.raises(fe.checkpoint.CheckpointMismatchError):
        saver.save(_state(other), model, tmp_path, "n")
    assert os.listdir(tmp_path) == []  # the folder its lock made is removed
    saver.save(_state(model), model, tmp_path, "n").wait()
    assert sorted(os.listdir(tmp_path / "n")) == ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]


def test_background_failure_reaches_wait_and_leaves_only_its_marker(tmp_path, monkeypatch, caplog):
    import json

    import functional_ema as fe

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver()
    with monkeypatch.context() as mp:
        _fail_writes(mp)
        h = saver.save(state, model, tmp_path, "f")
        _wait_done(h)
    err = h.exception()
    assert type(err) is OSError and str(err) == ENOSPC
    for _ in range(2):  # every wait raises it
        with pytest.raises(OSError) as e:
            h.wait()
        assert e.value is err
    (marker,) = os.listdir(tmp_path / "f")
    assert marker == f"ema_async.{_token_of(marker)}.rank00000.error"
    assert json.loads((tmp_path / "f" / marker).read_text()) == {
        "rank": 0,
        "type": "OSError",
        "message": ENOSPC,
        "checkpoint_error": False,
        "world": 1,  # how many ranks' error markers make the save's markers stale (writer._failed_async_markers)
    }
    assert f"functional_ema: async EMA save of step 3 into {tmp_path / 'f'} failed on rank 0: OSError: {ENOSPC}" in [
        r.getMessage() for r in caplog.records
    ]
    saver.wait()  # raised already by the handle's wait
    saver.save(state, model, tmp_path, "f").wait()  # its commit removes the failed save's marker
    assert sorted(os.listdir(tmp_path / "f")) == ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]


def test_unwaited_failure_is_raised_by_the_next_call_once(tmp_path, monkeypatch):
    import functional_ema as fe

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver()
    with monkeypatch.context() as mp:
        _fail_writes(mp)
        h = saver.save(state, model, tmp_path, "u")
        _wait_done(h)
    with pytest.raises(fe.checkpoint.CheckpointError) as e:
        saver.save(state, model, tmp_path, "v")
    assert str(e.value) == (
        f"the previous async EMA save (step 3, {tmp_path / 'u'}) failed: OSError: {ENOSPC}. Nothing of it is "
        "marked complete, and nothing of the saves before it was changed by this library (unless something else "
        "removed their folders, they load as before)"
    )
    assert e.value.__cause__ is h.exception() and not (tmp_path / "v").exists()
    assert saver.save(state, model, tmp_path, "v").wait() == tmp_path / "v"  # raised once: the next save goes on
    saver.wait()
    with pytest.raises(OSError):
        h.wait()  # the handle still raises it


def test_saver_wait_raises_each_failure_once_in_order(tmp_path, monkeypatch):
    import functional_ema as fe
    from functional_ema._checkpoint import writer

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver(2)
    both_started = threading.Event()  # x1's write must not fail before x2 is started (save x2 would raise it)

    def fail(path, *args, **kwargs):
        both_started.wait(60)
        raise OSError(28, f"no space for {path.parent.name}")

    monkeypatch.setattr(writer, "write_rank_file", fail)
    h1 = saver.save(state, model, tmp_path, "x1")
    h2 = saver.save(state, model, tmp_path, "x2")
    both_started.set()
    _wait_done(h1)
    _wait_done(h2)
    raised = [error_of(saver.wait) for _ in range(3)]
    assert raised[0][:2] == ["OSError", "[Errno 28] no space for x1"], raised
    assert raised[1][:2] == ["OSError", "[Errno 28] no space for x2"], raised
    assert raised[2] is None


def test_failed_commit_removes_the_new_files_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    import functional_ema as fe
    from functional_ema import _io
    from functional_ema._checkpoint import writer

    model = _model()
    old = _state(model)
    saver = fe.AsyncSaver()
    saver.save(old, model, tmp_path, "t").wait()

    def fail(*args, **kwargs):
        raise OSError(5, "manifest write failed (simulated)")

    with monkeypatch.context() as mp:
        mp.setattr(writer, "commit_manifest", fail)
        h = saver.save(_state(model, step=4), model, tmp_path, "t")
        _wait_done(h)
    (marker,) = [f for f in os.listdir(tmp_path / "t") if f.startswith("ema_async.")]
    assert sorted(os.listdir(tmp_path / "t")) == sorted(
        ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors", marker]
    )  # the new generation's file is gone, the previous checkpoint intact
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), [dict(e.items()) for e in old.emas])
    assert error_of(h.wait)[:2] == ["OSError", "[Errno 5] manifest write failed (simulated)"]

    # The failure cannot even be recorded for the other ranks: said in the log.
    atomic = _io.atomic_write_bytes

    def no_markers(path, data):
        if path.name.endswith(".error"):
            raise OSError(30, "read-only (simulated)")
        return atomic(path, data)

    with monkeypatch.context() as mp:
        mp.setattr(_io, "atomic_write_bytes", no_markers)
        _fail_writes(mp)
        h = saver.save(old, model, tmp_path, "r")
        _wait_done(h)
    assert os.listdir(tmp_path / "r") == []
    assert (
        "functional_ema: could not record the async save failure for the other ranks: [Errno 30] read-only (simulated)"
        in [r.getMessage() for r in caplog.records]
    )


def test_saver_as_context_manager(tmp_path, monkeypatch, caplog):
    import functional_ema as fe

    model = _model()
    state = _state(model)
    hold = _Hold(monkeypatch)
    hold.release(after=0.3)
    with fe.AsyncSaver() as saver:
        assert isinstance(saver, fe.AsyncSaver)
        h = saver.save(state, model, tmp_path, "ok")
    assert h.done() and h.exception() is None  # the exit waited

    with monkeypatch.context() as mp:
        _fail_writes(mp)
        with pytest.raises(OSError) as e, fe.AsyncSaver() as saver:  # a clean exit raises the save's failure
            saver.save(state, model, tmp_path, "bad")
        assert str(e.value) == ENOSPC
        caplog.clear()
        with pytest.raises(KeyError) as k, fe.AsyncSaver() as saver:  # already failing: the failure is logged
            h = saver.save(state, model, tmp_path, "bad2")
            raise KeyError("body")
    assert h.done() and str(h.exception()) == ENOSPC
    if sys.version_info >= (3, 11):  # and added to the block's own exception (raised as it was)
        assert k.value.args == ("body",) and k.value.__notes__ == [
            f"functional_ema: leaving the `with fe.AsyncSaver()` block, its saves failed: OSError: {ENOSPC}"
        ]
    assert f"functional_ema: async EMA save failed: {ENOSPC}" in [r.getMessage() for r in caplog.records]


def test_forked_child_fails_the_parents_save_in_flight(tmp_path, monkeypatch):
    """In a child forked while a save is in flight, that save fails (with a message saying why) instead of
    blocking; the child's own saves get writer threads of their own. The parent's save completes."""
    import json

    import functional_ema as fe
    from functional_ema._checkpoint import writer

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver()
    orig = writer.write_rank_file
    hold = _Hold(monkeypatch)
    h = saver.save(state, model, tmp_path, "t")
    hold.entered.wait(10)
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without returning into pytest
        code = 1
        try:
            signal.alarm(30)  # a wait that blocks ends the child (the parent then reads no report)
            writer.write_rank_file = orig  # this process's own saves are not held
            done, exc = h.done(), h.exception()
            out = {"pid": os.getpid(), "done": done, "exception": exc and [type(exc).__name__, str(exc)]}
            out["wait"] = error_of(h.wait)
            out["saver_wait"] = error_of(saver.wait)
            out["own"] = str(saver.save(state, model, tmp_path, "child").wait(10))
            os.write(w, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    hold.release()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and text, status
    out = json.loads(text)
    msg = (
        f"this process (pid {out['pid']}) was forked from pid {parent} while the async EMA save of step 3 into "
        f"{tmp_path / 't'} was in flight. That save is written by the parent's thread and completes there (wait for "
        "it in the parent); this process cannot wait for it or know its outcome. Save again from this process if it "
        "needs its own checkpoint"
    )
    assert out["done"] is True and out["exception"][:2] == ["CheckpointError", msg], out
    assert out["wait"][:2] == ["CheckpointError", msg] and out["saver_wait"] is None, out
    assert out["own"] == str(tmp_path / "child")
    assert h.wait() == tmp_path / "t" and h.done() and h.exception() is None
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), [dict(e.items()) for e in state.emas])


# ----------------------------------------------------- the commit between ranks, two ranks in threads


def _sim(save_dir: Path, tag: str, token: str, *, stage: int = 3, generation: int = 0, writers=(0, 1), timeout=10.0):
    """The background jobs (``_async._Job``) of the two ranks of one save, as ``AsyncSaver.save`` makes
    them: ZeRO-3-like (each rank holds half of every parameter) or replicated (``stage=0``: rank 0 writes
    alone). Returns the jobs and the full EMA they write."""
    import torch

    from functional_ema import EmaState, ShardLayout, ShardSpec, _async
    from functional_ema._checkpoint import writer

    full = {"a": torch.randn(4), "b": torch.randn(2, 2)}
    jobs = []
    for r in range(2):
        specs = {
            n: ShardSpec(tuple(t.shape), r * 2 if stage else 0, 2 if stage else t.numel()) for n, t in full.items()
        }
        lay = ShardLayout(r, 2, stage, specs)
        piece = {
            n: t.reshape(-1)[s.offset : s.offset + s.numel].clone() for (n, t), s in zip(full.items(), specs.values())
        }
        mine = writer.plan_save(EmaState(torch.tensor(5), (piece,)), [0.9], lay, tag)
        first = dict(jobs[0].mine if jobs else mine, token=token, generation=generation)
        jobs.append(
            _async._Job(
                save_dir=save_dir,
                tag_dir=save_dir / tag,
                layout=lay,
                rank=r,
                first=first,
                mine=mine,
                token=token,
                writers=list(writers),
                writes=lay.writes_pieces,
                emas=[piece] if lay.writes_pieces else None,
                ready=None,
                buffers=None,
                lock=None,
                dtype=torch.float32,
                timeout=timeout,
                world=2,
            )
        )
    (save_dir / tag).mkdir(parents=True, exist_ok=True)
    return jobs, full


def _setting_when_rank_1_ends(real_run, event: threading.Event):
    """``_async._run`` that sets ``event`` once rank 1's background part has ended (however it ended)."""

    def run(job, handle):
        try:
            real_run(job, handle)
        finally:
            if job.rank == 1:
                event.set()

    return run


def _run_ranks_in_threads(jobs, ranks=(0, 1), stagger: float = 0.2) -> list:
    """``_run`` of each job in its own thread, ``stagger`` s apart (rank 0 first: it polls for the others)."""
    from functional_ema import _async

    handles = {r: _async.SaveHandle(jobs[r].tag_dir, 5) for r in ranks}
    threads = []
    for i, r in enumerate(ranks):
        if i:
            time.sleep(stagger)
        threads.append(threading.Thread(target=_async._run, args=(jobs[r], handles[r])))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return [handles[r] for r in ranks]


def test_ranks_commit_through_marker_files(tmp_path, monkeypatch):
    """Rank 0 waits for rank 1's record, writes the manifest carrying this save's id, removes the markers;
    rank 1 returns once that manifest (not the previous one of the tag) is there, reading each version of
    it once. The checkpoint equals the ranks' pieces joined."""
    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer
    from functional_ema._testing.files import write_simulated

    old, _ = _sim(tmp_path, "t", "1" * 16)
    write_simulated(tmp_path, "t", [j.layout for j in old], lambda lay: tuple(old[lay.rank].emas), save_id="1" * 16)
    token = "0123456789abcdef"
    jobs, full = _sim(tmp_path, "t", token, generation=1)
    reads, commit = [], writer.commit_manifest
    is_save = _async._is_save

    def counted(mpath, tok):
        reads.append(tok)
        return is_save(mpath, tok)

    def late_commit(*args):
        time.sleep(0.5)  # rank 1 polls meanwhile, seeing the previous manifest unchanged
        commit(*args)

    monkeypatch.setattr(_async, "_is_save", counted)
    monkeypatch.setattr(writer, "commit_manifest", late_commit)
    h0, h1 = _run_ranks_in_threads(jobs)
    assert (h0.done(), h0.exception(), h1.done(), h1.exception()) == (True, None, True, None)
    assert reads in ([token], [token, token]), (
        reads
    )  # the previous manifest (unless it was replaced already), the new one
    assert sorted(os.listdir(tmp_path / "t")) == [
        "ema_manifest.json",
        "ema_rank_00000_of_00002.gen1.safetensors",
        "ema_rank_00001_of_00002.gen1.safetensors",
    ]
    m = fe.checkpoint.read_manifest(tmp_path, "t")
    assert (m["save_id"], m["generation"], m["step"]) == (token, 1, 5)
    got = fe.consolidate(tmp_path, "t")
    assert sorted(got) == ["a", "b"] and all(torch.equal(got[n], full[n]) for n in full)


def test_rank_0_does_not_commit_over_a_rank_that_gave_up_while_it_waited_for_the_previous_save(tmp_path):
    """Rank 0 has every rank's record but waits for the saver's previous save to commit first (start order);
    meanwhile rank 1's commit_timeout passes and it gives up (its error marker, its files removed). Rank 0 then
    fails with rank 1's error instead of committing a checkpoint whose save rank 1 reported failed."""
    import dataclasses

    jobs, _ = _sim(tmp_path, "t", "0123456789abcdef")
    previous = threading.Event()
    jobs = [dataclasses.replace(jobs[0], after=previous), dataclasses.replace(jobs[1], timeout=0.5)]
    threading.Timer(2.0, previous.set).start()  # long after rank 1's timeout
    h0, h1 = _run_ranks_in_threads(jobs, stagger=0.05)
    assert previous.is_set() and h1.done() and "timed out after" in str(h1.exception())
    assert h0.done() and "failed on rank 1" in str(h0.exception()), h0.exception()
    assert not (tmp_path / "t" / "ema_manifest.json").exists(), sorted(os.listdir(tmp_path / "t"))


def test_a_rank_failure_reaches_the_other_rank(tmp_path, monkeypatch):
    import json

    from functional_ema import _async
    from functional_ema._checkpoint import writer

    write = writer.write_rank_file
    for bad in (1, 0):

        def fail_on(path, layout, *args, bad=bad):
            if layout.rank == bad:
                raise OSError(28, "No space left on device (simulated)")
            return write(path, layout, *args)

        monkeypatch.setattr(writer, "write_rank_file", fail_on)
        token = f"{bad}" * 16
        jobs, _ = _sim(tmp_path, f"t{bad}", token)
        handles = _run_ranks_in_threads(jobs)
        errors = [[type(h.exception()).__name__, str(h.exception())] for h in handles]
        remote = f"async save of tag 't{bad}' failed on rank {bad} (OSError): {ENOSPC}"
        assert errors[bad] == ["OSError", ENOSPC] and errors[1 - bad] == ["_RemoteError", remote], errors
        assert isinstance(handles[1 - bad].exception(), _async.CheckpointError)
        files = sorted(os.listdir(tmp_path / f"t{bad}"))  # no rank file is left; each rank's error marker
        own = f"ema_async.{token}.rank0000"
        assert (
            files == [f"{own}0.error", f"{own}1.error"] if bad else [f"{own}0.error", f"{own}1.done", f"{own}1.error"]
        )
        payload = {"rank": bad, "type": "OSError", "message": ENOSPC, "checkpoint_error": False, "world": 2}
        for r in (0, 1):  # the other rank's marker repeats the failing rank's record
            assert json.loads((tmp_path / f"t{bad}" / f"{own}{r}.error").read_text()) == payload, r


def test_a_rank_alone_times_out_naming_what_it_waited_for(tmp_path):
    import json

    for rank, what in ((0, "the files of ranks [1]"), (1, "rank 0's manifest")):
        token = "abcdef012345678" + str(rank)
        jobs, _ = _sim(tmp_path, f"t{rank}", token, timeout=0.2)
        (h,) = _run_ranks_in_threads(jobs, ranks=(rank,))
        tag_dir = tmp_path / f"t{rank}"
        msg = (
            f"async save of tag 't{rank}' (rank {rank}): timed out after 0.2 s waiting for {what} in {tag_dir}. Is the "
            "directory shared by all ranks, and are they all alive? The checkpoint is not marked complete"
        )
        assert [type(h.exception()).__name__, str(h.exception())] == ["CheckpointError", msg]
        error, claim = f"ema_async.{token}.rank{rank:05d}.error", f"ema_async.{token}.rank00000.done"
        # Rank 1 gave up after its done marker: it claimed the outcome (rank 0's commit claim would now fail).
        want = [error] + ([f"ema_async.{token}.rank00001.done", claim] if rank else [])
        assert sorted(os.listdir(tag_dir)) == sorted(want)
        payload = {"rank": rank, "type": "CheckpointError", "message": msg, "checkpoint_error": True}
        assert json.loads((tag_dir / error).read_text()) == dict(payload, world=2)
        if rank:
            assert json.loads((tag_dir / claim).read_text()) == payload


def test_only_rank_0_writes_a_replicated_model(tmp_path):
    """A whole, replicated model without buffers: rank 0 commits without waiting; rank 1 writes nothing."""
    import torch

    import functional_ema as fe

    jobs, full = _sim(tmp_path, "t", "fedcba9876543210", stage=0, writers=(0,), timeout=5.0)
    (h0,) = _run_ranks_in_threads(jobs, ranks=(0,))
    (h1,) = _run_ranks_in_threads(jobs, ranks=(1,))
    assert (h0.exception(), h1.exception(), h1.done()) == (None, None, True)
    assert sorted(os.listdir(tmp_path / "t")) == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]
    got = fe.consolidate(tmp_path, "t")
    assert all(torch.equal(got[n], full[n]) for n in full)


def test_rank_0_of_a_replicated_model_commits_without_waiting_for_rank_1(tmp_path, monkeypatch):
    """A whole, replicated model: rank 1 writes no file, so rank 0 commits without its word (a done marker of every
    rank, at thousands of ranks, cost every save thousands of file creates and fsyncs and the slowest rank's delay):
    here rank 0 is done while rank 1's part is still held, and rank 1 then succeeds, having left no marker."""
    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    part_record, release = writer.part_record, threading.Event()

    def held(layout, plan):
        if layout.rank == 1:
            release.wait(30)
        return part_record(layout, plan)

    monkeypatch.setattr(writer, "part_record", held)
    jobs, full = _sim(tmp_path, "t", "fedcba9876543210", stage=0, writers=(0,), timeout=30.0)
    threading.Timer(25, release.set).start()  # a bound, should rank 0 wait for rank 1
    h1 = _async.SaveHandle(jobs[1].tag_dir, 5)
    rank1 = threading.Thread(target=_async._run, args=(jobs[1], h1))
    rank1.start()
    (h0,) = _run_ranks_in_threads(jobs, ranks=(0,))
    assert h0.done() and h0.exception() is None and not release.is_set()  # rank 0 committed, rank 1 still held
    assert sorted(os.listdir(tmp_path / "t")) == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]
    release.set()
    rank1.join(30)
    assert (h0.exception(), h1.done(), h1.exception()) == (None, True, None)
    assert sorted(os.listdir(tmp_path / "t")) == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]
    got = fe.consolidate(tmp_path, "t")
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_a_replicated_models_ranks_agree_whichever_claims_first(tmp_path, monkeypatch):
    """A whole, replicated model: rank 0 commits without waiting for rank 1 (it writes no file), but rank 1's part can
    fail. Whoever claims the outcome first decides it for both: rank 1's abort before rank 0's claim (rank 0 held
    until rank 1 is done): both fail, nothing committed; rank 0's claim first (rank 1 fails once the claim is there,
    rank 0 held until rank 1 read it), or rank 0's commit done (rank 1 fails once the manifest is there): both succeed
    (the data is complete: rank 0 wrote it). Rank 0 used to commit and return while rank 1 raised."""
    import json

    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    part_record, commit = writer.part_record, writer.commit_manifest
    real_claim, real_read, real_run = _async._claim, _async._read_claim, _async._run
    rank1_done, rank1_read = threading.Event(), threading.Event()

    def until(cond):  # bounded: a failing check below says what happened
        deadline = time.monotonic() + 20
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)

    def claim(job, outcome, committed):
        if job.rank == 0 and case == "abort":
            rank1_done.wait(20)
        return real_claim(job, outcome, committed)

    def read_claim(job, path, committed):
        decided = real_read(job, path, committed)
        if job.rank == 1:
            rank1_read.set()
        return decided

    def failing(layout, plan):
        if layout.rank != 1:
            return part_record(layout, plan)
        tag_dir = tmp_path / case
        if case == "claimed":
            until(lambda: any(n.endswith(".rank00000.done") for n in os.listdir(tag_dir)))
        elif case == "committed":
            until((tag_dir / "ema_manifest.json").exists)
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(_async, "_run", _setting_when_rank_1_ends(real_run, rank1_done))
    monkeypatch.setattr(_async, "_claim", claim)
    monkeypatch.setattr(_async, "_read_claim", read_claim)
    monkeypatch.setattr(writer, "part_record", failing)
    monkeypatch.setattr(
        writer, "commit_manifest", lambda *a: (rank1_read.wait(20) if case == "claimed" else None, commit(*a))[1]
    )
    for case in ("abort", "claimed", "committed"):
        rank1_done.clear()
        rank1_read.clear()
        token = {"abort": "a", "claimed": "b", "committed": "c"}[case] * 16
        jobs, full = _sim(tmp_path, case, token, stage=0, writers=(0,), timeout=30.0)
        h0, h1 = _run_ranks_in_threads(jobs, stagger=0.01)
        files = sorted(os.listdir(tmp_path / case))
        errors = [[type(h.exception()).__name__, str(h.exception())] for h in (h0, h1)]
        if case == "abort":
            assert errors == [
                ["_RemoteError", f"async save of tag 'abort' failed on rank 1 (OSError): {ENOSPC}"],
                ["OSError", ENOSPC],
            ], errors
            own = f"ema_async.{token}.rank0000"
            # the claim (rank 1's abort), each rank's error marker
            assert files == [f"{own}0.done", f"{own}0.error", f"{own}1.error"], files
            assert json.loads((tmp_path / case / f"{own}0.done").read_text())["rank"] == 1
        else:
            assert errors == [["NoneType", "None"]] * 2, (case, errors)
            assert files == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"], (case, files)
            assert rank1_read.is_set() or case == "committed", case  # it read rank 0's claim (then the commit)
            got = fe.consolidate(tmp_path, case)
            assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_a_claim_stalled_on_rank_0_never_splits_the_ranks(tmp_path, monkeypatch):
    """Rank 0 stalls (descheduled, slow NFS) right as it claims the commit, for longer than rank 1 takes to give up and
    claim an abort. The claim is linked into place whole, so rank 1 never reads it empty: both fail, nothing is
    committed. It was created empty and then written: rank 1 read it empty for 5 s, took rank 0 for dead ("rank
    unknown"), removed its file, and rank 0 then committed a manifest listing it (a checkpoint that never loads)."""
    import dataclasses

    from functional_ema import _async

    threads, rank1_done = {}, threading.Event()
    real_open, real_link, real_run = os.open, os.link, _async._run

    def stalled(path):  # rank 0's thread, at its claim: stall until rank 1 has finished (at most 20 s)
        if threads.get(0) is threading.current_thread() and str(path).endswith(".rank00000.done"):
            rank1_done.wait(20)

    def open_(path, *a, **k):
        fd = real_open(path, *a, **k)
        stalled(path)  # the file there (a claim made by O_EXCL: empty until written)
        return fd

    def link(src, dst, *a, **k):
        stalled(dst)  # before the claim is there
        return real_link(src, dst, *a, **k)

    def run(job, handle):
        threads[job.rank] = threading.current_thread()
        _setting_when_rank_1_ends(real_run, rank1_done)(job, handle)

    monkeypatch.setattr(_async, "_run", run)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "link", link)
    token = "5" * 16
    jobs, _ = _sim(tmp_path, "t", token)
    h0, h1 = _run_ranks_in_threads([jobs[0], dataclasses.replace(jobs[1], timeout=0.5)], stagger=0.05)
    monkeypatch.undo()
    assert h0.done() and h1.done()
    errors = [(type(h.exception()).__name__, str(h.exception())) for h in (h0, h1)]
    timed_out = "timed out after 0.5 s waiting for rank 0's manifest"
    assert errors[1][0] == "CheckpointError" and timed_out in errors[1][1], errors
    assert errors[0][0] == "_RemoteError" and f"failed on rank 1 (CheckpointError): {errors[1][1]}" in errors[0][1]
    own = f"ema_async.{token}.rank0000"
    assert sorted(os.listdir(tmp_path / "t")) == [f"{own}0.done", f"{own}0.error", f"{own}1.done", f"{own}1.error"]


def test_a_rank_waits_a_short_grace_for_rank_0s_manifest_after_its_claim_and_keeps_its_files(tmp_path, monkeypatch):
    """Rank 0 claims the commit, then stalls before its manifest (or dies). A rank that gives up meanwhile reads that
    claim and waits only max(min(commit_timeout, 60 s), 10 s) more for the manifest (here both cut to 2 s), not a second
    commit_timeout (30 s here: 1800 + 1800 s by default); then it fails without removing its files or leaving an
    error marker, as the save may still complete: here rank 0 goes on, and its checkpoint loads bitwise."""
    import dataclasses

    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    commit, release, part_record = writer.commit_manifest, threading.Event(), writer.part_record
    monkeypatch.setattr(_async, "_COMMIT_GRACE_S", 2.0)
    monkeypatch.setattr(_async, "_COMMIT_GRACE_MIN_S", 2.0)
    monkeypatch.setattr(writer, "commit_manifest", lambda *a: (release.wait(60), commit(*a))[1])
    for case in ("writer", "replicated"):
        release.clear()
        tag, token = case, "e" * 16 if case == "writer" else "d" * 16
        if case == "writer":  # rank 1's wait (3 s) times out while rank 0 stalls after its claim
            jobs, full = _sim(tmp_path, tag, token)
            jobs = [jobs[0], dataclasses.replace(jobs[1], timeout=3.0)]
        else:  # rank 1 writes no file; its part fails once rank 0 claimed (its commit_timeout: 30 s)
            jobs, full = _sim(tmp_path, tag, token, stage=0, writers=(0,), timeout=30.0)

            def failing(layout, plan):
                if layout.rank == 1:
                    deadline = time.monotonic() + 20
                    while not (tmp_path / tag / f"ema_async.{token}.rank00000.done").exists():
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    raise OSError(28, "No space left on device (simulated)")
                return part_record(layout, plan)

            monkeypatch.setattr(writer, "part_record", failing)
        handles = {r: _async.SaveHandle(jobs[r].tag_dir, 5) for r in (0, 1)}
        threading.Thread(target=_async._run, args=(jobs[0], handles[0])).start()
        started = time.monotonic()
        (h1,) = _run_ranks_in_threads(jobs, ranks=(1,))
        waited = time.monotonic() - started
        monkeypatch.setattr(writer, "part_record", part_record)
        error = h1.exception()
        assert type(error).__name__ == "_Undecided", error
        first = "timed out after 3 s waiting for rank 0's manifest" if case == "writer" else ENOSPC
        assert str(error).startswith(f"async save of tag {tag!r} (rank 1): this rank failed (") and first in str(error)
        said = (
            f"after rank 0 decided to commit the save, whose manifest then did not appear in {tmp_path / tag} within "
            "2 s (max(min(commit_timeout, 2 s), 2 s)): rank 0 died, or its storage stalls. This rank's files are left in place"
        )
        assert said in str(error), error
        assert waited < (3 + 2 if case == "writer" else 2) + 8, waited  # not a second commit_timeout
        left = sorted(os.listdir(tmp_path / tag))
        assert not any(n.endswith(".error") for n in left), left  # the other ranks wait on for the manifest
        if case == "writer":
            assert "ema_rank_00001_of_00002.safetensors" in left, left  # kept: the manifest will list it
        release.set()
        assert handles[0]._event.wait(30) and handles[0].exception() is None
        got = fe.consolidate(tmp_path, tag)
        assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_ranks_agree_when_one_gives_up_during_rank_0s_commit(tmp_path, monkeypatch):
    """Rank 1 left its done marker, then its wait for the manifest times out while rank 0 is between its last look at
    the markers and its commit (held there until rank 1 has claimed). Whoever claims the outcome first decides it for
    both: rank 1 (0.3 s) before rank 0's claim (rank 0 held while building the manifest): both fail, nothing committed
    (rank 0 used to commit and return while rank 1 raised); rank 0's claim first (held while writing the manifest):
    rank 1 (3 s) waits for that manifest, min(3 s, 60 s) more, after rank 0 is released: both succeed."""
    import dataclasses

    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    build, commit, real_claim = writer.build_manifest, writer.commit_manifest, _async._claim
    claimed = threading.Event()  # rank 1 gave up and claimed (or read) the outcome

    def claim(job, outcome, committed):
        decided = real_claim(job, outcome, committed)
        if job.rank == 1:
            claimed.set()
        return decided

    after_claim = lambda f: lambda *a, **k: (claimed.wait(30), f(*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(_async, "_claim", claim)
    for tag, where, f, limit in (("a", "build_manifest", build, 0.3), ("b", "commit_manifest", commit, 3.0)):
        claimed.clear()
        monkeypatch.setattr(writer, where, after_claim(f))
        token = tag * 16
        jobs, full = _sim(tmp_path, tag, token)
        h0, h1 = _run_ranks_in_threads([jobs[0], dataclasses.replace(jobs[1], timeout=limit)], stagger=0.05)
        monkeypatch.setattr(writer, where, f)
        files = sorted(os.listdir(tmp_path / tag))
        assert claimed.is_set(), tag
        if tag == "a":
            timed_out = "timed out after 0.3 s waiting for rank 0's manifest"
            assert type(h1.exception()).__name__ == "CheckpointError" and timed_out in str(h1.exception())
            assert type(h0.exception()).__name__ == "_RemoteError", h0.exception()
            assert "failed on rank 1 (CheckpointError)" in str(h0.exception()) and timed_out in str(h0.exception())
            own = f"ema_async.{token}.rank0000"
            assert files == [f"{own}0.done", f"{own}0.error", f"{own}1.done", f"{own}1.error"], (
                files
            )  # 0.done: the abort
        else:
            assert (h0.exception(), h1.exception()) == (None, None)
            assert files == [
                "ema_manifest.json",
                "ema_rank_00000_of_00002.safetensors",
                "ema_rank_00001_of_00002.safetensors",
            ]
            got = fe.consolidate(tmp_path, tag)
            assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_a_claim_removed_by_rank_0s_commit_reads_as_the_commit(tmp_path, monkeypatch):
    """Rank 1 gives up (its wait timed out) right after rank 0 claimed the outcome, and rank 0 writes its manifest and
    removes every marker, its claim too, before rank 1 reads that claim: rank 1 finds the claim gone and this save's
    manifest there, and succeeds with rank 0, leaving no claim behind. The order is set by events only: rank 1's wait
    "times out" once rank 0's claim exists (no timer decides who claims first)."""
    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer
    from functional_ema._checkpoint.errors import CheckpointError

    commit, real_read, real_remove, real_poll = (
        writer.commit_manifest,
        _async._read_claim,
        _async._remove_markers,
        _async._poll,
    )
    reading, removed = threading.Event(), threading.Event()
    claim = tmp_path / "c" / f"ema_async.{'c' * 16}.rank00000.done"

    def poll(check, deadline, job, what, limit=None, progress=None):  # rank 1: until rank 0 claimed
        if job.rank == 1 and what == "rank 0's manifest":
            real_poll(lambda: True if claim.exists() else None, deadline, job, "rank 0's claim")
            raise CheckpointError("rank 1 gave up waiting for rank 0's manifest (simulated timeout)")
        return real_poll(check, deadline, job, what, limit, progress)

    def read_claim(job, path, committed):  # rank 1, after its link met rank 0's claim: read once rank 0 cleaned up
        reading.set()
        removed.wait(20)
        return real_read(job, path, committed)

    def remove_markers(tag_dir, token):
        real_remove(tag_dir, token)
        removed.set()

    monkeypatch.setattr(_async, "_read_claim", read_claim)
    monkeypatch.setattr(_async, "_remove_markers", remove_markers)
    monkeypatch.setattr(_async, "_poll", poll)
    monkeypatch.setattr(writer, "commit_manifest", lambda *a, **k: (reading.wait(20), commit(*a, **k))[1])
    jobs, full = _sim(tmp_path, "c", "c" * 16)
    h0, h1 = _run_ranks_in_threads(jobs, stagger=0.05)
    assert reading.is_set() and removed.is_set() and (h0.exception(), h1.exception()) == (None, None)
    assert sorted(os.listdir(tmp_path / "c")) == [
        "ema_manifest.json",
        "ema_rank_00000_of_00002.safetensors",
        "ema_rank_00001_of_00002.safetensors",
    ]
    got = fe.consolidate(tmp_path, "c")
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def _run_named_ranks(jobs, hold_rank_0: threading.Event | None = None) -> list:
    """``_run`` of rank 0 then rank 1, in threads named ``r0`` and ``r1`` (for patches that act on one rank); with
    ``hold_rank_0``, rank 1 finishes before that event is set (the caller's patch holds rank 0 on it)."""
    from functional_ema import _async

    handles = [_async.SaveHandle(j.tag_dir, 5) for j in jobs]
    threads = [threading.Thread(target=_async._run, args=(jobs[r], handles[r]), name=f"r{r}") for r in (0, 1)]
    threads[0].start()
    threads[1].start()
    if hold_rank_0 is not None:
        threads[1].join(30)
        hold_rank_0.set()
    for t in threads:
        t.join(30)
    assert all(h.done() for h in handles)
    return handles


def test_an_io_error_deciding_after_the_vote_keeps_the_files_and_leaves_no_marker(tmp_path, monkeypatch):
    """Rank 1 left its done marker, and its wait for the manifest ended (a timeout). Then, deciding the outcome, an
    I/O error that decides nothing: 'claim', writing its abort claim (EIO; rank 0 held before its own claim); 'grace',
    polling for the manifest after reading rank 0's commit claim (ESTALE; rank 0 held before its manifest). Rank 1
    cannot know the outcome: it raises _Undecided, keeps its file and leaves no error marker (it used to remove its
    file and mark an error while rank 0 committed a manifest listing that file). Rank 0 commits; the tag loads bitwise."""
    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer
    from functional_ema._checkpoint.errors import CheckpointError

    real_build, real_commit, real_write, real_listdir, real_poll = (
        writer.build_manifest,
        writer.commit_manifest,
        Path.write_bytes,
        os.listdir,
        _async._poll,
    )
    for case in ("claim", "grace"):
        gate, tag, token = threading.Event(), case, ("a" if case == "claim" else "b") * 16
        claim = tmp_path / tag / f"ema_async.{token}.rank00000.done"
        rank1 = lambda: threading.current_thread().name == "r1"  # noqa: E731

        def poll(check, deadline, job, what, limit=None, progress=None, claim=claim, case=case):
            if job.rank == 1 and what == "rank 0's manifest":  # rank 1's wait ends: at once, or once rank 0 claimed
                if case == "grace":
                    real_poll(lambda: True if claim.exists() else None, deadline, job, "rank 0's claim")
                raise CheckpointError("rank 1 gave up waiting for rank 0's manifest (simulated timeout)")
            return real_poll(check, deadline, job, what, limit, progress)

        def write_bytes(self, data, token=token):
            if rank1() and self.name.startswith(f"ema_async.{token}.rank00000.done"):
                raise OSError(5, "Input/output error (simulated)")
            return real_write(self, data)

        def listdir(path, claim=claim):
            if rank1() and claim.exists() and b'"commit"' in claim.read_bytes():
                raise OSError(116, "Stale file handle (simulated)")
            return real_listdir(path)

        monkeypatch.setattr(_async, "_poll", poll)
        if case == "claim":
            monkeypatch.setattr(writer, "build_manifest", lambda *a, **k: (gate.wait(20), real_build(*a, **k))[1])
            monkeypatch.setattr(Path, "write_bytes", write_bytes)
        else:
            monkeypatch.setattr(writer, "commit_manifest", lambda *a, **k: (gate.wait(20), real_commit(*a, **k))[1])
            monkeypatch.setattr(os, "listdir", listdir)
        jobs, full = _sim(tmp_path, tag, token)
        h0, h1 = _run_named_ranks(jobs, hold_rank_0=gate)
        monkeypatch.undo()
        error = h1.exception()
        assert type(error).__name__ == "_Undecided", (case, error)
        said = "Input/output error" if case == "claim" else "Stale file handle"
        assert f"async save of tag {tag!r} (rank 1): this rank failed (" in str(error) and said in str(error), error
        assert "This rank's files are left in place" in str(error), error
        assert h0.exception() is None, (case, h0.exception())
        assert sorted(os.listdir(tmp_path / tag)) == [
            "ema_manifest.json",
            "ema_rank_00000_of_00002.safetensors",
            "ema_rank_00001_of_00002.safetensors",
        ], case
        got = fe.consolidate(tmp_path, tag)
        assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_a_failure_after_the_manifest_is_in_place_is_a_committed_save_with_a_warning(tmp_path, monkeypatch, caplog):
    """Rank 0's manifest is renamed into place, then writing ema_latest fails (EDQUOT): the save is complete (rank 1
    sees the manifest and succeeds; the tag loads), so rank 0 succeeds too, with a warning naming what failed (it used
    to raise 'not committed', remove its claim and leave an error marker). The markers are removed as on success."""
    import torch

    import functional_ema as fe
    from functional_ema import _io
    from functional_ema._checkpoint import writer

    real = _io.atomic_write_bytes

    def atomic_write_bytes(final, data):
        if Path(final).name == "ema_latest":
            raise OSError(122, "Disk quota exceeded (simulated)")
        return real(final, data)

    monkeypatch.setattr(writer._io, "atomic_write_bytes", atomic_write_bytes)
    jobs, full = _sim(tmp_path, "t", "cd" * 8)
    h0, h1 = _run_ranks_in_threads(jobs, stagger=0.05)
    assert (h0.exception(), h1.exception()) == (None, None)
    assert sorted(os.listdir(tmp_path)) == ["t"]  # no ema_latest
    assert sorted(os.listdir(tmp_path / "t")) == [
        "ema_manifest.json",
        "ema_rank_00000_of_00002.safetensors",
        "ema_rank_00001_of_00002.safetensors",
    ]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        f"the async EMA save into {tmp_path / 't'} is complete (its manifest is in place), but what follows it failed: "
        "OSError: [Errno 122] Disk quota exceeded (simulated). ema_latest may not name this tag" in m
        for m in warned
    ), warned
    got = fe.consolidate(tmp_path, "t")
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_the_grace_after_rank_0s_commit_claim_is_at_least_10_s(tmp_path, monkeypatch):
    """With a small commit_timeout (0.5 s here), a rank that gives up after rank 0 claimed the commit still waits
    max(min(commit_timeout, 60 s), 10 s) = 10 s for the manifest: rank 0 held 1.5 s after its claim, then commits, and
    both succeed (the grace used to be min(commit_timeout, 60 s) = 0.5 s: rank 1 raised _Undecided)."""
    import dataclasses

    import functional_ema as fe
    from functional_ema._checkpoint import writer

    real = writer.commit_manifest
    monkeypatch.setattr(writer, "commit_manifest", lambda *a, **k: (time.sleep(1.5), real(*a, **k))[1])
    jobs, full = _sim(tmp_path, "t", "ef" * 8)
    h0, h1 = _run_ranks_in_threads([jobs[0], dataclasses.replace(jobs[1], timeout=0.5)], stagger=0.05)
    assert (h0.exception(), h1.exception()) == (None, None)
    assert sorted(fe.consolidate(tmp_path, "t")) == sorted(full)


def test_a_claim_whose_link_reply_was_lost_is_recognised_as_its_own(tmp_path, monkeypatch):
    """NFS: rank 1's link of its abort claim is made, but the reply is lost and the retransmitted link is answered
    EEXIST. Rank 1 recognises the claim as its own (the temporary's second link; the claim read back equals its own):
    its save fails with its own error (ENOSPC), and rank 0, whose claim comes second, fails naming rank 1. Rank 1 used
    to read its own claim as another's outcome and raise a _RemoteError naming itself."""
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    gate, part_record, build, link = threading.Event(), writer.part_record, writer.build_manifest, os.link

    def failing(layout, plan):
        if layout.rank == 1:
            raise OSError(28, "No space left on device (simulated)")
        return part_record(layout, plan)

    def lost_reply(src, dst, *a, **k):
        link(src, dst, *a, **k)
        if threading.current_thread().name == "r1":
            raise FileExistsError(17, "File exists (simulated: the retransmitted link)")

    monkeypatch.setattr(writer, "part_record", failing)
    monkeypatch.setattr(writer, "build_manifest", lambda *a, **k: (gate.wait(20), build(*a, **k))[1])
    monkeypatch.setattr(_async.os, "link", lost_reply)
    jobs, _ = _sim(tmp_path, "t", "ab" * 8, stage=0, writers=(0,))  # rank 1 writes no file: it claims its abort
    h0, h1 = _run_named_ranks(jobs, hold_rank_0=gate)
    monkeypatch.undo()
    assert type(h1.exception()) is OSError and str(h1.exception()) == ENOSPC, h1.exception()
    assert type(h0.exception()).__name__ == "_RemoteError", h0.exception()
    assert f"failed on rank 1 (OSError): {ENOSPC}" in str(h0.exception())
    assert "ema_manifest.json" not in os.listdir(tmp_path / "t")


def test_a_blocking_save_after_a_failed_async_save_of_the_tag_goes_through(tmp_path):
    """An async save whose rank 0 never came (dead) leaves its markers (rank 1's done and error markers, its claim of
    the abort): a later save of the tag keeps them (rank 0 left no error marker: nothing says every rank of it is done
    with them, and a commit must not remove the markers of a save still in flight), is not disturbed by them (they
    are no checkpoint file) and loads, blocking or async."""
    import torch

    import functional_ema as fe

    token = "ab" * 8
    jobs, _ = _sim(tmp_path, "t", token, timeout=0.2)
    (h,) = _run_ranks_in_threads(jobs, ranks=(1,))
    markers = [f"ema_async.{token}.rank0000{r}.{kind}" for r, kind in ((0, "done"), (1, "done"), (1, "error"))]
    assert type(h.exception()).__name__ == "CheckpointError" and sorted(os.listdir(tmp_path / "t")) == markers
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
    fe.save(state, model, tmp_path, "t", decay=0.5)
    assert sorted(os.listdir(tmp_path / "t")) == [*markers, "ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), [dict(e) for e in state.emas])
    fe.AsyncSaver().save(state, model, tmp_path, "t", decay=0.5).wait()
    assert sorted(os.listdir(tmp_path / "t")) == [
        *markers,
        "ema_manifest.json",
        "ema_rank_00000_of_00001.gen1.safetensors",
    ]
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), [dict(e) for e in state.emas])


def test_a_replicated_rank_1_waits_out_rank_0s_write_that_outlasts_commit_timeout(tmp_path, monkeypatch):
    """A replicated model's rank 1 writes no file: its clock starts at once, while rank 0 still writes. It gives up
    only once commit_timeout (2 s here) passes with no change of the save's files. "slow": rank 0's write takes about
    2.7 s, a change every 0.9 s: both ranks commit, the checkpoint equals the pieces bitwise (rank 1 used to claim
    its abort after 2 s, failing the save on both ranks). "dead": rank 0 stops mid-write (held, as a killed rank
    would): rank 1 still gives up within commit_timeout (plus a quarter of it, when it looks) of the last change,
    and its abort, claimed first, fails rank 0 too once it goes on: nothing is committed."""
    import torch

    import functional_ema as fe
    from functional_ema import _io

    orig_write, orig_commit = _io.StreamingWriter.write, _io.StreamingWriter.commit
    stop, last_change = threading.Event(), [0.0]

    def step(w) -> None:  # rank 0's bytes so far on disk (not in Python's buffer), then a pause shorter than 2 s
        w._f.flush()
        last_change[0] = time.monotonic()
        if case == "dead" and w._next == 1:
            stop.wait(30)  # no change from here: a dead (or hung) rank 0
        time.sleep(0.9)

    def write(w, key, tensor):
        step(w)
        return orig_write(w, key, tensor)

    def commit(w):
        step(w)
        return orig_commit(w)

    monkeypatch.setattr(_io.StreamingWriter, "write", write)
    monkeypatch.setattr(_io.StreamingWriter, "commit", commit)
    for case in ("slow", "dead"):
        jobs, full = _sim(tmp_path, case, {"slow": "5", "dead": "d"}[case] * 16, stage=0, writers=(0,), timeout=2.0)
        start = time.monotonic()
        if case == "slow":
            h1, h0 = _run_ranks_in_threads(jobs, ranks=(1, 0), stagger=0.01)
            assert time.monotonic() - start > 2.6  # the write outlasted commit_timeout (2 s)
            assert (h0.exception(), h1.exception()) == (None, None), (h0.exception(), h1.exception())
            assert sorted(os.listdir(tmp_path / case)) == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]
            got = fe.consolidate(tmp_path, case)
            assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)
            continue
        bound = threading.Timer(20, stop.set)  # should rank 1 never give up
        bound.start()
        handles: dict = {}

        def run(r: int) -> None:
            handles[r] = _run_ranks_in_threads(jobs, ranks=(r,))[0]

        threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
        for t in threads:
            t.start()
        threads[0].join(30)
        bound.cancel()
        gave_up = time.monotonic() - last_change[0]
        # commit_timeout after the last change at the least (without it, 2 s after rank 1 started: about 1.1 s after
        # that change); within 1.25 commit_timeout of it, plus a generous slack for a loaded machine (2 cores in CI)
        assert not stop.is_set() and 2.0 <= gave_up <= 2.0 * 1.25 + 4.0, gave_up
        timed_out = "timed out after 2 s waiting for rank 0's manifest"
        assert type(handles[1].exception()).__name__ == "CheckpointError" and timed_out in str(handles[1].exception())
        stop.set()  # rank 0 goes on: its commit claim finds rank 1's abort
        threads[1].join(30)
        assert type(handles[0].exception()).__name__ == "_RemoteError", handles[0].exception()
        assert "ema_manifest.json" not in os.listdir(tmp_path / case)


def test_a_failed_saves_late_rank_never_touches_the_next_save_of_the_tag(tmp_path, monkeypatch):
    """Save 1 fails on rank 0 (ENOSPC) while its rank 1 still writes; save 2 of the tag then takes another generation
    (rank 0 recorded the one save 1 took), so save 1's late rank 1 neither replaces save 2's file of the same name nor
    removes it as its own unlisted one. Save 1's rank 1 resumes "written": once save 2's rank 1 left its done marker
    (it used to remove that file: save 2 committed a manifest listing a missing file), or "committed": after save 2's
    commit (it used to write over the committed file: checksum mismatch), which keeps save 1's error marker (another
    save's in flight): its rank 1 fails at once with rank 0's error instead of waiting out its commit_timeout. Both
    times a previous checkpoint of the tag is replaced by save 2's, which loads bitwise (plain torch copies)."""
    import dataclasses

    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    write, claim = writer.write_rank_file, _async._claim
    resume, commit = threading.Event(), threading.Event()

    def write_rank_file(path, layout, *args):
        name = threading.current_thread().name
        if name == "s1r0":
            raise OSError(28, "No space left on device (simulated)")
        if name == "s1r1":
            resume.wait(30)  # still writing
        return write(path, layout, *args)

    def held_claim(job, outcome, committed):
        if threading.current_thread().name == "s2r0":
            commit.wait(30)
        return claim(job, outcome, committed)

    monkeypatch.setattr(writer, "write_rank_file", write_rank_file)
    monkeypatch.setattr(_async, "_claim", held_claim)

    def start(tag, token, name, timeout=10.0):
        """A save's ranks, in threads ``<name>r0``, ``<name>r1``; rank 0 holds the tag's lock and takes the
        generation as its plan does (both ranks write files)."""
        lock = writer.TagLock.acquire(tmp_path / tag, 10, "test")
        layout = _sim(tmp_path, tag, token)[0][0].layout
        jobs, full = _sim(
            tmp_path, tag, token, timeout=timeout, generation=_async._take_generation(lock, layout, None, 2)
        )
        jobs[0] = dataclasses.replace(jobs[0], lock=lock)
        handles = [_async.SaveHandle(j.tag_dir, 5) for j in jobs]
        threads = [
            threading.Thread(target=_async._run, args=(j, h), name=f"{name}r{j.rank}") for j, h in zip(jobs, handles)
        ]
        for t in threads:
            t.start()
        return threads, handles, {n: t.clone() for n, t in full.items()}

    for case in ("written", "committed"):
        d = tmp_path / case
        threads, handles, _ = start(case, "0" * 16, "s0")
        for t in threads:
            t.join(30)
        assert [h.exception() for h in handles] == [None, None]  # the previous checkpoint of the tag (generation 0)
        resume.clear(), commit.clear()
        s1, h1, _ = start(case, "1" * 16, "s1", timeout=6.0)
        s1[0].join(30)
        assert type(h1[0].exception()) is OSError and not h1[1].done()
        s2, h2, want = start(case, "2" * 16, "s2")  # generation 2: save 1 took 1
        deadline = time.monotonic() + 20
        while not (d / f"ema_async.{'2' * 16}.rank00001.done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if case == "committed":
            commit.set()
            s2[0].join(30)
        resume.set()
        t0 = time.monotonic()
        s1[1].join(30)
        late = time.monotonic() - t0
        commit.set()
        for t in s2:
            t.join(30)
        assert type(h1[1].exception()).__name__ == "_RemoteError", h1[1].exception()
        assert late < 4.0, late  # rank 0's error marker was there (commit_timeout: 6 s)
        assert [h.exception() for h in h2] == [None, None]
        files = ["ema_rank_00000_of_00002.gen2.safetensors", "ema_rank_00001_of_00002.gen2.safetensors"]
        left = [f"ema_async.{'1' * 16}.rank0000{r}.{k}" for r, k in ((0, "error"), (1, "done"), (1, "error"))]
        if case == "written":  # save 1 ended before save 2's commit, on every rank: its markers are removed
            left = []
        got = fe.consolidate(
            tmp_path, case
        )  # save 2's files, whole: no IncompleteCheckpointError, no checksum mismatch
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), case
        assert sorted(os.listdir(d)) == sorted([*left, "ema_manifest.json", *files]), case


def test_a_blocking_save_removes_exactly_the_markers_of_async_saves_that_failed_on_every_rank(tmp_path, monkeypatch):
    """Every rank of a failed async save leaves its error marker (another rank's failure recorded as that rank's), and
    a rank reads no marker of the save after writing its own. A blocking save of the tag, once committed, removes
    the markers of the saves every rank of which left its error marker ("a": rank 1's write failed; "b": a replicated
    model's rank 1 claimed an abort first; "d" once its rank 1, still in flight at the first blocking save, has
    ended), and keeps: those of a save still in flight on a rank ("d" at first), of one whose rank 0 never came ("c":
    a dead rank), of an older release (no number of ranks in them), and a user's files named alike. A blocking save
    that fails before its commit removes nothing. The checkpoint loads bitwise (plain torch clones)."""
    import json

    import torch

    import functional_ema as fe
    from functional_ema import _async
    from functional_ema._checkpoint import writer

    write, part_record = writer.write_rank_file, writer.part_record
    fail = {"write": None, "part": None}  # the rank whose rank file write / part record fails
    held = threading.Event()

    def write_rank_file(path, layout, *args):
        if layout.rank == fail["write"]:
            raise OSError(28, "No space left on device (simulated)")
        return write(path, layout, *args)

    def failing_part(layout, plan):
        if layout.rank == fail["part"]:
            raise OSError(28, "No space left on device (simulated)")
        if layout.rank == 1 and fail["write"] == 0:  # "d": rank 1 in flight until released
            held.wait(30)
        return part_record(layout, plan)

    monkeypatch.setattr(writer, "write_rank_file", write_rank_file)
    monkeypatch.setattr(writer, "part_record", failing_part)
    tokens = {k: k * 16 for k in "abcd"}
    fail["write"] = 1  # a: a ZeRO-3-like save whose rank 1 cannot write
    jobs, _ = _sim(tmp_path, "t", tokens["a"])
    assert all(type(h.exception()).__name__ in ("OSError", "_RemoteError") for h in _run_ranks_in_threads(jobs))
    fail.update(write=None, part=1)  # b: a replicated model's rank 1 fails first and claims the abort
    jobs, _ = _sim(tmp_path, "t", tokens["b"], stage=0, writers=(0,))
    _run_ranks_in_threads(jobs, ranks=(1,))
    assert type(_run_ranks_in_threads(jobs, ranks=(0,))[0].exception()).__name__ == "_RemoteError"
    fail["part"] = None  # c: rank 0 never comes (dead): rank 1 times out and claims the abort
    jobs, _ = _sim(tmp_path, "t", tokens["c"], timeout=0.2)
    _run_ranks_in_threads(jobs, ranks=(1,))
    fail["write"] = 0  # d: rank 0 fails, rank 1 still writing (held) when the blocking save runs
    jobs, _ = _sim(tmp_path, "t", tokens["d"])
    h1 = _async.SaveHandle(jobs[1].tag_dir, 5)
    rank1 = threading.Thread(target=_async._run, args=(jobs[1], h1))
    rank1.start()
    (h0,) = _run_ranks_in_threads(jobs, ranks=(0,))
    assert type(h0.exception()).__name__ == "OSError" and not h1.done()
    fail["write"] = None
    d = tmp_path / "t"
    old = "0123456789abcdef"  # an older release's error marker: no number of ranks
    (d / f"ema_async.{old}.rank00000.error").write_text(json.dumps({"rank": 0, "type": "X", "message": "m"}))
    user = ["ema_async.log", f"ema_async.{'a' * 16}.rank00000.error.bak", f"ema_async.{'a' * 16}.rank0.error"]
    user += [f"ema_async.{'A' * 16}.rank00000.error", "ema_async.aaaaaaaaaaaaaaaa.rank00000.error.tmp-x"]
    for name in user:
        (d / name).write_text("{}")
    own = {k: f"ema_async.{t}.rank0000" for k, t in tokens.items()}
    failed = {
        "a": [f"{own['a']}0.error", f"{own['a']}1.error"],
        "b": [f"{own['b']}0.done", f"{own['b']}0.error", f"{own['b']}1.error"],
    }
    kept = [f"{own['c']}0.done", f"{own['c']}1.done", f"{own['c']}1.error", f"{own['d']}0.error"]
    kept += [f"ema_async.{old}.rank00000.error", *user]
    assert sorted(os.listdir(d)) == sorted([*failed["a"], *failed["b"], *kept])

    model = torch.nn.Linear(4, 3)
    state = _state(model, num_emas=1)
    want = [{n: t.clone() for n, t in e.items()} for e in state.emas]  # plain torch: the oracle
    eio = lambda *a: (_ for _ in ()).throw(OSError(5, "EIO (simulated)"))  # noqa: E731
    monkeypatch.setattr(fe.checkpoint, "write_rank_file", eio)  # the blocking save's own write
    with pytest.raises(fe.checkpoint.CheckpointIOError):  # not committed: nothing removed
        fe.save(state, model, tmp_path, "t")
    assert sorted(os.listdir(d)) == sorted([*failed["a"], *failed["b"], *kept])
    monkeypatch.undo()  # the blocking save writes for real (d's rank 1 read its patched part_record already)
    fe.save(state, model, tmp_path, "t")
    assert sorted(os.listdir(d)) == sorted([*kept, "ema_manifest.json", "ema_rank_00000_of_00001.safetensors"])
    assert _same_trees([dict(e.items()) for e in fe.load(model, tmp_path, "t").emas], want)

    held.set()  # d's rank 1 ends: it writes its file, then finds rank 0's error marker and leaves its own
    rank1.join(30)
    assert h1.done() and type(h1.exception()).__name__ == "_RemoteError", h1.exception()
    kept += [f"{own['d']}1.done", f"{own['d']}1.error"]
    assert sorted(os.listdir(d)) == sorted([*kept, "ema_manifest.json", "ema_rank_00000_of_00001.safetensors"])
    fe.save(state, model, tmp_path, "t")
    kept = [k for k in kept if not k.startswith(own["d"])]
    assert sorted(os.listdir(d)) == sorted([*kept, "ema_manifest.json", "ema_rank_00000_of_00001.gen1.safetensors"])
    assert _same_trees([dict(e.items()) for e in fe.load(model, tmp_path, "t").emas], want)


# ------------------------------------------------------------------------- the helpers, one by one


def test_poll_backs_off_to_50_ms_and_times_out_after_the_deadline(tmp_path, monkeypatch):
    from functional_ema import _async
    from functional_ema.checkpoint import CheckpointError

    class Clock:  # stands in for the module's ``time``: each sleep advances it, nothing waits
        def __init__(self):
            self.now, self.slept = 100.0, []

        def monotonic(self):
            return self.now

        def sleep(self, s):
            self.slept.append(s)
            self.now += s

    clock = Clock()
    monkeypatch.setattr(_async, "time", clock)
    answers = iter([None] * 9 + [True])
    jobs, _ = _sim(tmp_path, "t", "0" * 16, timeout=2.6)
    _async._poll(lambda: next(answers), 200.0, jobs[1], "x")
    assert clock.slept == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]

    clock.slept = []
    with pytest.raises(CheckpointError) as e:
        _async._poll(lambda: None, clock.now, jobs[1], "rank 0's manifest")  # at the deadline: one more look
    assert clock.slept == [0.001]
    assert str(e.value) == (
        f"async save of tag 't' (rank 1): timed out after 2.6 s waiting for rank 0's manifest in {tmp_path / 't'}. "
        "Is the directory shared by all ranks, and are they all alive? The checkpoint is not marked complete"
    )
    with pytest.raises(CheckpointError) as e:  # a wait of its own (not commit_timeout) names its own limit
        _async._poll(lambda: None, clock.now, jobs[1], "y", 60.0)
    assert "(rank 1): timed out after 60 s waiting for y in" in str(e.value), e.value


def test_remote_error_is_read_from_this_saves_error_marker(tmp_path):
    import json

    from functional_ema import _async

    token, other = "00000000000000aa", "00000000000000bb"
    jobs, _ = _sim(tmp_path, "t", token)
    d = tmp_path / "t"
    (d / f"ema_async.{token}.rank00001.done").write_text(json.dumps({"part": {}}))
    (d / f"ema_async.{other}.rank00002.error").write_text(json.dumps({"rank": 2, "type": "X", "message": "old"}))
    (d / f"ema_async.{token}.rank00003.error").write_text("{")  # being written: read at the next poll
    _async._raise_remote_error(jobs[0], set(os.listdir(d)))  # nothing of this save failed (yet)
    (d / f"ema_async.{token}.rank00004.error").write_text(
        json.dumps({"rank": 4, "type": "OSError", "message": "disk full", "checkpoint_error": False})
    )
    with pytest.raises(_async.CheckpointError) as e:
        _async._raise_remote_error(jobs[0], set(os.listdir(d)))
    assert type(e.value).__name__ == "_RemoteError"
    assert str(e.value) == "async save of tag 't' failed on rank 4 (OSError): disk full"


def test_remove_markers_removes_this_saves_and_failed_saves_markers_and_syncs_the_folder(tmp_path, monkeypatch):
    """The committed save's markers (and a temporary one) go, and those of a save that failed on every rank (each
    rank's error marker, naming the save's number of ranks); another save's still in flight (a rank of it has left
    no error marker: it still reads its peers' ones) stays, as does a user's file whose name only starts like one
    (``ema_async.log`` was deleted once)."""
    import json

    from functional_ema import _async, _io

    synced = []
    monkeypatch.setattr(_io, "fsync_dir", synced.append)
    mine, failed, flying = "0123456789abcdef", "fedcba9876543210", "00000000000000aa"
    ours = [
        _async._marker(mine, 1, "done"),
        _async._marker(mine, 123456, "done"),
        _io.tmp_name(tmp_path / _async._marker(mine, 2, "done")).name,
        _async._marker(failed, 0, "error"),
        _async._marker(failed, 1, "error"),
        _async._marker(failed, 1, "done"),
    ]
    others = [_async._marker(flying, 0, "error"), _async._marker(flying, 1, "done")]  # rank 1 still in flight
    users = ["ema_async.log", "ema_async_notes.txt", "ema_async.aa.rank00001.done", "ema_async.0123456789abcdef.txt"]
    for n in [*ours, *others, *users, "ema_manifest.json", "x.safetensors"]:
        (tmp_path / n).write_text(json.dumps({"rank": 0, "world": 2}) if n.endswith(".error") else "{}")
    _async._remove_markers(tmp_path, mine)
    assert sorted(os.listdir(tmp_path)) == sorted([*others, *users, "ema_manifest.json", "x.safetensors"])
    assert synced == [tmp_path]
    _async._remove_markers(tmp_path, mine)  # nothing to remove: no sync
    assert synced == [tmp_path]


def test_is_save_reads_the_manifest_head_only(tmp_path):
    import json

    from functional_ema import _async

    token = "0123456789abcdef"
    early, late = tmp_path / "early.json", tmp_path / "late.json"
    early.write_text(json.dumps({"save_id": token, "pad": "x" * (_async._SAVE_ID_WITHIN + 10)}))
    late.write_text(json.dumps({"pad": "x" * (_async._SAVE_ID_WITHIN + 10), "save_id": token}))
    assert _async._is_save(early, token) and not _async._is_save(late, token)


# ------------------------------------------- two real ranks (plain torch.distributed, a DDP model)


def ranks_worker(root: str) -> dict:
    """Every rank-dependent check of AsyncSaver.save in one launch; returns JSON-able results."""
    import json

    import torch
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema._checkpoint import writer
    from functional_ema.buffers import load_buffers

    rank, out, base = dist.get_rank(), {}, Path(root)
    d = base / "ck"
    model = torch.nn.parallel.DistributedDataParallel(_model())
    state, bufs = _state(model), _buffers(model)
    commits, commit = [], writer.commit_manifest

    def counted(save_dir, tag_dir, manifest):
        commits.append(tag_dir.name)
        return commit(save_dir, tag_dir, manifest)

    writer.commit_manifest = counted

    def files(tag: str) -> list:
        dist.barrier()  # every rank's background part is done: list what they left
        return sorted(os.listdir(d / tag)) if (d / tag).exists() else None

    # 1. Every rank writes (buffers): rank 0 commits once, for both; the same tag again: generation 1 on both.
    saver = fe.AsyncSaver()
    at_call = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    h = saver.save(state, model, d, "t", decay=[0.9, 0.99], buffers=bufs)
    _bump([t for e in state.emas for t in e.values()])
    out["wait"] = [str(h.wait()), h.step]
    out["files"] = files("t")
    out["save_id"] = fe.checkpoint.read_manifest(d, "t")["save_id"]
    out["loaded"] = _same_trees(list(fe.load(model, d, "t").emas), at_call)
    lb = load_buffers(model, d, "t")
    out["buffers"] = _same_trees(list(lb.emas), [dict(e) for e in bufs.emas]) and _same_trees(
        [lb.copied], [bufs.copied]
    )
    h = saver.save(state, model, d, "t", decay=[0.9, 0.99], buffers=bufs)
    h.wait()
    out["again"] = files("t")
    out["again_id"] = fe.checkpoint.read_manifest(d, "t")["save_id"]
    out["commits"] = list(commits)

    # 2. No buffers: only rank 0 writes, and it commits without waiting for rank 1 (held here until then). A failure
    #    of rank 1's part: the first claim decides for both. Rank 1 first (rank 0 held until rank 1's error marker is
    #    there): both fail, nothing committed; rank 0 first (rank 1 fails once the manifest is there): both succeed.
    from functional_ema import _async

    part_record, seen, claim = writer.part_record, {}, _async._claim

    def until(path_there, what: str) -> None:
        deadline = time.monotonic() + 20
        while not path_there() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen[what] = path_there()

    def late(layout, plan):
        until((d / "solo" / "ema_manifest.json").exists, "manifest_first")
        return part_record(layout, plan)

    if rank == 1:
        writer.part_record = late
    saver.save(state, model, d, "solo", decay=[0.9, 0.99]).wait()
    out["solo"] = [files("solo"), dict(seen)]

    def failing(layout, plan):
        if tag == "rep_commit":
            until((d / tag / "ema_manifest.json").exists, "manifest_before_failure")
        raise OSError(28, "No space left on device (simulated)")

    def held_claim(job, outcome, committed):
        until(lambda: any(n.endswith(".rank00001.error") for n in os.listdir(job.tag_dir)), "abort_before_claim")
        return claim(job, outcome, committed)

    seen.clear()
    for tag in ("rep_abort", "rep_commit"):
        if rank == 1:
            writer.part_record = failing
        elif tag == "rep_abort":
            _async._claim = held_claim
        h = saver.save(state, model, d, tag, decay=[0.9, 0.99])
        out[tag] = [error_of(h.wait), files(tag)]
        writer.part_record, _async._claim = part_record, claim
    out["rep_seen"] = dict(seen)

    #    Rank 0's write outlasting commit_timeout (0.4 s before each of its 8 tensors, 1.5 s allowed): rank 1, which
    #    writes no file and starts its clock at once, waits while the file grows. Both commit; it loads bitwise.
    from functional_ema import _io

    orig_write = _io.StreamingWriter.write

    def slow_write(w, key, tensor):
        w._f.flush()  # the bytes so far on disk, where rank 1 sees them
        time.sleep(0.4)
        return orig_write(w, key, tensor)

    if rank == 0:
        _io.StreamingWriter.write = slow_write
    at_call = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    start = time.monotonic()
    h = fe.AsyncSaver(commit_timeout=1.5).save(state, model, d, "slow", decay=[0.9, 0.99])
    out["slow"] = [error_of(h.wait), time.monotonic() - start > 1.5, files("slow")]
    _io.StreamingWriter.write = orig_write
    out["slow_loaded"] = _same_trees(list(fe.load(model, d, "slow").emas), at_call)

    # 3. A background failure on one rank reaches wait() on every rank; a later save of the tag clears it.
    for bad, where in ((1, "write_buffer_file"), (0, "write_rank_file")):
        orig = getattr(writer, where)
        if rank == bad:
            setattr(
                writer, where, lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device (simulated)"))
            )
        h = saver.save(state, model, d, f"e{bad}", decay=[0.9, 0.99], buffers=bufs)
        _wait_done(h)
        setattr(writer, where, orig)
        out[f"error{bad}"] = [error_of(h.wait), files(f"e{bad}")]
    h = saver.save(state, model, d, "e1", decay=[0.9, 0.99], buffers=bufs)
    h.wait()
    out["cleared"] = files("e1")
    #    A blocking save of the other failed tag: committed, it removes that save's markers (each rank left its own).
    at_call = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    fe.save(state, model, d, "e0", decay=[0.9, 0.99])
    out["cleared_blocking"] = [files("e0"), _same_trees(list(fe.load(model, d, "e0").emas), at_call)]

    # 4. A rank refuses its state: every rank raises, the tag folder rank 0 locked is gone, rank 0's
    #    snapshot buffer is kept for the next save.
    ptr = h._buffer.data_ptr() if h._buffer is not None else None
    release = writer.TagLock.release

    def slow_release(lock, remove_empty=False):  # rank 0's: gone before any rank raises, however late
        time.sleep(0.3)
        release(lock, remove_empty)

    if rank == 0:
        writer.TagLock.release = slow_release
    out["refused"] = error_of(lambda: saver.save(state, model, d, "r", decay=[0.9, 0.99] if rank == 0 else [0.9]))
    writer.TagLock.release = release
    out["refused_folder"] = (d / "r").exists()
    h = saver.save(state, model, d, "r2", decay=[0.9, 0.99])
    out["refused_reuse"] = (h._buffer.data_ptr() if h._buffer is not None else None) == ptr
    h.wait()

    # 5. A folder rank 1 does not share (its grace period for a lagging filesystem cut to 0.2 s):
    #    refused on every rank, nothing left in rank 0's.
    check_shared = writer.check_shared
    writer.check_shared = lambda tag_dir, r, what: check_shared(tag_dir, r, what, wait=0.2)
    where = d if rank == 0 else base / "elsewhere" / "deeper"
    out["unshared"] = error_of(lambda: saver.save(state, model, where, "u", decay=[0.9, 0.99]))
    out["unshared_folder"] = os.listdir(where / "u") if (where / "u").exists() else None
    writer.check_shared = check_shared
    h = saver.save(state, model, d, "u2", decay=[0.9, 0.99])
    out["unshared_reuse"] = (h._buffer.data_ptr() if h._buffer is not None else None) == ptr
    h.wait()
    out["commits_total"] = len(commits)
    writer.commit_manifest = commit

    # 6. The process group destroyed: refused before anything is written.
    dist.barrier()
    dist.destroy_process_group()
    out["gone"] = error_of(lambda: fe.AsyncSaver().save(state, model, d, "g"))
    out["gone_folder"] = (d / "g").exists()
    return json.loads(json.dumps(out))


def test_async_ranks_commit_through_files(tmp_path):
    """Two ranks, one launch: what the ranks agree on (the save's id and generation), who commits (rank 0,
    once), failures on one rank raised on both with the failing rank's message, refusals on every rank."""
    res = run_ranks(
        "tests.test_async_save:ranks_worker",
        world_size=2,
        timeout=120,
        env={"FE_DIST_INIT": "torch"},
        root=str(tmp_path),
    )
    d = tmp_path / "ck"
    full = ["buffers_rank_00000_of_00002.safetensors", "buffers_rank_00001_of_00002.safetensors", "ema_manifest.json"]
    assert [r["wait"] for r in res] == [[str(d / "t"), 3]] * 2
    assert [r["files"] for r in res] == [[*full, "ema_rank_00000_of_00002.safetensors"]] * 2
    assert [(r["loaded"], r["buffers"]) for r in res] == [(True, True)] * 2
    assert re.fullmatch("[0-9a-f]{16}", res[0]["save_id"]) and res[1]["save_id"] == res[0]["save_id"]
    assert res[1]["again_id"] == res[0]["again_id"] != res[0]["save_id"]
    gen1 = [f.replace(".safetensors", ".gen1.safetensors") if f.endswith("safetensors") else f for f in full]
    assert [r["again"] for r in res] == [sorted([*gen1, "ema_rank_00000_of_00002.gen1.safetensors"])] * 2
    # rank 0 commits, once (t twice, solo, rep_commit, slow, e1, r2, u2)
    assert [(r["commits"], r["commits_total"]) for r in res] == [(["t", "t"], 8), ([], 0)]
    assert [r["solo"] for r in res] == [
        [["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"], {}],
        [["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"], {"manifest_first": True}],
    ]
    # Rank 1's failure (it writes no file): its abort claimed first fails the save on both ranks; after rank 0's
    # commit, both succeed (rank 0 wrote everything).
    errors, files = [r["rep_abort"][0][:2] for r in res], [r["rep_abort"][1] for r in res]
    remote = f"async save of tag 'rep_abort' failed on rank 1 (OSError): {ENOSPC}"
    assert errors == [["_RemoteError", remote], ["OSError", ENOSPC]], errors
    token = _token_of(files[0][0])
    own = f"ema_async.{token}.rank0000"
    assert files[0] == files[1] == [f"{own}0.done", f"{own}0.error", f"{own}1.error"], files
    assert [r["rep_commit"] for r in res] == [[None, ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]]] * 2
    # (rank 0 reaches its claim, held until rank 1's error marker is there, unless it saw that marker first)
    assert res[0]["rep_seen"] in ({}, {"abort_before_claim": True}), res[0]["rep_seen"]
    assert res[1]["rep_seen"] == {"manifest_before_failure": True}, res[1]["rep_seen"]
    # Rank 0's write longer than commit_timeout: committed on both ranks (rank 1 used to claim its abort), bitwise.
    slow = [None, True, ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]]
    assert [r["slow"] for r in res] == [slow, slow] and [r["slow_loaded"] for r in res] == [True, True], res

    for bad in (1, 0):
        errors, files = [r[f"error{bad}"][0][:2] for r in res], [r[f"error{bad}"][1] for r in res]
        assert errors[bad] == ["OSError", ENOSPC], errors
        assert errors[1 - bad] == [
            "_RemoteError",
            f"async save of tag 'e{bad}' failed on rank {bad} (OSError): {ENOSPC}",
        ]
        # one save id on both ranks; and the generation it took (0: both ranks write files, one could write late)
        assert files[0] == files[1] and files[0][0] == ".ema_generation", files
        assert len({_token_of(f) for f in files[0][1:]}) == 1, files
        token = _token_of(files[0][1])
        own = f"ema_async.{token}.rank0000"
        want = [f"{own}0.error", f"{own}1.error"] if bad else [f"{own}0.error", f"{own}1.done", f"{own}1.error"]
        assert files[0] == [".ema_generation", *want], files
    # The later saves of those tags take generation 1, and their commits remove the record
    assert [r["cleared"] for r in res] == [[*gen1, "ema_rank_00000_of_00002.gen1.safetensors"]] * 2
    blocking = [["ema_manifest.json", "ema_rank_00000_of_00002.gen1.safetensors"], True]
    assert [r["cleared_blocking"] for r in res] == [blocking] * 2, [r["cleared_blocking"] for r in res]

    decays = "got 1 decays for a state tracking 2 EMAs"
    assert [r["refused"][:2] for r in res] == [
        ["CheckpointError", f"async save (checking the state) failed on rank 1 of 2 (ValueError): {decays}"],
        ["ValueError", decays],
    ]
    assert [(r["refused_folder"], r["refused_reuse"]) for r in res] == [(False, True)] * 2
    unshared = (
        f"AsyncSaver.save: rank 1 does not see the tag folder {tmp_path / 'elsewhere' / 'deeper' / 'u'} that rank 0 is "
        "writing (its lock file .ema_write.lock is missing here): the checkpoint directory is not shared by every rank "
        "(node-local storage?). A checkpoint saved so could not be loaded: save to a directory every rank shares, or with shared=False (each rank writes only its own files: docs/many-nodes.md). "
        "Nothing was committed"
    )
    assert [r["unshared"][:2] for r in res] == [
        ["CheckpointError", f"async save (the folder is shared) failed on rank 1 of 2 (CheckpointError): {unshared}"],
        ["CheckpointError", unshared],
    ]
    assert [(r["unshared_folder"], r["unshared_reuse"]) for r in res] == [(None, True), ([], True)]
    gone = (
        "functional_ema.AsyncSaver.save: the model's layout spans 2 ranks but torch.distributed is not initialized in "
        "this process (destroy_process_group called?). functional_ema.AsyncSaver.save is collective: call it on every "
        "rank while the process group that trains the model is up (before destroy_process_group)"
    )
    assert [(r["gone"][:2], r["gone_folder"]) for r in res] == [(["CheckpointError", gone], False)] * 2


def groups_worker(root: str) -> dict:
    """Four ranks, two DDP groups ({0, 1} and {2, 3}) of one job."""
    import torch
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema._checkpoint import writer

    rank, d, out = dist.get_rank(), Path(root) / "ck", {}
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = torch.nn.parallel.DistributedDataParallel(_model(), process_group=groups[rank // 2])
    state, bufs = _state(model), _buffers(model)
    saver = fe.AsyncSaver()
    # Each group into its own tag, at the same time: each agrees within its group, not across the job.
    out["own"] = str(saver.save(state, model, d, f"g{rank // 2}", decay=[0.9, 0.99]).wait())
    # Both groups into one tag: every rank of the job refuses, before writing anything.
    out["clash"] = error_of(lambda: saver.save(state, model, d, "same", decay=[0.9, 0.99], buffers=bufs))
    out["clash_folder"] = (d / "same").exists()
    # Rank 3 does not share group 1's folder (grace period cut to 0.2 s): group 1 refuses its save; group 0,
    # saving beside it at the same time, is not affected.
    check_shared = writer.check_shared
    writer.check_shared = lambda tag_dir, r, what: check_shared(tag_dir, r, what, wait=0.2)
    where = Path(root) / "elsewhere" if rank == 3 else d
    out["beside"] = error_of(lambda: saver.save(state, model, where, f"b{rank // 2}", decay=[0.9, 0.99]).wait())
    writer.check_shared = check_shared
    dist.barrier()
    return out


def test_async_ranks_two_groups_of_one_job(tmp_path):
    """Each data-parallel group agrees within itself (its process group, not the job's); two groups saving
    into one folder are refused on every rank of the job, naming the file they would share."""
    res = run_ranks(
        "tests.test_async_save:groups_worker",
        world_size=4,
        timeout=120,
        env={"FE_DIST_INIT": "torch"},
        root=str(tmp_path),
    )
    d = tmp_path / "ck"
    assert [r["own"] for r in res] == [str(d / "g0")] * 2 + [str(d / "g1")] * 2
    clash = (
        f"functional_ema.AsyncSaver.save: ranks [0, 2] of the job (world size 4) would all write "
        f"{os.path.realpath(d / 'same' / 'ema_rank_00000_of_00002.safetensors')} (2 more files likewise): each would "
        "overwrite the others' EMA. The model's pieces are spread over data-parallel groups of 2 rank(s), and 2 such "
        "groups save into one folder: save each group's EMA into its own folder (or tag). Nothing was written"
    )
    assert [(r["clash"][:2], r["clash_folder"]) for r in res] == [(["CheckpointError", clash], False)] * 4
    unshared = (
        f"AsyncSaver.save: rank 1 does not see the tag folder {tmp_path / 'elsewhere' / 'b1'} that rank 0 is writing "
        "(its lock file .ema_write.lock is missing here): the checkpoint directory is not shared by every rank "
        "(node-local storage?). A checkpoint saved so could not be loaded: save to a directory every rank shares, or with shared=False (each rank writes only its own files: docs/many-nodes.md). "
        "Nothing was committed"
    )
    assert [r["beside"] and r["beside"][:2] for r in res] == [
        None,
        None,
        ["CheckpointError", f"async save (the folder is shared) failed on rank 1 of 2 (CheckpointError): {unshared}"],
        ["CheckpointError", unshared],
    ]


def private_worker(root: str) -> dict:
    """AsyncSaver.save(..., shared=False) on FSDP2 (each rank holds half of every parameter), one folder per
    rank: written in the background, committed over the process group at the saver's next collective call."""
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe

    rank, base, out = dist.get_rank(), Path(root), {}
    own = base / f"own{rank}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    full = lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    state, ref = fe.init_ema(fe.local_shards(model)), full()
    saver = fe.AsyncSaver()

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(3, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        nonlocal state
        state = fe.update(state, fe.local_shards(model), step, decay=0.9)
        for n, t in full().items():
            ref[n].lerp_(t, 0.1)

    def local(s) -> list:
        return [t.clone() for t in s.emas[0].values()]

    def listing(tag: str) -> list:
        return sorted(p.name for p in (own / tag).iterdir()) if (own / tag).is_dir() else []

    for step in (1, 2, 3):
        train(step)
    at_call = local(state)
    if rank == 0:
        torch.save(ref, base / "ref3.pt")
    h = saver.save(state, model, own, "t", decay=0.9, shared=False)
    train(4)  # the training goes on; the write in the background holds the snapshot
    saver._pending[0].write.result(timeout=60)  # the background write is done; the commit is not
    out["before_commit"] = [listing("t"), h.done(), (own / "ema_latest").exists()]
    out["wait"] = [str(h.wait()), h.step, h.done()]
    out["after_commit"] = listing("t")
    out["t_loads"] = all(torch.equal(a, b) for a, b in zip(at_call, local(fe.load(model, own, "t", shared=False))))

    # The next save commits the one before it: "u" is complete once "v" is started, "v" at saver.wait().
    at_u = local(state)
    saver.save(state, model, own, "u", decay=0.9, shared=False)
    train(5)
    saver.save(state, model, own, "v", decay=0.9, shared=False)
    out["u_committed_by_next_save"] = (own / "u" / "ema_manifest.json").exists()
    out["v_before_wait"] = (own / "v" / "ema_manifest.json").exists()
    saver.wait()
    out["u_v"] = [
        all(torch.equal(a, b) for a, b in zip(want, local(fe.load(model, own, tag, shared=False))))
        for want, tag in ((at_u, "u"), (local(state), "v"))
    ]
    out["latest"] = (own / "ema_latest").read_text()

    # Rank 1's background write fails (a folder where its file goes): both ranks fail at the commit, no
    # manifest anywhere, rank 1's blocker left as it was, and every folder's "t" still loads.
    if rank == 1:
        (own / "f" / "ema_rank_00001_of_00002.safetensors").mkdir(parents=True)
    dist.barrier()
    hf = saver.save(state, model, own, "f", decay=0.9, shared=False)
    out["failed"] = error_of(hf.wait)
    out["failed_again"] = error_of(hf.wait)
    out["failed_files"] = listing("f")
    out["t_still_loads"] = all(
        torch.equal(a, b) for a, b in zip(at_call, local(fe.load(model, own, "t", shared=False)))
    )
    # The same failure nobody waited for: the next save raises it on every rank, before writing.
    saver.save(state, model, own, "f", decay=0.9, shared=False)
    out["next_raises"] = error_of(lambda: saver.save(state, model, own, "g", decay=0.9, shared=False))
    out["g_exists"] = (own / "g").exists()
    saver.wait()
    dist.barrier()
    return json.loads(json.dumps(out))


def test_async_ranks_private_folders(tmp_path):
    """``shared=False``: FSDP2 at 2 ranks, one folder each; the manifest appears only at the commit, in both
    folders, byte for byte; each rank loads the state at the call; the merged folders consolidate to the
    plain-torch EMA of the full tensors, bitwise; a failure on one rank fails both, at wait or the next save."""
    import torch

    import functional_ema as fe

    res = run_ranks(
        "tests.test_async_save:private_worker",
        world_size=2,
        timeout=180,
        env={"FE_DIST_INIT": "torch"},
        root=str(tmp_path),
    )
    files = ["ema_rank_00000_of_00002.safetensors", "ema_rank_00001_of_00002.safetensors"]
    for r, f in enumerate(files):
        assert res[r]["before_commit"] == [[".ema_write.lock", f], False, False]
        assert res[r]["after_commit"] == ["ema_manifest.json", f]
    assert [r["wait"] for r in res] == [[str(tmp_path / f"own{r}" / "t"), 3, True] for r in range(2)]
    assert all(r["t_loads"] and r["u_v"] == [True, True] for r in res)
    assert [(r["u_committed_by_next_save"], r["v_before_wait"], r["latest"]) for r in res] == [(True, False, "v\n")] * 2
    for tag in ("t", "u", "v"):
        assert len({(tmp_path / f"own{r}" / tag / "ema_manifest.json").read_bytes() for r in range(2)}) == 1
    merged = tmp_path / "merged"
    for r in range(2):
        shutil.copytree(tmp_path / f"own{r}", merged, dirs_exist_ok=True)
    got, want = fe.consolidate(merged, "t"), torch.load(tmp_path / "ref3.pt", weights_only=True)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)

    blocked = str(tmp_path / "own1" / "f" / files[1])
    assert res[1]["failed"][0] == "CheckpointIOError" and blocked in res[1]["failed"][1], res[1]["failed"]
    assert res[0]["failed"][:1] == ["CheckpointIOError"], res[0]["failed"]
    assert res[0]["failed"][1].startswith("async save (the background writes) failed on rank 1 of 2"), res[0]["failed"]
    assert all(r["failed_again"] == r["failed"] for r in res)
    assert [r["failed_files"] for r in res] == [[], [files[1]]]  # rank 0's new file removed; rank 1's blocker kept
    assert all(r["t_still_loads"] for r in res)
    for r in res:
        name, msg = r["next_raises"][:2]
        assert name == "CheckpointError" and "the previous async EMA save (step 5" in msg, msg
    assert [r["g_exists"] for r in res] == [False, False]


def peer_missing_worker(root: str) -> dict:
    """A private async save whose commit a peer does not come to. Two DDP models on two gloo groups of their own (a
    bounded wait that times out closes its group's connections), the world group between the cases.

    * ``exit``: rank 0 leaves ``with fe.AsyncSaver(commit_timeout=2)`` on an exception while rank 1 is busy for 5 s
      (still training): rank 0's commit waits 2 s for rank 1 (it waited in an all-reduce until rank 1 came, and would
      until gloo's 30 min timeout had rank 1 been in another collective), then its own exception leaves the block,
      the save's failure in a note. Rank 1's commit then fails at once.
    * ``wait``: rank 0's ``handle.wait(timeout=1)`` while rank 1 comes 4 s later (it returned only then): the wait
      for the other ranks is ``commit_timeout`` (2 s), not the wait's own timeout (a timed-out exchange closes the
      group: a short wait on ranks a little apart must not).
    * ``again``: as ``wait``, with rank 0's background write still going on (held 8 s) when its commit fails (2 s),
      rank 1 coming 5 s late (3 s of margin on either side);
      then the same tag saved again at once on the same saver (over a group of its own, the last one being closed)."""
    import json

    import torch
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema import _async_private

    rank, base, out = dist.get_rank(), Path(root), {}
    own = base / f"own{rank}"
    groups = [dist.new_group(backend="gloo") for _ in range(4)]

    def setup(group, tag: str):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3), process_group=group)
        state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
        fe.save(state, model, own, tag, decay=0.5, shared=False)  # the previous checkpoint, complete
        with torch.no_grad():
            for t in model.parameters():
                t.add_(1.0)
        return model, fe.update(state, fe.local_shards(model), 2, decay=0.5)

    model, state = setup(groups[0], "t")
    t0 = time.monotonic()
    try:
        with fe.AsyncSaver(commit_timeout=2) as saver:
            saver.save(state, model, own, "t", decay=0.5, shared=False)
            if rank == 0:
                raise RuntimeError("boom on rank 0")
            time.sleep(5)  # rank 1 trains on
    except Exception as e:  # noqa: BLE001
        out["exit"] = [type(e).__name__, str(e), list(getattr(e, "__notes__", [])), time.monotonic() - t0]
    out["exit_files"] = sorted(os.listdir(own / "t"))
    dist.barrier()

    model, state = setup(groups[1], "w")
    saver = fe.AsyncSaver(commit_timeout=2)
    h = saver.save(state, model, own, "u", decay=0.5, shared=False)
    if rank == 1:
        time.sleep(4)
    t0 = time.monotonic()
    out["wait"] = [*(error_of(lambda: h.wait(timeout=1)) or []), time.monotonic() - t0]
    out["saver_wait"] = error_of(saver.wait)  # raised already by the handle's wait
    out["wait_files"] = sorted(os.listdir(own / "u"))
    dist.barrier()

    model, state = setup(groups[2], "a")
    write, held = _async_private.write_private, [8.0] if rank == 0 else []

    def slow_once(*args):
        if held:
            time.sleep(held.pop())
        return write(*args)

    _async_private.write_private = slow_once
    saver = fe.AsyncSaver(commit_timeout=20)  # the wait for the others: the save's timeout (2 s)
    h = saver.save(state, model, own, "v", decay=0.5, shared=False, timeout=2)
    if rank == 1:
        time.sleep(5)  # well after rank 0 gave up (2 s), well before its write ends (8 s)
    out["again_wait"] = error_of(h.wait)
    out["again_left"] = sorted(os.listdir(own / "v")) if (own / "v").exists() else []  # at once, on either rank
    again = torch.nn.parallel.DistributedDataParallel(model.module, process_group=groups[3])
    out["again"] = error_of(lambda: saver.save(state, again, own, "v", decay=0.5, shared=False).wait())
    _async_private.write_private = write
    out["again_bitwise"] = False
    if out["again"] is None:  # the save went through on every rank (it is collective): load it back
        loaded = fe.load(again, own, "v", shared=False)
        got, want = list(loaded.emas[0].values()), list(state.emas[0].values())
        out["again_bitwise"] = int(loaded.step) == 2 and len(got) == len(want) and all(map(torch.equal, got, want))
    dist.barrier()
    return json.loads(json.dumps(out))


def test_async_ranks_private_commit_whose_peer_never_comes(tmp_path):
    """A private async save's commit is bounded: a rank whose peer does not come raises ``CheckpointTimeoutError``
    (a ``TimeoutError``) naming the tag, the missing rank and the limit, after the limit (``commit_timeout``, or the
    wait's timeout); an exception leaving the ``with`` block is raised as it is, the failure in a note. Nothing is
    committed: the tag's previous checkpoint consolidates to its state, bitwise; the new files are removed."""
    import torch

    import functional_ema as fe

    res = run_ranks(
        "tests.test_async_save:peer_missing_worker",
        world_size=2,
        timeout=120,
        env={"FE_DIST_INIT": "torch"},
        root=str(tmp_path),
    )
    name, msg, notes, took = res[0]["exit"]
    assert (name, msg) == ("RuntimeError", "boom on rank 0") and 1.9 < took < 4.5, res[0]["exit"]
    (note,) = notes
    assert note.startswith("functional_ema: leaving the `with fe.AsyncSaver()` block, its saves failed: ")
    assert "CheckpointTimeoutError: AsyncSaver: the commit of the async save of tag 't' (step 2)" in note, note
    assert "rank(s) [1] of the group did not arrive within 2 s" in note and "(limit 2 s)" in note, note
    assert "commit_timeout (2 s)" in note and "previous checkpoint is intact" in note, note
    name, msg, notes, took = res[1]["exit"]  # rank 1 came late: its commit failed at once (no peer)
    assert name == "CheckpointTimeoutError" and "of tag 't' (step 2)" in msg and took < 8, res[1]["exit"]

    name, msg, mro, took = res[0]["wait"]
    assert name == "CheckpointTimeoutError" and "TimeoutError" in mro and 1.9 < took < 3.9, res[0]["wait"]
    assert "of tag 'u' (step 2)" in msg and "rank(s) [1] of the group did not arrive within 2 s" in msg, msg
    assert res[1]["wait"][0] == "CheckpointTimeoutError" and res[1]["wait"][-1] < 3, res[1]["wait"]
    assert [r["saver_wait"] for r in res] == [None, None]

    # Nothing committed, the new files gone: t is the first save's (rank 0 holds the replicated model's pieces, each
    # folder the manifest), u has no checkpoint.
    assert [r["exit_files"] for r in res] == [["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]] * 2, res
    assert [r["wait_files"] for r in res] == [[], []], res
    # The failed save's files removed and its lock released before wait() raised (it said "Call saver.wait()" to the
    # save of the tag right after, a refusal on both ranks): the tag saves again at once, and loads bitwise.
    assert [r["again_wait"][0] for r in res] == ["CheckpointTimeoutError"] * 2, [r["again_wait"] for r in res]
    assert [(r["again_left"], r["again"], r["again_bitwise"]) for r in res] == [([], None, True)] * 2, res
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    want = {n: 0.5 * t.detach() + 0.5 * t.detach() for n, t in model.named_parameters()}  # step 1 from the weights
    for r in range(2):
        got = fe.consolidate(tmp_path / f"own{r}", "t")
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_private_save_of_one_process_commits_at_wait(tmp_path):
    """``shared=False`` without a process group: the file is written in the background, the manifest only at the
    commit (the handle's ``wait``, or the saver's next save or ``wait``); what loads is the state at the call."""
    import functional_ema as fe

    model = _model()
    state = _state(model)
    at_call = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    saver = fe.AsyncSaver()
    h = saver.save(state, model, tmp_path, "t", decay=[0.9, 0.99], shared=False)
    _bump([t for e in state.emas for t in e.values()])
    saver._pending[0].write.result(timeout=60)
    assert sorted(os.listdir(tmp_path / "t")) == [".ema_write.lock", "ema_rank_00000_of_00001.safetensors"]
    assert not h.done() and h.exception() is None and not (tmp_path / "ema_latest").exists()
    assert h.wait() == tmp_path / "t" and h.done() and saver._pending == []
    assert sorted(os.listdir(tmp_path / "t")) == ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]
    assert _same_trees(list(fe.load(model, tmp_path, "t", shared=False).emas), at_call)
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), at_call)  # one process: its folder is complete

    # committed by the next save (of either kind), and by the saver's wait
    at_u = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    hu = saver.save(state, model, tmp_path, "u", decay=[0.9, 0.99], shared=False)
    hv = saver.save(state, model, tmp_path, "v", decay=[0.9, 0.99])
    assert hu.done() and hu.exception() is None and (tmp_path / "u" / "ema_manifest.json").exists()
    hv.wait()
    hw = saver.save(state, model, tmp_path, "w", decay=[0.9, 0.99], shared=False)
    saver.wait()
    assert hw.done() and (tmp_path / "ema_latest").read_text() == "w\n"
    for tag in ("u", "v", "w"):
        assert _same_trees(list(fe.load(model, tmp_path, tag).emas), at_u), tag
    # The same tag again: generation 1 in the file names and in the manifest that lists them.
    _bump([t for e in state.emas for t in e.values()])
    at_again = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    saver.save(state, model, tmp_path, "w", decay=[0.9, 0.99], shared=False).wait()
    assert sorted(os.listdir(tmp_path / "w")) == ["ema_manifest.json", "ema_rank_00000_of_00001.gen1.safetensors"]
    assert fe.checkpoint.read_manifest(tmp_path, "w")["generation"] == 1
    assert _same_trees(list(fe.load(model, tmp_path, "w", shared=False).emas), at_again)

    # no tag: the default of a model that counts no steps, global_step<state.step>, as fe.save's
    assert saver.save(state, model, tmp_path, decay=[0.9, 0.99], shared=False).wait() == (
        tmp_path / f"global_step{int(state.step)}"
    )
    assert _same_trees(list(fe.load(model, tmp_path, f"global_step{int(state.step)}").emas), at_again)

    # refused at the call: a bad value for shared, before anything is written
    with pytest.raises(TypeError) as e:
        saver.save(state, model, tmp_path, "x", shared="no")
    assert str(e.value) == "shared must be True or False, got str 'no'" and not (tmp_path / "x").exists()


def test_private_save_background_failure_and_commit_timeout(tmp_path, monkeypatch):
    """A failed background write fails the save at its commit (nothing committed, the new file removed, the
    tag's previous checkpoint intact); a write that outlives commit_timeout fails it too, naming the limit, and a
    save of that tag right after waits for the write to end instead of being refused."""
    import functional_ema as fe
    from functional_ema._checkpoint import private

    model = _model()
    state = _state(model)
    saver = fe.AsyncSaver()
    saver.save(state, model, tmp_path, "t", decay=[0.9, 0.99], shared=False).wait()
    before = (tmp_path / "t" / "ema_manifest.json").read_bytes()
    _bump([t for e in state.emas for t in e.values()])
    monkeypatch.setattr(private, "write_rank_file", lambda *a: (_ for _ in ()).throw(OSError(28, "No space (sim)")))
    h = saver.save(state, model, tmp_path, "t", decay=[0.9, 0.99], shared=False)
    with pytest.raises(fe.checkpoint.CheckpointIOError) as e:
        h.wait()
    assert str(e.value) == (
        f"rank 0 could not write {tmp_path / 't' / 'ema_rank_00000_of_00001.gen1.safetensors'}: No space (sim) "
        "(errno 28, ENOSPC); free space on that filesystem (or save elsewhere) and save again"
    )
    assert (tmp_path / "t" / "ema_manifest.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "t")) == ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]
    monkeypatch.undo()

    from functional_ema import _async_private

    release = threading.Event()
    write = _async_private.write_private
    monkeypatch.setattr(_async_private, "write_private", lambda *a: (release.wait(30), write(*a))[1])
    slow = fe.AsyncSaver(commit_timeout=0.2)
    hs = slow.save(state, model, tmp_path, "s", decay=[0.9, 0.99], shared=False)
    with pytest.raises(fe.checkpoint.CheckpointError) as e:
        hs.wait()
    assert str(e.value) == (
        f"async save of tag 's' (rank 0): its background write into {tmp_path / 's'} did not finish within "
        "commit_timeout=0.2 s. Nothing of it is committed; each folder's previous checkpoint is intact"
    )
    # The tag saved again right away: it waits for the failed save's write to end (its lock no longer says it awaits
    # this thread's commit: it was refused at once, naming the saver.wait() that had just raised), then goes through.
    threading.Timer(0.5, release.set).start()
    at_again = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    slow.save(state, model, tmp_path, "s", decay=[0.9, 0.99], shared=False, timeout=30)
    slow.wait()
    assert _same_trees(list(fe.load(model, tmp_path, "s").emas), at_again)
    assert sorted(os.listdir(tmp_path / "s")) == ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]


def test_saves_in_flight_commit_in_start_order(tmp_path, monkeypatch):
    """Two saves in flight whose writes finish in the other order: the later one commits after the earlier, so
    ``ema_latest`` names the later save and ``load(tag=None)`` resumes it (it resumed the older step once)."""
    import torch

    import functional_ema as fe
    from functional_ema._checkpoint import writer

    real = writer.write_rank_file

    def slow_for_s4(path, *a, **k):
        if path.parent.name == "s4":
            time.sleep(1.0)  # the first save's write ends after the second's
        return real(path, *a, **k)

    monkeypatch.setattr(writer, "write_rank_file", slow_for_s4)
    model = _model()
    state = fe.init_ema(fe.local_shards(model))
    saver = fe.AsyncSaver(max_in_flight=2)
    for step in (4, 5):
        _bump(list(model.parameters()))
        state = fe.update(state, fe.local_shards(model), step, decay=0.5)
        saver.save(state, model, tmp_path, f"s{step}")
    at_s5 = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    saver.wait()
    assert (tmp_path / "ema_latest").read_text() == "s5\n"
    loaded = fe.load(model, tmp_path)
    assert int(loaded.step) == 5 and _same_trees(list(loaded.emas), at_s5)
    assert torch.equal(fe.load(model, tmp_path, "s4").step, torch.tensor(4))


def test_ema_latest_never_goes_back_to_a_save_started_earlier(tmp_path, monkeypatch):
    """An async save committed after a blocking save started later (its commit awaits the saver's next call, or its
    write is slow): ``ema_latest`` keeps naming the later save and ``load(tag=None)`` resumes it bitwise, in a private
    folder, a shared one (the commit thread beside the blocking save) and at a URL (it went back to the older save)."""
    import functional_ema as fe
    from functional_ema._checkpoint import writer
    from functional_ema._storage import storage_for

    real = writer.write_rank_file

    def slow_for_s2(path, *a, **k):
        if path.parent.name == "s2":
            time.sleep(1.0)  # the async save's write ends after the blocking save committed
        return real(path, *a, **k)

    monkeypatch.setattr(writer, "write_rank_file", slow_for_s2)
    model = _model()
    url = f"memory://fe-latest-{tmp_path.name}/run"
    for where, shared in ((tmp_path / "private", False), (tmp_path / "shared", True), (url, True)):
        saver, state = fe.AsyncSaver(), fe.init_ema(fe.local_shards(model))
        _bump(list(model.parameters()))
        state = fe.update(state, fe.local_shards(model), 2, decay=0.5)
        saver.save(state, model, where, "s2", shared=shared)
        _bump(list(model.parameters()))
        state = fe.update(state, fe.local_shards(model), 3, decay=0.5)
        at_s3 = [{n: t.clone() for n, t in e.items()} for e in state.emas]
        fe.save(state, model, where, "s3", shared=shared)
        saver.wait()
        latest = (
            storage_for(url).read_bytes("ema_latest") if where == url else (Path(where) / "ema_latest").read_bytes()
        )
        assert latest == b"s3\n", where
        loaded = fe.load(model, where, shared=shared)
        assert int(loaded.step) == 3 and _same_trees(list(loaded.emas), at_s3), where
        assert int(fe.load(model, where, "s2", shared=shared).step) == 2, where  # the older save is complete


def test_save_of_a_tag_pending_in_a_private_async_save_is_refused_at_once(tmp_path):
    """A blocking save (private or shared) of a tag whose private async save awaits its commit in this thread
    would wait for itself: refused at once naming ``saver.wait()`` (it waited its whole timeout); after the
    commit the same save goes through, and the tag holds it."""
    import functional_ema as fe

    model = _model()
    state = _state(model)
    at_call = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    saver = fe.AsyncSaver()
    h = saver.save(state, model, tmp_path, "t", shared=False)
    saver._pending[0].write.result(timeout=60)
    for shared in (False, True):
        t0 = time.monotonic()
        with pytest.raises(fe.checkpoint.CheckpointError) as e:
            fe.save(state, model, tmp_path, "t", shared=shared, timeout=30)
        assert time.monotonic() - t0 < 10 and "held by an AsyncSaver.save(shared=False) of this thread" in str(e.value)
        assert "Call saver.wait()" in str(e.value) and not h.done()
    h.wait()
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), at_call)
    _bump([t for e in state.emas for t in e.values()])
    at_again = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    fe.save(state, model, tmp_path, "t", shared=False, timeout=30)
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), at_again)


def test_a_failure_before_the_background_write_reaches_wait_and_frees_the_tag(tmp_path, monkeypatch):
    """An exception of the background job before its file write (``writer.save_files``: e.g. a leftover manifest it
    cannot plan from) reaches ``wait`` and releases the tag's lock: it died in the executor once, the handle never
    finished (``wait()`` blocked forever) and the tag stayed locked. The previous checkpoint still loads, and the tag
    saves again."""
    import functional_ema as fe
    from functional_ema._checkpoint import writer

    model = _model()
    state = _state(model)
    at_t = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    fe.save(state, model, tmp_path, "t", decay=[0.9, 0.99])
    real = writer.save_files

    def fails_in_the_background(*args, **kwargs):
        if threading.current_thread().name.startswith("fe_async_save"):
            raise RuntimeError("injected: save_files in the background")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "save_files", fails_in_the_background)
    _bump([t for e in state.emas for t in e.values()])
    saver = fe.AsyncSaver()
    h = saver.save(state, model, tmp_path, "t", decay=[0.9, 0.99])
    with pytest.raises(RuntimeError, match=r"^injected: save_files in the background$"):
        h.wait(timeout=20)
    assert h.done() and isinstance(h.exception(), RuntimeError)
    monkeypatch.undo()
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), at_t)
    assert sorted(os.listdir(tmp_path / "t")) == sorted(
        ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors", _async_marker(h, "error")]
    )
    t0 = time.monotonic()
    at_again = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    fe.save(state, model, tmp_path, "t", decay=[0.9, 0.99], timeout=5)  # the tag's lock is free
    assert time.monotonic() - t0 < 5 and _same_trees(list(fe.load(model, tmp_path, "t").emas), at_again)


def _async_marker(handle, kind: str) -> str:
    """The one marker of ``kind`` in the handle's tag folder."""
    (name,) = [n for n in os.listdir(handle.tag_dir) if n.startswith("ema_async.") and n.endswith(f".{kind}")]
    return name


def test_handle_wait_of_a_private_save_honours_its_timeout(tmp_path, monkeypatch):
    """``SaveHandle.wait(timeout)`` of a private save whose write is still running raises ``TimeoutError`` after
    ``timeout`` (it waited for the write, up to commit_timeout); the save stays pending, committed later."""
    import functional_ema as fe
    from functional_ema import _async_private

    release = threading.Event()
    write = _async_private.write_private
    monkeypatch.setattr(_async_private, "write_private", lambda *a: (release.wait(30), write(*a))[1])
    model = _model()
    state = _state(model)
    at_call = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    saver = fe.AsyncSaver()
    h = saver.save(state, model, tmp_path, "t", shared=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still running after 0\.3 s"):
        h.wait(timeout=0.3)
    assert time.monotonic() - t0 < 5 and not h.done() and len(saver._pending) == 1
    release.set()
    assert h.wait(timeout=30) == tmp_path / "t" and h.done() and saver._pending == []
    assert _same_trees(list(fe.load(model, tmp_path, "t").emas), at_call)
