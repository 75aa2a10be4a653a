"""What an EMA checkpoint is on disk, and the checks of everything read back from it.

Names (tags, rank files, tensor keys, dtypes), the format constants, the manifest schema and its
validation, the rank files' layout metadata, the checksum records, and the guard that keeps the
offline tools' outputs out of the checkpoint they read. Nothing here does I/O beyond reading the
small pointer files and listing folders.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import _io
from .._layout import ExpertLayout, ModelPart, ShardLayout, ShardSpec
from .._state import BufferState, EmaState
from .._storage import is_url
from .._tree import short_list as _tree_short_list
from .._version import __version__
from . import index
from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidTagError,
    OutputPathError,
)

# 5: a rank file's chunk checksums are one hex string (``chunk_checksums``: every tensor's chunks in the
#    file's order, fixed width) instead of a list per tensor name (a fifth of the bytes: a manifest of
#    4096 ZeRO-3 ranks would pass 256 MB), and each part may carry a ``piece_index`` (see
#    :mod:`.index`). Every save writes format 5; older formats are still read.
# 4: a model split by tensor or pipeline parallelism: the manifest lists its ``parts`` (one per
#    tensor-parallel rank and pipeline stage, each with its own world_size, zero_stage, params, files,
#    buffers), and file names carry the part (``ema_tp000of002_pp001of002_rank_...``). A whole model
#    is still written as format 3.
# 3: the manifest may list buffer files (``buffer_files``, ``buffers``) and carry a JSON object ``extra``
#    (mirrored in every rank file's header); a checkpoint is complete only with every listed file.
# 2: xxh3_64 checksums as hex strings (header_checksum / tensor_checksums); 1: CRC-32 integers. Both still read.
FORMAT_VERSION = 5
WHOLE_FORMAT_VERSION = FORMAT_VERSION  # a save of a whole model wrote format 3 before format 5
COMPACT_CHECKSUMS_VERSION = 5  # from this format on, rank-file records hold ``chunk_checksums``
MANIFEST_NAME = "ema_manifest.json"
#: A private save's manifest until every folder holds its own (``private.py``): never read as data.
PENDING_MANIFEST_NAME = MANIFEST_NAME + ".pending"
FILE_FORMAT = "functional_ema.ema_shards"
BUFFERS_FORMAT = "functional_ema.buffers"
MANIFEST_FORMAT = "functional_ema.manifest"
CONSOLIDATED_FORMAT = "functional_ema.consolidated"
_PART_NAME = r"(?:tp(\d+)of(\d+)_pp(\d+)of(\d+)_)?"
RANK_FILE = re.compile(r"^ema_" + _PART_NAME + r"rank_(\d+)_of_(\d+)(?:\.gen(\d+))?\.safetensors$")
BUFFER_FILE = re.compile(r"^buffers_" + _PART_NAME + r"rank_(\d+)_of_(\d+)(?:\.gen(\d+))?\.safetensors$")
#: Held (``flock``) by the save writing a tag folder, and removed by it; never read as data.
LOCK_NAME = ".ema_write.lock"
#: The generation the last save of a tag folder took (rank 0, holding its :data:`LOCK_NAME`), so that the next save
#: takes a later one even where that save failed and its late ranks still write its files (``writer.take_generation``).
#: Removed by the next commit (its manifest's generation is later); never read as data.
GENERATION_NAME = ".ema_generation"
#: A framework integration's record in a tag folder where the EMA has not started yet (see
#: :func:`record_bytes`); once it has, the record lives in the manifest's ``extra``.
RECORD_NAME = "integration.json"
RECORD_FORMAT = "functional_ema.integration"
#: Bound on the JSON text of a save's ``extra`` record (it is copied into every rank file's header).
MAX_EXTRA_BYTES = 64 << 10

# The tag of the last complete save in a checkpoint directory (see save and CheckpointReader.open).
LATEST_NAME = "ema_latest"


def _file_name(kind: str, rank: int, world_size: int, generation: int, part: ModelPart | None) -> str:
    where = (
        ""
        if part is None or part.whole
        else f"tp{part.tp:03d}of{part.tp_size:03d}_pp{part.pp:03d}of{part.pp_size:03d}_"
    )
    suffix = f".gen{generation}" if generation else ""
    return f"{kind}_{where}rank_{rank:05d}_of_{world_size:05d}{suffix}.safetensors"


def _checked_name_args(rank: Any, world_size: Any, generation: Any, part: Any) -> tuple[int, int, int, Any]:
    """The arguments of the public file-name functions, checked (names of files are built from them)."""
    from .._args import check_int, check_rank

    world_size = check_int(world_size, "world_size", minimum=1)
    rank = check_rank(rank, "rank", world_size)
    generation = check_int(generation, "generation")
    if part is not None and not isinstance(part, ModelPart):
        raise TypeError(f"part must be a ModelPart (or None for a whole model), got {type(part).__name__}")
    return rank, world_size, generation, part


def rank_file_name(rank: int, world_size: int, generation: int = 0, part: ModelPart | None = None) -> str:
    """``ema_rank_00000_of_00002.safetensors``; later saves into the same tag add ``.gen<N>``; a
    model-parallel part adds its coordinates (``ema_tp001of002_pp000of001_rank_...``)."""
    return _file_name("ema", *_checked_name_args(rank, world_size, generation, part))


def buffer_file_name(rank: int, world_size: int, generation: int = 0, part: ModelPart | None = None) -> str:
    """``buffers_rank_00000_of_00002.safetensors``: one rank's module buffers, saved with its EMA pieces."""
    return _file_name("buffers", *_checked_name_args(rank, world_size, generation, part))


def file_identity(match: re.Match) -> tuple[ModelPart, int, int, int]:
    """(part, rank, world size, generation) named by a :data:`RANK_FILE` / :data:`BUFFER_FILE` match."""
    tp, tps, pp, pps, rank, world, gen = match.groups()
    part = ModelPart(int(tp), int(tps), int(pp), int(pps)) if tp is not None else ModelPart()
    return part, int(rank), int(world), int(gen or 0)


#: The suffix :func:`functional_ema._io.tmp_name` gives one write's temporary file: ``.tmp-<pid>-<12 hex digits>``
#: (``.tmp-<pid>`` in releases before the per-write token, still recognised: a crashed save of one left it).
_TMP_SUFFIX = re.compile(r"\.tmp-\d+(?:-[0-9a-f]{12})?$")


#: The marker files of an async save (``_async._marker``: a save id is 16 hex digits, ``secrets.randbits(62)``) and
#: their temporary names (``_io.atomic_write_bytes``): the only ``ema_async.`` names removed, never a user's
#: ``ema_async.log``.
ASYNC_MARKER = re.compile(r"ema_async\.[0-9a-f]{16}\.rank\d{5,}\.(?:done|error)(?:\.tmp-\d+-[0-9a-f]{12})?")


def is_own_tmp(name: str, finals: Sequence[str]) -> bool:
    """Whether ``name`` is the temporary file of one write of a rank or buffer file, or of a name in ``finals``:
    that file's exact name and the exact suffix of :func:`functional_ema._io.tmp_name`. A user's file that merely
    starts alike (``ema_notes.tmp-backup``, ``buffers_of_mine.tmp-1``) is not one."""
    m = _TMP_SUFFIX.search(name)
    if m is None:
        return False
    final = name[: m.start()]
    return final in finals or RANK_FILE.match(final) is not None or BUFFER_FILE.match(final) is not None


