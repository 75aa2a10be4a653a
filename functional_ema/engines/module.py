"""Plain ``nn.Module`` and ``DistributedDataParallel`` adapter.

Every rank holds whole parameters (DDP keeps them identical on every rank), so the layout is the
replicated one, as for ZeRO-0: each piece is a whole parameter, rank ``r`` of the DDP group, stage 0.
The pieces are the trainable parameters themselves (``requires_grad`` when first read, see
``_base.is_read``), no copy.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from .._layout import ShardLayout, ShardSpec
from .._shards import shards_from_views
from ._base import (
    Adapter,
    Reading,
    any_requires_grad,
    caller_level,
    is_read,
    unmoved,
    warn_low_precision,
    world_of,
)

__all__ = ["ModuleAdapter", "is_ddp", "flatten_parameters"]


class _Check(NamedTuple):
    """What a plain module's reading depends on, gathered once so re-checking needs no tree walk."""

    trained: tuple  # the parameters read
    # A view of each, taken at the reading (``p.detach()``), for ``_base.unmoved``: the memory moved or was re-shaped
    # or re-strided in place, and the reading's views would go on averaging the old extent or layout. (One
    # ``is_set_to`` a parameter measured cheaper cold than the data pointer and ``size()`` passes it replaced;
    # docs/performance.md.)
    views: tuple
    # Every parameter registration of every module (`_parameters` dict, its own key object, the value held):
    # the trained ones, but also tied aliases, frozen ones and `None` entries, since replacing any of those
    # under its name keeps every count (untying `b.weight` from `a.weight`, a bias set where `bias=False` left
    # `None`, a frozen parameter replaced by a trainable one) and must be read again.
    registries: tuple
    keys: tuple
    values: tuple  # compared by identity (a tensor's `==` is elementwise)
    frozen: tuple  # the parameters left out as frozen (unfreezing one is seen)
    dicts: tuple  # every module's `_parameters` and `_modules` dict
    count: int  # type: ignore[assignment]  # total entries of those dicts (shadows tuple.count, never called here)
    # Every non-empty `_modules` dict: a submodule replaced or renamed keeps the counts. Compared as one list of
    # values and one of keys per dict, not entry by entry as above: a few dicts of many entries, where the lists
    # measured cheaper (the many small `_parameters` dicts measured the other way; docs/performance.md).
    parents: tuple
    children: list  # their values (compared by identity), one list per dict
    child_names: list  # their keys

    @classmethod
    def of(cls, module: torch.nn.Module, params: dict) -> _Check:
        mods = list(module.modules())
        registries, keys, values = [], [], []
        for m in mods:
            for key, value in m._parameters.items():
                registries.append(m._parameters)
                keys.append(key)
                values.append(value)
        read = {id(p) for p in params.values()}
        frozen = tuple(p for p in module.parameters() if id(p) not in read)
        dicts: tuple[dict, ...] = (*(m._parameters for m in mods), *(m._modules for m in mods))
        # A sparse parameter has no strided memory to compare (is_set_to has no sparse kernel); it is never
        # averaged (local_shards refuses it unless excluded), and replacing it is seen in the registries.
        trained = tuple(p for p in params.values() if p.layout is torch.strided)
        parents = tuple(m._modules for m in mods if m._modules)
        return cls(
            trained,
            tuple(p.detach() for p in trained),
            tuple(registries),
            tuple(keys),
            tuple(values),
            frozen,
            dicts,
            sum(map(len, dicts)),
            parents,
            list(map(list, map(dict.values, parents))),
            list(map(list, parents)),
        )

    def current(self) -> bool:
        """Whether nothing the reading depends on changed; a few C-level passes over tuples, no tree walk."""
        return (
            unmoved(self.trained, self.views)
            and all(map(operator.is_, map(dict.get, self.registries, self.keys), self.values))
            and not any_requires_grad(*self.frozen)
            and sum(map(len, self.dicts)) == self.count
            and list(map(list, map(dict.values, self.parents))) == self.children
            and list(map(list, self.parents)) == self.child_names
        )


def is_ddp(x: Any) -> bool:
    return isinstance(x, torch.nn.parallel.DistributedDataParallel)


