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
  DCP's process group makes one record, the same on every rank, which DCP writes once. HSDP
  replicas of a piece must agree, and the pieces must make every whole tensor (DCP writes only the
  pieces of the ranks that save), or the save is refused on every rank, before anything is written.
- ``dcp.load`` into an :class:`EMAStateful` (``load_state_dict``, after DCP has read): the number of
  EMAs, the dtype, the parameter names and the step (an integer >= 0, equal to ``ema.step``) are checked,
  every element this rank holds must lie in a piece the record lists (DCP leaves what no saved chunk
  covers as it was, silently: refused, naming the parameter and the missing block), and each rank
  recomputes the checksum of every saved row it now holds whole, from the bytes DCP loaded. Rows are
  the unit so that any resharding along dimension 0 (FSDP2 or HSDP at another size, a plain module,
  tensor-parallel pieces loaded into a layout that keeps their columns together) holds every saved row
  whole: then every byte read is verified. A saved row that the new layout splits
  across ranks (loading into tensor parallelism that cuts dimension 1 where the save did not) cannot be
  checked without moving data; ``load_state_dict`` then warns with the number of bytes left unverified,
  and :func:`consolidate_dcp` (or ``python -m functional_ema consolidate --dcp``) verifies every byte
  offline. A refusal is raised on every rank (a library error naming the checkpoint and the field);
  ``dcp.load`` has then already written into the state's buffers, so load again from a good checkpoint.