def tmp_final(name: str) -> str | None:
    """The file whose write's temporary ``name`` is (``x.tmp-<pid>-<token>`` is ``x``'s), else None."""
    m = _TMP_SUFFIX.search(name)
    return None if m is None else name[: m.start()]


def is_own_file(name: str) -> bool:
    """Whether ``name`` is one of the files a save writes into a tag folder (or their temporaries)."""
    return bool(
        RANK_FILE.match(name)
        or BUFFER_FILE.match(name)
        or name in (MANIFEST_NAME, PENDING_MANIFEST_NAME, LOCK_NAME, RECORD_NAME, GENERATION_NAME)
        # generous, as this guards names from being written over (an export's output); what a save removes is
        # matched exactly (is_own_tmp)
        or (_io.is_tmp_name(name) and name.startswith(("ema_", "buffers_", MANIFEST_NAME, RECORD_NAME)))
    )


# ------------------------------------------------------------------------------- checksummed records


def record_bytes(record: dict) -> bytes:
    """A small JSON record as written to disk: ``record`` plus ``format`` and a ``checksum`` (XXH3-64 of
    its canonical JSON), so a flipped byte or a hand edit is refused when read (:func:`read_record`)."""
    body = dict(record, format=RECORD_FORMAT)
    body.pop("checksum", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    body["checksum"] = f"xxh3_64:{_io.format_checksum('xxh3_64', _io.CHECKSUMS['xxh3_64'](canonical.encode()))}"
    return json.dumps(body, sort_keys=True, indent=1).encode()


def read_record(path: Path) -> dict | None:
    """The record at ``path`` (``None`` when there is none), its checksum verified; else
    :class:`CorruptCheckpointError` naming the file. Never quotes the file's content."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptCheckpointError(
            f"{path}: cannot read it ({e.strerror or e}): restore it or resume from another checkpoint"
        ) from None
    if size > MAX_EXTRA_BYTES:
        raise CorruptCheckpointError(f"{path} holds {size} bytes, far more than a record: it is damaged")
    try:
        raw = path.read_bytes()
        record = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else type(e).__name__
        raise CorruptCheckpointError(
            f"{path} is not a readable JSON record ({why}): the file is damaged; restore it or "
            "resume from another checkpoint"
        ) from None
    if (
        not isinstance(record, dict)
        or record.get("format") != RECORD_FORMAT
        or not isinstance(record.get("checksum"), str)
    ):
        raise CorruptCheckpointError(
            f"{path} is not a functional_ema record (no format {RECORD_FORMAT!r} and checksum): "
            "the file is damaged or was replaced"
        )
    if record_bytes(record) != json.dumps(record, sort_keys=True, indent=1).encode():
        raise CorruptCheckpointError(
            f"{path}: its checksum does not match its content: the file was damaged or edited "
            "by hand; restore it or resume from another checkpoint"
        )
    return record


def tensor_key(k: int, name: str) -> str:
    return f"emas.{k}.{name}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CorruptCheckpointError(f"{where}: unknown EMA dtype {name!r}")
    return dtype


#: Names a tag must not take: DeepSpeed's pointer files and recovery script beside the tag folders
#: (``latest`` is written by ``engine.save_checkpoint``; a folder of that name makes it fail on rank 0
#: only), and functional_ema's own file names. Compared case-insensitively (case-insensitive filesystems).
_RESERVED_TAGS = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py", MANIFEST_NAME, LATEST_NAME)
_MAX_TAG_BYTES = 255  # one path component on common filesystems


def _tag_problem(tag: str) -> str | None:
    """Why ``tag`` is not one plain path component, or None. Never quotes the tag (it may come from a file)."""
    if not tag:
        return "is empty"
    if tag in (".", ".."):
        return f"is {tag!r}, which names a folder relative to the checkpoint, not a tag in it"
    if "/" in tag or "\\" in tag:
        return "contains a path separator ('/' or '\\'); a tag is one folder name"
    bad = sorted({c for c in tag if c.isspace() or unicodedata.category(c).startswith("C")})
    if bad:
        return "contains whitespace or control characters (" + ", ".join(f"U+{ord(c):04X}" for c in bad[:6]) + ")"
    if len(tag.encode("utf-8", "surrogatepass")) > _MAX_TAG_BYTES:
        return f"is longer than {_MAX_TAG_BYTES} bytes"
    return None


def check_tag(tag: Any, *, saving: bool = True) -> str:
    """The tag as a ``str`` if it is one plain folder name; else :class:`InvalidTagError`.

    Saving also refuses the reserved names of :data:`_RESERVED_TAGS` and names of the library's own
    files (rank files, temporary files).
    """
    if isinstance(tag, int) and not isinstance(tag, bool):
        tag = str(tag)
    if not isinstance(tag, str):
        raise InvalidTagError(f"tag must be a str (a folder name such as 'global_step<N>'), got {type(tag).__name__}")
    problem = _tag_problem(tag)
    if problem is None and saving:
        if tag.lower() in _RESERVED_TAGS:
            problem = (
                "collides with a file DeepSpeed or functional_ema writes beside the tag folders "
                f"(reserved: {', '.join(_RESERVED_TAGS)})"
            )
        elif RANK_FILE.match(tag) or BUFFER_FILE.match(tag) or _io.is_tmp_name(tag):
            problem = "is the name of one of functional_ema's own files"
    if problem is not None:
        shown = repr(tag) if len(tag) <= 80 else repr(tag[:80]) + "..."
        raise InvalidTagError(
            f"tag {shown} {problem}. Use a plain folder name such as DeepSpeed's default 'global_step<N>'"
        )
    return tag


_MAX_LATEST_BYTES = 4096


def read_latest(root: Path, latest: Path) -> str:
    """The tag named by ``root/latest`` (DeepSpeed's pointer file), validated; never echoes its content."""
    try:
        inside = latest.resolve().parent == root.resolve()
        size = latest.stat().st_size
    except OSError as e:
        raise CheckpointNotFoundError(f"cannot read {latest}: {e}") from None
    if not inside:
        raise InvalidTagError(
            f"{latest} is a link to a file outside {root}; DeepSpeed writes 'latest' as a plain file holding one tag. "
            "Pass tag=... (or --tag) instead"
        )
    if size > _MAX_LATEST_BYTES:
        raise InvalidTagError(
            f"{latest} holds {size} bytes, not one tag name (DeepSpeed writes a single tag): pass tag=..."
        )
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidTagError(f"{latest} is not UTF-8 text, so it names no tag: pass tag=...") from None
    except OSError as e:
        raise CheckpointNotFoundError(f"cannot read {latest}: {e}") from None
    problem = _tag_problem(tag) if tag else None
    if problem is not None:
        raise InvalidTagError(
            f"{latest} does not name a tag folder of {root}: its content {problem}. Tags are looked up only inside the "
            f"checkpoint directory; pass tag=... (or --tag). Tags here with a complete EMA: {complete_tags(root)}"
        )
    return tag


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def complete_tags(root: Path) -> list[str]:
    try:
        tags = [d.name for d in root.iterdir() if d.is_dir() and (d / MANIFEST_NAME).is_file()]
    except OSError:
        return []
    return sorted(tags, key=_natural)


def short_list(names: Sequence[str], limit: int = 8) -> str:
    """``['a', 'b' and 3 more]``: the core's short list (``_tree.short_list``), bracketed."""
    return "[" + _tree_short_list(list(names), limit) + "]"


def library_version() -> str:
    """This library's version, as recorded in the manifests it writes."""
    return __version__


def uses_compact_checksums(manifest: dict, key: str = "files") -> bool:
    """Whether the records of ``manifest``'s ``key`` (``files``: rank files) hold ``chunk_checksums``."""
    return key == "files" and _is_int(manifest.get("format_version"), COMPACT_CHECKSUMS_VERSION)


def join_chunk_checksums(algo: str, crcs: dict[str, list[int]]) -> str:
    """A rank file's ``chunk_checksums``: every tensor's chunk checksums (``crcs``, in file order) as one
    fixed-width hex string."""
    return "".join(_io.format_checksum(algo, v) for sums in crcs.values() for v in sums)


def split_chunk_checksums(
    mpath: Path, field: str, text: str, algo: str, tensors: dict[str, _io.TensorEntry], where: str
) -> dict[str, list[int]]:
    """``chunk_checksums`` (validated hex, see :func:`check_tensor_checksums`) cut into each tensor's chunk
    checksums, in the order of the tensors' bytes in the file (whose header the caller has verified)."""
    width = 8 if algo == "crc32" else 16
    order = sorted(tensors, key=lambda k: tensors[k].start)
    counts = [-(-(tensors[k].end - tensors[k].start) // _io.CHUNK_BYTES) for k in order]
    if len(text) != width * sum(counts):
        raise CorruptCheckpointError(
            f"{mpath}: field '{field}.chunk_checksums' holds {len(text) // width} checksums, but {where} has "
            f"{sum(counts)} chunks of {_io.CHUNK_BYTES} bytes: the manifest is damaged or belongs to another save"
        )
    values = struct.unpack(f">{sum(counts)}{'I' if width == 8 else 'Q'}", bytes.fromhex(text))
    out, at = {}, 0
    for k, n in zip(order, counts, strict=True):
        out[k], at = list(values[at : at + n]), at + n
    return out


def file_checksums(
    manifest: dict, entry: dict, where: str, key: str = "files"
) -> tuple[str, int | None, dict[str, list[int]]]:
    """(algorithm, header checksum, chunk checksums per tensor) of one manifest file record.

    Format 2 records ``header_checksum`` / ``tensor_checksums`` as hex strings of ``manifest["checksum"]``;
    format 1 recorded ``header_crc32`` / ``tensor_crc32`` as CRC-32 integers.
    """
    try:
        if int(manifest["format_version"]) < 2:
            header, tensors = entry.get("header_crc32"), entry.get("tensor_crc32", {})
            return (
                "crc32",
                None if header is None else int(header),
                {k: [int(v) for v in vs] for k, vs in tensors.items()},
            )
        algo = manifest.get("checksum")
        header, tensors = entry.get("header_checksum"), entry.get("tensor_checksums", {})
        # Compact records (format 5): the caller cuts ``chunk_checksums`` once the file's header is verified.
        parsed = (
            {} if uses_compact_checksums(manifest, key) else {k: [int(v, 16) for v in vs] for k, vs in tensors.items()}
        )
        header = None if header is None else int(header, 16)
    except (TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{where}: unreadable checksums in the manifest ({e!r}); the manifest is damaged"
        ) from None
    if not isinstance(algo, str) or algo not in _io.CHECKSUMS:
        raise CheckpointVersionError(
            f"{where}: the manifest's checksums use {algo!r}, which this functional_ema ({library_version()}) cannot compute "
            f"(it knows {sorted(_io.CHECKSUMS)}). Upgrade functional_ema, or load with verify=False"
        )
    return algo, header, parsed


# ------------------------------------------------------------------- validation of files read back
#
# Everything read from disk is untrusted: the manifest is checked against a schema (types, ranges,
# the library's own rank-file names) before anything else is read, and every field that changes a
# result is cross-checked against the rank files' headers, which the manifest's checksums cover.
# Sizes are checked against the bytes on disk before anything is allocated.

MAX_MANIFEST_BYTES = 256 << 20  # ~22M checksum entries, i.e. ~90 TB of EMA
_MAX_NUM_EMAS = 1 << 16
_MAX_WORLD = 1 << 20
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 62
#: The largest generation a manifest may name: the writer never picks one above it and the reader accepts none
#: above it (one bound for both sides; it leaves room for the int64 the ranks agree on and for ``+ 1``).
MAX_GENERATION = 1 << 62
_SAVED_DTYPES = tuple(dtype_name(d) for d in _io.DTYPE_TO_STR if d.is_floating_point)
_COPIED_DTYPES = tuple(dtype_name(d) for d in _io.DTYPE_TO_STR)


def brief(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:60] + '...'}"


def _is_int(value: Any, lo: int = 0, hi: int = _MAX_NUMEL) -> bool:
    return type(value) is int and lo <= value <= hi


def _manifest_field_error(mpath: Path, field: str, want: str, got: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{mpath}: field {field!r} must be {want}, got {brief(got)}. The manifest is damaged or was edited: restore it "
        "from a copy or load another tag"
    )


#: The fields that describe one model-parallel part: at the top level of a manifest of a whole model
#: (formats 1-3), inside each entry of ``parts`` for a model-parallel one (format 4).
PART_FIELDS = (
    "world_size",
    "zero_stage",
    "params",
    "files",
    "buffers",
    "buffer_files",
    "tp_dims",
    "experts",
    index.FIELD,
)
_REQUIRED_PART_FIELDS = ("world_size", "zero_stage", "params", "files")
_MAX_PARTS = 1 << 16


def manifest_parts(m: dict) -> list[dict]:
    """The parts of a validated manifest, each ``{"part": ModelPart, "field": "parts[i]." or "", world_size,
    zero_stage, params, files, buffers, buffer_files, tp_dims}``: one (the whole model) before format 4."""
    if m.get("parts") is None:
        return [dict({k: m.get(k) for k in PART_FIELDS}, part=ModelPart(), field="")]
    return [
        dict({k: p.get(k) for k in PART_FIELDS}, part=ModelPart(**p["part"]), field=f"parts[{i}].")
        for i, p in enumerate(m["parts"])
    ]


def listed_files(manifest: dict) -> set[str]:
    """Every file a validated manifest lists (rank and buffers files, every part's): what a cleanup keeps."""
    return {e["file"] for p in manifest_parts(manifest) for e in p["files"] + (p.get("buffer_files") or [])}


def _selection_ok(v: Any) -> bool:
    """A manifest's ``selection`` record (functional_ema._selection.Selection.record) is well-formed."""
    parts = (v.get("include"), v.get("exclude")) if isinstance(v, dict) else ((),)
    return all(
        p is None or isinstance(p, str) or (isinstance(p, list) and all(isinstance(x, str) for x in p)) for p in parts
    )


def validate_manifest(mpath: Path, m: dict) -> None:
    """Types and ranges of every manifest field, and the file names; before anything else is read."""
    for field, ok, want in (  # in order, each check may rely on the ones before it
        ("tag", lambda v: isinstance(v, str) and _tag_problem(v) is None, "one plain folder name"),
        ("generation", lambda v: type(v) is int and v >= 0, "an int >= 0"),
        ("generation", lambda v: v <= MAX_GENERATION, f"at most 2**62 ({MAX_GENERATION}), the largest a save writes"),
        ("step", lambda v: _is_int(v, 0, 2**63 - 1), "an int in [0, 2**63)"),
        ("num_emas", lambda v: _is_int(v, 1, _MAX_NUM_EMAS), f"an int in [1, {_MAX_NUM_EMAS}]"),
        ("dtype", lambda v: isinstance(v, str) and v in _SAVED_DTYPES, f"one of {list(_SAVED_DTYPES)}"),
    ):
        if not ok(m[field]):
            raise _manifest_field_error(mpath, field, want, m[field])
    scheds = m.get("schedules")
    if scheds is not None and not (
        isinstance(scheds, list) and len(scheds) == m["num_emas"] and all(isinstance(d, dict) for d in scheds)
    ):
        raise _manifest_field_error(mpath, "schedules", "null or a list of num_emas objects", scheds)
    v1 = _is_int(m.get("format_version")) and m["format_version"] < 2
    if not v1 and not isinstance(m.get("checksum"), str):  # a list or dict is no algorithm's name (nor hashable)
        raise _manifest_field_error(mpath, "checksum", "the name of a checksum algorithm", m.get("checksum"))
    if not v1 and m["checksum"] not in _io.CHECKSUMS:
        raise CheckpointVersionError(
            f"{mpath}: field 'checksum' is {brief(m.get('checksum'))}, not an algorithm this version reads "
            f"({sorted(_io.CHECKSUMS)}): upgrade functional_ema, or restore the manifest from a copy"
        )
    if "extra" in m and m["extra"] is not None and not isinstance(m["extra"], dict):
        raise _manifest_field_error(mpath, "extra", "null or a JSON object", m["extra"])
    if m.get("selection") is not None and not _selection_ok(m["selection"]):
        want = "absent, or an object whose include and exclude are each null, a list of patterns or a predicate's name"
        raise _manifest_field_error(mpath, "selection", want, m["selection"])
    if m.get("parts") is None:
        _validate_part(mpath, m, m, ModelPart(), "")
        return
    _validate_parts(mpath, m, m["parts"])


def _validate_parts(mpath: Path, m: dict, parts: Any) -> None:
    """A format-4 manifest's ``parts``: distinct parts of one tensor- and pipeline-parallel grid, all of it, each
    part's fields checked."""
    if not (_is_int(m.get("format_version"), 4) and isinstance(parts, list) and 1 <= len(parts) <= _MAX_PARTS):
        raise _manifest_field_error(
            mpath, "parts", f"a list of 1 to {_MAX_PARTS} model-parallel parts (format 4)", parts
        )
    stray = [f for f in PART_FIELDS if f in m]
    if stray:
        raise _manifest_field_error(mpath, stray[0], "absent at the top level of a manifest with 'parts'", m[stray[0]])
    seen: set[ModelPart] = set()
    sizes: tuple[int, int] | None = None
    for i, p in enumerate(parts):
        where = f"parts[{i}]"
        if not isinstance(p, dict):
            raise _manifest_field_error(mpath, where, "an object", p)
        c = p.get("part")
        if not (
            isinstance(c, dict)
            and set(c) == {"tp", "tp_size", "pp", "pp_size"}
            and _is_int(c["tp_size"], 1, _MAX_WORLD)
            and _is_int(c["pp_size"], 1, _MAX_WORLD)
            and _is_int(c["tp"], 0, c["tp_size"] - 1)
            and _is_int(c["pp"], 0, c["pp_size"] - 1)
        ):
            raise _manifest_field_error(
                mpath, f"{where}.part", "{tp, tp_size, pp, pp_size}: ints, tp < tp_size, pp < pp_size", c
            )
        part = ModelPart(**c)
        if part in seen or (sizes is not None and (part.tp_size, part.pp_size) != sizes):
            raise _manifest_field_error(
                mpath,
                f"{where}.part",
                "a distinct part of the same tensor- and pipeline-parallel sizes as the other parts",
                c,
            )
        seen.add(part)
        sizes = (part.tp_size, part.pp_size)
        _validate_part(mpath, m, p, part, f"{where}.")
    assert sizes is not None  # parts holds at least one part (checked above)
    if len(seen) != sizes[0] * sizes[1]:
        raise IncompleteCheckpointError(
            f"{mpath}: field 'parts' lists {len(seen)} model-parallel part(s), but tensor-parallel size {sizes[0]} x pipeline "
            f"size {sizes[1]} makes {sizes[0] * sizes[1]}: the manifest is damaged or was edited"
        )


def _validate_part(mpath: Path, m: dict, p: dict, part: ModelPart, prefix: str) -> None:
    """One part's fields (``p`` is the manifest itself for a whole model), each named with ``prefix``."""
    missing = [f for f in _REQUIRED_PART_FIELDS if f not in p]
    if missing:
        raise CorruptCheckpointError(f"{mpath} lacks fields {[prefix + f for f in missing]}: the manifest is damaged")
    for field, ok, want in (
        ("world_size", lambda v: _is_int(v, 1, _MAX_WORLD), f"an int in [1, {_MAX_WORLD}]"),
        ("zero_stage", lambda v: _is_int(v, 0, 3), "0, 1, 2 or 3"),
        ("params", lambda v: isinstance(v, dict), "an object {parameter name: full shape}"),
        (
            "files",
            lambda v: isinstance(v, list) and 1 <= len(v) <= p["world_size"],
            "a list of 1 to world_size rank-file entries",
        ),
    ):
        if not ok(p[field]):
            raise _manifest_field_error(mpath, prefix + field, want, p[field])
    for name, shape in p["params"].items():
        if not _is_shape(shape):
            raise _manifest_field_error(mpath, f"{prefix}params[{name!r}]", "a full shape: a list of ints >= 0", shape)
    _validate_file_entries(
        mpath,
        m,
        p,
        part,
        prefix,
        "files",
        RANK_FILE,
        "ema_[tp<t>of<T>_pp<p>of<P>_]rank_<rank>_of_<world>[.gen<N>].safetensors",
    )
    tp_dims = p.get("tp_dims")
    if tp_dims is not None and not (
        isinstance(tp_dims, dict)
        and set(tp_dims) == set(p["params"])
        and all(d is None or (_is_int(d) and d < max(1, len(p["params"][n]))) for n, d in tp_dims.items())
    ):
        raise _manifest_field_error(
            mpath,
            prefix + "tp_dims",
            "null or {parameter name: a dimension of it, or null} for every parameter of the part",
            tp_dims,
        )
    _validate_experts(mpath, p, prefix)
    _validate_index(mpath, p, prefix)
    has_files, has_desc = p.get("buffer_files") is not None, p.get("buffers") is not None
    if has_files != has_desc:
        raise _manifest_field_error(
            mpath,
            prefix + ("buffers" if has_files else "buffer_files"),
            "present together with 'buffer_files' and 'buffers'",
            p.get("buffers" if has_files else "buffer_files"),
        )
    if has_files:
        validate_buffers_descriptor(mpath, p, prefix)
        if not (isinstance(p["buffer_files"], list) and 1 <= len(p["buffer_files"]) <= p["world_size"]):
            raise _manifest_field_error(
                mpath, prefix + "buffer_files", "a list of 1 to world_size buffer-file entries", p["buffer_files"]
            )
        _validate_file_entries(
            mpath,
            m,
            p,
            part,
            prefix,
            "buffer_files",
            BUFFER_FILE,
            "buffers_[tp<t>of<T>_pp<p>of<P>_]rank_<rank>_of_<world>[.gen<N>].safetensors",
        )


def _validate_index(mpath: Path, p: dict, prefix: str) -> None:
    """A part's ``piece_index`` (see :mod:`.index`): absent or null (older saves, expert parallelism), else one
    entry per parameter whose pieces, in the files listed, cover the parameter."""
    cuts = p.get(index.FIELD)
    if cuts is None:
        return
    field = prefix + index.FIELD
    if not (isinstance(cuts, dict) and set(cuts) == set(p["params"])):
        raise _manifest_field_error(mpath, field, "null or {parameter name: its cut} for every parameter", cuts)
    if p.get("experts") is not None:
        raise _manifest_field_error(mpath, field, "absent under expert parallelism", cuts)
    ranks = {e["rank"] for e in p["files"]}
    for name, cut in cuts.items():
        why = index.problem(math.prod(p["params"][name]), cut, ranks, _MAX_NUMEL)
        if why is not None:
            raise _manifest_field_error(mpath, f"{field}[{name!r}]", why, cut)


def _validate_experts(mpath: Path, p: dict, prefix: str) -> None:
    """A part's ``experts`` (expert parallelism): ``{"ep_size", "owners": {expert parameter: its expert-parallel
    rank}}``, and then an ``ep`` in every rank-file entry; absent without expert parallelism."""
    e = p.get("experts")
    if e is None:
        for i, f in enumerate(p["files"]):
            if "ep" in f:
                raise _manifest_field_error(
                    mpath, f"{prefix}files[{i}].ep", "absent (the part records no 'experts')", f["ep"]
                )
        return
    if not (
        isinstance(e, dict)
        and set(e) == {"ep_size", "owners"}
        and _is_int(e["ep_size"], 1, _MAX_WORLD)
        and isinstance(e["owners"], dict)
    ):
        raise _manifest_field_error(
            mpath, prefix + "experts", "{ep_size: an int >= 1, owners: {parameter: expert-parallel rank}}", e
        )
    for name, owner in e["owners"].items():
        if name not in p["params"] or not _is_int(owner, 0, e["ep_size"] - 1):
            raise _manifest_field_error(
                mpath,
                f"{prefix}experts.owners[{name!r}]",
                f"a parameter of 'params' owned by an expert-parallel rank in [0, {e['ep_size']})",
                owner,
            )
    for i, f in enumerate(p["files"]):
        if not _is_int(f.get("ep"), 0, e["ep_size"] - 1):
            raise _manifest_field_error(
                mpath,
                f"{prefix}files[{i}].ep",
                f"the file's expert-parallel rank, an int in [0, {e['ep_size']})",
                f.get("ep"),
            )


def validate_buffers_descriptor(mpath: Path, p: dict, prefix: str = "") -> None:
    """A part's ``buffers``: ``{"num_emas", "dtype", "floating": {name: shape}, "copied": {name: [dtype, shape]}}``."""
    d = p["buffers"]
    if not isinstance(d, dict):
        raise _manifest_field_error(mpath, prefix + "buffers", "an object {num_emas, dtype, floating, copied}", d)
    for field, ok, want in (
        ("num_emas", lambda v: _is_int(v, 1, _MAX_NUM_EMAS), f"an int in [1, {_MAX_NUM_EMAS}]"),
        ("dtype", lambda v: isinstance(v, str) and v in _SAVED_DTYPES, f"one of {list(_SAVED_DTYPES)}"),
        ("floating", lambda v: isinstance(v, dict), "an object {buffer name: shape}"),
        ("copied", lambda v: isinstance(v, dict), "an object {buffer name: [dtype, shape]}"),
    ):
        if not ok(d.get(field)):
            raise _manifest_field_error(mpath, f"{prefix}buffers.{field}", want, d.get(field))
    for name, shape in d["floating"].items():
        if not _is_shape(shape):
            raise _manifest_field_error(
                mpath, f"{prefix}buffers.floating[{name!r}]", "a shape: a list of ints >= 0", shape
            )
    for name, v in d["copied"].items():
        if not (isinstance(v, list) and len(v) == 2 and v[0] in _COPIED_DTYPES and _is_shape(v[1])):
            raise _manifest_field_error(mpath, f"{prefix}buffers.copied[{name!r}]", "[dtype name, shape]", v)
    both = sorted(set(d["floating"]) & set(d["copied"]))
    if both:
        raise _manifest_field_error(mpath, prefix + "buffers", "disjoint 'floating' and 'copied' names", both)


def _is_shape(shape: Any) -> bool:
    return (
        isinstance(shape, list)
        and len(shape) <= _MAX_DIMS
        and all(_is_int(x) for x in shape)
        and math.prod(shape) <= _MAX_NUMEL
    )


def _validate_file_entries(
    mpath: Path, m: dict, p: dict, part: ModelPart, prefix: str, key: str, pattern: re.Pattern, form: str
) -> None:
    """The records of ``p[key]`` (``files`` or ``buffer_files`` of one part): the library's own file names
    for their part, rank, world size and generation, distinct ranks, sizes and checksums of the right types."""
    world, generation, seen = p["world_size"], m["generation"], set()
    for i, e in enumerate(p[key]):
        field = f"{prefix}{key}[{i}]"
        if not isinstance(e, dict):
            raise _manifest_field_error(mpath, field, "an object", e)
        name = e.get("file")
        match = pattern.match(name) if isinstance(name, str) else None
        if match is None:
            raise CorruptCheckpointError(
                f"{mpath}: field '{field}.file' is not the name of a functional_ema file ({form}, inside the tag "
                "folder); the manifest is damaged or was edited: only the library's own files beside it are ever read"
            )
        rank = e.get("rank")
        if not _is_int(rank, 0, world - 1) or rank in seen:
            raise _manifest_field_error(mpath, f"{field}.rank", f"a distinct int in [0, {world})", rank)
        seen.add(rank)
        if file_identity(match) != (part, rank, world, generation):
            raise _manifest_field_error(
                mpath,
                f"{field}.file",
                f"the file of rank {rank} of world_size {world}, generation {generation}"
                + ("" if part.whole else f", {part.describe()}"),
                name,
            )
        header_key, tensors_key, is_sum, want_sum = _checksum_form(m, key)
        if tensors_key == "chunk_checksums":  # format 5: one string per rank file
            sums_ok, want_sums = isinstance(e.get(tensors_key), str), "a string of hex checksums"
        else:
            sums_ok, want_sums = (
                isinstance(e.get(tensors_key, {}), dict),
                f"an object {{tensor name: [{want_sum}, ...]}}",
            )
        for k, ok, want in (
            ("bytes", _is_int(e.get("bytes")), "an int >= 0"),
            (header_key, is_sum(e.get(header_key)), want_sum),
            (tensors_key, sums_ok, want_sums),
        ):
            if not ok:
                raise _manifest_field_error(mpath, f"{field}.{k}", want, e.get(k))
        if key != "files":  # a rank file's chunk checksums: checked when a reader opens it (check_tensor_checksums)
            check_tensor_checksums(mpath, m, e, field, key)


def _checksum_form(m: dict, key: str = "files") -> tuple[str, str, Callable[[Any], bool], str]:
    """(the keys of a file record's header and chunk checksums, the test of one checksum, what one must be)."""
    if _is_int(m.get("format_version")) and m["format_version"] < 2:  # format 1: CRC-32 integers
        return "header_crc32", "tensor_crc32", lambda c: _is_int(c, 0, 2**32 - 1), "a CRC-32 (an int in [0, 2**32))"
    sums = "chunk_checksums" if uses_compact_checksums(m, key) else "tensor_checksums"  # formats 5 / 2-4
    return "header_checksum", sums, _is_hex64, f"a {m.get('checksum')} checksum (a hex string)"


def check_tensor_checksums(mpath: Path, m: dict, e: dict, field: str, key: str = "files") -> None:
    """The chunk checksums of one file record ``e`` (at ``field``, of ``m[key]``), named in the error.

    A rank file's are checked when a reader opens that file, not with the manifest: a rank loading at
    another world size opens a few of the files, and checking every rank's would cost it O(world size x
    parameters)."""
    _, tensors_key, is_sum, want_sum = _checksum_form(m, key)
    if tensors_key == "chunk_checksums":
        text, width = e[tensors_key], 8 if m.get("checksum") == "crc32" else 16
        if not (len(text) % width == 0 and _HEX.fullmatch(text)):
            raise _manifest_field_error(
                mpath, f"{field}.{tensors_key}", f"{width}-digit {m.get('checksum')} checksums in one hex string", text
            )
        return
    for k, crcs in e.get(tensors_key, {}).items():
        if not (isinstance(crcs, list) and all(is_sum(c) for c in crcs)):
            raise _manifest_field_error(mpath, f"{field}.{tensors_key}[{k!r}]", f"a list, each {want_sum}", crcs)


_HEX = re.compile(r"[0-9a-fA-F]*")


def _is_hex64(v: Any) -> bool:
    """A checksum as format 2 stores it: a hex string of at most 64 bits."""
    if not isinstance(v, str) or not 1 <= len(v) <= 16:
        return False
    try:
        int(v, 16)
    except ValueError:
        return False
    return True


def check_json_metadata(where: str, meta: dict, key: str, manifest: dict) -> None:
    """The manifest's field ``key`` must equal the JSON saved under ``key`` in a file's header, which the
    manifest's header checksum covers: ``schedules`` (what post-hoc EMA reads its gammas from) and, since
    format 3, ``extra`` (a save's own record, e.g. an integration's training step)."""
    raw = meta.get(key)
    if raw is None and key == "extra" and int(manifest.get("format_version", 0)) < 3:
        raw = "null"  # older files have no 'extra'
    try:
        saved = json.loads(raw) if isinstance(raw, str) else ...
    except (ValueError, RecursionError):
        saved = ...
    if saved is ...:
        raise CorruptCheckpointError(f"{where}: metadata {key!r} is missing or not JSON: the file is damaged")
    if json.dumps(saved, sort_keys=True) != json.dumps(manifest.get(key), sort_keys=True):
        raise CorruptCheckpointError(
            f"{where}: the manifest's field {key!r} ({brief(manifest.get(key))}) differs from the one saved "
            f"in this file's header ({brief(saved)}): the manifest was edited after the save"
            f"{' (e.g. a changed gamma)' if key == 'schedules' else ''}. Restore the manifest from a copy or load another tag"
        )


def parse_layout(
    where: str, text: Any, manifest: dict, rank: int, ep: int | None = None, entry: str = "files[?]"
) -> ShardLayout:
    """The rank file's ``layout`` metadata, checked against its part of the manifest (``manifest``: one
    entry of :func:`manifest_parts`): same rank, world size, stage, model-parallel part, tensor-parallel
    split and parameters (with their full shapes), every piece inside its parameter. Under expert
    parallelism also: the manifest's ``experts`` record, the expert-parallel rank ``ep`` that the
    manifest's file entry ``entry`` gives the file, and no piece of an expert another expert-parallel
    rank owns."""

    def bad(field: str, want: str, got: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: layout metadata field {field!r} must be {want}, got {brief(got)}; "
            "the file is damaged: restore it or load another tag"
        )

    try:
        d = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        d = None
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: metadata 'layout' is missing or not a JSON object; the file is damaged")
    for field, want in (("rank", rank), ("world_size", manifest["world_size"]), ("stage", manifest["zero_stage"])):
        if type(d.get(field)) is not int or d[field] != want:
            raise bad(field, f"{want}, as in the manifest", d.get(field))
    part = manifest["part"]
    if (d.get("part") or ModelPart().to_json_dict()) != part.to_json_dict():
        raise bad("part", f"{part.to_json_dict()} ({part.describe()}), as in the manifest", d.get("part"))
    if d.get("tp_dims") != manifest.get("tp_dims"):
        raise bad("tp_dims", f"{brief(manifest.get('tp_dims'))}, as in the manifest", d.get("tp_dims"))
    specs, params = d.get("specs"), manifest["params"]
    if not isinstance(specs, dict):
        raise bad("specs", "an object {parameter name: [shape, offset, numel]}", specs)
    if set(specs) != set(params):
        raise CorruptCheckpointError(
            f"{where}: its layout lists other parameters than the manifest's field 'params': only in the file "
            f"{short_list(sorted(set(specs) - set(params)), 4)}, only in the manifest {short_list(sorted(set(params) - set(specs)), 4)}"
        )
    out = {}
    for n, v in specs.items():
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], list)):
            raise bad(f"specs[{n!r}]", "[shape, offset, numel]", v)
        shape, off, cnt = v
        if not all(_is_int(x) for x in shape) or shape != params[n]:
            raise bad(f"specs[{n!r}] shape", f"{params[n]}, the shape in the manifest's field 'params'", shape)
        full = math.prod(shape)
        if not (_is_int(off) and _is_int(cnt) and off + cnt <= full):
            raise bad(
                f"specs[{n!r}] offset, numel", f"a piece inside the {full} elements of {tuple(shape)}", [off, cnt]
            )
        out[n] = ShardSpec(tuple(shape), off, cnt)
    experts = _parse_experts(where, d.get("experts"), manifest, ep, entry, out, bad)
    return ShardLayout(
        rank,
        manifest["world_size"],
        manifest["zero_stage"],
        out,
        part=part,
        tp_dims=manifest.get("tp_dims"),
        experts=experts,
    )


