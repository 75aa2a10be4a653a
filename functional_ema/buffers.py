"""Module buffers (BatchNorm running statistics and the like) carried along with the EMA.

Buffers are not parameters: no optimizer updates them and no sharding engine partitions them
(DeepSpeed ZeRO-3 and FSDP2 keep every buffer whole on every rank; DDP broadcasts rank 0's). So
they need none of the machinery of sharded weights: they are a small, name-keyed tree of whole
tensors, and the engine-agnostic core handles them as it handles any tree (:func:`functional_ema.update`
takes its per-tensor path). This module adds only what a tree cannot know:

* which buffers a model has (:func:`module_buffers`: the persistent ones, by ``state_dict`` name);
* the two behaviours of the peers: ``mode="average"`` keeps an EMA of every floating buffer (timm's
  ``ModelEmaV3``, Lightning's ``EMAWeightAveraging``), ``mode="copy"`` copies the live values at
  each update (ema-pytorch's default). Integer and bool buffers (``num_batches_tracked``) are always
  copied, never averaged;
* evaluation with them (:func:`swapped_buffers`, to nest with :func:`functional_ema.swapped`);
* files: one small safetensors file per rank inside the EMA checkpoint's tag folder (DeepSpeed and
  FSDP2 do not synchronise buffers, so each rank's may differ; at another world size rank 0's is
  used, as DeepSpeed does for module state), and :func:`consolidate` that returns parameters and
  buffers together, loadable with ``load_state_dict(strict=True)`` (models without frozen or tied
  parameters; the parameters' EMA covers the trainable parameters once each).

Example:
    >>> import torch, functional_ema as fe
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    >>> bufs = fe.buffers.init_buffers(net)
    >>> _ = net(torch.randn(8, 3))                      # running stats move
    >>> bufs = fe.buffers.update_buffers(bufs, net, 1, decay=0.5)
    >>> sorted(bufs.emas[0]), sorted(bufs.copied)
    (['1.running_mean', '1.running_var'], ['1.num_batches_tracked'])
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NoReturn

import torch

from ._buffers import exact_dtype, loaded_buffer_state, persistent_buffers, refuse_unstorable, split_floating
from ._core import (
    check_ema_dtype,
    check_num_emas,
    check_step,
    check_step_tensor,
    decay_weights,
    refuse_inference,
    refuse_overflow,
    warn_sixteen_bit,
)
from ._core import update as _update
from ._errors import SwappedTrainingError
from ._state import BufferState, finish, marked_swapped, swapped_count
from .schedules import DecayLike

__all__ = [
    "BufferState",
    "module_buffers",
    "init_buffers",
    "update_buffers",
    "swapped_buffers",
    "load_buffers",
    "has_buffers",
    "consolidate",
    "buffer_file_name",
]

Mode = Literal["average", "copy"]


def _module(x: Any) -> torch.nn.Module:
    from .engines import adapter_for

    return adapter_for(x).module()


def module_buffers(x: Any) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``x``'s module, by ``state_dict`` name (live tensors, no copy).

    Args:
        x: anything :func:`functional_ema.local_shards` accepts (a DeepSpeed engine, an FSDP2 model,
            a DDP or plain module). Non-persistent buffers (not in ``state_dict``) are left out.
    """
    return persistent_buffers(_module(x))


