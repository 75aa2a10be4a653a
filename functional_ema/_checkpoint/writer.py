"""Writing one EMA checkpoint: the agreed plan, each rank's file, the manifest that completes the
save, and the cleanup after it. :func:`functional_ema.save` and :class:`functional_ema.AsyncSaver`
both write through these, so a checkpoint looks the same whichever wrote it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
import torch.distributed as dist
import xxhash

from .. import _io
from .._fit import state_problem
from .._layout import ModelPart, ShardLayout
from .._selection import selection_record
from .._state import BufferState, EmaState
from ..schedules import DecayLike, as_schedule
from . import collective, index
from .errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from .format import (
    ASYNC_MARKER,
    BUFFER_FILE,
    BUFFERS_FORMAT,
    FILE_FORMAT,
    FORMAT_VERSION,
    GENERATION_NAME,
    LATEST_NAME,
    LOCK_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MAX_EXTRA_BYTES,
    MAX_GENERATION,
    MAX_MANIFEST_BYTES,
    PENDING_MANIFEST_NAME,
    RANK_FILE,
    WHOLE_FORMAT_VERSION,
    buffer_file_name,
    check_tag,
    describe_buffers,
    dtype_name,
    is_own_tmp,
    join_chunk_checksums,
    library_version,
    listed_files,
    rank_file_name,
    tensor_key,
)

logger = logging.getLogger("functional_ema")

#: The key of a rank's pieces (``{name: [offset, numel]}``) in its file record, until the manifest is built.
PIECES = "pieces"


def describe_decays(decay: DecayLike | Sequence[DecayLike] | None, num_emas: int) -> list[dict[str, Any]] | None:
    if decay is None:
        return None
    decays: list[Any] = list(decay) if isinstance(decay, (list, tuple)) else [decay]  # each checked by as_schedule
    if len(decays) != num_emas:
        raise ValueError(f"got {len(decays)} decays for a state tracking {num_emas} EMAs")
    out = []
    for d in decays:
        s = as_schedule(d)
        describe = getattr(s, "describe", None)
        out.append(describe() if describe is not None else {"kind": "callable", "name": repr(s)})
    json.dumps(out)  # must be JSON-able
    return out


def check_state(state: EmaState, layout: ShardLayout) -> torch.dtype:
    """The EMA dtype of a state to save, once it fits this rank's layout (names, piece lengths, one dtype)."""
    problem = state_problem(state, layout.specs, layout.rank, one_dtype=True)
    if problem:
        raise problem.error(
            CheckpointMismatchError,
            f"save on rank {layout.rank}",
            "Save the state made for this model: init_ema(local_shards(model)), update or load",
        )
    for ema in state.emas:
        for t in ema.values():
            return t.dtype
    return torch.float32  # a model with no trainable parameters on this rank


def check_extra(extra: object) -> dict[str, Any] | None:
    """A save's ``extra`` record: a JSON object (strict JSON: no NaN), at most :data:`MAX_EXTRA_BYTES`."""
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise TypeError(f"save(extra=...) takes a dict of JSON values (or None), got {type(extra).__name__}")
    try:
        text = json.dumps(extra, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"save(extra=...) must hold JSON values only (str keys; numbers, strings, lists, dicts, "
            f"true/false/null; no NaN): {e}"
        ) from None
    if len(text) > MAX_EXTRA_BYTES:
        raise ValueError(
            f"save(extra=...) is {len(text)} bytes as JSON; at most {MAX_EXTRA_BYTES} (it is copied into every "
            "rank file's header): keep weights and large data out of it"
        )
    return json.loads(text)  # a plain copy, as it will read back


def plan_save(
    state: EmaState,
    decay: DecayLike | Sequence[DecayLike] | None,
    layout: ShardLayout,
    tag: str,
    buffers: BufferState | None = None,
    extra: object = None,
) -> dict[str, Any]:
    """This rank's part of a save's plan, everything checked; rank 0 adds the generation once it holds
    the tag (see :func:`read_generation`)."""
    dtype = check_state(state, layout)
    schedules = describe_decays(decay, state.num_emas)
    selection = selection_record(state.emas[0])  # the include/exclude the EMA averages (None: every parameter)
    return {
        **({"selection": selection} if selection is not None else {}),
        "tag": tag,
        "step": int(state.step),
        "num_emas": state.num_emas,
        "dtype": dtype_name(dtype),
        "schedules": schedules,
        "buffers": describe_buffers(buffers, state),
        "extra": check_extra(extra),
        "model_parallel": not layout.part.whole,
        "layout": collective.layout_record(layout, across_parts=not layout.part.whole),
        "generation": 0,
        # When the save started (rank 0's is agreed): ema_latest is not moved back to a save started earlier
        # than the one it names (:func:`publish_latest`). Wall-clock time: comparable across jobs and hosts.
        "started_ns": time.time_ns(),
    }


