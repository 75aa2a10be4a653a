"""The offline tools over a checkpoint at an fsspec URL (``s3://bucket/run/checkpoint_...``): fetched first.

``consolidate``, ``consolidate_to_file`` and the export read a checkpoint at a URL by copying what they
read into a new temporary local folder through the storage seam (``functional_ema._storage``), then
reading that folder as any local checkpoint, so every byte is checked against the manifest's checksums
by the one reader. Copied: the pointer files (``latest``, ``ema_latest``) when the tag is not given,
the tag's manifest, and exactly the files the manifest lists (the rank files and buffer files of every
model-parallel part); nothing else, and nothing outside the URL's prefix. The folder is removed when
the tool is done (it is the library's own).

The cost is a local copy of the checkpoint's EMA files (the disk space of one EMA, held while the tool
runs); ranged reads straight from the bucket are not built yet.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from .. import _io
from .._storage import Storage, storage_for
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .format import LATEST_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, check_tag, manifest_parts, validate_manifest

__all__ = ["fetched", "fetched_file"]

#: Bytes copied per read from the storage (a ranged GET each).
_CHUNK = 64 << 20
#: Pointer files are one tag name: more than this is not one (the local reader refuses it, naming it).
_POINTER_BYTES = 4097


@contextlib.contextmanager
def fetched(url: str, tag: str | None, **storage_options: Any) -> Iterator[Path]:
    """A local copy of what an offline tool reads of the checkpoint at ``url`` (see the module docstring):
    the path to hand the tool (the checkpoint folder, or the tag folder when ``url`` is one). Errors name
    the URL, not the temporary folder."""
    store = storage_for(url, **storage_options)
    work = Path(tempfile.mkdtemp(prefix="fe_fetch_"))
    try:
        try:
            yield _fetch(store, tag, work)
        except CheckpointError as e:
            raise type(e)(str(e).replace(str(work), url.rstrip("/"))) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def fetched_file(url: str, **storage_options: Any) -> Iterator[Path]:
    """A local copy of one file at ``url`` (a consolidated ``.safetensors`` file), removed afterwards."""
    parent, _, name = url.rstrip("/").rpartition("/")
    store = storage_for(parent, **storage_options)
    work = Path(tempfile.mkdtemp(prefix="fe_fetch_"))
    try:
        if not store.exists(name):
            raise CheckpointNotFoundError(f"{url} does not exist")
        _copy(store, name, work / name)
        yield work / name
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fetch(store: Storage, tag: str | None, work: Path) -> Path:
    if tag is None and store.exists(MANIFEST_NAME):  # the URL is a tag folder: named as its last part
        folder = work / check_tag(PurePosixPath(store.location.rstrip("/")).name, saving=False)
        _copy_tag(store, "", folder)
        return folder
    if tag is None:
        for name in ("latest", LATEST_NAME):
            if store.exists(name):
                (work / name).write_bytes(store.read_range(name, 0, min(store.size(name), _POINTER_BYTES)))
        tag = _pointed_tag(work, store)
    tag = check_tag(tag, saving=False)
    _copy_tag(store, tag, work / tag)
    return work


def _pointed_tag(work: Path, store: Storage) -> str:
    """The tag the pointer files name, read by the local reader's own rules (``latest`` first)."""
    from .format import read_latest

    for name in ("latest", LATEST_NAME):
        if (work / name).is_file():
            return read_latest(work, work / name)
    raise CheckpointNotFoundError(
        f"checkpoint directory {store.location} has no 'latest' file (DeepSpeed writes it in save_checkpoint) nor "
        f"{LATEST_NAME!r} (functional_ema.save writes it), nor is it a tag folder: pass tag=... (--tag)"
    )


def _copy_tag(store: Storage, tag: str, folder: Path) -> None:
    """The tag folder's manifest and every file it lists, from ``store`` into ``folder``."""
    prefix = f"{tag}/" if tag else ""
    mrel = f"{prefix}{MANIFEST_NAME}"
    if not store.exists(mrel):
        raise CheckpointNotFoundError(
            f"checkpoint directory {store.location}: no complete EMA checkpoint of tag {tag!r} there "
            f"({store.describe(mrel)} does not exist; the manifest is written last)"
        )
    size = store.size(mrel)
    if size > MAX_MANIFEST_BYTES:  # the local reader's own bound, refused before the read
        raise CorruptCheckpointError(
            f"{store.describe(mrel)} holds {size} bytes, more than a manifest may ({MAX_MANIFEST_BYTES})"
        )
    raw = store.read_bytes(mrel)
    folder.mkdir(parents=True)
    mpath = folder / MANIFEST_NAME
    mpath.write_bytes(raw)
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{mpath}: not valid JSON ({e})") from None
    validate_manifest(mpath, manifest)  # the file names below are then plain names of this folder's files
    for name in _listed_files(manifest):
        _copy(store, f"{prefix}{name}", folder / name)


def _listed_files(manifest: dict) -> list[str]:
    names = []
    for part in manifest_parts(manifest):
        names += [e["file"] for e in part.get("files") or []]
        names += [e["file"] for e in part.get("buffer_files") or []]
    return sorted(set(names))


def _copy(store: Storage, rel: str, dest: Path) -> None:
    """One file, in chunks (a missing file is left missing: the local reader names it as incomplete)."""
    try:
        size = store.size(rel)
    except FileNotFoundError:
        return
    with _io.atomic_open(dest) as f:
        for offset in range(0, size, _CHUNK):
            f.write(store.read_range(rel, offset, min(_CHUNK, size - offset)))
    if os.path.getsize(dest) != size:  # pragma: no cover - read_range returns exactly what it is asked
        raise CorruptCheckpointError(f"{store.describe(rel)}: copied {os.path.getsize(dest)} of {size} bytes")
