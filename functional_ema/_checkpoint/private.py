"""Saves into folders the ranks do not share: ``functional_ema.save(..., shared=False)``.

Node-local disks (DeepSpeed's ``use_node_local_storage``, the HF Trainer's ``save_on_each_node``) and Ray
Train (every worker reports its own temporary folder) give each rank, or each node, a folder the others do
not see. A shared-folder save refuses them (a manifest would list files that a resume cannot read). This
mode writes a checkpoint whose **union of folders** is one complete, verifiable checkpoint of the usual
format, however it is later merged (Ray's upload, ``rsync``, a bucket):

1. The plan is agreed as for a shared save, with a token from rank 0 naming this save.
2. Which ranks share each folder is found from the folders themselves: each rank leaves a marker
   ``.ema_present.<token>.<rank>`` in its tag folder, and after a barrier lists the markers it sees.
   Ranks that see each other's markers share a folder; its lowest rank is the folder's committer.
3. Each committer takes its tag folder's write lock and reads its generation; every folder uses the
   largest (agreed over the process group, not through the filesystem).
4. Every rank holding EMA pieces writes its file into its own folder. A replica (a later rank of a
   replicated ZeRO-0 / DDP / plain model, an HSDP replica) writes the same file as the rank it
   replicates: same name, same bytes, which the records' checksums must show, or the save is refused.
5. Every rank's file records go to every rank; each committer writes the same manifest (the same bytes)
   into its folder under a pending name, once every rank's files are durable; once every folder holds it
   (agreed), each renames it into place and writes ``ema_latest``. A failure or a crash before that leaves
   every folder's previous manifest in place (never one folder ahead of another). A folder holding only
   some ranks' files is never complete on its own: its manifest lists files it lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from .. import _io
from .._layout import ShardLayout
from .._state import BufferState, EmaState
from ..schedules import DecayLike
from . import collective, writer
from .collective import agree, all_reduce_max, exchange, io_error
from .errors import CheckpointError, CheckpointMismatchError
from .format import (
    LATEST_NAME,
    MANIFEST_NAME,
    PENDING_MANIFEST_NAME,
    check_tag,
    listed_files,
    parse_dtype,
)
from .writer import (
    TagLock,
    agree_plans,
    buffer_file_meta,
    build_manifest,
    commit_manifest,
    drop_pending,
    part_record,
    plan_save,
    publish_latest,
    rank_file_meta,
    read_generation,
    remove_unlisted,
    save_files,
    write_buffer_file,
    write_rank_file,
)

__all__ = [
    "MARKER_PREFIX",
    "PrivateSave",
    "abandon_private",
    "commit_private",
    "prepare_private",
    "write_private",
]

#: Markers a private save leaves for a moment in each tag folder, to find which ranks share it.
MARKER_PREFIX = ".ema_present."


def holder_layout(layout: ShardLayout) -> ShardLayout:
    """The layout of the rank whose file this rank's pieces replicate (itself when it holds its own)."""
    if layout.writes_pieces:
        return layout
    return layout._replace(rank=0 if layout.stage == 0 else layout.rank, replica=0)


def folder_group(tag_dir: Path, token: str, rank: int, job: tuple[Any, int, int], timeout: float) -> list[int]:
    """The ranks that share ``tag_dir`` with this one (itself included), found by markers (see module docstring)."""
    group, world, _ = job
    marker = tag_dir / f"{MARKER_PREFIX}{token}.{rank:06d}"
    try:
        touch = lambda: _touch(tag_dir, marker, rank)  # noqa: E731
        agree("save (finding which ranks share a folder)", touch, group, world, rank, results=False)
        seen = sorted(int(p.name.rsplit(".", 1)[1]) for p in tag_dir.glob(f"{MARKER_PREFIX}{token}.*"))
        groups = _everyone(seen, group, world, timeout)  # every rank listed: then unlink
    finally:
        with contextlib.suppress(OSError):
            marker.unlink()
    for r, g in enumerate(groups):
        if r not in g or any(groups[q] != g for q in g if 0 <= q < world):
            raise CheckpointError(
                f"save(shared=False): the ranks see each other's folders inconsistently (rank {r} sees the markers of "
                f"ranks {g}; they see {[groups[q] for q in g if 0 <= q < world]}): a network filesystem whose listings "
                "lag? Save to folders that are either shared or private. Nothing was written"
            )
    return groups[rank]