def read_generation(tag_dir: Path) -> int:
    """The generation the next save of ``tag_dir`` writes: one more than the complete checkpoint's there
    (whose files it must not touch) and than the one the last save took (:meth:`TagLock.take_generation`: a failed
    save's late ranks may still write its files), else 0. Read by rank 0 while it holds the tag's :class:`TagLock`, inside
    the plan's agreement: a manifest naming a generation no save can follow (a damaged or forged leftover) is
    refused there, before anything is written, so every rank raises at once."""
    mpath = tag_dir / MANIFEST_NAME
    try:
        found = int(json.loads(mpath.read_text())["generation"])
    except Exception:  # noqa: BLE001 - no manifest, or an unreadable one: nothing to preserve
        return _taken_generation(tag_dir) + 1
    if found == MAX_GENERATION:  # a valid checkpoint (it loads), the last a tag may hold: no save can follow it
        raise CheckpointError(
            f"{mpath}: tag {tag_dir.name!r} holds generation {found} (2**62), the largest a checkpoint may name: no "
            "later save of this tag can be written (each takes one generation more). Its checkpoint stays as it is, "
            "loadable. Nothing was written: save under another tag"
        )
    if not 0 <= found < MAX_GENERATION:
        raise CorruptCheckpointError(
            f"{mpath}: the manifest of tag {tag_dir.name!r} names generation {found}, outside [0, 2**62]: no "
            f"checkpoint may name one above 2**62 ({MAX_GENERATION}). The manifest is damaged or was edited (no load "
            f"reads it). Nothing was written: remove the damaged tag folder {tag_dir} (or restore its manifest from "
            "a copy), or save under another tag"
        )
    return max(found, _taken_generation(tag_dir)) + 1


def _write_record(path: Path, data: bytes) -> None:
    """The :data:`GENERATION_NAME` record written: a temporary file renamed over it, so a link or a hard-linked copy
    at that name (a backup made with ``cp -al``) is replaced, never written through; neither fsynced (an async save's
    call makes no such I/O: its background thread does). It only fences off ranks alive to write late: a crash
    leaves an older or no record (and maybe the temporary, removed at the next commit), as after a power loss,
    which ends those ranks too. Raises ``OSError`` naming it."""
    tmp = _io.tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, str(path)) from None


def _read_record(tag_dir: Path) -> bytes | None:
    """The :data:`GENERATION_NAME` record's first bytes (``None``: there is none; ``b""``: unreadable, ignored as a
    damaged one). Anything else at that name (a symbolic link, a folder, a pipe) is refused with
    :class:`CheckpointError` naming it, before the save writes anything: it is not the library's record, and the
    library neither writes through it nor removes it."""
    path = tag_dir / GENERATION_NAME
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return b""
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "not a file"
        )
        raise CheckpointError(
            f"save: {path} is {kind}, not the generation record functional_ema writes at that name (a small file "
            f"holding one number): the save would replace or write through it. Nothing was written: remove "
            f"{GENERATION_NAME} from the tag folder {tag_dir} (the library writes it anew) and save again"
        )
    try:  # a link or a pipe swapped in since the lstat is refused by the kernel, never waited on
        return _read_regular(path, 64, follow=False)  # a record is a number: 64 bytes hold it
    except OSError:
        return b""


def _read_regular(path: Path, limit: int, follow: bool = True) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``; ``OSError`` for anything else (a pipe is never waited
    on: ``O_NONBLOCK``; with ``follow=False`` a symbolic link is refused by the kernel)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _taken_generation(tag_dir: Path) -> int:
    """The generation recorded by :meth:`TagLock.take_generation` (-1: none, or not one a save may follow with a later
    one: a damaged record is ignored, as it only fences off late writers and the next save records a valid one).
    Refuses what is not a file at that name (:func:`_read_record`)."""
    data = _read_record(tag_dir)  # outside the try: its refusal, a CheckpointError, is a ValueError
    try:
        taken = int(data or b"")
    except ValueError:
        return -1
    return taken if 0 <= taken < MAX_GENERATION else -1  # the next save takes taken + 1 <= MAX_GENERATION


def _checked_generation(plan: Callable[[], dict[str, Any]], what: str) -> Callable[[], dict[str, Any]]:
    """``plan`` refusing a generation above :data:`MAX_GENERATION` (whatever picked it: a manifest, file names or
    a store's markers), inside the agreement: the int64 the ranks agree on holds it, and a load would refuse it."""

    def checked() -> dict[str, Any]:
        p = plan()
        generation = p.get("generation", 0)
        if not (type(generation) is int and 0 <= generation <= MAX_GENERATION):
            raise CorruptCheckpointError(
                f"{what}: tag {p.get('tag')!r}: the next save would write generation {generation}, above 2**62 "
                f"({MAX_GENERATION}), the largest a checkpoint may name: the tag's manifest or file names claim "
                "one no save can follow (damaged or edited). Nothing was written: remove the damaged tag, or save "
                "under another tag"
            )
        return p

    return checked


def save_files(layout: ShardLayout, generation: int, has_buffers: bool, writes_pieces: bool) -> list[str]:
    """The names of the files this rank writes into the tag folder: its EMA pieces (unless another rank
    holds the same replicated pieces), its buffers (every rank: buffers are not synchronised); named by
    its model-parallel part, data-parallel rank and world, and the save's generation."""
    names = [rank_file_name(layout.rank, layout.world_size, generation, layout.part)] if writes_pieces else []
    if has_buffers:
        names.append(buffer_file_name(layout.rank, layout.world_size, generation, layout.part))
    return names


def part_record(layout: ShardLayout, plan: dict) -> dict:
    """What the manifest says of this rank's model-parallel part (the same on every rank of the part)."""
    experts = layout.experts
    return {
        "part": layout.part.to_json_dict(),
        "world_size": layout.world_size,
        "zero_stage": layout.stage,
        "params": {n: list(s.shape) for n, s in layout.specs.items()},
        "tp_dims": layout.tp_dims,
        "buffers": plan["buffers"],
        "experts": None if experts is None else {"ep_size": experts.ep_size, "owners": dict(experts.owners)},
    }


