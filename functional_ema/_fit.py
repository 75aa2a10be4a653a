"""Does an EMA state fit a rank's layout? The one check behind every verb that takes a state.

:func:`state_problem` answers without raising, so the collective verbs can share its answer before
any rank acts on it (see :func:`functional_ema._checkpoint.collective.agree`); each verb then raises
the problem as its own error class with its own prefix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ._layout import ShardSpec
from ._shards import Shards, other_whole_shape, selection_note
from ._state import EmaState, wait_pending
from ._tree import compile_hint, short_list

__all__ = ["FitProblem", "state_problem"]


class FitProblem(NamedTuple):
    """Why a state does not fit: ``wrong_type`` is a programming error (``TypeError``), otherwise a
    mismatch (the verb's :class:`~functional_ema.MismatchError` subclass)."""

    message: str
    wrong_type: bool = False

    def error(self, mismatch: type[Exception], prefix: str, hint: str = "") -> Exception:
        """The exception to raise: ``prefix: message. hint`` as ``TypeError`` or as ``mismatch``."""
        return (TypeError if self.wrong_type else mismatch)(f"{prefix}: {self.message}" + (f". {hint}" if hint else ""))


def _names_problem(k: int, ema: Mapping, specs: Mapping[str, ShardSpec], shards: Shards | None) -> FitProblem:
    """The names of ``state.emas[k]`` differ from the reading's: which, and the likely cause (two selections, a
    ``torch.compile`` prefix, or a parameter this model does not train)."""
    missing, extra = sorted(set(specs) - set(ema)), sorted(set(ema) - set(specs))
    note = selection_note(ema, shards)
    not_here = (
        "which this reading does not hold"
        if note
        else "which this model does not train (frozen here, or another model)"
    )
    parts = ([f"this model trains {short_list(missing)}, which the state lacks"] if missing else []) + (
        [f"the state has EMAs of {short_list(extra)}, {not_here}"] if extra else []
    )
    return FitProblem(
        f"state.emas[{k}] does not match this model's trainable parameters: {'; '.join(parts)}"
        + (note or compile_hint(missing, extra))
    )


def state_problem(
    state: Any,
    specs: Mapping[str, ShardSpec],
    rank: int,
    *,
    indices: Sequence[int] | None = None,
    num_emas: int | None = None,
    dtype: torch.dtype | None = None,
    source: str = "the checkpoint",
    one_dtype: bool = False,
    contiguous: bool = False,
    shards: Shards | None = None,
) -> FitProblem | None:
    """``None`` if ``state`` fits this rank's pieces ``specs``, else what is wrong, naming the EMA and
    parameter.

    Args:
        state: what the caller passed as the state.
        specs: this rank's layout (``ShardLayout.specs``): the names and each piece's length.
        rank: this rank's data-parallel rank (for the message).
        indices: which EMAs must fit (default: all of them); an index that is not one of the state's
            is a problem.
        num_emas: the number of EMAs the state must track (e.g. a checkpoint's), or ``None``.
        dtype: the dtype every EMA tensor must have.
        source: what ``num_emas`` and ``dtype`` come from, for the message (e.g. ``"tag 'global_step9'"``).
        one_dtype: the EMA tensors must share one dtype (a checkpoint stores one).
        contiguous: every EMA tensor must be contiguous (filled in place).
        shards: the reading the state came from; a state laid out over the same segments fits at once.
    """
    if not isinstance(state, EmaState):
        return FitProblem(f"expected an EmaState (from init_ema, update or load), got {type(state).__name__}", True)
    # Every verb that reads or fills a state checks it here first: the update queued by
    # update(..., blocking=False) is finished (or its failure raised) before anything reads the EMA.
    wait_pending(state)
    if num_emas is not None and state.num_emas != num_emas:
        return FitProblem(f"{source} holds {num_emas} EMA(s) but the state has {state.num_emas}")
    if indices is None:
        indices = range(state.num_emas)
    dtypes: set[torch.dtype] = set()
    for k in indices:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < state.num_emas:
            return FitProblem(f"index={k!r} is not one of the state's {state.num_emas} EMAs")
        ema = state.emas[k]
        if shards is not None and isinstance(ema, Shards) and (ema.index is shards.index or ema.index == shards.index):
            seg_dtypes = {seg.dtype for seg in ema.segments}
            if dtype is None or seg_dtypes == {dtype}:
                dtypes |= seg_dtypes
                other = _other_whole_shapes(k, ema, specs, shards)
                if other is not None:  # the same pieces, of parameters of other whole shapes
                    return other
                continue  # the reading's own segment layout: names and lengths agree by construction
        if not isinstance(ema, Mapping):
            return FitProblem(
                f"state.emas[{k}] is a {type(ema).__name__}, not a name-keyed mapping (make the state with "
                "init_ema over a name-keyed tree or local_shards)",
                True,
            )
        if set(ema) != set(specs):
            return _names_problem(k, ema, specs, shards)
        for n, spec in specs.items():
            t = ema[n]
            if not isinstance(t, torch.Tensor):
                return FitProblem(f"state.emas[{k}][{n!r}] is a {type(t).__name__}, not a tensor", True)
            if t.numel() != spec.numel:
                return FitProblem(
                    f"state.emas[{k}][{n!r}] has {t.numel()} elements but rank {rank}'s piece of it has "
                    f"{spec.numel}: the state was cut for another world size, sharding or model"
                )
            if t.dim() > 1 and t.numel() == math.prod(spec.shape) and tuple(t.shape) != tuple(spec.shape):
                # A whole parameter's EMA in another shape (a transposed or re-shaped weight): the same count,
                # but copying it in would scramble the values. (Pieces of a sharded one are 1-D, or dim-0 rows.)
                return FitProblem(
                    f"state.emas[{k}][{n!r}] has shape {tuple(t.shape)} but the parameter has "
                    f"{tuple(spec.shape)}: the state was made for another model"
                )
            if dtype is not None and t.dtype != dtype:
                return FitProblem(
                    f"state.emas[{k}][{n!r}] is {_dtype_name(t.dtype)} but {source} holds {_dtype_name(dtype)} EMAs"
                )
            if contiguous and not t.is_contiguous():
                return FitProblem(f"state.emas[{k}][{n!r}] is not contiguous; it is filled in place", True)
            dtypes.add(t.dtype)
        other = _other_whole_shapes(k, ema, specs, shards)
        if other is not None:  # every piece fits: of parameters of other whole shapes all the same?
            return other
    if one_dtype and len(dtypes) > 1:
        return FitProblem(f"the EMA tensors mix dtypes {sorted(map(str, dtypes))}; a checkpoint stores one EMA dtype")
    return None


def _other_whole_shapes(k: int, ema: Any, specs: Mapping[str, ShardSpec], shards: Shards | None) -> FitProblem | None:
    """The problem of an EMA made for parameters of other whole shapes than ``specs``' (``other_whole_shape``)."""
    if not isinstance(ema, Shards) or ema.full_shapes is None:
        return None  # nothing recorded (a dict, Shards.from_views)
    if shards is not None and ema.full_shapes is shards.full_shapes:
        return None  # the reading's own record (identity: a constant cost)
    other = other_whole_shape(ema, {name: spec.shape for name, spec in specs.items()})
    if other is None:
        return None
    name, was, now = other
    return FitProblem(
        f"state.emas[{k}][{name!r}] was made for a parameter of shape {was} but this model's has {now}: the state was "
        "made for another model"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # as checkpoint manifests write it
