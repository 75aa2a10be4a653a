"""``init_ema`` / ``update``: the EMA math over any name-keyed tree of tensors.

This module never imports a training framework. The fast path exploits one fact about sharded
training: the shards handed in are usually views into a few flat buffers (DeepSpeed's ZeRO
partitions). ``init_ema`` mirrors that layout, so ``update`` runs one ``lerp_`` per flat buffer
instead of one per parameter, and reads the weights once for all tracked EMAs.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import optree
import torch

from ._state import EmaState
from ._tree import TreeMismatchError, check_same_tree, flatten_named
from .schedules import DecayLike, interval_decay

__all__ = ["init_ema", "update", "ema_nbytes"]

# Two leaves of one source buffer stay in one fused run while the gap between them is at most this
# many elements (ZeRO-3 pads each partition to ceil(numel / world_size); ZeRO-1/2 align groups).
# The EMA mirrors the gap, so this bounds the wasted EMA memory per gap.
_MAX_GAP = 4096
# With several EMAs the weights are streamed in chunks small enough to stay in cache while every EMA
# reads them, so memory traffic is 4 + 8K bytes per element instead of 12K.
_CHUNK_ELEMENTS = 1 << 16

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

# Flat EMA buffers allocated here, by id -> weakref. A fused update writes a whole span of such a
# buffer, including the alignment gaps between leaves; it never does that to memory it did not make.
_OWNED: dict[int, weakref.ref] = {}


def _own(buf: torch.Tensor) -> torch.Tensor:
    key = id(buf)
    _OWNED[key] = weakref.ref(buf, lambda _r, key=key: _OWNED.pop(key, None))
    return buf


def _owned_base(t: torch.Tensor) -> torch.Tensor | None:
    base = t._base if t._base is not None else t
    ref = _OWNED.get(id(base))
    return base if ref is not None and ref() is base else None


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.untyped_storage().data_ptr())


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
        pin_memory: allocate CPU EMAs in pinned memory (for GPU training with a CPU EMA).
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
    names, leaves, spec = flatten_named(shards)
    for name, leaf in zip(names, leaves):
        if not leaf.is_floating_point():
            raise TypeError(f"shards[{name!r}] has dtype {leaf.dtype}; EMAs need floating-point weights")

    emas_flat: list[list[torch.Tensor | None]] = [[None] * len(leaves) for _ in range(num_emas)]
    with torch.no_grad():
        for run in _mirror_runs(leaves):
            target = torch.device(device) if device is not None else leaves[run.members[0]].device
            span = run.stop - run.start
            base = torch.zeros(num_emas * span, dtype=dtype, device=target, pin_memory=pin_memory and target.type == "cpu")
            _own(base)
            for i, rel in zip(run.members, run.rel_offsets):
                leaf = leaves[i]
                for k in range(num_emas):
                    view = base.narrow(0, k * span + rel, leaf.numel()).view(leaf.shape)
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
    every N steps; see :mod:`functional_ema.schedules`). The update is one ``lerp_`` per flat
    source buffer when the state came from :func:`init_ema` on the same buffers, one per tensor
    otherwise; both give bitwise the same numbers. It never communicates.

    Args:
        state: from :func:`init_ema` (or :func:`functional_ema.load`).
        shards: the same tree (names, shapes) the state was made from, current values.
        step: the training step the shards belong to, e.g. ``engine.global_steps``; must be larger
            than ``state.step``. ``None`` means ``state.step + 1``.
        decay: a float (per-step decay), a schedule, or a callable ``step -> decay``; a sequence of
            ``state.num_emas`` of them when the state tracks several EMAs.
        inplace: ``True`` (default) writes into the state's buffers and returns a state sharing
            them (the old state is updated too, as in torchopt); ``False`` leaves ``state``
            untouched and returns fresh tensors.

    Returns:
        The new state, with ``step`` set to ``step``.

    Raises:
        TreeMismatchError: names or shapes of ``shards`` differ from the state's.
        ValueError: ``step`` is not after ``state.step``, or the number of decays is wrong.
    """
    last = int(state.step)
    step = last + 1 if step is None else int(step)
    if step <= last:
        raise ValueError(f"update(step={step}) must come after the state's step {last}; steps must increase")
    decays = _decays_for(state, decay)
    weights = [1.0 - interval_decay(d, last, step) for d in decays]

    src_names, src, src_spec = flatten_named(shards, "shards")
    ema_lists = []
    for k, ema in enumerate(state.emas):
        names, leaves, spec = flatten_named(ema, "state.emas[%d]" % k)
        check_same_tree(names, spec, src_names, src_spec)
        ema_lists.append(leaves)
    plan = _plan_for(ema_lists, src, src_names)

    with torch.no_grad():
        if inplace:
            _apply_inplace(plan, ema_lists, src, weights)
            state.step.fill_(step)
            return state
        new_lists = _apply_out_of_place(plan, ema_lists, src, weights)
    emas = tuple(optree.tree_unflatten(src_spec, leaves) for leaves in new_lists)
    return EmaState(torch.tensor(step, dtype=torch.int64), emas)


