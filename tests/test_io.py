"""functional_ema/_io.py: durable atomic writes, the streaming safetensors writer, checksums, and
verified reads of whole tensors and of parts of them.

Durability is checked by recording the order of the system calls (``os.fsync`` of the file, then
``os.replace`` over the target, then ``os.fsync`` of the folder), and checksum coverage by flipping
one byte inside, and one outside, the part a read covers. Small checksum chunks (64 bytes, patched)
make a tensor of a few hundred bytes span several chunks.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from functional_ema import _io


@pytest.fixture
def small_chunks(monkeypatch) -> int:
    monkeypatch.setattr(_io, "CHUNK_BYTES", 64)
    monkeypatch.setattr(_io, "_READ_BYTES", 16)
    return 64


def _syscalls(monkeypatch) -> list[tuple]:
    """Record os.fsync (of a file, with its size then, or of a folder) and os.replace, then run them."""
    calls: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        calls.append(("fsync dir",) if stat.S_ISDIR(st.st_mode) else ("fsync file", st.st_size))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


# ------------------------------------------------------------------------------------------ atomic


def test_atomic_write_fsyncs_the_data_then_renames_then_fsyncs_the_folder(tmp_path, monkeypatch):
    """The bytes are flushed and fsynced under the temporary name, renamed over the target, and then the
    folder's entry is fsynced: a crash at any point leaves the old file or the whole new one."""
    target = tmp_path / "m.json"
    target.write_bytes(b"old")
    calls = _syscalls(monkeypatch)
    _io.atomic_write_bytes(target, b"0123456789")
    assert len(calls) == 3, calls
    assert calls[0] == ("fsync file", 10)  # every byte was flushed before the fsync
    assert calls[1][0] == "replace" and calls[1][2] == "m.json" and _io.is_tmp_name(calls[1][1])
    assert calls[1][1].startswith(f"m.json.tmp-{os.getpid()}-")
    assert calls[2] == ("fsync dir",)
    assert target.read_bytes() == b"0123456789" and sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_atomic_open_failure_leaves_the_target_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "m.json"
    target.write_bytes(b"old")
    calls = _syscalls(monkeypatch)
    with pytest.raises(RuntimeError, match="disk gone"), _io.atomic_open(target) as f:
        f.write(b"half")
        raise RuntimeError("disk gone")
    assert calls == [] and target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_atomic_open_without_replace_keeps_a_file_that_appears_meanwhile(tmp_path, monkeypatch):
    """``replace=False`` (consolidate/posthoc/--plot without --overwrite): a file created at the target while the
    block runs (a user's, another run's) is kept, the temporary file removed, and ``FileExistsError`` names the
    target; ``os.replace`` dropped it silently. Also where the file system has no hard links (``os.link``: EPERM),
    through an O_EXCL reservation. With no file there, the bytes are committed as with ``replace=True``, which
    (saves' default) still replaces."""
    import errno

    real_link = os.link

    def no_links(src, dst, **kw):
        raise OSError(errno.EPERM, "Operation not permitted", str(src))

    for links in ("hard links", "no hard links"):
        if links == "no hard links":
            monkeypatch.setattr(os, "link", no_links)
        folder = tmp_path / links.replace(" ", "_")
        folder.mkdir()
        target = folder / "ema.safetensors"
        with pytest.raises(FileExistsError) as e, _io.atomic_open(target, replace=False) as f:
            f.write(b"ours")
            target.write_bytes(b"USER DATA")  # appears while the file is written
        assert str(e.value) == (
            f"refusing to replace {target}: it appeared while this file was being written (another process or a user "
            "created it), and is left as it is; nothing was written. Pass --overwrite (overwrite=True) to replace it, "
            "or choose another name"
        )
        assert target.read_bytes() == b"USER DATA" and [p.name for p in folder.iterdir()] == ["ema.safetensors"]
        target.unlink()
        with _io.atomic_open(target, replace=False) as f:  # nothing there: committed
            f.write(b"ours")
        assert target.read_bytes() == b"ours" and [p.name for p in folder.iterdir()] == ["ema.safetensors"]
        with _io.atomic_open(target) as f:  # the default replaces (checkpoint saves, --overwrite)
            f.write(b"again")
        assert target.read_bytes() == b"again" and [p.name for p in folder.iterdir()] == ["ema.safetensors"]
    monkeypatch.setattr(os, "link", real_link)
    # the streaming writer and write_tensors pass it on
    target = tmp_path / "w.safetensors"
    with pytest.raises(FileExistsError), _io.StreamingWriter(target, [("w", torch.float32, (2,))], replace=False) as w:
        w.write("w", torch.ones(2))
        target.write_bytes(b"USER DATA")
        w.commit()
    assert target.read_bytes() == b"USER DATA"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard_links", "no_hard_links", "w.safetensors"]
    target.unlink()
    _io.write_tensors(target, {"w": torch.arange(3.0)}, {}, replace=False)
    assert torch.equal(load_file(target)["w"], torch.arange(3.0))


