"""How one :func:`functional_ema.update` runs: the fused ``lerp_`` calls, planned once and cached.

An EMA update is pure memory traffic (read the EMA and the weights, write the EMA: 12 bytes per fp32
element), so the plan aims at the fewest, largest ``lerp_`` calls over contiguous memory:

* A *fused run*: leaves that are views of one source buffer (DeepSpeed's flat ZeRO partitions) and
  whose EMAs sit at the same relative offsets in one EMA buffer made by ``init_ema`` become a single
  ``lerp_`` over the whole span, alignment gaps included (the EMA buffer mirrors them).
* Several EMAs: the span is cut into chunks and the K ``lerp_`` calls of a chunk run back to back, so
  the weights are read from memory once and from cache K-1 times: 4 + 8K bytes per element instead
  of 12K.
* Everything else (arbitrary trees) runs per tensor, grouped by (device, dtype) into one
  ``torch._foreach_lerp_`` call each.
* Where the EMA has another device (a pinned CPU EMA of CUDA weights) or dtype than the weights,
  chunks of the weights are first copied into a staging buffer: on a CUDA side stream, double
  buffered, so the copy of chunk i+1 overlaps the CPU ``lerp_`` of chunk i.

All of these give bitwise the same numbers as ``ema.lerp_(shard, 1 - decay)`` per tensor: lerp is
elementwise and its vectorised and scalar code paths agree (checked in ``tests/test_core.py``).

Plans are cached by the identity of the leaf tensors (and the names), and dropped as soon as any
of those tensors is freed, so a cache entry never keeps a model's buffers alive on its own. The
same dict objects as in a plan's last call are matched at a constant cost (see lookup_dicts).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from ._tree import TreeMismatchError

__all__ = ["Key", "Plan", "build_plan", "cache_key", "lookup", "own", "owned_base", "remember"]

# Several EMAs are updated chunk by chunk; a chunk of the weights must still be in cache when the
# K-th EMA reads it. Swept 32 Ki..2 Mi elements on a 2-core EPYC (512 KiB L2 per core, 32 MiB L3),
# K=2, fp32, 5.6M elements, 1 thread per rank, 2 ranks: 256 Ki elements (1 MiB) was the most
# consistent (1.06-1.19x a flat lerp_ moving the same bytes; two full passes: 1.16-1.32x). Smaller
# chunks pay per-call overhead, larger ones lose the cache. With several intra-op threads each
# chunk is split between them, and every chunk is one OpenMP parallel region (tens of us each,
# milliseconds when the cores are oversubscribed), so the chunk grows with the thread count.
_CHUNK_ELEMENTS = 1 << 18
# Chunks copied through a staging buffer (device-to-host or dtype conversion). 4 MiB of fp32: large
# enough that the per-chunk cost (copy launch, event wait) is small next to the copy itself.
_STAGE_CHUNK_ELEMENTS = 1 << 20
_MAX_PLANS = 32

# On these devices a group of lerps runs as one torch._foreach_lerp_ call. On CPU it was ~3x faster
# than a Python loop of lerp_ for 520 small tensors and as fast for large ones (torch 2.13, 1
# thread); on CUDA it is the fused multi-tensor kernel. Other devices loop over lerp_.
_FOREACH_DEVICES = frozenset({"cpu", "cuda"})

# ------------------------------------------------------------------------------- owned EMA buffers

# Flat EMA buffers allocated by this package, by id -> weakref. A fused update writes a whole span
# of such a buffer, alignment gaps included; it never does that to memory it did not allocate.
_OWNED: dict[int, weakref.ref] = {}


def own(buf: torch.Tensor) -> torch.Tensor:
    """Mark ``buf`` (a fresh, non-view allocation) as an EMA buffer this package may write whole."""
    key = id(buf)
    _OWNED[key] = weakref.ref(buf, lambda _r, key=key: _OWNED.pop(key, None))
    return buf


def owned_base(t: torch.Tensor) -> torch.Tensor | None:
    """The owned EMA buffer ``t`` is a view of, or ``None``."""
    base = t._base if t._base is not None else t
    ref = _OWNED.get(id(base))
    return base if ref is not None and ref() is base else None


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.untyped_storage().data_ptr())


def _shadow(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object on ``t``'s memory: the plan holds these, never the caller's tensors, so
    the weakrefs on the caller's tensors still fire (and drop the plan) when they are freed."""
    return t.detach().as_strided(t.size(), t.stride(), t.storage_offset())


