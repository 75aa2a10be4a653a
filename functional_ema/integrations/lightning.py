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
  removed with it when ``ModelCheckpoint`` rotates checkpoints (a ``<ckpt>.ema`` beside a folder checkpoint is not
  the callback's, and stays). With ``async_save=True`` the EMA save in flight is completed before a checkpoint is
  removed (on every rank that calls ``remove_checkpoint``, as ``ModelCheckpoint`` does; no collective for shared local
  folders), so a rotation never leaves the run without a complete EMA. A file checkpoint that ``ModelCheckpoint``
  later replaces by a symbolic link (``save_last="link"``, which removes the file itself) loses the EMA folder this
  callback wrote beside it at the next batch or the end of training (rank 0; only what the callback wrote). A
  ``file://`` checkpoint path is its local path. With ``shared=False`` (folders the ranks
  do not share: Ray Train's ``RayTrainReportCallback`` saves into each worker's own folder) each rank writes
  beside its own path, not rank 0's. Lightning's callback hooks are not
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
``fit(ckpt_path="s3://...")``, and removed with the checkpoint when ``ModelCheckpoint`` rotates it (the objects
under ``<ckpt>.ema/`` only, through :mod:`functional_ema._storage`). The credentials come from fsspec's
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
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from functional_ema._checkpoint.errors import CheckpointError, CheckpointMismatchError, IncompleteCheckpointError
from functional_ema._checkpoint.format import LATEST_NAME, MANIFEST_NAME
from functional_ema._state import EmaState
from functional_ema._storage import file_url_path, is_url, remove_tree, storage_for
from functional_ema.schedules import DecayLike

from ._common import EMAController, agreed_everywhere, check_folder_tag, expected_ema_step, has_saved_ema

__all__ = ["EMACallback", "ema_dir_for"]

# The folders and extension-less files Lightning writes into a folder checkpoint, beside the EMA's tag folder: the
# DeepSpeed strategy's (its tag "checkpoint", zero_to_fp32.py; "latest" is refused for every tag by check_tag) and a distributed checkpoint's (FSDP's
# sharded state, ModelParallelStrategy: torch.distributed.checkpoint's .metadata and __<rank>_<n>.distcp files, and
# meta.pt, refused by check_folder_tag's ending rule).
_LIGHTNING_FOLDERS = re.compile(r"checkpoint|zero_to_fp32|\.metadata|__\d+_\d+\.distcp")

# Set on a trainer whose save_checkpoint/remove_checkpoint this callback wrapped (setup() runs once per stage).
_WRAPPED_ATTR = "_functional_ema_wrapped"


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


def _remove_own_ema(folder: Path, tag: str) -> None:
    """What this callback wrote into ``folder`` (a checkpoint's ``<ckpt>.ema``): the tag folder, and the library's
    ``ema_latest`` pointer beside it; then ``folder`` itself when that left it empty. Anything else stays."""
    if folder.is_symlink() or not folder.is_dir():
        return
    if (folder / tag).is_dir() and not (folder / tag).is_symlink():
        shutil.rmtree(folder / tag, ignore_errors=True)
    if (folder / LATEST_NAME).is_file():
        (folder / LATEST_NAME).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: something else lives there, and stays
        folder.rmdir()


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


def _remove_url_ema(ckpt_url: str) -> None:
    """The EMA objects this callback wrote beside the checkpoint ``ckpt_url`` (under ``<ckpt>.ema/``), and
    nothing else: the prefix is walked through the storage seam, each object removed by its exact name."""
    remove_tree(storage_for(ckpt_url.rstrip("/") + ".ema"))


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
                save(filepath, *args, **kwargs)
                self._saved_ema(
                    trainer, path, self.ema.save(self._target(trainer), ema_dir_for(path), trainer.global_step)
                )
            finally:
                if swapped:
                    self._swap_in(trainer)
            self._last_saved = path

        def remove_checkpoint(filepath: str | Path) -> None:
            # ModelCheckpoint removes the old checkpoint right after saving the new one: that order is crash-safe only
            # once the new one's EMA is complete, so the save in flight (async_save) is completed first.
            self._wait_in_flight(os.fspath(filepath))
            # Asked before the checkpoint goes: whether it is a file (its EMA beside it, this callback's) or a
            # folder (its EMA inside it, removed with it).
            sibling = _ema_beside(filepath) if trainer.is_global_zero else None
            if trainer.is_global_zero:
                self._beside.discard(_local_key(filepath))
            remove(filepath)
            if isinstance(sibling, str):
                _remove_url_ema(sibling.removesuffix(".ema"))
            elif sibling is not None and sibling.is_dir():
                shutil.rmtree(sibling, ignore_errors=True)

        # Instance attributes shadowing the methods, on purpose: the hooks are not told the checkpoint path.
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]  # wrapped per trainer instance
        strategy.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]  # wrapped per strategy instance
        setattr(trainer, _WRAPPED_ATTR, self)

    def _saved_ema(self, trainer: pl.Trainer, path: str, where: Path | str) -> None:
        """After the EMA save of the checkpoint ``path`` into ``where``: what the removals and the link check need."""
        if self.ema.async_save:
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
        the commit is collective: ``ModelCheckpoint`` removes on every rank, as Lightning's ``remove_checkpoint`` is
        meant to be called. A failure is raised before anything is removed, so the checkpoint before stays whole."""
        if self._in_flight is None:
            return
        (path, step), self._in_flight = self._in_flight, None
        try:
            self.ema.wait()
        except Exception as e:
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
                _remove_own_ema(Path(key + ".ema"), self.ema.tag)
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
        self._drop_linked_over(trainer)  # a link made by the last saves
