"""Files other tools wrote, read as hostile input: one reader, one error (:class:`ForeignFileError`).

A ``--like`` folder's ``config.json``, weight index, ``adapter_config.json`` and safetensors files are
parsed here and nowhere else, with the same checks as the library's own files (``_io.SafetensorsFile``
for weights: header bounds, offsets, no pickle). Every failure is one :class:`ForeignFileError` naming
the file and the field; no ``TypeError``, ``KeyError``, ``RecursionError`` or safetensors error escapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import _io
from .._checkpoint.errors import ForeignFileError

__all__ = ["MAX_JSON_BYTES", "read_json_object", "read_index", "read_weights_header", "plain_file_name"]

#: A model folder's JSON files are kilobytes (an index of 100k tensors is a few MB); larger is not one of them.
MAX_JSON_BYTES = 64 * 2**20


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """``path`` parsed as one JSON object (UTF-8, at most :data:`MAX_JSON_BYTES`).

    Raises:
        ForeignFileError: unreadable, too large, not UTF-8, not JSON, nested too deeply, or not an object.
    """
    try:
        if not path.is_file():
            raise ForeignFileError(f"{what}: {path} is not a regular file")
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ForeignFileError(f"{what}: {path} has {size} bytes, more than a model folder's JSON file holds")
        raw = path.read_bytes()
    except OSError as e:
        raise ForeignFileError(f"{what}: cannot read {path}: {e}") from None
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


def read_weights_header(path: Path, what: str) -> dict[str, _io.TensorEntry]:
    """The tensors (name -> dtype, shape, offsets) of the safetensors file ``path``, validated, nothing loaded.

    Raises:
        ForeignFileError: missing, a pickle, truncated, corrupted, or a dtype this library cannot read.
    """
    try:
        with _io.SafetensorsFile(path) as f:
            return dict(f.tensors)
    except (_io.FormatError, OSError) as e:  # FileNotFoundError included
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
