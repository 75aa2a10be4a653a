"""DeepSpeed glue: read this rank's fp32 master partitions, gather full EMA weights.

Every function here takes a ``deepspeed.DeepSpeedEngine``. DeepSpeed is imported lazily, so the
core package works without it. Internals relied on (DeepSpeed 0.19):

* ZeRO-3: each trainable parameter ``p`` owns ``[r*ps, (r+1)*ps)`` of its flattened values on rank
  ``r`` (``ps = p.partition_numel()``), stored in ``opt.fp32_partitioned_groups_flat[g]`` at
  ``opt.grad_position[id][1]``. The tail of the last piece is uninitialised padding and is cut off.
* ZeRO-1/2: ``p._hp_mapping.hp_fragment`` is a view into the flat fp32 partition, and
  ``p._hp_mapping.lp_fragment_address`` gives its offset and length in the flattened parameter.
* ZeRO-0: fp32 training updates the parameters themselves; 16-bit training keeps fp32 copies in
  the wrapper optimizer (``fp32_groups`` per parameter, or ``fp32_groups_flat``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist

from ._layout import ShardLayout, ShardSpec
from ._state import EmaState

__all__ = ["local_shards", "shard_layout", "gather_full", "swapped", "SwapStats", "data_parallel_group", "unsupported_reason"]


class _Cached(NamedTuple):
    optimizer: Any  # weak reference to the engine's optimizer when read (it may refer to the engine)
    stage: int
    buffer_ptrs: tuple
    shards: dict[str, torch.Tensor]
    layout: ShardLayout
    params: dict[str, torch.nn.Parameter]
    # What local_shards hands out: the same dict on every call (so update() recognises it at a
    # constant cost), holding its own view objects (so replacing one of them frees the old view,
    # which update() notices). Internal code reads `shards`, which callers cannot reach.
    handed_out: dict[str, torch.Tensor]


_CACHE: "weakref.WeakKeyDictionary[Any, _Cached]" = weakref.WeakKeyDictionary()


def local_shards(engine) -> dict[str, torch.Tensor]:
    """This rank's pieces of the fp32 master weights, keyed by parameter name.

    Returns:
        ``{name: 1-D fp32 view}`` for every parameter the optimizer trains, in
        ``module.named_parameters()`` order, the same keys on every rank. The views alias
        DeepSpeed's master buffers (no copy): call it after ``engine.step()`` and do not write into
        them. A rank that owns none of a parameter gets an empty tensor. Piece ``name`` is
        ``full.reshape(-1)[spec.offset : spec.offset + spec.numel]`` with ``spec =
        shard_layout(engine).specs[name]``.

    Frozen parameters (``requires_grad=False``) and trainable parameters that are not in the
    optimizer never change, so they have no EMA and are left out; their live weights are their
    EMA. Works for ZeRO stages 0-3, fp32/bf16/fp16, ``offload_optimizer`` and ``offload_param``
    to CPU (not NVMe). The result is cached per engine and re-read only when DeepSpeed's master
    buffers move, so calling it every step is cheap: it returns the **same dict object** each time,
    which :func:`functional_ema.update` recognises at a constant cost, whatever the number of
    tensors. Treat it as read-only: copy it (``dict(local_shards(engine))``) before editing.
    """
    return _read(engine).handed_out


def shard_layout(engine) -> ShardLayout:
    """Full shape, offset and length of each of this rank's pieces (see :func:`local_shards`)."""
    return _read(engine).layout


def data_parallel_group(engine):
    """The process group ZeRO partitions over."""
    opt = engine.optimizer
    group = getattr(opt, "dp_process_group", None)
    if group is None:
        group = getattr(engine, "data_parallel_group", None)
    return group if group is not None else dist.group.WORLD


def _world(engine) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    group = data_parallel_group(engine)
    return dist.get_rank(group), dist.get_world_size(group)


