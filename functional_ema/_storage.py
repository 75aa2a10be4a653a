"""Where checkpoint files live: one small interface, a local folder or an fsspec filesystem behind it.

A :class:`Storage` is rooted at one location (a folder, or a URL such as ``s3://bucket/prefix``) and
takes paths relative to it (``"tag/ema_manifest.json"``). The guarantees, stated once here and checked
for each implementation by ``tests/test_storage.py`` (a local folder, ``memory://``, and a real S3
server started by the test):

* **Atomic publish.** :meth:`Storage.writer` streams a file; the file appears under its name only when
  the block exits cleanly, whole. A failure inside the block (or a crash, or a server killed mid-upload)
  publishes nothing: a reader sees the previous file of that name, or none. Local: a temporary sibling,
  fsynced, renamed over the name, the folder fsynced. fsspec: ``open(..., autocommit=False)`` then
  ``commit()`` (S3: a multipart upload completed at the end, or aborted), ``discard()`` on failure.
* **Durable on return.** Local: fsynced file and folder. Object stores: the upload's completion was
  acknowledged by the server.
* **Confinement.** Every relative path is checked before use: no empty, ``.`` or ``..`` component, no
  leading ``/``, no backslash; a local path whose real location (symlinks resolved) leaves the root is
  refused. Nothing is read or written outside the root.
* **Exact reads.** :meth:`Storage.read_range` returns exactly the bytes asked for, or raises naming the
  file and how many bytes it holds (a truncated or replaced file is never read short).
* **Listing.** :meth:`Storage.listdir` names the entries directly under a folder (none for a missing
  folder), read from the storage at the call (no listing cache carried between calls).

Not provided: a lock between processes on object stores (they have none that every server honours).
The checkpoint protocol does not need one there: one rank per folder commits, agreed over the process
group.

fsspec and its filesystem packages (``s3fs``, ``gcsfs``, ``adlfs``) are optional: imported only when a
URL is used (``pip install 'functional-ema[s3]'``).
"""

from __future__ import annotations

import abc
import contextlib
import io
import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any

from . import _io

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "file_url_path",
    "is_url",
    "normalize_url",
    "redact_url",
    "remove_tree",
    "storage_for",
]

#: ``scheme://...`` with a scheme other than these names an fsspec filesystem; ``local://`` is fsspec's other name
#: for ``file://``: both name a local folder, written through the local path's own atomic renames (fsspec's local
#: filesystem makes no parent folders, which an object store needs none of).
_LOCAL_SCHEMES = ("file", "local")
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is an fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://``, ...), not a path."""
    if not isinstance(location, str):
        return False
    m = _URL.match(location)
    return m is not None and m.group(1).lower() not in _LOCAL_SCHEMES


#: A relative path's first component that is a URL scheme and its colon (``s3:`` of ``s3:/bucket/run``), or that
#: starts so (``s3:bucket``). A scheme of one letter is a Windows drive (``C:``), never refused.
_SCHEME_PREFIX = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):([^/]*)")
#: The schemes refused: fsspec's usual filesystems. Another word and a colon (``run:2``, ``exp:/x``, ``best:``) may be
#: a folder's name, and is left alone.
_KNOWN_SCHEMES = re.compile(r"s3a?|gc?s|az|abfss?|adl|memory|file|local|hf|https?|(?:web)?hdfs|s?ftp|ssh|oci|oss|dbfs")


def refuse_mistyped_url(location: str) -> None:
    """``ValueError`` when a local path looks like a URL missing a slash (``s3:/bucket/run``, ``s3:bucket/run``,
    ``gs:/b/x``, ``file:/abs/dir``): ``Path`` would take it as a folder named ``s3:`` under the current directory,
    and a save would write there, silently. Names the URL most likely meant. Only fsspec's usual schemes
    (``_KNOWN_SCHEMES``): ``exp:/x`` may name a folder ``exp:``; an absolute path is never refused."""
    m = _SCHEME_PREFIX.match(location)
    if m is None or _URL.match(location) or not _KNOWN_SCHEMES.fullmatch(m.group(1).lower()):
        return
    scheme, rest = m.group(1), location[m.end(1) + 1 :].lstrip("/")
    meant = f"{scheme}:///{rest}" if scheme.lower() in _LOCAL_SCHEMES else f"{scheme}://{rest}"
    shown = redact_url(meant)
    given = f"{location!r}" if shown == meant else "the path given"  # a secret written into it stays out
    first = location.split("/", 1)[0] if shown == meant else f"{scheme}:"
    raise ValueError(
        f"{given} looks like a URL missing a slash, not a local path (a path would name a folder {first!r} under the "
        f"current directory): write {shown!r}; for a local folder or file of that name, give its absolute path"
    )