def _parse_experts(
    where: str,
    e: Any,
    manifest: dict[str, Any],
    ep: int | None,
    entry: str,
    specs: dict[str, ShardSpec],
    bad: Callable[[str, str, Any], CorruptCheckpointError],
) -> ExpertLayout | None:
    """The file's expert-parallel record against the manifest's (see :func:`parse_layout`)."""
    want = manifest.get("experts")
    if want is None:
        if e is not None:
            raise bad("experts", "absent, as in the manifest (no expert parallelism)", e)
        return None
    if not (isinstance(e, dict) and {"ep_size": e.get("ep_size"), "owners": e.get("owners")} == want):
        got = e.get("ep_size") if isinstance(e, dict) else e
        raise CorruptCheckpointError(
            f"{where}: the manifest's field 'experts' (ep_size {want['ep_size']}, {len(want['owners'])} expert parameters "
            f"and the expert-parallel rank of each) differs from the record in this file's header (ep_size {brief(got)}): "
            "the manifest was edited after the save or mixes two saves; restore it or load another tag"
        )
    if ep is None or e.get("ep") != ep:  # None: the manifest's file entry names no expert-parallel rank
        raise CorruptCheckpointError(
            f"{where}: the manifest's field '{entry}.ep' says expert-parallel rank {ep}, but the file's header holds the "
            f"experts of expert-parallel rank {brief(e.get('ep'))}: the manifest was edited or mixes two saves; restore it "
            "or load another tag"
        )
    foreign = [n for n, o in want["owners"].items() if o != ep and specs[n].numel]
    if foreign:
        n = foreign[0]
        raise CorruptCheckpointError(
            f"{where}: it holds elements of expert parameter {n!r}, which the manifest's field 'experts' gives to "
            f"expert-parallel rank {want['owners'][n]}, but this file is expert-parallel rank {ep}'s: the file or "
            "manifest is damaged or was edited; restore it or load another tag"
        )
    return ExpertLayout(int(ep), int(want["ep_size"]), dict(want["owners"]))