def unsupported_reason(engine) -> str | None:
    """Why :func:`local_shards` cannot read this engine, or ``None`` when it can."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3 and getattr(opt, "params_in_nvme_and_cpu", False):
        return "ZeRO-3 with NVMe offload keeps the fp32 master on disk; functional_ema supports CPU offload only"
    if engine.zero_optimization_stage() == 3 and any(t.numel() == 0 for t in getattr(opt, "fp32_partitioned_groups_flat", [])):
        return "ZeRO-3 optimizer state is swapped out (NVMe); functional_ema supports CPU offload only"
    return None


def _named_params(engine) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in engine.module.named_parameters():
        if id(p) not in seen:  # tied weights: one entry, under the first name
            seen.add(id(p))
            out.append((name, p))
    return out


def _master_buffers(opt, stage: int) -> list[torch.Tensor]:
    """The tensors holding the fp32 master weights (a few flat buffers, per parameter at stage 0)."""
    if stage == 3:
        return opt.fp32_partitioned_groups_flat
    if stage in (1, 2):
        return getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_groups_flat_partition", [])
    if hasattr(opt, "fp32_groups_flat"):
        return opt.fp32_groups_flat
    if hasattr(opt, "fp32_groups"):
        return [t for g in opt.fp32_groups for t in g]
    return [p for g in opt.param_groups for p in g["params"]]


def _buffer_ptrs(bufs: list[torch.Tensor]) -> tuple:
    return tuple(map(_data_ptr, bufs))


_data_ptr = torch.Tensor.data_ptr
# The engine read last and its cache entry: local_shards runs every step right after the optimizer
# step has flushed the CPU caches, when a WeakKeyDictionary lookup alone costs ~20 us. Cleared when
# that engine is freed, so it never keeps an engine's buffers alive.
_LAST: list = [None, None]


def _read(engine) -> _Cached:
    ref, cached = _LAST
    if ref is None or ref() is not engine:
        cached = _CACHE.get(engine)
    if cached is not None:
        opt = engine.optimizer
        # DeepSpeed does not move its master buffers in normal training; if it ever does (or the
        # optimizer is replaced), everything is read again.
        if opt is cached.optimizer() and _buffer_ptrs(_master_buffers(opt, cached.stage)) == cached.buffer_ptrs:
            if ref is None or ref() is not engine:
                _LAST[:] = [weakref.ref(engine, _clear_last), cached]
            return cached
    reason = unsupported_reason(engine)
    if reason:
        raise NotImplementedError(reason)
    stage = engine.zero_optimization_stage()
    rank, world = _world(engine)
    named = _named_params(engine)
    if stage == 3:
        pieces = _zero3(engine, named, rank)
    elif stage in (1, 2):
        pieces = _zero12(engine, named)
    else:
        pieces = _zero0(engine, named)
    shards = {n: v for n, (v, _) in pieces.items()}
    layout = ShardLayout(rank, world, stage, {n: s for n, (_, s) in pieces.items()})
    params = {n: p for n, p in named if n in pieces}
    handed_out = {n: v.view(v.shape) for n, v in shards.items()}
    opt = engine.optimizer
    cached = _Cached(weakref.ref(opt), stage, _buffer_ptrs(_master_buffers(opt, stage)), shards, layout, params, handed_out)
    _CACHE[engine] = cached
    _LAST[:] = [weakref.ref(engine, _clear_last), cached]
    return cached


def _clear_last(_ref) -> None:
    if _LAST[0] is _ref:
        _LAST[:] = [None, None]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)


def _zero3(engine, named, rank) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    opt = engine.optimizer
    trained = {id(p) for group in opt.fp16_groups for p in group}
    out = {}
    for name, p in named:
        if id(p) not in trained:
            continue
        group_idx, offset, _ = opt.grad_position[opt.get_param_id(p)]
        ps = p.partition_numel()
        prank = dist.get_rank(p.ds_process_group) if dist.is_initialized() else 0
        valid = max(0, min(p.ds_numel - prank * ps, ps))
        flat = opt.fp32_partitioned_groups_flat[group_idx]
        view = _flat(flat).narrow(0, offset, valid)
        out[name] = (view, ShardSpec(tuple(p.ds_shape), prank * ps if valid else 0, valid))
    return out


def _zero12(engine, named) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    opt = engine.optimizer
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
    if groups is None:
        raise NotImplementedError(f"unknown ZeRO-1/2 optimizer {type(opt).__name__}: no bit16_groups/bf16_groups")
    flat_parts = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
    trained = {id(p) for group in groups for p in group}
    out = {}
    for name, p in named:
        if id(p) not in trained:
            continue
        hp = getattr(p, "_hp_mapping", None)
        if hp is None:  # this rank owns none of p
            empty = flat_parts[0].detach().narrow(0, 0, 0)
            out[name] = (empty, ShardSpec(tuple(p.shape), 0, 0))
            continue
        start, numel = int(hp.lp_fragment_address.start), int(hp.lp_fragment_address.numel)
        view = _flat(hp.hp_fragment)
        assert view.numel() == numel, (name, view.numel(), numel)
        out[name] = (view, ShardSpec(tuple(p.shape), start, numel))
    return out


def _zero0(engine, named) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    opt = engine.optimizer
    pairs: dict[int, torch.Tensor] = {}  # id(module param) -> fp32 master
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer
        for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
            for lp, hp in zip(lp_group, hp_group):
                pairs[id(lp)] = hp
    elif hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer
        for lp_group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            offset = 0
            for lp in lp_group:
                pairs[id(lp)] = flat.detach().narrow(0, offset, lp.numel())
                offset += lp.numel()
    else:  # fp32 training: the optimizer updates the module parameters themselves
        for group in opt.param_groups:
            for p in group["params"]:
                pairs[id(p)] = p
    out = {}
    for name, p in named:
        hp = pairs.get(id(p))
        if hp is None or not p.requires_grad:
            continue
        out[name] = (_flat(hp), ShardSpec(tuple(p.shape), 0, p.numel()))
    return out


# ------------------------------------------------------------------------------------ gather_full


def gather_full(
    state: EmaState,
    engine,
    *,
    index: int = 0,
    dst: int | None = None,
    device: torch.device | str | None = None,
    bucket_bytes: int = 256 << 20,
) -> dict[str, torch.Tensor]:
    """Full-shape EMA weights from every rank's pieces. A collective: call it on all ranks.

    Args:
        state: this rank's state (from :func:`functional_ema.init_ema` over ``local_shards``).
        engine: the engine the shards came from.
        index: which tracked EMA (``state.emas[index]``).
        dst: ``None`` returns the full weights on every rank; a rank number returns them on that
            rank only (the others get ``{}``), which saves memory on the others.
        device: where the result goes (default: the EMA's device).
        bucket_bytes: pieces are exchanged in buckets of about this size per rank, so the
            transient memory is ``world_size * bucket_bytes`` plus the result.

    Returns:
        ``{name: tensor of the parameter's full shape}``, dtype of the EMA, names as in
        ``engine.module.named_parameters()``.
    """
    cached = _read(engine)
    layout = cached.layout
    ema = state.emas[index]
    if set(ema) != set(layout.specs):
        missing, extra = sorted(set(layout.specs) - set(ema)), sorted(set(ema) - set(layout.specs))
        raise ValueError(f"the state does not match the engine's parameters: missing {missing[:8]}, extra {extra[:8]}")
    names = list(layout.specs)
    if layout.stage == 0 or layout.world_size == 1:  # every rank holds everything
        if dst is not None and layout.rank != dst:
            return {}
        return {n: ema[n].detach().reshape(layout.specs[n].shape).to(device or ema[n].device, copy=True) for n in names}
    group = data_parallel_group(engine)
    all_specs = _all_layouts(engine, cached)
    out: dict[str, torch.Tensor] = {}
    ref = ema[names[0]]
    dtype, src_device = ref.dtype, ref.device
    device = torch.device(device) if device is not None else src_device
    # The collective runs on the backend's device: gloo takes CPU tensors, nccl CUDA ones.
    comm_device = src_device
    for bucket in _buckets(names, all_specs, bucket_bytes // ref.element_size()):
        sizes = [sum(all_specs[r][n].numel for n in bucket) for r in range(layout.world_size)]
        width = max(sizes)
        send = torch.zeros(width, dtype=dtype, device=comm_device)
        torch.cat([ema[n].detach().reshape(-1).to(comm_device) for n in bucket] or [send[:0]], out=send[: sizes[layout.rank]])
        if dst is None:
            recv = [torch.empty(width, dtype=dtype, device=comm_device) for _ in range(layout.world_size)]
            dist.all_gather(recv, send, group=group)
        else:
            recv = [torch.empty(width, dtype=dtype, device=comm_device) for _ in range(layout.world_size)] if layout.rank == dst else None
            dist.gather(send, recv, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)
            if layout.rank != dst:
                continue
        cursor = [0] * layout.world_size
        for n in bucket:
            spec = layout.specs[n]
            full = torch.empty(spec.full_numel, dtype=dtype, device=device)
            for r in range(layout.world_size):
                s = all_specs[r][n]
                if s.numel:
                    full[s.offset : s.offset + s.numel].copy_(recv[r][cursor[r] : cursor[r] + s.numel])
                    cursor[r] += s.numel
            out[n] = full.view(spec.shape)
    return out


def _buckets(names, all_specs, max_elems):
    bucket, size = [], 0
    for n in names:
        n_el = max(specs[n].numel for specs in all_specs)
        if bucket and size + n_el > max_elems:
            yield bucket
            bucket, size = [], 0
        bucket.append(n)
        size += n_el
    if bucket:
        yield bucket


_LAYOUTS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _all_layouts(engine, cached: _Cached) -> list[dict[str, ShardSpec]]:
    """Every rank's specs (exchanged once per engine and layout)."""
    hit = _LAYOUTS.get(engine)
    if hit is not None and hit[0] is cached:
        return hit[1]
    layout = cached.layout
    group = data_parallel_group(engine)
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, [(n, s.offset, s.numel) for n, s in layout.specs.items()], group=group)
    result = []
    for r, entries in enumerate(gathered):
        specs = {}
        for n, off, numel in entries:
            specs[n] = ShardSpec(layout.specs[n].shape, off, numel)
        if list(specs) != list(layout.specs):
            raise RuntimeError(f"rank {r} reports different parameter names than rank {layout.rank}")
        result.append(specs)
    _LAYOUTS[engine] = (cached, result)
    return result


# ----------------------------------------------------------------------------------- eval swap


class SwapStats(NamedTuple):
    """What a :func:`swapped` block allocated on this rank."""

    swapped_params: int
    extra_bytes: int  # temporary weight memory held during the block


@contextlib.contextmanager
def swapped(engine, state: EmaState, *, index: int = 0) -> Iterator[SwapStats]:
    """Run the engine's ordinary forward with EMA weights; live weights come back on exit.

    Inside the block ``engine(x)`` (and ``engine.module(x)``) computes with ``state.emas[index]``
    cast to the parameters' dtype, exactly as a plain model loaded with those weights would.
    Restored on exit, also when the body raises. DeepSpeed's fp32 master weights and optimizer
    state are never written, so training after the block continues bitwise as if it never ran.
    Use it for forward passes only (evaluation, sampling) under ``torch.no_grad()``; do not call
    ``backward``/``step`` inside. Call it on every rank (ZeRO-1/2 gather the EMA; ZeRO-3 gathers
    weights in the forward as usual).

    How, per stage:
        * ZeRO-3: the EMA piece, cast to the partition dtype, replaces each parameter's local
          partition (``ds_tensor``); DeepSpeed's gathered-parameter cache is emptied on entry and on
          exit so no live weights leak in and no EMA weights leak out. Extra memory: one 16-bit
          copy of this rank's partition (O(local shard), never the full model).
        * ZeRO-1/2: the full EMA is all-gathered once and the parameters' ``.data`` point at it
          (full model in the parameter dtype, the memory the forward needs anyway).
        * ZeRO-0: the EMA is already full on every rank; no communication.
    Frozen parameters and parameters outside the optimizer keep their live weights, which never
    change, so they are their own EMA.

    Yields:
        :class:`SwapStats` with the number of swapped parameters and the temporary bytes held.

    Example:
        >>> with fe.swapped(engine, state), torch.no_grad():   # doctest: +SKIP
        ...     val_loss = loss_fn(engine(x_val), y_val)
    """
    cached = _read(engine)
    ema = state.emas[index]
    missing = [n for n in cached.params if n not in ema]
    if missing:
        raise ValueError(f"the EMA state has no entry for parameters {missing[:8]} of this engine")
    if cached.layout.stage == 3:
        with _swap_zero3(engine, cached, ema) as stats:
            yield stats
    else:
        with _swap_data(engine, cached, state, index) as stats:
            yield stats


@contextlib.contextmanager
def _swap_zero3(engine, cached: _Cached, ema: dict[str, torch.Tensor]):
    engine.empty_partition_cache()  # drop gathered live weights (persistent ones included)
    saved: list[tuple[torch.nn.Parameter, torch.Tensor, Any]] = []
    extra = 0
    try:
        for name, p in cached.params.items():
            part = p.ds_tensor
            piece = ema[name]
            swap = torch.empty_like(part.data)
            n = piece.numel()
            swap[:n].copy_(piece.reshape(-1))
            if n < swap.numel():  # padding tail: keep whatever DeepSpeed had there
                swap[n:].copy_(part.data[n:])
            extra += swap.numel() * swap.element_size()
            saved.append((p, part.data, getattr(p, "ds_secondary_tensor", None)))
            part.data = swap
            if getattr(p, "ds_secondary_tensor", None) is not None:  # ZeRO++ hpZ gathers from here
                p.ds_secondary_tensor = None
        yield SwapStats(len(saved), extra)
    finally:
        engine.empty_partition_cache()  # drop gathered EMA weights before training resumes
        for p, data, secondary in saved:
            p.ds_tensor.data = data
            if secondary is not None:
                p.ds_secondary_tensor = secondary


@contextlib.contextmanager
def _swap_data(engine, cached: _Cached, state: EmaState, index: int):
    full = gather_full(state, engine, index=index)
    saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    extra = 0
    try:
        for name, p in cached.params.items():
            w = full[name].to(device=p.device, dtype=p.dtype).view(p.shape)
            extra += w.numel() * w.element_size()
            saved.append((p, p.data))
            p.data = w
        del full
        yield SwapStats(len(saved), extra)
    finally:
        for p, data in saved:
            p.data = data