- :func:`consolidate_dcp` reads full tensors, so it verifies every row of every piece, and checks that
  the record's pieces are exactly the pieces in DCP's metadata and tile each tensor's size there exactly
  (in bounds, no overlap, every element; the size equals the record's ``shape``, when it has one): no
  byte read goes unchecked, and no element is returned unread.
- Older entries: a record without ``shape`` (0.4.0) is read. An entry written by 0.3.0 (``step`` and
  ``emas``, no record) is read by :func:`consolidate_dcp` unverified, with a ``UserWarning``; ``dcp.load``
  refuses it (DCP's "Missing key", or with ``allow_partial_load=True`` a ``CheckpointVersionError``).

How DCP calls it: ``state_dict()`` for a save and for the load's template, with neither its ``no_dist``
nor its ``process_group``; :class:`EMAStateful` reads them, and which call it is, from DCP's entry point
(its frame's arguments; a warning when a DCP frame is on the stack but its entry point is not found, and the
call is taken as a save). The load's template holds placeholders (nothing checksummed, replicas not compared:
the load overwrites them; one left in place means DCP loaded nothing under the key, refused). The save's record
exchange and the load's agreement run over DCP's ``process_group``; the check of the state against the model's
layout agrees over the model's group (the one ``local_shards`` read its layout from). With ``no_dist=True``
none runs, and a save writes only this rank's pieces. Either way a save whose ranks do not hold every
element of each tensor (``no_dist=True`` on one rank of FSDP2 or tensor parallelism, a ``process_group``
smaller than the model's group) is refused, naming the parameter and the missing block; whole tensors (a
plain module, replicas) saved by one rank are accepted.

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
import itertools
import json
import math
import os
import pickle
import stat
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType, MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

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
from ._errors import StateMismatchError
from ._fit import state_problem
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
#: What ``state_dict()`` puts into DCP's load template in place of the record and the step: values no
#: saved entry has (a record is a JSON object, a saved step is >= 0), so that ``load_state_dict`` sees
#: what DCP did not load (``allow_partial_load=True`` skips an entry the checkpoint lacks).
_UNLOADED = "functional_ema.dcp: nothing was loaded into this template entry"
_UNLOADED_STEP = -1


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
        call = _dcp_call(self)
        state = self.state
        reading = read_for(adapter_for(self._x), state)  # the state's selection, if any
        emas = {}
        for k in range(state.num_emas):
            pieces = _pieces(state, reading, k, "EMAStateful.state_dict", call.single)
            emas[str(k)] = {name: _as_dtensor(pieces[name], reading.params[name]) for name in reading.layout.specs}
        if call.kind == "load":
            # DCP's load template: the load overwrites every value, so nothing is checksummed or compared
            # across replicas here (a fresh model's replicas may differ); placeholders mark what is not loaded
            return {"step": torch.full_like(state.step, _UNLOADED_STEP), "emas": emas, RECORD_KEY: _UNLOADED}
        # the step is a copy: dcp.load writes into the template, and the state's step moves only once checked
        return {"step": state.step.detach().clone(), "emas": emas, RECORD_KEY: _saved_record(state, emas, call)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from ._args import check_mapping

        check_mapping(state_dict, "state_dict")
        call = _dcp_call(self)
        state = self.state
        reading = read_for(adapter_for(self._x), state)  # the state's selection, if any
        _pieces(state, reading, 0, "EMAStateful.load_state_dict", call.single)  # ranks agree first
        group, world, rank = _world(call)
        every = agree(
            "EMAStateful.load_state_dict",
            lambda: _check_loaded(state_dict, state, self._where, call.key),
            group,
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


class _Call(NamedTuple):
    """How torch DCP called an :class:`EMAStateful` method (:func:`_dcp_call`)."""

    kind: str  # "save" (dcp.save / dcp.async_save), "load" (dcp.load), "" (not called by DCP: as a save)
    single: bool  # one process: DCP's no_dist=True, or no process group; no collective runs
    group: Any  # DCP's process_group (None: the default group)
    key: str | None  # the key of the EMAStateful in the state dict given to DCP, when found


#: DCP's entry points, by module and function name, and what each does with a ``Stateful``.
_DCP_ENTRIES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "torch.distributed.checkpoint.state_dict_saver": MappingProxyType({"save": "save", "async_save": "save"}),
        "torch.distributed.checkpoint.state_dict_loader": MappingProxyType({"load": "load"}),
    }
)
_DCP_FRAMES = 12  # save: state_dict <- DCP's logging wrappers <- _stateful_to_state_dict <- save


def _dcp_call(stateful: object) -> _Call:
    """Whether ``dcp.save``/``dcp.async_save`` or ``dcp.load`` is calling, with which ``no_dist`` and
    ``process_group``, read from the caller's frames: DCP calls ``state_dict()`` both for a save and for the
    load's template, and hands a ``Stateful`` neither argument, so its entry point's locals are the one place
    they are (``tests/test_dcp.py`` checks they are found on the torch versions ``pyproject.toml`` allows)."""
    alone = not (dist.is_available() and dist.is_initialized())
    frame: FrameType | None = sys._getframe(1)
    try:
        for _ in range(_DCP_FRAMES):
            if frame is None:
                break
            kind = _DCP_ENTRIES.get(frame.f_globals.get("__name__", ""), {}).get(frame.f_code.co_name)
            if kind is not None:
                where = frame.f_locals
                given = where.get("state_dict")
                key = next((k for k, v in given.items() if v is stateful), None) if isinstance(given, dict) else None
                single = alone or where.get("no_dist") is True
                return _Call(kind, single, where.get("process_group"), key if isinstance(key, str) else None)
            frame = frame.f_back
    finally:
        del frame  # a frame held in a local keeps every frame above it alive
    _warn_entry_not_found(alone)
    return _Call("", alone, None, None)


def _warn_entry_not_found(alone: bool) -> None:
    """Warn when DCP's entry frame was not found yet DCP is on the stack (nested deeper than _DCP_FRAMES, or an
    entry point torch renamed): the call is then taken as a save with DCP's defaults, which may be wrong (a
    load's template checksummed, ``no_dist`` or ``process_group`` ignored), so the user must hear of it."""
    frame: FrameType | None = sys._getframe(2)
    try:
        while frame is not None and not frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            frame = frame.f_back
        if frame is None:
            return  # not called by DCP at all: a save, as documented
        where = f"{frame.f_globals['__name__']}.{frame.f_code.co_name}"
    finally:
        del frame
    warnings.warn(
        f"functional_ema.dcp.EMAStateful: called from {where} but DCP's entry point (dcp.save, dcp.async_save or "
        f"dcp.load) was not found within {_DCP_FRAMES} frames; falling back to a save "
        f"{'in one process' if alone else 'over the default process group'}: a load's template is built as a save's "
        "state dict, and DCP's no_dist and process_group are not read. Call dcp.save/dcp.load directly with the "
        "EMAStateful in the state dict, or report the torch version if it does",
        stacklevel=4,
    )


def _world(call: _Call) -> tuple[Any, int, int]:
    """The process group DCP runs over, its size and this rank in it (None, 1, 0 for one process)."""
    if call.single:
        return None, 1, 0
    return call.group, dist.get_world_size(call.group), dist.get_rank(call.group)


def _pieces(state: EmaState, reading: Any, index: int, verb: str, single: bool) -> Mapping[str, torch.Tensor]:
    """``state.emas[index]`` checked against this rank's layout: with the other ranks
    (:func:`~functional_ema._api.state_pieces`), or, for one process (DCP's ``no_dist``), alone: the other
    ranks are not in this call, and a collective would wait for them until the process group times out."""
    if not single:
        return state_pieces(state, reading, index, verb)
    layout = reading.layout
    problem = state_problem(state, layout.specs, layout.rank, indices=(index,), shards=reading.shards)
    if problem:
        raise problem.error(
            StateMismatchError, f"{verb} on rank {layout.rank}", "Make the state with init_ema(local_shards(model))"
        )
    return state.emas[index]


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


def _saved_record(state: EmaState, emas: Mapping[str, Mapping[str, torch.Tensor]], call: _Call) -> str:
    """The record every rank saves under ``RECORD_KEY``: this rank's pieces, exchanged with the other ranks
    (of DCP's process group) and merged, so that it is the same string on every rank (DCP writes one copy
    of a non-tensor entry)."""
    mine = {
        "num_emas": state.num_emas,
        "step": int(state.step),
        "emas": {
            k: {
                name: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),  # the global shape (a DTensor's), which consolidate_dcp checks
                    "piece": [*_piece_of(t)],
                }
                for name, t in ema.items()
            }
            for k, ema in emas.items()
        },
    }
    group, world, rank = _world(call)
    every = exchange(mine, group, world)
    for r, other in enumerate(every):
        if (other["num_emas"], other["step"]) != (mine["num_emas"], mine["step"]):
            raise CheckpointError(
                f"EMAStateful.state_dict: rank {r} saves {other['num_emas']} EMAs at step {other['step']}, rank "
                f"{rank} {mine['num_emas']} at step {mine['step']}: every rank must save the same state"
            )
    merged = _merged(every)
    _check_whole(merged)  # the same on every rank of the save: all refuse alike
    record = {
        "format": _RECORD_FORMAT,
        "version": _RECORD_VERSION,
        "checksum": _io.CHECKSUM,
        "num_emas": mine["num_emas"],
        "step": mine["step"],
        "emas": merged,
    }
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _check_whole(merged: Mapping[str, Mapping[str, Any]]) -> None:
    """The pieces the ranks of this save hold make every whole tensor: DCP writes only theirs, so a save from
    some ranks of a sharded layout (``no_dist=True`` on one rank, a ``process_group`` smaller than the model's
    group) would write a checkpoint that lacks the others' rows, found only when a load cannot fill them."""
    for k, ema in merged.items():
        for name, slot in ema.items():
            gap = _gap([0] * len(slot["shape"]), slot["shape"], slot["pieces"])
            if gap is None:
                continue
            missing, first, last = gap
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0  # the global rank
            raise CheckpointError(
                f"EMAStateful.state_dict on rank {rank}: EMA {k} parameter {name!r} (shape {slot['shape']}): {missing} "
                f"of its {math.prod(slot['shape'])} elements lie in no piece the ranks of this save hold (the first "
                f"missing block: {first} to {last}, inclusive), so the checkpoint would lack them; nothing was "
                "written. A save from only some ranks of a sharded layout (dcp.save with no_dist=True, or with a "
                "process_group smaller than the model's group) writes only their pieces: call dcp.save on every rank "
                "of the model's group, without no_dist and with a process_group that holds them all (the default "
                "group does), or save with functional_ema.save(state, model, save_dir) on every rank"
            )


