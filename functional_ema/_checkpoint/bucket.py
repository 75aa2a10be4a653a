"""Saves to an object store: ``functional_ema.save(state, engine, "s3://bucket/run")`` (any fsspec URL).

The checkpoint is the local format, object for object (``<prefix>/<tag>/ema_rank_*.safetensors``, the
buffer files, ``<prefix>/<tag>/ema_manifest.json``, ``<prefix>/ema_latest``), written through the storage
seam (:mod:`functional_ema._storage`): each file streamed by :class:`~functional_ema._io.StreamingWriter`
into ``Storage.writer`` (S3: a multipart upload, completed only when the file is whole, aborted on a
failure), nothing staged on local disk. Object stores have no lock and no rename, so the commit is agreed
over the process group instead of through the folder:

1. The plan is agreed as for a local save. Rank 0 (the committing rank) picks the generation: one more
   than the tag's manifest names, than any rank or buffer file already under the tag and than any other save's
   marker, so no object a complete checkpoint lists (nor a leftover of a failed save, nor the files a save in
   flight is uploading) is ever overwritten; and it publishes a marker object
   ``<tag>/.ema_store.<token>.gen<generation>`` holding this save's random token, before any file is uploaded.
   It then lists the tag again: a marker of another save with the same generation (both picked it before
   either marker was there) makes it withdraw its own and pick again (:func:`_claim_generation`).
2. Every other rank reads the marker and must find the token: else it reaches another store (another
   endpoint, bucket, prefix or credentials) and the save is refused on every rank before any file is written,
   naming where rank 0 wrote the marker and where the ranks that missed it looked (one small all-gather of
   each rank's answer: the URLs are not compared, as nodes may reach one store by other endpoints).
3. Every rank streams its files; all ranks agree that every upload completed.
4. Rank 0 publishes the manifest (carrying the token as ``save_id``; the checkpoint is complete from here), then
   ``ema_latest`` (its own object), then removes its marker, older generations' markers and files (best effort).

A failure anywhere raises on every rank, and each rank removes only the objects it wrote that no manifest
lists (none at all when the manifest cannot be read: an unreachable server leaves orphans, which the next
commit of the tag removes, rather than risking a listed file). The previous checkpoint stays loadable. Rank 0
removes its marker only where every rank's upload is known to have ended (the ranks agreed on the failure after
their writes, or its commit had every rank's records); else it keeps it: another rank may still be uploading a file
of the failed save (a background write past ``commit_timeout``), and the marker keeps the next save of the tag off
that generation, whose file names the late upload would replace. The tag's next commit removes it (step 4).

Not excluded: two jobs saving the same tag of the same prefix at once (there is no lock); within one
process, an ``AsyncSaver`` waits for its own save of a tag. What is guarded (a blocking ``save`` of a tag
whose ``AsyncSaver`` save awaits its commit, in this process or another): the markers give the two saves
different generations, even while the first one's files are not uploaded yet; rank 0 publishes a manifest only
if no later generation of the tag was committed meanwhile (nor the same one by another save) and every file it
lists is there, else the save fails on every rank, and a commit removes only older generations' files and
markers: the tag keeps the later save, complete. Everything stays under the
URL's prefix (the tag is one plain name, every path is checked by the seam).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from .._layout import ShardLayout
from .._state import BufferState, EmaState
from .._storage import Storage, redact_url, storage_for
from ..schedules import DecayLike
from .collective import (
    DEFAULT_TIMEOUT_S,
    CommitRef,
    agree,
    check_distinct_writers,
    commit_exchange,
    commit_step,
    gather_to_first,
)
from .errors import CheckpointError, CheckpointIOError, CheckpointTimeoutError
from .format import (
    BUFFER_FILE,
    LATEST_NAME,
    MANIFEST_NAME,
    RANK_FILE,
    check_tag,
    listed_files,
    parse_dtype,
)
from .writer import (
    agree_plans,
    buffer_file_meta,
    build_manifest,
    later_save_named,
    part_record,
    plan_save,
    rank_file_meta,
    save_files,
    write_buffer_file,
    write_rank_file,
)

__all__ = [
    "MARKER_PREFIX",
    "access_refused",
    "BucketSave",
    "abandon_bucket",
    "commit_bucket",
    "prepare_bucket",
    "url_storage",
    "write_bucket",
]

logger = logging.getLogger("functional_ema")

#: Rank 0's marker object in the tag's prefix (steps 1-2 of the module docstring), removed at the commit.
MARKER_PREFIX = ".ema_store."
#: A marker's name: the save's token and the generation it claims (counted by :func:`next_generation`).
MARKER_NAME = re.compile(r"\.ema_store\.([0-9a-f]{16})\.gen(\d+)")
#: A marker as releases before generation markers named it (``.ema_store.<token>``): removed by a later commit.
_OLD_MARKER_NAME = re.compile(r"\.ema_store\.[0-9a-f]{16}")
#: Picks of a generation before rank 0 gives up when other saves of the tag keep claiming the same one at once,
#: and the longest random pause before picking again (it parts two saves that withdrew together).
CLAIM_TRIES = 8
CLAIM_PAUSE_S = 0.2
#: How long a rank waits for rank 0's marker to become visible (stores whose listings or reads lag).
MARKER_WAIT_S = 5.0


class BucketSave(NamedTuple):
    """One save to a URL, once its ranks agreed on it (:func:`prepare_bucket`)."""

    job: tuple[Any, int, int]  # (group, world, rank)
    store: Storage
    tag: str
    tag_dir: str  # the tag's URL, for messages and the caller's return value
    mine: dict[str, Any]  # this rank's plan
    first: dict[str, Any]  # rank 0's plan (agreed): its generation and token
    layout: ShardLayout
    names: list[str]  # the files this rank writes (its pieces' file first, its buffers' last)
    verb: str = "save"  # the public verb, as a refused access names its storage_options ("AsyncSaver.save")
    timeout: float = DEFAULT_TIMEOUT_S  # the save's bound on each wait for the other ranks (its timeout=)

    @property
    def marker(self) -> str:
        return f"{self.tag}/{marker_name(self.first['token'], self.first['generation'])}"


def marker_name(token: str, generation: int) -> str:
    """The name of the marker of the save ``token`` claiming ``generation`` (:data:`MARKER_NAME`)."""
    return f"{MARKER_PREFIX}{token}.gen{generation}"


def url_storage(url: str, shared: bool, options: dict[str, Any], what: str) -> Storage:
    """The storage of a save's URL; ``ImportError`` naming the extra when fsspec or the scheme's package is
    missing. ``shared=False`` is refused: it is for folders the ranks do not share, and a URL names one
    store every rank reaches (a per-rank prefix would only scatter one checkpoint over several)."""
    if not shared:
        raise ValueError(
            f"{what}(shared=False) is for folders the ranks do not share (node-local disks, Ray Train's per-worker "
            f"folders); {redact_url(url)!r} is a URL, one store every rank reaches: save to it with shared=True (the default), "
            "or save shared=False into local folders and upload them"
        )
    return storage_for(url, **options)


def access_refused(e: BaseException, verb: str) -> str | None:
    """What to say of the storage refusing access (a wrong key or secret: s3fs's bare ``PermissionError('Forbidden')``,
    which has no filename, unlike a local file's): the cause and ``verb``'s ``storage_options`` to check; ``None``
    for any other error."""
    if not isinstance(e, PermissionError) or e.filename is not None:
        return None
    return (
        f"the storage refused access ({e}): check {verb}(storage_options=...) (key, secret, endpoint_url) or fsspec's "
        "configuration"
    )


def store_error(
    e: BaseException, rank: int, url: str, doing: str = "write", verb: str | None = None
) -> CheckpointError:
    """A storage failure (an ``OSError``, or a client library's own error: botocore's connection errors are
    not ``OSError``) as a :class:`CheckpointIOError` naming the rank, the object and the cause; a refused access
    also names ``verb``'s ``storage_options`` (:func:`access_refused`)."""
    if isinstance(e, CheckpointError):
        return e
    refused = access_refused(e, verb) if verb is not None else None
    err = CheckpointIOError(f"rank {rank} could not {doing} {url}: {refused or f'{type(e).__name__}: {e}'}")
    err.errno = getattr(e, "errno", None)
    return err


def _verb(what: str) -> str:
    """The public verb of the ``what`` the bucket's steps are called with, as a refused access names it."""
    return "AsyncSaver.save" if what == "async save" else what


def next_generation(store: Storage, tag: str) -> int:
    """The generation of a new save of ``tag`` (module docstring, step 1): above the manifest's, every rank or
    buffer file's and every marker's (a save in flight whose files are not uploaded yet). A store that cannot be
    asked raises: guessing 0 could overwrite the files of the complete checkpoint there."""
    gens = [-1]
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):  # none, or unreadable: the
        gens.append(int(json.loads(store.read_bytes(f"{tag}/{MANIFEST_NAME}"))["generation"]))  # names count
    for name in store.listdir(tag):
        m = RANK_FILE.match(name) or BUFFER_FILE.match(name)
        if m:
            gens.append(int(m.groups()[-1] or 0))
        elif (claimed := _marker_generation(name)) is not None:
            gens.append(claimed)
    return max(gens) + 1


