"""Ship the EMA as a Hugging Face model folder: ``from_pretrained`` loads it, nothing else needed.

:func:`to_hf` reads one EMA from a checkpoint that :func:`functional_ema.save` (or an integration)
wrote, in any layout (every rank's pieces, pipeline stages and tensor-parallel slices joined, as
:func:`functional_ema.consolidate` does), or from a consolidated ``.safetensors`` file (the output of
``consolidate``, ``consolidate --dcp`` or ``posthoc``), and writes, next to the files of a reference
folder ``like`` (the model's own ``save_pretrained`` folder, or a PEFT adapter's)::

    out_dir/model.safetensors                   one file when the weights fit one shard, else
    out_dir/model-00001-of-00003.safetensors    shards of at most max_shard_size bytes each, and
    out_dir/model.safetensors.index.json        which shard holds each tensor
    out_dir/config.json, tokenizer files, ...   every other file of ``like``, copied
    out_dir/ema_export.json                     which EMA this is: source, tag, step, index, schedule

or, when ``like`` is a PEFT adapter folder (it holds ``adapter_config.json``)::

    out_dir/adapter_model.safetensors           the adapters' EMA, names as PEFT saves them
    out_dir/adapter_config.json, ...            copied from ``like``
    out_dir/ema_export.json

Names: the module's parameter names as the checkpoint recorded them, with wrapper prefixes removed
(a leading ``module.``; ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, Lightning's ``_forward_module.``
anywhere), then fitted to the names in ``like``'s weight files when it has any: leading components
are dropped until the name is one of them (a framework's own prefix, e.g. a LightningModule's
attribute ``model.``); PEFT's adapter name is removed (``lora_A.default.weight`` ->
``lora_A.weight``). A tied duplicate (``lm_head.weight`` with ``tie_word_embeddings``) that ``like``
does not store is left out, as ``save_pretrained`` does. Weights that ``like`` stores and the EMA
lacks (frozen parameters, persistent buffers of a checkpoint saved without buffers) are copied from
``like`` (``missing="like"``, the default, listed in ``ema_export.json``) or refused
(``missing="error"``). An EMA name with no place in ``like`` is refused, naming it.

Memory: one tensor at a time (read, cast to ``dtype``, written; the shard's header is written first),
never a whole shard or model. Writes: the folder is built under a temporary name beside ``out_dir``
and renamed into place when complete; an existing ``out_dir`` is refused unless ``overwrite=True``
(then it is replaced, as a whole, after the new one is complete). An ``out_dir`` inside or above the
checkpoint or ``like`` is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from . import _io, _memory
from ._checkpoint.errors import CheckpointMismatchError, OutputPathError
from ._checkpoint.format import library_version, short_list
from ._checkpoint.reader import JoinedReader, open_joined

__all__ = ["EXPORT_RECORD", "WRAPPER_PREFIXES", "hf_name", "parse_dtype", "parse_size", "to_hf"]

EXPORT_RECORD = "ema_export.json"
#: Module-path components that wrappers insert: removed from every name (``module`` only in front).
WRAPPER_PREFIXES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")
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
    {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
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
    (:data:`WRAPPER_PREFIXES` anywhere, a leading ``module.``), and with ``adapter_name`` PEFT's adapter
    component (``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PREFIXES]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    if adapter_name is not None and len(parts) > 1:
        if parts[-1] == adapter_name:
            parts.pop()
        elif len(parts) > 2 and parts[-2] == adapter_name:
            parts.pop(-2)
    return ".".join(parts)


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
    source: str | os.PathLike, tag: str | None, index: int, verify: bool, tp_dims: dict | None
) -> Iterator[_Source]:
    path = Path(source)
    if path.is_file():  # a consolidated / post-hoc / DCP-consolidated safetensors file
        with _io.SafetensorsFile(path) as f:
            pass  # validated: a real safetensors file, no pickle
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            shapes, dtypes = {}, {}
            keys = f.keys()  # a safetensors handle, not a dict
            for name in keys:
                sl = f.get_slice(name)
                shapes[name] = tuple(sl.get_shape())
                dtypes[name] = _st_dtype(sl.get_dtype(), path, name)

            def fill_file(dst: torch.Tensor, name: str) -> None:
                dst.copy_(f.get_tensor(name).reshape(-1))

            info = {"source": str(path), "source_kind": "file", **{k: meta[k] for k in sorted(meta) if k != "format"}}
            yield _Source(shapes, dtypes, fill_file, info, [path])
        return
    ckpt: JoinedReader
    with open_joined(path, tag, verify, tp_dims) as ckpt:
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
            "source": str(path),
            "source_kind": "checkpoint",
            "tag": ckpt.tag,
            "step": int(ckpt.step),
            "ema_index": index,
            "schedule": schedules[index] if schedules else None,
            "saved_world_size": ckpt.world_size,
            "buffers": sorted(buffers),
        }
        yield _Source(shapes, dtypes, fill_ckpt, info, [Path(ckpt.root), Path(ckpt.tag_dir)])


def _st_dtype(name: str, path: Path, key: str) -> torch.dtype:
    table = {v: k for k, v in _io.DTYPE_TO_STR.items()}
    if name not in table:
        raise CheckpointMismatchError(f"{path}: tensor {key!r} has dtype {name}, which this export cannot read")
    return table[name]


# ------------------------------------------------------------------------------------------ the `like`


class _Like(NamedTuple):
    folder: Path
    peft: bool
    config: dict
    weights: dict[str, Path]  # name -> the safetensors file of `like` holding it (empty: no weights)


def _read_like(like: str | os.PathLike) -> _Like:
    folder = Path(like)
    if not folder.is_dir():
        raise FileNotFoundError(f"like (--like): {folder} is not a folder (give the model's save_pretrained folder)")
    peft = (folder / "adapter_config.json").is_file()
    cfg_file = folder / ("adapter_config.json" if peft else "config.json")
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"like (--like): {folder} holds no config.json (a Hugging Face model folder) and no adapter_config.json "
            "(a PEFT adapter folder)"
        )
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"like (--like): cannot read {cfg_file}: {e}") from None
    weights: dict[str, Path] = {}
    from safetensors import safe_open

    for index_file in sorted(folder.glob("*.safetensors.index.json")):
        try:
            wmap = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"like (--like): cannot read the weight map of {index_file}: {e}") from None
        weights.update({n: folder / f for n, f in wmap.items()})
    if not weights:
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                keys = sf.keys()  # a safetensors handle, not a dict
                weights.update({n: f for n in keys})
    return _Like(folder, peft, config, weights)


def _stem(like: _Like) -> str:
    """The weight files' name in ``like``: ``model`` (transformers), ``adapter_model`` (PEFT),
    ``diffusion_pytorch_model`` (diffusers), as its own files are named (``model`` when it has none)."""
    if like.peft:
        return "adapter_model"
    for f in sorted({p.name for p in like.weights.values()}):
        m = re.fullmatch(r"(.+?)(?:-\d{5}-of-\d{5})?\.safetensors", f)
        if m:
            return m.group(1)
    return "model"


def _fit_names(source_names: list[str], like: _Like, adapter_name: str) -> tuple[dict[str, str], list[str]]:
    """``{source name: exported name}`` and the tied duplicates left out (see the module docstring)."""
    expected = set(like.weights)
    out: dict[str, str] = {}
    dropped: list[str] = []
    unplaced: list[str] = []
    tied = bool(like.config.get("tie_word_embeddings", False)) or bool(
        like.config.get("text_config", {}).get("tie_word_embeddings", False)
    )
    for name in source_names:
        hf = hf_name(name, adapter_name if like.peft else None)
        if expected and hf not in expected:
            parts = hf.split(".")
            fits = [".".join(parts[i:]) for i in range(1, len(parts)) if ".".join(parts[i:]) in expected]
            if fits:
                hf = fits[0]
            elif tied and hf.split(".")[-2:] == ["lm_head", "weight"]:
                dropped.append(name)  # the output embedding tied to the input one: save_pretrained omits it
                continue
            else:
                unplaced.append(name)
                continue
        out[name] = hf
    if unplaced:
        raise CheckpointMismatchError(
            f"{len(unplaced)} EMA tensor(s) have no place in {like.folder}'s weights: {short_list(unplaced, 6)} "
            f"(its weights are named like {short_list(sorted(expected), 3)}); is --like the model this EMA was "
            "trained from?"
        )
    seen: dict[str, str] = {}
    for name, hf in out.items():
        if hf in seen:
            raise CheckpointMismatchError(f"EMA tensors {seen[hf]!r} and {name!r} both export as {hf!r}")
        seen[hf] = name
    return out, dropped


# ---------------------------------------------------------------------------------------------- paths


def _check_out_dir(out: Path, avoid: list[Path], overwrite: bool) -> Path:
    try:
        real = out.resolve()
        avoid_real = [p.resolve() for p in avoid]
    except (OSError, RuntimeError) as e:
        raise OutputPathError(f"out_dir: cannot resolve {out}: {e}") from None
    for a in avoid_real:
        inside = a.is_dir() and a in real.parents
        if real == a or inside or real in a.parents:
            raise OutputPathError(
                f"out_dir: refusing to write {out} (-> {real}): it is {'inside' if inside else 'equal to or above'} "
                f"{a}, which this export reads. Write it elsewhere, e.g. {a.parent.parent / (out.name or 'ema_hf')}"
            )
    if real.exists() and not real.is_dir():
        raise OutputPathError(f"out_dir: {out} exists and is not a folder; choose another name")
    if real.is_dir() and any(real.iterdir()) and not overwrite:
        raise OutputPathError(
            f"out_dir: refusing to replace the existing, non-empty folder {out}: pass overwrite=True (--overwrite) "
            "to replace it as a whole once the new one is complete, or choose another name"
        )
    return real


def _commit_dir(tmp: Path, final: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` folder to ``final``; an existing ``final`` is moved aside first, removed after
    (refused without ``overwrite``: files that appeared there during the export are never removed)."""
    old = None
    if final.exists():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        elif not overwrite:
            raise OutputPathError(f"out_dir: {final} was filled while the export ran; it is left as it is")
        else:
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
    os.rename(tmp, final)
    _io.fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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


