"""The checkpoint reader (``functional_ema/_checkpoint/reader.py``): locating a tag, the manifest's and the rank
files' checks, reads of any range at another world size with every byte read verified, module buffers, the
joined and re-cut readers of model-parallel saves, and private folders (``local=``).

Checkpoints are written in this process through the library's own writer (each rank's layout as its engine
would report it; see ``_write``), or by ``fe.save`` of a plain module; values are compared with the tensors
they were written from, and every refusal with its whole message (the file, field and both values it names).
Two 2-rank launches (plain torch.distributed) cover what depends on the rank: every rank refusing a copy of
another save, and loads at another world size."""

from __future__ import annotations

import json
import math
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import functional_ema as fe
from functional_ema import ExpertLayout, ModelPart, ShardLayout, ShardSpec, _io
from functional_ema._checkpoint import index, reader, writer
from functional_ema._checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidTagError,
)
from functional_ema._checkpoint.format import (
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    brief,
    library_version,
    parse_dtype,
    short_list,
    split_chunk_checksums,
)
from functional_ema._checkpoint.reader import (
    CheckpointReader,
    RecutReader,
    check_local,
    check_tp_dims,
    fill_all,
    locate_checkpoint,
    open_checkpoint,
    open_joined,
    open_parts,
)
from functional_ema._state import BufferState, EmaState
from functional_ema._testing.files import hashes
from functional_ema._testing.multirank import run_ranks

SHAPES = {"w": (6, 5), "b": (7,)}
STEP = 12


def _ref(name: str, shape: tuple[int, ...] = (), k: int = 0) -> torch.Tensor:
    """EMA ``k`` of parameter ``name``, flattened: distinct values per parameter, element and EMA."""
    numel = math.prod(shape or SHAPES[name])
    return torch.arange(numel, dtype=torch.float32) * 0.5 + 1000 * (ord(name[0]) - 96) + 100 * k


def _msg(exc: type[BaseException], fn: Callable[[], object]) -> str:
    """The message of the error ``fn`` raises, which must be exactly of type ``exc``."""
    with pytest.raises(exc) as info:
        fn()
    assert type(info.value) is exc, repr(info.value)
    return str(info.value)


# ------------------------------------------------------------------------------------------- layouts


def _even(rank: int, world: int, shapes: dict | None = None) -> dict[str, ShardSpec]:
    """ZeRO-3's cut: each flattened parameter in pieces of ``ceil(numel / world)``."""
    specs = {}
    for n, s in (shapes or SHAPES).items():
        numel = math.prod(s)
        per = -(-numel // world)
        lo = min(rank * per, numel)
        specs[n] = ShardSpec(tuple(s), lo, min(lo + per, numel) - lo)
    return specs


def _zero3(world: int, shapes: dict | None = None, **kw: object) -> list[ShardLayout]:
    return [ShardLayout(r, world, 3, _even(r, world, shapes), **kw) for r in range(world)]  # type: ignore[arg-type]


Values = Callable[[ShardLayout, str, int], torch.Tensor]


def _values(lay: ShardLayout, name: str, k: int) -> torch.Tensor:
    """EMA ``k`` of ``name`` in ``lay``'s model-parallel part, flattened (the default: the same in every part)."""
    return _ref(name, lay.specs[name].shape, k)


def _pieces(lay: ShardLayout, num_emas: int, values: Values = _values) -> tuple[dict[str, torch.Tensor], ...]:
    return tuple(
        {n: values(lay, n, k)[s.offset : s.offset + s.numel].clone() for n, s in lay.specs.items()}
        for k in range(num_emas)
    )


def _write(
    root: Path,
    layouts: list[ShardLayout],
    tag: str = "t",
    num_emas: int = 2,
    generation: int = 0,
    buffers: Callable[[ShardLayout], BufferState] | None = None,
    meta: Callable[[ShardLayout, dict], None] | None = None,
    values: Values = _values,
) -> dict:
    """The checkpoint the ranks of ``layouts`` would save (one process plays every rank) through the library's
    writer, with each rank's buffers (``buffers``), at ``generation``; ``meta`` may edit a rank file's metadata
    before it is written (the manifest then records that file's checksums, as a save would). The manifest."""
    tag_dir = root / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    records, first = [], None
    for lay in layouts:
        emas = _pieces(lay, num_emas, values)
        bufs = None if buffers is None else buffers(lay)
        plan = writer.plan_save(EmaState(torch.tensor(STEP), emas), [0.9] * num_emas, lay, tag, bufs)
        plan["generation"] = generation
        first = first or plan
        record: dict = {"part": writer.part_record(lay, plan)}
        names = writer.save_files(lay, generation, bufs is not None, lay.writes_pieces)
        if lay.writes_pieces:
            m = writer.rank_file_meta(plan, lay, generation)
            if meta is not None:
                meta(lay, m)
            dtype = parse_dtype(plan["dtype"], tag)
            record["file"] = writer.write_rank_file(tag_dir / names[0], lay, emas, dtype, m)
        if bufs is not None:
            bmeta = writer.buffer_file_meta(plan, lay, generation)
            record["buffers"] = writer.write_buffer_file(tag_dir / names[-1], lay.rank, bufs, plan["buffers"], bmeta)
        records.append(record)
    assert first is not None
    manifest = writer.build_manifest(first, records)
    writer.commit_manifest(root, tag_dir, manifest)
    return manifest


def _manifest(tag_dir: Path) -> dict:
    return json.loads((tag_dir / MANIFEST_NAME).read_text())


def _set_manifest(tag_dir: Path, m: dict) -> None:
    (tag_dir / MANIFEST_NAME).write_text(json.dumps(m))


def _flip(path: Path, at: int) -> None:
    """Flip one bit of byte ``at`` of ``path``."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def _data_at(path: Path, key: str, element: int) -> int:
    """The file offset of element ``element`` of tensor ``key`` in a rank file."""
    with _io.SafetensorsFile(path) as st:
        entry = st.tensors[key]
        return st.header_size + entry.start + element * entry.dtype.itemsize


def _read(ckpt: object, name: str, start: int, numel: int, k: int = 0, verify: bool = True) -> torch.Tensor:
    out = torch.full((numel,), float("nan"))
    ckpt.fill(out, k, name, start, numel, verify)  # type: ignore[attr-defined]
    return out


def _rank_file(rank: int, world: int, gen: int = 0) -> str:
    return f"ema_rank_{rank:05d}_of_{world:05d}{f'.gen{gen}' if gen else ''}.safetensors"


# --------------------------------------------------------------------------------- locating a tag


def test_locate_follows_latest_and_the_tag_folder(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(1), tag="a")
    _write(root, _zero3(1), tag="b")
    assert locate_checkpoint(root)[:3] == (root, "b", root / "b")  # ema_latest names the last save
    (root / "latest").write_text("a\n")  # DeepSpeed's pointer wins where present
    got = locate_checkpoint(root)
    assert got[:3] == (root, "a", root / "a") and got[3]["tag"] == "a"
    assert locate_checkpoint(root, "b")[1] == "b"  # a tag given wins over both
    got = locate_checkpoint(root / "b")  # the tag folder itself
    assert got[:3] == (root, "b", root / "b") and got[3] == _manifest(root / "b")
    with CheckpointReader.open(root / "a", None) as ckpt:
        assert (ckpt.root, ckpt.tag, ckpt.tag_dir) == (root, "a", root / "a")
    with CheckpointReader.open(root, "b") as ckpt:  # the tag given, not the one 'latest' names
        assert ckpt.tag == "b"
    assert _msg(TypeError, lambda: locate_checkpoint(3)) == (  # type: ignore[arg-type]
        "checkpoint_dir must be a path (a str or os.PathLike), got int 3"
    )


def test_locate_refuses_files_and_missing_folders(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(1), tag="a")
    pick = tmp_path / "ema.pt"
    pick.write_bytes(pickle.dumps({"x": 1}, protocol=2))
    assert _msg(CorruptCheckpointError, lambda: locate_checkpoint(pick)) == (
        f"{pick} is a pickle / torch.save file. functional_ema never unpickles (loading a pickle can run arbitrary "
        "code); pass the checkpoint directory (the one holding 'latest' and the tag folders)"
    )
    mpath = root / "a" / MANIFEST_NAME
    assert _msg(CheckpointError, lambda: locate_checkpoint(mpath)) == (
        f"{mpath} is a manifest: pass its folder, {mpath.parent}, or the checkpoint directory with tag="
    )
    other = root / "a" / _rank_file(0, 1)
    assert _msg(CheckpointError, lambda: CheckpointReader.open(other, None)) == (
        f"{other} is a file: pass the checkpoint directory (the one holding 'latest' and the tag folders)"
    )
    gone = tmp_path / "nothing"
    assert _msg(CheckpointNotFoundError, lambda: open_checkpoint(gone)) == f"checkpoint directory {gone} does not exist"


def test_locate_names_the_tags_there(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(1), tag="a10")
    _write(root, _zero3(1), tag="a9")
    (root / LATEST_NAME).unlink()
    (root / "stray").mkdir()  # no manifest: not a complete tag
    tags = "['a9', 'a10']"
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root)) == (
        f"{root} has no 'latest' file (DeepSpeed writes it in save_checkpoint) nor 'ema_latest' "
        f"(functional_ema.save writes it): pass tag=... Tags here with a complete EMA: {tags}"
    )
    (root / LATEST_NAME).write_text("\n")
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root)) == (
        f"{root / LATEST_NAME} is empty (a crash while DeepSpeed wrote it?): pass tag=... Tags here with a complete "
        f"EMA: {tags}"
    )
    (root / "latest").write_text("")
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root)).startswith(f"{root / 'latest'} is empty")
    (root / "latest").write_text("zz")
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root)) == (
        f"no tag 'zz' in {root} (named by latest). Tags here with a complete EMA: {tags}"
    )
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root, "zz")) == (
        f"no tag 'zz' in {root}. Tags here with a complete EMA: {tags}"
    )
    assert _msg(InvalidTagError, lambda: locate_checkpoint(root, "a/b")).startswith("tag 'a/b' contains a path")
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root, "latest")) == (  # a name only saves refuse
        f"no tag 'latest' in {root}. Tags here with a complete EMA: {tags}"
    )


def test_locate_refuses_a_tag_without_its_manifest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(1), tag="a")
    _write(root, _zero3(1), tag="b")
    (root / "c").mkdir()
    tail = "Load another tag; tags here with a complete EMA: ['a', 'b']"
    assert _msg(IncompleteCheckpointError, lambda: locate_checkpoint(root, "c")) == (
        f"tag 'c' in {root} has no complete EMA checkpoint: there are no EMA files at all (was functional_ema.save "
        f"called for this tag?). {tail}"
    )
    found = [_rank_file(r, 5) for r in range(5)]
    for name in reversed(found):
        (root / "c" / name).write_bytes(b"x")
    (root / "c" / "notes.txt").write_text("not a rank file")
    assert _msg(IncompleteCheckpointError, lambda: locate_checkpoint(root, "c")) == (
        f"tag 'c' in {root} has no complete EMA checkpoint: found 5 EMA rank file(s) {short_list(found, 4)} but the "
        f"manifest, written last, is missing. {tail}"
    )
    (root / "latest").write_text("c")
    assert _msg(IncompleteCheckpointError, lambda: locate_checkpoint(root)) == (
        f"tag 'c' in {root} has no complete EMA checkpoint: found 5 EMA rank file(s) {short_list(found, 4)} but the "
        "manifest, written last, is missing. 'latest' names this tag: DeepSpeed finished its save but the EMA save "
        f"did not (call functional_ema.save before engine.save_checkpoint to avoid this). {tail}"
    )


def test_ema_latest_refusals_name_ema_latest_not_deepspeed(tmp_path: Path) -> None:
    """Without DeepSpeed's 'latest' (an FSDP2 or plain run), ``ema_latest`` naming a tag whose manifest is gone was
    explained as DeepSpeed's 'latest' and engine.save_checkpoint; it names ema_latest now. ``ema_latest`` replaced by
    a folder (a link to a tag folder) is named as such, and no pointer name is listed among the tags."""
    root = tmp_path / "ck"
    _write(root, _zero3(1), tag="a")
    _write(root, _zero3(1), tag="b")
    (root / "b" / MANIFEST_NAME).unlink()
    (root / LATEST_NAME).write_text("b")
    assert not (root / "latest").exists()
    assert _msg(IncompleteCheckpointError, lambda: locate_checkpoint(root)) == (
        f"tag 'b' in {root} has no complete EMA checkpoint: found 1 EMA rank file(s) ['{_rank_file(0, 1)}'] but the "
        "manifest, written last, is missing. 'ema_latest' names this tag (functional_ema.save writes it once a tag is "
        "complete), so the tag's manifest was removed or the folder copied or pruned partially since. Load another "
        "tag; tags here with a complete EMA: ['a']"
    )
    (root / LATEST_NAME).write_text("zz")
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root)) == (
        f"no tag 'zz' in {root} (named by ema_latest). Tags here with a complete EMA: ['a']"
    )
    (root / LATEST_NAME).unlink()
    (root / LATEST_NAME).symlink_to(root / "a", target_is_directory=True)
    assert _msg(CheckpointNotFoundError, lambda: locate_checkpoint(root)) == (
        f"{root} has no 'latest' file (DeepSpeed writes it in save_checkpoint) nor 'ema_latest' (functional_ema.save "
        "writes it); 'ema_latest' here is a folder (a link to a folder), not the pointer file naming a tag (replace it "
        "with that file): pass tag=... Tags here with a complete EMA: ['a']"
    )


def test_locate_refuses_missing_files_unless_local(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    m = _write(root, _zero3(5))
    for r in range(5):
        (root / "t" / _rank_file(r, 5)).unlink()
    listed = ", ".join(f"{_rank_file(r, 5)} (rank {r} of 5)" for r in range(4))
    want = (
        f"tag 't' in {root} is missing 5 file(s) listed in its manifest: {listed}. The folder was copied or pruned "
        "partially: restore the file(s) or load another tag (a save with shared=False into each rank's own folder: "
        "load it with shared=False, or merge the folders first)"
    )
    assert _msg(IncompleteCheckpointError, lambda: locate_checkpoint(root)) == want
    assert locate_checkpoint(root, local=True) == (root, "t", root / "t", m)  # a private folder: checked per file


# ------------------------------------------------------------------------------------- the manifest


def test_manifest_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    good = _write(root, _zero3(2))
    mpath = root / "t" / MANIFEST_NAME
    size = mpath.stat().st_size
    monkeypatch.setattr(reader, "MAX_MANIFEST_BYTES", size)  # at the limit: read
    assert locate_checkpoint(root)[3] == good
    monkeypatch.setattr(reader, "MAX_MANIFEST_BYTES", size - 1)
    assert _msg(CorruptCheckpointError, lambda: locate_checkpoint(root)) == (
        f"{mpath} holds {size} bytes, far more than any manifest: it is damaged; load another tag"
    )
    monkeypatch.undo()

    def refused(exc: type[BaseException], raw: bytes | dict) -> str:
        mpath.write_bytes(raw if isinstance(raw, bytes) else json.dumps(raw).encode())
        return _msg(exc, lambda: locate_checkpoint(root))

    assert refused(CorruptCheckpointError, pickle.dumps(good, protocol=4)) == (
        f"{mpath} is a pickle, not JSON; functional_ema never unpickles. The manifest is damaged"
    )
    try:
        json.loads(b'{"format": ')
    except ValueError as e:
        why = str(e)
    assert refused(CorruptCheckpointError, b'{"format": ') == (
        f"{mpath} is not valid JSON ({why}): the manifest is damaged; load another tag"
    )
    assert refused(CorruptCheckpointError, b"[" * 100_000 + b"]" * 100_000) == (
        f"{mpath} is not valid JSON (nested too deeply): the manifest is damaged; load another tag"
    )
    assert refused(CorruptCheckpointError, b"[1]") == f"{mpath} is not a functional_ema manifest (format None)"
    assert refused(CorruptCheckpointError, dict(good, format="x")) == (
        f"{mpath} is not a functional_ema manifest (format 'x')"
    )
    for bad in (True, 0, "5", None):
        assert refused(CorruptCheckpointError, dict(good, format_version=bad)) == f"{mpath}: bad format_version {bad!r}"
    newer = FORMAT_VERSION + 1
    assert refused(CheckpointVersionError, dict(good, format_version=newer, library="functional_ema 9.0")) == (
        f"{mpath} was written by a newer functional_ema (functional_ema 9.0, format version {newer}); this one "
        f"({library_version()}) reads format version {FORMAT_VERSION} and older. Upgrade functional_ema "
        "(pip install -U functional-ema)"
    )
    no_library = {k: v for k, v in good.items() if k != "library"}
    assert refused(CheckpointVersionError, dict(no_library, format_version=newer)).startswith(
        f"{mpath} was written by a newer functional_ema (?, format version {newer})"
    )
    for field in ("tag", "generation", "step", "num_emas", "dtype", "world_size", "zero_stage", "params", "files"):
        assert refused(CorruptCheckpointError, {k: v for k, v in good.items() if k != field}) == (
            f"{mpath} lacks fields [{field!r}]: the manifest is damaged"
        )
    lacking = {k: v for k, v in good.items() if k not in ("step", "files")}
    assert (
        refused(CorruptCheckpointError, lacking) == f"{mpath} lacks fields ['step', 'files']: the manifest is damaged"
    )
    assert refused(CheckpointVersionError, dict(good, chunk_bytes=1 << 20)) == (
        f"{mpath} uses checksum chunks of int 1048576 bytes; this version uses {_io.CHUNK_BYTES}"
    )
    without_chunks = {k: v for k, v in good.items() if k != "chunk_bytes"}  # older manifests: the one size there was
    mpath.write_text(json.dumps(without_chunks))
    assert locate_checkpoint(root)[3] == without_chunks
    # Checked by the schema before any file: a record's rank must be below the world size.
    files = [dict(good["files"][0]), dict(good["files"][1], rank=2)]
    assert refused(CorruptCheckpointError, dict(good, files=files)) == (
        f"{mpath}: field 'files[1].rank' must be a distinct int in [0, 2), got int 2. The manifest is damaged or was "
        "edited: restore it from a copy or load another tag"
    )


def test_format1_manifest_is_read(tmp_path: Path) -> None:
    """Format version 1 (the first) is still read: its CRC-32 checksums included."""
    v1 = Path(__file__).parent / "data" / "ckpt_v1"
    with CheckpointReader.open(v1, None) as ckpt:
        assert ckpt.manifest["format_version"] == 1 and ckpt.tag == "global_step3"
        assert {f.algo for f in ckpt.files} == {"crc32"}
        full = fe.consolidate(v1, index=1)
        n = next(iter(ckpt.shapes))
        assert torch.equal(_read(ckpt, n, 0, full[n].numel(), k=1), full[n].reshape(-1))


# ----------------------------------------------------------------------------------- the rank files


def _rewrite(
    tag_dir: Path,
    i: int,
    edit: Callable[[dict[str, torch.Tensor], dict[str, str]], None],
    key: str = "files",
    algo: str = _io.CHECKSUM,
) -> Path:
    """Rewrite the file of record ``i`` of the manifest's ``key`` with ``edit`` applied to its tensors (in file
    order) and metadata, and record its new size and checksums in the manifest, as a save of that file would."""
    m = _manifest(tag_dir)
    record = m[key][i]
    path = tag_dir / record["file"]
    with _io.SafetensorsFile(path) as st:
        meta = dict(st.metadata)
        tensors = {}
        for k in sorted(st.tensors, key=lambda k: st.tensors[k].start):
            e = st.tensors[k]
            tensors[k] = torch.empty(e.shape, dtype=e.dtype)
            st.read_into(k, tensors[k])
    edit(tensors, meta)
    entries = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    with _io.StreamingWriter(path, entries, meta, algo=algo) as w:
        for k, t in tensors.items():
            w.write(k, t)
        size = w.commit()
    record.update(writer._record(w, record["rank"], path, size, record.get("ep"), compact=key == "files"))
    _set_manifest(tag_dir, m)
    return path


def _where(tag_dir: Path, rank: int, world: int, gen: int = 0) -> str:
    return f"{tag_dir / _rank_file(rank, world, gen)} (rank {rank} of {world})"


def test_rank_file_metadata_must_match_the_manifest(tmp_path: Path) -> None:
    """Every field of a rank file's header that says which save it belongs to is checked against the manifest,
    on the file a reader opens (here rank 1's, at generation 3)."""
    cases = {
        "tag": ("u", "'t'"),
        "step": ("13", "12"),
        "num_emas": ("1", "2"),
        "world_size": ("3", "2"),
        "rank": ("0", "1"),
        "zero_stage": ("2", "3"),
        "generation": ("2", "3"),
        "dtype": ("bfloat16", "'float32'"),
    }
    for field, (value, want) in cases.items():
        root = tmp_path / field
        _write(root, _zero3(2), generation=3)
        _rewrite(root / "t", 1, lambda t, meta: meta.update({field: value}))
        where = _where(root / "t", 1, 2, 3)
        assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, None)) == (
            f"{where}: metadata {field}={value!r} but the manifest says {want}: the file does not belong to this "
            "checkpoint (mixed copies of two saves?)"
        ), field
        with CheckpointReader.open(root, None, own=(0, 2, 3)) as ckpt:  # rank 0's own file is fine
            assert [f.rank for f in ckpt.files] == [0] and ckpt.partial
            assert torch.equal(_read(ckpt, "w", 0, 15, k=1), _ref("w", k=1)[:15])