# ------------------------------------------------------------------------------ outputs of tools


#: Files beside the tag folders in a checkpoint's root: DeepSpeed's pointer files and recovery scripts
#: (0.19 writes the scripts), and the pointer functional_ema.save writes (the only one an FSDP2 / DDP /
#: plain checkpoint has). Compared lower-cased (case-insensitive filesystems).
_POINTER_FILES = (
    "latest",
    "latest_universal",
    "zero_to_fp32.py",
    "zero_to_torch.py",
    LATEST_NAME,
)


def _is_checkpoint_file(name: str) -> bool:
    """A name only a checkpoint's own files have: the library's, DeepSpeed's (``*_states.pt``, the pointer
    files and recovery scripts beside the tags)."""
    return is_own_file(name) or name == LATEST_NAME or name.lower() in _POINTER_FILES or name.endswith("_states.pt")


def _looks_like_tag(folder: Path) -> bool:
    """A folder holding an EMA manifest, rank or buffer files, a record, or DeepSpeed's ``*_states.pt`` files."""
    try:
        return any(is_own_file(p.name) or p.name.endswith("_states.pt") for p in folder.iterdir())
    except OSError:
        return False


def check_export_path(out_path: str | os.PathLike, what: str = "export") -> Path:
    """Refuse an export (full weights written by a training run) that would land on a checkpoint's files.

    Refused, symlinks resolved: a directory; a file named like a checkpoint's own files (rank, buffer
    and manifest files, records, ``latest``/``ema_latest``, DeepSpeed's ``*_states.pt``); any file inside
    a tag folder (one holding such files). The message names the path and what it would overwrite.
    """
    out = Path(out_path)
    try:
        real = out.resolve()
    except (OSError, RuntimeError) as e:
        raise OutputPathError(f"{what}: cannot resolve the path {out}: {e}") from None
    shown = f"{out}{f' (-> {real})' if real != out.absolute() else ''}"
    fix = "Write it outside the checkpoint folders, e.g. next to them as ema.safetensors"
    if real.is_dir():
        raise OutputPathError(f"{what}: refusing to write {shown}: it is a directory; give a .safetensors file name")
    if _is_checkpoint_file(real.name):
        raise OutputPathError(
            f"{what}: refusing to write {shown}: that name belongs to a checkpoint's own files, which "
            f"an export would replace. {fix}"
        )
    if _looks_like_tag(real.parent):
        raise OutputPathError(
            f"{what}: refusing to write {shown}: {real.parent} holds a checkpoint's files (a tag "
            f"folder), and an export there would mix with them. {fix}"
        )
    return out