def file_url_path(location: str) -> str | None:
    """The local path a ``file://`` (or ``local://``) URL names (``file:///abs/dir`` or ``file://localhost/abs/dir``:
    ``/abs/dir``, percent-escapes decoded); ``None`` when ``location`` is not such a URL. ``ValueError`` for one that
    names another host (``file://dir/x``: two slashes) or carries a query or fragment: nothing local to use; and
    for a path that looks like a URL missing a slash (:func:`refuse_mistyped_url`): every local path argument
    reaches here (``_args.check_path``), so no verb makes a folder ``s3:`` of a mistyped URL."""
    m = _URL.match(location)
    if m is None or m.group(1).lower() not in _LOCAL_SCHEMES:
        refuse_mistyped_url(location)
        return None
    parts = urllib.parse.urlsplit(location)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment or not parts.path.startswith("/"):
        raise ValueError(
            f"{location!r} is not a local file URL: write {m.group(1)}:///absolute/path (three slashes), or the path "
            "itself"
        )
    return urllib.parse.unquote(parts.path)


def normalize_url(url: str) -> str:
    """An fsspec URL with its scheme in lower case (schemes are case-insensitive; fsspec knows ``s3``, not
    ``S3``). ``ValueError`` when its path has a ``.`` or ``..`` part (the store folds them: ``s3://b/./k`` is
    written at ``b/k``, so the paths this library names and returns would not be where the files are), or when
    it carries a password or secret (``s3://KEY:SECRET@bucket``: those go in ``storage_options``)."""
    m = _URL.match(url)
    if m is None:
        raise ValueError(f"{redact_url(url)!r} is not a URL")
    rest = url[m.end() :]
    creds = _CREDENTIALS.match(url)
    if creds is not None and ":" in creds.group(2):
        raise ValueError(
            f"the URL {redact_url(url)!r} carries a secret: pass it in storage_options (e.g. key= and secret= for "
            "s3://), never in the URL (s3fs reads it as part of the bucket name, and it would show in messages)"
        )
    if any(part in (".", "..") for part in rest.split("/")):
        raise ValueError(
            f"the URL {redact_url(url)!r} has a '.' or '..' part: name the prefix plainly (the store would fold it)"
        )
    return f"{m.group(1).lower()}://{rest}"


def redact_url(url: str) -> str:
    """``url`` with a secret written into it (``s3://KEY:SECRET@bucket/run``: user-info holding a ``:``) replaced
    by ``***``, for messages: a secret never reaches a log. User-info without a ``:`` is no secret but part of
    where the URL points (Azure's ``abfs://container@account/...``, ``sftp://user@host/...``): it stays, so the
    paths named and returned (:attr:`FsspecStorage.location`) still name the place written."""
    creds = _CREDENTIALS.match(url)
    if creds is None or ":" not in creds.group(2):
        return url
    return f"{creds.group(1)}***@{url[creds.end() :]}"


#: The user-info part of a URL (``scheme://user:secret@``).
_CREDENTIALS = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)([^/@]*)@")


def check_relative(rel: str) -> str:
    """``rel`` if it is a plain relative path inside the root (see Confinement), else ``ValueError`` naming it."""
    if not isinstance(rel, str):
        raise TypeError(f"storage path must be a str, got {type(rel).__name__} {rel!r}")
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"storage path {rel!r} is not a plain relative path (no empty, '.' or '..' parts, no leading '/', "
            "no backslash): nothing outside the checkpoint's root is read or written"
        )
    return rel


