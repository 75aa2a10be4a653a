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
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import accelerate  # noqa: F401 - the framework this module glues to

from functional_ema._state import EmaState
from functional_ema.engines import adapter_for
from functional_ema.schedules import DecayLike

from ._common import EMAController, check_folder_tag, local_folder

__all__ = ["AcceleratorEMA"]

# The folders (and extension-less files) accelerator.save_state writes into its folder besides files with an
# extension (model.safetensors, optimizer.bin, random_states_0.pkl, ...): DeepSpeed's checkpoint (its tag
# "pytorch_model", zero_to_fp32.py) and FSDP's sharded model and optimizer folders. ("latest" is every tag's reserved
# name already: check_tag refuses it first.)
_ACCELERATE_FOLDERS = re.compile(r"pytorch_model|(pytorch_model_fsdp|optimizer)_\d+|zero_to_fp32")

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
    none after every ``remove_hooks()``: then it only calls through) a save enters :meth:`AcceleratorEMA._saving`;
    every swap in force is taken out for the verb and put back after it (:func:`_swapped_out`). A plain
    object (the accelerator, the verb's name and the callable it wraps), so the accelerator still pickles and
    deep-copies."""

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
                for helper in helpers:
                    stack.enter_context(helper._saving())
            stack.enter_context(_swapped_out([s for h in helpers for s in h._swaps]))
            return verb(*args, **kwargs)


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
    def _saving(self) -> Iterator[None]:
        """Around ``accelerator.save_state`` (:class:`_StateVerb`), before Accelerate deletes or gathers anything."""
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
        try:
            yield
        finally:
            self._pending[: len(pending)] = pending

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
        self.ema.save(self.model, folder, self.optimizer_step)

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
        self._pending = [0] * len(self._pending)  # the count restarts from the checkpoint's
        if self._engine_steps() is not None:
            self.ema.load(self.model, folder, framework_step=self.optimizer_step)
        else:
            self._steps = self.ema.load(self.model, folder, framework_step=None)

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
