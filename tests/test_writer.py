"""The checkpoint writer (``functional_ema/_checkpoint/writer.py``) function by function: the plan a rank
saves under, the metadata and manifest records of its files, the manifest of a save, the cleanup after
it, the tag lock, and the agreement of the ranks on the plan.

Single-process tests call the writer's functions directly with real states (``fe.init_ema`` over a
small module's ``local_shards``, or over the pieces of a sharded layout) and compare what they return
or write with values computed here (the files parsed as raw safetensors, checksums with ``xxhash``).
One 2-rank launch (plain torch.distributed, no DeepSpeed) batches the ranks' agreements: agreeing plans,
plans that differ in tag, dtype or layout, a rank whose plan fails, a rank that does not see the
folder the committing rank writes; every rank's error is asserted exactly, with what it cost in
collectives and what is left on disk.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import shutil
import socket
import struct
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import functional_ema as fe
from functional_ema import buffers as fb
from functional_ema._checkpoint import writer
from functional_ema._checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from functional_ema._checkpoint.format import FORMAT_VERSION, LATEST_NAME, LOCK_NAME, MANIFEST_NAME, MAX_EXTRA_BYTES
from functional_ema._layout import ExpertLayout, ModelPart, ShardLayout, ShardSpec
from functional_ema._state import EmaState
from functional_ema._testing.multirank import error_of, run_ranks

VERSION = f"functional_ema {fe.__version__}"
NOTE = (
    "functional_ema EMA checkpoint: complete because this manifest exists (with every file it lists). "
    "Each rank file holds 'emas.<k>.<parameter>' = that rank's 1-D piece of EMA k; its 'layout' metadata "
    "says where the piece sits in the full parameter"
)
FIX = ". Every rank must save the same state (the same step: update every rank alike) with the same tag"


def _model(seed: int = 0, width: int = 2) -> torch.nn.Module:
    """A small plain module with trainable parameters and buffers (BatchNorm's running stats and counter)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.BatchNorm1d(width))


def _digest(value: Any) -> int:
    """The 62-bit xxh3 digest of a value's sorted JSON (how the plan's layout record names the shapes)."""
    return xxhash.xxh3_64_intdigest(json.dumps(value, sort_keys=True).encode()) >> 2


def _zero3(rank: int, world: int = 2, **kw: Any) -> ShardLayout:
    """ZeRO-3's even cut of parameters a (2x3) and b (3): ceil(numel / world) elements per rank."""
    specs = {}
    for name, shape in {"a": (2, 3), "b": (3,)}.items():
        numel = math.prod(shape)
        per = -(-numel // world)
        lo = min(rank * per, numel)
        specs[name] = ShardSpec(shape, lo, min(lo + per, numel) - lo)
    return ShardLayout(rank, world, 3, specs, **kw)


def _pieces(layout: ShardLayout, num_emas: int = 2) -> EmaState:
    """A state over ``layout``'s pieces, EMA k of parameter n filled with distinct values."""
    emas = tuple(
        {n: torch.arange(s.numel, dtype=torch.float32) + 10 * k + s.offset for n, s in layout.specs.items()}
        for k in range(num_emas)
    )
    return EmaState(torch.tensor(7, dtype=torch.int64), emas)


def _parse(path: Path) -> tuple[dict, bytes, bytes]:
    """A safetensors file as (header JSON, header bytes with the 8-byte prefix, data), read here."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[: 8 + n], raw[8 + n :]


def _checksums(path: Path) -> tuple[str, dict[str, list[str]]]:
    """The file's header checksum and each tensor's chunk checksums (xxh3_64, hex; one chunk per
    non-empty tensor of these small files, none for an empty one), in file order."""
    header, head, data = _parse(path)
    sums = {}
    for key, entry in header.items():
        if key != "__metadata__":
            lo, hi = entry["data_offsets"]
            sums[key] = [f"{xxhash.xxh3_64_intdigest(data[lo:hi]):016x}"] if hi > lo else []
    return f"{xxhash.xxh3_64_intdigest(head):016x}", sums


def _plan(model: torch.nn.Module, tag: str = "t", **kw: Any) -> tuple[EmaState, ShardLayout, dict]:
    state = fe.init_ema(fe.local_shards(model), num_emas=2, step=7)
    layout = fe.shard_layout(model)
    return state, layout, writer.plan_save(state, [0.9, 0.99], layout, tag, **kw)


# ------------------------------------------------------------------------------------ the plan


def test_plan_save_records_what_the_ranks_agree_on() -> None:
    """A plan holds the tag, step, EMAs, dtype, schedules, buffers, extra and layout, exactly; a
    model-parallel part records only the sizes of its layout (each part holds other parameters)."""
    model = _model()
    buffers = fb.init_buffers(model, num_emas=2, step=7)
    before = time.time_ns()
    _, layout, plan = _plan(model, buffers=buffers, extra={"b": 1, "a": [1.5]})
    started = plan.pop("started_ns")  # when the save started: ema_latest is never moved back to an earlier one
    assert type(started) is int and before <= started <= time.time_ns()
    shapes = [["0.weight", [2, 3]], ["0.bias", [2]], ["1.weight", [2]], ["1.bias", [2]]]
    assert plan == {
        "tag": "t",
        "step": 7,
        "num_emas": 2,
        "dtype": "float32",
        "schedules": [{"kind": "constant", "decay": 0.9}, {"kind": "constant", "decay": 0.99}],
        "buffers": {
            "num_emas": 2,
            "dtype": "float32",
            "floating": {"1.running_mean": [2], "1.running_var": [2]},
            "copied": {"1.num_batches_tracked": ["int64", []]},
        },
        "extra": {"a": [1.5], "b": 1},
        "model_parallel": False,
        "layout": f"world_size=1 stage=0, 4 parameters #{_digest(shapes):016x}",
        "generation": 0,
    }
    state, replicated = _replicated(model, 1)  # the stand-ins of the 2-rank test: as read from the model
    assert replicated == layout._replace(rank=1, world_size=2)
    assert writer.plan_save(state, [0.9, 0.99], layout, "t", _buffers(model))["buffers"] == plan["buffers"]
    part = _zero3(1, part=ModelPart(tp=1, tp_size=2))
    plan = writer.plan_save(_pieces(part), None, part, "u")
    assert (plan["model_parallel"], plan["layout"], plan["schedules"]) == (
        True,
        "world_size=2 stage=3 tp_size=2 pp_size=1",
        None,
    )
    with pytest.warns(UserWarning, match="16-bit EMA stalls"):
        bf16 = fe.init_ema(fe.local_shards(model), dtype=torch.bfloat16)
    assert writer.plan_save(bf16, 0.5, layout, "t")["dtype"] == "bfloat16"
    nothing = ShardLayout(1, 2, 3, {})  # a rank holding no trainable parameter
    assert writer.plan_save(EmaState(torch.tensor(0), ({},)), None, nothing, "t")["dtype"] == "float32"


class _NoDescribe:
    """A user schedule following the protocol (callable, ``interval``) without ``describe``."""

    def __call__(self, step: int) -> float:
        return 0.5

    def interval(self, start: int, stop: int) -> float:
        return 0.5 ** (stop - start)

    def __repr__(self) -> str:
        return "NoDescribe()"


class _OddDescribe(_NoDescribe):
    def describe(self) -> dict:
        return {"kind": "odd", "value": {1, 2}}  # a set: not JSON


def test_describe_decays() -> None:
    """One description per EMA; a schedule without ``describe`` is named by its repr; a wrong count or a
    description that is not JSON is refused."""
    assert writer.describe_decays(None, 3) is None
    assert writer.describe_decays(0.5, 1) == [{"kind": "constant", "decay": 0.5}]
    assert writer.describe_decays((0.5, _NoDescribe()), 2) == [
        {"kind": "constant", "decay": 0.5},
        {"kind": "callable", "name": "NoDescribe()"},
    ]
    with pytest.raises(ValueError) as info:
        writer.describe_decays([0.5], 2)
    assert str(info.value) == "got 1 decays for a state tracking 2 EMAs"
    with pytest.raises(TypeError, match="Object of type set is not JSON serializable"):
        writer.describe_decays(_OddDescribe(), 1)


def test_check_state_names_the_rank_and_the_problem() -> None:
    """A state that does not fit the rank's pieces, or mixes dtypes, is refused naming the rank."""
    layout = _zero3(1)
    assert writer.check_state(_pieces(layout), layout) == torch.float32
    short = EmaState(torch.tensor(7), ({"a": torch.zeros(3), "b": torch.zeros(2)},))
    with pytest.raises(CheckpointMismatchError) as info:
        writer.check_state(short, layout)
    assert str(info.value) == (
        "save on rank 1: state.emas[0]['b'] has 2 elements but rank 1's piece of it has 1: the state was cut "
        "for another world size, sharding or model. Save the state made for this model: "
        "init_ema(local_shards(model)), update or load"
    )
    mixed = EmaState(
        torch.tensor(7),
        ({"a": torch.zeros(3), "b": torch.zeros(1)}, {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(1)}),
    )
    with pytest.raises(CheckpointMismatchError) as info:
        writer.check_state(mixed, layout)
    assert str(info.value) == (
        "save on rank 1: the EMA tensors mix dtypes ['torch.bfloat16', 'torch.float32']; a checkpoint stores one "
        "EMA dtype. Save the state made for this model: init_ema(local_shards(model)), update or load"
    )


def test_check_extra() -> None:
    """``extra``: a JSON object (keys sorted, as the manifest reads back), at most MAX_EXTRA_BYTES as JSON."""
    assert writer.check_extra(None) is None
    out = writer.check_extra({"b": {"y": 1, "x": [True, None]}, "a": "s"})
    assert out == {"a": "s", "b": {"x": [True, None], "y": 1}}
    assert list(out) == ["a", "b"] and list(out["b"]) == ["x", "y"]
    with pytest.raises(TypeError) as info:
        writer.check_extra([1])
    assert str(info.value) == "save(extra=...) takes a dict of JSON values (or None), got list"
    prefix = "save(extra=...) must hold JSON values only (str keys; numbers, strings, lists, dicts, true/false/null; no NaN): "
    for bad, why in [
        ({"x": float("nan")}, "Out of range float values are not JSON compliant"),
        ({"x": torch.zeros(1)}, "Object of type Tensor is not JSON serializable"),
    ]:
        with pytest.raises(TypeError) as info:
            writer.check_extra(bad)
        assert str(info.value).startswith(prefix) and why in str(info.value), str(info.value)
    fits = {"k": "x" * (MAX_EXTRA_BYTES - len('{"k": ""}'))}
    assert writer.check_extra(fits) == fits
    with pytest.raises(ValueError) as info:
        writer.check_extra({"k": fits["k"] + "x"})
    assert str(info.value) == (
        f"save(extra=...) is {MAX_EXTRA_BYTES + 1} bytes as JSON; at most {MAX_EXTRA_BYTES} (it is copied into every "
        "rank file's header): keep weights and large data out of it"
    )


def test_read_generation(tmp_path: Path) -> None:
    """The next generation: one more than the complete checkpoint's, else 0 (no or an unreadable manifest)."""
    assert writer.read_generation(tmp_path) == 0
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"generation": 4}))
    assert writer.read_generation(tmp_path) == 5
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert writer.read_generation(tmp_path) == 0
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"generation": 2**62 - 1}))
    assert writer.read_generation(tmp_path) == 2**62  # the last generation a save may write
    for bad in (2**62, 2**63 - 1, 2**70, -1):
        (tmp_path / MANIFEST_NAME).write_text(json.dumps({"generation": bad}))
        with pytest.raises(CheckpointError) as e:
            writer.read_generation(tmp_path)
        assert (type(e.value).__name__, str(e.value)) == (_no_next_class(bad), _no_next_generation(tmp_path, bad))