def test_rank_file_format_fields(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(2))
    tag_dir = root / "t"
    where = _where(tag_dir, 1, 2)
    opened = lambda: CheckpointReader.open(root, "t")  # noqa: E731
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(format="functional_ema.buffers"))
    assert _msg(CorruptCheckpointError, opened) == (
        f"{where} is not a functional_ema EMA file (format 'functional_ema.buffers')"
    )
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(format="functional_ema.ema_shards", format_version="v5"))
    assert _msg(CorruptCheckpointError, opened) == f"{where}: bad format_version 'v5'"
    _rewrite(tag_dir, 1, lambda t, meta: meta.pop("format_version"))
    assert _msg(CorruptCheckpointError, opened) == f"{where}: bad format_version None"
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(format_version=str(FORMAT_VERSION + 1)))
    assert _msg(CheckpointVersionError, opened) == (
        f"{where} was written by a newer functional_ema (format version {FORMAT_VERSION + 1}; this one reads up to "
        f"{FORMAT_VERSION}). Upgrade functional_ema (pip install -U functional-ema)"
    )
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(format_version=str(FORMAT_VERSION)))
    with opened() as ckpt:
        assert [f.rank for f in ckpt.files] == [0, 1]
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(schedules="[]"))
    assert _msg(CorruptCheckpointError, opened).startswith(f"{where}: the manifest's field 'schedules' (")
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(schedules=json.dumps(_manifest(tag_dir)["schedules"])))
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(extra='{"x": 1}'))
    assert _msg(CorruptCheckpointError, opened).startswith(f"{where}: the manifest's field 'extra' (")


def test_rank_file_tensors_must_match_its_layout(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(2))
    tag_dir = root / "t"
    where = _where(tag_dir, 1, 2)
    opened = lambda: CheckpointReader.open(root, "t")  # noqa: E731
    saved = tag_dir.parent / "saved"
    shutil.copytree(tag_dir, saved)

    def case(edit: Callable[[dict[str, torch.Tensor], dict[str, str]], None]) -> str:
        shutil.rmtree(tag_dir)
        shutil.copytree(saved, tag_dir)
        _rewrite(tag_dir, 1, edit)
        return _msg(CorruptCheckpointError, opened)

    extra = [f"emas.{k}.x{i}" for k in (2, 0) for i in range(3)]
    assert case(lambda t, meta: t.update({k: torch.zeros(2) for k in extra})) == (
        f"{where} holds tensors that no EMA of this checkpoint has: {short_list(sorted(extra), 4)}"
    )
    assert case(lambda t, meta: t.pop("emas.1.b")) == f"{where} lacks tensor 'emas.1.b' (parameter 'b', EMA 1)"
    assert case(lambda t, meta: t.update({"emas.0.b": t["emas.0.b"].double()})) == (
        f"{where}: dtype mismatch for parameter 'b' (EMA 0): the file stores torch.float64, the manifest says "
        "torch.float32. The file was rewritten by another tool; restore it or load another tag"
    )
    assert case(lambda t, meta: t.update({"emas.1.w": t["emas.1.w"][:-1].clone()})) == (
        f"{where}: parameter 'w' (EMA 1): 14 elements stored, layout says 15 of (6, 5), manifest says shape [6, 5]"
    )

    def past_end(t: dict, meta: dict) -> None:  # a piece one element past its parameter
        lay = json.loads(meta["layout"])
        lay["specs"]["b"] = [[7], 4, 4]
        meta["layout"] = json.dumps(lay)
        t["emas.0.b"] = torch.zeros(4)
        t["emas.1.b"] = torch.zeros(4)

    assert case(past_end) == (
        f"{where}: layout metadata field \"specs['b'] offset, numel\" must be a piece inside the 7 elements of (7,), "
        "got list [4, 4]; the file is damaged: restore it or load another tag"
    )

    def at_end(t: dict, meta: dict) -> None:  # the same piece, ending at the parameter's end: read
        lay = json.loads(meta["layout"])
        lay["specs"]["b"] = [[7], 4, 3]
        meta["layout"] = json.dumps(lay)

    shutil.rmtree(tag_dir)
    shutil.copytree(saved, tag_dir)
    m = _manifest(tag_dir)
    m.pop(index.FIELD)  # rank 1 no longer holds the even cut's piece of 'b'
    _set_manifest(tag_dir, m)
    _rewrite(tag_dir, 1, at_end)
    with opened() as ckpt:
        assert ckpt.pieces["b"] == [(0, 4, 0), (4, 3, 1)]
        assert torch.equal(_read(ckpt, "b", 0, 7, k=1), _ref("b", k=1))


def test_rank_file_header_and_size_are_verified(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(2))
    tag_dir = root / "t"
    path = tag_dir / _rank_file(1, 2)
    where = _where(tag_dir, 1, 2)
    raw = path.read_bytes()
    at = raw.index(b"functional_ema ", 8)  # in the header's "library" value
    _flip(path, at)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{where}: the header does not match the checksum in the manifest; the file is corrupted"
    )
    with CheckpointReader.open(root, "t", verify=False) as ckpt:  # not verified: read as it is
        assert [f.crcs for f in ckpt.files] == [{}, {}] and [f.algo for f in ckpt.files] == ["xxh3_64"] * 2
        assert torch.equal(_read(ckpt, "w", 0, 30, verify=False), _ref("w"))
        assert _msg(CorruptCheckpointError, lambda: _read(ckpt, "w", 20, 3, k=1)) == (
            f"{path}: the manifest has no checksum for tensor 'emas.1.w' [rank 1 of 2, parameter 'w', EMA 1, tag 't']"
        )
    path.write_bytes(raw[:-3])
    with pytest.raises(_io.FormatError) as direct:
        _io.SafetensorsFile(path, expected_size=len(raw))
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{where} is truncated: {len(raw) - 3} bytes, the manifest records {len(raw)}. The write or copy was cut "
        f"short: restore the file or load another tag ({direct.value})"
    )
    path.write_bytes(raw + b"\0")
    with pytest.raises(_io.FormatError) as direct:
        _io.SafetensorsFile(path, expected_size=len(raw))
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == f"{where}: {direct.value}"
    path.write_bytes(pickle.dumps(list(range(len(raw))), protocol=2)[: len(raw)])
    with pytest.raises(_io.PickleFileError) as pick:
        _io.SafetensorsFile(path, expected_size=len(raw))
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == f"{pick.value} [rank 1 of 2]"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(raw)
    path.unlink()
    path.symlink_to(outside)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{where} is a link to a file outside the tag folder {tag_dir}; functional_ema reads only its own files "
        "inside the tag folder. Replace the link by the file itself"
    )


def test_chunk_checksums_are_checked_per_file_opened(tmp_path: Path) -> None:
    """A rank file's checksum record is checked when that file is opened, and named by its field."""
    root = tmp_path / "ck"
    _write(root, _zero3(2))
    tag_dir = root / "t"
    m = _manifest(tag_dir)
    good = m["files"][1]["chunk_checksums"]
    m["files"][1]["chunk_checksums"] = good[:-1] + "g"
    _set_manifest(tag_dir, m)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{tag_dir / MANIFEST_NAME}: field 'files[1].chunk_checksums' must be 16-digit xxh3_64 checksums in one hex "
        f"string, got {brief(good[:-1] + 'g')}. The manifest is damaged or was edited: restore it from a copy or load "
        "another tag"
    )
    with CheckpointReader.open(root, "t", own=(0, 2, 3)) as ckpt:  # rank 0 never opens rank 1's file
        assert [f.rank for f in ckpt.files] == [0]
    with CheckpointReader.open(root, "t", verify=False) as ckpt:  # unverified: the record is not read
        assert torch.equal(_read(ckpt, "b", 0, 7, verify=False), _ref("b"))
    m["files"][1]["chunk_checksums"] = good[16:]
    _set_manifest(tag_dir, m)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{tag_dir / MANIFEST_NAME}: field 'files[1].chunk_checksums' holds 3 checksums, but {_where(tag_dir, 1, 2)} "
        f"has 4 chunks of {_io.CHUNK_BYTES} bytes: the manifest is damaged or belongs to another save"
    )


def _moe(world: int = 2, ep_size: int = 2) -> list[ShardLayout]:
    """Expert parallelism over ``world`` ranks: expert ``e<i>`` whole on the rank of expert-parallel rank ``i``
    (``rank % ep_size``), every rank listing every expert; ``b`` cut evenly as by ZeRO-3."""
    shapes = {"b": (7,), **{f"e{i}": (2, 3) for i in range(ep_size)}}
    owners = {f"e{i}": i for i in range(ep_size)}
    out = []
    for r in range(world):
        specs = {"b": _even(r, world, {"b": (7,)})["b"]}
        for n, o in owners.items():
            specs[n] = ShardSpec(shapes[n], 0, 6 if o == r % ep_size else 0)
        out.append(ShardLayout(r, world, 3, specs, experts=ExpertLayout(r % ep_size, ep_size, owners)))
    return out


def test_expert_parallel_records(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    layouts = _moe()
    _write(root, layouts)
    tag_dir = root / "t"
    with open_checkpoint(root, "t", True, layouts[1]) as ckpt:
        assert [f.rank for f in ckpt.files] == [1] and ckpt.experts == {"ep_size": 2, "owners": {"e0": 0, "e1": 1}}
        ckpt.check_experts(layouts[1])
        assert torch.equal(_read(ckpt, "e1", 0, 6, k=1), _ref("e1", (2, 3), 1))
        plain = ShardLayout(0, 1, 3, {n: ShardSpec(s.shape, 0, s.full_numel) for n, s in layouts[0].specs.items()})
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_experts(plain)) == (
            f"tag 't' in {root} was saved with expert-parallel size (ep_size) 2, and this run has expert-parallel "
            "size 1 (no expert parallelism): load it with the saved ep_size (any data-parallel size), or rebuild the "
            "weights with functional_ema.consolidate and start a new EMA"
        )
        one = plain._replace(experts=ExpertLayout(0, 1, {"e0": 0, "e1": 0}))
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_experts(one)).startswith(
            f"tag 't' in {root} was saved with expert-parallel size (ep_size) 2, and this run has expert-parallel "
            "size 1: load it"
        )
    with open_checkpoint(root, "t", True, layouts[0]._replace(world_size=1)) as ckpt:  # every file: no index
        assert [f.rank for f in ckpt.files] == [0, 1]
        assert torch.equal(_read(ckpt, "e0", 0, 6), _ref("e0", (2, 3)))
        assert torch.equal(_read(ckpt, "b", 0, 7, k=1), _ref("b", k=1))
    m = _manifest(tag_dir)
    m["files"][1]["ep"] = 0
    _set_manifest(tag_dir, m)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{_where(tag_dir, 1, 2)}: the manifest's field 'files[1].ep' says expert-parallel rank 0, but the file's header "
        "holds the experts of expert-parallel rank int 1: the manifest was edited or mixes two saves; restore it or "
        "load another tag"
    )
    flat = tmp_path / "flat"
    _write(flat, _zero3(1))
    with CheckpointReader.open(flat, "t") as ckpt:
        assert ckpt.experts is None
        ckpt.check_experts(_zero3(2)[1])
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_experts(layouts[0])) == (
            f"tag 't' in {flat} was saved with expert-parallel size (ep_size) 1 (no expert parallelism), and this run "
            "has expert-parallel size 2: load it with the saved ep_size (any data-parallel size), or rebuild the "
            "weights with functional_ema.consolidate and start a new EMA"
        )
    single = tmp_path / "single"
    _write(single, _moe(1, 1))
    with CheckpointReader.open(single, "t") as ckpt:
        assert "(ep_size) 1, and this run has expert-parallel size 1 (no expert parallelism):" in _msg(
            CheckpointMismatchError, lambda: ckpt.check_experts(_zero3(1)[0])
        )