def _marker_generation(name: str) -> int | None:
    """The generation a marker named ``name`` claims; ``None`` for any other name."""
    m = MARKER_NAME.fullmatch(name)
    return None if m is None else int(m.group(2))


def _claim_generation(store: Storage, tag: str, token: str, published: list[str]) -> int:
    """Step 1 (rank 0): pick the generation and publish the marker claiming it; ``published`` holds the marker
    while it is there (the caller removes it on a failure). An object store has no lock: two saves (two processes)
    may both pick N, each having listed before the other's marker was there. Each lists again after publishing, so
    the later of the two publishes is followed by a listing that shows both markers: a save that sees another
    marker of its generation withdraws its own and picks again (above it), after a random pause (two that withdrew
    together pick apart). So no two saves upload the same generation's files."""
    mine = f"{MARKER_PREFIX}{token}."
    for _ in range(CLAIM_TRIES):
        generation = next_generation(store, tag)
        marker = f"{tag}/{marker_name(token, generation)}"
        store.publish_bytes(marker, token.encode())
        published.append(marker)
        rivals = [n for n in store.listdir(tag) if _marker_generation(n) == generation and not n.startswith(mine)]
        if not rivals:
            return generation
        store.remove(marker)
        published.remove(marker)
        time.sleep(random.uniform(0.0, CLAIM_PAUSE_S))  # a random pause: two saves that withdrew together part
    raise CheckpointError(
        f"save: tag {tag!r} at {store.describe(tag)}: other saves of the tag claimed the same generation at once "
        f"{CLAIM_TRIES} times in a row ({', '.join(rivals[:2])}): one save of a tag at a time. Nothing was written"
    )


