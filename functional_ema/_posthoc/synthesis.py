"""Synthesising the EMA of a requested profile from snapshots held in memory."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from .._args import check_int, check_optional_int, check_real, check_reals, check_sequence
from .._core import check_ema_dtype
from .._state import EmaState, wait_pending
from .._tree import TreeMismatchError, check_same_tree, flatten_named
from ..schedules import Schedule, sigma_rel_to_gamma
from .profiles import DEFAULT_MAX_PROFILE_ERROR, ReconstructionError, solve_coefficients

# ---------------------------------------------------------------------------------------- synthesis


def synthesize(
    snapshots: Sequence[Any],
    coeffs: Sequence[float] | np.ndarray,
    *,
    dtype: torch.dtype = torch.float32,
    accumulate_dtype: torch.dtype = torch.float64,
) -> Any:
    """``sum_i coeffs[i] * snapshots[i]``, leaf by leaf, over trees of tensors of the same structure.

    Snapshots with a zero coefficient are not read. The sum is accumulated in ``accumulate_dtype``
    (float64 by default: the coefficients alternate in sign, and fp32 snapshots are exact in it)
    and returned in ``dtype``.

    Memory beyond the snapshots: accumulators for the whole tree in ``accumulate_dtype``, 4 MiB of
    scratch (:func:`add_scaled`), and at the end one leaf in ``dtype`` beside them (each accumulator is
    freed once cast), so the peak is the accumulators plus the largest leaf in ``dtype``.

    Args:
        snapshots: name-keyed trees (e.g. ``dict[str, Tensor]``), all with the same names and shapes.
        coeffs: one float per snapshot, e.g. from :func:`solve_coefficients`.

    Returns:
        A tree like ``snapshots[0]`` with ``dtype`` tensors on the snapshots' device.

    Example:
        >>> synthesize([{"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)}], [0.5, 0.5])
        {'w': tensor([2., 2.])}
    """
    snapshots = check_sequence(snapshots, "snapshots", nonempty=False)
    x = [float(c) for c in check_reals(coeffs, "coeffs").reshape(-1)]
    dtype = check_ema_dtype(dtype)
    accumulate_dtype = check_ema_dtype(accumulate_dtype, "accumulate_dtype")
    if len(x) != len(snapshots):
        raise ReconstructionError(f"coeffs: got {len(x)} coefficients for {len(snapshots)} snapshots")
    if not snapshots:
        raise ReconstructionError("no snapshots to synthesise from")
    names0, leaves0, spec0 = flatten_named(snapshots[0], "snapshots[0]")
    acc = [torch.zeros(leaf.shape, dtype=accumulate_dtype, device=leaf.device) for leaf in leaves0]
    with torch.no_grad():
        for i, (c, tree) in enumerate(zip(x, snapshots)):
            names, leaves, spec = flatten_named(tree, f"snapshots[{i}]")
            check_same_tree(names0, spec0, names, spec, "snapshots[0]", f"snapshots[{i}]")
            if c == 0.0:
                continue
            for name, a, leaf in zip(names, acc, leaves):
                if leaf.shape != a.shape:
                    raise TreeMismatchError(
                        f"snapshots[{i}][{name!r}] has shape {tuple(leaf.shape)}, snapshots[0] has {tuple(a.shape)}"
                    )
                add_scaled(a, leaf, c)
    out = []
    for j in range(len(acc)):  # each accumulator freed once cast: never every one beside every output
        out.append(acc[j].to(dtype))
        acc[j] = out[-1]
    del acc
    return optree.tree_unflatten(spec0, out)


#: Elements scaled at a time by :func:`add_scaled`: its scratch is at most this many accumulator elements
#: (4 MiB in float64), however large the tensor.
SCALE_CHUNK = 1 << 19


def add_scaled(acc: torch.Tensor, t: torch.Tensor, c: float) -> None:
    """``acc += c * t`` for a contiguous ``acc`` of ``t``'s shape, :data:`SCALE_CHUNK` elements at a time.

    Each element is converted to ``acc``'s dtype, multiplied by ``c``, then added: two roundings, never a
    fused multiply-add, so every element gets the same arithmetic wherever it sits in a tensor and per-rank
    pieces reconstruct bitwise like full ones. Chunks change no value (the arithmetic is elementwise); they
    bound the scratch, which a whole-tensor copy made as large as the accumulator itself.
    """
    scratch = torch.empty(min(t.numel(), SCALE_CHUNK), dtype=acc.dtype, device=acc.device)
    _add_scaled(acc, t, c, scratch)


def _add_scaled(acc: torch.Tensor, t: torch.Tensor, c: float, scratch: torch.Tensor) -> None:
    """:func:`add_scaled` with its scratch (one buffer for every chunk: a fresh one a chunk costs page faults)."""
    if t.numel() <= scratch.numel():
        buf = scratch[: t.numel()].view(t.shape)
        acc.add_(buf.copy_(t).mul_(c))  # copy_ converts as .to() does (the same cast)
    elif t.dim() == 1 or t.is_contiguous():  # flat views of both (reshape of these is a view, never a copy)
        a, f = acc.view(-1), t.reshape(-1)
        for s in range(0, f.numel(), SCALE_CHUNK):
            n = min(SCALE_CHUNK, f.numel() - s)
            a.narrow(0, s, n).add_(scratch[:n].copy_(f.narrow(0, s, n)).mul_(c))
    else:  # strided (e.g. a transposed snapshot): blocks of whole rows, or row by row for rows over a chunk
        rows = SCALE_CHUNK // max(1, t[0].numel())
        if rows == 0:
            for i in range(t.shape[0]):
                _add_scaled(acc[i], t[i], c, scratch)
            return
        for s in range(0, t.shape[0], rows):
            n = min(rows, t.shape[0] - s)
            _add_scaled(acc.narrow(0, s, n), t.narrow(0, s, n), c, scratch)


# ------------------------------------------------------------------------------ in-memory snapshots


class Snapshot(NamedTuple):
    """Copies of every tracked power EMA at one training step.

    Attributes:
        step: the training step (``int(state.step)``), ``>= 1``.
        gammas: exponent of each EMA, ``len(gammas) == len(emas)``.
        emas: detached copies of ``state.emas`` (fp32 by default), one name-keyed dict per EMA.
    """

    step: int
    gammas: tuple[float, ...]
    emas: tuple[dict[str, torch.Tensor], ...]


def snapshot_gammas(schedules: Sequence[Schedule | float]) -> tuple[float, ...]:
    """Exponents of power EMAs given as :func:`functional_ema.schedules.power` schedules or as
    ``sigma_rel`` floats (a float is always read as a ``sigma_rel``)."""
    out = []
    for i, s in enumerate(check_sequence(schedules, "schedules")):
        if isinstance(s, numbers.Real) and not isinstance(s, bool):
            try:
                out.append(sigma_rel_to_gamma(check_real(s, f"schedules[{i}]")))
            except ValueError as e:
                raise ValueError(f"schedules[{i}]: {e}") from None
        elif isinstance(getattr(s, "gamma", None), (int, float)):
            out.append(float(s.gamma))
        else:
            raise TypeError(
                f"schedules[{i}]: post-hoc EMA needs power EMAs (schedules.power(sigma_rel=...)) or sigma_rel floats, "
                f"got {s!r:.80}"
            )
    return tuple(out)


def gammas_and_step(state: EmaState, schedules: Sequence[Schedule | float]) -> tuple[tuple[float, ...], int]:
    """The exponents of ``state``'s power EMAs (one schedule per EMA) and its step (at least 1)."""
    wait_pending(state)  # an update queued with blocking=False finishes before its step and EMAs are read
    gammas = snapshot_gammas(schedules)
    if len(gammas) != state.num_emas:
        raise ValueError(f"got {len(gammas)} schedules for a state tracking {state.num_emas} EMAs")
    step = int(state.step)
    if step < 1:
        raise ValueError("the state has not been updated yet (step 0): a power EMA has no profile before step 1")
    return gammas, step


def snapshot(
    state: EmaState,
    schedules: Sequence[Schedule | float],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = "cpu",
) -> Snapshot:
    """A detached copy of every EMA of ``state``, tagged with its step and exponents.

    Args:
        state: a state tracking ``K`` power EMAs, updated with ``decay=schedules``.
        schedules: the ``K`` power schedules (or their ``sigma_rel`` floats), in the state's order.
        dtype: snapshot dtype. Keep fp32: on the random walk of ``tests/test_posthoc.py`` the error
            at sigma_rel 0.15, relative to the EMA's distance from the live weights, is 1.7e-5 from
            fp32 snapshots, 9.5e-4 from fp16 and 7.6e-3 from bf16 ones.
        device: where the copies go (default CPU; ``None`` keeps the EMA's device).

    Returns:
        A :class:`Snapshot` (copies, never views of the state's buffers).
    """
    from .._args import check_device, check_state
    from .._core import check_ema_dtype

    check_state(state)
    dtype, device = check_ema_dtype(dtype), check_device(device, "device")
    gammas, step = gammas_and_step(state, schedules)
    with torch.no_grad():
        emas = tuple(copied(ema, device, dtype) for ema in state.emas)
    return Snapshot(step, gammas, emas)


def copied(tree: Any, device: torch.device | str | None, dtype: torch.dtype) -> Any:
    """A detached copy of one EMA tree, of the same structure (``Any``: optree types a tree as its own
    ``PyTree`` class, which a ``dict`` is not to a type checker)."""
    return optree.tree_map(
        lambda e: e.detach().to(device=e.device if device is None else device, dtype=dtype, copy=True),
        tree,
        none_is_leaf=False,
    )


def _snapshot_fields(snap: Snapshot, i: int) -> tuple[int, list[float], tuple[Any, ...]]:
    """The fields of ``snapshots[i]`` checked (a hand-built :class:`Snapshot` may hold anything), each error
    naming ``snapshots[i].<field>``."""
    at = check_int(snap.step, f"snapshots[{i}].step", minimum=1)
    if not isinstance(snap.gammas, (tuple, list)):
        raise TypeError(
            f"snapshots[{i}].gammas must be a tuple of exponents, one per EMA, got {type(snap.gammas).__name__} "
            f"{snap.gammas!r:.60} (for one EMA: gammas=(g,))"
        )
    gammas = check_reals(snap.gammas, f"snapshots[{i}].gammas").tolist()
    if not isinstance(snap.emas, (tuple, list)) or any(not isinstance(e, Mapping) for e in snap.emas):
        got = (
            type(snap.emas).__name__ if not isinstance(snap.emas, (tuple, list)) else "a tuple holding other than dicts"
        )
        raise TypeError(
            f"snapshots[{i}].emas must be a tuple of name-keyed dicts of tensors, one per EMA, got {got} "
            "(for one EMA: emas=(tree,))"
        )
    if len(gammas) != len(snap.emas):
        raise ReconstructionError(
            f"snapshots[{i}] (step {at}) has {len(gammas)} gammas for {len(snap.emas)} EMAs: give one gamma per EMA"
        )
    return at, gammas, tuple(snap.emas)


def reconstruct(
    snapshots: Sequence[Snapshot],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Post-hoc EMA of ``sigma_rel`` (or ``gamma``) at ``step`` from in-memory :class:`Snapshot` s.

    ``EMA ~ sum_{snapshot j, EMA k} x_jk * snapshots[j].emas[k]`` with ``x`` from
    :func:`solve_coefficients`. Works on any tree, e.g. this rank's shards (then gather, or gather
    the snapshots first: the result is the same). Memory: :func:`synthesize`'s (float64 accumulators for
    the whole tree, plus its largest leaf in ``dtype``, plus 4 MiB).

    Example:
        >>> ema = reconstruct(snaps, sigma_rel=0.15)   # doctest: +SKIP
    """
    snapshots = check_sequence(snapshots, "snapshots", nonempty=False)
    for i, snap in enumerate(snapshots):
        if not isinstance(snap, Snapshot):
            raise TypeError(
                f"snapshots[{i}] must be a posthoc.Snapshot (from posthoc.snapshot), got {type(snap).__name__} {snap!r:.60}"
            )
    step = check_optional_int(step, "step", minimum=1)
    dtype = check_ema_dtype(dtype)
    gammas: list[float] = []
    steps: list[int] = []
    trees: list[Any] = []
    for i, snap in enumerate(snapshots):
        at, gs, emas = _snapshot_fields(snap, i)
        for g, tree in zip(gs, emas):
            gammas.append(g)
            steps.append(at)
            trees.append(tree)
    x = solve_coefficients(
        gammas, steps, sigma_rel=sigma_rel, gamma=gamma, step=step, max_profile_error=max_profile_error
    )
    return synthesize(trees, x, dtype=dtype)
