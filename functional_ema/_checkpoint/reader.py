"""Reading a saved EMA checkpoint: :class:`CheckpointReader` validates the manifest and the rank
files' headers, then fills any range of any parameter of any EMA from the saved pieces, verifying
checksums. ``load``, ``consolidate`` and post-hoc EMA all read through it (:func:`open_checkpoint`).

A checkpoint is a local folder or an fsspec URL (``s3://bucket/run/ckpt``). At a URL it is read through the
storage seam (``functional_ema._storage``) with ranged reads, nothing copied: the pointer file (``latest``,
then ``ema_latest``) and the manifest by their exact names, the manifest validated before anything else;
then, of each rank file a reader opens, its size, prefix and header, and later exactly the byte ranges of
the pieces filled (each verified against the manifest's checksums). Nothing is listed, so a listing that
lags a write changes nothing. Where a local folder is named by a ``Path``, a URL's files are named by a
:class:`StoragePath` (a ``str``, the URL, carrying its storage and relative path).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from .. import _io
from .._args import check_bool, check_int, check_location, check_optional_int, check_path
from .._layout import ModelPart, ShardLayout, ShardSpec
from .._storage import FsspecStorage, Storage, is_url, storage_for
from . import index
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidTagError,
)
from .format import (
    _MAX_LATEST_BYTES,
    BUFFERS_FORMAT,
    FILE_FORMAT,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    RANK_FILE,
    _tag_problem,
    brief,
    check_json_metadata,
    check_tag,
    check_tensor_checksums,
    complete_tags,
    dtype_name,
    file_checksums,
    library_version,
    manifest_parts,
    parse_dtype,
    parse_layout,
    read_latest,
    short_list,
    split_chunk_checksums,
    tensor_key,
    uses_compact_checksums,
    validate_manifest,
)

__all__ = [
    "CheckpointReader",
    "JoinedReader",
    "RecutReader",
    "locate_checkpoint",
    "open_checkpoint",
    "open_parts",
    "open_joined",
    "untied_copies",
    "fill_all",
    "StoragePath",
]

#: A save's module buffers as read back: ``(num_emas, emas, copied)``; ``emas[k]`` maps a floating buffer's
#: name to EMA ``k`` of it, ``copied`` each non-floating buffer's name to its value.
BufferTensors = tuple[int, tuple[dict[str, torch.Tensor], ...], dict[str, torch.Tensor]]


class StoragePath(str):
    """A file or folder of a :class:`~functional_ema._storage.Storage`, as a ``str``: its URL (what messages
    show). ``store`` and ``rel`` (relative to the store's root; ``""``: the root) are what reads use;
    ``/``, ``name`` and ``parent`` work as a ``Path``'s do."""

    store: Storage
    rel: str

    def __new__(cls, store: Storage, rel: str = "") -> StoragePath:
        self = super().__new__(cls, store.describe(rel) if rel else store.location.rstrip("/"))
        self.store, self.rel = store, rel
        return self

    def __truediv__(self, name: str) -> StoragePath:
        return StoragePath(self.store, f"{self.rel}/{name}" if self.rel else name)

    @property
    def name(self) -> str:
        return self.rstrip("/").rpartition("/")[2]

    @property
    def parent(self) -> StoragePath:
        if self.rel:
            return StoragePath(self.store, self.rel.rpartition("/")[0])
        up = self.rstrip("/").rpartition("/")[0]
        if up.endswith(":/"):  # the bucket itself: the checkpoint folder is the bucket's root
            return self
        store = self.store
        return StoragePath(FsspecStorage(up, fs=store.fs) if isinstance(store, FsspecStorage) else storage_for(up))

    def source(self) -> tuple[Storage, str]:
        """The byte source :class:`functional_ema._io.SafetensorsFile` reads."""
        return self.store, self.rel

    def size(self) -> int | None:
        """The file's size, asked of the storage now by its exact name (a HEAD); None when no file is there."""
        return self.store.file_size(self.rel)


#: Where a checkpoint's files are: a local folder (``Path``) or a folder of a storage (``StoragePath``).
Location = Path | StoragePath


def _as_path(p: Location) -> Path:
    """``p`` where a helper of ``format`` takes a ``Path``: those only name the file in their messages."""
    return cast(Path, p)


def _file_source(p: Location) -> Path | tuple[Storage, str]:
    return p.source() if isinstance(p, StoragePath) else p


def _file_size(p: Location) -> int | None:
    """The size of the file at ``p``; None when no file is there (a folder is not one)."""
    if isinstance(p, StoragePath):
        return p.size()
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _pointed_tag(root: StoragePath) -> str:
    """The tag the pointer file at ``root`` names (``latest`` first, as DeepSpeed's wins), read by its exact
    name with the local reader's rules: one plain tag name, at most a few KiB, never echoed."""
    for name in ("latest", LATEST_NAME):
        pointer = root / name
        size = pointer.size()
        if size is None:
            continue
        if size > _MAX_LATEST_BYTES:
            raise InvalidTagError(f"{pointer} holds {size} bytes, not one tag name: pass tag=...")
        try:
            tag = pointer.store.read_range(pointer.rel, 0, size).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise InvalidTagError(f"{pointer} is not UTF-8 text, so it names no tag: pass tag=...") from None
        except EOFError:
            raise CheckpointNotFoundError(f"{pointer} changed while it was read: load again, or pass tag=...") from None
        if not tag:
            raise CheckpointNotFoundError(f"{pointer} is empty (a crash while it was written?): pass tag=...")
        problem = _tag_problem(tag)
        if problem is not None:
            raise InvalidTagError(
                f"{pointer} does not name a tag folder of {root}: its content {problem}. Tags are looked up only "
                "inside the checkpoint directory; pass tag=... (or --tag)"
            )
        return tag
    raise CheckpointNotFoundError(
        f"checkpoint directory {root} has no 'latest' file (DeepSpeed writes it in save_checkpoint) nor "
        f"{LATEST_NAME!r} (functional_ema.save writes it), nor is it a tag folder (no ema_manifest.json): pass tag=..."
    )


def _tags_here(root: Path) -> list[str]:
    """The tags a refusal lists: the complete ones, never a pointer name (``ema_latest`` made a link to a tag folder
    would otherwise be listed as a tag)."""
    return [t for t in complete_tags(root) if t not in ("latest", LATEST_NAME)]


def _refuse_given_tag_folder(root: Path, tag: str | None) -> None:
    """Refuse, saying so, a tag folder given where its root was looked for (it holds a manifest or EMA rank files
    itself), rather than as a root missing ``latest`` or tag ``tag``: with ``tag``, the folder is that tag's own (drop
    it) or another's (give the root); without, its manifest is missing (the save is in progress or was interrupted),
    as the refusal reached through its root says. Returns for any other folder."""
    try:
        found = sorted(p.name for p in root.iterdir() if RANK_FILE.match(p.name))
    except OSError:
        return
    has_manifest = (root / MANIFEST_NAME).is_file()
    if tag is not None and (has_manifest or found):
        with_tag = f"with --tag {tag} (tag={tag!r})"
        if tag == root.name:
            whose = "itself the tag folder of that tag"
            fix = f"drop tag=... (--tag) to read it, or give its root {root.parent} {with_tag}"
        else:
            whose, fix = (
                f"itself a tag folder (of tag {root.name!r})",
                f"give the checkpoint's root {root.parent} {with_tag}",
            )
        raise CheckpointNotFoundError(
            f"no tag {tag!r} in {root}: the folder given is {whose}, not a checkpoint directory holding tag folders; "
            f"{fix}"
        )
    if tag is None and found and not has_manifest:
        raise IncompleteCheckpointError(
            f"{root} is a tag folder with no complete EMA checkpoint: found {len(found)} EMA rank file(s) "
            f"{short_list(found, 4)} but the manifest, written last, is missing (the save of tag {root.name!r} is in "
            f"progress or was interrupted). Load another tag; tags beside it in {root.parent} with a complete EMA: "
            f"{[t for t in _tags_here(root.parent) if t != root.name]}"
        )


def _pointer_folder(folder: Path | None) -> str:
    """A refusal's note on a pointer name (``latest``/``ema_latest``) that is a folder or a link to one."""
    if folder is None:
        return ""
    link = " (a link to a folder)" if folder.is_symlink() else ""
    return f"; {folder.name!r} here is a folder{link}, not the pointer file naming a tag (replace it with that file)"


def _missing_files(tag: str, tag_dir: Location, missing: list[tuple[dict, dict]]) -> IncompleteCheckpointError:
    """The refusal of a tag whose manifest lists files (``(file record, part)``) that are not there."""
    listed = ", ".join(
        f"{e['file']} (rank {e['rank']} of {p['world_size']}"
        + ("" if p["part"].whole else f", {p['part'].describe()}")
        + ")"
        for e, p in missing[:4]
    )
    return IncompleteCheckpointError(
        f"tag {tag!r} in {tag_dir.parent} is missing {len(missing)} file(s) listed in its manifest: {listed}. "
        "The folder was copied or pruned partially: restore the file(s) or load another tag (a save with "
        "shared=False into each rank's own folder: load it with shared=False, or merge the folders first)"
    )


def _check_inside(path: Location, tag_dir: Location, where: str, fix: str = "") -> None:
    """A local file that is a link to a file outside its tag folder is never followed (a storage's relative paths
    are confined by the storage itself)."""
    if isinstance(path, Path) and isinstance(tag_dir, Path) and path.resolve().parent != tag_dir.resolve():
        raise CorruptCheckpointError(
            f"{where} is a link to a file outside the tag folder {tag_dir}; functional_ema reads only its own "
            f"files inside the tag folder{fix}"
        )


class RankFile:
    def __init__(
        self,
        rank: int,
        st: _io.SafetensorsFile,
        layout: ShardLayout,
        crcs: dict[str, list[int]],
        algo: str = _io.CHECKSUM,
    ) -> None:
        self.rank, self.st, self.layout, self.crcs, self.algo = rank, st, layout, crcs, algo


class CheckpointReader:
    """An opened, validated checkpoint: the manifest and the headers of the rank files opened (every
    one, or this rank's only with ``open(..., own=...)``). Nothing loaded yet; made by :func:`open_checkpoint`.

    A model split by tensor or pipeline parallelism is saved as several parts (:class:`ModelPart`);
    a reader reads one of them (``part``), and :func:`open_parts` opens them all.

    What readers use: ``tag``, ``root``, ``tag_dir``, ``manifest`` (validated), ``step``,
    ``num_emas``, ``dtype``, ``part``, ``parts`` (every part's manifest entry), ``world_size``,
    ``stage``, ``shapes`` (parameter name -> full shape, in this part), ``tp_dims``;
    :meth:`fill` (any element range of any parameter of any EMA, checksums verified),
    :meth:`check_index`, :meth:`check_model`, :meth:`close` (or a ``with`` block).
    """

    def __init__(
        self,
        root: Location,
        tag: str,
        tag_dir: Location,
        manifest: dict,
        files: list[RankFile],
        part: dict | None = None,
    ) -> None:
        self.root, self.tag, self.tag_dir, self.manifest, self.files = root, tag, tag_dir, manifest, files
        self.partial = False  # True when only some rank files were opened (see open's ``own``)
        self.parts = manifest_parts(manifest)
        entry = part if part is not None else self.parts[0]
        self.part_manifest = entry
        self.part: ModelPart = entry["part"]
        self.step = int(manifest["step"])
        self.num_emas = int(manifest["num_emas"])
        self.dtype = parse_dtype(manifest["dtype"], str(tag_dir / MANIFEST_NAME))
        self.world_size = int(entry["world_size"])
        self.stage = int(entry["zero_stage"])
        self.tp_dims = entry.get("tp_dims")
        self.experts: dict | None = entry.get("experts")  # {"ep_size", "owners"} under expert parallelism
        self.shapes = {n: tuple(int(x) for x in s) for n, s in entry["params"].items()}
        self.pieces: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.shapes}
        for i, f in enumerate(files):
            for n, spec in f.layout.specs.items():
                if spec.numel:
                    self.pieces[n].append((spec.offset, spec.numel, i))
        for p in self.pieces.values():
            p.sort()
        # {name read: name saved} for a checkpoint of a compiled model saved under the wrapper's names (see rename)
        self._saved_as: dict[str, str] = {}
        self._ddp_inside = False

    # -- opening

    @classmethod
    def open(
        cls,
        checkpoint_dir: str | os.PathLike,
        tag: str | None,
        verify: bool = True,
        own: tuple[int, int, int] | None = None,
        part: ModelPart | None = None,
    ) -> CheckpointReader:
        """Open and validate the manifest and the rank files' headers of one part.

        ``part``: which model-parallel part to read (``None``: the only one; a checkpoint of several
        parts then refuses, naming them: read them with :meth:`open_parts`). ``own=(rank, world_size,
        stage)``: when that part was saved at that world size and stage and has a file of that rank,
        open that file only (``partial`` is then True and coverage is the caller's to check, see
        :meth:`holds`). A rank then reads one header instead of all ``world_size`` of them; the other
        ranks open their own files, and a bad one is reported on every rank by the collective's agreement.
        """
        check_bool(verify, "verify")
        root, tag, tag_dir, manifest = cls._locate(checkpoint_dir, tag)
        return cls._for_part(root, tag, tag_dir, manifest, cls._select(tag_dir, manifest, part), verify, own)

    @classmethod
    def open_parts(
        cls, checkpoint_dir: str | os.PathLike, tag: str | None, verify: bool = True
    ) -> list[CheckpointReader]:
        """One reader per model-parallel part (one for a whole model), from one reading of the manifest."""
        check_bool(verify, "verify")
        root, tag, tag_dir, manifest = cls._locate(checkpoint_dir, tag)
        readers: list[CheckpointReader] = []
        try:
            for entry in manifest_parts(manifest):
                readers.append(cls._for_part(root, tag, tag_dir, manifest, entry, verify, None))
        except BaseException:
            for r in readers:
                r.close()
            raise
        return readers

    @classmethod
    def _select(cls, tag_dir: Location, manifest: dict, part: ModelPart | None) -> dict:
        parts = manifest_parts(manifest)
        if part is None and len(parts) == 1:
            return parts[0]
        found = [p for p in parts if p["part"] == (part if part is not None else ModelPart())]
        if found:
            return found[0]
        saved = f"tensor-parallel size {parts[0]['part'].tp_size} x pipeline size {parts[0]['part'].pp_size}"
        if part is None:
            raise CheckpointMismatchError(
                f"{tag_dir / MANIFEST_NAME}: this checkpoint holds {len(parts)} model-parallel parts ({saved}); a reader "
                "of one part must name it (functional_ema.load does, from the engine), the offline tools read them all"
            )
        raise CheckpointMismatchError(
            f"{tag_dir / MANIFEST_NAME}: the EMA was saved with {saved if len(parts) > 1 or not parts[0]['part'].whole else 'no model parallelism'}, "
            f"and holds no part for {part.describe()} of this run: the model-parallel layout changed"
        )

    @classmethod
    def _locate(
        cls, checkpoint_dir: str | os.PathLike, tag: str | None, local: bool = False
    ) -> tuple[Location, str, Location, dict]:
        """(root, tag, tag folder, validated manifest), following ``latest`` / ``ema_latest`` for ``tag=None``;
        every file the manifest lists must exist, unless ``local`` (a private save's folder: the files this
        rank reads are checked when it opens them, :func:`check_local`)."""
        if isinstance(checkpoint_dir, str) and is_url(checkpoint_dir):  # a StoragePath is one too
            if not isinstance(checkpoint_dir, StoragePath):  # a plain URL, checked here too: not every verb does
                checkpoint_dir = cast("str", check_location(checkpoint_dir, "checkpoint_dir"))
            return cls._locate_url(checkpoint_dir, tag)
        root = check_path(checkpoint_dir, "checkpoint_dir")
        if root.is_file():
            cls._not_a_directory(root)
        if not root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
        from_latest = False
        if tag is None and (root / MANIFEST_NAME).is_file():  # handed the tag folder itself
            tag_dir, tag, root = root, root.name, root.parent
        else:
            if tag is None:
                latest = root / "latest"  # DeepSpeed's, written after its own save: it wins when present
                if not latest.is_file():
                    latest = root / LATEST_NAME  # ours, written by save() once a tag is complete
                if not latest.is_file():
                    _refuse_given_tag_folder(root, None)
                    odd = next((p for p in (root / "latest", latest) if p.is_dir()), None)
                    raise CheckpointNotFoundError(
                        f"{root} has no 'latest' file (DeepSpeed writes it in save_checkpoint) nor {LATEST_NAME!r} "
                        f"(functional_ema.save writes it){_pointer_folder(odd)}: pass tag=... "
                        f"Tags here with a complete EMA: {_tags_here(root)}"
                    )
                tag = read_latest(root, latest)
                if not tag:
                    raise CheckpointNotFoundError(
                        f"{latest} is empty (a crash while DeepSpeed wrote it?): pass tag=... "
                        f"Tags here with a complete EMA: {_tags_here(root)}"
                    )
                from_latest = True
            tag = check_tag(tag, saving=False)
            tag_dir = root / tag
            if not tag_dir.is_dir():
                _refuse_given_tag_folder(root, tag)
                raise CheckpointNotFoundError(
                    f"no tag {tag!r} in {root}{f' (named by {latest.name})' if from_latest else ''}. "
                    f"Tags here with a complete EMA: {_tags_here(root)}"
                )
        mpath = tag_dir / MANIFEST_NAME
        if not mpath.is_file():
            found = sorted(p.name for p in tag_dir.iterdir() if RANK_FILE.match(p.name))
            what = (
                f"found {len(found)} EMA rank file(s) {short_list(found, 4)} but the manifest, written last, is missing"
                if found
                else "there are no EMA files at all (was functional_ema.save called for this tag?)"
            )
            hint = ""
            if from_latest and latest.name == "latest":
                hint = (
                    " 'latest' names this tag: DeepSpeed finished its save but the EMA save did not (call "
                    "functional_ema.save before engine.save_checkpoint to avoid this)."
                )
            elif from_latest:  # written by save() only once the tag's manifest was in place: removed since
                hint = (
                    f" {LATEST_NAME!r} names this tag (functional_ema.save writes it once a tag is complete), so the "
                    "tag's manifest was removed or the folder copied or pruned partially since."
                )
            raise IncompleteCheckpointError(
                f"tag {tag!r} in {root} has no complete EMA checkpoint: {what}.{hint} Load another tag; "
                f"tags here with a complete EMA: {[t for t in _tags_here(root) if t != tag]}"
            )
        manifest = cls._read_manifest(mpath)
        if local:
            return root, tag, tag_dir, manifest
        cls._check_present(tag, tag_dir, manifest)
        return root, tag, tag_dir, manifest

    @classmethod
    def _check_present(cls, tag: str, tag_dir: Location, manifest: dict) -> None:
        missing = [
            (e, p)
            for p in manifest_parts(manifest)
            for e in p["files"] + (p.get("buffer_files") or [])
            if _file_size(tag_dir / e["file"]) is None
        ]
        if missing:
            raise _missing_files(tag, tag_dir, missing)

    @classmethod
    def _locate_url(cls, location: str | StoragePath, tag: str | None) -> tuple[Location, str, Location, dict]:
        """:meth:`_locate` of a checkpoint at a URL: the pointer files and the manifest read by their exact names
        (nothing listed); the files the manifest lists are checked when a reader opens them (one request each for
        the files it reads, not one per file of the save on every rank)."""
        root = location if isinstance(location, StoragePath) else StoragePath(storage_for(location))
        from_latest = False
        if tag is None and (root / MANIFEST_NAME).size() is not None:  # handed the tag folder itself
            tag, root = root.name, root.parent
        elif tag is None:
            tag, from_latest = _pointed_tag(root), True
        tag = check_tag(tag, saving=False)
        tag_dir = root / tag
        mpath = tag_dir / MANIFEST_NAME
        size = mpath.size()
        if size is None:  # without a listing, a tag never saved and one whose save did not finish look alike
            hint = " 'latest' names this tag: its EMA save did not finish; load another tag" if from_latest else ""
            raise CheckpointNotFoundError(
                f"checkpoint directory {root}: no complete EMA checkpoint of tag {tag!r} there ({mpath} does not "
                f"exist; the manifest is written last){hint}"
            )
        manifest = cls._parse_manifest(mpath, size, lambda: mpath.store.read_range(mpath.rel, 0, size))
        return root, tag, tag_dir, manifest

    @classmethod
    def _for_part(
        cls,
        root: Location,
        tag: str,
        tag_dir: Location,
        manifest: dict,
        entry: dict,
        verify: bool,
        own: tuple[int, int, int] | None,
        need: dict[str, ShardSpec] | None = None,
        local: bool = False,
    ) -> CheckpointReader:
        """A reader of one part: of its file of rank ``own[0]`` alone when it was saved at that world size and
        stage (``own``), else of the files holding ``need``'s pieces when the manifest has a piece index, else
        of every file."""
        entries = entry["files"]
        cuts = entry.get(index.FIELD)
        if own is not None and (int(entry["world_size"]), int(entry["zero_stage"])) == own[1:]:
            entries = [e for e in entries if e["rank"] == own[0]] or entries
        elif need is not None and cuts is not None:
            ranks = index.ranks_needed(cuts, entry["params"], ((n, s.offset, s.numel) for n, s in need.items()))
            if ranks is not None:  # one file at least: its header is checked even when this rank reads nothing
                entries = [e for e in entries if e["rank"] in ranks] or entries[:1]
        if local:
            check_local(tag_dir, entry, entries)
        files = cls._open_files(tag, tag_dir, manifest, entry, verify, entries)
        ckpt = cls(root, tag, tag_dir, manifest, files, entry)
        ckpt.partial = len(entries) < len(entry["files"])
        if not ckpt.partial:
            ckpt._check_coverage()
        return ckpt

    @staticmethod
    def _not_a_directory(path: Path) -> None:
        with open(path, "rb") as f:
            head = f.read(8)
        if _io.looks_like_pickle(head):
            raise CorruptCheckpointError(
                f"{path} is a pickle / torch.save file. functional_ema never unpickles (loading a pickle can run "
                "arbitrary code); pass the checkpoint directory (the one holding 'latest' and the tag folders)"
            )
        if path.name == MANIFEST_NAME:
            raise CheckpointError(
                f"{path} is a manifest: pass its folder, {path.parent}, or the checkpoint directory with tag="
            )
        raise CheckpointError(
            f"{path} is a file: pass the checkpoint directory (the one holding 'latest' and the tag folders)"
        )

    @classmethod
    def _read_manifest(cls, mpath: Path) -> dict:
        return cls._parse_manifest(mpath, mpath.stat().st_size, mpath.read_bytes)

    @staticmethod
    def _parse_manifest(mpath: Location, size: int, read: Callable[[], bytes]) -> dict:
        """The manifest of ``size`` bytes that ``read()`` returns, validated (its size checked before the read)."""
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{mpath} holds {size} bytes, far more than any manifest: it is damaged; load another tag"
            )
        try:
            raw = read()
        except EOFError:  # replaced by a shorter object between its size and its read
            raise CorruptCheckpointError(f"{mpath} changed while it was read: load again, or another tag") from None
        if _io.looks_like_pickle(raw[:8]):
            raise CorruptCheckpointError(
                f"{mpath} is a pickle, not JSON; functional_ema never unpickles. The manifest is damaged"
            )
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise CorruptCheckpointError(
                f"{mpath} is not valid JSON ({why}): the manifest is damaged; load another tag"
            ) from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise CorruptCheckpointError(
                f"{mpath} is not a functional_ema manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})"
            )
        version = manifest.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CorruptCheckpointError(f"{mpath}: bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise CheckpointVersionError(
                f"{mpath} was written by a newer functional_ema ({manifest.get('library', '?')}, format version {version}); "
                f"this one ({library_version()}) reads format version {FORMAT_VERSION} and older. Upgrade functional_ema "
                "(pip install -U functional-ema)"
            )
        required = ("tag", "generation", "step", "num_emas", "dtype") + (
            () if manifest.get("parts") is not None else ("world_size", "zero_stage", "params", "files")
        )
        missing = [k for k in required if k not in manifest]
        if missing:
            raise CorruptCheckpointError(f"{mpath} lacks fields {missing}: the manifest is damaged")
        if manifest.get("chunk_bytes", _io.CHUNK_BYTES) != _io.CHUNK_BYTES:
            raise CheckpointVersionError(
                f"{mpath} uses checksum chunks of {brief(manifest['chunk_bytes'])} bytes; this version uses {_io.CHUNK_BYTES}"
            )
        validate_manifest(_as_path(mpath), manifest)
        return manifest

    @staticmethod
    def _open_files(
        tag: str, tag_dir: Location, manifest: dict, part: dict, verify: bool, entries: list[dict]
    ) -> list[RankFile]:
        """The rank files of ``entries`` (of one part's ``files``), opened and validated."""
        world = int(part["world_size"])
        dtype_name = manifest["dtype"]
        files = []
        cuts = part.get(index.FIELD)
        lookup = None if cuts is None else index.Lookup(cuts, part["params"])
        position = {id(e): i for i, e in enumerate(part["files"])}
        for e in entries:
            path, rank = tag_dir / e["file"], int(e["rank"])
            record = f"{part['field']}files[{position[id(e)]}]"  # the file's record in the manifest
            where = (
                f"{path} (rank {rank} of {world}" + ("" if part["part"].whole else f", {part['part'].describe()}") + ")"
            )
            if verify:  # the checksum lists of the files a reader opens (of the others: never read)
                check_tensor_checksums(_as_path(tag_dir / MANIFEST_NAME), manifest, e, record)
            _check_inside(path, tag_dir, where, ". Replace the link by the file itself")
            st = _open_safetensors(tag, tag_dir, path, e, part, where, f"[rank {rank} of {world}]")
            algo, header_sum, crcs = file_checksums(manifest, e, where) if verify else (_io.CHECKSUM, None, {})
            if verify and st.header_checksum(algo) != header_sum:
                raise CorruptCheckpointError(
                    f"{where}: the header does not match the checksum in the manifest; the file is corrupted"
                )
            if verify and uses_compact_checksums(manifest):  # format 5: cut by the tensors of the header just verified
                crcs = split_chunk_checksums(
                    _as_path(tag_dir / MANIFEST_NAME), record, e["chunk_checksums"], algo, st.tensors, where
                )
            meta = st.metadata
            _check_file_metadata(where, meta, manifest, part, rank)
            layout = parse_layout(where, meta.get("layout"), part, rank, e.get("ep"), record)
            differs = (
                None
                if lookup is None
                else lookup.mismatch(rank, {n: (sp.offset, sp.numel) for n, sp in layout.specs.items()})
            )
            if differs is not None:
                raise CorruptCheckpointError(
                    f"{where}: {differs}: the manifest was edited or belongs to another save; restore it from a copy "
                    "or load another tag"
                )
            _check_file_tensors(where, st, layout, manifest, part, parse_dtype(dtype_name, where))
            if verify and set(crcs) != set(st.tensors):
                raise CorruptCheckpointError(
                    f"{where}: the manifest's checksums name other tensors than the file holds"
                )
            files.append(RankFile(rank, st, layout, crcs, algo))
        return files

    def rename(self, saved_as: dict[str, str], ddp_inside: bool) -> None:
        """Read the parameters (and buffers) saved as ``saved_as[n]`` under the names ``n`` of the model they load
        into: :func:`compiled_renames`' map of a checkpoint saved from a ``torch.compile``-d model when its names
        carried the wrapper's ``_orig_mod.`` (now the model inside is read). The files keep their tensor keys."""
        new_of = {saved: n for n, saved in saved_as.items()}
        self.shapes = {new_of.get(n, n): s for n, s in self.shapes.items()}
        self.pieces = {new_of.get(n, n): p for n, p in self.pieces.items()}
        self._saved_as, self._ddp_inside = saved_as, ddp_inside

    def holds(self, specs: dict[str, ShardSpec]) -> bool:
        """Whether the opened files hold exactly the pieces ``specs`` describes (same names, offsets, lengths)."""
        if len(self.files) != 1:
            return False
        saved = self.files[0].layout.specs
        return saved.keys() == specs.keys() and all(
            (saved[n].offset, saved[n].numel) == (s.offset, s.numel) for n, s in specs.items()
        )

    def _check_coverage(self) -> None:
        for n, shape in self.shapes.items():
            numel, cursor = math.prod(shape), 0
            for off, cnt, _ in self.pieces[n]:
                if off > cursor:
                    break
                cursor = max(cursor, off + cnt)
            if cursor < numel:
                raise IncompleteCheckpointError(
                    f"{self.tag_dir / MANIFEST_NAME}: field '{self.part_manifest['field']}params' gives parameter {n!r} the shape {shape}, but the saved "
                    f"pieces cover only elements [0, {cursor}) of "
                    f"{numel}; the manifest lists {len(self.files)} rank file(s) of a world size of {self.world_size}"
                )

    def close(self) -> None:
        for f in self.files:
            f.st.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- buffers

    @property
    def has_buffers(self) -> bool:
        """Whether the save carried module buffers (format 3: ``buffers`` / ``buffer_files`` in the manifest)."""
        return self.part_manifest.get("buffer_files") is not None

    def read_buffers(self, rank: int, world_size: int, verify: bool = True) -> BufferTensors:
        """This rank's buffers: ``(num_emas, emas, copied)`` read from its own buffer file when the save had
        ``world_size`` ranks, else from rank 0's (buffers are whole tensors; at another world size the
        first rank's stand for all, as DeepSpeed restores module state). Every field of the file is
        checked against the manifest and every byte against its checksum."""
        if not self.has_buffers:
            raise CheckpointMismatchError(
                f"tag {self.tag!r} in {self.root} was saved without buffers (save(..., buffers=None)): load without them, "
                "or start the buffer EMAs from the live buffers (functional_ema.buffers.init_buffers)"
            )
        desc = self.part_manifest["buffers"]
        entry, path, where = self._buffer_file(rank, world_size)
        r = entry["rank"]
        try:
            st = _io.SafetensorsFile(_file_source(path), expected_size=int(entry["bytes"]))
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where} is missing: restore it or load another tag") from None
        except _io.FormatError as err:
            raise CorruptCheckpointError(f"{where}: {err}") from None
        with st:
            algo, header_sum, crcs = (
                file_checksums(self.manifest, entry, where, "buffer_files") if verify else (_io.CHECKSUM, None, {})
            )
            if verify and st.header_checksum(algo) != header_sum:
                raise CorruptCheckpointError(
                    f"{where}: the header does not match the checksum in the manifest; the file is corrupted"
                )
            expect = {
                "format": BUFFERS_FORMAT,
                "tag": self.manifest["tag"],
                "step": str(self.step),
                "generation": str(self.manifest["generation"]),
                "rank": str(r),
                "world_size": str(self.world_size),
                "num_emas": str(desc["num_emas"]),
                "dtype": desc["dtype"],
            }
            for field, want in expect.items():
                if st.metadata.get(field) != want:
                    raise CorruptCheckpointError(
                        f"{where}: metadata {field}={brief(st.metadata.get(field))} but the manifest says {want!r}: the "
                        "file does not belong to this checkpoint (a copy from another save, rank or world size?)"
                    )
            note = f"[buffers of rank {r}, tag {self.tag!r}]"
            out = _read_buffer_tensors(st, where, _buffer_tensors_of(desc, where), crcs if verify else None, algo, note)
        emas = tuple({n: out[tensor_key(k, n)] for n in desc["floating"]} for k in range(desc["num_emas"]))
        copied = {n: out[f"copied.{n}"] for n in desc["copied"]}
        if self._saved_as:  # a compiled model's buffers, saved under the wrapper's names too (see rename)
            emas = tuple({_without_compiled(n, self._ddp_inside): t for n, t in e.items()} for e in emas)
            copied = {_without_compiled(n, self._ddp_inside): t for n, t in copied.items()}
        return desc["num_emas"], emas, copied

    def _buffer_file(self, rank: int, world_size: int) -> tuple[dict, Location, str]:
        """(the manifest's entry, the path, a description for messages) of the buffer file ``rank`` reads: its own
        at the saved world size, else rank 0's."""
        by_rank = {e["rank"]: e for e in self.part_manifest["buffer_files"]}
        entry = by_rank.get(rank) if world_size == self.world_size else by_rank.get(0)
        if entry is None:
            raise IncompleteCheckpointError(
                f"{self.tag_dir / MANIFEST_NAME}: field '{self.part_manifest['field']}buffer_files' lists no buffer file of rank "
                f"{rank if world_size == self.world_size else 0} (saved at world size {self.world_size}); the manifest is damaged"
            )
        path, r = self.tag_dir / entry["file"], entry["rank"]
        where = (
            f"{path} (buffers of rank {r} of {self.world_size}"
            + ("" if self.part.whole else f", {self.part.describe()}")
            + ")"
        )
        _check_inside(path, self.tag_dir, where)
        return entry, path, where

    # -- checks

    def check_index(self, index: int) -> None:
        index = check_int(index, "index")
        if not index < self.num_emas:
            raise CheckpointMismatchError(
                f"index={index}, but tag {self.tag!r} holds {self.num_emas} EMA(s) (valid: 0..{self.num_emas - 1})"
            )

    def check_experts(self, layout: ShardLayout) -> None:
        """The run's expert-parallel size must be the saved one: expert parameters are named by their global
        expert index, but which ranks hold which expert (and so which pieces a rank reads) follows the
        expert-parallel size. Checked before anything is read."""
        saved = self.experts["ep_size"] if self.experts else 1
        mine = layout.experts.ep_size if layout.experts is not None else 1
        if saved != mine or (self.experts is None) != (layout.experts is None):
            raise CheckpointMismatchError(
                f"tag {self.tag!r} in {self.root} was saved with expert-parallel size (ep_size) {saved}"
                f"{'' if self.experts else ' (no expert parallelism)'}, and this run has expert-parallel size {mine}"
                f"{'' if layout.experts is not None else ' (no expert parallelism)'}: load it with the saved ep_size (any "
                "data-parallel size), or rebuild the weights with functional_ema.consolidate and start a new EMA"
            )

    def check_model(self, specs: dict[str, ShardSpec]) -> None:
        saved = self.shapes
        in_model_only = [n for n in specs if n not in saved]
        in_ckpt_only = [n for n in saved if n not in specs]
        bad_shapes = [
            (n, saved[n], tuple(specs[n].shape)) for n in specs if n in saved and saved[n] != tuple(specs[n].shape)
        ]
        if not (in_model_only or in_ckpt_only or bad_shapes):
            return
        lines = [
            f"the EMA checkpoint (tag {self.tag!r} in {self.root}, {len(saved)} parameters) does not match this model "
            f"({len(specs)} trained parameters):"
        ]
        if in_model_only:
            lines.append(f"  in the model but not in the checkpoint: {short_list(in_model_only)}")
        if in_ckpt_only:
            lines.append(f"  in the checkpoint but not in the model: {short_list(in_ckpt_only)}")
        renamed = [(a, b) for a in in_ckpt_only for b in in_model_only if saved[a] == tuple(specs[b].shape)]
        if renamed and len(in_model_only) == len(in_ckpt_only):
            lines.append("  renamed? " + ", ".join(f"{a!r} -> {b!r}" for a, b in renamed[:8]))
        for n, want, got in bad_shapes[:8]:
            lines.append(f"  shape of {n!r}: checkpoint {want}, model {got}")
        nowhere = [n for n in in_model_only if not any(n in p["params"] for p in self.parts)]
        if not self.part.whole and nowhere:
            lines.append(
                f"  this rank is {self.part.describe()}, and no saved part holds {short_list(nowhere, 4)}: not "
                "another pipeline partitioning (load joins the saved stages and re-cuts them by name) but another model"
            )
        lines.append(
            "Load into the model the EMA was saved from (frozen and not-optimized parameters have no EMA), or rebuild "
            "the weights with functional_ema.consolidate, adapt them, and start a new EMA with init_ema"
        )
        raise CheckpointMismatchError("\n".join(lines))

    # -- reading pieces

    def fill(self, dst: torch.Tensor, k: int, name: str, start: int, numel: int, verify: bool) -> None:
        """Write elements ``[start, start + numel)`` of flattened EMA ``k`` of ``name`` into 1-D ``dst``,
        checking the checksums of every byte read when ``verify``."""
        stop, cursor, key = start + numel, start, tensor_key(k, self._saved_as.get(name, name))
        for off, cnt, i in self.pieces[name]:
            if cursor >= stop:
                break
            end = off + cnt
            if end <= cursor:
                continue
            if off > cursor:
                break
            upto = min(end, stop)
            f = self.files[i]
            context = f"[rank {f.rank} of {self.world_size}, parameter {name!r}, EMA {k}, tag {self.tag!r}]"
            crcs = f.crcs.get(key) if verify else None
            if verify and crcs is None:
                raise CorruptCheckpointError(f"{f.st.path}: the manifest has no checksum for tensor {key!r} {context}")
            out = dst[cursor - start : upto - start]
            try:
                if cursor == off and upto == end:
                    f.st.read_into(key, out, crcs, context, f.algo)
                elif crcs is None or _whole_chunks(cursor - off, upto - off, cnt, dst.element_size()):
                    f.st.read_into(key, out, crcs, context, f.algo, start=cursor - off)  # a part of fill_all's
                else:
                    out.copy_(f.st.read_range(key, cursor - off, upto - off, crcs, context, f.algo))
            except _io.FormatError as err:
                msg = str(err)
                raise CorruptCheckpointError(msg if context in msg else f"{msg} {context}") from None
            cursor = upto
        if cursor < stop:  # _check_coverage makes this unreachable for well-formed manifests
            raise IncompleteCheckpointError(
                f"tag {self.tag!r}: elements [{cursor}, {stop}) of {name!r} are in no saved piece"
            )


