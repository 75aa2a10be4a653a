"""Hugging Face ``Trainer`` callback: EMA under DeepSpeed ZeRO-0..3, FSDP2, DDP or one process.

Example::

    from functional_ema.integrations.transformers import EMACallback

    ema = EMACallback(decay=0.999, export_path="out/ema.safetensors")
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val, callbacks=[ema])
    trainer.train()                                  # or train(resume_from_checkpoint=True)

``trainer.add_callback(ema)`` works the same.

What it does, per ``Trainer`` event:

* ``on_step_end`` (once per optimizer step, after gradient accumulation): update the EMA of the
  fp32 weights the optimizer holds (``trainer.model_wrapped``: the DeepSpeed engine, the FSDP2 or
  DDP model), at ``state.global_step``;
* ``on_evaluate`` (once per ``evaluate`` call, once per dataset of a dict): evaluate the same dataset
  again with the EMA weights swapped in; the metrics are logged, and added to the dict ``evaluate``
  returns, with the prefix ``metric_prefix`` (``eval_ema``) in place of the live prefix's leading
  ``eval`` (``eval_ema_loss``, ``eval_ema_<name>_loss`` for a dict of datasets; another
  ``metric_key_prefix``, e.g. ``"test"``, follows it: ``eval_ema_test_loss``);
* ``on_save``: every rank writes its EMA pieces into the checkpoint folder
  (``output_dir/checkpoint-<step>/ema/``), so checkpoint rotation removes them together; with
  ``async_save=True`` and ``save_total_limit``, the save in flight is committed on every rank at the last
  event before the Trainer may delete its folder (``on_step_end``/``on_epoch_end`` of a step that saves,
  ``on_log`` once training stops), so a folder is never deleted mid-write;
* ``on_train_begin`` of a resumed run: load the EMA from the checkpoint being resumed (any world
  size: it reshards);
* ``on_train_end``: the optional export (one consolidated safetensors file) or copy into the model.

The callback needs the ``Trainer`` itself: its events are handed the unwrapped model and, under
DeepSpeed, Accelerate's optimizer wrapper, neither of which leads to the engine (``trainer.model_wrapped``)
that holds the fp32 weights, nor to ``trainer.evaluate``. Nothing the ``Trainer`` passes names it, so at
each ``on_train_begin`` (and ``on_init_end``) the callback finds it on the call stack: the innermost caller
that is a ``transformers.Trainer`` (any subclass) whose callback handler holds this callback. Every
``Trainer`` raises its events from its own methods, so this holds for ``callbacks=[...]``,
``add_callback`` and subclasses (TRL's trainers, ...); the resumed checkpoint folder is read from the same
frames (``resume_from_checkpoint``, as ``train`` resolved it), and so is the dataset of the ``evaluate``
call being answered (its ``eval_dataset`` and ``metric_key_prefix``). :meth:`EMACallback.attach` stays for
code that raises the events outside a ``Trainer`` method: it names the ``Trainer`` explicitly.

One callback serves one ``Trainer``: its EMA is that ``Trainer``'s weights. A second ``Trainer`` that
raises its events (or is given to ``attach``) while the first is alive is refused with a
``RuntimeError`` naming both; once the first was garbage collected a new one is accepted, with a fresh
EMA.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import re
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback

from functional_ema._args import check_str
from functional_ema._checkpoint.errors import CheckpointError
from functional_ema._checkpoint.format import MANIFEST_NAME
from functional_ema._state import EmaState
from functional_ema.schedules import DecayLike

from ._common import EMAController, agreed_everywhere, barrier, check_folder_tag, has_saved_ema, local_folder

__all__ = ["EMACallback"]

_HF = "the Hugging Face Trainer"  # named when a URL reaches a folder only the Trainer's local I/O writes

_LIVE_PREFIX = "eval"  # the Trainer's default metric_key_prefix, which metric_prefix stands in for

# reason: Trainers evaluating with EMA weights swapped in now (weak: none is kept alive): the events of that
# evaluation are not answered, by this callback (no recursion) nor by another EMACallback on the same Trainer.
_EMA_EVALUATING: weakref.WeakSet[Any] = weakref.WeakSet()  # reason: Trainers in an EMA evaluation (weak)

logger = logging.getLogger("functional_ema")

# The folders (and extension-less files) the Trainer writes into a checkpoint folder under FSDP (pytorch_model_fsdp_<N>,
# optimizer_<N>) or DeepSpeed; its files with an extension are refused by check_folder_tag's ending rule.
_TRAINER_FOLDERS = re.compile(r"(pytorch_model_fsdp|optimizer)_\d+|global_step\d+|zero_to_fp32")


def _check_trainer_tag(tag: str) -> str:
    """``tag``: a folder name that none of the Trainer's own checkpoint files or folders can have."""
    return check_folder_tag(
        tag, _TRAINER_FOLDERS, "the Trainer", "model.safetensors, trainer_state.json, optimizer.pt, rng_state.pth"
    )


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Put back the global random generators the EMA evaluation advances (dropout, sampling, a shuffling eval
    sampler): torch's CPU one, every CUDA device's (when CUDA is initialised), numpy's and Python's. Without this,
    turning the EMA evaluation on changes what the training that follows draws, and so the trained weights."""
    import numpy as np

    cpu, py, npy = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        np.random.set_state(npy)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _framework_callbacks(trainer: Any) -> tuple[type, ...]:
    """The classes of the callbacks the Trainer adds itself, which must not hear the EMA evaluation's ``on_evaluate``
    (they count or report one evaluation per event; they get its ``on_log`` with the EMA metrics): the flow and
    progress ones (``DefaultFlowCallback``, ``ProgressCallback``, ``PrinterCallback``, ``NotebookProgressCallback``)
    and the reporting integrations of ``args.report_to``. NotebookProgressCallback is looked up only where its module
    is imported (it needs IPython): without that, no instance of it can be in the handler."""
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

    classes: list[type] = [DefaultFlowCallback, ProgressCallback, PrinterCallback]
    notebook = sys.modules.get("transformers.utils.notebook")
    if isinstance(getattr(notebook, "NotebookProgressCallback", None), type):
        classes.append(notebook.NotebookProgressCallback)  # type: ignore[union-attr]
    with contextlib.suppress(ValueError, KeyError, TypeError):  # a report_to the Trainer would refuse: none added
        classes.extend(get_reporting_integration_callbacks(getattr(trainer.args, "report_to", None)))
    return tuple(c for c in classes if isinstance(c, type))


def _answer_earlier(handler: Any, earlier: list[Any], flags: dict[str, Any], kept: dict[str, Any]) -> Any:
    """The callback handler's ``on_evaluate`` during an EMA evaluation: heard only by the user's callbacks ``earlier``
    than the EMA callback in the handler's list (the Trainer's own flow, progress and reporting callbacks, which come
    first, left out: :func:`_framework_callbacks`), which met the outer event before the EMA metrics were added to it
    (an ``EarlyStoppingCallback`` on ``eval_ema_loss`` placed before it finds them only here); the later ones get
    them in the outer event's ``metrics``, and hearing this one too would count one evaluation twice. They meet
    ``control`` as it was before the EMA evaluation (``flags``: not as its ``on_log`` left it), and the flags they
    change go into ``kept``, to survive the EMA evaluation's restore."""

    def on_evaluate(args: Any, state: Any, control: Any, metrics: Any = None) -> Any:
        vars(control).update(flags)
        control.should_evaluate = False  # as the handler's own on_evaluate
        everyone = handler.callbacks
        handler.callbacks = [c for c in earlier if _would_act(c, args, metrics)]
        try:
            control = handler.call_event("on_evaluate", args, state, control, metrics=metrics)
        finally:
            handler.callbacks = everyone
        kept.update({k: v for k, v in vars(control).items() if flags.get(k) != v and k != "should_evaluate"})
        return control

    return on_evaluate