def writable(folder: Path) -> bool:
    """Whether this process may create files in ``folder``, by its effective ids where the platform can say (a setuid
    process, a container user with CAP_DAC_OVERRIDE: the real ids would refuse what the write would do)."""
    return os.access(folder, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids)


def check_out_folder(out: Path, what: str) -> None:
    """Refuse (``OutputPathError``, naming ``what`` and ``out``) an output file whose folder is missing, not a folder
    or not writable: the write would otherwise fail last, after everything was read, naming its temporary file.
    A leading ``~`` is named: nothing here expands it (a shell does, unquoted)."""
    parent = out.parent  # Path("o.safetensors").parent is Path("."): always there
    # a folder that exists only once ".." is folded ("ck/sub/../x", sub missing) is left to the checks of where
    # the path leads (inside a checkpoint: refused as such)
    folder = parent if parent.is_dir() else Path(os.path.realpath(parent))
    tilde = (
        f" ('~' is not expanded here: write the path out, e.g. {Path(os.path.expanduser(str(out)))})"
        # not where a file or folder of that very name is there: the path names it, as a shell leaves the word
        if out.parts and out.parts[0].startswith("~") and not os.path.lexists(out.parts[0])
        else ""
    )
    if not folder.is_dir():
        raise OutputPathError(
            f"{what}: the folder {parent} of {out} does not exist (or is not a folder){tilde}: create it first, or "
            "choose another path"
        )
    if not writable(folder):
        raise OutputPathError(
            f"{what}: the folder {parent} of {out} is not writable by this user: choose another path, or make it "
            "writable"
        )