def _swapped(world: int = 2) -> list[ShardLayout]:
    """Rank 0 holds the second half of ``b`` (10 elements), rank 1 the first: not an even cut, so the piece
    index lists both pieces."""
    shape = (10,)
    return [ShardLayout(r, world, 1, {"b": ShardSpec(shape, 5 * (1 - r), 5)}) for r in range(world)]


def test_piece_index_must_agree_with_each_file_opened(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    m = _write(root, _swapped())
    assert m[index.FIELD] == {"b": [0, 5, 5, 1, 0, 5]}
    whole = ShardLayout(0, 1, 1, {"b": ShardSpec((10,), 0, 10)})
    with open_checkpoint(root, "t", True, whole) as ckpt:
        assert ckpt.pieces["b"] == [(0, 5, 1), (5, 5, 0)]
        assert torch.equal(_read(ckpt, "b", 0, 10, k=1), _ref("b", (10,), 1))
        assert torch.equal(_read(ckpt, "b", 3, 4), _ref("b", (10,))[3:7])
    m[index.FIELD] = {"b": [0, 0, 5, 1, 5, 5]}  # two equal-length pieces at swapped offsets: a valid index
    _set_manifest(root / "t", m)
    before = hashes(root)
    assert _msg(CorruptCheckpointError, lambda: open_checkpoint(root, "t", True, whole)) == (
        f"{_where(root / 't', 0, 2)}: its layout holds elements [5, 10) of 'b', the manifest's piece_index says "
        "[0, 5): the manifest was edited or belongs to another save; restore it from a copy or load another tag"
    )
    assert hashes(root) == before  # a refused read changes nothing on disk
    m.pop(index.FIELD)  # without an index: the files' own layouts are read
    _set_manifest(root / "t", m)
    with open_checkpoint(root, "t", True, whole) as ckpt:
        assert torch.equal(_read(ckpt, "b", 0, 10, k=1), _ref("b", (10,), 1))


def _cut(pieces: dict[str, list[tuple[int, int]]], shapes: dict) -> list[ShardLayout]:
    """One rank per piece: rank ``r`` holds ``pieces[name][r]`` (offset, numel) of each parameter."""
    world = len(next(iter(pieces.values())))
    return [ShardLayout(r, world, 1, {n: ShardSpec(shapes[n], *pieces[n][r]) for n in shapes}) for r in range(world)]


def test_coverage_of_every_element(tmp_path: Path) -> None:
    shapes = {"b": (7,), "w": (6, 5)}
    ok = {  # overlapping, nested and adjacent pieces cover 'w'
        "overlap": {"b": [(0, 7), (0, 0)], "w": [(0, 20), (10, 20)]},
        "nested": {"b": [(0, 7), (2, 3)], "w": [(0, 30), (5, 5)]},
        "nested later": {"b": [(0, 4), (4, 3), (0, 0)], "w": [(0, 12), (12, 18), (2, 4)]},
    }
    for name, pieces in ok.items():
        root = tmp_path / name
        _write(root, _cut(pieces, shapes))
        with CheckpointReader.open(root, "t") as ckpt:
            assert not ckpt.partial
            assert torch.equal(_read(ckpt, "w", 0, 30, k=1), _ref("w", k=1)), name
            assert torch.equal(_read(ckpt, "b", 0, 7), _ref("b")), name
    gaps = {
        "gap inside": ({"b": [(0, 7), (0, 0)], "w": [(0, 10), (12, 18)]}, 10),
        "gap at the end": ({"b": [(0, 7), (0, 0)], "w": [(0, 10), (10, 19)]}, 29),
        "gap at the start": ({"b": [(0, 7), (0, 0)], "w": [(0, 0), (1, 29)]}, 0),
    }
    for name, (pieces, cursor) in gaps.items():
        root = tmp_path / name
        _write(root, _cut(pieces, shapes))
        assert _msg(IncompleteCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
            f"{root / 't' / MANIFEST_NAME}: field 'params' gives parameter 'w' the shape (6, 5), but the saved pieces "
            f"cover only elements [0, {cursor}) of 30; the manifest lists 2 rank file(s) of a world size of 2"
        ), name
        with CheckpointReader.open(root, "t", own=(1, 2, 1)) as ckpt:  # a partial reader: coverage is the caller's
            assert ckpt.partial and [f.rank for f in ckpt.files] == [1]


# ------------------------------------------------------------------------ which files a reader opens


def test_own_file_and_holds(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    layouts = _zero3(2)
    _write(root, layouts)
    with CheckpointReader.open(root, "t", own=(1, 2, 3)) as ckpt:
        assert [f.rank for f in ckpt.files] == [1] and ckpt.partial
        assert ckpt.holds(layouts[1].specs) and not ckpt.holds(layouts[0].specs)
        specs = layouts[1].specs
        assert not ckpt.holds({"w": specs["w"]})  # another set of names
        assert not ckpt.holds(dict(specs, b=specs["b"]._replace(offset=specs["b"].offset - 1)))
        assert not ckpt.holds(dict(specs, b=specs["b"]._replace(numel=specs["b"].numel - 1)))
        assert not ckpt.holds(dict(specs, w=specs["w"]._replace(numel=specs["w"].numel + 1)))
        assert ckpt.holds(dict(specs, w=specs["w"]._replace(shape=(30,))))  # pieces, not shapes
    for own in ((1, 3, 3), (1, 2, 2), None):  # another world size or stage: every file
        with CheckpointReader.open(root, "t", own=own) as ckpt:
            assert [f.rank for f in ckpt.files] == [0, 1] and not ckpt.partial
            assert not ckpt.holds(layouts[0].specs)
    rep = tmp_path / "replicated"  # stage 0: rank 0 alone writes the whole parameters
    _write(rep, [ShardLayout(r, 2, 0, _even(0, 1)) for r in range(2)])
    with CheckpointReader.open(rep, "t", own=(1, 2, 0)) as ckpt:
        assert [f.rank for f in ckpt.files] == [0] and not ckpt.partial
    assert _msg(TypeError, lambda: CheckpointReader.open(rep, "t", verify=1)).startswith("verify must be")  # type: ignore[arg-type]
    assert _msg(TypeError, lambda: CheckpointReader.open_parts(rep, "t", verify="no")).startswith("verify must be")  # type: ignore[arg-type]


def test_open_checkpoint_for_a_layout(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(4))
    tag_dir = root / "t"
    for lay, ranks in (
        (_zero3(4)[2], [2]),  # its own file
        (_zero3(2)[1], [1, 2, 3]),  # another world size: the files the piece index names
        (_zero3(40)[39], [0]),  # nothing to read: one file, whose header is still checked
        (ShardLayout(1, 4, 2, _even(1, 4)), [1]),  # another stage, the same pieces
        (ShardLayout(1, 4, 3, _even(2, 4)), [2]),  # the same world and stage, cut otherwise
    ):
        with open_checkpoint(root, "t", True, lay) as ckpt:
            assert [f.rank for f in ckpt.files] == ranks, lay
            for n, s in lay.specs.items():
                assert torch.equal(_read(ckpt, n, s.offset, s.numel, k=1), _ref(n, k=1)[s.offset : s.offset + s.numel])
    extra = _zero3(3, dict(SHAPES, zz=(2,)))[0]  # a parameter the checkpoint lacks: every file, then the check
    with open_checkpoint(root, "t", True, extra) as ckpt:
        assert [f.rank for f in ckpt.files] == [0, 1, 2, 3]
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(extra.specs)).startswith(
            f"the EMA checkpoint (tag 't' in {root}, 2 parameters) does not match this model (3 trained parameters):\n"
            "  in the model but not in the checkpoint: ['zz']\n"
        )
    # verify=False reaches every path: a flipped byte of rank 2's piece of 'w' is read as it is
    _flip(tag_dir / _rank_file(2, 4), _data_at(tag_dir / _rank_file(2, 4), "emas.0.w", 2))
    for lay in (_zero3(4)[2], _zero3(2)[1], ShardLayout(1, 4, 3, _even(2, 4))):
        s = lay.specs["w"]
        with open_checkpoint(root, "t", False, lay) as ckpt:
            got = _read(ckpt, "w", s.offset, s.numel, verify=False)
            assert not torch.equal(got, _ref("w")[s.offset : s.offset + s.numel])
        with open_checkpoint(root, "t", True, lay) as ckpt:
            assert "checksum mismatch in tensor 'emas.0.w'" in _msg(
                CorruptCheckpointError, lambda: _read(ckpt, "w", s.offset, s.numel)
            )
    assert open_checkpoint(root, "t", True, _zero3(4)[2]).partial


def test_check_model_and_index(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(1))
    head = f"the EMA checkpoint (tag 't' in {root}, 2 parameters) does not match this model"
    hint = (
        "Load into the model the EMA was saved from (frozen and not-optimized parameters have no EMA), or rebuild the "
        "weights with functional_ema.consolidate, adapt them, and start a new EMA with init_ema"
    )
    with CheckpointReader.open(root, "t") as ckpt:
        assert ckpt.check_model(_zero3(2)[1].specs) is None
        model = {"w": ShardSpec((5, 6), 0, 30), "c": ShardSpec((7,), 0, 7)}
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(model)) == (
            f"{head} (2 trained parameters):\n  in the model but not in the checkpoint: ['c']\n  in the checkpoint but "
            "not in the model: ['b']\n  renamed? 'b' -> 'c'\n  shape of 'w': checkpoint (6, 5), model (5, 6)\n" + hint
        )
        model = {"w": ShardSpec((6, 5), 0, 30), "c": ShardSpec((7,), 0, 7), "d": ShardSpec((7,), 0, 7)}
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(model)) == (
            f"{head} (3 trained parameters):\n  in the model but not in the checkpoint: ['c', 'd']\n  in the checkpoint "
            "but not in the model: ['b']\n" + hint
        )
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model({"w": ShardSpec((6, 5), 0, 30)})) == (
            f"{head} (1 trained parameters):\n  in the checkpoint but not in the model: ['b']\n" + hint
        )
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model({"b": ShardSpec((7,), 0, 7)})) == (
            f"{head} (1 trained parameters):\n  in the checkpoint but not in the model: ['w']\n" + hint
        )
        ckpt.check_index(1)
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_index(2)) == (
            "index=2, but tag 't' holds 2 EMA(s) (valid: 0..1)"
        )
        assert _msg(TypeError, lambda: ckpt.check_index("1")).startswith("index must be")  # type: ignore[arg-type]
    many = {f"p{i}": (i + 1,) for i in range(10)}
    _write(tmp_path / "many", _zero3(1, many))
    with CheckpointReader.open(tmp_path / "many", "t") as ckpt:
        shapes = {n: ShardSpec((s[0] + 1,), 0, s[0] + 1) for n, s in many.items()}
        lines = _msg(CheckpointMismatchError, lambda: ckpt.check_model(shapes)).split("\n")
        assert lines[1:] == [f"  shape of 'p{i}': checkpoint ({i + 1},), model ({i + 2},)" for i in range(8)] + [hint]
        renamed = {f"q{i}": ShardSpec(s, 0, s[0]) for i, s in enumerate(many.values())}
        lines = _msg(CheckpointMismatchError, lambda: ckpt.check_model(renamed)).split("\n")
        assert lines[3] == "  renamed? " + ", ".join(f"'p{i}' -> 'q{i}'" for i in range(8))


# ------------------------------------------------------------------- reads at another world size, verified

PC = _io.CHUNK_BYTES // 4  # fp32 elements per checksum chunk
H = 5 * PC // 2 + 1  # where rank 1's piece starts: two and a half chunks and an element on each of 2 ranks
BIG = {"big": (2 * H,)}


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big")
    _write(root, _zero3(2, BIG), num_emas=1)
    return root