def _everyone(obj: Any, group: Any, world: int, timeout: float) -> list[Any]:
    """``obj`` of every rank (on the gloo side group); a one-rank save has no process group to ask."""
    if world <= 1 or not dist.is_initialized():
        return [obj]
    return exchange(obj, collective.barrier_group(group, timeout), world)


def _touch(tag_dir: Path, marker: Path, rank: int) -> None:
    try:
        tag_dir.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(b"")
    except OSError as e:
        raise io_error(e, rank, marker) from None


class PrivateSave(NamedTuple):
    """One private save, once its ranks agreed on it (:func:`prepare_private`): what every later stage needs."""

    job: tuple[Any, int, int]  # (group, world, rank)
    save_dir: Path
    tag_dir: Path
    mine: dict[str, Any]  # this rank's plan
    first: dict[str, Any]  # rank 0's plan (agreed)
    sharers: list[int]  # the ranks that share this rank's folder (its lowest commits it)
    layout: ShardLayout  # this rank's
    holder: ShardLayout  # whose pieces this rank's EMA file holds
    generation: int
    names: list[str]  # the files this rank writes (its pieces unless a rank of its folder does; its buffers)
    lock: list[TagLock]  # the folder's write lock, held by its committer until the commit or the failure


def prepare_private(
    state: EmaState,
    layout: ShardLayout,
    job: tuple[Any, int, int],
    save_dir: Path,
    raw_tag: Any,
    decay: DecayLike | Any,
    buffers: BufferState | None,
    extra: dict[str, Any] | None,
    timeout: float,
    what: str,
    before: Callable[[], None] | None = None,
) -> PrivateSave:
    """Steps 1-3 (module docstring) and the names each rank writes. Collective; ``before()`` runs first on
    every rank inside the plan's agreement (a failure there raises on every rank). On a failure the folders'
    locks are released and nothing is left behind."""
    group, world, rank = job
    box: dict[str, Any] = {}

    def plan() -> dict[str, Any]:
        if before is not None:
            before()
        tag = check_tag(raw_tag)
        box["tag_dir"] = save_dir / tag
        p = dict(plan_save(state, decay, layout, tag, buffers, extra), shared=False)
        p["token"] = f"{secrets.randbits(62):016x}" if rank == 0 else None
        return p

    mine, first = agree_plans(f"{what} (checking the state)", plan, group, world, rank)
    tag_dir: Path = box["tag_dir"]
    token = first["token"] if first.get("token") else f"{secrets.randbits(62):016x}"  # world 1: no agreement ran
    sharers = folder_group(tag_dir, token, rank, job, timeout)
    lock: list[TagLock] = []
    holder = holder_layout(layout)
    try:
        generation = _agree_generation(tag_dir, sharers[0] == rank, lock, job, timeout)
        piece_file = save_files(holder, generation, False, True)[0]
        others = _everyone(piece_file, group, world, timeout)
        writes_pieces = not any(others[q] == piece_file for q in sharers if q < rank)  # a folder gets one copy
        writes_buffers = buffers is not None and layout.replica == 0
        names = ([piece_file] if writes_pieces else []) + (
            save_files(layout, generation, True, False) if writes_buffers else []
        )
    except BaseException:
        for held in lock:
            held.release(remove_empty=True)
        raise
    # The agreed plan names the generation the folders agreed on (the plan's own is a shared save's, from
    # rank 0's lock): the manifest must name the generation of the files it lists.
    first = dict(first, generation=generation)
    return PrivateSave(job, save_dir, tag_dir, mine, first, sharers, layout, holder, generation, names, lock)