def init_buffers(x: Any, *, num_emas: int = 1, step: int = 0, dtype: torch.dtype = torch.float32) -> BufferState:
    """Start the buffer EMAs equal to ``x``'s buffers (copies; integer buffers copied as they are).

    ``num_emas``, ``step`` and ``dtype`` are checked as :func:`functional_ema.init_ema` checks them
    (an int >= 1, an int step, a float32/float64/float16/bfloat16 ``torch.dtype``; a 16-bit one warns, and a
    float16 one is refused naming the buffer when a buffer's finite values exceed its range), and buffers on
    the meta device, or kept as they are (not floating) in a dtype a checkpoint cannot store (complex, uint16,
    ...), are refused naming the buffer, before anything is copied. The copies are normal tensors also under
    ``torch.inference_mode()`` (so that :func:`update_buffers` can write them outside it).
    """
    num_emas = check_num_emas(num_emas)
    dtype = check_ema_dtype(dtype)
    step = check_step(step, "step")
    floats, others = split_floating(module_buffers(x))
    for n, b in {**floats, **others}.items():
        if b.is_meta:
            raise ValueError(
                f"buffer {n!r} is on the meta device: it has a shape but no values to keep. Materialise the model "
                "(e.g. model.to_empty(device=...) and load or initialise its buffers) before init_buffers"
            )
    refuse_unstorable(others, "init_buffers")  # the averaged ones are kept in dtype, which is storable
    warn_sixteen_bit(dtype, "buffer EMA")
    with torch.no_grad(), torch.inference_mode(False):
        emas = tuple({n: b.detach().to(dtype=dtype, copy=True) for n, b in floats.items()} for _ in range(num_emas))
        copied = {n: b.detach().clone() for n, b in others.items()}
        if dtype is torch.float16:
            refuse_overflow(emas[0], floats, dtype, "init_buffers", "buffer")
        return BufferState(torch.tensor(step, dtype=torch.int64), emas, copied)


def _check_bstate(bstate: Any) -> None:
    if not isinstance(bstate, BufferState):
        raise TypeError(
            f"bstate must be a BufferState (from init_buffers or load_buffers), got {type(bstate).__name__}"
        )


def _check_names(bstate: BufferState, floats: dict, others: dict, verb: str) -> None:
    want_f, want_o = set(floats), set(others)
    for k, ema in enumerate(bstate.emas):
        if set(ema) != want_f:
            raise ValueError(
                f"{verb}: buffer EMA {k} holds {sorted(ema)} but the model's floating buffers are {sorted(want_f)}: "
                "the buffer state was made for another model"
            )
    if set(bstate.copied) != want_o:
        raise ValueError(
            f"{verb}: the buffer state copies {sorted(bstate.copied)} but the model's integer buffers are {sorted(want_o)}"
        )


def _check_writable(bstate: BufferState) -> None:
    """Refuse a buffer state holding inference tensors (built under ``torch.inference_mode()`` by hand), which
    :func:`update_buffers` could not write outside inference mode, before anything is written."""
    named = [("bstate.step", bstate.step), *((f"bstate.copied[{n!r}]", t) for n, t in bstate.copied.items())]
    named += [(f"bstate.emas[{k}][{n!r}]", t) for k, ema in enumerate(bstate.emas) for n, t in ema.items()]
    for what, t in named:
        if t.is_inference():
            refuse_inference(what, "init_buffers")