def _whole_chunks(lo: int, hi: int, numel: int, itemsize: int) -> bool:
    """Whether elements ``[lo, hi)`` of a tensor of ``numel`` elements are whole checksum chunks."""
    per_chunk = _io.CHUNK_BYTES // itemsize
    return lo % per_chunk == 0 and (hi % per_chunk == 0 or hi == numel)


def _split_jobs(ckpt: Any, jobs: list, threads: int) -> list:
    """``jobs`` with the large ones cut into parts of whole checksum chunks, so ``threads`` threads get
    equal shares even when one tensor holds most of the bytes (an embedding, a flat FSDP shard).

    Only a job that lies inside one saved piece starting where it starts is cut (the usual load, same
    world size): every part is then read straight into its place and verified chunk by chunk, as
    whole. Resharded ranges are left as they are (a cut there would re-read the chunk it falls in).
    """
    pieces = getattr(ckpt, "pieces", None)  # a reader of saved pieces; a re-cut of joined parts is left as is
    if pieces is None:
        return jobs
    total = sum(job[4] for job in jobs)
    out = []
    for job in jobs:
        dst, k, name, start, numel = job
        per_chunk = _io.CHUNK_BYTES // dst.element_size()
        step = max(per_chunk, -(-total // (threads * 4)) // per_chunk * per_chunk)
        if numel <= step or not any(off == start and start + numel <= off + cnt for off, cnt, _ in pieces[name]):
            out.append(job)
            continue
        for lo in range(0, numel, step):
            m = min(step, numel - lo)
            out.append((dst[lo : lo + m], k, name, start + lo, m))
    return out


def fill_all(
    ckpt: CheckpointReader | JoinedReader,
    jobs: list[tuple[torch.Tensor, int, str, int, int]],
    verify: bool,
    threads: int | None = None,
) -> None:
    """``ckpt.fill(*job, verify)`` for every job, on ``threads`` threads at once.

    Each thread reads (positional reads, GIL released) and hashes its own share of the jobs
    (balanced by size); with one thread it is a plain loop. ``threads=None`` takes this rank's share
    of its node's CPUs (:func:`functional_ema._io.io_threads`), for loads that every rank runs at
    once; the offline tools, alone on their machine, pass ``io_threads(shared=False)``. Every job
    has run when this returns or raises (the first failure, in job order).
    """
    threads = _io.io_threads() if threads is None else threads

    def run(job: tuple[torch.Tensor, int, str, int, int]) -> None:
        with torch.no_grad():
            ckpt.fill(*job, verify)

    if threads >= 2:
        jobs = _split_jobs(ckpt, jobs, threads)
    if len(jobs) < 2 or threads < 2:
        for job in jobs:
            run(job)
        return
    shares: list[list[int]] = [[] for _ in range(min(threads, len(jobs)))]
    loads = [0] * len(shares)
    for i in sorted(range(len(jobs)), key=lambda i: -jobs[i][4]):  # largest first, each to the least loaded
        j = loads.index(min(loads))
        shares[j].append(i)
        loads[j] += jobs[i][4]
    failures: dict[int, BaseException] = {}

    def run_share(share: list[int]) -> None:
        for i in sorted(share):
            try:
                run(jobs[i])
            except BaseException as e:  # noqa: BLE001 - re-raised below, the first in job order
                failures[i] = e

    futures = [_io._pool().submit(run_share, share) for share in shares]
    concurrent.futures.wait(futures)
    for fut in futures:
        fut.result()
    if failures:
        raise failures[min(failures)]


def check_local(tag_dir: Location, part: dict, entries: list[dict]) -> None:
    """A private save's folder (``load(..., shared=False)``) must hold the files this rank reads: else refused,
    naming them and how to merge the folders."""
    missing = [e for e in entries if _file_size(tag_dir / e["file"]) is None]
    if missing:
        listed = ", ".join(f"{e['file']} (saved by rank {e['rank']} of {part['world_size']})" for e in missing[:4])
        raise IncompleteCheckpointError(
            f"{tag_dir} lacks {len(missing)} file(s) this rank reads: {listed}{' ...' if len(missing) > 4 else ''}. A "
            "save with shared=False loads from each rank's own folder at the world size and layout it was saved at; "
            "to load it at another, merge the folders into one first (e.g. rsync -a each node's checkpoint folder "
            "into one, or Ray Train's merged checkpoint) and load from that folder"
        )


def open_checkpoint(
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    verify: bool = True,
    layout: ShardLayout | None = None,
    part: ModelPart | None = None,
    local: bool = False,
) -> CheckpointReader:
    """Open and validate a saved checkpoint for reading; use it as a context manager.

    Args:
        load_dir: the checkpoint directory, or a tag folder.
        tag: the tag; ``None`` follows ``latest`` (else ``ema_latest``), as :func:`functional_ema.load` does.
        verify: check the manifest's checksums of the headers now and of every byte :meth:`CheckpointReader.fill` reads.
        layout: this rank's :class:`~functional_ema.ShardLayout`, for a reader of this rank's pieces
            (of its model-parallel part): when the checkpoint was saved at the same world size and
            stage with exactly these pieces, only this rank's file is opened; otherwise (and with
            ``None``, for the offline tools) every rank file is, so any range can be re-cut.
        part: without ``layout``, which model-parallel part to read (``None``: the only one; use
            :func:`open_joined` for all of them).
        local: a private save's folder (``shared=False``): it may lack other ranks' files; those this rank
            reads must be there (:func:`check_local`).

    Example:
        >>> with open_checkpoint("ckpt") as reader:                      # doctest: +SKIP
        ...     full = torch.empty(reader.shapes["w"]).view(-1)
        ...     reader.fill(full, 0, "w", 0, full.numel(), verify=True)
    """
    if layout is None:
        return CheckpointReader.open(load_dir, tag, verify, part=part)
    # one reading of the manifest, the tag as resolved
    root, tag, tag_dir, manifest = CheckpointReader._locate(load_dir, tag, local)
    parts = manifest_parts(manifest)
    entry = next((p for p in parts if p["part"] == layout.part), None)
    if entry is not None and _repartitioned(parts, entry, layout):
        entry = None  # the same stage index, another pipeline partitioning: its parameters are in other saved parts
    if entry is None and local:
        every = [(p, e) for p in manifest_parts(manifest) for e in p["files"]]
        for p, e in every:
            check_local(tag_dir, p, [e])
    if entry is None:  # another model-parallel layout: join the saved parts, then cut this rank's part out of them
        # A RecutReader is not a CheckpointReader: it duck-types what load reads (tag, dtype, check_experts,
        # check_model, check_index, fill, read_buffers, close); typing it honestly needs load's callers typed alike.
        return RecutReader(open_joined(root, tag, verify), layout)  # type: ignore[return-value]  # see above
    renamed = compiled_renames(entry["params"], layout.specs)
    read = layout  # the files are opened for the saved names, then read under the model's (see rename)
    if renamed is not None:
        read = layout._replace(specs={renamed[0][n]: spec for n, spec in layout.specs.items()})
    ckpt: CheckpointReader | None = None
    if (int(entry["world_size"]), int(entry["zero_stage"])) == (layout.world_size, layout.stage):
        own = (layout.rank, layout.world_size, layout.stage)
        ckpt = CheckpointReader._for_part(root, tag, tag_dir, manifest, entry, verify, own, local=local)
        if ckpt.partial and not ckpt.holds(read.specs):
            ckpt.close()  # the same world size, cut otherwise: read the pieces from the files that hold them
            ckpt = None
    if ckpt is None:
        ckpt = CheckpointReader._for_part(root, tag, tag_dir, manifest, entry, verify, None, read.specs, local)
    if renamed is not None:
        ckpt.rename(*renamed)
    return ckpt


_COMPILED = "_orig_mod"  # the component torch.compile's wrapper (OptimizedModule) puts before its model's names


def _without_compiled(name: str, ddp_inside: bool) -> str:
    """``name`` without torch.compile's ``_orig_mod`` components; with ``ddp_inside``, also without the ``module``
    of a DDP wrapper inside the compiled one (``torch.compile(DDP(m))`` listed ``_orig_mod.module.<m's name>``)."""
    parts = name.split(".")
    if ddp_inside and parts[:2] == [_COMPILED, "module"]:
        parts = parts[2:]
    return ".".join(p for p in parts if p != _COMPILED)


def compiled_renames(saved: Iterable[str], names: Iterable[str]) -> tuple[dict[str, str], bool] | None:
    """``({name read: name saved}, ddp_inside)`` when the ``saved`` parameter names are exactly ``names`` once
    torch.compile's ``_orig_mod.`` components are taken out (and, failing that, also the ``module.`` of a DDP inside
    the compiled wrapper); ``None`` otherwise. A compiled model was read under its wrapper's names before the
    library read the model inside (``engines.unwrap_compiled``); its checkpoints load into the same model."""
    saved, wanted = list(saved), set(names)
    if set(saved) == wanted or not any(_COMPILED in n.split(".") for n in saved):
        return None
    for ddp_inside in (False, True):
        saved_as = {_without_compiled(n, ddp_inside): n for n in saved}
        if len(saved_as) == len(saved) and saved_as.keys() == wanted:
            return saved_as, ddp_inside
    return None


def _repartitioned(parts: list[dict], entry: dict, layout: ShardLayout) -> bool:
    """Whether this rank's part (``entry``, the saved part of the same tensor-parallel rank and pipeline stage)
    holds other parameters than this rank's stage, every one of which some saved part holds: the same number of
    pipeline stages with the layers split otherwise (``PipelineModule(partition_method=...)``), loaded by joining
    the saved stages and taking this stage's parameters by name, as for another number of stages. Where a name is
    in no saved part the direct reader's ``check_model`` refuses, naming what differs."""
    if layout.part.pp_size < 2 or len(parts) < 2 or set(entry["params"]) == set(layout.specs):
        return False  # only pipeline stages are cut by layer: tensor-parallel parts hold the same names
    saved = {n for p in parts for n in p["params"]}
    return all(n in saved for n in layout.specs)


def locate_checkpoint(
    load_dir: str | os.PathLike[str], tag: str | None = None, local: bool = False
) -> tuple[Location, str, Location, dict]:
    """(root, tag, tag folder, validated manifest) of a saved checkpoint, following ``latest`` /
    ``ema_latest`` for ``tag=None``; every file the manifest lists must exist (``local``: a private save's
    folder, which may lack other ranks' files). Reads no rank file."""
    return CheckpointReader._locate(load_dir, tag, local)


def open_parts(load_dir: str | os.PathLike[str], tag: str | None = None, verify: bool = True) -> list[CheckpointReader]:
    """Every model-parallel part of a saved checkpoint, opened (one reader for a whole model); close each."""
    return CheckpointReader.open_parts(load_dir, tag, verify)


def check_tp_dims(tp_dims: Any) -> dict[str, int | None] | None:
    """``tp_dims`` as ``{parameter name: dim (an int >= 0) or None}``, or ``None``; else a
    ``TypeError``/``ValueError`` naming ``tp_dims`` (the names and dims are checked against the
    checkpoint by :class:`JoinedReader`)."""
    if tp_dims is None:
        return None
    if not isinstance(tp_dims, Mapping):
        raise TypeError(
            f"tp_dims must be a dict {{parameter name: split dimension or None}}, got {type(tp_dims).__name__} "
            f"{tp_dims!r:.80}"
        )
    out: dict[str, int | None] = {}
    for name, dim in tp_dims.items():
        if not isinstance(name, str):
            raise TypeError(f"tp_dims: keys must be parameter names (str), got {type(name).__name__} {name!r}")
        out[name] = check_optional_int(dim, f"tp_dims[{name!r}]")
    return out


class JoinedReader:
    """The full parameters of a whole checkpoint, every model-parallel part joined: what the offline
    tools (``consolidate``, post-hoc EMA from files, buffers' ``consolidate``) read.

    Pipeline stages hold different parameters: their names are merged. A name held by several stages (a
    ``TiedLayerSpec`` layer) is read from the first only when every stage's copy is bitwise equal (a tied weight,
    which DeepSpeed keeps in sync); copies that differ are refused (:func:`untied_copies`) when the name is first
    filled, at the cost of reading its copies once then (opening the reader compares their shapes only, so what
    reads metadata alone, e.g. listing snapshots, reads no tensor). Tensor-parallel ranks hold slices of the same
    parameters: they are concatenated along each parameter's split dimension (``tp_dims``: given here, else as the
    engine recorded it at save time), or one rank's slices are read alone (``tp_rank``).

    Attributes:
        readers: one :class:`CheckpointReader` per part (closed with this reader).
        shapes: output name -> full shape.
        tag, root, tag_dir, manifest, step, num_emas, dtype: as for :class:`CheckpointReader`.
    """

    def __init__(
        self,
        readers: list[CheckpointReader],
        tp_dims: dict[str, int | None] | None = None,
        tp_rank: int | None = None,
    ) -> None:
        self.readers = readers
        first = readers[0]
        self.tag, self.root, self.tag_dir, self.manifest = first.tag, first.root, first.tag_dir, first.manifest
        self.step, self.num_emas, self.dtype = first.step, first.num_emas, first.dtype
        self.world_size, self.stage = first.world_size, first.stage
        tp_size = first.part.tp_size
        self._check_given_dims(readers, tp_dims)
        if tp_rank is not None and not 0 <= int(tp_rank) < tp_size:
            raise CheckpointMismatchError(
                f"tp_rank={tp_rank}, but tag {self.tag!r} was saved with tensor-parallel size {tp_size}"
            )
        # name -> (list of (reader, local shape), dim or None): the sources of each output tensor
        self.sources: dict[str, tuple[list[tuple[CheckpointReader, tuple[int, ...]]], int | None]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        # name -> (stage, its sources) of every stage holding a name held by several (tied layers)
        copies: dict[str, list[tuple[int, tuple[list[tuple[CheckpointReader, tuple[int, ...]]], int | None]]]] = {}
        for pp in range(first.part.pp_size):
            stage = sorted((r for r in readers if r.part.pp == pp), key=lambda r: r.part.tp)
            if tp_rank is not None:
                stage = [stage[int(tp_rank)]]
            names = list(stage[0].shapes)
            for r in stage[1:]:
                if list(r.shapes) != names:
                    raise CorruptCheckpointError(
                        f"{self.tag_dir / MANIFEST_NAME}: the tensor-parallel ranks of pipeline stage {pp} hold different "
                        "parameters; the manifest is damaged"
                    )
            dims = self._dims(stage, names, tp_dims) if len(stage) > 1 else {n: None for n in names}
            for n in names:
                d = dims[n]
                group = [stage[0]] if d is None else stage
                shapes = [r.shapes[n] for r in group]
                full = list(shapes[0])
                if d is not None:
                    if any(
                        len(s) != len(full) or any(a != b for i, (a, b) in enumerate(zip(s, full)) if i != d)
                        for s in shapes
                    ):
                        raise CheckpointMismatchError(
                            f"parameter {n!r}: its tensor-parallel slices {shapes} do not join along dimension {d}"
                        )
                    full[d] = sum(s[d] for s in shapes)
                source = ([(r, r.shapes[n]) for r in group], d)
                if n in self.sources:  # a tied layer held by an earlier stage too: compared below
                    if tuple(full) != self.shapes[n]:
                        raise CheckpointMismatchError(
                            untied_copies(f"tag {self.tag!r}", {n: [p for p, _ in copies[n]] + [pp]})
                        )
                    copies[n].append((pp, source))
                    continue
                copies[n] = [(pp, source)]
                self.sources[n] = source
                self.shapes[n] = tuple(full)
        # Names held by several stages, compared (every EMA, bitwise) the first time one is filled, not here: opening
        # reads metadata only (listing snapshots, a load into another layout reads the names it needs).
        self._tied = {n: c for n, c in copies.items() if len(c) > 1}
        self._tied_checked: dict[str, list[int] | None] = {}  # name -> the stages whose copies differ, None: equal
        self._tied_lock = threading.Lock()

    def _check_tied(self, name: str, verify: bool) -> None:
        """Refuse ``name`` when it is held by several stages whose copies differ in any EMA (see
        :func:`untied_copies`): reads its copies once, the first time it is filled (the outcome kept)."""
        held = self._tied.get(name)
        if held is None:
            return
        with self._tied_lock:  # fill_all fills from several threads
            if name not in self._tied_checked:
                differ = None
                for k in range(self.num_emas):
                    values = []
                    for _, source in held:
                        t = torch.empty(self.shapes[name], dtype=self.dtype)
                        self._fill_from(source, t.view(-1), k, name, verify)
                        values.append(t)
                    if not all(torch.equal(values[0], v) for v in values[1:]):
                        differ = [pp for pp, _ in held]
                        break
                self._tied_checked[name] = differ
            stages = self._tied_checked[name]
        if stages is not None:
            raise CheckpointMismatchError(untied_copies(f"tag {self.tag!r}", {name: stages}))

    def _check_given_dims(self, readers: list[CheckpointReader], given: dict | None) -> None:
        """``tp_dims`` against the checkpoint: every name a saved parameter, every dim one of its dimensions,
        and equal to the split the engine recorded where one was recorded (a contradicting dim would join a
        replicated tensor twice, or keep one rank's half). Refused naming the parameter and both dims."""
        if given is None:
            return
        shapes = {n: s for r in readers for n, s in r.shapes.items()}
        for name, dim in given.items():
            if name not in shapes:
                raise CheckpointMismatchError(
                    f"tp_dims names {name!r}, which is not a parameter of tag {self.tag!r} (it has "
                    f"{short_list(sorted(shapes), 4)})"
                )
            ndim = len(shapes[name])
            if dim is not None and not 0 <= dim < ndim:
                raise CheckpointMismatchError(
                    f"tp_dims[{name!r}]={dim}: parameter {name!r} has {ndim} dimension(s) (shape {shapes[name]}), "
                    f"so its split dimension is one of 0..{ndim - 1} (or None: replicated)"
                )
        for r in readers:
            if r.part.tp_size > 1 and r.tp_dims is not None:
                for name, dim in given.items():
                    if name in r.tp_dims and r.tp_dims[name] != dim:
                        raise CheckpointMismatchError(
                            f"tp_dims[{name!r}]={dim} contradicts the split recorded at save time for parameter "
                            f"{name!r}: dimension {r.tp_dims[name]} (None: replicated across tensor-parallel ranks). "
                            "Leave it out of tp_dims (the recorded split is used), or give the recorded one"
                        )

    def _dims(
        self, stage: list[CheckpointReader], names: list[str], given: dict[str, int | None] | None
    ) -> dict[str, int | None]:
        recorded = [r.tp_dims for r in stage]
        known = all(d is not None for d in recorded) and all(d == recorded[0] for d in recorded)
        first: dict[str, int | None] = recorded[0] or {}  # recorded[0] itself whenever known
        if given is not None:
            missing = [n for n in names if n not in given and not (known and n in first)]
            if missing:
                raise CheckpointMismatchError(
                    f"tp_dims= does not say how {short_list(missing, 4)} join; give a dimension "
                    "(or None for a parameter replicated across tensor-parallel ranks) for each"
                )
            return {n: (given[n] if n in given else first[n]) for n in names}
        if not known:
            raise CheckpointMismatchError(
                f"tag {self.tag!r} was saved with tensor parallelism ({len(stage)} ranks), and how its slices join is "
                "unknown (the parameters carried no split: no AutoTP layout record, no Megatron attributes "
                "'tensor_model_parallel'/'partition_dim'). Pass tp_dims={name: dim or None, ...}, or tp_rank=r for one "
                "rank's slices (the CLI writes one file per tensor-parallel rank then)"
            )
        return first

    def fill(self, dst: torch.Tensor, k: int, name: str, start: int, numel: int, verify: bool) -> None:
        """Write the full EMA ``k`` of ``name`` into the flat ``dst`` (``start`` 0, ``numel`` all of it, as
        :func:`fill_all` passes them), checksums verified."""
        if start != 0 or numel != math.prod(self.shapes[name]) or dst.numel() != numel:
            raise ValueError(
                f"a joined reader fills whole parameters; got elements [{start}, {start + numel}) of {name!r}"
            )
        self._check_tied(name, verify)
        self._fill_from(self.sources[name], dst, k, name, verify)

    def _fill_from(
        self,
        source: tuple[list[tuple[CheckpointReader, tuple[int, ...]]], int | None],
        dst: torch.Tensor,
        k: int,
        name: str,
        verify: bool,
    ) -> None:
        """Write the full EMA ``k`` of ``name`` from ``source`` (one stage's readers, and the split they join along)."""
        group, d = source
        if d is None:
            reader, shape = group[0]
            reader.fill(dst, k, name, 0, dst.numel(), verify)
            return
        out = dst.view(self.shapes[name])
        offset = 0
        for reader, shape in group:
            local = torch.empty(shape, dtype=dst.dtype)
            reader.fill(local.view(-1), k, name, 0, local.numel(), verify)
            out.narrow(d, offset, shape[d]).copy_(local)
            offset += shape[d]

    def check_index(self, index: int) -> None:
        self.readers[0].check_index(index)

    def read_buffers(self, verify: bool = True) -> BufferTensors:
        """Rank 0's buffers of every pipeline stage (of tensor-parallel rank 0), merged: ``(num_emas, emas, copied)``."""
        num = 0
        emas: tuple[dict[str, torch.Tensor], ...] | None = None
        copied: dict[str, torch.Tensor] = {}
        for r in sorted(self.readers, key=lambda r: (r.part.pp, r.part.tp)):
            if r.part.tp != 0:
                continue
            n, e, c = r.read_buffers(0, r.world_size, verify)
            if emas is None:
                num, emas = n, tuple({} for _ in e)
            for k, ek in enumerate(e):
                for name, t in ek.items():
                    emas[k].setdefault(name, t)
            for name, t in c.items():
                copied.setdefault(name, t)
        if emas is None:  # a validated manifest always has tensor-parallel rank 0
            raise CorruptCheckpointError(
                f"{self.tag_dir / MANIFEST_NAME}: no part of tensor-parallel rank 0 holds buffers; the manifest is damaged"
            )
        return num, emas, copied

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def __enter__(self) -> JoinedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_joined(
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    verify: bool = True,
    tp_dims: Mapping[str, int | None] | None = None,
    tp_rank: int | None = None,
) -> JoinedReader:
    """Every part of a saved checkpoint, joined into full parameters (see :class:`JoinedReader`).
    The arguments are checked before any file is opened."""
    verify = check_bool(verify, "verify")
    tp_dims = check_tp_dims(tp_dims)
    tp_rank = check_optional_int(tp_rank, "tp_rank")
    readers: list[CheckpointReader] = []
    try:  # a URL is read in place, with ranged reads (see the module docstring)
        readers = CheckpointReader.open_parts(load_dir, tag, verify)
        return JoinedReader(readers, tp_dims, tp_rank)
    except BaseException:
        for r in readers:
            r.close()
        raise


def untied_copies(where: str, stages: Mapping[str, list[int]]) -> str:
    """The refusal of parameters held by several pipeline stages with different values (``stages``: name -> the
    stages holding it), with the fix: shared by ``consolidate`` (``where``: the tag) and ``gather_full``."""
    name, held = next(iter(stages.items()))
    others = [n for n in stages if n != name]
    also = f" (and {short_list(others, 4)})" if others else ""
    return (
        f"{where}: parameter {name!r}{also} is held by pipeline stages {held} with different values, so there is no "
        "one value to join: a TiedLayerSpec ties only the attributes in its tied_weight_attr (by default ['weight']), "
        "and each stage trains its own copy of the others. Tie it too (TiedLayerSpec(..., tied_weight_attr=['weight', "
        f"'bias'])), or leave it out of the EMA with local_shards(engine, exclude={sorted(stages)!r})"
    )


class RecutReader:
    """A checkpoint saved with another model-parallel layout, read for this rank's part: every saved part
    joined (:class:`JoinedReader`), then this rank's tensor-parallel slice cut out along the split its
    engine records (``layout.tp_dims``) and its pipeline stage's parameters taken by name. Used by
    ``load`` when the checkpoint has no part like this rank's; refused where a split is unknown."""

    recut = True

    def __init__(self, joined: JoinedReader, layout: ShardLayout) -> None:
        self.joined, self.layout = joined, layout
        self.tag, self.root, self.tag_dir, self.manifest = joined.tag, joined.root, joined.tag_dir, joined.manifest
        self.step, self.num_emas, self.dtype = joined.step, joined.num_emas, joined.dtype
        self.world_size, self.stage = joined.world_size, joined.stage
        self.part = layout.part
        self.experts = joined.readers[0].experts
        self.shapes = {n: tuple(s.shape) for n, s in layout.specs.items()}

    def _dim(self, name: str) -> int | None:
        if self.layout.part.tp_size == 1:
            return None
        dims = self.layout.tp_dims
        if dims is None or name not in dims:
            raise CheckpointMismatchError(
                f"tag {self.tag!r} was saved with another model-parallel layout than this run's "
                f"({self.layout.part.describe()}), and this engine records no tensor-parallel split to cut "
                f"{name!r} from the full parameter (no AutoTP layout record, no Megatron 'partition_dim'): resume "
                "with the layout it was saved with"
            )
        return dims[name]

    check_experts = CheckpointReader.check_experts

    def check_model(self, specs: dict[str, ShardSpec]) -> None:
        missing = [n for n in specs if n not in self.joined.shapes]
        if missing:
            raise CheckpointMismatchError(
                f"tag {self.tag!r} in {self.root} (saved with another model-parallel layout) has no EMA of "
                f"{short_list(missing)}, which {self.layout.part.describe()} of this run trains"
            )
        size = self.layout.part.tp_size
        for n, spec in specs.items():
            full, local, d = self.joined.shapes[n], tuple(spec.shape), self._dim(n)
            want = local if d is None else tuple(x * size if i == d else x for i, x in enumerate(local))
            if tuple(full) != want:
                raise CheckpointMismatchError(
                    f"parameter {n!r}: its full shape in tag {self.tag!r} is {tuple(full)}, but this rank's slice "
                    f"{local} of {self.layout.part.describe()} (split along {d}) makes {want}"
                )

    def check_index(self, index: int) -> None:
        self.joined.check_index(index)

    def fill(self, dst: torch.Tensor, k: int, name: str, start: int, numel: int, verify: bool) -> None:
        full = torch.empty(self.joined.shapes[name], dtype=dst.dtype)
        self.joined.fill(full.view(-1), k, name, 0, full.numel(), verify)
        d = self._dim(name)
        local = full
        if d is not None:
            size = self.shapes[name][d]
            local = full.narrow(d, self.layout.part.tp * size, size)
        dst.copy_(local.reshape(-1)[start : start + numel])

    @property
    def has_buffers(self) -> bool:
        return all(r.has_buffers for r in self.joined.readers)

    def read_buffers(self, rank: int, world_size: int, verify: bool = True) -> BufferTensors:
        return self.joined.read_buffers(verify)

    def close(self) -> None:
        self.joined.close()

    def __enter__(self) -> RecutReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_safetensors(
    tag: str, tag_dir: Location, path: Location, e: dict, part: dict, where: str, rank_note: str
) -> _io.SafetensorsFile:
    """The rank file ``e`` of ``part`` opened (its header parsed and its size checked); each failure as the
    checkpoint error that names the file."""
    try:
        return _io.SafetensorsFile(_file_source(path), expected_size=int(e["bytes"]))
    except FileNotFoundError:
        if not isinstance(path, StoragePath):  # a local folder's files were all found by _locate
            raise
        raise _missing_files(tag, tag_dir, [(e, part)]) from None
    except _io.PickleFileError as err:
        raise CorruptCheckpointError(f"{err} {rank_note}") from None
    except _io.TruncatedFileError as err:
        raise CorruptCheckpointError(
            f"{where} is truncated: {_file_size(path)} bytes, the manifest records {e['bytes']}. The write or "
            f"copy was cut short: restore the file or load another tag ({err})"
        ) from None
    except _io.FormatError as err:
        raise CorruptCheckpointError(f"{where}: {err}") from None


def _check_file_metadata(where: str, meta: dict, manifest: dict, part: dict, rank: int) -> None:
    """A rank file's header metadata: one of ours, of a format this reader knows, of this save and this rank."""
    if meta.get("format") != FILE_FORMAT:
        raise CorruptCheckpointError(f"{where} is not a functional_ema EMA file (format {meta.get('format')!r})")
    try:
        fversion = int(meta.get("format_version", ""))
    except ValueError:
        raise CorruptCheckpointError(f"{where}: bad format_version {meta.get('format_version')!r}") from None
    if fversion > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{where} was written by a newer functional_ema (format version {fversion}; this one reads up to "
            f"{FORMAT_VERSION}). Upgrade functional_ema (pip install -U functional-ema)"
        )
    for field, want in (
        ("tag", manifest["tag"]),
        ("step", manifest["step"]),
        ("num_emas", manifest["num_emas"]),
        ("world_size", int(part["world_size"])),
        ("rank", rank),
        ("zero_stage", part["zero_stage"]),
        ("generation", manifest["generation"]),
        ("dtype", manifest["dtype"]),
    ):
        if meta.get(field) != str(want):
            raise CorruptCheckpointError(
                f"{where}: metadata {field}={meta.get(field)!r} but the manifest says {want!r}: the file does not "
                "belong to this checkpoint (mixed copies of two saves?)"
            )
    check_json_metadata(where, meta, "schedules", manifest)
    check_json_metadata(where, meta, "extra", manifest)


def _check_file_tensors(
    where: str, st: _io.SafetensorsFile, layout: Any, manifest: dict, part: dict, dtype: torch.dtype
) -> None:
    """A rank file holds exactly one tensor per EMA and piece of ``layout``, each of the manifest's dtype and size."""
    num_emas = int(manifest["num_emas"])
    extra = sorted(set(st.tensors) - {tensor_key(k, n) for k in range(num_emas) for n in layout.specs})
    if extra:
        raise CorruptCheckpointError(
            f"{where} holds tensors that no EMA of this checkpoint has: {short_list(extra, 4)}"
        )
    for k in range(num_emas):
        for n, spec in layout.specs.items():
            entry = st.tensors.get(tensor_key(k, n))
            if entry is None:
                raise CorruptCheckpointError(f"{where} lacks tensor {tensor_key(k, n)!r} (parameter {n!r}, EMA {k})")
            if entry.dtype != dtype:
                raise CorruptCheckpointError(
                    f"{where}: dtype mismatch for parameter {n!r} (EMA {k}): the file stores {entry.dtype}, the "
                    f"manifest says {dtype}. The file was rewritten by another tool; restore it or load another tag"
                )
            if entry.numel != spec.numel or tuple(spec.shape) != tuple(part["params"].get(n, ())):
                raise CorruptCheckpointError(
                    f"{where}: parameter {n!r} (EMA {k}): {entry.numel} elements stored, layout says {spec.numel} of "
                    f"{spec.shape}, manifest says shape {part['params'].get(n)}"
                )


def _buffer_tensors_of(desc: dict, where: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors a buffer file holds by the manifest's field ``buffers``: key -> (dtype, shape)."""
    dtype = parse_dtype(desc["dtype"], where)
    wanted = {
        tensor_key(k, n): (dtype, tuple(shape))
        for k in range(desc["num_emas"])
        for n, shape in desc["floating"].items()
    }
    wanted.update({f"copied.{n}": (getattr(torch, dt), tuple(shape)) for n, (dt, shape) in desc["copied"].items()})
    return wanted


def _read_buffer_tensors(
    st: _io.SafetensorsFile,
    where: str,
    wanted: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    crcs: dict | None,
    algo: str,
    note: str,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``wanted`` read from ``st`` (exactly those, each of its dtype and shape), each checked
    against its checksum in ``crcs`` (``None``: unverified)."""
    if set(st.tensors) != set(wanted):
        raise CorruptCheckpointError(
            f"{where} holds other tensors than the manifest's field 'buffers' describes: only in the file "
            f"{short_list(sorted(set(st.tensors) - set(wanted)), 4)}, missing "
            f"{short_list(sorted(set(wanted) - set(st.tensors)), 4)}"
        )
    out = {}
    for key, (dt, shape) in wanted.items():
        e = st.tensors[key]
        if e.dtype != dt or tuple(e.shape) != shape:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} is {dtype_name(e.dtype)}{list(e.shape)} in the file but "
                f"{dtype_name(dt)}{list(shape)} in the manifest's field 'buffers'"
            )
        if crcs is not None and key not in crcs:
            raise CorruptCheckpointError(f"{where}: the manifest has no checksum for tensor {key!r}")
        t = torch.empty(shape, dtype=dt)
        try:
            st.read_into(key, t, None if crcs is None else crcs.get(key), note, algo)
        except _io.FormatError as err:
            raise CorruptCheckpointError(f"{err}") from None
        out[key] = t
    return out