#: The fields of a save's plan every rank must agree on (not the path: mounts may differ between nodes).
#: The buffers' description too, unless the model is split into parts (each part has its own buffers).
AGREED_FIELDS = (
    "tag",
    "step",
    "num_emas",
    "dtype",
    "selection",  # the include/exclude the EMA averages (absent from a plan: every parameter), named when it differs
    "layout",
    "schedules",
    "buffers",
    "extra",
    "model_parallel",
    "shared",  # set by the verbs (save's ``shared=``): a rank saving privately beside shared ones is refused
)


def _agreed(plan: dict) -> tuple[str, ...]:
    return tuple(
        f for f in AGREED_FIELDS if not (f == "buffers" and plan.get("model_parallel")) and (f != "shared" or f in plan)
    )


def check_plans(plans: list[dict], what: str = "save") -> None:
    """Raise :class:`CheckpointMismatchError` naming each rank's value of every field the plans differ in (``what``:
    the verb the user called, e.g. ``"save_snapshot"``)."""
    fields = _agreed(plans[0])
    plans = [dict(p, selection=p.get("selection")) for p in plans]  # absent: every parameter (as agree_plans)
    if "buffers" not in fields:  # model-parallel parts: each its own buffers, but all of them save some or none
        fields += ("buffers",)  # (as agree_plans's digest has it: a part without buffers would fail to resume)
        plans = [dict(p, buffers=p.get("buffers") is not None) for p in plans]
    if any(len({json.dumps(p.get(f), sort_keys=True) for p in plans}) > 1 for f in fields):
        raise CheckpointMismatchError(
            collective.disagreement(what, fields, plans)
            + ". Every rank must save the same state (the same step: update every rank alike) with the same tag"
        )