def prepare_bucket(
    state: EmaState,
    layout: ShardLayout,
    job: tuple[Any, int, int],
    store: Storage,
    raw_tag: Any,
    decay: DecayLike | Any,
    buffers: BufferState | None,
    extra: dict[str, Any] | None,
    timeout: float,
    what: str,
    before: Callable[[], None] | None = None,
) -> BucketSave:
    """Steps 1-2 (module docstring). Collective; ``before()`` runs first on every rank inside the plan's
    agreement. On a failure every rank raises and the marker is removed."""
    group, world, rank = job
    verb = _verb(what)
    writes_buffers = buffers is not None and layout.replica == 0  # replicas' buffers: replica 0's are saved
    if _tag_ok(raw_tag):  # a bad tag is refused below, on every rank together
        mine_files = save_files(layout, 0, writes_buffers, layout.writes_pieces)
        check_distinct_writers(what, store.describe(check_tag(raw_tag)), mine_files, world, timeout)
    published: list[str] = []

    def plan() -> dict[str, Any]:
        if before is not None:
            before()
        tag = check_tag(raw_tag)  # inside the agreement: a bad tag raises on every rank
        p = dict(plan_save(state, decay, layout, tag, buffers, extra), shared="url")
        if rank == 0:
            p["token"] = f"{secrets.randbits(62):016x}"
            try:
                p["generation"] = _claim_generation(store, tag, p["token"], published)
            except Exception as e:  # noqa: BLE001 - the store's own errors are not OSError
                raise store_error(e, rank, store.describe(tag), "write the tag", verb) from None
        return p

    def give_up() -> None:
        for marker in published:
            _quietly(functools.partial(store.remove, marker))

    mine, first = agree_plans(f"{what} (checking the state)", plan, group, world, rank, on_failure=give_up)
    tag = cast("str", mine["tag"])
    names = save_files(layout, first["generation"], writes_buffers, layout.writes_pieces)
    prep = BucketSave(job, store, tag, store.describe(tag), mine, first, layout, names, verb, timeout)
    try:
        seen = agree(f"{what} (every rank reaches the store)", lambda: _see_marker(prep), group, world, rank)
        _check_markers(seen)
    except BaseException:
        give_up()
        raise
    return prep


