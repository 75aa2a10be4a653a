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

Keys (DCP flattens them): ``ema.step`` (int64), ``ema.emas.<k>.<parameter name>``. A DCP checkpoint's
``.metadata`` file is a pickle, which DCP unpickles on load: load DCP checkpoints from sources you
trust (:func:`functional_ema.load` never unpickles). Offline full weights: :func:`consolidate_dcp`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._api import state_pieces
from ._state import EmaState, wait_pending
from .engines import adapter_for

__all__ = ["EMAStateful", "consolidate_dcp"]


class EMAStateful:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` view of the EMA of ``x``.

    Args:
        x: the model the EMA's pieces come from (FSDP2 / HSDP / DTensor tensor parallel, a
            ``torch.distributed.pipelining`` stage, a DDP or plain module). Not a DeepSpeed engine.
        state: the :class:`~functional_ema.EmaState`, or a callable returning the current one (the
            state changes identity when you reassign ``state = fe.update(...)`` with ``inplace=False``;
            with the default in-place update it shares the buffers, so either works).

    ``state_dict()`` is called by ``dcp.save`` (and by ``dcp.load`` for the template), ``load_state_dict``
    by ``dcp.load`` after it has written into the template's tensors (the state's own buffers). Every
    EMA of the state is saved; the step is restored with the values, so decays continue exactly.
    """

    def __init__(self, x: Any, state: EmaState | Callable[[], EmaState]):
        from .engines.deepspeed import is_deepspeed_engine

        if is_deepspeed_engine(x):
            raise TypeError(
                "functional_ema.dcp.EMAStateful: a DeepSpeed engine's fp32 partitions are flat slices across parameter "
                "boundaries, which DTensor (and so torch.distributed.checkpoint) cannot describe. Save the EMA with "
                "functional_ema.save(state, engine, save_dir) beside engine.save_checkpoint(save_dir), and load it "
                "with functional_ema.load(engine, save_dir)"
            )
        self._x = x
        self._state = state if callable(state) else (lambda: state)

    @property
    def state(self) -> EmaState:
        return self._state()

    def state_dict(self) -> dict[str, Any]:
        state = self._state()
        reading = adapter_for(self._x).read()
        emas = {}
        for k in range(state.num_emas):
            pieces = state_pieces(state, reading, k, "EMAStateful.state_dict")
            emas[str(k)] = {name: _as_dtensor(pieces[name], reading.params[name]) for name in reading.layout.specs}
        return {"step": state.step, "emas": emas}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = self._state()
        wait_pending(state)  # an update queued with blocking=False must not write over what is loaded
        missing = [k for k in ("step", "emas") if k not in state_dict]
        if missing:
            raise KeyError(
                f"EMAStateful.load_state_dict: no {missing} in the loaded state dict (keys {sorted(state_dict)})"
            )
        with torch.no_grad():
            for k, ema in state_dict["emas"].items():
                target = state.emas[int(k)]
                for name, t in ema.items():
                    local = t.to_local() if hasattr(t, "to_local") else t
                    dst = target[name]
                    if local.data_ptr() != dst.data_ptr() or local.numel() != dst.numel():  # DCP loaded elsewhere
                        dst.copy_(local.reshape(dst.shape))
            step = state_dict["step"]
            if step is not state.step:
                state.step.copy_(torch.as_tensor(step, dtype=state.step.dtype))


def _as_dtensor(piece: torch.Tensor, param) -> torch.Tensor:
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


def consolidate_dcp(checkpoint_dir: str | os.PathLike, key: str = "ema", *, index: int = 0) -> dict[str, torch.Tensor]:
    """The full EMA ``index`` from a DCP checkpoint folder, without a process group.

    Reads DCP's metadata (a pickle: see the module docstring), allocates each EMA tensor at its full
    size (checked against the metadata) and lets DCP fill it. ``key``: the entry the
    :class:`EMAStateful` was saved under. Raises ``KeyError`` naming what the folder holds when it
    has no such EMA.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.fspath(checkpoint_dir))
    meta = reader.read_metadata()
    prefix = f"{key}.emas.{index}."
    template = {
        fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for fqn, m in meta.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    if not template:
        emas = sorted({f.split(".")[2] for f in meta.state_dict_metadata if f.startswith(f"{key}.emas.")})
        raise KeyError(
            f"{checkpoint_dir}: no EMA {index} under key {key!r} (EMAs there: {emas or 'none'}; top-level keys "
            f"{sorted({f.split('.')[0] for f in meta.state_dict_metadata})})"
        )
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    return {fqn[len(prefix) :]: t for fqn, t in template.items()}
