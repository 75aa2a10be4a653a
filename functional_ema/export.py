"""Ship the EMA as a Hugging Face model folder: ``from_pretrained`` loads it, exactly the EMA, or the export refuses.

:func:`to_hf` reads one EMA from a checkpoint that :func:`functional_ema.save` (or an integration)
wrote, in any layout (every rank's pieces, pipeline stages and tensor-parallel slices joined, as
:func:`functional_ema.consolidate` does), or from a consolidated ``.safetensors`` file that this library
wrote (``consolidate``, ``consolidate --dcp``, ``posthoc``, a callback's ``export_path``), and writes, next
to the files of a reference folder ``like`` (the model's own ``save_pretrained`` folder, or a PEFT adapter's)::

    out_dir/model.safetensors                   one file when the weights fit one shard, else
    out_dir/model-00001-of-00003.safetensors    shards of at most max_shard_size bytes each, and
    out_dir/model.safetensors.index.json        which shard holds each tensor
    out_dir/config.json, tokenizer files, ...   every other file of ``like``, copied
    out_dir/ema_export.json                     which EMA this is, and what the export checked and did

(``diffusion_pytorch_model*`` for a diffusers folder, ``adapter_model.safetensors`` for a PEFT adapter).

The export runs in stages, each refusing with one error that names the file, tensor or option:

1. **read** ``like`` with one validating reader (:mod:`functional_ema._export.like`: the folder kind
   and weight file names by the loaders' own rules, every JSON and safetensors file checked);
2. **view** what the real loader expects (:mod:`functional_ema._export.loader`: the config's class built on
   the meta device; names, shapes, tied groups and renamings as ``save_pretrained`` writes them);
3. **plan** every tensor written (:mod:`functional_ema._export.plan`: names fitted, shapes checked, tied
   aliases left out only when their EMA value equals the tensor they are tied to, missing weights
   copied from ``like`` only when the EMA lacks them);
4. **write** under a temporary folder beside ``out_dir`` (one tensor in memory at a time; ``fp16`` values
   that do not fit are refused), read back and checked against the checksums computed while writing,
   then renamed into place (:mod:`functional_ema._export.outdir`: ``overwrite`` replaces only a previous
   export or an empty folder, never the current folder, a parent, home or ``/``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from . import _io, _memory
from ._args import check_bool, check_location, check_path, check_storage_options, check_str, refuse_url
from ._checkpoint.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignFileError,
)
from ._checkpoint.format import CONSOLIDATED_FORMAT, _selection_ok, library_version, short_list
from ._checkpoint.reader import JoinedReader, StoragePath, open_joined
from ._core import all_finite
from ._export.foreign import copy_regular_file, open_weights
from ._export.like import EXPORT_RECORD, LikeFolder, read_like
from ._export.loader import loader_view, peft_expected, untied_by_flag
from ._export.names import WRAPPER_PREFIXES, peft_name, strip_wrappers
from ._export.outdir import EXPORT_FORMAT, check_out_dir, commit_dir, new_tmp_dir
from ._export.plan import Item, Plan, make_plan
from ._storage import file_url_path, is_url, storage_for

__all__ = ["EXPORT_RECORD", "WRAPPER_PREFIXES", "hf_name", "parse_dtype", "parse_size", "to_hf"]

#: ``ema_export.json``'s version: 2 adds ``written``, ``loader_check``, ``ignored_in_like`` and ``source_metadata``.
RECORD_VERSION = 2
#: The ``format`` metadata of the files this library writes with full EMA weights: the sources a file export takes.
SOURCE_FORMATS = (CONSOLIDATED_FORMAT, "functional_ema.export", "functional_ema.posthoc")
_DTYPES = MappingProxyType(
    {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
)
_UNITS = MappingProxyType(
    {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    | {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # every unit parse_size's pattern accepts
)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` (also fp16, fp32) -> the torch dtype; ``None`` keeps the EMA's.

    Raises:
        ValueError: another value, naming the ``dtype`` option.
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in _DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype (--dtype) must be one of fp32, bf16, fp16 (or the torch dtypes), got {dtype!r}")


def parse_size(size: int | str) -> int:
    """``"5GB"`` (10^9 bytes, as Hugging Face counts), ``"500MiB"``, ``"10KB"`` or an int of bytes -> bytes (> 0).

    Raises:
        ValueError: anything else, naming the ``max_shard_size`` option.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper()) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size (--max-shard-size) must be a positive size such as 5GB, 500MB, 64KiB or a number of "
            f"bytes, got {size!r}"
        )
    return max(1, int(float(m.group(1)) * _UNITS[m.group(2) or ""]))