def agree_plans(
    what: str,
    plan: Callable[[], dict[str, Any]],
    group: dist.ProcessGroup | None,
    world: int,
    rank: int,
    on_failure: Callable[[], object] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``plan()`` (this rank's :func:`plan_save`, plus a hex ``token`` on rank 0 for an async save)
    on every rank and agree on it: returns (this rank's plan, rank 0's). Collective.

    A success costs one small all-reduce: a digest of the :data:`AGREED_FIELDS` (equal on every
    rank iff the maximum of it and of its negation agree) and rank 0's generation and token. A
    failure anywhere or a disagreement falls back to exchanging the plans, and raises on every rank
    as :func:`collective.agree` does, naming the rank or the field; ``on_failure()`` (e.g. rank 0 giving
    up the tag it locked) runs first on every rank, and no rank raises before every rank has run it.
    """
    payload, local_exc = collective.run_local(_checked_generation(plan, what), rank)
    if world > 1 and dist.is_initialized():
        mine = payload[1] if local_exc is None else None
        digest, generation, token, started = -1, -1, -1, -1
        if mine is not None:
            agreed = json.dumps(
                [mine.get(f) for f in _agreed(mine)] + [mine["buffers"] is not None], sort_keys=True
            ).encode()
            digest = xxhash.xxh3_64_intdigest(agreed) >> 2  # in [0, 2**62): its negation fits too
            if rank == 0:
                generation = mine["generation"]
                token = int(mine["token"], 16) if mine.get("token") else -1  # only async saves carry one
                started = mine.get("started_ns", -1)
        failed, high, neg_low, generation, token, started = collective.all_reduce_max(
            [int(mine is None), digest, -digest, generation, token, started], group
        )
        if mine is not None and not failed and high == -neg_low:
            first = dict(mine, generation=generation, token=f"{token:016x}" if token >= 0 else None)
            if started >= 0:  # rank 0's, as every manifest of the save names it
                first["started_ns"] = started
            return mine, first
    try:
        plans = collective.settle(what, payload, local_exc, group, world, rank)
        check_plans(plans, what.split(" (", 1)[0])  # the verb called ("save_snapshot"), not the step of it
    except BaseException:
        if on_failure is not None:
            on_failure()
        if world > 1 and dist.is_initialized():
            with contextlib.suppress(Exception):  # a failure path: what the others see must be the cleaned-up state
                collective.all_reduce_max([0], group)
        raise
    return plans[rank], plans[0]


def rank_file_meta(plan: dict, layout: ShardLayout, generation: int) -> dict[str, str]:
    """The string metadata of one rank file (``plan``: the agreed tag, step, num_emas, dtype, schedules, extra)."""
    return {
        "format": FILE_FORMAT,
        "format_version": str(FORMAT_VERSION if not layout.part.whole else WHOLE_FORMAT_VERSION),
        "library": f"functional_ema {library_version()}",
        "tag": plan["tag"],
        "step": str(plan["step"]),
        "num_emas": str(plan["num_emas"]),
        "dtype": plan["dtype"],
        "schedules": json.dumps(plan["schedules"]),
        "extra": json.dumps(plan["extra"], sort_keys=True),
        "world_size": str(layout.world_size),
        "rank": str(layout.rank),
        "zero_stage": str(layout.stage),
        "generation": str(generation),
        "layout": json.dumps(layout.to_json_dict(), separators=(",", ":")),
    }


def _record(
    w: _io.StreamingWriter, rank: int, path: Path, size: int, ep: int | None = None, compact: bool = False
) -> dict:
    """A file's manifest record: its rank (and expert-parallel rank, under expert parallelism), name, size
    and checksums (hex strings: JSON-safe beyond 2**53); ``compact`` (rank files): every chunk checksum in
    one string, in file order (``chunk_checksums``), else a list per tensor (``tensor_checksums``)."""
    hexa = lambda v: _io.format_checksum(w.algo, v)  # noqa: E731
    record: dict[str, Any] = {
        "rank": rank,
        "file": path.name,
        "bytes": size,
        "header_checksum": hexa(w.header_checksum),
    }
    if compact:
        record["chunk_checksums"] = join_chunk_checksums(w.algo, w.crcs)
    else:
        record["tensor_checksums"] = {key: [hexa(v) for v in vals] for key, vals in w.crcs.items()}
    if ep is not None:
        record["ep"] = ep
    return record


def write_rank_file(
    path: Path,
    layout: ShardLayout,
    emas: Sequence[dict[str, torch.Tensor]],
    dtype: torch.dtype,
    meta: dict[str, str],
    sink: contextlib.AbstractContextManager[IO[bytes]] | None = None,
) -> dict:
    """Write this rank's file (``emas.<k>.<name>``, atomically) and return its manifest record. ``sink``:
    stream it there instead of ``path`` (a ``Storage.writer``; ``path`` then only names it)."""
    names = list(layout.specs)
    entries = [(tensor_key(k, n), dtype, (layout.specs[n].numel,)) for k in range(len(emas)) for n in names]
    with _io.StreamingWriter(path, entries, meta, algo=_io.CHECKSUM, sink=sink) as w:
        for k, ema in enumerate(emas):
            for n in names:
                w.write(tensor_key(k, n), ema[n].reshape(-1))
        size = w.commit()
    record = _record(w, layout.rank, path, size, None if layout.experts is None else layout.experts.ep, compact=True)
    # Where this rank's pieces sit, for the manifest's piece index (build_manifest takes it out of the record).
    record[PIECES] = {n: [s.offset, s.numel] for n, s in layout.specs.items()}
    return record


def buffer_file_meta(plan: dict, layout: ShardLayout, generation: int) -> dict[str, str]:
    """The string metadata of one buffer file: what it belongs to (tag, step, generation, rank, world)."""
    version = FORMAT_VERSION if not layout.part.whole else WHOLE_FORMAT_VERSION
    return {
        "format": BUFFERS_FORMAT,
        "format_version": str(version),
        "library": f"functional_ema {library_version()}",
        "tag": plan["tag"],
        "step": str(plan["step"]),
        "generation": str(generation),
        "rank": str(layout.rank),
        "world_size": str(layout.world_size),
        "num_emas": str(plan["buffers"]["num_emas"]),
        "dtype": plan["buffers"]["dtype"],
    }


def buffer_tensors(buffers: BufferState, desc: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of a buffer state in file order: ``emas.<k>.<name>`` then ``copied.<name>``."""
    out = [(tensor_key(k, n), buffers.emas[k][n]) for k in range(desc["num_emas"]) for n in desc["floating"]]
    return out + [(f"copied.{n}", buffers.copied[n]) for n in desc["copied"]]


def write_buffer_file(
    path: Path,
    rank: int,
    buffers: BufferState,
    desc: dict[str, Any],
    meta: dict[str, str],
    sink: contextlib.AbstractContextManager[IO[bytes]] | None = None,
) -> dict:
    """Write this rank's buffers (atomically) and return the file's manifest record (``sink``: as
    :func:`write_rank_file`'s)."""
    tensors = buffer_tensors(buffers, desc)
    entries = [(key, t.dtype, tuple(t.shape)) for key, t in tensors]
    with _io.StreamingWriter(path, entries, meta, algo=_io.CHECKSUM, sink=sink) as w:
        for key, t in tensors:
            w.write(key, t.detach())
        size = w.commit()
    return _record(w, rank, path, size)


def build_manifest(plan: dict[str, Any], records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The manifest of a save from every rank's record of what it wrote (``{"part": part_record(...),
    "file": ..., "buffers": ...}``; ``plan`` as agreed by the ranks). One model-parallel part (a whole
    model) is written at the top level (format 3); several as ``parts`` (format 4). The ranks of one
    part must describe it alike."""
    by_part: dict[str, dict] = {}
    for r in records:
        desc = r["part"]
        key = json.dumps(desc["part"], sort_keys=True)
        entry = by_part.setdefault(key, dict(desc, files=[], buffer_files=[]))
        if any(json.dumps(entry[k], sort_keys=True) != json.dumps(desc[k], sort_keys=True) for k in desc):
            raise CheckpointError(
                f"save: the ranks of {ModelPart(**desc['part']).describe()} describe it differently "
                "(parameters, shapes, world size or buffers); every rank of a part must hold the same model"
            )
        if "file" in r:
            entry["files"].append(dict(r["file"]))
        if "buffers" in r:
            entry["buffer_files"].append(r["buffers"])
    parts = []
    for entry in sorted(by_part.values(), key=lambda e: (e["part"]["pp"], e["part"]["tp"])):
        entry["files"].sort(key=lambda e: e["rank"])
        pieces = {f["rank"]: f.pop(PIECES, None) for f in entry["files"]}
        if entry.get("experts") is None and None not in pieces.values():  # experts: each file holds its own ones
            cuts = index.build(entry["params"], pieces)
            if cuts is not None:
                entry[index.FIELD] = cuts
        if entry["buffers"] is None:
            del entry["buffers"], entry["buffer_files"]
        else:
            entry["buffer_files"].sort(key=lambda e: e["rank"])
        if entry["tp_dims"] is None:
            del entry["tp_dims"]
        if entry.get("experts", ...) is None:
            del entry["experts"]
        parts.append(entry)
    whole = len(parts) == 1 and ModelPart(**parts[0]["part"]).whole
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": WHOLE_FORMAT_VERSION if whole else FORMAT_VERSION,
        "library": f"functional_ema {library_version()}",
        "note": "functional_ema EMA checkpoint: complete because this manifest exists (with every file it lists). "
        "Each rank file holds 'emas.<k>.<parameter>' = that rank's 1-D piece of EMA k; its 'layout' metadata "
        "says where the piece sits in the full parameter"
        + ("." if whole else ", and which model-parallel part (tensor-parallel rank, pipeline stage) it holds."),
        "tag": plan["tag"],
        **extra,  # before anything long: an async save's ranks look for their save_id in the file's head
        # An optional field (older readers ignore it; no format change): when the save started (publish_latest)
        **({"started_ns": plan["started_ns"]} if type(plan.get("started_ns")) is int else {}),
        "generation": plan["generation"],
        "step": plan["step"],
        "num_emas": plan["num_emas"],
        "dtype": plan["dtype"],
        "schedules": plan["schedules"],
        "extra": plan["extra"],
        **({"selection": plan["selection"]} if plan.get("selection") is not None else {}),  # absent: every parameter
        "chunk_bytes": _io.CHUNK_BYTES,
        "checksum": _io.CHECKSUM,
    }
    if whole:
        manifest.update({k: v for k, v in parts[0].items() if k != "part"})
    else:
        manifest["parts"] = parts
    return manifest


def commit_manifest(save_dir: Path, tag_dir: Path, manifest: dict, pending: bool = False) -> None:
    """Rank 0, once every file of the save is durable: write the manifest (which completes the checkpoint),
    then ``ema_latest`` and remove what older generations and crashed saves left. ``pending``: the first
    phase of a private save's commit (``private.py``): the manifest goes to :data:`PENDING_MANIFEST_NAME`
    only, where no reader looks, until ``private._publish_manifest`` renames it once every folder holds its own."""
    _io.fsync_dir(save_dir)  # the tag folder's own entry
    data = json.dumps(manifest, indent=1).encode()
    if pending:
        _io.atomic_write_bytes(tag_dir / PENDING_MANIFEST_NAME, data)
        return
    _io.atomic_write_bytes(tag_dir / MANIFEST_NAME, data)
    _finish_commit(save_dir, tag_dir, manifest)


def drop_pending(tag_dir: Path) -> None:
    """A private save failed before its manifests were published: its pending manifest goes (best effort)."""
    with contextlib.suppress(OSError):
        os.unlink(tag_dir / PENDING_MANIFEST_NAME)


def _finish_commit(save_dir: Path, tag_dir: Path, manifest: dict) -> None:
    # The pointer that load/consolidate follow when no tag is given and there is no DeepSpeed
    # 'latest' (FSDP2, plain and DDP models): written only once the tag is complete.
    publish_latest(save_dir, manifest)
    _cleanup(tag_dir, listed_files(manifest))


#: The most of ``ema_latest`` read: a tag name; a larger file is no pointer of ours.
_POINTER_BYTES = 4096
#: How long a commit waits for another commit's hold of the save folder's ``flock`` (held for a few small reads and
#: one write) before it goes on unlocked, with a warning: another tool may hold it (``flock DIR cmd`` in a script).
_FOLDER_LOCK_WAIT_S = 30.0


def later_save_named(read: Callable[[str], bytes], manifest: dict[str, Any]) -> str | None:
    """The tag ``ema_latest`` names where that tag's complete save started after this one (``manifest``, being
    committed) at a step as late, else ``None``: the pointer then stays (the docs' promise: it names the last save
    started, which commits need not follow: an ``AsyncSaver`` save committed after a blocking save started later, or
    a rank's slow write). The step too, because start times come from wall clocks: a clock set back (NTP, another
    host) must not keep a later step's save off the pointer; and it is read from the manifests alone, so every
    rank's folder decides alike. ``read(relative path)``: the bytes of a file of the checkpoint directory. Anything
    else (no pointer, a tag that is missing, incomplete or unreadable, a manifest of an older release without
    ``started_ns``) gives ``None``: the pointer is overwritten."""
    mine, my_step = manifest.get("started_ns"), manifest.get("step")
    if type(mine) is not int or type(my_step) is not int:
        return None
    try:
        tag = read(LATEST_NAME)[:_POINTER_BYTES].decode().strip()
        if tag == manifest["tag"] or check_tag(tag, saving=False) != tag:
            return None
        theirs = json.loads(read(f"{tag}/{MANIFEST_NAME}"))
        started, step = theirs.get("started_ns"), theirs.get("step")
    except Exception:  # noqa: BLE001 - whatever the pointer or its manifest is, it is overwritten as before
        return None
    if type(started) is int and type(step) is int and started > mine and step >= my_step:
        return tag
    return None


def publish_latest(save_dir: Path, manifest: dict[str, Any]) -> None:
    """Point ``save_dir``'s ``ema_latest`` at the tag just committed (``manifest``'s) unless it names a save that
    started later (:func:`later_save_named`). Read, compared and written under a ``flock`` of ``save_dir`` itself
    (no file added): two commits of one process (an ``AsyncSaver``'s commit thread and a blocking save) or of two
    processes of this host would otherwise both read the older pointer, and the earlier save's write could land
    last. Where the folder cannot be locked (some network mounts) it goes on unlocked."""

    def read(rel: str) -> bytes:  # a regular file only: a pipe there is never waited on (no save hangs on it)
        return _read_regular(save_dir / rel, MAX_MANIFEST_BYTES + 1)

    with _folder_lock(save_dir):
        later = later_save_named(read, manifest)
        if later is not None:
            logger.warning(
                "functional_ema: tag %r in %s is committed; %s keeps naming %r, a save started after this one at a "
                "step as late (load this one by its tag)",
                manifest["tag"],
                save_dir,
                LATEST_NAME,
                later,
            )
            return
        _io.atomic_write_bytes(save_dir / LATEST_NAME, (manifest["tag"] + "\n").encode())


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` of ``folder``'s own descriptor for the block, waited for at most
    :data:`_FOLDER_LOCK_WAIT_S` (best effort: unlocked where it fails or the wait runs out, with a warning then).
    Unlocked explicitly before the close: a child forked meanwhile shares the descriptor's lock."""
    fd = None
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    locked = fd is not None and _flock_within(fd, _FOLDER_LOCK_WAIT_S, folder)
    try:
        yield
    finally:
        if fd is not None:
            if locked:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _flock_within(fd: int, seconds: float, folder: Path) -> bool:
    """Take an exclusive ``flock`` of ``fd`` within ``seconds``; False (with a warning where another holder kept it)
    otherwise: where ``flock`` is not supported at all, no warning."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                logger.warning(
                    "functional_ema: %s stayed locked (flock) by another process for %.0f s: ema_latest is written "
                    "without the lock",
                    folder,
                    seconds,
                )
                return False
            time.sleep(0.01)
        except OSError:
            return False


def remove_unlisted(tag_dir: Path, fnames: Sequence[str]) -> None:
    """After a failed save: remove this rank's new files unless the manifest on disk lists them (the
    previous complete checkpoint, if any, stays as it was). Best effort."""
    if not fnames:
        return
    try:
        m = json.loads((tag_dir / MANIFEST_NAME).read_bytes())
        listed = {
            e.get("file") for p in (m.get("parts") or [m]) for e in p.get("files", []) + (p.get("buffer_files") or [])
        }
    except Exception:  # noqa: BLE001 - no readable manifest: nothing lists the files
        listed = set()
    for fname in fnames:
        if fname not in listed:
            with contextlib.suppress(OSError):
                os.unlink(tag_dir / fname)


def _cleanup(tag_dir: Path, keep: set[str]) -> None:
    """Remove files of older generations, temporary files of crashed saves, the markers of async saves that
    failed on every rank and the taken generation's record, once the committed manifest's is as late (best effort;
    the caller holds the tag's :class:`TagLock` and has committed: nothing removed here is a file the tag's complete
    checkpoint needs). The late ranks of a failed save may still write here (their own generation's files, which
    are then removed, and their markers, which are left to them)."""
    removed = _drop_taken_record(tag_dir)
    names = os.listdir(tag_dir)
    failed = set(_failed_async_markers(tag_dir, names))
    for name in sorted(failed):
        try:
            os.unlink(tag_dir / name)
            removed = True
        except OSError as e:  # pragma: no cover
            logger.warning("functional_ema: could not remove the marker %s of a failed async save: %s", name, e)
    for p in (tag_dir / n for n in names if n not in failed):
        stale_file = (RANK_FILE.match(p.name) or BUFFER_FILE.match(p.name)) and p.name not in keep
        stale_file = stale_file or p.name == PENDING_MANIFEST_NAME  # a crashed private save's
        # Exact names: never a user's file. Not an async marker's temporary: it may be a late rank's marker being
        # written (removing it fails that rank's rename, and its peers wait out their timeout); a failed save's are
        # in ``failed``, and a crash leaves a small one.
        stale_tmp = is_own_tmp(p.name, (MANIFEST_NAME, PENDING_MANIFEST_NAME, GENERATION_NAME))
        if stale_file or stale_tmp:
            try:
                os.unlink(p)
                removed = True
            except OSError as e:  # pragma: no cover
                logger.warning("functional_ema: could not remove stale %s: %s", p, e)
    if removed:
        _io.fsync_dir(tag_dir)


def _drop_taken_record(tag_dir: Path) -> bool:
    """After a commit: remove the :data:`GENERATION_NAME` record when the manifest's generation is as late (the
    manifest alone then makes the next save's later: :func:`read_generation`). Returns whether it was removed."""
    try:  # only a file: a link or folder at that name is no record of ours (it was refused at the plan)
        if not stat.S_ISREG(os.lstat(tag_dir / GENERATION_NAME).st_mode):
            return False
    except OSError:
        return False
    try:
        if int(json.loads((tag_dir / MANIFEST_NAME).read_bytes())["generation"]) < _taken_generation(tag_dir):
            return False  # not this commit's (edited, or a save this one cannot see): kept, it only skips numbers
        os.unlink(tag_dir / GENERATION_NAME)
    except (OSError, ValueError, KeyError, TypeError):  # ValueError: a CheckpointError too (a link swapped in)
        return False
    return True