def _merged(every: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """The ranks' pieces, one entry per distinct piece (HSDP replicas of a piece must agree)."""
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    for other in every:
        for k, ema in other["emas"].items():
            for name, entry in ema.items():
                slot = merged.setdefault(k, {}).setdefault(
                    name, {"dtype": entry["dtype"], "shape": entry["shape"], "pieces": {}}
                )
                if slot["shape"] != entry["shape"]:
                    raise CheckpointError(
                        f"EMAStateful.state_dict: EMA {k} parameter {name!r} has the global shape {slot['shape']} on "
                        f"one rank and {entry['shape']} on another: every rank must save the same model"
                    )
                offsets, sizes, rows = entry["piece"]
                if math.prod(sizes) == 0:
                    continue
                seen = slot["pieces"].setdefault((tuple(offsets), tuple(sizes)), rows)
                if seen != rows:
                    raise CheckpointError(
                        f"EMAStateful.state_dict: EMA {k} parameter {name!r}: replicas of the piece at offsets "
                        f"{offsets} (sizes {sizes}) differ between ranks; their EMAs diverged"
                    )
    return {
        k: {
            name: {
                "dtype": slot["dtype"],
                "shape": slot["shape"],
                "pieces": [[list(o), list(s), rows] for (o, s), rows in slot["pieces"].items()],
            }
            for name, slot in sorted(ema.items())
        }
        for k, ema in merged.items()
    }


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
                and ("shape" not in slot or _is_sizes(slot["shape"]))  # records before the shape have none
            ):
                raise bad(f"emas.{k}.{name}", "is not a dtype, a shape and a list of [offsets, sizes, row checksums]")
    return record