def update_buffers(
    bstate: BufferState,
    x: Any,
    step: int | None = None,
    *,
    decay: DecayLike | Sequence[DecayLike] = 0.9999,
    mode: Mode = "average",
) -> BufferState:
    """Move the buffer EMAs towards ``x``'s buffers (``mode="average"``) or copy them (``"copy"``).

    ``"average"`` is :func:`functional_ema.update` over the floating buffers with the same
    ``step`` and ``decay`` as the parameters' EMA (so the two stay in step, compounded alike: pass the EMA
    state's step after :func:`functional_ema.update`, ``int(state.step)``, which stays the last step when
    ``update(..., nonfinite="skip")`` skipped one, so the buffers skip it too and ``save`` takes both);
    ``"copy"`` sets every EMA to the live values, bitwise: a state whose dtype cannot hold a buffer's
    values exactly (a float64 buffer in the default float32 state) is widened first, every EMA to the one
    dtype that holds them all (float64 there; :func:`init_buffers` with that ``dtype`` copies exactly from the
    start). Integer buffers are copied in both modes. An
    update at the state's own step is a no-op, as for :func:`functional_ema.update`. In place.
    ``bstate.step``, ``step`` and ``decay`` (also with ``"copy"``, which does not use it) are checked as
    :func:`functional_ema.update` checks them, and a state holding inference tensors is refused, before
    any buffer value changes. A state swapped into a model by an open :func:`swapped_buffers` block is refused
    (:class:`~functional_ema.SwappedTrainingError`): the buffers hold its EMA there.
    """
    if not (isinstance(mode, str) and mode in ("average", "copy")):
        raise ValueError(f'mode must be "average" or "copy", got {mode!r}')
    _check_bstate(bstate)
    check_step_tensor(bstate.step, "bstate.step", "init_buffers", "load_buffers")
    if swapped_count(bstate.step):
        _refuse_swapped_buffers()
    floats, others = split_floating(module_buffers(x))
    _check_names(bstate, floats, others, "update_buffers")
    _check_writable(bstate)
    last = int(bstate.step)
    step = last + 1 if step is None else check_step(step, "step")
    if step == last:
        return bstate
    emas = bstate.emas
    if mode == "copy":
        if step > last:  # an earlier step is refused by update below, as in "average"
            # Checked as in "average", then unused; a single decay stands for every EMA here (nothing to compound),
            # so a state of several EMAs copies with the default decay too.
            decay_weights(bstate.num_emas if isinstance(decay, (list, tuple)) else 1, decay, last, step)
            emas = _widened(emas, floats)
        decay = [0.0] * bstate.num_emas if bstate.num_emas > 1 else 0.0
    from ._state import EmaState

    inner = _update(EmaState(bstate.step, emas), floats, step, decay=decay)
    for mine, wide in zip(bstate.emas, emas):  # in place: the widened copies (if any) are the state's now
        mine.update(wide)
    with torch.no_grad():
        for n, b in others.items():
            bstate.copied[n].copy_(b)
    return BufferState(inner.step, bstate.emas, bstate.copied)


def _refuse_swapped_buffers() -> NoReturn:
    raise SwappedTrainingError(
        "update_buffers() of a buffer state that is swapped into a model by an open "
        "functional_ema.buffers.swapped_buffers(...) block: the model's buffers hold this state's EMA there, so it "
        "would be averaged into itself while its step advanced; nothing was changed. Update the buffers before or "
        "after the block (with the parameters' update, before the evaluation)"
    )


def _widened(emas: tuple[dict[str, torch.Tensor], ...], floats: dict[str, torch.Tensor]) -> tuple:
    """``emas``, or new copies of them in a dtype that holds every live buffer exactly when theirs does not (a float64
    buffer in the default float32 state): a copy is then bitwise the live values. One dtype for all (a checkpoint
    stores the buffer EMAs in one); the copies are new dicts, so that a refusal by ``update`` leaves the state as
    it was."""
    have = [t.dtype for ema in emas for t in ema.values()]
    want = exact_dtype([*have, *(b.dtype for b in floats.values())]) if have else None
    if all(d == want for d in have):
        return emas
    with torch.no_grad(), torch.inference_mode(False):  # normal tensors, as init_buffers makes them
        return tuple({n: t.to(dtype=want, copy=True) for n, t in ema.items()} for ema in emas)


@contextlib.contextmanager
def swapped_buffers(x: Any, bstate: BufferState, *, index: int = 0) -> Iterator[int]:
    """Within the block ``x``'s buffers hold EMA ``index`` (cast to each buffer's dtype) and the
    copied integer buffers; the live values come back on exit, also on error. Nest it with
    :func:`functional_ema.swapped` to evaluate with EMA parameters and buffers. Yields the number of
    buffers swapped.

    Refused before anything changes: an ``index`` that is not one of the EMAs (``TypeError``/``ValueError``),
    a state of other buffer names or shapes, a buffer whose elements share memory (an expanded view) (``ValueError``). A block that re-types (``model.double()``) or
    re-assigns (``load_state_dict(..., assign=True)``) the buffers, or replaces a submodule, has them put back
    on exit (the objects and memory they had on entry, the live values in them), and then
    :class:`~functional_ema.SwappedParametersChangedError` names each (on an exception from the block: that
    exception, with a note). The parameters are left as the block left them. :func:`update_buffers` of
    ``bstate`` is refused inside the block (:class:`~functional_ema.SwappedTrainingError`)."""
    from ._api import changes_reported, checked_index
    from .engines._base import parameters_put_back

    _check_bstate(bstate)
    index = checked_index(index, bstate, in_range=True, of="the buffer state")
    module = _module(x)
    floats, others = split_floating(persistent_buffers(module))
    _check_names(bstate, floats, others, "swapped_buffers")
    sources = ((bstate.emas[index], floats), (bstate.copied, others))
    pairs = [(b, src[n]) for src, live in sources for n, b in live.items()]
    _check_swap_shapes(pairs, [*floats, *others])
    refuse_overlapping(dict(zip([*floats, *others], (b for b, _ in pairs))), "swapped_buffers")
    with (
        marked_swapped(bstate),  # update_buffers(bstate, ...) is refused in the block: the buffers hold its EMA
        changes_reported("functional_ema.buffers.swapped_buffers(...)") as changes,
        _emas_in(pairs),
        parameters_put_back(module, changes, skip=lambda _mod, _attr: True),  # buffers and submodules only
    ):
        yield len(pairs)


