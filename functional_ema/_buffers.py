"""Module buffers below the public :mod:`functional_ema.buffers`: which buffers a module has, and
a buffer state read back from an opened checkpoint. ``checkpoint.load`` and ``buffers`` both use
these; keeping them here keeps ``checkpoint`` from importing ``buffers`` (which imports it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from . import _io  # _io.DTYPE_TO_STR: the dtypes the checkpoint writer stores (one list, also for refuse_unstorable)
from ._checkpoint.errors import CheckpointMismatchError
from ._layout import ShardLayout
from ._state import BufferState

__all__ = ["exact_dtype", "loaded_buffer_state", "persistent_buffers", "refuse_unstorable", "split_floating"]


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`functional_ema.buffers.module_buffers` of a module already in hand (the verbs read the
    training object once). Every name ``state_dict`` has: a tensor registered under two names (in two modules,
    or a module registered twice) is listed under both, so that ``consolidate`` loads with ``strict=True``."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in skip:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = b
    return out


def exact_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The narrowest dtype that holds the values of every one of ``dtypes`` exactly (torch's promotion: float64 when
    one is float64): what a copy (``mode="copy"``) of buffers of these dtypes must be kept in to be bitwise."""
    # torch does not promote float8 types: a 1-byte float is held exactly by float32 (the buffer EMA's default dtype)
    return functools.reduce(
        torch.promote_types, (torch.float32 if d.is_floating_point and d.itemsize == 1 else d for d in dtypes)
    )


def refuse_unstorable(bufs: dict[str, torch.Tensor], verb: str) -> None:
    """``TypeError`` naming the first buffer kept as it is (not averaged) whose dtype a checkpoint cannot store
    (complex, unsigned beyond uint8, ...): refused when the buffer state is made, not at its first save."""
    for n, b in bufs.items():
        if b.dtype not in _io.DTYPE_TO_STR:
            storable = ", ".join(str(d).removeprefix("torch.") for d in _io.DTYPE_TO_STR)
            raise TypeError(
                f"{verb}: buffer {n!r} has dtype {b.dtype}, which a checkpoint cannot store (storable: {storable}). "
                "Keep it out of the buffer state: register it with persistent=False when it is computed from the "
                "config (e.g. RoPE's complex freqs_cis, which then needs no EMA), store it in a storable dtype "
                "(e.g. torch.view_as_real for a complex one), or carry no buffers (no init_buffers; buffers=None "
                "in the callbacks)"
            )


def split_floating(bufs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(floating, others)``: the buffers to average and the ones (integer, bool) to copy."""
    floats = {n: b for n, b in bufs.items() if b.is_floating_point()}
    others = {n: b for n, b in bufs.items() if not b.is_floating_point()}
    return floats, others


def loaded_buffer_state(
    live_buffers: dict[str, torch.Tensor], layout: ShardLayout, ckpt: Any, verify: bool = True
) -> BufferState:
    """This rank's buffer state from an opened checkpoint, checked against the module's live buffers
    (:func:`persistent_buffers`) and placed on their devices (see :func:`functional_ema.buffers.load_buffers`).
    Normal tensors also under ``torch.inference_mode()``, so that ``update_buffers`` can write them outside it."""
    with torch.inference_mode(False):
        return _read_buffer_state(live_buffers, layout, ckpt, verify)


def _read_buffer_state(
    live_buffers: dict[str, torch.Tensor], layout: ShardLayout, ckpt: Any, verify: bool
) -> BufferState:
    _num_emas, emas, copied = ckpt.read_buffers(layout.rank, layout.world_size, verify)
    floats, others = split_floating(live_buffers)
    where = f"buffers of tag {ckpt.tag!r} in {ckpt.root}"
    if getattr(ckpt, "recut", False):  # saved with another model-parallel layout: this part's buffers, by name
        emas = tuple({n: t for n, t in ema.items() if n in floats} for ema in emas)
        copied = {n: t for n, t in copied.items() if n in others}
    emas = tuple(_aliases_filled(ema, floats) for ema in emas)
    copied = _aliases_filled(copied, others)
    for what, saved, live in (("floating", emas[0] if emas else {}, floats), ("integer", copied, others)):
        if set(saved) != set(live):
            raise CheckpointMismatchError(
                f"{where}: the saved {what} buffers {sorted(saved)} are not this model's {sorted(live)}: the checkpoint "
                "was saved from another model"
            )
        for n, t in saved.items():
            if tuple(t.shape) != tuple(live[n].shape):
                raise CheckpointMismatchError(
                    f"{where}: buffer {n!r} has shape {tuple(t.shape)} in the checkpoint but "
                    f"{tuple(live[n].shape)} in the model"
                )
    emas = tuple({n: t.to(floats[n].device) for n, t in ema.items()} for ema in emas)
    copied = {n: t.to(others[n].device) for n, t in copied.items()}
    return BufferState(torch.tensor(ckpt.step, dtype=torch.int64), emas, copied)


def _aliases_filled(saved: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``saved`` with the second names of a tensor registered under several added, from its first name, when only
    that one was saved (0.4.0 and earlier saved one name per tensor): each name its own copy, as
    ``init_buffers`` makes them (an update moves each once)."""
    first: dict[int, str] = {}
    out = dict(saved)
    for n, b in live.items():
        src = first.setdefault(id(b), n)
        if n not in out and src != n and src in saved:
            out[n] = saved[src].clone()
    return out
