"""Files other tools wrote, read as hostile input: one reader, one error (:class:`ForeignFileError`).

A ``--like`` folder's ``config.json``, weight index, ``adapter_config.json`` and safetensors files are
parsed here and nowhere else, with the same checks as the library's own files (``_io.SafetensorsFile``
for weights: header bounds, offsets, no pickle). Every failure is one :class:`ForeignFileError` naming
the file and the field; no ``TypeError``, ``KeyError``, ``RecursionError`` or safetensors error escapes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import _io
from .._checkpoint.errors import ForeignFileError

__all__ = [
    "MAX_JSON_BYTES",
    "read_json_object",
    "read_index",
    "read_weights_header",
    "plain_file_name",
    "special_kind",
    "not_regular",
    "copy_regular_file",
    "open_regular",
    "open_weights",
]

#: A model folder's JSON files are kilobytes (an index of 100k tensors is a few MB); larger is not one of them.
MAX_JSON_BYTES = 64 * 2**20


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """``path`` parsed as one JSON object (UTF-8, at most :data:`MAX_JSON_BYTES`).

    Raises:
        ForeignFileError: missing, not a regular file (checked on the descriptor read), unreadable, too large, not
            UTF-8, not JSON, nested too deeply, or not an object.
    """
    try:  # checked on the descriptor read: a file swapped for a FIFO after its stat is refused, never waited on
        fd = open_regular(path, what)
    except ForeignFileError:  # (a ValueError too) named already
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError):  # ValueError: a NUL in the path
        raise ForeignFileError(f"{what}: {path} is not a regular file") from None
    except OSError as e:
        raise ForeignFileError(f"{what}: cannot read {path}: {e}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            size = os.fstat(fd).st_size
            raw = f.read(MAX_JSON_BYTES + 1) if size <= MAX_JSON_BYTES else b""
        except OSError as e:
            raise ForeignFileError(f"{what}: cannot read {path}: {e}") from None
    if size > MAX_JSON_BYTES or len(raw) > MAX_JSON_BYTES:  # (or grown since the fstat)
        raise ForeignFileError(
            f"{what}: {path} has {max(size, len(raw))} bytes, more than a model folder's JSON file holds"
        )
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ForeignFileError(f"{what}: {path} is nested too deeply to be a model folder's JSON file") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ForeignFileError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ForeignFileError(f"{what}: {path} must hold a JSON object, got {type(doc).__name__}")
    return doc


def plain_file_name(value: Any) -> bool:
    """A bare file name inside its folder: a non-empty string, no separator, not ``.``/``..``, no NUL."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and "/" not in value
        and "\\" not in value
        and "\x00" not in value
        and not os.path.isabs(value)
    )


def _mode_kind(mode: int) -> str | None:
    """What a file of ``mode`` is, in words, when it is not a regular file (``None`` when it is)."""
    if stat.S_ISREG(mode):
        return None
    for test, words in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return words
    return "not a file"


