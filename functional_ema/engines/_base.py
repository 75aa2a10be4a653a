"""What every engine adapter provides, and the parts they share.

An adapter turns one kind of training object (a DeepSpeed engine, an FSDP2 model, a plain or DDP
module) into plain data the rest of the package works with:

* a :class:`Reading`: this rank's :class:`~functional_ema.Shards` (views of the fp32 weights the
  optimizer updates, no copy), the :class:`~functional_ema.ShardLayout` that places each piece in
  its full parameter, the live parameters (for swapping weights in), and the process group the
  pieces are spread over;
* ``swap``: a context manager that makes the model's forward compute with other weights.

The reading is kept on the training object itself (the object the user holds), re-read when the
adapter sees that the buffers moved; there is no module-level registry.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .._layout import ShardLayout, ShardSpec
from .._selection import Selection
from .._shards import Shards, shards_from_views
from .._state import finish

if TYPE_CHECKING:
    from .._state import EmaState

__all__ = [
    "Adapter",
    "Reading",
    "SwapStats",
    "select",
    "selection_of",
    "read_for",
    "swap_by_copy",
    "known_adapter",
    "gather_pieces",
    "warn_low_precision",
    "parameters_put_back",
    "refuse_sparse",
]

# Attribute of the training object under which its reading is kept (see Adapter.read).
_SLOT = "_functional_ema_reading"
_OPEN_SWAPS = "_functional_ema_open_swaps"  # the module's OpenSwaps


class SwapStats(NamedTuple):
    """What a :func:`functional_ema.swapped` block allocated on this rank."""

    swapped_params: int
    extra_bytes: int  # temporary weight memory held during the block


class Reading:
    """This rank's view of a training object's weights. Immutable once made.

    Attributes:
        shards: ``Shards`` of this rank's pieces of the fp32 weights (no copy).
        layout: where each piece sits in its full parameter.
        params: ``{name: nn.Parameter}``, the live parameters, same names as ``shards``.
        group: the process group the pieces are spread over (``None`` without one).
        token: what the adapter compares to decide whether the reading is still current.
    """

    __slots__ = ("shards", "layout", "params", "group", "token", "_all_specs", "_selected", "sparse", "_overlaps")

    def __init__(
        self, shards: Shards, layout: ShardLayout, params: dict[str, torch.nn.Parameter], group: Any, token: Any
    ) -> None:
        self.shards, self.layout, self.params, self.group, self.token = shards, layout, params, group, token
        self._all_specs: list[dict[str, ShardSpec]] | None = None  # every rank's specs, exchanged once
        self._selected: dict[tuple, Reading] = {}  # readings of a selection of these names (see select)
        # Names of sparse parameters read: no EMA of them exists (a dense lerp_ towards a sparse tensor does not),
        # so local_shards refuses a selection that keeps one (refuse_sparse), at one truth test a call otherwise.
        self.sparse: tuple[str, ...] = ()
        # The clusters of pieces whose memory may overlap (see overlapping), found by the first swap_by_copy of this
        # reading: its views never move (a moved parameter makes a new reading).
        self._overlaps: list[list[str]] | None = None
        shards.group = training_group(layout, group)
        shards.full_shapes = _full_shapes(shards, layout)

    def all_specs(self) -> list[dict[str, ShardSpec]]:
        """Every rank's specs (a collective the first time it is asked for, on every rank)."""
        if self._all_specs is None:
            self._all_specs = exchange_specs(self.layout, self.group)
        return self._all_specs


def _full_shapes(shards: Shards, layout: ShardLayout) -> tuple[tuple[int, ...], ...] | None:
    """Each parameter's whole shape as ``layout`` records it, in ``shards``' order (``None`` if it lacks a name): the
    index holds this rank's 1-D pieces only, which two models' parameters of other shapes may share. Made once per
    reading, never per call; the same on every rank, so ``update`` refuses an EMA of other shapes on every rank."""
    specs = layout.specs
    if not all(n in specs for n in shards.index.names):
        return None
    return tuple(tuple(int(d) for d in specs[n].shape) for n in shards.index.names)


# How many selections of one reading are kept (see select): a loop that passes a new predicate object at
# every call would otherwise keep every one alive; the usual one or two selections stay cached.
_MAX_SELECTIONS = 4


def select(
    reading: Reading, selection: Selection | None, module: torch.nn.Module | None = None, *, partial: bool | None = None
) -> Reading:
    """The reading of the parameters ``selection`` picks (``reading`` itself for ``None``): the one place every
    engine's pieces are filtered by name (:mod:`functional_ema._selection`).

    Its ``Shards`` holds views of the selected pieces only, grouped into segments as ``local_shards`` groups any
    views (neighbours in one flat buffer share a segment), and carries the selection; its layout, parameters and
    group are the reading's for those names, so every verb (``save``, ``swapped``, ``gather_full``, copies into
    the model) touches the selected parameters only and leaves the others live. Kept on ``reading`` (made once
    per selection while the reading is current), so ``local_shards(x, include=...)`` returns the same object
    every step and ``update`` keeps its fused plan. ``module``: the model whose parameter names a pattern that
    matches no name read is looked up in (frozen ones, tied aliases; see ``Selection.apply``). ``partial``: the
    reading is one pipeline stage's (``Selection.apply``'s ``partial``); ``None``: whether its layout has several
    stages. An adapter that wraps a stage's module (``torch.distributed.pipelining``) passes it for the module's
    own reading, whose layout is the module's alone (one stage)."""
    if selection is None:
        return reading
    cache = reading._selected
    hit = cache.get(selection.key)
    if hit is not None:
        return hit
    layout = reading.layout
    unread = None if module is None else lambda: unread_names(module, layout.specs)
    # A pipeline stage sees its own names only: the selection describes the whole model, so a pattern for another
    # stage's parameters, or one that leaves this stage nothing, is no error here (that stage averages nothing).
    pipelined = layout.part.pp_size > 1 if partial is None else partial
    names = selection.apply(list(layout.specs), unread, partial=pipelined)  # raises, naming the pattern or predicate
    shards = shards_from_views([(n, reading.shards[n]) for n in names])
    shards.swapped_in = reading.shards.swapped_in  # the model's counter of open swapped() blocks
    sub = Reading(
        shards,
        _select_layout(layout, names),
        # not every name has a live parameter here: another expert-parallel rank's experts are listed, empty
        {n: reading.params[n] for n in names if n in reading.params},
        reading.group,
        reading.token,
    )
    shards.selection = selection
    if len(cache) >= _MAX_SELECTIONS:
        cache.pop(next(iter(cache)))
    cache[selection.key] = sub
    return sub