def test_a_taken_generation_is_never_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TagLock.take_generation records what it takes (.ema_generation): the next save takes a later one, with or
    without a manifest (a failed save's late ranks may still write the generation it took); a damaged record is
    ignored; untake_generation (a save refused before any write) puts the record back as it was, a folder it made
    goes; the commit of a later generation removes the record, and a record above the manifest's stays. A record
    that cannot be written names its file."""
    rec = tmp_path / ".ema_generation"

    def take(generation=None) -> int:
        lock = writer.TagLock.acquire(tmp_path, 5, "save")
        try:
            return lock.take_generation(generation)
        finally:
            lock.release()

    assert [take() for _ in range(3)] == [0, 1, 2] and rec.read_bytes() == b"2\n"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"generation": 0}))  # an older complete checkpoint
    assert writer.read_generation(tmp_path) == 3 and take() == 3 and take(7) == 7  # 7: agreed over private folders
    assert writer.read_generation(tmp_path) == 8
    for damaged in (b"", b"x\n", b"-5\n", str(2**62).encode(), str(2**62 + 1).encode()):
        rec.write_bytes(damaged)  # 2**62: no save may follow it (the reader's bound is the writer's)
        assert writer.read_generation(tmp_path) == 1, damaged
    rec.write_bytes(str(2**62 - 1).encode())  # a save may follow it, with the last generation
    assert writer.read_generation(tmp_path) == 2**62
    rec.write_bytes(b"4\n")
    lock = writer.TagLock.acquire(tmp_path, 5, "save")
    assert lock.take_generation() == 5 and rec.read_bytes() == b"5\n"
    lock.untake_generation()
    lock.untake_generation()  # idempotent
    lock.release(remove_empty=True)
    assert rec.read_bytes() == b"4\n" and writer.read_generation(tmp_path) == 5
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"generation": 3}))  # above it: kept by that commit
    writer._cleanup(tmp_path, set())
    assert rec.read_bytes() == b"4\n" and writer.read_generation(tmp_path) == 5
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"generation": 4}))
    writer._cleanup(tmp_path, set())
    assert not rec.exists() and writer.read_generation(tmp_path) == 5

    made = tmp_path / "made"
    lock = writer.TagLock.acquire(made, 5, "save")
    assert lock.take_generation() == 0 and (made / ".ema_generation").exists()
    lock.untake_generation()
    lock.release(remove_empty=True)
    assert not made.exists()
    lock = writer.TagLock.acquire(made, 5, "save")
    (made / ".ema_generation").mkdir()  # no record of ours: refused naming it, and left as it is
    with pytest.raises(CheckpointError, match=f"save: {made / '.ema_generation'} is a folder, not the generation"):
        lock.take_generation()
    (made / ".ema_generation").rmdir()
    monkeypatch.setattr(writer._io, "tmp_name", lambda final: made / "gone" / "tmp")  # cannot be written
    with pytest.raises(OSError) as e:
        lock.take_generation()
    lock.release()
    assert e.value.filename == str(made / ".ema_generation") and e.value.errno == errno.ENOENT


def test_the_generation_record_is_never_written_through_or_removed_when_not_ours(tmp_path: Path) -> None:
    """What sits at ``.ema_generation`` but is not a file (a link to a user's file, a dangling link, a folder, a
    pipe) is refused naming it, by a save's read and by take_generation, before anything is written: the user's file
    keeps its bytes, no file appears at a link's target, the link stays (the record was written through the link and
    the link deleted at the commit). A record hard-linked into a backup (``cp -al``) is replaced, the backup's copy
    kept (it was rewritten in place)."""
    model = torch.nn.Linear(4, 3)
    state = fe.init_ema(fe.local_shards(model))
    ck, tag_dir = tmp_path / "ck", tmp_path / "ck" / "t"
    fe.save(state, model, ck, "t")
    rec, notes, gone = tag_dir / ".ema_generation", tmp_path / "notes.txt", tmp_path / "outside" / "gone"
    notes.write_text("my precious notes\n")
    for name, make, kind in (
        ("link", lambda: rec.symlink_to(notes), "a symbolic link"),
        ("dangling", lambda: rec.symlink_to(gone), "a symbolic link"),
        ("folder", rec.mkdir, "a folder"),
        ("pipe", lambda: os.mkfifo(rec), "not a file"),
    ):
        make()
        before = _snapshot(ck)
        refusal = f"save: {rec} is {kind}, not the generation record functional_ema writes at that name"
        with pytest.raises(CheckpointError, match=re.escape(refusal)):
            fe.save(state, model, ck, "t")
        lock = writer.TagLock.acquire(tag_dir, 5, "save")
        try:
            with pytest.raises(CheckpointError, match=re.escape(refusal)):
                lock.take_generation(7)
        finally:
            lock.release()
        assert _snapshot(ck) == before and os.path.lexists(rec), name
        assert notes.read_text() == "my precious notes\n" and not gone.exists(), name
        writer._cleanup(tag_dir, writer.listed_files(json.loads((tag_dir / MANIFEST_NAME).read_text())))
        assert os.path.lexists(rec), name  # a commit's cleanup removes only a record that is a file
        shutil.rmtree(rec) if name == "folder" else rec.unlink()
    rec.write_bytes(b"3\n")
    backup = tmp_path / "backup"
    backup.mkdir()
    os.link(rec, backup / ".ema_generation")
    lock = writer.TagLock.acquire(tag_dir, 5, "save")
    try:
        assert lock.take_generation() == 4 and rec.read_bytes() == b"4\n"
    finally:
        lock.release()
    assert (backup / ".ema_generation").read_bytes() == b"3\n"
    assert [p for p in os.listdir(tag_dir) if ".tmp-" in p] == []


def test_ema_latest_keeps_naming_a_save_started_later(tmp_path: Path) -> None:
    """publish_latest: ``ema_latest`` is left where it names a complete save that started after the one committing
    at a step as late; overwritten where it names a save started earlier, one started later at an earlier step (a
    wall clock set back: a later step's save is never kept off the pointer), a missing or incomplete tag, one whose
    manifest has no ``started_ns`` (an older release's), or is no pointer at all (a pipe or a folder there is never
    waited on)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    now = time.time_ns()

    def tag(name: str, started: Any = ..., step: int = 5) -> dict[str, Any]:
        manifest = {"tag": name, "generation": 0, "step": step, **({} if started is ... else {"started_ns": started})}
        (ck / name).mkdir(exist_ok=True)
        (ck / name / MANIFEST_NAME).write_text(json.dumps(manifest))
        return manifest

    def latest() -> str:
        return (ck / LATEST_NAME).read_text()

    mine = tag("mine", now - 10)
    writer.publish_latest(ck, mine)  # no pointer yet
    assert latest() == "mine\n"
    for name, started, step, kept in (
        ("later", now, 5, True),
        ("later_step", now, 9, True),
        ("future", now + 10**18, 5, True),  # far ahead: held while its step is as late (no clock read here)
        ("clock_set_back", now, 4, False),  # started "later" by a clock, at an earlier step
        ("earlier", now - 20, 9, False),
        ("old_release", ..., 9, False),
        ("no_manifest", None, 0, False),
    ):
        if started is None:
            (ck / name).mkdir()
        else:
            tag(name, started, step)
        (ck / LATEST_NAME).write_text(f"{name}\n")
        writer.publish_latest(ck, mine)
        assert latest() == (f"{name}\n" if kept else "mine\n"), name
    for pointer in (b"../outside\n", b"\xff\xfe", b""):
        (ck / LATEST_NAME).write_bytes(pointer)
        writer.publish_latest(ck, mine)
        assert latest() == "mine\n", pointer
    for odd in ("fifo", "folder"):  # not a pointer: replaced, never read from (a pipe would block the save)
        (ck / LATEST_NAME).unlink()
        os.mkfifo(ck / LATEST_NAME) if odd == "fifo" else (ck / LATEST_NAME).mkdir()
        if odd == "folder":
            with pytest.raises(OSError):  # the atomic rename cannot replace a folder: the save's error names it
                writer.publish_latest(ck, mine)
            (ck / LATEST_NAME).rmdir()
            continue
        writer.publish_latest(ck, mine)
        assert latest() == "mine\n", odd
    fifo_manifest = tag("piped", now)
    (ck / "piped" / MANIFEST_NAME).unlink()
    os.mkfifo(ck / "piped" / MANIFEST_NAME)
    (ck / LATEST_NAME).write_text("piped\n")
    writer.publish_latest(ck, mine)
    assert latest() == "mine\n" and fifo_manifest["tag"] == "piped"
    writer.publish_latest(ck, {"tag": "t_without_start"})  # a manifest built without started_ns: as before
    assert latest() == "t_without_start\n"


def _no_next_generation(tag_dir: Path, generation: int) -> str:
    """The refusal of a save over a manifest naming ``generation``, which no save can follow: the last one a
    checkpoint may name (valid, loadable: never called damaged), or one above it (damaged or edited)."""
    if generation == 2**62:
        return (
            f"{tag_dir / MANIFEST_NAME}: tag {tag_dir.name!r} holds generation {generation} (2**62), the largest a "
            "checkpoint may name: no later save of this tag can be written (each takes one generation more). Its "
            "checkpoint stays as it is, loadable. Nothing was written: save under another tag"
        )
    return (
        f"{tag_dir / MANIFEST_NAME}: the manifest of tag {tag_dir.name!r} names generation {generation}, outside "
        "[0, 2**62]: no checkpoint may name one above 2**62 (4611686018427387904). The manifest is damaged or was "
        f"edited (no load reads it). Nothing was written: remove the damaged tag folder {tag_dir} (or restore its "
        "manifest from a copy), or save under another tag"
    )


def _no_next_class(generation: int) -> str:
    """The class of :func:`_no_next_generation`'s refusal: the last generation is no damage."""
    return "CheckpointError" if generation == 2**62 else "CorruptCheckpointError"


def _forge_generation(manifest: Path, generation: int) -> None:
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(doc, generation=generation)))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_generation_no_save_can_follow_is_refused_before_writing(tmp_path: Path) -> None:
    """A tag whose manifest names a generation at or above 2**62 (a damaged or forged leftover): every save verb
    (blocking, async, ``shared=False``) refuses it with a CorruptCheckpointError naming the manifest, the tag, the
    value and the limit, before writing anything (the folder and ``ema_latest`` bytewise unchanged). One below the
    limit: the save writes generation 2**62, which loads back bitwise (the reader's bound is the writer's); one above
    it is refused by the reader, which states the bound."""
    model = torch.nn.Linear(4, 3)
    shards = fe.local_shards(model)
    state = fe.update(fe.init_ema(shards), {n: t + 1 for n, t in shards.items()}, 1, decay=0.5)
    ck, tag_dir = tmp_path / "ck", tmp_path / "ck" / "t"
    for generation in (2**62, 2**63 - 1, 2**64):
        fe.save(state, model, ck, "t")
        _forge_generation(tag_dir / MANIFEST_NAME, generation)
        before = _snapshot(ck)
        for verb in ("save", "async", "private"):
            with pytest.raises(CheckpointError) as e:
                if verb == "async":
                    fe.AsyncSaver().save(state, model, ck, "t").wait()
                else:
                    fe.save(state, model, ck, "t", shared=verb == "save")
            assert type(e.value).__name__ == _no_next_class(generation), verb
            assert str(e.value) == _no_next_generation(tag_dir, generation), verb
            assert _snapshot(ck) == before, verb
        if generation > 2**62:
            with pytest.raises(CorruptCheckpointError) as e:
                fe.load(model, ck, "t")
            assert str(e.value) == (
                f"{tag_dir / MANIFEST_NAME}: field 'generation' must be at most 2**62 (4611686018427387904), the "
                f"largest a save writes, got int {generation}. The manifest is damaged or was edited: restore it from "
                "a copy or load another tag"
            )
        (tag_dir / MANIFEST_NAME).unlink()
    fe.save(state, model, ck, "t")
    _forge_generation(tag_dir / MANIFEST_NAME, 2**62 - 1)
    assert fe.save(state, model, ck, "t") == tag_dir
    assert json.loads((tag_dir / MANIFEST_NAME).read_text())["generation"] == 2**62
    assert sorted(os.listdir(tag_dir)) == [MANIFEST_NAME, f"ema_rank_00000_of_00001.gen{2**62}.safetensors"]
    loaded = fe.load(model, ck, "t")
    assert all(torch.equal(loaded.emas[0][n], state.emas[0][n]) for n in shards) and int(loaded.step) == 1


