"""The EMA inside ``torch.distributed.checkpoint`` (DCP): one more ``Stateful`` in the state dict you save.

FSDP2, HSDP and tensor-parallel training codes (torchtitan among them) keep one state dict of
``Stateful`` objects and write it with ``dcp.save`` / ``dcp.async_save``. :class:`EMAStateful` puts the
EMA in that same request::

    ema = fe.dcp.EMAStateful(model, lambda: state)
    dcp.save({"model": model_sd, "optim": optim_sd, "ema": ema}, checkpoint_id=path)
    ...
    state = fe.init_ema(fe.local_shards(model))          # at the new layout: the buffers to load into
    dcp.load({"model": ..., "optim": ..., "ema": fe.dcp.EMAStateful(model, lambda: state)}, checkpoint_id=path)

``state_dict()`` returns this rank's EMA pieces as ``DTensor``\\ s with their parameters' mesh and
placements (``shape=``/``stride=`` given: FSDP2's last shards are short), as plain tensors for
parameters outside DTensor (a plain or DDP module, FSDP2's unsharded parameters); the tensors are views
of the state's own buffers, so ``dcp.load`` writes into them (no second EMA in memory) and DCP reshards
between any two layouts it can place (FSDP2 at another size, HSDP, tensor parallel, a plain module).

DeepSpeed is refused: its fp32 partitions are flat slices that cross parameter boundaries, which a
DTensor cannot describe; use :func:`functional_ema.save` beside DeepSpeed's checkpoint.

Keys (DCP flattens them): ``ema.step`` (int64), ``ema.emas.<k>.<parameter name>``, and ``ema.checksums``,
a JSON record (a string; DCP stores non-tensor entries with ``torch.save``) of the number of EMAs, the
step, each EMA's dtype, and for every piece a rank saved its global offsets and sizes (DCP's own chunk
coordinates) and the XXH3-64 checksum of each of its rows (slices along dimension 0; a 0-d tensor is one
row).

What is verified, and when:

- Saving: every rank checksums its own pieces (no data moves); one small exchange of these records over
  the default process group makes one record, the same on every rank, which DCP writes once. HSDP
  replicas of a piece must agree, or the save is refused on every rank.
- ``dcp.load`` into an :class:`EMAStateful` (``load_state_dict``, after DCP has read): the number of
  EMAs, the dtype, the parameter names and the step (an integer >= 0, equal to ``ema.step``) are checked,
  and each rank recomputes the checksum of every saved row it now holds whole, from the bytes DCP
  loaded. Rows are the unit so that any resharding along dimension 0 (FSDP2 or HSDP at another size, a
  plain module, tensor-parallel pieces loaded into a layout that keeps their columns together) holds
  every saved row whole: then every byte read is verified. A saved row that the new layout splits
  across ranks (loading into tensor parallelism that cuts dimension 1 where the save did not) cannot be
  checked without moving data; ``load_state_dict`` then warns with the number of bytes left unverified,
  and :func:`consolidate_dcp` (or ``python -m functional_ema consolidate --dcp``) verifies every byte
  offline. A refusal is raised on every rank (a library error naming the checkpoint and the field);
  ``dcp.load`` has then already written into the state's buffers, so load again from a good checkpoint.
- :func:`consolidate_dcp` reads full tensors, so it verifies every row of every piece, and checks that
  the record's pieces are exactly the pieces in DCP's metadata (no byte read goes unchecked).

Errors that DCP raises while it reads (a garbage ``.metadata``, a missing or truncated ``.distcp``, a
1-EMA checkpoint loaded into a 2-EMA state: "Missing key ... ema.emas.1...") are DCP's own exceptions;
:func:`consolidate_dcp` turns each of them into a :class:`~functional_ema.checkpoint.CheckpointError`
naming the file.

Pickles: a DCP checkpoint's ``.metadata`` file is a pickle, and ``dcp.load`` unpickles it and every
non-tensor entry (``ema.checksums`` among them) without restriction: load DCP checkpoints into training
only from sources you trust. :func:`consolidate_dcp` does not: it unpickles ``.metadata`` with an
allow-list of DCP's metadata classes, reads ``ema.checksums`` with ``torch.load(weights_only=True)``
and the tensors through DCP's reader, which uses ``weights_only=True`` (:func:`functional_ema.load`
never unpickles).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from . import _io
from ._api import state_pieces
from ._checkpoint.collective import agree, exchange
from ._checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ._state import EmaState
from .engines import adapter_for
from .engines._base import read_for

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["RECORD_KEY", "EMAStateful", "consolidate_dcp"]

#: The entry, beside ``step`` and ``emas``, holding the checksum record (``<key>.checksums`` in DCP).
RECORD_KEY = "checksums"
_RECORD_FORMAT = "functional_ema.dcp"
_RECORD_VERSION = 1


class EMAStateful:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` view of the EMA of ``x``.

    Args:
        x: the model the EMA's pieces come from (FSDP2 / HSDP / DTensor tensor parallel, a
            ``torch.distributed.pipelining`` stage, a DDP or plain module). Not a DeepSpeed engine.
        state: the :class:`~functional_ema.EmaState`, or a callable returning the current one (the
            state changes identity when you reassign ``state = fe.update(...)`` with ``inplace=False``;
            with the default in-place update it shares the buffers, so either works). A callable's
            result is checked each time it is used.
        checkpoint_id: only named in error messages (the ``checkpoint_id`` you pass to ``dcp.load``);
            without it they say "the DCP checkpoint".

    ``state_dict()`` is called by ``dcp.save`` (and by ``dcp.load`` for the template), ``load_state_dict``
    by ``dcp.load`` after it has written into the template's tensors (the state's own buffers). Every
    EMA of the state is saved; the step is restored with the values, so decays continue exactly. What
    is verified at load: the module docstring.

    Raises:
        TypeError: ``x`` is a DeepSpeed engine or not a model functional_ema reads; ``state`` is neither
            an ``EmaState`` nor a callable.
    """

    def __init__(
        self, x: Any, state: EmaState | Callable[[], EmaState], *, checkpoint_id: str | os.PathLike | None = None
    ) -> None:
        from ._args import check_location
        from .engines.deepspeed import is_deepspeed_engine

        # DCP takes an fsspec URL as its checkpoint_id too: named as given
        where = None if checkpoint_id is None else check_location(checkpoint_id, "checkpoint_id")
        if is_deepspeed_engine(x):
            raise TypeError(
                "functional_ema.dcp.EMAStateful: a DeepSpeed engine's fp32 partitions are flat slices across parameter "
                "boundaries, which DTensor (and so torch.distributed.checkpoint) cannot describe. Save the EMA with "
                "functional_ema.save(state, engine, save_dir) beside engine.save_checkpoint(save_dir), and load it "
                "with functional_ema.load(engine, save_dir)"
            )
        try:
            adapter_for(x)
        except TypeError as e:
            raise TypeError(
                f"functional_ema.dcp.EMAStateful: x: {e} (here: any of these but a DeepSpeed engine)"
            ) from None
        if isinstance(state, EmaState):
            fixed = state
            self._get: Callable[[], Any] = lambda: fixed
        elif callable(state):
            self._get = state
        else:
            raise TypeError(
                f"functional_ema.dcp.EMAStateful: state must be an EmaState or a callable returning one (e.g. "
                f"lambda: state), got a {type(state).__module__}.{type(state).__qualname__}"
            )
        self._x = x
        self._where = "the DCP checkpoint" + ("" if where is None else f" {where}")

    @property
    def state(self) -> EmaState:
        """The current :class:`~functional_ema.EmaState` (the callable's result, checked)."""
        state = self._get()
        if not isinstance(state, EmaState):
            raise TypeError(
                f"functional_ema.dcp.EMAStateful: the callable given as state returned a "
                f"{type(state).__module__}.{type(state).__qualname__}, not an EmaState (return the current state, "
                "e.g. lambda: state)"
            )
        return state

    def state_dict(self) -> dict[str, Any]:
        state = self.state
        reading = read_for(adapter_for(self._x), state)  # the state's selection, if any
        emas = {}
        for k in range(state.num_emas):
            pieces = state_pieces(state, reading, k, "EMAStateful.state_dict")
            emas[str(k)] = {name: _as_dtensor(pieces[name], reading.params[name]) for name in reading.layout.specs}
        # the step is a copy: dcp.load writes into the template, and the state's step moves only once checked
        return {"step": state.step.detach().clone(), "emas": emas, RECORD_KEY: _saved_record(state, emas)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from ._args import check_mapping

        check_mapping(state_dict, "state_dict")
        state = self.state
        reading = read_for(adapter_for(self._x), state)  # the state's selection, if any
        state_pieces(state, reading, 0, "EMAStateful.load_state_dict")  # ranks agree first
        world, rank = _world()
        every = agree(
            "EMAStateful.load_state_dict",
            lambda: _check_loaded(state_dict, state, self._where),
            None,
            world,
            rank,
            fallback=CorruptCheckpointError,
        )
        _check_names(every, self._where)  # the same outcome on every rank: it reads the exchanged results
        unverified = every[rank][0]
        if unverified:
            warnings.warn(
                f"EMAStateful.load_state_dict on rank {rank}: {unverified} bytes of {self._where} lie in saved rows "
                "that this layout splits across ranks and were not checksummed at load; verify them offline with "
                "functional_ema.dcp.consolidate_dcp (python -m functional_ema consolidate --dcp)",
                stacklevel=2,
            )
        with torch.no_grad():
            for k, ema in state_dict["emas"].items():
                target = state.emas[int(k)]
                for name, t in ema.items():
                    local = t.to_local() if hasattr(t, "to_local") else t
                    dst = target[name]
                    if local.data_ptr() != dst.data_ptr() or local.numel() != dst.numel():  # DCP loaded elsewhere
                        dst.copy_(local.reshape(dst.shape))
            state.step.copy_(torch.as_tensor(int(state_dict["step"]), dtype=state.step.dtype))


def _world() -> tuple[int, int]:
    """World size and rank of the default process group DCP uses (1, 0 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _as_dtensor(piece: torch.Tensor, param: Any) -> torch.Tensor:
    """This rank's EMA piece of ``param`` as the parameter holds it: a ``DTensor`` of the same mesh,
    placements, shape and stride (a view of the piece), or the piece in the parameter's shape."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        local = piece.view(param._local_tensor.shape)
        return DTensor.from_local(
            local,
            device_mesh=param.device_mesh,
            placements=param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return piece.view(param.shape)


# ------------------------------------------------------------------------------------- the record


def _held(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """This rank's tensor of a (D)Tensor entry and its global offsets (DCP's chunk coordinates)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t.to_local()
        chunks = t.__create_chunk_list__()  # what DCP records for this rank's piece
        return local, list(chunks[0].offsets) if chunks else [0] * local.dim()
    return t, [0] * t.dim()


def _row_checksums(t: torch.Tensor) -> list[int]:
    """XXH3-64 of each row (slice along dimension 0) of ``t``'s C-contiguous bytes; a 0-d tensor is one row.

    Args:
        t: any dtype and device (copied to the CPU when elsewhere).
    """
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return []
    rows = t.shape[0] if t.dim() else 1
    buf = _io._byte_view(t)
    row = len(buf) // rows
    if row >= _io.CHUNK_BYTES:  # long rows: the library's threaded chunk checksums
        return _io.chunk_checksums(buf, row)
    fn = _io.checksum_fn(_io.CHECKSUM)  # short rows: a thread hand-off per row would cost more than the hash
    return [fn(buf[i : i + row]) for i in range(0, len(buf), row)]


def _saved_record(state: EmaState, emas: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
    """The record every rank saves under ``RECORD_KEY``: this rank's pieces, exchanged with the other ranks
    and merged, so that it is the same string on every rank (DCP writes one copy of a non-tensor entry)."""
    mine = {
        "num_emas": state.num_emas,
        "step": int(state.step),
        "emas": {
            k: {
                name: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "piece": [*_piece_of(t)],
                }
                for name, t in ema.items()
            }
            for k, ema in emas.items()
        },
    }
    world, rank = _world()
    every = exchange(mine, None, world)
    for r, other in enumerate(every):
        if (other["num_emas"], other["step"]) != (mine["num_emas"], mine["step"]):
            raise CheckpointError(
                f"EMAStateful.state_dict: rank {r} saves {other['num_emas']} EMAs at step {other['step']}, rank "
                f"{rank} {mine['num_emas']} at step {mine['step']}: every rank must save the same state"
            )
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    for other in every:
        for k, ema in other["emas"].items():
            for name, entry in ema.items():
                slot = merged.setdefault(k, {}).setdefault(name, {"dtype": entry["dtype"], "pieces": {}})
                offsets, sizes, rows = entry["piece"]
                if math.prod(sizes) == 0:
                    continue
                seen = slot["pieces"].setdefault((tuple(offsets), tuple(sizes)), rows)
                if seen != rows:
                    raise CheckpointError(
                        f"EMAStateful.state_dict: EMA {k} parameter {name!r}: replicas of the piece at offsets "
                        f"{offsets} (sizes {sizes}) differ between ranks; their EMAs diverged"
                    )
    record = {
        "format": _RECORD_FORMAT,
        "version": _RECORD_VERSION,
        "checksum": _io.CHECKSUM,
        "num_emas": mine["num_emas"],
        "step": mine["step"],
        "emas": {
            k: {
                name: {
                    "dtype": slot["dtype"],
                    "pieces": [[list(o), list(s), rows] for (o, s), rows in slot["pieces"].items()],
                }
                for name, slot in sorted(ema.items())
            }
            for k, ema in merged.items()
        },
    }
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _piece_of(t: torch.Tensor) -> tuple[list[int], list[int], str]:
    local, offsets = _held(t)
    return offsets, list(local.shape), _hex(_row_checksums(local))


def _hex(checksums: list[int]) -> str:
    """16 hex digits per checksum, concatenated (what the record stores)."""
    return np.array(checksums, dtype=">u8").tobytes().hex()


def _unhex(hexes: str) -> list[int]:
    """The checksums of :func:`_hex`; ``ValueError`` for what is not such a string."""
    if len(hexes) % 16:
        raise ValueError("not a multiple of 16 hex digits")
    return np.frombuffer(bytes.fromhex(hexes), dtype=">u8").tolist()


def _parse_record(raw: Any, where: str) -> dict[str, Any]:
    """The record as saved, its fields checked; :class:`CorruptCheckpointError` naming the field otherwise."""

    def bad(field: str, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: field {field!r} of the EMA's checksum record {why}")

    if not isinstance(raw, str):
        raise bad(RECORD_KEY, f"is a {type(raw).__name__}, not the JSON string functional_ema writes")
    try:
        record = json.loads(raw)
    except ValueError as e:
        raise bad(RECORD_KEY, f"is not JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT:
        raise bad("format", f"is not {_RECORD_FORMAT!r}")
    if record.get("version") != _RECORD_VERSION:
        raise CheckpointVersionError(
            f"{where}: the EMA's checksum record has version {record.get('version')!r}; this functional_ema reads "
            f"version {_RECORD_VERSION}"
        )
    if record.get("checksum") != _io.CHECKSUM:
        raise bad("checksum", f"names {record.get('checksum')!r}, not {_io.CHECKSUM!r}")
    n = record.get("num_emas")
    if type(n) is not int or n < 1:
        raise bad("num_emas", f"is {n!r}, not a positive integer")
    step = record.get("step")
    if type(step) is not int or step < 0:
        raise bad("step", f"is {step!r}, not an integer >= 0")
    emas = record.get("emas")
    if not isinstance(emas, dict) or sorted(emas) != sorted(str(k) for k in range(n)):
        raise bad("emas", f"does not hold EMAs 0..{n - 1}")
    for k, ema in emas.items():
        for name, slot in ema.items() if isinstance(ema, dict) else [("?", None)]:
            if not (
                isinstance(slot, dict)
                and isinstance(slot.get("dtype"), str)
                and isinstance(slot.get("pieces"), list)
                and all(_is_piece(p) for p in slot["pieces"])
            ):
                raise bad(f"emas.{k}.{name}", "is not a dtype and a list of [offsets, sizes, row checksums]")
    return record


def _is_piece(p: Any) -> bool:
    return (
        isinstance(p, list)
        and len(p) == 3
        and all(isinstance(v, list) and all(type(i) is int and i >= 0 for i in v) for v in p[:2])
        and len(p[0]) == len(p[1])
        and isinstance(p[2], str)
    )


def _verify(
    held: torch.Tensor, offsets: list[int], pieces: list, name: str, k: str, where: Callable[[list[int]], str]
) -> int:
    """Check every saved row that ``held`` (at global ``offsets``) holds whole against its recorded checksum.

    Args:
        held: this rank's loaded tensor of parameter ``name`` in EMA ``k`` (any dtype/device).
        offsets: its global offsets.
        pieces: the record's saved pieces of that parameter: ``[offsets, sizes, row checksums (hex)]``.
        where: names the checkpoint (or file) of a saved piece, from its offsets, for the message.

    Returns:
        The number of bytes of ``held`` that lie in saved rows it does not hold whole (so not verified).
    """
    if held.dim() == 0:
        held, offsets = held.reshape(1), [0]
    sizes = list(held.shape)
    item = held.element_size()
    held_bytes, verified = held.numel() * item, 0
    for piece_off, piece_size, hexes in pieces:
        # a 0-d parameter: one row
        saved_off, saved_size = ([0], [1]) if held.dim() == 1 and not piece_off else (piece_off, piece_size)
        if len(saved_off) != held.dim():
            raise CorruptCheckpointError(
                f"{where(saved_off)}: EMA {k} parameter {name!r}: a saved piece has {len(saved_off)} dimensions, the "
                f"tensor {held.dim()}"
            )
        try:
            rows = _unhex(hexes)
        except ValueError:
            rows = []
        if len(rows) != saved_size[0] or len(hexes) != 16 * len(rows):
            raise CorruptCheckpointError(
                f"{where(saved_off)}: EMA {k} parameter {name!r}: the record lists {len(hexes) / 16:g} row checksums "
                f"for the piece at offsets {saved_off} of {saved_size[0]} rows"
            )
        inner = list(zip(saved_off[1:], saved_size[1:], offsets[1:], sizes[1:]))
        if any(so < ho or so + ss > ho + hs for so, ss, ho, hs in inner):
            continue  # the piece's rows are cut across this layout's ranks: not checkable here
        r0, r1 = max(saved_off[0], offsets[0]), min(saved_off[0] + saved_size[0], offsets[0] + sizes[0])
        if r1 <= r0:
            continue
        cut = (slice(r0 - offsets[0], r1 - offsets[0]), *(slice(so - ho, so - ho + ss) for so, ss, ho, _ in inner))
        block = held[cut]
        for i, (got, want) in enumerate(zip(_row_checksums(block), rows[r0 - saved_off[0] : r1 - saved_off[0]])):
            if got != want:
                raise CorruptCheckpointError(
                    f"{where(saved_off)}: EMA {k} parameter {name!r}, row {r0 + i} of the piece saved at offsets "
                    f"{saved_off} (sizes {saved_size}), fails its XXH3-64 checksum (read {got:016x}, saved "
                    f"{want:016x}): its bytes changed after the save"
                )
        verified += block.numel() * item
    return held_bytes - verified


def _check_loaded(
    state_dict: Mapping[str, Any], state: EmaState, where: str
) -> tuple[int, dict[str, list[str]], list[str]]:
    """Check what ``dcp.load`` put into the template against the record and the state; return the bytes
    left unverified on this rank (rows this layout splits), the record's parameter names per EMA, and the
    names this rank loaded (for :func:`_check_names`, across the ranks)."""
    missing = [key for key in ("step", "emas", RECORD_KEY) if key not in state_dict]
    if missing:
        raise IncompleteCheckpointError(
            f"EMAStateful.load_state_dict: {where}: no {missing} in the loaded entry (keys {sorted(state_dict)})"
        )
    record = _parse_record(state_dict[RECORD_KEY], where)
    if record["num_emas"] != state.num_emas:
        raise CheckpointMismatchError(
            f"{where} holds {record['num_emas']} EMAs (field num_emas), this state {state.num_emas}: make the state "
            f"with init_ema(..., num_emas={record['num_emas']})"
        )
    step = state_dict["step"]
    loaded_step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if loaded_step != record["step"]:
        raise CorruptCheckpointError(
            f"{where}: field step is {loaded_step!r}, the checksum record says {record['step']}: the checkpoint was "
            "changed after the save"
        )
    unverified = 0
    for k in range(state.num_emas):
        saved, loaded = record["emas"][str(k)], state_dict["emas"].get(str(k), {})
        if set(loaded) - set(saved):  # DCP reads only what the checkpoint has: a record that does not list it
            raise CorruptCheckpointError(
                f"{where}: field emas.{k} of the EMA's checksum record lacks {sorted(set(loaded) - set(saved))[:5]}"
            )
        for name, t in loaded.items():
            held, offsets = _held(t)
            want = saved[name]["dtype"]
            if str(held.dtype).removeprefix("torch.") != want:
                raise CheckpointMismatchError(
                    f"{where}: EMA {k} parameter {name!r} was saved in {want}, this state holds "
                    f"{str(held.dtype).removeprefix('torch.')} (field dtype): make the state with "
                    f"init_ema(..., dtype=torch.{want}) and cast after loading"
                )
            unverified += _verify(held, offsets, saved[name]["pieces"], name, str(k), lambda _o: where)
    return unverified, {k: sorted(ema) for k, ema in record["emas"].items()}, sorted(state_dict["emas"]["0"])


def _check_names(every: list[tuple[int, dict[str, list[str]], list[str]]], where: str) -> None:
    """Every parameter the checkpoint's EMA holds is loaded by some rank (pipeline stages each load their
    own): a checkpoint of a model with more parameters is refused, on every rank alike."""
    saved = every[0][1]["0"]
    loaded = set().union(*(names for _, _, names in every))
    if set(saved) - loaded:
        raise CheckpointMismatchError(
            f"{where}: its EMA holds parameters the model does not (field emas.0: {sorted(set(saved) - loaded)[:5]}); "
            "load it into the model it was saved from"
        )


# ----------------------------------------------------------------------------------- offline read

#: The globals a DCP ``.metadata`` pickle may name (DCP's metadata dataclasses and the torch values in
#: them); anything else is refused, so that consolidate_dcp runs no code from the file.
_METADATA_GLOBALS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "torch.distributed.checkpoint.metadata": frozenset(
            {
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            }
        ),
        "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
        "torch.serialization": frozenset({"_get_layout"}),
        "torch": frozenset(
            {"Size", "strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"}
            | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
        ),
        "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
        "collections": frozenset({"OrderedDict"}),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's metadata")


def _read_metadata(path: Path) -> Metadata:
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointNotFoundError(f"{path}: cannot read DCP's metadata ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is a corrupt file
        raise CorruptCheckpointError(f"{path}: not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path}: not DCP metadata (it unpickles to a {type(meta).__name__})")
    return meta


def _storage(root: Path, meta: Metadata, fqn: str, offsets: list[int] | None) -> tuple[Path, Any]:
    """The ``.distcp`` file, offset and length of one entry (a tensor piece at ``offsets``, or an object)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = (meta.storage_data or {}).get(MetadataIndex(fqn, offsets))
    if info is None:
        raise CorruptCheckpointError(f"{root / '.metadata'}: no storage entry for {fqn} at offsets {offsets}")
    path = root / info.relative_path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: missing (DCP's metadata places {fqn} in it)") from None
    except OSError as e:
        raise CheckpointNotFoundError(f"{path}: cannot read ({e.strerror or e})") from None
    if size < info.offset + info.length:
        raise CorruptCheckpointError(
            f"{path}: truncated ({size} bytes; DCP's metadata places {fqn} at bytes {info.offset}.."
            f"{info.offset + info.length})"
        )
    return path, info


def _read_record(root: Path, meta: Metadata, fqn: str) -> Any:
    """The record entry, read from its file with ``torch.load(weights_only=True)`` (no code runs)."""
    path, info = _storage(root, meta, fqn, None)
    if getattr(info, "transform_descriptors", None):
        raise CorruptCheckpointError(f"{path}: {fqn} is stored transformed ({info.transform_descriptors}); not read")
    with open(path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load raises on these bytes: a corrupt entry
        raise CorruptCheckpointError(f"{path}: {fqn} does not load ({type(e).__name__}: {e})") from None


def consolidate_dcp(
    checkpoint_dir: str | os.PathLike, key: str = "ema", *, index: int = 0, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The full EMA ``index`` from a DCP checkpoint folder, without a process group.

    Reads DCP's metadata with an allow-list unpickler (no code from the file runs), allocates each EMA
    tensor at its full size (checked against the metadata) and lets DCP fill it, then recomputes every
    row checksum of every saved piece (``verify=False`` skips that).

    Args:
        checkpoint_dir: the folder ``dcp.save`` wrote.
        key: the entry the :class:`EMAStateful` was saved under.
        index: which EMA, when several were tracked.
        verify: check the XXH3-64 row checksums of the record against the bytes read.

    Returns:
        Parameter name -> full tensor (the EMA's dtype).

    Raises:
        CheckpointNotFoundError: no such folder, or no ``.metadata`` in it (not a DCP checkpoint).
        CheckpointMismatchError: no :class:`EMAStateful` under ``key``, or no EMA ``index``.
        IncompleteCheckpointError: a ``.distcp`` file the EMA lives in is missing.
        CorruptCheckpointError: a file is garbage or truncated, the record is malformed, or a checksum fails;
            the message names the file.
    """
    from ._args import check_bool, check_int, check_path, check_str

    root = check_path(checkpoint_dir, "checkpoint_dir")
    key, index, verify = check_str(key, "key"), check_int(index, "index"), check_bool(verify, "verify")
    return _consolidate(root, key, index, verify)[0]


def _consolidate(root: Path, key: str, index: int, verify: bool) -> tuple[dict[str, torch.Tensor], int]:
    """:func:`consolidate_dcp`, and the step the record holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if type(index) is not int or index < 0:
        raise ValueError(f"consolidate_dcp: index must be an integer >= 0, got {index!r}")
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint_dir {root}: no such folder (a DCP checkpoint is a folder holding .metadata)"
        )
    if not (root / ".metadata").is_file():
        raise CheckpointNotFoundError(f"{root} is not a DCP checkpoint: it has no .metadata file")
    meta = _read_metadata(root / ".metadata")
    entries = meta.state_dict_metadata
    record_fqn = f"{key}.{RECORD_KEY}"
    if record_fqn not in entries:
        raise CheckpointMismatchError(
            f"{root}: no functional_ema EMA under key {key!r} (no entry {record_fqn}; top-level keys "
            f"{sorted({f.split('.')[0] for f in entries})})"
        )
    record = _parse_record(_read_record(root, meta, record_fqn), f"{root}")
    if index >= record["num_emas"]:
        raise CheckpointMismatchError(
            f"{root}: no EMA {index} under key {key!r} (index={index}; it holds {record['num_emas']} EMAs, "
            f"0..{record['num_emas'] - 1})"
        )
    saved = record["emas"][str(index)]
    prefix = f"{key}.emas.{index}."
    template: dict[str, torch.Tensor] = {f"{key}.step": torch.zeros((), dtype=torch.int64)}
    for name, slot in saved.items():
        m = entries.get(prefix + name)
        if not isinstance(m, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"{root / '.metadata'}: no tensor {prefix + name}, which the EMA's record lists"
            )
        if str(m.properties.dtype).removeprefix("torch.") != slot["dtype"]:
            raise CorruptCheckpointError(
                f"{root / '.metadata'}: {prefix + name} is {m.properties.dtype}, the EMA's record says {slot['dtype']}"
            )
        chunks = sorted((list(c.offsets), list(c.sizes)) for c in m.chunks if math.prod(c.sizes))
        if chunks != sorted((p[0], p[1]) for p in slot["pieces"]):
            raise CorruptCheckpointError(
                f"{root}: {prefix + name}: the pieces in DCP's metadata are not the pieces the EMA's checksum record "
                "lists"
            )
        for offsets, _ in chunks:
            _storage(root, meta, prefix + name, offsets)
        template[prefix + name] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    _storage(root, meta, f"{key}.step", [])  # the step: a 0-d tensor, one piece
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(template, storage_reader=_reader(root, meta), no_dist=True)
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: one line naming it
        raise CorruptCheckpointError(
            f"{root}: DCP could not read EMA {index} under key {key!r} ({_first_failure(e)})"
        ) from None
    if int(template[f"{key}.step"]) != record["step"]:
        raise CorruptCheckpointError(
            f"{root}: field step is {int(template[f'{key}.step'])}, the EMA's checksum record says {record['step']}"
        )
    full = {fqn[len(prefix) :]: t for fqn, t in template.items() if fqn.startswith(prefix)}
    if verify:
        for name, t in full.items():

            def where(offsets: list[int], fqn: str = prefix + name) -> str:
                return str(_storage(root, meta, fqn, offsets)[0])

            _verify(t, [0] * t.dim(), saved[name]["pieces"], name, str(index), where)
    return full, record["step"]


def _first_failure(e: BaseException) -> str:
    """``Type: message`` of what DCP failed on (the first rank's error inside its ``CheckpointException``)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else e
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _reader(root: Path, meta: Metadata) -> FileSystemReader:
    """DCP's file reader, handed ``meta`` (read by the allow-list unpickler) instead of running ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            storage = getattr(meta, "storage_meta", None)
            if storage is None:
                storage = meta.storage_meta = StorageMeta()
            storage.load_id = self.load_id
            return meta

    return Reader(os.fspath(root))
