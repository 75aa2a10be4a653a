"""Module buffers below the public :mod:`functional_ema.buffers`: which buffers a module has, and
a buffer state read back from an opened checkpoint. ``checkpoint.load`` and ``buffers`` both use
these; keeping them here keeps ``checkpoint`` from importing ``buffers`` (which imports it).
"""

from __future__ import annotations

from typing import Any

import torch

from ._checkpoint.errors import CheckpointMismatchError
from ._layout import ShardLayout
from ._state import BufferState

__all__ = ["loaded_buffer_state", "persistent_buffers", "split_floating"]


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`functional_ema.buffers.module_buffers` of a module already in hand (the verbs read the
    training object once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for b_name, b in mod.named_buffers(recurse=False):
            if b is None or b_name in skip or id(b) in seen:
                continue
            seen.add(id(b))
            out[f"{mod_name}.{b_name}" if mod_name else b_name] = b
    return out


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
