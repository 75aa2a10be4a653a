"""PyTorch Lightning callback: EMA under DDP, FSDP2 (``ModelParallelStrategy``) and DeepSpeed.

Example::

    import lightning as L
    from functional_ema.integrations.lightning import EMACallback

    ema = EMACallback(decay=0.999, export_path="out/ema.safetensors")
    trainer = L.Trainer(strategy="ddp", callbacks=[ema, L.pytorch.callbacks.ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path=...)   # resuming loads the EMA saved with that checkpoint

Per Lightning event:

* ``on_train_batch_end``: after each batch, ``update`` at ``trainer.global_step``: it moves only
  when the optimizer stepped (within gradient accumulation the step is unchanged: a no-op);
* validation: ``on_validation_epoch_start`` swaps the EMA weights in (the model's own validation
  metrics are then the EMA's), ``on_validation_epoch_end`` swaps them out (also on an exception); a
  validation before the EMA starts (``start_step``) runs with the live weights, under the same metric names:
  warned once (``UserWarning``); ``trainer.test`` alike (``on_test_epoch_start`` / ``on_test_epoch_end``);
* ``validate``/``test(ckpt_path=...)`` outside ``fit``: ``on_validation_start`` / ``on_test_start`` load the EMA
  saved beside that checkpoint, which stays the callback's EMA afterwards; without one there, the live weights
  are evaluated, with a ``UserWarning`` naming the checkpoint;
* saving: every ``trainer.save_checkpoint`` (``ModelCheckpoint`` included) also writes every rank's
  EMA pieces: inside the checkpoint folder when the checkpoint is a folder (DeepSpeed,
  distributed FSDP2 checkpoints: ``<ckpt>/ema/``), else beside the file (``<ckpt>.ema/ema/``),
  removed with it when ``ModelCheckpoint`` rotates checkpoints, also one an earlier process saved (a resumed run), but
  only the files this library's save writes there, by their exact names (crash-left temporaries of them included),
  and only when the tag folder verifiably holds such a save (a valid manifest or not-started record, or a rank file
  with the library's header): a user's folder, or a user's file of any other name, stays, with a ``UserWarning``; a
  ``<ckpt>.ema`` beside a folder checkpoint is not the callback's, and stays. With ``async_save=True`` the EMA save in
  flight is completed before a checkpoint is removed (by ``ModelCheckpoint``, which removes on every rank; no
  collective for shared local folders), so a rotation never leaves the run without a complete EMA. A removal from
  elsewhere (``trainer.strategy.remove_checkpoint`` from a rank-0-only callback or ``CheckpointIO``) while a
  ``shared=False`` or URL save awaits its commit, which is collective, is put off until that commit (the next save,
  rotation, or the end of ``fit``), with a ``UserWarning`` once: until then one checkpoint more than asked is on disk
  (a save before the EMA starts awaits no commit: its removals are done at once). A file checkpoint that
  ``ModelCheckpoint`` later replaces by a symbolic link (``save_last="link"``, which removes the file itself) loses
  the EMA folder saved beside it (by this process, or an earlier one for the checkpoint resumed from or
  ``last_model_path``) at the next batch or the end of training (rank 0; only what the library wrote).
  A ``file://`` checkpoint path is its local path. With ``shared=False`` (folders the ranks
  do not share: Ray Train's ``RayTrainReportCallback`` saves into each worker's own folder) each rank writes
  beside its own path, not rank 0's, and a ``ModelCheckpoint`` rotation inside its saves (which run on every rank)
  removes each rank's EMA folder beside its own path (Lightning removes the checkpoint on rank 0 only, first; by the
  same rules, on every rank together; a removal made on some ranks only fails there with ``CheckpointTimeoutError``
  after ``FUNCTIONAL_EMA_TIMEOUT``, removing nothing). Other removals (a subclass's own ``_remove_checkpoint`` call,
  a rank-0-only callback) and the ``save_last="link"`` cleanup act on rank 0's path alone: another rank's own
  ``<ckpt>.ema`` (its ``last.ckpt.ema`` once rank 0 links ``last.ckpt``) stays. Lightning's callback hooks are not
  told the checkpoint path, so the callback wraps this trainer's ``save_checkpoint`` and its
  strategy's ``remove_checkpoint`` (instance attributes, set up in ``setup``). A save while the EMA is swapped
  in writes the live weights (swapped out for the save, in again after it). A save after an optimizer step and
  before this callback's ``on_train_batch_end`` (from a callback listed before it) first updates the EMA for
  that step, with the weights that step made, as ``on_train_batch_end`` would (automatic optimization; under
  manual optimization it is refused, before Lightning writes anything);
* ``on_train_start`` of ``fit(ckpt_path=...)``: load the EMA saved with that checkpoint (any world
  size: it reshards);
* ``on_train_end``: optional export to one safetensors file, or copy into the model.

Checkpoints in a bucket: with ``ModelCheckpoint(dirpath="s3://bucket/run")`` (any fsspec URL; Lightning writes
there through fsspec) the EMA is saved at ``<ckpt>.ema/ema/`` under the same prefix, read back from there by
``fit(ckpt_path="s3://...")``, and removed with the checkpoint when ``ModelCheckpoint`` rotates it (under
``<ckpt>.ema/``, through :mod:`functional_ema._storage`, by the same rules as a local folder: only the objects of a
verified EMA save, by their exact names; a user's object there stays, with a ``UserWarning``). The credentials come from fsspec's
configuration, which Lightning reads too (``FSSPEC_S3_KEY``, ``FSSPEC_S3_SECRET``, ``FSSPEC_S3_ENDPOINT_URL``, or
s3fs's own, e.g. ``AWS_*``).

The training object is ``trainer.strategy.model``: the ``DeepSpeedEngine``, the DDP wrapper, or
the LightningModule with ``fully_shard`` applied. Lightning's ``DeepSpeedStrategy`` runs only on CUDA
(it refuses CPU in ``setup_environment``); this callback's DeepSpeed path is tested on CPU with a
test-only subclass that lifts the check.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from functional_ema._checkpoint.bucket import _OLD_MARKER_NAME as OLD_BUCKET_MARKER
from functional_ema._checkpoint.bucket import MARKER_NAME as BUCKET_MARKER
from functional_ema._checkpoint.collective import TIMEOUT_ENV, agree, agree_on
from functional_ema._checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointTimeoutError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from functional_ema._checkpoint.format import (
    ASYNC_MARKER,
    BUFFER_FILE,
    FILE_FORMAT,
    GENERATION_NAME,
    LATEST_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    PENDING_MANIFEST_NAME,
    RANK_FILE,
    RECORD_NAME,
    is_own_tmp,
    read_record,
    short_list,
)
from functional_ema._checkpoint.private import MARKER_PREFIX
from functional_ema._checkpoint.reader import CheckpointReader, StoragePath
from functional_ema._io import SafetensorsFile
from functional_ema._state import EmaState
from functional_ema._storage import Storage, file_url_path, is_url, storage_for
from functional_ema.schedules import DecayLike

from ._common import (
    EMAController,
    agreed_everywhere,
    check_folder_tag,
    expected_ema_step,
    has_saved_ema,
    read_record_at,
)

__all__ = ["EMACallback", "ema_dir_for"]

# The folders and extension-less files Lightning writes into a folder checkpoint, beside the EMA's tag folder: the
# DeepSpeed strategy's (its tag "checkpoint", zero_to_fp32.py; "latest" is refused for every tag by check_tag) and a distributed checkpoint's (FSDP's
# sharded state, ModelParallelStrategy: torch.distributed.checkpoint's .metadata and __<rank>_<n>.distcp files, and
# meta.pt, refused by check_folder_tag's ending rule).
_LIGHTNING_FOLDERS = re.compile(r"checkpoint|zero_to_fp32|\.metadata|__\d+_\d+\.distcp")

# Set on a trainer whose save_checkpoint/remove_checkpoint this callback wrapped (setup() runs once per stage).
_WRAPPED_ATTR = "_functional_ema_wrapped"

# The ModelCheckpoint methods (Lightning 2.x) that its hooks call on every rank alike, and that remove the checkpoint
# they replace (_save_topk_checkpoint through _save_monitor_checkpoint/_update_best_and_save, or
# _save_none_monitor_checkpoint). Only a removal inside them is taken as one of every rank's: a subclass may call
# _remove_checkpoint on rank 0 alone (rank-zero-only housekeeping).
_EVERY_RANK_SAVES = ("_save_topk_checkpoint", "_save_last_checkpoint", "_save_none_monitor_checkpoint")

# The marker a shared=False save leaves for a moment in its tag folder (private.folder_group): ".ema_present.", the
# save's token (16 hex digits), the rank (6 digits or more). Matched exactly: a user's ".ema_present.notes" is not one.
_PRIVATE_MARKER = re.compile(re.escape(MARKER_PREFIX) + r"[0-9a-f]{16}\.\d{6,}")


def ema_dir_for(ckpt_path: str | os.PathLike) -> Path | str:
    """Where the EMA of a Lightning checkpoint lives: inside it when it is a folder, else beside it. For a
    checkpoint at a URL (``s3://bucket/run/epoch=0-step=8.ckpt``), the URL of that place (a ``str``): the
    storage is asked whether the checkpoint is a folder (a prefix) or an object. A local symbolic link (``last.ckpt``
    of ``ModelCheckpoint(save_last="link")``, which Lightning links to a checkpoint without saving it) is resolved to
    its target: the EMA was saved beside the checkpoint it points to. A ``file://`` URL (``file:///abs/x.ckpt``,
    which Lightning reads through fsspec) is its local path."""
    if isinstance(ckpt_path, str) and is_url(ckpt_path):
        url = ckpt_path.rstrip("/")
        return url if _url_is_folder(url) else url + ".ema"
    p = _local(ckpt_path)
    if p.is_symlink():
        p = p.resolve()
    return p if p.is_dir() else p.with_name(p.name + ".ema")


def _local(path: str | os.PathLike) -> Path:
    """A local checkpoint path, a ``file://`` URL mapped to the path it names (``ValueError`` for one naming another
    host)."""
    local = file_url_path(path) if isinstance(path, str) else None
    return Path(path if local is None else local)


def _ema_beside(ckpt_path: str | os.PathLike) -> Path | str | None:
    """The folder this callback writes beside the checkpoint ``ckpt_path`` (``<ckpt>.ema``; a URL's: a ``str``),
    asked before the checkpoint is removed; ``None`` when the checkpoint is a folder (DeepSpeed, a distributed
    checkpoint): its EMA is inside it, removed with it, and a ``<ckpt>.ema`` beside it is someone else's."""
    path = os.fspath(ckpt_path)
    if is_url(path):
        url = path.rstrip("/")
        return None if _url_is_folder(url) else url + ".ema"
    p = _local(path)
    return None if p.is_dir() else p.with_name(p.name + ".ema")


def _local_key(ckpt_path: str | os.PathLike) -> str:
    """How :attr:`EMACallback._beside` names a checkpoint: its absolute local path (a URL of a storage: as given)."""
    path = os.fspath(ckpt_path)
    return path.rstrip("/") if is_url(path) else os.path.abspath(_local(path))


def _is_library_save(tag_dir: Path, names: set[str]) -> bool:
    """Whether the folder ``tag_dir`` (holding ``names``) verifiably holds an EMA save of this library, by the
    library's own readers: a valid manifest (one of a newer library's format too), a valid not-started record
    (checksummed), or a rank file (its exact name) whose header says it is this library's EMA file (a save cut off
    before its manifest leaves rank files). A file merely named like one proves nothing."""
    if MANIFEST_NAME in names and _own_manifest(tag_dir / MANIFEST_NAME):
        return True
    if RECORD_NAME in names and _own_record(tag_dir / RECORD_NAME):
        return True
    for name in sorted(n for n in names if RANK_FILE.match(n)):
        with contextlib.suppress(OSError, ValueError):  # not a readable safetensors file (FormatError): no proof
            if SafetensorsFile(tag_dir / name).metadata.get("format") == FILE_FORMAT:
                return True
    return False


def _own_manifest(path: Path) -> bool:
    """Whether ``path`` is a manifest of this library: read and validated by its reader (a newer library's, which
    this one cannot load, counts: it is this library's save all the same)."""
    try:
        CheckpointReader._read_manifest(path)
    except CheckpointVersionError:
        return True
    except (CheckpointError, OSError):
        return False
    return True


def _own_record(path: Path) -> bool:
    """Whether ``path`` is the library's not-started record: read by its reader (checksum verified) and of an
    integration."""
    try:
        record = read_record(path)
    except (CorruptCheckpointError, OSError):
        return False
    return record is not None and record.get("integration") == 1


def _is_own_name(tag_dir: Path, name: str) -> bool:
    """Whether ``name`` in a verified tag folder is a file a save writes there, by its exact name (the library's own
    cleanup rules, ``writer._cleanup``): rank and buffer files, the manifest (and its pending copy), the lock, the
    not-started record when it is a valid one, async markers, shared=False folder markers, and the temporaries of
    those names. A user's file of any other name (``ema_notes.tmp-1``, an ``integration.json`` of theirs) is not."""
    if RANK_FILE.match(name) or BUFFER_FILE.match(name) or name in (MANIFEST_NAME, PENDING_MANIFEST_NAME, LOCK_NAME):
        return True
    if name == GENERATION_NAME:  # the generation a save took (writer.TagLock.take_generation)
        return True
    if name == RECORD_NAME:
        return _own_record(tag_dir / name)
    return (
        is_own_tmp(name, (MANIFEST_NAME, PENDING_MANIFEST_NAME, RECORD_NAME, GENERATION_NAME))
        or ASYNC_MARKER.fullmatch(name) is not None
        or _PRIVATE_MARKER.fullmatch(name) is not None
    )


def _library_files(tag_dir: Path) -> list[Path] | None:
    """The files in ``tag_dir`` that this library's saves write, by exact name (:func:`_is_own_name`), when
    ``tag_dir`` is a real folder that verifiably holds an EMA save (:func:`_is_library_save`). ``None`` otherwise:
    nothing there is this library's to remove."""
    if tag_dir.is_symlink() or not tag_dir.is_dir():
        return None
    try:
        entries = list(tag_dir.iterdir())
    except OSError:
        return None
    if not _is_library_save(tag_dir, {e.name for e in entries}):
        return None
    return [e for e in entries if _is_own_name(tag_dir, e.name) and e.is_file() and not e.is_symlink()]


def _remove_companion(folder: Path, tag: str) -> list[str]:
    """Remove the EMA folder beside a removed file checkpoint (``<ckpt>.ema``), whichever process saved it, but only
    what this library's save writes there, and only when it verifiably is such a save (:func:`_library_files`): the
    tag folder's files, the tag folder once empty, the ``ema_latest`` pointer; then ``folder`` once empty. A folder of
    the same name that is not an EMA save (a user's), or a user's file in one, stays. Returns the names still in
    ``folder`` (empty: it is gone, or never was)."""
    if not folder.exists() and not folder.is_symlink():
        return []
    if folder.is_symlink() or not folder.is_dir():
        return [folder.name]  # not a folder a save makes
    own = _library_files(folder / tag)
    if own is not None:
        for f in own:
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: a file of someone else's stays, with its folder
            (folder / tag).rmdir()
        for name in _names_in(folder):  # the ema_latest pointer, and a crash-left temporary of it
            path = folder / name
            if (name == LATEST_NAME or is_own_tmp(name, (LATEST_NAME,))) and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: something else lives there, and stays
        folder.rmdir()
    return _names_in(folder)


def _names_in(folder: Path) -> list[str]:
    """The names in ``folder``; none when it is gone (also removed meanwhile by a rank that shares it)."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _complete_ema_beside(ckpt: Path, tag: str) -> list[str]:
    """The file checkpoints in ``ckpt``'s folder (``*.ckpt``, not links) with a complete EMA beside them (a manifest),
    other than ``ckpt``: what a refused resume from ``ckpt`` can resume from instead. Asked on that error only."""
    try:
        names = sorted(os.listdir(ckpt.parent))
    except OSError:
        return []
    return [
        str(ckpt.parent / n)
        for n in names
        if n.endswith(".ckpt")
        and n != ckpt.name
        and not (ckpt.parent / n).is_symlink()
        and (ckpt.parent / f"{n}.ema" / tag / MANIFEST_NAME).is_file()
    ]


def _url_is_folder(url: str) -> bool:
    """Whether the checkpoint at ``url`` is a folder (a prefix holding objects), asked of the storage now."""
    parent, _, name = url.rpartition("/")
    store = storage_for(parent)
    return store.file_size(name) is None and bool(store.listdir(name))


def _on_every_rank(inner: Callable[..., Any], callbacks: list[EMACallback]) -> Callable[..., Any]:
    """``inner`` (a ``ModelCheckpoint`` method of :data:`_EVERY_RANK_SAVES`) with each of ``callbacks`` told, while it
    runs, that a removal now is every rank's (their ``_every_rank``; put back as it was after: these methods nest)."""

    def every_rank(*args: Any, **kwargs: Any) -> Any:
        before = [(c, c._every_rank) for c in callbacks]
        for c, _ in before:
            c._every_rank = True
        try:
            return inner(*args, **kwargs)
        finally:
            for c, was in before:
                c._every_rank = was

    setattr(every_rank, _WRAPPED_ATTR, callbacks)
    return every_rank


def _removal_stalled(path: str, rank: int, limit: float, waited: float, e: Exception) -> CheckpointTimeoutError:
    """The error of a ``shared=False`` removal inside ``ModelCheckpoint``'s saves that the other ranks did not join."""
    return CheckpointTimeoutError(
        f"EMACallback(shared=False): rank {rank} waited {waited:.1f} s (limit {limit:g} s, {TIMEOUT_ENV}) for the "
        f"other ranks to remove the rotated checkpoint {path} with it, and they did not ({type(e).__name__}: {e}). "
        "With shared=False each rank removes its own EMA folder, so ModelCheckpoint's removals inside its saves "
        "(_save_topk_checkpoint, _save_last_checkpoint) run on every rank together; this one was decided on some "
        "ranks only (a metric in the checkpoint's name that differs between ranks: log it with sync_dist=True; or a "
        "subclass that removes on some ranks from those methods). Nothing was removed"
    )


def _remove_url_ema(ckpt_url: str, tag: str) -> list[str]:
    """The EMA objects a save of this library wrote beside the checkpoint ``ckpt_url`` (under ``<ckpt>.ema/``),
    whichever process saved them, removed by their exact names (:func:`_url_library_objects`), as
    :func:`_remove_companion` does for a local folder: a user's object under that prefix stays. Returns the names
    still directly under the prefix (empty: nothing is left there)."""
    store = storage_for(ckpt_url.rstrip("/") + ".ema")
    for rel in _url_library_objects(store, tag):
        store.remove(rel)
    return store.listdir()


def _url_library_objects(store: Storage, tag: str) -> list[str]:
    """The objects of ``store`` (the ``<ckpt>.ema`` prefix) that this library's saves write, by exact name, when its
    tag holds verifiably such a save (:func:`_is_url_library_save`; a failed save's marker alone is one): the rank
    and buffer files (those its manifest lists, and a failed save's leftovers of those names), the manifest, a valid
    not-started record, the save markers (``.ema_store.<token>.gen<N>``), and ``ema_latest`` beside the tag. ``[]``
    otherwise."""
    names = store.listdir(tag)
    if not _is_url_library_save(store, tag, names):
        return []
    own = [
        f"{tag}/{n}"
        for n in names
        if RANK_FILE.match(n)
        or BUFFER_FILE.match(n)
        or n == MANIFEST_NAME
        or BUCKET_MARKER.fullmatch(n)
        or OLD_BUCKET_MARKER.fullmatch(n)
        or (n == RECORD_NAME and _own_url_record(store, f"{tag}/{n}"))
    ]
    # listed entries may be prefixes ("folders" of a user's objects): only objects are removed
    own = [rel for rel in own if store.file_size(rel) is not None]
    return own + ([LATEST_NAME] if store.file_size(LATEST_NAME) is not None else [])


def _is_url_library_save(store: Storage, tag: str, names: list[str]) -> bool:
    """:func:`_is_library_save` of a tag at a URL, by the same readers: a valid manifest, a valid not-started record,
    a rank file whose header says it is this library's, or a valid save marker (:func:`_own_url_marker`)."""
    if MANIFEST_NAME in names and _own_url_manifest(store, f"{tag}/{MANIFEST_NAME}"):
        return True
    if RECORD_NAME in names and _own_url_record(store, f"{tag}/{RECORD_NAME}"):
        return True
    for name in sorted(n for n in names if RANK_FILE.match(n)):
        with contextlib.suppress(OSError, ValueError):  # not a readable safetensors object: no proof
            if SafetensorsFile((store, f"{tag}/{name}")).metadata.get("format") == FILE_FORMAT:
                return True
    return any(_own_url_marker(store, tag, n) for n in names if BUCKET_MARKER.fullmatch(n))


def _own_url_marker(store: Storage, tag: str, name: str) -> bool:
    """Whether ``name`` in ``tag`` is the marker rank 0 of a save at a URL publishes (``bucket._claim_generation``):
    named ``.ema_store.<token>.gen<N>`` and holding exactly that token. A failed save whose late rank may still
    upload keeps it, for the tag's next commit to remove (``bucket.abandon_bucket``); Lightning saves each
    checkpoint's tag once, so no commit comes and the marker can be all that is left: proof enough to remove it.
    An object merely named like one (other content) proves nothing."""
    m = BUCKET_MARKER.fullmatch(name)
    if m is None:
        return False
    token, rel = m.group(1).encode(), f"{tag}/{name}"
    try:  # the size first: a large object of that name is not read
        return store.file_size(rel) == len(token) and store.read_bytes(rel) == token
    except (OSError, ValueError):  # unreadable: no proof
        return False


def _own_url_manifest(store: Storage, rel: str) -> bool:
    """:func:`_own_manifest` of the object ``rel``: read and validated by the library's reader."""
    try:
        size = store.file_size(rel)
        if size is None:
            return False
        CheckpointReader._parse_manifest(StoragePath(store, rel), size, lambda: store.read_bytes(rel))
    except CheckpointVersionError:
        return True
    except (CheckpointError, OSError):
        return False
    return True


def _own_url_record(store: Storage, rel: str) -> bool:
    """Whether the object ``rel`` is the library's not-started record (checksum verified), of an integration."""
    try:
        record = read_record_at(StoragePath(store, rel))
    except (CorruptCheckpointError, OSError):
        return False
    return record is not None and record.get("integration") == 1


class EMACallback(pl.Callback):
    """EMA of the weights for a ``lightning.Trainer``; see the module docstring.

    Args:
        decay: one decay (float, schedule or callable) or a sequence, one per EMA.
        **kwargs: ``every_n_steps``, ``start_step``, ``buffers``, ``eval_index``, ``posthoc_dir``,
            ``posthoc_every``, ``export_path``, ``copy_to_model``, ``tag``, ``async_save``, ``dtype``,
            ``include``, ``exclude`` (which parameters are averaged, by name): as for
            ``functional_ema.integrations._common.EMAController``.
    """

    def __init__(self, decay: DecayLike | Sequence[DecayLike] = 0.9999, **kwargs: Any) -> None:
        self.ema = EMAController(decay, **kwargs)
        check_folder_tag(
            self.ema.tag, _LIGHTNING_FOLDERS, "Lightning", "DeepSpeed's checkpoint/ and latest, meta.pt, .metadata"
        )
        self._swap: contextlib.ExitStack | None = None
        self._last_saved: str | None = None
        self._warned_live = False  # a validation before the EMA started was warned about (once)
        self._loaded_meta: dict[str, Any] | None = None  # this callback's state in the checkpoint being restored
        self._live_run = False  # this validate/test run's checkpoint has no EMA: it evaluates the live weights
        self._seen_step: int | None = None  # the step on_train_batch_end last gave the EMA (inside fit)
        # async_save: the checkpoint path and step of the last EMA save not yet waited for (every rank alike)
        self._in_flight: tuple[str, int] | None = None
        # Rank 0: the local file checkpoints this callback wrote an EMA beside (<path>.ema), still there as files;
        # one that becomes a symbolic link (save_last="link") has its EMA folder removed (_drop_linked_over).
        self._beside: set[str] = set()
        self._link_check_due = False  # a save since the last _drop_linked_over
        # Removals asked outside ModelCheckpoint (maybe on this rank alone) while the save in flight awaited a collective
        # commit (shared=False, a URL): (checkpoint, the strategy's own removal), done once that save is committed.
        self._deferred: list[tuple[str, Callable[[str], None]]] = []
        self._every_rank = False  # inside a ModelCheckpoint's removal: it runs on every rank
        self._warned_deferred = False

    @property
    def state(self) -> EmaState | None:
        """This rank's :class:`functional_ema.EmaState` (``None`` before the EMA starts)."""
        return self.ema.state

    @staticmethod
    def _target(trainer: pl.Trainer) -> Any:
        model = trainer.strategy.model
        return model if model is not None else trainer.lightning_module

    # ----------------------------------------------------------------------------------- wiring

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Per run, before Lightning restores its checkpoint: no metadata of an earlier run's checkpoint is kept.
        self._loaded_meta, self._live_run, self._seen_step = None, False, None
        for saves in trainer.checkpoint_callbacks:
            self._mark_every_rank(saves)
        if getattr(trainer, _WRAPPED_ATTR, None) is self:
            return
        save, strategy = trainer.save_checkpoint, trainer.strategy
        remove = strategy.remove_checkpoint

        def save_checkpoint(filepath: str | Path, *args: Any, **kwargs: Any) -> None:
            # Shared folders: rank 0's path, where Lightning writes the checkpoint. Private ones (shared=False):
            # each rank's own path, the folder that rank hands on (Ray's RayTrainReportCallback: one per worker).
            # Every rank broadcasts either way, so ranks configured apart reach the save, which refuses them.
            rank0_path = os.fspath(trainer.strategy.broadcast(filepath))
            path = rank0_path if self.ema.shared else os.fspath(filepath)
            # A save during the EMA evaluation (a callback's epoch-end hook, a validation_step) writes the live
            # weights, not the EMA's; the evaluation then goes on with the EMA.
            swapped = self._swap is not None
            self._unswap()
            try:
                self._catch_up(trainer, filepath)  # before Lightning writes: a refusal leaves nothing behind
                self._deferred = [d for d in self._deferred if _local_key(d[0]) != _local_key(filepath)]  # saved anew
                save(filepath, *args, **kwargs)
                try:
                    where = self.ema.save(self._target(trainer), ema_dir_for(path), trainer.global_step)
                except BaseException:
                    self._deferred = []  # their removal waited for a save that failed: they stay, whole
                    raise
                if self.ema.started or self._in_flight is None:
                    # The async saves before this one are committed (a failed one raised), or none was in flight (a
                    # save before the EMA starts writes a record alone, at once): what waited for them goes now.
                    self._drain(trainer)
                self._saved_ema(trainer, path, where)
            finally:
                if swapped:
                    self._swap_in(trainer)
            self._last_saved = path

        def remove_checkpoint(filepath: str | Path) -> None:
            path = os.fspath(filepath)
            if self._must_defer():
                self._defer(path, remove)
                return
            # ModelCheckpoint removes the old checkpoint right after saving the new one: that order is crash-safe only
            # once the new one's EMA is complete, so the save in flight (async_save) is completed first.
            self._wait_in_flight(path)
            self._drain(trainer)
            self._remove(trainer, remove, path, every_rank=self._every_rank)

        # Instance attributes shadowing the methods, on purpose: the hooks are not told the checkpoint path.
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]  # wrapped per trainer instance
        strategy.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]  # wrapped per strategy instance
        setattr(trainer, _WRAPPED_ATTR, self)

    def _mark_every_rank(self, saves: Any) -> None:
        """A removal inside a ``ModelCheckpoint``'s saves (:data:`_EVERY_RANK_SAVES`) runs on every rank (its hooks
        call them on every rank), so it may commit the async save in flight collectively (``_wait_in_flight``) and,
        with ``shared=False``, remove every rank's EMA folder together (``_remove_private``); its other removals (a
        subclass's, maybe on rank 0 alone) are taken as one rank's (``_must_defer``). Marked by wrapping those methods
        (instance attributes, as ``save_checkpoint``) once, for every ``EMACallback`` of its trainers."""
        if not isinstance(saves, pl.callbacks.ModelCheckpoint):
            return
        for name in _EVERY_RANK_SAVES:
            inner = getattr(saves, name, None)
            if inner is None:
                continue
            marked = getattr(inner, _WRAPPED_ATTR, None)
            if isinstance(marked, list):  # wrapped already (a stage before, another EMACallback)
                if not any(m is self for m in marked):
                    marked.append(self)
                continue
            setattr(saves, name, _on_every_rank(inner, [self]))

    def _must_defer(self) -> bool:
        """Whether a removal asked now must wait for a commit it cannot run: an async save is in flight whose commit is
        collective (``shared=False``, a URL), and the call is not a ``ModelCheckpoint``'s (which removes on every
        rank): a caller on rank 0 alone (a rank-0-only callback, a ``CheckpointIO`` acting on rank 0) would wait for
        ranks that never come to the commit, then fail."""
        if self._in_flight is None or self._every_rank:
            return False
        return not self.ema.shared or is_url(self._in_flight[0])

    def _defer(self, path: str, remove: Callable[[str], None]) -> None:
        """Keep the checkpoint ``path`` (and its EMA) until the save in flight is committed, then remove it
        (``_drain``): the run is never left without a checkpoint whose EMA is complete."""
        self._deferred.append((path, remove))
        if self._warned_deferred or self._in_flight is None:
            return
        self._warned_deferred = True
        saving, step = self._in_flight
        warnings.warn(
            f"EMACallback: strategy.remove_checkpoint({path!r}) was called outside ModelCheckpoint while the async EMA "
            f"save of step {step} beside {saving} awaits its commit, which is collective (shared=False or a URL) and "
            "cannot run in a call that may come from rank 0 alone. The checkpoint is kept until that save is committed "
            "(the next trainer.save_checkpoint on every rank, a ModelCheckpoint rotation, or the end of fit), and "
            "removed then, so that the run always holds a checkpoint with a complete EMA: after the next save, one "
            "checkpoint more than your removals leave is on disk until it returns (allow the disk space for it). "
            "Warned once",
            UserWarning,
            stacklevel=3,
        )

    def _drain(self, trainer: pl.Trainer) -> None:
        """The removals deferred (``_defer``) until the async save then in flight was committed: it is, now."""
        todo, self._deferred = self._deferred, []
        for path, remove in todo:
            self._remove(trainer, remove, path)  # asked on this rank alone, maybe: no collective

    def _remove(self, trainer: pl.Trainer, remove: Callable[[str], None], path: str, every_rank: bool = False) -> None:
        """Remove the checkpoint ``path`` (the strategy's own ``remove``) and the EMA folder saved beside it.
        ``every_rank``: the removal runs on every rank (a ``ModelCheckpoint``'s), so with ``shared=False`` each rank's
        own EMA folder goes too (:meth:`_remove_private`)."""
        if every_rank and not self.ema.shared:
            self._remove_private(trainer, remove, path)
            return
        # Asked before the checkpoint goes: whether it is a file (its EMA beside it) or a folder (its EMA inside it,
        # removed with it).
        sibling = _ema_beside(path) if trainer.is_global_zero else None
        if trainer.is_global_zero:
            self._beside.discard(_local_key(path))
        remove(path)
        if isinstance(sibling, str):
            self._warn_left(path, sibling, _remove_url_ema(sibling.removesuffix(".ema"), self.ema.tag))
        elif sibling is not None:
            self._drop_companion(path, sibling)

    def _remove_private(self, trainer: pl.Trainer, remove: Callable[[str], None], path: str) -> None:
        """``shared=False``, a ``ModelCheckpoint``'s removal (on every rank, each with its own ``path``): Lightning
        removes the checkpoint on rank 0 only, so each rank removes the EMA folder beside its own path, by the library's
        exact names (``_remove_companion``). Every rank asks first, before rank 0 removes anything, whether its
        checkpoint is a folder (its EMA inside it: Lightning's to remove) or a file: once a folder a rank shares with
        rank 0 is gone, it would take a ``<ckpt>.ema`` beside it, which is not the callback's, for the EMA's. Ranks
        that share a folder (a node's, on node-local disks) remove it together: removals by exact name whose target
        may already be gone, so none fails; what is left is read once every rank is done, and warned about.
        Collective (a bounded arrival, then two small all-reduces); a failure anywhere raises on every rank."""
        joined = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if joined else (1, 0)
        sibling = _ema_beside(path)  # shared=False takes no URL: a local path
        # Bounded: the ranks' arrival. A removal decided on some ranks only (a metric in the file name that differs
        # between ranks) fails on them after the timeout, nothing removed, instead of hanging; past it every rank is
        # here, and the removals, however long, are waited for without a bound.
        agree_on(
            "EMACallback: removing a rotated checkpoint (shared=False)",
            dict,
            (),
            None,
            world,
            rank,
            stalled=lambda t, waited, e: _removal_stalled(path, rank, t, waited, e),
        )
        if trainer.is_global_zero:
            self._beside.discard(_local_key(path))
        # The checkpoint first, in its own step: no rank's EMA goes while the checkpoint it belongs to is still there.
        agree(
            "EMACallback: removing a rotated checkpoint's file (shared=False)",
            lambda: remove(path),
            None,
            world,
            rank,
            False,
        )

        def drop() -> None:  # a folder checkpoint (no sibling) held its EMA: gone with it. Every rank takes the step.
            if isinstance(sibling, Path):
                _remove_companion(sibling, self.ema.tag)

        agree("EMACallback: removing a rotated checkpoint's EMA (shared=False)", drop, None, world, rank, False)
        if isinstance(sibling, Path):
            self._warn_left(path, sibling, _names_in(sibling))

    def _drop_companion(self, ckpt: str, folder: Path) -> None:
        """The EMA folder beside the removed file checkpoint ``ckpt`` (saved by this process or an earlier one), only
        as far as it verifiably is this library's (``_remove_companion``); what stays is warned about."""
        self._warn_left(ckpt, folder, _remove_companion(folder, self.ema.tag))

    def _warn_left(self, ckpt: str, folder: Path | str, left: list[str]) -> None:
        """Warn of what stays in the EMA folder ``folder`` of the removed checkpoint ``ckpt``: not the library's."""
        if left:
            warnings.warn(
                f"EMACallback: the checkpoint {ckpt} is removed, but {folder} beside it holds {short_list(left)}, which "
                f"this library did not write there (not an EMA save of tag {self.ema.tag!r}): it was left in place. "
                "Remove it yourself if it is not needed, or keep such files out of <checkpoint>.ema",
                UserWarning,
                stacklevel=2,
            )

    def _saved_ema(self, trainer: pl.Trainer, path: str, where: Path | str) -> None:
        """After the EMA save of the checkpoint ``path`` into ``where``: what the removals and the link check need."""
        if self.ema.async_save and self.ema.started:
            # Written in the background (a save before the EMA starts writes its not-started record at once: nothing
            # in flight, so no removal waits for it: _must_defer)
            self._in_flight = (path, int(trainer.global_step))
        local = None if is_url(path) else _local(path)
        if (
            trainer.is_global_zero
            and local is not None
            and isinstance(where, Path)
            and where.parent == _ema_beside(local)
        ):
            # Beside a local file checkpoint (inside a folder one, Lightning's removal of the folder takes it).
            self._beside.add(_local_key(local))
            self._link_check_due = True

    def _wait_in_flight(self, removing: str) -> None:
        """Before ``removing`` a checkpoint (``async_save``): wait for the EMA save in flight, on this rank. For a shared
        local folder this is no collective: rank 0's save completes once every rank's file is in (it writes the
        manifest last), and every rank's wait fails alike when one rank's write failed. For ``shared=False`` or a URL
        the commit is collective: run here only for ``ModelCheckpoint``, which removes on every rank (another caller's
        removal waits for the next collective point: ``_must_defer``). A failure is raised before anything is removed, so the checkpoint before stays whole."""
        if self._in_flight is None:
            return
        (path, step), self._in_flight = self._in_flight, None
        try:
            self.ema.wait()
        except Exception as e:
            self._deferred = []  # removals put off until this save: they stay too
            raise CheckpointError(
                f"EMACallback: the async EMA save of step {step} beside the checkpoint {path} failed ({type(e).__name__}: "
                f"{e}), so that checkpoint holds no complete EMA. The checkpoint it was to replace, {removing}, was not "
                "removed: resume from it"
            ) from e

    def _drop_linked_over(self, trainer: pl.Trainer) -> None:
        """``ModelCheckpoint(save_last="link")`` may replace a file checkpoint this callback saved (``last.ckpt``, saved
        as a file when no top-k checkpoint was saved since the resume) by a symbolic link, removing the file itself
        (``_link_checkpoint``, not ``remove_checkpoint``): the EMA folder beside it is nobody's now (a resume from the
        link reads the EMA beside the link's target), and is removed here, after the save that preceded the link.
        Rank 0, which removes checkpoints; only what this callback wrote; not while that EMA is still being written."""
        if not self._link_check_due or not trainer.is_global_zero:
            return
        self._link_check_due = False
        busy = None if self._in_flight is None else _local_key(self._in_flight[0])
        for key in sorted(self._beside):
            if key == busy:
                self._link_check_due = True  # checked again once its save is waited for
            elif os.path.islink(key):
                self._beside.discard(key)
                self._drop_companion(key, Path(key + ".ema"))
            elif not os.path.exists(key):
                self._beside.discard(key)  # removed by something else: what is beside it is not decided here

    def state_dict(self) -> dict[str, Any]:
        # Only small metadata goes into Lightning's checkpoint: the pieces are per-rank files.
        return {
            "ema_step": None if self.ema.state is None else int(self.ema.state.step),
            "num_emas": self.ema.num_emas,
            "tag": self.ema.tag,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded_meta = dict(state_dict)

    # ----------------------------------------------------------------------------------- events

    def _catch_up(self, trainer: pl.Trainer, filepath: str | Path) -> None:
        """Before a save: an optimizer step this callback's ``on_train_batch_end`` has not seen yet (the save comes
        from a callback listed before it, or the module's ``training_step``) is given to the EMA now, with the
        weights it made, as ``on_train_batch_end`` would (it is then a no-op for that step). Under automatic
        optimization only: there one optimizer step makes one global step, and the weights stay as it left them
        until the batch ends. Under manual optimization (several steps per batch, weights changed afterwards) the
        save is refused, before Lightning writes anything."""
        seen, step = self._seen_step, trainer.global_step
        if seen is None or step <= seen:
            return
        if step == seen + 1 and trainer.lightning_module.automatic_optimization:
            self.ema.on_step(self._target(trainer), step)
            self._seen_step = step
            return
        if expected_ema_step(step, self.ema.start_step, self.ema.every_n_steps) == expected_ema_step(
            seen, self.ema.start_step, self.ema.every_n_steps
        ):
            return  # the rules leave the EMA where it is at this step: what is saved is the uninterrupted run's
        raise RuntimeError(
            f"trainer.save_checkpoint({os.fspath(filepath)!r}) at global step {step}: the optimizer stepped since "
            f"EMACallback last updated the EMA (at step {seen}), and its on_train_batch_end for this step has not "
            "run yet, so the EMA to save with this checkpoint does not exist yet. The save runs before EMACallback's "
            "on_train_batch_end: from a callback listed before EMACallback in Trainer(callbacks=[...]), or from the "
            "LightningModule (manual optimization). List EMACallback before the callback that saves, or save from "
            "on_train_batch_end of a callback listed after it. Nothing was written"
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._adopt_earlier(trainer)
        if trainer.ckpt_path:
            where = ema_dir_for(trainer.ckpt_path)
            try:
                self.ema.load(self._target(trainer), where, framework_step=trainer.global_step)
            except (CheckpointMismatchError, IncompleteCheckpointError) as e:
                hint = self._unfinished_save_hint(os.fspath(trainer.ckpt_path), where, trainer.global_step, e)
                if not hint:
                    raise
                raise type(e)(f"{e}. {hint}") from e
            self._check_own_record(where)
        elif trainer.global_step == 0:
            self.ema.state = self.ema.buffer_state = None

    def _adopt_earlier(self, trainer: pl.Trainer) -> None:
        """Rank 0, at a resume: the file checkpoints an earlier process saved that ``ModelCheckpoint(save_last="link")``
        may replace by a link (the checkpoint resumed from, each ``ModelCheckpoint``'s ``last_model_path``) are watched
        as this process's own saves are (``_drop_linked_over``): their EMA folder goes once they are linked over, as far
        as it verifiably is this library's."""
        if not trainer.is_global_zero:
            return
        known = [trainer.ckpt_path, *(getattr(c, "last_model_path", "") for c in trainer.checkpoint_callbacks)]
        for path in known:
            if not path or is_url(os.fspath(path)):
                continue
            with contextlib.suppress(ValueError):  # a file:// URL naming another host: none of this run's
                local = _local(path)
                if local.is_file() and not local.is_symlink() and local.with_name(local.name + ".ema").is_dir():
                    self._beside.add(_local_key(local))
                    self._link_check_due = True

    def _unfinished_save_hint(self, ckpt: str, where: Path | str, step: int, error: Exception) -> str:
        """For a refused resume from a local file checkpoint: what a stop during the EMA save leaves (an EMA older than
        the checkpoint file, rewritten in place; or an incomplete one), and the checkpoints beside it with a complete
        EMA to resume from instead. Empty when the refusal is something else."""
        if not isinstance(where, Path) or where.suffix != ".ema" or where.with_suffix("").is_dir():
            return ""  # a URL, or a folder checkpoint (its EMA inside it)
        if isinstance(error, IncompleteCheckpointError):
            if not (where / self.ema.tag).is_dir():
                return ""  # no EMA was ever saved there: the refusal says so
            why = (
                f"The EMA saved with {ckpt} is not complete: the process stopped while it was being written (with "
                "async_save=True it is written in the background, after the checkpoint file)"
            )
        else:
            import functional_ema as fe

            try:
                saved = int(fe.checkpoint.read_manifest(where, self.ema.tag)["extra"]["framework_step"])
            except Exception:  # noqa: BLE001 - no record to compare: the refusal stands as it is
                return ""
            if saved >= step:
                return ""
            why = (
                f"{ckpt} was saved at step {step} over a checkpoint of step {saved} (the same name: "
                "ModelCheckpoint(save_last=True)'s last.ckpt, or a filename without the step), and the process stopped "
                f"before the EMA of step {step} was complete (with async_save=True it is written in the background): the "
                f"EMA beside it is still the overwritten checkpoint's"
            )
        others = _complete_ema_beside(where.with_suffix(""), self.ema.tag)
        instead = ", ".join(others) if others else f"none beside it in {where.parent}"
        return f"{why}. Resume from a checkpoint whose EMA is complete ({instead}), or start a new EMA"

    def _check_own_record(self, where: Path | str) -> None:
        """The EMA read from beside the checkpoint must be the one this callback's state in the checkpoint
        itself names (its step): an ``.ema`` folder from another checkpoint is refused, not used."""
        meta = getattr(self, "_loaded_meta", None)
        if meta is None:
            return
        loaded = None if self.ema.state is None else int(self.ema.state.step)
        if meta.get("ema_step") != loaded:
            import functional_ema as fe

            raise fe.checkpoint.CheckpointMismatchError(
                f"resuming the EMA from {where}: the Lightning checkpoint's own EMACallback state says the EMA was at step "
                f"{meta.get('ema_step')} when it was saved, but the EMA files there are at step {loaded}: they belong to "
                "another checkpoint. Restore the EMA folder saved with this checkpoint, or resume from another one"
            )

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.ema.before_optimizer_step(self._target(trainer))  # parameters unfrozen since the last step join the EMA

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._drop_linked_over(trainer)  # a link ModelCheckpoint made after its save at the step before
        self.ema.on_step(self._target(trainer), trainer.global_step)
        self._seen_step = trainer.global_step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load_evaluated_checkpoint(trainer)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load_evaluated_checkpoint(trainer)

    def _load_evaluated_checkpoint(self, trainer: pl.Trainer) -> None:
        """``validate``/``test(ckpt_path=...)`` (not inside ``fit``): Lightning loaded that checkpoint's weights, so
        the EMA saved beside it is the one to evaluate; it replaces the EMA in memory. Without one there (every rank
        must find it), the live weights are evaluated, with a warning: not the EMA of another checkpoint."""
        verb = getattr(trainer.state.fn, "value", trainer.state.fn)  # TrainerFn: "fit", "validate", "test", ...
        if verb not in ("validate", "test") or not trainer.ckpt_path:
            return
        ckpt = os.fspath(trainer.ckpt_path)
        where = ema_dir_for(ckpt)
        saved = agreed_everywhere(has_saved_ema(where, self.ema.tag), "EMACallback: the evaluated checkpoint's EMA")
        if saved:
            self.ema.load(self._target(trainer), where, framework_step=None)  # the step: the EMA's own record's
            self._check_own_record(where)
        if saved and self.ema.started:  # not started: a newer not-started record there superseded that EMA
            return
        self._live_run = self.ema.eval_index is not None
        if self._live_run:
            warnings.warn(
                f"EMACallback: trainer.{verb}(ckpt_path={ckpt!r}) evaluates the live weights: no EMA was "
                f"saved beside that checkpoint (no complete EMA in {where}/{self.ema.tag}: saved before the EMA "
                "started, or without this callback), so its metrics are the live weights', not an EMA's",
                UserWarning,
                stacklevel=2,
            )

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._swap is not None or self._live_run:
            return
        self._warn_live_validation(trainer.global_step)
        self._swap_in(trainer)

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_validation_epoch_start(trainer, pl_module)  # the test evaluates the same EMA as validation

    def _swap_in(self, trainer: pl.Trainer) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.ema.swapped(self._target(trainer)))
        self._swap = stack

    def _warn_live_validation(self, step: int) -> None:
        """Once: a validation before the EMA started evaluates the live weights, under the names the EMA's take."""
        if self.ema.started or self.ema.eval_index is None or self._warned_live:
            return
        self._warned_live = True
        warnings.warn(
            f"EMACallback: the validation at step {step} runs before the EMA starts (start_step={self.ema.start_step}: "
            f"after optimizer step {max(1, self.ema.start_step)}), so it evaluates the live weights, and its metrics "
            "are logged under the same names as the EMA's in the later validations: a ModelCheckpoint(monitor=...) or "
            "EarlyStopping compares the two. Validate only once the EMA has started (e.g. "
            "Trainer(check_val_every_n_epoch=...)), or lower start_step. Warned once",
            UserWarning,
            stacklevel=2,
        )

    def _unswap(self) -> None:
        stack, self._swap = self._swap, None
        if stack is not None:
            stack.close()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unswap()

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unswap()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unswap()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unswap()
        # Lightning's DeepSpeed strategy wraps the LightningModule: export with its own names.
        self.ema.on_train_end(self._target(trainer), strip_prefix="_forward_module.")
        self._in_flight = None  # waited for by on_train_end
        self._drain(trainer)  # removals deferred until the saves in flight were committed: they are now
        self._drop_linked_over(trainer)  # a link made by the last saves
