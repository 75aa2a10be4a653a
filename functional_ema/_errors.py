"""Errors of the verbs that take a training object (a leaf: engines and the API both raise them)."""

from __future__ import annotations

__all__ = ["StateMismatchError", "SwappedTrainingError"]


class StateMismatchError(ValueError):
    """An EMA state does not fit the training object it is used with (names or piece sizes)."""


class SwappedTrainingError(RuntimeError):
    """``backward`` or an optimizer step was attempted inside :func:`functional_ema.swapped`."""