def write_private(
    prep: PrivateSave, emas: Sequence[Mapping[str, torch.Tensor]], buffers: BufferState | None
) -> dict[str, Any]:
    """This rank's files (``prep.names``: its pieces as their holder writes them, its buffers) and their
    record. Not collective: the async save runs it in its background thread. ``buffers`` is ignored
    unless this rank writes a buffer file."""
    names, tag_dir, rank = prep.names, prep.tag_dir, prep.job[2]
    records: dict[str, Any] = {"part": part_record(prep.layout, prep.mine)}
    path = tag_dir
    try:
        dtype = parse_dtype(prep.mine["dtype"], "save")
        if names and names[0].startswith("ema_"):  # the pieces' file (buffer files start "buffers_")
            path = tag_dir / names[0]
            meta = rank_file_meta(prep.mine, prep.holder, prep.generation)
            # write_rank_file only indexes ``ema[name]``; its ``dict`` annotation is narrower than a Shards.
            pieces = cast("list[dict[str, torch.Tensor]]", emas)
            records["file"] = write_rank_file(path, prep.holder, pieces, dtype, meta)
        if buffers is not None and names and names[-1].startswith("buffers_"):
            path = tag_dir / names[-1]
            meta = buffer_file_meta(prep.mine, prep.layout, prep.generation)
            records["buffers"] = write_buffer_file(path, prep.layout.rank, buffers, prep.mine["buffers"], meta)
    except OSError as e:
        raise io_error(e, rank, path) from None
    return records


def commit_private(prep: PrivateSave, record: dict[str, Any], timeout: float, what: str) -> None:
    """Step 5: every rank's records to every rank, then the commit in two phases, each agreed over the
    process group: each folder's committer writes the manifest under a pending name; once every folder holds
    it, each renames it into place and writes ``ema_latest``; once every folder did, each removes its older
    generations (best effort, after the last agreement: a slow removal keeps no other rank waiting in the commit).
    A failure before the second phase (a full disk, a rank dying) removes the pending manifests and this rank's new
    files: every folder keeps its previous checkpoint and ``ema_latest``, a folder never gets ahead of the others.
    Every wait for the other ranks is bounded by ``timeout`` (:func:`collective.commit_step`): a rank that hangs
    or dies mid-commit fails the others with :class:`CheckpointTimeoutError` naming the step and what is left.
    The locks are released. Collective."""
    group, world, rank = prep.job
    exchange_records = lambda: _everyone(record, group, world, timeout)  # noqa: E731
    ref = collective.CommitRef(what, prep.first["tag"], str(prep.tag_dir), str(prep.first.get("token")), timeout)
    manifest: list[dict[str, Any]] = []
    try:
        records = collective.commit_exchange(
            ref, "exchanging the file records", exchange_records, prep.job, _uncommitted
        )
        stage = lambda: manifest.append(_stage_manifest(prep, records))  # noqa: E731
        collective.commit_step(ref, "writing the pending manifests", stage, prep.job, _uncommitted)
    except BaseException:
        try:
            if prep.sharers[0] == rank:
                drop_pending(prep.tag_dir)
            remove_unlisted(prep.tag_dir, prep.names)  # after the pending manifest: the live one lists none of them
        finally:  # an interrupt (or a failure) mid-cleanup must not leave the folder locked
            for held in prep.lock:
                held.release(remove_empty=True)
        raise
    published: list[bool] = []
    try:  # every folder holds the pending manifest: publishing it is one rename per folder
        publish = lambda: _publish_manifest(prep, manifest[0], published)  # noqa: E731
        left = lambda: _half_published(prep, bool(published))  # noqa: E731
        collective.commit_step(ref, "publishing the manifests", publish, prep.job, left)
        if published:  # every folder holds this save: its older generations go, however long that takes
            with contextlib.suppress(OSError):  # best effort (the save is committed); the next commit retries
                writer._cleanup(prep.tag_dir, listed_files(manifest[0]))
    finally:
        for held in prep.lock:
            held.release()


def _uncommitted() -> str:
    """What a private save's commit that stopped before publishing leaves (:func:`commit_private`)."""
    return (
        "Nothing of this save is committed: this rank removed its new files and its folder's pending manifest; every "
        "folder keeps its previous checkpoint and ema_latest, loadable (a stopped rank's folder may keep its pending "
        f"{MANIFEST_NAME}.pending, which no load reads and its next save removes). Save again once every rank is back."
    )