def to_hf(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    like: str | os.PathLike,
    *,
    tag: str | None = None,
    index: int = 0,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    missing: str = "like",
    adapter_name: str = "default",
    overwrite: bool = False,
    verify: bool = True,
    progress: bool | None = None,
    tp_dims: dict[str, int | None] | None = None,
) -> Path:
    """Write EMA ``index`` of ``source`` as a Hugging Face model folder (or PEFT adapter folder); see the module docstring.

    Args:
        source: a checkpoint directory (or tag folder) written by :func:`functional_ema.save`, any
            layout; or a consolidated ``.safetensors`` file (``consolidate``, ``consolidate --dcp``,
            ``posthoc`` outputs).
        out_dir: the folder to create (must not exist, or be empty, unless ``overwrite``).
        like: the model's ``save_pretrained`` folder (``config.json``; its weights, when present, fix
            the names and supply what the EMA lacks), or a PEFT adapter folder (``adapter_config.json``).
        tag, index, verify, tp_dims: as for :func:`functional_ema.consolidate` (ignored for a file source,
            which holds one EMA).
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or the torch dtype) for floating tensors; ``None``: as saved.
        max_shard_size: the most bytes per ``model-*.safetensors`` shard (``"5GB"`` as Hugging Face
            counts, ``"500MiB"``, or an int). One shard is written as ``model.safetensors``. PEFT: one file.
        missing: ``"like"`` copies weights the EMA lacks from ``like``; ``"error"`` refuses them.
        adapter_name: the PEFT adapter whose name is removed from the names (PEFT folders only).
        overwrite: replace an existing ``out_dir`` (as a whole, once the new folder is complete).
        progress: show a progress bar (``None``: when stderr is a terminal).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: a bad ``dtype``, ``max_shard_size``, ``missing`` or ``index``, naming it.
        OutputPathError: ``out_dir`` inside or above the source or ``like``, or existing (without ``overwrite``).
        CheckpointMismatchError: an EMA tensor with no place in ``like``, or a missing one with ``missing="error"``.

    Example:
        >>> fe.export.to_hf("out/checkpoint-800", "ema_hf", like="base_model")   # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("ema_hf")                         # doctest: +SKIP
    """
    from .checkpoint import _progress

    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    if missing not in ("like", "error"):
        raise ValueError(f'missing must be "like" or "error", got {missing!r}')
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index (--index) must be an int >= 0, got {index!r}")
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty name without dots, got {adapter_name!r}")
    out = Path(out_dir)
    info_like = _read_like(like)
    with _open_source(source, tag, index, verify, tp_dims) as src:
        real_out = _check_out_dir(out, [*src.paths, info_like.folder], overwrite)
        names, dropped = _fit_names(list(src.shapes), info_like, adapter_name)
        exported = set(names.values())
        lacking = [n for n in info_like.weights if n not in exported]
        if lacking and missing == "error":
            raise CheckpointMismatchError(
                f"{len(lacking)} weight(s) of {info_like.folder} have no EMA: {short_list(lacking, 6)} (frozen "
                'parameters or buffers); pass missing="like" (the default) to copy them from there'
            )
        # (exported name, dtype out, shape, reader) in the source's order, then the weights copied from `like`
        plan: list[tuple[str, torch.dtype, tuple[int, ...], Any]] = []

        def out_dtype(d: torch.dtype) -> torch.dtype:
            return cast if cast is not None and d.is_floating_point else d

        for name, hf in names.items():
            plan.append((hf, out_dtype(src.dtypes[name]), src.shapes[name], ("ema", name)))
        if lacking:
            from safetensors import safe_open

            for n in lacking:
                with safe_open(str(info_like.weights[n]), framework="pt") as f:
                    sl = f.get_slice(n)
                    d = _st_dtype(sl.get_dtype(), info_like.weights[n], n)
                    plan.append((n, out_dtype(d), tuple(sl.get_shape()), ("like", n)))
        nbytes = {hf: math.prod(shape) * d.itemsize for hf, d, shape, _ in plan}
        by_name = {p[0]: p for p in plan}
        stem = _stem(info_like)
        groups = [list(by_name)] if info_like.peft else _shards(list(by_name), nbytes, limit)
        files = (
            [f"{stem}.safetensors"]
            if len(groups) == 1
            else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        record = {
            "format": "functional_ema.hf_export",
            "format_version": 1,
            "library": f"functional_ema {library_version()}",
            **src.info,
            "dtype": str(cast or "as saved").removeprefix("torch."),
            "layout": {"adapter_model": "peft", "diffusion_pytorch_model": "diffusers"}.get(stem, "transformers"),
            "like": str(info_like.folder),
            "files": files,
            "tied_left_out": dropped,
            "copied_from_like": lacking,
        }
        meta = {"format": "pt", "functional_ema": json.dumps({k: record[k] for k in record if k in _META_KEYS})}
        tmp = real_out.parent / f".{real_out.name}.tmp-{uuid.uuid4().hex[:8]}"
        real_out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        bar = _progress(sum(nbytes.values()), progress, f"export {real_out.name}")
        try:
            largest = max((math.prod(s) for n, (_, _, s, r) in by_name.items() if r[0] == "ema"), default=0)
            fp = max((d.itemsize for d in src.dtypes.values()), default=4)
            buffer = _memory.empty(largest * fp // 4 + 1, dtype=torch.float32).view(torch.uint8)  # reused
            for group, fname in zip(groups, files):
                entries = [(n, by_name[n][1], by_name[n][2]) for n in group]
                with _io.StreamingWriter(tmp / fname, entries, meta, checksums=False) as w:
                    for n in group:
                        _, d, shape, (kind, key) = by_name[n]
                        if kind == "ema":
                            sdt = src.dtypes[key]
                            flat = buffer[: math.prod(shape) * sdt.itemsize].view(sdt)
                            src.fill(flat, key)  # checked before it is written
                        else:
                            from safetensors import safe_open

                            with safe_open(str(info_like.weights[key]), framework="pt") as f:
                                flat = f.get_tensor(key).reshape(-1)
                        w.write(n, flat.to(d) if flat.dtype != d else flat)
                        bar.update(nbytes[n])
                    w.commit()
            if len(groups) > 1:
                index_json = {
                    "metadata": {"total_size": sum(nbytes.values()), "functional_ema": meta["functional_ema"]},
                    "weight_map": {n: f for g, f in zip(groups, files) for n in g},
                }
                _io.atomic_write_bytes(
                    tmp / f"{stem}.safetensors.index.json", json.dumps(index_json, indent=2).encode()
                )
            for f in sorted(info_like.folder.iterdir()):
                if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != EXPORT_RECORD:
                    shutil.copy2(f, tmp / f.name)
            if cast is not None and not info_like.peft:  # from_pretrained(dtype="auto") reads the dtype here
                config = dict(info_like.config)
                for key in ("dtype", "torch_dtype"):
                    if key in config or key == "dtype":
                        config[key] = str(cast).removeprefix("torch.")
                _io.atomic_write_bytes(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
            _io.atomic_write_bytes(tmp / EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())
            _io.fsync_dir(tmp)
            _commit_dir(tmp, real_out, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
    return out


_META_KEYS = ("format", "source", "tag", "step", "ema_index", "schedule", "dtype", "layout")