def _decays_for(state: EmaState, decay) -> list:
    k = state.num_emas
    if isinstance(decay, (list, tuple)):
        if len(decay) != k:
            raise ValueError(f"got {len(decay)} decays for a state tracking {k} EMAs")
        return list(decay)
    if k != 1:
        raise ValueError(f"the state tracks {k} EMAs: pass decay as a sequence of {k} decays or schedules")
    return [decay]


@dataclass
class _FusedRun:
    """One lerp over ``length`` elements: source span at ``src_start`` of leaf ``src_rep``'s
    storage, EMA k's span at ``ema_starts[k]`` of leaf ``ema_reps[k]``'s storage."""

    members: list[int]
    src_rep: int
    src_start: int
    length: int
    ema_reps: list[int]
    ema_starts: list[int]


@dataclass
class _Plan:
    fused: list[_FusedRun]
    single: list[int]  # leaves updated one by one
    src_refs: list[weakref.ref]
    ema_refs: list[list[weakref.ref]]

    def matches(self, ema_lists, src) -> bool:
        if len(src) != len(self.src_refs) or len(ema_lists) != len(self.ema_refs):
            return False
        for ref, t in zip(self.src_refs, src):
            if ref() is not t:
                return False
        for refs, leaves in zip(self.ema_refs, ema_lists):
            for ref, t in zip(refs, leaves):
                if ref() is not t:
                    return False
        return True


_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
_MAX_PLANS = 32


def _plan_for(ema_lists: list[list[torch.Tensor]], src: list[torch.Tensor], names: list[str]) -> _Plan:
    key = (id(src[0]) if src else 0, id(ema_lists[0][0]) if src else 0, len(src), len(ema_lists))
    plan = _PLANS.get(key)
    if plan is not None and plan.matches(ema_lists, src):
        _PLANS.move_to_end(key)
        return plan
    plan = _build_plan(ema_lists, src, names)
    _PLANS[key] = plan
    while len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return plan


def _build_plan(ema_lists, src, names) -> _Plan:
    for i, (name, s) in enumerate(zip(names, src)):
        for k, leaves in enumerate(ema_lists):
            e = leaves[i]
            if e.shape != s.shape:
                raise TreeMismatchError(
                    f"shards[{name!r}] has shape {tuple(s.shape)} but the EMA (emas[{k}]) has {tuple(e.shape)}; "
                    "was the state made from another model or world size? (functional_ema.load reshards)"
                )
            if e.device != s.device and e.device.type != "cpu":
                raise ValueError(f"shards[{name!r}] is on {s.device} but its EMA is on {e.device}")
    # Group leaves whose source and every EMA sit in one buffer each, at a constant offset apart.
    groups: dict[tuple, list[int]] = {}
    single: list[int] = []
    for i, s in enumerate(src):
        es = [leaves[i] for leaves in ema_lists]
        fusable = (
            s.numel() > 0
            and s.is_contiguous()
            and all(e.is_contiguous() and e.dtype == s.dtype and e.device == s.device for e in es)
        )
        bases = [_owned_base(e) for e in es] if fusable else []
        if not fusable or any(b is None for b in bases):
            single.append(i)
            continue
        key = (_storage_key(s),) + tuple(
            (id(b), e.storage_offset() - s.storage_offset()) for b, e in zip(bases, es)
        )
        groups.setdefault(key, []).append(i)
    fused: list[_FusedRun] = []
    for key, members in groups.items():
        if len(members) == 1:
            single.extend(members)
            continue
        start = min(src[i].storage_offset() for i in members)
        stop = max(src[i].storage_offset() + src[i].numel() for i in members)
        ema_starts, ok = [], True
        for (base_id, delta), leaves in zip(key[1:], ema_lists):
            base = _owned_base(leaves[members[0]])
            lo, hi = start + delta, stop + delta
            if lo < base.storage_offset() or hi > base.storage_offset() + base.numel():
                ok = False
            ema_starts.append(lo)
        if ok:
            fused.append(_FusedRun(members, members[0], start, stop - start, [members[0]] * len(ema_lists), ema_starts))
        else:
            single.extend(members)
    # A fused run writes its whole span, gaps included: if spans of two runs (or a run and a leaf
    # updated on its own) overlap in one EMA buffer, e.g. after names were shuffled, fall back.
    unsafe = _overlapping(fused, ema_lists, single)
    if unsafe:
        keep = []
        for r_idx, run in enumerate(fused):
            if r_idx in unsafe:
                single.extend(run.members)
            else:
                keep.append(run)
        fused = keep
    single.sort()
    return _Plan(
        fused,
        single,
        [weakref.ref(t) for t in src],
        [[weakref.ref(t) for t in leaves] for leaves in ema_lists],
    )


