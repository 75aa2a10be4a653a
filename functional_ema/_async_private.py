"""``AsyncSaver.save(..., shared=False)``: a private-folder save written in the background; and, the same
way, ``AsyncSaver.save`` to a URL (an object store: no folder to commit through, ``_checkpoint/bucket.py``).

A private save (``_checkpoint/private.py``, folders the ranks do not share) commits over the process
group: every rank's file records go to every rank, then each folder's committer writes the same
manifest. A shared-folder async save commits through marker files in the one folder; private folders
share nothing, and collectives cannot run in the background thread (``_async``'s module docstring). So
the save is split in three:

* **At the call** (training thread, collective): the plan, which ranks share a folder, the folders'
  locks and generation (as the blocking private save), and the snapshot of this rank's EMA.
* **In the background** (no collectives): this rank's files, written as the blocking save writes them.
* **At the saver's next collective call** (training thread): the next ``save`` (of either kind),
  ``AsyncSaver.wait``/``close``, or this save's ``SaveHandle.wait``, every rank: meet the other ranks (a
  bounded wait: a rank whose peers do not come fails the save rather than block in a collective), wait for
  the background write (at most ``commit_timeout``), agree that every rank's write succeeded, exchange the
  records, write the manifests, release the locks. A failure anywhere fails the save on every rank and
  removes its new files.

Not at interpreter exit: the ranks exit at different times (a crashed one never comes), so a save still
awaiting its commit then is left uncommitted, with a warning (``_async._warn_uncommitted``).

Until the commit, the folders hold the new files but not their manifest: each folder's previous
checkpoint stays the complete, loadable one, as after a crash mid-save.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ._checkpoint import collective
from ._checkpoint.bucket import abandon_bucket, commit_bucket, prepare_bucket, write_bucket
from ._checkpoint.errors import CheckpointError, CheckpointMismatchError, CheckpointTimeoutError
from ._checkpoint.format import parse_dtype
from ._checkpoint.private import abandon_private, commit_private, prepare_private, write_private
from ._layout import ShardLayout
from ._state import BufferState, EmaState
from ._storage import Storage

__all__ = [
    "BUCKET",
    "PRIVATE",
    "Ops",
    "PendingCommit",
    "abandon_after_write",
    "abandon_when_written",
    "commit",
    "save_now",
    "start",
    "written",
]

logger = logging.getLogger("functional_ema")

#: An EMA snapshot: its tensors (views of one host buffer), the buffer, and the end of its device copies.
Snapshot = tuple[list[Mapping[str, torch.Tensor]], torch.Tensor, "torch.cuda.Event | None"]


class Handle(Protocol):
    """What this module needs of ``_async.SaveHandle`` (``_async`` imports this module, not the reverse)."""

    _buffer: torch.Tensor | None
    step: int

    def done(self) -> bool: ...

    def _finish(self, error: BaseException | None) -> None: ...


class Saver(Protocol):
    """What this module needs of ``_async.AsyncSaver``."""

    commit_timeout: float
    _free: list[torch.Tensor]

    def _settle(self, tag_dir: Path | None) -> None: ...

    def _snapshot(self, state: EmaState, dtype: torch.dtype) -> Snapshot: ...

    def _writer_threads(self) -> concurrent.futures.ThreadPoolExecutor: ...


@dataclass(frozen=True)
class Ops:
    """One kind of save that commits over the process group: how it is prepared (collective), written
    (not collective: the background thread), committed and abandoned. ``PRIVATE``: folders the ranks do
    not share (``_checkpoint/private.py``); ``BUCKET``: an object store at a URL (``_checkpoint/bucket.py``)."""

    prepare: Callable[..., Any]
    write: Callable[[Any, Sequence[Mapping[str, torch.Tensor]], BufferState | None], dict[str, Any]]
    commit: Callable[[Any, dict[str, Any], float, str], None]  # (prep, the records, timeout, what)
    abandon: Callable[[Any, bool], None]  # (prep, whether every rank's write is known to have ended)


# The module's functions are looked up at each call (tests replace them, e.g. a background write that fails).
PRIVATE = Ops(
    lambda *args: prepare_private(*args),  # noqa: PLW0108
    lambda prep, emas, buffers: write_private(prep, emas, buffers),  # noqa: PLW0108
    lambda prep, record, timeout, what: commit_private(prep, record, timeout, what),  # noqa: PLW0108
    lambda prep, ended: abandon_private(prep),
)
BUCKET = Ops(
    lambda *args: prepare_bucket(*args),  # noqa: PLW0108
    lambda prep, emas, buffers: write_bucket(prep, emas, buffers),  # noqa: PLW0108
    lambda prep, record, timeout, what: commit_bucket(prep, record, what),
    lambda prep, ended: abandon_bucket(prep, ended),  # noqa: PLW0108 - ended: rank 0 may remove its marker
)


def save_now(
    ops: Ops,
    state: EmaState,
    layout: ShardLayout,
    job: tuple[Any, int, int],
    location: Path | Storage,
    raw_tag: Any,
    decay: Any,
    buffers: BufferState | None,
    extra: dict[str, Any] | None,
    timeout: float,
    what: str = "save",
) -> Any:
    """The blocking save of one of these kinds (a private folder, a bucket): prepared, every rank's files
    written, committed; returns the tag's folder (or URL). On a failure every rank raises and this rank's
    new files are removed. ``job`` is (group, world, rank); ``what`` is the public verb errors name. Collective."""
    prep = ops.prepare(state, layout, job, location, raw_tag, decay, buffers, extra, timeout, what)
    group, world, rank = job
    written: list[dict[str, Any]] = []
    try:
        write = lambda: written.append(ops.write(prep, state.emas, buffers))  # noqa: E731
        collective.agree(f"{what} (writing the rank files)", write, group, world, rank, results=False)
    except BaseException as e:
        # Agreed (a CheckpointError, not the wait's timeout) once every rank's write ended: none writes late
        ops.abandon(prep, isinstance(e, CheckpointError) and not isinstance(e, CheckpointTimeoutError))
        raise
    ops.commit(prep, written[0], timeout, what)
    return prep.tag_dir


@dataclass(frozen=True)
class PendingCommit:
    """A private async save whose files are being written, to be committed at the next collective call."""

    prep: Any  # a PrivateSave or a BucketSave (``ops``): its job, tag_dir, names, plans
    handle: Handle
    write: concurrent.futures.Future[dict[str, Any]]  # the background write: this rank's record
    commit_timeout: float  # how long the commit waits for the background write
    timeout: float  # the collectives' bound (the save's ``timeout``)
    ops: Ops = PRIVATE


def start(
    saver: Saver,
    make_handle: Callable[[Path, int], Handle],
    state: EmaState,
    layout: ShardLayout,
    job: tuple[Any, int, int],
    save_dir: Path | Storage,
    raw_tag: Any,
    decay: Any,
    buffers: BufferState | None,
    extra: dict[str, Any] | None,
    timeout: float,
    ops: Ops = PRIVATE,
) -> PendingCommit:
    """The call's part (module docstring). Collective; on a failure every rank raises and nothing is left.
    ``make_handle(tag_dir, step)`` makes the caller's handle of the save; ``save_dir``: a folder
    (``PRIVATE``) or the URL's storage (``BUCKET``)."""
    group, world, rank = job
    before = lambda: saver._settle(None)  # noqa: E731 - raises a previous failure, inside the agreement
    prep = ops.prepare(state, layout, job, save_dir, raw_tag, decay, buffers, extra, timeout, "async save", before)
    for held in getattr(prep, "lock", ()):  # a private save's folder lock (a bucket has none): held past this call
        held.hold_for_commit()
    snapshot: list[Snapshot] = []
    copied: list[BufferState] = []

    def take() -> None:
        # A folder that other ranks write too (its committer holds the lock until its own write ends, not theirs):
        # the generation recorded as taken, as a shared-folder save's. A rank whose write does not finish before the
        # commit gives up goes on writing, and the next save must not take its file's name.
        for held in getattr(prep, "lock", ()) if len(getattr(prep, "sharers", ())) > 1 else ():
            held.take_generation(prep.first["generation"])
        if prep.names and prep.names[0].startswith("ema_"):  # this rank writes its folder's copy of the pieces
            snapshot.append(saver._snapshot(state, parse_dtype(prep.mine["dtype"], "save")))
        if buffers is not None and prep.names and prep.names[-1].startswith("buffers_"):
            copied.append(_host_copy(buffers))

    try:
        collective.agree("async save (the snapshot)", take, group, world, rank, results=False)
    except BaseException:
        if snapshot:
            saver._free.append(snapshot[0][1])
        for held in getattr(prep, "lock", ()):
            held.untake_generation()  # refused at the call: nothing written
        ops.abandon(prep, True)
        raise
    emas, buffer, ready = snapshot[0] if snapshot else ([], None, None)
    handle = make_handle(prep.tag_dir, prep.first["step"])
    handle._buffer = buffer
    write = saver._writer_threads().submit(_write, ops, prep, emas, ready, copied[0] if copied else None)
    return PendingCommit(prep, handle, write, saver.commit_timeout, timeout, ops)


