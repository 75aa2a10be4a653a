"""Hugging Face Accelerate: an EMA that follows ``accelerator.save_state`` / ``load_state``.

Example (the gradient-accumulation loop; DeepSpeed, FSDP2, DDP or one process alike)::

    from functional_ema.integrations.accelerate import AcceleratorEMA

    model, optimizer = accelerator.prepare(model, optimizer)
    ema = AcceleratorEMA(accelerator, model, decay=0.999)     # after prepare
    for batch in loader:
        with accelerator.accumulate(model):
            loss = compute_loss(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        ema.step()                      # moves only when the optimizer stepped
    with ema.swapped(), torch.no_grad():
        val_loss = compute_loss(model, val_batch)
    accelerator.save_state("ckpt")      # every rank also writes its EMA pieces into ckpt/ema/
    accelerator.load_state("ckpt")      # ... and reads them back (any world size: it reshards)

The helper registers a save-state and a load-state pre-hook on the accelerator; each writes or reads
the EMA inside the folder ``save_state``/``load_state`` uses. Accelerate gathers the model's state (and,
with ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)``, deletes the oldest checkpoint
folders) before its pre-hooks run, so the first helper of an accelerator also wraps its ``save_state`` and
``load_state`` (instance attributes, :class:`_StateVerb`, which pickle with the accelerator): a ``save_state``
inside ``with ema.swapped():`` writes the live (trained) weights, the EMA swapped out for the save and in again
after it (as the Lightning callback does), and a ``load_state`` there loads the live weights and swaps the
loaded EMA in; with ``async_save=True`` and a ``total_limit``, the EMA save in flight is
committed on every rank before Accelerate may delete its folder. The optimizer step is DeepSpeed's
``engine.global_steps`` under DeepSpeed, else a count of the steps really taken, kept in the checkpoint: the
steps of the optimizers the accelerator had prepared when the helper was made (those holding the model's
parameters), counted by a step post-hook on each of them (per instance), so a loop that accumulates by hand
(``optimizer.step()`` every N-th micro-batch, ``ema.step()`` every iteration) counts its real steps too, and
none is counted inside ``accelerator.accumulate`` or when the fp16 scaler skips one. With no such optimizer
(prepared after the helper), one step per :meth:`~AcceleratorEMA.step` call where the accelerator stepped
(``sync_gradients`` and not ``optimizer_step_was_skipped``).

Each wrapped ``save_state`` also leaves a checksummed record in its folder, ``<tag>_save_state.json``: the optimizer
step of that save, marked unfinished in the EMA's hook, before the EMA's save and Accelerate's own files (a refused
or failed EMA save puts the earlier record back, so the folder's earlier save still loads; a failed mark changes
nothing), and finished once ``save_state`` returned (Accelerate's own files written). Under DeepSpeed, FSDP and Megatron-LM, which write the model before the
hooks, the folder is marked unfinished before Accelerate writes anything (an ``output_dir`` given: first; a new
``checkpoint_<n>`` of ``automatic_checkpoint_naming``: once Accelerate has named it, :func:`_marked_once_named`),
and stays so if the save fails. The
wrapped ``load_state`` refuses, before Accelerate loads anything (also under DeepSpeed and FSDP), a folder whose save
did not finish, whose ranks read different records, or whose EMA is not of the recorded save by its manifest (an
``async_save`` write that failed, or a process that ended before its write committed); a folder with no record (an
earlier version's) loads as before, the step taken from the EMA's own record.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import accelerate  # the framework this module glues to
import torch.distributed as dist

from functional_ema._checkpoint.collective import agree, arrive, io_error
from functional_ema._checkpoint.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from functional_ema._checkpoint.format import MANIFEST_NAME, RECORD_NAME, read_record, record_bytes
from functional_ema._checkpoint.reader import locate_checkpoint
from functional_ema._io import atomic_write_bytes
from functional_ema._state import EmaState
from functional_ema.engines import adapter_for
from functional_ema.schedules import DecayLike

from ._common import EMAController, check_folder_tag, expected_ema_step, has_saved_ema, local_folder

__all__ = ["AcceleratorEMA"]

# The folders (and extension-less files) accelerator.save_state writes into its folder besides files with an
# extension (model.safetensors, optimizer.bin, random_states_0.pkl, ...): DeepSpeed's checkpoint (its tag
# "pytorch_model", zero_to_fp32.py) and FSDP's sharded model and optimizer folders. ("latest" is every tag's reserved
# name already: check_tag refuses it first.)
_ACCELERATE_FOLDERS = re.compile(r"pytorch_model|(pytorch_model_fsdp|optimizer)_\d+|zero_to_fp32")

# The helper's record of the last save_state into a folder, beside its tag folder (``ema_save_state.json`` for the
# tag "ema"; no tag can be named so: check_folder_tag refuses tags ending in .json): the optimizer step of that save
# and whether save_state returned. A resume checks the EMA against it (AcceleratorEMA._recorded_step).
_SAVE_RECORD = "{tag}_save_state.json"
_SAVE_RECORD_KIND = "functional_ema.accelerate.save_state"

# What torch.compile's wrapper (OptimizedModule) and an inner DDP put before the names of the module they wrap.
_COMPILED_PREFIX = "_orig_mod."
_DDP_PREFIX = "module."


def _live_helpers(accelerator: Any) -> list[AcceleratorEMA]:
    """The helpers registered on ``accelerator`` now, found through its own save-state pre-hooks (a helper's bound
    ``_on_save``): nothing is kept elsewhere, and a helper is live exactly as long as its hook is registered (until
    its :meth:`~AcceleratorEMA.remove_hooks`). ``[]`` for an accelerator that keeps its hooks elsewhere (another
    Accelerate version)."""
    hooks = getattr(accelerator, "_save_model_state_pre_hook", None)
    if not isinstance(hooks, Mapping):
        return []
    helpers = []
    for hook in list(hooks.values()):
        other = getattr(hook, "__self__", None)
        if isinstance(other, AcceleratorEMA) and getattr(hook, "__name__", None) == "_on_save":
            helpers.append(other)
    return helpers


def _world_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _check_tag(accelerator: Any, tag: str, helper: AcceleratorEMA) -> None:
    """Refuse ``tag`` when another live helper of this accelerator (:func:`_live_helpers`) writes it at
    ``save_state`` (both would write ``<folder>/<tag>/``, the second overwriting the first)."""
    for other in _live_helpers(accelerator):
        if other is not helper and other.ema.tag == tag:
            raise ValueError(
                f"tag={tag!r}: another AcceleratorEMA of this accelerator already uses it; both would write their "
                f"EMA into <save_state folder>/{tag}/, the second overwriting the first. Call remove_hooks() on the "
                "other helper, or give this one its own tag= (e.g. tag='ema_slow')"
            )


class _StateVerb:
    """``accelerator.save_state`` or ``load_state``, wrapped: set on the accelerator (an instance attribute shadowing
    the method) by its first helper, once each. Accelerate gathers the model's state, and deletes the oldest
    checkpoint folders (``total_limit``), before its save-state pre-hooks run, and loads a DeepSpeed or FSDP model
    before its load-state pre-hooks; this runs before all of that. For each live helper (:func:`_live_helpers`;
    none after every ``remove_hooks()``: then it only calls through) a save enters :meth:`AcceleratorEMA._saving`
    (the folder marked unfinished first where Accelerate writes the model before its pre-hooks), and once the save
    returned (Accelerate's own files written), marks it whole (:meth:`AcceleratorEMA._saved`); a load enters
    :meth:`AcceleratorEMA._loading` (the folder's record checked); every swap in force is taken out for the verb and
    put back after it (:func:`_swapped_out`). A plain object (the accelerator, the verb's name and the callable it
    wraps), so the accelerator still pickles and deep-copies."""

    def __init__(self, accelerator: Any, name: str, inner: Any = None) -> None:
        self.accelerator = accelerator
        self.name = name  # "save_state" or "load_state"
        self.inner = inner  # an instance-level verb set before this one (another wrapper), else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        acc = self.accelerator
        verb = self.inner if self.inner is not None else functools.partial(getattr(type(acc), self.name), acc)
        helpers = _live_helpers(acc)
        with contextlib.ExitStack() as stack:
            if self.name == "save_state":
                folder = _save_folder(acc, args, kwargs) if helpers else None
                for helper in helpers:
                    stack.enter_context(helper._saving(folder))
                if helpers:
                    stack.enter_context(_marked_once_named(acc, helpers))
            else:
                folder = _load_folder(acc, args, kwargs) if helpers else None
                for helper in helpers:  # before anything is swapped out or loaded: a refusal changes nothing
                    stack.enter_context(helper._loading(folder))
            stack.enter_context(_swapped_out([s for h in helpers for s in h._swaps]))
            result = verb(*args, **kwargs)
            if self.name == "save_state":
                for helper in helpers:  # Accelerate's own files are all written: the save is whole
                    helper._saved()
            return result


#: The distributed types under which Accelerate's ``save_state`` writes the model (and optimizer) before it runs
#: its save-state pre-hooks (accelerate 1.16: ``save_fsdp_model``, DeepSpeed's and Megatron-LM's ``save_checkpoint``).
#: Under every other type it writes nothing of its own before them.
_WRITES_MODEL_FIRST = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def _writes_model_first(accelerator: Any) -> bool:
    """Whether ``accelerator.save_state`` writes files of its own before its save-state pre-hooks run (the EMA's)."""
    kind = getattr(accelerator, "distributed_type", None)
    return str(getattr(kind, "value", kind)) in _WRITES_MODEL_FIRST and bool(getattr(accelerator, "_models", ()))


def _save_folder(accelerator: Any, args: tuple, kwargs: dict) -> Path | None:
    """The folder ``save_state(*args, **kwargs)`` writes into, to be marked unfinished before Accelerate writes
    there: its ``output_dir``, where the record of an earlier save may lie, and only where Accelerate writes the
    model before the EMA's hook (:func:`_writes_model_first`). ``None`` elsewhere: the EMA's hook marks the save,
    and puts an earlier save's record back if the EMA's save is refused or fails (Accelerate wrote nothing yet).
    ``None`` also with ``automatic_checkpoint_naming`` (Accelerate writes a new ``checkpoint_<n>`` and refuses one
    that exists: no earlier record can be there, and the folder must not be made before Accelerate makes it) or with
    no ``output_dir`` (Accelerate refuses that)."""
    if not _writes_model_first(accelerator):
        return None
    if getattr(getattr(accelerator, "project_configuration", None), "automatic_checkpoint_naming", False):
        return None
    output_dir = args[0] if args else kwargs.get("output_dir")
    if output_dir is None:
        return None
    return local_folder(output_dir, "accelerator.save_state(output_dir)", "Accelerate")


@contextlib.contextmanager
def _marked_once_named(accelerator: Any, helpers: list[AcceleratorEMA]) -> Iterator[None]:
    """For one ``save_state`` with ``automatic_checkpoint_naming`` where Accelerate writes the model before the EMA's
    hook (:func:`_writes_model_first`): the new folder is marked unfinished by every helper (:meth:`AcceleratorEMA.
    _mark`) once Accelerate has named it and before it writes anything, so a save stopped between the model's write
    and the EMA's hook leaves the folder refused, not loadable as one saved before records were. It cannot be marked
    before ``save_state`` (:func:`_save_folder`): Accelerate refuses a ``checkpoint_<iteration>`` that exists, and
    deletes the oldest folders first (``total_limit``). Accelerate (1.16) names it, checks that it is new, then calls
    ``self.wait_for_everyone()`` on every rank before it makes the folder: that call, shadowed on the accelerator
    instance for this ``save_state`` only, waits (every rank has checked the folder is new), then marks the folder
    named by ``output_dir`` in Accelerate's frame. Only a call from Accelerate's own ``save_state`` (:func:`_named_by`)
    marks: a barrier before it (a subclass's ``save_state`` before ``super()``, another wrapper) comes before the check
    and passes through, the shadow kept for Accelerate's. An Accelerate that does not call it there leaves the mark to
    the EMA's hook, as for a folder Accelerate wrote nothing into first."""
    config = getattr(accelerator, "project_configuration", None)
    if not (_writes_model_first(accelerator) and getattr(config, "automatic_checkpoint_naming", False)):
        yield
        return
    name = "wait_for_everyone"
    shadowed, real = vars(accelerator).get(name), getattr(accelerator, name)

    def put_back() -> None:
        if shadowed is not None:
            setattr(accelerator, name, shadowed)
        elif name in vars(accelerator):
            delattr(accelerator, name)

    def wait_then_mark() -> Any:
        path = _named_by(sys._getframe(1))
        if path is None:  # not Accelerate's barrier after the naming: the folder may not be checked yet
            return real()
        put_back()  # once: the call after the naming
        waited = real()  # first: every rank has checked that the folder is new before the mark makes it
        folder = local_folder(path, "accelerator.save_state(output_dir)", "Accelerate")
        try:
            for helper in helpers:
                helper._mark(folder)  # collective: every rank returns once the mark is written
        except BaseException:
            with contextlib.suppress(OSError):  # made for the mark alone: Accelerate's next save would refuse it
                folder.rmdir()
            raise
        return waited

    setattr(accelerator, name, wait_then_mark)
    try:
        yield
    finally:
        put_back()


def _named_by(caller: FrameType) -> str | None:
    """The folder Accelerate's own ``save_state`` has named and checked to be new (its local ``output_dir``), when
    ``caller`` is that function's frame (the base class's code: a subclass's ``save_state`` calling ``super()`` is
    not it, nor a wrapper that patched the class, whose ``__wrapped__`` leads to it); ``None`` for any other caller."""
    own = inspect.unwrap(accelerate.Accelerator.save_state)
    if caller.f_code is not getattr(own, "__code__", None):
        return None
    output_dir = caller.f_locals.get("output_dir")
    return os.fspath(output_dir) if isinstance(output_dir, (str, os.PathLike)) else None


def _numbered_last(root: str) -> str | None:
    """The folder of ``root`` that Accelerate's ``load_state()`` picks with ``automatic_checkpoint_naming``: the last
    by the number in its name (Accelerate's own sort, so ties fall alike); ``None`` where Accelerate would fail."""
    try:
        folders = [os.path.join(root, name) for name in os.listdir(root)]
        folders.sort(key=lambda f: [int(n) for n in re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)][0])  # noqa: RUF015
    except (OSError, IndexError):
        return None
    return folders[-1] if folders else None


def _load_folder(accelerator: Any, args: tuple, kwargs: dict) -> Path | None:
    """The folder ``load_state(*args, **kwargs)`` reads, as Accelerate picks it: ``input_dir`` (``~`` expanded), or
    with ``automatic_checkpoint_naming`` and none given the last numbered checkpoint folder; ``None`` where it names
    no local folder (Accelerate refuses it; the EMA's hook checks whatever folder Accelerate does load)."""
    input_dir = args[0] if args else kwargs.get("input_dir")
    if input_dir is None:
        config = getattr(accelerator, "project_configuration", None)
        if not getattr(config, "automatic_checkpoint_naming", False):
            return None
        input_dir = _numbered_last(os.path.join(accelerator.project_dir, "checkpoints"))
    if not isinstance(input_dir, (str, os.PathLike)) or not os.path.isdir(input_dir := os.path.expanduser(input_dir)):
        return None
    return local_folder(input_dir, "accelerator.load_state(input_dir)", "Accelerate")


def _saved_ema_step(tag_dir: Path, shared: bool) -> tuple[str, int | None]:
    """What the EMA checkpoint in ``tag_dir`` is, read from its manifest or not-started record alone (no tensor), as
    the EMA's load decides it: ``("ema" | "unstarted", the framework step it was saved at)`` (``None`` when no record
    of it can be read: the load judges that), or ``("nothing", None)``."""
    record = read_record(tag_dir / RECORD_NAME)
    generation, step = None, None
    if (tag_dir / MANIFEST_NAME).is_file():
        *_, manifest = locate_checkpoint(tag_dir.parent, tag_dir.name, local=not shared)
        generation, extra = int(manifest["generation"]), manifest.get("extra")
        if isinstance(extra, dict) and extra.get("integration") == 1:
            step = extra.get("framework_step")
    if record is not None:
        newer = record.get("supersedes_generation")
        if generation is None or (type(newer) is int and newer >= generation):
            step = record.get("framework_step")
            return "unstarted", step if type(step) is int else None
    if generation is None:
        return "nothing", None
    return "ema", step if type(step) is int else None


@contextlib.contextmanager
def _swapped_out(swaps: list[_Swapped]) -> Iterator[None]:
    """The live weights in the model for the block: every swap in force, of every helper, swapped out in the reverse
    of the order the blocks were opened (a nested block's EMA over an outer one's), and in again in that order
    after it (a load's EMA, for a ``load_state``)."""
    ordered = sorted((s for s in swaps if s.inner is not None), key=lambda s: s.opened)
    for s in reversed(ordered):
        s._out()
    try:
        yield
    finally:
        for s in ordered:
            s._in()


def _wrap_state_verbs(accelerator: Any) -> None:
    """Set :class:`_StateVerb` on ``accelerator`` for ``save_state`` and ``load_state``, unless there already. Not
    for an accelerator that keeps its hooks elsewhere (another Accelerate version): the wrapper could not find the
    helpers there, and the helper's hooks refuse a save or load while its EMA is swapped in instead."""
    if not isinstance(getattr(accelerator, "_save_model_state_pre_hook", None), Mapping):
        return
    for name in ("save_state", "load_state"):
        current = vars(accelerator).get(name)
        if not isinstance(current, _StateVerb):
            setattr(accelerator, name, _StateVerb(accelerator, name, current))


class _Swapped:
    """:meth:`AcceleratorEMA.swapped`'s block: the EMA swapped in, out around each ``save_state`` or ``load_state``
    inside it (:func:`_swapped_out`), then in again."""

    def __init__(self, helper: AcceleratorEMA, index: int | None) -> None:
        self.helper, self.index = helper, index
        self.inner: contextlib.AbstractContextManager[bool] | None = None  # the swap in force (None: swapped out)
        self.entered = False  # EMA weights went in (False before the EMA started: nothing to swap)
        self.opened = 0  # when the block was opened (time.monotonic_ns): nested blocks are swapped out last first

    def _in(self) -> bool:
        cm = self.helper.ema.swapped(self.helper.model, self.index)
        entered = cm.__enter__()
        self.inner = cm
        return entered

    def _out(self) -> None:
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.__exit__(None, None, None)

    def __enter__(self) -> bool:
        self.opened = time.monotonic_ns()
        self.entered = self._in()
        self.helper._swaps.append(self)
        return self.entered

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self in self.helper._swaps:
            self.helper._swaps.remove(self)
        inner, self.inner = self.inner, None
        return None if inner is None else inner.__exit__(exc_type, exc, tb)


def _wrapper_prefix(model: Any) -> str:
    """The prefix the wrappers inside the module the EMA reads add to the names of ``model``'s own module (``""``
    when there is none): ``_orig_mod.`` per torch.compile wrapper (OptimizedModule), ``module.`` per DDP below the
    outermost one (whose ``.module`` the adapter reads). torch.compile(DDP(m)), what Accelerate's DDP with dynamo
    gives: ``_orig_mod.module.``; DDP(torch.compile(m)), a model compiled before ``prepare``: ``_orig_mod.``."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel

    module, prefix = adapter_for(model).module(), ""  # an outermost DDP skipped: its .module is what is read
    for _ in range(64):  # wrappers nest a few deep; bounded against a module that wraps itself
        if isinstance(module, OptimizedModule):
            module, prefix = module._orig_mod, prefix + _COMPILED_PREFIX
        elif isinstance(module, DistributedDataParallel):
            module, prefix = module.module, prefix + _DDP_PREFIX
        else:
            break
    return prefix


class AcceleratorEMA:
    """EMA of a prepared model's weights, saved and loaded with the accelerator's state.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: what ``accelerator.prepare`` returned for the model (a DeepSpeed engine, a DDP or
            FSDP2 model, or the module). Make the helper after the optimizer is prepared too: the steps
            of the prepared optimizers that hold the model's parameters are counted from then on.
        decay: one decay (float, schedule or callable) or a sequence, one per EMA.
        **kwargs: ``every_n_steps``, ``start_step``, ``buffers``, ``eval_index``, ``posthoc_dir``,
            ``posthoc_every``, ``export_path``, ``copy_to_model``, ``tag``, ``async_save``, ``dtype``,
            ``include``, ``exclude`` (which parameters are averaged, by name): as for
            ``functional_ema.integrations._common.EMAController``.
    """

    def __init__(
        self, accelerator: Any, model: Any, decay: DecayLike | Sequence[DecayLike] = 0.9999, **kwargs: Any
    ) -> None:
        if not callable(getattr(accelerator, "register_save_state_pre_hook", None)):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        try:
            adapter_for(model)  # a model the verbs can read, refused now rather than at the first step
        except TypeError as e:
            raise TypeError(f"model: {e}") from None
        self.ema = EMAController(decay, **kwargs)  # every other argument checked there, before the hooks
        check_folder_tag(
            self.ema.tag, _ACCELERATE_FOLDERS, "accelerator.save_state", "model.safetensors, optimizer.bin"
        )
        _check_tag(accelerator, self.ema.tag, self)
        self.accelerator, self.model = accelerator, model
        self._steps = 0
        self._pending: list[int] = []  # per hooked optimizer: the steps it took since the last step() call
        self._seen = 0  # how many prepared optimizers were looked at (one prepared later is hooked at step())
        self._swaps: list[_Swapped] = []  # the swapped() blocks open now
        # Inside the wrapper's save_state (None outside): the folders (and optimizer steps) this save marked as being
        # written, marked whole once it returns (_saved)
        self._marked: list[tuple[Path, int]] | None = None
        # Inside the wrapper's load_state (None outside): the folder it checked before Accelerate loaded anything, and
        # the optimizer step of its save record (None: no record), which the load-state hook takes from here
        self._checked: tuple[Path, int | None] | None = None
        self._handles = [
            accelerator.register_save_state_pre_hook(self._on_save),
            accelerator.register_load_state_pre_hook(self._on_load),
        ]
        _wrap_state_verbs(accelerator)
        self._hook_optimizers()

    def _hook_optimizers(self) -> int:
        """A step post-hook on each optimizer the accelerator prepared since the last look that holds this model's
        parameters (on that instance: no global hook), counting the steps it really takes; an optimizer prepared
        later (a second stage, one rebuilt after unfreezing) is hooked at the next :meth:`step`, one length compare
        per call until then. None under DeepSpeed (the engine counts)."""
        prepared = getattr(self.accelerator, "_optimizers", ())
        if len(prepared) == self._seen or self._engine_steps() is not None:
            return 0
        new, self._seen, before = list(prepared)[self._seen :], len(prepared), len(self._pending)
        mine = {id(p) for p in self.model.parameters()}
        for wrapped in new:
            inner = getattr(wrapped, "optimizer", wrapped)  # AcceleratedOptimizer wraps the torch optimizer
            if not callable(getattr(inner, "register_step_post_hook", None)):
                continue
            if any(id(p) in mine for group in inner.param_groups for p in group["params"]):
                self._pending.append(0)
                hook = functools.partial(self._stepped, len(self._pending) - 1)
                self._handles.append(inner.register_step_post_hook(hook))
        return len(self._pending) - before

    def _stepped(self, k: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._pending[k] += 1

    @property
    def state(self) -> EmaState | None:
        """This rank's :class:`functional_ema.EmaState` (``None`` before the EMA starts)."""
        return self.ema.state

    def _engine_steps(self) -> int | None:
        return adapter_for(self.model).optimizer_steps()  # DeepSpeed counts its own; other engines do not

    @property
    def optimizer_step(self) -> int:
        """Optimizer steps taken so far (the engine's own counter where it keeps one: DeepSpeed's ``global_steps``)."""
        counted = self._engine_steps()
        return self._steps if counted is None else counted

    def before_step(self) -> None:
        """Optional, before ``optimizer.step()`` (every micro-batch is fine): parameters frozen when the EMA started
        and unfrozen since (progressive unfreezing) join the EMA before that step trains them, as if averaged all
        along. Without it they join at :meth:`step`, from their values one optimizer step later, with a warning.
        Nothing to do, and nothing read, when the model has no frozen parameter outside the EMA."""
        self.ema.before_optimizer_step(self.model)

    def step(self) -> bool:
        """Call once per loop iteration, after ``optimizer.step()``. Returns whether the EMA moved. The steps the
        hooked optimizers took since the last call are counted (the most any of them took), however the loop
        accumulates."""
        acc = self.accelerator
        # An optimizer hooked only now stepped unseen in this iteration: then this call counts as the loop's step,
        # as every call does while no optimizer is hooked (the helper made before prepare).
        unseen = self._hook_optimizers() > 0
        taken = max(self._pending, default=0)
        self._pending = [0] * len(self._pending)
        if taken:
            self._steps += taken
        elif (unseen or not self._pending) and self._engine_steps() is None:
            self._steps += int(acc.sync_gradients and not acc.optimizer_step_was_skipped)
        return self.ema.on_step(self.model, self.optimizer_step)

    def swapped(self, index: int | None = None) -> contextlib.AbstractContextManager[bool]:
        """Context manager: the model computes with EMA ``index`` (default ``eval_index``). Yields whether EMA
        weights are in (``False`` before the EMA started). An ``accelerator.save_state`` inside the block writes the
        live (trained) weights: the EMA is swapped out for the save, and in again after it."""
        return _Swapped(self, index)

    @contextlib.contextmanager
    def _saving(self, folder: Path | None = None) -> Iterator[None]:
        """Around ``accelerator.save_state`` (:class:`_StateVerb`), before Accelerate deletes or gathers anything.
        ``folder``: given where Accelerate writes the model before its pre-hooks (DeepSpeed, FSDP, Megatron-LM:
        :func:`_save_folder`): marked unfinished first, before Accelerate writes a file, so a save stopped at any
        point leaves no finished record of an earlier save beside files of this one. It stays unfinished when the
        save fails, even before Accelerate wrote anything: which files it wrote cannot be told."""
        config = getattr(self.accelerator, "project_configuration", None)
        if (
            self.ema.async_save
            and getattr(config, "automatic_checkpoint_naming", False)
            and getattr(config, "total_limit", None) is not None
        ):
            # Accelerate deletes the oldest checkpoint folders first, on the main process: an EMA save in flight
            # into one of them is committed on every rank first (a failure of it is raised here, before anything
            # is deleted), so a folder goes whole, never mid-write.
            self.ema.wait()
            self.accelerator.wait_for_everyone()
        # torch.distributed.checkpoint steps an optimizer without state once (zero gradients and lr) to build it
        # when FSDP's optimizer state is gathered: not a training step, so not counted.
        pending = list(self._pending)
        self._marked = []
        try:
            if folder is not None:
                self._mark(folder)
            yield
        finally:
            self._pending[: len(pending)] = pending
            self._marked = None

    def _mark(self, folder: Path) -> None:
        """Inside the wrapped ``save_state``, before Accelerate writes into ``folder``: its record marked unfinished at
        this optimizer step (collective), and the folder remembered to be marked whole once the save returns."""
        step = self.optimizer_step
        self._write_record(folder, step, complete=False)
        if self._marked is not None:
            self._marked.append((folder, step))

    def _on_save(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        if any(s.inner is not None and s.entered for s in self._swaps):
            # Only when save_state was not called through _StateVerb (e.g. Accelerator.save_state(acc, ...)):
            # the model's state gathered before this hook is the EMA's.
            raise RuntimeError(
                f"accelerator.save_state({output_dir!r}) ran while the EMA is swapped into the model (inside `with "
                "ema.swapped():`) and past the helper's wrapper of accelerator.save_state, which swaps the live "
                f"weights back for the save: Accelerate gathered the EMA as the model's weights, so {output_dir} "
                "holds EMA weights where the model's belong (under FSDP and DeepSpeed they are written already). Do "
                "not resume from that folder; call accelerator.save_state(...) itself, or save outside the `with "
                "ema.swapped():` block"
            )
        folder = local_folder(output_dir, "accelerator.save_state(output_dir)", "Accelerate")
        step = self.optimizer_step
        if self._marked is None:
            # Past the wrapper, which alone can tell when the save is whole: no record, so a resume from this folder
            # is checked as one saved before records were (the record of an earlier save would not fit this EMA).
            self._write_record(folder, None)
        if self._marked is None or (folder, step) in self._marked:  # marked by the wrapper already
            self.ema.save(self.model, folder, step)
            return
        # Accelerate wrote nothing of this save yet, but under _writes_model_first with a new checkpoint_<n> whose naming
        # _marked_once_named did not see (another Accelerate; no earlier record there: nothing is put back). Marked before the EMA's save, so a failed
        # mark leaves the folder as it was; from here until save_state returns the folder may hold files of two
        # saves, and a resume refuses it. An EMA save refused or failed puts the earlier record back: the folder
        # holds nothing of this save but a partial EMA, which its manifest, written last, does not list.
        restorable, earlier = self._finished_record(folder)
        self._write_record(folder, step, complete=False)
        self._marked.append((folder, step))
        try:
            self.ema.save(self.model, folder, step)
        except BaseException:
            if restorable:
                self._put_back(folder, earlier)
            raise

    def _finished_record(self, folder: Path) -> tuple[bool, int | None]:
        """On the ranks that write the save record: ``(True, the step of folder's finished record or None when it has
        none)``; ``(False, None)`` where nothing is to be put back (another rank, an unfinished or unreadable record,
        which refuse the folder already, or a folder Accelerate wrote the model into before this hook)."""
        if not self._writes_record() or _writes_model_first(self.accelerator):
            return False, None
        try:
            seen = self._read_record(self._record_path(folder))
        except CorruptCheckpointError:
            return False, None
        if seen is None:
            return True, None
        return seen[1], seen[0] if seen[1] else None

    def _put_back(self, folder: Path, step: int | None) -> None:
        """This rank's record of ``folder`` as it was before the save: finished at ``step``, or none. Local (the save
        is failing, maybe on this rank alone); a failure to put it back leaves the folder marked unfinished: refused."""
        path = self._record_path(folder)
        with contextlib.suppress(OSError):
            if step is None:
                path.unlink(missing_ok=True)
            else:
                record = {"kind": _SAVE_RECORD_KIND, "tag": self.ema.tag, "optimizer_step": step, "complete": True}
                atomic_write_bytes(path, record_bytes(record))

    def _record_path(self, folder: Path) -> Path:
        return folder / _SAVE_RECORD.format(tag=self.ema.tag)

    def _writes_record(self) -> bool:
        """Whether this rank writes the save record: where Accelerate writes its model's files (the main process, or
        each node's with ``save_on_each_node``), or every rank when each has its own folder (``shared=False``)."""
        acc = self.accelerator
        if not self.ema.shared:
            return True
        if getattr(getattr(acc, "project_configuration", None), "save_on_each_node", False):
            return bool(acc.is_local_main_process)
        return bool(acc.is_main_process)

    def _write_record(self, folder: Path, step: int | None, complete: bool = False) -> None:
        """The record of this save into ``folder`` (atomically), on the ranks that write it: at ``step``, ``complete``
        or not; ``step=None`` removes the helper's own record. On every rank (agreed: a failure raises on each)."""
        path = self._record_path(folder)
        world, rank = _world_rank()

        def write() -> None:
            if not self._writes_record():
                return
            try:
                if step is not None:
                    folder.mkdir(parents=True, exist_ok=True)  # a save's first write (see _saving) may come first
                    record = {"kind": _SAVE_RECORD_KIND, "tag": self.ema.tag, "optimizer_step": step}
                    atomic_write_bytes(path, record_bytes({**record, "complete": complete}))
                    return
                with contextlib.suppress(CorruptCheckpointError):  # a file that is not the helper's record stays
                    if self._read_record(path) is not None:
                        path.unlink()
            except OSError as e:
                raise io_error(e, rank, path) from None

        if complete:  # save_state has no collective after its hooks: each writing rank marks its own folder
            write()
        else:
            agree("accelerator.save_state (EMA save record)", write, None, world, rank, results=False)

    def _read_record(self, path: Path) -> tuple[int, bool] | None:
        """The (optimizer step, complete) of the save record at ``path``; ``None`` when there is none (a folder
        saved before records were, or past the wrapper); a damaged or foreign file is refused, naming it."""
        record = read_record(path)
        if record is None:
            return None
        step, complete = record.get("optimizer_step"), record.get("complete")
        if (
            record.get("kind") != _SAVE_RECORD_KIND
            or record.get("tag") != self.ema.tag
            or type(step) is not int
            or step < 0
            or type(complete) is not bool
        ):
            raise CorruptCheckpointError(
                f"{path} is not the accelerator.save_state record of the EMA tag {self.ema.tag!r} (its kind, tag, "
                "optimizer_step or complete field is wrong): the file is damaged or was replaced; restore it or "
                "resume from another checkpoint"
            )
        return step, complete

    def _saved(self) -> None:
        """After the wrapped ``save_state`` returned: each folder it marked is whole (Accelerate's files written)."""
        marked, self._marked = self._marked or [], []
        for folder, step in marked:
            self._write_record(folder, step, complete=True)

    def _on_load(self, models: list[Any], input_dir: str) -> None:
        # Runs after DeepSpeed's load_checkpoint (global_steps restored) and before the rest. Without
        # DeepSpeed the optimizer-step counter is this helper's own: it comes back from the EMA
        # checkpoint's checksummed record, checked against the EMA's step.
        if any(s.inner is not None and s.entered for s in self._swaps):
            # Only when load_state was not called through _StateVerb (e.g. Accelerator.load_state(acc, ...)).
            raise RuntimeError(
                f"accelerator.load_state({input_dir!r}) ran while the EMA is swapped into the model (inside `with "
                "ema.swapped():`) and past the helper's wrapper of accelerator.load_state, which swaps the live "
                "weights back for the load: the end of the block would put the weights of before the load back "
                "(under FSDP and DeepSpeed Accelerate loaded the model already). Call accelerator.load_state(...) "
                "itself, or load outside the `with ema.swapped():` block"
            )
        folder = local_folder(input_dir, "accelerator.load_state(input_dir)", "Accelerate")
        checked = self._checked
        # The save_state the folder's own files are of (None: no record): checked by the wrapper before Accelerate
        # loaded anything, or here, past the wrapper (e.g. Accelerator.load_state(acc, ...))
        recorded = checked[1] if checked is not None and checked[0] == folder else self._recorded_step(folder, False)
        engine = self._engine_steps()
        try:
            saved = self.ema.load(self.model, folder, framework_step=recorded if engine is None else engine)
        except (CheckpointMismatchError, IncompleteCheckpointError) as e:
            raise self._refused(folder, recorded, e) from e
        self._pending = [0] * len(self._pending)  # the count restarts from the checkpoint's
        if engine is None:
            self._steps = saved

    @contextlib.contextmanager
    def _loading(self, folder: Path | None) -> Iterator[None]:
        """Around ``accelerator.load_state`` (:class:`_StateVerb`), before Accelerate loads anything (a DeepSpeed or
        FSDP model is loaded before its pre-hooks): what needs nothing loaded is checked on ``folder`` (the folder
        it loads, :func:`_load_folder`; ``None``: left to the hook), so a refused folder changes nothing: its save
        record, and the step its EMA was saved at against the record. The rest the EMA's load checks in the hook."""
        if folder is not None:
            recorded = self._recorded_step(folder)
            if recorded is not None:
                self._check_saved_ema(folder, recorded)
            self._checked = (folder, recorded)
        try:
            yield
        finally:
            self._checked = None

    def _check_saved_ema(self, folder: Path, recorded: int) -> None:
        """Refuse ``folder`` when its EMA is not of the ``save_state`` at optimizer step ``recorded`` (its record),
        from the EMA's manifest or not-started record alone (:func:`_saved_ema_step`), read on every rank: an EMA of
        another save, or none where the EMA must have started by then."""
        world, rank = _world_rank()
        tag_dir = folder / self.ema.tag
        what = "accelerator.load_state (EMA checkpoint)"
        seen = agree(what, lambda: _saved_ema_step(tag_dir, self.ema.shared), None, world, rank)
        other = [step for _, step in seen if step is not None and step != recorded]
        if other:
            where = f"accelerator.load_state({str(folder)!r})"
            raise CheckpointMismatchError(
                f"{where}: the folder holds Accelerate's files of the save_state at optimizer step {recorded} (its "
                f"record {self._record_path(folder).name} says so), but its EMA {tag_dir} was saved with the "
                f"save_state of optimizer step {other[0]}: the EMA save of step {recorded} did not finish (an "
                "async_save write that failed in the background, or a process that ended before its write committed), "
                "leaving the EMA of another save. Nothing was loaded. Resume from an earlier checkpoint folder, or "
                "save again from a run at that step"
            )
        if all(kind == "nothing" for kind, _ in seen) and (
            expected_ema_step(recorded, self.ema.start_step, self.ema.every_n_steps) is not None
        ):
            missing = IncompleteCheckpointError(f"{tag_dir} holds no EMA checkpoint")
            raise self._refused(folder, recorded, missing)

    def _recorded_step(self, folder: Path, before_load: bool = True) -> int | None:
        """The optimizer step of the ``save_state`` whose files ``folder`` holds, by its save record, agreed by every
        rank; ``None`` without one (saved by an earlier version, or past the wrapper: the EMA's own record gives the
        step, as before). A save that did not finish, or ranks that read different records, are refused.
        ``before_load``: called before Accelerate loaded anything (by the wrapper), else from the load-state hook."""
        path = self._record_path(folder)
        world, rank = _world_rank()
        what = "accelerator.load_state (EMA save record)"
        arrive(what, None, world, rank, None)  # bounded, as the EMA's load: a rank loading alone fails, not hangs
        seen = agree(what, lambda: self._read_record(path), None, world, rank)
        where = f"accelerator.load_state({str(folder)!r})"
        if any(v != seen[0] for v in seen):
            views = ", ".join(
                f"rank {r}: " + ("none" if v is None else f"step {v[0]}" + ("" if v[1] else " (unfinished)"))
                for r, v in enumerate(seen)
            )
            raise CheckpointMismatchError(
                f"{where}: the ranks read different save records {path.name} ({views}); every rank must load the "
                "folder of one save_state"
            )
        if seen[0] is None:
            return None
        step, complete = seen[0]
        loaded = (
            "Nothing was loaded."
            if before_load
            else "The EMA was not loaded, but this load_state ran past the helper's wrapper of accelerator.load_state "
            "(which checks before anything is loaded), and under DeepSpeed or FSDP Accelerate loaded the model and "
            "optimizer already: load another folder now."
        )
        if not complete:
            raise CheckpointMismatchError(
                f"{where}: the save_state of optimizer step {step} into this folder did not finish (its record "
                f"{path.name} says so): it failed or was stopped while writing, so the folder may hold the model, "
                f"optimizer and EMA of different saves. {loaded} Resume from an earlier checkpoint folder, or save "
                "again from a run at that step"
            )
        return step

    def _refused(self, folder: Path, recorded: int | None, e: Exception) -> Exception:
        """The EMA's refusal to load from ``folder`` with what the helper knows of it: the step of the save_state
        its files are of (``recorded``), and what most likely left the EMA of another save, or none."""
        where = f"accelerator.load_state({str(folder)!r})"
        at = "" if recorded is None else f" of the save_state at optimizer step {recorded} (its record says so)"
        cause = "an async_save write that failed in the background, or a process that ended before its write committed"
        if isinstance(e, IncompleteCheckpointError) and not (
            has_saved_ema(folder, self.ema.tag) or (folder / self.ema.tag / RECORD_NAME).is_file()
        ):
            though = "" if recorded is None else f", though the folder is{at},"
            return IncompleteCheckpointError(
                f"{where}: {folder / self.ema.tag} holds no complete EMA checkpoint (no {MANIFEST_NAME}) and no "
                f"not-started record{though} and the EMA (start_step={self.ema.start_step}) must have started by "
                f"then. Its EMA save did not finish ({cause}), or the "
                "helper was not attached when it ran. An earlier checkpoint folder may hold a complete EMA: "
                "load_state that folder, or start a new EMA"
            )
        if recorded is None or not isinstance(e, CheckpointMismatchError):
            return e
        return CheckpointMismatchError(
            f"{where}: the folder holds Accelerate's files{at}, but not its EMA: {e}. Where the EMA's step is what "
            f"differs, the EMA save of that save_state did not finish ({cause}), leaving the EMA of an "
            "earlier save: resume from an earlier checkpoint folder, or save again from a run at that step"
        )

    def export(self, path: str | os.PathLike, index: int | None = None) -> Path | None:
        """Consolidated EMA ``index`` into one safetensors file (rank 0 writes). Collective. Named as the model's
        own parameters: without the ``_orig_mod.`` of torch.compile's wrapper and the ``module.`` of a DDP inside it
        (:func:`_wrapper_prefix`), so it loads into the plain model."""
        return self.ema.export(self.model, path, index, strip_prefix=_wrapper_prefix(self.model))

    def copy_to_model(self, index: int | None = None) -> None:
        """Overwrite the model's weights with EMA ``index`` (end of training). Collective."""
        self.ema.copy_to_model(self.model, index)

    def wait(self) -> None:
        """Wait for the EMA writes in flight (``async_save=True``); raise a failure of one."""
        self.ema.wait()

    def end(self) -> None:
        """The configured final export / copy into the model (``export_path=``, ``copy_to_model=``)."""
        self.ema.on_train_end(self.model, strip_prefix=_wrapper_prefix(self.model))

    def remove_hooks(self) -> None:
        """Detach from the accelerator: no save/load of the EMA with its state, no step counted; frees the tag."""
        for h in self._handles:
            h.remove()
        self._handles, self._pending = [], []