def test_a_generation_no_save_can_follow_is_refused_at_a_url() -> None:
    """The same at a URL (``memory://``): the generation a save picks from the manifest (or file names) is checked
    inside the plan's agreement, before any file is uploaded; the store holds what it held (no marker left)."""
    import fsspec

    model = torch.nn.Linear(4, 3)
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
    fs = fsspec.filesystem("memory")
    for i, generation in enumerate((2**62, 2**63 - 1)):
        url = f"memory://fe-writer-generation-{i}/ck"
        fe.save(state, model, url, "t")
        path = f"/fe-writer-generation-{i}/ck/t/{MANIFEST_NAME}"
        fs.pipe(path, json.dumps(dict(json.loads(fs.cat(path)), generation=generation)).encode())
        before = {p: fs.cat(p) for p in fs.find(f"/fe-writer-generation-{i}")}
        for verb in ("save", "async save"):
            with pytest.raises(CorruptCheckpointError) as e:
                if verb == "async save":
                    fe.AsyncSaver().save(state, model, url, "t").wait()
                else:
                    fe.save(state, model, url, "t")
            assert str(e.value) == (
                f"{verb} (checking the state): tag 't': the next save would write generation {generation + 1}, above "
                "2**62 (4611686018427387904), the largest a checkpoint may name: the tag's manifest or file names "
                "claim one no save can follow (damaged or edited). Nothing was written: remove the damaged tag, or "
                "save under another tag"
            )
            assert {p: fs.cat(p) for p in fs.find(f"/fe-writer-generation-{i}")} == before, verb
        fs.rm(f"/fe-writer-generation-{i}", recursive=True)


# ------------------------------------------------------------------------- a rank's files


def _experts(rank: int = 1) -> ShardLayout:
    """ZeRO-1 over 2 ranks with expert parallelism: rank ``rank`` holds half of w and expert ``rank`` whole
    (an empty piece of the other expert)."""
    specs = {"w": ShardSpec((4,), 2 * rank, 2)} | {f"e.{i}": ShardSpec((3,), 0, 3 if i == rank else 0) for i in (0, 1)}
    return ShardLayout(rank, 2, 1, specs, tp_dims={"w": 0}, experts=ExpertLayout(rank, 2, {"e.0": 0, "e.1": 1}))


