"""EMA checkpoints beside DeepSpeed's: every rank's pieces, exact resume, resharding, offline rebuild.

Layout of one checkpoint, inside DeepSpeed's tag folder ``save_dir/tag/``::

    ema_rank_00000_of_00002.safetensors   rank 0's 1-D piece of every parameter, for every EMA
    ema_rank_00001_of_00002.safetensors   rank 1's (one file per rank on ZeRO stages 1-3; stage 0
                                          replicates whole parameters, so only rank 0 writes)
    buffers_rank_0000<r>_of_00002.safetensors  each rank's module buffers (save(..., buffers=...))
    ema_manifest.json                     written last, by rank 0, once every file is durable; lists
                                          them all with their checksums, and the save's ``extra``

Each rank file holds tensors ``emas.<k>.<parameter name>`` (EMA ``k``'s local piece, 1-D, the EMA
dtype) and string metadata: format version, tag, step, number of EMAs, EMA dtype, the decay
schedules (when passed to :func:`save`), world size, rank, ZeRO stage and the :class:`ShardLayout`
(per parameter: full shape, offset and length of the piece). That is enough to rebuild full weights
with no process group (:func:`consolidate`) and to re-cut the pieces for another world size or
stage (:func:`load`). The manifest lists the rank files with their sizes and checksums of their
header and tensor bytes (XXH3-64 per 4 MiB chunk since format 2; format 1's CRC-32s are still read).
**Only a manifest makes a checkpoint complete**, and only with every file it lists.

Crash safety: every file is written to a temporary name, fsynced, renamed into place, and the
folder fsynced. Saving again into a tag that already holds a complete EMA writes the new rank files
under new names (``...of_00002.gen1.safetensors``) and swaps the manifest last, so a crash at any
moment leaves either the old or the new checkpoint loadable, never a mix; stale files are removed
after the swap. One save writes a tag at a time: its committing rank holds the tag's lock
(``.ema_write.lock``, ``flock``) from choosing the generation to writing the manifest.

Recommended order, and what ``latest`` means::

    fe.save(state, engine, save_dir)          # EMA first ...
    engine.save_checkpoint(save_dir)          # ... then DeepSpeed, which writes `latest` last

DeepSpeed writes ``save_dir/latest`` at the end of ``save_checkpoint`` (from rank 0, not atomically).
Saving the EMA first means ``latest`` only ever names a tag whose EMA is complete. With the other
order a crash between the two calls leaves ``latest`` naming a tag without an EMA manifest;
:func:`load` then raises :class:`IncompleteCheckpointError` naming the tag and listing the tags that
are complete. Either order is otherwise fine: the two never touch each other's files. :func:`load`
and :func:`consolidate` follow ``latest`` when no tag is given, like DeepSpeed's tools.

Nothing per-rank goes through DeepSpeed's ``client_state`` (on ZeRO stages 0-2 DeepSpeed keeps rank
0's only); :func:`client_state_summary` gives a small JSON-able record that is safe to put there.

Resuming::

    engine.load_checkpoint(save_dir)              # DeepSpeed's weights and optimizer
    state = fe.load(engine, save_dir)             # the EMA, same tag (``latest``)
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from . import _io, _memory
from ._args import check_bool, check_location, check_path, check_state, check_storage_options
from ._async import AsyncSaver, SaveHandle, _take_generation
from ._async_private import BUCKET, PRIVATE, save_now
from ._checkpoint.bucket import access_refused, url_storage
from ._checkpoint.collective import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    agree,
    agree_on,
    arrive,
    check_distinct_writers,
    gather_to_first,
    io_error,
    job_of,
    layout_record,
    timeout_s,
    value_digest,
)
from ._checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointVersionError,
    CorruptCheckpointError,
    ForeignFileError,
    IncompleteCheckpointError,
    InvalidTagError,
    OutputPathError,
)
from ._checkpoint.format import (
    CONSOLIDATED_FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    check_output,
    check_tag,
    dtype_name,
    library_version,
    manifest_parts,
    parse_dtype,
    rank_file_name,
)
from ._checkpoint.reader import (
    CheckpointReader,
    JoinedReader,
    RecutReader,
    StoragePath,
    fill_all,
    open_checkpoint,
    open_joined,
    open_parts,
)
from ._checkpoint.writer import (
    SaveRequest,
    TagLock,
    agree_plans,
    buffer_file_meta,
    build_manifest,
    check_shared,
    commit_manifest,
    part_record,
    plan_save,
    rank_file_meta,
    read_generation,
    remove_unlisted,
    save_files,
    write_buffer_file,
    write_rank_file,
)
from ._core import _allocate, check_ema_dtype, check_step_tensor, refuse_inference
from ._fit import state_problem
from ._layout import ShardLayout
from ._selection import SelectionLike, check_loaded_selection, check_recut_selection, make_selection
from ._shards import Shards
from ._state import BufferState, EmaState
from ._storage import storage_for
from ._tree import short_list
from .engines import adapter_for
from .engines._base import read_for, select, selection_of
from .schedules import DecayLike

__all__ = [
    "save",
    "load",
    "consolidate",
    "consolidate_to_file",
    "client_state_summary",
    "read_manifest",
    "load_checkpoint",
    "Loaded",
    "saved_parts",
    "SavedParts",
    "default_tag",
    "rank_file_name",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CheckpointVersionError",
    "CheckpointMismatchError",
    "AsyncSaver",
    "SaveHandle",
    "InvalidTagError",
    "CheckpointIOError",
    "CheckpointTimeoutError",
    "OutputPathError",
    "ForeignFileError",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
]

logger = logging.getLogger("functional_ema")

# ---------------------------------------------------------------------------------------- naming


def default_tag(x: Any, state: EmaState | None = None) -> str:
    """The tag :func:`save` uses when none is given: DeepSpeed's own default,
    ``f"global_step{engine.global_steps}"``, for a DeepSpeed engine; ``f"global_step{state.step}"``
    for other models."""
    if state is not None:
        check_state(state)
    return adapter_for(x).default_tag(state)


# -------------------------------------------------------------------------------------------- save


def save(
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
) -> Path | str:
    """Write every rank's EMA pieces into ``save_dir/tag/``, beside the training checkpoint. Collective.

    Call it on every rank, with the same ``tag`` the training checkpoint uses (the default is
    DeepSpeed's, ``f"global_step{engine.global_steps}"``, for an engine, ``f"global_step{state.step}"``
    otherwise). Each rank writes its own safetensors file (only rank 0 where every rank holds the same
    whole parameters: ZeRO-0, DDP, a plain module), and its buffers' file when ``buffers`` is given;
    rank 0 then writes ``ema_manifest.json``, which lists every file with its checksums and makes the
    checkpoint complete. See the module docstring for the layout, the crash guarantees and the
    recommended order with ``engine.save_checkpoint`` (EMA first). The directory must be shared by all
    ranks. One save writes a tag at a time: a second save of the same tag (another saver, thread or
    process) waits until the first is done; a tag whose ``AsyncSaver.save(shared=False)`` awaits its commit
    in this thread (at that saver's next call) is refused at once, naming ``saver.wait()``.

    Args:
        state: this rank's state (from :func:`functional_ema.init_ema` over ``local_shards(engine)``,
            :func:`functional_ema.update` or :func:`load`).
        engine: the training object the state's pieces come from (a DeepSpeed engine, an FSDP2, DDP
            or plain model).
        save_dir: the checkpoint directory (the one given to ``engine.save_checkpoint``); a
            ``file:///absolute/path`` URL is that folder.
        tag: the tag folder; ``None`` means the default above.
        decay: optional, metadata only: the decay(s) or schedule(s) the EMAs use (one per EMA), so
            offline tools know what each EMA is. Not needed by :func:`load`.
        buffers: optional :class:`functional_ema.buffers.BufferState` of this rank (at the state's
            step), saved in the same checkpoint: listed and checksummed in the manifest, read back
            with :func:`functional_ema.buffers.load_buffers`.
        extra: optional small JSON object (at most 64 KiB as JSON), the same on every rank, saved in the
            manifest and in every rank file's header (so its checksums cover it): e.g. your training
            loop's counters. Read back with ``read_manifest(dir, tag)["extra"]``.
        timeout: seconds to wait for every rank to call ``save`` (and for another save of the same tag
            to finish) before raising :class:`CheckpointTimeoutError`; ``None`` reads
            :data:`TIMEOUT_ENV` (``FUNCTIONAL_EMA_TIMEOUT``), else :data:`DEFAULT_TIMEOUT_S` (600 s).
        shared: ``True`` (the default): ``save_dir`` is one folder every rank sees, and a rank that does not
            see the committing rank's files is refused. ``False``: each rank's ``save_dir`` is its own, or its
            node's (node-local disks, Ray Train's per-worker folder): each folder gets the files of the ranks
            that write there and the same manifest, so the union of the folders, however merged, is one
            complete checkpoint (docs/many-nodes.md). Load it with ``load(..., shared=False)``. Refused
            for a URL (every rank reaches the one bucket).
        storage_options: for a URL ``save_dir``, fsspec's arguments (``key``, ``secret``,
            ``endpoint_url``, ...); ``None`` uses fsspec's configuration (``FSSPEC_S3_*`` variables, the
            filesystem's own, e.g. ``AWS_*``). Refused for a local folder. A store refusing them (a wrong
            key or secret) fails the save on every rank with :class:`CheckpointIOError` naming the rank, the
            URL and ``save(storage_options=...)``.

    ``save_dir`` may be an fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://...``; needs
    ``pip install 'functional-ema[s3]'`` for ``s3://``): the same objects are written under that prefix,
    each rank's file streamed as a multipart upload (nothing staged on local disk). Object stores have no
    lock: every rank checks that it reaches the store rank 0 writes (a marker object), the ranks agree that
    every upload completed, then rank 0 writes the manifest (last), then ``ema_latest``. A new save of a
    tag never overwrites what its manifest lists; a failed one removes only the objects it wrote; a commit
    removes only older generations, and is refused when a later save of the tag committed meanwhile (an
    ``AsyncSaver`` save of it awaiting its commit: ``saver.wait()`` first). Do not save one tag of one prefix
    from two jobs at once. A URL's scheme is case-insensitive; one with ``.``/``..`` parts or a secret in it
    (``s3://KEY:SECRET@...``: use ``storage_options``) is refused. See docs/many-nodes.md.

    Returns:
        The tag folder, ``save_dir/tag`` (for a URL, the tag's URL, a ``str``).

    Raises:
        CheckpointError: on every rank when any rank fails, the same subclass on every rank
            (nothing is marked complete then; a previous complete checkpoint in the same tag stays
            loadable; the files of the failed save are removed). :class:`CheckpointIOError`
            for a full disk, a read-only folder or a permission error (naming rank, file, errno);
            :class:`InvalidTagError` for a tag that is not one plain folder name or is reserved
            (``latest``, ``latest_universal``, ``ema_latest``, ``zero_to_fp32.py``, ``zero_to_torch.py``);
            :class:`CheckpointTimeoutError` when not every rank calls it. Refused before anything is
            written: a process group that is gone (``destroy_process_group``), and two ranks of the job
            that would write the same file (model-parallel ranks, several groups saving into one folder).

    Example:
        >>> fe.save(state, engine, "ckpt", decay=0.999)          # doctest: +SKIP
        >>> engine.save_checkpoint("ckpt")                       # doctest: +SKIP
    """
    return _save(state, engine, save_dir, tag, decay, buffers, extra, timeout, shared, storage_options, "save")


def _save(
    state: EmaState,
    engine: Any,
    save_dir: str | os.PathLike,
    tag: str | None,
    decay: DecayLike | Sequence[DecayLike] | None,
    buffers: BufferState | None,
    extra: dict[str, Any] | None,
    timeout: float | None,
    shared: bool,
    storage_options: dict[str, Any] | None,
    what: str,
) -> Path | str:
    """:func:`save`, its errors naming ``what``: the public verb called (``save``, ``save_snapshot``)."""
    location = check_location(save_dir, "save_dir")  # the state is checked in the plan, on every rank together
    options = check_storage_options(storage_options, location, f"{what}(storage_options=...)")
    timeout_s(timeout)  # checked now: a bad timeout is refused before any wait
    adapter = adapter_for(engine)
    reading = read_for(adapter, state)  # read once (the state's selection); everything below takes plain data
    layout = reading.layout
    jgroup, jrank, jworld = job_of(reading)
    raw_tag = adapter.default_tag(state) if tag is None else tag
    shared = check_bool(shared, "shared")
    if isinstance(location, str):  # a URL
        store = url_storage(location, shared, options, what)
        arrive(what, jgroup, jworld, jrank, timeout)
        job = (jgroup, jworld, jrank)
        return save_now(BUCKET, state, layout, job, store, raw_tag, decay, buffers, extra, timeout_s(timeout), what)
    save_dir = location
    arrive(what, jgroup, jworld, jrank, timeout)
    if not shared:
        job = (jgroup, jworld, jrank)
        return save_now(PRIVATE, state, layout, job, save_dir, raw_tag, decay, buffers, extra, timeout_s(timeout), what)
    request = SaveRequest(state, layout, (jgroup, jworld, jrank), decay, buffers, extra, timeout)
    return _save_shared(request, save_dir, raw_tag, what)


def _save_shared(request: SaveRequest, save_dir: Path, raw_tag: Any, what: str) -> Path:
    """:func:`save` into a folder every rank shares: the ranks agree on the plan (rank 0 holding the tag's lock
    from then on), write their rank files, and rank 0 commits the manifest; each step is collective, and a
    failure in one removes this save's files and gives the lock up on every rank."""
    layout, (jgroup, jworld, jrank) = request.layout, request.ranks
    writes_buffers = request.writes_buffers
    if isinstance(raw_tag, str) and _tag_ok(raw_tag):  # a bad tag is refused in the plan, on every rank together
        files = save_files(layout, 0, writes_buffers, layout.writes_pieces)
        check_distinct_writers(what, save_dir / raw_tag, files, jworld, request.timeout)
    lock: list[TagLock] = []
    tag_dir, mine, first = _agree_save_plan(request, save_dir, raw_tag, lock, what)
    done = False
    try:
        names = save_files(layout, first["generation"], writes_buffers, layout.writes_pieces)
        try:
            written = _write_rank_files(request, tag_dir, names, mine, first["generation"], what)
            agree(
                f"{what} (writing the manifest)",
                lambda: _commit(save_dir, tag_dir, first, written, lock, jrank),
                jgroup,
                jworld,
                jrank,
                results=False,
            )
        except CheckpointError as e:
            remove_unlisted(tag_dir, names)
            if not isinstance(e, CheckpointTimeoutError):  # agreed once every rank's write ended: none writes late
                for held in lock:
                    if held.held:  # not once the commit gave the tag up
                        held.untake_generation()  # the folder as it was (the generation's record too)
            raise
        done = True
    finally:
        for held in lock:
            held.release(remove_empty=not done)
    return tag_dir


def _agree_save_plan(
    request: SaveRequest, save_dir: Path, raw_tag: Any, lock: list[TagLock], what: str
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(the tag's folder, this rank's plan, rank 0's plan), agreed by every rank; rank 0 holds the tag's lock
    (put in ``lock``) and reads the generation. On a failure anywhere, the lock is given up and every rank raises."""
    state, layout, (jgroup, jworld, jrank), decay, buffers, extra, timeout = request

    def plan() -> dict[str, Any]:
        tag = check_tag(raw_tag)  # inside the agreement: a bad tag raises on every rank
        p = dict(plan_save(state, decay, layout, tag, buffers, extra), shared=True)
        if jrank == 0:  # the committing rank holds the tag for the whole save, then picks the generation
            lock.append(TagLock.acquire(save_dir / tag, timeout_s(timeout), what))
            # Recorded as taken where other ranks write (as an async save's): the ranks agree on a failure once
            # every write ended (the record is then put back), but a failure of that wait itself (the gloo side
            # group's timeout, a rank gone) has rank 0 give the tag up while a rank may still write, and the next
            # save must take other file names than that late write's. read_generation honours the record
            p["generation"] = _take_generation_if_written(lock[-1], layout, buffers, jworld)
        return p

    def give_up() -> None:  # refused at the call: no rank wrote a file of the generation, none can write late
        for held in lock:
            held.untake_generation()
            held.release(remove_empty=True)

    try:
        mine, first = agree_plans(f"{what} (checking the state)", plan, jgroup, jworld, jrank, on_failure=give_up)
    except BaseException:
        give_up()  # a failure of this rank's own plan (the others' raise after the agreement)
        raise
    return save_dir / check_tag(raw_tag), mine, first


def _take_generation_if_written(lock: TagLock, layout: ShardLayout, buffers: BufferState | None, world: int) -> int:
    """Rank 0's generation, recorded as taken (:func:`_agree_save_plan`) where the record can be written: where it
    cannot (a full disk), the save goes on unrecorded, as before there was a record, and a full disk then fails it
    at the rank files, naming them; a warning names the record."""
    try:
        return _take_generation(lock, layout, buffers, world)
    except OSError as e:
        lock.untake_generation()  # what the failed write left
        generation = read_generation(lock.tag_dir)
        logger.warning(
            "functional_ema: could not record generation %d as taken by the save of tag %r in %s (%s): a rank "
            "still writing after this save failed could write over the next save's file of the same name",
            generation,
            lock.tag_dir.name,
            lock.tag_dir.parent,
            e,
        )
        return generation


def _write_rank_files(
    request: SaveRequest, tag_dir: Path, names: list[str], mine: dict[str, Any], generation: int, what: str
) -> list[dict[str, Any]] | None:
    """Every rank writes its files (collective: a failure raises on every rank); returns every rank's record,
    on rank 0 (which writes the manifest), else ``None``."""
    state, layout, (jgroup, jworld, jrank), buffers = request.state, request.layout, request.ranks, request.buffers
    writes_buffers = request.writes_buffers

    def write() -> dict[str, Any]:
        path = tag_dir
        if jrank != 0:
            check_shared(tag_dir, jrank, what)
        try:
            tag_dir.mkdir(parents=True, exist_ok=True)
            records: dict[str, Any] = {"part": part_record(layout, mine)}
            if layout.writes_pieces:
                path = tag_dir / names[0]
                meta = rank_file_meta(mine, layout, generation)
                records["file"] = write_rank_file(path, layout, state.emas, parse_dtype(mine["dtype"], what), meta)
            if writes_buffers and buffers is not None:
                path = tag_dir / names[-1]
                meta = buffer_file_meta(mine, layout, generation)
                records["buffers"] = write_buffer_file(path, layout.rank, buffers, mine["buffers"], meta)
            return records
        except OSError as e:
            raise io_error(e, jrank, path) from None

    mine_written: list[dict[str, Any]] = []
    agree(
        f"{what} (writing the rank files)", lambda: mine_written.append(write()), jgroup, jworld, jrank, results=False
    )
    return gather_to_first(mine_written[0], jgroup, jworld)  # rank 0 alone writes the manifest


def _commit(save_dir: Path, tag_dir: Path, first: dict[str, Any], written: Any, lock: list[TagLock], rank: int) -> None:
    """Rank 0 writes the manifest (the save is then complete) and gives the tag up before any rank returns."""
    if written is None:  # not rank 0
        return
    try:
        commit_manifest(save_dir, tag_dir, build_manifest(first, written))
    except OSError as e:
        raise io_error(e, rank, tag_dir / MANIFEST_NAME) from None
    for held in lock:
        held.release()


def _refuse_mismatch(ckpt: Any, layout: Any, selection: Any, dtype: torch.dtype | None) -> None:
    """``CheckpointMismatchError`` where the opened checkpoint is not this model's EMA as asked: another
    selection, expert-parallel cut, set of names or shapes, or ``dtype``."""
    # The selection first: another selection of an MoE model also differs in its experts, and the names
    # that differ say why where an expert-parallel size mismatch would not.
    where = f"tag {ckpt.tag!r} in {ckpt.root}"
    if isinstance(ckpt, RecutReader):  # its names are this rank's by construction: the records are compared
        check_recut_selection(where, ckpt.manifest.get("selection"), selection)
    elif hasattr(ckpt, "shapes"):  # this part's names as saved
        check_loaded_selection(where, ckpt.manifest.get("selection"), selection, list(layout.specs), list(ckpt.shapes))
    ckpt.check_experts(layout)
    ckpt.check_model(layout.specs)
    if dtype is not None and dtype != ckpt.dtype:
        raise CheckpointMismatchError(
            f"tag {ckpt.tag!r} holds {dtype_name(ckpt.dtype)} EMAs but dtype={dtype_name(dtype)} was requested. "
            f"Pass dtype=None to restore them as saved ({dtype_name(ckpt.dtype)}); cast afterwards only if you "
            "accept the loss"
        )


def _refuse_untaken(ckpt: Any, layout: ShardLayout, job: Any) -> None:
    """Collective: refuse, on every rank, a load of a checkpoint of several model-parallel parts where some saved EMA
    is taken by no rank of the job. Each rank checks only that its own names were saved; loaded into another
    partitioning (the saved parts joined and re-cut), a parameter removed or frozen since the save would otherwise
    leave its EMA behind without a word."""
    taken = gather_to_first(sorted(layout.specs), job.group, job.world)

    def every_saved_ema_taken() -> None:
        if taken is None:  # not the first rank: it hears the first's verdict through the agreement
            return
        loaded = set().union(*taken)
        left = sorted({n for p in manifest_parts(ckpt.manifest) for n in p["params"]} - loaded)
        if left:
            raise CheckpointMismatchError(
                f"tag {ckpt.tag!r} in {ckpt.root} holds the EMA of {len(left)} parameter(s) that no rank of this job "
                f"loads: {short_list(left, 6)}. The model no longer trains them (removed, or frozen since the save): "
                "load into the model the EMA was saved from, or rebuild the weights with functional_ema.consolidate "
                "and start a new EMA with init_ema"
            )

    agree("load (every saved EMA taken)", every_saved_ema_taken, job.group, job.world, job.rank, results=False)


def _fill_state(ckpt: Any, layout: Any, shards: Any, target: Any, verify: bool) -> EmaState:
    """The EMA state read from ``ckpt``: into ``target`` (``load(out=...)``'s tensors) or, when ``None``, into
    new tensors laid out like :func:`init_ema`'s (so updates stay fused), not filled before being overwritten."""
    if target is None:
        state = _allocate(shards, ckpt.num_emas, ckpt.dtype, None, False, ckpt.step, copy_values=False)
    else:
        state = EmaState(torch.tensor(ckpt.step, dtype=torch.int64), target)
    jobs = [
        (state.emas[k][n].view(-1), k, n, spec.offset, spec.numel)
        for k in range(ckpt.num_emas)
        for n, spec in layout.specs.items()
    ]
    fill_all(ckpt, jobs, verify)
    return state


def _tag_ok(tag: str) -> bool:
    try:
        check_tag(tag)
    except CheckpointError:
        return False
    return True


def client_state_summary(state: EmaState, engine: Any = None) -> dict[str, Any]:
    """A small JSON-able record of the EMA, safe to pass in DeepSpeed's ``client_state``.

    It holds **no weights**: on ZeRO stages 0-2 DeepSpeed keeps rank 0's ``client_state`` only, so
    per-rank data placed there is silently lost. The weights live in the files :func:`save` writes;
    this record only lets you see, from DeepSpeed's checkpoint alone, that an EMA exists and where.

    Returns:
        ``{"functional_ema": {"step", "num_emas", "manifest", "format_version", "holds_weights": False,
        ...}}``; with ``engine``, also ``world_size`` and ``zero_stage``.

    Example:
        >>> engine.save_checkpoint(d, client_state=fe.client_state_summary(state, engine))  # doctest: +SKIP
    """
    info: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": int(check_state(state).step),
        "num_emas": state.num_emas,
        "manifest": MANIFEST_NAME,
        "files": "ema_rank_<rank>_of_<world>.safetensors beside this file (listed in the manifest)",
        "holds_weights": False,
        "note": "EMA weights are not in client_state (DeepSpeed keeps rank 0's only on ZeRO 0-2); "
        "load them with functional_ema.load(engine, load_dir, tag)",
    }
    if engine is not None:
        layout = adapter_for(engine).read().layout
        info.update(world_size=layout.world_size, zero_stage=layout.stage)
    return {"functional_ema": info}


# -------------------------------------------------------------------------------------------- load


def read_manifest(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, *, storage_options: dict[str, Any] | None = None
) -> dict:
    """The validated manifest of a checkpoint (step, num_emas, dtype, schedules, world size, ...).

    Checks that the tag is complete and every rank file is present and well-formed; reads no
    tensor data. ``tag=None`` follows ``latest`` (or takes ``checkpoint_dir`` as the tag folder
    when it holds a manifest). ``checkpoint_dir`` may be an fsspec URL, with ``storage_options``
    as for :func:`load`.
    """
    checkpoint_dir = _load_location(checkpoint_dir, storage_options, "read_manifest", "checkpoint_dir")
    advice = (
        f"(a save with shared=False into each rank's own folder: read_manifest checks every listed file; each rank's "
        f"folder holds the same manifest, {MANIFEST_NAME} in the tag folder, plain JSON: read it with json.load)"
    )
    with (
        url_access(_url_of(checkpoint_dir), "read_manifest"),
        _private_advice(advice),
        open_checkpoint(checkpoint_dir, tag, verify=True) as ckpt,
    ):
        return dict(ckpt.manifest, tag_dir=str(ckpt.tag_dir))


#: How the reader's refusal of a tag that lacks files its manifest lists ends: advice for the verbs that take
#: ``shared=`` (a private save's folder holds only its ranks' files).
_SHARED_ADVICE = (
    "(a save with shared=False into each rank's own folder: load it with shared=False, or merge the folders first)"
)


@contextlib.contextmanager
def _private_advice(advice: str) -> Iterator[None]:
    """For a verb without ``shared=`` (``read_manifest``, ``buffers.load_buffers``): the reader's refusal of a tag
    missing listed files ends with ``advice`` (what works for it) instead of "load it with shared=False"."""
    try:
        yield
    except IncompleteCheckpointError as e:
        text = str(e)
        if not text.endswith(_SHARED_ADVICE):
            raise
        raise IncompleteCheckpointError(text[: -len(_SHARED_ADVICE)] + advice) from None


def load(
    engine: Any,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    timeout: float | None = None,
    out: EmaState | None = None,
    shared: bool = True,
    include: SelectionLike = None,
    exclude: SelectionLike = None,
    storage_options: dict[str, Any] | None = None,
) -> EmaState:
    """Rebuild this rank's EMA state from a checkpoint written by :func:`save`. Collective.

    Works at any world size and ZeRO stage, and across engines: when they match the saved ones each
    rank reads its own file; otherwise each rank reads just the slices of the saved pieces that
    overlap its new pieces. The step and the EMA dtype are restored as saved (an fp32 EMA stays fp32),
    and the state is laid out like :func:`functional_ema.init_ema`'s, so :func:`functional_ema.update`
    keeps its fused path. Call it before or after the engine's own checkpoint load (it only reads the
    engine's parameter layout).

    Args:
        engine: the training object to load for (a DeepSpeed engine, an FSDP2, DDP or plain model).
        load_dir: the checkpoint directory (as for ``engine.load_checkpoint``), or a tag folder; or an
            fsspec URL of one (``s3://bucket/run``, ``gs://...``; ``pip install 'functional-ema[s3]'`` for
            ``s3://``), read in place with ranged reads: each rank fetches the pointer file, the manifest
            (validated first) and only the byte ranges of the pieces it loads, every byte checked against
            the manifest's checksums; nothing is listed or copied to local disk (docs/many-nodes.md).
        tag: the tag; ``None`` reads ``load_dir/latest`` like DeepSpeed, or, where DeepSpeed wrote no
            ``latest`` (FSDP2, plain and DDP models), ``load_dir/ema_latest``, which :func:`save` writes.
        dtype: the EMA dtype you expect; ``None`` accepts the saved one. A different value raises
            rather than casting silently.
        verify: check the checksums of every byte read (the default).
        timeout: seconds to wait for every rank to call ``load`` (as for :func:`save`).
        out: a state of this rank to read into instead of allocating a new one (e.g. the one
            ``init_ema`` made before resuming): its EMA buffers are overwritten in place and the
            returned state shares them, so peak memory stays at one state and no fresh memory is
            faulted in. It must hold the saved number of EMAs, in the saved dtype, with this rank's
            pieces (same names and sizes); that is checked on every rank before any byte is read. If
            the load fails after reading began (a checksum mismatch), ``out``'s values are partly
            overwritten (the error says so): discard it. Its ``step`` tensor is set to the saved step in
            place too, last, once every value is in on every rank (as :func:`functional_ema.update` writes
            it), so ``out`` and the returned state agree; a failed load leaves it as it was.
        shared: ``False`` for a save made with ``save(..., shared=False)`` and read from each rank's own
            folder: this rank's folder may lack the other ranks' files; those it reads must be there (at
            the world size and layout of the save, its own). At another world size merge the folders
            first and load the merged one (``shared=True``). The ranks agree on the manifest they read,
            so a node's stale folder is refused.
        include, exclude: the selection the EMA was saved with (as for :func:`functional_ema.local_shards`;
            default: ``out``'s, else every parameter). Other selected names than the saved ones are refused
            (``CheckpointMismatchError`` naming them and both selections).
        storage_options: for a URL ``load_dir``, fsspec's arguments (``key``, ``secret``,
            ``endpoint_url``, ...); ``None`` uses fsspec's configuration (``FSSPEC_S3_*`` variables, the
            filesystem's own, e.g. ``AWS_*``). Refused for a local folder. A store refusing them (a wrong
            key or secret) fails the load on every rank with :class:`CheckpointIOError` naming the rank, the
            URL and ``load(storage_options=...)``.

    Returns:
        ``EmaState`` with ``step`` and ``num_emas`` as saved and this rank's pieces (``out``'s
        buffers and step tensor when given).

    Raises:
        CheckpointError: on every rank, with the reason, as one of its subclasses
            ``CheckpointNotFoundError``, ``IncompleteCheckpointError``, ``CorruptCheckpointError``,
            ``CheckpointVersionError``, ``CheckpointMismatchError``. Nothing on disk is modified. A
            checkpoint saved with another model-parallel layout (tensor-parallel size, pipeline stages)
            is joined and re-cut for this rank's part where every split is known, else refused with
            ``CheckpointMismatchError`` naming the parameter.
        TypeError: ``out`` is not an ``EmaState`` or holds tensors a load cannot fill in place.
        TypeError, ValueError: ``out.step`` cannot take the saved step in place (not a one-element int64 tensor
            on a real device, or an inference tensor outside inference mode); before any byte is read.

    Example:
        >>> engine.load_checkpoint("ckpt")                        # doctest: +SKIP
        >>> state = fe.load(engine, "ckpt")                       # doctest: +SKIP
        >>> state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.999)  # doctest: +SKIP
        >>> state = fe.load(engine, "ckpt", out=state)            # doctest: +SKIP  (into its own buffers)
        >>> state = fe.load(engine, "s3://bucket/run")            # doctest: +SKIP  (ranged reads, in place)
    """
    return load_checkpoint(
        engine,
        load_dir,
        tag,
        dtype=dtype,
        verify=verify,
        timeout=timeout,
        out=out,
        shared=shared,
        include=include,
        exclude=exclude,
        storage_options=storage_options,
    ).state


def _load_location(load_dir: Any, storage_options: Any, verb: str, what: str = "load_dir") -> Path | StoragePath:
    """``load_dir`` (the argument ``what`` of ``verb``) checked: a local folder, or a URL read in place through the
    storage seam (with ``storage_options``; fsspec and the filesystem's package imported now, else an error naming
    the extra). ``storage_options`` with a local folder are refused."""
    location = check_location(load_dir, what)
    options = check_storage_options(storage_options, location, f"{verb}(storage_options=...)")
    if isinstance(location, StoragePath) and not options:
        return location  # already opened (with its own filesystem and options)
    if isinstance(location, str):
        return StoragePath(storage_for(location, **options))
    return location


@contextlib.contextmanager
def url_access(url: str | None, verb: str, rank: int | None = None) -> Iterator[None]:
    """The storage at ``url`` refusing access (a wrong key or secret: s3fs's bare ``PermissionError('Forbidden')``)
    re-raised naming the URL and ``verb``'s ``storage_options``; a local file's error (it has a filename) as is.

    ``rank``: for a collective verb, a :class:`CheckpointIOError` naming the rank instead, which the verb's
    agreement raises on every rank (a bare ``OSError`` there would only say "could not access a checkpoint file")."""
    try:
        yield
    except PermissionError as e:
        why = access_refused(e, verb) if url is not None else None
        if why is None:
            raise
        if rank is None:
            raise PermissionError(f"{url}: {why}") from e
        err = CheckpointIOError(f"rank {rank} could not read {url}: {why}")
        err.errno = e.errno  # only errno, as io_error: OSError.__str__ would drop the message otherwise
        raise err from e


def _url_of(location: Path | StoragePath) -> str | None:
    return location if isinstance(location, StoragePath) else None


class Loaded(NamedTuple):
    """What :func:`load_checkpoint` read, from one opening of one checkpoint (one generation)."""

    state: EmaState
    buffers: Any  # a functional_ema.buffers.BufferState, or None (not asked for)
    manifest: dict  # the validated manifest: step, generation, schedules, extra, ...


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    timeout: float | None = None,
    out: EmaState | None = None,
    buffers: bool = False,
    shared: bool = True,
    include: SelectionLike = None,
    exclude: SelectionLike = None,
    storage_options: dict[str, Any] | None = None,
) -> Loaded:
    """:func:`load`, and with ``buffers=True`` this rank's module buffers saved with it, plus the
    validated manifest (its ``extra`` record), all from one opening of the checkpoint. Collective."""
    if out is not None and not isinstance(out, EmaState):
        raise TypeError(f"load(out=...) takes an EmaState (from fe.init_ema or fe.load), got {type(out).__name__}")
    if dtype is not None:
        check_ema_dtype(dtype)
    verify = check_bool(verify, "verify")
    buffers = check_bool(buffers, "buffers")
    local = not check_bool(shared, "shared")
    load_dir = _load_location(load_dir, storage_options, "load")
    timeout_s(timeout)  # checked now: a bad timeout is refused before any wait
    adapter = adapter_for(engine)
    selection = make_selection(include, exclude) or selection_of(out)  # checked before any collective
    reading = select(adapter.read(), selection, adapter.module())
    layout, job = reading.layout, job_of(reading)
    arrive("load", job.group, job.world, job.rank, timeout)
    box: dict[str, Any] = {}
    opened = contextlib.ExitStack()

    # A storage refusing this rank's credentials: named (the URL, load's storage_options) on every rank.
    access = functools.partial(url_access, _url_of(load_dir), "load", job.rank)

    @access()
    def open_and_check() -> dict[str, Any]:
        ckpt = box["ckpt"] = opened.enter_context(open_checkpoint(load_dir, tag, verify, layout, local=local))
        try:
            _refuse_mismatch(ckpt, layout, selection, dtype)
        except CheckpointMismatchError as e:
            _note_frozen(e, ckpt, layout, adapter.module())
            raise
        if out is not None:
            box["target"] = _load_target(out, ckpt, layout, reading.shards)
        return load_record(ckpt, layout, not layout.part.whole)

    @access()
    def run() -> None:
        ckpt = box["ckpt"]
        if (ckpt.world_size, ckpt.stage) != (layout.world_size, layout.stage):
            logger.info(
                "functional_ema: resharding EMA saved at world_size=%d stage=%d for world_size=%d stage=%d",
                ckpt.world_size,
                ckpt.stage,
                layout.world_size,
                layout.stage,
            )
        bstate = None
        if buffers:
            from ._buffers import loaded_buffer_state, persistent_buffers

            bstate = loaded_buffer_state(persistent_buffers(adapter.module()), layout, ckpt, verify)
        box["reading"] = True  # from here, out= may be partly overwritten
        state = _fill_state(ckpt, layout, reading.shards, box.get("target"), verify)
        box["loaded"] = Loaded(state, bstate, dict(ckpt.manifest, tag_dir=str(ckpt.tag_dir)))

    with opened:
        # Every rank opens its copy of the checkpoint and checks it; then one small agreement (bounded by
        # timeout=): any failure, or ranks that read different saves (a stale node-local copy, another tag),
        # refuse on every rank before a byte of the EMA is read.
        agree_on(
            "load",
            open_and_check,
            LOAD_FIELDS,
            job.group,
            job.world,
            job.rank,
            timeout=timeout,
            fix="Every rank must read the same complete save: on node-local disks copy one save of the tag to every "
            "node (or load from shared storage), and pass the same tag everywhere",
        )
        if len(manifest_parts(box["ckpt"].manifest)) > 1:  # the same on every rank: agreed above (save, layout)
            _refuse_untaken(box["ckpt"], layout, job)
        try:
            agree("load", run, job.group, job.world, job.rank, results=False)
        except Exception as e:
            if out is not None and box.get("reading"):
                _add_note(
                    e,
                    f"The state passed as out= was partly overwritten on rank {layout.rank} before the failure: "
                    "discard it (load into a fresh state, or without out=)",
                )
            raise
        if out is not None:  # every value is in, on every rank: out's step last, in place, as update writes it
            out.step.fill_(box["ckpt"].step)
            box["loaded"] = box["loaded"]._replace(state=EmaState(out.step, box["loaded"].state.emas))
    return box["loaded"]


#: What every rank of a :func:`load` must read alike: the tag, which save of it (its generation and a
#: digest of its manifest, which lists every file's checksums), and what the save holds: the selection
#: (the include/exclude it averages, as its manifest records it; None: every parameter) named apart from
#: the layout its parameter count changes, so ranks reading saves of other selections are told so.
LOAD_FIELDS = ("tag", "step", "num_emas", "dtype", "selection", "layout", "generation", "save")


def load_record(ckpt: CheckpointReader, layout: ShardLayout, across_parts: bool) -> dict[str, Any]:
    """This rank's :data:`LOAD_FIELDS` of the opened checkpoint ``ckpt``, read for ``layout``."""
    manifest = ckpt.manifest
    return {
        "tag": ckpt.tag,
        "step": ckpt.step,
        "generation": manifest.get("generation"),
        "save": f"manifest #{value_digest(manifest):016x}",
        "num_emas": ckpt.num_emas,
        "dtype": dtype_name(ckpt.dtype),
        "selection": manifest.get("selection"),  # absent: every parameter
        "layout": layout_record(layout, across_parts),
    }


def _load_target(out: EmaState, ckpt: CheckpointReader, layout: ShardLayout, shards: Shards) -> tuple:
    """``out.emas``, checked as the destination of ``ckpt``'s EMAs for this rank's pieces (``shards``: the
    reading loaded into)."""
    problem = state_problem(
        out,
        layout.specs,
        layout.rank,
        num_emas=ckpt.num_emas,
        dtype=ckpt.dtype,
        source=f"tag {ckpt.tag!r}",
        contiguous=True,
        shards=shards,
    )
    if problem:
        raise problem.error(
            CheckpointMismatchError,
            f"load(out=...) on rank {layout.rank}",
            "Pass a state made for this model and checkpoint, or load without out= (restores it as saved)",
        )
    # The saved step is written into out.step once every value is in: refused now, before any byte is read, if it
    # cannot hold it
    check_step_tensor(out.step, "load(out=...): out.step", "init_ema", "functional_ema.load")
    if out.step.is_inference() and not torch.is_inference_mode_enabled():
        refuse_inference("load(out=...): out.step")
    return out.emas


def _note_frozen(e: BaseException, ckpt: Any, layout: ShardLayout, module: torch.nn.Module) -> None:
    """Add to a refused load the fix where saved EMAs are of parameters this model holds frozen (a resume with the
    parameters frozen as they were at the save): a reading leaves out what is frozen when it is first made."""
    saved = getattr(ckpt, "shapes", {})
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad and n in saved and n not in layout.specs]
    if frozen:
        _add_note(
            e,
            f"{short_list(frozen, 4)} are parameters of this model, frozen now: a model is read with the parameters "
            "trainable when it is first read (a parameter frozen later stays in the EMA). When resuming a run that "
            "froze them, read the model before freezing them: fe.load(model, ...) (or fe.local_shards(model)) before "
            'requires_grad_(False), as at the start of the run (docs/core.md, "What is averaged")',
        )


def _add_note(e: BaseException, note: str) -> None:
    """Append ``note`` to ``e``'s message (a note where the message is not one string, on Python 3.11+)."""
    if len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]}\n{note}",)
    elif hasattr(e, "add_note"):
        e.add_note(note)


