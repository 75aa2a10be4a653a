"""``functional_ema._checkpoint.format``: what a checkpoint is on disk, and the checks of everything read back.

The manifests and rank-file layouts are real ones: ``tests/data/format/<layout>.json`` hold the manifest
and the rank files' ``layout`` / ``schedules`` / ``extra`` metadata of real multi-rank saves of every layout
(plain module, ZeRO-3, MoE, pipeline, DeepSpeed and FSDP2 tensor parallelism, FSDP2, HSDP) and of a save in
one process (``single``), written by ``make_format.py`` there; ``tests/data/ckpt_v1`` holds a format-1
checkpoint. Each case mutates one field of one of them and checks the refusal: the library's error class
and its whole message (the field's path, what it must be, what it holds); the clean ones must be accepted
with the exact parsed result. One process, no ranks, no save (its engine detection imports
torch.distributed.pipelining: seconds): ``make mutate`` reruns these tests per mutant.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import functional_ema as fe
from functional_ema import _io
from functional_ema._checkpoint import format as fmt
from functional_ema._checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidTagError,
    OutputPathError,
)
from functional_ema._checkpoint.reader import StoragePath
from functional_ema._layout import ExpertLayout, ModelPart, ShardLayout, ShardSpec
from functional_ema._state import BufferState, EmaState
from functional_ema._storage import storage_for

DATA = Path(__file__).parent / "data" / "format"
V1_MANIFEST = Path(__file__).parent / "data" / "ckpt_v1" / "global_step3" / "ema_manifest.json"
LAYOUTS = ("single", "plain", "zero3", "moe", "pp", "ds_tp", "fsdp2", "hsdp", "tp")
MPATH = Path("/ck/t/ema_manifest.json")
CE = CorruptCheckpointError
GONE = object()  # an edit's value: delete the key
Edit = Callable[[dict], None]


# ------------------------------------------------------------------------------------------ helpers


@functools.cache
def _text(name: str) -> str:
    return V1_MANIFEST.read_text() if name == "v1" else (DATA / f"{name}.json").read_text()


def real(name: str) -> dict:
    """A fresh copy of ``tests/data/format/<name>.json`` (``manifest`` and ``metadata``)."""
    return json.loads(_text(name))


def manifest(name: str) -> dict:
    """A fresh copy of a real manifest (``v1``: the format-1 one of tests/data/ckpt_v1)."""
    return json.loads(_text(name)) if name == "v1" else real(name)["manifest"]


def shown(value: Any) -> str:
    """How a message shows a value: type name and repr, cut at 60 characters (``test_brief`` pins it)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:60] + '...'}"


def field_error(field: str, want: str, got: Any) -> str:
    return (
        f"{MPATH}: field {field!r} must be {want}, got {shown(got)}. The manifest is damaged or was edited: "
        "restore it from a copy or load another tag"
    )


def not_a_name(field: str, form: str = "ema") -> str:
    return (
        f"{MPATH}: field '{field}.file' is not the name of a functional_ema file ({form}_[tp<t>of<T>_pp<p>of<P>_]"
        "rank_<rank>_of_<world>[.gen<N>].safetensors, inside the tag folder); the manifest is damaged or was edited: "
        "only the library's own files beside it are ever read"
    )


