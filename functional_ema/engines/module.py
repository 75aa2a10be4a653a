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
from . import unwrap_compiled
from ._base import (
    _SLOT,
    Adapter,
    Reading,
    _Slot,
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
    # The parameters left out as frozen (unfreezing one is seen), and under DDP also those read while frozen: DDP
    # does not reduce one unfrozen after it was built, which a new reading warns about (warn_unreduced).
    frozen: tuple
    dicts: tuple  # every module's `_parameters` and `_modules` dict
    count: int  # type: ignore[assignment]  # total entries of those dicts (shadows tuple.count, never called here)
    # Every non-empty `_modules` dict: a submodule replaced or renamed keeps the counts. Compared as one list of
    # values and one of keys per dict, not entry by entry as above: a few dicts of many entries, where the lists
    # measured cheaper (the many small `_parameters` dicts measured the other way; docs/performance.md).
    parents: tuple
    children: list  # their values (compared by identity), one list per dict
    child_names: list  # their keys
    # Each non-empty `_parameters` and `_modules` dict (`held`), with the `__dict__` of its module (`owners`) and the
    # attribute naming it (`attrs`): a dict object replaced whole (`m.__dict__.update(fresh.__dict__)`, `m._modules =
    # {...}`) leaves every entry above as it was in the old dict. One C-level item lookup and identity test a dict,
    # the empty ones left out (an empty dict replaced by a full one is far-fetched): about 15 us a local_shards call
    # on the 516-tensor benchmark model (293 modules), half the cost of getattr over every dict.
    owners: tuple
    attrs: tuple
    held: tuple
    root: torch.nn.Module  # the module read (a DDP wrapper's `.module` replaced is another root)

    @classmethod
    def of(cls, module: torch.nn.Module, params: dict, ddp: bool = False) -> _Check:
        mods = list(module.modules())
        registries, keys, values = [], [], []
        for m in mods:
            for key, value in m._parameters.items():
                registries.append(m._parameters)
                keys.append(key)
                values.append(value)
        read = {id(p) for p in params.values()}
        frozen = tuple(p for p in module.parameters() if id(p) not in read or (ddp and not p.requires_grad))
        dicts: tuple[dict, ...] = (*(m._parameters for m in mods), *(m._modules for m in mods))
        # A sparse parameter has no strided memory to compare (is_set_to has no sparse kernel); it is never
        # averaged (local_shards refuses it unless excluded), and replacing it is seen in the registries.
        trained = tuple(p for p in params.values() if p.layout is torch.strided)
        parents = tuple(m._modules for m in mods if m._modules)
        held = [(vars(m), a, d) for a in ("_parameters", "_modules") for m in mods if (d := getattr(m, a))]
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
            tuple(owner for owner, _, _ in held),
            tuple(a for _, a, _ in held),
            tuple(d for _, _, d in held),
            module,
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
            and all(map(operator.is_, map(dict.__getitem__, self.owners, self.attrs), self.held))
        )


def is_ddp(x: Any) -> bool:
    return isinstance(x, torch.nn.parallel.DistributedDataParallel)


class ModuleAdapter(Adapter):
    """A plain ``nn.Module`` (world of one) or a DDP-wrapped one (replicated over its group)."""

    name = "module"
    keeps_frozen = True

    def module(self) -> torch.nn.Module:
        # DDP(torch.compile(m)): m's own names, as for torch.compile(DDP(m)) (adapter_for unwraps the outer one)
        return unwrap_compiled(self.target.module) if is_ddp(self.target) else self.target

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
        # (Freezing a parameter read changes nothing: see _base.is_read.) A DDP wrapper's module replaced
        # (ddp.module = new_net): the check above walked the old one.
        token = reading.token
        return token.current() and (token.root is self.target or token.root is self.module())

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
        # A DDP wrapper read first keeps what its module's own reading kept: the documented way to average a
        # parameter frozen for a while is to read the model before freezing it, and that model then wrapped
        # (DDP(model), built while it is frozen) is the same model.
        kept = previous if previous is not None or not is_ddp(self.target) else _module_reading(self.module())
        named = self._params(kept)
        refuse_uninitialised(named)
        group = getattr(self.target, "process_group", None) if is_ddp(self.target) else None
        if is_ddp(self.target) and group is None and dist.is_initialized():
            group = dist.group.WORLD
        rank, world = world_of(group) if group is not None else (0, 1)
        if world > 1 and is_ddp(self.target):  # one rank has no replica to drift from
            warn_unreduced(self.target, [n for n, _ in named if kept is not None and n not in kept.params])
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
            _Check.of(self.module(), params, is_ddp(self.target)),
        )
        # Refused by local_shards unless its selection leaves them out (exclude=): see Reading.sparse.
        reading.sparse = tuple(n for n, p in named if p.layout is not torch.strided)
        return reading