# ------------------------------------------------------------------------------------- consolidate


def consolidate(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    index: int = 0,
    verify: bool = True,
    tp_dims: dict[str, int | None] | None = None,
    tp_rank: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Full EMA weights from a checkpoint, offline: no process group, no GPU, no DeepSpeed engine.

    A checkpoint of a model split by pipeline and tensor parallelism is joined: every stage's
    parameters, each tensor-parallel parameter concatenated from its slices along the dimension the
    engine recorded (DeepSpeed AutoTP, Megatron's ``partition_dim``) or ``tp_dims`` gives.

    Args:
        checkpoint_dir: the checkpoint directory (holding ``latest`` and tag folders), or a tag folder;
            or an fsspec URL of one (``s3://bucket/run``), read in place with ranged reads.
        tag: the tag; ``None`` reads ``checkpoint_dir/latest`` like DeepSpeed's ``zero_to_fp32.py``,
            else ``checkpoint_dir/ema_latest`` (written by :func:`save` once a tag is complete).
        index: which EMA (``state.emas[index]`` at save time).
        verify: check the checksums of every byte read.
        tp_dims: ``{name: dim}`` (``None`` for a parameter replicated across tensor-parallel ranks):
            how the slices of a tensor-parallel checkpoint join, where the engine recorded no split
            (a plain ``mpu=``). Where a split was recorded, an entry must agree with it (a contradicting
            dim, a dim the parameter lacks or an unknown name: :class:`CheckpointMismatchError` naming the
            parameter, the recorded dim and the given one).
        tp_rank: instead of joining, return this tensor-parallel rank's slices as they are.
        storage_options: for a URL ``checkpoint_dir``, fsspec's arguments (``key``, ``secret``,
            ``endpoint_url``, ...) as for :func:`load`; ``None``: fsspec's configuration. Refused with a
            local folder.

    Returns:
        ``{parameter name: tensor of its full shape}`` in the EMA dtype, names as in
        ``module.named_parameters()`` (trained parameters only: frozen and not-optimized ones have
        no EMA; load with ``module.load_state_dict(weights, strict=False)``). Bitwise equal to
        :func:`functional_ema.gather_full` of the saved state. Holds the whole EMA in memory; to
        write a file with memory near one tensor use :func:`consolidate_to_file` or the CLI.

    Raises:
        CheckpointMismatchError: a tensor-parallel checkpoint whose split is unknown (pass ``tp_dims``
            or ``tp_rank``), or ``index`` / ``tp_rank`` out of range.

    Example:
        >>> weights = fe.consolidate("ckpt")                      # doctest: +SKIP
        >>> missing, unexpected = model.load_state_dict(weights, strict=False)  # doctest: +SKIP
    """
    checkpoint_dir = _load_location(checkpoint_dir, storage_options, "consolidate", "checkpoint_dir")
    with (
        url_access(_url_of(checkpoint_dir), "consolidate"),
        open_joined(checkpoint_dir, tag, verify, tp_dims, tp_rank) as ckpt,
    ):
        return consolidate_opened(ckpt, index, verify)


def consolidate_opened(ckpt: JoinedReader, index: int, verify: bool) -> dict[str, torch.Tensor]:
    """:func:`consolidate` of a checkpoint already opened (so other reads come from the same files)."""
    ckpt.check_index(index)
    out = {name: _memory.empty(shape, dtype=ckpt.dtype) for name, shape in ckpt.shapes.items()}
    jobs = [(t.view(-1), index, name, 0, t.numel()) for name, t in out.items()]
    fill_all(ckpt, jobs, verify, threads=_io.io_threads(shared=False))  # offline: every core of this process
    return out


class _Progress(Protocol):
    """What a progress bar is used for (a ``tqdm`` bar, or :func:`_progress`'s silent stand-in)."""

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


def _progress(total: int, enabled: bool | None, desc: str) -> _Progress:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
        except ImportError:  # pragma: no cover - tqdm comes with deepspeed
            pass

    class _Null:
        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    return _Null()


#: What to do instead of writing a consolidated file to a URL.
_LOCAL_OUTPUT = (
    "the file is written locally (atomically); upload it afterwards (functional_ema.export.to_hf reads a "
    "consolidated .safetensors file at a URL)"
)


def consolidate_to_file(
    checkpoint_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    tag: str | None = None,
    *,
    index: int = 0,
    verify: bool = True,
    progress: bool | None = None,
    overwrite: bool = False,
    tp_dims: dict[str, int | None] | None = None,
    tp_rank: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """Stream full EMA weights into one safetensors file, holding about one tensor in memory.

    The header (every name, shape and offset, known from the manifest) is written first, then each
    parameter is assembled from its saved pieces (and, for a tensor-parallel checkpoint, its slices)
    and written before the next one is read. Peak memory is the largest single parameter in the EMA
    dtype (plus one tensor-parallel slice), and a few 4 MiB checksum chunks when a piece is read
    partially; never the whole model. The file appears atomically at ``out_path`` when complete
    (temporary file, fsync, rename).

    Args:
        checkpoint_dir, tag, index, verify, tp_dims, tp_rank, storage_options: as for :func:`consolidate`
            (``checkpoint_dir`` may be a URL).
        out_path: the local ``.safetensors`` file to write (replaced atomically if it exists and
            ``overwrite``). A path inside the checkpoint being read (its tag folders, ``latest``)
            is refused with :class:`OutputPathError`, symlinks resolved; a URL is refused (write
            locally, then upload: the export reads a consolidated file at a URL).
        progress: show a progress bar; ``None`` shows one when stderr is a terminal.
        overwrite: replace an existing ``out_path``; ``False`` (the default, as the CLI without ``--overwrite``, the
            post-hoc ``posthoc_to_file`` and ``export.to_hf``) refuses it, naming ``overwrite=True``.

    Returns:
        ``out_path``. Its metadata records the source tag, step, EMA index and schedule; its names
        are the module's parameter names, so ``safetensors.torch.load_file`` then
        ``module.load_state_dict(..., strict=False)`` restores the EMA weights.

    Example:
        >>> fe.consolidate_to_file("ckpt", "ema.safetensors")     # doctest: +SKIP

    Command line: ``python -m functional_ema consolidate ckpt ema.safetensors [--tag T] [--index K]``.
    """
    out_path = check_path(out_path, "out_path", url_hint=_LOCAL_OUTPUT)
    overwrite = check_bool(overwrite, "overwrite")
    if progress is not None:
        check_bool(progress, "progress")
    checkpoint_dir = _load_location(checkpoint_dir, storage_options, "consolidate_to_file", "checkpoint_dir")
    with (
        url_access(_url_of(checkpoint_dir), "consolidate_to_file"),
        open_joined(checkpoint_dir, tag, verify, tp_dims, tp_rank) as ckpt,
    ):
        ckpt.check_index(index)
        # a checkpoint at a URL: nothing local to keep the output out of (the output is a local file)
        check_output(out_path, ckpt.root, [ckpt.tag_dir] if isinstance(ckpt.tag_dir, Path) else [], overwrite)
        schedules = ckpt.manifest.get("schedules")
        meta = {
            "format": CONSOLIDATED_FORMAT,
            "format_version": str(FORMAT_VERSION),
            "library": f"functional_ema {library_version()}",
            "tag": ckpt.tag,
            "step": str(ckpt.step),
            "ema_index": str(index),
            "schedule": json.dumps(schedules[index] if schedules else None),
            "saved_world_size": str(ckpt.world_size),
            "saved_zero_stage": str(ckpt.stage),
        }
        if tp_rank is not None:
            meta["tp_rank"] = str(tp_rank)
        if ckpt.manifest.get("selection") is not None:  # the include/exclude the EMA averages (absent: every parameter)
            meta["selection"] = json.dumps(ckpt.manifest["selection"])
        entries = [(name, ckpt.dtype, shape) for name, shape in ckpt.shapes.items()]
        itemsize = ckpt.dtype.itemsize
        total = sum(math.prod(s) for s in ckpt.shapes.values()) * itemsize
        bar = _progress(total, progress, f"consolidate {ckpt.tag}")
        try:
            # One buffer, the size of the largest parameter, reused for each (faulted in once).
            buffer = _memory.empty(max((math.prod(s) for s in ckpt.shapes.values()), default=0), dtype=ckpt.dtype)
            # the file checks itself; without overwrite, a file that appeared at out_path meanwhile is kept (exclusive commit)
            with _io.StreamingWriter(out_path, entries, meta, self_checksums=True, replace=overwrite) as w:
                for name, shape in ckpt.shapes.items():
                    full = buffer[: math.prod(shape)]
                    ckpt.fill(full, index, name, 0, full.numel(), verify)  # checked before it is written
                    w.write(name, full)
                    bar.update(full.numel() * itemsize)
                w.commit()
        finally:
            bar.close()
    return out_path


class SavedParts(NamedTuple):
    """How a checkpoint's model was split (see :func:`saved_parts`)."""

    tp_size: int  # tensor-parallel size (1: none)
    pp_size: int  # pipeline stages (1: none)
    tp_split_known: bool  # every tensor-parallel parameter's split dimension was recorded


def saved_parts(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, *, storage_options: dict[str, Any] | None = None
) -> SavedParts:
    """The model-parallel layout a checkpoint was saved with, from its validated manifest and the rank
    files' headers (no tensor data read; the headers' checksummed layout records are what a manifest
    edited to hide a recorded split is caught by): e.g. to decide whether a consolidation can join
    tensor-parallel slices. ``checkpoint_dir`` may be an fsspec URL, with ``storage_options`` as for :func:`load`."""
    where = _load_location(checkpoint_dir, storage_options, "saved_parts", "checkpoint_dir")
    with url_access(_url_of(where), "saved_parts"):
        readers = open_parts(where, tag)
    try:
        first = readers[0].part
        known = first.tp_size == 1 or all(r.tp_dims is not None for r in readers)
        return SavedParts(first.tp_size, first.pp_size, known)
    finally:
        for r in readers:
            r.close()