def refuse_sparse(reading: Reading, shards: Shards) -> None:
    """Refuse ``shards`` (a selection of ``reading``) when it keeps a sparse parameter, naming it and the fix."""
    kept = [n for n in reading.sparse if n in shards]
    if kept:
        name = kept[0]
        raise TypeError(
            f"parameter {name!r} is a sparse tensor ({reading.params[name].layout}); an EMA averages dense weights: "
            f"leave it out with local_shards(model, exclude={kept!r}) (and the same exclude= at every call)"
        )


def unread_names(module: torch.nn.Module, read: Mapping[str, Any]) -> dict[str, str | None]:
    """``module``'s parameter names that are not in ``read``, each mapped to the read name it is a tied alias of
    (the first name of the same parameter), or to ``None`` (a parameter not read, e.g. frozen)."""
    first: dict[int, str] = {}
    out: dict[str, str | None] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        if name not in read:
            out[name] = first[id(p)] if first[id(p)] in read else None
    return out


def _select_layout(layout: ShardLayout, names: list[str]) -> ShardLayout:
    """``layout`` of ``names`` only: the specs, the tensor-parallel split and the expert owners of the others
    dropped, since a checkpoint's records must list the parameters it holds, no more (an owner outside them
    makes the manifest invalid). A selection of no expert has no expert parallelism: its pieces are cut over
    the data-parallel group like any model's, so its checkpoint loads at any expert-parallel size."""
    keep = set(names)
    tp_dims = None if layout.tp_dims is None else {n: d for n, d in layout.tp_dims.items() if n in keep}
    experts = layout.experts
    if experts is not None:
        owners = {n: o for n, o in experts.owners.items() if n in keep}
        experts = experts._replace(owners=owners) if owners else None
    return layout._replace(specs={n: layout.specs[n] for n in names}, tp_dims=tp_dims, experts=experts)


def selection_of(state: Any) -> Selection | None:
    """The selection a state's EMAs were made with (``None`` for all parameters, or a state of plain trees)."""
    emas = getattr(state, "emas", None)
    first = emas[0] if isinstance(emas, tuple) and emas else None
    return first.selection if isinstance(first, Shards) else None


def read_for(adapter: Adapter, state: Any) -> Reading:
    """The adapter's reading, of the parameters ``state`` averages (its selection, if any)."""
    return select(adapter.read(), selection_of(state), adapter.module())