def _tag_ok(tag: Any) -> bool:
    try:
        check_tag(tag)
    except (CheckpointError, TypeError):
        return False
    return True


def _see_marker(prep: BucketSave) -> tuple[str, str | None]:
    """Where this rank reads rank 0's marker (module docstring, step 2), and what it found there if not this
    save's token (``None``: the token). Every rank's answer is exchanged: the ranks' URLs are not compared (nodes
    may reach one store by other endpoints), so where each looked is what names a disagreement."""
    rank, where = prep.job[2], prep.store.describe(prep.marker)
    if rank == 0:
        return where, None
    deadline = time.monotonic() + MARKER_WAIT_S
    while True:
        try:
            got = prep.store.read_bytes(prep.marker)
        except FileNotFoundError:
            got = None
        except Exception as e:  # noqa: BLE001
            raise store_error(e, rank, where, "read", prep.verb) from None
        if got is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if got != prep.first["token"].encode():
        return where, "missing" if got is None else "other bytes"
    return where, None


def _check_markers(seen: Sequence[tuple[str, str | None]]) -> None:
    """Refuse, on every rank alike (``seen``: every rank's :func:`_see_marker`), a save where a rank did not find
    rank 0's marker, naming where rank 0 wrote it and where the first such ranks looked."""
    missed = [(r, where, how) for r, (where, how) in enumerate(seen) if how is not None]
    if not missed:
        return
    looked = "; ".join(f"rank {r} does not see it at {where} ({how})" for r, where, how in missed[:4])
    more = f" (and {len(missed) - 4} more ranks)" if len(missed) > 4 else ""
    raise CheckpointError(
        f"save: rank 0 wrote its marker at {seen[0][0]}; {looked}{more}: the ranks do not reach the same store "
        "(another endpoint, bucket, prefix or credentials: check storage_options and the FSSPEC_*/AWS_* variables on "
        "every rank). A checkpoint saved so could not be loaded. Nothing was committed"
    )


def write_bucket(
    prep: BucketSave, emas: Sequence[Mapping[str, torch.Tensor]], buffers: BufferState | None
) -> dict[str, Any]:
    """This rank's files (step 3), streamed into the store, and their record. Not collective (an async save
    runs it in its background thread)."""
    rank, store, mine, layout = prep.job[2], prep.store, prep.mine, prep.layout
    generation = prep.first["generation"]
    records: dict[str, Any] = {"part": part_record(layout, mine)}
    rel = prep.tag
    try:
        dtype = parse_dtype(mine["dtype"], "save")
        if prep.names and prep.names[0].startswith("ema_"):  # the pieces' file (buffer files start "buffers_")
            rel = f"{prep.tag}/{prep.names[0]}"
            meta = rank_file_meta(mine, layout, generation)
            pieces = cast("list[dict[str, torch.Tensor]]", emas)  # write_rank_file only indexes ``ema[name]``
            records["file"] = write_rank_file(Path(prep.names[0]), layout, pieces, dtype, meta, sink=store.writer(rel))
        if buffers is not None and prep.names and prep.names[-1].startswith("buffers_"):
            rel = f"{prep.tag}/{prep.names[-1]}"
            meta = buffer_file_meta(mine, layout, generation)
            sink = store.writer(rel)
            records["buffers"] = write_buffer_file(
                Path(prep.names[-1]), layout.rank, buffers, mine["buffers"], meta, sink
            )
    except (ValueError, TypeError):
        raise
    except Exception as e:  # noqa: BLE001 - the store's own errors are not OSError
        raise store_error(e, rank, store.describe(rel), verb=prep.verb) from None
    return records