def _failed_async_markers(tag_dir: Path, names: Sequence[str]) -> list[str]:
    """The markers in ``names`` (exact names: :data:`ASYNC_MARKER`, with their temporaries) of the async saves that
    failed on every rank: each rank of the save left its error marker, all of them naming the same number of ranks.
    A rank writes its error marker last, once it failed (its own failure or another rank's), and reads no marker of
    the save after it, so these are stale wherever the save's ranks run. Kept: the markers of a save still in flight
    on any rank (it has not written its error marker), of one whose rank died or could not learn the outcome
    (``_async._Undecided``: none), and those an older release wrote (no number of ranks in them)."""
    by_save: dict[str, list[str]] = {}
    for name in names:
        if ASYNC_MARKER.fullmatch(name) is not None:  # ema_async.<id>.rank<r>.<kind>[.tmp-...]
            by_save.setdefault(name.split(".")[1], []).append(name)
    stale: list[str] = []
    for own in by_save.values():
        worlds: dict[int, object] = {}  # rank -> the number of ranks its error marker names
        for name in own:
            _, _, rank, kind, *tmp = name.split(".")
            if kind == "error" and not tmp:
                worlds[int(rank[len("rank") :])] = _marker_world(tag_dir / name)
        world = next(iter(worlds.values()), None)
        if type(world) is int and set(worlds) == set(range(world)) and all(w == world for w in worlds.values()):
            stale += own
    return stale