def _span(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.detach().as_strided((length,), (1,), start)


def _extent(t: torch.Tensor) -> int:
    """Number of storage elements between ``t``'s first and last element, inclusive."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


def _needs_staging(src: torch.Tensor, ema: torch.Tensor) -> bool:
    """Whether the weights must be copied (and converted) before ``ema`` can lerp towards them.

    Tests patch this to send same-device fp32 runs through the staging code on CPU.
    """
    return src.device != ema.device or src.dtype != ema.dtype


def _chunk_elements() -> int:
    # Each intra-op thread gets _CHUNK_ELEMENTS of every chunk (ATen splits a lerp_ evenly).
    return _CHUNK_ELEMENTS * max(1, torch.get_num_threads())


# -------------------------------------------------------------------------------------- execution


class _Group:
    """Lerps on one (device, dtype): ``emas[j].lerp_(srcs[j], weights[ks[j]])`` for all j, in order."""

    def __init__(self, device: torch.device):
        self.foreach = device.type in _FOREACH_DEVICES
        self.emas: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.ks: list[int] = []
        self._weights_for: tuple | None = None  # (weights, per-item weights) of the last call
        self._num_emas = 0

    def add(self, emas: list[torch.Tensor], src: torch.Tensor, chunk: int) -> None:
        """Lerp every EMA in ``emas`` (EMA k at index k) towards ``src``.

        With several EMAs and a contiguous 1-D ``src`` longer than ``chunk``, the work is interleaved
        chunk by chunk (EMA 0 and 1 on chunk 0, then on chunk 1, ...) so each chunk of ``src`` is
        read from memory once.
        """
        self._num_emas = max(self._num_emas, len(emas))
        n = src.numel()
        step = chunk if len(emas) > 1 and src.dim() == 1 and src.is_contiguous() else max(n, 1)
        for lo in range(0, n, step):
            m = min(step, n - lo)
            s = src if m == n else src.narrow(0, lo, m)
            for k, e in enumerate(emas):
                self.emas.append(e if m == n else e.narrow(0, lo, m))
                self.srcs.append(s)
                self.ks.append(k)

    def run(self, weights: Sequence[float]) -> None:
        if len(self.emas) == 1:  # one fused span: a plain lerp_ has less to dispatch
            self.emas[0].lerp_(self.srcs[0], weights[self.ks[0]])
            return
        if not self.emas:
            return
        if self._num_emas == 1:
            ws: Any = weights[0]
        elif self._weights_for is not None and self._weights_for[0] == tuple(weights):
            ws = self._weights_for[1]  # the usual case: constant decays give the same weights
        else:
            ws = [weights[k] for k in self.ks]
            self._weights_for = (tuple(weights), ws)
        if self.foreach:
            torch._foreach_lerp_(self.emas, self.srcs, ws)
        else:
            for j, (e, s) in enumerate(zip(self.emas, self.srcs)):
                e.lerp_(s, ws if self._num_emas == 1 else ws[j])


class _CopyStager:
    """Stages chunks with plain copies on the current stream (synchronous on CPU).

    Used for a dtype conversion on one device, and as the CPU stand-in for :class:`_CudaToHost`:
    same chunk and double-buffer bookkeeping, so tests on CPU run the same pipeline.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False):
        self.bufs = [torch.empty(numel, dtype=dtype, device=device, pin_memory=pin) for _ in range(2)]

    def begin(self) -> None:
        pass

    def start(self, i: int, src: torch.Tensor) -> None:
        """Start copying chunk ``i`` into buffer ``i % 2`` (last used by chunk ``i - 2``, done)."""
        self.bufs[i % 2][: src.numel()].copy_(src)

    def wait(self, i: int, numel: int) -> torch.Tensor:
        return self.bufs[i % 2][:numel]