class _Spy:
    """Records every read of a rank file: ``(file's rank, "into", start, numel)`` or ``(rank, "range", lo, hi)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple] = []
        into, ranged = _io.SafetensorsFile.read_into, _io.SafetensorsFile.read_range
        rank = lambda st: int(Path(st.path).name.split("_")[2])  # noqa: E731

        def read_into(st: _io.SafetensorsFile, key: str, dst: torch.Tensor, *a: object, **kw: object) -> None:
            self.calls.append((rank(st), "into", kw.get("start", 0), dst.numel()))
            return into(st, key, dst, *a, **kw)  # type: ignore[arg-type]

        def read_range(st: _io.SafetensorsFile, key: str, lo: int, hi: int, *a: object, **kw: object) -> torch.Tensor:
            self.calls.append((rank(st), "range", lo, hi))
            return ranged(st, key, lo, hi, *a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(_io.SafetensorsFile, "read_into", read_into)
        monkeypatch.setattr(_io.SafetensorsFile, "read_range", read_range)

    def take(self) -> list[tuple]:
        out, self.calls = self.calls, []
        return out


# (start, stop) of a read at another world size -> the reads of the saved pieces, verified and not
READS = {
    (0, 2 * H): ([(0, "into", 0, H), (1, "into", 0, H)], None),
    (PC, H): ([(0, "into", PC, H - PC)], None),  # whole chunks to the piece's end: read in place
    (H + PC, H + 2 * PC): ([(1, "into", PC, PC)], None),  # whole chunks inside rank 1's piece
    (H, H + PC): ([(1, "into", 0, PC)], None),  # from where rank 0's piece ends: rank 1's alone
    (PC + 3, H + PC): (
        [(0, "range", PC + 3, H), (1, "into", 0, PC)],
        [(0, "into", PC + 3, H - PC - 3), (1, "into", 0, PC)],
    ),
    (H - 10, H + 10): ([(0, "range", H - 10, H), (1, "range", 0, 10)], [(0, "into", H - 10, 10), (1, "into", 0, 10)]),
    (7, 7): ([], None),
}


def test_reads_across_pieces_read_and_verify_what_they_use(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    want = _ref("big", BIG["big"])
    with CheckpointReader.open(big, "t") as ckpt:
        assert ckpt.pieces["big"] == [(0, H, 0), (H, H, 1)]
        for (start, stop), (verified, unverified) in READS.items():
            for verify, calls in ((True, verified), (False, unverified or verified)):
                got = _read(ckpt, "big", start, stop - start, verify=verify)
                assert torch.equal(got, want[start:stop]), (start, stop, verify)
                assert spy.take() == calls, (start, stop, verify)


def _checksum_error(path: Path, chunk: int, nbytes: int, rank: int, name: str = "big", k: int = 0) -> str:
    lo = chunk * _io.CHUNK_BYTES
    return (
        rf"{path}: checksum mismatch in tensor 'emas\.{k}\.{name}', bytes {lo}\.\.{lo + nbytes} of the tensor: xxh3_64 "
        r"[0-9a-f]{16}, recorded [0-9a-f]{16}\. The file is corrupted: restore it from a copy or load an earlier tag "
        rf"\[rank {rank} of 2, parameter '{name}', EMA {k}, tag 't'\]"
    )


def test_a_flipped_byte_inside_the_part_read_is_refused(big: Path) -> None:
    """One flipped bit inside exactly the part a resharded read uses fails it, naming the chunk; one in a chunk
    the read does not touch is not read (and not reported); without verification the read returns it as is."""
    import re

    half = _io.CHUNK_BYTES // 2 + 4  # the pieces' last chunk: half a chunk and an element
    cases = [  # (rank, element flipped, start, stop, chunk reported or None, its bytes)
        (0, PC + 5, PC, H, 1, _io.CHUNK_BYTES),
        (0, H - 1, PC, H, 2, half),  # the piece's last element: its short last chunk
        (0, 5, PC, H, None, 0),  # chunk 0 is not read
        (1, PC, H + PC, H + 2 * PC, 1, _io.CHUNK_BYTES),
        (1, 2 * PC - 1, H + PC, H + 2 * PC, 1, _io.CHUNK_BYTES),
        (1, 2 * PC, H + PC, H + 2 * PC, None, 0),
        (0, PC + 3, PC + 3, H + PC, 1, _io.CHUNK_BYTES),  # the first element of a read through a wider range
        (0, PC + 1, PC + 3, H + PC, 1, _io.CHUNK_BYTES),  # outside it, but in the chunk verified with it
        (1, PC - 1, PC + 3, H + PC, 0, _io.CHUNK_BYTES),  # rank 1's part: its first chunk, read in place
        (0, H - 10, H - 10, H + 10, 2, half),
        (1, 9, H - 10, H + 10, 0, _io.CHUNK_BYTES),
        (1, 10, H - 10, H + 10, 0, _io.CHUNK_BYTES),  # widened to the chunk: verified, not returned
    ]
    want = _ref("big", BIG["big"])
    with CheckpointReader.open(big, "t") as ckpt:
        for i, (rank, element, start, stop, chunk, nbytes) in enumerate(cases):
            path = big / "t" / _rank_file(rank, 2)
            at = _data_at(path, "emas.0.big", element)
            _flip(path, at)
            try:
                if chunk is None:
                    assert torch.equal(_read(ckpt, "big", start, stop - start), want[start:stop]), i
                else:
                    msg = _msg(CorruptCheckpointError, lambda: _read(ckpt, "big", start, stop - start))
                    assert re.fullmatch(_checksum_error(path, chunk, nbytes, rank), msg), (i, msg)
                got = _read(ckpt, "big", start, stop - start, verify=False)
                inside = start <= rank * H + element < stop
                assert torch.equal(got, want[start:stop]) != inside, i
            finally:
                _flip(path, at)  # the shared checkpoint as it was


def test_fill_refusals(big: Path, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(2))
    with CheckpointReader.open(root, "t", own=(0, 2, 3)) as ckpt:  # rank 0's piece only: elements [0, 15) of 'w'
        assert torch.equal(_read(ckpt, "w", 3, 12, k=1), _ref("w", k=1)[3:15])
        for start, stop, missing in ((10, 20, (15, 20)), (20, 25, (20, 25)), (15, 16, (15, 16))):
            assert _msg(IncompleteCheckpointError, lambda: _read(ckpt, "w", start, stop - start)) == (
                f"tag 't': elements [{missing[0]}, {missing[1]}) of 'w' are in no saved piece"
            )
    with CheckpointReader.open(root, "t", own=(1, 2, 3)) as ckpt:  # elements [15, 30)
        assert _msg(IncompleteCheckpointError, lambda: _read(ckpt, "w", 0, 5)) == (
            "tag 't': elements [0, 5) of 'w' are in no saved piece"
        )
    path = root / "t" / _rank_file(1, 2)
    with CheckpointReader.open(root, "t") as ckpt:
        for start, numel, part, verify in ((15, 15, "", True), (20, 3, " elements [5, 8)", False)):
            wrong = torch.empty(numel, dtype=torch.float64)
            assert _msg(CorruptCheckpointError, lambda: ckpt.fill(wrong, 1, "w", start, numel, verify)) == (
                f"{path}: tensor 'emas.1.w' is torch.float32[15]; cannot read it{part} into torch.float64[{numel}] "
                "[rank 1 of 2, parameter 'w', EMA 1, tag 't']"
            )


def test_whole_chunks() -> None:
    pc = PC
    for lo, hi, numel, itemsize, want in (
        (0, pc, 10 * pc, 4, True),
        (pc, 3 * pc, 10 * pc, 4, True),
        (1, pc, 10 * pc, 4, False),
        (pc, pc + 1, 10 * pc, 4, False),
        (pc, 10 * pc - 1, 10 * pc - 1, 4, True),  # to the tensor's end
        (pc, 10 * pc - 2, 10 * pc - 1, 4, False),
        (0, 7, 7, 4, True),
        (0, 2 * pc, 10 * pc, 2, True),  # 2-byte elements: twice as many per chunk
        (0, pc, 10 * pc, 2, False),
        (pc, 4 * pc, 10 * pc, 2, False),
        (2 * pc, 4 * pc, 10 * pc, 2, True),
        (pc // 2, pc, 10 * pc, 8, True),
        (0, pc // 2, pc, 8, True),
    ):
        assert reader._whole_chunks(lo, hi, numel, itemsize) is want, (lo, hi, numel, itemsize)


# ------------------------------------------------------------------------- many reads on several threads


class _Pieces:
    """What ``_split_jobs`` reads of a reader: where the saved pieces of each parameter are."""

    def __init__(self, pieces: dict[str, list[tuple[int, int, int]]]) -> None:
        self.pieces = pieces


def _cuts(jobs: list) -> list[tuple[int, int]]:
    return [(j[3], j[4]) for j in jobs]


def test_split_jobs_cuts_large_reads_in_whole_chunks() -> None:
    n = 24 * PC
    dst = torch.zeros(1).expand(n)  # no memory: the cut only slices it
    one = _Pieces({"x": [(0, n, 0)]})
    job = (dst, 1, "x", 0, n)
    assert _cuts(reader._split_jobs(one, [job], 2)) == [(i * 3 * PC, 3 * PC) for i in range(8)]
    assert _cuts(reader._split_jobs(one, [job], 1)) == [(i * 6 * PC, 6 * PC) for i in range(4)]
    assert _cuts(reader._split_jobs(one, [job], 3)) == [(i * 2 * PC, 2 * PC) for i in range(12)]
    assert _cuts(reader._split_jobs(one, [job], 4)) == [(i * PC, PC) for i in range(24)]  # 1.5 chunks: floored
    assert _cuts(reader._split_jobs(one, [job], 100)) == [(i * PC, PC) for i in range(24)]  # at least one chunk
    parts = reader._split_jobs(one, [job], 2)
    assert all(p[1:3] == (1, "x") and p[0].numel() == p[4] for p in parts)
    real = torch.empty(4 * PC)  # each part a view of its place in the job's tensor
    parts = reader._split_jobs(_Pieces({"x": [(0, 4 * PC, 0)]}), [(real, 0, "x", 0, 4 * PC)], 100)
    assert [p[0].data_ptr() - real.data_ptr() for p in parts] == [i * _io.CHUNK_BYTES for i in range(4)]
    m = n + 5  # floored to whole chunks; the rest in a last short part
    odd = _Pieces({"x": [(0, m, 0)]})
    assert _cuts(reader._split_jobs(odd, [(torch.zeros(1).expand(m), 0, "x", 0, m)], 2)) == [
        (i * 3 * PC, 3 * PC) for i in range(8)
    ] + [(24 * PC, 5)]
    assert _cuts(reader._split_jobs(odd, [(torch.zeros(1).expand(m), 0, "x", 0, m)], 4)) == [
        (i * PC, PC) for i in range(24)
    ] + [(24 * PC, 5)]
    # Every job's size counts toward the share: two jobs of 12 chunks are cut as one of 24 would be.
    two = _Pieces({"x": [(0, 12 * PC, 0), (12 * PC, 12 * PC, 1)]})
    jobs = [
        (torch.zeros(1).expand(12 * PC), 0, "x", 0, 12 * PC),
        (torch.zeros(1).expand(12 * PC), 0, "x", 12 * PC, 12 * PC),
    ]
    assert _cuts(reader._split_jobs(two, jobs, 2)) == [(i * 3 * PC, 3 * PC) for i in range(8)]


def test_split_jobs_leaves_resharded_and_small_reads_whole() -> None:
    n = 4 * PC
    dst = torch.zeros(1).expand(n)
    for pieces, job in (
        ({"x": [(0, n, 0)]}, (dst, 0, "x", 0, PC)),  # one chunk: nothing to cut
        ({"x": [(0, n - 1, 0), (n - 1, 1, 1)]}, (dst, 0, "x", 0, n)),  # over two pieces
        ({"x": [(0, 2 * n, 0)]}, (dst, 0, "x", 1, n)),  # starts inside a piece: a resharded range
        ({"x": [(1, n, 0)]}, (dst, 0, "x", 0, n)),
    ):
        out = reader._split_jobs(_Pieces(pieces), [job], 2)
        assert len(out) == 1 and out[0] is job, pieces
    fits = reader._split_jobs(_Pieces({"x": [(PC, n, 0)]}), [(dst, 0, "x", PC, n)], 2)  # ends where the piece ends
    assert _cuts(fits) == [(PC * (i + 1), PC) for i in range(4)]
    for bf16 in (torch.zeros(1, dtype=torch.bfloat16).expand(n),):  # 2-byte elements: twice as many per chunk
        assert _cuts(reader._split_jobs(_Pieces({"x": [(0, n, 0)]}), [(bf16, 0, "x", 0, n)], 2)) == [
            (0, 2 * PC),
            (2 * PC, 2 * PC),
        ]
    jobs = [(dst, 0, "x", 0, n)]
    assert reader._split_jobs(object(), jobs, 2) is jobs  # a joined reader's whole parameters: as they are


class _Pool:
    """Runs each submitted share at once, recording it (the job indices one thread would read, in order)."""

    def __init__(self) -> None:
        self.shares: list[list[int]] = []

    def submit(self, fn: Callable[[list[int]], None], share: list[int]) -> object:
        import concurrent.futures

        self.shares.append(list(share))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(fn(share))
        except BaseException as e:  # noqa: BLE001 - handed back through the future, as a pool would
            fut.set_exception(e)
        return fut


class _Jobs:
    """A reader whose fill records the jobs run (and fails those named in ``fail``)."""

    def __init__(self, fail: dict[int, Exception] | None = None) -> None:
        self.ran: list[int] = []
        self.fail = fail or {}
        self.grad: list[bool] = []

    def fill(self, dst: torch.Tensor, k: int, name: str, start: int, numel: int, verify: bool) -> None:
        self.ran.append(k)
        self.grad.append(torch.is_grad_enabled())
        assert verify is True
        if k in self.fail:
            raise self.fail[k]
        dst.fill_(k)


def test_fill_all_balances_threads_and_reports_the_first_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _Pool()
    monkeypatch.setattr(_io, "_pool", lambda: pool)

    def jobs(sizes: list[int]) -> list:
        return [(torch.zeros(n), k, "x", 0, n) for k, n in enumerate(sizes)]

    ckpt = _Jobs()
    todo = jobs([5, 100, 10, 30, 7])
    fill_all(ckpt, todo, True, threads=2)  # largest first, each to the least loaded thread
    assert pool.shares == [[1], [3, 2, 4, 0]] and ckpt.ran == [1, 0, 2, 3, 4]  # each share in job order
    assert all(torch.equal(t, torch.full((n,), float(k))) for t, k, _, _, n in todo)
    assert ckpt.grad == [False] * 5
    pool.shares.clear()
    fill_all(ckpt, jobs([40, 30, 20, 10]), True, threads=3)
    assert pool.shares == [[0], [1], [2, 3]]
    pool.shares.clear()
    fill_all(ckpt, jobs([5, 6]), True, threads=8)  # no more threads than jobs
    assert pool.shares == [[1], [0]]
    monkeypatch.setenv(_io.IO_THREADS_ENV, "3")  # threads=None: this rank's share of the node
    pool.shares.clear()
    fill_all(ckpt, jobs([1, 2, 3, 4]), True)
    assert pool.shares == [[3], [2], [1, 0]]
    pool.shares.clear()
    fill_all(ckpt, jobs([10, 9, 8, 3]), True, threads=2)  # the loads add up: 10 against 9 + 8
    assert pool.shares == [[0, 3], [1, 2]]
    for threads, sizes in ((1, [5, 6, 7]), (4, [5])):  # one thread or one job: a plain loop
        pool.shares.clear()
        ckpt = _Jobs()
        fill_all(ckpt, jobs(sizes), True, threads=threads)
        assert pool.shares == [] and ckpt.ran == list(range(len(sizes)))
    # Every job runs; the error raised is the first failure in job order.
    ckpt = _Jobs({1: ValueError("job 1"), 3: KeyError("job 3")})
    todo = jobs([50, 10, 40, 30, 5])
    with pytest.raises(ValueError, match=r"^job 1$"):
        fill_all(ckpt, todo, True, threads=2)
    assert sorted(ckpt.ran) == [0, 1, 2, 3, 4] and torch.equal(todo[4][0], torch.full((5,), 4.0))
    ckpt = _Jobs({3: KeyError("job 3"), 4: ValueError("job 4")})
    with pytest.raises(KeyError, match="job 3"):
        fill_all(ckpt, jobs([50, 10, 40, 30, 5]), True, threads=2)
    ckpt = _Jobs({0: ValueError("job 0")})
    with pytest.raises(ValueError, match=r"^job 0$"):
        fill_all(ckpt, jobs([5, 6, 7]), True, threads=1)
    assert ckpt.ran == [0]  # a plain loop stops at the failure


def test_fill_all_reads_a_checkpoint_on_threads(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real reads by 2 threads: the large jobs cut into whole chunks, each verified in place."""
    spy = _Spy(monkeypatch)
    want = _ref("big", BIG["big"])
    with CheckpointReader.open(big, "t") as ckpt:
        out = torch.full((2 * H,), float("nan"), requires_grad=True)
        with torch.no_grad():
            halves = [out[:H], out[H:]]
        fill_all(ckpt, [(halves[0], 0, "big", 0, H), (halves[1], 0, "big", H, H)], True, threads=2)
        assert torch.equal(out.detach(), want)
        assert sorted(spy.take()) == [
            (r, "into", s, n) for r in (0, 1) for s, n in ((0, PC), (PC, PC), (2 * PC, H - 2 * PC))
        ]


# ------------------------------------------------------------------------------------------- buffers


def _bufs(lay: ShardLayout) -> BufferState:
    """Rank ``r``'s buffers (each rank's differ: engines do not synchronise them)."""
    r = lay.rank + 10 * lay.part.pp
    emas = tuple({"bn.mean": torch.arange(4.0) + 10 * r + k, "bn.var": torch.full((3,), r + 1.0 + k)} for k in range(2))
    copied = {"bn.count": torch.tensor(r + 5), "mask": torch.tensor([True, r == 1])}
    return BufferState(torch.tensor(STEP), emas, copied)


def _same_buffers(got: tuple, want: BufferState) -> bool:
    num, emas, copied = got
    return (
        num == want.num_emas
        and len(emas) == len(want.emas)
        and all(e.keys() == w.keys() and all(torch.equal(e[n], w[n]) for n in w) for e, w in zip(emas, want.emas))
        and copied.keys() == want.copied.keys()
        and all(torch.equal(copied[n], t) and copied[n].dtype == t.dtype for n, t in want.copied.items())
    )