def _check_swap_shapes(pairs: list[tuple[torch.Tensor, torch.Tensor]], names: list[str]) -> None:
    """``ValueError`` naming the first buffer whose EMA (or copy) has another shape than the buffer's: ``copy_``
    would broadcast it (a ``(1,)`` EMA into a ``(4,)`` buffer) or fail half-way."""
    for name, (b, src) in zip(names, pairs):
        if src.shape != b.shape:
            raise ValueError(
                f"swapped_buffers: buffer {name!r} has shape {tuple(b.shape)} in the model but {tuple(src.shape)} in "
                "the buffer state: the buffer state was made for another model"
            )


def refuse_overlapping(buffers: dict[str, torch.Tensor], verb: str) -> None:
    """``ValueError`` naming the first buffer whose elements share memory (an ``expand``-ed view, stride 0), before
    anything is written: a copy of the EMA into it has no meaning (one memory location would hold several values),
    and torch's own error names no buffer."""
    for name, b in buffers.items():
        if _overlaps(b):
            raise ValueError(
                f"{verb}: buffer {name!r} (shape {tuple(b.shape)}, strides {tuple(b.stride())}) has elements that "
                "share memory (an expanded view), so its EMA cannot be written into it. Register it as its own "
                "memory (module.register_buffer(name, buffer.contiguous())) before training, or leave it out of the "
                "state (persistent=False)"
            )


def _overlaps(t: torch.Tensor) -> bool:
    has_overlap = getattr(torch, "_debug_has_internal_overlap", None)  # torch's own test (0 no, 1 yes, 2 unknown)
    if has_overlap is not None:
        return bool(has_overlap(t) == 1)
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))  # pragma: no cover