def check_output(
    out_path: str | os.PathLike,
    root: str | os.PathLike,
    tag_dirs: Sequence[Path],
    overwrite: bool,
    what: str = "out_path",
) -> Path:
    """Refuse an output that would land inside the checkpoint being read, or replace a file unasked.

    ``root`` is the checkpoint (or snapshot) directory and ``tag_dirs`` the tag folders being read.
    Refused, after resolving symlinks: anything inside a tag folder being read or inside any other
    folder of ``root`` (DeepSpeed's and functional_ema's tag folders), the pointer files beside them
    (``latest``, ...), ``root`` itself, any directory; an existing file unless ``overwrite``; a file whose folder is
    missing or not writable (:func:`check_out_folder`, naming ``what``). A ``root`` that is a URL (a checkpoint in
    a bucket) has no local folder to keep the output out of: only the last three apply. ``out_path`` is a local
    path (a ``file://`` URL is converted by the caller, ``_args.check_path``).
    """
    out = Path(out_path)
    try:
        real = out.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise OutputPathError(f"cannot resolve the output path {out}: {e}") from None
    if not is_url(root):  # Path("s3://b/run") would be ./s3:/b/run, and refuse an unrelated local path
        _check_outside(out, real, root, tag_dirs)
    if real.is_dir():
        raise OutputPathError(f"refusing to write {out}: it is a directory; give a .safetensors file name")
    if not overwrite and (out.exists() or out.is_symlink()):
        raise OutputPathError(
            f"refusing to replace the existing file {out}: pass --overwrite (overwrite=True) to replace it "
            "(atomically), or choose another name"
        )
    check_out_folder(out, what)
    return out


