"""Errors of the verbs that take a training object (a leaf: engines, the API and the checkpoint code
all raise them)."""

from __future__ import annotations

__all__ = [
    "LowPrecisionWeightsWarning",
    "MismatchError",
    "StateMismatchError",
    "SwappedParametersChangedError",
    "SwappedTrainingError",
    "UnsyncedReplicasWarning",
]


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


class SwappedParametersChangedError(RuntimeError):
    """The block of :func:`functional_ema.swapped` replaced or re-typed the model's parameters (``model.to(dtype)``,
    ``load_state_dict(..., assign=True)``, a new ``nn.Parameter`` set on a module). Raised on exit, after the trained
    values were put back; the message names the parameters and what was done to them."""


class LowPrecisionWeightsWarning(UserWarning):
    """The weights read are 16-bit with no fp32 master behind them: the EMA averages rounded copies. Issued once per
    process and reason; filter it with ``warnings.filterwarnings("ignore", category=LowPrecisionWeightsWarning)``."""


class UnsyncedReplicasWarning(UserWarning):
    """A ``DistributedDataParallel`` model trains parameters whose gradients it does not all-reduce: DDP chose the
    parameters to reduce when it was built (those with ``requires_grad`` then), so one unfrozen or added since is
    trained apart on each rank, and the ranks' weights and EMAs drift apart (the EMA saved is rank 0's). Issued when
    ``local_shards`` reads such a model; the message names the parameters and the fixes."""