class Storage(abc.ABC):
    """A tree of files under one root: see the module docstring for what every implementation guarantees.

    Attributes:
        location: the root as given (a path or a URL), for messages.
    """

    location: str

    def describe(self, rel: str) -> str:
        """``rel`` as the user would name it (the full path or URL), for error messages."""
        return f"{self.location.rstrip('/')}/{check_relative(rel)}"

    @abc.abstractmethod
    def writer(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary file to stream into; published atomically at ``rel`` when the block exits cleanly."""

    def publish_bytes(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` atomically (see :meth:`writer`)."""
        with self.writer(rel) as f:
            f.write(data)

    @abc.abstractmethod
    def read_bytes(self, rel: str) -> bytes:
        """The whole file (``FileNotFoundError`` naming it when absent)."""

    @abc.abstractmethod
    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``; ``EOFError`` naming the file when it holds fewer."""

    @abc.abstractmethod
    def size(self, rel: str) -> int:
        """The file's size in bytes (``FileNotFoundError`` naming it when absent)."""

    def file_size(self, rel: str) -> int | None:
        """The size of the *file* at ``rel``, asked of the storage now; ``None`` when no file is there (a
        folder, or an object store's prefix, is not one). What a reader probes names with, by exact name."""
        try:
            return self.size(rel)
        except (FileNotFoundError, IsADirectoryError):
            return None

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether a file (or folder) is at ``rel``, asked of the storage now."""

    @abc.abstractmethod
    def listdir(self, rel: str = "") -> list[str]:
        """The names directly under folder ``rel`` (``""``: the root), sorted; ``[]`` for a missing folder."""

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Remove the file at ``rel``; nothing when it is already gone."""

    def _short(self, rel: str, offset: int, length: int, got: int) -> EOFError:
        return EOFError(
            f"{self.describe(rel)}: asked for {length} bytes at offset {offset}, the file holds {got} there "
            "(truncated, or replaced by another file)"
        )


class LocalStorage(Storage):
    """A local (or network-mounted) folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.location = os.fspath(root)

    def _path(self, rel: str, must_exist: bool = False) -> Path:
        path = self.root / check_relative(rel)
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
            raise ValueError(f"storage path {rel!r} leads to {real}, outside the root {real_root} (a symlink?)")
        if must_exist and not path.exists():
            raise FileNotFoundError(f"{path}: no such file")
        return path

    @contextlib.contextmanager
    def writer(self, rel: str) -> Iterator[IO[bytes]]:
        path = self._path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _io.atomic_open(path) as f:
            yield f

    def read_bytes(self, rel: str) -> bytes:
        return self._path(rel, must_exist=True).read_bytes()

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        path = self._path(rel, must_exist=True)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            data = os.pread(fd, length, offset)
            while len(data) < length:  # pread may return short before the end on some filesystems
                more = os.pread(fd, length - len(data), offset + len(data))
                if not more:
                    raise self._short(rel, offset, length, len(data))
                data += more
            return data
        finally:
            os.close(fd)

    def size(self, rel: str) -> int:
        return self._path(rel, must_exist=True).stat().st_size

    def file_size(self, rel: str) -> int | None:
        path = self._path(rel)
        return path.stat().st_size if path.is_file() else None

    def exists(self, rel: str) -> bool:
        return self._path(rel).exists()

    def listdir(self, rel: str = "") -> list[str]:
        path = self._path(rel) if rel else self.root
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(rel).unlink()


class FsspecStorage(Storage):
    """A prefix of an fsspec filesystem (``s3://bucket/prefix``, ``memory://x``, ...).

    Args:
        url: the root URL.
        fs: the filesystem to use (default: the one fsspec builds for ``url`` with ``storage_options``).
        storage_options: passed to fsspec (``key``, ``secret``, ``endpoint_url``, ...).
    """

    def __init__(self, url: str, fs: Any = None, **storage_options: Any) -> None:
        try:
            import fsspec
        except ImportError:
            raise ImportError(
                f"{redact_url(url)!r} is a URL: reading and writing it needs fsspec and its filesystem package "
                "(pip install 'functional-ema[s3]' for s3://)"
            ) from None
        if fs is None:
            try:
                fs, root = fsspec.core.url_to_fs(url, **storage_options)
            except ImportError as e:  # fsspec is there, the scheme's package (s3fs, gcsfs, adlfs) is not
                raise ImportError(
                    f"{redact_url(url)!r} is a URL whose filesystem package is not installed ({e}); for s3:// "
                    "pip install 'functional-ema[s3]'"
                ) from None
        else:
            root = fs._strip_protocol(url)
        # Only a URL built without storage_for can carry a secret here (normalize_url refuses one): kept out
        # of the location, which messages name; any other user-info is part of the place (redact_url).
        self.fs, self.root, self.location = fs, str(root).rstrip("/"), redact_url(url)

    def _full(self, rel: str) -> str:
        return str(PurePosixPath(self.root) / check_relative(rel)) if self.root else check_relative(rel)

    def _fresh(self) -> None:
        """Drop fsspec's listing cache: every question goes to the storage (a lagging listing is the storage's)."""
        self.fs.invalidate_cache()

    @contextlib.contextmanager
    def writer(self, rel: str) -> Iterator[IO[bytes]]:
        full = self._full(rel)
        if _commits_at_open(self.fs):  # memory://: a file is live from open: stage the bytes, publish them at once
            staged = io.BytesIO()
            try:
                yield staged
                self.fs.pipe_file(full, staged.getvalue())
            finally:
                self._fresh()
            return
        f = self.fs.open(full, "wb", autocommit=False)
        try:
            yield f
            f.close()
            f.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # aborts an open multipart upload: nothing is published
            f.closed = True  # discarded: its finaliser must not flush (and upload) what is left
            raise
        finally:
            self._fresh()

    def read_bytes(self, rel: str) -> bytes:
        self._fresh()
        try:
            data: bytes = self.fs.cat_file(self._full(rel))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.describe(rel)}: no such file") from None
        return data

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        try:
            data: bytes = self.fs.cat_file(self._full(rel), start=offset, end=offset + length)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.describe(rel)}: no such file") from None
        if len(data) != length:
            raise self._short(rel, offset, length, len(data))
        return data

    def size(self, rel: str) -> int:
        self._fresh()
        try:
            return int(self.fs.size(self._full(rel)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.describe(rel)}: no such file") from None

    def file_size(self, rel: str) -> int | None:
        self._fresh()  # a HEAD of the exact name; a filesystem that answers "a folder" from a listing: not a file
        try:
            info = self.fs.info(self._full(rel))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def exists(self, rel: str) -> bool:
        self._fresh()
        return bool(self.fs.exists(self._full(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        self._fresh()
        where = self._full(rel) if rel else self.root
        try:
            entries = self.fs.ls(where, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {PurePosixPath(str(e).rstrip("/")).name for e in entries}
        return sorted(n for n in names if n)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(rel))
        self._fresh()


def _commits_at_open(fs: Any) -> bool:
    """Whether ``fs`` ignores ``autocommit=False`` (fsspec's in-memory filesystem publishes a file when it
    is opened); the buffered remote filesystems (s3fs, gcsfs, adlfs) honour it."""
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)


def storage_for(location: str | os.PathLike[str], **storage_options: Any) -> Storage:
    """The :class:`Storage` for a folder path or an fsspec URL (``storage_options`` go to fsspec)."""
    if is_url(location):
        return FsspecStorage(normalize_url(os.fspath(location)), **storage_options)
    if storage_options:
        raise TypeError(f"storage_options are for URLs; {os.fspath(location)!r} is a local path")
    local = file_url_path(location) if isinstance(location, str) else None
    return LocalStorage(location if local is None else local)


def remove_tree(store: Storage, rel: str = "") -> None:
    """Remove every file under folder ``rel`` of ``store`` (``""``: everything under its root), each by its exact
    name, walking the listing: nothing outside that folder is touched (every path is confined as any other), and
    nothing is removed by a prefix match (``run/a.ema`` never reaches ``run/a.ema2``)."""
    for name in store.listdir(rel):
        child = f"{rel}/{name}" if rel else name
        if store.file_size(child) is not None:
            store.remove(child)
        else:
            remove_tree(store, child)