def test_read_buffers_of_each_rank(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    layouts = _zero3(2)
    _write(root, layouts, buffers=_bufs)
    with CheckpointReader.open(root, "t") as ckpt:
        assert ckpt.has_buffers
        assert _same_buffers(ckpt.read_buffers(1, 2), _bufs(layouts[1]))  # its own, at the saved world size
        assert _same_buffers(ckpt.read_buffers(0, 2), _bufs(layouts[0]))
        assert _same_buffers(ckpt.read_buffers(1, 3), _bufs(layouts[0]))  # rank 0's at another world size
        assert _same_buffers(ckpt.read_buffers(0, 1, verify=False), _bufs(layouts[0]))
    m = _manifest(root / "t")
    mpath = root / "t" / MANIFEST_NAME
    for drop, rank, world, named in ((1, 1, 2, 1), (0, 1, 3, 0), (0, 0, 2, 0)):
        edited = json.loads(json.dumps(m))
        del edited["buffer_files"][drop]
        _set_manifest(root / "t", edited)
        with CheckpointReader.open(root, "t") as ckpt:
            assert _msg(IncompleteCheckpointError, lambda: ckpt.read_buffers(rank, world)) == (
                f"{mpath}: field 'buffer_files' lists no buffer file of rank {named} (saved at world size 2); the "
                "manifest is damaged"
            )
            assert _same_buffers(ckpt.read_buffers(1 - drop, 2), _bufs(layouts[1 - drop]))
    plain = tmp_path / "plain"
    _write(plain, _zero3(1))
    with CheckpointReader.open(plain, "t") as ckpt:
        assert not ckpt.has_buffers
        assert _msg(CheckpointMismatchError, lambda: ckpt.read_buffers(0, 1)) == (
            f"tag 't' in {plain} was saved without buffers (save(..., buffers=None)): load without them, or start the "
            "buffer EMAs from the live buffers (functional_ema.buffers.init_buffers)"
        )


def test_buffer_file_checks(tmp_path: Path) -> None:
    import re

    root = tmp_path / "ck"
    layouts = _zero3(2)
    _write(root, layouts, buffers=_bufs)
    tag_dir = root / "t"
    saved = tmp_path / "saved"
    shutil.copytree(tag_dir, saved)
    path = tag_dir / "buffers_rank_00001_of_00002.safetensors"
    where = f"{path} (buffers of rank 1 of 2)"

    def fresh() -> None:
        shutil.rmtree(tag_dir)
        shutil.copytree(saved, tag_dir)

    def refused(exc: type[BaseException], verify: bool = True) -> str:
        with CheckpointReader.open(root, "t", verify=False) as ckpt:
            return _msg(exc, lambda: ckpt.read_buffers(1, 2, verify))

    fields = {
        "format": ("functional_ema.ema_shards", "'functional_ema.buffers'"),
        "tag": ("u", "'t'"),
        "step": ("11", "'12'"),
        "generation": ("1", "'0'"),
        "rank": ("0", "'1'"),
        "world_size": ("3", "'2'"),
        "num_emas": ("1", "'2'"),
        "dtype": ("float16", "'float32'"),
    }
    for field, (value, want) in fields.items():
        for got in (value, None):
            fresh()
            _rewrite(tag_dir, 1, lambda t, meta: meta.update({field: got}) if got else meta.pop(field), "buffer_files")
            assert refused(CorruptCheckpointError) == (
                f"{where}: metadata {field}={brief(got)} but the manifest says {want}: the file does not belong to this "
                "checkpoint (a copy from another save, rank or world size?)"
            ), (field, got)
    fresh()
    extra = [f"copied.z{i}" for i in range(5)]

    gone = ["copied.bn.count", "copied.mask", "emas.0.bn.mean", "emas.0.bn.var", "emas.1.bn.var"]

    def tensors(t: dict, meta: dict) -> None:
        for k in gone:
            t.pop(k)
        t.update({k: torch.zeros(1) for k in extra})

    _rewrite(tag_dir, 1, tensors, "buffer_files")
    assert refused(CorruptCheckpointError) == (
        f"{where} holds other tensors than the manifest's field 'buffers' describes: only in the file "
        f"{short_list(extra, 4)}, missing {short_list(gone, 4)}"
    )
    for key, value, shown in (
        ("copied.bn.count", torch.tensor(6, dtype=torch.int32), "int32[] in the file but int64[]"),
        ("emas.1.bn.mean", torch.zeros(5), "float32[5] in the file but float32[4]"),
        ("copied.mask", torch.tensor([True]), "bool[1] in the file but bool[2]"),
    ):
        fresh()
        _rewrite(tag_dir, 1, lambda t, meta: t.update({key: value}), "buffer_files")
        assert refused(CorruptCheckpointError) == (
            f"{where}: tensor {key!r} is {shown} in the manifest's field 'buffers'"
        )
    fresh()
    m = _manifest(tag_dir)
    del m["buffer_files"][1]["tensor_checksums"]["emas.1.bn.mean"]
    _set_manifest(tag_dir, m)
    assert refused(CorruptCheckpointError) == f"{where}: the manifest has no checksum for tensor 'emas.1.bn.mean'"
    with CheckpointReader.open(root, "t") as ckpt:
        assert _same_buffers(ckpt.read_buffers(1, 2, verify=False), _bufs(layouts[1]))
    fresh()
    with _io.SafetensorsFile(path) as st:
        at = st.header_size + st.tensors["emas.1.bn.var"].start + 5
    _flip(path, at)
    assert re.fullmatch(
        rf"{path}: checksum mismatch in tensor 'emas\.1\.bn\.var', bytes 0\.\.12 of the tensor: xxh3_64 [0-9a-f]{{16}}, "
        r"recorded [0-9a-f]{16}\. The file is corrupted: restore it from a copy or load an earlier tag "
        r"\[buffers of rank 1, tag 't'\]",
        refused(CorruptCheckpointError),
    )
    with CheckpointReader.open(root, "t") as ckpt:
        _, emas, _ = ckpt.read_buffers(1, 2, verify=False)
        assert not torch.equal(emas[1]["bn.var"], _bufs(layouts[1]).emas[1]["bn.var"])
        assert torch.equal(emas[0]["bn.var"], _bufs(layouts[1]).emas[0]["bn.var"])


def test_buffer_file_header_and_place(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    layouts = _zero3(2)
    _write(root, layouts, buffers=_bufs)
    tag_dir = root / "t"
    path = tag_dir / "buffers_rank_00001_of_00002.safetensors"
    where = f"{path} (buffers of rank 1 of 2)"
    raw = path.read_bytes()
    with CheckpointReader.open(root, "t") as ckpt:
        _flip(path, raw.index(b"functional_ema ", 8))
        assert _msg(CorruptCheckpointError, lambda: ckpt.read_buffers(1, 2)) == (
            f"{where}: the header does not match the checksum in the manifest; the file is corrupted"
        )
        assert _same_buffers(ckpt.read_buffers(1, 2, verify=False), _bufs(layouts[1]))
        path.write_bytes(raw[:20] + b"x" * (len(raw) - 20))
        with pytest.raises(_io.FormatError) as direct:
            _io.SafetensorsFile(path, expected_size=len(raw))
        assert _msg(CorruptCheckpointError, lambda: ckpt.read_buffers(1, 2)) == f"{where}: {direct.value}"
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes(raw)
        path.unlink()
        path.symlink_to(outside)
        assert _msg(CorruptCheckpointError, lambda: ckpt.read_buffers(1, 2)) == (
            f"{where} is a link to a file outside the tag folder {tag_dir}; functional_ema reads only its own files "
            "inside the tag folder"
        )
        path.unlink()
        assert _msg(IncompleteCheckpointError, lambda: ckpt.read_buffers(1, 2)) == (
            f"{where} is missing: restore it or load another tag"
        )


# ------------------------------------------------------------------------- model-parallel saves, joined

TP_FULL = {"w": (6, 4), "v": (4, 6), "b": (7,)}
TP_DIMS: dict[str, int | None] = {"w": 0, "v": 1, "b": None}


def _tp_shapes(tp_size: int, dims: dict = TP_DIMS) -> dict[str, tuple[int, ...]]:
    return {n: tuple(x // tp_size if i == dims[n] else x for i, x in enumerate(s)) for n, s in TP_FULL.items()}


def _tp(world: int, tp_size: int = 2, dims: dict | None = TP_DIMS, shapes: Callable | None = None) -> list[ShardLayout]:
    """Tensor parallelism of ``tp_size`` ranks, each part cut by ZeRO-3 over ``world`` data-parallel ranks."""
    out = []
    for t in range(tp_size):
        local = shapes(t) if shapes is not None else _tp_shapes(tp_size)
        for r in range(world):
            out.append(ShardLayout(r, world, 3, _even(r, world, local), part=ModelPart(t, tp_size), tp_dims=dims))
    return out


def _full(name: str, k: int) -> torch.Tensor:
    return _ref(name, TP_FULL[name], k).view(TP_FULL[name])


def _tp_values(lay: ShardLayout, name: str, k: int) -> torch.Tensor:
    """The slice of the full parameter that ``lay``'s tensor-parallel rank holds; the replicated ``b`` differs on
    tensor-parallel rank 1 (so that a read from the wrong rank shows)."""
    d, part = TP_DIMS[name], lay.part
    if d is None:
        return _ref(name, TP_FULL[name], k) + 0.25 * part.tp
    size = lay.specs[name].shape[d]
    return _full(name, k).narrow(d, part.tp * size, size).reshape(-1)


def _joined(reader_: object, name: str, k: int = 0) -> torch.Tensor:
    shape = reader_.shapes[name]  # type: ignore[attr-defined]
    out = torch.full((math.prod(shape),), float("nan"))
    reader_.fill(out, k, name, 0, out.numel(), True)  # type: ignore[attr-defined]
    return out.view(shape)


def test_select_a_part(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _tp(2), values=_tp_values)
    mpath = root / "t" / MANIFEST_NAME
    assert _msg(CheckpointMismatchError, lambda: CheckpointReader.open(root, "t")) == (
        f"{mpath}: this checkpoint holds 2 model-parallel parts (tensor-parallel size 2 x pipeline size 1); a reader of "
        "one part must name it (functional_ema.load does, from the engine), the offline tools read them all"
    )
    assert _msg(CheckpointMismatchError, lambda: CheckpointReader.open(root, "t", part=ModelPart(0, 4))) == (
        f"{mpath}: the EMA was saved with tensor-parallel size 2 x pipeline size 1, and holds no part for "
        "tensor-parallel rank 0 of 4 of this run: the model-parallel layout changed"
    )
    assert _msg(CheckpointMismatchError, lambda: CheckpointReader.open(root, "t", part=ModelPart())).startswith(
        f"{mpath}: the EMA was saved with tensor-parallel size 2 x pipeline size 1, and holds no part for the whole model"
    )
    for t in (1, 0):
        with CheckpointReader.open(root, "t", part=ModelPart(t, 2)) as ckpt:
            assert ckpt.part == ModelPart(t, 2) and ckpt.part_manifest["field"] == f"parts[{t}]."
            assert ckpt.shapes == _tp_shapes(2) and ckpt.tp_dims == TP_DIMS
            assert torch.equal(_read(ckpt, "w", 0, 12, k=1), _full("w", 1)[3 * t : 3 * t + 3].reshape(-1))
    readers = open_parts(root, "t")
    assert [r.part for r in readers] == [ModelPart(0, 2), ModelPart(1, 2)]
    for r in readers:
        r.close()
    _write(root, _tp(2), tag="u", values=_tp_values)  # now ema_latest names 'u'
    path = root / "t" / "ema_tp001of002_pp000of001_rank_00000_of_00002.safetensors"
    _flip(path, path.read_bytes().index(b"functional_ema ", 8))  # in the header
    for opened in (
        lambda: open_parts(root, "t"),
        lambda: CheckpointReader.open_parts(root, "t"),
        lambda: open_joined(root, "t"),
    ):
        assert "the header does not match the checksum" in _msg(CorruptCheckpointError, opened)
    with open_joined(root, "t", verify=False) as joined:
        got = torch.full((24,), float("nan"))
        joined.fill(got, 0, "w", 0, 24, False)
        assert torch.equal(got, _full("w", 0).reshape(-1))
    readers = open_parts(root, "t", verify=False)
    assert [(r.tag, r.part) for r in readers] == [("t", ModelPart(0, 2)), ("t", ModelPart(1, 2))]
    assert torch.equal(_read(readers[1], "w", 0, 12, verify=False), _full("w", 0)[3:].reshape(-1))
    whole = tmp_path / "whole"
    _write(whole, _zero3(2))
    for part in (None, ModelPart()):
        with CheckpointReader.open(whole, "t", part=part) as ckpt:
            assert ckpt.part == ModelPart() and ckpt.part_manifest["field"] == ""
    assert _msg(CheckpointMismatchError, lambda: CheckpointReader.open(whole, "t", part=ModelPart(1, 2))) == (
        f"{whole / 't' / MANIFEST_NAME}: the EMA was saved with no model parallelism, and holds no part for "
        "tensor-parallel rank 1 of 2 of this run: the model-parallel layout changed"
    )
    assert [r.part for r in open_parts(whole, "t")] == [ModelPart()]


def test_part_files_are_named_with_their_part(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _tp(2), values=_tp_values)
    tag_dir = root / "t"
    name = "ema_tp001of002_pp000of001_rank_00001_of_00002.safetensors"
    m = _manifest(tag_dir)
    m["parts"][1]["files"][1]["chunk_checksums"] = "zz"
    _set_manifest(tag_dir, m)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t", part=ModelPart(1, 2))).startswith(
        f"{tag_dir / MANIFEST_NAME}: field 'parts[1].files[1].chunk_checksums' must be"
    )
    (tag_dir / name).unlink()
    listed = f"{name} (rank 1 of 2, tensor-parallel rank 1 of 2)"
    assert _msg(IncompleteCheckpointError, lambda: locate_checkpoint(root)) == (
        f"tag 't' in {root} is missing 1 file(s) listed in its manifest: {listed}. The folder was copied or pruned "
        "partially: restore the file(s) or load another tag (a save with shared=False into each rank's own folder: "
        "load it with shared=False, or merge the folders first)"
    )
    root2 = tmp_path / "ck2"
    edit = lambda lay, m: m.update(step="3") if lay.part.tp and lay.rank else None  # noqa: E731
    _write(root2, _tp(2), values=_tp_values, meta=edit)
    where = f"{root2 / 't' / name} (rank 1 of 2, tensor-parallel rank 1 of 2)"
    assert _msg(CorruptCheckpointError, lambda: open_parts(root2, "t")) == (
        f"{where}: metadata step='3' but the manifest says 12: the file does not belong to this checkpoint (mixed "
        "copies of two saves?)"
    )
    with CheckpointReader.open(root2, "t", part=ModelPart(0, 2)) as ckpt:
        assert ckpt.part_manifest["field"] == "parts[0]."


def test_joined_reader_joins_tensor_parallel_slices(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _tp(2), values=_tp_values, buffers=_bufs)
    with open_joined(root, "t") as joined:
        assert joined.shapes == TP_FULL and (joined.tag, joined.root, joined.tag_dir) == ("t", root, root / "t")
        assert (joined.step, joined.num_emas, joined.dtype, joined.world_size, joined.stage) == (
            STEP,
            2,
            torch.float32,
            2,
            3,
        )
        assert joined.manifest == _manifest(root / "t")
        for n in TP_FULL:
            for k in (0, 1):
                assert torch.equal(_joined(joined, n, k), _full(n, k)), (n, k)  # 'b' from tensor-parallel rank 0
        joined.check_index(1)
        assert "index=2" in _msg(CheckpointMismatchError, lambda: joined.check_index(2))
        assert _same_buffers(joined.read_buffers(), _bufs(_tp(2)[0]))
        for start, numel, size in ((1, 23, 24), (0, 23, 23), (0, 24, 23)):
            dst = torch.empty(size)
            assert _msg(ValueError, lambda: joined.fill(dst, 0, "w", start, numel, True)) == (
                f"a joined reader fills whole parameters; got elements [{start}, {start + numel}) of 'w'"
            )
    with open_joined(root, "t", tp_rank=1) as one:
        assert one.shapes == _tp_shapes(2)
        assert torch.equal(_joined(one, "w", 1), _full("w", 1)[3:])
        assert torch.equal(_joined(one, "b"), _full("b", 0) + 0.25)
    with open_joined(root, "t", tp_rank=0) as one:
        assert torch.equal(_joined(one, "v"), _full("v", 0)[:, :3])
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_rank=2)) == (
        "tp_rank=2, but tag 't' was saved with tensor-parallel size 2"
    )
    with open_joined(root, "t", tp_dims={"w": 0, "b": None}) as joined:  # the recorded splits, given again
        assert torch.equal(_joined(joined, "v"), _full("v", 0))
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={"w": 1})) == (
        "tp_dims['w']=1 contradicts the split recorded at save time for parameter 'w': dimension 0 (None: replicated "
        "across tensor-parallel ranks). Leave it out of tp_dims (the recorded split is used), or give the recorded one"
    )
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={"b": 0})).startswith(
        "tp_dims['b']=0 contradicts the split recorded at save time for parameter 'b': dimension None"
    )
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={"b": 1})) == (
        "tp_dims['b']=1: parameter 'b' has 1 dimension(s) (shape (7,)), so its split dimension is one of 0..0 (or "
        "None: replicated)"
    )
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={"zz": 0})) == (
        "tp_dims names 'zz', which is not a parameter of tag 't' (it has ['b', 'v', 'w'])"
    )


def test_joined_reader_without_a_recorded_split(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _tp(1, dims=None), values=_tp_values)
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t")) == (
        "tag 't' was saved with tensor parallelism (2 ranks), and how its slices join is unknown (the parameters "
        "carried no split: no AutoTP layout record, no Megatron attributes 'tensor_model_parallel'/'partition_dim'). "
        "Pass tp_dims={name: dim or None, ...}, or tp_rank=r for one rank's slices (the CLI writes one file per "
        "tensor-parallel rank then)"
    )
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={"w": 0, "v": 1})) == (
        "tp_dims= does not say how ['b'] join; give a dimension (or None for a parameter replicated across "
        "tensor-parallel ranks) for each"
    )
    with open_joined(root, "t", tp_dims=TP_DIMS) as joined:
        assert all(torch.equal(_joined(joined, n, 1), _full(n, 1)) for n in TP_FULL)
    with open_joined(root, "t", tp_dims={"w": 0, "v": 1, "b": 0}) as joined:  # concatenated: both ranks' copies
        assert torch.equal(_joined(joined, "b"), torch.cat([_full("b", 0), _full("b", 0) + 0.25]))
    with open_joined(root, "t", tp_dims={"w": 1, "v": 0, "b": None}) as joined:  # other dims: other shapes
        assert joined.shapes == {"w": (3, 8), "v": (8, 3), "b": (7,)}
        assert torch.equal(_joined(joined, "w"), torch.cat([_full("w", 0)[:3], _full("w", 0)[3:]], dim=1))
    with open_joined(root, "t", tp_rank=1) as one:
        assert torch.equal(_joined(one, "v"), _full("v", 0)[:, 3:])
    with CheckpointReader.open(root, "t", part=ModelPart(1, 2)) as ckpt:
        assert ckpt.tp_dims is None