def test_tmp_names_are_unique_siblings():
    a, b = _io.tmp_name("/x/y/ema.safetensors"), _io.tmp_name("/x/y/ema.safetensors")
    assert a != b and a.parent == Path("/x/y") and a.name.startswith(f"ema.safetensors.tmp-{os.getpid()}-")
    assert len(a.name) == len(f"ema.safetensors.tmp-{os.getpid()}-") + 12
    assert _io.is_tmp_name(a.name) and not _io.is_tmp_name("ema.safetensors") and not _io.is_tmp_name("a.tmp")


# --------------------------------------------------------------------------------------- checksums


def test_checksums_of_chunks_and_their_text():
    data = bytes(range(256)) * 3
    assert _io.chunk_checksums(data, 100) == [xxhash.xxh3_64_intdigest(data[i : i + 100]) for i in range(0, 768, 100)]
    assert _io.chunk_crcs(data, 512) == [zlib.crc32(data[:512]), zlib.crc32(data[512:])]
    assert _io.chunk_checksums(b"", 64) == []
    assert _io.format_checksum("crc32", 255) == "000000ff" and _io.format_checksum("xxh3_64", 255) == "00000000000000ff"
    inc = _io._Incremental("crc32")
    for i in range(0, 768, 10):
        inc.update(memoryview(data)[i : i + 10])
    assert inc.value() == zlib.crc32(data)
    inc = _io._Incremental("xxh3_64")
    inc.update(memoryview(data))
    assert inc.value() == xxhash.xxh3_64_intdigest(data)
    with pytest.raises(
        _io.FormatError, match=r"unknown checksum algorithm 'md5' \(this version knows \['crc32', 'xxh3_64'\]\)"
    ):
        _io.checksum_fn("md5")