def commit_bucket(prep: BucketSave, record: dict[str, Any], what: str, timeout: float | None = None) -> None:
    """Step 4: every rank's records to rank 0, which publishes the manifest, then ``ema_latest``; once every rank
    agreed that it did, rank 0 cleans up (best effort, after the last agreement: removing an older generation's
    objects one by one keeps no other rank waiting in the commit). Collective. On a failure every rank raises and
    removes its unlisted objects. Every wait for the other ranks is bounded by ``timeout`` (default: the save's,
    ``prep.timeout``; :func:`collective.commit_step`): a rank that hangs or dies mid-commit fails the others with
    :class:`CheckpointTimeoutError` naming the step and what is left; a rank whose wait for rank 0's publishing ran
    out keeps its objects (rank 0 may still publish a manifest listing them; if not, the tag's next commit removes
    them)."""
    group, world, rank = prep.job
    limit = prep.timeout if timeout is None else timeout
    ref = CommitRef(what, prep.tag, prep.tag_dir, str(prep.first["token"]), limit)
    published: list[dict[str, Any]] = []  # rank 0's manifest, once it is the tag's
    gather = lambda: gather_to_first(record, group, world)  # noqa: E731
    step = "collecting the file records"
    try:
        written = commit_exchange(ref, step, gather, prep.job, _not_published)
        step = "publishing the manifest"
        publish = lambda: _publish(prep, written, published)  # noqa: E731
        commit_step(ref, step, publish, prep.job, lambda: _publishing(rank, bool(published)))
    except BaseException as e:
        if not (isinstance(e, CheckpointTimeoutError) and step == "publishing the manifest" and rank != 0):
            # rank 0 publishing had every rank's records: every upload ended, no late one needs the marker
            abandon_bucket(prep, uploads_ended=rank == 0 and step == "publishing the manifest")
        raise
    if published:  # rank 0, the save committed and agreed: however long the removals take, no rank waits for them
        _cleanup(prep, listed_files(published[0]))


def _publish(prep: BucketSave, written: list[dict[str, Any]] | None, published: list[dict[str, Any]]) -> None:
    """Rank 0 (``written``: every rank's records; None on the others): the manifest, published once no later save
    of the tag committed (then noted in ``published``: the tag holds this save), then ``ema_latest``."""
    if written is None:  # not rank 0
        return
    manifest = build_manifest(prep.first, written, save_id=prep.first["token"])
    store, rel = prep.store, f"{prep.tag}/{MANIFEST_NAME}"
    try:
        _check_still_newest(prep, manifest)
        store.publish_bytes(rel, json.dumps(manifest, indent=1).encode())
        published.append(manifest)
        rel = LATEST_NAME
        # Unlocked (a store has no lock): a process commits its URL saves from the training thread, one at a time
        later = later_save_named(store.read_bytes, manifest)
        if later is None:
            store.publish_bytes(rel, (prep.tag + "\n").encode())
        else:
            logger.info("functional_ema: %s keeps naming %r, a save started after this one", store.describe(rel), later)
    except Exception as e:  # noqa: BLE001
        raise store_error(e, prep.job[2], store.describe(rel), verb=prep.verb) from None


def _not_published() -> str:
    """What a URL save's commit that stopped before rank 0 published its manifest leaves."""
    return (
        "Nothing of this save is committed: rank 0 publishes the manifest only once every rank's records came; the "
        "tag keeps its previous checkpoint, loadable; this rank removed its new objects. Save again once every rank "
        "is back."
    )


def _publishing(rank: int, published: bool) -> str:
    """What a URL save's commit that stopped while rank 0 published its manifest leaves, as ``rank`` knows it."""
    if rank == 0:
        if published:
            return (
                "This save is committed nevertheless: this rank (rank 0) published its manifest, so the tag holds "
                "this save, complete and loadable; a rank that did not learn it may raise a timeout too, not knowing "
                "which checkpoint the tag holds. The older generations' objects stay until the tag's next commit."
            )
        return "Nothing of this save is committed: the tag keeps its previous checkpoint, loadable."
    return (
        "Rank 0 was publishing this save's manifest: the tag holds either its previous checkpoint or this save, each "
        "complete and loadable (the manifest is one object, written whole). This rank kept its new objects: a "
        "manifest rank 0 may still publish lists them (the tag's next commit removes them otherwise)."
    )