def _marker_world(path: Path) -> object:
    """The number of ranks an async save's error marker names (``None`` where it cannot be read or names none)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)  # a marker is a small record; a larger file is no marker of ours
        if len(data) == 1 << 20:
            return None
        record = json.loads(data)
    except (OSError, ValueError):
        return None
    return record.get("world") if isinstance(record, dict) else None


# ------------------------------------------------------------------------------------ one writer


class SaveRequest(NamedTuple):
    """One save's arguments once its public verb has checked them: what the plan, the files and the commit read."""

    state: EmaState
    layout: ShardLayout
    ranks: tuple[Any, int, int]  # (group, world, rank) of the ranks that save the model together
    decay: DecayLike | Sequence[DecayLike] | None
    buffers: BufferState | None
    extra: dict[str, Any] | None
    timeout: float | None  # seconds (None: FUNCTIONAL_EMA_TIMEOUT's)

    @property
    def writes_buffers(self) -> bool:
        """Whether this rank writes a buffer file: replicas' buffers are alike, replica 0's are saved."""
        return self.buffers is not None and self.layout.replica == 0


class TagLock:
    """The right to write one tag folder, exclusive across threads and processes.

    ``flock`` on :data:`LOCK_NAME` inside the tag folder, taken by the rank that commits (rank 0)
    before it picks the generation and held until the manifest is written or the save has failed.
    A ``flock`` belongs to one open file description, so two savers of one process exclude each other
    as two processes do, and it is released by the kernel when its holder dies (no stale locks).
    The holder removes the file before releasing it; a waiter that then holds a removed file tries again.
    """

    def __init__(self, tag_dir: Path, fd: int | None, created: bool) -> None:
        self.tag_dir, self._fd, self.created = tag_dir, fd, created
        self._replaced: list[bytes | None] = []  # the record take_generation replaced (empty: none taken)

    @classmethod
    def acquire(cls, tag_dir: Path, timeout: float, what: str) -> TagLock:
        """Create ``tag_dir`` if needed and take its lock, waiting at most ``timeout`` seconds for another
        save of the same tag to finish; else :class:`CheckpointError` naming the tag and the holder."""
        created = not tag_dir.is_dir()
        tag_dir.mkdir(parents=True, exist_ok=True)
        path = tag_dir / LOCK_NAME
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                token, holder = _read_holder(fd)
                os.close(fd)
                if token == _commit_token():
                    raise CheckpointError(
                        f"{what}: tag {tag_dir.name!r} in {tag_dir.parent} is held by an AsyncSaver.save(shared=False) "
                        "of this thread, whose commit runs at that saver's next save or wait: waiting here would wait "
                        "for ourselves. Call saver.wait() (or the handle's wait()) on every rank before saving this "
                        "tag again, or save under another tag. Nothing was written"
                    ) from None
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"{what}: tag {tag_dir.name!r} in {tag_dir.parent} is being written by another save ({holder}) and "
                        f"it did not finish within {timeout:g} s. One save writes a tag at a time: wait for the other "
                        "one (AsyncSaver.wait()), or save under another tag"
                    ) from None
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
                continue
            except OSError as e:  # a filesystem without flock (some network mounts): go on unlocked, say so
                logger.warning(
                    "functional_ema: cannot lock %s (%s); concurrent saves of this tag are not excluded", path, e
                )
                os.close(fd)
                return cls(tag_dir, None, created)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file we locked: take the new one
                os.close(fd)
                continue
            lock = cls(tag_dir, fd, created)
            lock._note_holder(awaits_commit=False)
            return lock

    def hold_for_commit(self) -> None:
        """Say that the lock stays held after the call that took it returns, until a later call of this
        thread commits the save (an ``AsyncSaver.save(shared=False)``): a save of the tag from this thread
        would wait for itself, so :meth:`acquire` refuses it at once instead of waiting its timeout."""
        self._note_holder(awaits_commit=True)

    def _note_holder(self, awaits_commit: bool) -> None:
        """Who holds the lock, in the lock file, for another waiter's message (best effort: a full disk)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, _holder_text(awaits_commit).encode(), 0)

    def take_generation(self, generation: int | None = None) -> int:
        """Record that this save takes ``generation`` (default :func:`read_generation`'s) in :data:`GENERATION_NAME`,
        before any rank writes a file of it, and return it: the next save of the tag takes a later one. Without it, a
        save that failed on rank 0 while another rank still writes leaves no manifest, the next save takes the same
        generation, and that rank's late write replaces (or its cleanup removes) the next save's file of that name.
        A crash after it only skips a number; the next commit removes the record (:func:`_cleanup`)."""
        path = self.tag_dir / GENERATION_NAME
        replaced = _read_record(self.tag_dir)  # refuses a link or folder there: never written through or replaced
        taken = read_generation(self.tag_dir) if generation is None else generation
        self._replaced = [replaced]
        _write_record(path, f"{taken}\n".encode())
        return taken

    def untake_generation(self) -> None:
        """Put the record back as it was before :meth:`take_generation`, for a save refused at its call (before any
        rank wrote a file of it: none can write late), so that it leaves the folder as it was. Best effort;
        idempotent."""
        if not self._replaced:
            return
        (replaced,) = self._replaced
        self._replaced = []
        with contextlib.suppress(OSError):
            if replaced is None:
                if stat.S_ISREG(os.lstat(self.tag_dir / GENERATION_NAME).st_mode):  # ours: nothing was there
                    os.unlink(self.tag_dir / GENERATION_NAME)
            else:
                _write_record(self.tag_dir / GENERATION_NAME, replaced)

    @property
    def held(self) -> bool:
        """Whether this lock still holds the tag (not yet released; ``False`` also where the folder has no flock)."""
        return self._fd is not None

    def release(self, remove_empty: bool = False) -> None:
        """Give the tag up (idempotent); ``remove_empty`` also removes the folder if this lock created it
        and nothing else is in it (a save refused before writing anything)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.tag_dir / LOCK_NAME)
        os.close(fd)
        if remove_empty and self.created:
            with contextlib.suppress(OSError):
                self.tag_dir.rmdir()