def _host_copy(buffers: BufferState) -> BufferState:
    """The buffers on the host, copied: small whole tensors the training may change right after the call."""
    with torch.no_grad():
        return type(buffers)(
            buffers.step.clone(),
            tuple({n: t.detach().to("cpu", copy=True) for n, t in e.items()} for e in buffers.emas),
            {n: t.detach().to("cpu", copy=True) for n, t in buffers.copied.items()},
        )


def _write(
    ops: Ops,
    prep: Any,
    emas: list[Mapping[str, torch.Tensor]],
    ready: torch.cuda.Event | None,
    buffers: BufferState | None,
) -> dict[str, Any]:
    """The background part: this rank's files and their record. No collectives."""
    if ready is not None:
        ready.synchronize()  # the snapshot's device-to-host copies
    return ops.write(prep, emas, buffers)


def written(pending: PendingCommit, timeout: float | None) -> bool:
    """Whether to :func:`commit` ``pending`` now. Collective, and every exchange is bounded (a peer that never comes
    to the commit, e.g. one still training while this rank leaves a ``with`` block on an exception, must not hold
    this rank in an all-reduce until the process group's own timeout): first the ranks meet (at most
    :func:`arrival_limit`, never the caller's ``timeout``: an exchange that times out closes the group's
    connections, so a short ``wait(timeout)`` on ranks that come a little apart must not end it); then each waits for
    its own background write, at most what is left of ``timeout`` (``None``: ``commit_timeout``, past which the
    commit fails the save); then they agree, so that all of them commit or none: ``False`` when a write was not done
    on some rank as its ``timeout`` passed (the save goes on, still pending). Meeting first: a rank whose write ends
    late is not taken for one that never came.

    Raises:
        CheckpointTimeoutError: a peer did not come within the bound (the caller fails the save and the later ones).
    """
    t0 = time.monotonic()
    limit = arrival_limit(pending)
    _exchange(pending, "arrival", 0, limit)
    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
    bound = pending.commit_timeout if left is None else min(left, pending.commit_timeout)
    concurrent.futures.wait([pending.write], timeout=bound)
    late = int(not pending.write.done() and bound < pending.commit_timeout)
    # The ranks met just now: each one's wait for its write ends within `most` seconds of that.
    most = pending.commit_timeout if timeout is None else min(timeout, pending.commit_timeout)
    return not _exchange(pending, "the background writes", late, most + limit)