def _is_piece(p: Any) -> bool:
    return (
        isinstance(p, list)
        and len(p) == 3
        and _is_sizes(p[0])
        and _is_sizes(p[1])
        and len(p[0]) == len(p[1])
        and isinstance(p[2], str)
    )


def _is_sizes(v: Any) -> bool:
    """A list of integers >= 0 (offsets, sizes, a shape)."""
    return isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)


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


def _grid(lo: list[int], hi: list[int], a: Any, b: Any) -> tuple[list[Any], Any]:
    """The grid that the boxes' boundaries cut the box ``[lo, hi)`` into, and per cell the number of boxes
    ``[a[i], b[i])`` (int64 arrays, one row per box, inside ``[lo, hi)``) that cover it: the cells are the
    coarsest blocks no boundary crosses, so a count holds for every element of its cell."""
    if not lo:  # a 0-d box is one cell, which each 0-d box covers
        return [], np.array(len(a))
    cuts = [np.unique(np.concatenate(([lo[d], hi[d]], a[:, d], b[:, d]))) for d in range(len(lo))]
    ends = [[np.searchsorted(c, x[:, d]) for d, c in enumerate(cuts)] for x in (a, b)]
    # a difference array (one cell longer per axis): each box adds +1 at its first cell and +-1, alternating,
    # at its other corners just past its end; the prefix sums along every axis are then each cell's count.
    # Vectorised, not a loop over boxes: a save from many ranks lists many pieces per tensor
    counts = np.zeros([len(c) for c in cuts], dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=len(lo)):
        np.add.at(counts, tuple(ends[up][d] for d, up in enumerate(corner)), (-1) ** sum(corner))
    for d in range(len(lo)):
        counts = np.cumsum(counts, axis=d)
    return cuts, counts[tuple(slice(0, len(c) - 1) for c in cuts)]


def _boxes(pieces: list, dim: int) -> tuple[Any, Any]:
    """The boxes ``[offsets, offsets + sizes)`` of pieces (``[offsets, sizes, ...]``) as two int64 arrays."""
    off = np.array([p[0] for p in pieces], dtype=np.int64).reshape(len(pieces), dim)
    return off, off + np.array([p[1] for p in pieces], dtype=np.int64).reshape(len(pieces), dim)


def _gap(lo: list[int], hi: list[int], pieces: list) -> tuple[int, list[int], list[int]] | None:
    """The elements of the box ``[lo, hi)`` (global offsets) that no saved piece (``[offsets, sizes, ...]``)
    covers: their number and the first missing block (its first and last index, inclusive); None if none."""
    a, b = _boxes([p for p in pieces if len(p[0]) == len(lo)], len(lo))
    a, b = np.maximum(a, lo), np.minimum(b, hi)  # the pieces' parts inside the box
    inside = (a < b).all(axis=1)
    cuts, counts = _grid(lo, hi, a[inside], b[inside])
    uncovered = counts == 0
    if not uncovered.any():
        return None
    volume = np.ones(counts.shape, dtype=np.int64)  # the elements in each cell
    for d, c in enumerate(cuts):
        volume = volume * np.diff(c).reshape([-1 if e == d else 1 for e in range(len(cuts))])
    cell = np.argwhere(uncovered)[0].tolist()
    first, last = [int(c[i]) for c, i in zip(cuts, cell)], [int(c[i + 1]) - 1 for c, i in zip(cuts, cell)]
    return int(volume[uncovered].sum()), first, last