class OpenSwaps:
    """How many :func:`functional_ema.swapped` blocks are open on one model: kept on the model's module (one for its
    wrappers too: a DDP model and ``ddp.module`` read alike) and by the ``Shards`` of each of its readings
    (``Shards.swapped_in``), so that :func:`functional_ema.update` refuses them inside a block. Copies and pickles
    of the module get a closed one (``None`` once unpickled: a pickled model must not need functional_ema)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> OpenSwaps:
        return OpenSwaps()

    def __copy__(self) -> OpenSwaps:
        return OpenSwaps()

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return type(None), ()


def open_swaps(module: torch.nn.Module) -> OpenSwaps:
    """The counter of ``swapped`` blocks open on ``module`` (made on first use, kept in its ``__dict__`` beside the
    reading's slot: not an attribute torch registers, saves or moves)."""
    counter = module.__dict__.get(_OPEN_SWAPS)
    if not isinstance(counter, OpenSwaps):
        counter = module.__dict__[_OPEN_SWAPS] = OpenSwaps()
    return counter


class _Slot:
    """Holds a reading on the training object; copies and pickles of the object get an empty slot
    (a reading holds views of this process's buffers)."""

    __slots__ = ("reading", "adapter", "kind")

    def __init__(self, reading: Reading | None = None, adapter: type | None = None, kind: type | None = None) -> None:
        self.reading = reading
        self.adapter = adapter  # the adapter class, so the next call skips the type checks
        # The object's class at the reading: fully_shard swaps a module's class (to FSDP<name>), and the adapter
        # chosen for the plain module no longer applies.
        self.kind = kind

    def __deepcopy__(self, memo: dict[int, Any]) -> _Slot:
        return _Slot()

    def __copy__(self) -> _Slot:
        return _Slot()

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        # Unpickles as None: a pickled model must not need functional_ema to be loaded.
        return (type(None), ())


def known_adapter(x: Any) -> type | None:
    """The adapter class that read ``x`` last, if any (kept with its reading on ``x``)."""
    d = getattr(x, "__dict__", None)
    slot = d.get(_SLOT) if d is not None else None
    return slot.adapter if isinstance(slot, _Slot) and slot.kind is type(x) else None


class Adapter:
    """Base class: subclasses implement ``_read`` and ``_is_current`` and may override ``swap``."""

    name = "?"
    #: Whether ``read(keep=...)`` reads the frozen parameters it names (a module's and FSDP2's readings choose
    #: parameters by ``requires_grad``, see :func:`is_read`; DeepSpeed's by its optimizer's groups).
    keeps_frozen = False

    def __init__(self, target: Any) -> None:
        self.target = target
        self.keep: frozenset[str] = frozenset()  # frozen parameters read all the same (see read)

    # -- reading
    def read(self, keep: Iterable[str] = ()) -> Reading:
        """The current reading, made once and re-made only when ``_is_current`` says the one kept
        on the training object is stale (the buffers moved, the optimizer was replaced).

        ``keep``: names of parameters to read even though they are frozen (an EMA resumed from a checkpoint
        that holds them: they were trained, and stay in the EMA, as one frozen after a reading does, see
        :func:`is_read`). A name that is no frozen parameter of a module or FSDP2 model changes nothing."""
        slot = self.target.__dict__.get(_SLOT)
        previous = None
        self.keep = frozenset(keep)
        if isinstance(slot, _Slot) and slot.reading is not None:
            mine = slot.adapter is type(self)
            if mine and self._is_current(slot.reading) and self.keep <= slot.reading.params.keys():
                return slot.reading
            close = getattr(slot.reading.token, "close", None)
            if close is not None:  # e.g. hooks the stale reading registered on the model
                close()
            previous = slot.reading if mine else None  # another adapter's reading says nothing about this one's
        reading = self._read(previous)
        # One counter of open swapped() blocks per model, on its module: a reading made inside a block (the parameters'
        # memory moved there), after forget(), or through another wrapper of the module is refused by update too.
        reading.shards.swapped_in = open_swaps(self.module())
        self.target.__dict__[_SLOT] = _Slot(reading, type(self), type(self.target))
        return reading

    def forget(self) -> None:
        """Drop the reading kept on the training object (and what it registered on the model): the next call
        chooses the adapter and reads the model anew, with no memory of parameters read before."""
        slot = self.target.__dict__.pop(_SLOT, None)
        close = getattr(getattr(getattr(slot, "reading", None), "token", None), "close", None)
        if close is not None:
            close()

    def _read(self, previous: Reading | None) -> Reading:  # pragma: no cover - abstract
        """A new reading; ``previous`` is the stale one it replaces (``None`` the first time)."""
        raise NotImplementedError

    def _is_current(self, reading: Reading) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- what the verbs need besides the reading
    def module(self) -> torch.nn.Module:
        """The ``nn.Module`` whose forward computes with the parameters."""
        return self.target

    def default_tag(self, state: EmaState | None) -> str:
        """The tag :func:`functional_ema.save` uses when none is given."""
        if state is None:
            raise TypeError(
                "state: the default tag of a model that counts no steps (not a DeepSpeed engine) is "
                "'global_step<state.step>': pass the state (or a tag)"
            )
        return f"global_step{int(state.step)}"

    @contextlib.contextmanager
    def swap(
        self, reading: Reading, pieces: Mapping[str, torch.Tensor], state: EmaState, index: int, changes: list[str]
    ) -> Iterator[SwapStats]:
        """Context manager: the forward computes with ``pieces`` (this rank's EMA pieces); on exit the trained values
        are back in the parameters the model holds, whatever the block did to them, and ``changes`` names what the
        block had replaced or re-typed (put back)."""
        with swap_by_copy(reading, pieces) as stats, parameters_put_back(self.module(), changes):
            yield stats

    def write_weights(self, reading: Reading, pieces: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the trained weights with ``pieces`` (this rank's pieces, already checked against the
        reading): the fp32 weights the optimizer holds, and any other copy the forward computes with.
        Call it on every rank (collective where the engine keeps full copies to rebuild)."""
        with torch.no_grad():
            for name, target in reading.shards.items():
                if target.numel():
                    target.copy_(pieces[name].reshape(target.shape))

    def joins_slices(self, reading: Reading) -> bool:
        """Whether :func:`functional_ema.gather_full` joins this rank's tensor-parallel slices by default: where the
        parameters report the global shape (DTensors), so the result has the shape they report. Engines whose
        model-parallel parameters are plain per-rank tensors (DeepSpeed TP, pipeline stages) keep parts."""
        return False

    def join_slices(
        self, reading: Reading, part: dict[str, torch.Tensor], device: torch.device | str | None
    ) -> dict[str, torch.Tensor]:
        """``part`` (this rank's part, whole over its data-parallel group) with its tensor-parallel slices joined
        along each parameter's split; a collective over the tensor-parallel group (see :meth:`joins_slices`)."""
        return part

    def refuse_empty_reading(self) -> None:
        """Called by :func:`functional_ema.local_shards` when the reading holds no parameter: refuse where that
        cannot be legitimate. Here nothing: a rank of a sharded or pipelined engine may hold no piece (a frozen
        pipeline stage, a ZeRO-3 rank with nothing)."""

    def optimizer_steps(self) -> int | None:
        """The optimizer steps the engine counts itself (DeepSpeed's ``global_steps``), or ``None`` when it
        keeps no such counter (a framework integration then counts them)."""
        return None

    @contextlib.contextmanager
    def refuse_training(self, why: str) -> Iterator[None]:
        """While EMA weights are swapped in: refuse the engine's own training verbs (raising
        ``SwappedTrainingError`` with ``why``). The hooks every engine shares (backward through a
        swapped forward, ``torch.optim`` steps) are set by :func:`functional_ema.swapped` itself."""
        yield


def is_read(name: str, param: torch.Tensor, previous: Reading | None, keep: frozenset[str] = frozenset()) -> bool:
    """Whether a parameter belongs in a reading: trainable now, in the reading this one replaces, or kept
    (``Adapter.read(keep=...)``: an EMA resumed with it).

    So a parameter frozen after the model was first read keeps its place (its EMA goes on averaging
    its now-constant value, as DeepSpeed's fp32 master copy, fixed at engine init, does), also when
    the reading is re-made for another reason; one frozen from the start is left out.
    """
    return param.requires_grad or name in keep or (previous is not None and name in previous.params)


def unmoved(tensors: Iterable[torch.Tensor], views: Iterable[torch.Tensor]) -> bool:
    """Whether each tensor still has the storage, offset, sizes and strides of its view taken at a reading
    (``t.detach()``): one ``Tensor.is_set_to`` C call each, which compares the storage's address without reading it.
    Sees memory moved (``.to(...)``, ``p.data = new``) and memory re-shaped or re-strided in place (``p.data =
    p.data[:k]``, a square ``p.data.t()``), which a data pointer alone does not."""
    return all(map(torch.Tensor.is_set_to, tensors, views))


try:  # one C loop over the tensors, stopping at the first that requires grad
    any_requires_grad = torch._C._any_requires_grad
except AttributeError:  # pragma: no cover - older torch

    def any_requires_grad(*tensors: torch.Tensor) -> bool:
        return any(t.requires_grad for t in tensors)


def training_group(layout: ShardLayout, group: Any) -> Any:
    """The ranks that train one model together, for ``update(nonfinite=...)``'s joint decision: the
    data-parallel group of a whole model; every rank of the job under model parallelism or HSDP
    (``dist.group.WORLD``); ``None`` on one rank."""
    if not dist.is_initialized() or layout.job_ranks <= 1:
        return None
    if layout.part.whole and layout.replicas == 1:
        return group
    return dist.group.WORLD


# reason: each low-precision warning once per process (the warnings module's own "once" is per call site and is
# reset by every warnings.simplefilter / catch_warnings, so a training loop would see it again and again)
_WARNED: set[tuple[str, str]] = set()  # reason: each low-precision warning once per process (above)


def warn_low_precision(source: str, named: Mapping[str, torch.Tensor], fix: str) -> None:
    """Warn once per process (per ``source`` and dtype) that the pieces read are 16-bit with no fp32 master behind
    them: the EMA then averages rounded copies, and an update smaller than the dtype's resolution is lost.

    Args:
        source: what was read (e.g. ``"a plain module"``, ``"FSDP2 shards"``), part of the once-key.
        named: ``{name: piece}``; floating pieces narrower than 32 bits are the ones warned about.
        fix: what to do instead, appended to the message.
    """
    low = [(n, t.dtype) for n, t in named.items() if t.is_floating_point() and t.element_size() < 4]
    if not low:
        return
    dtypes = sorted({str(d) for _, d in low})
    key = (source, ",".join(dtypes))
    if key in _WARNED:
        return
    _WARNED.add(key)
    from .._errors import LowPrecisionWeightsWarning
    from .._tree import short_list

    warnings.warn(
        f"functional_ema: the weights read from {source} are {'/'.join(dtypes)} with no fp32 master behind them "
        f"({len(low)} parameters: {short_list([n for n, _ in low], 4)}): the EMA averages these rounded copies, so "
        f"decay-sized steps below the dtype's resolution are lost. {fix}. (Issued once per process; category "
        "functional_ema.LowPrecisionWeightsWarning.)",
        LowPrecisionWeightsWarning,
        stacklevel=caller_level(),
    )


def caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside functional_ema (the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def world_of(group: Any) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def exchange_specs(layout: ShardLayout, group: Any) -> list[dict[str, ShardSpec]]:
    """Every rank's specs (a collective over ``group``); just this rank's without a group."""
    if layout.world_size == 1 or (group is None and not dist.is_initialized()):
        return [layout.specs]
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, [(n, s.offset, s.numel) for n, s in layout.specs.items()], group=group)
    result = []
    for r, entries in enumerate(gathered):
        specs = {n: ShardSpec(layout.specs[n].shape, off, numel) for n, off, numel in entries if n in layout.specs}
        if list(specs) != list(layout.specs) or len(entries) != len(layout.specs):
            raise RuntimeError(f"rank {r} reports different parameter names than rank {layout.rank}")
        result.append(specs)
    return result


@contextlib.contextmanager
def swap_by_copy(
    reading: Reading,
    pieces: Mapping[str, torch.Tensor],
    current: Callable[[], Mapping[str, torch.Tensor]] | None = None,
) -> Iterator[SwapStats]:
    """Copy ``pieces`` into the parameters' storage, keep the live values aside, copy them back.

    In place, so every alias of the parameters (the optimizer's references, hooks, DDP's buckets)
    sees the swapped values, and the live values come back bitwise. Extra memory: one copy of this
    rank's pieces.

    Every live value is kept aside before any EMA is written: parameters tied through memory (two ``Parameter``
    objects over one storage, ``dec.weight.data = enc.weight.data``) would otherwise keep the first one's EMA as the
    second one's "live" value. Where pieces overlap in memory, each must then hold its own EMA: if the EMAs differ
    on the overlap, ``ValueError`` names both before the block runs, the live values back.

    Args:
        reading: the reading the pieces fit.
        pieces: ``{name: EMA piece}``.
        current: on exit, returns ``{name: this rank's piece}`` of the parameters the model holds *then*, which
            the live values are copied into by name (an engine whose parameters the block may have re-made
            passes it); ``None``: back into the views of ``reading``.
    """
    saved: dict[str, torch.Tensor] = {}
    extra = 0
    targets = [(name, t) for name, t in reading.shards.items() if t.numel()]
    names = [name for name, _ in targets]
    if reading._overlaps is None:
        reading._overlaps = overlapping(targets)
    versions = entry_versions(targets)  # before any copy: views of one tensor share one counter
    found: dict[str, Any] = {}  # what the exit found (see finish: a call an exception cut short is made again)
    exact: dict[str, torch.Tensor] = {}  # the tensors the live values went back into, by name

    def prepare(_: object) -> None:
        # Only counters nothing else moved inside the block: an in-place edit through a tensor sharing one (a frozen
        # or unselected view of the same buffer) must stay visible to autograd, as without the version handling.
        # Read once, before any copy back moves them.
        if "untouched" not in found:
            found["untouched"] = {n for n, (t, v) in versions.items() if t._version == v + _INSIDE}
        found["back"] = reading.shards if current is None else current()

    def copy_back(name: str) -> None:
        live = saved.get(name)  # none where an exception cut the entry short before this one was kept aside
        target = found.get("back", reading.shards).get(name)
        if live is not None and target is not None:
            target.copy_(live.reshape(target.shape))  # views of the weights, no autograd: no no_grad (above)
            exact[name] = target

    def versions_back(_: object) -> None:
        # Bitwise the entry values again: so are autograd's versions, or the backward of a forward made before the
        # block would refuse the tensors it saved (docs/core.md: training continues as if the block never ran).
        untouched = found.get("untouched", ())
        set_versions([versions[n] for n, t in exact.items() if n in untouched and _same_tensor(t, versions[n][0])], 0)

    # Every live value back, also when an exception (Ctrl-C) lands in the middle of it, then that one raised; made
    # before the block, so that the finally calls nothing before its try.
    steps = ((prepare, _ONCE), (copy_back, names), (versions_back, _ONCE))
    try:
        # Views of the weights that record no autograd history, so no no_grad: an exception (Ctrl-C) landing in its
        # __enter__ or __exit__ would leave gradients off for the rest of the training.
        for name, target in targets:  # all kept aside first: restored in any order, the bits are the live ones
            saved[name] = target.clone()
            extra += target.numel() * target.element_size()
        for name, target in targets:
            target.copy_(pieces[name].reshape(target.shape))
        set_versions(versions.values(), _INSIDE)
        _refuse_disagreeing(reading, pieces, reading._overlaps)
        yield SwapStats(len(saved), extra)
    finally:
        try:
            finish(*steps)
        except BaseException:  # one that landed before finish began: every step again, then raised
            finish(*steps)
            raise


_Key = TypeVar("_Key")

#: The items of a phase of ``finish`` made once.
_ONCE = (None,)


#: Added to each parameter's version inside a ``swapped`` block (hidden from the user on exit): a tensor autograd
#: saved inside the block (a grad-enabled loss built there) keeps a version far above the restored one, so the
#: backward of it after the block is still refused, even after a few in-place steps had moved the version on.
_INSIDE = 1 << 20

_set_version_counter: Callable[[tuple[torch.Tensor, ...], tuple[int, ...]], None] | None
try:  # torch's setter behind torch.autograd.graph._unsafe_preserve_version_counter (tuples of tensors, versions)
    _set_version_counter = torch._C._autograd._unsafe_set_version_counter
except AttributeError:  # pragma: no cover - a torch without it: versions move, as they did before
    _set_version_counter = None


def entry_versions(targets: Iterable[tuple[_Key, torch.Tensor]]) -> dict[_Key, tuple[torch.Tensor, int]]:
    """Each tensor's autograd version counter, by name (inference tensors, which have none, left out)."""
    if _set_version_counter is None:  # pragma: no cover - older torch
        return {}
    return {name: (t, t._version) for name, t in targets if not t.is_inference()}


def _same_tensor(now: torch.Tensor, entry: torch.Tensor) -> bool:
    """Whether the live values went back into the tensor a version was read from (an engine that re-reads the model
    on exit gives a new view of the same memory; memory the block replaced keeps the versions it has)."""
    return now is entry or now.is_set_to(entry)


def set_versions(entries: Iterable[tuple[torch.Tensor, int]], offset: int) -> None:
    """Set each tensor's version counter (shared with the parameter it views) to its version plus ``offset``: one C
    call. Only for tensors whose values are bitwise those the version was read with (``offset=0``), or inside the
    block (``_INSIDE``)."""
    pairs = list(entries)
    if pairs and _set_version_counter is not None:
        _set_version_counter(tuple(t for t, _ in pairs), tuple(v + offset for _, v in pairs))


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[first byte, one past the last byte)`` that a strided, non-empty tensor's elements lie in."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def overlapping(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[str]]:
    """The names whose tensors' memory spans meet, in clusters (each of two or more names, in address order): two
    tensors of different clusters share no memory. One sort; meta and sparse tensors (no memory to share) and empty
    ones are left out."""
    spans = sorted(
        (*memory_span(t), str(t.device), name)
        for name, t in named
        if t.layout is torch.strided and t.numel() and t.device.type != "meta"
    )
    clusters: list[list[str]] = []
    widest: dict[str, tuple[int, list[str]]] = {}  # per device: the greatest end so far, and its cluster
    for start, end, device, name in spans:
        seen = widest.get(device)
        if seen is not None and seen[0] > start:
            seen[1].append(name)
            widest[device] = (max(end, seen[0]), seen[1])
        else:
            widest[device] = (end, [name])
            clusters.append(widest[device][1])
    return [c for c in clusters if len(c) > 1]


def meeting(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans meet (a strided, non-empty tensor each)."""
    (a0, a1), (b0, b1) = memory_span(a), memory_span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def _refuse_disagreeing(reading: Reading, pieces: Mapping[str, torch.Tensor], clusters: list[list[str]]) -> None:
    """``ValueError`` naming two parameters that share memory where their EMAs differ (each piece written: one that no
    longer holds its own EMA was overwritten by another's). Nothing to do without overlaps."""
    for names in clusters:
        for name in names:
            t = reading.shards[name]
            if same_bits(t, pieces[name].reshape(t.shape).to(t)):
                continue
            other = next(n for n in names if n != name and meeting(t, reading.shards[n]))
            raise ValueError(
                f"fe.swapped: parameters {name!r} and {other!r} share memory (tied through .data or views of one "
                "tensor, not as one Parameter object) but their EMAs differ where they overlap, so no weight can "
                "hold both; nothing was swapped (the live values are back). Tie them as one Parameter "
                "(model.dec.weight = model.enc.weight) before init_ema, so one EMA averages both, or evaluate "
                "with fe.gather_full(state, model) and torch.func.functional_call"
            )


#: The integer dtypes whose views compare a tensor's bits, by element size (a tuple: no module-level table).
_BITS = (torch.uint8, torch.int16, None, torch.int32, None, None, None, torch.int64)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold identical bits: ``torch.equal`` calls a NaN unequal to itself
    (two tied weights whose EMAs both hold it would look different), and ``-0.0`` equal to ``0.0``."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    size = a.element_size()
    bits = _BITS[size - 1] if 1 <= size <= len(_BITS) else None
    if bits is None or a.dtype is torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(bits), b.view(bits))


def _form(p: torch.Tensor) -> tuple:
    """What ``swapped`` compares to see a parameter re-typed, moved or re-made in place: dtype, device, shape, where
    its values are (``.to(dtype)`` gives the same object new memory) and its strides (``p.data = p.data.t()`` of a
    square weight keeps the rest, and would read the restored values transposed)."""
    return (p.dtype, p.device, tuple(p.shape), p.data_ptr(), p.stride() if p.layout is torch.strided else ())


def placeholder_form(p: torch.Tensor) -> tuple:
    """The form of a parameter whose memory comes and goes by design (a ZeRO-3 placeholder, gathered and released)."""
    return (p.dtype, p.device)


@contextlib.contextmanager
def parameters_put_back(
    module: torch.nn.Module,
    changes: list[str],
    *,
    form: Callable[[torch.Tensor], tuple] = _form,
    skip: Callable[[torch.nn.Module, str], bool] | None = None,
) -> Iterator[None]:
    """On exit, every submodule, parameter and buffer registration of ``module`` is the object it was on entry, the
    tensors with the memory (``.data``: dtype, device, storage, shape and strides) they had then; what the block
    changed is appended to ``changes`` as it is put back (parametrizations and submodules first, so their own
    registrations are then checked too).

    So a ``model.to(dtype)``, ``load_state_dict(..., assign=True)``, a new ``nn.Parameter`` or a replaced submodule
    (``model[2] = copy.deepcopy(model[2])``) inside a :func:`functional_ema.swapped` block cannot leave the model
    with EMA weights, nor detach the parameters the optimizer holds: the enclosing swap then restores the trained
    values into that memory. Buffers are put back the same way (``model.to(dtype)`` re-types them too), though
    values written into them in place (BatchNorm statistics of a forward in training mode) stay. ``skip(module,
    attr)`` leaves a parameter registration to the engine (FSDP2's managed parameters, which FSDP2 itself
    re-registers; ``buffers.swapped_buffers`` skips every parameter). Each module's submodule registry (its current
    ``_modules``: ``del seq[2]`` makes Sequential a new one) gets exactly its entry items back, in their order, so
    submodules the block added, removed, moved or replaced are put back as they were; each module's parameter registry
    its entry names in order (ones the block added removed, unless ``skip``), a ``ParameterDict``'s keys and a
    ``ParameterList``'s length with them; a parametrization the block
    registered (``weight_norm``, ``register_parametrization``) on a tensor that had none is removed first, its
    tensor then put back as any other. Cost: one pass over the modules on entry, one over what it recorded on exit.
    """
    parents: list[tuple[torch.nn.Module, str, list[tuple[str, Any]], frozenset[str], tuple, type]] = []
    containers: list[tuple[Any, dict[str, Any]] | None] = []  # a ParameterDict's or ParameterList's own bookkeeping
    entry = []
    for prefix, mod in module.named_modules():
        containers.append(_container_state(mod))
        tensors = (tuple(mod._parameters.items()), tuple(mod._buffers.items()))
        parents.append((mod, prefix, list(mod._modules.items()), _parametrized(mod), tensors, type(mod)))
        for buffer, registry in ((False, mod._parameters), (True, mod._buffers)):
            for attr, t in registry.items():
                if t is None or (not buffer and skip is not None and skip(mod, attr)):
                    continue
                shape_of = _form if buffer else form
                name = ("buffer " if buffer else "") + repr(f"{prefix}.{attr}" if prefix else attr)
                entry.append((registry, attr, name, t, t.data, shape_of, shape_of(t)))
    try:
        yield
    finally:
        for mod, prefix, _, before, tensors, cls in parents:
            _parametrizations_back(mod, prefix, before, tensors, cls, changes)
        for mod, prefix, items, *_ in parents:
            _submodules_back(mod, prefix, items, changes)
        moved = [_reordered(mod._parameters, tensors[0]) for mod, _, _, _, tensors, _ in parents]
        _tensors_back(entry, changes)
        for (mod, prefix, _, _, tensors, _), held, reordered in zip(parents, containers, moved):
            _parameters_back(mod, prefix, tensors[0], skip, changes)
            if reordered:
                changes.append(f"parameters of {repr(prefix) if prefix else 'the model'} reordered")
            if held is not None:
                _container_back(mod, prefix, held, changes)


def _parametrized(mod: torch.nn.Module) -> frozenset[str]:
    """The names of ``mod``'s tensors under a parametrization (``torch.nn.utils.parametrize``)."""
    plists = mod._modules.get("parametrizations")
    return frozenset(plists._modules) if isinstance(plists, torch.nn.ModuleDict) else frozenset()


def _parametrizations_back(
    mod: torch.nn.Module, prefix: str, before: frozenset[str], tensors: tuple, cls: type, changes: list[str]
) -> None:
    """Put ``mod``'s parametrizations (``torch.nn.utils.parametrize``) back as on entry, computing nothing: one the
    block registered on a tensor that had none (``weight_norm``) loses the property torch put on the module's class
    and its ``ParametrizationList``, and the entry tensor object is registered again, in its entry place
    (``tensors``: the entry ``_parameters`` and ``_buffers`` items; ``_tensors_back`` then checks its memory); one
    the block removed gets its property back (its ``ParametrizationList`` is put back by ``_submodules_back``, as is
    a parametrization stacked on one from entry). The module's class is its entry one (``cls``) again."""
    now = _parametrized(mod)
    added, removed = now - before, before - now
    if not added and not removed:
        return
    plists: Any = mod._modules.get("parametrizations")  # a ModuleDict of ParametrizationLists
    for tensor in sorted(added):
        name = f"{prefix}.{tensor}" if prefix else tensor
        changes.append(f"parametrization registered on {name!r} ({type(plists[tensor][0]).__name__}) removed")
        delattr(type(mod), tensor)  # the property on the class torch made for this module alone
        del plists[tensor]
    if not before:  # none on entry: no holder of ParametrizationLists either
        del mod._modules["parametrizations"]
    registries: tuple[dict[str, Any], dict[str, Any]] = (mod._parameters, mod._buffers)
    for registry, items in zip(registries, tensors):
        entry = dict(items)
        for tensor in removed:  # what remove_parametrizations registered in its place
            if tensor in registry and tensor not in entry:
                del registry[tensor]
        for attr in added & entry.keys():
            registry.setdefault(attr, entry[attr])
        order = [k for k in entry if k in registry] + [k for k in registry if k not in entry]
        if list(registry) != order:
            kept = [(k, registry[k]) for k in order]
            registry.clear()
            registry.update(kept)
    mod.__class__ = cls
    for tensor in sorted(removed):
        name = f"{prefix}.{tensor}" if prefix else tensor
        changes.append(f"parametrization of {name!r} removed, registered again")
        if not isinstance(cls.__dict__.get(tensor), property):
            from torch.nn.utils import parametrize

            parametrize._inject_property(mod, tensor)  # what register_parametrization sets: torch's own getter


def _submodules_back(mod: torch.nn.Module, prefix: str, items: list[tuple[str, Any]], changes: list[str]) -> None:
    """Give ``mod``'s current submodule registry exactly its entry ``items``, in order, where the block changed it
    (``parameters_put_back``), naming each submodule removed, moved, replaced or added."""
    registry = mod._modules
    now = list(registry.items())
    if len(now) == len(items) and all(k == k0 and v is v0 for (k, v), (k0, v0) in zip(now, items)):
        return

    def name(attr: str) -> str:
        return repr(f"{prefix}.{attr}" if prefix else attr)

    where = {id(v): k for k, v in now if v is not None}
    mine = []
    for attr, child in items:
        held = registry.get(attr)
        if held is child:
            continue
        if child is None:
            mine.append(f"submodule {name(attr)} set where None was registered")
        elif id(child) in where:
            mine.append(f"submodule {name(attr)} moved to {name(where[id(child)])}")
        elif held is None or any(held is v for _, v in items):  # its place taken by another one moved there
            mine.append(f"submodule {name(attr)} removed")
        else:
            mine.append(f"submodule {name(attr)} replaced by another {type(held).__name__}")
    entry_keys = {k for k, _ in items}
    mine += [f"submodule {name(k)} added" for k, _ in now if k not in entry_keys]
    changes.extend(mine or [f"submodules of {repr(prefix) if prefix else 'the model'} reordered"])
    registry.clear()
    registry.update(items)


def _parameters_back(
    mod: torch.nn.Module,
    prefix: str,
    items: tuple[tuple[str, Any], ...],
    skip: Callable[[torch.nn.Module, str], bool] | None,
    changes: list[str],
) -> None:
    """Give ``mod``'s parameter registry its entry keys in their order (``_tensors_back`` has put each entry object
    back, at the end where it was removed), naming and removing each parameter the block added: one left registered
    is read by the next ``update`` and fails it, as the EMA state has none. Ones ``skip`` leaves to the engine stay."""
    registry = mod._parameters
    if list(registry) == [k for k, _ in items] and all(registry[k] is None for k, t in items if t is None):
        return
    entry = dict(items)
    for attr in [k for k in registry if k not in entry and not (skip is not None and skip(mod, k))]:
        changes.append(f"parameter {_dotted(prefix, attr)} added, removed")
        del registry[attr]
    for attr, t in items:  # a None registration the block removed or set (the others are back already)
        if t is None and registry.get(attr, 0) is not None and not (skip is not None and skip(mod, attr)):
            changes.append(f"parameter {_dotted(prefix, attr)} set where None was registered")
            registry[attr] = None
    kept = [(k, registry[k]) for k in entry if k in registry] + [(k, v) for k, v in registry.items() if k not in entry]
    registry.clear()
    registry.update(kept)


def _reordered(registry: dict[str, Any], items: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the block re-registered entry keys in another order, none missing (a removed one is named when put
    back, which also moves it: ``pd["a"] = pd.pop("a")`` removes nothing and reorders ``pd``)."""
    keys = [k for k, _ in items]
    entry = set(keys)
    return entry.issubset(registry) and [k for k in registry if k in entry] != keys


def _dotted(prefix: str, attr: str) -> str:
    """``attr``'s quoted name in the model (``prefix`` its module's)."""
    return repr(f"{prefix}.{attr}" if prefix else attr)


def _container_attrs(mod: torch.nn.Module) -> list[str] | None:
    """The attributes a ``ParameterDict`` or ``ParameterList`` holds its entries in, in order; ``None`` for others."""
    if isinstance(mod, torch.nn.ParameterDict):
        return [mod._key_to_attr(k) for k in mod._keys]
    if isinstance(mod, torch.nn.ParameterList):
        return [str(i) for i in range(mod._size)]
    return None


def _container_state(mod: torch.nn.Module) -> tuple[Any, dict[str, Any]] | None:
    """A ``ParameterDict``'s keys or a ``ParameterList``'s length (their own bookkeeping beside the parameter
    registry), and the entries that are not parameters (plain attributes); ``None`` for other modules."""
    attrs = _container_attrs(mod)
    if attrs is None:
        return None
    keys = dict(mod._keys) if isinstance(mod, torch.nn.ParameterDict) else mod._size
    return keys, {a: mod.__dict__[a] for a in attrs if a in mod.__dict__}


def _container_back(mod: torch.nn.Module, prefix: str, held: tuple[Any, dict[str, Any]], changes: list[str]) -> None:
    """Put a ``ParameterDict``'s keys or a ``ParameterList``'s length back as on entry (``_container_state``), with
    its plain entries, naming those the block added, removed or replaced; its parameters are back already
    (``_parameters_back``), so ``keys()``, ``len()`` and iteration agree with them again."""
    keys, plain = held
    for attr in _container_attrs(mod) or []:
        value = mod.__dict__.get(attr, plain.get(attr))
        shadowing = attr in mod._parameters and attr in mod.__dict__  # a plain value set where a parameter was
        if shadowing or (attr not in mod._parameters and value is not plain.get(attr)):
            changes.append(f"entry {_dotted(prefix, attr)} added, removed")
            mod.__dict__.pop(attr, None)
    for attr, value in plain.items():
        if mod.__dict__.get(attr) is not value:
            changes.append(f"entry {_dotted(prefix, attr)} removed or replaced, put back")
            mod.__dict__[attr] = value
    if isinstance(mod, torch.nn.ParameterDict):
        mod._keys = dict(keys)
    else:
        mod._size = keys


def _tensors_back(entry: list[tuple], changes: list[str]) -> None:
    """Register each recorded parameter or buffer again, with the memory it had (``parameters_put_back``)."""
    # No no_grad (none is needed to register a tensor or set its .data): an exception (Ctrl-C) landing in its
    # __enter__ or __exit__ would leave gradients off for the rest of the training.
    for registry, attr, name, t, data, shape_of, seen in entry:
        now = registry.get(attr)
        if now is not t:
            what = "removed" if now is None else f"replaced by another {type(now).__name__}"
            if now is not None:
                what += f" ({_describe(seen)} -> {_describe(_form(now))})"
            changes.append(f"{name} {what}")
            registry[attr] = t
        now_form = shape_of(t)
        if now_form != seen:
            what = f"({_describe(seen, now_form)} -> {_describe(now_form, seen)})"
            changes.append(f"{name} re-typed, moved or re-strided {what}")
            t.data = data


def _describe(form: tuple, other: tuple | None = None) -> str:
    """dtype, device and shape of a form; its strides too when those are what differs from ``other``'s."""
    shown = [str(x) for x in form[:3]]
    if other is not None and len(form) > 4 and form[:3] == other[:3] and form[4] != other[4]:
        shown.append(f"strides {tuple(form[4])}")
    return " ".join(shown)


def gather_pieces(
    reading: Reading,
    pieces: Mapping[str, torch.Tensor],
    *,
    dst: int | None = None,
    device: torch.device | str | None = None,
    bucket_bytes: int = 256 << 20,
) -> dict[str, torch.Tensor]:
    """:func:`functional_ema.gather_full` over plain data: a reading's layout and group, and checked pieces
    (a collective over the reading's group)."""
    layout = reading.layout
    names = list(layout.specs)
    if not names:
        return {}
    if layout.stage == 0 or layout.world_size == 1:  # every rank holds everything
        if dst is not None and layout.rank != dst:
            return {}
        return {
            n: pieces[n].detach().reshape(layout.specs[n].shape).to(device or pieces[n].device, copy=True)
            for n in names
        }
    group = reading.group
    all_specs = reading.all_specs()
    out: dict[str, torch.Tensor] = {}
    ref = pieces[names[0]]
    dtype, src_device = ref.dtype, ref.device
    device = torch.device(device) if device is not None else src_device
    # The collective runs on the backend's device: gloo takes CPU tensors, nccl CUDA ones.
    comm_device = src_device
    dst_global = dist.get_global_rank(group, dst) if dst is not None and group is not None else dst  # gather's dst
    for bucket in _buckets(names, all_specs, max(1, bucket_bytes // ref.element_size())):
        sizes = [sum(all_specs[r][n].numel for n in bucket) for r in range(layout.world_size)]
        width = max(sizes)
        send = torch.zeros(width, dtype=dtype, device=comm_device)
        torch.cat(
            [pieces[n].detach().reshape(-1).to(comm_device) for n in bucket] or [send[:0]],
            out=send[: sizes[layout.rank]],
        )
        if dst is not None and layout.rank != dst:  # a sender only: no receive buffers off the destination
            dist.gather(send, None, dst=dst_global, group=group)
            continue
        recv = [torch.empty(width, dtype=dtype, device=comm_device) for _ in range(layout.world_size)]
        if dst is None:
            dist.all_gather(recv, send, group=group)
        else:
            dist.gather(send, recv, dst=dst_global, group=group)
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


def _buckets(names: list[str], all_specs: list[dict[str, ShardSpec]], max_elems: int) -> Iterator[list[str]]:
    """``names`` cut into consecutive buckets of at most ``max_elems`` elements on the widest rank (one name alone
    may exceed it)."""
    bucket: list[str] = []
    size = 0
    for n in names:
        n_el = max(specs[n].numel for specs in all_specs)
        if bucket and size + n_el > max_elems:
            yield bucket
            bucket, size = [], 0
        bucket.append(n)
        size += n_el
    if bucket:
        yield bucket


def join_parts(
    reading: Reading, part: dict[str, torch.Tensor], *, dst: int | None = None, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's tensors from every model-parallel part's (``part``: this rank's part, whole, as
    :func:`gather_pieces` returns it on every rank of its data-parallel group). A collective over every
    rank of the job: one rank per part (data-parallel rank 0 of replica 0) sends its part; on ``dst``
    (a rank of the job; ``None``: every rank) the pipeline stages' parameters are merged by name and the
    tensor-parallel slices concatenated along each parameter's recorded split (``tp_dims``), in
    tensor-parallel rank order; a parameter replicated over tensor parallelism is taken from rank 0's.

    A name held by several stages (a ``TiedLayerSpec`` layer) is taken from the first stage holding it when
    every stage's value is bitwise equal (the tied weight).

    Raises ``ValueError`` (on every rank, before anything is sent) when the engine records no split
    for a tensor-parallel model; ``StateMismatchError`` (on every rank alike: ``dst`` tells the others) when
    stages hold one name with different values (an attribute the tie leaves out, naming it and the fix).
    """
    layout = reading.layout
    if layout.part.whole:
        return part if dst is None or not dist.is_initialized() or dist.get_rank() == dst else {}
    if layout.part.tp_size > 1 and (layout.tp_dims is None or any(n not in layout.tp_dims for n in part)):
        raise ValueError(
            f"gather_full(join_parts=True): {layout.part.describe()} records no tensor-parallel split for its parameters "
            "(no AutoTP layout record, no Megatron 'partition_dim'): the slices cannot be joined; gather each part "
            "(join_parts=False) or consolidate the saved checkpoint with tp_dims="
        )
    sender = layout.rank == 0 and layout.replica == 0
    payload = (
        (layout.part.tp, layout.part.pp, dict(layout.tp_dims or {}), {n: t.detach().cpu() for n, t in part.items()})
        if sender
        else None
    )
    world, me = dist.get_world_size(), dist.get_rank()
    gathered: list[Any] = [None] * world
    if dst is None:
        dist.all_gather_object(gathered, payload)
    else:
        dist.gather_object(payload, gathered if me == dst else None, dst=dst)
    stages = _stage_parts(gathered) if dst is None or me == dst else {}
    problem = _untied(stages)
    if dst is not None and layout.part.pp_size > 1:  # only dst has seen the parts: every rank raises as it does
        said = [problem]
        dist.broadcast_object_list(said, src=dst)
        problem = said[0]
    if problem is not None:
        from .._errors import StateMismatchError

        raise StateMismatchError(problem)
    out: dict[str, torch.Tensor] = {}
    for tensors in stages.values():
        for name, t in tensors.items():
            if name not in out:  # a name of several stages: equal on each (_untied), taken from the first
                out[name] = t.to(device if device is not None else t.device)
    return out


def _stage_parts(gathered: list[Any]) -> dict[int, dict[str, torch.Tensor]]:
    """Each pipeline stage's tensors, in stage order, from the parts ``join_parts`` gathered: the tensor-parallel
    slices joined along each parameter's recorded split (a replicated one taken from tensor-parallel rank 0)."""
    by_stage: dict[int, dict[int, tuple[dict, dict]]] = {}
    for entry in gathered:
        if entry is not None:
            tp, pp, dims, tensors = entry
            by_stage.setdefault(pp, {})[tp] = (dims, tensors)
    stages: dict[int, dict[str, torch.Tensor]] = {}
    for pp in sorted(by_stage):
        slices = [by_stage[pp][tp] for tp in sorted(by_stage[pp])]
        dims, first = slices[0]
        stages[pp] = {}
        for name, t in first.items():
            d = dims.get(name)
            stages[pp][name] = t if d is None or len(slices) == 1 else torch.cat([s[1][name] for s in slices], dim=d)
    return stages


def _untied(stages: dict[int, dict[str, torch.Tensor]]) -> str | None:
    """The refusal of names held by several stages with different values (``None`` when there is none): a
    ``TiedLayerSpec`` layer's tied weight is equal on each (DeepSpeed keeps it in sync), its other attributes not."""
    held: dict[str, list[int]] = {}
    for pp, tensors in stages.items():
        for name in tensors:
            held.setdefault(name, []).append(pp)
    differ = {
        name: pps
        for name, pps in held.items()
        if len(pps) > 1 and not all(_same(stages[pps[0]][name], stages[pp][name]) for pp in pps[1:])
    }
    if not differ:
        return None
    from .._checkpoint.reader import untied_copies

    return untied_copies("gather_full(join_parts=True)", differ)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