def _module_reading(module: torch.nn.Module) -> Reading | None:
    """The reading a plain module's adapter keeps on ``module`` (``None``: not read, or read by another engine)."""
    slot = vars(module).get(_SLOT)
    reading = slot.reading if isinstance(slot, _Slot) and slot.kind is type(module) else None
    return reading if reading is not None and isinstance(reading.token, _Check) else None


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
    """Warn (``UnsyncedReplicasWarning``) when ``ddp`` trains parameters it does not all-reduce.

    DDP picks the parameters to reduce once, when built (the parameter objects, by ``requires_grad`` then), and
    never again: a parameter unfrozen later (Lightning's ``BackboneFinetuning``, Lightning issue #20340), added
    later, or replaced later (``model.head = new_head``, ``model.w = nn.Parameter(...)``: the same count, other
    objects) gets its gradient from this rank's batch alone, so every rank trains its own copy. The replicated EMA
    assumes the ranks agree and saves rank 0's. The reducer does not list its parameters, but DDP keeps every
    parameter its module held when wrapped (``_module_parameters``): a trainable one not among them (by identity)
    is not reduced, and more trainable parameters than it reduces proves at least one unfrozen since. Called at a
    reading only (a replaced parameter makes the reading stale). ``joined``: the names this reading adds to the
    previous one (the likely ones), may be empty."""
    try:  # private, but present since torch 1.9; without it there is nothing to compare
        reduced = int(ddp._get_ddp_logging_data()["num_parameter_tensors"])
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        return
    ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
    trainable = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    built = getattr(ddp, "_module_parameters", None)  # private (torch >= 1.12); without it, the count alone
    known = {id(p) for p in built} if isinstance(built, list) else None
    foreign = [n for n, p in trainable if known is not None and id(p) not in known]
    if not foreign and len(trainable) <= reduced:
        return
    from .._errors import UnsyncedReplicasWarning
    from .._tree import short_list

    if len(trainable) > reduced:  # unfrozen or added since (the count says so; added ones are foreign too)
        among = f" (new in this reading: {short_list(joined, 4)})" if joined else ""
        what = (
            f"trains {len(trainable)} parameters but all-reduces the gradients of {reduced}: DDP chose them when "
            f"it was built, by requires_grad, so the parameters unfrozen or added since{among} are"
        )
        after = "unfreezing"
    else:  # as many, but some are other objects
        what = (
            f"trains {len(foreign)} parameter(s) that it did not hold when it was built ({short_list(foreign, 4)}: "
            "replaced since; DDP all-reduces the parameter objects it found then), so they are"
        )
        after = "replacing them"
    warnings.warn(
        f"functional_ema: this DistributedDataParallel model {what} trained on each rank's batch alone and the ranks' "
        f"weights drift apart; the EMA follows each rank's weights and saves rank 0's. Build the "
        f"DistributedDataParallel wrapper after {after} (or freeze by learning rate: keep requires_grad=True and set "
        "the group's lr to 0 until it trains; see Lightning issue #20340 for BackboneFinetuning). (Category "
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
    (e.g. ``channels_last`` weights) are left where they are, with any parameter sharing their memory.
    Parameters tied through memory (``dec.weight.data = enc.weight.data``) share one slot, so they stay
    tied; two that overlap partially are refused (``ValueError`` naming both) before anything moves. A later ``model.to(...)`` or
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
    groups: dict[tuple, list[list[torch.nn.Parameter]]] = {}
    for ties in _memory_ties(inner):  # parameters over one memory (tied through .data) keep one slot: still tied
        p = ties[0]
        groups.setdefault((p.device, p.dtype, p.device.type == "cpu" and p.is_pinned()), []).append(ties)
    moved = 0
    with torch.no_grad():
        for (device, dtype, pinned), slots in groups.items():
            if len(slots) < 2:
                continue
            flat = torch.empty(sum(t[0].numel() for t in slots), dtype=dtype, device=device, pin_memory=pinned)
            pos = 0
            for ties in slots:
                n = ties[0].numel()
                flat[pos : pos + n].copy_(ties[0].reshape(-1))
                for p in ties:
                    p.data = flat[pos : pos + n].view(p.shape)
                    moved += 1
                pos += n
    return moved


def _memory_ties(inner: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """``flatten_parameters``' slots: the trainable contiguous parameters, those over the same memory (same
    address, dtype and size: ``dec.weight.data = enc.weight.data``) together, one slot each. A parameter whose
    memory meets another parameter's otherwise (a frozen or non-contiguous one, which stay where they are) stays
    too, with its ties; ``ValueError`` naming both, before anything moves, where two that would move overlap
    partially (no flat buffer keeps that: flattening would untie them)."""
    from ._base import meeting, overlapping

    params = list(inner.named_parameters())  # tied objects once, under the first name
    movable = {name: p for name, p in params if p.requires_grad and p.layout is torch.strided and p.is_contiguous()}
    same: dict[tuple, list[str]] = {}  # (device, address, dtype, size) -> the names over that one memory
    for name, p in movable.items():
        same.setdefault((p.device, p.data_ptr(), p.dtype, p.numel()), []).append(name)
    tie_of = {name: key for key, names in same.items() for name in names}
    stay: set[tuple] = set()
    for names in overlapping((name, p.detach()) for name, p in params):
        if any(n not in movable for n in names):  # a parameter that stays keeps the memory it shares
            stay.update(tie_of[n] for n in names if n in movable)
            continue
        for i, a in enumerate(names):  # contiguous: their spans are their memory; some two differ unless one tie
            b = next((b for b in names[i + 1 :] if tie_of[b] != tie_of[a] and meeting(movable[a], movable[b])), None)
            if b is not None:
                raise ValueError(
                    f"flatten_parameters: parameters {a!r} {tuple(movable[a].shape)} and {b!r} "
                    f"{tuple(movable[b].shape)} partially share memory (views of one tensor): one flat buffer cannot "
                    "keep that, and moving them would untie them. Give each its own memory, tie them as one "
                    "Parameter object, or leave the model unflattened; nothing was moved"
                )
    return [[movable[n] for n in names] for key, names in same.items() if key not in stay]