def _overlapping(fused, ema_lists, single) -> set[int]:
    spans = []  # (base id, lo, hi, run index or -1)
    for r_idx, run in enumerate(fused):
        for k, leaves in enumerate(ema_lists):
            base = _owned_base(leaves[run.ema_reps[k]])
            spans.append((id(base), run.ema_starts[k], run.ema_starts[k] + run.length, r_idx))
    for i in single:
        for leaves in ema_lists:
            e = leaves[i]
            base = _owned_base(e)
            if base is not None and e.numel():
                spans.append((id(base), e.storage_offset(), e.storage_offset() + e.numel(), -1))
    spans.sort()
    unsafe: set[int] = set()
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            unsafe.update(x for x in (a[3], b[3]) if x >= 0)
    return unsafe


def _span(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.as_strided((length,), (1,), start)


def _lerp_k(emas: list[torch.Tensor], src: torch.Tensor, weights: list[float]) -> None:
    """``emas[k].lerp_(src, weights[k])`` for all k, reading ``src`` once from memory."""
    if len(emas) == 1:
        emas[0].lerp_(src, weights[0])
        return
    n = src.numel()
    for lo in range(0, n, _CHUNK_ELEMENTS):
        m = min(_CHUNK_ELEMENTS, n - lo)
        s = src.narrow(0, lo, m)
        for e, w in zip(emas, weights):
            e.narrow(0, lo, m).lerp_(s, w)


def _apply_inplace(plan: _Plan, ema_lists, src, weights) -> None:
    for run in plan.fused:
        s = _span(src[run.src_rep], run.src_start, run.length)
        es = [_span(leaves[r], st, run.length) for leaves, r, st in zip(ema_lists, run.ema_reps, run.ema_starts)]
        _lerp_k(es, s, weights)
    for i in plan.single:
        s = src[i]
        for leaves, w in zip(ema_lists, weights):
            e = leaves[i]
            e.lerp_(s.to(device=e.device, dtype=e.dtype), w)


def _apply_out_of_place(plan: _Plan, ema_lists, src, weights) -> list[list[torch.Tensor]]:
    # Fresh buffers shaped like the old ones keep the mirrored layout, so the next update is fused too.
    new_bases: dict[int, torch.Tensor] = {}

    def fresh(e: torch.Tensor) -> torch.Tensor | None:
        base = _owned_base(e)
        if base is None:
            return None
        nb = new_bases.get(id(base))
        if nb is None:
            nb = new_bases[id(base)] = _own(torch.empty_like(base))
        return nb.as_strided(e.shape, e.stride(), e.storage_offset() - base.storage_offset() + nb.storage_offset())

    new_lists = [[fresh(e) for e in leaves] for leaves in ema_lists]
    for run in plan.fused:
        s = _span(src[run.src_rep], run.src_start, run.length)
        for k, leaves in enumerate(ema_lists):
            rep = run.ema_reps[k]
            old = _span(leaves[rep], run.ema_starts[k], run.length)
            # Same place in the fresh buffer: shift by the difference of the two leaf views.
            shift = new_lists[k][rep].storage_offset() - leaves[rep].storage_offset()
            torch.lerp(old, s, weights[k], out=_span(new_lists[k][rep], run.ema_starts[k] + shift, run.length))
    for i in plan.single:
        s = src[i]
        for k, leaves in enumerate(ema_lists):
            e = leaves[i]
            val = torch.lerp(e, s.to(device=e.device, dtype=e.dtype), weights[k])
            if new_lists[k][i] is None:
                new_lists[k][i] = val
            else:
                new_lists[k][i].copy_(val)
    return new_lists