def _would_act(callback: Any, args: Any, metrics: Any) -> bool:
    """Whether ``callback`` should hear the EMA evaluation's ``on_evaluate``: an ``EarlyStoppingCallback`` only where
    these metrics hold the one it watches (``args.metric_for_best_model``, ``eval_`` prefixed as it does): one on
    the live ``eval_loss`` would find nothing there but warn, at every evaluation, that early stopping is disabled
    (it is not: the live event carries its metric)."""
    from transformers import EarlyStoppingCallback

    if not isinstance(callback, EarlyStoppingCallback):
        return True
    watched = getattr(args, "metric_for_best_model", None)
    if not isinstance(watched, str):
        return True  # EarlyStoppingCallback's own assertion names it
    watched = watched if watched.startswith("eval_") else f"eval_{watched}"
    return isinstance(metrics, Mapping) and watched in metrics


def _generation_kwargs(trainer: Any) -> dict[str, Any]:
    """The generation settings of the live evaluation being answered (``Seq2SeqTrainer.evaluate(**gen_kwargs)``
    keeps them in ``_gen_kwargs`` for its prediction steps), for the EMA evaluation to generate the same way."""
    from transformers import Seq2SeqTrainer

    gen = getattr(trainer, "_gen_kwargs", None)
    return dict(gen) if isinstance(trainer, Seq2SeqTrainer) and isinstance(gen, dict) else {}