def test_joined_reader_refuses_slices_that_do_not_join(tmp_path: Path) -> None:
    uneven = tmp_path / "uneven"  # tensor-parallel rank 1 holds fewer rows of 'w'
    _write(uneven, _tp(1, dims=None, shapes=lambda t: {"w": (3 - t, 4), "v": (4, 3), "b": (7,)}))
    assert _msg(CheckpointMismatchError, lambda: open_joined(uneven, "t", tp_dims={"w": 1, "v": 1, "b": None})) == (
        "parameter 'w': its tensor-parallel slices [(3, 4), (2, 4)] do not join along dimension 1"
    )
    with open_joined(uneven, "t", tp_dims={"w": 0, "v": 1, "b": None}) as joined:
        assert joined.shapes["w"] == (5, 4)
    flat = tmp_path / "flat"  # one rank holds 'w' flattened: the slices differ in their number of dimensions
    _write(flat, _tp(1, dims=None, shapes=lambda t: {"w": (3, 4) if t == 0 else (12,), "v": (4, 3), "b": (7,)}))
    assert _msg(CheckpointMismatchError, lambda: open_joined(flat, "t", tp_dims={"w": 0, "v": 1, "b": None})) == (
        "parameter 'w': its tensor-parallel slices [(3, 4), (12,)] do not join along dimension 0"
    )
    other = tmp_path / "other"  # tensor-parallel rank 1 holds other parameters
    _write(other, _tp(1, dims=None, shapes=lambda t: {"w": (3, 4), "v" if t == 0 else "u": (4, 3), "b": (7,)}))
    assert _msg(CorruptCheckpointError, lambda: open_joined(other, "t", tp_dims={"w": 0})) == (
        f"{other / 't' / MANIFEST_NAME}: the tensor-parallel ranks of pipeline stage 0 hold different parameters; the "
        "manifest is damaged"
    )
    with open_joined(other, "t", tp_rank=1) as one:
        assert sorted(one.shapes) == ["b", "u", "w"]


def _pp(world: int) -> list[ShardLayout]:
    """Two pipeline stages: 'w' on stage 0, 'v' on stage 1, and 'b' (a tied layer) on both."""
    out = []
    for pp, names in ((0, ("w", "b")), (1, ("b", "v"))):  # the tied layer first on stage 1
        shapes = {n: TP_FULL[n] for n in names}
        out += [
            ShardLayout(r, world, 3, _even(r, world, shapes), part=ModelPart(pp=pp, pp_size=2)) for r in range(world)
        ]
    return out


def _pp_values(lay: ShardLayout, name: str, k: int) -> torch.Tensor:
    return _ref(name, TP_FULL[name], k) + (0.5 * lay.part.pp if name == "b" else 0)


def test_joined_reader_merges_pipeline_stages(tmp_path: Path) -> None:
    root = tmp_path / "ck"

    def bufs(lay: ShardLayout) -> BufferState:
        b = _bufs(lay)
        if lay.part.pp == 1:  # stage 1 has a buffer of its own besides the shared ones
            b.emas[0]["head.mean"] = torch.ones(2)
            b.emas[1]["head.mean"] = torch.zeros(2)
        return b

    _write(root, _pp(2), values=_pp_values, buffers=bufs)
    with open_joined(root, "t") as joined:
        assert joined.shapes == TP_FULL
        # 'b' is held by both stages with other values (an attribute a TiedLayerSpec leaves untied): no one value to
        # join, refused when it is read (stage 0's was taken silently); equal copies are joined (test_model_parallel)
        untied = r"tag 't': parameter 'b' is held by pipeline stages \[0, 1\] with different values"
        with pytest.raises(CheckpointMismatchError, match=untied):
            _joined(joined, "b")
        assert torch.equal(_joined(joined, "v", 1), _full("v", 1))
        num, emas, copied = joined.read_buffers()
        first = _bufs(_pp(2)[0])
        assert num == 2 and torch.equal(copied["bn.count"], first.copied["bn.count"])
        assert torch.equal(emas[1]["bn.mean"], first.emas[1]["bn.mean"]) and torch.equal(
            emas[1]["head.mean"], torch.zeros(2)
        )
        assert sorted(emas[0]) == ["bn.mean", "bn.var", "head.mean"]
    tp_pp = tmp_path / "tp_pp"
    _write(tp_pp, _tp(1), values=_tp_values, buffers=lambda lay: _bufs(lay._replace(rank=lay.rank + 3 * lay.part.tp)))
    with open_joined(tp_pp, "t") as joined:  # buffers: tensor-parallel rank 0's
        assert _same_buffers(joined.read_buffers(verify=False), _bufs(_tp(1)[0]))


def test_open_joined_checks_its_arguments_first(tmp_path: Path) -> None:
    gone = tmp_path / "nothing"
    assert _msg(TypeError, lambda: open_joined(gone, verify="yes")).startswith("verify must be")  # type: ignore[arg-type]
    assert _msg(TypeError, lambda: open_joined(gone, tp_dims=[("w", 0)])) == (  # type: ignore[arg-type]
        "tp_dims must be a dict {parameter name: split dimension or None}, got list [('w', 0)]"
    )
    assert _msg(TypeError, lambda: open_joined(gone, tp_rank="1")).startswith("tp_rank must be")  # type: ignore[arg-type]
    assert _msg(CheckpointNotFoundError, lambda: open_joined(gone)) == f"checkpoint directory {gone} does not exist"
    assert check_tp_dims(None) is None
    assert check_tp_dims({"w": 0, "b": None}) == {"w": 0, "b": None}
    assert _msg(TypeError, lambda: check_tp_dims({1: 0})) == "tp_dims: keys must be parameter names (str), got int 1"
    assert _msg(TypeError, lambda: check_tp_dims({"w": 0.5})).startswith("tp_dims['w'] must be")
    assert _msg(ValueError, lambda: check_tp_dims({"w": -1})) == "tp_dims['w']=-1 is outside [0, 2**63 - 1]"
    long = "x" * 100
    assert _msg(TypeError, lambda: check_tp_dims(long)) == (
        f"tp_dims must be a dict {{parameter name: split dimension or None}}, got str {long!r:.80}"
    )


# --------------------------------------------------------------------- another model-parallel layout: re-cut


def test_recut_to_a_whole_model(tmp_path: Path) -> None:
    """A tensor-parallel save read by a run without model parallelism: the joined parameters, any range."""
    root = tmp_path / "ck"
    _write(root, _tp(2), values=_tp_values, buffers=_bufs)
    lay = ShardLayout(1, 2, 3, _even(1, 2, TP_FULL))
    with open_checkpoint(root, "t", True, lay) as ckpt:
        assert isinstance(ckpt, RecutReader) and ckpt.recut
        assert (ckpt.tag, ckpt.root, ckpt.tag_dir, ckpt.step, ckpt.num_emas, ckpt.dtype) == (
            "t",
            root,
            root / "t",
            STEP,
            2,
            torch.float32,
        )
        assert (ckpt.world_size, ckpt.stage, ckpt.part, ckpt.experts) == (2, 3, ModelPart(), None)
        assert ckpt.manifest == _manifest(root / "t") and ckpt.shapes == TP_FULL
        ckpt.check_model(lay.specs)
        ckpt.check_experts(lay)
        ckpt.check_index(1)
        assert "index=2" in _msg(CheckpointMismatchError, lambda: ckpt.check_index(2))
        for n, s in lay.specs.items():
            want = _full(n, 1).reshape(-1)[s.offset : s.offset + s.numel]
            assert torch.equal(_read(ckpt, n, s.offset, s.numel, k=1), want), n
        assert ckpt.has_buffers and _same_buffers(ckpt.read_buffers(1, 2), _bufs(_tp(2)[0]))
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(dict(lay.specs, zz=ShardSpec((2,), 0, 1)))) == (
            f"tag 't' in {root} (saved with another model-parallel layout) has no EMA of ['zz'], which the whole model "
            "of this run trains"
        )
        bad = dict(lay.specs, v=ShardSpec((6, 4), 0, 12))
        assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(bad)) == (
            "parameter 'v': its full shape in tag 't' is (4, 6), but this rank's slice (6, 4) of the whole model (split "
            "along None) makes (6, 4)"
        )
    plain = tmp_path / "plain"
    _write(plain, _tp(2), values=_tp_values)
    with open_checkpoint(plain, "t", True, lay) as ckpt:
        assert not ckpt.has_buffers


def test_recut_to_tensor_parallel_slices(tmp_path: Path) -> None:
    """A save without model parallelism read by tensor-parallel rank 1 of 2: its slice of each parameter."""
    root = tmp_path / "ck"
    _write(root, _zero3(2, TP_FULL))
    for t in (1, 0):
        lay = ShardLayout(0, 1, 3, _even(0, 1, _tp_shapes(2)), part=ModelPart(t, 2), tp_dims=TP_DIMS)
        with open_checkpoint(root, "t", True, lay) as ckpt:
            assert isinstance(ckpt, RecutReader) and ckpt.part == ModelPart(t, 2)
            ckpt.check_model(lay.specs)
            want = {"w": _full("w", 1)[3 * t : 3 * t + 3], "v": _full("v", 1)[:, 3 * t : 3 * t + 3], "b": _full("b", 1)}
            for n, w in want.items():
                assert torch.equal(_read(ckpt, n, 0, w.numel(), k=1), w.reshape(-1)), (t, n)
            assert torch.equal(_read(ckpt, "v", 5, 4, k=1), want["v"].reshape(-1)[5:9])
            small = dict(lay.specs, w=ShardSpec((2, 4), 0, 8))
            assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(small)) == (
                f"parameter 'w': its full shape in tag 't' is (6, 4), but this rank's slice (2, 4) of tensor-parallel "
                f"rank {t} of 2 (split along 0) makes (4, 4)"
            )
    for dims in (None, {"w": 0}):
        lay = ShardLayout(0, 1, 3, _even(0, 1, _tp_shapes(2)), part=ModelPart(1, 2), tp_dims=dims)
        with open_checkpoint(root, "t", True, lay) as ckpt:
            assert _msg(CheckpointMismatchError, lambda: ckpt.check_model(lay.specs)) == (
                "tag 't' was saved with another model-parallel layout than this run's (tensor-parallel rank 1 of 2), "
                f"and this engine records no tensor-parallel split to cut {'w' if dims is None else 'v'!r} from the "
                "full parameter (no AutoTP layout record, no Megatron 'partition_dim'): resume with the layout it was "
                "saved with"
            )
            assert "no tensor-parallel split to cut 'v'" in _msg(
                CheckpointMismatchError, lambda: _read(ckpt, "v", 0, 12)
            )
    # verify reaches the joined readers: a flipped byte is refused, and read as it is without verification
    path = root / "t" / _rank_file(1, 2)
    _flip(path, _data_at(path, "emas.0.v", 3))  # element 15 of v: row 2, column 3, in tensor-parallel rank 1's slice
    lay = ShardLayout(0, 1, 3, _even(0, 1, _tp_shapes(2)), part=ModelPart(1, 2), tp_dims=TP_DIMS)
    with open_checkpoint(root, "t", True, lay) as ckpt:
        assert "checksum mismatch in tensor 'emas.0.v'" in _msg(CorruptCheckpointError, lambda: _read(ckpt, "v", 0, 12))
    with open_checkpoint(root, "t", False, lay) as ckpt:
        assert not torch.equal(_read(ckpt, "v", 0, 12, verify=False), _full("v", 0)[:, 3:].reshape(-1))


def _stages(world: int, split: tuple[tuple[str, ...], ...]) -> list[ShardLayout]:
    """Pipeline stages holding the names of ``split`` (one tuple per stage), each cut over ``world`` ranks."""
    out = []
    for pp, names in enumerate(split):
        shapes = {n: TP_FULL[n] for n in names}
        part = ModelPart(pp=pp, pp_size=len(split))
        out += [ShardLayout(r, world, 3, _even(r, world, shapes), part=part) for r in range(world)]
    return out


def test_recut_to_another_partitioning_of_the_same_stages(tmp_path: Path) -> None:
    """Saved by 2 stages holding (w, v) and (b), loaded by 2 stages holding (w) and (v, b) (another
    ``partition_method``): each stage reads its parameters by name from the joined stages, exactly; the part of the
    same index is not read directly (its names differ). Names no saved stage holds are refused naming the stage."""
    root = tmp_path / "ck"
    _write(root, _stages(2, (("w", "v"), ("b",))), buffers=_bufs)
    for lay in _stages(2, (("w",), ("v", "b"))) + _stages(1, (("w",), ("v", "b"))):
        with open_checkpoint(root, "t", True, lay) as ckpt:
            assert isinstance(ckpt, RecutReader) and ckpt.part == lay.part, lay
            ckpt.check_model(lay.specs)
            for n, s in lay.specs.items():
                want = _full(n, 1).reshape(-1)[s.offset : s.offset + s.numel]
                assert torch.equal(_read(ckpt, n, s.offset, s.numel, k=1), want), (lay.part, n)
    for lay in _stages(2, (("w", "v"), ("b",))):  # the saved partitioning: this rank's own file, read directly
        with open_checkpoint(root, "t", True, lay) as ckpt:
            assert isinstance(ckpt, CheckpointReader) and ckpt.partial
    # a name no saved stage holds: not another partitioning, another model; refused naming the stage
    other = _stages(1, (("w",), ("v", "b")))[1]
    other = other._replace(specs=dict(other.specs, zz=ShardSpec((2,), 0, 2)))
    with open_checkpoint(root, "t", True, other) as ckpt:
        assert isinstance(ckpt, CheckpointReader)
        msg = _msg(CheckpointMismatchError, lambda: ckpt.check_model(other.specs))
    assert "in the model but not in the checkpoint: ['v', 'zz']" in msg, msg
    assert "this rank is pipeline stage 1 of 2, and no saved part holds ['zz']: not another pipeline " in msg


def test_a_load_that_leaves_a_saved_stage_ema_behind_is_refused(tmp_path: Path) -> None:
    """A checkpoint of 2 pipeline stages loaded by one process into a plain module (the saved stages joined and
    re-cut by name): with every saved parameter it loads each exactly; with ``v`` gone from the model (removed, or
    frozen since the save) every name the module has is still found, so only the count over the whole job shows
    that ``v``'s EMA would be left behind: the load is refused naming it."""

    class Plain(torch.nn.Module):
        def __init__(self, names: tuple[str, ...]) -> None:
            super().__init__()
            for n in names:
                self.register_parameter(n, torch.nn.Parameter(torch.zeros(TP_FULL[n])))

    root = tmp_path / "ck"
    _write(root, _stages(1, (("w", "v"), ("b",))))
    model = Plain(("w", "v", "b"))
    state = fe.load(model, root, "t")
    for k in (0, 1):
        assert all(torch.equal(state.emas[k][n], _full(n, k)) for n in ("w", "v", "b"))
    msg = _msg(CheckpointMismatchError, lambda: fe.load(Plain(("w", "b")), root, "t"))
    assert msg.startswith(
        f"tag 't' in {root} holds the EMA of 1 parameter(s) that no rank of this job loads: 'v'. The model no longer "
        "trains them (removed, or frozen since the save)"
    ), msg


# ------------------------------------------------------------------------------------ private folders


