"""``init_ema`` / ``update``: the EMA math over any name-keyed tree of tensors.

This module never imports a training framework. The fast path exploits one fact about sharded
training: the shards handed in are usually views into a few flat buffers (DeepSpeed's ZeRO
partitions). ``init_ema`` mirrors that layout, so ``update`` runs one ``lerp_`` per flat buffer
instead of one per parameter, and reads the weights once for all tracked EMAs.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from . import _plan
from ._plan import _storage_key
from ._plan import own as _own
from ._plan import owned_base as _owned_base
from ._state import EmaState
from ._tree import check_same_tree, flatten_named
from .schedules import DecayLike, interval_decay

__all__ = ["ema_nbytes", "init_ema", "update"]

# Two leaves of one source buffer stay in one fused run while the gap between them is at most this
# many elements (ZeRO-3 pads each partition to ceil(numel / world_size); ZeRO-1/2 align groups).
# The EMA mirrors the gap, so this bounds the wasted EMA memory per gap.
_MAX_GAP = 4096

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------- init


def init_ema(
    shards: Any,
    *,
    num_emas: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    pin_memory: bool = False,
    step: int = 0,
) -> EmaState:
    """Start EMAs equal to ``shards``.

    Args:
        shards: a pytree (usually ``dict[str, Tensor]`` from :func:`functional_ema.local_shards`)
            of floating tensors: this rank's pieces of the fp32 master weights. Empty tensors are
            fine (a rank that owns none of a parameter).
        num_emas: how many EMAs to track in one state (e.g. two decays, or EDM2's two power EMAs).
        dtype: EMA dtype. fp32 by default; a 16-bit EMA warns, because at decay 0.9999 the update
            ``(1 - decay) * (x - ema)`` is below bf16 resolution and the EMA stops moving.
        device: where the EMA lives; defaults to each shard's device (with ZeRO-Offload that is
            already the CPU).
        pin_memory: allocate CPU EMAs in pinned memory. For GPU training with ``device="cpu"``:
            :func:`update` then copies the weights to the host chunk by chunk on a side CUDA stream,
            overlapped with the CPU update of the previous chunk. Ignored when CUDA is not
            available (there is nothing to transfer from).
        step: the training step the EMAs correspond to (0 at the start of training).

    Returns:
        ``EmaState(step=tensor(step), emas=(ema_0, ..., ema_{K-1}))``; each ``ema_k`` has the
        tree structure and shapes of ``shards`` and dtype ``dtype``.

    Example:
        >>> import torch, functional_ema as fe
        >>> state = fe.init_ema({"w": torch.zeros(3)})
        >>> state = fe.update(state, {"w": torch.ones(3)}, decay=0.5)
        >>> state.ema["w"]
        tensor([0.5000, 0.5000, 0.5000])
    """
    if num_emas < 1:
        raise ValueError(f"num_emas must be >= 1, got {num_emas}")
    if not dtype.is_floating_point:
        raise TypeError(f"the EMA dtype must be floating point, got {dtype}")
    if dtype in _SIXTEEN_BIT:
        warnings.warn(
            f"keeping the EMA in {dtype} loses updates smaller than its resolution: with decay 0.9999 a "
            "16-bit EMA stalls. Use dtype=torch.float32 (the default) unless memory forces otherwise.",
            stacklevel=2,
        )
    return _allocate(shards, num_emas, dtype, device, pin_memory, step, copy_values=True)


def _allocate(shards, num_emas, dtype, device, pin_memory, step, *, copy_values: bool) -> EmaState:
    """The state's buffers laid out like ``shards``; filled with their values when ``copy_values``,
    else uninitialised (for :func:`functional_ema.load`, which overwrites every value)."""
    names, leaves, spec = flatten_named(shards)
    for name, leaf in zip(names, leaves):
        if not leaf.is_floating_point():
            raise TypeError(f"shards[{name!r}] has dtype {leaf.dtype}; EMAs need floating-point weights")

    emas_flat: list[list[torch.Tensor | None]] = [[None] * len(leaves) for _ in range(num_emas)]
    with torch.no_grad():
        for run in _mirror_runs(leaves):
            target = torch.device(device) if device is not None else leaves[run.members[0]].device
            span = run.stop - run.start
            # Pinning needs a CUDA runtime; without one there is no device-to-host copy to speed up.
            pin = pin_memory and target.type == "cpu" and torch.cuda.is_available()
            # The K EMAs of a run share one buffer, EMA k at [k * span, (k + 1) * span).
            alloc = torch.zeros if copy_values else torch.empty  # zeros keep the mirrored gaps clean
            base = alloc(num_emas * span, dtype=dtype, device=target, pin_memory=pin)
            _own(base)
            for i, rel in zip(run.members, run.rel_offsets):
                leaf = leaves[i]
                for k in range(num_emas):
                    view = base.narrow(0, k * span + rel, leaf.numel()).view(leaf.shape)
                    if copy_values:
                        view.copy_(leaf.detach())
                    emas_flat[k][i] = view
    emas = tuple(optree.tree_unflatten(spec, flat) for flat in emas_flat)
    return EmaState(torch.tensor(int(step), dtype=torch.int64), emas)


@dataclass
class _Run:
    """Leaves laid out in one EMA buffer: ``rel_offsets[j]`` is leaf ``members[j]``'s place in it."""

    members: list[int]
    rel_offsets: list[int]
    start: int = 0
    stop: int = 0