class ModuleAdapter(Adapter):
    """A plain ``nn.Module`` (world of one) or a DDP-wrapped one (replicated over its group)."""

    name = "module"
    keeps_frozen = True

    def module(self) -> torch.nn.Module:
        return self.target.module if is_ddp(self.target) else self.target

    def _params(self, previous: Reading | None) -> list[tuple[str, torch.nn.Parameter]]:
        seen: set[int] = set()
        out = []
        for name, p in self.module().named_parameters():  # tied weights: once, under the first name
            if is_read(name, p, previous, self.keep) and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def refuse_empty_reading(self) -> None:
        refuse_nothing_trainable(self.target)  # every rank holds whole parameters: nothing read is nothing trained

    def _is_current(self, reading: Reading) -> bool:
        # What could make the reading stale, each checked without walking the module tree (a walk costs
        # milliseconds for a few hundred parameters): a parameter's memory moved (module.to(...),
        # load_state_dict(assign=True)) or its shape or strides changed over the same memory (p.data =
        # p.data[:k], a square p.data.t()); any parameter registration was replaced (a trained one, a tied
        # alias untied, a frozen one, a None bias set); one left out as frozen was unfrozen; a parameter or
        # submodule was added, removed, replaced (model.head = new_head, or PEFT wrapping a layer) or renamed.
        # (Freezing a parameter read changes nothing: see _base.is_read.)
        return reading.token.current()

    def _read(self, previous: Reading | None = None) -> Reading:
        from . import refuse_engine_internals

        refuse_engine_internals(self.module())
        if previous is not None and _sharded_since(self.module()):
            # FSDP2 or tensor parallelism applied since the plain read, the root's class kept (fully_shard on
            # submodules only, parallelize_module), so adapter_for chose this adapter again: this object becomes the
            # FSDP2 adapter (no state of its own beyond Adapter's), for the verb holding it and, through the slot
            # Adapter.read keeps, every later call. A state made from the plain reading is refused by update's shape
            # check, which names sharding after init_ema.
            from .fsdp2 import FSDP2Adapter

            self.__class__ = FSDP2Adapter  # type: ignore[assignment]  # the adapter this object becomes (above)
            return self._read(None)
        named = self._params(previous)
        refuse_uninitialised(named)
        group = getattr(self.target, "process_group", None) if is_ddp(self.target) else None
        if is_ddp(self.target) and group is None and dist.is_initialized():
            group = dist.group.WORLD
        rank, world = world_of(group) if group is not None else (0, 1)
        if world > 1:  # one rank has no replica to drift from
            warn_unreduced(self.target, [n for n, _ in named if previous is not None and n not in previous.params])
        specs = {n: ShardSpec(tuple(p.shape), 0, p.numel()) for n, p in named}
        shards = shards_from_views([(n, p) for n, p in named])
        params = dict(named)
        warn_low_precision(
            f"a {'DistributedDataParallel' if is_ddp(self.target) else 'plain'} module's parameters",
            params,
            "Keep the parameters in fp32 and compute in 16 bits with torch.autocast, or pass the engine that holds "
            "fp32 masters (a DeepSpeed engine, not engine.module)",
        )
        reading = Reading(
            shards,
            ShardLayout(rank, world, 0, specs, engine="module"),
            params,
            group if world > 1 else None,
            _Check.of(self.module(), params),
        )
        # Refused by local_shards unless its selection leaves them out (exclude=): see Reading.sparse.
        reading.sparse = tuple(n for n, p in named if p.layout is not torch.strided)
        return reading


def refuse_uninitialised(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse, naming it, a lazy module's ``UninitializedParameter`` (no shape or values before the module's first
    forward), before torch's own error (about ``load_state_dict``, naming no parameter) escapes from the reading."""
    for name, p in named:
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name!r} is not initialised yet (a lazy module's {type(p).__name__}: it has no shape or "
                "values before the module's first forward): run one forward (or materialise the model) before "
                "local_shards / init_ema"
            )


def refuse_nothing_trainable(target: torch.nn.Module) -> NoReturn:
    """Refuse a plain or DDP module read with no trainable parameter: its EMA would be empty, nothing averaged.
    (Not for a pipeline stage or a sharded engine, whose rank may legitimately hold nothing: their adapters keep
    ``Adapter.refuse_empty_reading``'s no-op.)"""
    inner: torch.nn.Module = target.module if is_ddp(target) else target  # type: ignore[assignment]  # DDP's .module
    frozen = sum(1 for _ in inner.parameters())
    kind = "DistributedDataParallel model" if is_ddp(target) else f"{type(inner).__name__} module"
    has = f"all {frozen} of its parameters are frozen (requires_grad=False)" if frozen else "it has no parameters"
    raise ValueError(
        f"local_shards: this {kind} has no trainable parameter ({has}), so nothing would be averaged. Read the model "
        "while its parameters train (fe.local_shards(model) before freezing anything, also when resuming: a "
        "parameter frozen after the first reading stays in the EMA), or unfreeze what is trained"
    )


