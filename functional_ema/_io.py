"""File plumbing for checkpoints: atomic writes, a streaming safetensors writer, checked reads.

Nothing here unpickles. Files are safetensors (an 8-byte little-endian header length, a JSON header,
then the raw tensor bytes), written by :class:`StreamingWriter` one tensor at a time, so a file of
any size is written with no more extra memory than one tensor's host copy, and read back either
whole-tensor straight into a destination buffer (:meth:`SafetensorsFile.read_into`) or slice by slice
through ``safetensors.safe_open(...).get_slice`` (:meth:`SafetensorsFile.read_range`). A file of a
:class:`functional_ema._storage.Storage` (an object store) is read the same way with ranged reads of exactly
the bytes needed (:meth:`Storage.read_range <functional_ema._storage.Storage.read_range>`), every check alike.

Integrity: every tensor's bytes are covered by checksums over fixed :data:`CHUNK_BYTES` chunks, so a
slice can be verified by reading only the chunks it touches. The writer returns them; the caller
stores them in its manifest and hands them back to the reader. New files use xxHash's XXH3-64
(:data:`CHECKSUM`, several times faster than CRC-32 and hashed with the GIL released); CRC-32
(zlib) is still read, for files of checkpoint format 1.

Atomicity (:func:`atomic_open`, :func:`atomic_write_bytes`): write to a temporary file in the target
directory, flush and ``os.fsync`` it, ``os.replace`` it over the target, then ``os.fsync`` the
directory. A reader sees the old file or the new one, never a mix, including after a crash.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import xxhash

from . import _memory

if TYPE_CHECKING:
    from safetensors import safe_open


class Storage(Protocol):
    """What a :class:`SafetensorsFile` reads an object-store file through: the part of
    :class:`functional_ema._storage.Storage` it uses (named here so that ``_storage``, which writes
    through this module, is not imported by it)."""

    def describe(self, rel: str) -> str: ...

    def size(self, rel: str) -> int: ...

    def read_range(self, rel: str, offset: int, length: int) -> bytes: ...


__all__ = [
    "CHUNK_BYTES",
    "CHECKSUM",
    "CHECKSUMS",
    "chunk_checksums",
    "FormatError",
    "PickleFileError",
    "TruncatedFileError",
    "ChecksumError",
    "TensorEntry",
    "SafetensorsFile",
    "StreamingWriter",
    "atomic_open",
    "atomic_write_bytes",
    "fsync_dir",
    "chunk_crcs",
    "looks_like_pickle",
    "tmp_name",
    "is_tmp_name",
]

CHUNK_BYTES = 4 << 20  # checksum granularity; a multiple of every dtype's size
_READ_BYTES = 1 << 20  # read (and hash) granularity: a piece stays in a core's L2 cache until hashed
#: Bytes one ranged request reads from a Storage (an object store): whole checksum chunks, so each request
#: is verified on its own; large enough that the request's latency is small beside its transfer.
_REMOTE_READ_BYTES = 4 * CHUNK_BYTES
# Checksum algorithms by the name recorded in manifests: each maps a buffer to an int.
CHECKSUMS: dict[str, Callable[[memoryview | bytes], int]] = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}
CHECKSUM = "xxh3_64"  # what new files use; "crc32" is for reading checkpoint format 1
_MAX_HEADER = 100 << 20  # safetensors' own limit
_TMP_MARK = ".tmp-"

if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian; so do we
    raise ImportError("functional_ema checkpoints need a little-endian host")

DTYPE_TO_STR: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
STR_TO_DTYPE = {v: k for k, v in DTYPE_TO_STR.items()}


class FormatError(ValueError):
    """A file is not a well-formed safetensors file (the message names the file and the problem)."""


class PickleFileError(FormatError):
    """A pickle / ``torch.save`` file was handed in where a safetensors file was expected."""


class TruncatedFileError(FormatError):
    """A file is shorter than its header (or its manifest) says."""


class ChecksumError(FormatError):
    """Bytes read back do not match the recorded checksum."""


# ------------------------------------------------------------------------------------------ atomic


def tmp_name(final: str | os.PathLike) -> Path:
    """A temporary sibling for one write of ``final`` (same directory, so ``os.replace`` is atomic).

    Unique per write, not per process: two writers of one file in one process (two threads, two savers)
    never share a temporary file, so neither can rename the other's half-written bytes into place.
    """
    final = Path(final)
    return final.with_name(f"{final.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(6)}")


def is_tmp_name(name: str) -> bool:
    return _TMP_MARK in name


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (created, renamed, removed files) durable."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(final: str | os.PathLike, *, replace: bool = True) -> Iterator[IO[bytes]]:
    """Open a temporary file that replaces ``final`` atomically when the block exits cleanly.

    On exit the file is flushed, fsynced, ``os.replace``-d over ``final`` and the directory is
    fsynced. On an exception the temporary file is removed and ``final`` is left as it was.
    ``replace=False`` commits only if ``final`` does not exist at that moment (:func:`_commit_new`): a file that
    appeared there while the block ran (another process's, a user's) is kept, the temporary file removed, and
    ``FileExistsError`` names ``final``. Checkpoint saves keep the default: they replace their own files by design.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> with atomic_open(os.path.join(d, "x.txt")) as f:
        ...     _ = f.write(b"hello")
        >>> open(os.path.join(d, "x.txt"), "rb").read()
        b'hello'
    """
    final = Path(final)
    tmp = tmp_name(final)
    f = open(tmp, "wb")  # noqa: SIM115 - closed below on success and failure alike (this is the context manager)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if replace:
            os.replace(tmp, final)
        else:
            _commit_new(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):  # on a full disk close() fails too (flushing its buffer)
            f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(final.parent)


def _commit_new(tmp: Path, final: Path) -> None:
    """Move the complete ``tmp`` to ``final`` only if no file is there, atomically: a hard link fails with
    ``EEXIST`` when ``final`` exists (``os.replace`` would silently drop that file), then ``tmp`` is unlinked.
    ``FileExistsError`` naming ``final`` when something is there (``tmp`` is removed by the caller)."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        if _same_file(tmp, final):  # NFS: a retransmitted link that had succeeded answers EEXIST (open(2)'s advice)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        raise _appeared(final) from None
    except OSError:
        # No hard links here (EPERM on FAT; FUSE, SMB mounts answer various errnos, EACCES too): the exclusive open
        # below reproduces a genuine error (EACCES, EROFS, ENOSPC) itself.
        # No hard links here (FAT/exFAT, some FUSE and SMB mounts): reserve the name with O_EXCL, then rename over
        # the reservation. Two writers of ours never both commit; only a writer that opens ``final`` without
        # O_EXCL in the microseconds between the two calls can still be replaced (not the whole run, as before).
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise _appeared(final) from None
        try:
            reserved = os.fstat(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, final)
        except BaseException:  # Ctrl-C too: our empty reservation is not left behind as a "result"
            with contextlib.suppress(OSError):
                now = os.lstat(final)
                if (now.st_dev, now.st_ino, now.st_size) == (reserved.st_dev, reserved.st_ino, 0):  # still ours
                    os.unlink(final)
            raise
        return
    with contextlib.suppress(OSError):  # committed: a leftover temporary name is recognisable (is_tmp_name)
        os.unlink(tmp)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _appeared(final: Path) -> FileExistsError:
    return FileExistsError(  # one argument: str() is the message alone, as the CLI prints it
        f"refusing to replace {final}: it appeared while this file was being written (another process or a user "
        "created it), and is left as it is; nothing was written. Pass --overwrite (overwrite=True) to replace it, or "
        "choose another name"
    )


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``final`` atomically (see :func:`atomic_open`)."""
    with atomic_open(final) as f:
        f.write(data)


# --------------------------------------------------------------------------------------- checksums


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return t.detach().reshape(-1).view(torch.uint8).numpy().data  # the array's own buffer, as memoryview(array)


_POOL: ThreadPoolExecutor | None = None


#: Environment variable that sets :func:`io_threads` (a positive int), e.g. where ranks are pinned to cores.
IO_THREADS_ENV = "FUNCTIONAL_EMA_IO_THREADS"


def io_threads(shared: bool = True) -> int:
    """Threads one process reads and hashes checkpoint files with, 1 to 4; :data:`IO_THREADS_ENV`
    overrides.

    ``shared=True`` (saves and loads, which every rank runs at once): this process's share of the
    CPUs it may run on, among the ranks of its node (``LOCAL_WORLD_SIZE``, set by torchrun and
    ``accelerate launch``). ``shared=False`` (the offline tools, alone): every CPU it may run on.

    Why a share: when every rank of a node reads at once, more threads than cores only add
    contention (docs/performance.md has the figures).
    """
    env = os.environ.get(IO_THREADS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"environment variable {IO_THREADS_ENV} must be a positive integer, got {env!r}")
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        cpus = os.cpu_count() or 1
    local_ranks = 1
    if shared:
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_ranks = 1
    return max(1, min(4, cpus // local_ranks))


def _pool() -> ThreadPoolExecutor:
    """Threads for checksums and reads (xxhash, zlib and file reads release the GIL), made on first use."""
    global _POOL  # one pool per process, shared by readers and writers (a cache, not state)
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=io_threads(shared=False), thread_name_prefix="fe_io")
    return _POOL


def _forget_pool() -> None:  # a forked child does not inherit the threads
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _chunks(buf: memoryview, chunk_bytes: int) -> list[memoryview]:
    return [buf[i : i + chunk_bytes] for i in range(0, len(buf), chunk_bytes)]


def checksum_fn(algo: str) -> Callable[[memoryview | bytes], int]:
    """The function computing checksum ``algo`` ("xxh3_64" or "crc32") of a buffer, as an int."""
    try:
        return CHECKSUMS[algo]
    except KeyError:
        raise FormatError(f"unknown checksum algorithm {algo!r} (this version knows {sorted(CHECKSUMS)})") from None


class _Incremental:
    """Checksum ``algo`` of bytes fed piece by piece; equals ``checksum_fn(algo)`` of their concatenation."""

    __slots__ = ("_h", "_crc")

    def __init__(self, algo: str) -> None:
        checksum_fn(algo)  # unknown names fail here
        self._h = xxhash.xxh3_64() if algo == "xxh3_64" else None
        self._crc = 0

    def update(self, piece: memoryview) -> None:
        if self._h is not None:
            self._h.update(piece)
        else:
            self._crc = zlib.crc32(piece, self._crc)

    def value(self) -> int:
        return self._h.intdigest() if self._h is not None else self._crc


def format_checksum(algo: str, value: int) -> str:
    """``value`` as fixed-width hex (8 digits for crc32, 16 for xxh3_64), as stored in manifests."""
    return f"{value:0{8 if algo == 'crc32' else 16}x}"


def chunk_checksums(buf: memoryview | bytes, chunk_bytes: int = CHUNK_BYTES, algo: str = CHECKSUM) -> list[int]:
    """Checksum ``algo`` of each ``chunk_bytes`` chunk of ``buf`` (the last one may be shorter; none if empty)."""
    fn = checksum_fn(algo)
    chunks = _chunks(memoryview(buf), chunk_bytes)
    if len(chunks) < 2 or io_threads() < 2:
        return [fn(c) for c in chunks]
    return list(_pool().map(fn, chunks))


def chunk_crcs(buf: memoryview | bytes, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """CRC-32 of each ``chunk_bytes`` chunk of ``buf`` (checkpoint format 1's checksums)."""
    return chunk_checksums(buf, chunk_bytes, "crc32")


# ------------------------------------------------------------------------------------------ writer


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file: ``dtype``, ``shape`` and its byte range in the data area."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _header_bytes(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, TensorEntry]]:
    header: dict = {"__metadata__": dict(metadata)}
    table: dict[str, TensorEntry] = {}
    offset = 0
    for key, dtype, shape in entries:
        if key in table or key == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor name {key!r}")
        if dtype not in DTYPE_TO_STR:
            raise TypeError(f"tensor {key!r}: dtype {dtype} cannot be stored in safetensors here")
        dims = tuple(int(s) for s in shape)
        nbytes = math.prod(dims) * dtype.itemsize
        header[key] = {"dtype": DTYPE_TO_STR[dtype], "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
        table[key] = TensorEntry(dtype, dims, offset, offset + nbytes)
        offset += nbytes
    for k, v in header["__metadata__"].items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str; got {k!r}: {type(v).__name__}")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw, table


#: Metadata of a file that carries its own checksums (the consolidated outputs: ``consolidate_to_file``,
#: ``posthoc_to_file``, ``consolidate --dcp``, a callback's ``export_path``): every tensor's chunk
#: checksums, in the file's tensor order, as one hex string; and ``<algo>/<chunk bytes>``.
SELF_CHECKSUMS = "content_checksums"
SELF_CHECKSUMS_ALGO = "content_checksum_algo"


def _chunk_count(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


def self_checksums(st: SafetensorsFile) -> dict[str, list[int]] | None:
    """The checksums a file carries in its own metadata (:data:`SELF_CHECKSUMS`): tensor -> chunk checksums, for
    :meth:`SafetensorsFile.read_into`; ``None`` for a file written without them.

    Raises:
        FormatError: the fields are malformed (another algorithm or chunk size, a wrong length, not hex).
    """
    value = st.metadata.get(SELF_CHECKSUMS)
    if value is None:
        return None
    algo = st.metadata.get(SELF_CHECKSUMS_ALGO)
    if algo != f"{CHECKSUM}/{CHUNK_BYTES}":
        raise FormatError(f"{st.path}: metadata {SELF_CHECKSUMS_ALGO!r} is {algo!r}, expected {CHECKSUM}/{CHUNK_BYTES}")
    order = sorted(st.tensors, key=lambda n: st.tensors[n].start)
    counts = [_chunk_count(st.tensors[n].end - st.tensors[n].start) for n in order]
    if len(value) != 16 * sum(counts) or not all(c in "0123456789abcdef" for c in value):
        raise FormatError(
            f"{st.path}: metadata {SELF_CHECKSUMS!r} is not {sum(counts)} hex checksums of 16 digits (one per "
            f"{CHUNK_BYTES >> 20} MiB of each tensor): the file is corrupted"
        )
    out, pos = {}, 0
    for name, count in zip(order, counts):
        out[name] = [int(value[pos + 16 * i : pos + 16 * (i + 1)], 16) for i in range(count)]
        pos += 16 * count
    return out


class StreamingWriter:
    """Write a safetensors file header first, then one tensor at a time, atomically.

    All names, dtypes and shapes are declared up front, so the header (with every offset) is written
    before any data; :meth:`write` then appends the tensors in the declared order. Peak extra memory
    is one tensor's host copy (none for contiguous CPU tensors). :meth:`commit` fsyncs and renames
    the temporary file over ``path``; leaving the ``with`` block through an exception removes it.
    ``sink``: another atomic destination instead (a ``Storage.writer(rel)``, e.g. an S3 multipart upload),
    entered here, exited cleanly by :meth:`commit` (which publishes it) or with an error by :meth:`abort`
    (which publishes nothing); ``path`` then only names the file in messages and records.
    ``replace=False``: :meth:`commit` keeps a file that appeared at ``path`` meanwhile (see :func:`atomic_open`).

    Example:
        >>> import tempfile, os, torch
        >>> from safetensors.torch import load_file
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> with StreamingWriter(path, [("w", torch.float32, (2, 2))], {"note": "x"}) as w:
        ...     _ = w.write("w", torch.eye(2))
        ...     _ = w.commit()
        >>> load_file(path)["w"]
        tensor([[1., 0.],
                [0., 1.]])
    """

    def __init__(
        self,
        path: str | os.PathLike,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
        *,
        checksums: bool = True,
        algo: str = CHECKSUM,
        self_checksums: bool = False,
        sink: contextlib.AbstractContextManager[IO[bytes]] | None = None,
        replace: bool = True,
    ) -> None:
        if sink is not None and self_checksums:  # they are written over the header's placeholder: a seek
            raise ValueError("StreamingWriter: self_checksums need a local file, not a stream (sink=)")
        self.path = Path(path)
        self.checksums = checksums or self_checksums
        self.algo = algo
        self._hash = checksum_fn(algo)
        metadata = dict(metadata or {})
        self._self_at = -1
        if self_checksums:  # a placeholder of the exact length, overwritten at commit (the header comes first)
            if algo != CHECKSUM:
                raise ValueError(f"self_checksums are {CHECKSUM}, not {algo}")
            chunks = sum(_chunk_count(math.prod(int(d) for d in shape) * dt.itemsize) for _, dt, shape in entries)
            metadata[SELF_CHECKSUMS] = "x" * (16 * chunks)
            metadata[SELF_CHECKSUMS_ALGO] = f"{CHECKSUM}/{CHUNK_BYTES}"
        self._header, self.table = _header_bytes(entries, metadata)
        if self_checksums:
            self._self_at = self._header.index(f'"{SELF_CHECKSUMS}":"'.encode()) + len(SELF_CHECKSUMS) + 4
        self._order = list(self.table)
        self._next = 0
        self._cm = atomic_open(self.path, replace=replace) if sink is None else sink
        self._f = self._cm.__enter__()
        self._f.write(self._header)
        self.header_checksum = self._hash(self._header)  # ``algo`` of the 8-byte prefix + JSON header
        self.crcs: dict[str, list[int]] = {}  # per tensor, its chunk checksums (``algo``)
        self._done = False

    @property
    def size(self) -> int:
        """Total file size once every tensor is written."""
        return len(self._header) + (self.table[self._order[-1]].end if self._order else 0)

    def write(self, key: str, tensor: torch.Tensor) -> list[int]:
        """Append ``tensor`` (must be the next declared one, same dtype and numel); return its chunk
        checksums (``algo``; empty with ``checksums=False``)."""
        if self._next >= len(self._order) or self._order[self._next] != key:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing (all written)"
            raise ValueError(
                f"{self.path.name}: tensors must be written in declared order; expected {expected!r}, got {key!r}"
            )
        entry = self.table[key]
        if tensor.dtype != entry.dtype or tensor.numel() != entry.numel:
            raise ValueError(
                f"{self.path.name}: tensor {key!r} was declared {entry.dtype} with {entry.numel} elements, "
                f"got {tensor.dtype} with {tensor.numel()}"
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        chunks = _chunks(_byte_view(t), CHUNK_BYTES)
        pending = _pool().map(self._hash, chunks) if self.checksums and len(chunks) > 1 else None  # overlaps the writes
        for piece in chunks:
            self._f.write(piece)
        crcs = (list(pending) if pending is not None else [self._hash(c) for c in chunks]) if self.checksums else []
        self.crcs[key] = crcs
        self._next += 1
        return crcs

    def commit(self) -> int:
        """Finish: fsync, rename over the target, fsync the directory. Returns the file size."""
        if self._next != len(self._order):
            raise ValueError(f"{self.path.name}: {len(self._order) - self._next} declared tensors were never written")
        if self._self_at >= 0:
            value = "".join(format_checksum(self.algo, v) for key in self._order for v in self.crcs[key])
            self._f.flush()
            os.pwrite(self._f.fileno(), value.encode(), self._self_at)
        self._done = True
        self._cm.__exit__(None, None, None)
        return self.size

    def abort(self) -> None:
        if not self._done:
            self._done = True
            with contextlib.suppress(Exception):
                self._cm.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None or not self._done:
            self.abort()


def write_tensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *, replace: bool = True
) -> int:
    """``tensors`` (whole, in memory) into the safetensors file ``path``, atomically, carrying its own checksums
    (:data:`SELF_CHECKSUMS`); the size written. Tied aliases are written as separate tensors. ``replace=False``:
    a file that appeared at ``path`` while writing is kept (``FileExistsError``, see :func:`atomic_open`)."""
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with StreamingWriter(path, entries, metadata, self_checksums=True, replace=replace) as w:
        for n, t in tensors.items():
            w.write(n, t.detach().reshape(-1))
        return w.commit()


# ------------------------------------------------------------------------------------------ reader


def looks_like_pickle(head: bytes) -> bool:
    """True for ``torch.save`` zip archives and raw pickles (protocol 2+)."""
    return head[:4] == b"PK\x03\x04" or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


_PICKLE_HINT = (
    "functional_ema never unpickles files (loading a pickle can run arbitrary code); EMA checkpoints "
    "are safetensors files named ema_rank_*.safetensors beside an ema_manifest.json: pass the "
    "checkpoint directory (the one holding 'latest' and the tag folders)"
)


class SafetensorsFile:
    """A validated safetensors file: header parsed and checked against the file size, nothing loaded.

    Args:
        path: the file: a local path, or ``(storage, rel)``, a file of a
            :class:`functional_ema._storage.Storage` (an object store), read with ranged reads of exactly
            the bytes needed (the prefix, the header, then only the tensor bytes asked for). The checks
            are the same for both.
        expected_size: the size recorded elsewhere (a manifest); a shorter file is reported as
            truncated, a different one as modified.

    Raises:
        PickleFileError: the file is a pickle / ``torch.save`` archive.
        TruncatedFileError: the file is shorter than its header or ``expected_size`` says.
        FormatError: anything else that makes it not a safetensors file.
    """

    def __init__(self, path: str | os.PathLike | tuple[Storage, str], expected_size: int | None = None) -> None:
        # The byte source: a local file (read with positional reads on one descriptor), or a file of a
        # Storage (an object store: every read is one ranged request of exactly the bytes asked for).
        self._store: Storage | None = None
        self._rel = ""
        self.path: Path | str
        if isinstance(path, tuple):
            self._store, self._rel = path
            self.path = self._store.describe(self._rel)
        else:
            self.path = Path(path)
        try:
            size, head, raw, n = self._read_header()
        except FileNotFoundError:
            raise
        except EOFError as e:  # an object replaced by a shorter one between its size and its read
            raise TruncatedFileError(f"{self.path} is truncated: {e}") from None
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read ({e})") from e
        if len(raw) < n:
            raise TruncatedFileError(f"{self.path} is truncated: {size} bytes, but its header alone needs {8 + n}")
        self.header_size = 8 + n
        self._header_raw = head + raw
        header = self._parse_header(head, raw)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise FormatError(f"{self.path}: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.tensors: dict[str, TensorEntry] = {key: self._entry(key, info) for key, info in header.items()}
        self.data_size = self._check_spans()
        self.size = self.header_size + self.data_size
        self._check_size(size, expected_size)
        self._fh: IO[bytes] | None = None
        self._st: safe_open | None = None
        self._lock = threading.Lock()  # read_into and read_range may be called from several threads

    def _parse_header(self, head: bytes, raw: bytes) -> dict:
        """The JSON header as a dict; a pickle file, bad JSON or a nesting too deep named as such."""
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except RecursionError:
            raise FormatError(
                f"{self.path}: the safetensors header is nested too deeply; the file is corrupted"
            ) from None
        except ValueError as e:
            if looks_like_pickle(head):
                raise PickleFileError(
                    f"{self.path} is a pickle / torch.save file, not safetensors. {_PICKLE_HINT}"
                ) from None
            raise FormatError(
                f"{self.path}: the safetensors header is not valid JSON ({e}); the file is corrupted"
            ) from None
        return header

    def _entry(self, key: str, info: Any) -> TensorEntry:
        """One header entry, checked: known dtype, a shape of non-negative ints, offsets that fit the shape."""
        field = _bad_entry_field(info)
        if field is not None:
            shown = repr(info.get(field) if isinstance(info, dict) else info)
            raise FormatError(
                f"{self.path}: header entry of tensor {key!r}: field {field!r} is invalid "
                f"({shown[:80] + '...' if len(shown) > 80 else shown}); the file is corrupted"
            )
        dtype, shape = STR_TO_DTYPE[info["dtype"]], tuple(info["shape"])
        start, end = info["data_offsets"]
        entry = TensorEntry(dtype, shape, start, end)
        if end - start != entry.numel * dtype.itemsize or start < 0:
            raise FormatError(
                f"{self.path}: header entry of tensor {key!r}: its fields 'data_offsets' [{start}, {end}) and 'shape' "
                f"{list(shape)[:8]} ({dtype}) disagree; the file is corrupted"
            )
        return entry

    def _check_spans(self) -> int:
        """The data's size, once the tensors are seen to tile it exactly (no gap, no overlap)."""
        pos = 0
        for start, end, key in sorted((e.start, e.end, k) for k, e in self.tensors.items()):
            if start != pos:
                raise FormatError(
                    f"{self.path}: tensor {key!r} starts at byte {start} of the data, expected {pos} (gap or overlap)"
                )
            pos = end
        return pos

    def _check_size(self, size: int, expected_size: int | None) -> None:
        """The file's ``size`` is what its header describes and (if given) what the manifest records."""
        if expected_size is not None and size < expected_size:
            raise TruncatedFileError(f"{self.path} is truncated: {size} bytes, expected {expected_size}")
        if size < self.size:
            raise TruncatedFileError(f"{self.path} is truncated: {size} bytes, its header describes {self.size}")
        if size != self.size or (expected_size is not None and size != expected_size):
            raise FormatError(
                f"{self.path} has {size} bytes, expected {expected_size if expected_size is not None else self.size}: "
                "it was modified after it was written"
            )

    def _read_header(self) -> tuple[int, bytes, bytes, int]:
        """(file size, its first 8 bytes, the JSON header as far as the file holds it, the header's length);
        the header is read only once its length field is checked (an out-of-range one is never fetched)."""
        if self._store is None:
            size = Path(self.path).stat().st_size
            with open(self.path, "rb") as f:
                return self._header_from(lambda off, n: f.read(n), size)
        store, rel = self._store, self._rel
        size = store.size(rel)
        return self._header_from(lambda off, n: store.read_range(rel, off, max(0, min(n, size - off))), size)

    def _header_from(self, read: Callable[[int, int], bytes], size: int) -> tuple[int, bytes, bytes, int]:
        """The prefix and header through ``read(offset, at_most)``, the prefix checked as a safetensors file's."""
        head = read(0, 8)
        if len(head) < 8:
            raise self._bad_head(head, size, "it is shorter than the 8-byte safetensors prefix")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or n < 2:  # the value is not quoted: these are the file's first bytes
            raise self._bad_head(head, size, "its 8-byte header length field is out of range")
        return size, head, read(8, n), n

    def header_checksum(self, algo: str = CHECKSUM) -> int:
        """Checksum ``algo`` of the 8-byte prefix and the JSON header, as :class:`StreamingWriter` records it."""
        return checksum_fn(algo)(self._header_raw)

    def _bad_head(self, head: bytes, size: int, why: str) -> FormatError:
        if looks_like_pickle(head):
            return PickleFileError(f"{self.path} is a pickle / torch.save file, not safetensors. {_PICKLE_HINT}")
        if size < 8:
            return TruncatedFileError(f"{self.path} is truncated ({size} bytes): {why}")
        return FormatError(f"{self.path} is not a safetensors file: {why}")

    # -- reading

    def _file(self) -> IO[bytes]:
        with self._lock:
            if self._fh is None:
                self._fh = open(self.path, "rb", buffering=0)  # noqa: SIM115 - kept for later reads; close() closes it
            return self._fh

    def _safe_open(self) -> safe_open:
        with self._lock:
            if self._st is None:
                from safetensors import safe_open

                self._st = safe_open(os.fspath(self.path), framework="pt")
            return self._st

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._st = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(
        self,
        key: str,
        dst: torch.Tensor,
        crcs: Sequence[int] | None = None,
        context: str = "",
        algo: str = CHECKSUM,
        start: int = 0,
    ) -> None:
        """Read tensor ``key`` into ``dst`` (same dtype), verifying ``crcs`` if given: the whole tensor, or
        with ``start`` its flattened elements ``[start, start + dst.numel())``.

        ``crcs`` are the tensor's chunk checksums computed with ``algo``; a part read with them must
        cover whole checksum chunks (start and end on a :data:`CHUNK_BYTES` boundary, or the end at
        the tensor's end), so every byte read is verified, each chunk by the thread that reads it
        (several threads read one large tensor's parts at once). The bytes go straight from
        the file into ``dst``'s memory when it is a contiguous CPU tensor (no intermediate copy);
        otherwise through one host buffer. Each checksum chunk is read in :data:`_READ_BYTES` pieces,
        each hashed by the reading thread right after it is read, while it is still in the CPU cache
        (steadier than hashing large chunks on a thread pool once several ranks share the cores).
        Positional reads, so several threads may
        read one file at once. On a mismatch ``dst`` holds unchecked bytes.
        """
        entry = self.tensors[key]
        whole = start == 0 and dst.numel() == entry.numel
        if dst.dtype != entry.dtype or not (whole or 0 <= start <= start + dst.numel() <= entry.numel):
            part = "" if whole else f" elements [{start}, {start + dst.numel()})"
            raise FormatError(
                f"{self.path}: tensor {key!r} is {entry.dtype}{list(entry.shape)}; cannot read it{part} into "
                f"{dst.dtype}{list(dst.shape)}"
            )
        skip = start * entry.dtype.itemsize  # bytes of the tensor before the part read
        if crcs is not None and not whole:
            end = skip + dst.numel() * entry.dtype.itemsize
            if skip % CHUNK_BYTES or (end % CHUNK_BYTES and end != entry.end - entry.start):
                raise ValueError(f"read_into: bytes [{skip}, {end}) of {key!r} are not whole checksum chunks")
        direct = dst.device.type == "cpu" and dst.is_contiguous()
        host = dst if direct else _memory.empty(dst.shape, dtype=dst.dtype)
        buf = _byte_view(host)
        want = (
            _expected(self.path, key, buf, skip // CHUNK_BYTES, crcs, context) if crcs is not None else None
        )  # a wrong count fails before any read
        base = self.header_size + entry.start + skip
        if self._store is not None:
            self._fill_from_store(key, buf, base, skip, want, context, algo)
            if not direct:
                dst.copy_(host)
            return
        fd = self._file().fileno()
        for i, lo in enumerate(range(0, len(buf), CHUNK_BYTES)):
            chunk = buf[lo : lo + CHUNK_BYTES]
            hasher = _Incremental(algo) if want is not None else None
            for plo in range(0, len(chunk), _READ_BYTES):
                piece = chunk[plo : plo + _READ_BYTES]
                got = 0
                while got < len(piece):  # positional reads: several threads may read one file at once
                    n = _pread_into(fd, piece[got:], base + lo + plo + got)
                    if not n:
                        raise TruncatedFileError(f"{self.path} is truncated: tensor {key!r} ends early")
                    got += n
                if hasher is not None:
                    hasher.update(piece)
            if hasher is not None and want is not None and hasher.value() != want[i]:
                raise _mismatch(self.path, key, skip + lo, len(chunk), hasher.value(), want[i], context, algo)
        if not direct:
            dst.copy_(host)

    def read_range(
        self,
        key: str,
        start: int,
        stop: int,
        crcs: Sequence[int] | None = None,
        context: str = "",
        algo: str = CHECKSUM,
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, via ``safe_open(...).get_slice``.

        With ``crcs`` (chunk checksums computed with ``algo``), the read widens to whole CRC chunks (at most one chunk more on each side),
        which are verified before the requested part is returned.
        """
        entry = self.tensors[key]
        if not 0 <= start <= stop <= entry.numel:
            raise IndexError(f"{self.path}: range [{start}, {stop}) outside tensor {key!r} of {entry.numel} elements")
        if start == stop:
            return torch.empty(0, dtype=entry.dtype)
        lo, hi = start, stop
        itemsize = entry.dtype.itemsize
        per_chunk = CHUNK_BYTES // itemsize
        if crcs is not None:
            lo = (start // per_chunk) * per_chunk
            hi = min(-(-stop // per_chunk) * per_chunk, entry.numel)
        if self._store is not None:  # exactly the bytes of elements [lo, hi), one ranged read
            t = torch.empty(hi - lo, dtype=entry.dtype)
            self._fill_from_store(key, _byte_view(t), self.header_size + entry.start + lo * itemsize, lo * itemsize)
        else:
            sl = self._safe_open().get_slice(key)
            if len(entry.shape) == 1:
                t = sl[lo:hi]
            else:  # get_slice indexes dimensions; take whole rows and flatten
                row = math.prod(entry.shape[1:]) or 1
                r0, r1 = lo // row, -(-hi // row)
                t = sl[r0:r1].reshape(-1)[lo - r0 * row : hi - r0 * row]
            t = t.contiguous()
        if crcs is not None:
            _verify_now(self.path, key, _byte_view(t), lo // per_chunk, crcs, context, algo)
        return t[start - lo : stop - lo]

    def _fill_from_store(
        self,
        key: str,
        buf: memoryview,
        base: int,
        skip: int,
        want: list[int] | None = None,
        context: str = "",
        algo: str = CHECKSUM,
    ) -> None:
        """``buf`` from the Storage file's bytes at ``base`` (byte ``skip`` of tensor ``key``), in ranged reads
        of :data:`_REMOTE_READ_BYTES`, each checksum chunk verified against ``want`` as soon as it is read."""
        if self._store is None:  # pragma: no cover - only called for a Storage source
            raise AssertionError("not a Storage file")
        fn = checksum_fn(algo) if want is not None else None
        for glo in range(0, len(buf), _REMOTE_READ_BYTES):
            group = buf[glo : glo + _REMOTE_READ_BYTES]
            try:
                group[:] = self._store.read_range(self._rel, base + glo, len(group))
            except EOFError as e:
                raise TruncatedFileError(f"{self.path} is truncated: tensor {key!r} ends early ({e})") from None
            except FileNotFoundError:
                raise TruncatedFileError(
                    f"{self.path} is gone: it was removed while tensor {key!r} was read from it"
                ) from None
            if fn is None or want is None:
                continue
            for lo in range(0, len(group), CHUNK_BYTES):
                got, i = fn(group[lo : lo + CHUNK_BYTES]), (glo + lo) // CHUNK_BYTES
                if got != want[i]:
                    n = min(CHUNK_BYTES, len(group) - lo)
                    raise _mismatch(self.path, key, skip + glo + lo, n, got, want[i], context, algo)


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Read into ``buf`` from ``offset`` without moving a shared file position; bytes read (0 at EOF)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], offset)
    data = os.pread(fd, len(buf), offset)  # pragma: no cover - platforms without preadv (one extra copy)
    buf[: len(data)] = data
    return len(data)


def _bad_entry_field(info: Any) -> str | None:
    """The first invalid field of a safetensors header entry (None if valid): a known dtype, a shape
    of ints >= 0, two byte offsets (ints >= 0). Checked before any size is computed from them."""
    if not isinstance(info, dict):
        return "entry"
    if not isinstance(info.get("dtype"), str) or info["dtype"] not in STR_TO_DTYPE:
        return "dtype"
    shape = info.get("shape")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(s) is int and 0 <= s < 2**62 for s in shape)):
        return "shape"
    offsets = info.get("data_offsets")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int and 0 <= x < 2**62 for x in offsets)
    ):
        return "data_offsets"
    return None


def _expected(
    path: str | os.PathLike[str], key: str, buf: memoryview, first_chunk: int, crcs: Sequence[int], context: str
) -> list[int]:
    n = -(-len(buf) // CHUNK_BYTES)
    want = list(crcs[first_chunk : first_chunk + n])
    if len(want) != n:
        raise ChecksumError(
            f"{path}: tensor {key!r} has {len(crcs)} recorded checksum chunks, which does not fit its size: the file "
            f"or its manifest was modified {context}".rstrip()
        )
    return want


def _mismatch(
    path: str | os.PathLike[str], key: str, lo: int, n: int, got: int, want: int, context: str, algo: str
) -> ChecksumError:
    return ChecksumError(
        f"{path}: checksum mismatch in tensor {key!r}, bytes {lo}..{lo + n} of the tensor: {algo} "
        f"{format_checksum(algo, got)}, recorded {format_checksum(algo, want)}. The file is corrupted: restore it from "
        f"a copy or load an earlier tag {context}".rstrip()
    )


def _verify_now(
    path: str | os.PathLike[str],
    key: str,
    buf: memoryview,
    first_chunk: int,
    crcs: Sequence[int],
    context: str = "",
    algo: str = CHECKSUM,
) -> None:
    want = _expected(path, key, buf, first_chunk, crcs, context)
    fn = checksum_fn(algo)
    got = [fn(c) for c in _chunks(buf, CHUNK_BYTES)]  # in this thread: it may be one of the pool's
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            lo = (first_chunk + i) * CHUNK_BYTES
            raise _mismatch(path, key, lo, min(CHUNK_BYTES, len(buf) - i * CHUNK_BYTES), g, w, context, algo)
