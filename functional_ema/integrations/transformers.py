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
* ``on_evaluate``: evaluate again with the EMA weights swapped in; the metrics are logged with the
  prefix ``eval_ema`` (``eval_ema_loss``, ...) beside the live ones;
* ``on_save``: every rank writes its EMA pieces into the checkpoint folder
  (``output_dir/checkpoint-<step>/ema/``), so checkpoint rotation removes them together;
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
frames (``resume_from_checkpoint``, as ``train`` resolved it). :meth:`EMACallback.attach` stays for code
that raises the events outside a ``Trainer`` method: it names the ``Trainer`` explicitly.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

from transformers import TrainerCallback

from functional_ema._args import check_str
from functional_ema._state import EmaState
from functional_ema.schedules import DecayLike

from ._common import EMAController

__all__ = ["EMACallback"]


class EMACallback(TrainerCallback):
    """EMA of the weights for a ``transformers.Trainer``; see the module docstring.

    Args:
        decay: one decay (float, schedule or callable) or a sequence, one per EMA.
        **kwargs: ``every_n_steps``, ``start_step``, ``buffers``, ``eval_index``, ``posthoc_dir``,
            ``posthoc_every``, ``export_path``, ``copy_to_model``, ``tag``, ``async_save``, ``dtype``: as
            for ``functional_ema.integrations._common.EMAController``.
        metric_prefix: prefix of the metrics of the evaluation with EMA weights.
    """

    def __init__(
        self, decay: DecayLike | Sequence[DecayLike] = 0.9999, *, metric_prefix: str = "eval_ema", **kwargs: Any
    ) -> None:
        self.ema = EMAController(decay, **kwargs)
        self.metric_prefix = check_str(metric_prefix, "metric_prefix")
        self._trainer: Any = None
        self._resume_arg: Any = None
        self._in_ema_eval = False
        self._evaluated_at: int | None = None

    # -------------------------------------------------------------------------------- wiring

    def attach(self, trainer: Any) -> EMACallback:
        """Add this callback to ``trainer`` (if not already there) and keep a reference to it.

        Not needed with ``Trainer(..., callbacks=[ema])`` or ``trainer.add_callback(ema)``: the callback
        finds its ``Trainer`` when training begins. ``attach`` names it explicitly, for code that
        raises the callback events outside the ``Trainer``'s own methods. ``trainer.train`` is wrapped
        (on this instance only) to see ``resume_from_checkpoint``, so the EMA is loaded from the same
        checkpoint as the weights. Returns ``self``.
        """
        if not (callable(getattr(trainer, "add_callback", None)) and hasattr(trainer, "callback_handler")):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self._trainer = weakref.proxy(trainer)
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

    def _find_trainer(self) -> None:
        """Find the ``Trainer`` raising this event (see the module docstring) and the checkpoint it resumes."""
        from transformers import Trainer

        frame: FrameType | None = sys._getframe(1)
        found, resumed = None, None
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and self in getattr(owner.callback_handler, "callbacks", ()):
                found = found if found is not None else owner
                arg = frame.f_locals.get("resume_from_checkpoint")
                if owner is found and resumed is None and isinstance(arg, (str, os.PathLike)):
                    resumed = arg  # as train() resolved it (True -> the last checkpoint)
            frame = frame.f_back
        if found is not None:
            self._trainer = weakref.proxy(found)
        if resumed is not None:
            self._resume_arg = resumed

    def _target(self) -> Any:
        if self._trainer is None:
            raise RuntimeError(
                "EMACallback found no Trainer: pass it in Trainer(..., callbacks=[ema]) or trainer.add_callback(ema) "
                "and train with trainer.train(); if the callback events are raised outside the Trainer's methods, "
                "name it with EMACallback(...).attach(trainer)"
            )
        t = self._trainer
        wrapped = getattr(t, "model_wrapped", None)
        return wrapped if wrapped is not None else t.model

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
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

    # -------------------------------------------------------------------------------- events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._find_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._find_trainer()
        if state.global_step > 0:  # a resumed run: the weights came from a checkpoint, so does the EMA
            self.ema.load(self._target(), self._resume_dir(args, state), framework_step=state.global_step)
        else:
            self.ema.state = self.ema.buffer_state = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ema.on_step(self._target(), state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.ema.save(self._target(), folder, state.global_step)

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if self._in_ema_eval or not self.ema.started or self.ema.eval_index is None:
            return
        if self._evaluated_at == state.global_step:  # several eval datasets: one EMA pass covers them all
            return
        self._evaluated_at = state.global_step
        trainer = self._trainer
        self._in_ema_eval = True
        try:
            with self.ema.swapped(self._target()):
                datasets = trainer.eval_dataset
                if isinstance(datasets, dict):
                    for name, ds in datasets.items():
                        trainer.evaluate(ds, metric_key_prefix=f"{self.metric_prefix}_{name}")
                else:
                    trainer.evaluate(metric_key_prefix=self.metric_prefix)
        finally:
            self._in_ema_eval = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ema.on_train_end(self._target())