def _check_metric_prefix(value: Any) -> str:
    """``metric_prefix``: a name that keeps the EMA metrics apart from the live ones."""
    prefix = check_str(value, "metric_prefix")
    if not prefix.strip() or prefix != prefix.strip():
        raise ValueError(f"metric_prefix must be a non-empty name without surrounding spaces, got {prefix!r}")
    if prefix == _LIVE_PREFIX:
        raise ValueError(
            f"metric_prefix={prefix!r} is the Trainer's own prefix: the EMA metrics would overwrite the live ones "
            "(eval_loss); use another, e.g. the default 'eval_ema'"
        )
    return prefix


def _describe(trainer: Any) -> str:
    """A ``Trainer``'s identity for an error message: its class, address and output folder."""
    out = getattr(getattr(trainer, "args", None), "output_dir", None)
    return f"{type(trainer).__name__} at 0x{id(trainer):x} (output_dir={out!r})"


def _method_self(frame: FrameType) -> Any:
    """The ``self`` of a method's frame; ``None`` for other frames, whose locals are not read: before
    Python 3.13 reading ``f_locals`` keeps a copy of them in the frame, and a plain function (the
    user's script) would keep a deleted ``Trainer`` alive through it."""
    code = frame.f_code
    if code.co_argcount and code.co_varnames[0] == "self":
        return frame.f_locals.get("self")
    return None


def _strategy(args: Any) -> str:
    """``args.eval_strategy`` as its string value (``"steps"``, ``"epoch"``, ``"no"``)."""
    value = getattr(args, "eval_strategy", "no")
    return str(getattr(value, "value", value))


