"""The state types: the EMA state and the module-buffer state, typed NamedTuples of tensors.

A leaf (it imports only ``_shards``): the checkpoint writer checks a ``BufferState`` from here, so
nothing under ``_checkpoint`` imports the public :mod:`functional_ema.buffers` above it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn, SupportsIndex

import optree
import torch

from ._shards import Shards, clone_tree

__all__ = ["BufferState", "EmaState", "finish", "marked_swapped", "swapped_count", "wait_pending"]

# The attribute of ``state.step`` that holds the update queued by ``update(..., blocking=False)``
# (a :class:`functional_ema._offload.PendingUpdate`). On the step tensor because an EmaState is an
# immutable NamedTuple and every state sharing these EMA buffers (``inplace=True`` returns the same
# objects) shares its step tensor: whoever reads the state finds the work in flight there.
PENDING_ATTR = "_fe_pending"

# The attribute of ``state.step`` counting the ``fe.swapped`` (or ``buffers.swapped_buffers``) blocks open with the
# state: inside one the model holds this state's EMA, so weights read from it in any form (``local_shards``, a dict
# of its parameters, one read before the block: the same tensors) are the EMA itself, and ``update`` refuses the
# state. On the step tensor for the reason above: one attribute read on ``update``'s path, shared by every state
# over these buffers (``inplace=True`` results, ``copy.copy``); a state with its own step (``deepcopy``,
# ``update(..., inplace=False)`` made before the block) is another state and is not marked.
SWAPPED_ATTR = "_fe_swapped"


def wait_pending(state: object) -> None:
    """Wait for the update queued on ``state`` (if any), raising its failure once.

    The one place every reader of a state passes through: :func:`functional_ema.update`, and
    ``_fit.state_problem`` (which ``save``, ``AsyncSaver.save``, ``swapped``, ``gather_full``,
    ``load(out=)`` and the integrations call before they touch the EMA).
    """
    counter = getattr(state, "step", None)
    pending = getattr(counter, PENDING_ATTR, None)
    if pending is not None:
        setattr(counter, PENDING_ATTR, None)  # cleared first: a failure is raised once
        pending.wait()


# Swap blocks of one state may open and close on several threads: the count's read-modify-write under one lock
# (a lost count would leave a closed state refused for good, or an open one unmarked).
_MARK_LOCK = threading.Lock()


def swapped_count(counter: torch.Tensor) -> int:
    """How many swap blocks hold the state whose step tensor is ``counter``. The mark names the tensor it was set on
    (``id``): a copy of the tensor (``copy.deepcopy``, ``torch.save``/``load``, which carry a tensor's attributes)
    taken inside a block is another state's step, never marked by it."""
    mark = getattr(counter, SWAPPED_ATTR, None)
    return len(mark[1]) if mark is not None and mark[0] == id(counter) else 0


def _blocks(counter: torch.Tensor) -> tuple[int, ...]:
    """The tokens of the swap blocks that hold ``counter``'s state (see :func:`swapped_count`)."""
    mark = getattr(counter, SWAPPED_ATTR, None)
    return mark[1] if mark is not None and mark[0] == id(counter) else ()


@contextlib.contextmanager
def marked_swapped(state: EmaState | BufferState) -> Iterator[None]:
    """Mark a swap block on ``state.step``'s :data:`SWAPPED_ATTR` for the block's duration (nested blocks add
    up); the attribute is removed when the last one closes, also when the block raises. Each block is a token in
    the mark, not a count: taking its own token out again is no change, so the exit can be done again when an
    exception (Ctrl-C) lands in it (:func:`finish`) without closing another block's mark."""
    counter = state.step
    # An int (the id of an object this generator holds until its exit: unique among the open blocks), not the object:
    # torch.save of the step tensor inside the block carries the mark, and torch.load(weights_only=True) loads ints.
    holder = object()
    token = id(holder)
    done = ((_unmark, ((counter, token),)),)  # made before the block: the finally calls nothing before its try
    with _MARK_LOCK:
        setattr(counter, SWAPPED_ATTR, (id(counter), (*_blocks(counter), token)))
    try:
        yield
    finally:
        try:
            finish(*done)
        except BaseException:  # one that landed before finish began: every step again, then raised
            finish(*done)
            raise
        del holder  # held until here: no other open block can get its id


def _unmark(entry: tuple[torch.Tensor, int]) -> None:
    counter, token = entry
    with _MARK_LOCK:
        left = tuple(t for t in _blocks(counter) if t != token)
        if left:
            setattr(counter, SWAPPED_ATTR, (id(counter), left))
        else:
            vars(counter).pop(SWAPPED_ATTR, None)  # the tensor as it was: nothing of the block stays on it


#: How many times in a row one call of an exit is made (see finish) before its error is taken for its own.
_TRIES = 3


def finish(*phases: tuple[Callable[[Any], object], Sequence[Any]]) -> None:
    """Call ``do(item)`` for each item of each ``(do, items)`` phase, in order, every call to its end even when an
    exception lands in it, and only then raise the first exception that landed.

    A swap block's exit puts the live values back (weights, buffers, attributes, marks). A ``KeyboardInterrupt``
    (Ctrl-C), or any exception a signal handler raises, can land between any two bytecodes of it: a loop cut short
    there would leave the rest holding EMA values while training goes on, silently (a trainer that catches Ctrl-C
    and saves would write them). So each ``do`` is idempotent (a copy of a kept value, an attribute set back), and
    the call an exception cut short is made again, then the next ones. A call that fails ``_TRIES`` times in a row
    fails by itself (its own error, not one that landed): the other calls are still made, and that error is raised
    rather than an interruption (the values are not all back). The loops are inside the ``try``: an exception
    landing at their back edges is caught too (Python runs signal handlers between bytecodes, never inside one C
    call such as ``copy_``). One landing before this function's first bytecode escapes it: so call it, in a
    ``finally``, as ``try: finish(*phases)``, ``except BaseException: finish(*phases); raise`` (every call made
    again, each idempotent, then the first exception raised). Only a second exception landing in an ``except``
    here escapes.
    """
    landed: BaseException | None = None
    failed: BaseException | None = None
    p = i = tries = 0
    while True:
        try:
            while p < len(phases):
                do, items = phases[p]
                while i < len(items):
                    do(items[i])
                    i += 1
                    tries = 0
                p, i = p + 1, 0
            break
        except BaseException as error:  # noqa: BLE001 - raised below, once every call is made
            if landed is None:
                landed = error
            # Only errors count towards giving a call up: Ctrl-C pressed again and again (KeyboardInterrupt,
            # SystemExit: BaseException only) makes the interrupted call again, however often it lands.
            tries += isinstance(error, Exception)
            if tries >= _TRIES:
                if failed is None:
                    failed = error
                i, tries = i + 1, 0
    if failed is not None:
        raise failed
    if landed is not None:
        raise landed


def _shallow(tree: Any) -> Any:
    """``tree`` with new containers over the same leaves (``None`` stays ``None``)."""
    return optree.tree_map(lambda t: t, tree, none_is_leaf=False)


class EmaState(NamedTuple):
    """State of one or more EMAs over a name-keyed tree of (local) shards.

    A NamedTuple, hence a pytree node for optree and ``torch.utils._pytree``, and so are its ``Shards``
    EMAs (nodes of their tensors, rebuilt as dicts): ``optree.tree_map`` or ``torch.utils._pytree.tree_map``
    over a state maps over ``step`` and every EMA tensor. Keep ``step`` an int64 tensor and one dtype and
    device for all EMAs of a tensor (map every EMA alike), which :func:`update` checks.

    Attributes:
        step: int64 scalar tensor, the training step of the last update (0 right after
            :func:`init_ema`). Decays are pure functions of it, so resuming cannot desynchronise them.
        emas: one name-keyed tree per tracked EMA (``len(emas) == num_emas``); ``emas[k][name]``
            has the shape of ``shards[name]`` and the EMA dtype (fp32 by default). When the state
            was made from a :class:`~functional_ema.Shards` (``init_ema(local_shards(x))``) each
            ``emas[k]`` is a read-only ``Shards`` over buffers that mirror the engine's, with the
            same layout, which lets :func:`update` run one fused pass; otherwise each is a tree of
            the same type as the shards (e.g. a ``dict``).

    An ``EmaState`` refuses to be pickled: it holds only this rank's pieces, and DeepSpeed keeps
    ``client_state`` from rank 0 only on ZeRO stages 0-2. Use :func:`functional_ema.save`.
    """

    step: torch.Tensor
    emas: tuple[dict[str, torch.Tensor], ...]

    @property
    def ema(self) -> dict[str, torch.Tensor]:
        """The first (often the only) EMA: ``emas[0]``."""
        return self.emas[0]

    @property
    def num_emas(self) -> int:
        return len(self.emas)

    def __reduce__(self) -> NoReturn:  # pickle, torch.save, client_state
        raise TypeError(
            "EmaState holds only this rank's shard of the EMA and is not picklable: DeepSpeed keeps "
            "client_state from rank 0 only on ZeRO stages 0-2, so the other ranks' EMA would be lost. "
            "Save it with functional_ema.save(state, engine, save_dir, tag) beside engine.save_checkpoint."
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        self.__reduce__()

    def __copy__(self) -> EmaState:
        """A new state over the same tensors: each EMA tree rebuilt with its own containers (lists, tuples, dicts,
        any nesting), a read-only ``Shards`` shared as it is."""
        wait_pending(self)
        return EmaState(self.step, tuple(e if isinstance(e, Shards) else _shallow(e) for e in self.emas))

    def __deepcopy__(self, memo: dict[int, Any]) -> EmaState:
        wait_pending(self)
        return EmaState(self.step.clone(), tuple(map(clone_tree, self.emas)))


class BufferState(NamedTuple):
    """EMAs (or copies) of a module's buffers; whole tensors, the same tree on every rank.

    Attributes:
        step: int64 scalar tensor, the training step of the last update.
        emas: one ``{buffer name: tensor}`` per tracked EMA, floating buffers only, dtype ``float32``
            (or the ``dtype`` given to :func:`functional_ema.buffers.init_buffers`), the buffers' shapes.
        copied: ``{buffer name: tensor}`` for the integer and bool buffers: the live values at the
            last update (never averaged).
    """

    step: torch.Tensor
    emas: tuple[dict[str, torch.Tensor], ...]
    copied: dict[str, torch.Tensor]

    @property
    def num_emas(self) -> int:
        return len(self.emas)