def test_file_names_and_metadata() -> None:
    """The names a rank writes (its part, rank, world and generation), each file's string metadata and
    the manifest's record of the rank's part, field by field."""
    model = _model()
    buffers = fb.init_buffers(model, num_emas=2, step=7)
    _, layout, plan = _plan(model, buffers=buffers, extra={"b": 1, "a": 2})
    assert writer.save_files(layout, 0, True, True) == [
        "ema_rank_00000_of_00001.safetensors",
        "buffers_rank_00000_of_00001.safetensors",
    ]
    assert writer.save_files(layout, 2, False, True) == ["ema_rank_00000_of_00001.gen2.safetensors"]
    assert writer.save_files(layout, 0, True, False) == ["buffers_rank_00000_of_00001.safetensors"]
    assert writer.save_files(layout, 0, False, False) == []
    part = _zero3(1, part=ModelPart(tp=1, tp_size=2))
    assert writer.save_files(part, 3, True, True) == [
        "ema_tp001of002_pp000of001_rank_00001_of_00002.gen3.safetensors",
        "buffers_tp001of002_pp000of001_rank_00001_of_00002.gen3.safetensors",
    ]
    unsorted = dict(plan, extra={"b": 1, "a": 2})  # the file's header is the same whatever the dict's order
    assert writer.rank_file_meta(unsorted, layout, 3) == {
        "format": "functional_ema.ema_shards",
        "format_version": str(FORMAT_VERSION),
        "library": VERSION,
        "tag": "t",
        "step": "7",
        "num_emas": "2",
        "dtype": "float32",
        "schedules": '[{"kind": "constant", "decay": 0.9}, {"kind": "constant", "decay": 0.99}]',
        "extra": '{"a": 2, "b": 1}',
        "world_size": "1",
        "rank": "0",
        "zero_stage": "0",
        "generation": "3",
        "layout": '{"rank":0,"world_size":1,"stage":0,"engine":"module","specs":{"0.weight":[[2,3],0,6],'
        '"0.bias":[[2],0,2],"1.weight":[[2],0,2],"1.bias":[[2],0,2]}}',
    }
    assert writer.buffer_file_meta(plan, layout, 3) == {
        "format": "functional_ema.buffers",
        "format_version": str(FORMAT_VERSION),
        "library": VERSION,
        "tag": "t",
        "step": "7",
        "generation": "3",
        "rank": "0",
        "world_size": "1",
        "num_emas": "2",
        "dtype": "float32",
    }
    assert writer.part_record(layout, plan) == {
        "part": {"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1},
        "world_size": 1,
        "zero_stage": 0,
        "params": {"0.weight": [2, 3], "0.bias": [2], "1.weight": [2], "1.bias": [2]},
        "tp_dims": None,
        "buffers": plan["buffers"],
        "experts": None,
    }
    experts = _experts()
    assert writer.part_record(experts, dict(plan, buffers=None)) == {
        "part": {"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1},
        "world_size": 2,
        "zero_stage": 1,
        "params": {"w": [4], "e.0": [3], "e.1": [3]},
        "tp_dims": {"w": 0},
        "buffers": None,
        "experts": {"ep_size": 2, "owners": {"e.0": 0, "e.1": 1}},
    }


def test_rank_and_buffer_files_and_their_records(tmp_path: Path) -> None:
    """A rank file holds ``emas.<k>.<name>`` (this rank's pieces, in the layout's order) and its record names
    the rank (and expert-parallel rank), the file, its size, the header checksum and every tensor's
    checksum in file order, and where the pieces sit; a buffer file's record lists checksums per tensor."""
    model = _model()
    buffers = fb.init_buffers(model, num_emas=2, step=7)
    state, layout, plan = _plan(model, buffers=buffers)
    for ema in state.emas:  # distinct values per EMA and parameter
        for i, t in enumerate(ema.values()):
            t.copy_(torch.arange(t.numel()).reshape(t.shape) + 100.0 * i)
    path = tmp_path / "ema_rank_00000_of_00001.safetensors"
    record = writer.write_rank_file(path, layout, state.emas, torch.float32, writer.rank_file_meta(plan, layout, 0))
    header, _, data = _parse(path)
    keys = [f"emas.{k}.{n}" for k in range(2) for n in ("0.weight", "0.bias", "1.weight", "1.bias")]
    assert [k for k in header if k != "__metadata__"] == keys
    for key in keys:
        k, name = key.split(".", 2)[1:]
        lo, hi = header[key]["data_offsets"]
        assert torch.equal(
            torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.float32), state.emas[int(k)][name].reshape(-1)
        )
    head_sum, sums = _checksums(path)
    assert record == {
        "rank": 0,
        "file": path.name,
        "bytes": path.stat().st_size,
        "header_checksum": head_sum,
        "chunk_checksums": "".join(sums[k][0] for k in keys),
        "pieces": {"0.weight": [0, 6], "0.bias": [0, 2], "1.weight": [0, 2], "1.bias": [0, 2]},
    }
    bpath = tmp_path / "buffers_rank_00000_of_00001.safetensors"
    brecord = writer.write_buffer_file(bpath, 0, buffers, plan["buffers"], writer.buffer_file_meta(plan, layout, 0))
    head_sum, sums = _checksums(bpath)
    assert list(sums) == [
        "emas.0.1.running_mean",
        "emas.0.1.running_var",
        "emas.1.1.running_mean",
        "emas.1.1.running_var",
        "copied.1.num_batches_tracked",
    ]
    assert brecord == {
        "rank": 0,
        "file": bpath.name,
        "bytes": bpath.stat().st_size,
        "header_checksum": head_sum,
        "tensor_checksums": sums,
    }
    experts = _experts()
    epath = tmp_path / "ema_rank_00001_of_00002.safetensors"
    record = writer.write_rank_file(epath, experts, _pieces(experts).emas, torch.float32, {"x": "y"})
    head_sum, sums = _checksums(epath)
    assert record == {
        "rank": 1,
        "file": epath.name,
        "bytes": epath.stat().st_size,
        "header_checksum": head_sum,
        "chunk_checksums": "".join(v for vs in sums.values() for v in vs),
        "ep": 1,
        "pieces": {"w": [2, 2], "e.0": [0, 0], "e.1": [0, 3]},
    }


# ------------------------------------------------------------------------------- the manifest


def _write(tag_dir: Path, layout: ShardLayout, generation: int = 0, buffers: Any = None, **plan_kw: Any) -> dict:
    """What one rank writes into ``tag_dir`` and its record (``{"part", "file", "buffers"}``), as a save does."""
    state = _pieces(layout)
    plan = writer.plan_save(state, [0.9, 0.99], layout, "t", buffers, **plan_kw)
    names = writer.save_files(layout, generation, buffers is not None, layout.writes_pieces)
    record: dict[str, Any] = {"part": writer.part_record(layout, plan)}
    meta = writer.rank_file_meta(plan, layout, generation)
    record["file"] = writer.write_rank_file(tag_dir / names[0], layout, state.emas, torch.float32, meta)
    if buffers is not None:
        meta = writer.buffer_file_meta(plan, layout, generation)
        record["buffers"] = writer.write_buffer_file(tag_dir / names[-1], layout.rank, buffers, plan["buffers"], meta)
    return record


def _listed(record: dict) -> dict:
    """A rank file's record as the manifest lists it (without the pieces, which the piece index replaces)."""
    return {k: v for k, v in record.items() if k != writer.PIECES}


def _top(plan: dict, note: str, **extra: Any) -> dict:
    """The fields every manifest starts with, in order."""
    return {
        "format": "functional_ema.manifest",
        "format_version": FORMAT_VERSION,
        "library": VERSION,
        "note": NOTE + note,
        "tag": "t",
        **extra,
        "started_ns": plan["started_ns"],
        "generation": plan["generation"],
        "step": 7,
        "num_emas": 2,
        "dtype": "float32",
        "schedules": [{"kind": "constant", "decay": 0.9}, {"kind": "constant", "decay": 0.99}],
        "extra": plan["extra"],
        "chunk_bytes": 4 << 20,
        "checksum": "xxh3_64",
    }


def test_build_manifest_of_a_whole_model(tmp_path: Path) -> None:
    """One part: its fields at the top level after the save's, the files and buffer files sorted by rank,
    the piece index of ZeRO-3's even cut, no model-parallel fields, the caller's fields after the tag."""
    buffers = fb.init_buffers(_model(), num_emas=2, step=7)
    records = [_write(tmp_path, _zero3(r), 2, buffers, extra={"z": 1}) for r in (1, 0)]  # rank 1's first
    plan = dict(writer.plan_save(_pieces(_zero3(0)), [0.9, 0.99], _zero3(0), "t", buffers, {"z": 1}), generation=2)
    manifest = writer.build_manifest(plan, records, save_id="abc")
    expected = _top(plan, ".", save_id="abc") | {
        "world_size": 2,
        "zero_stage": 3,
        "params": {"a": [2, 3], "b": [3]},
        "buffers": plan["buffers"],
        "files": [_listed(records[1]["file"]), _listed(records[0]["file"])],
        "buffer_files": [records[1]["buffers"], records[0]["buffers"]],
        "piece_index": {"a": 3, "b": 2},  # rank r holds elements [r*c, (r+1)*c)
    }
    assert manifest == expected
    assert list(manifest) == list(expected)
    assert [f["file"] for f in manifest["files"]] == [
        "ema_rank_00000_of_00002.gen2.safetensors",
        "ema_rank_00001_of_00002.gen2.safetensors",
    ]


def test_build_manifest_of_model_parallel_parts(tmp_path: Path) -> None:
    """Several parts: ``parts`` sorted by (pipeline stage, tensor-parallel rank) whatever the records'
    order (or the key order of their part), each with its sorted files and tensor-parallel dims; no piece
    index for a part whose files' pieces are unknown; one part that is not the whole model is a part too."""
    tp_dims = {"a": 0, "b": None}
    layouts = {(t, r): _zero3(r, part=ModelPart(tp=t, tp_size=2), tp_dims=tp_dims) for t in (0, 1) for r in (0, 1)}
    records = {key: _write(tmp_path, lay) for key, lay in layouts.items()}
    for r in (0, 1):
        records[1, r]["file"].pop(writer.PIECES)  # e.g. a writer that did not say
    records[0, 1]["part"]["part"] = dict(reversed(list(records[0, 1]["part"]["part"].items())))
    plan = writer.plan_save(_pieces(layouts[0, 0]), [0.9, 0.99], layouts[0, 0], "t")
    order = [(1, 1), (0, 0), (1, 0), (0, 1)]
    manifest = writer.build_manifest(plan, [records[k] for k in order])

    def part(t: int) -> dict:
        return {
            "part": {"tp": t, "tp_size": 2, "pp": 0, "pp_size": 1},
            "world_size": 2,
            "zero_stage": 3,
            "params": {"a": [2, 3], "b": [3]},
            "tp_dims": tp_dims,
            "files": [_listed(records[t, r]["file"]) for r in (0, 1)],
        }

    mp = ", and which model-parallel part (tensor-parallel rank, pipeline stage) it holds."
    expected = _top(plan, mp) | {"parts": [part(0) | {"piece_index": {"a": 3, "b": 2}}, part(1)]}
    assert manifest == expected
    assert list(manifest) == list(expected) and [list(p) for p in manifest["parts"]] == [
        list(p) for p in expected["parts"]
    ]
    one = writer.build_manifest(plan, [records[0, 1], records[0, 0]])
    assert one == _top(plan, mp) | {"parts": [part(0) | {"piece_index": {"a": 3, "b": 2}}]}


def test_build_manifest_with_experts_and_older_records(tmp_path: Path) -> None:
    """Expert parallelism: the experts' owners are kept and no piece index is made (each file holds its own
    experts); a part record without an ``experts`` field (an older writer) is taken as none."""
    records = [_write(tmp_path, _experts(r)) for r in (0, 1)]
    plan = writer.plan_save(_pieces(_experts(0)), [0.9, 0.99], _experts(0), "t")
    manifest = writer.build_manifest(plan, records)
    assert manifest == _top(plan, ".") | {
        "world_size": 2,
        "zero_stage": 1,
        "params": {"w": [4], "e.0": [3], "e.1": [3]},
        "tp_dims": {"w": 0},
        "experts": {"ep_size": 2, "owners": {"e.0": 0, "e.1": 1}},
        "files": [_listed(r["file"]) for r in records],
    }
    assert [f["ep"] for f in manifest["files"]] == [0, 1]
    older = [_write(tmp_path, _zero3(r)) for r in (0, 1)]
    for r in older:
        del r["part"]["experts"]
    manifest = writer.build_manifest(plan, older)
    assert "experts" not in manifest and manifest["piece_index"] == {"a": 3, "b": 2}


def test_build_manifest_refuses_ranks_that_describe_a_part_differently(tmp_path: Path) -> None:
    """Two ranks of one part with other parameters: refused, naming the part."""
    for part, named in [(ModelPart(), "the whole model"), (ModelPart(tp=1, tp_size=2), "tensor-parallel rank 1 of 2")]:
        lay = _zero3(0, part=part)
        other = lay._replace(rank=1, specs=dict(lay.specs, c=ShardSpec((1,), 0, 1)))
        records = [_write(tmp_path, lay), _write(tmp_path, other)]
        with pytest.raises(CheckpointError) as info:
            writer.build_manifest(writer.plan_save(_pieces(lay), None, lay, "t"), records)
        assert str(info.value) == (
            f"save: the ranks of {named} describe it differently (parameters, shapes, world size or buffers); "
            "every rank of a part must hold the same model"
        )


# ------------------------------------------------------------------------- commit and cleanup


def test_commit_manifest_then_cleanup(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The commit writes the manifest (indented JSON) and the ``ema_latest`` pointer, then removes the older
    generations' files and the temporary files of crashed saves (their exact names: a file's name and the suffix
    ``_io.tmp_name`` gives it), and nothing else (another library's files, a user's files named almost like its
    own or like its temporaries, the lock); a stale entry it cannot remove is logged."""
    from functional_ema import _io

    tag_dir = tmp_path / "t"
    tag_dir.mkdir()
    stale = [
        "ema_rank_00000_of_00002.safetensors",  # generation 0, replaced by generation 1
        "buffers_rank_00001_of_00002.safetensors",
        "ema_rank_00003_of_00004.gen5.safetensors",  # another world size
        _io.tmp_name("ema_rank_00000_of_00002.gen1.safetensors").name,  # crashed saves' temporary files
        "buffers_rank_00000_of_00002.safetensors.tmp-1-0123456789ab",
        f"{MANIFEST_NAME}.tmp-9-ffffffffffff",
        f"{MANIFEST_NAME}.pending.tmp-9-ffffffffffff",
        "ema_rank_00001_of_00002.safetensors.tmp-77",  # an older release's (no per-write token)
        ".ema_generation",  # the generation this save took (its manifest's: the manifest alone fences it now)
    ]
    kept = [
        # an async marker's temporary: maybe a late rank of a failed save writing it now (removed with that save's
        # markers once every rank of it failed: _failed_async_markers)
        "ema_async.0123456789abcdef.rank00001.done.tmp-4-0123456789ab",
        "mp_rank_00_model_states.pt",
        "mp_rank_00_model_states.pt.tmp-5-aaaaaaaaaaaa",  # DeepSpeed's own temporary file
        "ema_rank_notes.txt",
        "zero_to_fp32.py",
        LOCK_NAME,
        # a user's files that only look like the library's temporaries
        "ema_notes.tmp-backup",
        "buffers_of_mine.tmp-1",
        f"{MANIFEST_NAME}.tmp-copy",
        f"{MANIFEST_NAME}.tmp-1-aa",
        "ema_latest.tmp-x",
        "ema_rank_00000_of_00002.safetensors.tmp-1-0123456789ab.bak",
        "ema_rank_00000_of_00002.safetensors.tmp-1-ABCDEF012345",
        "ema_async.log.tmp-4-0123456789ab",
    ]
    for name in stale + kept:
        (tag_dir / name).write_bytes(b"1\n" if name == ".ema_generation" else b"x")
    (tag_dir / "ema_rank_00009_of_00010.safetensors").mkdir()  # named like a rank file: unlink fails
    buffers = fb.init_buffers(_model(), num_emas=2, step=7)
    records = [_write(tag_dir, _zero3(r), 1, buffers) for r in (0, 1)]
    plan = dict(writer.plan_save(_pieces(_zero3(0)), None, _zero3(0), "t", buffers), generation=1)
    manifest = writer.build_manifest(plan, records)
    with caplog.at_level(logging.WARNING, logger="functional_ema"):
        writer.commit_manifest(tmp_path, tag_dir, manifest)
    assert (tag_dir / MANIFEST_NAME).read_bytes() == json.dumps(manifest, indent=1).encode()
    assert (tmp_path / LATEST_NAME).read_bytes() == b"t\n"
    written = [e["file"] for e in manifest["files"] + manifest["buffer_files"]]
    assert sorted(os.listdir(tag_dir)) == sorted(
        [*kept, *written, MANIFEST_NAME, "ema_rank_00009_of_00010.safetensors"]
    )
    bad = tag_dir / "ema_rank_00009_of_00010.safetensors"
    assert caplog.messages == [f"functional_ema: could not remove stale {bad}: [Errno 21] Is a directory: '{bad}'"]


def test_remove_unlisted_keeps_what_the_manifest_lists(tmp_path: Path) -> None:
    """After a failed save a rank removes its new files, except those the complete manifest lists (rank
    and buffer files, whole-model or part manifests); without a readable manifest, all of them; never
    another file, and a file already gone is no error."""
    mine = ["ema_rank_00000_of_00002.safetensors", "buffers_rank_00000_of_00002.safetensors"]
    new = ["ema_rank_00000_of_00002.gen1.safetensors", "buffers_rank_00000_of_00002.gen1.safetensors"]
    whole = {"files": [{"file": mine[0]}], "buffer_files": [{"file": mine[1]}]}
    parts = {"parts": [{"buffer_files": None}, whole]}  # a damaged part without files hides no other part's
    for manifest, left in [(whole, mine), (parts, mine), (None, []), ("{broken", [])]:
        tag_dir = tmp_path / f"case{len(os.listdir(tmp_path))}"
        tag_dir.mkdir()
        for name in [*mine, *new, "keep.bin"]:
            (tag_dir / name).write_bytes(b"x")
        if manifest is not None:
            (tag_dir / MANIFEST_NAME).write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
        writer.remove_unlisted(tag_dir, [])
        assert len(os.listdir(tag_dir)) == 5 + (manifest is not None)
        writer.remove_unlisted(tag_dir, [*mine, *new, "ema_rank_00001_of_00002.gen1.safetensors"])
        assert sorted(os.listdir(tag_dir)) == sorted([*left, "keep.bin"] + ([MANIFEST_NAME] if manifest else [])), (
            manifest
        )


# ------------------------------------------------------------------------------- the tag lock


def _holder(thread: str = "MainThread", pid: int | None = None) -> str:
    return f"pid {os.getpid() if pid is None else pid} on {socket.gethostname()}, thread {thread}"


def _busy(tag_dir: Path, holder: str, timeout: str = "0.05") -> str:
    return (
        f"save: tag {tag_dir.name!r} in {tag_dir.parent} is being written by another save ({holder}) and it did not "
        f"finish within {timeout} s. One save writes a tag at a time: wait for the other one (AsyncSaver.wait()), "
        "or save under another tag"
    )


def test_tag_lock_creates_records_and_releases(tmp_path: Path) -> None:
    """Taking a tag creates its folder (and says so) and a lock file (mode 0644 less the umask) naming the
    holder, overwriting what a dead holder left; releasing removes the file, and the folder only when asked,
    if the lock created it and it is empty."""
    umask = os.umask(0)
    os.umask(umask)
    tag_dir = tmp_path / "new" / "t"
    lock = writer.TagLock.acquire(tag_dir, 1, "save")
    assert (lock.tag_dir, lock.created) == (tag_dir, True)
    path = tag_dir / LOCK_NAME
    assert path.read_text() == _holder() and path.stat().st_mode & 0o777 == 0o644 & ~umask
    lock.release()
    lock.release()  # idempotent
    assert os.listdir(tag_dir) == []  # the folder stays unless asked
    lock = writer.TagLock.acquire(tag_dir, 1, "save")
    assert lock.created is False
    lock.release(remove_empty=True)
    assert tag_dir.is_dir()  # not made by this lock
    os.rmdir(tag_dir)
    lock = writer.TagLock.acquire(tag_dir, 1, "save")
    path.unlink()  # someone removed the lock file: releasing is still no error
    lock.release(remove_empty=True)
    assert not tag_dir.exists()
    lock = writer.TagLock.acquire(tag_dir, 1, "save")
    (tag_dir / "written").write_bytes(b"x")
    lock.release(remove_empty=True)
    assert os.listdir(tag_dir) == ["written"]


def test_tag_lock_of_a_dead_holder_is_taken_at_once(tmp_path: Path) -> None:
    """A holder that died without releasing leaves its lock file (naming its pid), but the kernel dropped
    its lock: the next save takes the tag at once and records itself instead."""
    tag_dir = tmp_path / "t"
    dead = "holder-that-died-" + "x" * 60
    pid = os.fork()
    if pid == 0:  # the dead holder: takes the tag on a thread and exits without releasing it
        try:
            t = threading.Thread(target=writer.TagLock.acquire, args=(tag_dir, 5, "save"), name=dead)
            t.start()
            t.join()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert (tag_dir / LOCK_NAME).read_text() == _holder(dead, pid)
    t0 = time.monotonic()
    lock = writer.TagLock.acquire(tag_dir, 5, "save")
    assert time.monotonic() - t0 < 1.0
    assert (tag_dir / LOCK_NAME).read_text() == _holder() and lock.created is False
    lock.release()


def test_tag_lock_held_by_another_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second save of a held tag waits, then names the tag, its folder and the holder (its record's first
    200 characters, or "holder unknown" when there is none, it is not text or cannot be read)."""
    tag_dir = tmp_path / "t"
    held = writer.TagLock.acquire(tag_dir, 1, "save")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        writer.TagLock.acquire(tag_dir, 0.05, "save")
    assert time.monotonic() - t0 >= 0.05
    assert str(info.value) == _busy(tag_dir, _holder())
    path = tag_dir / LOCK_NAME
    long = "thread " + "y" * 300
    for content, holder in [(long.encode(), long[:200]), (b"", "holder unknown"), (b"\xff\xfe", "holder unknown")]:
        with open(path, "r+b") as f:  # the same file, another record
            f.truncate(0)
            f.write(content)
        with pytest.raises(CheckpointError) as info:
            writer.TagLock.acquire(tag_dir, 0.05, "save")
        assert str(info.value) == _busy(tag_dir, holder)
    path.write_text("pid 1 on h, thread T")

    def unreadable(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", unreadable)
    with pytest.raises(CheckpointError) as info:
        writer.TagLock.acquire(tag_dir, 0.05, "save")
    assert str(info.value) == _busy(tag_dir, "holder unknown")
    monkeypatch.undo()
    held.release()


def test_tag_lock_waits_for_the_holder(tmp_path: Path) -> None:
    """A waiter takes the tag soon after the holder releases it (polling every 2 to 50 ms), on the new lock
    file the holder's release left room for, and records itself there."""
    tag_dir = tmp_path / "t"
    for hold in (0.05, 1.2):
        held = writer.TagLock.acquire(tag_dir, 1, "save")
        released: list[float] = []
        timer = threading.Timer(hold, lambda h=held: (h.release(), released.append(time.monotonic())))
        timer.start()
        lock = writer.TagLock.acquire(tag_dir, 10, "save")
        taken = time.monotonic()
        timer.join()
        assert taken - released[0] < 0.5, (hold, taken - released[0])
        assert (tag_dir / LOCK_NAME).read_text() == _holder()
        lock.release()


def test_tag_lock_taken_while_the_holder_removes_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder gives the tag up (removing its lock file) between a waiter's open and its lock: the
    waiter then holds a removed file, so it takes the tag again, on the lock file now at the path."""
    tag_dir = tmp_path / "t"
    held = writer.TagLock.acquire(tag_dir, 1, "save")
    real, locked = fcntl.flock, []

    def flock(fd: int, op: int) -> None:
        locked.append(fd)
        if len(locked) == 1:
            held.release()  # now: after this waiter opened the file, before it locks it
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = writer.TagLock.acquire(tag_dir, 1, "save")
    monkeypatch.undo()
    assert len(locked) == 2 and (tag_dir / LOCK_NAME).read_text() == _holder()
    with pytest.raises(CheckpointError, match="being written by another save"):  # it holds that file's lock
        writer.TagLock.acquire(tag_dir, 0.05, "save")
    lock.release()


def test_tag_lock_without_flock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A filesystem without ``flock`` (some network mounts): the save goes on unlocked and says so; a full
    disk that cannot take the holder's record does not stop it either."""

    def no_lock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    tag_dir = tmp_path / "t"
    monkeypatch.setattr(writer.fcntl, "flock", no_lock)
    with caplog.at_level(logging.WARNING, logger="functional_ema"):
        lock = writer.TagLock.acquire(tag_dir, 1, "save")
    assert (lock.tag_dir, lock.created) == (tag_dir, True)
    assert caplog.messages == [
        f"functional_ema: cannot lock {tag_dir / LOCK_NAME} ([Errno 37] No locks available); concurrent saves of "
        "this tag are not excluded"
    ]
    lock.release()
    monkeypatch.undo()

    def full(fd: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    (tag_dir / LOCK_NAME).unlink()
    monkeypatch.setattr(os, "ftruncate", full)
    lock = writer.TagLock.acquire(tag_dir, 1, "save")
    monkeypatch.undo()
    assert (tag_dir / LOCK_NAME).read_bytes() == b""
    with pytest.raises(CheckpointError, match="holder unknown"):  # it holds the tag all the same
        writer.TagLock.acquire(tag_dir, 0.05, "save")
    lock.release()


# ---------------------------------------------------------------------- the folder is shared


def test_check_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank sees the committing rank's lock file (at once, or once it appears within ``wait`` s, 2 s by
    default, listing the folder meanwhile: on NFS that refreshes a cached "no such file"); otherwise it
    refuses the save, naming itself, the folder and the lock file."""
    tag_dir = tmp_path / "t"
    tag_dir.mkdir()
    (tag_dir / LOCK_NAME).write_bytes(b"")
    assert writer.check_shared(tag_dir, 1, "save", wait=0) is None
    (tag_dir / LOCK_NAME).unlink()
    listed: list[object] = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: (listed.append(p), real_listdir(p))[1])
    with pytest.raises(CheckpointError, match="does not see the tag folder"):
        writer.check_shared(tag_dir, 1, "save", wait=0.1)
    monkeypatch.undo()
    assert listed and all(p == tag_dir for p in listed), listed
    timer = threading.Timer(0.1, (tag_dir / LOCK_NAME).write_bytes, args=(b"",))
    timer.start()
    t0 = time.monotonic()
    writer.check_shared(tag_dir, 1, "save", wait=5)
    assert time.monotonic() - t0 < 1.0
    timer.join()
    missing = tmp_path / "elsewhere" / "t"  # not even the folder: another node's disk
    for wait, low, high in [(0.3, 0.3, 0.9), (None, 2.0, 2.9)]:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            writer.check_shared(missing, 3, "AsyncSaver.save", *([] if wait is None else [wait]))
        assert low <= time.monotonic() - t0 < high
        assert str(info.value) == (
            f"AsyncSaver.save: rank 3 does not see the tag folder {missing} that rank 0 is writing (its lock file "
            f"{LOCK_NAME} is missing here): the checkpoint directory is not shared by every rank (node-local "
            "storage?). A checkpoint saved so could not be loaded: save to a directory every rank shares, or with shared=False (each rank writes only its own files: docs/many-nodes.md). "
            "Nothing was committed"
        )


# ---------------------------------------------------------------------- the ranks' agreement


def test_check_plans_names_each_rank_and_field() -> None:
    """Plans that differ in an agreed field (not the generation) are refused naming every rank's value of
    each such field; model-parallel parts each describe their own buffers."""
    model = _model()
    _, _, plan = _plan(model, buffers=fb.init_buffers(model, num_emas=2, step=7), extra={"x": 1})
    writer.check_plans([plan, dict(plan, generation=4), dict(plan)])
    other = dict(plan, tag="u", dtype="bfloat16", buffers=None, extra={"x": 2})
    with pytest.raises(CheckpointMismatchError) as info:
        writer.check_plans([plan, plan, other])
    shown = str(plan["buffers"])[:77] + "..."
    assert str(info.value) == (
        "save: ranks disagree on tag: rank 0: 't', rank 1: 't', rank 2: 'u'; and on dtype: rank 0: 'float32', "
        "rank 1: 'float32', rank 2: 'bfloat16'; and on buffers: rank 0: "
        f"{shown}, rank 1: {shown}, rank 2: None; and on extra['x']: rank 0: 1, rank 1: 1, rank 2: 2" + FIX
    )
    with pytest.raises(CheckpointMismatchError) as info:
        writer.check_plans([plan, dict(plan, step=8)])
    assert str(info.value) == "save: ranks disagree on step: rank 0: 7, rank 1: 8" + FIX
    parts = [_zero3(0, part=ModelPart(tp=t, tp_size=2)) for t in (0, 1)]
    mp = [
        writer.plan_save(_pieces(p), None, p, "t", fb.init_buffers(_model(width=2 + t), num_emas=2, step=7))
        for t, p in enumerate(parts)
    ]
    assert mp[0]["buffers"] != mp[1]["buffers"] and mp[0]["layout"] == mp[1]["layout"]
    writer.check_plans(mp)
    with pytest.raises(CheckpointMismatchError) as info:
        writer.check_plans([mp[0], dict(mp[1], tag="u")])
    assert str(info.value) == "save: ranks disagree on tag: rank 0: 't', rank 1: 'u'" + FIX
    with pytest.raises(CheckpointMismatchError) as info:  # but every part saves buffers, or none does
        writer.check_plans([mp[0], dict(mp[1], buffers=None)])
    assert str(info.value) == "save: ranks disagree on buffers: rank 0: True, rank 1: False" + FIX


def test_agree_plans_on_one_rank() -> None:
    """A job of one rank: its plan is both plans; a failing plan raises its own error (an OSError as a
    CheckpointIOError naming the rank and file) once ``on_failure`` has run."""
    model = _model()
    _, _, plan = _plan(model)
    failures: list[str] = []
    mine, first = writer.agree_plans("save", lambda: plan, None, 1, 0, on_failure=lambda: failures.append("x"))
    assert mine is plan and first is plan and failures == []
    err = CheckpointMismatchError("this rank's plan failed")

    def fail() -> dict:
        raise err

    with pytest.raises(CheckpointMismatchError) as info:
        writer.agree_plans("save", fail, None, 1, 0, on_failure=lambda: failures.append("x"))
    assert info.value is err and failures == ["x"]

    def full() -> dict:
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/t/f")

    with pytest.raises(CheckpointIOError) as info:
        writer.agree_plans("save", full, None, 1, 0)
    assert str(info.value) == (
        "rank 0 could not access /ckpt/t/f: No space left on device (errno 28, ENOSPC); free space on that "
        "filesystem (or save elsewhere) and save again"
    )


#: The agreed plans of the 2-rank test: name, rank 0's generation and (async saves) token.
AGREED = [("agree", 3, "00000000deadbeef"), ("agree_no_token", 0, None), ("agree_zero_token", 1, "0" * 16)]


def _spy_collectives() -> dict[str, int]:
    """Count this rank's all-reduces and object exchanges (each still runs): what an agreement cost."""
    import torch.distributed as dist

    calls = {"all_reduce": 0, "all_gather_object": 0}

    def counted(name: str) -> Any:
        real = getattr(dist, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return spy

    for name in calls:
        setattr(dist, name, counted(name))
    return calls


def _agree(calls: dict[str, int], rank: int, plan: Any, world: int = 2, on_failure: Any = None) -> dict[str, Any]:
    """One agreement on this rank: ``{"mine", "first"}`` or ``{"error": [class, message]}``, with
    ``"cost"``: the all-reduces and object exchanges it made."""
    before = dict(calls)
    try:
        mine, first = writer.agree_plans("save (checking the state)", plan, None, world, rank, on_failure)
        out: dict[str, Any] = {"mine": mine, "first": first}
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out = {"error": [type(e).__name__, str(e)]}
    out["cost"] = [calls[n] - before[n] for n in calls]
    return out


def _replicated(model: torch.nn.Module, rank: int, dtype: torch.dtype = torch.float32) -> tuple[EmaState, ShardLayout]:
    """A state of ``model`` and its layout as a plain (DDP) model replicated on 2 ranks reports it: whole
    parameters, stage 0 (made here rather than read, so that the ranks skip the engines' imports)."""
    params = dict(model.named_parameters())
    specs = {n: ShardSpec(tuple(p.shape), 0, p.numel()) for n, p in params.items()}
    state = fe.init_ema({n: p.detach() for n, p in params.items()}, num_emas=2, step=7, dtype=dtype)
    return state, ShardLayout(rank, 2, 0, specs, "module")


def _buffers(model: torch.nn.Module) -> fb.BufferState:
    """Buffer EMAs of ``model`` at step 7, as ``init_buffers`` makes them (floating ones averaged, others copied)."""
    named = dict(model.named_buffers())
    floating = {n: b.detach().float().clone() for n, b in named.items() if b.is_floating_point()}
    copied = {n: b.detach().clone() for n, b in named.items() if not b.is_floating_point()}
    return fb.BufferState(torch.tensor(7), (floating, {n: b.clone() for n, b in floating.items()}), copied)


def _plan_of(rank: int, tag: str = "t", width: int = 2, dtype: torch.dtype = torch.float32, **kw: Any) -> dict:
    """This rank's plan for a plain model of ``width`` replicated on 2 ranks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a bfloat16 EMA's warning
        state, layout = _replicated(_model(width=width), rank, dtype)
    return writer.plan_save(state, [0.9, 0.99], layout, tag, **kw)


def _agreements(calls: dict[str, int], rank: int) -> dict[str, Any]:
    """Agreed plans: rank 0 adds the generation (and an async save's token); key order inside a field is no
    difference. Then each rank as its own job of one rank (a plain module, rank 0 of it): nothing exchanged."""
    out = {}
    for name, generation, token in AGREED:
        p = _plan_of(rank, extra={"b": 1, "a": 2})
        if rank == 0:
            p.update(generation=generation, **({"token": token} if token else {}))
        else:
            p["schedules"] = [dict(reversed(list(d.items()))) for d in p["schedules"]]
        result = _agree(calls, rank, lambda p=p: p)
        out[name] = dict(result, mine=result["mine"] is p, plan=p)
    p = _plan_of(rank, tag=f"t{rank}")
    result = _agree(calls, 0, lambda: p, world=1)
    out["own_job"] = dict(result, mine=result["mine"] is p, first=result["first"] is p)
    failures: list[int] = []
    out["own_job_fails"] = _agree(calls, 0, lambda: _fails(f"rank {rank}'s own plan"), 1, lambda: failures.append(1))
    out["own_job_fails"]["on_failure"] = len(failures)
    return out


def _fails(message: str) -> dict:
    raise CheckpointMismatchError(message)


def _failures(calls: dict[str, int], rank: int, root: Path) -> dict[str, Any]:
    """Ranks that plan another tag, dtype and model (layout); rank 1's state that does not fit while rank 0
    took the tag (its folder and lock file) and gives it up slowly (no rank raises before that is done);
    every rank's plan failing."""
    out, failures = {}, []
    other = {"tag": "u", "width": 3, "dtype": torch.bfloat16} if rank == 1 else {}
    out["disagree"] = _agree(calls, rank, lambda: _plan_of(rank, **other), on_failure=lambda: failures.append(2))
    out["disagree"]["on_failure"] = failures.count(2)
    tag_dir = root / "t"

    def take() -> dict:
        tag_dir.mkdir()
        (tag_dir / LOCK_NAME).write_bytes(b"")
        return _plan_of(rank)

    def give_up() -> None:
        time.sleep(0.3)
        (tag_dir / LOCK_NAME).unlink()
        tag_dir.rmdir()

    unfit, layout = _replicated(_model(width=3), rank)[0], _replicated(_model(), rank)[1]
    mine = take if rank == 0 else (lambda: writer.plan_save(unfit, None, layout, "t"))
    out["one_fails"] = _agree(calls, rank, mine, on_failure=give_up if rank == 0 else lambda: failures.append(3))
    out["one_fails"].update(on_failure=failures.count(3), left=tag_dir.exists())
    out["all_fail"] = _agree(calls, rank, lambda: _fails(f"bad plan on rank {rank}"))
    return out


def _parts(calls: dict[str, int], rank: int) -> dict[str, Any]:
    """Model-parallel parts (tensor-parallel rank = rank): each part's own buffers, but all or none."""
    part = _zero3(0, part=ModelPart(tp=rank, tp_size=2))
    bufs = _buffers(_model(width=2 + rank))
    p = writer.plan_save(_pieces(part), None, part, "t", bufs)
    result = _agree(calls, rank, lambda: p)
    some = writer.plan_save(_pieces(part), None, part, "t", bufs if rank == 0 else None)
    return {
        "parts": dict(result, mine=result["mine"] is p, plan=p),
        "parts_some_buffers": _agree(calls, rank, lambda: some),
    }


def _shared(rank: int, root: Path) -> dict[str, Any]:
    """Writing: rank 1 must see rank 0's lock file (a shared folder), or every rank refuses the save."""
    from functional_ema._checkpoint import collective

    out: dict[str, Any] = {}
    shared, own = root / "r0" / "t", root / f"r{rank}" / "t"
    if rank == 0:
        shared.mkdir(parents=True)
        (shared / LOCK_NAME).write_bytes(b"")

    def check(folder: Path) -> None:  # rank 0 holds the tag; the others check they see it
        if rank:
            writer.check_shared(folder, rank, "save", wait=0.3)

    for name, folder in [("shared", shared), ("not_shared", own)]:
        try:
            collective.agree("save (writing the rank files)", lambda f=folder: check(f), None, 2, rank)
            out[name] = None
        except CheckpointError as e:
            out[name] = [type(e).__name__, str(e)]
    out["left"] = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    return out


def _forged_generation(rank: int, root: Path) -> dict[str, Any]:
    """A DDP model's tag whose manifest rank 0 edits to a generation no save can follow (2**62, 2**63 - 1: the
    latter no int64 holds once one is added): each save verb, the seconds it took and what it left; then the process
    group still serves a save and a load of another tag (its EMA returned for a bitwise check)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    shards = fe.local_shards(model)
    state = fe.update(fe.init_ema(shards), {n: t * 2 for n, t in shards.items()}, 1, decay=0.5)
    ck, out = root / "forged", {}
    for generation in (2**62, 2**63 - 1):
        fe.save(state, model, ck, "t")
        if rank == 0:
            _forge_generation(ck / "t" / MANIFEST_NAME, generation)
        dist.barrier()
        before = _snapshot(ck)
        for verb in ("save", "async", "private"):
            start = time.monotonic()
            try:
                if verb == "async":
                    fe.AsyncSaver().save(state, model, ck, "t", timeout=60).wait()
                else:
                    fe.save(state, model, ck, "t", shared=verb == "save", timeout=60)
                got: list[Any] = ["saved"]
            except Exception as e:  # noqa: BLE001 - reported to the parent
                got = [type(e).__name__, str(e)]
            seconds = time.monotonic() - start
            dist.barrier()  # what the save left once every rank is out of it (rank 0 gives the tag's lock up)
            out[f"{generation}/{verb}"] = [*got, seconds, _snapshot(ck) == before]
            dist.barrier()  # every rank has looked before the next save takes the tag's lock
        dist.barrier()
        if rank == 0:
            (ck / "t" / MANIFEST_NAME).unlink()
        dist.barrier()
    fe.save(state, model, ck, "u")
    loaded = fe.load(model, ck, "u")
    out["after"] = {n: [t.tolist(), loaded.emas[0][n].tolist()] for n, t in state.emas[0].items()}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ck)  # the later scenarios list what they leave under root
    dist.barrier()
    return out


def _save_with_rank1_stalled(save: Any, agreed: bool) -> tuple[list[Any] | None, list[tuple]]:
    """``save()`` with rank 1's rank file not written (what it would write is returned, to be written late):
    ``agreed``: its write fails and every rank agrees on the failure; else rank 1 is still writing when the ranks'
    wait for each other's writes fails (the gloo side group's timeout, as gloo raises it, on both ranks)."""
    from functional_ema import checkpoint
    from functional_ema._checkpoint import collective

    held: list[tuple] = []
    write, reduce = checkpoint.write_rank_file, collective.all_reduce_max
    writes = collective.value_digest("save (writing the rank files)")

    def stalled(path: Path, layout: Any, emas: list, *args: Any) -> Any:
        held.append((path, layout, [{n: t.clone() for n, t in e.items()} for e in emas], *args))  # what it writes
        raise OSError(errno.ETIMEDOUT, "stalled", str(path))

    def timed_out(values: list[int], group: Any) -> list[int]:
        if values[0] == writes:
            raise RuntimeError("[gloo] Timed out waiting 600000ms for recv operation to complete")
        return reduce(values, group)

    if torch.distributed.get_rank() == 1:
        checkpoint.write_rank_file = stalled  # type: ignore[assignment]
    if not agreed:
        collective.all_reduce_max = timed_out  # type: ignore[assignment]
    try:
        return error_of(save), held
    finally:
        checkpoint.write_rank_file, collective.all_reduce_max = write, reduce  # type: ignore[assignment]


def _late_rank(rank: int, root: Path) -> dict[str, Any]:
    """A blocking save into a shared folder fails while rank 1 still writes its file: the ranks' wait for each
    other's writes failed (the gloo side group's timeout), rank 0 gives the tag up. The next save must take the next
    generation, so that the late file (written here after the next save committed) lands on a name of its own:
    what the tag then loads (bitwise, each rank), what the folder holds (rank 0) at each point. A save whose ranks
    agree on its failure (every write ended) and a save refused at its call (rank 1's decay differs) leave the
    folder as it was, the first failed save's record of its generation included."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))  # each rank writes its own file
    shards = fe.local_shards(model)
    ck, out = root / "late", {}

    def stepped(state: EmaState, step: int) -> EmaState:  # update works in place: earlier states change too
        return fe.update(state, {n: t * (step + 1) for n, t in shards.items()}, step, decay=0.5)

    def listing() -> list[str] | None:
        dist.barrier()  # every rank is out of the save
        return sorted(os.listdir(ck / "t")) if rank == 0 else None

    state = stepped(fe.init_ema(shards), 1)
    fe.save(state, model, ck, "t")  # generation 0, complete
    state = stepped(state, 2)
    out["failed"], late = _save_with_rank1_stalled(lambda: fe.save(state, model, ck, "t"), agreed=False)
    out["after_failed"] = listing()
    before = _snapshot(ck / "t") if rank == 0 else None
    state = stepped(state, 3)
    out["agreed"], _ = _save_with_rank1_stalled(lambda: fe.save(state, model, ck, "t"), agreed=True)
    decay = 0.5 if rank == 0 else 0.25
    out["refused"] = error_of(lambda: fe.save(state, model, ck, "t", decay=decay))
    dist.barrier()
    out["kept"] = _snapshot(ck / "t") == before if rank == 0 else None
    fe.save(state, model, ck, "t")
    dist.barrier()
    if rank == 1:
        writer.write_rank_file(*late[0])  # the late write lands, after the commit
    dist.barrier()
    try:
        got = fe.load(model, ck, "t")
        out["loaded"] = int(got.step) == 3 and all(torch.equal(got.emas[0][n], t) for n, t in state.emas[0].items())
    except CheckpointError as e:
        out["loaded"] = [type(e).__name__, str(e)]
    out["after_late"] = listing()
    fe.save(state, model, ck, "t")  # the next commit removes the late file
    out["after_next"] = listing()
    if rank == 0:
        shutil.rmtree(ck)  # the later scenarios list what they leave under root
    dist.barrier()
    return out


def agree_worker(root: str) -> dict[str, Any]:
    """Each rank of test_agree_plans_on_two_ranks: every scenario's result or error and its cost."""
    import torch.distributed as dist

    rank = dist.get_rank()
    forged = _forged_generation(rank, Path(root))  # before the spies: it counts no collectives
    late = _late_rank(rank, Path(root))
    calls = _spy_collectives()
    out = _agreements(calls, rank) | _failures(calls, rank, Path(root)) | _parts(calls, rank)
    return out | _shared(rank, Path(root)) | {"forged": forged, "late": late}


def test_agree_plans_on_two_ranks(tmp_path: Path) -> None:
    """Two ranks (plain torch.distributed): agreement costs one all-reduce and returns rank 0's generation
    and token to every rank; a disagreement or a failed plan costs an exchange and a last all-reduce, and
    every rank raises the same error (the failing rank its own) after every rank's ``on_failure``."""
    res = run_ranks(
        f"{__name__}:agree_worker", world_size=2, timeout=180, env={"FE_DIST_INIT": "torch"}, root=str(tmp_path)
    )
    fast, slow = [1, 0], [2, 1]
    for name, generation, token in AGREED:
        for r in (0, 1):
            got = res[r][name]
            assert got["mine"] is True and got["cost"] == fast, (name, r, got)
            started = res[0][name]["plan"]["started_ns"]  # rank 0's, on every rank
            assert got["first"] == dict(got["plan"], generation=generation, token=token, started_ns=started), (name, r)
    for r in (0, 1):
        assert res[r]["own_job"] == {"mine": True, "first": True, "cost": [0, 0]}
        assert res[r]["own_job_fails"] == {
            "error": ["CheckpointMismatchError", f"rank {r}'s own plan"],
            "cost": [0, 0],
            "on_failure": 1,
        }
    shapes = {w: [["0.weight", [w, 3]], ["0.bias", [w]], ["1.weight", [w]], ["1.bias", [w]]] for w in (2, 3)}
    layouts = [f"'world_size=2 stage=0, 4 parameters #{_digest(shapes[w]):016x}'" for w in (2, 3)]
    disagree = (
        "save: ranks disagree on tag: rank 0: 't', rank 1: 'u'; and on dtype: rank 0: 'float32', rank 1: "
        f"'bfloat16'; and on layout: rank 0: {layouts[0]}, rank 1: {layouts[1]}" + FIX
    )
    unfit = (
        "save on rank 1: state.emas[0]['0.weight'] has 9 elements but rank 1's piece of it has 6: the state was cut "
        "for another world size, sharding or model. Save the state made for this model: "
        "init_ema(local_shards(model)), update or load"
    )
    failed = "save (checking the state) failed on rank {} of 2 (CheckpointMismatchError): {}"
    for r in (0, 1):
        assert res[r]["disagree"] == {"error": ["CheckpointMismatchError", disagree], "cost": slow, "on_failure": 1}
        assert res[r]["all_fail"] == {
            "error": [
                "CheckpointMismatchError",
                "bad plan on rank 0" if r == 0 else failed.format(0, "bad plan on rank 0"),
            ],
            "cost": slow,
        }
    assert res[1]["one_fails"] == {
        "error": ["CheckpointMismatchError", unfit],
        "cost": slow,
        "on_failure": 1,
        "left": False,
    }
    assert res[0]["one_fails"] == {
        "error": ["CheckpointMismatchError", failed.format(1, unfit)],
        "cost": slow,
        "on_failure": 0,
        "left": False,
    }
    for r in (0, 1):
        got, started = res[r]["parts"], res[0]["parts"]["plan"]["started_ns"]  # rank 0's, on every rank
        assert got["mine"] is True and got["first"] == dict(got["plan"], token=None, started_ns=started)
        assert got["cost"] == fast
        assert got["plan"]["buffers"]["floating"] == {"1.running_mean": [2 + r], "1.running_var": [2 + r]}
        assert res[r]["parts_some_buffers"] == {
            "error": ["CheckpointMismatchError", "save: ranks disagree on buffers: rank 0: True, rank 1: False" + FIX],
            "cost": slow,
        }
    missing = (
        f"save: rank 1 does not see the tag folder {tmp_path / 'r1' / 't'} that rank 0 is writing (its lock file "
        f"{LOCK_NAME} is missing here): the checkpoint directory is not shared by every rank (node-local storage?). "
        "A checkpoint saved so could not be loaded: save to a directory every rank shares, or with shared=False (each rank writes only its own files: docs/many-nodes.md). Nothing was committed"
    )
    assert res[1]["not_shared"] == ["CheckpointError", missing]
    assert res[0]["not_shared"] == [
        "CheckpointError",
        f"save (writing the rank files) failed on rank 1 of 2 (CheckpointError): {missing}",
    ]
    assert res[0]["shared"] is None and res[1]["shared"] is None
    assert res[0]["left"] == ["r0", "r0/t", f"r0/t/{LOCK_NAME}"]
    # A manifest naming a generation no save can follow: every rank raises a CheckpointError at once (rank 0 its
    # own, rank 1 naming rank 0), nothing is written, and the process group still serves the next save and load.
    tag_dir = tmp_path / "forged" / "t"
    for generation in (2**62, 2**63 - 1):
        own = _no_next_generation(tag_dir, generation)
        for verb, what in (("save", "save"), ("async", "async save"), ("private", "save (locking each folder)")):
            for r in (0, 1):
                cls, message, seconds, unchanged = res[r]["forged"][f"{generation}/{verb}"]
                expected = own if r == 0 else f"{what}" + (" (checking the state)" if verb != "private" else "")
                if r == 1:
                    expected += f" failed on rank 0 of 2 ({_no_next_class(generation)}): {own}"
                want = [_no_next_class(generation), expected, True]
                assert [cls, message, unchanged] == want, (generation, verb, r)
                assert seconds < 10, (generation, verb, r, seconds)
    for r in (0, 1):
        assert all(saved == loaded for saved, loaded in res[r]["forged"]["after"].values()), r
    _check_late_rank([r["late"] for r in res])


def _check_late_rank(late: list[dict[str, Any]]) -> None:
    """:func:`_late_rank`'s results: the failed save took generation 1 and recorded it (rank 0's file of it left),
    the agreed failure and the refused save changed nothing, the next save took generation 2 (it used to take 1:
    rank 1's late write then replaced its file, a CorruptCheckpointError at load) and loads bitwise on each rank;
    the next commit removes the late file and the record."""
    files = [f"ema_rank_0000{r}_of_00002" for r in (0, 1)]
    for r, got in enumerate(late):
        assert got["failed"] is not None and got["failed"][0] == "RuntimeError", got["failed"]
        assert got["agreed"] is not None and got["agreed"][0] == "CheckpointIOError", got["agreed"]
        assert "stalled" in got["agreed"][1], got["agreed"]
        assert got["refused"] is not None and got["refused"][0] == "CheckpointMismatchError", got["refused"]
        assert got["loaded"] is True, (r, got["loaded"])
    first = late[0]
    gen0 = [f"{f}.safetensors" for f in files]
    assert first["after_failed"] == sorted([".ema_generation", MANIFEST_NAME, f"{files[0]}.gen1.safetensors", *gen0])
    assert first["kept"] is True
    # the late file (generation 1) beside the complete generation 2; the record removed by the commit
    late_file = f"{files[1]}.gen1.safetensors"
    assert first["after_late"] == sorted([MANIFEST_NAME, late_file] + [f"{f}.gen2.safetensors" for f in files])
    assert first["after_next"] == [MANIFEST_NAME] + [f"{f}.gen3.safetensors" for f in files]


def test_tag_lock_awaiting_a_commit_is_recognised_with_a_long_thread_name(tmp_path: Path) -> None:
    """A thread whose name is long (and not ASCII: the file once was read 200 bytes at a time, cutting a character,
    or the text compared) holds a tag's lock until a later commit: a save of the tag from that same thread is
    refused at once (it waited its whole timeout), while another thread waits and is told who holds the tag."""
    import threading

    from functional_ema._checkpoint.writer import TagLock

    name = "é" * 150 + "-writer"
    tag_dir = tmp_path / "t"
    out: dict[str, Any] = {}

    def body() -> None:
        lock = TagLock.acquire(tag_dir, 1.0, "save")
        lock.hold_for_commit()
        t0 = time.monotonic()
        try:
            TagLock.acquire(tag_dir, 30.0, "save")
        except CheckpointError as e:
            out["own"], out["own_s"] = str(e), time.monotonic() - t0
        other = threading.Thread(target=lambda: out.setdefault("other", _error_text(tag_dir)))
        other.start()
        other.join()
        lock.release()

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    assert out["own_s"] < 5 and "held by an AsyncSaver.save(shared=False) of this thread" in out["own"], out
    quoted = _holder(name).encode()[:200].decode(errors="ignore")  # its first 200 bytes, a cut character dropped
    assert f"another save ({quoted}, awaiting an AsyncSaver commit)" in out["other"], out["other"]


def _error_text(tag_dir: Path) -> str:
    from functional_ema._checkpoint.writer import TagLock

    try:
        TagLock.acquire(tag_dir, 0.05, "save").release()
    except CheckpointError as e:
        return str(e)
    return "taken"


def test_a_save_folder_held_locked_by_another_tool_delays_ema_latest_only_boundedly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: ``publish_latest`` waited without limit for the save folder's ``flock`` (a backup script's
    ``flock DIR cmd`` held it: the save hung after writing its manifest). It now waits a bounded time, warns, and
    writes the pointer unlocked; and it unlocks before closing (a child forked meanwhile shares the lock)."""
    import fcntl

    ck = tmp_path / "ck"
    ck.mkdir()
    monkeypatch.setattr(writer, "_FOLDER_LOCK_WAIT_S", 0.3)
    other = os.open(ck, os.O_RDONLY)  # another open file description: flock conflicts as another process's would
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="functional_ema"):
            writer.publish_latest(ck, {"tag": "t", "step": 1, "started_ns": time.time_ns()})
        assert time.monotonic() - t0 < 10 and (ck / LATEST_NAME).read_text() == "t\n"
        assert "stayed locked" in caplog.text and str(ck) in caplog.text
    finally:
        os.close(other)
    writer.publish_latest(ck, {"tag": "u", "step": 2, "started_ns": time.time_ns()})  # free again: locked, no wait
    probe = os.open(ck, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by publish_latest
    finally:
        os.close(probe)
    assert (ck / LATEST_NAME).read_text() == "u\n"