def test_private_folder_holds_what_this_rank_reads(tmp_path: Path) -> None:
    """A save with shared=False leaves each rank's folder with its own files: a load at the saved world size
    reads them; one at another world size needs the files its pieces are in, and names those missing."""
    root = tmp_path / "ck"
    _write(root, _zero3(4))
    tag_dir = root / "t"
    for r in (0, 1, 3):
        (tag_dir / _rank_file(r, 4)).unlink()  # rank 2's folder
    with open_checkpoint(root, "t", True, _zero3(4)[2], local=True) as ckpt:
        assert [f.rank for f in ckpt.files] == [2]
        s = _zero3(4)[2].specs["w"]
        assert torch.equal(_read(ckpt, "w", s.offset, s.numel), _ref("w")[s.offset : s.offset + s.numel])
    tail = (
        "A save with shared=False loads from each rank's own folder at the world size and layout it was saved at; to "
        "load it at another, merge the folders into one first (e.g. rsync -a each node's checkpoint folder into one, "
        "or Ray Train's merged checkpoint) and load from that folder"
    )
    own = tag_dir / _rank_file(2, 4)
    own.rename(tmp_path / "away")  # the file this rank saved is gone too: named, not a bare FileNotFoundError
    assert _msg(IncompleteCheckpointError, lambda: open_checkpoint(root, "t", True, _zero3(4)[2], local=True)) == (
        f"{tag_dir} lacks 1 file(s) this rank reads: {_rank_file(2, 4)} (saved by rank 2 of 4). {tail}"
    )
    (tmp_path / "away").rename(own)
    assert _msg(IncompleteCheckpointError, lambda: open_checkpoint(root, "t", True, _zero3(2)[1], local=True)) == (
        f"{tag_dir} lacks 2 file(s) this rank reads: {_rank_file(1, 4)} (saved by rank 1 of 4), {_rank_file(3, 4)} "
        f"(saved by rank 3 of 4). {tail}"
    )
    assert "is missing 3 file(s)" in _msg(
        IncompleteCheckpointError, lambda: open_checkpoint(root, "t", True, _zero3(4)[2])
    )
    m = _manifest(tag_dir)
    five = [{"rank": r, "file": _rank_file(r, 9)} for r in range(5)]
    listed = ", ".join(f"{_rank_file(r, 9)} (saved by rank {r} of 9)" for r in range(4))
    assert _msg(IncompleteCheckpointError, lambda: check_local(tag_dir, {"world_size": 9}, five)) == (
        f"{tag_dir} lacks 5 file(s) this rank reads: {listed} .... {tail}"
    )
    assert _msg(IncompleteCheckpointError, lambda: check_local(tag_dir, {"world_size": 9}, five[:4])) == (
        f"{tag_dir} lacks 4 file(s) this rank reads: {listed}. {tail}"
    )
    check_local(tag_dir, {"world_size": 4}, [m["files"][2]])  # rank 2's file: there


def test_private_folder_of_a_model_parallel_save(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _tp(2), values=_tp_values)
    tag_dir = root / "t"
    own = _tp(2)[3]  # tensor-parallel rank 1, data-parallel rank 1
    whole = ShardLayout(0, 1, 3, _even(0, 1, TP_FULL))
    with open_checkpoint(root, "t", True, whole, local=True) as ckpt:  # every file there: re-cut
        assert isinstance(ckpt, RecutReader)
    name = "ema_tp000of002_pp000of001_rank_00001_of_00002.safetensors"
    (tag_dir / name).unlink()
    with open_checkpoint(root, "t", True, own, local=True) as ckpt:
        assert [f.rank for f in ckpt.files] == [1] and ckpt.part == ModelPart(1, 2)
    assert _msg(IncompleteCheckpointError, lambda: open_checkpoint(root, "t", True, whole, local=True)).startswith(
        f"{tag_dir} lacks 1 file(s) this rank reads: {name} (saved by rank 1 of 2). A save with shared=False"
    )


# ------------------------------------------------------------------------------ 2 ranks (torch.distributed)

RANKS_ENV = {"FE_DIST_INIT": "torch"}


LINEAR = {"weight": (6, 5), "bias": (6,)}  # nn.Linear(5, 6), cut by FSDP2 into rows 0-2 and 3-5


def _full_of(name: str, k: int) -> torch.Tensor:
    return _ref(name, LINEAR[name], k).view(LINEAR[name])


def _reshard(base: Path) -> dict:
    """FSDP2 ranks load a checkpoint saved by 3 ZeRO-3 ranks (written by the parent): each reads the files its
    rows are in; a flipped byte in the part that rank 1 alone reads fails the load on both ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from functional_ema._testing.multirank import error_of

    torch.manual_seed(1)
    model = torch.nn.Linear(5, 6)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    layout = fe.engines.adapter_for(model).read().layout
    out: dict = {"specs": {n: [s.offset, s.numel] for n, s in layout.specs.items()}}
    with open_checkpoint(base / "w3", "t", True, layout) as ckpt:
        out["opened"] = [f.rank for f in ckpt.files]
    state = fe.load(model, base / "w3", "t")
    out["ema"] = {n: t.reshape(-1).tolist() for n, t in state.emas[1].items()}  # this rank's pieces
    out["bad"] = error_of(lambda: fe.load(model, base / "w3_bad", "t"))
    state = fe.load(model, base / "w3_bad", "t", verify=False)
    out["unverified"] = {n: t.reshape(-1).tolist() for n, t in state.emas[1].items()}
    return out


def ranks_worker(root: str) -> dict:
    """DDP ranks (replicated, each with its own BatchNorm statistics) save one tag twice (generations 0 and 1);
    each node keeps a copy of the tag, rank 1's taken before the second save. Loads of those copies, of the
    shared folder, and with each rank's own buffers; then the loads of :func:`_reshard`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from functional_ema._testing.multirank import error_of

    rank, base = dist.get_rank(), Path(root)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ddp = DDP(net, broadcast_buffers=False)
    with torch.no_grad():
        net(torch.arange(32.0).view(8, 4) * (rank + 1))  # each rank's running statistics differ
    state = fe.init_ema(fe.local_shards(ddp))
    bufs = fe.buffers.init_buffers(ddp)
    shared = base / "shared"
    for gen in (0, 1):
        fe.save(state, ddp, shared, "t", buffers=bufs)
        dist.barrier()
        if rank == 0:
            shutil.copytree(shared, base / f"node{1 - gen}")  # node 1 keeps generation 0, node 0 generation 1
        dist.barrier()
    out: dict = {"generation": _manifest(base / f"node{rank}" / "t")["generation"]}
    out["stale"] = error_of(lambda: fe.load(ddp, base / f"node{rank}", "t"))
    out["stale_private"] = error_of(lambda: fe.load(ddp, base / f"node{rank}", "t", shared=False))
    loaded = fe.checkpoint.load_checkpoint(ddp, shared, "t", buffers=True)
    out["ema"] = {n: t.tolist() for n, t in loaded.state.ema.items()}
    out["want"] = {n: p.detach().tolist() for n, p in net.named_parameters()}
    out["buffers"] = {n: t.tolist() for n, t in loaded.buffers.emas[0].items()}
    out["own_buffers"] = {n: t.tolist() for n, t in net.state_dict().items() if n.endswith(("mean", "var"))}
    out["reshard"] = _reshard(base)
    return out


def test_ranks_refuse_other_saves_and_reshard(tmp_path: Path) -> None:
    """One 2-rank launch: a node whose copy of the tag is another generation (stale) makes every rank refuse the
    load, naming each rank's generation; the same save everywhere loads, with each rank's own buffers. Then a
    load at another world size (3 -> 2) reads on each rank the files its pieces are in, and a flipped byte that
    one rank reads is refused on both."""
    import re

    _write(tmp_path / "w3", _zero3(3, LINEAR))
    shutil.copytree(tmp_path / "w3", tmp_path / "w3_bad")
    path = tmp_path / "w3_bad" / "t" / _rank_file(2, 3)
    _flip(path, _data_at(path, "emas.1.weight", 5))  # element 25 of the weight: row 5, rank 1's
    r0, r1 = run_ranks("tests.test_reader:ranks_worker", world_size=2, timeout=300, env=RANKS_ENV, root=str(tmp_path))
    assert (r0["generation"], r1["generation"]) == (1, 0)
    stale = (
        r"load: ranks disagree on generation: rank 0: 1, rank 1: 0; and on save: rank 0: 'manifest #[0-9a-f]{16}', "
        r"rank 1: 'manifest #[0-9a-f]{16}'\. Every rank must read the same complete save: on node-local disks copy "
        r"one save of the tag to every node \(or load from shared storage\), and pass the same tag everywhere"
    )
    for r in (r0, r1):
        for key in ("stale", "stale_private"):
            assert r[key][0] == "CheckpointMismatchError" and re.fullmatch(stale, r[key][1]), r[key]
        assert r["ema"] == r["want"]
        assert r["buffers"] == r["own_buffers"]
    assert r0["buffers"] != r1["buffers"] and r0["stale"] == r1["stale"]
    a, b = r0["reshard"], r1["reshard"]
    assert (a["specs"], b["specs"]) == ({"weight": [0, 15], "bias": [0, 3]}, {"weight": [15, 15], "bias": [3, 3]})
    assert (a["opened"], b["opened"]) == ([0, 1], [1, 2])
    for r, rows in ((a, slice(0, 3)), (b, slice(3, 6))):
        want = {"weight": _full_of("weight", 1)[rows], "bias": _full_of("bias", 1)[rows]}
        assert r["ema"] == {n: w.reshape(-1).tolist() for n, w in want.items()}
    corrupt = (
        rf"{path}: checksum mismatch in tensor 'emas\.1\.weight', bytes 0\.\.40 of the tensor: xxh3_64 [0-9a-f]{{16}}, "
        r"recorded [0-9a-f]{16}\. The file is corrupted: restore it from a copy or load an earlier tag \[rank 2 of 3, "
        r"parameter 'weight', EMA 1, tag 't'\]"
    )
    assert b["bad"][0] == "CorruptCheckpointError" and re.fullmatch(corrupt, b["bad"][1]), b["bad"]
    assert a["bad"][0] == "CorruptCheckpointError", a["bad"]
    assert re.fullmatch(r"load failed on rank 1 of 2 \(CorruptCheckpointError\): " + corrupt, a["bad"][1]), a["bad"]
    assert a["unverified"] == a["ema"]  # rank 0 reads none of the flipped chunk
    flipped = b["unverified"]["weight"]
    assert (
        flipped[10] != b["ema"]["weight"][10]
        and flipped[:10] + flipped[11:] == b["ema"]["weight"][:10] + b["ema"]["weight"][11:]
    )
    assert b["unverified"]["bias"] == b["ema"]["bias"]


def test_joined_reader_edge_cases(tmp_path: Path) -> None:
    from functional_ema._checkpoint.reader import JoinedReader

    root = tmp_path / "ck"
    _write(root, _tp(1), values=_tp_values)
    readers = open_parts(root, "t")
    with JoinedReader(list(reversed(readers))) as joined:  # the parts in any order: joined in tensor-parallel order
        assert torch.equal(_joined(joined, "w"), _full("w", 0)) and torch.equal(_joined(joined, "v"), _full("v", 0))
        assert torch.equal(_joined(joined, "b"), _full("b", 0))
    recorded = tmp_path / "recorded"  # a whole model whose engine records splits: nothing to join
    _write(recorded, [ShardLayout(0, 1, 3, _even(0, 1, TP_FULL), tp_dims=TP_DIMS)])
    with open_joined(recorded, "t", tp_dims={"w": 1, "v": 0, "b": None}) as joined:
        assert joined.shapes == TP_FULL and torch.equal(_joined(joined, "w"), _full("w", 0))
    for dims in ({"w": 1, "v": 1, "b": None}, None):  # the parts record other splits, or one records none
        mixed = tmp_path / f"mixed{dims is None}"
        layouts = [lay._replace(tp_dims=dims) if lay.part.tp else lay for lay in _tp(1)]
        _write(mixed, layouts, values=_tp_values)
        assert "how its slices join is unknown" in _msg(CheckpointMismatchError, lambda: open_joined(mixed, "t"))
        with open_joined(mixed, "t", tp_rank=0) as joined:
            assert torch.equal(_joined(joined, "w"), _full("w", 0)[:3])
    with open_joined(mixed, "t", tp_dims=TP_DIMS) as joined:  # the split given: as tensor-parallel rank 0 records
        assert all(torch.equal(_joined(joined, n), _full(n, 0)) for n in TP_FULL)
    assert _msg(CheckpointMismatchError, lambda: open_joined(mixed, "t", tp_dims={"w": 0})).startswith(
        "tp_dims= does not say how ['v', 'b'] join"  # one rank's record is no record of the split
    )
    half = tmp_path / "half"  # buffers saved by tensor-parallel rank 0 only
    _write(half, _tp(1), values=_tp_values, buffers=lambda lay: None if lay.part.tp else _bufs(lay))  # type: ignore[arg-type, return-value]
    with open_checkpoint(half, "t", True, ShardLayout(0, 1, 3, _even(0, 1, TP_FULL))) as ckpt:
        assert isinstance(ckpt, RecutReader) and not ckpt.has_buffers


def test_part_coverage_and_buffers_are_named_with_their_part(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    layouts = _tp(2)
    gap = layouts[3]  # tensor-parallel rank 1, data-parallel rank 1: 'b' from element 5 (element 4 in no file)
    layouts[3] = gap._replace(specs=dict(gap.specs, b=ShardSpec((7,), 5, 2)))
    _write(root, layouts, values=_tp_values, buffers=_bufs)
    mpath = root / "t" / MANIFEST_NAME
    assert _msg(IncompleteCheckpointError, lambda: open_parts(root, "t")) == (
        f"{mpath}: field 'parts[1].params' gives parameter 'b' the shape (7,), but the saved pieces cover only "
        "elements [0, 4) of 7; the manifest lists 2 rank file(s) of a world size of 2"
    )
    with CheckpointReader.open(root, "t", own=(1, 2, 3), part=ModelPart(1, 2)) as ckpt:
        assert _same_buffers(ckpt.read_buffers(1, 2), _bufs(layouts[3]))
        path = root / "t" / "buffers_tp001of002_pp000of001_rank_00001_of_00002.safetensors"
        path.unlink()
        assert _msg(IncompleteCheckpointError, lambda: ckpt.read_buffers(1, 2)) == (
            f"{path} (buffers of rank 1 of 2, tensor-parallel rank 1 of 2) is missing: restore it or load another tag"
        )


def test_recut_of_experts_bf16_and_verified_buffers(tmp_path: Path) -> None:
    moe = tmp_path / "moe"  # expert parallelism inside each tensor-parallel part
    dims = {"b": None, "e0": None, "e1": None}
    _write(moe, [lay._replace(part=ModelPart(t, 2), tp_dims=dims) for t in (0, 1) for lay in _moe()])
    plain = ShardLayout(
        0, 1, 3, {n: ShardSpec(s, 0, math.prod(s)) for n, s in (("b", (7,)), ("e0", (2, 3)), ("e1", (2, 3)))}
    )
    with open_checkpoint(moe, "t", True, plain) as ckpt:
        assert isinstance(ckpt, RecutReader) and ckpt.experts == {"ep_size": 2, "owners": {"e0": 0, "e1": 1}}
        assert "saved with expert-parallel size (ep_size) 2" in _msg(
            CheckpointMismatchError, lambda: ckpt.check_experts(plain)
        )
    bf16 = tmp_path / "bf16"
    _write(bf16, _tp(1), values=lambda lay, n, k: _tp_values(lay, n, k).to(torch.bfloat16), buffers=_bufs)
    with open_checkpoint(bf16, "t", True, ShardLayout(0, 1, 3, _even(0, 1, TP_FULL))) as ckpt:
        assert ckpt.dtype == torch.bfloat16
        out = torch.empty(24, dtype=torch.bfloat16)
        ckpt.fill(out, 1, "w", 0, 24, True)
        assert torch.equal(out, _full("w", 1).reshape(-1).to(torch.bfloat16))
        path = bf16 / "t" / "buffers_tp000of002_pp000of001_rank_00000_of_00001.safetensors"
        with _io.SafetensorsFile(path) as st:
            at = st.header_size + st.tensors["emas.0.bn.mean"].start
        _flip(path, at)
        assert "checksum mismatch in tensor 'emas.0.bn.mean'" in _msg(
            CorruptCheckpointError, lambda: ckpt.read_buffers(0, 1)
        )
        _, emas, _ = ckpt.read_buffers(0, 1, verify=False)
        assert not torch.equal(emas[0]["bn.mean"], _bufs(_tp(1)[0]).emas[0]["bn.mean"])


def test_joined_buffers_of_tensor_and_pipeline_parts(tmp_path: Path) -> None:
    """Buffers of a save split both ways: tensor-parallel rank 0's part of each pipeline stage, merged; checked
    by default, read as they are without verification."""
    from functional_ema._checkpoint.reader import JoinedReader

    root = tmp_path / "ck"
    layouts = []
    for pp, names in ((0, ("w", "b")), (1, ("v",))):
        for t in (0, 1):
            part = ModelPart(t, 2, pp, 2)
            local = {n: _tp_shapes(2)[n] for n in names}
            dims = {n: TP_DIMS[n] for n in names}
            layouts += [ShardLayout(r, 2, 3, _even(r, 2, local), part=part, tp_dims=dims) for r in range(2)]

    def bufs(lay: ShardLayout) -> BufferState:
        b = _bufs(lay._replace(rank=lay.rank + 3 * lay.part.tp))  # tensor-parallel rank 1's differ
        if lay.part.pp == 1:
            b.emas[0]["head.mean"] = torch.ones(2) * (lay.part.tp + 1)
            b.emas[1]["head.mean"] = torch.zeros(2)
        return b

    _write(root, layouts, values=_tp_values, buffers=bufs)
    with open_joined(root, "t") as joined:
        assert joined.shapes == TP_FULL
        assert all(torch.equal(_joined(joined, n, 1), _full(n, 1)) for n in TP_FULL)
        num, emas, copied = joined.read_buffers()
        assert num == 2 and torch.equal(emas[0]["head.mean"], torch.ones(2))  # stage 1, tensor-parallel rank 0
        assert torch.equal(emas[1]["bn.var"], _bufs(layouts[0]).emas[1]["bn.var"])  # stage 0 first
        assert torch.equal(copied["mask"], _bufs(layouts[0]).copied["mask"])
        path = root / "t" / "buffers_tp000of002_pp001of002_rank_00000_of_00002.safetensors"
        with _io.SafetensorsFile(path) as st:
            at = st.header_size + st.tensors["emas.0.head.mean"].start
        _flip(path, at)
        assert "checksum mismatch in tensor 'emas.0.head.mean'" in _msg(CorruptCheckpointError, joined.read_buffers)
        assert not torch.equal(joined.read_buffers(verify=False)[1][0]["head.mean"], torch.ones(2))
    tp = tmp_path / "tp"
    _write(tp, _tp(1), values=_tp_values, buffers=_bufs)
    with JoinedReader([r for r in open_parts(tp, "t") if r.part.tp == 1]) as one:  # tensor-parallel rank 0 left out
        assert torch.equal(_joined(one, "w"), _full("w", 0)[3:])
        assert _msg(CorruptCheckpointError, one.read_buffers) == (
            f"{tp / 't' / MANIFEST_NAME}: no part of tensor-parallel rank 0 holds buffers; the manifest is damaged"
        )


def test_buffer_file_size_is_the_manifests(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _zero3(2), buffers=_bufs)
    tag_dir = root / "t"
    m = _manifest(tag_dir)
    size = m["buffer_files"][1]["bytes"]
    m["buffer_files"][1]["bytes"] = size + 1
    _set_manifest(tag_dir, m)
    path = tag_dir / "buffers_rank_00001_of_00002.safetensors"
    with CheckpointReader.open(root, "t") as ckpt:
        assert _msg(CorruptCheckpointError, lambda: ckpt.read_buffers(1, 2, verify=False)) == (
            f"{path} (buffers of rank 1 of 2): {path} is truncated: {size} bytes, expected {size + 1}"
        )


def test_tp_dims_missing_are_listed_briefly(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shapes = {f"p{i}": (2, 2) for i in range(6)}
    layouts = [ShardLayout(0, 1, 3, _even(0, 1, shapes), part=ModelPart(t, 2)) for t in (0, 1)]
    _write(root, layouts)
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={})) == (
        "tp_dims= does not say how ['p0', 'p1', 'p2', 'p3' and 2 more] join; give a dimension (or None for a "
        "parameter replicated across tensor-parallel ranks) for each"
    )
    assert _msg(CheckpointMismatchError, lambda: open_joined(root, "t", tp_dims={"zz": 0})) == (
        "tp_dims names 'zz', which is not a parameter of tag 't' (it has ['p0', 'p1', 'p2', 'p3' and 2 more])"
    )