def test_io_threads_share_of_the_cpus(monkeypatch):
    monkeypatch.delenv(_io.IO_THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _io.io_threads() == 2 and _io.io_threads(shared=False) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert _io.io_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert _io.io_threads() == 4
    monkeypatch.setenv(_io.IO_THREADS_ENV, "7")
    assert _io.io_threads() == 7
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(_io.IO_THREADS_ENV, bad)
        with pytest.raises(
            ValueError, match=f"environment variable FUNCTIONAL_EMA_IO_THREADS must be a positive integer, got '{bad}'"
        ):
            _io.io_threads()


# ---------------------------------------------------------------------------------- streaming writer


def _entries():
    return [("a", torch.float32, (3, 4)), ("b", torch.int64, (5,))]


def test_streaming_writer_file_equals_safetensors_and_records_checksums(tmp_path, small_chunks):
    a, b = torch.arange(12.0).view(3, 4), torch.arange(5)
    path = tmp_path / "w.safetensors"
    with _io.StreamingWriter(path, _entries(), {"note": "x"}) as w:
        assert w.write("a", a) == _io.chunk_checksums(_io._byte_view(a), 64)
        assert w.crcs["a"] == [xxhash.xxh3_64_intdigest(a.numpy().tobytes()[:48])]
        assert w.write("b", b) == [xxhash.xxh3_64_intdigest(b.numpy().tobytes())]
        assert not path.exists()  # under a temporary name until commit
        size = w.commit()
    assert size == os.path.getsize(path) == w.size
    got = load_file(path)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    f = _io.SafetensorsFile(path)
    assert f.metadata == {"note": "x"} and f.header_checksum() == w.header_checksum
    assert f.header_checksum("crc32") == zlib.crc32(path.read_bytes()[: f.header_size])


def test_streaming_writer_refuses_out_of_order_and_unwritten(tmp_path):
    path = tmp_path / "w.safetensors"
    with _io.StreamingWriter(path, _entries(), checksums=False) as w:
        with pytest.raises(
            ValueError, match=r"^w.safetensors: tensors must be written in declared order; expected 'a', got 'b'$"
        ):
            w.write("b", torch.arange(5))
        with pytest.raises(
            ValueError, match=r"tensor 'a' was declared torch.float32 with 12 elements, got torch.float64 with 12$"
        ):
            w.write("a", torch.zeros(12, dtype=torch.float64))
        with pytest.raises(
            ValueError, match=r"tensor 'a' was declared torch.float32 with 12 elements, got torch.float32 with 11$"
        ):
            w.write("a", torch.zeros(11))
        assert w.write("a", torch.zeros(3, 4)) == []
        with pytest.raises(ValueError, match=r"^w.safetensors: 1 declared tensors were never written$"):
            w.commit()
        w.write("b", torch.arange(5))
        with pytest.raises(ValueError, match=r"expected 'nothing \(all written\)', got 'c'$"):
            w.write("c", torch.zeros(1))
    assert list(tmp_path.iterdir()) == []  # left the block without a commit: nothing
    with _io.StreamingWriter(path, [], None) as w:
        assert w.commit() == os.path.getsize(path)
    assert _io.SafetensorsFile(path).tensors == {}


def test_streaming_writer_commit_order(tmp_path, monkeypatch):
    calls = _syscalls(monkeypatch)
    path = tmp_path / "w.safetensors"
    with _io.StreamingWriter(path, [("a", torch.float32, (4,))]) as w:
        w.write("a", torch.ones(4))
        assert calls == []
        w.commit()
    assert [c[0] for c in calls] == ["fsync file", "replace", "fsync dir"] and calls[0][1] == w.size


# ------------------------------------------------------------------------------------------ reading


def _file(tmp_path: Path, t: torch.Tensor) -> tuple[Path, list[int], int]:
    """``t`` saved as tensor 'x' (the writer's checksums, 64-byte chunks); the offset of its data."""
    path = tmp_path / "x.safetensors"
    with _io.StreamingWriter(path, [("x", t.dtype, tuple(t.shape))]) as w:
        crcs = w.write("x", t)
        w.commit()
    return path, crcs, _io.SafetensorsFile(path).header_size


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_partial_read_verifies_every_byte_it_reads(tmp_path, small_chunks):
    """A part read with checksums (whole 64-byte chunks: 16 float32) fails on a flipped byte anywhere in
    it, its first and last byte included; a flipped byte outside it is not its business."""
    t = torch.arange(60, dtype=torch.float32)  # 240 bytes: 3 whole chunks and 48 bytes
    path, crcs, base = _file(tmp_path, t)
    dst = torch.empty(32)
    with _io.SafetensorsFile(path) as f:
        f.read_into("x", dst, crcs, start=16)
    assert torch.equal(dst, t[16:48])
    for at, fails in [(64, True), (127, True), (128, True), (191, True), (63, False), (192, False)]:
        _flip(path, base + at)
        with _io.SafetensorsFile(path) as f:
            if fails:
                with pytest.raises(
                    _io.ChecksumError,
                    match=r"checksum mismatch in tensor 'x', bytes (64\.\.128|128\.\.192) of the tensor: xxh3_64",
                ):
                    f.read_into("x", torch.empty(32), crcs, start=16)
            else:
                f.read_into("x", torch.empty(32), crcs, start=16)
        _flip(path, base + at)  # back
    with _io.SafetensorsFile(path) as f:
        with pytest.raises(ValueError, match=r"bytes \[4, 132\) of 'x' are not whole checksum chunks"):
            f.read_into("x", torch.empty(32), crcs, start=1)
        with pytest.raises(ValueError, match=r"bytes \[64, 132\) of 'x' are not whole checksum chunks"):
            f.read_into("x", torch.empty(17), crcs, start=16)
        last = torch.empty(12)
        f.read_into("x", last, crcs, start=48)  # ends at the tensor's end, mid-chunk: allowed
        assert torch.equal(last, t[48:])
        f.read_into("x", torch.empty(3), None, start=5)  # without checksums any part may be read
        with pytest.raises(_io.FormatError, match=r"cannot read it elements \[60, 70\) into torch.float32\[10\]"):
            f.read_into("x", torch.empty(10), None, start=60)
        with pytest.raises(_io.ChecksumError, match="has 3 recorded checksum chunks, which does not fit its size"):
            f.read_into("x", torch.empty(60), crcs[:3])


def test_whole_read_and_range_read_verify_what_they_read(tmp_path, small_chunks):
    t = torch.arange(40, dtype=torch.float64).view(8, 5)  # 320 bytes: 5 chunks
    path, crcs, base = _file(tmp_path, t)
    with _io.SafetensorsFile(path) as f:
        whole = torch.empty(8, 5, dtype=torch.float64)
        f.read_into("x", whole, crcs)
        assert torch.equal(whole, t)
        strided = torch.empty(5, 8, dtype=torch.float64).t()  # not contiguous: through a host buffer
        f.read_into("x", strided, crcs)
        assert torch.equal(strided, t)
        assert torch.equal(f.read_range("x", 9, 23, crcs), t.reshape(-1)[9:23])
        assert torch.equal(f.read_range("x", 0, 40), t.reshape(-1))
        assert f.read_range("x", 7, 7).numel() == 0
        with pytest.raises(IndexError, match=r"range \[30, 41\) outside tensor 'x' of 40 elements"):
            f.read_range("x", 30, 41)
    _flip(path, base + 120)  # in element 15, so in the chunk of bytes 64..128 (elements 8 to 15)
    with _io.SafetensorsFile(path) as f:
        with pytest.raises(_io.ChecksumError, match=r"bytes 64\.\.128 of the tensor"):
            f.read_range("x", 9, 10, crcs)  # widened to the whole chunk, so the flip in element 15 is seen
        assert f.read_range("x", 16, 24, crcs).tolist() == list(range(16, 24))
        with pytest.raises(
            _io.ChecksumError,
            match=r"bytes 64\.\.128 of the tensor: xxh3_64 [0-9a-f]{16}, recorded [0-9a-f]{16}\. The file is corrupted: restore it from a copy or load an earlier tag ctx$",
        ):
            f.read_into("x", torch.empty(8, 5, dtype=torch.float64), crcs, context="ctx")


# ---------------------------------------------------------------------------------- what is refused


def _raw(tmp_path: Path, header: dict, data: bytes = b"", name: str = "r.safetensors") -> Path:
    text = json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_safetensors_file_refusals_name_the_problem(tmp_path):
    ok = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert _io.SafetensorsFile(_raw(tmp_path, ok, b"\0" * 8), expected_size=8 + len(json.dumps(ok)) + 8).size > 0
    cases = [
        ({"x": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, 8, "field 'dtype' is invalid ('F33')"),
        ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "field 'shape' is invalid ([-2])"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, 8, "field 'data_offsets' is invalid ([0])"),
        ({"x": [1]}, 8, "field 'entry' is invalid ([1])"),
        (
            {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}},
            12,
            "its fields 'data_offsets' [0, 12) and 'shape' [2] (torch.float32) disagree",
        ),
        (
            {"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
            8,
            "tensor 'x' starts at byte 4 of the data, expected 0 (gap or overlap)",
        ),
        ({"__metadata__": {"a": 1}}, 0, "__metadata__ must map strings to strings"),
    ]
    for header, n, words in cases:
        with pytest.raises(_io.FormatError) as e:
            _io.SafetensorsFile(_raw(tmp_path, header, b"\0" * n))
        assert words in str(e.value), (words, str(e.value))
    path = _raw(tmp_path, ok, b"\0" * 4)
    with pytest.raises(_io.TruncatedFileError, match=r"is truncated: .* bytes, its header describes"):
        _io.SafetensorsFile(path)
    path = _raw(tmp_path, ok, b"\0" * 9)
    with pytest.raises(_io.FormatError, match="it was modified after it was written"):
        _io.SafetensorsFile(path)
    size = os.path.getsize(_raw(tmp_path, ok, b"\0" * 8))
    with pytest.raises(_io.TruncatedFileError, match=f"is truncated: {size} bytes, expected {size + 1}"):
        _io.SafetensorsFile(tmp_path / "r.safetensors", expected_size=size + 1)
    with pytest.raises(_io.FormatError, match=f"has {size} bytes, expected {size - 1}: it was modified"):
        _io.SafetensorsFile(tmp_path / "r.safetensors", expected_size=size - 1)


def test_pickles_and_short_files_refused_without_unpickling(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "p.pt")
    with pytest.raises(
        _io.PickleFileError, match=r"is a pickle / torch\.save file, not safetensors\. functional_ema never unpickles"
    ):
        _io.SafetensorsFile(tmp_path / "p.pt")
    assert (
        _io.looks_like_pickle(b"PK\x03\x04rest")
        and _io.looks_like_pickle(b"\x80\x02")
        and _io.looks_like_pickle(b"\x80\x05")
    )
    assert (
        not _io.looks_like_pickle(b"\x80\x01")
        and not _io.looks_like_pickle(b"\x80\x06")
        and not _io.looks_like_pickle(b"\x80")
    )
    (tmp_path / "s").write_bytes(b"\x01\x02")
    with pytest.raises(
        _io.TruncatedFileError, match=r"is truncated \(2 bytes\): it is shorter than the 8-byte safetensors prefix"
    ):
        _io.SafetensorsFile(tmp_path / "s")
    (tmp_path / "z").write_bytes(struct.pack("<Q", 1) + b"{}")
    with pytest.raises(
        _io.FormatError, match="is not a safetensors file: its 8-byte header length field is out of range"
    ):
        _io.SafetensorsFile(tmp_path / "z")
    (tmp_path / "t").write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(_io.TruncatedFileError, match=r"is truncated: 10 bytes, but its header alone needs 108"):
        _io.SafetensorsFile(tmp_path / "t")
    (tmp_path / "j").write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(
        _io.FormatError, match=r"the safetensors header is not valid JSON \(header is not a JSON object\)"
    ):
        _io.SafetensorsFile(tmp_path / "j")
    save_file({"a": torch.ones(2)}, tmp_path / "ok.safetensors")
    assert list(_io.SafetensorsFile(tmp_path / "ok.safetensors").tensors) == ["a"]


# --------------------------------------------------------------------- exact bounds and messages (make mutate)


def test_header_entry_bounds(tmp_path):
    """64 dimensions are allowed and 65 are not; a dimension or offset of 2**62 - 1 passes the field check
    (then fails the size check) and 2**62 does not; offsets must be ints."""
    ok = {"x": {"dtype": "F32", "shape": [1] * 64, "data_offsets": [0, 4]}}
    assert _io.SafetensorsFile(_raw(tmp_path, ok, b"\0" * 4)).tensors["x"].shape == (1,) * 64
    cases = [
        ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, "field 'shape' is invalid"),
        ({"dtype": "F32", "shape": [2**62], "data_offsets": [0, 4]}, "field 'shape' is invalid"),
        (
            {"dtype": "F32", "shape": [2**62 - 1], "data_offsets": [0, 4]},
            "its fields 'data_offsets' [0, 4) and 'shape'",
        ),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 2**62]}, "field 'data_offsets' is invalid"),
        (
            {"dtype": "F32", "shape": [1], "data_offsets": [0, 2**62 - 1]},
            "its fields 'data_offsets' [0, 4611686018427387903)",
        ),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}, "field 'data_offsets' is invalid ([0.0, 4])"),
        (
            {"dtype": "F32", "shape": [1] * 9 + [2], "data_offsets": [0, 4]},
            "'shape' [1, 1, 1, 1, 1, 1, 1, 1] (torch.float32) disagree",
        ),
        (
            {"dtype": "F" * 100, "shape": [1], "data_offsets": [0, 4]},
            "field 'dtype' is invalid ('" + "F" * 79 + "...); the file",
        ),
        (
            {"dtype": "F" * 77, "shape": [1], "data_offsets": [0, 4]},
            "field 'dtype' is invalid ('" + "F" * 77 + "'); the file",
        ),
        (
            {"dtype": "F" * 78, "shape": [1], "data_offsets": [0, 4]},
            "field 'dtype' is invalid ('" + "F" * 78 + "'); the file",
        ),
        (
            {"dtype": "F" * 79, "shape": [1], "data_offsets": [0, 4]},
            "field 'dtype' is invalid ('" + "F" * 79 + "...); the file",
        ),
    ]
    for entry, words in cases:
        with pytest.raises(_io.FormatError) as e:
            _io.SafetensorsFile(_raw(tmp_path, {"x": entry}, b"\0" * 4))
        assert words in str(e.value), (words, str(e.value))