def arrival_limit(pending: PendingCommit) -> float:
    """How long a rank waits for the others to come to the commit: the smaller of the saver's ``commit_timeout``
    and the save's ``timeout`` (``timeout=``, else ``FUNCTIONAL_EMA_TIMEOUT``, else 600 s)."""
    return min(pending.commit_timeout, pending.timeout)


def _exchange(pending: PendingCommit, stage: str, word: int, bound: float) -> int:
    """The maximum of ``word`` over the save's ranks, each waiting at most ``bound`` seconds on its own clock
    (``collective.bounded_max``, in :func:`~functional_ema._checkpoint.collective.agree_on`'s message format: a
    rank in another functional_ema verb learns that the verbs differ, as this one does)."""
    prep = pending.prep
    group, world, _ = prep.job
    if world <= 1 or not dist.is_initialized():
        return word
    what = f"AsyncSaver commit ({stage})"
    verb = collective.value_digest(what)
    mine = torch.zeros(collective.AGREE_WORDS, dtype=torch.int64)
    mine[:4] = torch.tensor([verb, -verb, 0, word], dtype=torch.int64)
    side = collective.barrier_group(group, pending.timeout)
    bound = round(bound, 3)  # as messages show it: a wait(timeout=1) that reached here after 3 us shows 1 s
    t0 = time.monotonic()
    try:
        got = collective.bounded_max(side, bound, mine, (collective.AGREE_TAG, collective.AGREE_RELEASE_TAG)).tolist()
    except RuntimeError as e:  # gloo reports a timeout, or a vanished peer, as RuntimeError (DistError)
        raise _timed_out(pending, stage, bound, time.monotonic() - t0, e) from None
    if got[0] != -got[1]:  # as agree_on: every rank names the call each rank made
        called = collective.exchange((what, ""), side, world)
        shown = ", ".join(f"rank {r}: {v}" for r, (v, _) in enumerate(called))
        raise CheckpointMismatchError(
            f"{what} of tag {prep.first['tag']!r}: the ranks called different collective verbs ({shown}); call "
            "saver.wait() (or the next saver.save) on every rank at the same point"
        )
    return int(got[3])