def _mirror_runs(leaves: list[torch.Tensor]) -> list[_Run]:
    """Group leaves into EMA buffers that mirror the source buffers' layout where they can.

    Leaves that are contiguous views of one storage, close together, become one run whose EMA buffer
    copies their relative offsets (gaps included). Everything else is packed per (device, dtype).
    """
    by_storage: dict[tuple, list[int]] = {}
    loose: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.numel() == 0:
            loose.setdefault((leaf.device, leaf.dtype), []).append(i)
        elif leaf.is_contiguous():
            by_storage.setdefault(_storage_key(leaf), []).append(i)
        else:
            loose.setdefault((leaf.device, leaf.dtype), []).append(i)
    runs: list[_Run] = []
    for members in by_storage.values():
        members.sort(key=lambda i: leaves[i].storage_offset())
        current: list[int] = []
        end = 0
        for i in members:
            off, n = leaves[i].storage_offset(), leaves[i].numel()
            if current and (off < end or off - end > _MAX_GAP):  # overlap or a large gap: new run
                runs.append(_span_run(leaves, current))
                current = []
            end = off + n if not current else max(end, off + n)
            current.append(i)
        if current:
            runs.append(_span_run(leaves, current))
    # A run of one leaf gains nothing from mirroring; pack those with the loose ones.
    packed = [r for r in runs if len(r.members) > 1]
    for r in runs:
        if len(r.members) == 1:
            leaf = leaves[r.members[0]]
            loose.setdefault((leaf.device, leaf.dtype), []).append(r.members[0])
    for members in loose.values():
        offsets = list(itertools.accumulate((leaves[i].numel() for i in members), initial=0))
        packed.append(_Run(members, offsets[:-1], 0, offsets[-1]))
    return packed


def _span_run(leaves: list[torch.Tensor], members: list[int]) -> _Run:
    start = leaves[members[0]].storage_offset()
    stop = max(leaves[i].storage_offset() + leaves[i].numel() for i in members)
    return _Run(members, [leaves[i].storage_offset() - start for i in members], start, stop)


def ema_nbytes(state: EmaState) -> int:
    """Bytes held by the state's EMA buffers (mirrored gaps included)."""
    seen: dict[int, int] = {}
    for t in optree.tree_leaves(state.emas):
        base = t._base if t._base is not None else t
        seen[id(base)] = base.numel() * base.element_size()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------- update


