"""What every framework integration does, written once, with no framework imported.

:class:`EMAController` holds the configuration and this rank's state, and has one method per
moment of training: :meth:`~EMAController.on_step` after each optimizer step (a micro-batch inside
gradient accumulation passes the same step again: a no-op), :meth:`~EMAController.swapped` around
evaluation, :meth:`~EMAController.save` / :meth:`~EMAController.load` beside the framework's
checkpoint, :meth:`~EMAController.export` / :meth:`~EMAController.copy_to_model` at the end. The
callbacks only translate their framework's events and find the training object (a DeepSpeed
engine, an FSDP2 model, a DDP or plain module) that the verbs of :mod:`functional_ema` take.

Files written into a checkpoint folder ``save_dir`` under ``tag`` (default ``"ema"``) by one
:func:`functional_ema.save`::

    save_dir/tag/ema_rank_*_of_*.safetensors     every rank's EMA pieces
    save_dir/tag/buffers_rank_*_of_*.safetensors every rank's buffer EMAs (when buffers= is set)
    save_dir/tag/ema_manifest.json               written last: lists every file with its checksums,
                                                 and the integration's record (``extra``): the
                                                 framework's step and the EMA's rules

Before the EMA has started (``start_step``) there is no EMA to save: rank 0 writes a checksummed
record, ``integration.json``, instead (the framework's step, and the generation of any EMA in that
folder it supersedes).

``save_dir`` / ``load_dir`` may be an fsspec URL (``s3://bucket/run/ckpt``): the same objects under that
prefix, written by :func:`functional_ema.save` (which handles URLs) and read by
:func:`functional_ema.load`; the record goes through the storage seam (:mod:`functional_ema._storage`:
published atomically, read by its exact name). fsspec's own configuration gives the credentials
(``FSSPEC_S3_KEY``, ``FSSPEC_S3_SECRET``, ``FSSPEC_S3_ENDPOINT_URL``, or the filesystem's, e.g. ``AWS_*``),
as it does for the frameworks that write their checkpoints there (Lightning). A URL names one store every
rank reaches: ``shared=False`` with a URL is refused.

Resuming checks, and never guesses: the EMA's step must be the one these rules give for the
framework's step (:func:`expected_ema_step`), the record must belong to the framework's checkpoint,
and nothing unchecked can discard or restart a verified EMA.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import warnings
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist

import functional_ema as fe
from functional_ema import buffers as fb
from functional_ema._api import state_pieces
from functional_ema._args import check_bool, check_int, check_location, check_optional_int, check_path, check_str
from functional_ema._buffers import exact_dtype, split_floating
from functional_ema._checkpoint.bucket import next_generation, store_error, url_storage
from functional_ema._checkpoint.collective import agree, agree_on, arrive, io_error, job_of, timeout_s
from functional_ema._checkpoint.format import (
    MANIFEST_NAME,
    RECORD_NAME,
    check_export_path,
    check_tag,
    manifest_parts,
    read_record,
    record_bytes,
)
from functional_ema._checkpoint.reader import StoragePath, locate_checkpoint
from functional_ema._checkpoint.writer import TagLock, describe_decays, read_generation
from functional_ema._core import check_ema_dtype
from functional_ema._io import atomic_write_bytes, write_tensors
from functional_ema._selection import SelectionLike, make_selection, selection_record
from functional_ema._storage import Storage, is_url, storage_for
from functional_ema._tree import short_list
from functional_ema.checkpoint import Loaded
from functional_ema.engines._base import any_requires_grad, read_for
from functional_ema.schedules import DecayLike, Schedule, check_decays

__all__ = [
    "EMAController",
    "agreed_everywhere",
    "barrier",
    "check_folder_tag",
    "expected_ema_step",
    "grown_state",
    "has_saved_ema",
    "read_record_at",
    "RECORD_NAME",
]

logger = logging.getLogger("functional_ema")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def barrier() -> None:
    """``dist.barrier()`` where a process group is initialised (an integration's ranks line up); nothing on one process."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def expected_ema_step(framework_step: int, start_step: int, every_n_steps: int) -> int | None:
    """The EMA's step after the optimizer step ``framework_step``, under the controller's rules (``None``:
    not started). The EMA starts equal to the weights after the first optimizer step ``>= start_step``
    (optimizer steps count from 1), then moves at the multiples of ``every_n_steps``."""
    first = max(1, int(start_step))
    if framework_step < first:
        return None
    return max(first, (int(framework_step) // int(every_n_steps)) * int(every_n_steps))


# The endings of the files the frameworks write into a checkpoint folder, beside the EMA's tag folder (the HF
# Trainer's model.safetensors, trainer_state.json, optimizer.pt, rng_state.pth, ...; Accelerate's optimizer.bin,
# random_states_0.pkl, custom_checkpoint_0.pkl, ...): a tag with one of them could collide with such a file.
_FILE_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".json", ".txt", ".model", ".jinja", ".md", ".py", ".ckpt", ".pkl"
)  # fmt: skip


def check_folder_tag(tag: str, reserved: re.Pattern[str], framework: str, examples: str) -> str:
    """``tag``: a folder name that none of ``framework``'s own checkpoint files (named like files: an ending of
    :data:`_FILE_SUFFIXES`) or folders (``reserved``, matched whole, case-insensitively) can have. ``examples``: a
    few of the files it writes, for the message."""
    lowered = tag.lower()
    why = None
    if lowered.endswith(_FILE_SUFFIXES):
        why = f"looks like a file name (it ends in {os.path.splitext(lowered)[1]})"
    elif reserved.fullmatch(lowered):
        why = f"is the name of a folder or file {framework} writes under FSDP or DeepSpeed"
    if why is not None:
        raise fe.checkpoint.InvalidTagError(
            f"tag={tag!r} {why}: {framework} writes its own files ({examples}, ...) into each checkpoint folder, "
            "beside the EMA's tag folder, and would collide with a folder of that name. Use a plain folder name such "
            "as the default 'ema'"
        )
    return tag


def agreed_everywhere(flag: bool, what: str) -> bool:
    """``flag`` where every rank of the job found it true (one bounded exchange, named ``what``; the rank alone when
    there is no process group): a decision that leads into a collective (``load``) is taken by every rank alike,
    also when some ranks see another folder (node-local disks) or a file late (a slow shared filesystem)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        agree_on(what, lambda: {"found": flag}, ("found",), None, world, rank)
    except fe.checkpoint.CheckpointMismatchError as disagree:  # raised on every rank alike: an agreed "no"
        logger.info("%s: the ranks did not all find it: %s", what, disagree)
        return False
    return flag


def has_saved_ema(folder: Path | str, tag: str) -> bool:
    """Whether ``folder/tag`` (a local folder or a URL) holds a complete EMA checkpoint (its manifest), asked now."""
    if isinstance(folder, str) and is_url(folder):
        return storage_for(folder.rstrip("/")).file_size(f"{tag}/{MANIFEST_NAME}") is not None
    return (Path(folder) / tag / MANIFEST_NAME).is_file()


#: A checkpoint folder: a local one, or a prefix of a storage (a URL, ``str`` as its messages show it).
Where = Path | StoragePath


class _StoredRecord(StoragePath):
    """A record object at a URL, read by :func:`read_record` as it reads a local file (``stat``, ``read_bytes``):
    its size asked by the exact name (``FileNotFoundError`` when absent), then the object itself."""

    def stat(self) -> SimpleNamespace:
        size = self.size()
        if size is None:
            raise FileNotFoundError(f"{self}: no such file")
        return SimpleNamespace(st_size=size)

    def read_bytes(self) -> bytes:
        return self.store.read_bytes(self.rel)


def read_record_at(path: Where) -> dict | None:
    """:func:`read_record` of a local file or of an object at a URL (checksum verified alike)."""
    if isinstance(path, StoragePath):
        return read_record(cast(Path, _StoredRecord(path.store, path.rel)))
    return read_record(path)


def _is_file(path: Where) -> bool:
    return path.size() is not None if isinstance(path, StoragePath) else path.is_file()


def _url_store(location: str, shared: bool, what: str) -> Storage:
    """The storage of a URL folder, with fsspec's configuration; ``shared=False`` refused naming the URL."""
    return url_storage(location, shared, {}, f"EMAController(shared={shared}).{what}")


def local_folder(value: Any, what: str, framework: str) -> Path:
    """``value`` as a local folder (``check_path``); a URL is refused naming ``what``: ``framework`` writes its
    own checkpoint there with local file I/O, so an EMA in a bucket would not sit beside it."""
    if isinstance(value, str) and is_url(value):
        raise ValueError(
            f"{what}={value!r} is a URL, but {framework} writes its checkpoints into local folders only: the EMA "
            "would not be beside them. Give a local (or mounted) folder, and copy it to the bucket after the save"
        )
    return check_path(value, what)


def _resume_error(where: Where, why: str) -> fe.CheckpointError:
    return fe.checkpoint.CheckpointMismatchError(
        f"resuming the EMA from {where}: {why}. The EMA files do not belong to the checkpoint being resumed (or the "
        "EMA settings changed); resume from the checkpoint they were saved with, or start a new EMA"
    )


class EMAController:
    """One or more EMAs of a model's weights, driven by a training loop's events.

    Args:
        decay: a float, a schedule (:mod:`functional_ema.schedules`) or a callable ``step -> decay``;
            or a sequence of them to track several EMAs at once (one state, read once per update).
        every_n_steps: update at optimizer steps that are multiples of N only; the decay is
            compounded over the skipped steps exactly (``update`` does that).
        start_step: the EMA starts (equal to the weights) after the first optimizer step ``>= start_step``
            that :meth:`on_step` sees. Optimizer steps are numbered from 1, so it starts at a step
            ``>= max(1, start_step)`` whatever the gradient accumulation: step 0 (no optimizer step
            yet, e.g. the first micro-batches of an accumulation) never starts it. Before it there is
            nothing to evaluate, save or export.
        buffers: ``None`` (parameters only), ``"average"`` (an EMA of every floating buffer, with
            the same decays) or ``"copy"`` (the live buffers copied at each update). Integer buffers
            are copied in both modes. See :mod:`functional_ema.buffers`.
        eval_index: which EMA the evaluation swaps in (``None``: evaluate with the live weights).
        posthoc_dir: write post-hoc snapshots (:func:`functional_ema.posthoc.save_snapshot`) into
            this folder every ``posthoc_every`` steps; the decays must be power schedules.
        posthoc_every: snapshot interval in optimizer steps; a multiple of ``every_n_steps`` (a snapshot is
            the EMA at its step, which moves only at the multiples of ``every_n_steps``).
        export_path: at the end of training, write the consolidated EMA ``eval_index`` (parameters,
            tied aliases and buffers) to this safetensors file (rank 0 writes it).
        copy_to_model: at the end of training, copy EMA ``eval_index`` into the model's weights.
        tag: the tag folder name inside each checkpoint folder.
        dtype: EMA dtype (fp32).
        async_save: write the EMA files in the background (:class:`functional_ema.AsyncSaver`):
            :meth:`save` returns after a memory copy of this rank's EMA, the write overlaps the
            training that follows, and a failure is raised at the next :meth:`save`, at
            :meth:`wait`, :meth:`load` or at the end of training. A process that exits waits for
            the write to finish.
        shared: ``False`` when the checkpoint folders are each rank's (or each node's) own: node-local disks,
            the HF Trainer's ``save_on_each_node``, Ray Train's per-worker folders. Saves and resumes then use
            ``save(..., shared=False)`` / ``load(..., shared=False)`` (docs/many-nodes.md); every rank writes
            the not-started record into its own folder. With ``async_save``, a save's files are written in the
            background and committed over the process group at the next :meth:`save`, :meth:`wait`,
            :meth:`load` or the end of training (``AsyncSaver.save(..., shared=False)``).
        include, exclude: which parameters are averaged, by name (as for :func:`functional_ema.local_shards`:
            shell-style patterns or a predicate ``(name) -> bool``; ``exclude`` wins). The others are trained and
            left live by the EMA evaluation, the checkpoint, :meth:`copy_to_model` and the export (which holds
            the selected parameters only: ``fe.export.to_hf`` copies the others from ``--like``). A resume must
            pass the same selection. Patterns are checked against the model's names at the first update.
    """

    def __init__(
        self,
        decay: DecayLike | Sequence[DecayLike] = 0.9999,
        *,
        every_n_steps: int = 1,
        start_step: int = 0,
        buffers: fb.Mode | None = None,
        eval_index: int | None = 0,
        posthoc_dir: str | os.PathLike | None = None,
        posthoc_every: int | None = None,
        export_path: str | os.PathLike | None = None,
        copy_to_model: bool = False,
        tag: str = "ema",
        dtype: torch.dtype = torch.float32,
        async_save: bool = False,
        shared: bool = True,
        include: SelectionLike = None,
        exclude: SelectionLike = None,
    ) -> None:
        # Every argument is checked here, before training starts (not at the first update, hours in).
        self.decays = check_decays(decay, "decay")
        self.every_n_steps = check_int(every_n_steps, "every_n_steps", minimum=1)
        self.start_step = check_int(start_step, "start_step")
        if not (buffers is None or (isinstance(buffers, str) and buffers in ("average", "copy"))):
            raise ValueError(f'buffers must be None, "average" or "copy", got {buffers!r}')
        self.buffers = buffers
        self.eval_index = check_optional_int(eval_index, "eval_index")
        if self.eval_index is not None and self.eval_index >= len(self.decays):
            raise ValueError(f"eval_index={self.eval_index} is not one of the {len(self.decays)} EMAs")
        posthoc_path = None if posthoc_dir is None else check_path(posthoc_dir, "posthoc_dir")
        self.posthoc_every = check_optional_int(posthoc_every, "posthoc_every", minimum=1)
        if (posthoc_path is None) != (self.posthoc_every is None):
            raise ValueError("posthoc_dir and posthoc_every go together: give both or neither")
        if self.posthoc_every is not None and self.posthoc_every % self.every_n_steps:
            # A snapshot is the EMA at its step, and the EMA moves only at multiples of every_n_steps: on_step would
            # skip the other snapshot steps silently (refused, not moved: extra updates would change the EMA).
            both = math.lcm(self.every_n_steps, self.posthoc_every)
            raise ValueError(
                f"posthoc_every={self.posthoc_every} is not a multiple of every_n_steps={self.every_n_steps}: a "
                "snapshot is taken where the EMA moves, so only the common multiples would be written. Give a "
                f"posthoc_every that is a multiple of every_n_steps (e.g. {both})"
            )
        if self.posthoc_every is not None:
            # Post-hoc synthesis needs power EMAs; refuse anything else now, not at the first snapshot
            # (a bare float would be read as a sigma_rel by posthoc.snapshot_gammas).
            bad = [d for d in self.decays if not isinstance(getattr(d, "gamma", None), (int, float))]
            if bad:
                raise TypeError(
                    f"post-hoc snapshots need power EMAs (fe.schedules.power(sigma_rel=...)) for every decay; "
                    f"got {bad!r}"
                )
        self.tag = check_tag(check_str(tag, "tag"))  # a folder name save() accepts, refused now rather than at a save
        self.copy_to_model_at_end = check_bool(copy_to_model, "copy_to_model")
        async_save = check_bool(async_save, "async_save")
        self.shared = check_bool(shared, "shared")
        self.dtype = check_ema_dtype(dtype)  # refused here, not at the first optimizer step
        make_selection(include, exclude)  # the types now; the names at the first local_shards
        self.include, self.exclude = include, exclude
        self.posthoc_dir = posthoc_path
        # Refused now as at the end of training (a folder, a checkpoint's own file), not after the whole run.
        self.export_path = (
            None if export_path is None else check_export_path(check_path(export_path, "export_path"), "export_path")
        )
        self.state: fe.EmaState | None = None
        self.buffer_state: fb.BufferState | None = None
        self._saver = fe.AsyncSaver() if async_save else None
        self._frozen: dict[str, torch.Tensor] = {}  # the model's frozen parameters the state lacks (see _grown)
        self._frozen_of: weakref.ref | None = None  # the reading's shards they were taken with (see _watch_frozen)

    # ------------------------------------------------------------------------------------ helpers

    @property
    def decay(self) -> DecayLike | list[DecayLike]:
        """The ``decay`` argument for :func:`functional_ema.update` (one, or one per EMA)."""
        return self.decays[0] if len(self.decays) == 1 else self.decays

    @property
    def num_emas(self) -> int:
        return len(self.decays)

    @property
    def async_save(self) -> bool:
        """Whether the EMA files are written in the background (``async_save=True``)."""
        return self._saver is not None

    @property
    def started(self) -> bool:
        return self.state is not None

    def _buffer_state(self) -> fb.BufferState:
        """The buffer EMAs, which exist whenever the EMA has started with ``buffers`` set."""
        if self.buffer_state is None:
            raise RuntimeError(
                f"buffers={self.buffers!r} is set but the buffer EMAs were never started (buffer_state is None); "
                "set state and buffer_state together (both None: the EMA restarts)"
            )
        return self.buffer_state

    def _init_buffers(self, x: Any, step: int) -> fb.BufferState:
        """The buffer EMAs started from ``x``'s buffers at ``step``: float32 (as :func:`fb.init_buffers`), or with
        ``buffers="copy"`` a dtype that holds every floating buffer exactly (float64 when one is), so that the copies
        are the live values bitwise from the first step on."""
        floats = split_floating(fb.module_buffers(x))[0]
        dtype = torch.float32
        if self.buffers == "copy":
            dtype = exact_dtype([dtype, *(b.dtype for b in floats.values())])
        return fb.init_buffers(x, num_emas=self.num_emas, step=step, dtype=dtype)

    def _grown(self, shards: Any, late_model: Any = None) -> fe.EmaState | None:
        """The state with the parameters added that were frozen when it began (or was resumed) and are trained
        in ``shards`` now, each EMA of them starting from its current value: what an EMA that had averaged them
        from the start holds, if they did not change while frozen (the EMA of a constant is that constant), and
        unless ``late_model`` (the model) is given: an optimizer step has trained them since (:meth:`on_step` noticing them, which
        warns). ``None`` when ``shards`` differ from the state otherwise (the verbs then refuse it, naming the
        parameter)."""
        have = None if self.state is None else self.state.emas[0]
        if not isinstance(have, fe.Shards) or not isinstance(shards, fe.Shards):
            return None
        names = shards.index.names
        if len(names) <= len(have):  # nothing added (the usual case, at every pre-step check)
            return None
        added = [n for n in names if n not in have]
        if not added or not set(added) <= self._frozen.keys() or len(names) - len(added) != len(have):
            return None
        state = cast(fe.EmaState, self.state)
        grown = grown_state(state, shards, int(state.step), dtype=have[next(iter(have))].dtype)
        what = f"EMA: {short_list(added)}, frozen when the EMA started or resumed, are trained now"
        if late_model is not None:
            warnings.warn(self._late_join_message(late_model, added, what), UserWarning, stacklevel=4)
        else:
            logger.info("%s: they join the EMA from their current values", what)
        self._frozen = {n: p for n, p in self._frozen.items() if n not in added}
        return grown

    def _late_join_message(self, x: Any, added: list[str], what: str) -> str:
        """Why parameters join only after the step that trained them: unfrozen with no pre-step hook called, or new
        parameters (their module replaced since the EMA started, under names frozen then), which no hook watched."""
        live = fe.engines.adapter_for(x).read().params
        replaced = [n for n in added if live.get(n) is not self._frozen.get(n)]
        if replaced:
            return (
                f"EMA: {short_list(replaced)} are new parameters, set since the EMA started under names that were "
                "frozen then (their module replaced), and are trained now: their EMA starts from their values after "
                "the optimizer step that first trained them (nothing watched them before it)"
            )
        return (
            f"{what}; their EMA starts from their values after the optimizer step that first trained them, one "
            "step later than an EMA that had averaged them all along. To add them before that step, call the "
            "EMA's hook before each optimizer step, as the Lightning and Transformers callbacks do: "
            "AcceleratorEMA.before_step(), EMAController.before_optimizer_step(model)"
        )

    def _watch_frozen(self, x: Any, shards: Any) -> None:
        """After an update: when the model was read anew since the frozen parameters were taken (a module replaced,
        say), take them again, so a replaced one is neither kept alive nor watched instead of its successor."""
        if self._frozen and (self._frozen_of is None or self._frozen_of() is not shards):
            self._frozen, self._frozen_of = _frozen_params(x, cast(fe.EmaState, self.state)), weakref.ref(shards)

    def _fit(self, x: Any) -> None:
        """Before a verb that reads the state against the model: add the parameters unfrozen since the last
        update (:meth:`_grown`). Nothing to read when the model had no frozen parameter outside the state."""
        # One C loop over the frozen parameters' flags: nothing read at each step while none is unfrozen.
        if self.state is not None and self._frozen and any_requires_grad(*self._frozen.values()):
            grown = self._grown(fe.local_shards(x, include=self.include, exclude=self.exclude))
            if grown is not None:
                self.state = grown

    # ---------------------------------------------------------------------------------- training

    def on_step(self, x: Any, step: int) -> bool:
        """After the optimizer step that made the training step ``step`` (optimizer steps count from
        1; ``0``: none yet). Returns whether the EMA moved. Calling it again with the same step (each
        micro-batch of an accumulation) is a no-op.

        The EMA starts equal to the weights at the first step ``>= max(1, start_step)`` seen: a call
        at step 0 (a micro-batch before the first optimizer step) never starts it, so the same
        trajectory gives the same EMA with or without gradient accumulation."""
        step = check_int(step, "step")
        if step < max(1, self.start_step):
            return False
        if self.state is None:
            shards = fe.local_shards(x, include=self.include, exclude=self.exclude)
            self.state = fe.init_ema(shards, num_emas=self.num_emas, dtype=self.dtype, step=step)
            self._frozen, self._frozen_of = _frozen_params(x, self.state), weakref.ref(shards)
            if self.buffers:
                self.buffer_state = self._init_buffers(x, step)
            moved = True
        elif step % self.every_n_steps or step == int(self.state.step):
            return False
        else:
            shards = fe.local_shards(x, include=self.include, exclude=self.exclude)
            try:
                self.state = fe.update(self.state, shards, step, decay=self.decay)
            except fe.TreeMismatchError:  # checked before anything is written
                grown = self._grown(shards, late_model=x)
                if grown is None:
                    raise
                self.state = fe.update(grown, shards, step, decay=self.decay)
            self._watch_frozen(x, shards)
            if self.buffers:
                self.buffer_state = fb.update_buffers(
                    self._buffer_state(), x, step, decay=self.decay, mode=self.buffers
                )
            moved = True
        if self.posthoc_dir is not None and self.posthoc_every and step % self.posthoc_every == 0 and step >= 1:
            # Every decay is a power schedule (a numeric gamma), checked in __init__.
            fe.posthoc.save_snapshot(self.state, x, self.posthoc_dir, cast(list[Schedule], self.decays))
        return moved

    def before_optimizer_step(self, x: Any) -> None:
        """Before an optimizer step (the frameworks' pre-optimizer-step event): parameters frozen when the EMA
        started (or resumed) and trained from this step on join the EMA now, from the values they held while
        frozen, so the EMA is the one that had averaged them all along. (Seen only at the next :meth:`on_step`,
        they join from their values after this step: one step of theirs later, with a warning.) Nothing read
        when the model has no frozen parameter outside the EMA."""
        fe.engines.adapter_for(x)  # a model the verbs can read, also when there is nothing to do
        self._fit(x)

    @contextlib.contextmanager
    def swapped(self, x: Any, index: int | None = None) -> Iterator[bool]:
        """Evaluate with EMA ``index`` (default ``eval_index``), buffers too when they are carried.
        Yields whether EMA weights are in (``False`` before the EMA started, or ``eval_index=None``)."""
        index = self.eval_index if index is None else self._checked_index(index)
        if self.state is None or index is None:
            yield False
            return
        self._fit(x)
        with contextlib.ExitStack() as stack:
            stack.enter_context(fe.swapped(x, self.state, index=index))
            if self.buffer_state is not None:
                stack.enter_context(fb.swapped_buffers(x, self.buffer_state, index=index))
            yield True

    # ------------------------------------------------------------------------------- checkpoints

    def _record(self, framework_step: int) -> dict:
        """What a resume checks: the framework's step and the rules that give the EMA's step from it."""
        return {
            "integration": 1,
            "framework_step": int(framework_step),
            "started": self.state is not None,
            "ema_step": None if self.state is None else int(self.state.step),
            "num_emas": self.num_emas,
            "buffers": self.buffers if self.buffer_state is not None else None,
            "every_n_steps": self.every_n_steps,
            "start_step": self.start_step,
        }

    def save(self, x: Any, save_dir: str | os.PathLike, framework_step: int) -> Path | str:
        """Write every rank's pieces (and buffers) into ``save_dir/<tag>/``. Collective: call on every rank.

        ``save_dir`` may be an fsspec URL (module docstring); the tag's URL (a ``str``) is returned then.

        One :func:`functional_ema.save` (or :class:`functional_ema.AsyncSaver` save) writes the EMA, the
        buffers and this controller's record (``extra``: the framework's step and the rules), all listed
        and checksummed in one manifest: a failed save leaves no part of the tag at a newer step than
        the rest. Before the EMA started only a checksummed ``integration.json`` record is written.
        """
        location = check_location(save_dir, "save_dir")  # a URL stays a str: a Path would name a local "s3:"
        framework_step = check_int(framework_step, "framework_step")
        root: Where = location if isinstance(location, Path) else StoragePath(_url_store(location, self.shared, "save"))
        expected = expected_ema_step(framework_step, self.start_step, self.every_n_steps)
        have = None if self.state is None else int(self.state.step)
        # The ranks agree on what they save first (one small all-reduce): the check below, alone, would refuse on
        # the ranks whose EMA is elsewhere while the others wait in the save's collectives.
        self._fit(x)
        job = job_of(fe.engines.adapter_for(x).read())
        rules = f"start_step={self.start_step}, every_n_steps={self.every_n_steps}"
        agree_on(
            "EMA save",
            lambda: {"step": have, "framework_step": framework_step, "rules": rules},
            ("step", "framework_step", "rules"),
            job.group,
            job.world,
            job.rank,
            fix="Every rank must save the same EMA at the same framework step",
        )
        if expected != have:
            # What load() would refuse: refused now, on every rank alike, before anything is written.
            want = "not started" if expected is None else f"at step {expected}"
            now = "not started" if have is None else f"at step {have}"
            raise ValueError(
                f"framework_step={framework_step}: the rules ({rules}) put the EMA {want} at that optimizer step, but "
                f"it is {now}; pass the step of the optimizer step the EMA last saw (on_step)"
            )
        tag_dir = root / self.tag
        record = self._record(framework_step)
        if self.state is None:
            self._save_unstarted(x, tag_dir, record)
            return tag_dir if isinstance(tag_dir, Path) else str(tag_dir)
        save = fe.save if self._saver is None else self._saver.save  # async: manifest last, in the background
        save(
            self.state,
            x,
            location,
            self.tag,
            decay=self.decay,
            buffers=self.buffer_state,
            extra=record,
            shared=self.shared,
        )
        if isinstance(tag_dir, StoragePath):
            if self._saver is None and _rank() == 0:
                _drop_superseded_url_record(tag_dir)
            return str(tag_dir)
        if self._saver is not None:
            return tag_dir
        if (_rank() == 0 or not self.shared) and (tag_dir / RECORD_NAME).exists():
            # An older not-started record is superseded by the manifest just written: remove it, holding the tag
            # (a record another save wrote meanwhile, newer than this manifest, stays).
            lock = TagLock.acquire(tag_dir, timeout_s(None), "EMA save")
            try:
                with contextlib.suppress(OSError, fe.CheckpointError):
                    old = read_record(tag_dir / RECORD_NAME)
                    if old is not None and old.get("supersedes_generation", -1) < read_generation(tag_dir) - 1:
                        (tag_dir / RECORD_NAME).unlink()
            finally:
                lock.release()
        return tag_dir

    def _save_unstarted(self, x: Any, tag_dir: Where, record: dict) -> None:
        """Rank 0 writes the not-started record, atomically, holding the tag's write lock; it names the
        generation of the EMA saved in that folder before (if any), which it supersedes. At a URL (no lock
        there): published through the storage seam, superseding every generation present under the tag."""
        job = job_of(fe.engines.adapter_for(x).read())  # every rank that saves this model (all parts)

        def write() -> None:
            if job.rank != 0 and self.shared:  # private folders: every rank writes its folder's (identical) record
                return None
            if isinstance(tag_dir, StoragePath):
                _publish_url_record(tag_dir, record, job.rank)
                return None
            tag_dir.mkdir(parents=True, exist_ok=True)
            lock = TagLock.acquire(tag_dir, timeout_s(None), "EMA save")
            try:
                record["supersedes_generation"] = read_generation(tag_dir) - 1
                atomic_write_bytes(tag_dir / RECORD_NAME, record_bytes(record))
            except OSError as e:
                raise io_error(e, 0, tag_dir / RECORD_NAME) from None
            finally:
                lock.release()
            return None

        agree("EMA save (not started yet)", write, job.group, job.world, job.rank, results=False)

    def wait(self) -> None:
        """Wait for the EMA writes in flight (``async_save=True``); raise a failure of one."""
        if self._saver is not None:
            self._saver.wait()

    def load(self, x: Any, load_dir: str | os.PathLike, framework_step: int | None = None) -> int:
        """Restore this rank's state from ``load_dir/<tag>/`` (any world size or engine: it reshards).
        Collective. Returns the framework step the EMA was saved at (verified).

        ``framework_step`` is the step the framework resumed at (``None``: take it from the checkpoint's
        own checksummed record, for a framework that keeps no step of its own). Checked, on every rank,
        before anything is kept: the EMA's record belongs to that step, the EMA's step is the one the
        rules give for it (:func:`expected_ema_step`: equal, or the last update before it under
        ``every_n_steps`` / ``start_step``), the number of EMAs; a not-started record is honoured only
        when the rules say the EMA had not started, and only if it is newer than any EMA beside it.
        A mismatch is refused (:class:`functional_ema.CheckpointError`) naming both steps.
        """
        location = check_location(load_dir, "load_dir")  # a URL stays a str: a Path would name a local "s3:"
        framework_step = check_optional_int(framework_step, "framework_step")
        root: Where = location if isinstance(location, Path) else StoragePath(_url_store(location, self.shared, "load"))
        self.wait()  # a write of this process in flight finishes first
        tag_dir = root / self.tag
        job = job_of(fe.engines.adapter_for(x).read())

        saved_names: set[str] = set()  # the parameters the EMA checkpoint holds (this rank's reading of it)
        saved_selection: list[Any] = [None]  # the manifest's selection record (None: every parameter)

        def decide() -> tuple[str, dict[str, Any] | None, bool]:
            record = read_record_at(tag_dir / RECORD_NAME)
            if record is not None and record.get("started") is not False:
                raise fe.checkpoint.CorruptCheckpointError(
                    f"{tag_dir / RECORD_NAME}: a record beside an EMA must say 'started': false; the file is damaged"
                )
            generation, buffers = None, False
            if _is_file(tag_dir / MANIFEST_NAME):  # the manifest alone (validated); the load reads the files
                *_, manifest = locate_checkpoint(root, self.tag, local=not self.shared)
                generation = int(manifest["generation"])
                buffers = all(p.get("buffer_files") is not None for p in manifest_parts(manifest))
                saved_names.update(n for p in manifest_parts(manifest) for n in p["params"])
                saved_selection[0] = manifest.get("selection")
            if record is not None and (
                generation is None or _int_field(record, "supersedes_generation", tag_dir) >= generation
            ):
                return ("unstarted", record, False)
            return ("ema", None, buffers) if generation is not None else ("nothing", None, False)

        # Bounded, as fe.load's entry: a rank resuming alone fails after FUNCTIONAL_EMA_TIMEOUT, naming the verb,
        # instead of waiting in the exchange below for the group's own timeout
        arrive("EMA resume", job.group, job.world, job.rank, None)
        decisions = agree("EMA resume", decide, job.group, job.world, job.rank)
        if any(d[0] != decisions[0][0] for d in decisions):  # private folders: each rank decided from its own
            seen = ", ".join(f"rank {r}: {d[0]}" for r, d in enumerate(decisions))
            raise fe.checkpoint.CheckpointMismatchError(
                f"resuming the EMA from {tag_dir}: the ranks' folders disagree on what they hold ({seen}); every "
                "rank's folder must hold the same save"
            )
        kind, record, saved_buffers = decisions[0]
        if kind == "unstarted":
            saved_step = _int_field(record, "framework_step", tag_dir / RECORD_NAME)
            self._check_unstarted(tag_dir / RECORD_NAME, saved_step, framework_step)
            self.state = self.buffer_state = None
            return saved_step
        if kind == "nothing":
            if (
                framework_step is not None
                and expected_ema_step(framework_step, self.start_step, self.every_n_steps) is None
            ):
                self.state = self.buffer_state = None  # nothing to resume: the EMA starts later, by the rules
                return int(framework_step)
            at = "by then" if framework_step is None else f"at framework step {framework_step}"
            raise fe.checkpoint.IncompleteCheckpointError(
                f"resuming the EMA: {tag_dir} holds no complete EMA checkpoint (no {MANIFEST_NAME}) and no not-started "
                f"record, but the EMA (start_step={self.start_step}) must have started {at}. Was the EMA callback "
                "attached when this checkpoint was written, and did its save finish? An earlier checkpoint may hold "
                "a complete EMA"
            )
        return self._load_saved(x, location, tag_dir, saved_names, saved_buffers, framework_step, saved_selection[0])

    def _load_saved(
        self,
        x: Any,
        location: Path | str,
        tag_dir: Where,
        saved: set[str],
        saved_buffers: bool,
        framework_step: int | None,
        saved_selection: dict[str, Any] | None = None,
    ) -> int:
        """:meth:`load` of an EMA checkpoint (``saved``: the parameters it holds), checked against the framework's
        step; the frozen parameters it holds are read in (:func:`_read_frozen`). Returns the verified saved step."""
        _read_frozen(x, saved)
        try:
            loaded = fe.checkpoint.load_checkpoint(
                x,
                location,
                self.tag,
                buffers=bool(self.buffers) and saved_buffers,
                shared=self.shared,
                include=self.include,
                exclude=self.exclude,
            )
        except fe.CheckpointError as e:
            hint = self._unfrozen_hint(x, saved, saved_selection)
            raise type(e)(f"resuming the EMA from {tag_dir}: {e}{hint}") from e
        saved_step = self._check_loaded(tag_dir, loaded, framework_step)
        self.state = loaded.state
        self._frozen, self._frozen_of = _frozen_params(x, loaded.state), None
        if not self.buffers:
            self.buffer_state = None
        elif loaded.buffers is not None:
            self.buffer_state = loaded.buffers
        else:  # saved without buffers: start them from the live ones at the EMA's step (as a new run would)
            self.buffer_state = self._init_buffers(x, int(loaded.state.step))
        return saved_step

    def _unfrozen_hint(self, x: Any, saved: set[str], saved_selection: dict[str, Any] | None) -> str:
        """For a resume refused because the model trains parameters the checkpoint lacks, and only that: how a
        run that unfroze them after the save resumes. ``saved_selection``: the checkpoint's selection record."""
        with contextlib.suppress(Exception):  # a hint only: the refusal stands whatever happens here
            mine = make_selection(self.include, self.exclude)
            if saved_selection != (None if mine is None else mine.record()):
                return ""  # another selection than the checkpoint's: that refusal names both, unfreezing is not it
            names = fe.local_shards(x, include=self.include, exclude=self.exclude).index.names
            added = [n for n in names if n not in saved]
            if saved and added and saved <= set(names):
                return (
                    f" ({short_list(added)} are trained now and not in the checkpoint: if they were frozen when it was "
                    "saved, resume with them frozen, as they were then, and unfreeze them afterwards; the EMA adds "
                    "them then)"
                )
        return ""

    def _check_unstarted(self, where: Where, saved_step: int, framework_step: int | None) -> None:
        if framework_step is not None and saved_step != int(framework_step):
            raise _resume_error(
                where,
                f"the not-started record was saved at framework step {saved_step}, but the "
                f"training resumed at step {framework_step}",
            )
        expected = expected_ema_step(saved_step, self.start_step, self.every_n_steps)
        if expected is not None:
            raise _resume_error(
                where,
                f"the record says the EMA had not started at framework step {saved_step}, but "
                f"with start_step={self.start_step} it starts after optimizer step "
                f"{max(1, self.start_step)} and must be at step {expected}",
            )

    def _check_loaded(self, tag_dir: Where, loaded: Loaded, framework_step: int | None) -> int:
        """The loaded EMA against the framework's step and these rules; returns the verified saved step."""
        extra = loaded.manifest.get("extra")
        ema_step = int(loaded.state.step)
        if loaded.state.num_emas != self.num_emas:
            raise _resume_error(
                tag_dir,
                f"the checkpoint tracks {loaded.state.num_emas} EMA(s) but this run's callback has "
                f"{self.num_emas} decay(s)",
            )
        saved_step: int | None = None
        if isinstance(extra, dict) and extra.get("integration") == 1:
            saved_step = _int_field(extra, "framework_step", tag_dir / MANIFEST_NAME)
            if framework_step is not None and saved_step != int(framework_step):
                raise _resume_error(
                    tag_dir,
                    f"the EMA was saved with the checkpoint of framework step {saved_step}, but "
                    f"the training resumed at step {framework_step}",
                )
        step = int(framework_step) if framework_step is not None else saved_step
        if step is None:  # no step given and no integration record to read it from
            raise _resume_error(
                tag_dir,
                "its manifest carries no integration record (saved by functional_ema.save "
                "directly?), so the framework's step cannot be checked",
            )
        expected = expected_ema_step(step, self.start_step, self.every_n_steps)
        if expected != ema_step:
            rules = f"start_step={self.start_step}, every_n_steps={self.every_n_steps}"
            changed = ""
            if isinstance(extra, dict) and (extra.get("start_step"), extra.get("every_n_steps")) != (
                self.start_step,
                self.every_n_steps,
            ):
                changed = (
                    f"; it was saved by a run with start_step={extra.get('start_step')}, "
                    f"every_n_steps={extra.get('every_n_steps')}"
                )
            want = "not started" if expected is None else f"at step {expected}"
            raise _resume_error(
                tag_dir,
                f"the EMA is at step {ema_step}, but at framework step {step} the rules "
                f"({rules}) put it {want}{changed}",
            )
        return step

    # --------------------------------------------------------------------------------------- end

    def full_state_dict(
        self, x: Any, index: int | None = None, dst: int | None = 0, strip_prefix: str = ""
    ) -> dict[str, torch.Tensor]:
        """Full-shape EMA ``index`` (parameters, their tied aliases, buffers) on rank ``dst``
        (``None``: every rank; others get ``{}``), names as in the engine's module with
        ``strip_prefix`` removed (a framework's wrapper, e.g. Lightning's ``_forward_module.``). Collective."""
        index, state = self._index(index, x)
        strip_prefix = check_str(strip_prefix, "strip_prefix")
        full = fe.gather_full(state, x, index=index, dst=dst, join_parts=True)  # model-parallel parts joined
        if dst is not None and _rank() != dst:
            return {}
        module = fe.engines.adapter_for(x).module()
        first: dict[int, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), n)
        for n, p in module.named_parameters(remove_duplicate=False):
            if n not in full and first[id(p)] in full:
                full[n] = full[first[id(p)]]  # a tied alias: the same tensor under each name
        if self.buffer_state is not None:
            full.update({n: t.detach().clone() for n, t in self.buffer_state.emas[index].items()})
            full.update({n: t.detach().clone() for n, t in self.buffer_state.copied.items()})
        if strip_prefix:
            full = {n.removeprefix(strip_prefix): t for n, t in full.items()}
        return full

    def _checked_index(self, index: Any) -> int:
        """``index`` as one of the EMAs' indices (an int in ``[0, num_emas)``), else an error naming it."""
        index = check_int(index, "index")
        if index >= self.num_emas:
            raise ValueError(f"index={index!r} is not one of the {self.num_emas} EMA(s)")
        return index

    def _index(self, index: int | None, x: Any) -> tuple[int, fe.EmaState]:
        """EMA ``index`` (default ``eval_index``, else 0), checked, and the state, fitted to the model ``x``
        (:meth:`_fit`); the EMA must have started."""
        index = self.eval_index if index is None else index
        index = self._checked_index(0 if index is None else index)
        if self.state is None:
            raise RuntimeError(f"the EMA has not started (start_step={self.start_step}): nothing to export or copy")
        self._fit(x)
        return index, self.state

    def export(self, x: Any, path: str | os.PathLike, index: int | None = None, strip_prefix: str = "") -> Path | None:
        """Write :meth:`full_state_dict` to one safetensors file from rank 0 (atomic). Collective.

        The path is refused (:class:`functional_ema.checkpoint.OutputPathError`, on every rank, before
        anything is gathered) when it would land on a checkpoint's files: a tag folder, a rank, buffer or
        manifest file, ``latest``. Its metadata records the EMA written (``ema_index``), its step and schedule.
        """

        index, state = self._index(index, x)
        strip_prefix = check_str(strip_prefix, "strip_prefix")
        path = check_export_path(check_path(path, "path"), "EMA export")
        full = self.full_state_dict(x, index=index, dst=0, strip_prefix=strip_prefix)
        if _rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tensors = {n: t.detach().contiguous() for n, t in full.items()}  # aliases are written separately
            schedule = describe_decays(self.decays[index], 1)
            meta = {
                "format": "functional_ema.export",
                "step": str(int(state.step)),
                "ema_index": str(index),
                "schedule": json.dumps(schedule[0] if schedule else None),
            }
            if selection_record(state.emas[0]) is not None:  # the file holds the selected parameters only
                meta["selection"] = json.dumps(selection_record(state.emas[0]))
            write_tensors(path, tensors, meta)  # atomically, with the file's own checksums
        barrier()
        return path if _rank() == 0 else None

    def copy_to_model(self, x: Any, index: int | None = None) -> None:
        """Overwrite the model's trained weights with EMA ``index`` (end of training). Collective.

        The fp32 weights the optimizer holds (DeepSpeed's masters, FSDP2's local shards, the plain
        parameters) and the copies the forward uses (ZeRO-3 partitions, ZeRO-0/1/2 module
        parameters) all receive the EMA, so ``save_pretrained``/``save_checkpoint`` afterwards
        write the EMA weights. Buffers too when they are carried. The state must fit the model
        exactly (every EMA'd parameter trainable in it, same pieces), else
        :class:`functional_ema.StateMismatchError` on every rank, before anything is written.
        """
        index, state = self._index(index, x)
        adapter = fe.engines.adapter_for(x)
        reading = read_for(adapter, state)  # a selection's parameters; the others keep their trained values
        pieces = state_pieces(state, reading, index, "copy_to_model")  # all ranks agree before any write
        live = fb.module_buffers(x) if self.buffer_state is not None else {}
        if self.buffer_state is not None:
            saved = {**self.buffer_state.emas[index], **self.buffer_state.copied}
            if set(saved) != set(live) or any(tuple(saved[n].shape) != tuple(live[n].shape) for n in saved):
                raise fe.StateMismatchError(
                    f"copy_to_model: the buffer EMAs {sorted(saved)} do not fit the model's buffers "
                    f"{sorted(live)} (names or shapes)"
                )
            fb.refuse_overlapping(live, "copy_to_model")
        adapter.write_weights(reading, pieces)
        with torch.no_grad():
            for n, t in (
                {**self.buffer_state.emas[index], **self.buffer_state.copied} if self.buffer_state else {}
            ).items():
                live[n].copy_(t)
        barrier()

    def on_train_end(self, x: Any, strip_prefix: str = "") -> None:
        """Wait for the EMA writes in flight, then the configured final export and/or copy into the model."""
        strip_prefix = check_str(strip_prefix, "strip_prefix")
        fe.engines.adapter_for(x)  # a model the verbs can read, also when there is nothing to do
        self.wait()
        if self.state is None:
            return
        if self.export_path is not None:
            self.export(x, self.export_path, strip_prefix=strip_prefix)
        if self.copy_to_model_at_end:
            self.copy_to_model(x)


def grown_state(state: fe.EmaState, shards: fe.Shards, step: int, **init: Any) -> fe.EmaState:
    """A state over ``shards``, which hold every name of ``state`` and more (parameters that joined the EMA): at
    ``step``, each EMA with ``state``'s values for its names and the parameters' current values for the others
    (``init_ema(shards, **init)``'s starting values)."""
    grown = fe.init_ema(shards, num_emas=state.num_emas, step=step, **init)
    with torch.no_grad():
        for old, new in zip(state.emas, grown.emas):
            for n, t in old.items():
                new[n].copy_(t)
    return grown


def _frozen_params(x: Any, state: fe.EmaState) -> dict[str, torch.Tensor]:
    """The model's frozen parameters that ``state`` lacks, by name: the ones that may join it once trained
    (``EMAController._grown``)."""
    adapter = fe.engines.adapter_for(x)
    have = state.emas[0]
    in_optimizer = getattr(adapter, "frozen_in_optimizer", None)
    if in_optimizer is not None:
        # DeepSpeed reads its optimizer's groups: at ZeRO-0 the frozen parameters they hold, left out of the reading,
        # join once unfrozen (see DeepSpeedAdapter.frozen_in_optimizer); none at stages 1-3
        waiting = {id(p) for p in in_optimizer()}
        if not waiting:
            return {}
        return {n: p for n, p in adapter.module().named_parameters() if id(p) in waiting and n not in have}
    if not adapter.keeps_frozen:
        return {}
    return {n: p for n, p in adapter.module().named_parameters() if not p.requires_grad and n not in have}


def _read_frozen(x: Any, saved: set[str]) -> None:
    """Read the model afresh, with its frozen parameters that the EMA checkpoint holds (trained before the save,
    frozen again at the resume, e.g. by a fine-tuning schedule that freezes at setup): they stay in the EMA, as a
    parameter frozen during a run does. Afresh: a reading kept from earlier in this process holds every parameter
    trained since it was made (see ``engines._base.is_read``), and a resume into the same model object (a rollback,
    a second ``fit``) starts from the checkpoint and the model as they are now, as a new process would. A module's
    and FSDP2's readings, and a DeepSpeed engine's (at ZeRO-0 fp32 its optimizer holds frozen parameters, read
    alike; elsewhere its groups decide, and the names kept change nothing)."""
    adapter = fe.engines.adapter_for(x)
    if adapter.keeps_frozen or hasattr(adapter, "frozen_in_optimizer"):
        keep = {n for n, p in adapter.module().named_parameters() if n in saved and not p.requires_grad}
        adapter.forget()
        adapter.read(keep=keep)


def _publish_url_record(tag_dir: StoragePath, record: dict, rank: int) -> None:
    """The not-started record at a URL, published atomically; it supersedes every generation under the tag
    (one below the next save's: a complete manifest's, and any failed save's leftovers)."""
    rel = f"{tag_dir.rel}/{RECORD_NAME}"
    try:
        record["supersedes_generation"] = next_generation(tag_dir.store, tag_dir.rel) - 1
        tag_dir.store.publish_bytes(rel, record_bytes(record))
    except Exception as e:  # noqa: BLE001 - the store's client raises its own errors, not only OSError
        raise store_error(e, rank, tag_dir.store.describe(rel)) from None


def _drop_superseded_url_record(tag_dir: StoragePath) -> None:
    """After a complete save to a URL (rank 0): an older not-started record beside it is superseded, so it is
    removed (best effort: one that names this manifest's generation or a newer one stays, and a leftover is
    ignored at load as long as it is older than the manifest)."""
    with contextlib.suppress(Exception):  # best effort: load() decides by the generations anyway
        old = read_record_at(tag_dir / RECORD_NAME)
        if old is None:
            return
        generation = int(json.loads(tag_dir.store.read_bytes(f"{tag_dir.rel}/{MANIFEST_NAME}"))["generation"])
        if old.get("supersedes_generation", -1) < generation:
            tag_dir.store.remove(f"{tag_dir.rel}/{RECORD_NAME}")


def _int_field(record: dict, field: str, where: Where) -> int:
    value = record.get(field)
    if type(value) is not int or value < -1:
        raise fe.checkpoint.CorruptCheckpointError(
            f"{where}: field {field!r} must be an int, got {value!r}; the record is damaged"
        )
    return value