@contextlib.contextmanager
def _emas_in(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Each ``(buffer, value)`` pair's value copied into the buffer for the block, the live values kept aside and
    copied back on exit, also on error and when an exception (Ctrl-C) lands in the copying back (``finish``).

    Autograd's version counters are handled as ``functional_ema.swapped`` handles the parameters': a training forward
    saves the BatchNorm running statistics for its backward, so a block between that forward and its backward (an
    evaluation mid-step) must leave them at their versions, as it leaves their values, or the backward is refused;
    one the block itself moved (a forward in training mode, an in-place edit) keeps its version."""
    from .engines._base import _INSIDE, _ONCE, entry_versions, set_versions

    # Copies into them record no autograd history (a buffer that requires grad, rare, through a detached view: the
    # same memory and version counter), so the exit's copies need no no_grad.
    targets = [b.detach() if b.requires_grad else b for b, _ in pairs]
    indices = range(len(targets))
    versions = entry_versions(zip(indices, targets))  # before any copy: views of one tensor share one counter
    saved: list[torch.Tensor] = []
    untouched: set[int] = set()

    def prepare(_: object) -> None:
        # The counters nothing moved in the block, read before any copy back moves them (made again if cut short).
        untouched.update(k for k, (t, v) in versions.items() if t._version == v + _INSIDE)

    def copy_back(k: int) -> None:
        if k < len(saved):  # kept aside before an exception cut the entry short
            targets[k].copy_(saved[k])

    def versions_back(_: object) -> None:
        set_versions([versions[k] for k in untouched], 0)

    steps = ((prepare, _ONCE), (copy_back, indices), (versions_back, _ONCE))  # before the block (see finish)
    try:
        saved.extend(t.clone() for t in targets)
        for t, (_, value) in zip(targets, pairs):
            t.copy_(value)
        set_versions(versions.values(), _INSIDE)
        yield
    finally:
        try:
            finish(*steps)
        except BaseException:  # one that landed before finish began: every step again, then raised
            finish(*steps)
            raise


# ------------------------------------------------------------------------------------------- files
#
# Buffers are saved by functional_ema.save(state, x, dir, tag, buffers=bstate): one file per rank
# (buffers_rank_<r>_of_<w>[.gen<N>].safetensors) written with the EMA's files, listed with their
# checksums in the same manifest, so a tag is complete only with them and a failed save never leaves
# buffers at a newer step than the EMA. Reading goes through the validated checkpoint reader.


def buffer_file_name(rank: int, world_size: int, generation: int = 0) -> str:
    """``buffers_rank_<rank>_of_<world>[.gen<N>].safetensors``: one rank's buffers in a tag folder."""
    from ._checkpoint.format import buffer_file_name as name

    return name(rank, world_size, generation)


def load_buffers(x: Any, load_dir: str | os.PathLike, tag: str | None = None, *, verify: bool = True) -> BufferState:
    """This rank's buffer state saved with the EMA (``fe.save(..., buffers=...)``). Collective.

    Reads this rank's own buffer file when the checkpoint was saved at this world size, else rank 0's;
    only files the tag's manifest lists (of its world size and generation), checked field by field and
    byte by byte, on the devices of ``x``'s buffers and against ``x``'s buffer names and shapes.
    ``tag=None`` follows ``latest`` / ``ema_latest`` as :func:`functional_ema.load` does.
    """
    from ._args import check_bool, check_path
    from ._checkpoint.collective import agree, arrive, job_of
    from ._checkpoint.reader import open_checkpoint
    from .checkpoint import _private_advice

    load_dir, verify = check_path(load_dir, "load_dir"), check_bool(verify, "verify")
    from .engines import adapter_for

    adapter = adapter_for(x)
    reading = adapter.read()
    layout, job = reading.layout, job_of(reading)
    arrive("load_buffers", job.group, job.world, job.rank, None)
    box = {}

    advice = (
        "(a save with shared=False into each rank's own folder, which load_buffers cannot read: restore its buffers "
        "with functional_ema.checkpoint.load_checkpoint(x, load_dir, tag, buffers=True, shared=False), or merge the "
        "folders first)"
    )

    def run() -> None:
        with _private_advice(advice), open_checkpoint(load_dir, tag, verify, layout) as ckpt:
            box["state"] = loaded_buffer_state(persistent_buffers(adapter.module()), layout, ckpt, verify)

    agree("load_buffers", run, job.group, job.world, job.rank, results=False)
    return box["state"]


def has_buffers(load_dir: str | os.PathLike, tag: str | None = None) -> bool:
    """Whether the complete checkpoint ``load_dir/tag`` carries buffers (its manifest lists buffer files)."""
    from ._args import check_path

    load_dir = check_path(load_dir, "load_dir")
    from .checkpoint import read_manifest

    return read_manifest(load_dir, tag).get("buffer_files") is not None


def consolidate(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, *, index: int = 0, verify: bool = True
) -> dict[str, torch.Tensor]:
    """:func:`functional_ema.consolidate` plus rank 0's buffers: a full ``state_dict`` offline.

    Floating buffers come from buffer EMA ``index``, integer buffers as copied; both from the same
    checkpoint (one opening, one generation). Loads with ``model.load_state_dict(sd, strict=True)``
    when every parameter is trainable and untied.
    """
    from ._checkpoint.reader import open_joined
    from .checkpoint import consolidate_opened

    with open_joined(checkpoint_dir, tag, verify) as ckpt:
        weights = consolidate_opened(ckpt, index, verify)
        _, emas, copied = ckpt.read_buffers(verify)
    weights.update(emas[index])
    weights.update(copied)
    return weights