def special_kind(path: Path) -> str | None:
    """What ``path`` (a link followed) is when it exists and is not a regular file: ``"a FIFO"``, ``"a character
    device"``, ...; ``None`` for a regular file or nothing there. Only ``stat``: nothing is opened (opening a FIFO
    for reading waits for a writer)."""
    try:
        return _mode_kind(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def not_regular(path: Path, what: str, kind: str) -> ForeignFileError:
    """The refusal of a file the export would read that is a FIFO, a socket, a device or a folder."""
    return ForeignFileError(
        f"{what}: {path} is not a regular file ({kind}{', through a link' if path.is_symlink() else ''}): the export "
        "reads only regular files (a FIFO would block it, a device never end); give a folder of regular files, as "
        "save_pretrained writes it"
    )


def copy_regular_file(src: Path, dst: Path, what: str) -> None:
    """Copy the regular file ``src`` to ``dst``. ``src`` is opened without blocking (``O_NONBLOCK``: opening a FIFO
    waits for a writer) and checked on the descriptor opened, so a file replaced by a FIFO or a device after the
    folder was listed is refused naming it, never waited on or copied without end (``/dev/zero``).

    Raises:
        ForeignFileError: ``src`` is not a regular file, or cannot be read.
    """
    try:
        fd = open_regular(src, what)
    except ForeignFileError:  # (a ValueError too) named already
        raise
    except (OSError, ValueError) as e:
        raise ForeignFileError(f"{what}: cannot read {src}: {e}") from None
    with os.fdopen(fd, "rb") as f, open(dst, "xb") as out:
        shutil.copyfileobj(f, out, 2**20)


#: ``O_NONBLOCK``: opening a FIFO for reading waits for a writer; with it the open returns and the fstat refuses it.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path, what: str) -> int:
    """A descriptor of ``path`` for reading, opened only once ``stat`` sees a regular file (a device is never
    opened), without blocking, and checked again on the descriptor itself (``fstat``): a file swapped for a FIFO or
    a device between the ``stat`` and the open is refused naming it, never waited on. The descriptor is blocking
    again when returned (``O_NONBLOCK`` guards only the open). The caller closes it.

    Raises:
        ForeignFileError: ``path`` is a FIFO, a socket or a device (or a link to one).
        OSError: it cannot be opened (missing: ``FileNotFoundError``; a folder: ``IsADirectoryError``), each caller
            words it as it did before (a missing JSON file "is not a regular file").
    """
    kind = special_kind(path)
    if kind is not None and kind != "a folder":
        raise not_regular(path, what, kind)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        kind = _mode_kind(os.fstat(fd).st_mode)
        if kind == "a folder":
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if kind is not None:
            raise not_regular(path, what, kind)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Descriptor:
    """One descriptor of :func:`open_regular` as the byte source of an ``_io.SafetensorsFile`` (its ``Storage``
    interface: size, positional reads): the file checked is the file read, never reopened by its path."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def describe(self, rel: str) -> str:
        return str(self.path)

    def size(self, rel: str) -> int:
        return os.fstat(self.fd).st_size

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        parts, got = [], 0
        while got < length:
            part = os.pread(self.fd, length - got, offset + got)
            if not part:
                raise EOFError(f"{length - got} of {length} bytes at offset {offset} past the end of the file")
            parts.append(part)
            got += len(part)
        return b"".join(parts)


@contextlib.contextmanager
def open_weights(path: Path, what: str) -> Iterator[_io.SafetensorsFile]:
    """The safetensors file ``path`` of a foreign folder, its header validated, read through one descriptor of
    :func:`open_regular` (headers, tensors: no path reopened, no ``safe_open``), closed on exit.

    Raises:
        ForeignFileError: not a regular file, a pickle, truncated or corrupted (the header).
        OSError: it cannot be opened (missing, a folder, no permission): the caller names the file.
    """
    fd = open_regular(path, what)
    try:
        try:
            f = _io.SafetensorsFile((_Descriptor(path, fd), path.name))
        except (_io.FormatError, OSError) as e:
            raise ForeignFileError(f"{what}: {path}: {e}") from None
        yield f
    finally:
        os.close(fd)


def read_weights_header(path: Path, what: str) -> dict[str, _io.TensorEntry]:
    """The tensors (name -> dtype, shape, offsets) of the safetensors file ``path``, validated, nothing loaded.

    Raises:
        ForeignFileError: missing, not a regular file (a FIFO, a device: never opened), a pickle, truncated,
            corrupted, or a dtype this library cannot read.
    """
    try:
        with open_weights(path, what) as f:
            return dict(f.tensors)
    except ForeignFileError:  # (a ValueError too) named already
        raise
    except (OSError, ValueError) as e:  # FileNotFoundError included; ValueError: a NUL in the path
        raise ForeignFileError(f"{what}: {path}: {e}") from None


def read_index(path: Path, what: str) -> dict[str, str]:
    """A ``*.safetensors.index.json``'s ``weight_map``: tensor name -> a file name in the index's folder.

    Raises:
        ForeignFileError: not a JSON object, no ``weight_map`` object, a name or value that is not a
            string, or a value that is not a plain file name in the folder (``../x``, an absolute path).
    """
    doc = read_json_object(path, what)
    wmap = doc.get("weight_map")
    if not isinstance(wmap, dict):
        got = "missing" if "weight_map" not in doc else type(wmap).__name__
        raise ForeignFileError(f"{what}: {path}: field 'weight_map' must be an object, got {got}")
    out: dict[str, str] = {}
    for name, file in wmap.items():
        if not plain_file_name(file) or not isinstance(name, str) or not name:
            raise ForeignFileError(
                f"{what}: {path}: field 'weight_map' entry {name!r}: {file!r} is not a file name in the index's "
                "folder (no paths: the export reads nothing outside --like)"
            )
        out[name] = file
    return out