def _check_covered(held: torch.Tensor, offsets: list[int], pieces: list, what: str) -> None:
    """Every element of ``held`` (at global ``offsets``) lies in a saved piece: DCP reads the parts of the
    template that the checkpoint's chunks cover and leaves the rest as it was, silently (a checkpoint saved
    by some ranks of a sharded layout lacks the other ranks' pieces; the save refuses that, older saves did not)."""
    gap = _gap(offsets, [o + n for o, n in zip(offsets, held.shape)], pieces)
    if gap is None:
        return
    missing, first, last = gap
    block = f"the first missing block: {first} to {last}, inclusive" if held.dim() else "its one element"
    raise CorruptCheckpointError(
        f"{what}: {missing} of the {held.numel()} elements this rank holds (offsets {offsets}, sizes "
        f"{list(held.shape)}) lie in no piece the checkpoint saved ({block}); dcp.load left them unloaded. Its saved "
        f"pieces (offsets, sizes): {[(p[0], p[1]) for p in pieces][:8]}. A checkpoint saved by only some ranks of a "
        "sharded layout (no_dist=True, or a process_group smaller than the model's) lacks the other ranks' pieces: "
        "save again with dcp.save on every rank of the model's group"
    )


def _check_loaded(
    state_dict: Mapping[str, Any], state: EmaState, where: str, key: str | None
) -> tuple[int, dict[str, list[str]], list[str]]:
    """Check what ``dcp.load`` put into the template against the record and the state; return the bytes
    left unverified on this rank (rows this layout splits), the record's parameter names per EMA, and the
    names this rank loaded (for :func:`_check_names`, across the ranks)."""
    missing = [entry for entry in ("step", "emas", RECORD_KEY) if entry not in state_dict]
    if missing:
        raise IncompleteCheckpointError(
            f"EMAStateful.load_state_dict: {where}: no {missing} in the loaded entry (keys {sorted(state_dict)})"
        )
    if isinstance(state_dict[RECORD_KEY], str) and state_dict[RECORD_KEY] == _UNLOADED:
        raise _not_loaded(state_dict["step"], where, key)
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
        if set(loaded) - set(saved):  # DCP skips what the checkpoint lacks only with allow_partial_load=True
            raise CheckpointMismatchError(
                f"{where}: this model has parameters its EMA does not hold (field emas.{k} of the checksum record: "
                f"{sorted(set(loaded) - set(saved))[:5]}); dcp.load with allow_partial_load=True left them as they "
                "were. Load it into the model it was saved from"
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
            _check_covered(held, offsets, saved[name]["pieces"], f"{where}: EMA {k} parameter {name!r}")
    return unverified, {k: sorted(ema) for k, ema in record["emas"].items()}, sorted(state_dict["emas"]["0"])


def _not_loaded(step: Any, where: str, key: str | None) -> CheckpointError:
    """The refusal of a load that left the template's record in place: DCP found no ``<key>.checksums``
    (``allow_partial_load=True`` skips it), so nothing can be checked; ``step``: what DCP left as the step."""
    named = f"key {key!r}" if key is not None else "this EMAStateful's key"
    entry = f"{key}.{RECORD_KEY}" if key is not None else f"<key>.{RECORD_KEY}"
    unloaded = isinstance(step, torch.Tensor) and step.numel() == 1 and int(step) == _UNLOADED_STEP
    if unloaded:
        return CheckpointMismatchError(
            f"EMAStateful.load_state_dict: {where} holds no functional_ema EMA under {named} (no entry {entry}); "
            "dcp.load with allow_partial_load=True skipped it and the EMA was not loaded. Load from a checkpoint "
            "saved with an EMAStateful under that key, or leave the EMA out of the load"
        )
    return CheckpointVersionError(
        f"EMAStateful.load_state_dict: {where}: the EMA under {named} has a step and values but no checksum "
        f"record (no entry {entry}): it was written by functional_ema 0.3.0, before the record, and cannot be "
        "verified; dcp.load has already written its values into the state's buffers. Read it offline with "
        "functional_ema.dcp.consolidate_dcp (unverified, with a warning)"
    )


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
        st = path.stat()
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: missing (DCP's metadata places {fqn} in it)") from None
    except OSError as e:
        raise CheckpointNotFoundError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):  # a folder, a fifo: reading it would raise or block
        raise CorruptCheckpointError(f"{path}: not a file (DCP's metadata places {fqn} in it)")
    size = st.st_size
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
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
    except OSError as e:
        raise CheckpointNotFoundError(f"{path}: cannot read ({e.strerror or e})") from None
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
    if type(index) is not int or index < 0:
        raise ValueError(f"consolidate_dcp: index must be an integer >= 0, got {index!r}")
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint_dir {root}: no such folder (a DCP checkpoint is a folder holding .metadata)"
        )
    if not (root / ".metadata").is_file():
        raise CheckpointNotFoundError(f"{root} is not a DCP checkpoint: it has no .metadata file")
    meta = _read_metadata(root / ".metadata")
    record, checked = _entry_record(root, meta, key)
    if index >= record["num_emas"]:
        raise CheckpointMismatchError(
            f"{root}: no EMA {index} under key {key!r} (index={index}; it holds {record['num_emas']} EMAs, "
            f"0..{record['num_emas'] - 1})"
        )
    saved = record["emas"][str(index)]
    prefix = f"{key}.emas.{index}."
    template: dict[str, torch.Tensor] = {f"{key}.step": torch.zeros((), dtype=torch.int64)}
    for name, slot in saved.items():
        template[prefix + name] = _full_tensor(root, meta, prefix + name, slot)
    _storage(root, meta, f"{key}.step", [])  # the step: a 0-d tensor, one piece
    _read_into(root, meta, template, f"EMA {index} under key {key!r}")
    step = int(template[f"{key}.step"])
    if (step != record["step"]) if checked else (step < 0):  # without a record: only its range
        raise CorruptCheckpointError(
            f"{root}: field step is {step}, "
            + (f"the EMA's checksum record says {record['step']}" if checked else "not an integer >= 0")
        )
    full = {fqn[len(prefix) :]: t for fqn, t in template.items() if fqn.startswith(prefix)}
    if verify and checked:
        for name, t in full.items():

            def where(offsets: list[int], fqn: str = prefix + name) -> str:
                return str(_storage(root, meta, fqn, offsets)[0])

            _verify(t, [0] * t.dim(), saved[name]["pieces"], name, str(index), where)
    return full, step