def test_the_manifests_checksum_algorithm_is_used(tmp_path: Path) -> None:
    """Every file of a save recorded with CRC-32 checksums (the manifest names its algorithm): verified with it."""
    import re

    root = tmp_path / "ck"
    shapes = dict(SHAPES, x=(2 * PC + 6,))  # a piece of a chunk and 3 elements on each rank
    _write(root, _zero3(2, shapes), buffers=_bufs)
    tag_dir = root / "t"
    m = _manifest(tag_dir)
    m["checksum"] = "crc32"
    _set_manifest(tag_dir, m)
    for key in ("files", "buffer_files"):
        for i in (0, 1):
            _rewrite(tag_dir, i, lambda t, meta: None, key, algo="crc32")
    assert len(_manifest(tag_dir)["files"][0]["header_checksum"]) == 8
    with CheckpointReader.open(root, "t") as ckpt:
        assert [f.algo for f in ckpt.files] == ["crc32", "crc32"]
        assert torch.equal(_read(ckpt, "w", 0, 30, k=1), _ref("w", k=1))
        assert _same_buffers(ckpt.read_buffers(1, 2), _bufs(_zero3(2)[1]))
        x = _ref("x", shapes["x"], 1)
        assert torch.equal(_read(ckpt, "x", PC + 3, PC, k=1), x[PC + 3 : 2 * PC + 3])  # whole chunks of rank 1's
        assert torch.equal(_read(ckpt, "x", 5, 95, k=1), x[5:100])  # a part of a chunk, read through its chunk
        assert torch.equal(_read(ckpt, "x", 0, 2 * PC + 6, k=1), x)
        path = tag_dir / "buffers_rank_00001_of_00002.safetensors"
        with _io.SafetensorsFile(path) as st:
            at = st.header_size + st.tensors["emas.1.bn.mean"].start
        _flip(path, at)
        assert re.fullmatch(
            rf"{path}: checksum mismatch in tensor 'emas\.1\.bn\.mean', bytes 0\.\.16 of the tensor: crc32 "
            r"[0-9a-f]{8}, recorded [0-9a-f]{8}\. The file is corrupted: restore it from a copy or load an earlier tag "
            r"\[buffers of rank 1, tag 't'\]",
            _msg(CorruptCheckpointError, lambda: ckpt.read_buffers(1, 2)),
        )


def test_joined_reader_of_three_tensor_parallel_ranks(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _write(root, _tp(2, tp_size=3), values=_tp_values)
    with open_joined(root, "t") as joined:
        assert joined.shapes == TP_FULL
        assert all(torch.equal(_joined(joined, n, 1), _full(n, 1)) for n in TP_FULL)
        path = root / "t" / "ema_tp002of003_pp000of001_rank_00001_of_00002.safetensors"
        _flip(path, _data_at(path, "emas.0.v", 1))  # a slice of a split parameter: verified as it is joined
        assert "checksum mismatch in tensor 'emas.0.v'" in _msg(CorruptCheckpointError, lambda: _joined(joined, "v"))
        got = torch.full((24,), float("nan"))
        joined.fill(got, 0, "v", 0, 24, False)
        assert (got != _full("v", 0).reshape(-1)).sum() == 1


def test_open_checkpoint_passes_its_arguments_on_every_path(tmp_path: Path) -> None:
    """The tag, verify and part given reach every way a reader is opened: 'a' is read though 'ema_latest' names
    'b', and a damaged header of 'a' is refused unless verify=False."""
    root, mp = tmp_path / "ck", tmp_path / "mp"
    for tag in ("a", "b"):
        _write(root, _zero3(2), tag=tag)
        _write(mp, _tp(2), tag=tag, values=_tp_values)
    for path in (root / "a" / _rank_file(1, 2), mp / "a" / "ema_tp001of002_pp000of001_rank_00000_of_00002.safetensors"):
        _flip(path, path.read_bytes().index(b"functional_ema ", 8))
    damaged = "the header does not match the checksum in the manifest"
    whole = ShardLayout(0, 1, 3, _even(0, 1, TP_FULL))
    for opened in (
        lambda verify: open_checkpoint(root, "a", verify),
        lambda verify: open_checkpoint(root, "a", verify, _zero3(2)[1]),  # its own file
        lambda verify: open_checkpoint(root, "a", verify, _zero3(3)[2]),  # the files its pieces are in
        lambda verify: open_checkpoint(mp, "a", verify, part=ModelPart(1, 2)),
        lambda verify: open_checkpoint(mp, "a", verify, whole),  # re-cut from the joined parts
    ):
        assert damaged in _msg(CorruptCheckpointError, lambda: opened(True))
        with opened(False) as ckpt:
            assert ckpt.tag == "a"
    assert damaged in _msg(CorruptCheckpointError, lambda: open_checkpoint(root, "a"))  # verified by default
    assert damaged in _msg(CorruptCheckpointError, lambda: open_checkpoint(root, "a", layout=_zero3(2)[1]))
    with open_checkpoint(mp, "a", False, part=ModelPart(1, 2)) as ckpt:
        assert ckpt.part == ModelPart(1, 2)
        assert torch.equal(_read(ckpt, "w", 0, 12, verify=False), _full("w", 0)[3:].reshape(-1))


def test_reader_attributes(tmp_path: Path) -> None:
    from functional_ema._checkpoint.format import manifest_parts

    root = tmp_path / "ck"
    _write(root, _tp(2), values=_tp_values)
    m = _manifest(root / "t")
    with CheckpointReader.open(root, "t", part=ModelPart(1, 2)) as ckpt:
        assert ckpt.parts == manifest_parts(m) and ckpt.part_manifest == ckpt.parts[1]
        assert (ckpt.step, ckpt.num_emas, ckpt.dtype, ckpt.world_size, ckpt.stage) == (STEP, 2, torch.float32, 2, 3)
    bare = CheckpointReader(root, "t", root / "t", m, [])  # no part named: the manifest's first
    assert bare.part == ModelPart(0, 2) and bare.part_manifest == manifest_parts(m)[0] and bare.pieces["w"] == []
    assert bare.partial is False  # set by whoever opens files for it


def test_format4_checksum_lists(tmp_path: Path) -> None:
    """A manifest of format 4 lists each rank file's checksums per tensor: read and verified as such; a list
    that names other tensors than the file holds is refused; a reader opened unverified holds none."""
    root = tmp_path / "ck"
    _write(root, _zero3(2))
    tag_dir = root / "t"
    m = _manifest(tag_dir)
    m["format_version"] = 4
    for e in m["files"]:
        with _io.SafetensorsFile(tag_dir / e["file"]) as st:
            sums = split_chunk_checksums(
                tag_dir / MANIFEST_NAME, "", e.pop("chunk_checksums"), "xxh3_64", st.tensors, ""
            )
        e["tensor_checksums"] = {k: [_io.format_checksum("xxh3_64", v) for v in vs] for k, vs in sums.items()}
    _set_manifest(tag_dir, m)
    with CheckpointReader.open(root, "t") as ckpt:
        assert sorted(ckpt.files[1].crcs) == ["emas.0.b", "emas.0.w", "emas.1.b", "emas.1.w"]
        assert torch.equal(_read(ckpt, "w", 0, 30, k=1), _ref("w", k=1))
    with CheckpointReader.open(root, "t", verify=False) as ckpt:
        assert [f.crcs for f in ckpt.files] == [{}, {}]
        assert "the manifest has no checksum for tensor 'emas.0.w'" in _msg(
            CorruptCheckpointError, lambda: _read(ckpt, "w", 0, 3)
        )
    del m["files"][1]["tensor_checksums"]["emas.1.b"]
    _set_manifest(tag_dir, m)
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader.open(root, "t")) == (
        f"{_where(tag_dir, 1, 2)}: the manifest's checksums name other tensors than the file holds"
    )
    with CheckpointReader.open(root, "t", verify=False) as ckpt:
        assert torch.equal(_read(ckpt, "b", 0, 7, k=1, verify=False), _ref("b", k=1))


def test_checks_behind_the_manifest_schema_name_what_they_refuse(tmp_path: Path) -> None:
    """The dtype and checksum algorithm that validate_manifest vouches for are checked again where they are used,
    and still name what they refuse when a manifest edited in memory gets past it: a reader built from it, a part
    opened from it, the buffers of a reader holding it, a parts list cut short. Unverified reads never look at
    the checksums, whatever their algorithm."""
    from functional_ema._checkpoint.format import manifest_parts

    root = tmp_path / "ck"
    layouts = _zero3(2)
    _write(root, layouts, buffers=_bufs)
    tag_dir = root / "t"
    m = _manifest(tag_dir)
    m["dtype"] = "int8"
    assert _msg(CorruptCheckpointError, lambda: CheckpointReader(root, "t", tag_dir, m, [])) == (
        f"{tag_dir / MANIFEST_NAME}: unknown EMA dtype 'int8'"
    )

    def open_part(root: Path, m: dict, verify: bool) -> CheckpointReader:  # as open_checkpoint opens a part
        return CheckpointReader._for_part(root, "t", root / "t", m, manifest_parts(m)[0], verify, None)

    m = locate_checkpoint(root, "t")[3]
    m["checksum"] = "md5"
    unknown = (
        f": the manifest's checksums use 'md5', which this functional_ema ({library_version()}) cannot compute (it "
        "knows ['crc32', 'xxh3_64']). Upgrade functional_ema, or load with verify=False"
    )
    assert _msg(CheckpointVersionError, lambda: open_part(root, m, True)) == _where(tag_dir, 0, 2) + unknown
    bpath = tag_dir / "buffers_rank_00001_of_00002.safetensors"
    with open_part(root, m, False) as ckpt:
        assert torch.equal(_read(ckpt, "w", 0, 30, k=1, verify=False), _ref("w", k=1))
        assert _msg(CheckpointVersionError, lambda: ckpt.read_buffers(1, 2)) == (
            f"{bpath} (buffers of rank 1 of 2)" + unknown
        )
        assert _same_buffers(ckpt.read_buffers(1, 2, verify=False), _bufs(layouts[1]))
    _rewrite(tag_dir, 1, lambda t, meta: meta.update(dtype="int8"), "buffer_files")
    with CheckpointReader.open(root, "t") as ckpt:
        ckpt.part_manifest["buffers"]["dtype"] = "int8"  # as the file says now
        assert _msg(CorruptCheckpointError, lambda: ckpt.read_buffers(1, 2)) == (
            f"{bpath} (buffers of rank 1 of 2): unknown EMA dtype 'int8'"
        )
    odd = tmp_path / "int8"  # a rank file and a manifest that agree on a dtype no EMA has
    _write(odd, _zero3(1), meta=lambda lay, meta: meta.update(dtype="int8"))
    m = locate_checkpoint(odd, "t")[3]
    m["dtype"] = "int8"
    assert _msg(CorruptCheckpointError, lambda: open_part(odd, m, True)) == (
        f"{_where(odd / 't', 0, 1)}: unknown EMA dtype 'int8'"
    )
    mp = tmp_path / "mp"
    _write(mp, _tp(1), values=_tp_values)
    m = _manifest(mp / "t")
    m["parts"] = m["parts"][:1]  # one part left of two: still described as saved with tensor parallelism
    assert _msg(CheckpointMismatchError, lambda: CheckpointReader._select(mp / "t", m, ModelPart(0, 3))) == (
        f"{mp / 't' / MANIFEST_NAME}: the EMA was saved with tensor-parallel size 2 x pipeline size 1, and holds no "
        "part for tensor-parallel rank 0 of 3 of this run: the model-parallel layout changed"
    )


def test_only_private_folders_are_checked_for_this_ranks_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_local (a private save's folder must hold the files this rank reads) runs for local=True only, on the
    files that rank opens; the shared folder's files were all checked when the manifest was read."""
    root = tmp_path / "ck"
    layouts = _zero3(2)
    _write(root, layouts)
    calls: list[list[int]] = []
    real = reader.check_local

    def spy(tag_dir: Path, part: dict, entries: list[dict]) -> None:
        calls.append([e["rank"] for e in entries])
        real(tag_dir, part, entries)

    monkeypatch.setattr(reader, "check_local", spy)
    CheckpointReader.open(root, "t").close()
    for r in open_parts(root, "t"):
        r.close()
    open_checkpoint(root, "t", True, layouts[1]).close()
    assert calls == []
    open_checkpoint(root, "t", True, layouts[1], local=True).close()
    assert calls == [[1]]


def test_joined_reader_sources(tmp_path: Path) -> None:
    """Each output tensor's sources: every tensor-parallel rank's slice of a split parameter, along its dimension;
    tensor-parallel rank 0's copy alone of a replicated one."""
    root = tmp_path / "ck"
    _write(root, _tp(1), values=_tp_values)
    with open_joined(root, "t") as joined:
        r0, r1 = sorted(joined.readers, key=lambda r: r.part.tp)
        assert joined.sources == {
            "w": ([(r0, (3, 4)), (r1, (3, 4))], 0),
            "v": ([(r0, (4, 3)), (r1, (4, 3))], 1),
            "b": ([(r0, (7,))], None),
        }