def check_shared(tag_dir: Path, rank: int, what: str, wait: float = 2.0) -> None:
    """Refuse a save whose folder this rank does not share with the committing rank: its ``TagLock`` file,
    made before the plan was agreed, must be visible here. Otherwise (node-local storage: the same path
    on another disk) the manifest would list files this rank's node cannot read, found only at resume.
    A network filesystem's cached "no such file" is given ``wait`` seconds to clear."""
    path = tag_dir / LOCK_NAME
    deadline = time.monotonic() + wait
    while not path.exists():
        with contextlib.suppress(OSError):
            os.listdir(tag_dir)  # revalidates a cached directory (NFS)
        if path.exists():
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{what}: rank {rank} does not see the tag folder {tag_dir} that rank 0 is writing (its lock file "
                f"{LOCK_NAME} is missing here): the checkpoint directory is not shared by every rank (node-local "
                "storage?). A checkpoint saved so could not be loaded: save to a directory every rank shares, or with shared=False (each rank writes only its own files: docs/many-nodes.md). "
                "Nothing was committed"
            )
        time.sleep(0.05)


#: The first line of a :class:`TagLock` file whose holder awaits a later commit (:func:`_commit_token`).
_AWAITS = "awaiting an AsyncSaver commit:"
#: How much of a lock file's text a waiter's message quotes (a hostname or thread name may make it long).
_HOLDER_BYTES = 200