def _read_into(root: Path, meta: Metadata, template: dict[str, torch.Tensor], what: str) -> None:
    """DCP's reader fills ``template`` (one process); what it raises becomes a :class:`CorruptCheckpointError`."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(template, storage_reader=_reader(root, meta), no_dist=True)
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: one line naming it
        raise CorruptCheckpointError(f"{root}: DCP could not read {what} ({_first_failure(e)})") from None


def _entry_record(root: Path, meta: Metadata, key: str) -> tuple[dict[str, Any], bool]:
    """The checksum record of the EMA under ``key``, and whether it is one (True), or, for an entry that
    0.3.0 wrote (``step`` and ``emas``, no record), one made from DCP's metadata, with no checksums (False)."""
    entries = meta.state_dict_metadata
    record_fqn = f"{key}.{RECORD_KEY}"
    if record_fqn in entries:
        return _parse_record(_read_record(root, meta, record_fqn), f"{root}"), True
    if f"{key}.step" not in entries or not any(f.startswith(f"{key}.emas.") for f in entries):
        raise CheckpointMismatchError(
            f"{root}: no functional_ema EMA under key {key!r} (no entry {record_fqn}; top-level keys "
            f"{sorted({f.split('.')[0] for f in entries})})"
        )
    warnings.warn(
        f"{root}: the EMA under key {key!r} has no checksum record (no entry {record_fqn}): it was written by "
        "functional_ema 0.3.0, before the record; its values are read unverified (as with verify=False)",
        UserWarning,
        stacklevel=4,
    )
    return _legacy_record(root, entries, key), False


