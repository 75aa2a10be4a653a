"""``Shards``: a read-only, name-keyed tree of tensors that carries its own fused layout.

Sharded training keeps a rank's weights in a few contiguous buffers (DeepSpeed's flat ZeRO
partitions) or one tensor per parameter (FSDP2, plain modules). A ``Shards`` records that layout
where the user holds it: its ``segments`` are those buffers (or spans of them), and its
``index`` (plain data, no tensors) says where each named tensor sits in them. :func:`init_ema`
mirrors the segments, so the EMA of a ``Shards`` is a ``Shards`` with the *same* index, and
:func:`update` runs one ``lerp_`` per segment after a single identity check of the two indexes,
whatever the number of tensors. Nothing is cached anywhere else.

A ``Shards`` cannot be edited: item assignment raises, and every ``shards[name]`` is a fresh view
of the segment memory, so writing *into* a view writes the segment (honoured by the next update),
and there is no stored tensor object whose ``.data`` could be rebound behind the segments' back.

This module is a leaf: it imports nothing from the package.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optree
import optree.registry
import torch
import torch.utils._pytree

from . import _memory

__all__ = ["SegmentIndex", "Shards", "clone_tree", "other_whole_shape", "selection_note", "shards_from_views"]

# Two views of one source buffer stay in one segment while the gap between them is at most this
# many elements (ZeRO-3 pads each partition to ceil(numel / world_size); ZeRO-1/2 align groups).
# The EMA mirrors the gap, so this bounds the EMA memory spent on one gap.
MAX_GAP = 4096


class SegmentIndex:
    """Where each named tensor sits in a tuple of segments. Immutable plain data.

    Attributes:
        names: tensor names, in the order the engine lists its parameters.
        shapes: ``shapes[i]`` is the shape of tensor ``names[i]``.
        places: ``places[i] = (segment, offset, numel)``: tensor ``i`` is
            ``segments[segment].reshape(-1)[offset : offset + numel].view(shapes[i])``.
        segment_shapes: shape of each segment (1-D spans of flat buffers, or whole tensors).
    """

    __slots__ = ("names", "shapes", "places", "segment_shapes", "_position", "_hash")

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        places: Sequence[tuple[int, int, int]],
        segment_shapes: Sequence[Sequence[int]],
    ) -> None:
        self.names: tuple[str, ...] = tuple(names)
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in shapes)
        self.places: tuple[tuple[int, int, int], ...] = tuple((int(j), int(o), int(n)) for j, o, n in places)
        self.segment_shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in segment_shapes)
        self._position = {n: i for i, n in enumerate(self.names)}
        if len(self._position) != len(self.names):
            raise ValueError("duplicate tensor names in a SegmentIndex")
        self._hash = hash((self.names, self.shapes, self.places, self.segment_shapes))

    def _key(self) -> tuple:
        return (self.names, self.shapes, self.places, self.segment_shapes)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, SegmentIndex) and self._hash == other._hash and self._key() == other._key()

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"SegmentIndex({len(self.names)} tensors in {len(self.segment_shapes)} segments)"


class Shards(Mapping):
    """A read-only ``{name: tensor}`` over a few segments; see the module docstring.

    ``local_shards(engine)`` returns one (views of the engine's fp32 masters), and so does
    ``init_ema`` for each EMA of a ``Shards``. It is an optree node whose children are its tensors
    in sorted name order (like a dict); mapping a function over it gives a plain ``dict``.

    Attributes:
        segments: the tensors that hold the values (views of the engine's buffers, or EMA buffers).
        index: the :class:`SegmentIndex` that places each name in ``segments``.
        group: for the ``Shards`` that ``local_shards`` returns, the process group of the ranks that
            train the same model together (``None`` on one process, and for EMA buffers): where
            ``update(..., nonfinite=...)`` makes its decision together.
        selection: the include/exclude selection (``local_shards(x, include=..., exclude=...)``) these
            tensors were chosen by, ``None`` for all of them; ``init_ema`` (``mirror``) and ``clone`` carry
            it into the EMA, so the verbs that take a state (``save``, ``swapped``, ...) read the same names.
        swapped_in: for the ``Shards`` that ``local_shards`` returns, the model's count of open
            :func:`functional_ema.swapped` blocks (one counter shared by every reading of the model, so also
            readings made inside a block); ``update`` refuses these tensors while it is not zero. ``None`` for others.
        full_shapes: for the ``Shards`` that ``local_shards`` returns, the whole shape of each parameter (as the
            engine's layout records it), in ``index.names`` order; ``init_ema`` and ``clone`` carry it into the EMA.
            ``update`` refuses an EMA whose parameters had other shapes, although its pieces on this rank may have
            the same lengths (a (4, 6) weight's and a (6, 4) one's). ``None`` where unknown (``from_views``).
    """

    __slots__ = ("segments", "index", "_memo", "group", "selection", "swapped_in", "full_shapes", "__weakref__")
    segments: tuple[torch.Tensor, ...]
    index: SegmentIndex
    _memo: Any  # the last update's lerp program (see _core), or None
    group: Any  # the training group's process group (torch.distributed.ProcessGroup), or None
    selection: Any  # the include/exclude it was read with (functional_ema._selection.Selection), or None
    swapped_in: Any  # the model's open swapped() blocks (functional_ema.engines._base.OpenSwaps), or None
    full_shapes: tuple[tuple[int, ...], ...] | None  # each parameter's whole shape, in index.names order, or None

    def __init__(self, segments: Sequence[torch.Tensor], index: SegmentIndex) -> None:
        if len(segments) != len(index.segment_shapes):
            raise ValueError(f"{len(segments)} segments for an index of {len(index.segment_shapes)}")
        for j, (seg, shape) in enumerate(zip(segments, index.segment_shapes)):
            if tuple(seg.shape) != shape:
                raise ValueError(f"segment {j} has shape {tuple(seg.shape)}, the index says {shape}")
        object.__setattr__(self, "segments", tuple(segments))
        object.__setattr__(self, "index", index)
        # The lerp program of the last update that read this EMA (see _core): a pure function of
        # immutable inputs (these segments and the other side's), so it is kept with them.
        object.__setattr__(self, "_memo", None)
        # The process group whose ranks hold the other pieces of the same weights, when read from a
        # training object (set once by its reading); update(nonfinite=...) decides over it.
        object.__setattr__(self, "group", None)
        # The selection the tensors were chosen by (set once by the reading that chose them; see _selection).
        object.__setattr__(self, "selection", None)
        # The counter of fe.swapped blocks open on the model these tensors were read from (set by its reading).
        object.__setattr__(self, "swapped_in", None)
        # The parameters' whole shapes (set by the reading; the index holds this rank's pieces only).
        object.__setattr__(self, "full_shapes", None)

    @classmethod
    def from_views(cls, named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]) -> Shards:
        """A ``Shards`` over existing tensors, e.g. views of one flat buffer (no copy).

        Views that are contiguous pieces of one storage, close together, become one segment
        (see :func:`shards_from_views`); others are segments by themselves.

        Example:
            >>> import torch, functional_ema as fe
            >>> buf = torch.zeros(10)
            >>> s = fe.Shards.from_views({"a": buf[:4], "b": buf[5:10]})
            >>> len(s.segments), s["b"].shape
            (1, torch.Size([5]))
        """
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        return shards_from_views(items)

    # -- Mapping
    def __getitem__(self, name: str) -> torch.Tensor:
        index = self.index
        try:
            i = index._position[name]
        except KeyError:
            raise KeyError(name) from None
        j, offset, numel = index.places[i]
        seg = self.segments[j]
        shape = index.shapes[i]
        if offset == 0 and numel == seg.numel() and tuple(seg.shape) == shape:
            return seg.view(shape)  # a new view object over the same memory
        return seg.view(-1).narrow(0, offset, numel).view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index.names)

    def __len__(self) -> int:
        return len(self.index.names)

    def __contains__(self, name: object) -> bool:
        return name in self.index._position

    # -- read-only, and identity semantics (comparing tensors elementwise has no truth value)
    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_memo", "group", "selection", "swapped_in", "full_shapes"):
            object.__setattr__(self, name, value)
            return
        raise AttributeError("Shards is read-only")

    def __setitem__(self, name: str, value: object) -> None:
        raise TypeError(
            f"Shards is read-only (tried to set {name!r}). Its tensors are views of fused segments, so a replaced "
            "tensor would be ignored by the fused update. Write into the tensor (shards[name].copy_(x)), or build a "
            "new tree (dict(shards) gives a plain dict, which update handles per tensor)."
        )

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"Shards is read-only (tried to delete {name!r}); dict(shards) gives an editable copy")

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        kinds = sorted({f"{s.dtype}@{s.device}" for s in self.segments})
        return f"Shards({len(self)} tensors in {len(self.segments)} segments, {', '.join(kinds) or 'empty'})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "Shards holds views of this rank's buffers and is not picklable; save an EMA with functional_ema.save"
        )

    # -- helpers for the package
    def mirror(
        self, dtype: torch.dtype, device: torch.device | str | None = None, pin_memory: bool = False, fill: bool = True
    ) -> Shards:
        """New contiguous segments shaped like these, with the same index (so update stays fused).

        ``fill`` copies the values of every named tensor (gaps between them are zero); otherwise the
        memory is uninitialised, for a caller that overwrites every value.
        """
        gapless = fill and self._gapless()
        segs = []
        for seg in self.segments:
            target = torch.device(device) if device is not None else seg.device
            # Pinning needs a CUDA runtime; without one there is no device-to-host copy to speed up.
            pin = pin_memory and target.type == "cpu" and torch.cuda.is_available()
            new = _memory.empty(seg.shape, dtype=dtype, device=target, pin_memory=pin)
            segs.append(new.zero_() if fill and not gapless else new)
        out = Shards(segs, self.index)
        out.selection = self.selection  # the EMA of a selection is saved and swapped as that selection
        out.full_shapes = self.full_shapes  # so update knows the parameters this EMA was made for
        if fill:
            with torch.no_grad():
                if gapless:
                    for dst, src in zip(segs, self.segments):
                        dst.copy_(src)
                else:  # copy the named tensors only: gaps may hold uninitialised padding
                    for name in self.index.names:
                        out[name].copy_(self[name])
        return out

    def clone(self) -> Shards:
        """Copies of the segments (same dtype, device, pinning), same index."""
        segs = []
        for seg in self.segments:
            new = _memory.empty(seg.shape, dtype=seg.dtype, device=seg.device, pin_memory=seg.is_pinned())
            segs.append(new.copy_(seg))
        out = Shards(segs, self.index)
        out.selection = self.selection
        out.full_shapes = self.full_shapes
        return out

    def _gapless(self) -> bool:
        covered = [0] * len(self.segments)
        for j, _, n in self.index.places:
            if j >= 0:
                covered[j] += n
        return all(c == s.numel() for c, s in zip(covered, self.segments))


def _flatten(s: Shards) -> tuple[list[torch.Tensor], tuple[str, ...], tuple[str, ...]]:
    names = sorted(s.index.names)
    return [s[n] for n in names], tuple(names), tuple(names)


def _unflatten(names: tuple[str, ...], children: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(names, children))


optree.register_pytree_node(
    Shards,
    _flatten,  # type: ignore[arg-type]  # optree's stub types the flatten of a Collection, not of this Mapping
    _unflatten,  # type: ignore[arg-type]  # ... and an unflatten of (metadata, children); ours are (names, tensors)
    path_entry_type=optree.MappingEntry,
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # the global registry: a Shards is a node for every caller
)


def _torch_flatten(s: Shards) -> tuple[list[torch.Tensor], list[str]]:
    children, names, _ = _flatten(s)
    return children, list(names)


def _torch_flatten_with_keys(s: Shards) -> tuple[list[tuple[Any, torch.Tensor]], list[str]]:
    children, names = _torch_flatten(s)
    return [(torch.utils._pytree.MappingKey(n), t) for n, t in zip(names, children)], names


def _torch_unflatten(children: Any, names: list[str]) -> dict[str, Any]:
    return dict(zip(names, children))


# torch's pytree too (torch.utils._pytree.tree_map over a state, torch.compile, torch.export), as optree above:
# a node of its tensors in sorted name order, rebuilt as a dict, so both libraries see the same tree.
torch.utils._pytree.register_pytree_node(
    Shards,
    _torch_flatten,
    _torch_unflatten,
    serialized_type_name="functional_ema.Shards",
    flatten_with_keys_fn=_torch_flatten_with_keys,
)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.untyped_storage().data_ptr())


def shards_from_views(named: Sequence[tuple[str, torch.Tensor]]) -> Shards:
    """Group ``(name, view)`` pairs into segments; the one place that decides the fused layout.

    Views that are contiguous pieces of one storage, close together (gaps of at most
    :data:`MAX_GAP` elements, no overlap), share one 1-D segment spanning them, gaps included.
    Every other view (its own storage, non-contiguous, or empty) is a segment by itself.
    """
    views = [(n, t.detach()) for n, t in named]
    by_storage: dict[tuple, list[int]] = {}
    alone: list[int] = []
    for i, (_, t) in enumerate(views):
        if t.numel() and t.is_contiguous():
            by_storage.setdefault(_storage_key(t), []).append(i)
        else:
            alone.append(i)
    runs: list[list[int]] = []
    for members in by_storage.values():
        members.sort(key=lambda i: views[i][1].storage_offset())
        current: list[int] = []
        end = 0
        for i in members:
            off, n = int(views[i][1].storage_offset()), views[i][1].numel()
            if current and (off < end or off - end > MAX_GAP):  # overlap or a large gap: a new segment
                runs.append(current)
                current = []
            end = off + n if not current else max(end, off + n)
            current.append(i)
        if current:
            runs.append(current)
    segments: list[torch.Tensor] = []
    places: list[tuple[int, int, int]] = [(0, 0, 0)] * len(views)
    for members in runs:
        first = views[members[0]][1]
        if len(members) == 1:
            alone.append(members[0])
            continue
        start = int(first.storage_offset())
        stop = max(views[i][1].storage_offset() + views[i][1].numel() for i in members)
        j = len(segments)
        segments.append(first.as_strided((stop - start,), (1,), start))
        for i in members:
            places[i] = (j, int(views[i][1].storage_offset()) - start, views[i][1].numel())
    for i in sorted(alone):
        t = views[i][1]
        places[i] = (len(segments), 0, t.numel())
        segments.append(t)
    # Segments in the order of their first tensor, so the layout reads like the parameter list.
    first_use: dict[int, int] = {}
    for i, (j, _, _) in enumerate(places):
        first_use.setdefault(j, i)
    order = sorted(range(len(segments)), key=first_use.__getitem__)
    renumber = {old: new for new, old in enumerate(order)}
    index = SegmentIndex(
        [n for n, _ in views],
        [tuple(t.shape) for _, t in views],
        [(renumber[j], o, n) for j, o, n in places],
        [tuple(segments[j].shape) for j in order],
    )
    return Shards([segments[j] for j in order], index)


def clone_tree(tree: Any) -> Any:
    """A copy of an EMA tree; a ``Shards`` keeps its layout, so the copy updates fused too."""
    if isinstance(tree, Shards):
        return tree.clone()
    with torch.no_grad():
        return optree.tree_map(lambda t: t.detach().clone(), tree, none_is_leaf=False)


def segment_count(tree: Any) -> int:
    """Number of segments of a ``Shards`` (for tests and benchmarks), else the number of leaves."""
    if isinstance(tree, Shards):
        return len(tree.segments)
    return len(optree.tree_leaves(tree, none_is_leaf=False))


def other_whole_shape(
    ema: Any, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """The first parameter, in ``ema``'s order, that ``ema`` was made for at another whole shape than ``shapes``
    names for it: ``(name, shape made for, shape now)``; None where all agree or ``ema`` recorded no shapes (a
    mapping, ``Shards.from_views``). Names missing from ``shapes`` are left to the names checks.

    This rank's pieces of two such parameters may have equal lengths (a (4, 6) weight's and a (6, 4) one's; under
    ZeRO-3 on some ranks only), so the piece checks let them through; the whole shapes are the same on every rank,
    so every rank refuses alike."""
    recorded = ema.full_shapes if isinstance(ema, Shards) else None
    if recorded is None:
        return None
    for name, was in zip(ema.index.names, recorded):
        now = shapes.get(name)
        if now is not None and tuple(was) != tuple(now):
            return name, tuple(was), tuple(now)
    return None


def selection_note(ema: Any, shards: Any) -> str:
    """Why an EMA and the shards it is used with name different parameters, when the reason is that they were read
    with different include/exclude selections: ``" (the state was made from ...)"``; ``""`` otherwise (not two
    ``Shards``, or the same selection), where the caller's own explanation stands."""
    if not (isinstance(ema, Shards) and isinstance(shards, Shards)) or ema.selection == shards.selection:
        return ""

    def shown(selection: Any) -> str:
        return "every parameter (no include/exclude)" if selection is None else f"the selection {selection.describe()}"

    return (
        f" (the state was made from {shown(ema.selection)}, and these shards are of {shown(shards.selection)}: pass "
        "the same include/exclude at every call, or make a new state with init_ema)"
    )