def test_header_length_and_short_files(tmp_path):
    (tmp_path / "eight").write_bytes(b"\x01" + b"\0" * 7)  # 8 bytes, length field 1: not truncated, not safetensors
    with pytest.raises(_io.FormatError) as e:
        _io.SafetensorsFile(tmp_path / "eight")
    assert type(e.value) is _io.FormatError and "its 8-byte header length field is out of range" in str(e.value)
    (tmp_path / "max").write_bytes(struct.pack("<Q", 100 << 20) + b"{}")  # the largest header allowed, cut short
    with pytest.raises(_io.TruncatedFileError, match=r"but its header alone needs 104857608$"):
        _io.SafetensorsFile(tmp_path / "max")
    (tmp_path / "over").write_bytes(struct.pack("<Q", (100 << 20) + 1) + b"{}")
    with pytest.raises(_io.FormatError, match="header length field is out of range"):
        _io.SafetensorsFile(tmp_path / "over")
    (tmp_path / "raw.pkl").write_bytes(b"\x80\x02" + b"\0" * 6 + b"x" * 700)  # a raw pickle whose prefix reads as 640
    with pytest.raises(
        _io.PickleFileError, match=r"raw\.pkl is a pickle / torch\.save file, not safetensors\. functional_ema never"
    ):
        _io.SafetensorsFile(tmp_path / "raw.pkl")
    deep = b"[" * 200_000 + b"]" * 200_000
    (tmp_path / "deep").write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(_io.FormatError, match=r"the safetensors header is nested too deeply; the file is corrupted$"):
        _io.SafetensorsFile(tmp_path / "deep")
    (tmp_path / "folder").mkdir()
    with pytest.raises(_io.FormatError, match=r"folder: cannot read \(\[Errno 21\] Is a directory"):
        _io.SafetensorsFile(tmp_path / "folder")
    ok = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path = _raw(tmp_path, ok, b"\0" * 9)
    with pytest.raises(
        _io.FormatError, match=f"has {path.stat().st_size} bytes, expected {path.stat().st_size - 1}: it was"
    ):
        _io.SafetensorsFile(path)
    assert _io.SafetensorsFile(_raw(tmp_path, ok, b"\0" * 8)).data_size == 8