def _first_evaluation(args: Any, state: Any, per_epoch: int | None) -> tuple[int | None, str]:
    """The optimizer step after which the Trainer's first evaluation of this run comes (``None``: none, or not
    known: an epoch strategy whose steps per epoch were not read), by its own rules (``DefaultFlowCallback``), from
    ``state.global_step`` (a resume's), and the settings that put it there, for a message."""
    done, last, delay = int(state.global_step), int(state.max_steps), args.eval_delay or 0
    if _strategy(args) == "steps":
        every = int(state.eval_steps)
        start = max(done + 1, math.ceil(delay))
        due = [e for e in (math.ceil(start / every) * every, last) if done < e <= last and e >= delay]
        return (min(due) if due else None), f"eval_strategy='steps', eval_steps={every}, eval_delay={delay}"
    if _strategy(args) == "epoch" and per_epoch:
        epoch = max(done // per_epoch + 1, math.ceil(delay))  # the first epoch whose end is evaluated
        first: int | None = epoch * per_epoch
        if epoch * per_epoch > last:  # training stops before that epoch ends: at the end of the one running then
            first = last if epoch == done // per_epoch + 1 else None
        return first, f"eval_strategy='epoch', {per_epoch} optimizer steps per epoch, eval_delay={delay}"
    return None, ""


def _delay_fix(args: Any, begins: int, per_epoch: int | None) -> str:
    """The ``eval_delay`` that puts the first evaluation at or after optimizer step ``begins``."""
    if _strategy(args) == "epoch" and per_epoch:
        return f"eval_delay={math.ceil(begins / per_epoch)} epochs"
    return f"eval_delay={begins}"


class EMACallback(TrainerCallback):
    """EMA of the weights for a ``transformers.Trainer``; see the module docstring.

    Args:
        decay: one decay (float, schedule or callable) or a sequence, one per EMA.
        **kwargs: ``every_n_steps``, ``start_step``, ``buffers``, ``eval_index``, ``posthoc_dir``,
            ``posthoc_every``, ``export_path``, ``copy_to_model``, ``tag``, ``async_save``, ``dtype``,
            ``include``, ``exclude`` (which parameters are averaged, by name): as for
            ``functional_ema.integrations._common.EMAController``.
        metric_prefix: prefix of the metrics of the evaluation with EMA weights; it replaces the leading
            ``eval`` of the live prefix (``eval_loss`` -> ``eval_ema_loss``, ``eval_<name>_loss`` ->
            ``eval_ema_<name>_loss``) and comes before any other (``metric_key_prefix="test"``:
            ``eval_ema_test_loss``). Not empty, and not ``"eval"`` (the live metrics' own).
    """

    def __init__(
        self, decay: DecayLike | Sequence[DecayLike] = 0.9999, *, metric_prefix: str = "eval_ema", **kwargs: Any
    ) -> None:
        self.ema = EMAController(decay, **kwargs)
        _check_trainer_tag(self.ema.tag)
        self.metric_prefix = _check_metric_prefix(metric_prefix)
        self._trainer_ref: weakref.ReferenceType[Any] | None = None  # weak: the Trainer holds this callback
        self._resume_arg: Any = None
        self._steps_per_epoch: int | None = None  # the Trainer's optimizer steps per epoch, read at on_train_begin
        # async_save: the checkpoint folder and step of the last EMA save not yet waited for (every rank alike)
        self._in_flight: tuple[Path, int] | None = None

    # -------------------------------------------------------------------------------- wiring

    def attach(self, trainer: Any) -> EMACallback:
        """Add this callback to ``trainer`` (if not already there) and keep a reference to it.

        Not needed with ``Trainer(..., callbacks=[ema])`` or ``trainer.add_callback(ema)``: the callback
        finds its ``Trainer`` when training begins. ``attach`` names it explicitly, for code that
        raises the callback events outside the ``Trainer``'s own methods. ``trainer.train`` is wrapped
        (on this instance only) to see ``resume_from_checkpoint``, so the EMA is loaded from the same
        checkpoint as the weights. A callback serves one ``Trainer``: a second one, while the first is
        alive, is refused (``RuntimeError``). Returns ``self``.
        """
        if not (callable(getattr(trainer, "add_callback", None)) and hasattr(trainer, "callback_handler")):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        self._adopt(trainer)  # before anything changes on the trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        train = trainer.train

        @functools.wraps(train)
        def train_and_remember(*args: Any, **kwargs: Any) -> Any:
            self._resume_arg = kwargs.get("resume_from_checkpoint", args[0] if args else None)
            return train(*args, **kwargs)

        trainer.train = train_and_remember
        return self

    @property
    def state(self) -> EmaState | None:
        """This rank's :class:`functional_ema.EmaState` (``None`` before the EMA starts)."""
        return self.ema.state

    def _trainer(self) -> Any:
        """The ``Trainer`` this callback serves (``None``: none yet, or it was garbage collected)."""
        return None if self._trainer_ref is None else self._trainer_ref()

    def _adopt(self, trainer: Any) -> None:
        """Serve ``trainer``; a second ``Trainer`` while the first is alive is refused: the EMA is the
        first one's weights, and would be swapped into the second one's model."""
        current = self._trainer()
        if current is trainer:
            return
        if current is not None:
            import gc

            del current
            gc.collect()  # a deleted Trainer kept only by its own reference cycles is gone, not in the way
            current = self._trainer()
        if current is not None:
            why = (
                f"this EMACallback already serves {_describe(current)}, whose weights its EMA holds; "
                f"{_describe(trainer)} cannot use it too: create one EMACallback per Trainer"
            )
            del current  # the traceback of the error must not keep the first Trainer alive
            raise RuntimeError(why)
        if self._trainer_ref is not None:  # the previous Trainer was garbage collected: its EMA goes with it
            self.ema.state = self.ema.buffer_state = None
        self._trainer_ref, self._resume_arg = weakref.ref(trainer), None

    def _find_trainer(self) -> None:
        """Find the ``Trainer`` raising this event (see the module docstring) and the checkpoint it resumes."""
        from transformers import Trainer

        frame: FrameType | None = sys._getframe(1)
        found, resumed, per_epoch = None, None, None
        while frame is not None:
            owner = _method_self(frame)
            if isinstance(owner, Trainer) and self in getattr(owner.callback_handler, "callbacks", ()):
                found = found if found is not None else owner
                arg = frame.f_locals.get("resume_from_checkpoint")
                if owner is found and resumed is None and isinstance(arg, (str, os.PathLike)):
                    resumed = arg  # as train() resolved it (True -> the last checkpoint)
                steps = frame.f_locals.get("num_update_steps_per_epoch")  # the training loop's own count
                if owner is found and per_epoch is None and type(steps) is int and steps > 0:
                    per_epoch = steps
            frame = frame.f_back
        self._steps_per_epoch = per_epoch
        if found is not None:
            self._adopt(found)
        if resumed is not None:
            self._resume_arg = resumed

    def _evaluate_call(self) -> tuple[Any, Any, Any, str]:
        """The ``Trainer`` whose ``evaluate`` raised this ``on_evaluate``, and what that call evaluates:
        ``(trainer, eval_dataset, ignore_keys, metric_key_prefix)``, read from the innermost ``evaluate``
        frame on the stack (the one that raised the event, after it resolved ``eval_dataset``: a
        dataset, the name of one of ``trainer.eval_dataset``'s, or ``None`` for the default)."""
        for owner, found in self._evaluate_frames():
            prefix = found.get("metric_key_prefix")
            if "eval_dataset" in found and isinstance(prefix, str):
                dataset = found["eval_dataset"]
                # The Trainer's own dataset (what evaluate() resolved None to) is passed on as None, as the
                # call was made: a subclass's evaluate treats a dataset given to it as a new one (TRL's
                # DPOTrainer with precompute_ref_log_probs refuses one after step 0).
                if dataset is getattr(owner, "eval_dataset", None):
                    dataset = None
                return owner, dataset, found.get("ignore_keys"), prefix
            break
        raise RuntimeError(
            "EMACallback.on_evaluate found no Trainer.evaluate call (with eval_dataset and metric_key_prefix) on "
            "the call stack, so it cannot tell which dataset to evaluate the EMA on; raise on_evaluate from "
            "trainer.evaluate(...), or set eval_index=None to evaluate no EMA"
        )

    def _ema_prefix(self, live: str) -> str:
        """The EMA metrics' prefix for an evaluation whose live metrics have prefix ``live``."""
        if live == _LIVE_PREFIX or live.startswith(_LIVE_PREFIX + "_"):
            return self.metric_prefix + live[len(_LIVE_PREFIX) :]
        return f"{self.metric_prefix}_{live}"

    def _target(self) -> Any:
        t = self._trainer()
        if t is None:
            raise RuntimeError(
                "EMACallback found no Trainer: pass it in Trainer(..., callbacks=[ema]) or trainer.add_callback(ema) "
                "and train with trainer.train(); if the callback events are raised outside the Trainer's methods, "
                "name it with EMACallback(...).attach(trainer)"
            )
        wrapped = getattr(t, "model_wrapped", None)
        return wrapped if wrapped is not None else t.model

    def _run_dir(self, args: Any) -> Any:
        """The folder the Trainer writes this run's ``checkpoint-<N>`` folders into: ``output_dir``, or under
        ``hyperparameter_search`` the trial's own ``output_dir/<run name>`` (``Trainer._get_output_dir``)."""
        trainer = self._trainer()
        if trainer is not None and hasattr(trainer, "_trial") and callable(getattr(trainer, "_get_output_dir", None)):
            return trainer._get_output_dir(trial=trainer._trial)
        return args.output_dir

    def _resume_dir(self, args: Any, state: Any) -> str:
        arg = self._resume_arg
        if isinstance(arg, (str, os.PathLike)) and os.path.isdir(arg):
            return os.fspath(arg)
        if arg is True or arg is None:
            from transformers.trainer_utils import get_last_checkpoint

            if arg is True:
                last = get_last_checkpoint(args.output_dir)
                if last is not None:
                    return last
        return os.path.join(self._run_dir(args), f"checkpoint-{state.global_step}")

    # -------------------------------------------------------------------------------- events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._find_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._find_trainer()
        if state.global_step > 0:  # a resumed run: the weights came from a checkpoint, so does the EMA
            folder = local_folder(self._resume_dir(args, state), "resume_from_checkpoint", _HF)
            self.ema.load(self._target(), folder, framework_step=state.global_step)
        else:
            self.ema.state = self.ema.buffer_state = None
        self._check_best_metric(args, state)

    def _check_best_metric(self, args: Any, state: Any) -> None:
        """Refuse, before any step, a ``metric_for_best_model`` naming an EMA metric when the first evaluation of
        this run comes before the EMA starts: that evaluation has no EMA metric, and the Trainer would stop there
        with a ``KeyError`` (``eval_on_start``'s evaluation picks no best model: it is not counted)."""
        best = getattr(args, "metric_for_best_model", None)
        if not isinstance(best, str) or self.ema.eval_index is None:
            return
        key = best if best.startswith("eval_") else f"eval_{best}"  # as the Trainer looks it up
        if not any(k.startswith(self.metric_prefix + "_") for k in (best, key)):
            return  # a live metric
        first, setting = _first_evaluation(args, state, self._steps_per_epoch)
        begins = max(1, self.ema.start_step)
        if first is None or first >= begins:
            return
        raise ValueError(
            f"metric_for_best_model={best!r} is an EMA metric, but the first evaluation comes after optimizer step "
            f"{first} ({setting}) and the EMA starts after step {begins} (start_step={self.ema.start_step}): "
            f"that evaluation has no {key!r} and the Trainer would stop there with a KeyError. Delay the "
            f"evaluations ({_delay_fix(args, begins, self._steps_per_epoch)}), lower start_step to {first} or less, "
            "or choose a live metric (eval_loss) for metric_for_best_model"
        )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ema.before_optimizer_step(self._target())  # parameters unfrozen since the last step join the EMA

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ema.on_step(self._target(), state.global_step)
        self._before_deletion(args, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before_deletion(args, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        # The last event before _finalize_training's cleanup is its log of the train metrics: training has stopped.
        self._before_deletion(args, control, end=bool(control.should_training_stop))

    def _before_deletion(self, args: Any, control: Any, end: bool = False) -> None:
        """With ``async_save`` and ``save_total_limit``: the Trainer deletes checkpoint folders in ``_save_checkpoint``
        before ``on_save`` (its rotation, which can take the folder of the EMA save in flight: the previous checkpoint,
        when it is not the best, or any under mtime ordering) and, ``save_total_limit=1`` with a best checkpoint, at the
        end of training before ``on_train_end``. At the last events before those (``on_step_end``, ``on_epoch_end``,
        ``on_log``) where a save (``should_save``; ``save_strategy="best"``: an evaluation) or the end follows, the save
        in flight is committed on every rank, then a barrier (rank 0 deletes): a folder goes whole, never mid-write,
        and a failure of the write is raised here. The write still overlaps the training between two saves."""
        if self._in_flight is None or (getattr(args, "save_total_limit", None) or 0) <= 0:
            return
        best = str(getattr(args.save_strategy, "value", args.save_strategy)) == "best" and control.should_evaluate
        if end or control.should_save or best:
            self._wait_in_flight()
            barrier()

    def _wait_in_flight(self) -> None:
        """Wait for the async EMA save in flight (``_in_flight``); a failure of it is raised as a
        :class:`CheckpointError` naming its checkpoint folder: when that folder is gone, with the cause (something
        deleted it under the write), never as the background's raw ``OSError``."""
        if self._in_flight is None:
            return
        (folder, step), self._in_flight = self._in_flight, None
        try:
            self.ema.wait()
        except Exception as e:
            where = folder / self.ema.tag
            if where.is_dir() and isinstance(e, CheckpointError):
                raise  # the save's own (another rank's failure, ...): it names the folder
            why = (
                f"{type(e).__name__}: {e}"
                if where.is_dir()
                else f"{folder} was deleted while the EMA was being written into it in the background "
                f"({type(e).__name__}: {e}). EMACallback waits for its save in flight before the Trainer's own "
                "deletions (save_total_limit, and the end-of-training cleanup of load_best_model_at_end with "
                "save_total_limit=1), so something else deleted it: another process, or the Trainer's rotation after "
                "a callback placed after EMACallback set control.should_save (place EMACallback after that callback)"
            )
            raise CheckpointError(
                f"the async EMA save of step {step} into {where} failed: {why}. That checkpoint holds no complete EMA: "
                f"resume from another one (whose {self.ema.tag}/ holds {MANIFEST_NAME})"
            ) from e

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The folder the Trainer just saved into (a trial's own under hyperparameter_search): rotated together.
        output_dir = local_folder(self._run_dir(args), "TrainingArguments.output_dir", _HF)
        folder = output_dir / f"checkpoint-{state.global_step}"
        # The save below waits for the previous one anyway (one in flight): waited for here, its failure is named.
        self._wait_in_flight()
        self.ema.save(self._target(), folder, state.global_step)
        if self.ema.async_save:
            self._in_flight = (folder, int(state.global_step))

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        """Evaluate what this ``evaluate`` call evaluated (one dataset: the Trainer raises one event per
        dataset of a dict), with the EMA weights; log the metrics and add them to ``metrics``."""
        if not self.ema.started or self.ema.eval_index is None:
            return  # nothing to evaluate
        if self._trainer() in _EMA_EVALUATING:
            return  # the event of an EMA evaluation (this callback's or another EMACallback's)
        trainer, dataset, ignore_keys, live = self._evaluate_call()
        if trainer in _EMA_EVALUATING:
            return
        self._adopt(trainer)  # a second Trainer is refused here too (or, the first one gone, starts afresh)
        if not self.ema.started:
            return
        if metrics and not any(k.startswith(live + "_") for k in metrics):
            raise RuntimeError(
                f"EMACallback read metric_key_prefix={live!r} from the evaluate call on the stack, but the metrics "
                f"of this evaluation are {sorted(metrics)}: it cannot tell which evaluation it answers"
            )
        self._check_dataset_names()
        prefix = self._ema_prefix(live)
        ema_metrics = self._ema_evaluate(trainer, dataset, ignore_keys, prefix)
        if metrics is not None:
            ours = {k: v for k, v in ema_metrics.items() if k.startswith(prefix + "_")}
            clash = sorted(set(ours) & set(metrics))
            if clash:
                raise ValueError(
                    f"metric_prefix={self.metric_prefix!r} names EMA metrics {clash} that the live evaluation "
                    "already has; choose another metric_prefix"
                )
            metrics.update(ours)  # the dict evaluate() returns: metric_for_best_model can name an EMA metric

    def _check_dataset_names(self) -> None:
        """For a dict of datasets evaluated in one call (the outer ``evaluate`` frame on the stack): refuse, at its
        first dataset's event, before any metric is written, an EMA prefix of one dataset that is the live prefix
        of another (``{"b": B, "ema_b": E}``: ``eval_ema_b_loss`` would be both B's EMA loss and E's live one)."""
        for _, found in self._evaluate_frames():
            datasets, outer = found.get("eval_dataset"), found.get("metric_key_prefix")
            if isinstance(datasets, dict) and isinstance(outer, str):
                live = {f"{outer}_{name}": name for name in datasets}
                for name in datasets:
                    other = live.get(self._ema_prefix(f"{outer}_{name}"))
                    if other is not None:
                        raise ValueError(
                            f"metric_prefix={self.metric_prefix!r}: the EMA metrics of dataset {name!r} "
                            f"({self._ema_prefix(f'{outer}_{name}')}_*) would take the names of the live metrics "
                            f"of dataset {other!r} in the same evaluate call; rename one of the datasets or "
                            "choose another metric_prefix"
                        )
                return

    def _evaluate_frames(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """``(trainer, frame locals)`` of each ``Trainer.evaluate`` frame on the stack whose trainer holds this
        callback, innermost first (the one that raised the event; a dict evaluation's outer call further out)."""
        from transformers import Trainer

        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            owner = _method_self(frame) if frame.f_code.co_name == "evaluate" else None
            if isinstance(owner, Trainer) and self in getattr(owner.callback_handler, "callbacks", ()):
                yield owner, frame.f_locals
            frame = frame.f_back

    def _ema_evaluate(self, trainer: Any, dataset: Any, ignore_keys: Any, prefix: str) -> dict[str, float]:
        """``trainer.evaluate`` of the same dataset with the EMA weights swapped in. The Trainer sees no trace of it
        but the logged metrics (every callback hears its ``on_log``): its ``on_evaluate`` is heard only by the user's
        callbacks placed before this one (:func:`_answer_earlier`: they met the outer event before the EMA metrics
        were added to it), not by the Trainer's flow, progress and ``report_to`` callbacks nor by the callbacks after
        this one (one evaluation, one event); ``control`` and the random generators are as before (the training that
        follows is the one without it), but for what those earlier callbacks decided on the EMA metrics; and a
        ``Seq2SeqTrainer`` generates with the live call's settings, which it keeps afterwards."""
        handler, control = trainer.callback_handler, trainer.control
        flags, gen_kwargs = dict(vars(control)), getattr(trainer, "_gen_kwargs", None)
        patched = handler.__dict__.get("on_evaluate")  # an instance attribute someone set, put back after
        everyone = list(handler.callbacks)
        kept: dict[str, Any] = {}
        framework = _framework_callbacks(trainer)
        earlier = (
            [c for c in everyone[: everyone.index(self)] if not isinstance(c, framework)] if self in everyone else []
        )
        _EMA_EVALUATING.add(trainer)
        handler.on_evaluate = _answer_earlier(handler, earlier, flags, kept)
        try:
            with _rng_kept(), self.ema.swapped(self._target()):
                return trainer.evaluate(
                    eval_dataset=dataset,
                    ignore_keys=ignore_keys,
                    metric_key_prefix=prefix,
                    **_generation_kwargs(trainer),
                )
        finally:
            if patched is None:
                del handler.on_evaluate
            else:
                handler.on_evaluate = patched
            _EMA_EVALUATING.discard(trainer)
            trainer.control = control  # a callback's on_log may have set should_training_stop, should_save, ...
            vars(control).update(flags)
            vars(control).update(kept)  # ... but what the earlier callbacks decided on the EMA metrics stands
            if gen_kwargs is not None:
                trainer._gen_kwargs = gen_kwargs

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wait_in_flight()  # the best checkpoint's EMA may still be on its way (async_save); a failure named
        best = getattr(state, "best_model_checkpoint", None)
        if getattr(args, "load_best_model_at_end", False) and best is not None and self.ema.started:
            self._load_best_ema(best)
        self.ema.on_train_end(self._target())

    def _load_best_ema(self, checkpoint: str) -> None:
        """``load_best_model_at_end``: the Trainer holds the best checkpoint's weights now; the EMA saved with them
        replaces the final one, so the export and ``copy_to_model`` hold the EMA of the same checkpoint (and
        ``copy_to_model`` does not overwrite the best model with the final EMA). A checkpoint without an EMA (saved
        before it started, or without this callback) keeps the final EMA, with a warning."""
        folder = local_folder(checkpoint, "TrainerState.best_model_checkpoint", _HF)
        step = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        final = (self.ema.state, self.ema.buffer_state)
        saved = agreed_everywhere(has_saved_ema(folder, self.ema.tag), "load_best_model_at_end")
        if saved:
            self.ema.load(self._target(), folder, framework_step=int(step.group(1)) if step else None)
        if self.ema.state is None or not saved:  # None: a newer not-started record there supersedes its EMA
            self.ema.state, self.ema.buffer_state = final
            warnings.warn(
                f"load_best_model_at_end: the best checkpoint {folder} holds no EMA ({folder / self.ema.tag} has no "
                f"{MANIFEST_NAME}: saved before the EMA started?), so the export and copy_to_model use the final "
                "EMA, not the best checkpoint's",
                UserWarning,
                stacklevel=2,
            )
            return
        logger.info(
            "load_best_model_at_end: the EMA saved in the best checkpoint %s (EMA step %d) replaces the final one, "
            "for the export and copy_to_model",
            folder,
            int(self.ema.state.step),
        )