def _timed_out(pending: PendingCommit, stage: str, bound: float, waited: float, e: Exception) -> CheckpointTimeoutError:
    """The error of a commit whose peers did not come: names the tag, the missing rank(s) (as this rank knows them:
    rank 0 knows which, the others only that rank 0 did not release them), the limit and what sets it."""
    prep = pending.prep
    _, world, rank = prep.job
    detail = collective.error_detail(e)
    return CheckpointTimeoutError(
        f"AsyncSaver: the commit of the async save of tag {prep.first['tag']!r} (step {prep.first['step']}) into "
        f"{prep.tag_dir}: rank {rank} waited {waited:.1f} s (limit {bound:g} s) at the commit's {stage} for the other "
        f"ranks of its process group (world size {world}), and they did not come ({detail}). The commit of a "
        "shared=False or URL save is collective: call saver.wait() (or handle.wait(), or the next saver.save) on every "
        "rank, or leave the `with fe.AsyncSaver(...)` block on every rank. The wait for the others is the smaller of "
        f"the saver's commit_timeout ({pending.commit_timeout:g} s) and the save's timeout ({pending.timeout:g} s: "
        f"timeout=, else {collective.TIMEOUT_ENV}); after the ranks meet, add the time "
        "each may still spend on its own write. Nothing of this save is committed: each folder's previous "
        "checkpoint is intact. The process group may be unusable after this"
    )


def abandon_after_write(pending: PendingCommit) -> None:
    """Remove this rank's new files of a failed save and release its locks, once its background write has ended
    (at once if it has): removing them while the write goes on could leave a file behind, or free the tag for
    another save while this one still writes into it. Best effort: a failure is logged."""

    def abandon(_: object) -> None:
        try:
            pending.ops.abandon(pending.prep, False)  # another rank's write may go on
        except Exception as e:  # noqa: BLE001 - a cleanup; the save's failure is the handle's error
            logger.error("functional_ema: could not clean up the failed async save in %s: %s", pending.prep.tag_dir, e)

    pending.write.add_done_callback(abandon)


def abandon_when_written(pending: PendingCommit, bound: float) -> None:
    """:func:`abandon_after_write`, run before the save's failure is reported (its handle finished): an immediate
    save of the tag from this thread must find it free and its new files gone. Waits for the background write at
    most ``bound`` seconds. A write still going on then (stalled storage) keeps the tag until it ends; its lock then
    no longer says it awaits this thread's commit, so a save of the tag waits for it (at most that save's timeout)
    instead of being refused as waiting for itself."""
    concurrent.futures.wait([pending.write], timeout=bound)
    if not pending.write.done():  # nothing releases the lock before abandon_after_write below: no race with it
        for held in getattr(pending.prep, "lock", ()):  # a bucket has no lock
            held._note_holder(awaits_commit=False)  # the holder's note (hold_for_commit's inverse)
    abandon_after_write(pending)


def commit(pending: PendingCommit) -> None:
    """The commit (module docstring), once :func:`written` said so (the background writes had their time
    there). Collective. Never raises a failure of the save itself: that is the handle's error, raised by
    ``wait`` or the saver's next ``save`` on every rank."""
    prep = pending.prep
    group, world, rank = prep.job
    record: list[dict[str, Any]] = []

    def outcome() -> dict[str, Any]:
        try:
            record.append(pending.write.result(timeout=0))  # written() waited up to commit_timeout
        except concurrent.futures.TimeoutError:
            raise CheckpointError(
                f"async save of tag {prep.first['tag']!r} (rank {rank}): its background write into {prep.tag_dir} did "
                f"not finish within commit_timeout={pending.commit_timeout:g} s. Nothing of it is committed; each "
                "folder's previous checkpoint is intact"
            ) from None
        return {}  # agree_on's record: no fields, only whether every rank's write succeeded

    error: BaseException | None = None
    try:
        try:  # bounded: the ranks met in written() just now; one that vanished since must not hold the others
            collective.agree_on(
                "async save (the background writes)", outcome, (), group, world, rank, timeout=arrival_limit(pending)
            )
        except BaseException:
            abandon_when_written(pending, 0.0)  # written() gave the write its commit_timeout already
            raise
        pending.ops.commit(prep, record[0], pending.timeout, "async save")
    except Exception as e:  # noqa: BLE001 - the save's failure, handed to the caller through the handle
        error = e
    pending.handle._finish(error)
