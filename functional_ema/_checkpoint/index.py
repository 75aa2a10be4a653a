"""Which rank file holds which elements of each parameter: the manifest's piece index.

A rank loading at another world size needs a few of the saved files, and without an index it learns
which by opening every file's header (each header carries its rank's layout): O(world size x
parameters) per loading rank, so O(world size^2 x parameters) over the job. A save therefore records
in each model-parallel part of the manifest ``piece_index``, ``{parameter: cut}``, where a cut is

* an int ``c`` >= 1, the even cut of ZeRO-3 and FSDP2 (and of a replicated model's one file): the file
  of rank ``r`` holds elements ``[min(r*c, numel), min((r+1)*c, numel))`` of the flattened parameter,
  one int per parameter whatever the world size;
* a list ``[rank, offset, numel, rank, offset, numel, ...]`` of the non-empty pieces otherwise (ZeRO-1/2
  cut one flat buffer, so a parameter sits on one or two ranks).

The index is checked with the manifest (types, ranks that have files, pieces inside their parameter,
the listed ranks' pieces cover every element) and against each file's own layout when that file is
opened (the manifest's header checksum covers the layout), so a damaged index cannot make a load read
wrong elements. Manifests without one (older saves, expert parallelism) are read as before: a
resharding load opens every file of its part.

Nothing here does I/O or raises: :mod:`.format` and the reader turn the problems found into errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

#: The field of a manifest part that holds the index.
FIELD = "piece_index"

Cut = int | list  # the JSON value of one parameter's entry (see the module docstring)


def even_cut(numel: int, c: int, rank: int) -> tuple[int, int]:
    """``(offset, numel)`` of rank ``rank``'s piece under the even cut ``c`` of ``numel`` elements."""
    lo = min(rank * c, numel)
    return lo, min(lo + c, numel) - lo


def _as_even_cut(numel: int, held: Sequence[tuple[int, int, int]]) -> int | None:
    """The ``c`` of an even cut matching every ``(rank, offset, numel)`` piece in ``held``, or None."""
    first = next((n for r, o, n in held if r == 0 and o == 0 and n), None)
    if first is None:
        return None
    for r, o, n in held:
        lo, want = even_cut(numel, first, r)
        if n != want or (n and o != lo):
            return None
    return first


def build(
    params: Mapping[str, Sequence[int]], pieces: Mapping[int, Mapping[str, Sequence[int]]]
) -> dict[str, Cut] | None:
    """The index of one part from each writing rank's pieces (``{rank: {parameter: [offset, numel]}}``);
    None when a rank's pieces are unknown or the pieces leave an element uncovered (then no index is
    written and a load opens every file, which reports the gap)."""
    ranks = sorted(pieces)
    out: dict[str, Cut] = {}
    for name, shape in params.items():
        numel = math.prod(shape)
        try:
            held = [(r, int(pieces[r][name][0]), int(pieces[r][name][1])) for r in ranks]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        c = _as_even_cut(numel, held) if numel else None
        out[name] = c if c is not None else [x for piece in held if piece[2] for x in piece]
        if problem(numel, out[name], set(ranks)) is not None:
            return None
    return out


def _is_int(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi  # bool is not an int here


def problem(numel: int, cut: object, ranks: set[int], max_numel: int = 1 << 62) -> str | None:
    """What is wrong with one parameter's entry (``numel`` elements; ``ranks``: the ranks that have a file),
    as the phrase "must be ...", or None."""
    if isinstance(cut, int) and not isinstance(cut, bool):
        if not _is_int(cut, 1, max_numel):
            return "an int >= 1 (the even cut) or a list [rank, offset, numel, ...]"
        pieces = -(-numel // cut)  # ranks 0 .. pieces-1 hold the elements; bounded by the files before the scan
        missing = next((r for r in range(min(pieces, len(ranks) + 1)) if r not in ranks), None)
        if missing is not None:
            return f"a cut whose pieces are all in rank files; rank {missing} has none"
        return None
    if not (isinstance(cut, list) and len(cut) % 3 == 0 and len(cut) <= 3 * len(ranks)):
        return "an int >= 1 (the even cut) or a list [rank, offset, numel, ...] of at most one piece per rank file"
    triples = [tuple(cut[i : i + 3]) for i in range(0, len(cut), 3)]
    seen: set[int] = set()
    for r, o, n in triples:
        inside = _is_int(o, 0, numel) and _is_int(n, 1, numel - o)
        if not (_is_int(r, 0, max_numel) and r in ranks and r not in seen and inside):
            return f"pieces [rank, offset, numel] of distinct ranks with files, inside the {numel} elements"
        seen.add(r)
    cursor = 0
    for o, n in sorted((o, n) for _, o, n in triples):
        if o > cursor:
            break
        cursor = max(cursor, o + n)
    if cursor < numel:
        return f"pieces that cover all {numel} elements (elements from {cursor} are in none)"
    return None


def ranks_needed(
    index: Mapping[str, Cut], params: Mapping[str, Sequence[int]], need: Iterable[tuple[str, int, int]]
) -> set[int] | None:
    """The ranks whose files hold some of ``need``'s ``(parameter, offset, numel)`` ranges (of a validated
    index); None when ``need`` names a parameter the part lacks or a range outside it (the model does not
    match: the caller opens every file, and the model check names the difference)."""
    out: set[int] = set()
    for name, start, count in need:
        if count <= 0:
            continue
        stop, cut = start + count, index.get(name)
        if cut is None or name not in params or start < 0 or stop > math.prod(params[name]):
            return None
        if isinstance(cut, int):
            out.update(range(start // cut, (stop - 1) // cut + 1))
        else:
            out.update(cut[i] for i in range(0, len(cut), 3) if cut[i + 1] < stop and cut[i + 1] + cut[i + 2] > start)
    return out


class Lookup:
    """A validated index, asked for one rank's piece of a parameter (list entries looked up once)."""

    def __init__(self, index: Mapping[str, Cut], params: Mapping[str, Sequence[int]]) -> None:
        self.index = index
        self.numel = {n: math.prod(s) for n, s in params.items()}
        self._by_rank: dict[str, dict[int, tuple[int, int]]] = {}

    def piece(self, name: str, rank: int) -> tuple[int, int]:
        """``(offset, numel)`` of ``rank``'s piece of ``name``; numel 0 when it holds none."""
        cut = self.index[name]
        if isinstance(cut, int):
            return even_cut(self.numel[name], cut, rank)
        table = self._by_rank.get(name)
        if table is None:
            table = self._by_rank[name] = {cut[i]: (cut[i + 1], cut[i + 2]) for i in range(0, len(cut), 3)}
        return table.get(rank, (0, 0))

    def mismatch(self, rank: int, specs: Mapping[str, tuple[int, int]]) -> str | None:
        """The first parameter whose piece in a rank file's layout (``{name: (offset, numel)}``) differs from
        the index, described; None when they agree."""
        for name, (offset, count) in specs.items():
            want_offset, want = self.piece(name, rank)
            if count != want or (count and offset != want_offset):
                return (
                    f"its layout holds elements [{offset}, {offset + count}) of {name!r}, the manifest's "
                    f"{FIELD} says [{want_offset}, {want_offset + want})"
                )
        return None