def error_of(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned for the caller's exact checks
        return e
    raise AssertionError("no error raised")


def refusal(fn: Callable[[], Any], exc: type[BaseException]) -> str:
    """The message of the error ``fn`` raises, which must be of exactly class ``exc``."""
    e = error_of(fn)
    assert type(e) is exc, f"{type(e).__name__}: {e}"
    return str(e)


def put(path: str | tuple, value: Any) -> Edit:
    """An edit setting (or, with ``GONE``, deleting) the item at ``path`` (a key, or a tuple of keys and indices)."""
    keys = (path,) if isinstance(path, str) else path

    def edit(m: dict) -> None:
        *head, last = keys
        for k in head:
            m = m[k]
        if value is GONE:
            del m[last]
        elif isinstance(m, list) and last == len(m):
            m.append(copy.deepcopy(value))
        else:
            m[last] = copy.deepcopy(value)

    return edit


def copied(src: tuple, dst: tuple) -> Edit:
    """An edit copying the item at ``src`` over the one at ``dst``."""

    def edit(m: dict) -> None:
        v = m
        for k in src:
            v = v[k]
        put(dst, v)(m)

    return edit


def older(version: int) -> Edit:
    """The manifest as format ``version`` (2 to 4) wrote it: its rank-file records hold a ``tensor_checksums``
    object (here: the record's first chunk checksum) instead of format 5's ``chunk_checksums`` string."""

    def edit(m: dict) -> None:
        m["format_version"] = version
        for p in m.get("parts") or [m]:
            for e in p["files"]:
                e["tensor_checksums"] = {"emas.0.w": [e.pop("chunk_checksums")[:16]]}

    return edit


def repart(i: int, tp: int, tp_size: int, pp: int, pp_size: int) -> Edit:
    """Moves ``parts[i]`` to other model-parallel coordinates, its files renamed to match."""
    coords = f"tp{tp:03d}of{tp_size:03d}_pp{pp:03d}of{pp_size:03d}_"

    def edit(m: dict) -> None:
        p = m["parts"][i]
        p["part"] = {"pp": pp, "pp_size": pp_size, "tp": tp, "tp_size": tp_size}
        for e in p["files"] + (p.get("buffer_files") or []):
            e["file"] = re.sub(r"tp\d{3}of\d{3}_pp\d{3}of\d{3}_", coords, e["file"])

    return edit


def edited(name: str, edits: Edit | tuple[Edit, ...]) -> dict:
    m = manifest(name)
    for edit in edits if isinstance(edits, tuple) else (edits,):
        edit(m)
    return m


# -------------------------------------------------------------------------------- names of files


def test_file_names():
    """Rank and buffer file names: zero-padded rank and world size, ``.gen<N>`` from generation 1, the
    model-parallel coordinates for a part (none for the whole model); every argument checked, by name."""
    assert fmt.rank_file_name(0, 1) == "ema_rank_00000_of_00001.safetensors"
    assert fmt.rank_file_name(3, 12, 2) == "ema_rank_00003_of_00012.gen2.safetensors"
    assert fmt.rank_file_name(0, 1, 0, ModelPart()) == "ema_rank_00000_of_00001.safetensors"
    assert (
        fmt.rank_file_name(1, 2, 0, ModelPart(1, 2, 0, 3))
        == "ema_tp001of002_pp000of003_rank_00001_of_00002.safetensors"
    )
    assert fmt.buffer_file_name(1, 2) == "buffers_rank_00001_of_00002.safetensors"
    assert fmt.buffer_file_name(0, 4, 5) == "buffers_rank_00000_of_00004.gen5.safetensors"
    assert (
        fmt.buffer_file_name(0, 1, 1, ModelPart(0, 1, 1, 2))
        == "buffers_tp000of001_pp001of002_rank_00000_of_00001.gen1.safetensors"
    )
    for fn in (fmt.rank_file_name, fmt.buffer_file_name):
        assert (
            refusal(lambda fn=fn: fn(2, 2), ValueError) == "rank=2 is not a rank of the group: it has 2 rank(s), 0 to 1"
        )
        assert refusal(lambda fn=fn: fn(0, 0), ValueError) == "world_size must be >= 1, got 0"
        assert refusal(lambda fn=fn: fn(0, True), TypeError) == "world_size must be an int, got a bool (True)"
        assert refusal(lambda fn=fn: fn(True, 2), TypeError) == "rank must be an int, got a bool (True)"
        assert refusal(lambda fn=fn: fn(-1, 2), ValueError) == "rank=-1 is outside [0, 2**63 - 1]"
        assert refusal(lambda fn=fn: fn(0, 1, -1), ValueError) == "generation=-1 is outside [0, 2**63 - 1]"
        assert refusal(lambda fn=fn: fn(0, 1, 1.5), TypeError) == "generation must be an int, got float 1.5"
        assert (
            refusal(lambda fn=fn: fn(0, 1, 0, (0, 1, 0, 1)), TypeError)
            == "part must be a ModelPart (or None for a whole model), got tuple"
        )


def test_file_identity_and_own_files():
    """A rank or buffer file name's (part, rank, world size, generation); which names are the library's."""
    full = "ema_tp001of002_pp003of004_rank_00005_of_00006.gen7.safetensors"
    assert fmt.file_identity(fmt.RANK_FILE.match(full)) == (ModelPart(1, 2, 3, 4), 5, 6, 7)
    assert fmt.file_identity(fmt.RANK_FILE.match("ema_rank_00001_of_00002.safetensors")) == (ModelPart(), 1, 2, 0)
    buffers = "buffers_tp000of003_pp002of005_rank_00004_of_00009.gen8.safetensors"
    assert fmt.file_identity(fmt.BUFFER_FILE.match(buffers)) == (ModelPart(0, 3, 2, 5), 4, 9, 8)
    assert fmt.BUFFER_FILE.match(full) is None and fmt.RANK_FILE.match(buffers) is None
    own = [
        full,
        buffers,
        "ema_manifest.json",
        ".ema_write.lock",
        "integration.json",
        "ema_rank_00000_of_00001.safetensors.tmp-12-ab",
        "buffers_x.tmp-1",
        "ema_manifest.json.tmp-1-a",
        "integration.json.tmp-3",
        "ema_x.tmp-",
    ]
    assert [n for n in own if not fmt.is_own_file(n)] == []
    others = [
        "model.safetensors",
        "x.tmp-1",
        "ema_latest",
        "latest",
        "ema_x",
        "buffers_rank_0.safetensors",
        "ema_manifest",
    ]
    assert [n for n in others if fmt.is_own_file(n)] == []


def test_small_names():
    """Tensor keys, dtype names both ways (only floating dtypes are EMA dtypes), the library's version."""
    assert fmt.tensor_key(1, "a.b") == "emas.1.a.b"
    assert [fmt.dtype_name(d) for d in (torch.float16, torch.bfloat16, torch.int64)] == ["float16", "bfloat16", "int64"]
    assert fmt.parse_dtype("bfloat16", "W") is torch.bfloat16 and fmt.parse_dtype("float64", "W") is torch.float64
    for bad in ("int64", "nonexistent", "bool", 5, "Tensor"):
        assert refusal(lambda bad=bad: fmt.parse_dtype(bad, "W"), CE) == f"W: unknown EMA dtype {bad!r}"
    assert fmt.library_version() == fe.__version__
    assert fmt._SAVED_DTYPES == ("float64", "float32", "float16", "bfloat16")


def test_short_list_and_brief():
    """The bracketed short list of names (8 shown by default) and the short form of a value in messages."""
    assert fmt.short_list([]) == "[]"
    assert fmt.short_list(("x",)) == "['x']"
    assert fmt.short_list(list("abcdefghi")) == "['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h' and 1 more]"
    assert fmt.short_list(list("abcdefgh")) == "['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h']"
    assert fmt.short_list(("x", "y", "z"), 2) == "['x', 'y' and 1 more]"
    assert fmt.brief(5) == "int 5" and fmt.brief(None) == "NoneType None" and fmt.brief(True) == "bool True"
    assert fmt.brief("x" * 58) == "str '" + "x" * 58 + "'"  # a repr of 60 characters: whole
    assert fmt.brief("x" * 59) == "str '" + "x" * 59 + "..."  # 61: its first 60
    assert fmt.brief([1] * 30) == "list [" + "1, " * 19 + "1,..."


# ----------------------------------------------------------------------------------- checksummed records


def _canonical_checksum(body: dict) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(text.encode())


def test_record_bytes():
    """A record as written: the fields plus ``format`` and the XXH3-64 of their canonical JSON, sorted, indented
    by 1; a given ``checksum`` is replaced; NaN is refused (not JSON)."""
    rec = {"step": 3, "b": [1, 2], "checksum": "stale"}
    body = {"b": [1, 2], "format": "functional_ema.integration", "step": 3}
    want = dict(body, checksum=_canonical_checksum(body))
    assert fmt.record_bytes(rec) == json.dumps(want, sort_keys=True, indent=1).encode()
    assert rec["checksum"] == "stale"  # the caller's dict is left alone
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        fmt.record_bytes({"x": float("nan")})


def test_read_record(tmp_path):
    """``read_record``: None when absent; the record, verified, whatever the order of its keys on disk; else a
    ``CorruptCheckpointError`` naming the file and what is wrong, never quoting its content."""
    path = tmp_path / "integration.json"
    assert fmt.read_record(path) is None
    rec = {"step": 7, "kind": "ema"}
    path.write_bytes(fmt.record_bytes(rec))
    want = {"format": "functional_ema.integration", "kind": "ema", "step": 7}
    want["checksum"] = _canonical_checksum(want)
    assert fmt.read_record(path) == want
    path.write_text(json.dumps(dict(reversed(list(want.items())))))  # same content, other order, no indent
    assert fmt.read_record(path) == want
    pad = "x" * (fmt.MAX_EXTRA_BYTES - len(fmt.record_bytes({"pad": ""})))
    path.write_bytes(fmt.record_bytes({"pad": pad}))  # exactly the bound
    assert path.stat().st_size == fmt.MAX_EXTRA_BYTES and fmt.read_record(path)["pad"] == pad
    path.write_bytes(fmt.record_bytes({"pad": pad + "y"}))
    assert (
        refusal(lambda: fmt.read_record(path), CE) == f"{path} holds 65537 bytes, far more than a record: it is damaged"
    )
    not_json = f"{path} is not a readable JSON record ({{}}): the file is damaged; restore it or resume from another checkpoint"
    for raw, why in (
        (b"\xff\xfe", "UnicodeDecodeError"),
        (b"{", "JSONDecodeError"),
        (b"[" * 60000, "nested too deeply"),
    ):
        path.write_bytes(raw)
        assert refusal(lambda: fmt.read_record(path), CE) == not_json.format(why)
    not_record = (
        f"{path} is not a functional_ema record (no format 'functional_ema.integration' and checksum): "
        "the file is damaged or was replaced"
    )
    for bad in ([1], dict(want, format="x"), {k: v for k, v in want.items() if k != "format"}, dict(want, checksum=5)):
        path.write_text(json.dumps(bad))
        assert refusal(lambda: fmt.read_record(path), CE) == not_record
    path.write_text(json.dumps(dict(want, step=8)))
    assert refusal(lambda: fmt.read_record(path), CE) == (
        f"{path}: its checksum does not match its content: the file was damaged or edited by hand; restore it or "
        "resume from another checkpoint"
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    assert refusal(lambda: fmt.read_record(folder), CE) == (
        f"{folder} is not a readable JSON record (IsADirectoryError): the file is damaged; restore it or resume "
        "from another checkpoint"
    )
    under_file = path / "x.json"
    assert refusal(lambda: fmt.read_record(under_file), CE) == (
        f"{under_file}: cannot read it (Not a directory): restore it or resume from another checkpoint"
    )


# ---------------------------------------------------------------------------------- tags and pointers


TAG_HINT = ". Use a plain folder name such as DeepSpeed's default 'global_step<N>'"
RESERVED = (
    "collides with a file DeepSpeed or functional_ema writes beside the tag folders (reserved: latest, "
    "latest_universal, zero_to_fp32.py, zero_to_torch.py, ema_manifest.json, ema_latest)"
)
OWN = "is the name of one of functional_ema's own files"


def test_check_tag():
    """Tags: a str (ints converted, bools refused) that is one plain folder name; saving also refuses the
    reserved names (any case) and the library's own file names; the message shows at most 80 characters."""
    assert fmt.check_tag("global_step3") == "global_step3" and fmt.check_tag(7) == "7"
    assert fmt.check_tag("latest", saving=False) == "latest"
    assert fmt.check_tag("a" * 255) == "a" * 255 and fmt.check_tag("é" * 127 + "a") == "é" * 127 + "a"
    for bad in (True, None, 1.5, b"t"):
        assert refusal(lambda bad=bad: fmt.check_tag(bad), InvalidTagError) == (
            f"tag must be a str (a folder name such as 'global_step<N>'), got {type(bad).__name__}"
        )
    cases = [
        ("latest", RESERVED),
        ("LATEST", RESERVED),
        ("Zero_To_FP32.py", RESERVED),
        ("ema_latest", RESERVED),
        ("ema_rank_00000_of_00001.safetensors", OWN),
        ("buffers_rank_00001_of_00002.gen3.safetensors", OWN),
        ("t.tmp-1-ab", OWN),
        (".tmp- x", "contains whitespace or control characters (U+0020)"),  # a bad name first, whatever else
        ("", "is empty"),
        (".", "is '.', which names a folder relative to the checkpoint, not a tag in it"),
        ("..", "is '..', which names a folder relative to the checkpoint, not a tag in it"),
        ("a/b", "contains a path separator ('/' or '\\'); a tag is one folder name"),
        ("a\\b", "contains a path separator ('/' or '\\'); a tag is one folder name"),
        ("a b", "contains whitespace or control characters (U+0020)"),
        ("a\x01b", "contains whitespace or control characters (U+0001)"),
        ("a\u200bb", "contains whitespace or control characters (U+200B)"),
        ("\ud800", "contains whitespace or control characters (U+D800)"),
        (
            "x\x1d\x1c \t\n\x0b\x0c\r",
            "contains whitespace or control characters (U+0009, U+000A, U+000B, U+000C, U+000D, U+001C)",
        ),
        ("é" * 128, "is longer than 255 bytes"),
        ("a" * 256, "is longer than 255 bytes"),
    ]
    for tag, problem in cases:
        shown_tag = repr(tag) if len(tag) <= 80 else repr(tag[:80]) + "..."
        assert refusal(lambda tag=tag: fmt.check_tag(tag), InvalidTagError) == f"tag {shown_tag} {problem}{TAG_HINT}"
    for saving in (True, False):
        assert refusal(lambda s=saving: fmt.check_tag("a" * 79 + "/", saving=s), InvalidTagError) == (
            f"tag {'a' * 79 + '/'!r} contains a path separator ('/' or '\\'); a tag is one folder name{TAG_HINT}"
        )
    assert refusal(lambda: fmt.check_tag("a" * 80 + "/"), InvalidTagError) == (
        f"tag {'a' * 80!r}... contains a path separator ('/' or '\\'); a tag is one folder name{TAG_HINT}"
    )


def _checkpoint_dir(root: Path) -> Path:
    """Tag folders with a manifest (natural order: a, step9, step10, t), one without, and a plain file."""
    for tag in ("step10", "t", "step9", "a"):
        (root / tag).mkdir(parents=True)
        (root / tag / "ema_manifest.json").write_text("{}")
    (root / "partial").mkdir()
    (root / "ema_rank_00000_of_00001.safetensors").write_text("")
    return root


def test_complete_tags(tmp_path):
    """The tag folders holding a manifest, in natural order; none for a folder that cannot be listed."""
    root = _checkpoint_dir(tmp_path / "ck")
    assert fmt.complete_tags(root) == ["a", "step9", "step10", "t"]
    assert fmt.complete_tags(tmp_path / "missing") == []
    assert fmt._natural("step10b2") == ["step", 10, "b", 2, ""]
    assert sorted(["10", "9x", "x"], key=fmt._natural) == ["9x", "10", "x"]


def test_read_latest(tmp_path):
    """DeepSpeed's ``latest``: its one tag, stripped; refused when it is a link out of the checkpoint, too big,
    not UTF-8 or not one folder name (the message lists the complete tags instead; never the content)."""
    root = _checkpoint_dir(tmp_path / "ck")
    latest = root / "latest"
    latest.write_text("step10\n")
    assert fmt.read_latest(root, latest) == "step10"
    latest.write_text("")
    assert fmt.read_latest(root, latest) == ""
    pointer = (
        f"{latest} does not name a tag folder of {root}: its content {{}}. Tags are looked up only inside the "
        "checkpoint directory; pass tag=... (or --tag). Tags here with a complete EMA: ['a', 'step9', 'step10', 't']"
    )
    for content, problem in (
        ("../t\n", "contains a path separator ('/' or '\\'); a tag is one folder name"),
        ("a b", "contains whitespace or control characters (U+0020)"),
        (".", "is '.', which names a folder relative to the checkpoint, not a tag in it"),
    ):
        latest.write_text(content)
        assert refusal(lambda: fmt.read_latest(root, latest), InvalidTagError) == pointer.format(problem)
    latest.write_text("a" * 4096)  # within the size bound: refused as a name
    assert refusal(lambda: fmt.read_latest(root, latest), InvalidTagError) == pointer.format("is longer than 255 bytes")
    latest.write_text("a" * 4097)
    assert refusal(lambda: fmt.read_latest(root, latest), InvalidTagError) == (
        f"{latest} holds 4097 bytes, not one tag name (DeepSpeed writes a single tag): pass tag=..."
    )
    latest.write_bytes(b"\xfft")
    assert refusal(lambda: fmt.read_latest(root, latest), InvalidTagError) == (
        f"{latest} is not UTF-8 text, so it names no tag: pass tag=..."
    )
    latest.unlink()
    outside = tmp_path / "elsewhere"
    outside.write_text("t")
    latest.symlink_to(outside)
    assert refusal(lambda: fmt.read_latest(root, latest), InvalidTagError) == (
        f"{latest} is a link to a file outside {root}; DeepSpeed writes 'latest' as a plain file holding one tag. "
        "Pass tag=... (or --tag) instead"
    )
    latest.unlink()
    assert refusal(lambda: fmt.read_latest(root, latest), CheckpointNotFoundError) == (
        f"cannot read {latest}: [Errno 2] No such file or directory: '{latest}'"
    )
    latest.mkdir()
    assert refusal(lambda: fmt.read_latest(root, latest), CheckpointNotFoundError) == (
        f"cannot read {latest}: [Errno 21] Is a directory: '{latest}'"
    )


# ------------------------------------------------------------------------------------ the manifest

W_TAG = "one plain folder name"
W_GEN = "an int >= 0"
W_STEP = "an int in [0, 2**63)"
W_NUM = "an int in [1, 65536]"
W_DTYPE = "one of ['float64', 'float32', 'float16', 'bfloat16']"
W_SCHED = "null or a list of num_emas objects"
W_SUM = "the name of a checksum algorithm"
W_EXTRA = "null or a JSON object"
W_PARTS = "a list of 1 to 65536 model-parallel parts (format 4)"
W_STRAY = "absent at the top level of a manifest with 'parts'"
W_COORD = "{tp, tp_size, pp, pp_size}: ints, tp < tp_size, pp < pp_size"
W_DISTINCT = "a distinct part of the same tensor- and pipeline-parallel sizes as the other parts"
W_WORLD = "an int in [1, 1048576]"
W_STAGE = "0, 1, 2 or 3"
W_PARAMS = "an object {parameter name: full shape}"
W_FILES = "a list of 1 to world_size rank-file entries"
W_SHAPE = "a full shape: a list of ints >= 0"
W_TPD = "null or {parameter name: a dimension of it, or null} for every parameter of the part"
W_EXPERTS = "{ep_size: an int >= 1, owners: {parameter: expert-parallel rank}}"
W_OWNER = "a parameter of 'params' owned by an expert-parallel rank in [0, 2)"
W_EP = "the file's expert-parallel rank, an int in [0, 2)"
W_NO_EP = "absent (the part records no 'experts')"
W_INDEX = "null or {parameter name: its cut} for every parameter"
W_CUT = "an int >= 1 (the even cut) or a list [rank, offset, numel, ...]"
W_PAIR = "present together with 'buffer_files' and 'buffers'"
W_BFILES = "a list of 1 to world_size buffer-file entries"
W_HEX = "a xxh3_64 checksum (a hex string)"
W_CRC = "a CRC-32 (an int in [0, 2**32))"
W_CHUNKS = "a string of hex checksums"
X2 = "moe.deepspeed_moe.experts.deepspeed_experts.2.weight"
X0B = "moe.deepspeed_moe.experts.deepspeed_experts.0.bias"
F0 = ("files", 0)
F1 = ("files", 1)
Z_FILE0 = "ema_rank_00000_of_00002.gen1.safetensors"
Z_FILE1 = "ema_rank_00001_of_00002.gen1.safetensors"
DT_FILE1 = "ema_tp001of002_pp000of001_rank_00000_of_00001.gen1.safetensors"


def _fill_index(m: dict) -> None:
    m["piece_index"] = {n: math.prod(s) for n, s in m["params"].items()}


def _experts_on_one_rank(m: dict) -> None:
    m["experts"]["ep_size"] = 1
    m["experts"]["owners"] = {n: 0 for n in m["experts"]["owners"]}
    for e in m["files"]:
        e["ep"] = 0


def _one_part(m: dict) -> None:
    del m["parts"][1]
    repart(0, 0, 1, 0, 1)(m)


ACCEPTED: list[tuple[str, str, Edit | tuple[Edit, ...]]] = [
    *[(name, name, ()) for name in (*LAYOUTS, "v1")],
    ("extra null", "zero3", put("extra", None)),
    ("extra object", "zero3", put("extra", {"step": 3})),
    ("no extra", "zero3", put("extra", GONE)),
    ("no schedules", "zero3", put("schedules", None)),
    ("step 2**63-1", "zero3", put("step", 2**63 - 1)),
    ("step 2**62+1", "zero3", put("step", 2**62 + 1)),
    ("num_emas 65536", "zero3", (put("num_emas", 65536), put("schedules", None))),
    ("format 2", "zero3", older(2)),
    ("format 4 parts", "ds_tp", older(4)),
    ("format 1 any checksum", "v1", put("checksum", "md5")),
    ("one part", "ds_tp", _one_part),
    ("ep_size 1", "moe", _experts_on_one_rank),
    ("ep_size 2**20", "moe", put(("experts", "ep_size"), 2**20)),
    ("index pieces", "zero3", put(("piece_index", "inp.bias"), [1, 7, 6, 0, 0, 7])),
    ("index pieces overlap", "zero3", put(("piece_index", "inp.bias"), [0, 0, 9, 1, 7, 6])),
    ("bytes 0", "zero3", put((*F0, "bytes"), 0)),
    (
        "hex case and width",
        "zero3",
        (put((*F0, "header_checksum"), "ABCDEF0123456789"), put((*F1, "header_checksum"), "0")),
    ),
    ("chunks read later", "zero3", put((*F0, "chunk_checksums"), "zz")),
    ("tp_dims null", "ds_tp", put(("parts", 0, "tp_dims", "fc1.bias"), None)),
    ("crc 0 and 2**32-1", "v1", (put((*F0, "header_crc32"), 0), put((*F1, "header_crc32"), 2**32 - 1))),
    ("v1 without checksums", "v1", (put((*F0, "tensor_crc32"), GONE),)),
    ("format 4 no tensor checksums", "ds_tp", (older(4), put(("parts", 0, *F0, "tensor_checksums"), GONE))),
    ("format 4 checksums read later", "ds_tp", (older(4), put(("parts", 0, *F0, "tensor_checksums"), {"x": ["zz"]}))),
    ("stage 0", "zero3", put("zero_stage", 0)),
]


@pytest.mark.parametrize("name,edits", [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_validate_manifest_accepts(name, edits):
    """Real manifests of every layout and format, and the edge values of their fields, are accepted as they are."""
    m = edited(name, edits)
    before = copy.deepcopy(m)
    assert fmt.validate_manifest(MPATH, m) is None
    assert m == before


REFUSED: list[tuple[str, str, Edit | tuple[Edit, ...], Any, type[CheckpointError]]] = [
    # top-level fields, in the order they are checked
    ("tag int", "zero3", put("tag", 5), ("tag", W_TAG, 5), CE),
    ("tag path", "zero3", put("tag", "a/b"), ("tag", W_TAG, "a/b"), CE),
    ("tag empty", "zero3", put("tag", ""), ("tag", W_TAG, ""), CE),
    ("generation -1", "zero3", put("generation", -1), ("generation", W_GEN, -1), CE),
    ("generation bool", "zero3", put("generation", True), ("generation", W_GEN, True), CE),
    ("generation float", "zero3", put("generation", 1.0), ("generation", W_GEN, 1.0), CE),
    ("step -1", "zero3", put("step", -1), ("step", W_STEP, -1), CE),
    ("step 2**63", "zero3", put("step", 2**63), ("step", W_STEP, 2**63), CE),
    ("step str", "zero3", put("step", "2"), ("step", W_STEP, "2"), CE),
    ("num_emas 0", "zero3", put("num_emas", 0), ("num_emas", W_NUM, 0), CE),
    ("num_emas 65537", "zero3", put("num_emas", 65537), ("num_emas", W_NUM, 65537), CE),
    ("num_emas bool", "zero3", put("num_emas", True), ("num_emas", W_NUM, True), CE),
    ("dtype int64", "zero3", put("dtype", "int64"), ("dtype", W_DTYPE, "int64"), CE),
    ("dtype int", "zero3", put("dtype", 5), ("dtype", W_DTYPE, 5), CE),
    ("schedules str", "zero3", put("schedules", "ab"), ("schedules", W_SCHED, "ab"), CE),
    ("schedules short", "zero3", put("schedules", [{}]), ("schedules", W_SCHED, [{}]), CE),
    ("schedules not objects", "zero3", put("schedules", [{}, 5]), ("schedules", W_SCHED, [{}, 5]), CE),
    ("schedules object", "zero3", put("schedules", {}), ("schedules", W_SCHED, {}), CE),
    ("checksum null", "zero3", put("checksum", None), ("checksum", W_SUM, None), CE),
    ("checksum list", "zero3", put("checksum", ["xxh3_64"]), ("checksum", W_SUM, ["xxh3_64"]), CE),
    ("checksum absent", "zero3", put("checksum", GONE), ("checksum", W_SUM, None), CE),
    ("format 2 no checksum", "zero3", (older(2), put("checksum", GONE)), ("checksum", W_SUM, None), CE),
    ("format 3 no checksum", "zero3", (older(3), put("checksum", GONE)), ("checksum", W_SUM, None), CE),
    (
        "checksum unknown",
        "zero3",
        put("checksum", "md5"),
        ": field 'checksum' is str 'md5', not an algorithm this version reads (['crc32', 'xxh3_64']): upgrade "
        "functional_ema, or restore the manifest from a copy",
        CheckpointVersionError,
    ),
    ("extra str", "zero3", put("extra", "x"), ("extra", W_EXTRA, "x"), CE),
    ("extra list", "moe", put("extra", []), ("extra", W_EXTRA, []), CE),
    # the parts of a model-parallel manifest
    ("parts format 3", "ds_tp", put("format_version", 3), ("parts", W_PARTS, "PARTS"), CE),
    ("parts empty", "ds_tp", put("parts", []), ("parts", W_PARTS, []), CE),
    ("parts object", "ds_tp", put("parts", {"a": 1}), ("parts", W_PARTS, {"a": 1}), CE),
    ("parts str", "ds_tp", put("parts", "ab"), ("parts", W_PARTS, "ab"), CE),
    ("parts at the bound", "ds_tp", put("parts", [None] * 65536), ("parts[0]", "an object", None), CE),
    ("parts past the bound", "ds_tp", put("parts", [None] * 65537), ("parts", W_PARTS, [None] * 65537), CE),
    ("stray world_size", "ds_tp", put("world_size", 2), ("world_size", W_STRAY, 2), CE),
    ("stray piece_index", "pp", put("piece_index", None), ("piece_index", W_STRAY, None), CE),
    ("part not an object", "ds_tp", put(("parts", 1), 5), ("parts[1]", "an object", 5), CE),
    ("part coords absent", "ds_tp", put(("parts", 0, "part"), GONE), ("parts[0].part", W_COORD, None), CE),
    (
        "part coords list",
        "ds_tp",
        put(("parts", 0, "part"), [0, 2, 0, 1]),
        ("parts[0].part", W_COORD, [0, 2, 0, 1]),
        CE,
    ),
    *[
        (f"part {label}", "ds_tp", put(("parts", 1, "part"), c), ("parts[1].part", W_COORD, c), CE)
        for label, c in (
            ("extra key", {"pp": 0, "pp_size": 1, "tp": 1, "tp_size": 2, "ep": 0}),
            ("no pp", {"pp_size": 1, "tp": 1, "tp_size": 2}),
            ("tp_size 0", {"pp": 0, "pp_size": 1, "tp": 0, "tp_size": 0}),
            ("tp_size bool", {"pp": 0, "pp_size": 1, "tp": 0, "tp_size": True}),
            ("tp_size past the bound", {"pp": 0, "pp_size": 1, "tp": 1, "tp_size": 2**20 + 1}),
            ("tp = tp_size", {"pp": 0, "pp_size": 1, "tp": 2, "tp_size": 2}),
            ("tp -1", {"pp": 0, "pp_size": 1, "tp": -1, "tp_size": 2}),
            ("tp bool", {"pp": 0, "pp_size": 1, "tp": True, "tp_size": 2}),
            ("pp = pp_size", {"pp": 1, "pp_size": 1, "tp": 1, "tp_size": 2}),
            ("pp_size 0", {"pp": 0, "pp_size": 0, "tp": 1, "tp_size": 2}),
            ("pp_size past the bound", {"pp": 0, "pp_size": 2**20 + 1, "tp": 1, "tp_size": 2}),
            ("pp -1", {"pp": -1, "pp_size": 1, "tp": 1, "tp_size": 2}),
        )
    ],
    (
        "tp_size at the bound",
        "ds_tp",
        put(("parts", 0, "part", "tp_size"), 2**20),
        (
            "parts[0].files[0].file",
            "the file of rank 0 of world_size 1, generation 1, tensor-parallel rank 0 of 1048576",
            "ema_tp000of002_pp000of001_rank_00000_of_00001.gen1.safetensors",
        ),
        CE,
    ),
    (
        "pp_size at the bound",
        "pp",
        put(("parts", 0, "part", "pp_size"), 2**20),
        (
            "parts[0].files[0].file",
            "the file of rank 0 of world_size 1, generation 1, pipeline stage 0 of 1048576",
            "ema_tp000of001_pp000of002_rank_00000_of_00001.gen1.safetensors",
        ),
        CE,
    ),
    (
        "part twice",
        "ds_tp",
        copied(("parts", 0, "part"), ("parts", 1, "part")),
        ("parts[1].part", W_DISTINCT, {"pp": 0, "pp_size": 1, "tp": 0, "tp_size": 2}),
        CE,
    ),
    (
        "part of other sizes",
        "ds_tp",
        repart(1, 1, 3, 0, 1),
        ("parts[1].part", W_DISTINCT, {"pp": 0, "pp_size": 1, "tp": 1, "tp_size": 3}),
        CE,
    ),
    (
        "parts missing tp",
        "ds_tp",
        (repart(0, 0, 3, 0, 1), repart(1, 1, 3, 0, 1)),
        ": field 'parts' lists 2 model-parallel part(s), but tensor-parallel size 3 x pipeline size 1 makes 3: "
        "the manifest is damaged or was edited",
        IncompleteCheckpointError,
    ),
    (
        "parts missing pp",
        "pp",
        (repart(0, 0, 1, 0, 3), repart(1, 0, 1, 2, 3)),
        ": field 'parts' lists 2 model-parallel part(s), but tensor-parallel size 1 x pipeline size 3 makes 3: "
        "the manifest is damaged or was edited",
        IncompleteCheckpointError,
    ),
    # one part's fields (the whole model's, at the top level)
    (
        "lacks fields",
        "zero3",
        (put("world_size", GONE), put("files", GONE)),
        " lacks fields ['world_size', 'files']: the manifest is damaged",
        CE,
    ),
    (
        "part lacks fields",
        "ds_tp",
        put(("parts", 1, "params"), GONE),
        " lacks fields ['parts[1].params']: the manifest is damaged",
        CE,
    ),
    ("world_size 0", "zero3", put("world_size", 0), ("world_size", W_WORLD, 0), CE),
    ("world_size bool", "zero3", put("world_size", True), ("world_size", W_WORLD, True), CE),
    ("world_size str", "zero3", put("world_size", "2"), ("world_size", W_WORLD, "2"), CE),
    ("world_size past the bound", "zero3", put("world_size", 2**20 + 1), ("world_size", W_WORLD, 2**20 + 1), CE),
    (
        "world_size at the bound",
        "zero3",
        put("world_size", 2**20),
        ("files[0].file", "the file of rank 0 of world_size 1048576, generation 1", Z_FILE0),
        CE,
    ),
    ("part world_size 0", "ds_tp", put(("parts", 1, "world_size"), 0), ("parts[1].world_size", W_WORLD, 0), CE),
    ("zero_stage 4", "zero3", put("zero_stage", 4), ("zero_stage", W_STAGE, 4), CE),
    ("zero_stage -1", "zero3", put("zero_stage", -1), ("zero_stage", W_STAGE, -1), CE),
    ("zero_stage bool", "zero3", put("zero_stage", True), ("zero_stage", W_STAGE, True), CE),
    ("params list", "zero3", put("params", []), ("params", W_PARAMS, []), CE),
    ("files empty", "zero3", put("files", []), ("files", W_FILES, []), CE),
    ("files str", "zero3", put("files", "ab"), ("files", W_FILES, "ab"), CE),
    ("files object", "zero3", put("files", {}), ("files", W_FILES, {}), CE),
    ("files past world_size", "zero3", copied(F0, ("files", 2)), ("files", W_FILES, "FILES"), CE),
    ("shape -1", "zero3", put(("params", "inp.bias"), [-1]), ("params['inp.bias']", W_SHAPE, [-1]), CE),
    ("shape str", "zero3", put(("params", "inp.bias"), "13"), ("params['inp.bias']", W_SHAPE, "13"), CE),
    ("shape bool", "zero3", put(("params", "inp.bias"), [True]), ("params['inp.bias']", W_SHAPE, [True]), CE),
    (
        "part shape",
        "ds_tp",
        put(("parts", 0, "params", "fc1.bias"), [6.0]),
        ("parts[0].params['fc1.bias']", W_SHAPE, [6.0]),
        CE,
    ),
    # tensor-parallel dimensions
    ("tp_dims list", "ds_tp", put(("parts", 0, "tp_dims"), []), ("parts[0].tp_dims", W_TPD, []), CE),
    ("tp_dims in a whole model", "zero3", put("tp_dims", {}), ("tp_dims", W_TPD, {}), CE),
    *[
        (f"tp_dims {label}", "ds_tp", put(("parts", 1, "tp_dims", name), d), ("parts[1].tp_dims", W_TPD, "TPD"), CE)
        for label, name, d in (
            ("missing", "fc2.bias", GONE),
            ("past a 1-d shape", "fc1.bias", 1),
            ("past a 2-d shape", "fc2.weight", 2),
            ("-1", "fc1.bias", -1),
            ("bool", "fc1.bias", True),
            ("str", "fc1.bias", "0"),
        )
    ],
    # expert parallelism
    ("ep without experts", "zero3", put((*F1, "ep"), 0), ("files[1].ep", W_NO_EP, 0), CE),
    ("experts list", "moe", put("experts", []), ("experts", W_EXPERTS, []), CE),
    ("experts no owners", "moe", put(("experts", "owners"), GONE), ("experts", W_EXPERTS, "EXPERTS"), CE),
    ("experts extra key", "moe", put(("experts", "ep"), 0), ("experts", W_EXPERTS, "EXPERTS"), CE),
    ("ep_size 0", "moe", put(("experts", "ep_size"), 0), ("experts", W_EXPERTS, "EXPERTS"), CE),
    ("ep_size bool", "moe", put(("experts", "ep_size"), True), ("experts", W_EXPERTS, "EXPERTS"), CE),
    ("ep_size past the bound", "moe", put(("experts", "ep_size"), 2**20 + 1), ("experts", W_EXPERTS, "EXPERTS"), CE),
    ("owners list", "moe", put(("experts", "owners"), []), ("experts", W_EXPERTS, "EXPERTS"), CE),
    ("owner unknown", "moe", put(("experts", "owners", "nope"), 0), ("experts.owners['nope']", W_OWNER, 0), CE),
    *[
        (f"owner {v!r}", "moe", put(("experts", "owners", X0B), v), (f"experts.owners[{X0B!r}]", W_OWNER, v), CE)
        for v in (2, -1, True, None)
    ],
    *[(f"file ep {v!r}", "moe", put((*F1, "ep"), v), ("files[1].ep", W_EP, v), CE) for v in (2, -1, True, "1")],
    ("file ep absent", "moe", put((*F0, "ep"), GONE), ("files[0].ep", W_EP, None), CE),
    # piece index
    ("index list", "zero3", put("piece_index", []), ("piece_index", W_INDEX, []), CE),
    ("index missing a parameter", "zero3", put(("piece_index", "table"), GONE), ("piece_index", W_INDEX, "INDEX"), CE),
    ("index under experts", "moe", _fill_index, ("piece_index", "absent under expert parallelism", "INDEX"), CE),
    ("cut 0", "zero3", put(("piece_index", "inp.bias"), 0), ("piece_index['inp.bias']", W_CUT, 0), CE),
    (
        "cut past the files",
        "zero3",
        put(("piece_index", "inp.bias"), 1),
        ("piece_index['inp.bias']", "a cut whose pieces are all in rank files; rank 2 has none", 1),
        CE,
    ),
    (
        "cut of a missing file",
        "zero3",
        put(F1, GONE),  # rank 1 has no file
        ("piece_index['inp.bias']", "a cut whose pieces are all in rank files; rank 1 has none", 7),
        CE,
    ),
    (
        "pieces with a gap",
        "zero3",
        put(("piece_index", "inp.bias"), [0, 0, 6, 1, 7, 6]),
        (
            "piece_index['inp.bias']",
            "pieces that cover all 13 elements (elements from 6 are in none)",
            [0, 0, 6, 1, 7, 6],
        ),
        CE,
    ),
    (
        "part cut",
        "ds_tp",
        put(("parts", 1, "piece_index", "fc1.bias"), 0),
        ("parts[1].piece_index['fc1.bias']", W_CUT, 0),
        CE,
    ),
    # buffers
    ("buffers alone", "plain", put("buffer_files", GONE), ("buffer_files", W_PAIR, None), CE),
    ("buffer files alone", "plain", put("buffers", GONE), ("buffers", W_PAIR, None), CE),
    ("part buffer files alone", "pp", put(("parts", 1, "buffers"), None), ("parts[1].buffers", W_PAIR, None), CE),
    ("buffer files empty", "plain", put("buffer_files", []), ("buffer_files", W_BFILES, []), CE),
    ("buffer files str", "plain", put("buffer_files", "a"), ("buffer_files", W_BFILES, "a"), CE),
    (
        "buffer files past world_size",
        "moe",
        copied(("buffer_files", 0), ("buffer_files", 2)),
        ("buffer_files", W_BFILES, "BFILES"),
        CE,
    ),
    ("buffers num_emas", "plain", put(("buffers", "num_emas"), 0), ("buffers.num_emas", W_NUM, 0), CE),
    (
        "part buffers dtype",
        "pp",
        put(("parts", 0, "buffers", "dtype"), "int8"),
        ("parts[0].buffers.dtype", W_DTYPE, "int8"),
        CE,
    ),
    (
        "buffer file named as a rank file",
        "plain",
        put(("buffer_files", 0, "file"), "ema_rank_00000_of_00001.gen3.safetensors"),
        "NAME buffer_files[0]",
        CE,
    ),
    (
        "buffer file rank",
        "plain",
        put(("buffer_files", 0, "rank"), 1),
        ("buffer_files[0].rank", "a distinct int in [0, 1)", 1),
        CE,
    ),
    (
        "buffer checksums",
        "plain",
        put(("buffer_files", 0, "tensor_checksums", "emas.0.1.running_mean"), ["zz"]),
        ("buffer_files[0].tensor_checksums['emas.0.1.running_mean']", f"a list, each {W_HEX}", ["zz"]),
        CE,
    ),
    (
        "part buffer checksums",
        "pp",
        put(("parts", 1, "buffer_files", 0, "tensor_checksums", "emas.0.x"), "ab"),
        ("parts[1].buffer_files[0].tensor_checksums['emas.0.x']", f"a list, each {W_HEX}", "ab"),
        CE,
    ),
    # rank-file records
    ("record str", "zero3", put(F0, "x"), ("files[0]", "an object", "x"), CE),
    ("file name int", "zero3", put((*F0, "file"), 5), "NAME files[0]", CE),
    ("file name absent", "zero3", put((*F1, "file"), GONE), "NAME files[1]", CE),
    ("file name outside", "zero3", put((*F0, "file"), "../" + Z_FILE0), "NAME files[0]", CE),
    (
        "file name of buffers",
        "zero3",
        put((*F0, "file"), "buffers_rank_00000_of_00002.gen1.safetensors"),
        "NAME files[0]",
        CE,
    ),
    *[
        (f"rank {v!r}", "zero3", put((*F1, "rank"), v), ("files[1].rank", "a distinct int in [0, 2)", v), CE)
        for v in (2, -1, True, "1", None)
    ],
    ("rank twice", "zero3", copied(F0, F1), ("files[1].rank", "a distinct int in [0, 2)", 0), CE),
    (
        "file of another rank",
        "zero3",
        put((*F0, "file"), Z_FILE1),
        ("files[0].file", "the file of rank 0 of world_size 2, generation 1", Z_FILE1),
        CE,
    ),
    (
        "file of another generation",
        "zero3",
        put("generation", 2),
        ("files[0].file", "the file of rank 0 of world_size 2, generation 2", Z_FILE0),
        CE,
    ),
    (
        "file of another part",
        "ds_tp",
        copied(("parts", 0, *F0, "file"), ("parts", 1, *F0, "file")),
        (
            "parts[1].files[0].file",
            "the file of rank 0 of world_size 1, generation 1, tensor-parallel rank 1 of 2",
            "ema_tp000of002_pp000of001_rank_00000_of_00001.gen1.safetensors",
        ),
        CE,
    ),
    (
        "file of the whole model in a part",
        "pp",
        put(("parts", 1, *F0, "file"), "ema_rank_00000_of_00001.gen1.safetensors"),
        (
            "parts[1].files[0].file",
            "the file of rank 0 of world_size 1, generation 1, pipeline stage 1 of 2",
            "ema_rank_00000_of_00001.gen1.safetensors",
        ),
        CE,
    ),
    *[
        (f"bytes {v!r}", "zero3", put((*F1, "bytes"), v), ("files[1].bytes", "an int >= 0", v), CE)
        for v in (-1, True, "1", None)
    ],
    *[
        (f"header {v!r}", "zero3", put((*F1, "header_checksum"), v), ("files[1].header_checksum", W_HEX, v), CE)
        for v in ("", "g" * 16, "f" * 17, 5, None)
    ],
    *[
        (f"chunks {v!r}", "zero3", put((*F1, "chunk_checksums"), v), ("files[1].chunk_checksums", W_CHUNKS, v), CE)
        for v in (5, [], None)
    ],
    (
        "format 4 tensor checksums list",
        "ds_tp",
        (older(4), put(("parts", 1, *F0, "tensor_checksums"), [])),
        ("parts[1].files[0].tensor_checksums", f"an object {{tensor name: [{W_HEX}, ...]}}", []),
        CE,
    ),
    *[
        (f"crc {v!r}", "v1", put((*F1, "header_crc32"), v), ("files[1].header_crc32", W_CRC, v), CE)
        for v in (2**32, -1, "1", None)
    ],
    (
        "crc list",
        "v1",
        put((*F0, "tensor_crc32"), []),
        ("files[0].tensor_crc32", f"an object {{tensor name: [{W_CRC}, ...]}}", []),
        CE,
    ),
]


def _expected(case_want: Any, m: dict) -> str:
    """The whole message of a refusal: ``(field, want, got)`` of a field error (a few ``got`` stand for the
    edited manifest's value: ``"PARTS"``, ``"FILES"``...), ``"NAME <record>"`` for a file name that is not the
    library's, else the text after the manifest's path."""
    if isinstance(case_want, str):
        if case_want.startswith("NAME "):
            record = case_want.removeprefix("NAME ")
            return not_a_name(record, "buffers" if record.startswith("buffer_files") else "ema")
        return f"{MPATH}{case_want}"
    field, want, got = case_want
    stand_for = {
        "PARTS": lambda: m["parts"],
        "FILES": lambda: m["files"],
        "BFILES": lambda: m["buffer_files"],
        "EXPERTS": lambda: m["experts"],
        "INDEX": lambda: m["piece_index"],
        "TPD": lambda: m["parts"][1]["tp_dims"],
    }
    return field_error(field, want, stand_for[got]() if isinstance(got, str) and got in stand_for else got)


@pytest.mark.parametrize("name,edits,want,exc", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_validate_manifest_refuses(name, edits, want, exc):
    """Each field of a real manifest made wrong in one way: the library's error class, and a message naming the
    manifest, the field's path, what it must be and what it holds."""
    m = edited(name, edits)
    assert refusal(lambda: fmt.validate_manifest(MPATH, m), exc) == _expected(want, m)


def test_manifest_parts():
    """The parts of a validated manifest: the whole model's fields (field prefix "") or each part's
    (``parts[i].``), with its coordinates, every part field present (None where absent)."""
    fields = (
        "world_size",
        "zero_stage",
        "params",
        "files",
        "buffers",
        "buffer_files",
        "tp_dims",
        "experts",
        "piece_index",
    )
    for name in ("zero3", "moe", "plain", "v1"):
        m = manifest(name)
        assert fmt.manifest_parts(m) == [dict({k: m.get(k) for k in fields}, part=ModelPart(), field="")]
    for name, coords in (("pp", [(0, 1, 0, 2), (0, 1, 1, 2)]), ("ds_tp", [(0, 2, 0, 1), (1, 2, 0, 1)])):
        m = manifest(name)
        got = fmt.manifest_parts(m)
        assert [p["part"] for p in got] == [ModelPart(*c) for c in coords]
        assert [p["field"] for p in got] == ["parts[0].", "parts[1]."]
        for p, raw in zip(got, m["parts"], strict=True):
            assert {k: v for k, v in p.items() if k not in ("part", "field")} == {k: raw.get(k) for k in fields}
    assert fields == fmt.PART_FIELDS


# ------------------------------------------------------------------------------- buffers descriptor

BUFFERS = {  # the plain layout's buffers (a BatchNorm's), as the manifest records them
    "copied": {"1.num_batches_tracked": ["int64", []]},
    "dtype": "float32",
    "floating": {"1.running_mean": [13], "1.running_var": [13]},
    "num_emas": 2,
}


def test_validate_buffers_descriptor():
    """A part's ``buffers`` record: num_emas, one saved floating dtype, shapes of the averaged buffers, dtype and
    shape of the copied ones, no name in both; each field named (with the part's prefix) in the error."""
    m = manifest("plain")
    assert m["buffers"] == BUFFERS
    for ok in (
        BUFFERS,
        dict(BUFFERS, num_emas=65536),
        dict(BUFFERS, floating={}, copied={}),
        dict(BUFFERS, copied={"b": ["bool", [2, 0]], "i": ["uint8", []]}),
    ):
        assert fmt.validate_buffers_descriptor(MPATH, {"buffers": ok}) is None
    cases: list[tuple[Any, str, str, Any]] = [
        ([], "buffers", "an object {num_emas, dtype, floating, copied}", []),
        (None, "buffers", "an object {num_emas, dtype, floating, copied}", None),
        *[(dict(BUFFERS, num_emas=v), "buffers.num_emas", W_NUM, v) for v in (0, 65537, True, None)],
        ({k: v for k, v in BUFFERS.items() if k != "num_emas"}, "buffers.num_emas", W_NUM, None),
        *[(dict(BUFFERS, dtype=v), "buffers.dtype", W_DTYPE, v) for v in ("int64", 5, None)],
        (dict(BUFFERS, floating=[]), "buffers.floating", "an object {buffer name: shape}", []),
        (dict(BUFFERS, copied=None), "buffers.copied", "an object {buffer name: [dtype, shape]}", None),
        *[
            (dict(BUFFERS, floating={"x": v}), "buffers.floating['x']", "a shape: a list of ints >= 0", v)
            for v in ([-1], "8", [True], [1] * 65)
        ],
        *[
            (dict(BUFFERS, copied={"x": v}), "buffers.copied['x']", "[dtype name, shape]", v)
            for v in (["int64"], ["int65", []], ["int64", [-1]], "int64", ["int64", [], 1], ("int64", []), [None, []])
        ],
        (
            dict(
                BUFFERS,
                floating={"a": [1], "b": [2]},
                copied={"b": ["int64", []], "a": ["int8", []], "c": ["bool", []]},
            ),
            "buffers",
            "disjoint 'floating' and 'copied' names",
            ["a", "b"],
        ),
    ]
    for d, field, want, got in cases:
        for prefix in ("", "parts[1]."):
            assert refusal(lambda d=d, p=prefix: fmt.validate_buffers_descriptor(MPATH, {"buffers": d}, p), CE) == (
                field_error(prefix + field, want, got)
            )
        assert refusal(lambda d=d: fmt.validate_buffers_descriptor(MPATH, {"buffers": d}), CE) == field_error(
            field, want, got
        )


def test_is_shape():
    """A shape: a list of at most 64 ints >= 0 (bools are no ints) of at most 2**62 elements."""
    good = [[], [0], [1] * 64, [2**31, 2**31], [2**62], [3, 0, 2**62]]
    bad = [[-1], [True], [1.0], [1] * 65, [2**31, 2**31, 2], [2**62 + 1], "ab", (1, 2), None, [[1]]]
    assert [s for s in good if not fmt._is_shape(s)] == []
    assert [s for s in bad if fmt._is_shape(s)] == []


# ----------------------------------------------------------------------------------------- checksums


def _tensors(*chunks_bytes: tuple[str, int, int]) -> dict[str, _io.TensorEntry]:
    return {n: _io.TensorEntry("F32", [(end - start) // 4], start, end) for n, start, end in chunks_bytes}


def test_join_and_split_chunk_checksums():
    """A rank file's checksums as one fixed-width hex string, in the order of the tensors' bytes; cut back into
    each tensor's chunks (ceil(bytes / 4 MiB) each), refused when the count does not match the file."""
    crcs = {"a": [1, 0xFFFFFFFF], "b": [255]}
    assert fmt.join_chunk_checksums("crc32", crcs) == "00000001ffffffff000000ff"
    assert fmt.join_chunk_checksums("xxh3_64", {"a": [1, 2**64 - 1]}) == "0000000000000001ffffffffffffffff"
    chunk = _io.CHUNK_BYTES
    tensors = _tensors(("late", chunk + 8, 2 * chunk + 8), ("empty", chunk + 8, chunk + 8), ("first", 0, chunk + 8))
    text = "800000010000fffffffffffe"  # first: 2 chunks, empty: none, late: 1
    assert fmt.split_chunk_checksums(MPATH, "files[3]", text, "crc32", tensors, "W") == {
        "first": [0x80000001, 0xFFFF],
        "empty": [],
        "late": [0xFFFFFFFE],
    }
    wide = "80000000000000010000000000000002ffffffffffffffff"
    assert fmt.split_chunk_checksums(MPATH, "files[3]", wide, "xxh3_64", tensors, "W") == {
        "first": [2**63 + 1, 2],
        "empty": [],
        "late": [2**64 - 1],
    }
    for text, algo, held in ((wide[:40], "xxh3_64", 2), (wide, "crc32", 6), ("", "crc32", 0)):
        assert refusal(lambda t=text, a=algo: fmt.split_chunk_checksums(MPATH, "files[3]", t, a, tensors, "W"), CE) == (
            f"{MPATH}: field 'files[3].chunk_checksums' holds {held} checksums, but W has 3 chunks of 4194304 bytes: "
            "the manifest is damaged or belongs to another save"
        )


def test_file_checksums():
    """(algorithm, header checksum, per-tensor chunk checksums) of a file record of each format: format 5 rank
    files leave the chunks to split_chunk_checksums; unreadable values and unknown algorithms are refused."""
    z = manifest("zero3")
    e = z["files"][1]
    assert fmt.file_checksums(z, e, "W") == ("xxh3_64", int(e["header_checksum"], 16), {})
    assert fmt.file_checksums(z, dict(e, tensor_checksums={"x": ["zz"]}), "W") == (
        "xxh3_64",
        int(e["header_checksum"], 16),
        {},
    )
    moe = manifest("moe")
    b = moe["buffer_files"][0]
    assert fmt.file_checksums(moe, b, "W", "buffer_files") == (
        "xxh3_64",
        int(b["header_checksum"], 16),
        {k: [int(v, 16) for v in vs] for k, vs in b["tensor_checksums"].items()},
    )
    assert fmt.file_checksums(moe, {"header_checksum": "ab"}, "W", "buffer_files") == ("xxh3_64", 0xAB, {})
    v1 = manifest("v1")
    e1 = v1["files"][0]
    assert fmt.file_checksums(v1, e1, "W") == ("crc32", e1["header_crc32"], e1["tensor_crc32"])
    assert fmt.file_checksums(v1, {}, "W") == ("crc32", None, {})
    v2 = edited("zero3", older(2))
    rec = {"header_checksum": "ab", "tensor_checksums": {"emas.0.x": ["01", "ff"]}}
    assert fmt.file_checksums(v2, rec, "W") == ("xxh3_64", 0xAB, {"emas.0.x": [1, 255]})
    assert fmt.file_checksums(v2, {}, "W") == ("xxh3_64", None, {})
    assert refusal(lambda: fmt.file_checksums(v2, {"tensor_checksums": {"x": ["zz"]}}, "W"), CE) == (
        "W: unreadable checksums in the manifest (ValueError(\"invalid literal for int() with base 16: 'zz'\")); "
        "the manifest is damaged"
    )
    assert refusal(lambda: fmt.file_checksums(v1, {"header_crc32": "x"}, "W"), CE) == (
        "W: unreadable checksums in the manifest (ValueError(\"invalid literal for int() with base 10: 'x'\")); "
        "the manifest is damaged"
    )
    for algo in ("md5", None, ["xxh3_64"]):
        assert refusal(lambda a=algo: fmt.file_checksums(dict(z, checksum=a), e, "W"), CheckpointVersionError) == (
            f"W: the manifest's checksums use {algo!r}, which this functional_ema ({fe.__version__}) cannot compute "
            "(it knows ['crc32', 'xxh3_64']). Upgrade functional_ema, or load with verify=False"
        )


def test_checksum_forms():
    """The keys and test of a file record's checksums by format: CRC-32 ints (format 1), hex strings per tensor
    (formats 2-4, and buffer files), one hex string per rank file (format 5)."""
    z, v1 = manifest("zero3"), manifest("v1")
    assert fmt._checksum_form(z)[:2] == ("header_checksum", "chunk_checksums")
    assert fmt._checksum_form(z, "buffer_files")[:2] == ("header_checksum", "tensor_checksums")
    assert fmt._checksum_form(edited("zero3", older(2)))[:2] == ("header_checksum", "tensor_checksums")
    assert fmt._checksum_form(edited("zero3", older(4)))[:2] == ("header_checksum", "tensor_checksums")
    assert (
        fmt._checksum_form(z)[3] == W_HEX
        and fmt._checksum_form(dict(z, checksum="crc32"))[3] == "a crc32 checksum (a hex string)"
    )
    assert fmt._checksum_form(z)[2] is fmt._is_hex64
    header, tensors, is_crc, want = fmt._checksum_form(v1)
    assert (header, tensors, want) == ("header_crc32", "tensor_crc32", W_CRC)
    assert [is_crc(v) for v in (0, 2**32 - 1, 2**32, -1, True, 1.0, "1", 2**62)] == [True, True] + [False] * 6
    assert fmt.uses_compact_checksums(z) and not fmt.uses_compact_checksums(z, "buffer_files")
    assert not fmt.uses_compact_checksums(edited("zero3", older(4))) and not fmt.uses_compact_checksums(v1)
    hexes = {"0": True, "F" * 16: True, "0123456789abcdef": True, "": False, "f" * 17: False, "0g": False, "g": False}
    assert {v: fmt._is_hex64(v) for v in hexes} == hexes
    assert [fmt._is_hex64(v) for v in (5, None, b"ab", ["a"])] == [False] * 4


def test_check_tensor_checksums():
    """The chunk checksums of one file record, checked when a reader opens the file: format 5's hex string of
    whole checksums (8 digits for crc32, 16 for xxh3_64), the per-tensor lists of older formats and buffer files."""
    for name in LAYOUTS:
        m = manifest(name)
        for p in fmt.manifest_parts(m):
            for key in ("files", "buffer_files"):
                for i, e in enumerate(p[key] or []):
                    assert fmt.check_tensor_checksums(MPATH, m, e, f"{p['field']}{key}[{i}]", key) is None
    z = manifest("zero3")
    crc = dict(z, checksum="crc32")
    for m, text in ((crc, "0123abcd" * 3), (crc, ""), (z, "0123456789ABCDEF" * 2)):
        assert fmt.check_tensor_checksums(MPATH, m, {"chunk_checksums": text}, "files[1]") is None
    for m, text, width in ((crc, "0123abcd0", 8), (crc, "0123abcz", 8), (z, "0123abcd" * 3, 16), (z, "zz" * 8, 16)):
        assert refusal(
            lambda m=m, t=text: fmt.check_tensor_checksums(MPATH, m, {"chunk_checksums": t}, "files[1]"), CE
        ) == (
            field_error("files[1].chunk_checksums", f"{width}-digit {m['checksum']} checksums in one hex string", text)
        )
    moe, v1 = manifest("moe"), manifest("v1")
    assert fmt.check_tensor_checksums(MPATH, moe, {}, "buffer_files[0]", "buffer_files") is None
    assert (
        fmt.check_tensor_checksums(MPATH, moe, {"tensor_checksums": {"x": []}}, "buffer_files[0]", "buffer_files")
        is None
    )
    for m, key, entry_key, sums, want in (
        (moe, "buffer_files", "tensor_checksums", ["zz"], W_HEX),
        (moe, "buffer_files", "tensor_checksums", "ab", W_HEX),
        (moe, "buffer_files", "tensor_checksums", ["ab", 5], W_HEX),
        (edited("zero3", older(4)), "files", "tensor_checksums", ["0" * 17], W_HEX),
        (v1, "files", "tensor_crc32", [2**32], W_CRC),
        (v1, "files", "tensor_crc32", [0, "0"], W_CRC),
    ):
        entry = {entry_key: {"ok": [], "emas.0.x": sums}}
        assert refusal(lambda m=m, k=key, e=entry: fmt.check_tensor_checksums(MPATH, m, e, "rec[2]", k), CE) == (
            field_error(f"rec[2].{entry_key}['emas.0.x']", f"a list, each {want}", sums)
        )


# ----------------------------------------------------------------------------------- file metadata


def test_check_json_metadata():
    """A rank file's ``schedules`` and ``extra`` (JSON in its header) must equal the manifest's; files older than
    format 3 have no ``extra`` (null then)."""
    for name in LAYOUTS:
        data = real(name)
        for meta in data["metadata"].values():
            for key in ("schedules", "extra"):
                assert fmt.check_json_metadata("W", meta, key, data["manifest"]) is None
    m = manifest("zero3")
    meta = real("zero3")["metadata"][Z_FILE0]
    for version in (1, 2):
        assert fmt.check_json_metadata("W", {}, "extra", dict(m, format_version=version)) is None
    assert fmt.check_json_metadata("W", {}, "extra", {k: v for k, v in m.items() if k != "format_version"}) is None
    missing = "W: metadata {!r} is missing or not JSON: the file is damaged"
    for bad_meta, key, man in (
        ({}, "extra", dict(m, format_version=3)),
        ({}, "extra", m),
        ({}, "schedules", dict(m, schedules=None)),
        ({"extra": 5}, "extra", m),
        ({"extra": "{"}, "extra", m),
        ({"extra": "[" * 60000}, "extra", m),
        ({"schedules": b"null"}, "schedules", dict(m, schedules=None)),
    ):
        assert refusal(lambda b=bad_meta, k=key, n=man: fmt.check_json_metadata("W", b, k, n), CE) == missing.format(
            key
        )
    gamma = copy.deepcopy(m["schedules"])
    gamma[1]["gamma"] = 4.0
    saved = json.loads(meta["schedules"])
    assert refusal(lambda: fmt.check_json_metadata("W", meta, "schedules", dict(m, schedules=gamma)), CE) == (
        f"W: the manifest's field 'schedules' ({shown(gamma)}) differs from the one saved in this file's header "
        f"({shown(saved)}): the manifest was edited after the save (e.g. a changed gamma). Restore the manifest from a "
        "copy or load another tag"
    )
    assert refusal(lambda: fmt.check_json_metadata("W", meta, "extra", dict(m, extra={"a": 1})), CE) == (
        "W: the manifest's field 'extra' (dict {'a': 1}) differs from the one saved in this file's header "
        "(NoneType None): the manifest was edited after the save. Restore the manifest from a copy or load another tag"
    )


# --------------------------------------------------------------------------------- rank-file layouts


def _files_of(name: str) -> list[tuple[dict, int, dict, str]]:
    """(manifest part, index of the file in the part, the file's record, its layout text) of every rank file."""
    data = real(name)
    out = []
    for p in fmt.manifest_parts(data["manifest"]):
        for i, e in enumerate(p["files"]):
            out.append((p, i, e, data["metadata"][e["file"]]["layout"]))
    return out


def _expected_specs(p: dict, rank: int, given: dict) -> dict[str, ShardSpec]:
    """Each parameter's piece on ``rank``, from the manifest alone where it has an even cut (``piece_index``);
    else (expert parallelism) the file's own, once checked to tile the parameter with the other ranks' pieces."""
    out = {}
    for n, shape in p["params"].items():
        full, c = math.prod(shape), (p.get("piece_index") or {}).get(n)
        if isinstance(c, int):
            lo = min(rank * c, full)
            numel = min(lo + c, full) - lo
            out[n] = ShardSpec(tuple(shape), lo if numel else given[n][1], numel)
        else:
            out[n] = ShardSpec(tuple(shape), given[n][1], given[n][2])
    return out


def test_parse_layout_of_every_layout():
    """Every real rank file's layout parses to the ShardLayout the manifest implies: its rank, the part's world
    size, stage, coordinates, tensor-parallel dims and experts, and pieces where the piece index puts them."""
    seen = set()
    for name in LAYOUTS:
        pieces: dict[tuple, list[tuple[int, int]]] = {}
        for p, i, e, text in _files_of(name):
            given = json.loads(text)["specs"]
            ep = e.get("ep")
            experts = (
                None if p["experts"] is None else ExpertLayout(ep, p["experts"]["ep_size"], p["experts"]["owners"])
            )
            want = ShardLayout(
                e["rank"],
                p["world_size"],
                p["zero_stage"],
                _expected_specs(p, e["rank"], given),
                part=ModelPart(**p["part"]._asdict()),
                tp_dims=p["tp_dims"],
                experts=experts,
            )
            got = fmt.parse_layout("W", text, p, e["rank"], ep, f"{p['field']}files[{i}]")
            assert got == want and list(got.specs) == list(given), (name, e["file"])
            seen.add((name, got.part.whole, got.tp_dims is None, got.experts is None))
            for n, s in got.specs.items():
                pieces.setdefault((p["field"], n, s.full_numel), []).append((s.offset, s.numel))
        for (_, n, full), held in pieces.items():  # the pieces of each parameter tile it
            cursor = 0
            for off, numel in sorted(x for x in held if x[1]):
                assert off == cursor, (name, n, held)
                cursor += numel
            assert cursor == full, (name, n, held)
    assert {(w, t, x) for _, w, t, x in seen} == {
        (True, True, True),
        (False, True, True),
        (False, False, True),
        (True, True, False),
    }


def _layout(name: str, file: str, *edits: tuple[str | tuple, Any]) -> str:
    d = json.loads(real(name)["metadata"][file]["layout"])
    for path, value in edits:
        put(path, value)(d)
    return json.dumps(d)


def _layout_error(field: str, want: str, got: Any) -> str:
    return (
        f"W: layout metadata field {field!r} must be {want}, got {shown(got)}; the file is damaged: restore it or "
        "load another tag"
    )


def test_parse_layout_refuses():
    """A rank file's layout that disagrees with its part of the manifest, or holds a piece outside its parameter:
    refused, naming the field, what the manifest says and what the file holds."""
    z = fmt.manifest_parts(manifest("zero3"))[0]
    z1 = real("zero3")["metadata"][Z_FILE1]["layout"]
    assert fmt.parse_layout("W", z1, z, 1).specs["inp.bias"] == ShardSpec((13,), 7, 6)
    not_json = "W: metadata 'layout' is missing or not a JSON object; the file is damaged"
    for text in (None, z1.encode(), "[1]", "{", "[" * 60000, 5):
        assert refusal(lambda t=text: fmt.parse_layout("W", t, z, 1), CE) == not_json
    cases = [
        (z1, 0, ("rank", "0, as in the manifest", 1)),
        (_layout("zero3", Z_FILE1, ("rank", True)), 1, ("rank", "1, as in the manifest", True)),
        (_layout("zero3", Z_FILE1, ("rank", "1")), 1, ("rank", "1, as in the manifest", "1")),
        (_layout("zero3", Z_FILE1, ("world_size", 3)), 1, ("world_size", "2, as in the manifest", 3)),
        (_layout("zero3", Z_FILE1, ("world_size", GONE)), 1, ("world_size", "2, as in the manifest", None)),
        (_layout("zero3", Z_FILE1, ("stage", 2)), 1, ("stage", "3, as in the manifest", 2)),
        (_layout("zero3", Z_FILE1, ("stage", 3.0)), 1, ("stage", "3, as in the manifest", 3.0)),
        (
            _layout("zero3", Z_FILE1, ("part", {"tp": 0, "tp_size": 2, "pp": 0, "pp_size": 1})),
            1,
            (
                "part",
                "{'tp': 0, 'tp_size': 1, 'pp': 0, 'pp_size': 1} (the whole model), as in the manifest",
                {"tp": 0, "tp_size": 2, "pp": 0, "pp_size": 1},
            ),
        ),
        (_layout("zero3", Z_FILE1, ("tp_dims", {})), 1, ("tp_dims", "NoneType None, as in the manifest", {})),
        (
            _layout("zero3", Z_FILE1, ("specs", [])),
            1,
            ("specs", "an object {parameter name: [shape, offset, numel]}", []),
        ),
        (
            _layout("zero3", Z_FILE1, ("specs", GONE)),
            1,
            ("specs", "an object {parameter name: [shape, offset, numel]}", None),
        ),
    ]
    for spec in ([[13], 7], "abc", [13, 7, 6], [[13], 7, 6, 0], None):
        cases.append(
            (
                _layout("zero3", Z_FILE1, (("specs", "inp.bias"), spec)),
                1,
                ("specs['inp.bias']", "[shape, offset, numel]", spec),
            )
        )
    shape_want = "[13], the shape in the manifest's field 'params'"
    for shape in ([14], [13.0], ["13"], [13, 1], []):
        cases.append(
            (
                _layout("zero3", Z_FILE1, (("specs", "inp.bias", 0), shape)),
                1,
                ("specs['inp.bias'] shape", shape_want, shape),
            )
        )
    for off, numel in ((7, 7), (-1, 0), (14, 0), (1, 13), (True, 1), (0, "1"), (0, -1), (0.0, 1)):
        text = _layout("zero3", Z_FILE1, (("specs", "inp.bias", 1), off), (("specs", "inp.bias", 2), numel))
        cases.append(
            (text, 1, ("specs['inp.bias'] offset, numel", "a piece inside the 13 elements of (13,)", [off, numel]))
        )
    text = _layout("zero3", Z_FILE1, (("specs", "inp.weight", 2), 46))
    cases.append(
        (text, 1, ("specs['inp.weight'] offset, numel", "a piece inside the 91 elements of (13, 7)", [46, 46]))
    )
    for text, rank, (field, want, got) in cases:
        assert refusal(lambda t=text, r=rank: fmt.parse_layout("W", t, z, r), CE) == _layout_error(field, want, got)
    for off, numel in ((6, 7), (13, 0), (0, 13)):
        text = _layout("zero3", Z_FILE1, (("specs", "inp.bias", 1), off), (("specs", "inp.bias", 2), numel))
        assert fmt.parse_layout("W", text, z, 1).specs["inp.bias"] == ShardSpec((13,), off, numel)
    whole = _layout("zero3", Z_FILE1, ("part", {"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1}))
    assert fmt.parse_layout("W", whole, z, 1) == fmt.parse_layout("W", z1, z, 1)


def test_parse_layout_parameters_and_parts():
    """Other parameter names than the manifest's (at most 4 of each side shown); a model-parallel part's file
    must carry the part's coordinates and tensor-parallel dims."""
    z = fmt.manifest_parts(manifest("zero3"))[0]
    specs = json.loads(real("zero3")["metadata"][Z_FILE1]["layout"])["specs"]
    other = "W: its layout lists other parameters than the manifest's field 'params': only in the file {}, only in the manifest {}"
    one = dict({k: v for k, v in specs.items() if k != "inp.bias"}, extra=[[1], 0, 1])
    assert refusal(lambda: fmt.parse_layout("W", _layout("zero3", Z_FILE1, ("specs", one)), z, 1), CE) == (
        other.format("['extra']", "['inp.bias']")
    )
    gone = sorted(specs)[:5]
    many = dict({k: v for k, v in specs.items() if k not in gone}, **{f"new{i}": [[1], 0, 1] for i in range(5)})
    assert refusal(lambda: fmt.parse_layout("W", _layout("zero3", Z_FILE1, ("specs", many)), z, 1), CE) == (
        other.format(
            "['new0', 'new1', 'new2', 'new3' and 1 more]", "[" + ", ".join(repr(n) for n in gone[:4]) + " and 1 more]"
        )
    )
    assert refusal(lambda: fmt.parse_layout("W", _layout("zero3", Z_FILE1, ("specs", {})), z, 1), CE) == (
        other.format("[]", "[" + ", ".join(repr(n) for n in sorted(specs)[:4]) + " and 5 more]")
    )
    dt0, dt1 = fmt.manifest_parts(manifest("ds_tp"))
    text1 = real("ds_tp")["metadata"][DT_FILE1]["layout"]
    got = fmt.parse_layout("W", text1, dt1, 0)
    assert got.part == ModelPart(1, 2, 0, 1) and got.tp_dims == {
        "fc1.bias": 0,
        "fc1.weight": 0,
        "fc2.bias": None,
        "fc2.weight": 1,
    }
    assert refusal(lambda: fmt.parse_layout("W", text1, dt0, 0), CE) == _layout_error(
        "part",
        "{'tp': 0, 'tp_size': 2, 'pp': 0, 'pp_size': 1} (tensor-parallel rank 0 of 2), as in the manifest",
        {"tp": 1, "tp_size": 2, "pp": 0, "pp_size": 1},
    )
    no_part = _layout("ds_tp", DT_FILE1, ("part", GONE))
    assert refusal(lambda: fmt.parse_layout("W", no_part, dt1, 0), CE) == _layout_error(
        "part", "{'tp': 1, 'tp_size': 2, 'pp': 0, 'pp_size': 1} (tensor-parallel rank 1 of 2), as in the manifest", None
    )
    no_dims = _layout("ds_tp", DT_FILE1, ("tp_dims", GONE))
    assert refusal(lambda: fmt.parse_layout("W", no_dims, dt1, 0), CE) == _layout_error(
        "tp_dims", f"{shown(dt1['tp_dims'])}, as in the manifest", None
    )
    other_dims = _layout("ds_tp", DT_FILE1, (("tp_dims", "fc2.bias"), 0))
    assert refusal(lambda: fmt.parse_layout("W", other_dims, dt1, 0), CE) == _layout_error(
        "tp_dims", f"{shown(dt1['tp_dims'])}, as in the manifest", json.loads(other_dims)["tp_dims"]
    )


M_FILE0 = "ema_rank_00000_of_00002.gen1.safetensors"
M_FILE1 = "ema_rank_00001_of_00002.gen1.safetensors"


def test_parse_layout_experts():
    """Under expert parallelism the file's record must be the manifest's, its expert-parallel rank the one the
    manifest's file entry gives, and it may hold no element of another rank's expert."""
    moe = fmt.manifest_parts(manifest("moe"))[0]
    owners = moe["experts"]["owners"]
    t0 = real("moe")["metadata"][M_FILE0]["layout"]
    assert fmt.parse_layout("W", t0, moe, 0, 0, "files[0]").experts == ExpertLayout(0, 2, owners)
    differs = (
        "W: the manifest's field 'experts' (ep_size 2, 8 expert parameters and the expert-parallel rank of each) differs "
        "from the record in this file's header (ep_size {}): the manifest was edited after the save or mixes two saves; "
        "restore it or load another tag"
    )
    for path, value, got in (
        ("experts", GONE, None),
        ("experts", 5, 5),
        ("experts", "ab", "ab"),
        ("experts", {"ep": 0, "owners": owners}, None),
        (("experts", "ep_size"), 3, 3),
        (("experts", "owners", X2), 0, 2),
        (("experts", "owners", "extra"), 0, 2),
    ):
        text = _layout("moe", M_FILE0, (path, value))
        assert refusal(lambda t=text: fmt.parse_layout("W", t, moe, 0, 0, "files[0]"), CE) == differs.format(shown(got))
    says = (
        "W: the manifest's field '{}.ep' says expert-parallel rank {}, but the file's header holds the experts of "
        "expert-parallel rank {}: the manifest was edited or mixes two saves; restore it or load another tag"
    )
    assert refusal(lambda: fmt.parse_layout("W", t0, moe, 0, 1, "files[0]"), CE) == says.format("files[0]", 1, "int 0")
    assert refusal(lambda: fmt.parse_layout("W", t0, moe, 0), CE) == says.format("files[?]", None, "int 0")
    no_ep = _layout("moe", M_FILE0, (("experts", "ep"), GONE))
    assert refusal(lambda: fmt.parse_layout("W", no_ep, moe, 0, 0, "parts[1].files[3]"), CE) == (
        says.format("parts[1].files[3]", 0, "NoneType None")
    )
    foreign = _layout("moe", M_FILE0, (("specs", X2, 2), 1))
    assert refusal(lambda: fmt.parse_layout("W", foreign, moe, 0, 0, "files[0]"), CE) == (
        f"W: it holds elements of expert parameter {X2!r}, which the manifest's field 'experts' gives to expert-parallel "
        "rank 1, but this file is expert-parallel rank 0's: the file or manifest is damaged or was edited; restore it "
        "or load another tag"
    )
    z = fmt.manifest_parts(manifest("zero3"))[0]
    stray = _layout("zero3", Z_FILE1, ("experts", {"ep": 0, "ep_size": 1, "owners": {}}))
    assert refusal(lambda: fmt.parse_layout("W", stray, z, 1), CE) == _layout_error(
        "experts", "absent, as in the manifest (no expert parallelism)", {"ep": 0, "ep_size": 1, "owners": {}}
    )
    assert fmt.parse_layout("W", _layout("zero3", Z_FILE1, ("experts", None)), z, 1).experts is None


# ------------------------------------------------------------------------------------ outputs of tools

EXPORT_FIX = "Write it outside the checkpoint folders, e.g. next to them as ema.safetensors"


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    """A checkpoint directory: tags t1 and t2 (a manifest each), a DeepSpeed-only tag (``*_states.pt``), a plain
    folder, ``latest``; paths resolved (messages show the resolved target of a link)."""
    root = tmp_path.resolve() / "ck"
    for tag in ("t1", "t2"):
        (root / tag).mkdir(parents=True)
        (root / tag / "ema_manifest.json").write_text("{}")
    (root / "ds").mkdir()
    (root / "ds" / "mp_rank_00_model_states.pt").write_text("")
    (root / "plain" / "sub").mkdir(parents=True)
    (root / "latest").write_text("t1")
    return root


def test_check_export_path(ck):
    """An export may not land on a checkpoint's files: not a folder, not a name of a checkpoint's own files, not
    into a tag folder (the library's or DeepSpeed's); links resolved and shown."""
    out = ck.parent / "ema.safetensors"
    assert fmt.check_export_path(out) == out and fmt.check_export_path(str(out)) == out
    assert fmt.check_export_path(ck / "plain" / "x.safetensors") == ck / "plain" / "x.safetensors"
    assert fmt.check_export_path(ck / "missing" / "x.safetensors") == ck / "missing" / "x.safetensors"
    assert refusal(lambda: fmt.check_export_path(ck / "plain"), OutputPathError) == (
        f"export: refusing to write {ck / 'plain'}: it is a directory; give a .safetensors file name"
    )
    for name in (
        "ema_rank_00000_of_00001.safetensors",
        "buffers_rank_00000_of_00002.gen1.safetensors",
        "ema_manifest.json",
        "integration.json",
        "latest",
        "LATEST",
        "latest_universal",
        "zero_to_fp32.py",
        "ema_latest",
        "x_states.pt",
    ):
        path = ck.parent / name
        assert refusal(lambda p=path: fmt.check_export_path(p, "consolidate"), OutputPathError) == (
            f"consolidate: refusing to write {path}: that name belongs to a checkpoint's own files, which an export "
            f"would replace. {EXPORT_FIX}"
        )
    for tag in ("t1", "ds"):
        path = ck / tag / "ema.safetensors"
        assert refusal(lambda p=path: fmt.check_export_path(p), OutputPathError) == (
            f"export: refusing to write {path}: {ck / tag} holds a checkpoint's files (a tag folder), and an export "
            f"there would mix with them. {EXPORT_FIX}"
        )
    link = ck.parent / "link.safetensors"
    link.symlink_to(ck / "t2" / "x.safetensors")
    assert refusal(lambda: fmt.check_export_path(link), OutputPathError) == (
        f"export: refusing to write {link} (-> {ck / 't2' / 'x.safetensors'}): {ck / 't2'} holds a checkpoint's files "
        f"(a tag folder), and an export there would mix with them. {EXPORT_FIX}"
    )
    loop = ck.parent / "loop"
    loop.symlink_to(loop)
    msg = refusal(lambda: fmt.check_export_path(loop), OutputPathError)
    assert msg.startswith(f"export: cannot resolve the path {loop}: ") and len(msg) > len(
        f"export: cannot resolve the path {loop}: "
    )


def test_check_output(ck):
    """An offline tool's output may not land inside the checkpoint it reads (the tags read, any tag folder of the
    directory, its pointer files, the directory itself), nor be a folder, nor replace a file unasked."""
    fix = f"Write it outside the checkpoint, e.g. {ck.parent / 'x.safetensors'}"
    tags = [ck / "t1"]
    allowed = [
        ck.parent / "x.safetensors",
        ck / "x.safetensors",
        ck / "plain" / "x.safetensors",
        ck / "plain" / "latest",
        ck / "plain" / "sub" / "x.safetensors",
    ]
    for path in allowed:
        assert fmt.check_output(path, ck, tags, False) == path
    assert fmt.check_output(str(ck.parent / "x.safetensors"), str(ck), tags, False) == ck.parent / "x.safetensors"
    for path, tag in (
        (ck / "t1" / "x.safetensors", ck / "t1"),
        (ck / "t1", ck / "t1"),
        (ck / "t1" / "a" / "x.safetensors", ck / "t1"),
    ):
        assert refusal(lambda p=path: fmt.check_output(p, ck, tags, True), OutputPathError) == (
            f"refusing to write {path}: it is inside the tag folder {tag} being read, and would replace or add to that "
            f"checkpoint's files. {fix.replace('x.safetensors', path.name)}"
        )
    inside = "refusing to write {}: it is inside the checkpoint directory {} being read (a tag folder or a pointer file such as 'latest'). {}"
    for path in (
        ck / "t2" / "x.safetensors",
        ck / "ds" / "x.safetensors",
        ck / "latest",
        ck / "LATEST",
        ck / "zero_to_fp32.py",
        ck,
        ck / "t2" / "a" / "b",
    ):
        name = path.name if path != ck else f"{ck.name}.safetensors"  # not the checkpoint itself again
        assert refusal(lambda p=path: fmt.check_output(p, ck, tags, True), OutputPathError) == (
            inside.format(path, ck, fix.replace("x.safetensors", name))
        )
    link = ck.parent / "out.safetensors"
    link.symlink_to(ck / "t1" / "y.safetensors")
    assert refusal(lambda: fmt.check_output(link, ck, tags, True), OutputPathError) == (
        f"refusing to write {link} (-> {ck / 't1' / 'y.safetensors'}): it is inside the tag folder {ck / 't1'} being "
        f"read, and would replace or add to that checkpoint's files. {fix.replace('x.safetensors', 'out.safetensors')}"
    )
    link.unlink()
    link.symlink_to(ck / "t2" / "y.safetensors")
    assert refusal(lambda: fmt.check_output(link, ck, tags, True), OutputPathError) == inside.format(
        f"{link} (-> {ck / 't2' / 'y.safetensors'})", ck, fix.replace("x.safetensors", "out.safetensors")
    )
    assert refusal(lambda: fmt.check_output(ck.parent, ck / "plain", [], True), OutputPathError) == (
        f"refusing to write {ck.parent}: it is a directory; give a .safetensors file name"
    )
    existing, dangling = ck.parent / "old.safetensors", ck.parent / "dangling.safetensors"
    existing.write_text("x")
    dangling.symlink_to(ck.parent / "nowhere")
    for path in (existing, dangling):
        assert refusal(lambda p=path: fmt.check_output(p, ck, tags, False), OutputPathError) == (
            f"refusing to replace the existing file {path}: pass --overwrite (overwrite=True) to replace it "
            "(atomically), or choose another name"
        )
        assert fmt.check_output(path, ck, tags, True) == path
    # A checkpoint at a URL has no local folder: a local output is only checked for a folder or an existing file,
    # never against Path(url) (./s3:/bucket/run, an unrelated local folder that was refused before).
    (ck.parent / "s3:" / "bucket" / "run").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ck.parent)
        relative = Path("s3:/bucket/run/latest")  # was refused as the URL checkpoint's pointer file
        assert fmt.check_output(relative, "s3://bucket/run", [], False) == relative
        memory = Path("memory:/bucket/run")  # the readers' root is a StoragePath; this was refused as that root
        memory.parent.mkdir(parents=True)
        assert fmt.check_output(memory, StoragePath(storage_for("memory://bucket/run")), [], False) == memory
        assert refusal(lambda: fmt.check_output(ck.parent, "s3://bucket/run", [], True), OutputPathError) == (
            f"refusing to write {ck.parent}: it is a directory; give a .safetensors file name"
        )
        assert refusal(lambda: fmt.check_output(existing, "s3://bucket/run", [], False), OutputPathError) == (
            f"refusing to replace the existing file {existing}: pass --overwrite (overwrite=True) to replace it "
            "(atomically), or choose another name"
        )
    loop = ck.parent / "loop"
    loop.symlink_to(loop)
    msg = refusal(lambda: fmt.check_output(loop, ck, tags, True), OutputPathError)
    assert msg.startswith(f"cannot resolve the output path {loop}: ") and len(msg) > len(
        f"cannot resolve the output path {loop}: "
    )


# ---------------------------------------------------------------------------------- buffers at a save


def _bstate(step: int, emas: list[dict], copied: dict | None = None) -> BufferState:
    return BufferState(torch.tensor(step), tuple(emas), copied or {})


def _state(step: int, num_emas: int) -> EmaState:
    return EmaState(torch.tensor(step), tuple({"w": torch.zeros(2)} for _ in range(num_emas)))


def test_describe_buffers():
    """The manifest's ``buffers`` record of a buffer state saved with an EMA state: names sorted, shapes, one
    floating dtype (float32 when there is none), copied dtypes; the same step, EMA count, names, shapes and dtype
    required, each refusal naming the buffer."""
    f64 = torch.zeros(2, 3, dtype=torch.float64)
    b = _bstate(
        5,
        [{"z": f64, "a": torch.zeros(4, dtype=torch.float64)}] * 2,
        {"n": torch.tensor(3), "m": torch.zeros(2, dtype=torch.bool)},
    )
    assert fmt.describe_buffers(b, _state(5, 2)) == {
        "num_emas": 2,
        "dtype": "float64",
        "floating": {"a": [4], "z": [2, 3]},
        "copied": {"m": ["bool", [2]], "n": ["int64", []]},
    }
    assert list(fmt.describe_buffers(b, _state(5, 2))["floating"]) == ["a", "z"]
    assert fmt.describe_buffers(_bstate(1, [{}], {}), _state(1, 1)) == {
        "num_emas": 1,
        "dtype": "float32",
        "floating": {},
        "copied": {},
    }
    assert fmt.describe_buffers(None, _state(1, 1)) is None
    assert refusal(lambda: fmt.describe_buffers({"a": f64}, _state(1, 1)), TypeError) == (
        "save(buffers=...) takes a functional_ema.buffers.BufferState (from init_buffers / update_buffers / "
        "load_buffers), got dict"
    )
    cases: list[tuple[BufferState, int, type[Exception], str]] = [
        (
            _bstate(3, [{}]),
            1,
            CheckpointMismatchError,
            "the buffer state is at step 3 but the EMA state at step 4; update both at the same steps so a resume reads "
            "one step: pass update_buffers the EMA state's step after update, int(state.step) (update(..., "
            'nonfinite="skip") keeps it at the last step it averaged, and the buffers then skip that step too)',
        ),
        (
            _bstate(4, [{}, {}]),
            1,
            CheckpointMismatchError,
            "the buffer state tracks 2 EMA(s) but the EMA state 1; make both with the same num_emas",
        ),
        (
            _bstate(4, [{"a": f64}, {"b": f64}]),
            2,
            CheckpointMismatchError,
            "buffer EMA 1 holds other names than buffer EMA 0",
        ),
        (
            _bstate(4, [{"a": f64}, {"a": f64}, {"b": f64}]),
            3,
            CheckpointMismatchError,
            "buffer EMA 2 holds other names than buffer EMA 0",
        ),
        (
            _bstate(4, [{"a": torch.zeros(2, dtype=torch.int64)}]),
            1,
            TypeError,
            "buffers.emas[0]['a'] must be a floating tensor, got torch.int64",
        ),
        (_bstate(4, [{"a": f64}, {"a": 5}]), 2, TypeError, "buffers.emas[1]['a'] must be a floating tensor, got int"),
        (
            _bstate(4, [{"a": f64}, {"a": f64[:1]}]),
            2,
            CheckpointMismatchError,
            "buffer 'a' has shape [1, 3] in EMA 1 but [2, 3] in EMA 0",
        ),
        (
            _bstate(4, [{"a": f64, "b": torch.zeros(1)}]),
            1,
            CheckpointMismatchError,
            "the buffer EMAs mix dtypes ['torch.float32', 'torch.float64']",
        ),
        (_bstate(4, [{}], {"c": 5}), 1, TypeError, "buffers.copied['c'] must be a tensor of a storable dtype, got int"),
        (
            _bstate(4, [{}], {"c": torch.zeros(1, dtype=torch.complex64)}),
            1,
            TypeError,
            "buffers.copied['c'] must be a tensor of a storable dtype, got torch.complex64",
        ),
        (
            _bstate(4, [{"a": f64}], {"a": torch.tensor(1)}),
            1,
            CheckpointMismatchError,
            "buffer 'a' is both averaged and copied",
        ),
    ]
    for bs, num_emas, exc, msg in cases:
        assert (
            refusal(lambda bs=bs, n=num_emas: fmt.describe_buffers(bs, _state(4, n)), exc)
            == f"save(buffers=...): {msg}"
        )


# ----------------------------------------------------------------------- a save in one process


def test_a_single_process_save():
    """What ``fe.save`` wrote in one process (``single.json``: a Linear and a BatchNorm, two EMAs, buffers, world
    size 1, generation 0) passes every check here: manifest, file names, layout (whole parameters), metadata,
    the buffers record a fresh BatchNorm's buffer state gives, and the chunk checksums cut by the rank file's
    tensors (those of the BatchNorm's ones and zeros recomputed here)."""
    data = real("single")
    m, (file,) = data["manifest"], data["metadata"]
    assert fmt.validate_manifest(MPATH, m) is None
    (p,) = fmt.manifest_parts(m)
    assert [e["file"] for e in p["files"]] == [fmt.rank_file_name(0, 1)] == [file]
    assert [e["file"] for e in p["buffer_files"]] == [fmt.buffer_file_name(0, 1)]
    shapes = {"0.weight": (3, 4), "0.bias": (3,), "1.weight": (3,), "1.bias": (3,)}
    assert fmt.parse_layout("W", data["metadata"][file]["layout"], p, 0) == ShardLayout(
        0, 1, 0, {n: ShardSpec(s, 0, math.prod(s)) for n, s in shapes.items()}
    )
    for key in ("schedules", "extra"):
        assert fmt.check_json_metadata("W", data["metadata"][file], key, m) is None
    bn = torch.nn.BatchNorm1d(3)
    floating = {"1.running_mean": bn.running_mean, "1.running_var": bn.running_var}
    bstate = BufferState(torch.tensor(0), (floating, floating), {"1.num_batches_tracked": bn.num_batches_tracked})
    assert (
        fmt.describe_buffers(bstate, _state(0, 2)) == m["buffers"] == BUFFERS | {"floating": {n: [3] for n in floating}}
    )
    tensors = {k: _io.TensorEntry("F32", [(b - a) // 4], a, b) for k, (a, b) in data["tensors"][file].items()}
    algo, header, none = fmt.file_checksums(m, p["files"][0], "W")
    assert (algo, header, none) == ("xxh3_64", int(p["files"][0]["header_checksum"], 16), {})
    sums = fmt.split_chunk_checksums(MPATH, "files[0]", p["files"][0]["chunk_checksums"], algo, tensors, "W")
    assert sorted(sums) == sorted(tensors) and all(len(v) == 1 for v in sums.values())
    ones, zeros = (xxhash.xxh3_64_intdigest(t.numpy().tobytes()) for t in (torch.ones(3), torch.zeros(3)))
    assert [sums[f"emas.{k}.1.{n}"] for k in (0, 1) for n in ("weight", "bias")] == [[ones], [zeros]] * 2
    assert sums["emas.0.0.weight"] == sums["emas.1.0.weight"] and sums["emas.0.0.weight"] != [ones]