def test_writer_header_refusals_and_alignment(tmp_path):
    with pytest.raises(ValueError, match=r"^duplicate or reserved tensor name 'a'$"):
        _io.StreamingWriter(tmp_path / "d", [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(ValueError, match=r"^duplicate or reserved tensor name '__metadata__'$"):
        _io.StreamingWriter(tmp_path / "m", [("__metadata__", torch.float32, (1,))])
    with pytest.raises(TypeError, match=r"^tensor 'q': dtype torch\.quint8 cannot be stored in safetensors here$"):
        _io.StreamingWriter(tmp_path / "q", [("q", torch.quint8, (1,))])
    with pytest.raises(TypeError, match=r"^safetensors metadata must map str to str; got 'k': int$"):
        _io.StreamingWriter(tmp_path / "k", [], {"k": 1})
    with pytest.raises(TypeError, match=r"^safetensors metadata must map str to str; got 1: str$"):
        _io.StreamingWriter(tmp_path / "k", [], {1: "v"})
    assert not list(tmp_path.iterdir())
    for n in range(9):  # every metadata length: the header is padded to 8 bytes, as safetensors writes it
        path = tmp_path / f"p{n}.safetensors"
        with _io.StreamingWriter(path, [("a", torch.float32, (2,))], {"k": "v" * n}) as w:
            w.write("a", torch.ones(2))
            w.commit()
        f = _io.SafetensorsFile(path)
        assert f.header_size % 8 == 0 and f.metadata == {"k": "v" * n}
        assert torch.equal(load_file(path)["a"], torch.ones(2))


def test_mismatch_messages_name_the_bytes_the_algorithm_and_the_file(tmp_path, small_chunks):
    """The bytes a mismatch names are those of the chunk that failed, its last (short) chunk included,
    wherever the verified range starts; crc32 shows 8 hex digits; no context leaves no trailing space."""
    t = torch.arange(60, dtype=torch.float32)  # 240 bytes: chunks 0..64, 64..128, 128..192, 192..240
    path, crcs, base = _file(tmp_path, t)
    _flip(path, base + 200)
    with _io.SafetensorsFile(path) as f:
        with pytest.raises(_io.ChecksumError) as e:
            f.read_range("x", 20, 60, crcs)  # chunks 1 to 3
        assert str(e.value).startswith(
            f"{path}: checksum mismatch in tensor 'x', bytes 192..240 of the tensor: xxh3_64 "
        )
        assert str(e.value).endswith("restore it from a copy or load an earlier tag")
        with pytest.raises(_io.ChecksumError, match=r"bytes 192\.\.240 of the tensor.* earlier tag$"):
            f.read_into("x", torch.empty(60), crcs)
        with pytest.raises(_io.ChecksumError) as e:
            f.read_into("x", torch.empty(60), _io.chunk_crcs(_io._byte_view(t), 64), algo="crc32", context="(rank 1)")
        assert "bytes 192..240 of the tensor: crc32 " in str(e.value) and str(e.value).endswith("earlier tag (rank 1)")
        assert len(str(e.value).split("crc32 ")[1].split(",")[0]) == 8
        assert len(str(e.value).split("recorded ")[1].split(".")[0]) == 8
        assert str(e.value).startswith(f"{path}: checksum mismatch")
        with pytest.raises(_io.ChecksumError) as e:
            f.read_into("x", torch.empty(60), crcs[:3])
        assert str(e.value) == (
            f"{path}: tensor 'x' has 3 recorded checksum chunks, which does not fit its size: the file or its manifest "
            "was modified"
        )
        with pytest.raises(_io.ChecksumError) as e:
            f.read_range("x", 0, 60, crcs[:3], context="(rank 0)")
        assert str(e.value).endswith("its manifest was modified (rank 0)")
        assert str(e.value).startswith(f"{path}: tensor 'x'")


def test_reads_of_empty_ranges_rows_and_after_close(tmp_path, small_chunks):
    t = torch.arange(24, dtype=torch.float64).view(2, 3, 4)
    path, crcs, _ = _file(tmp_path, t)
    f = _io.SafetensorsFile(path)
    empty = f.read_range("x", 5, 5)
    assert empty.dtype == torch.float64 and empty.numel() == 0
    assert torch.equal(f.read_range("x", 7, 17, crcs), t.reshape(-1)[7:17])
    f.close()
    assert torch.equal(f.read_range("x", 3, 9), t.reshape(-1)[3:9])  # reopened after close
    out = torch.empty(2, 3, 4, dtype=torch.float64)
    f.read_into("x", out, crcs)
    f.close()
    f.read_into("x", out, crcs)
    assert torch.equal(out, t)
    flat = torch.empty(0, dtype=torch.float64)
    f.read_into("x", flat, None, start=24)  # an empty part at the very end
    with pytest.raises(
        _io.FormatError, match=r"is torch\.float64\[2, 3, 4\]; cannot read it into torch\.float32\[2, 3, 4\]$"
    ):
        f.read_into("x", torch.empty(2, 3, 4), crcs)
    with pytest.raises(_io.FormatError, match=r"cannot read it elements \[1, 25\) into torch\.float64\[24\]$"):
        f.read_into("x", torch.empty(24, dtype=torch.float64), None, start=1)
    row = _io.SafetensorsFile(_file(tmp_path, torch.zeros(3, 0))[0])  # rows of no elements
    assert row.read_range("x", 0, 0).numel() == 0


def test_reads_without_preadv(tmp_path, small_chunks, monkeypatch):
    """Where os.preadv is missing the reads fall back to os.pread: the same bytes, verified."""
    t = torch.arange(50, dtype=torch.float32)
    path, crcs, _ = _file(tmp_path, t)
    monkeypatch.delattr(os, "preadv")
    out = torch.empty(50)
    with _io.SafetensorsFile(path) as f:
        f.read_into("x", out, crcs)
    assert torch.equal(out, t)


def test_truncated_during_read(tmp_path, small_chunks):
    t = torch.arange(50, dtype=torch.float32)
    path, _, _ = _file(tmp_path, t)
    f = _io.SafetensorsFile(path)
    os.truncate(path, path.stat().st_size - 10)  # cut after it was opened and checked
    with pytest.raises(_io.TruncatedFileError, match=r"x\.safetensors is truncated: tensor 'x' ends early$"):
        f.read_into("x", torch.empty(50), None)


def test_pool_and_threads(monkeypatch):
    """The shared pool: io_threads(shared=False) workers named fe_io, made again after a fork forgets it;
    io_threads falls back to os.cpu_count without an affinity, and takes 1 from the environment."""
    monkeypatch.delenv(_io.IO_THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the pool is the offline tools' size: every CPU, not a share
    _io._forget_pool()
    pool = _io._pool()
    assert pool._max_workers == 4
    assert pool._max_workers == _io.io_threads(shared=False) and pool._thread_name_prefix == "fe_io"
    assert _io.chunk_checksums(bytes(300), 64) == [xxhash.xxh3_64_intdigest(bytes(64))] * 4 + [
        xxhash.xxh3_64_intdigest(bytes(44))
    ]
    _io._forget_pool()
    assert _io._POOL is None and _io._pool() is not pool

    def no_affinity(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", no_affinity)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for count, want in ((None, 1), (3, 3), (6, 4)):
        monkeypatch.setattr(os, "cpu_count", lambda c=count: c)
        assert _io.io_threads(shared=False) == want, count
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert _io.io_threads(shared=False) == 2 and _io.io_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _io.io_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert _io.io_threads() == 2
    monkeypatch.setenv(_io.IO_THREADS_ENV, "1")
    assert _io.io_threads() == 1


def test_short_reads_are_resumed_at_the_right_offset(tmp_path, small_chunks, monkeypatch):
    """A positional read may return fewer bytes than asked: the rest is read from where it stopped."""
    t = torch.arange(50, dtype=torch.float32)
    path, crcs, _ = _file(tmp_path, t)
    real = _io._pread_into
    monkeypatch.setattr(_io, "_pread_into", lambda fd, buf, offset: real(fd, buf[:5], offset))
    out = torch.empty(50)
    with _io.SafetensorsFile(path) as f:
        f.read_into("x", out, crcs)
    assert torch.equal(out, t)


def test_partial_read_of_a_later_tensor_may_end_at_its_end(tmp_path, small_chunks):
    """The end of a part is checked against the tensor's own length, not its position in the file."""
    a, b = torch.arange(30, dtype=torch.float32), torch.arange(60, dtype=torch.float32) * 2
    path = tmp_path / "two.safetensors"
    with _io.StreamingWriter(path, [("a", a.dtype, (30,)), ("b", b.dtype, (60,))]) as w:
        w.write("a", a)
        crcs = w.write("b", b)
        w.commit()
    part = torch.empty(12)
    with _io.SafetensorsFile(path) as f:
        f.read_into("b", part, crcs, start=48)  # bytes 192..240 of b: its end, mid-chunk
    assert torch.equal(part, b[48:])


def test_self_checksums_round_trip_and_refusals(tmp_path):
    """write_tensors records each tensor's chunk checksums in the file's own metadata (4 MiB chunks, in file
    order); self_checksums reads them back; another algorithm, a wrong length or non-hex text is refused."""
    big = torch.arange((4 << 20) // 4 + 3, dtype=torch.float32)  # two chunks
    small = torch.ones(3, dtype=torch.float64)
    path = tmp_path / "s.safetensors"
    size = _io.write_tensors(path, {"small": small, "big": big.view(-1, 1)}, {"note": "n"})
    assert size == path.stat().st_size
    f = _io.SafetensorsFile(path)
    want = {
        "small": _io.chunk_checksums(small.numpy().tobytes()),
        "big": _io.chunk_checksums(big.numpy().tobytes()),
    }
    assert _io.self_checksums(f) == want and len(want["big"]) == 2
    assert f.metadata["note"] == "n" and f.metadata[_io.SELF_CHECKSUMS_ALGO] == "xxh3_64/4194304"
    out = torch.empty(big.numel(), 1)
    f.read_into("big", out, want["big"])
    assert torch.equal(out.view(-1), big)
    with pytest.raises(ValueError, match=r"^self_checksums are xxh3_64, not crc32$"):
        _io.StreamingWriter(tmp_path / "c", [("a", torch.float32, (1,))], algo="crc32", self_checksums=True)
    plain = tmp_path / "p.safetensors"
    save_file({"a": torch.ones(2)}, plain)
    assert _io.self_checksums(_io.SafetensorsFile(plain)) is None
    value = f.metadata[_io.SELF_CHECKSUMS]
    algo = "xxh3_64/4194304"
    for meta, words in [
        ({_io.SELF_CHECKSUMS: value, _io.SELF_CHECKSUMS_ALGO: "crc32/4194304"}, "is 'crc32/4194304', expected " + algo),
        ({_io.SELF_CHECKSUMS: value}, "is None, expected xxh3_64/4194304"),
        (
            {_io.SELF_CHECKSUMS: value[:-16], _io.SELF_CHECKSUMS_ALGO: algo},
            "is not 3 hex checksums of 16 digits (one per 4 MiB of each tensor): the file is corrupted",
        ),
        ({_io.SELF_CHECKSUMS: value.upper(), _io.SELF_CHECKSUMS_ALGO: algo}, "is not 3 hex checksums"),
        ({_io.SELF_CHECKSUMS: "g" + value[1:], _io.SELF_CHECKSUMS_ALGO: algo}, "is not 3 hex checksums"),
    ]:
        forged = tmp_path / "f.safetensors"
        save_file({"small": small, "big": big.view(-1, 1)}, forged, metadata=meta)
        with pytest.raises(_io.FormatError) as e:
            _io.self_checksums(_io.SafetensorsFile(forged))
        assert words in str(e.value) and str(e.value).startswith(str(forged)), (words, str(e.value))


def test_self_checksums_of_three_tensors_at_chunk_boundaries(tmp_path):
    """Each tensor's chunk count is of its own bytes (a tensor after a 4 MiB one has one chunk), and the
    checksums are taken in file order; an X (not hex) is refused."""
    first = torch.arange((4 << 20) // 4, dtype=torch.float32)  # exactly one chunk
    second, third = torch.ones(3), torch.full((5,), 2.0, dtype=torch.float64)
    path = tmp_path / "three.safetensors"
    _io.write_tensors(path, {"first": first, "second": second, "third": third}, {})
    f = _io.SafetensorsFile(path)
    assert [f.tensors[n].start for n in ("first", "second", "third")] == [0, 4 << 20, (4 << 20) + 12]
    assert _io.self_checksums(f) == {
        n: _io.chunk_checksums(t.numpy().tobytes()) for n, t in (("first", first), ("second", second), ("third", third))
    }
    value = f.metadata[_io.SELF_CHECKSUMS]
    forged = tmp_path / "x.safetensors"
    save_file(
        {"first": first, "second": second, "third": third},
        forged,
        metadata={_io.SELF_CHECKSUMS: "X" + value[1:], _io.SELF_CHECKSUMS_ALGO: "xxh3_64/4194304"},
    )
    with pytest.raises(_io.FormatError, match="is not 3 hex checksums of 16 digits"):
        _io.self_checksums(_io.SafetensorsFile(forged))


def test_exclusive_commit_counts_a_lost_link_reply_and_never_leaves_its_reservation(tmp_path, monkeypatch):
    """Review of the exclusive commit: (1) on NFS a retransmitted ``link`` that had succeeded answers EEXIST: our own
    complete file is at the target, so the commit stands (it was reported refused and the temporary removed);
    (2) without hard links, an interrupt (Ctrl-C) between the O_EXCL reservation and the rename left an empty file at
    the target: it is removed, and only if it is still the reservation (a file someone put there instead stays)."""
    import errno

    real_link, real_replace = os.link, os.replace

    def lost_reply(src, dst, **kw):
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(os, "link", lost_reply)
    target = tmp_path / "a.st"
    with _io.atomic_open(target, replace=False) as f:
        f.write(b"ours")
    assert target.read_bytes() == b"ours" and [p.name for p in tmp_path.iterdir()] == ["a.st"]

    def no_links(src, dst, **kw):
        raise OSError(errno.EACCES, "Permission denied", str(src))  # some FUSE/SMB mounts answer EACCES

    monkeypatch.setattr(os, "link", no_links)
    for swapped_in in (False, True):

        def interrupted(src, dst, swapped_in=swapped_in):
            if swapped_in:  # someone replaced our reservation meanwhile
                Path(dst).unlink()
                Path(dst).write_bytes(b"THEIRS")
            raise KeyboardInterrupt

        monkeypatch.setattr(os, "replace", interrupted)
        target = tmp_path / f"b{int(swapped_in)}.st"
        with pytest.raises(KeyboardInterrupt), _io.atomic_open(target, replace=False) as f:
            f.write(b"ours")
        monkeypatch.setattr(os, "replace", real_replace)
        assert (target.read_bytes() == b"THEIRS") if swapped_in else not target.exists()
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
