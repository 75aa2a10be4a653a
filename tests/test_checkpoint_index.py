"""The manifest's piece index (``functional_ema/_checkpoint/index.py``): a load at another world size opens
only the files that hold its pieces, reads the same values as a read of every file, and a damaged or
lying index is refused, naming the manifest field or the file.

Checkpoints are written in one process through the library's own writer (each rank's layout as its
engine reports it: ZeRO-3's even cut, FSDP2's rows, ZeRO-1/2's flat partition, a replicated model);
the multi-rank loads at other world sizes on real engines are in ``tests/test_checkpoint.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import functional_ema as fe
from functional_ema import ShardLayout, ShardSpec
from functional_ema._checkpoint import index
from functional_ema._checkpoint.reader import fill_all, open_checkpoint
from functional_ema._testing.files import hashes, write_simulated

SHAPES = {"embed": (10, 3), "norm": (7,), "proj": (5, 4), "bias": (1,)}
REF = {n: torch.arange(math.prod(s), dtype=torch.float32) * 0.5 + i for i, (n, s) in enumerate(SHAPES.items())}


def _even(rank: int, world: int, rows: bool = False) -> dict[str, ShardSpec]:
    """ZeRO-3 (each parameter flattened, ``ceil(numel / world)`` per rank) or FSDP2 (``ceil(rows / world)`` rows)."""
    specs = {}
    for n, s in SHAPES.items():
        unit = math.prod(s[1:]) if rows else 1
        total = s[0] if rows else math.prod(s)
        per = -(-total // world)
        lo = min(rank * per, total)
        specs[n] = ShardSpec(s, lo * unit, (min(lo + per, total) - lo) * unit)
    return specs


def _flat(rank: int, world: int) -> dict[str, ShardSpec]:
    """ZeRO-1/2: the parameters concatenated, the flat buffer cut into ``world`` equal ranges."""
    total = sum(math.prod(s) for s in SHAPES.values())
    per = -(-total // world)
    lo, hi, start, specs = rank * per, (rank + 1) * per, 0, {}
    for n, s in SHAPES.items():
        numel = math.prod(s)
        a, b = max(lo, start), min(hi, start + numel)
        specs[n] = ShardSpec(s, a - start if b > a else 0, max(0, b - a))
        start += numel
    return specs


CUTS = {
    "zero3": lambda r, w: ShardLayout(r, w, 3, _even(r, w)),
    "fsdp2": lambda r, w: ShardLayout(r, w, 3, _even(r, w, rows=True), "fsdp2"),
    "zero2": lambda r, w: ShardLayout(r, w, 2, _flat(r, w)),
    "replicated": lambda r, w: ShardLayout(r, w, 0, {n: ShardSpec(s, 0, math.prod(s)) for n, s in SHAPES.items()}),
}


def _pieces(lay: ShardLayout) -> tuple[dict[str, torch.Tensor], ...]:
    return tuple({n: REF[n][s.offset : s.offset + s.numel] + k for n, s in lay.specs.items()} for k in range(2))


def _save(root: Path, cut: str, world: int) -> dict:
    return write_simulated(root, "t", [CUTS[cut](r, world) for r in range(world)], _pieces)


def _load(root: Path, layout: ShardLayout) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(the ranks whose files were opened, EMA 1 of ``layout``'s pieces) as ``fe.load`` reads them."""
    with open_checkpoint(root, "t", True, layout) as ckpt:
        out = {n: torch.full((s.numel,), float("nan")) for n, s in layout.specs.items()}
        fill_all(ckpt, [(out[n], 1, n, s.offset, s.numel) for n, s in layout.specs.items()], True)
        return sorted(f.rank for f in ckpt.files), out


def _want(layout: ShardLayout) -> dict[str, torch.Tensor]:
    return {n: REF[n][s.offset : s.offset + s.numel] + 1 for n, s in layout.specs.items()}