class _CudaToHost(_CopyStager):
    """Device-to-host staging on a side stream into pinned buffers, so the copy of chunk i+1 runs
    while the CPU lerps chunk i. Constructed only when the weights are on a CUDA device."""

    def __init__(self, numel: int, dtype: torch.dtype, src_device: torch.device):
        super().__init__(numel, dtype, torch.device("cpu"), pin=True)
        self.src_device = src_device
        self.stream = torch.cuda.Stream(src_device)
        self.events = [torch.cuda.Event(), torch.cuda.Event()]

    def begin(self) -> None:
        # The weights are final only once the work queued so far (the optimizer step) has run.
        self.stream.wait_stream(torch.cuda.current_stream(self.src_device))

    def start(self, i: int, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            self.bufs[i % 2][: src.numel()].copy_(src, non_blocking=True)
            self.events[i % 2].record(self.stream)

    def wait(self, i: int, numel: int) -> torch.Tensor:
        self.events[i % 2].synchronize()
        return self.bufs[i % 2][:numel]


def _make_stager(numel: int, src: torch.Tensor, ema: torch.Tensor) -> _CopyStager:
    if src.device.type == "cuda" and ema.device.type == "cpu" and torch.cuda.is_available():
        return _CudaToHost(numel, ema.dtype, src.device)
    return _CopyStager(numel, ema.dtype, ema.device)


class _Staged:
    """Chunks whose weights are copied through a stager before the EMAs lerp towards them."""

    def __init__(self) -> None:
        self.stager: _CopyStager | None = None  # made at the first run, sized to the largest chunk
        self.chunks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (weights chunk, EMA k chunks)

    def add(self, emas: list[torch.Tensor], src: torch.Tensor, chunk: int) -> None:
        n = src.numel()
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            self.chunks.append((src.narrow(0, lo, m), [e.narrow(0, lo, m) for e in emas]))

    def run(self, weights: Sequence[float]) -> None:
        chunks, stager = self.chunks, self.stager
        if not chunks:
            return
        if stager is None:
            src, emas = chunks[0]
            stager = self.stager = _make_stager(max(c[0].numel() for c in chunks), src, emas[0])
        stager.begin()
        stager.start(0, chunks[0][0])
        for i, (src, emas) in enumerate(chunks):
            if i + 1 < len(chunks):
                stager.start(i + 1, chunks[i + 1][0])  # overlaps the lerps below on CUDA
            staged = stager.wait(i, src.numel())
            for k, e in enumerate(emas):
                e.lerp_(staged, weights[k])


class Plan:
    """The lerp calls of one update, over tensors of one (state, shards) pair.

    Attributes:
        groups: same-device, same-dtype lerps, one ``_foreach_lerp_`` per (device, dtype).
        staged: fused spans and contiguous leaves whose weights are staged (other device or dtype).
        converted: ``(ema, weights, k)`` for the remaining leaves of another device or dtype.
        fused_runs: number of fused spans (for tests and benchmarks).
    """

    def __init__(self) -> None:
        self.groups: dict[tuple, _Group] = {}
        self.staged: dict[tuple, _Staged] = {}
        self.converted: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.fused_runs = 0
        # Leaves (positions in build_plan's order) whose data pointers lookup() checks: the first
        # and last leaf of each fused span and every leaf updated on its own. See lookup().
        self.check_leaves: list[int] = []
        self.ids: tuple = ()  # Key.ids this plan was cached under (trees other than flat dicts)
        # Flat dicts: the keys and weak references to the values it was cached under (see lookup).
        self.src_keys: tuple | None = None
        self.src_refs: tuple = ()
        self.ema_keys: tuple = ()
        self.ema_refs: tuple = ()
        self.n = 0  # number of leaves
        self.ends: tuple = ()  # weak references to the first and last value of the shards dict
        self.ema_ends: tuple = ()  # the same, per EMA dict
        self.check_keys: tuple = ()  # names of the leaves at _check_pos
        self.recent: tuple | None = None  # this plan's key in _RECENT
        self.slot: tuple = ()  # this plan's key in _PLANS
        self._check_pos: list[int] | None = None  # check_leaves as positions in Key.src; None: all
        self._src_ptrs: tuple[int, ...] = ()
        self._refs: list[weakref.ref] = []
        self._step: torch.Tensor | None = None
        self._step_view: Any = None
        self.single: tuple | None = None  # (bound lerp_ of the EMA span, weights span), see finish()

    def step_array(self, step: torch.Tensor) -> Any:
        """A one-element memoryview of the state's step counter, or ``None`` if it has none.

        Reading and writing the counter through a memoryview skips the torch dispatcher (and
        numpy's scalar machinery): ~40 us less per update when the caches are cold. The view is
        kept for the step tensor last seen.
        """
        if step is not self._step:
            view = None
            if step.device.type == "cpu" and step.dim() == 0 and step.dtype == torch.int64 and not step.requires_grad:
                try:
                    view = memoryview(step.numpy().reshape(1))
                except (RuntimeError, TypeError, ValueError):  # e.g. torch built without numpy
                    view = None
            self._step, self._step_view = step, view
        return self._step_view

    def _ptrs(self, src: list[torch.Tensor]) -> tuple[int, ...]:
        if self._check_pos is None:
            return tuple(map(_data_ptr, src))
        return tuple(map(_data_ptr, map(src.__getitem__, self._check_pos)))

    def add(self, emas: list[torch.Tensor], src: torch.Tensor) -> None:
        """Schedule ``emas[k].lerp_(src, w_k)`` for each k (one leaf or one fused span)."""
        if src.numel() == 0:
            return
        flat = src.is_contiguous() and all(e.is_contiguous() for e in emas)
        if flat:  # chunkable as 1-D
            src, emas = src.view(-1), [e.view(-1) for e in emas]
        e0 = emas[0]
        if not _needs_staging(src, e0):
            key = (src.device, src.dtype)
            if key not in self.groups:
                self.groups[key] = _Group(src.device)
            self.groups[key].add(emas, src, _chunk_elements())
        elif flat:
            key = (src.device, e0.device, e0.dtype)
            if key not in self.staged:
                self.staged[key] = _Staged()
            self.staged[key].add(emas, src, _STAGE_CHUNK_ELEMENTS)
        else:
            self.converted.extend((e, src, k) for k, e in enumerate(emas))

    def finish(self) -> None:
        """Called once built: notes whether the whole update is a single ``lerp_`` (see run)."""
        groups = list(self.groups.values())
        single = len(groups) == 1 and len(groups[0].emas) == 1 and not self.staged and not self.converted
        self.single = (groups[0].emas[0].lerp_, groups[0].srcs[0]) if single else None

    def run(self, weights: Sequence[float]) -> None:
        """All lerps, in place: EMA k moves towards the weights by ``weights[k]``."""
        if self.single is not None:  # one fused span, one EMA: the usual DeepSpeed case
            self.single[0](self.single[1], weights[0])
            return
        for group in self.groups.values():
            group.run(weights)
        for staged in self.staged.values():
            staged.run(weights)
        for e, s, k in self.converted:
            e.lerp_(s.to(device=e.device, dtype=e.dtype), weights[k])


# ------------------------------------------------------------------------------------------- cache
#
# Two levels. _PLANS holds every plan under a slot derived from its leaves; a lookup there checks
# every leaf (identity, at C speed: ~0.1 us per tensor warm, ~0.4 us when the caches are cold).
# _RECENT maps the identity of the containers of the last flat-dict call of each plan to it, so the
# next call with the same dict objects (every step's `update(state, local_shards(engine))`) costs
# the same whatever the number of tensors. Both drop a plan as soon as any tensor it was built
# from is freed.

_PLANS: OrderedDict[tuple, Plan] = OrderedDict()
_RECENT: dict[tuple, Plan] = {}
_data_ptr: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr
_is = operator.is_
_deref = getattr(operator, "call", weakref.ref.__call__)  # operator.call: Python 3.11+, ~2x faster


class Key(NamedTuple):
    """Identity of a (state, shards) pair, see :func:`cache_key`."""

    slot: tuple  # a few ids: where the plan is cached
    shards: Any  # the caller's shards tree
    emas: Sequence[Any]  # the state's EMA trees
    src: list[torch.Tensor]  # the shards' leaves (dict order for flat dicts, else optree order)
    ids: tuple | None  # other trees: tree specs and ``id()`` of every leaf; None for flat dicts


def _dict_slot(src: list[torch.Tensor], emas: Sequence[dict]) -> tuple:
    """Where a flat-dict plan is cached: sizes and the ids of the first shard and first EMA tensor."""
    first_ema = next(iter(emas[0].values()), None) if emas else None
    return (len(src), len(emas), id(src[0]) if src else 0, id(first_ema))


def cache_key(emas: Sequence[Any], shards: Any) -> Key:
    """The cache key of a (state, shards) pair.

    Flat dicts of tensors (what ``local_shards`` returns and ``init_ema`` builds) are checked in
    :func:`lookup` by the identity of their keys and values. Other trees are flattened with optree
    and keyed by their specs and leaf ids.
    """
    if type(shards) is dict and all(type(e) is dict for e in emas):
        src = list(shards.values())
        if all(map(isinstance, src, itertools.repeat(torch.Tensor))):
            return Key(_dict_slot(src, emas), shards, emas, src, None)
    src, spec = optree.tree_flatten(shards, none_is_leaf=False)
    parts = [spec, tuple(map(id, src))]
    for e in emas:
        leaves, espec = optree.tree_flatten(e, none_is_leaf=False)
        parts.append(espec)
        parts.append(tuple(map(id, leaves)))
    return Key((len(src), len(emas), parts[1][:1], parts[3][:1]), shards, emas, src, tuple(parts))


def _same_dict(d: dict, keys: tuple, refs: tuple) -> bool:
    """``d`` has exactly ``keys`` (in order) and, under them, the objects ``refs`` point to."""
    return type(d) is dict and len(d) == len(refs) and tuple(d) == keys and all(map(_is, d.values(), map(_deref, refs)))


def lookup_dicts(emas: Sequence[dict], shards: dict) -> Plan | None:
    """:func:`lookup` for flat dicts (``type(shards) is dict``), without building a :class:`Key`.

    This is every step's path, run right after the optimizer step has flushed the CPU caches,
    when every Python call costs microseconds. When ``shards`` and the EMA dicts are the very
    objects of this plan's last call, only their lengths, first and last values and the data
    pointers of a few leaves are checked: a constant cost, whatever the number of tensors.
    Otherwise every key and value is checked, and the plan remembers these dict objects.

    What the constant-cost check relies on: a dict passed to ``update`` is not edited in place
    while the tensor it held stays alive elsewhere. Replacing a value frees the old tensor in the
    usual case (the dicts of ``local_shards`` and ``init_ema`` are their tensors' only owners),
    which drops the plan, so the next call checks everything again.
    """
    if not emas:
        return None
    plan = _RECENT.get((id(shards), *map(id, emas)))
    if plan is not None:
        n, ends = plan.n, plan.ends
        values = shards.values()
        hold = len(shards) == n and next(iter(values)) is ends[0]() and next(reversed(values)) is ends[1]()
        if hold:  # a loop, not a call per dict: each distinct call costs microseconds here
            for e, (first, last) in zip(emas, plan.ema_ends):
                values = e.values() if type(e) is dict else None
                if values is None or len(e) != n or next(iter(values)) is not first() or next(reversed(values)) is not last():
                    hold = False
                    break
        if hold:
            try:
                if tuple(map(_data_ptr, map(shards.__getitem__, plan.check_keys))) == plan._src_ptrs:
                    if plan.slot in _PLANS:  # keep it the most recently used
                        _PLANS.move_to_end(plan.slot)
                    return plan
            except (KeyError, TypeError):  # another dict at a reused address, without those names
                pass
    src = list(shards.values())
    if not src or type(emas[0]) is not dict:
        return None
    plan = _PLANS.get(_dict_slot(src, emas))
    if (
        plan is None
        or plan.src_keys is None
        or len(src) != len(plan.src_refs)
        or tuple(shards) != plan.src_keys
        or not all(map(_is, src, map(_deref, plan.src_refs)))
        or len(emas) != len(plan.ema_refs)
        or not all(map(_same_dict, emas, plan.ema_keys, plan.ema_refs))
        or plan._ptrs(src) != plan._src_ptrs
    ):
        return None
    _PLANS.move_to_end(plan.slot)
    _remember_recent(plan, shards, emas)
    return plan


def _remember_recent(plan: Plan, shards: dict, emas: Sequence[dict]) -> None:
    """Make ``plan`` the constant-cost match for these dict objects (one entry per plan)."""
    old = plan.recent
    if old is not None and _RECENT.get(old) is plan:
        del _RECENT[old]
    plan.recent = (id(shards), *map(id, emas))
    _RECENT[plan.recent] = plan


def _forget(plan: Plan) -> None:
    if plan.recent is not None and _RECENT.get(plan.recent) is plan:
        del _RECENT[plan.recent]


def lookup(key: Key) -> Plan | None:
    """The cached plan for ``key``, if its tensors are the plan's and still point at the same memory.

    Flat dicts match when their keys are equal and their values are the very tensor objects the
    plan was built from (identity, through weak references: a plan is dropped as soon as any of
    its tensors is freed); other trees when their specs and leaf ids are equal. The data pointers
    of a few leaves rule out ``module.to(...)``-style rebinding of ``.data`` between steps: the
    first and last leaf of each fused span (rebinding moves all of a module's parameters) and every
    leaf updated on its own. Rebinding ``.data`` of one leaf inside a fused span (a view of a flat
    buffer) is not detected: pass a new tensor object instead.
    """
    if key.ids is None:
        return lookup_dicts(key.emas, key.shards)
    plan = _PLANS.get(key.slot)
    # Tuple equality short-cuts on identical elements, so this is cheap when it holds.
    if plan is None or plan.ids != key.ids or plan._ptrs(key.src) != plan._src_ptrs:
        return None
    _PLANS.move_to_end(key.slot)
    return plan


def remember(key: Key, plan: Plan, src: list[torch.Tensor], ema_leaves: list[torch.Tensor]) -> None:
    """Cache ``plan`` until one of the tensors it was built from is freed.

    ``src`` are the shards' leaves in build_plan's order (``plan.check_leaves`` index them).
    """
    if not all(isinstance(t, torch.Tensor) for t in key.src):
        return
    position = {id(t): j for j, t in enumerate(key.src)}
    check = [position[id(src[i])] for i in plan.check_leaves]
    slot, plan_ref = key.slot, weakref.ref(plan)

    def expire(_ref) -> None:
        p = plan_ref()
        if p is not None and _PLANS.get(slot) is p:
            _PLANS.pop(slot, None)
            _forget(p)

    if key.ids is None:  # flat dicts: identity checks go through these weak references
        plan._check_pos = check  # lookup_dicts needs the names of these leaves
        plan.check_keys = tuple(map(list(key.shards).__getitem__, check))
        plan.src_keys = tuple(key.shards)
        plan.src_refs = tuple(weakref.ref(t, expire) for t in key.src)
        plan.ema_keys = tuple(tuple(e) for e in key.emas)
        plan.ema_refs = tuple(tuple(weakref.ref(t, expire) for t in e.values()) for e in key.emas)
        plan.n = len(key.src)
        if plan.n:
            plan.ends = (plan.src_refs[0], plan.src_refs[-1])
            plan.ema_ends = tuple((refs[0], refs[-1]) for refs in plan.ema_refs)
        plan._refs = []
    else:
        plan._check_pos = check if 2 * len(check) < len(key.src) else None
        plan.ids = key.ids
        plan._refs = [weakref.ref(t, expire) for t in (*key.src, *ema_leaves)]
    plan._src_ptrs = plan._ptrs(key.src)
    plan.slot = slot
    _PLANS[slot] = plan
    if key.ids is None and plan.ends:
        _remember_recent(plan, key.shards, key.emas)
    while len(_PLANS) > _MAX_PLANS:
        _forget(_PLANS.popitem(last=False)[1])


# ------------------------------------------------------------------------------------------- build


def build_plan(ema_lists: list[list[torch.Tensor]], src: list[torch.Tensor], names: list[str]) -> Plan:
    """Plan the update of ``ema_lists[k][i]`` towards ``src[i]`` (leaves in the same order).

    Raises:
        TreeMismatchError: a shape differs (the error names the parameter).
        ValueError: an EMA is on another accelerator than its weights.
    """
    for i, (name, s) in enumerate(zip(names, src)):
        for k, leaves in enumerate(ema_lists):
            e = leaves[i]
            if e.shape != s.shape:
                raise TreeMismatchError(
                    f"shards[{name!r}] has shape {tuple(s.shape)} but the EMA (emas[{k}]) has {tuple(e.shape)}; "
                    "was the state made from another model or world size? (functional_ema.load reshards)"
                )
            if e.device != s.device and e.device.type != "cpu":
                raise ValueError(
                    f"shards[{name!r}] is on {s.device} but its EMA is on {e.device}; keep the EMA on the "
                    "weights' device or on the CPU (init_ema(..., device='cpu', pin_memory=True))"
                )
    # Leaves fuse when the weights are one contiguous source storage and each EMA k sits in one
    # owned buffer at a constant offset from the weights: key = (source storage, (buffer, delta)...).
    runs: dict[tuple, list[int]] = {}
    single: list[int] = []
    for i, s in enumerate(src):
        if s.numel() == 0:
            continue
        es = [leaves[i] for leaves in ema_lists]
        bases = [owned_base(e) for e in es] if s.is_contiguous() and all(e.is_contiguous() for e in es) else []
        if not bases or any(b is None for b in bases):
            single.append(i)
            continue
        key = (_storage_key(s),) + tuple((id(b), e.storage_offset() - s.storage_offset()) for b, e in zip(bases, es))
        runs.setdefault(key, []).append(i)
    fused: list[tuple[list[int], int, int]] = []  # (members, source start, source stop)
    for members in runs.values():
        start = min(src[i].storage_offset() for i in members)
        stop = max(src[i].storage_offset() + src[i].numel() for i in members)
        if len(members) > 1 and all(_span_in_base(leaves[members[0]], src[members[0]], start, stop) for leaves in ema_lists):
            fused.append((members, start, stop))
        else:
            single.extend(members)
    # A fused span writes its gaps too: if it overlaps another span or a leaf updated on its own in
    # the same EMA buffer (e.g. two trees sharing one state), update those leaves one by one.
    unsafe = _overlapping(fused, ema_lists, single, src)
    if unsafe:
        for r in sorted(unsafe, reverse=True):
            single.extend(fused.pop(r)[0])
    plan = Plan()
    for members, start, stop in fused:
        i = members[0]
        delta = [leaves[i].storage_offset() - src[i].storage_offset() for leaves in ema_lists]
        plan.add([_span(leaves[i], start + d, stop - start) for leaves, d in zip(ema_lists, delta)], _span(src[i], start, stop - start))
        plan.fused_runs += 1
        plan.check_leaves += sorted({members[0], members[-1]})
    for i in sorted(single):
        plan.add([_shadow(leaves[i]) for leaves in ema_lists], _shadow(src[i]))
        plan.check_leaves.append(i)
    plan.finish()
    return plan


def _span_in_base(ema: torch.Tensor, src: torch.Tensor, start: int, stop: int) -> bool:
    base = owned_base(ema)
    delta = ema.storage_offset() - src.storage_offset()
    return base.storage_offset() <= start + delta and stop + delta <= base.storage_offset() + base.numel()


def _overlapping(fused, ema_lists, single, src) -> set[int]:
    spans = []  # (buffer id, lo, hi, fused run index or -1 for a single leaf)
    for r, (members, start, stop) in enumerate(fused):
        i = members[0]
        for leaves in ema_lists:
            delta = leaves[i].storage_offset() - src[i].storage_offset()
            spans.append((id(owned_base(leaves[i])), start + delta, stop + delta, r))
    for i in single:
        for leaves in ema_lists:
            e = leaves[i]
            base = owned_base(e)
            if base is not None and e.numel():
                spans.append((id(base), e.storage_offset(), e.storage_offset() + _extent(e), -1))
    spans.sort()
    # Sweep by start; spans chained by overlaps form a cluster, and every fused run in a cluster of
    # two or more falls back (conservative: a chain A-B-C drops A and C even if they do not touch).
    unsafe: set[int] = set()
    cluster: list[int] = []
    cur_buf, cur_end = None, -1
    for buf, lo, hi, owner in spans:
        if buf != cur_buf or lo >= cur_end:
            if len(cluster) > 1:
                unsafe.update(x for x in cluster if x >= 0)
            cluster, cur_buf, cur_end = [], buf, hi
        cluster.append(owner)
        cur_end = max(cur_end, hi)
    if len(cluster) > 1:
        unsafe.update(x for x in cluster if x >= 0)
    return unsafe