def _legacy_record(root: Path, entries: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A record of a 0.3.0 entry from DCP's metadata: EMAs ``<key>.emas.<k>.<name>``, their chunks as pieces."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    emas: dict[str, dict[str, Any]] = {}
    for fqn, m in entries.items():
        k, dot, name = fqn.removeprefix(f"{key}.emas.").partition(".")
        if fqn.startswith(f"{key}.emas.") and dot and name and isinstance(m, TensorStorageMetadata):
            # the pieces are the metadata's own chunks (what _full_tensor checks for tiling), with no checksums
            pieces = [[list(c.offsets), list(c.sizes), None] for c in m.chunks if math.prod(c.sizes)]
            dtype = str(getattr(m.properties, "dtype", "?")).removeprefix("torch.")
            emas.setdefault(k, {})[name] = {"dtype": dtype, "pieces": pieces}
    n = len(emas)
    if sorted(emas) != sorted(str(k) for k in range(n)):
        raise CorruptCheckpointError(
            f"{root / '.metadata'}: the EMAs under key {key!r} are {sorted(emas)}, not 0..{n - 1}"
        )
    return {"num_emas": n, "step": None, "emas": emas}


def _full_tensor(root: Path, meta: Metadata, fqn: str, slot: Mapping[str, Any]) -> torch.Tensor:
    """An empty tensor for ``fqn`` at its full size, once the metadata's entry is checked against the record
    (dtype, shape, pieces), its pieces tile the size exactly, and the files hold their bytes (so no element
    is left as allocated, and no size from a damaged file is allocated)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    m = meta.state_dict_metadata.get(fqn)
    at = root / ".metadata"
    if not isinstance(m, TensorStorageMetadata):
        raise CorruptCheckpointError(f"{at}: no tensor {fqn}, which the EMA's record lists")
    dtype = getattr(m.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") != slot["dtype"]:
        raise CorruptCheckpointError(f"{at}: {fqn} is {dtype}, the EMA's record says {slot['dtype']}")
    size = list(m.size) if isinstance(m.size, (tuple, list)) else m.size
    if not _is_sizes(size):
        raise CorruptCheckpointError(f"{at}: {fqn} has the size {m.size!r}, not a list of integers >= 0")
    if "shape" in slot and slot["shape"] != size:
        raise CorruptCheckpointError(f"{at}: {fqn} has the size {size}, the EMA's checksum record says {slot['shape']}")
    chunks = sorted((list(c.offsets), list(c.sizes)) for c in m.chunks if math.prod(c.sizes))
    if chunks != sorted((p[0], p[1]) for p in slot["pieces"]):
        raise CorruptCheckpointError(
            f"{root}: {fqn}: the pieces in DCP's metadata are not the pieces the EMA's checksum record lists"
        )
    _check_tiling(at, fqn, size, chunks)
    item = torch.empty((), dtype=dtype).element_size()
    for offsets, sizes in chunks:
        path, info = _storage(root, meta, fqn, offsets)
        if not getattr(info, "transform_descriptors", None) and info.length < math.prod(sizes) * item:
            raise CorruptCheckpointError(
                f"{path}: DCP's metadata gives the piece of {fqn} at offsets {offsets} {info.length} bytes, fewer than "
                f"its sizes {sizes} of {dtype} need ({math.prod(sizes) * item})"
            )
    return torch.empty(tuple(size), dtype=dtype)


def _check_tiling(at: Path, fqn: str, size: list[int], chunks: list[tuple[list[int], list[int]]]) -> None:
    """The pieces lie inside ``size``, do not overlap and cover it: each element is read exactly once."""
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or any(o + n > s for o, n, s in zip(offsets, sizes, size)):
            raise CorruptCheckpointError(
                f"{at}: {fqn}: the piece at offsets {offsets} (sizes {sizes}) lies outside its size {size}"
            )
    covered, total = sum(math.prod(n) for _, n in chunks), math.prod(size)
    if covered != total:
        raise CorruptCheckpointError(
            f"{at}: {fqn}: its pieces hold {covered} elements, its size {size} {total}: "
            + ("some are read twice" if covered > total else "some were never saved")
        )
    a, b = _boxes(chunks, len(size))
    cuts, counts = _grid([0] * len(size), size, a, b)
    if (counts != 1).any():  # as many elements as the size: some lie in two pieces (and others in none)
        point = [int(c[i]) for c, i in zip(cuts, np.argwhere(counts > 1)[0])]
        both = [(o, n) for (o, n), x, y in zip(chunks, a, b) if ((x <= point) & (point < y)).all()][:2]
        raise CorruptCheckpointError(f"{at}: {fqn}: the pieces (offsets, sizes) {both} overlap at {point}")


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