@pytest.mark.parametrize("cut", list(CUTS))
def test_reshard_opens_only_the_files_it_needs(tmp_path, cut):
    manifest = _save(tmp_path, cut, 4)
    cuts = manifest[index.FIELD]
    if cut == "zero2":  # a flat partition: a parameter on one or two ranks (explicit pieces, or an even cut)
        assert (cuts["embed"], cuts["norm"], cuts["bias"]) == (15, [2, 0, 7], [3, 0, 1])
    else:  # one int per parameter whatever the world size
        assert all(isinstance(c, int) for c in cuts.values())
        assert cuts["embed"] == {"zero3": 8, "fsdp2": 9, "replicated": 30}[cut]
    writers = 1 if cut == "replicated" else 4
    for world in (1, 2, 3, 5, 40):
        for rank in sorted({0, world // 2, world - 1}):
            lay = CUTS["zero3"](rank, world)
            opened, got = _load(tmp_path, lay)
            want = index.ranks_needed(cuts, SHAPES, ((n, s.offset, s.numel) for n, s in lay.specs.items()))
            assert opened == (sorted(want) or [0]), (cut, world, rank, opened)
            assert len(opened) <= writers
            if cut in ("zero3", "fsdp2") and world >= 2:  # even cuts: a loading rank of 2+ needs fewer than all
                assert len(opened) < writers, (world, rank, opened)
            assert all(torch.equal(got[n], w) for n, w in _want(lay).items()), (cut, world, rank)
    # The same world size and cut: the rank's own file only; the same world size, cut otherwise: the index.
    assert _load(tmp_path, CUTS[cut](2, 4))[0] == ([0] if cut == "replicated" else [2])
    if cut == "zero2":
        opened, got = _load(tmp_path, CUTS["zero3"](1, 4))
        assert all(torch.equal(got[n], w) for n, w in _want(CUTS["zero3"](1, 4)).items())


def test_without_index_every_file_is_opened(tmp_path):
    """A manifest written before the index (or with ``piece_index: null``) is read as before."""
    _save(tmp_path, "zero3", 4)
    mpath = tmp_path / "t" / "ema_manifest.json"
    m = json.loads(mpath.read_text())
    for value in (..., None):
        if value is ...:
            m.pop(index.FIELD)
        else:
            m[index.FIELD] = value
        mpath.write_text(json.dumps(m))
        lay = CUTS["zero3"](0, 3)
        opened, got = _load(tmp_path, lay)
        assert opened == [0, 1, 2, 3] and all(torch.equal(got[n], w) for n, w in _want(lay).items())


def _refused(root: Path, fragments: list[str], fn) -> None:
    before = hashes(root)
    with pytest.raises(fe.checkpoint.CheckpointError) as info:
        fn()
    assert all(f in str(info.value) for f in fragments), (fragments, str(info.value))
    assert hashes(root) == before


@pytest.mark.parametrize("cut", ["zero3", "zero2"])
def test_damaged_index_refused_naming_the_field(tmp_path, cut):
    """Type-confused, out-of-range, overlapping and gapped entries: refused when the manifest is read, by a
    resharding load and by the offline tools, naming the manifest and the field."""
    _save(tmp_path, cut, 4)
    mpath = tmp_path / "t" / "ema_manifest.json"
    good = mpath.read_text()
    bad_entries = [
        0,
        -1,
        2.5,
        True,
        None,
        "8",
        2**70,
        1,  # the even cut of 1: ranks 4.. would hold elements, and have no file
        [0, 0],
        [0, 0, 29],  # element 29 in no piece
        [0, 0, 30, 0, 0, 30],  # one rank twice
        [4, 0, 30],  # a rank without a file
        [0, -1, 31],
        [0, 0, 31],  # past the parameter
        [0, 5, 0, 1, 0, 30],  # an empty piece
        [[0], 0, 30],
        [0, 0, 30] * 5,  # more pieces than files
    ]
    cases = [("x", index.FIELD), ([], index.FIELD), ({}, index.FIELD)]
    cases += [({**json.loads(good)[index.FIELD], "embed": v}, f"{index.FIELD}['embed']") for v in bad_entries]
    none_case = {k: v for k, v in json.loads(good)[index.FIELD].items() if k != "norm"}
    cases.append((none_case, index.FIELD))
    for value, field in cases:
        m = json.loads(good)
        m[index.FIELD] = value
        mpath.write_text(json.dumps(m))
        for fn in (lambda: _load(tmp_path, CUTS["zero3"](0, 3)), lambda: fe.consolidate(tmp_path, "t")):
            _refused(tmp_path, [str(mpath), field], fn)
    mpath.write_text(good)
    assert _load(tmp_path, CUTS["zero3"](0, 3))[1].keys() == SHAPES.keys()


@pytest.mark.parametrize("cut", ["zero3", "zero2"])
def test_lying_index_refused_naming_the_file(tmp_path, cut):
    """An index that is well formed and covers every parameter but says another rank holds the pieces a
    file's layout places: refused when that file is opened (its header checksum covers its layout), never
    a read of the wrong elements."""
    _save(tmp_path, cut, 4)
    mpath = tmp_path / "t" / "ema_manifest.json"
    good = json.loads(mpath.read_text())
    lie = dict(good[index.FIELD])
    # ZeRO-3: a cut of 10 instead of 8 (ranks 0-2 hold 30 elements); ZeRO-2: bias on rank 0, not 3.
    lie["embed" if cut == "zero3" else "bias"] = 10 if cut == "zero3" else [0, 0, 1]
    mpath.write_text(json.dumps({**good, index.FIELD: lie}))
    lay = CUTS["zero3"](0, 1)  # reads everything
    _refused(
        tmp_path, ["ema_rank_0000", index.FIELD, "embed" if cut == "zero3" else "bias"], lambda: _load(tmp_path, lay)
    )
    _refused(tmp_path, ["ema_rank_0000", index.FIELD], lambda: fe.consolidate(tmp_path, "t"))


def test_chunk_checksums_checked_when_their_file_is_opened(tmp_path):
    """Format 5 keeps a rank file's chunk checksums as one hex string (``chunk_checksums``, file order). It
    is checked when a reader opens that file: a resharding load that needs other files reads them; one that
    needs it (and the offline tools) names the damaged field, or the flipped checksum's tensor."""
    m0 = _save(tmp_path, "zero3", 4)
    assert m0["format_version"] == 5 and all(set(e) >= {"chunk_checksums"} for e in m0["files"])
    assert not any("tensor_checksums" in e for e in m0["files"])
    mpath = tmp_path / "t" / "ema_manifest.json"
    text = m0["files"][3]["chunk_checksums"]
    # Every checksum changed (its first digit): whichever tensor of file 3 a reader reads first is reported.
    flipped = "".join(
        ("0" if g[0] != "0" else "1") + g[1:] for g in (text[i : i + 16] for i in range(0, len(text), 16))
    )
    for bad, frags in (
        ("zz" + text[2:], [str(mpath), "files[3].chunk_checksums", "hex"]),
        (text[:-16], [str(mpath), "files[3].chunk_checksums", "chunks"]),
        (text + "0" * 16, [str(mpath), "files[3].chunk_checksums", "chunks"]),
        (flipped, ["checksum mismatch", "emas.1.", "rank 3 of 4"]),
    ):
        m = json.loads(json.dumps(m0))
        m["files"][3]["chunk_checksums"] = bad
        mpath.write_text(json.dumps(m))
        lay = CUTS["zero3"](0, 2)  # ranks 0-1 of the saved 4
        opened, got = _load(tmp_path, lay)
        assert opened == [0, 1] and all(torch.equal(got[n], w) for n, w in _want(lay).items())
        for fn in (lambda: _load(tmp_path, CUTS["zero3"](1, 2)), lambda: fe.consolidate(tmp_path, "t", index=1)):
            _refused(tmp_path, frags, fn)


def test_index_unit():
    """The even cut, the selection of ranks, and what is not an index (no I/O)."""
    assert [index.even_cut(10, 4, r) for r in range(4)] == [(0, 4), (4, 4), (8, 2), (10, 0)]
    params = {"w": (10,)}
    assert index.build(params, {0: {"w": [0, 4]}, 1: {"w": [4, 4]}, 2: {"w": [8, 2]}, 3: {"w": [10, 0]}}) == {"w": 4}
    assert index.build(params, {0: {"w": [0, 6]}, 1: {"w": [6, 4]}}) == {"w": 6}
    assert index.build(params, {0: {"w": [0, 3]}, 1: {"w": [3, 7]}}) == {"w": [0, 0, 3, 1, 3, 7]}
    assert index.build(params, {0: {"w": [0, 3]}, 1: {"w": [4, 6]}}) is None  # element 3 in no piece: no index
    assert index.build(params, {0: {}}) is None
    assert index.ranks_needed({"w": 4}, params, [("w", 3, 2)]) == {0, 1}
    assert index.ranks_needed({"w": 4}, params, [("w", 3, 0)]) == set()
    assert index.ranks_needed({"w": [0, 0, 3, 1, 3, 7]}, params, [("w", 3, 1)]) == {1}
    assert index.ranks_needed({"w": 4}, params, [("v", 0, 1)]) is None  # another model: every file, then check_model
    assert index.ranks_needed({"w": 4}, params, [("w", 8, 5)]) is None
    assert index.problem(10, 4, {0, 1, 2}) is None and "rank 1" in str(index.problem(10, 4, {0, 2}))
    assert index.problem(10**12, 1, {0}) is not None  # found without a scan of 10**12 ranks
    look = index.Lookup({"w": [0, 0, 3, 1, 3, 7]}, params)
    assert look.piece("w", 1) == (3, 7) and look.piece("w", 2) == (0, 0)
    assert look.mismatch(1, {"w": (3, 7)}) is None and "[3, 10)" in str(look.mismatch(0, {"w": (3, 7)}))


def test_format3_manifest_still_read(tmp_path):
    """A manifest as 0.3.0 wrote it (format 3: a list of hex checksums per tensor name, no piece index)
    loads at another world size (every file opened) and consolidates; its checksums are still checked."""
    from functional_ema import _io
    from functional_ema._checkpoint.format import split_chunk_checksums

    _save(tmp_path, "zero3", 4)
    mpath = tmp_path / "t" / "ema_manifest.json"
    m = json.loads(mpath.read_text())
    for e in m["files"]:
        st = _io.SafetensorsFile(tmp_path / "t" / e["file"])
        sums = split_chunk_checksums(mpath, "files[?]", e.pop("chunk_checksums"), m["checksum"], st.tensors, "")
        st.close()
        e["tensor_checksums"] = {k: [_io.format_checksum(m["checksum"], v) for v in vs] for k, vs in sums.items()}
    m.pop(index.FIELD)
    m["format_version"] = 3
    mpath.write_text(json.dumps(m))
    lay = CUTS["zero3"](1, 3)
    opened, got = _load(tmp_path, lay)
    assert opened == [0, 1, 2, 3] and all(torch.equal(got[n], w) for n, w in _want(lay).items())
    full = fe.consolidate(tmp_path, "t", index=1)
    assert all(torch.equal(full[n].reshape(-1), REF[n] + 1) for n in SHAPES)
    # A format-5 field in a format-3 record is not read (the format decides, not which keys are there).
    m["files"][0]["chunk_checksums"] = 5
    mpath.write_text(json.dumps(m))
    full = fe.consolidate(tmp_path, "t", index=1)
    assert all(torch.equal(full[n].reshape(-1), REF[n] + 1) for n in SHAPES)
    key = next(k for k, v in m["files"][2]["tensor_checksums"].items() if v and k.startswith("emas.1."))
    m["files"][2]["tensor_checksums"][key][0] = "0" * 16
    mpath.write_text(json.dumps(m))
    _refused(tmp_path, ["checksum mismatch", key, "rank 2 of 4"], lambda: fe.consolidate(tmp_path, "t", index=1))


def test_index_exact_boundaries():
    """Each bound of the index checks, on both sides: a piece ending at its parameter's last element is
    inside and one element past is not; element 0 must be covered; a piece starting exactly where a
    range stops is not needed; two equal-length pieces at swapped offsets are told apart."""
    lists = "an int >= 1 (the even cut) or a list [rank, offset, numel, ...]"
    assert index.problem(10, 0, {0}) == lists
    assert index.problem(10, 2**62, {0}) is None and index.problem(10, 2**62 + 1, {0}) == lists
    assert index.problem(10, True, {0}) == f"{lists} of at most one piece per rank file"
    assert index.problem(10, [0, 0, 5, 0, 5, 5], {0}) == f"{lists} of at most one piece per rank file"
    four = [0, 0, 3, 1, 3, 3, 2, 6, 3, 0, 9, 1]  # four pieces, three rank files
    assert index.problem(10, four, {0, 1, 2}) == f"{lists} of at most one piece per rank file"
    assert index.problem(10, [0, 0, 5, 1, 5, 5], {0, 1}) is None
    inside = "pieces [rank, offset, numel] of distinct ranks with files, inside the 10 elements"
    assert index.problem(10, [0, 0, 5, 1, 5, 6], {0, 1}) == inside  # one element past the parameter
    assert index.problem(10, [0, 0, 5, 1, 10, 1], {0, 1}) == inside
    assert index.problem(10, [0, 0, 5, 2, 5, 5], {0, 1}) == inside  # rank 2 has no file
    assert index.problem(10, [0, 0, 5, 0, 5, 5], {0, 1}) == inside  # rank 0 twice
    assert index.problem(10, [0, 1, 9], {0}) == "pieces that cover all 10 elements (elements from 0 are in none)"
    assert (
        index.problem(10, [0, 0, 4, 1, 5, 5], {0, 1})
        == "pieces that cover all 10 elements (elements from 4 are in none)"
    )
    assert index.problem(10, 3, {0, 1, 2}) == "a cut whose pieces are all in rank files; rank 3 has none"
    assert index.problem(10, 5, {0, 1, 2, 3}) is None  # more files than pieces
    params = {"w": (10,), "v": (2, 3)}
    cut = [0, 0, 5, 1, 5, 5]
    assert index.ranks_needed({"w": cut}, params, [("w", 0, 5)]) == {0}  # rank 1's piece starts where this stops
    assert index.ranks_needed({"w": cut}, params, [("w", 0, 6)]) == {0, 1}
    assert index.ranks_needed({"w": cut}, params, [("w", 5, 5)]) == {1}
    assert index.ranks_needed({"w": 5}, params, [("w", 0, 5)]) == {0}
    assert index.ranks_needed({"w": 5}, params, [("w", 4, 2)]) == {0, 1}
    assert index.ranks_needed({"w": 5, "v": 3}, params, [("v", 0, 6)]) == {0, 1}
    assert index.ranks_needed({"w": 5}, params, [("v", 0, 1)]) is None  # in the model, not in the index
    assert index.ranks_needed({"w": 5, "x": 1}, params, [("x", 0, 1)]) is None  # in the index, not in the model
    assert index.ranks_needed({"w": 5}, params, [("w", -1, 2)]) is None
    assert (
        index.ranks_needed({"w": 5}, params, [("w", 5, 5)]) == {1}
        and index.ranks_needed({"w": 5}, params, [("w", 5, 6)]) is None
    )
    look = index.Lookup({"w": cut}, params)
    assert look.piece("w", 0) == (0, 5) and look.piece("w", 1) == (5, 5) and look.piece("w", 0) == (0, 5)
    assert look.mismatch(0, {"w": (0, 5)}) is None and look.mismatch(1, {"w": (5, 5)}) is None
    assert look.mismatch(0, {"w": (5, 5)}) == (
        "its layout holds elements [5, 10) of 'w', the manifest's piece_index says [0, 5)"
    )
    assert look.mismatch(1, {"w": (0, 5)}) == (
        "its layout holds elements [0, 5) of 'w', the manifest's piece_index says [5, 10)"
    )
    assert look.mismatch(2, {"w": (0, 0)}) is None  # an empty piece: its offset does not matter