def _commit_token() -> str:
    """What marks a lock held by this thread until a later call of it commits: short and fixed (pid and thread
    id, no host or thread name of any length), so a save from exactly this thread recognises it whole."""
    return f"{_AWAITS} pid {os.getpid()} thread id {threading.get_ident()}"


def _holder_text(awaits_commit: bool) -> str:
    """What a :class:`TagLock` file says of its holder: this process and thread, for other waiters' messages;
    for a lock held until a later call of this thread commits, :func:`_commit_token` first, on its own line."""
    text = f"pid {os.getpid()} on {socket.gethostname()}, thread {threading.current_thread().name}"
    return f"{_commit_token()}\n{text}" if awaits_commit else text


def _read_holder(fd: int) -> tuple[str | None, str]:
    """A lock file's commit token (``None``: its holder awaits no commit) and the first :data:`_HOLDER_BYTES` of
    its text, for messages ("holder unknown" when there is none or it is not text)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        data = os.pread(fd, len(_commit_token()) + 64 + _HOLDER_BYTES, 0)
        token = None
        if data.startswith(_AWAITS.encode()) and b"\n" in data:
            first, data = data.split(b"\n", 1)
            token = first.decode()
        text = _decode_head(data[:_HOLDER_BYTES])
        if text:
            return token, text + (", awaiting an AsyncSaver commit" if token is not None else "")
    return None, "holder unknown"


def _decode_head(data: bytes) -> str:
    """``data`` as UTF-8, but for a character the read's bound cut short at its end (dropped); other bytes that
    are not UTF-8 raise ``UnicodeDecodeError``."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data":
            raise
        return data[: e.start].decode()
