"""Errors of the verbs that take a training object (a leaf: engines, the API and the checkpoint code
all raise them)."""

from __future__ import annotations

__all__ = ["MismatchError", "StateMismatchError", "SwappedTrainingError"]


class MismatchError(ValueError):
    """Two things that must match do not: an EMA state and a model's pieces, two trees, a checkpoint and
    the model it is loaded into. The message names the EMA, parameter, rank or file, and both sides.

    The mismatch errors are all subclasses: :class:`StateMismatchError`,
    :class:`functional_ema.TreeMismatchError` and ``functional_ema.checkpoint.CheckpointMismatchError``.
    """


class StateMismatchError(MismatchError):
    """An EMA state does not fit the training object it is used with (names or piece sizes)."""


class SwappedTrainingError(RuntimeError):
    """``backward`` or an optimizer step was attempted inside :func:`functional_ema.swapped`."""