def hf_name(name: str, adapter_name: str | None = None) -> str:
    """A checkpoint's parameter name as ``save_pretrained`` writes it: wrapper components removed
    (:data:`WRAPPER_PREFIXES` anywhere, a leading ``module.``), and with ``adapter_name`` PEFT's rule
    (``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``; ``x.modules_to_save.default.weight`` ->
    ``x.weight``; DoRA's ``x.lora_magnitude_vector.default.weight`` -> ``x.lora_magnitude_vector``)."""
    stripped = strip_wrappers(check_str(name, "name"))
    return stripped if adapter_name is None else peft_name(stripped, check_str(adapter_name, "adapter_name"))


# ------------------------------------------------------------------------------------------- sources


class _Source(NamedTuple):
    """Where the EMA's full tensors come from: shapes, dtype, a reader of one whole tensor, and what it is."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    fill: Any  # (flat dst, name) -> None
    info: dict[str, Any]
    paths: list[Path]  # folders/files written outputs must stay away from


@contextlib.contextmanager
def _open_source(
    source: str | os.PathLike,
    tag: str | None,
    index: int | None,
    verify: bool,
    tp_dims: dict | None,
    options: dict[str, Any],
) -> Iterator[_Source]:
    url = is_url(source)
    path = Path(source)
    if url and str(source).endswith(".safetensors"):  # a consolidated file at a URL: ranged reads, in place
        folder, _, name = str(source).rstrip("/").rpartition("/")
        with _open_file_source(StoragePath(storage_for(folder, **options)) / name, verify, tag, index) as src:
            yield src
        return
    if not url and path.is_file():
        with _open_file_source(path, verify, tag, index) as src:
            yield src
        return
    index = 0 if index is None else index
    ckpt: JoinedReader
    where = StoragePath(storage_for(str(source), **options)) if url else path
    with open_joined(where, tag, verify, tp_dims) as ckpt:
        ckpt.check_index(index)
        shapes = dict(ckpt.shapes)
        dtypes = {n: ckpt.dtype for n in shapes}
        buffers: dict[str, torch.Tensor] = {}
        if all(r.has_buffers for r in ckpt.readers):
            _, emas, copied = ckpt.read_buffers(verify)  # small: every buffer in memory
            buffers = {**emas[index], **copied}
        for n, t in buffers.items():
            if n not in shapes:
                shapes[n], dtypes[n] = tuple(t.shape), t.dtype

        def fill_ckpt(dst: torch.Tensor, name: str) -> None:
            if name in ckpt.shapes:
                ckpt.fill(dst, index, name, 0, dst.numel(), verify)
            else:
                dst.copy_(buffers[name].reshape(-1))

        schedules = ckpt.manifest.get("schedules")
        info = {
            "source": str(source) if url else str(path),
            "source_kind": "checkpoint",
            "tag": ckpt.tag,
            "step": int(ckpt.step),
            "ema_index": index,
            "schedule": schedules[index] if schedules else None,
            "saved_world_size": ckpt.world_size,
            "buffers": sorted(buffers),
        }
        if ckpt.manifest.get("selection") is not None:  # the include/exclude the EMA averages (absent: every
            info["selection"] = ckpt.manifest["selection"]  # parameter); the others come from --like (copied_from_like)
        yield _Source(shapes, dtypes, fill_ckpt, info, [Path(ckpt.root), Path(ckpt.tag_dir)])


@contextlib.contextmanager
def _open_file_source(
    path: Path | StoragePath, verify: bool, tag: str | None = None, index: int | None = None
) -> Iterator[_Source]:
    """A consolidated file this library wrote (its ``format`` metadata says which), validated, read per tensor
    (a file at a URL: with ranged reads of the storage, as a checkpoint's). ``tag``/``index``, when given, must be
    the file's own (:func:`_check_file_choice`)."""
    try:
        opened = _io.SafetensorsFile(path.source() if isinstance(path, StoragePath) else path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist") from None
    except _io.FormatError as e:
        raise CorruptCheckpointError(f"source: {e}") from None
    with opened as f:
        fmt = f.metadata.get("format")
        if fmt not in SOURCE_FORMATS:
            raise CheckpointMismatchError(
                f"{path}: not a file of full EMA weights written by functional_ema (its safetensors metadata 'format' "
                f"is {fmt!r}, expected one of {list(SOURCE_FORMATS)}); export a checkpoint folder, or the output of "
                "consolidate, consolidate --dcp or posthoc"
            )
        _check_file_choice(path, f.metadata, tag, index)
        shapes = {n: e.shape for n, e in f.tensors.items()}
        dtypes = {n: e.dtype for n, e in f.tensors.items()}
        try:
            sums = _io.self_checksums(f) if verify else None  # files this library wrote carry their own
        except _io.FormatError as e:
            raise CorruptCheckpointError(f"source: {e}") from None

        def fill_file(dst: torch.Tensor, name: str) -> None:
            try:
                f.read_into(name, dst, crcs=None if sums is None else sums[name], context="source")
            except _io.FormatError as e:
                raise CorruptCheckpointError(f"source: {e}") from None

        step = f.metadata.get("step", "")
        recorded = f.metadata.get("ema_index", "")
        info: dict[str, Any] = {
            "source": str(path),
            "source_kind": "file",
            "source_format": fmt,
            "step": int(step) if step.isdigit() else None,
            "ema_index": int(recorded) if recorded.isdigit() else None,
            "source_verified": sums is not None,  # older consolidated files carry no checksums of their own
            "source_metadata": {k: f.metadata[k] for k in sorted(f.metadata)},
        }
        if "selection" in f.metadata:  # consolidate_to_file of an EMA of an include/exclude selection
            info["selection"] = _file_selection(path, f.metadata["selection"])
        yield _Source(shapes, dtypes, fill_file, info, [path] if isinstance(path, Path) else [])


def _check_file_choice(path: Path | StoragePath, meta: dict[str, str], tag: str | None, index: int | None) -> None:
    """A file source holds one EMA, of one tag: a ``tag`` or ``index`` asked for must be the one its metadata records
    (it was ignored: another EMA than the one asked for was exported). An index 0 is the only EMA of a file that
    records none (a post-hoc file); a tag needs one recorded."""
    fix = "omit --tag and --index for a file (it holds one EMA), or export the checkpoint folder"
    held = meta.get("tag")
    if tag is not None and tag != held:
        what = f"holds tag {held!r}" if held is not None else "records no tag (its metadata has none)"
        raise CheckpointMismatchError(f"tag={tag!r}, but the file {path} {what}: {fix}")
    recorded = meta.get("ema_index", "")
    own = int(recorded) if recorded.isdigit() else 0
    if index is not None and index != own:
        what = (
            f"holds EMA {own}{f' of tag {held!r}' if held is not None else ''} only"
            if recorded.isdigit()
            else "holds one EMA (index 0: it records no ema_index)"
        )
        raise CheckpointMismatchError(f"index={index}, but the file {path} {what}: {fix}")


def _file_selection(path: Path | StoragePath, text: str) -> dict[str, Any]:
    """A consolidated file's ``selection`` metadata (the checkpoint manifest's record, as JSON), checked."""
    try:
        selection = json.loads(text)
    except ValueError:
        selection = None
    if not isinstance(selection, dict) or not _selection_ok(selection):
        raise CorruptCheckpointError(
            f"source: {path}: safetensors metadata 'selection' must be an include/exclude record as JSON, got "
            f"{text[:80]!r}"
        )
    return selection


# --------------------------------------------------------------------------------------------- export


def _shards(names: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """Names in order, cut into consecutive groups of at most ``limit`` bytes (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        if groups[-1] and size + nbytes[n] > limit:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes[n]
    return [g for g in groups if g]


def _check_options(
    dtype: Any, max_shard_size: Any, missing: Any, index: Any, adapter_name: Any, flags: dict[str, Any]
) -> tuple:
    for what, value in flags.items():
        if not (what == "progress" and value is None):
            check_bool(value, what)
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    if missing not in ("like", "error"):
        raise ValueError(f'missing (--missing) must be "like" or "error", got {missing!r}')
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise ValueError(f"index (--index) must be an int >= 0, got {index!r}")
    if not isinstance(adapter_name, str) or not adapter_name or any(c in adapter_name for c in "./\\\x00 \t\n"):
        raise ValueError(
            f"adapter_name (--adapter-name) must be a PEFT adapter name (no dots or separators), got {adapter_name!r}"
        )
    return cast, limit


class _Like:
    """``--like``'s weights read one tensor at a time (for the weights the EMA lacks, and the tie checks)."""

    def __init__(self, like: LikeFolder) -> None:
        self.like = like

    def read(self, name: str) -> torch.Tensor:
        file, entry = self.like.weights[name]
        out = torch.empty(entry.numel, dtype=entry.dtype)
        try:
            with open_weights(file, "like (--like)") as f:  # the descriptor checked regular is the one read
                f.read_into(name, out)
        except (_io.FormatError, OSError) as e:
            raise ForeignFileError(f"like (--like): {file}: {e}") from None
        return out

    def equal(self, a: str, b: str, chunk: int = 2**22) -> bool:
        """``a`` and ``b`` hold the same shape and values, compared a chunk of elements at a time (never two whole
        tensors in memory: an embedding can be the model's largest tensor) with ``torch.equal``: -0.0 equals 0.0 and
        NaN never equals NaN, as transformers compares a saved tied pair. Two floating dtypes are compared as float64,
        which holds both exactly: transformers casts both to the model's dtype before comparing, so an fp32 embedding
        beside its bf16 copy is tied (an fp32 value a bf16 cast would round is not equal: refused, never shipped)."""
        (fa, ea), (fb, eb) = self.like.weights[a], self.like.weights[b]
        cast = None if ea.dtype == eb.dtype else torch.float64
        if ea.shape != eb.shape or (
            cast is not None and not (ea.dtype.is_floating_point and eb.dtype.is_floating_point)
        ):
            return False
        try:  # each through a descriptor checked to be a regular file; a corrupted span is a FormatError, named
            with open_weights(fa, "like (--like)") as f, open_weights(fb, "like (--like)") as g:
                for i in range(0, ea.numel, chunk):
                    x, y = (h.read_range(n, i, min(i + chunk, ea.numel)) for h, n in ((f, a), (g, b)))
                    if not torch.equal(x if cast is None else x.to(cast), y if cast is None else y.to(cast)):
                        return False
                return True
        except (_io.FormatError, OSError) as e:
            raise ForeignFileError(f"like (--like): {fa if fa == fb else f'{fa} or {fb}'}: {e}") from None


def _saved_aliases(like: LikeFolder, view: Any) -> tuple[LikeFolder, dict[str, str]]:
    """Tied aliases saved in ``--like``'s weights (``lm_head.weight`` beside the embedding, as older Hub folders have
    it), which the loader's view says the class ties: ``save_pretrained`` leaves them out and ``from_pretrained`` ties
    them, so the export plans without them and leaves them out too (the loaded alias is then its pair's EMA). Only
    where --like holds the same values in both: transformers loads a folder whose saved alias differs untied, so the
    model may have trained untied, and its EMA would then not be what the export ships. (like, alias -> pair)

    Raises:
        ForeignFileError: a saved alias whose values differ from its pair's, naming both, the file and the tie.
    """
    if view is None:  # without a view, _stale_aliases takes such a folder (written from the EMA of its pair)
        return like, {}
    found = {a: h for a, h in view.aliases.items() if a in like.weights and h in like.weights and a not in view.saved}
    if not found:
        return like, {}
    reader = _Like(like)
    for alias, holder in found.items():
        if not reader.equal(alias, holder):
            raise _stale_alias(like, view, alias, holder)
    return like._replace(weights={n: w for n, w in like.weights.items() if n not in found}), found


def _stale_alias(like: LikeFolder, view: Any, alias: str, holder: str) -> ForeignFileError:
    """The refusal of --like's saved tied ``alias`` whose values differ from ``holder``'s. It advises setting
    ``tie_word_embeddings`` false only where that flag unties the two, as the loader reads a copy of the config
    stating it false (``untied_by_flag``: an output embedding, BART's ``embed_tokens``; not T5's, whose config forces
    the flag true)."""
    flag = alias in untied_by_flag(like.kind, like.config, like.config_file, [alias])
    why = f"tie_word_embeddings true in {like.config_file}" if flag else "by the class itself, whatever the config says"
    untied = (
        "Trained untied: set tie_word_embeddings to false in --like's config.json. "
        if flag
        else f"No config flag controls this tie in {view.cls}. "
    )
    return ForeignFileError(
        f"like (--like): {like.weights[alias][0]} holds {alias!r} with other values (or shape) than {holder!r}, to "
        f"which {view.cls} ties it ({why}): transformers loads such a folder untied, so a model trained from it may "
        f"have trained the two apart, and the export cannot tell which. {untied}Trained tied: load --like with "
        f"from_pretrained, save_pretrained it to a new folder (which leaves {alias!r} out), and pass that as --like"
    )


def _check_ties(plan: Plan, src: _Source, like: _Like) -> list[str]:
    """Each tied alias left out must hold, in the EMA, exactly the value the loader gives it. Its names."""
    by_name = {it.name: it for it in plan.items}
    for alias, holder in plan.ties:
        mine = torch.empty(math.prod(src.shapes[alias]), dtype=src.dtypes[alias])
        src.fill(mine, alias)
        it = by_name[holder]
        theirs = torch.empty(math.prod(it.shape), dtype=src.dtypes[it.key]) if it.origin == "ema" else None
        if theirs is not None:
            src.fill(theirs, it.key)
        else:
            theirs = like.read(holder)
        if not torch.equal(mine.to(it.dtype), theirs.to(it.dtype)):
            raise CheckpointMismatchError(
                f"EMA tensor {alias!r} is tied to {holder!r} by --like's config ({like.like.config_file}), but their "
                "values differ: the loaded model would hold one value for both, not this EMA. If the model was trained "
                "untied, set tie_word_embeddings to false in --like's config.json and save the output embedding there"
            )
    return [a for a, _ in plan.ties]


def _check_peft(like: LikeFolder, plan: Plan, adapter_name: str = "default") -> str:
    """The adapter written is what PEFT's loader reads for ``like``'s config (names and shapes); "" when checked,
    else why not (the record's ``loader_check``)."""
    planned = {it.name: tuple(it.shape) for it in plan.items}
    expected, why = peft_expected(like.config_file, planned, adapter_name)
    if expected is not None and expected != planned:
        odd = sorted(set(expected) ^ set(planned)) or sorted(n for n in planned if planned[n] != expected[n])
        shown = [
            f"{n} {list(planned.get(n, ())) or 'not written'} vs {list(expected.get(n, ())) or 'not read'}"
            for n in odd[:4]
        ]
        raise CheckpointMismatchError(
            f"{like.config_file} and the EMA disagree: PEFT, reading this config, expects other adapter weights than "
            f"the EMA's ({len(odd)} name(s), written vs read: {'; '.join(shown)}). Give the adapter's own config"
        )
    return why


def _record(
    src: _Source, like: LikeFolder, plan: Plan, cast: torch.dtype | None, files: list[str], extra: dict
) -> dict:
    """``ema_export.json``: the export's own fields always win over anything the source's metadata says."""
    layout = {"peft": "peft", "diffusers": "diffusers"}.get(like.kind, "transformers")
    own = {
        "format": EXPORT_FORMAT,
        "format_version": RECORD_VERSION,
        "library": f"functional_ema {library_version()}",
        "dtype": str(cast or "as saved").removeprefix("torch."),
        "layout": layout,
        "like": str(like.given),
        "like_folder": str(like.folder),
        "files": files,
        "prefix_dropped": plan.prefix,
        "copied_from_like": [it.name for it in plan.items if it.origin == "like"],
        "ignored_in_like": like.ignored,
        "other_adapters_left_out": plan.other_adapters,
        **extra,
    }
    return {**{k: v for k, v in src.info.items() if k not in own}, **own}


_META_KEYS = ("format", "source", "tag", "step", "ema_index", "schedule", "dtype", "layout")


def _scratch(plan: Plan, src: _Source) -> torch.Tensor:
    """One byte buffer, reused for every tensor read from the source and read back: the largest of them."""
    largest = max(
        (math.prod(it.shape) * max(it.dtype.itemsize, src.dtypes.get(it.key, it.dtype).itemsize) for it in plan.items),
        default=0,
    )
    return _memory.empty(largest // 4 + 1, dtype=torch.float32).view(torch.uint8)


def _write(
    tmp: Path,
    plan: Plan,
    groups: list[list[str]],
    files: list[str],
    src: _Source,
    like: _Like,
    meta: dict,
    bar: Any,
    buffer: torch.Tensor,
) -> dict[str, dict[str, list[int]]]:
    """Every planned tensor into its file, one in memory at a time. Returns file -> name -> chunk checksums."""
    by_name = {it.name: it for it in plan.items}
    sums: dict[str, dict[str, list[int]]] = {}
    for group, fname in zip(groups, files):
        entries = [(n, by_name[n].dtype, by_name[n].shape) for n in group]
        with _io.StreamingWriter(tmp / fname, entries, meta, checksums=True) as w:
            for n in group:
                it = by_name[n]
                if it.origin == "ema":
                    sdt = src.dtypes[it.key]
                    flat = buffer[: math.prod(it.shape) * sdt.itemsize].view(sdt)
                    src.fill(flat, it.key)  # checked before it is written
                else:
                    flat = like.read(it.key)
                out = flat.to(it.dtype) if flat.dtype != it.dtype else flat
                if out.dtype != flat.dtype and flat.is_floating_point():
                    _check_cast(flat, out, n)
                w.write(n, out)
                bar.update(out.numel() * out.element_size())
            w.commit()
            sums[fname] = dict(w.crcs)
    return sums


def _check_cast(before: torch.Tensor, after: torch.Tensor, name: str) -> None:
    if all_finite(after):  # the common case: one read, no mask
        return
    overflow = torch.isfinite(before) & ~torch.isfinite(after)
    if bool(overflow.any()):
        peak = float(before[overflow].abs().max())
        raise CheckpointMismatchError(
            f"tensor {name!r}: {int(overflow.sum())} value(s) (up to {peak:.4g} in magnitude) do not fit {after.dtype} "
            "and would become inf; export in bf16 or fp32 (--dtype)"
        )


def _read_back(
    tmp: Path, plan: Plan, files: list[str], sums: dict[str, dict[str, list[int]]], buffer: torch.Tensor
) -> None:
    """The export checks itself: each file re-opened, its tensors as planned, its bytes as written."""
    want = {it.name: it for it in plan.items}
    seen: set[str] = set()
    for fname in files:
        with _io.SafetensorsFile(tmp / fname) as f:
            for n, e in f.tensors.items():
                it = want.get(n)
                if it is None or e.dtype != it.dtype or tuple(e.shape) != tuple(it.shape) or n in seen:
                    raise CheckpointMismatchError(
                        f"export self-check: {fname} holds {n!r} {e.dtype}{list(e.shape)}, not as planned"
                    )
                buf = buffer[: e.numel * e.dtype.itemsize].view(e.dtype)
                f.read_into(n, buf, crcs=sums[fname][n], context="export self-check")
                seen.add(n)
    if seen != set(want):
        raise CheckpointMismatchError(
            f"export self-check: tensors never written: {short_list(sorted(set(want) - seen))}"
        )


def to_hf(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    like: str | os.PathLike,
    *,
    tag: str | None = None,
    index: int | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    missing: str = "like",
    adapter_name: str = "default",
    overwrite: bool = False,
    verify: bool = True,
    progress: bool | None = None,
    tp_dims: dict[str, int | None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """Write EMA ``index`` of ``source`` as a Hugging Face model folder (or PEFT adapter folder); see the module docstring.

    Args:
        source: a checkpoint directory (or tag folder) written by :func:`functional_ema.save`, any
            layout; or a consolidated ``.safetensors`` file this library wrote (``consolidate``,
            ``consolidate --dcp``, ``posthoc``, a callback's ``export_path``). Either may be an fsspec URL
            (``s3://bucket/run``), read in place.
        out_dir: the local folder to create (must not exist, or be empty, or with ``overwrite`` be a previous export).
        like: the model's ``save_pretrained`` folder (``config.json``; its weights, when present, fix
            the names and supply what the EMA lacks), or a PEFT adapter folder (``adapter_config.json``).
        tag, index, verify, tp_dims: as for :func:`functional_ema.consolidate` (``index=None``: 0). A file source
            holds one EMA: ``tag`` and ``index`` must then be omitted or match the file's own ``tag`` /
            ``ema_index`` metadata (refused otherwise, as a checkpoint refuses an index it does not hold).
            ``verify`` also reads the written files back against their checksums.
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or the torch dtype) for floating tensors; ``None``: as saved.
            Integer tensors keep their dtype. Values that do not fit ``fp16`` are refused.
        max_shard_size: the most bytes per ``model-*.safetensors`` shard (``"5GB"`` as Hugging Face
            counts, ``"500MiB"``, or an int). One shard is written as ``model.safetensors``. PEFT: one file.
        missing: ``"like"`` copies weights the EMA lacks from ``like``; ``"error"`` refuses them.
        adapter_name: PEFT: the adapter the EMA was trained as (its name is removed from the names, and
            a non-default adapter's folder is ``like/<adapter_name>/``, where PEFT saves it).
        overwrite: replace ``out_dir`` when it holds a previous export (as a whole, once the new folder is complete).
        progress: show a progress bar (``None``: when stderr is a terminal).
        storage_options: for a URL ``source``, fsspec's arguments (``key``, ``secret``, ``endpoint_url``, ...)
            as for :func:`functional_ema.load`; ``None``: fsspec's configuration. Refused with a local source.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: a bad ``dtype``, ``max_shard_size``, ``missing``, ``index`` or ``adapter_name``, naming it.
        OutputPathError: ``out_dir`` empty, the current folder or above it, inside or above what is read, under a
            file, or existing and not a previous export (or without ``overwrite``).
        ForeignFileError: a malformed, ambiguous or inconsistent ``like`` folder, naming the file and field.
        CheckpointMismatchError: the EMA does not fit ``like`` (names, shapes, ties, adapters), naming the tensors.

    Example:
        >>> fe.export.to_hf("out/checkpoint-800", "ema_hf", like="base_model")   # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("ema_hf")                         # doctest: +SKIP
    """
    from .checkpoint import _progress, url_access

    source = check_location(source, "source (SOURCE)")
    options = check_storage_options(storage_options, source, "to_hf(storage_options=...)")
    refuse_url(out_dir, "out_dir (OUT_DIR)", "the export builds a local folder; upload it once it is written")
    refuse_url(like, "like (--like)", "give the model's save_pretrained folder on a local disk")
    out_dir, like = _local(out_dir, "out_dir (OUT_DIR)"), _local(like, "like (--like)")
    flags = {"overwrite": overwrite, "verify": verify, "progress": progress}
    cast, limit = _check_options(dtype, max_shard_size, missing, index, adapter_name, flags)
    like_folder = read_like(like, adapter_name)
    view, why_not = loader_view(like_folder.kind, like_folder.config, like_folder.config_file)
    # a URL's storage refusing access names to_hf's storage_options
    with (
        url_access(str(source) if is_url(source) else None, "to_hf"),
        _open_source(source, tag, index, verify, tp_dims, options) as src,
    ):
        real_out = check_out_dir(out_dir, [*src.paths, like_folder.given], overwrite)
        like_folder, like_aliases = _saved_aliases(like_folder, view)
        selection = src.info.get("selection")
        plan = make_plan(src.shapes, src.dtypes, like_folder, view, adapter_name, cast, missing, selection)
        if like_folder.kind == "peft":
            why_not = _check_peft(like_folder, plan, adapter_name)
        reader = _Like(like_folder)
        tied = _check_ties(plan, src, reader)
        plan, from_ema = (plan, {}) if view is not None else _stale_aliases(plan, like_folder, reader)
        config_dtype = _config_dtype(like_folder, plan, cast)
        nbytes = {it.name: math.prod(it.shape) * it.dtype.itemsize for it in plan.items}
        groups = [list(nbytes)] if like_folder.kind == "peft" else _shards(list(nbytes), nbytes, limit)
        files, index_name = _file_names(like_folder.stem, len(groups))
        extra: dict[str, Any] = {
            "tied_left_out": tied,
            "aliases_from_ema": from_ema,
            # present only where --like saved a tied alias (older Hub folders): the record stays as it was otherwise
            **({"aliases_in_like_left_out": like_aliases} if like_aliases else {}),
            # config.json is --like's (copied; rewritten with a dtype): a PEFT export writes none, so lists none.
            "written": sorted({*files, *index_name, *(p.name for p in like_folder.copied), EXPORT_RECORD}),
            "loader_check": _loader_check(view, like_folder, why_not),
            "config_dtype": None if config_dtype is None else str(config_dtype).removeprefix("torch."),
        }
        record = _record(src, like_folder, plan, cast, files, extra)
        meta = {"format": "pt", "functional_ema": json.dumps({k: record.get(k) for k in _META_KEYS})}
        tmp = new_tmp_dir(real_out)
        bar = _progress(sum(nbytes.values()), progress, f"export {real_out.name}")
        try:
            buffer = _scratch(plan, src)
            sums = _write(tmp, plan, groups, files, src, reader, meta, bar, buffer)
            if verify:
                _read_back(tmp, plan, files, sums, buffer)
            if index_name:
                _write_index(tmp / index_name[0], groups, files, sum(nbytes.values()), meta)
            for f in like_folder.copied:  # regular when listed; checked again on the descriptor each is read from
                copy_regular_file(f, tmp / f.name, "like (--like)")
            _write_config(tmp, like_folder, config_dtype)
            _io.atomic_write_bytes(tmp / EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())
            _io.fsync_dir(tmp)
            commit_dir(tmp, real_out, Path(out_dir), overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
    return Path(out_dir)


def _local(value: Any, what: str) -> Any:
    """A ``file:///abs/dir`` (or ``local://``) URL as the local path it names (``_args.check_path``, as every verb
    reads one; ``Path`` would make it the relative folder ``file:``); anything else as given, for its own checks."""
    if isinstance(value, str) and value and "\x00" not in value:
        local = check_path(value, what)  # refuses a file URL naming no local path, or one missing a slash
        return local if file_url_path(value) is not None else value  # else as given: messages quote it so
    return value


def _file_names(stem: str, num_files: int) -> tuple[list[str], list[str]]:
    """The weight files' names as ``save_pretrained`` gives them (one file unsharded, else
    ``<stem>-00001-of-0000N``), and the index's name (none for one file)."""
    if num_files == 1:
        return [f"{stem}.safetensors"], []
    files = [f"{stem}-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    return files, [f"{stem}.safetensors.index.json"]


def _write_index(path: Path, groups: list[list[str]], files: list[str], total_size: int, meta: dict) -> None:
    """The sharded export's ``*.safetensors.index.json``, as ``save_pretrained`` writes it (plus our record)."""
    weight_map = {n: f for g, f in zip(groups, files) for n in g}
    body = {"metadata": {"total_size": total_size, "functional_ema": meta["functional_ema"]}, "weight_map": weight_map}
    _io.atomic_write_bytes(path, json.dumps(body, indent=2).encode())


def _loader_check(view: Any, like_folder: LikeFolder, why_not: str | None) -> dict[str, str | None]:
    """``ema_export.json``'s ``loader_check``: which loader's reading the plan was checked against, or why none."""
    if view is not None:
        return {"class": view.cls, "result": "names, shapes and ties as save_pretrained writes them"}
    if like_folder.kind == "peft" and not why_not:
        return {"class": "peft", "result": "names and shapes as PEFT reads them for this adapter_config.json"}
    return {"class": None, "result": f"not run: {why_not}{_UNSEEN if like_folder.kind != 'peft' else ''}"}


#: ``loader_check``'s note without a view: what the export then cannot see.
_UNSEEN = (
    "; without it, a weight the loader reads that neither the EMA nor --like's weights hold cannot be seen (the "
    "loader would leave it initialised)"
)
_SUBCONFIGS = ("text_config", "vision_config", "audio_config")


def _configs(like: LikeFolder) -> list[dict[str, Any]]:
    """``--like``'s config and the sub-configs (text, vision, audio) that composite models nest in it."""
    return [like.config, *(c for c in map(like.config.get, _SUBCONFIGS) if isinstance(c, dict))]


def _stale_aliases(plan: Plan, like: LikeFolder, reader: _Like) -> tuple[Plan, dict[str, str]]:
    """Without a loader view: a weight the EMA lacks that ``--like`` holds with exactly the values of a weight the EMA
    holds, of the word embeddings' shape under a config that ties them, is that weight's tied alias (a folder saved
    with it, as many are): written from the EMA of its pair, never copied stale from ``--like``. (plan, alias -> pair)"""
    configs = _configs(like)
    if like.kind != "transformers" or not any(c.get("tie_word_embeddings", True) is True for c in configs):
        return plan, {}
    vocab = {c.get("vocab_size") for c in configs}
    held = [it for it in plan.items if it.origin == "ema" and it.name in like.weights]
    items, found = [], {}
    for it in plan.items:
        pairs = [h for h in held if h.shape == it.shape] if it.origin == "like" and len(it.shape) == 2 else []
        pair = next(
            (h for h in pairs if it.shape[0] in vocab and torch.equal(reader.read(it.key), reader.read(h.name))), None
        )
        items.append(it if pair is None else Item(it.name, pair.dtype, pair.shape, "ema", pair.key))
        if pair is not None:
            found[it.name] = pair.name
    return plan._replace(items=items), found


def _config_dtype(like: LikeFolder, plan: Plan, cast: torch.dtype | None) -> torch.dtype | None:
    """The dtype a transformers ``config.json`` must state: the floating weights written (``from_pretrained``'s
    default ``dtype="auto"`` loads the model in it; mixed, float32 holds each exactly). ``None``: ``--like``'s
    config is copied as it is (no ``dtype`` given, and the dtype it states, if any, is this one; or it states none
    and the weights share one dtype, which ``dtype="auto"`` then takes from the file).

    Mixed weights under a config stating none must state one: ``dtype="auto"`` would take the first floating
    tensor's dtype from the file (a bf16 copy from ``--like``) and truncate the fp32 EMA."""
    if like.kind != "transformers":
        return None
    floats = {it.dtype for it in plan.items if it.dtype.is_floating_point}
    mixed = cast is None and len(floats) > 1
    written = cast or (floats.pop() if len(floats) == 1 else max(floats | {torch.float32}, key=lambda d: d.itemsize))
    configs = _configs(like)
    stated = [c[k] for c in configs for k in ("dtype", "torch_dtype") if c.get(k) is not None]
    if cast is not None or (mixed and not stated):
        return written
    return written if any(v != str(written).removeprefix("torch.") for v in stated) else None


def _write_config(tmp: Path, like: LikeFolder, dtype: torch.dtype | None) -> None:
    """A transformers config states ``dtype`` (``from_pretrained(dtype="auto")`` reads it there; sub-configs that
    state one too), when given (:func:`_config_dtype`)."""
    if dtype is None or like.kind != "transformers":
        return
    name = str(dtype).removeprefix("torch.")
    config = dict(like.config)
    for key in ("dtype", "torch_dtype"):
        if key in config or key == "dtype":
            config[key] = name
    for sub in _SUBCONFIGS:
        if isinstance(config.get(sub), dict):
            config[sub] = {**config[sub], **{k: name for k in ("dtype", "torch_dtype") if k in config[sub]}}
    _io.atomic_write_bytes(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