def check_outside(out_path: str | os.PathLike, folder: Path, kind: str, roots: Sequence[Path] = ()) -> None:
    """Refuse (``OutputPathError``) an output at or inside the local ``folder`` being read, ``kind`` naming it
    ("checkpoint ck (CHECKPOINT_DIR)"): the command line's check, before anything is read, stricter than
    :func:`check_output` for the folder given (a new file or subfolder in it is refused too). ``roots``: the
    checkpoint roots the reader takes above ``folder`` when it is a tag folder given as the checkpoint, held to
    :func:`check_output`'s rules and no more (the root itself, its pointer files, its tag-like folders; a new file
    or another subfolder there, ``exports/``, is not the checkpoint's and stays open, as the library leaves it)."""
    out = Path(out_path)
    try:
        real, real_folder = out.resolve(), folder.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise OutputPathError(f"cannot resolve the output path {out}: {e}") from None
    if real == real_folder or real_folder in real.parents:
        # advice beyond the root: a name beside the tag folder could be one of the root's refused ones
        beside = Path(roots[0]).resolve() if roots else real_folder
        raise OutputPathError(
            f"refusing to write {_shown(out, real)}: it is inside the {kind} being read, and would add to or replace "
            f"its files. {_outside_fix(out, beside, '')}"
        )
    for root in roots:
        _check_outside(out, real, root, [folder])


