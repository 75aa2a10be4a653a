"""Reading a saved EMA checkpoint: :class:`CheckpointReader` validates the manifest and the rank
files' headers, then fills any range of any parameter of any EMA from the saved pieces, verifying
checksums. ``load``, ``consolidate`` and post-hoc EMA all read through it (:func:`open_checkpoint`)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
from pathlib import Path

import torch

from .. import _io
from .._layout import ShardLayout, ShardSpec
from .errors import (CheckpointError, CheckpointMismatchError, CheckpointNotFoundError, CheckpointVersionError,
                     CorruptCheckpointError, IncompleteCheckpointError)
from .format import (BUFFERS_FORMAT, FILE_FORMAT, FORMAT_VERSION, LATEST_NAME, MANIFEST_FORMAT, MANIFEST_NAME, MAX_MANIFEST_BYTES, RANK_FILE,
                     brief, check_json_metadata, check_tag, complete_tags, file_checksums, parse_dtype, dtype_name,
                     library_version, parse_layout, read_latest, short_list, tensor_key, validate_manifest)

__all__ = ["CheckpointReader", "open_checkpoint", "fill_all"]


class RankFile:
    def __init__(self, rank: int, st: _io.SafetensorsFile, layout: ShardLayout, crcs: dict[str, list[int]],
                 algo: str = _io.CHECKSUM):
        self.rank, self.st, self.layout, self.crcs, self.algo = rank, st, layout, crcs, algo


class CheckpointReader:
    """An opened, validated checkpoint: the manifest and the headers of the rank files opened (every
    one, or this rank's only with ``open(..., own=...)``). Nothing loaded yet; made by :func:`open_checkpoint`.

    What readers use: ``tag``, ``root``, ``tag_dir``, ``manifest`` (validated), ``step``,
    ``num_emas``, ``dtype``, ``world_size``, ``stage``, ``shapes`` (parameter name -> full shape);
    :meth:`fill` (any element range of any parameter of any EMA, checksums verified),
    :meth:`check_index`, :meth:`check_model`, :meth:`close` (or a ``with`` block).
    """

    def __init__(self, root: Path, tag: str, tag_dir: Path, manifest: dict, files: list[RankFile]):
        self.root, self.tag, self.tag_dir, self.manifest, self.files = root, tag, tag_dir, manifest, files
        self.partial = False  # True when only some rank files were opened (see open's ``own``)
        self.step = int(manifest["step"])
        self.num_emas = int(manifest["num_emas"])
        self.dtype = parse_dtype(manifest["dtype"], str(tag_dir / MANIFEST_NAME))
        self.world_size = int(manifest["world_size"])
        self.stage = int(manifest["zero_stage"])
        self.shapes = {n: tuple(int(x) for x in s) for n, s in manifest["params"].items()}
        self.pieces: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.shapes}
        for i, f in enumerate(files):
            for n, spec in f.layout.specs.items():
                if spec.numel:
                    self.pieces[n].append((spec.offset, spec.numel, i))
        for p in self.pieces.values():
            p.sort()

    # -- opening

    @classmethod
    def open(cls, checkpoint_dir: str | os.PathLike, tag: str | None, verify: bool = True,
             own: tuple[int, int, int] | None = None) -> "CheckpointReader":
        """Open and validate the manifest and the rank files' headers.

        ``own=(rank, world_size, stage)``: when the checkpoint was saved at that world size and stage
        and has a file of that rank, open that file only (``partial`` is then True and coverage is
        the caller's to check, see :meth:`holds`). A rank then reads one header instead of all
        ``world_size`` of them; the other ranks open their own files, and a bad one is reported
        on every rank by the collective's agreement.
        """
        root = Path(checkpoint_dir)
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
                    raise CheckpointNotFoundError(
                        f"{root} has no 'latest' file (DeepSpeed writes it in save_checkpoint) nor {LATEST_NAME!r} "
                        f"(functional_ema.save writes it): pass tag=... "
                        f"Tags here with a complete EMA: {complete_tags(root)}"
                    )
                tag = read_latest(root, latest)
                if not tag:
                    raise CheckpointNotFoundError(f"{latest} is empty (a crash while DeepSpeed wrote it?): pass tag=... "
                                                  f"Tags here with a complete EMA: {complete_tags(root)}")
                from_latest = True
            tag = check_tag(tag, saving=False)
            tag_dir = root / tag
            if not tag_dir.is_dir():
                raise CheckpointNotFoundError(
                    f"no tag {tag!r} in {root}{' (named by latest)' if from_latest else ''}. "
                    f"Tags here with a complete EMA: {complete_tags(root)}"
                )
        mpath = tag_dir / MANIFEST_NAME
        if not mpath.is_file():
            found = sorted(p.name for p in tag_dir.iterdir() if RANK_FILE.match(p.name))
            what = (f"found {len(found)} EMA rank file(s) {short_list(found, 4)} but the manifest, written last, is missing"
                    if found else "there are no EMA files at all (was functional_ema.save called for this tag?)")
            hint = (" 'latest' names this tag: DeepSpeed finished its save but the EMA save did not (call "
                    "functional_ema.save before engine.save_checkpoint to avoid this)." if from_latest else "")
            raise IncompleteCheckpointError(
                f"tag {tag!r} in {root} has no complete EMA checkpoint: {what}.{hint} Load another tag; "
                f"tags here with a complete EMA: {[t for t in complete_tags(root) if t != tag]}"
            )
        manifest = cls._read_manifest(mpath)
        entries = manifest["files"]
        if own is not None and (int(manifest["world_size"]), int(manifest["zero_stage"])) == own[1:]:
            entries = [e for e in entries if e["rank"] == own[0]] or entries
        files = cls._open_files(tag, tag_dir, manifest, verify, entries)
        ckpt = cls(root, tag, tag_dir, manifest, files)
        ckpt.partial = len(entries) < len(manifest["files"])
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
            raise CheckpointError(f"{path} is a manifest: pass its folder, {path.parent}, or the checkpoint directory with tag=")
        raise CheckpointError(f"{path} is a file: pass the checkpoint directory (the one holding 'latest' and the tag folders)")

    @staticmethod
    def _read_manifest(mpath: Path) -> dict:
        size = mpath.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{mpath} holds {size} bytes, far more than any manifest: it is damaged; load another tag")
        raw = mpath.read_bytes()
        if _io.looks_like_pickle(raw[:8]):
            raise CorruptCheckpointError(f"{mpath} is a pickle, not JSON; functional_ema never unpickles. The manifest is damaged")
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise CorruptCheckpointError(f"{mpath} is not valid JSON ({why}): the manifest is damaged; load another tag") from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise CorruptCheckpointError(f"{mpath} is not a functional_ema manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
        version = manifest.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CorruptCheckpointError(f"{mpath}: bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise CheckpointVersionError(
                f"{mpath} was written by a newer functional_ema ({manifest.get('library', '?')}, format version {version}); "
                f"this one ({library_version()}) reads format version {FORMAT_VERSION} and older. Upgrade functional_ema "
                "(pip install -U functional-ema)"
            )
        missing = [k for k in ("tag", "generation", "step", "num_emas", "dtype", "world_size", "zero_stage", "params", "files") if k not in manifest]
        if missing:
            raise CorruptCheckpointError(f"{mpath} lacks fields {missing}: the manifest is damaged")
        if manifest.get("chunk_bytes", _io.CHUNK_BYTES) != _io.CHUNK_BYTES:
            raise CheckpointVersionError(f"{mpath} uses checksum chunks of {brief(manifest['chunk_bytes'])} bytes; this version uses {_io.CHUNK_BYTES}")
        validate_manifest(mpath, manifest)
        return manifest

    @staticmethod
    def _open_files(tag: str, tag_dir: Path, manifest: dict, verify: bool, entries: list[dict]) -> list[RankFile]:
        """The rank files of ``entries`` (of the manifest's ``files``), opened and validated; every
        listed file must exist."""
        world = int(manifest["world_size"])
        missing = [e for e in manifest["files"] + (manifest.get("buffer_files") or []) if not (tag_dir / e["file"]).is_file()]
        if missing:
            listed = ", ".join(f"{e['file']} (rank {e['rank']} of {world})" for e in missing[:4])
            raise IncompleteCheckpointError(
                f"tag {tag!r} in {tag_dir.parent} is missing {len(missing)} file(s) listed in its manifest: {listed}. "
                "The folder was copied or pruned partially: restore the file(s) or load another tag"
            )
        dtype_name = manifest["dtype"]
        files = []
        real_tag_dir = tag_dir.resolve()
        for e in entries:
            path, rank = tag_dir / e["file"], int(e["rank"])
            where = f"{path} (rank {rank} of {world})"
            if path.resolve().parent != real_tag_dir:  # a link to a file elsewhere: never followed
                raise CorruptCheckpointError(
                    f"{where} is a link to a file outside the tag folder {tag_dir}; functional_ema reads only its own "
                    "files inside the tag folder. Replace the link by the file itself"
                )
            try:
                st = _io.SafetensorsFile(path, expected_size=int(e["bytes"]))
            except _io.PickleFileError as err:
                raise CorruptCheckpointError(f"{err} [rank {rank} of {world}]") from None
            except _io.TruncatedFileError as err:
                raise CorruptCheckpointError(
                    f"{where} is truncated: {path.stat().st_size} bytes, the manifest records {e['bytes']}. The write or "
                    f"copy was cut short: restore the file or load another tag ({err})"
                ) from None
            except _io.FormatError as err:
                raise CorruptCheckpointError(f"{where}: {err}") from None
            algo, header_sum, crcs = file_checksums(manifest, e, where) if verify else (_io.CHECKSUM, None, {})
            if verify and st.header_checksum(algo) != header_sum:
                raise CorruptCheckpointError(f"{where}: the header does not match the checksum in the manifest; the file is corrupted")
            meta = st.metadata
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
            for field, want in (("tag", manifest["tag"]), ("step", manifest["step"]), ("num_emas", manifest["num_emas"]),
                                ("world_size", world), ("rank", rank), ("zero_stage", manifest["zero_stage"]),
                                ("generation", manifest["generation"]), ("dtype", dtype_name)):
                if meta.get(field) != str(want):
                    raise CorruptCheckpointError(
                        f"{where}: metadata {field}={meta.get(field)!r} but the manifest says {want!r}: the file does not "
                        "belong to this checkpoint (mixed copies of two saves?)"
                    )
            check_json_metadata(where, meta, "schedules", manifest)
            check_json_metadata(where, meta, "extra", manifest)
            layout = parse_layout(where, meta.get("layout"), manifest, rank)
            dtype = parse_dtype(dtype_name, where)
            extra = sorted(set(st.tensors) - {tensor_key(k, n) for k in range(int(manifest["num_emas"])) for n in layout.specs})
            if extra:
                raise CorruptCheckpointError(f"{where} holds tensors that no EMA of this checkpoint has: {short_list(extra, 4)}")
            for k in range(int(manifest["num_emas"])):
                for n, spec in layout.specs.items():
                    entry = st.tensors.get(tensor_key(k, n))
                    if entry is None:
                        raise CorruptCheckpointError(f"{where} lacks tensor {tensor_key(k, n)!r} (parameter {n!r}, EMA {k})")
                    if entry.dtype != dtype:
                        raise CorruptCheckpointError(
                            f"{where}: dtype mismatch for parameter {n!r} (EMA {k}): the file stores {entry.dtype}, the "
                            f"manifest says {dtype}. The file was rewritten by another tool; restore it or load another tag"
                        )
                    if entry.numel != spec.numel or tuple(spec.shape) != tuple(manifest["params"].get(n, ())):
                        raise CorruptCheckpointError(
                            f"{where}: parameter {n!r} (EMA {k}): {entry.numel} elements stored, layout says {spec.numel} of "
                            f"{spec.shape}, manifest says shape {manifest['params'].get(n)}"
                        )
            if verify and set(crcs) != set(st.tensors):
                raise CorruptCheckpointError(f"{where}: the manifest's checksums name other tensors than the file holds")
            files.append(RankFile(rank, st, layout, crcs, algo))
        return files

    def holds(self, specs: dict[str, ShardSpec]) -> bool:
        """Whether the opened files hold exactly the pieces ``specs`` describes (same names, offsets, lengths)."""
        if len(self.files) != 1:
            return False
        saved = self.files[0].layout.specs
        return saved.keys() == specs.keys() and all(
            (saved[n].offset, saved[n].numel) == (s.offset, s.numel) for n, s in specs.items())

    def _check_coverage(self) -> None:
        for n, shape in self.shapes.items():
            numel, cursor = math.prod(shape), 0
            for off, cnt, _ in self.pieces[n]:
                if off > cursor:
                    break
                cursor = max(cursor, off + cnt)
            if cursor < numel:
                raise IncompleteCheckpointError(
                    f"{self.tag_dir / MANIFEST_NAME}: field 'params' gives parameter {n!r} the shape {shape}, but the saved "
                    f"pieces cover only elements [0, {cursor}) of "
                    f"{numel}; the manifest lists {len(self.files)} rank file(s) of a world size of {self.world_size}"
                )

    def close(self) -> None:
        for f in self.files:
            f.st.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- buffers

    @property
    def has_buffers(self) -> bool:
        """Whether the save carried module buffers (format 3: ``buffers`` / ``buffer_files`` in the manifest)."""
        return self.manifest.get("buffer_files") is not None

    def read_buffers(self, rank: int, world_size: int, verify: bool = True):
        """This rank's buffers: ``(num_emas, emas, copied)`` read from its own buffer file when the save had
        ``world_size`` ranks, else from rank 0's (buffers are whole tensors; at another world size the
        first rank's stand for all, as DeepSpeed restores module state). Every field of the file is
        checked against the manifest and every byte against its checksum."""
        if not self.has_buffers:
            raise CheckpointMismatchError(
                f"tag {self.tag!r} in {self.root} was saved without buffers (save(..., buffers=None)): load without them, "
                "or start the buffer EMAs from the live buffers (functional_ema.buffers.init_buffers)"
            )
        desc, entries = self.manifest["buffers"], self.manifest["buffer_files"]
        by_rank = {e["rank"]: e for e in entries}
        entry = by_rank.get(rank) if world_size == self.world_size else by_rank.get(0)
        if entry is None:
            raise IncompleteCheckpointError(
                f"{self.tag_dir / MANIFEST_NAME}: field 'buffer_files' lists no buffer file of rank "
                f"{rank if world_size == self.world_size else 0} (saved at world size {self.world_size}); the manifest is damaged"
            )
        path, r = self.tag_dir / entry["file"], entry["rank"]
        where = f"{path} (buffers of rank {r} of {self.world_size})"
        if path.resolve().parent != self.tag_dir.resolve():
            raise CorruptCheckpointError(f"{where} is a link to a file outside the tag folder {self.tag_dir}; functional_ema "
                                         "reads only its own files inside the tag folder")
        try:
            st = _io.SafetensorsFile(path, expected_size=int(entry["bytes"]))
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where} is missing: restore it or load another tag") from None
        except _io.FormatError as err:
            raise CorruptCheckpointError(f"{where}: {err}") from None
        with st:
            algo, header_sum, crcs = file_checksums(self.manifest, entry, where) if verify else (_io.CHECKSUM, None, {})
            if verify and st.header_checksum(algo) != header_sum:
                raise CorruptCheckpointError(f"{where}: the header does not match the checksum in the manifest; the file is corrupted")
            meta = st.metadata
            expect = {"format": BUFFERS_FORMAT, "tag": self.manifest["tag"], "step": str(self.step),
                      "generation": str(self.manifest["generation"]), "rank": str(r), "world_size": str(self.world_size),
                      "num_emas": str(desc["num_emas"]), "dtype": desc["dtype"]}
            for field, want in expect.items():
                if meta.get(field) != want:
                    raise CorruptCheckpointError(
                        f"{where}: metadata {field}={brief(meta.get(field))} but the manifest says {want!r}: the file does not "
                        "belong to this checkpoint (a copy from another save, rank or world size?)"
                    )
            dtype = parse_dtype(desc["dtype"], where)
            want_tensors = {tensor_key(k, n): (dtype, tuple(shape)) for k in range(desc["num_emas"])
                            for n, shape in desc["floating"].items()}
            want_tensors.update({f"copied.{n}": (getattr(torch, dt), tuple(shape)) for n, (dt, shape) in desc["copied"].items()})
            if set(st.tensors) != set(want_tensors):
                raise CorruptCheckpointError(
                    f"{where} holds other tensors than the manifest's field 'buffers' describes: only in the file "
                    f"{short_list(sorted(set(st.tensors) - set(want_tensors)), 4)}, missing "
                    f"{short_list(sorted(set(want_tensors) - set(st.tensors)), 4)}"
                )
            out = {}
            for key, (dt, shape) in want_tensors.items():
                e = st.tensors[key]
                if e.dtype != dt or tuple(e.shape) != shape:
                    raise CorruptCheckpointError(
                        f"{where}: tensor {key!r} is {dtype_name(e.dtype)}{list(e.shape)} in the file but "
                        f"{dtype_name(dt)}{list(shape)} in the manifest's field 'buffers'"
                    )
                if verify and key not in crcs:
                    raise CorruptCheckpointError(f"{where}: the manifest has no checksum for tensor {key!r}")
                t = torch.empty(shape, dtype=dt)
                try:
                    st.read_into(key, t, crcs.get(key) if verify else None, f"[buffers of rank {r}, tag {self.tag!r}]", algo)
                except _io.FormatError as err:
                    raise CorruptCheckpointError(f"{err}") from None
                out[key] = t
        emas = tuple({n: out[tensor_key(k, n)] for n in desc["floating"]} for k in range(desc["num_emas"]))
        copied = {n: out[f"copied.{n}"] for n in desc["copied"]}
        return desc["num_emas"], emas, copied

    # -- checks

    def check_index(self, index: int) -> None:
        if not 0 <= int(index) < self.num_emas:
            raise CheckpointMismatchError(
                f"index={index}, but tag {self.tag!r} holds {self.num_emas} EMA(s) (valid: 0..{self.num_emas - 1})"
            )

    def check_model(self, specs: dict[str, ShardSpec]) -> None:
        saved = self.shapes
        in_model_only = [n for n in specs if n not in saved]
        in_ckpt_only = [n for n in saved if n not in specs]
        bad_shapes = [(n, saved[n], tuple(specs[n].shape)) for n in specs if n in saved and saved[n] != tuple(specs[n].shape)]
        if not (in_model_only or in_ckpt_only or bad_shapes):
            return
        lines = [f"the EMA checkpoint (tag {self.tag!r} in {self.root}, {len(saved)} parameters) does not match this model "
                 f"({len(specs)} trained parameters):"]
        if in_model_only:
            lines.append(f"  in the model but not in the checkpoint: {short_list(in_model_only)}")
        if in_ckpt_only:
            lines.append(f"  in the checkpoint but not in the model: {short_list(in_ckpt_only)}")
        renamed = [(a, b) for a in in_ckpt_only for b in in_model_only if saved[a] == tuple(specs[b].shape)]
        if renamed and len(in_model_only) == len(in_ckpt_only):
            lines.append("  renamed? " + ", ".join(f"{a!r} -> {b!r}" for a, b in renamed[:8]))
        for n, want, got in bad_shapes[:8]:
            lines.append(f"  shape of {n!r}: checkpoint {want}, model {got}")
        lines.append(
            "Load into the model the EMA was saved from (frozen and not-optimized parameters have no EMA), or rebuild "
            "the weights with functional_ema.consolidate, adapt them, and start a new EMA with init_ema"
        )
        raise CheckpointMismatchError("\n".join(lines))

    # -- reading pieces

    def fill(self, dst: torch.Tensor, k: int, name: str, start: int, numel: int, verify: bool) -> None:
        """Write elements ``[start, start + numel)`` of flattened EMA ``k`` of ``name`` into 1-D ``dst``,
        checking the checksums of every byte read when ``verify``."""
        stop, cursor, key = start + numel, start, tensor_key(k, name)
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
                else:
                    out.copy_(f.st.read_range(key, cursor - off, upto - off, crcs, context, f.algo))
            except _io.FormatError as err:
                msg = str(err)
                raise CorruptCheckpointError(msg if context in msg else f"{msg} {context}") from None
            cursor = upto
        if cursor < stop:  # _check_coverage makes this unreachable for well-formed manifests
            raise IncompleteCheckpointError(f"tag {self.tag!r}: elements [{cursor}, {stop}) of {name!r} are in no saved piece")


def fill_all(ckpt: CheckpointReader, jobs: list[tuple[torch.Tensor, int, str, int, int]], verify: bool,
             threads: int | None = None) -> None:
    """``ckpt.fill(*job, verify)`` for every job, on ``threads`` threads at once.

    Each thread reads (positional reads, GIL released) and hashes its own share of the jobs
    (balanced by size); with one thread it is a plain loop. ``threads=None`` takes this rank's share
    of its node's CPUs (:func:`functional_ema._io.io_threads`), for loads that every rank runs at
    once; the offline tools, alone on their machine, pass ``io_threads(shared=False)``. Every job
    has run when this returns or raises (the first failure, in job order).
    """
    threads = _io.io_threads() if threads is None else threads

    def run(job):
        with torch.no_grad():
            ckpt.fill(*job, verify)

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


def open_checkpoint(load_dir, tag: str | None = None, verify: bool = True, layout: ShardLayout | None = None) -> CheckpointReader:
    """Open and validate a saved checkpoint for reading; use it as a context manager.

    Args:
        load_dir: the checkpoint directory, or a tag folder.
        tag: the tag; ``None`` follows ``latest`` (else ``ema_latest``), as :func:`functional_ema.load` does.
        verify: check the manifest's checksums of the headers now and of every byte :meth:`CheckpointReader.fill` reads.
        layout: this rank's :class:`~functional_ema.ShardLayout`, for a reader of this rank's pieces:
            when the checkpoint was saved at the same world size and stage with exactly these pieces,
            only this rank's file is opened; otherwise (and with ``None``, for the offline tools)
            every rank file is, so any range can be re-cut from the saved pieces.

    Example:
        >>> with open_checkpoint("ckpt") as reader:                      # doctest: +SKIP
        ...     full = torch.empty(reader.shapes["w"]).view(-1)
        ...     reader.fill(full, 0, "w", 0, full.numel(), verify=True)
    """
    if layout is None:
        return CheckpointReader.open(load_dir, tag, verify)
    ckpt = CheckpointReader.open(load_dir, tag, verify, own=(layout.rank, layout.world_size, layout.stage))
    if not ckpt.partial or ckpt.holds(layout.specs):
        return ckpt
    ckpt.close()
    return CheckpointReader.open(ckpt.root, ckpt.tag, verify)  # the tag as resolved: `latest` may move meanwhile