def _check_still_newest(prep: BucketSave, manifest: dict[str, Any]) -> None:
    """Before publishing (rank 0): no later save of the tag committed meanwhile, and every file the manifest
    lists is in the store. Object stores have no lock: another save of the tag (a blocking ``save`` while an
    ``AsyncSaver`` save of it awaits its commit, another job) may have committed a newer generation and removed
    this one's files as an older generation's; publishing would then replace a complete checkpoint by one
    whose files are gone."""
    store, tag, generation = prep.store, prep.tag, prep.first["generation"]
    there, their_id = -1, None
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):  # none, or
        committed = json.loads(store.read_bytes(f"{tag}/{MANIFEST_NAME}"))  # unreadable: no newer
        there, their_id = int(committed["generation"]), committed.get("save_id")
    if there == generation and their_id != prep.first["token"]:
        # Another save claimed this generation too (step 1 should make that impossible: a store whose listings
        # lag, or a save by an older version without markers): its manifest lists files of this one's names.
        raise CheckpointError(
            f"{prep.verb}: tag {tag!r} at {prep.tag_dir} was committed by another save of the same generation "
            f"({generation}, save_id {their_id!r}) while this one (step {prep.first['step']}) was being written: "
            "this save is dropped. One save of a tag at a time: AsyncSaver.wait() before saving the tag again"
        )
    if there > generation:
        raise CheckpointError(
            f"{prep.verb}: tag {tag!r} at {prep.tag_dir} was committed by a later save (generation {there}) while "
            f"this one (generation {generation}, step {prep.first['step']}) was being written: this save is dropped "
            "and the tag keeps the later one. One save of a tag at a time: wait for an AsyncSaver's save of it "
            "(AsyncSaver.wait()) before saving the tag again"
        )
    missing = sorted(listed_files(manifest) - set(store.listdir(tag)))
    if missing:
        raise CheckpointError(
            f"{prep.verb}: {len(missing)} file(s) of this save are gone from {prep.tag_dir} before its commit "
            f"({', '.join(missing[:4])}): removed by another save of the tag? Nothing was committed; the tag keeps "
            "what it held. One save of a tag at a time: AsyncSaver.wait() before saving the tag again"
        )


def abandon_bucket(prep: BucketSave, uploads_ended: bool = False) -> None:
    """A failed save: remove this rank's new objects unless the manifest lists them, and (rank 0) the marker where
    ``uploads_ended`` (every rank's upload is known to have ended). Otherwise the marker stays, claiming the
    generation: another rank may still be uploading a file of it, and a next save of the tag that took the same
    generation would have that file replaced by the late upload (same name) after its commit. The tag's next commit
    removes the marker (:func:`_cleanup`). Best effort; nothing is removed when the manifest cannot be read (module
    docstring)."""
    store = prep.store
    try:
        m = json.loads(store.read_bytes(f"{prep.tag}/{MANIFEST_NAME}"))
        listed = {
            e.get("file") for p in (m.get("parts") or [m]) for e in p.get("files", []) + (p.get("buffer_files") or [])
        }
    except FileNotFoundError:
        listed = set()
    except Exception:  # noqa: BLE001 - unreachable or unreadable: the files might be listed, keep them
        return
    for name in prep.names:
        if name not in listed:
            _quietly(functools.partial(store.remove, f"{prep.tag}/{name}"))
    if prep.job[2] == 0 and uploads_ended:
        _quietly(lambda: store.remove(prep.marker))


def _cleanup(prep: BucketSave, keep: set[str]) -> None:
    """After the commit (rank 0): the marker, older generations' files and markers of older (failed or
    superseded) saves. Never a file or marker of a newer generation than this save's: another save of the tag
    may be writing it (no lock here), and its marker is what keeps a third save off its generation."""
    generation = prep.first["generation"]

    def older(m: re.Match | None) -> bool:
        return m is not None and int(m.groups()[-1] or 0) < generation

    def stale_marker(name: str) -> bool:  # only names this library gives its markers: others are not ours
        claimed = _marker_generation(name)
        return claimed <= generation if claimed is not None else _OLD_MARKER_NAME.fullmatch(name) is not None

    def run() -> None:
        for name in prep.store.listdir(prep.tag):
            stale_file = older(RANK_FILE.match(name) or BUFFER_FILE.match(name)) and name not in keep
            if stale_file or stale_marker(name):
                _quietly(functools.partial(prep.store.remove, f"{prep.tag}/{name}"))

    _quietly(run)


def _quietly(fn: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # best effort: a failure path, or cleanup after the commit
        fn()