def _shown(out: Path, real: Path) -> str:
    """``out`` as given, with where it leads when a link or ``..`` takes it elsewhere."""
    return f"{out}{f' (-> {real})' if real != out.absolute() else ''}"


def _outside_fix(out: Path, real_root: Path, of: str = " the checkpoint") -> str:
    """The advice of a refusal: the same name beside the checkpoint ``real_root``; the root's own name with
    ``.safetensors`` where that is no file name (``.``, ``..``: OUT given as the checkpoint or above a tag folder),
    would be the checkpoint itself, or is an existing folder there."""
    beside = real_root.parent / out.name
    if out.name in ("", ".", "..") or beside == real_root or beside.is_dir():
        beside = real_root.parent / f"{real_root.name}.safetensors"
    return f"Write it outside{of}, e.g. {beside}"


def _check_outside(out: Path, real: Path, root: str | os.PathLike, tag_dirs: Sequence[Path]) -> None:
    """:func:`check_output`'s refusal of an output (``real``: resolved) inside the local checkpoint ``root``."""
    try:
        real_root = Path(root).resolve()
        real_tags = [Path(t).resolve() for t in tag_dirs]
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise OutputPathError(f"cannot resolve the output path {out}: {e}") from None
    inside = next((t for t in real_tags if real == t or t in real.parents), None)
    if inside is not None:
        raise OutputPathError(
            f"refusing to write {_shown(out, real)}: it is inside the tag folder {inside} being read, and would "
            f"replace or add to that checkpoint's files. {_outside_fix(out, real_root)}"
        )
    first = real_root / real.relative_to(real_root).parts[0] if real_root in real.parents else None
    # in the root: any name of a file DeepSpeed or functional_ema writes there or in a tag (a root read as
    # its own tag folder holds those), whichever case the filesystem folds it to
    own = first == real and (_is_checkpoint_file(real.name) or _is_checkpoint_file(real.name.lower()))
    if real == real_root or (first is not None and (own or (first != real and _looks_like_tag(first)))):
        raise OutputPathError(
            f"refusing to write {_shown(out, real)}: it is inside the checkpoint directory {real_root} being read "
            f"(a tag folder or a pointer file such as 'latest'). {_outside_fix(out, real_root)}"
        )


def describe_buffers(buffers: object, state: EmaState) -> dict | None:
    """The manifest's ``buffers`` record of a :class:`functional_ema.buffers.BufferState` saved with
    ``state`` (checked: same step and number of EMAs, one floating dtype, names and shapes), or None."""
    if buffers is None:
        return None
    if not isinstance(buffers, BufferState):
        raise TypeError(
            f"save(buffers=...) takes a functional_ema.buffers.BufferState (from init_buffers / update_buffers / "
            f"load_buffers), got {type(buffers).__name__}"
        )
    if int(buffers.step) != int(state.step):
        raise CheckpointMismatchError(
            f"save(buffers=...): the buffer state is at step {int(buffers.step)} but the EMA state at step {int(state.step)}; "
            "update both at the same steps so a resume reads one step: pass update_buffers the EMA state's step after "
            'update, int(state.step) (update(..., nonfinite="skip") keeps it at the last step it averaged, and the '
            "buffers then skip that step too)"
        )
    if buffers.num_emas != state.num_emas:
        raise CheckpointMismatchError(
            f"save(buffers=...): the buffer state tracks {buffers.num_emas} EMA(s) but the EMA "
            f"state {state.num_emas}; make both with the same num_emas"
        )
    floating: dict[str, list[int]] = {}
    dtypes = set()
    for k, ema in enumerate(buffers.emas):
        if k and sorted(ema) != sorted(buffers.emas[0]):
            raise CheckpointMismatchError(f"save(buffers=...): buffer EMA {k} holds other names than buffer EMA 0")
        for n, t in ema.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(
                    f"save(buffers=...): buffers.emas[{k}][{n!r}] must be a floating tensor, got "
                    f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
            if n in floating and floating[n] != list(t.shape):
                raise CheckpointMismatchError(
                    f"save(buffers=...): buffer {n!r} has shape {list(t.shape)} in EMA {k} but {floating[n]} in EMA 0"
                )
            floating[n] = list(t.shape)
            dtypes.add(t.dtype)
    if len(dtypes) > 1:
        raise CheckpointMismatchError(f"save(buffers=...): the buffer EMAs mix dtypes {sorted(map(str, dtypes))}")
    copied = {}
    for n, t in buffers.copied.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in _io.DTYPE_TO_STR:
            raise TypeError(
                f"save(buffers=...): buffers.copied[{n!r}] must be a tensor of a storable dtype, got "
                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
        if n in floating:
            raise CheckpointMismatchError(f"save(buffers=...): buffer {n!r} is both averaged and copied")
        copied[n] = [dtype_name(t.dtype), list(t.shape)]
    return {
        "num_emas": buffers.num_emas,
        "dtype": dtype_name(dtypes.pop() if dtypes else torch.float32),
        "floating": dict(sorted(floating.items())),
        "copied": dict(sorted(copied.items())),
    }