def _sharded_since(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (on submodules only: the root's class stays, see ``_base._Slot.kind``) or
    ``parallelize_module`` turned a module read as plain into an FSDP2 / DTensor one (read by the FSDP2 adapter)."""
    from . import fsdp2

    return fsdp2.is_fsdp2(module)


def warn_unreduced(ddp: torch.nn.parallel.DistributedDataParallel, joined: list[str]) -> None:
    """Warn (``UnsyncedReplicasWarning``) when ``ddp`` trains more parameters than it all-reduces.

    DDP picks the parameters to reduce once, when built (``requires_grad`` then), and never again: a parameter
    unfrozen later (Lightning's ``BackboneFinetuning``, Lightning issue #20340) or added later gets its gradient
    from this rank's batch alone, so every rank trains its own copy. The replicated EMA assumes the ranks agree and
    saves rank 0's. No per-parameter test exists (the reducer does not list its parameters); more trainable
    parameters than it reduces proves at least one is left out. ``joined``: the names this reading adds to the
    previous one (the likely ones), may be empty."""
    try:  # private, but present since torch 1.9; without it there is nothing to compare
        reduced = int(ddp._get_ddp_logging_data()["num_parameter_tensors"])
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        return
    ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
    trainable = [n for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    if len(trainable) <= reduced:
        return
    from .._errors import UnsyncedReplicasWarning
    from .._tree import short_list

    among = f" (new in this reading: {short_list(joined, 4)})" if joined else ""
    warnings.warn(
        f"functional_ema: this DistributedDataParallel model trains {len(trainable)} parameters but all-reduces "
        f"the gradients of {reduced}: DDP chose them when it was built, by requires_grad, so the parameters "
        f"unfrozen or added since{among} are trained on each rank's batch alone and the ranks' weights drift "
        "apart; the EMA follows each rank's weights and saves rank 0's. Build the DistributedDataParallel wrapper "
        "after unfreezing (or freeze by learning rate: keep requires_grad=True and set the group's lr to 0 until "
        "it trains; see Lightning issue #20340 for BackboneFinetuning). (Category "
        "functional_ema.UnsyncedReplicasWarning.)",
        UnsyncedReplicasWarning,
        stacklevel=caller_level(),
    )


def flatten_parameters(model: torch.nn.Module) -> int:
    """Opt-in: move a plain or DDP-wrapped module's trainable parameters into one flat buffer
    (one per device and dtype), so ``local_shards(model)`` finds one segment and ``update`` is one
    ``lerp_`` instead of a ``_foreach_lerp_`` over every parameter.

    Each parameter keeps its identity (optimizers, hooks and DDP keep working) and its values; only
    its ``.data`` becomes a view of the flat buffer. Training is unchanged (tested bitwise against an
    untouched twin, also under DDP at 2 ranks). Call it after moving the model to its device, and
    before or after building the optimizer or wrapping in DDP. Frozen and non-contiguous parameters
    (e.g. ``channels_last`` weights) are left where they are. A later ``model.to(...)`` or
    ``load_state_dict(assign=True)`` gives parameters their own memory again (``local_shards``
    notices and reads them per tensor); call this again after it.

    Returns:
        The number of parameters moved.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> flatten_parameters(model)
        4
        >>> import functional_ema as fe
        >>> len(fe.local_shards(model).segments)
        1
    """
    inner: torch.nn.Module = model.module if is_ddp(model) else model  # type: ignore[assignment]  # DDP's .module is the wrapped Module
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in inner.parameters():  # tied parameters are listed once
        if p.requires_grad and p.is_contiguous():
            groups.setdefault((p.device, p.dtype, p.device.type == "cpu" and p.is_pinned()), []).append(p)
    moved = 0
    with torch.no_grad():
        for (device, dtype, pinned), params in groups.items():
            if len(params) < 2:
                continue
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device, pin_memory=pinned)
            pos = 0
            for p in params:
                view = flat[pos : pos + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
                pos += p.numel()
                moved += 1
    return moved
