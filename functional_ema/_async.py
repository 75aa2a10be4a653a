"""Asynchronous EMA checkpoint save: snapshot at the call, write in the background.

``AsyncSaver.save`` is :func:`functional_ema.checkpoint.save` split in two:

* **At the call** (the training thread, collective): wait for the previous save if the in-flight
  limit is reached (raising its error, if any, on every rank); check the state and agree the plan
  with the other ranks (one small all-reduce, as the blocking save); rank 0 takes the tag's write
  lock (held until its background commit is done); copy this
  rank's EMA into a reusable host buffer (pinned where the EMA lives on a GPU; the copy is queued
  on the current CUDA stream, so later work on that stream, such as ``update``, runs after it).
* **In a background thread** (no collectives, no process group at all): write this rank's file
  (temporary name, fsync, rename, folder fsync, as the blocking save), then commit through the
  shared filesystem: every writing rank other than 0 drops a small marker file with its file's
  record (``ema_async.<id>.rank<r>.done``); rank 0 polls for them, claims the outcome (links
  ``ema_async.<id>.rank00000.done`` into place, which fails if it exists), writes ``ema_manifest.json``
  (which completes the checkpoint, as before) and removes its markers (and those of earlier saves that failed on
  every rank, not another save's still in flight); the other ranks poll until the
  manifest carrying this save's id appears. A failure on any rank leaves an
  ``ema_async.<id>.rank<r>.error`` marker, so every rank's handle fails with it instead of waiting. A
  rank whose failure rank 0 may not wait for (one that writes no file, as a replicated model's ranks
  other than 0; one whose wait timed out after its done marker) first claims the outcome itself: if
  its claim comes first, rank 0 fails too; if rank 0's came first, it waits for the manifest and
  succeeds (the writers wrote everything). Every rank agrees whether the save is complete.

Why not a collective in the background: torch.distributed collectives on one process group must
be issued in the same order on every rank, and the training thread issues its own (gradients,
ZeRO); a second thread issuing collectives concurrently could interleave differently on different
ranks and deadlock or corrupt both. Files on the (already required) shared directory need no
ordering. The cost: a rank that dies silently is noticed by the others only after
``commit_timeout`` seconds (counted from the last change of the save's files: a write still going on is waited for).

Crash safety is the blocking save's: rank files are written under new names when the tag already
holds a complete EMA (and under a generation no earlier save took, where other ranks than 0 write files: rank 0
records it, so a failed save's rank still writing never meets the next save's files), and only the manifest (written last, atomically) makes a checkpoint
complete, so a process killed at any point of the background write leaves the previous checkpoint
loadable. Markers are never read by :func:`~functional_ema.checkpoint.load`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch

from . import _async_private, _io, _memory
from ._args import check_bool, check_int, check_location, check_real, check_storage_options
from ._checkpoint import bucket, collective, writer
from ._checkpoint import format as fmt
from ._checkpoint.errors import CheckpointError
from ._layout import ShardLayout
from ._shards import Shards
from ._state import BufferState, EmaState
from ._storage import Storage
from .engines import adapter_for
from .engines._base import read_for
from .schedules import DecayLike

__all__ = ["AsyncSaver", "SaveHandle"]

logger = logging.getLogger("functional_ema")

_MARK = "ema_async."


def _marker(token: str, rank: int, kind: str) -> str:
    return f"{_MARK}{token}.rank{rank:05d}.{kind}"


class SaveHandle:
    """One asynchronous save in flight: :meth:`wait` for it, :meth:`done` to poll it.

    Attributes:
        tag_dir: the tag folder being written, ``save_dir/tag`` (for a URL, the tag's URL, a ``str``).
        step: the EMA step that was snapshotted.
    """

    def __init__(self, tag_dir: Path | str, step: int) -> None:
        self.tag_dir, self.step = tag_dir, step
        self._pid = (
            os.getpid()
        )  # the process whose thread writes it (a forked child inherits the handle, not the thread)
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._raised = False  # the error reached the caller on this rank (wait or the next save)
        self._buffer: torch.Tensor | None = None  # the snapshot, reused by the next save once this one is done
        # A private or URL save's commit (collective), run by wait() with its timeout.
        self._commit: Callable[[float | None], None] | None = None

    def done(self) -> bool:
        """True once the checkpoint is complete (manifest written) or the save has failed (in a forked
        child, a save of the parent still in flight counts as failed here: see :meth:`wait`)."""
        self._adopt_after_fork()
        return self._event.is_set()

    def _adopt_after_fork(self) -> None:
        """In a child forked while this save was in flight, the writing thread is the parent's: nothing in
        the child will ever finish it. Fail it here (not in the parent, whose save goes on) with an error
        that says so, so ``wait()`` raises instead of blocking forever."""
        pid = os.getpid()
        if pid == self._pid:
            return
        parent, self._pid = self._pid, pid
        if not self._event.is_set():
            self._finish(
                CheckpointError(
                    f"this process (pid {pid}) was forked from pid {parent} while the async EMA save of step {self.step} into "
                    f"{self.tag_dir} was in flight. That save is written by the parent's thread and completes there (wait for it "
                    "in the parent); this process cannot wait for it or know its outcome. Save again from this process if it "
                    "needs its own checkpoint"
                )
            )

    def exception(self) -> BaseException | None:
        """The failure, once :meth:`done` (None on success)."""
        return self._error if self._event.is_set() else None

    def wait(self, timeout: float | None = None) -> Path | str:
        """Block until the save is complete; return ``tag_dir``.

        For a save with ``shared=False`` or to a URL this is collective (call it on every rank): it commits
        the save over the process group (and the saver's earlier ones), as :meth:`AsyncSaver.wait` does. With
        a ``timeout``, the ranks agree whether every rank's background write finished in time: if one did
        not, every rank raises ``TimeoutError`` and the save stays pending (committed by a later wait). The wait
        for the other ranks to come is bounded by the smaller of ``commit_timeout`` and the save's timeout, not by
        ``timeout`` (a timed-out exchange closes the group's connections): see ``CheckpointTimeoutError`` below.

        Raises:
            Exception: the background failure: on the rank where it happened, the original exception
                (e.g. ``OSError``); on the other ranks, :class:`~functional_ema.checkpoint.CheckpointError`
                naming the failed rank. Raised on every call to ``wait`` after a failure.
            TimeoutError: ``timeout`` seconds passed first (the save goes on).
            CheckpointTimeoutError: (a ``TimeoutError``) a ``shared=False`` or URL save whose other ranks did not
                come to the commit in time: the save failed (nothing committed), and the later ones awaiting
                their commit with it.
        """
        self._adopt_after_fork()
        if self._commit is not None and not self._event.is_set():
            self._commit(timeout)
        if not self._event.wait(timeout):
            raise TimeoutError(f"async EMA save into {self.tag_dir} still running after {timeout} s")
        if self._error is not None:
            self._raised = True
            raise self._error
        return self.tag_dir

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()


class AsyncSaver:
    """Save EMA checkpoints in the background; the call costs about one memory copy of this rank's EMA.

    Keep one saver per training run (it holds the reusable snapshot buffers and the saves in
    flight) and call :meth:`save` where you would call :func:`functional_ema.save`, on every rank.
    The file layout, atomicity and crash guarantees are the blocking save's; see the module
    docstring of :mod:`functional_ema._async` for how the ranks commit without collectives.

    Args:
        max_in_flight: saves allowed in the background at once (default 1). A :meth:`save` beyond
            it first waits for the oldest one (the training loop stalls until it is written).
            Each save in flight holds one host copy of this rank's EMA.
        commit_timeout: seconds a rank waits for the other ranks' files (or for rank 0's manifest)
            before failing the save; bounds the wait when another rank died silently. Counted from the last
            change seen in the save's files (looked at every quarter of it): a write still going on, such as a
            replicated model's rank 0 writing alone while the other ranks wait, is not given up on, and a rank
            that stops writing is noticed within 1.25 ``commit_timeout`` of its last write. For a ``shared=False``
            or URL save: how long the commit waits for this rank's write, and at most for the other ranks to
            come to the commit (with the save's ``timeout``, whichever is smaller).
        pin_memory: snapshot GPU-resident EMAs into pinned host memory (the default, faster
            device-to-host copies). CPU-resident EMAs always use ordinary memory.

    Example:
        >>> saver = fe.AsyncSaver()                                   # doctest: +SKIP
        >>> for step in range(1, n + 1):                              # doctest: +SKIP
        ...     train_step(engine)
        ...     state = fe.update(state, fe.local_shards(engine), step, decay=0.999)
        ...     if step % 1000 == 0:
        ...         saver.save(state, engine, "ckpt", decay=0.999)   # returns after the snapshot
        ...         engine.save_checkpoint("ckpt")                    # overlaps with the EMA write
        >>> saver.wait()                                              # doctest: +SKIP
    """

    def __init__(self, max_in_flight: int = 1, *, commit_timeout: float = 1800.0, pin_memory: bool = True) -> None:
        self.max_in_flight = check_int(max_in_flight, "max_in_flight", minimum=1)
        self.commit_timeout = check_real(commit_timeout, "commit_timeout", low=0.0, high=math.inf, low_open=True)
        self.pin_memory = check_bool(pin_memory, "pin_memory")
        self._handles: list[SaveHandle] = []  # in start order; finished ones are dropped at the next save
        self._free: list[torch.Tensor] = []  # snapshot buffers of finished saves, for reuse
        self._writers: tuple[int, ThreadPoolExecutor] | None = None  # (pid that started them, threads)
        self._pending: list[_async_private.PendingCommit] = []  # private saves written, not yet committed
        # Their commit is collective, so it cannot run at exit (the ranks exit at different times, a crashed one
        # never): what is still pending then is left uncommitted, and said so.
        weakref.finalize(self, _warn_uncommitted, self._pending)

    def _writer_threads(self) -> ThreadPoolExecutor:
        """The background writers, started once (again in a forked child, which inherits no threads):
        no thread start inside a save's call, and an executor's threads are joined at interpreter exit,
        so exit waits for a write rather than cutting it short."""
        if self._writers is None or self._writers[0] != os.getpid():
            self._writers = (os.getpid(), ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="fe_async_save"))
        return self._writers[1]

    # -- the call

    def save(
        self,
        state: EmaState,
        engine: Any,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        *,
        decay: DecayLike | Sequence[DecayLike] | None = None,
        buffers: BufferState | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        shared: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot this rank's EMA and write the checkpoint in the background. Collective.

        Arguments and the files written are those of :func:`functional_ema.save` (``buffers``,
        ``extra`` and ``shared`` included). Returns once the snapshot is taken: ``state`` (and
        ``buffers``) may be updated, even in place, right away. The checkpoint is complete when the
        returned handle's :meth:`SaveHandle.wait` returns (on every rank). A save of a tag that another
        save (of this saver, another saver, or another process) is writing first waits for it (``timeout``).
        Saves in flight commit in the order they were started, so ``ema_latest`` names the last one.

        ``shared=False`` (folders the ranks do not share, docs/many-nodes.md): the files are written in
        the background, and the save is committed over the process group at the saver's next collective
        call on every rank: the next :meth:`save`, :meth:`wait` (or ``close``, leaving a ``with`` block),
        or the handle's :meth:`SaveHandle.wait`. Until then each folder's previous checkpoint is the
        complete one; wait before handing the folders on (``ray.train.report``). Until then a blocking
        :func:`functional_ema.save` of the tag from this thread is refused at once (it would wait for itself).

        A URL ``save_dir`` (``s3://...``, ``storage_options`` as :func:`functional_ema.save`'s) is written in the
        background, streamed to the store, and committed over the process group as ``shared=False`` is (at
        the saver's next collective call): an object store has no folder to commit through.

        Raises:
            CheckpointError (or the original exception on the rank where it happened): on every
                rank, when the state does not fit the engine, the ranks disagree, a previous save of
                this saver failed and its ``wait()`` has not raised that on this rank, the process
                group is gone, or two ranks of the job would write the same file.
        """
        location = check_location(save_dir, "save_dir")  # the state is checked in the plan, on every rank together
        options = check_storage_options(storage_options, location, "AsyncSaver.save(storage_options=...)")
        collective.timeout_s(timeout)  # checked now: a bad timeout is refused before any wait
        shared = check_bool(shared, "shared")
        store = None if isinstance(location, Path) else bucket.url_storage(location, shared, options, "AsyncSaver.save")
        adapter = adapter_for(engine)
        reading = read_for(adapter, state)  # read once (the state's selection); the rest takes plain data
        layout = reading.layout
        group, rank, world = collective.job_of(reading)  # the ranks that save this model together
        collective.check_reachable("AsyncSaver.save", group, world)
        self._commit_private()  # earlier private saves first (collective); their failures raise in the plan
        raw_tag = adapter.default_tag(state) if tag is None else tag
        checked = collective.timeout_s(timeout)
        if not shared or store is not None:  # both commit over the process group (_async_private)
            target: Path | Storage = location if isinstance(location, Path) else cast("Storage", store)
            ranks = (group, world, rank)
            ops = _async_private.PRIVATE if store is None else _async_private.BUCKET
            return self._start_private(state, layout, ranks, target, raw_tag, decay, buffers, extra, checked, ops)
        tag_dir = cast("Path", location) / fmt.check_tag(raw_tag)
        request = writer.SaveRequest(state, layout, (group, world, rank), decay, buffers, extra, checked)
        files = writer.save_files(layout, 0, request.writes_buffers, layout.writes_pieces)
        collective.check_distinct_writers("AsyncSaver.save", tag_dir, files, world, timeout)
        return self._start_shared(request, tag_dir)

    def _start_private(
        self,
        state: EmaState,
        layout: Any,
        ranks: tuple[Any, int, int],
        target: Path | Storage,
        raw_tag: Any,
        decay: DecayLike | Sequence[DecayLike] | None,
        buffers: BufferState | None,
        extra: dict[str, Any] | None,
        timeout: float,
        ops: _async_private.Ops,
    ) -> SaveHandle:
        """Start a save committed over the process group (``shared=False``, or a URL): see :meth:`save`."""
        made: list[SaveHandle] = []

        def make(tag_dir: Path | str, step: int) -> SaveHandle:
            made.append(SaveHandle(tag_dir, step))
            return made[0]

        job = _async_private.start(
            self, make, state, layout, ranks, target, raw_tag, decay, buffers, extra, timeout, ops
        )
        self._pending.append(job)
        made[0]._commit = self._commit_private  # its wait(timeout) commits (collective)
        self._handles.append(made[0])
        return made[0]

    def _start_shared(self, request: writer.SaveRequest, tag_dir: Path) -> SaveHandle:
        """Start a save into a folder every rank shares: agree on the plan and the folder, snapshot, and hand
        the writing (and rank 0's commit) to a writer thread."""
        layout, buffers, (_, world, rank) = request.layout, request.buffers, request.ranks
        mine, first, snapshot, copied, lock = self._agree_shared(request, tag_dir)
        handle = SaveHandle(tag_dir, first["step"])
        emas, buffer, ready = snapshot[0] if snapshot else (None, None, None)
        handle._buffer = buffer
        all_write = _all_write(layout, buffers)
        job = _Job(
            save_dir=tag_dir.parent,
            tag_dir=tag_dir,
            layout=layout,
            rank=rank,
            first=first,
            mine=mine,
            token=first["token"],
            writers=list(range(world)) if all_write else [0],
            writes=layout.writes_pieces,
            emas=emas,
            ready=ready,
            buffers=copied[0] if copied else None,
            lock=lock[0] if lock else None,
            dtype=fmt.parse_dtype(first["dtype"], "save"),
            timeout=self.commit_timeout,
            after=self._last_shared(),
            world=world,
        )
        self._writer_threads().submit(_run, job, handle)
        self._handles.append(handle)
        return handle

    def _agree_shared(self, request: writer.SaveRequest, tag_dir: Path) -> tuple[dict, dict, list, list, list]:
        """Every rank's plan agreed (rank 0 holding the tag's lock), the EMA snapshot and the buffers' host copy
        taken, and the folder seen by every rank; on a failure, the lock and the snapshot buffer given back.
        Returns (this rank's plan, rank 0's plan, [snapshot], [buffers' copy], [lock]) (a cell each: empty
        where this rank takes none)."""
        state, layout, (group, world, rank), decay, buffers, extra, timeout = request
        writes, writes_buffers = layout.writes_pieces, request.writes_buffers
        snapshot: list[tuple[list[Mapping[str, torch.Tensor]], torch.Tensor, torch.cuda.Event | None]] = []
        copied: list[BufferState] = []
        lock: list[writer.TagLock] = []

        def plan() -> dict[str, Any]:
            self._settle(tag_dir)  # raises a previous failure; inside agree_plans, so on every rank
            p = dict(writer.plan_save(state, decay, layout, tag_dir.name, buffers, extra), shared=True)
            if rank == 0:  # the committing rank holds the tag until its background commit is done
                lock.append(writer.TagLock.acquire(tag_dir, collective.timeout_s(timeout), "AsyncSaver.save"))
                p["generation"] = _take_generation(lock[-1], layout, buffers, world)
            if writes:
                snapshot.append(self._snapshot(state, fmt.parse_dtype(p["dtype"], "save")))
            if writes_buffers and buffers is not None:  # small whole tensors: copied as they are
                copied.append(_async_private._host_copy(buffers))
            p["token"] = f"{secrets.randbits(62):016x}" if rank == 0 else None  # an int64 for agree_plans
            return p

        def give_up() -> None:
            for held in lock:
                held.untake_generation()  # refused at the call: nothing written
                held.release(remove_empty=True)

        def see_folder() -> None:  # made once the ranks agree on the tag: a disagreement leaves no folder
            tag_dir.mkdir(parents=True, exist_ok=True)
            if rank:
                writer.check_shared(tag_dir, rank, "AsyncSaver.save")

        try:
            mine, first = writer.agree_plans(
                "async save (checking the state)", plan, group, world, rank, on_failure=give_up
            )
            # Every rank must see the folder rank 0 holds, or the background commit could never complete.
            collective.agree("async save (the folder is shared)", see_folder, group, world, rank, results=False)
        except BaseException:
            if snapshot:  # nothing started: keep the buffer for the next call
                self._free.append(snapshot[0][1])
            give_up()
            raise
        return mine, first, snapshot, copied, lock

    def wait(self) -> None:
        """Wait for every save in flight; raise the first failure not yet raised on this rank.

        Collective while a ``shared=False`` save is in flight (it is committed here, on every rank).

        In a process forked while a save was in flight, that save is the parent's: it is reported here
        (once) as failed in this process, with an error that says so, instead of blocking forever."""
        self._commit_private()
        first_error = None
        for h in self._handles:
            h.done()  # a save of the parent, in a forked child, fails here
            h._event.wait()
            if h._error is not None and not h._raised and first_error is None:
                h._raised = True
                first_error = h._error
        self._reap()
        if first_error is not None:
            raise first_error

    close = wait

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.wait()
        else:  # already failing: finish the writes, report (not raise) their errors; every wait is bounded
            try:
                self.wait()
            except Exception as e:  # noqa: BLE001 - the block's own exception is the one raised
                logger.error("functional_ema: async EMA save failed: %s", e)
                if exc is not None and hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(
                        f"functional_ema: leaving the `with fe.AsyncSaver()` block, its saves failed: {type(e).__name__}: {e}"
                    )

    # -- internals

    def _reap(self) -> None:
        keep = []
        for h in self._handles:
            if h.done() and (h._error is None or h._raised):
                if h._buffer is not None:
                    self._free.append(h._buffer)
                    h._buffer = None
            else:
                keep.append(h)
        self._handles = keep

    def _commit_private(self, timeout: float | None = None) -> None:
        """Commit the private and URL saves written in the background, in start order (collective;
        ``_async_private``). A failed one fails its handle, raised by ``wait`` or the next ``save``'s plan on
        every rank. ``timeout``: a save whose background write is not done on every rank by then stays
        pending (with the later ones), and every rank raises ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            p = self._pending[0]
            if p.handle.done():  # done already: a forked child's copy of its parent's save (failed there)
                self._pending.pop(0)
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = _async_private.written(p, left)
            except BaseException as e:  # a peer never came (or an interrupt): this save and the later ones fail
                self._fail_pending(e)
                if not isinstance(e, Exception):
                    raise
                return
            if not ready:
                raise TimeoutError(f"async EMA save into {p.prep.tag_dir} still running after {timeout} s")
            self._pending.pop(0)
            _async_private.commit(p)

    def _fail_pending(self, error: BaseException) -> None:
        """Fail every save awaiting its commit: the first with ``error``, the later ones with an error naming it (their
        commits would meet the same missing ranks, each after its own wait; the process group may be unusable).
        Their new files are removed and their locks released (once their writes end) before their handles fail;
        nothing is committed."""
        pending = list(self._pending)
        self._pending.clear()  # the same list: the exit check (_warn_uncommitted) holds it
        # Each one's files are removed and its lock released before its handle fails, so that a save of the tag right
        # after the failing wait() finds it free: once its write has ended, waited for as the commit would have
        # (commit_timeout, all of them together); not after an interrupt, which the caller raises now.
        deadline = time.monotonic() + (
            max((p.commit_timeout for p in pending), default=0.0) if isinstance(error, Exception) else 0.0
        )
        if not isinstance(error, Exception):  # an interrupt: raised by the caller now, not again by every wait
            error = CheckpointError(f"the commit was interrupted ({type(error).__name__}); nothing of it is committed")
        for i, p in enumerate(pending):
            failure = error
            if i:
                failure = CheckpointError(
                    f"the async EMA save of step {p.handle.step} into {p.prep.tag_dir} was not committed: the commit of "
                    f"the save before it ({pending[0].prep.tag_dir}) failed: {type(error).__name__}: {error}"
                )
                failure.__cause__ = error
            _async_private.abandon_when_written(p, max(0.0, deadline - time.monotonic()))
            p.handle._finish(failure)

    def _last_shared(self) -> threading.Event | None:
        """The completion of this saver's latest shared-folder save still in flight: a new one commits after
        it, so saves commit (and ``ema_latest`` moves) in the order they were started, not the order their
        writes finish. (Private and URL saves are committed by the training thread, in start order.)"""
        busy = [h for h in self._handles if h._commit is None and not h._event.is_set()]
        return busy[-1]._event if busy else None

    def _settle(self, tag_dir: Path | str | None) -> None:
        """Before a new save: wait while the in-flight limit is reached or the same tag is being
        written, and raise any failure not yet raised on this rank."""
        while True:
            busy = [h for h in self._handles if not h.done()]  # done() fails a forked parent's save here
            if len(busy) < self.max_in_flight and not any(h.tag_dir == tag_dir for h in busy):
                break
            busy[0]._event.wait()
        for h in self._handles:
            if h.done() and h._error is not None and not h._raised:
                h._raised = True
                self._reap()
                raise CheckpointError(
                    f"the previous async EMA save (step {h.step}, {h.tag_dir}) failed: {type(h._error).__name__}: "
                    f"{h._error}. Nothing of it is marked complete, and nothing of the saves before it was changed by this "
                    "library (unless something else removed their folders, they load as before)"
                ) from h._error
        self._reap()

    def _snapshot(
        self, state: EmaState, dtype: torch.dtype
    ) -> tuple[list[Mapping[str, torch.Tensor]], torch.Tensor, torch.cuda.Event | None]:
        """Copy every EMA tensor into one host buffer; return the EMAs as views of it, the buffer
        and a CUDA event marking the end of the copies (None on CPU).

        The EMAs of ``init_ema(local_shards(x))`` are ``Shards``: their segments are copied as they
        are (one ``copy_`` per segment, the layout they already carry); other trees one tensor at a
        time."""
        # EmaState.emas is annotated as dicts, but holds a Shards each for ``init_ema(local_shards(x))``.
        trees: Sequence[Mapping[str, torch.Tensor]] = state.emas
        shards = [e for e in trees if isinstance(e, Shards)]
        as_shards = len(shards) == len(trees)
        if as_shards:
            sources = [seg.detach() for e in shards for seg in e.segments]
        else:
            sources = [t.detach() for e in trees for t in e.values()]
        total = sum(t.numel() for t in sources)
        on_gpu = any(t.device.type == "cuda" for t in sources)
        pinned = on_gpu and self.pin_memory
        buffer = next(
            (b for b in self._free if b.numel() == total and b.dtype == dtype and b.is_pinned() == pinned), None
        )
        if buffer is not None:
            self._free.remove(buffer)
        else:
            self._free.clear()  # another layout: the old buffers will not fit again
            buffer = _memory.empty(total, dtype=dtype, pin_memory=pinned)
        copies: list[torch.Tensor] = []
        pos = 0
        with torch.no_grad():
            for src in sources:
                n = src.numel()
                dst = buffer[pos : pos + n].view(src.shape)
                dst.copy_(src, non_blocking=pinned)
                copies.append(dst)
                pos += n
        ready: torch.cuda.Event | None = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()  # the copies are queued on the current stream; the writer waits for this
        it = iter(copies)
        emas: list[Mapping[str, torch.Tensor]]
        if as_shards:
            emas = [Shards([next(it) for _ in e.segments], e.index) for e in shards]
        else:
            emas = [{n: next(it) for n in ema} for ema in trees]
        return emas, buffer, ready


def _take_generation(lock: writer.TagLock, layout: ShardLayout, buffers: BufferState | None, world: int) -> int:
    """Rank 0, holding the tag's lock: the generation of its save, recorded as taken where other ranks write files
    (:meth:`~functional_ema._checkpoint.writer.TagLock.take_generation`). Rank 0 holds the lock until its own write
    and commit end, but not another rank's: one whose save failed may still write when the next save takes the tag,
    which must then write other names. Where rank 0 alone writes, nothing is recorded (nothing left after a failure)."""
    if world > 1 and _all_write(layout, buffers):
        return lock.take_generation()
    return writer.read_generation(lock.tag_dir)


def _all_write(layout: ShardLayout, buffers: BufferState | None) -> bool:
    """Whether rank 0 waits for every rank's record: yes, except where only rank 0 writes (a whole, replicated model
    without buffers). HSDP replicas other than 0 report a record without files."""
    return layout.stage != 0 or buffers is not None or not layout.part.whole or layout.replicas > 1


@dataclass(frozen=True)
class _Job:
    """What the background part of one rank's save needs: plain data, fixed at the call."""

    save_dir: Path
    tag_dir: Path
    layout: ShardLayout
    rank: int  # in the ranks that save together
    first: dict[str, Any]  # rank 0's plan (agreed)
    mine: dict[str, Any]  # this rank's plan
    token: str  # this save's id (rank 0's), in marker names and the manifest
    writers: list[int]  # ranks whose record rank 0 waits for
    writes: bool  # this rank writes EMA pieces
    emas: list[Mapping[str, torch.Tensor]] | None  # the snapshot (None: no EMA file on this rank)
    ready: torch.cuda.Event | None  # end of the snapshot's device-to-host copies (None on CPU)
    buffers: BufferState | None  # host copy of the buffers (None: no buffer file on this rank)
    lock: writer.TagLock | None  # rank 0's hold on the tag, released once the commit is done
    dtype: torch.dtype
    timeout: float  # commit_timeout
    after: threading.Event | None = None  # the saver's previous save still in flight: committed before this one
    world: int | None = None  # the ranks of this save, in its error markers (None: unknown, the markers never stale)


#: How far into a manifest its ``save_id`` is written: after the format, library, note and tag
#: (writer.build_manifest), before the schedules, the ``extra`` record and any parameter or file record.
_SAVE_ID_WITHIN = 64 << 10


#: The most a rank waits for rank 0's manifest once it read rank 0's claim to commit (``_fail_after_vote``), its own
#: wait (``commit_timeout``) being over already: rank 0 claims right before it writes the manifest, so a longer wait
#: means rank 0 died or its storage stalls (``max(min(commit_timeout, this), _COMMIT_GRACE_MIN_S)``).
_COMMIT_GRACE_S = 60.0
#: The least of that grace: a small ``commit_timeout`` (1-5 s) is no bound on a loaded rank 0's manifest write.
_COMMIT_GRACE_MIN_S = 10.0


def _is_save(mpath: Path, token: str) -> bool:
    """Whether the manifest at ``mpath`` (written whole, by a rename) is the one of the save ``token``.

    Reads its head only: every rank asks, and a manifest grows with world size x parameters (tens of
    MB at thousands of ranks), while ``save_id`` comes before the parameter and file records. ``token``
    is this save's random id, so no other field's text can match it."""
    with open(mpath, "rb") as f:
        head = f.read(_SAVE_ID_WITHIN)
    return re.search(rb'"save_id"\s*:\s*"' + re.escape(token.encode()) + rb'"', head) is not None


def _run(job: _Job, handle: SaveHandle) -> None:
    """The background part of one rank's save. No collectives (see the module docstring)."""
    error: BaseException | None = None
    names: list[str] = []
    try:  # everything: an exception escaping here would die in the executor, the handle never finished
        names = writer.save_files(job.layout, job.first["generation"], job.buffers is not None, job.emas is not None)
        if job.rank == 0:
            record = _write_files(job, names)
            _commit_when_all_wrote(job, record, time.monotonic() + job.timeout)
        else:
            _write_and_wait(job, names)
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the handle
        error = e
        try:
            _report_failure(job, e)
            if not isinstance(e, _Undecided):  # rank 0 may yet commit a manifest listing these files
                writer.remove_unlisted(job.tag_dir, names)
        except BaseException as e2:  # noqa: BLE001 - a cleanup; the handle gets the save's own failure
            logger.error("functional_ema: could not clean up the failed async save in %s: %s", job.tag_dir, e2)
    finally:
        try:
            if job.lock is not None:
                job.lock.release()
        except BaseException as e:  # noqa: BLE001 - the handle must finish, or wait() blocks forever
            error = error or e
        handle._finish(error)


def _write_files(job: _Job, names: list[str]) -> dict[str, Any]:
    """This rank's EMA and buffer files written; returns their record for the manifest."""
    if job.ready is not None:
        job.ready.synchronize()
    record: dict[str, Any] = {"part": writer.part_record(job.layout, job.mine)}
    if job.emas is not None:
        meta = writer.rank_file_meta(job.mine, job.layout, job.first["generation"])
        # write_rank_file only indexes ``ema[name]``; its ``dict`` annotation is narrower than the Shards it gets.
        emas = cast("list[dict[str, torch.Tensor]]", job.emas)
        record["file"] = writer.write_rank_file(job.tag_dir / names[0], job.layout, emas, job.dtype, meta)
    if job.buffers is not None:
        meta = writer.buffer_file_meta(job.mine, job.layout, job.first["generation"])
        record["buffers"] = writer.write_buffer_file(
            job.tag_dir / names[-1], job.layout.rank, job.buffers, job.mine["buffers"], meta
        )
    return record


def _commit_when_all_wrote(job: _Job, record: dict[str, Any], deadline: float) -> None:
    """Rank 0: wait for every writer's done marker (or an error marker), then for the save started before this
    one, then decide to commit (:func:`_claim`, unless a rank gave up first) and write the manifest."""
    records: dict[int, dict[str, Any]] = {0: record}
    others = [r for r in job.writers if r != 0]

    def collect() -> bool | None:
        found = set(os.listdir(job.tag_dir))
        _raise_remote_error(job, found)
        for r in others:
            if r not in records and _marker(job.token, r, "done") in found:
                records[r] = json.loads((job.tag_dir / _marker(job.token, r, "done")).read_text())
        return True if len(records) == len(job.writers) else None

    _poll(collect, deadline, job, f"the files of ranks {others}", progress=_writes_progress(job))
    if job.after is not None:  # start order (AsyncSaver._last_shared); that save ends within its timeout
        job.after.wait()
        # A rank may have given up meanwhile (its commit_timeout passed): committing would complete a
        # checkpoint that rank already reported failed and whose files it removed.
        _raise_remote_error(job, set(os.listdir(job.tag_dir)))
    manifest = writer.build_manifest(job.first, [records[r] for r in sorted(records)], save_id=job.token)
    # A rank rank 0 did not wait for (one writing no file; one whose wait timed out) may have claimed an abort first.
    decided = _claim(job, {"rank": 0, "commit": True}, _manifest_check(job))
    if not decided.get("commit"):
        raise _remote(job, decided)
    try:
        writer.commit_manifest(job.save_dir, job.tag_dir, manifest)
    except BaseException as e:
        if not (isinstance(e, Exception) and _committed_anyway(job, e)):  # not committed: the error marker says so
            with contextlib.suppress(OSError):
                os.unlink(job.tag_dir / _marker(job.token, 0, "done"))  # no claim is left behind
            raise
    with contextlib.suppress(OSError):  # best effort: the next commit of the tag removes what is left
        _remove_markers(job.tag_dir, job.token)


def _committed_anyway(job: _Job, error: Exception) -> bool:
    """Rank 0's commit failed: whether it failed after the manifest was renamed into place (the folder's fsync,
    ``ema_latest``, the removal of older generations). Then the save is complete, as every other rank sees it: a
    warning, and success. Raises :class:`_Undecided` where the manifest cannot be read (the others decide by it)."""
    try:
        done = _is_save(job.tag_dir / fmt.MANIFEST_NAME, job.token)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _Undecided(
            f"async save of tag {job.first['tag']!r} (rank 0): writing its manifest failed ({type(error).__name__}: "
            f"{error}), and whether the manifest is in place could not be read ({type(e).__name__}: {e}). The files "
            "are left in place: the save is complete if functional_ema.checkpoint.read_manifest reads this save's "
            f"manifest in {job.tag_dir}; if not, save again"
        ) from error
    if done:
        logger.warning(
            "functional_ema: the async EMA save into %s is complete (its manifest is in place), but what follows it "
            "failed: %s: %s. ema_latest may not name this tag (load it by tag), and files of older generations or "
            "markers may be left (the next save of the tag removes them)",
            job.tag_dir,
            type(error).__name__,
            error,
        )
    return done


def _write_and_wait(job: _Job, names: list[str]) -> None:
    """A rank other than 0: write its files, leave its done marker (a writer: rank 0 waits for it), then wait for the
    manifest of this save (or another rank's error marker). A failure where rank 0 may commit without this rank's
    word (it writes no file, or its done marker is out) is decided with rank 0 (:func:`_fail_after_vote`)."""
    committed = _manifest_check(job)
    voted = job.rank not in job.writers  # rank 0 commits without waiting for a rank that writes no file
    try:
        record = _write_files(job, names)
        deadline = time.monotonic() + job.timeout
        if not voted:
            voted = True  # from here rank 0 may hold this rank's record (a write that fails may have renamed it)
            _io.atomic_write_bytes(job.tag_dir / _marker(job.token, job.rank, "done"), json.dumps(record).encode())
        # Not given up while the writers' files still change: a replicated model's rank 0 alone writes the file, and
        # this rank (writing none) started its clock at once; commit_timeout bounds a stall, not rank 0's write.
        _poll(committed, deadline, job, "rank 0's manifest", progress=_writes_progress(job))
    except _RemoteError:
        raise  # rank 0 does not commit: it fails with that rank's error too
    except Exception as e:  # decided with rank 0 (below), then raised or not
        if not voted:
            raise  # rank 0 cannot commit without this rank's record: its error marker (next) fails the save
        _fail_after_vote(job, e, committed)


def _manifest_check(job: _Job) -> Callable[[], bool | None]:
    """A poll (:func:`_poll`) for the manifest of this save: True once it is there; raises another rank's error."""
    seen: list[tuple[int, int] | None] = [None]  # the manifest's (mtime, size) at the last parse
    found = [False]  # this save's manifest was seen: the answer stands (asked again after a claim)

    def committed() -> bool | None:
        mpath = job.tag_dir / fmt.MANIFEST_NAME
        if found[0]:
            return True
        try:
            st = mpath.stat()
            if (st.st_mtime_ns, st.st_size) != seen[0]:  # read only a changed manifest
                seen[0] = (st.st_mtime_ns, st.st_size)
                found[0] = _is_save(mpath, job.token)
                if found[0]:
                    return True
        except (OSError, ValueError):
            pass  # not there yet, or being replaced
        _raise_remote_error(job, set(os.listdir(job.tag_dir)))
        return None

    return committed


def _fail_after_vote(job: _Job, error: Exception, committed: Callable[[], bool | None]) -> None:
    """A rank that failed where rank 0 may be committing without it: the save fails only if this rank's abort is
    the claimed outcome (:func:`_claim`), so that every rank agrees. Where rank 0 decided to commit first, wait for
    its manifest (a short grace: this rank's own wait may have used ``commit_timeout`` already) and succeed.

    Any other failure on the way (making or reading the claim, polling in the grace: EIO, ESTALE) leaves the outcome
    unknown to this rank: :class:`_Undecided` (no error marker, no file removed: rank 0 may commit a manifest listing
    them)."""
    try:
        _decide_after_vote(job, error, committed)
    except (_RemoteError, _Undecided):
        raise  # decided: another rank's failure; or unknown, said so
    except Exception as e:
        if e is error:
            raise  # this rank's abort is the claimed outcome
        raise _Undecided(
            f"async save of tag {job.first['tag']!r} (rank {job.rank}): this rank failed ({type(error).__name__}: "
            f"{error}) after its done marker was out, and then could not learn the save's outcome "
            f"({type(e).__name__}: {e}). This rank's files are left in place: the save is complete if rank 0 wrote "
            f"its manifest in {job.tag_dir} (functional_ema.checkpoint.read_manifest); if not, save again"
        ) from e


def _decide_after_vote(job: _Job, error: Exception, committed: Callable[[], bool | None]) -> None:
    """:func:`_fail_after_vote`: claim this rank's abort; raise ``error`` if it stands, else follow rank 0's claim."""
    payload = {"rank": job.rank, "type": type(error).__name__, "message": str(error)}
    payload["checkpoint_error"] = isinstance(error, CheckpointError)
    decided = _claim(job, payload, committed)
    # Compared by content (a claim read back is a copy): this abort stands, unless rank 0 committed (and removed its
    # claim) before it was made.
    if decided == payload:
        if committed() is True:
            with contextlib.suppress(OSError):
                os.unlink(job.tag_dir / _marker(job.token, 0, "done"))  # the claim just made, left over
            return
        raise error
    if not decided.get("commit"):
        raise _remote(job, decided)
    grace = max(min(job.timeout, _COMMIT_GRACE_S), _COMMIT_GRACE_MIN_S)
    try:
        _poll(committed, time.monotonic() + grace, job, "the manifest of rank 0, which decided to commit", grace)
    except _RemoteError:
        raise  # rank 0 failed writing it (its error marker): nothing is committed
    except CheckpointError as e:
        raise _Undecided(
            f"async save of tag {job.first['tag']!r} (rank {job.rank}): this rank failed ({type(error).__name__}: "
            f"{error}) after rank 0 decided to commit the save, whose manifest then did not appear in {job.tag_dir} "
            f"within {grace:g} s (max(min(commit_timeout, {_COMMIT_GRACE_S:g} s), {_COMMIT_GRACE_MIN_S:g} s)): rank 0 died, or its storage stalls. "
            "This rank's files are left in place: the save is complete if that manifest appears "
            "(functional_ema.checkpoint.read_manifest); if not, save again"
        ) from e
    logger.warning(
        "functional_ema: rank %d gave up on its part of the async save into %s (%s: %s) after rank 0 decided to commit "
        "it: the checkpoint is complete (the writing ranks wrote it), and this rank's save succeeds",
        job.rank,
        job.tag_dir,
        type(error).__name__,
        error,
    )


def _claim(job: _Job, outcome: dict[str, Any], committed: Callable[[], bool | None]) -> dict[str, Any]:
    """Decide the save's outcome once for every rank: the first of rank 0 (``{"commit": true}``, right before it
    writes the manifest) and a rank giving up (its error) to make the claim file (rank 0's done marker name, which
    no rank writes otherwise) wins. Returns the outcome that stands (``outcome`` itself when this rank's won).

    The claim is written whole under a temporary name, then ``os.link``-ed to its name: atomic and exclusive, on
    NFS too (the classic lock file), so that a claim read is never empty or partial. Not fsynced: it only decides
    between live ranks, and a crash loses the save anyway (no manifest)."""
    path = job.tag_dir / _marker(job.token, 0, "done")
    data = json.dumps(outcome).encode()
    while True:
        tmp = _io.tmp_name(path)  # a marker's temporary name: removed with the markers if a crash leaves it
        tmp.write_bytes(data)
        try:
            os.link(tmp, path)
            return outcome
        except FileExistsError:
            # NFS: a link retransmitted after its reply got lost is answered EEXIST: then the claim is this one
            with contextlib.suppress(OSError):
                if os.stat(tmp).st_nlink == 2:
                    return outcome
        except FileNotFoundError:
            continue  # the temporary removed with the markers of a save just committed: claim again (then read)
        except OSError:  # NFS: the reply to a link that was made can get lost; then the file has 2 links
            if os.stat(tmp).st_nlink == 2:
                return outcome
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        decided = _read_claim(job, path, committed)
        if decided is not None:
            return decided


def _read_claim(job: _Job, path: Path, committed: Callable[[], bool | None]) -> dict[str, Any] | None:
    """The outcome claimed in ``path`` (whole: it was linked into place), or None where the claim is gone since
    (a rank that claimed an abort only removes it after rank 0 committed; rank 0 removes its own when its commit
    failed): then the manifest decides, or else claim again."""
    try:
        return cast("dict[str, Any]", json.loads(path.read_bytes()))
    except FileNotFoundError:
        return {"rank": 0, "commit": True} if committed() is True else None
    except (OSError, ValueError) as e:
        raise _Undecided(
            f"async save of tag {job.first['tag']!r} (rank {job.rank}): could not read the save's outcome, claimed in "
            f"{path} ({type(e).__name__}: {e}). This rank's files are left in place: the save is complete if rank 0 "
            "wrote its manifest (functional_ema.checkpoint.read_manifest); if not, save again"
        ) from e


def _report_failure(job: _Job, e: BaseException) -> None:
    """Log this rank's failure and leave an error marker, so that the other ranks fail now rather than at the
    timeout (not where the save may yet be committed: the others wait for it). Another rank's failure is recorded
    too, as that rank's (the marker's name says who wrote it): once every rank of the save has its error marker, no
    rank reads the save's markers again, and a later save of the tag may remove them
    (``writer._failed_async_markers``)."""
    if not isinstance(e, _Undecided):
        try:
            if isinstance(e, _RemoteError):  # the failing rank's record: the others read the same message from either
                payload = dict(e.info)
            else:
                payload = {
                    "rank": job.rank,
                    "type": type(e).__name__,
                    "message": str(e),
                    "checkpoint_error": isinstance(e, CheckpointError),
                }
            payload["world"] = job.world
            _io.atomic_write_bytes(job.tag_dir / _marker(job.token, job.rank, "error"), json.dumps(payload).encode())
        except Exception as e2:  # noqa: BLE001
            logger.error("functional_ema: could not record the async save failure for the other ranks: %s", e2)
    logger.error(
        "functional_ema: async EMA save of step %s into %s failed on rank %d: %s: %s",
        job.first["step"],
        job.tag_dir,
        job.rank,
        type(e).__name__,
        e,
    )


class _RemoteError(CheckpointError):
    """Another rank's background write failed (read from its error marker): ``info``, that marker's record."""

    info: dict[str, Any]


class _Undecided(CheckpointError):
    """This rank failed without learning whether rank 0 commits the save (it decided to, and no manifest came): no
    error marker (the other ranks wait for the manifest) and no file removed (the manifest may list them)."""


def _raise_remote_error(job: _Job, names: set[str]) -> None:
    prefix = f"{_MARK}{job.token}."
    for name in sorted(names):
        if name.startswith(prefix) and name.endswith(".error"):
            try:
                info = json.loads((job.tag_dir / name).read_text())
            except (OSError, ValueError):
                continue  # being written (atomically: complete on the next poll)
            raise _remote(job, info)


def _remote(job: _Job, info: dict[str, Any]) -> _RemoteError:
    """Another rank's failure, from its error marker (or its claimed outcome)."""
    error = _RemoteError(
        f"async save of tag {job.first['tag']!r} failed on rank {info.get('rank')} "
        f"({info.get('type')}): {info.get('message')}"
    )
    error.info = {k: info.get(k) for k in ("rank", "type", "message", "checkpoint_error")}
    return error


def _poll(
    check: Callable[[], bool | None],
    deadline: float,
    job: _Job,
    what: str,
    limit: float | None = None,
    progress: Callable[[], bool] | None = None,
) -> None:
    """Call ``check`` until it returns non-None, backing off to 50 ms; past ``deadline`` (``limit`` s, the message
    says; ``commit_timeout`` unless given) raise. ``progress`` (:func:`_writes_progress`), asked every quarter of
    the limit: where it saw the save's files change, the deadline is ``limit`` s from then, so the limit bounds a
    stall (a writer that died or hangs), not a write that takes longer."""
    delay = 0.001
    span = job.timeout if limit is None else limit
    look = time.monotonic() + span / 4
    while check() is None:
        now = time.monotonic()
        if progress is not None and now >= min(look, deadline):
            look = now + span / 4
            if progress():
                deadline = max(deadline, now + span)
        if now > deadline:
            raise CheckpointError(
                f"async save of tag {job.first['tag']!r} (rank {job.rank}): timed out after "
                f"{job.timeout if limit is None else limit:g} s waiting for {what} in {job.tag_dir}. Is the directory shared by all "
                "ranks, and are they all alive? The checkpoint is not marked complete"
            )
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def _writes_progress(job: _Job) -> Callable[[], bool]:
    """For :func:`_poll`: whether the files of this save (its generation's rank and buffer files and their
    temporaries, any rank's) changed since the last call: a write going on (its temporary grows), or one just
    renamed into place. Another generation's files, and the leftovers of a crashed save (which do not change), are
    not this save's progress. A failure to list the folder is none. Only temporaries are stat-ed (the writes going
    on): a finished file's rename shows in the names alone."""
    generation = job.first["generation"]

    def seen() -> frozenset[tuple[str, int, int]] | None:
        found = set()
        try:
            names = os.listdir(job.tag_dir)
        except OSError:
            return None
        for name in names:
            final = fmt.tmp_final(name)
            m = fmt.RANK_FILE.match(final or name) or fmt.BUFFER_FILE.match(final or name)
            if m is None or fmt.file_identity(m)[3] != generation:
                continue
            if final is None:
                found.add((name, -1, -1))
                continue
            with contextlib.suppress(OSError):  # renamed or removed meanwhile: seen at the next look
                st = os.stat(job.tag_dir / name)
                found.add((name, st.st_size, st.st_mtime_ns))
        return frozenset(found)

    last = [seen()]

    def progressed() -> bool:
        now = seen()
        if now is None:
            return False
        changed, last[0] = now != last[0], now
        return changed

    return progressed


def _remove_markers(tag_dir: Path, token: str) -> None:
    """After the commit: remove this save's markers and those of earlier saves that failed on every rank
    (``writer._failed_async_markers``), best effort. Not another save's still in flight: a failed save's late rank
    still reads its peers' error markers (removed, it would wait out its ``commit_timeout``) and writes its own."""
    names = os.listdir(tag_dir)
    mine = f"{_MARK}{token}."
    stale = set(writer._failed_async_markers(tag_dir, names))
    removed = False
    for name in names:
        if (name.startswith(mine) and _is_marker(name)) or name in stale:
            try:
                os.unlink(tag_dir / name)
                removed = True
            except OSError:  # pragma: no cover
                pass
    if removed:
        _io.fsync_dir(tag_dir)


def _is_marker(name: str) -> bool:
    """Whether ``name`` is a marker this module writes, or the temporary name of one (a crash mid-write)."""
    return fmt.ASYNC_MARKER.fullmatch(name) is not None


def _warn_uncommitted(pending: list[_async_private.PendingCommit]) -> None:
    """At interpreter exit (or when the saver is garbage-collected): warn of every save still awaiting its commit.

    Not committed here: the commit is collective, and at exit the ranks are not together (they exit at different
    times; a crashed rank never comes). The files are left as they are: the tag's previous checkpoint stays the
    complete one, and ``ema_latest`` is unchanged."""
    for p in pending:
        if p.handle.done():  # committed, failed, or (in a forked child) its parent's
            continue
        msg = (
            f"functional_ema: the async EMA save of step {p.handle.step} into {p.prep.tag_dir} (tag "
            f"{p.prep.first['tag']!r}) was never committed: the process is ending, or its AsyncSaver was dropped, while "
            "the save awaited its commit, which a shared=False or URL save gets only from a collective call on every "
            "rank. Its files are left uncommitted: the tag's previous checkpoint, if any, stays the one that loads, and "
            "ema_latest is unchanged. Call saver.wait() on every rank before exiting, or use "
            "`with fe.AsyncSaver(...) as saver:`"
        )
        # Logged only, once: it reaches the handlers that collect a cluster's logs, and with logging unconfigured
        # Python's last-resort handler prints it on stderr. Not also a warning: said twice on stderr then, and at
        # exit a blanket filterwarnings("ignore") (common in training scripts) must not hide it, nor "error" raise it.
        logger.warning("%s", msg)