def update(
    state: EmaState,
    shards: Any,
    step: int | None = None,
    *,
    decay: DecayLike | Sequence[DecayLike] = 0.9999,
    inplace: bool = True,
) -> EmaState:
    """Move the EMAs towards ``shards``: ``ema = d * ema + (1 - d) * shards`` for each tracked EMA.

    ``d`` is the decay compounded over the steps since the last update,
    ``d = prod_{s = state.step + 1}^{step} beta(s)`` (``beta ** N`` for a constant decay updated
    every N steps; see :mod:`functional_ema.schedules`). It never communicates.

    Speed: when the state came from :func:`init_ema` on views of a few flat buffers (DeepSpeed's
    ZeRO partitions), the update is one ``lerp_`` per flat buffer, and several EMAs are updated
    chunk by chunk so the weights are read from memory once. Other trees are updated per tensor,
    one ``torch._foreach_lerp_`` per (device, dtype). All paths give bitwise the numbers of
    ``ema.lerp_(shard, 1 - d)`` per tensor. The plan is cached: called again with the same dict
    objects (``local_shards(engine)`` returns the same dict every step) the call costs a few
    microseconds whatever the number of tensors; with other dicts of the same tensors ~0.1-0.4 us
    per tensor (every key and value is checked); new tensor objects are re-planned, ~10 us per
    tensor. Treat the dicts you pass as values: a dict edited in place is noticed when the tensor
    it held is freed (the usual case), not while that tensor stays alive elsewhere, so pass a new
    dict to change what is tracked. ``module.to(...)``-style rebinding of the weights' ``.data`` is
    detected; rebinding ``.data`` of a single view inside a flat buffer, or of an EMA tensor, is
    not: pass new tensors.

    Args:
        state: from :func:`init_ema` (or :func:`functional_ema.load`).
        shards: the same tree (names, shapes) the state was made from, current values.
        step: the training step the shards belong to, e.g. ``engine.global_steps``; must be larger
            than ``state.step``. ``None`` means ``state.step + 1``.
        decay: a float (per-step decay), a schedule, or a callable ``step -> decay``; a sequence of
            ``state.num_emas`` of them when the state tracks several EMAs.
        inplace: ``True`` (default) writes into the state's buffers and returns a state sharing
            them (the old state is updated too, as in torchopt); ``False`` leaves ``state``
            untouched and returns new buffers with the same layout (so they update fused too).

    Returns:
        The new state, with ``step`` set to ``step``.

    Raises:
        TreeMismatchError: names or shapes of ``shards`` differ from the state's.
        ValueError: ``step`` is not after ``state.step``, or the number of decays is wrong.

    Example:
        >>> import torch, functional_ema as fe
        >>> w = {"a": torch.ones(2), "b": torch.ones(3)}
        >>> state = fe.init_ema(w, num_emas=2)
        >>> state = fe.update(state, {"a": torch.zeros(2), "b": torch.zeros(3)}, decay=(0.5, 0.75))
        >>> state.emas[0]["a"], state.emas[1]["a"]
        (tensor([0.5000, 0.5000]), tensor([0.7500, 0.7500]))
    """
    # This runs every step right after the optimizer step has flushed the CPU caches, when every
    # distinct Python call costs microseconds: the common path (flat dicts, one float decay, a
    # cached plan) is kept short: one cache lookup, the decay inlined, the step counter read and
    # written through a cached memoryview, and the lerps run without a no_grad context (the
    # plan's tensors are detached).
    emas = state.emas
    if not inplace:
        _decays_for(state, decay)
        _next_step(int(state.step), step)  # fail before copying anything
        # Copy the buffers (keeping their layout), then update the copy in place below.
        state = EmaState(state.step.clone(), _clone_emas(emas))
        emas = state.emas
    plan = _plan.lookup_dicts(emas, shards) if type(shards) is dict else None
    if plan is None:  # not flat dicts, or the first call with these tensors (or they changed)
        key = _plan.cache_key(emas, shards)
        # Flat dicts (key.ids is None) were just looked up; other trees go by specs and leaf ids.
        plan = _plan.lookup(key) if key.ids is not None else None
        if plan is None:  # check the trees, plan
            plan = _new_plan(state, shards, key)
    counter = plan._step_view if state.step is plan._step else plan.step_array(state.step)
    last = int(state.step) if counter is None else counter[0]
    step = last + 1 if step is None else _next_step(last, step)
    if type(decay) is float and len(emas) == 1 and 0.0 <= decay <= 1.0:
        plan.run((1.0 - decay ** (step - last),))
    else:
        plan.run([
            1.0 - d ** (step - last) if type(d) is float and 0.0 <= d <= 1.0 else 1.0 - interval_decay(d, last, step)
            for d in _decays_for(state, decay)
        ])
    if counter is None:
        state.step.fill_(step)
    else:
        counter[0] = step
    return state


def _next_step(last: int, step: int | None) -> int:
    step = last + 1 if step is None else int(step)
    if step <= last:
        raise ValueError(f"update(step={step}) must come after the state's step {last}; steps must increase")
    return step


def _new_plan(state: EmaState, shards: Any, key: _plan.Key) -> _plan.Plan:
    src_names, src, src_spec = flatten_named(shards, "shards")
    ema_lists = []
    for k, ema in enumerate(state.emas):
        names, leaves, spec = flatten_named(ema, f"state.emas[{k}]")
        check_same_tree(names, spec, src_names, src_spec)
        ema_lists.append(leaves)
    with torch.no_grad():
        plan = _plan.build_plan(ema_lists, src, src_names)
    _plan.remember(key, plan, src, [t for leaves in ema_lists for t in leaves])
    return plan


def _decays_for(state: EmaState, decay) -> list:
    k = state.num_emas
    if isinstance(decay, (list, tuple)):
        if len(decay) != k:
            raise ValueError(f"got {len(decay)} decays for a state tracking {k} EMAs")
        return list(decay)
    if k != 1:
        raise ValueError(f"the state tracks {k} EMAs: pass decay as a sequence of {k} decays or schedules")
    return [decay]


def _clone_emas(emas: tuple) -> tuple:
    """Copies of the EMA trees; leaves of one owned buffer become views of one copied buffer."""
    copies: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        base = _owned_base(t)
        if base is None:
            return t.detach().clone()
        new = copies.get(id(base))
        if new is None:
            new = torch.empty(base.shape, dtype=base.dtype, device=base.device, pin_memory=base.is_pinned())
            new = copies[id(base)] = _own(new.copy_(base))
        return new.as_strided(t.size(), t.stride(), t.storage_offset() - base.storage_offset())

    with torch.no_grad():
        return tuple(optree.tree_map(clone, e, none_is_leaf=False) for e in emas)