def _half_published(prep: PrivateSave, published: bool) -> str:
    """What a private save's commit that stopped while the folders published their manifests leaves."""
    committer = prep.sharers[0]
    if committer != prep.job[2]:
        mine = f"this rank's folder {prep.tag_dir} is rank {committer}'s to publish"
    elif published:
        mine = f"this rank published its folder {prep.tag_dir}: it holds this save"
    else:
        mine = f"this rank's folder {prep.tag_dir} keeps its previous checkpoint"
    return (
        f"The folders may disagree: {mine}; a folder whose committer stopped before publishing keeps its previous "
        f"checkpoint (its older files and {MANIFEST_NAME}) beside this save's complete {MANIFEST_NAME}.pending. "
        "load(shared=False) refuses folders of two saves, naming them: save the tag again on every rank."
    )


def _stage_manifest(prep: PrivateSave, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of the save; this folder's committer writes it under the pending name (first phase)."""
    rank = prep.job[2]
    manifest = build_manifest(prep.first, _one_record_per_file(records))
    if prep.sharers[0] == rank:
        try:
            commit_manifest(prep.save_dir, prep.tag_dir, manifest, pending=True)
        except OSError as e:
            raise io_error(e, rank, prep.tag_dir / MANIFEST_NAME) from None
    return manifest


def _publish_manifest(prep: PrivateSave, manifest: dict[str, Any], published: list[bool]) -> None:
    """Second phase: this folder's committer renames its pending manifest into place (then notes it in
    ``published``: the folder holds this save), then writes ``ema_latest``. Not its older generations' removal
    (done once every folder is published: :func:`commit_private`)."""
    rank = prep.job[2]
    if prep.sharers[0] == rank:
        path = prep.tag_dir / MANIFEST_NAME
        try:
            os.replace(prep.tag_dir / PENDING_MANIFEST_NAME, path)
            published.append(True)  # the folder holds this save from the rename on, whatever fails next
            _io.fsync_dir(prep.tag_dir)
            path = prep.save_dir / LATEST_NAME  # the pointer load follows without a tag: once the tag is complete
            publish_latest(prep.save_dir, manifest)  # unless it names a save started later
        except OSError as e:
            raise io_error(e, rank, path) from None


def abandon_private(prep: PrivateSave) -> None:
    """A failed private save: remove this rank's new files and release its folder's lock."""
    try:
        remove_unlisted(prep.tag_dir, prep.names)
    finally:  # an interrupt mid-cleanup must not leave the folder locked
        for held in prep.lock:
            held.release(remove_empty=True)


def _agree_generation(
    tag_dir: Path, committer: bool, lock: list[TagLock], job: tuple[Any, int, int], timeout: float
) -> int:
    """Each folder's committer locks it and reads its generation; every folder takes the largest."""
    group, world, rank = job
    found: list[int] = [-1]

    def take() -> None:
        if committer:
            lock.append(TagLock.acquire(tag_dir, timeout, "save"))
            found[0] = read_generation(tag_dir)

    agree("save (locking each folder)", take, group, world, rank, results=False)
    return all_reduce_max(found, group)[0] if world > 1 and dist.is_initialized() else found[0]


def _one_record_per_file(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as a shared save's: one record per file; replicas in other folders wrote the same file,
    whose bytes must be exactly the holder's (else the replicas' EMAs diverged: refused)."""
    by_file: dict[str, int] = {}
    out = []
    for r, rec in enumerate(records):
        kept = dict(rec)
        f = rec.get("file")
        if f is not None:
            first = by_file.setdefault(f["file"], r)
            if first != r:
                if _digest(records[first]["file"]) != _digest(f):
                    raise CheckpointMismatchError(
                        f"save(shared=False): ranks {first} and {r} hold the same replicated EMA pieces ({f['file']}) "
                        "with different values (their checksums differ): the replicas' EMAs diverged (updated at other "
                        "steps, or from other weights). Nothing was committed"
                    )
                del kept["file"]
        out.append(kept)
    return out


def _digest(record: dict[str, Any]) -> str:
    return json.dumps({k: record.get(k) for k in ("bytes", "header_checksum", "chunk_checksums")}, sort_keys=True)
