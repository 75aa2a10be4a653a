"""Post-hoc EMA: choose the EMA length after training (Karras et al. 2024, "EDM2", section 3).

Train once while tracking a few power-function EMAs (e.g. ``sigma_rel`` 0.05 and 0.10), save
snapshots of them every so often, and afterwards synthesise the EMA of *any* ``sigma_rel`` (or
``gamma``) at any snapshot step as a linear combination of the snapshots.

The math, implemented here from the paper's formulas:

* **Profile.** A power EMA with exponent ``gamma`` read at time ``t`` averages the trajectory with
  the normalised weight density ::

      p_{gamma,t}(tau) = (gamma + 1) * tau**gamma / t**(gamma + 1)      for 0 < tau <= t (else 0)

  With the per-step decay ``beta(t) = (1 - 1/t)**(gamma + 1)`` of
  :func:`functional_ema.schedules.power`, the discrete EMA at step ``t`` weighs the weights of step
  ``u`` by exactly ``integral_{u-1}^{u} p_{gamma,t} = (u**(g+1) - (u-1)**(g+1)) / t**(g+1)``, and when
  updated every N steps (decays compounded, ``((u-N)/u)**(g+1)``) by the integral over ``(u-N, u]``.
  So the EMA is ``integral p_{gamma,t}(tau) x(tau) dtau`` for the piecewise-constant trajectory ``x``,
  and snapshot times are simply training steps.

* **Inner product** (closed form, in ratios so it stays finite for large ``t`` and ``gamma``)::

      <p_a, p_b> = integral_0^{min(t_a, t_b)} p_a p_b
                 = (g_a + 1)(g_b + 1) / ((g_a + g_b + 1) * t_max) * (t_min / t_max)**g_max

  where ``t_max = max(t_a, t_b)``, ``t_min = min(t_a, t_b)`` and ``g_max`` is the exponent of the
  profile that ends at ``t_max``.

* **Coefficients.** For a target profile ``p*`` and snapshot profiles ``p_i`` the least-squares
  fit ``min_x || sum_i x_i p_i - p* ||_2`` solves ``A x = b`` with ``A_ij = <p_i, p_j>`` and
  ``b_i = <p_i, p*>`` (float64, :func:`numpy.linalg.lstsq`, minimum-norm solution). Because the EMA
  is linear in the trajectory, ``sum_i x_i snapshot_i`` is the EMA of ``p*`` up to the profile
  error. The relative L2 error of the profile, ``||sum_i x_i p_i - p*|| / ||p*||``, is computed
  in closed form (``x^T A x - 2 x^T b + <p*, p*>``) and requests it cannot meet are refused.

* **Per rank.** Reconstruction is linear and elementwise, so reconstructing each rank's shards and
  then gathering equals gathering and then reconstructing; no process group is needed.

Example:
    >>> import numpy as np
    >>> from functional_ema import posthoc, schedules
    >>> g = [schedules.sigma_rel_to_gamma(s) for s in (0.05, 0.10)]
    >>> steps = [s for s in range(1000, 64001, 1000) for _ in g]     # 64 snapshots of each EMA
    >>> gammas = g * 64
    >>> x = posthoc.solve_coefficients(gammas, steps, sigma_rel=0.15, step=64000)
    >>> x.shape
    (128,)
    >>> float(posthoc.profile_error(gammas, steps, x, sigma_rel=0.15, step=64000)) < 1e-3
    True

In a training loop, in memory (small models, tests)::

    scheds = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]
    state = fe.init_ema(shards, num_emas=2)
    snaps = []
    for step in range(1, total + 1):
        ...
        state = fe.update(state, shards, step, decay=scheds)
        if step % 1000 == 0:
            snaps.append(posthoc.snapshot(state, scheds))
    ema_015 = posthoc.reconstruct(snaps, sigma_rel=0.15)

or on disk, one safetensors file per rank per snapshot (DeepSpeed, any ZeRO stage)::

    if step % 1000 == 0:
        posthoc.save_snapshot(state, engine, "snapshots", scheds)       # collective
    ...
    weights = posthoc.posthoc_offline("snapshots", sigma_rel=0.15)      # later, anywhere, no GPU
    pieces = posthoc.posthoc_local("snapshots", engine, sigma_rel=0.15) # this rank's pieces
    posthoc.plot_profile(gammas, steps, "profile.png", sigma_rel=0.15)  # how faithful it is

Command line: ``python -m functional_ema posthoc SNAPSHOT_DIR --sigma-rel 0.15 OUT.safetensors
[--step S] [--plot profile.png]`` (:func:`posthoc_to_file` from Python).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from . import _io, checkpoint
from ._checkpoint.errors import CheckpointNotFoundError
from ._checkpoint.format import FORMAT_VERSION, MANIFEST_NAME, check_output, short_list
from ._checkpoint.reader import open_checkpoint
from ._layout import ShardLayout
from ._state import EmaState
from ._tree import TreeMismatchError, check_same_tree, flatten_named
from .schedules import SIGMA_REL_MAX, Schedule, gamma_to_sigma_rel, power, sigma_rel_to_gamma

__all__ = [
    "DEFAULT_MAX_PROFILE_ERROR",
    "SIGMA_REL_MAX",
    "SNAPSHOT_PREFIX",
    "ProfileComparison",
    "ReconstructionError",
    "Snapshot",
    "SnapshotInfo",
    "expressible_range",
    "list_snapshots",
    "plot_profile",
    "posthoc_local",
    "posthoc_offline",
    "posthoc_to_file",
    "power_profile",
    "profile_error",
    "profile_inner",
    "reconstruct",
    "reconstruction_profile",
    "save_snapshot",
    "snapshot",
    "snapshot_gammas",
    "snapshot_tag",
    "solve_coefficients",
    "synthesize",
]

#: Default limit on the relative L2 error of the synthesised averaging profile. With 64 snapshots
#: of sigma_rel 0.05 and 0.10 it admits sigma_rel ~0.016 to ~0.254 (0.075: 2.3e-4, 0.15: 5.8e-4).
DEFAULT_MAX_PROFILE_ERROR = 0.02


class ReconstructionError(ValueError):
    """The snapshots cannot express the requested EMA (or the request is malformed)."""


# ------------------------------------------------------------------------------------------ profiles


def power_profile(gamma: float, step: float, tau: Any) -> np.ndarray:
    """The normalised averaging profile of a power EMA, evaluated at ``tau``.

    ``p(tau) = (gamma + 1) * tau**gamma / step**(gamma + 1)`` for ``0 < tau <= step``, 0 elsewhere;
    it integrates to 1 over ``(0, step]``. Computed as ``(gamma + 1) / step * (tau/step)**gamma``.

    Args:
        gamma: exponent, ``> -1``.
        step: the time the EMA is read at (a training step), ``> 0``.
        tau: array-like of times.

    Returns:
        float64 array shaped like ``tau``.

    Example:
        >>> float(power_profile(1.0, 2.0, 1.0))   # 2 * 1 / 2**2
        0.5
    """
    g, t = float(gamma), float(step)
    tau = np.asarray(tau, dtype=np.float64)
    inside = (tau > 0) & (tau <= t)
    ratio = np.where(inside, tau, t) / t
    return np.where(inside, (g + 1.0) / t * ratio**g, 0.0)


def profile_inner(gamma_a: Any, step_a: Any, gamma_b: Any, step_b: Any) -> np.ndarray:
    """Closed-form ``<p_a, p_b> = integral p_a(tau) p_b(tau) dtau`` of two power profiles (broadcasts).

    ``<p_a, p_b> = (g_a + 1)(g_b + 1) / ((g_a + g_b + 1) t_max) * (t_min / t_max)**g_max``, with
    ``t_max = max(t_a, t_b)``, ``t_min = min(t_a, t_b)`` and ``g_max`` the exponent of the profile
    ending at ``t_max``. It scales as ``1/t``: multiplying every time by ``c`` divides it by ``c``.

    Example:
        >>> float(profile_inner(0.0, 1.0, 0.0, 1.0))   # uniform on (0, 1]
        1.0
    """
    ga, ta, gb, tb = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (gamma_a, step_a, gamma_b, step_b)))
    a_first = ta <= tb
    t_max = np.where(a_first, tb, ta)
    t_min = np.where(a_first, ta, tb)
    g_max = np.where(a_first, gb, ga)
    return (ga + 1.0) * (gb + 1.0) / ((ga + gb + 1.0) * t_max) * (t_min / t_max) ** g_max


# ------------------------------------------------------------------------------- argument checking


def _target_gamma(sigma_rel: float | None, gamma: float | None) -> float:
    if (sigma_rel is None) == (gamma is None):
        raise ReconstructionError("give exactly one of sigma_rel= or gamma= for the EMA to reconstruct")
    if gamma is not None:
        g = float(gamma)
        if not (g > -0.5 and math.isfinite(g)):
            raise ReconstructionError(
                f"gamma must be a finite number > -1/2 (so that the profile tau**gamma is square-integrable), got {gamma!r}"
            )
        return g
    s = float(sigma_rel)
    if not 0.0 < s < SIGMA_REL_MAX:
        raise ReconstructionError(
            f"sigma_rel={sigma_rel!r} is outside (0, {SIGMA_REL_MAX:.4f}): sigma_rel 1/sqrt(12) ~ 0.2887 is "
            "gamma = 0, a uniform average over the whole run, and no power EMA is wider. Ask for a smaller sigma_rel."
        )
    return sigma_rel_to_gamma(s)


def _check_snapshots(snapshot_gammas: Any, snapshot_steps: Any) -> tuple[np.ndarray, np.ndarray]:
    g = np.asarray(snapshot_gammas, dtype=np.float64).reshape(-1)
    t = np.asarray(snapshot_steps, dtype=np.float64).reshape(-1)
    if g.shape != t.shape:
        raise ReconstructionError(
            f"snapshot_gammas has {g.size} entries but snapshot_steps has {t.size}; give one (gamma, step) per snapshot"
        )
    if g.size == 0:
        raise ReconstructionError("no snapshots given: post-hoc EMA needs snapshots at >= 2 different steps")
    if not np.all(np.isfinite(g)) or np.any(g <= -0.5):
        raise ReconstructionError(
            f"snapshot gammas must be finite and > -1/2 (square-integrable profiles), got {sorted(set(g.tolist()))[:8]}"
        )
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        bad = t[~(np.isfinite(t) & (t > 0))][:4].tolist()
        raise ReconstructionError(
            f"snapshot steps must be > 0 (a power EMA has no profile before its first update), got {bad}"
        )
    return g, t


def _resolve_step(t: np.ndarray, step: float | None) -> float:
    first, last = float(t.min()), float(t.max())
    if step is None:
        return last
    s = float(step)
    if s > last:
        raise ReconstructionError(
            f"step {step} is after the last snapshot (step {last:g}); the snapshots cover steps "
            f"{first:g}..{last:g}. The weights after the last snapshot were never recorded."
        )
    if s < first:
        raise ReconstructionError(
            f"step {step} is before the first snapshot (step {first:g}); the snapshots cover steps {first:g}..{last:g}"
        )
    return s


def _used(t: np.ndarray, step: float) -> np.ndarray:
    used = t <= step
    times = np.unique(t[used])
    if times.size < 2:
        raise ReconstructionError(
            f"too few snapshots: post-hoc EMA at step {step:g} needs snapshots at >= 2 different steps up to it, "
            f"got {times.size} ({times.tolist()}); snapshot more often or reconstruct at a later step"
        )
    return used


def _fit(g: np.ndarray, t: np.ndarray, targets: np.ndarray, step: float, rcond: float | None):
    """Least-squares coefficients for each target gamma; returns (coeffs[n, m], rel_errors[m])."""
    # Times in units of `step` keep A and b of order 1 (the solution does not depend on the unit).
    tn = t / step
    A = profile_inner(g[:, None], tn[:, None], g[None, :], tn[None, :])
    b = profile_inner(g[:, None], tn[:, None], targets[None, :], 1.0)
    x, *_ = np.linalg.lstsq(A, b, rcond=rcond)
    pp = profile_inner(targets, 1.0, targets, 1.0)
    err2 = np.einsum("im,ij,jm->m", x, A, x) - 2.0 * np.einsum("im,im->m", x, b) + pp
    return x, np.sqrt(np.maximum(err2, 0.0) / pp)


# ------------------------------------------------------------------------------------ coefficients


def solve_coefficients(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    rcond: float | None = None,
) -> np.ndarray:
    """Coefficients ``x`` with ``EMA(target) ~ sum_i x[i] * snapshot_i``.

    Solves ``A x = b`` in the least-squares sense (float64, ``numpy.linalg.lstsq``), with
    ``A_ij = <p_i, p_j>`` over the snapshots taken at or before ``step`` and
    ``b_i = <p_i, p_target>``; see :func:`profile_inner`. Snapshots after ``step`` get coefficient 0.

    Args:
        snapshot_gammas: exponent of each snapshot's EMA (``schedules.sigma_rel_to_gamma(0.05)``...).
        snapshot_steps: training step of each snapshot (same length). Two EMAs snapshotted at the
            same step are two entries with the same step.
        sigma_rel: target EMA width relative to the step, in ``(0, 1/sqrt(12))``; or
        gamma: target exponent (``> -1/2``, so that the profile is square-integrable). Exactly one of the two.
        step: when the target EMA is read; default the last snapshot step. Must lie within the
            snapshots' steps. Between two snapshot steps the weights since the previous snapshot
            are unknown and show up as profile error.
        max_profile_error: refuse targets whose synthesised profile has a relative L2 error
            (:func:`profile_error`) above this; ``None`` disables the check.
        rcond: cut-off for small singular values of ``A`` (``numpy.linalg.lstsq``; default machine
            precision times the number of snapshots).

    Returns:
        float64 array of ``len(snapshot_steps)`` coefficients.

    Raises:
        ReconstructionError: mismatched lengths, no or too few snapshots (< 2 different steps up
            to ``step``), ``step`` outside the snapshots, ``sigma_rel`` outside ``(0, 0.2887)``, or
            a target the snapshots cannot express within ``max_profile_error``.

    Example:
        >>> from functional_ema import schedules
        >>> g = schedules.sigma_rel_to_gamma(0.10)
        >>> x = solve_coefficients([g, g], [50, 100], gamma=g)   # the snapshot at step 100 itself
        >>> bool(np.allclose(x, [0.0, 1.0]))
        True
    """
    g, t = _check_snapshots(snapshot_gammas, snapshot_steps)
    target = _target_gamma(sigma_rel, gamma)
    s = _resolve_step(t, step)
    used = _used(t, s)
    x_used, err = _fit(g[used], t[used], np.array([target]), s, rcond)
    err = float(err[0])
    if max_profile_error is not None and not err <= max_profile_error:
        lo, hi = _range(g[used], t[used], s, max_profile_error, rcond)
        what = f"sigma_rel={sigma_rel!r}" if sigma_rel is not None else f"gamma={gamma!r} (sigma_rel {_sr(target)})"
        tracked = ", ".join(f"{_sr(v)}" for v in sorted(set(g[used].tolist()), reverse=True))
        can = (
            f"these snapshots express sigma_rel ~{lo:.3g} to ~{hi:.3g} at step {s:g}"
            if lo is not None
            else f"these snapshots express no sigma_rel within that error at step {s:g}"
        )
        raise ReconstructionError(
            f"{what} cannot be synthesised from the snapshots at step {s:g}: the averaging profile would be off by "
            f"{err:.2%} (relative L2) > max_profile_error={max_profile_error:g}. Tracked sigma_rels: {tracked}; "
            f"{can}. Ask for a sigma_rel in that range, track a wider/narrower EMA, or raise max_profile_error."
        )
    out = np.zeros(t.shape, dtype=np.float64)
    out[used] = x_used[:, 0]
    return out


def _sr(gamma: float) -> str:
    return f"{gamma_to_sigma_rel(gamma):.4g}"


def profile_error(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    coeffs: Sequence[float],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float,
) -> float:
    """Relative L2 error of the synthesised profile: ``||sum_i x_i p_i - p*|| / ||p*||``.

    Closed form: ``||r||^2 = x^T A x - 2 x^T b + <p*, p*>`` (see :func:`solve_coefficients`),
    clamped at 0 before the square root.
    """
    g, t = _check_snapshots(snapshot_gammas, snapshot_steps)
    x = np.asarray(coeffs, dtype=np.float64).reshape(-1)
    if x.shape != g.shape:
        raise ReconstructionError(f"got {x.size} coefficients for {g.size} snapshots")
    target = _target_gamma(sigma_rel, gamma)
    s = float(step)
    tn = t / s
    A = profile_inner(g[:, None], tn[:, None], g[None, :], tn[None, :])
    b = profile_inner(g, tn, target, 1.0)
    pp = float(profile_inner(target, 1.0, target, 1.0))
    return math.sqrt(max(float(x @ A @ x - 2.0 * x @ b + pp), 0.0) / pp)


def _range(g, t, step, max_err, rcond) -> tuple[float | None, float | None]:
    grid = np.geomspace(1e-3, SIGMA_REL_MAX * 0.999, 400)
    _, errs = _fit(g, t, np.array([sigma_rel_to_gamma(v) for v in grid]), step, rcond)
    ok = grid[errs <= max_err]
    return (float(ok.min()), float(ok.max())) if ok.size else (None, None)


def expressible_range(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    *,
    step: float | None = None,
    max_profile_error: float = DEFAULT_MAX_PROFILE_ERROR,
    rcond: float | None = None,
) -> tuple[float, float] | None:
    """Smallest and largest ``sigma_rel`` (on a log grid of 400 in ``[1e-3, 0.2887)``) whose profile
    error at ``step`` is within ``max_profile_error``; ``None`` when none is.

    Example:
        >>> from functional_ema import schedules
        >>> g = [schedules.sigma_rel_to_gamma(s) for s in (0.05, 0.10)]
        >>> lo, hi = expressible_range(g * 64, [s for s in range(64, 4097, 64) for _ in g])
        >>> round(lo, 3), round(hi, 3)
        (0.016, 0.254)
    """
    g, t = _check_snapshots(snapshot_gammas, snapshot_steps)
    s = _resolve_step(t, step)
    used = _used(t, s)
    lo, hi = _range(g[used], t[used], s, max_profile_error, rcond)
    return None if lo is None else (lo, hi)


# ----------------------------------------------------------------------------------------- profiles


class ProfileComparison(NamedTuple):
    """Synthesised vs requested averaging profile on a grid of training steps.

    Attributes:
        tau: float64 ``[num]`` grid of times in ``(0, step]``.
        synthesized: ``sum_i x_i p_i(tau)``, float64 ``[num]``.
        requested: ``p_target(tau)``, float64 ``[num]``.
        rel_error: closed-form relative L2 error of the whole profile (:func:`profile_error`).
        gamma: target exponent.
        sigma_rel: target ``sigma_rel``.
        step: the step the target is read at.
        coeffs: float64 coefficients, one per snapshot.
    """

    tau: np.ndarray
    synthesized: np.ndarray
    requested: np.ndarray
    rel_error: float
    gamma: float
    sigma_rel: float
    step: float
    coeffs: np.ndarray


def reconstruction_profile(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float | None = None,
    coeffs: Sequence[float] | None = None,
    num: int = 2000,
    max_profile_error: float | None = None,
) -> ProfileComparison:
    """The synthesised averaging profile against the requested one, on ``num`` points of ``(0, step]``.

    Args:
        snapshot_gammas, snapshot_steps, sigma_rel, gamma, step: as in :func:`solve_coefficients`.
        coeffs: coefficients to evaluate; default: solve for them (with ``max_profile_error``, no
            limit by default so that a poor fit can be looked at).
        num: grid points (``tau_k = step * (k + 1/2) / num``).
    """
    g, t = _check_snapshots(snapshot_gammas, snapshot_steps)
    target = _target_gamma(sigma_rel, gamma)
    s = _resolve_step(t, step)
    if coeffs is None:
        x = solve_coefficients(g, t, gamma=target, step=s, max_profile_error=max_profile_error)
    else:
        x = np.asarray(coeffs, dtype=np.float64).reshape(-1)
        if x.shape != g.shape:
            raise ReconstructionError(f"got {x.size} coefficients for {g.size} snapshots")
    tau = s * (np.arange(num, dtype=np.float64) + 0.5) / num
    synth = np.zeros_like(tau)
    for xi, gi, ti in zip(x, g, t):
        if xi != 0.0:
            synth += xi * power_profile(gi, ti, tau)
    req = power_profile(target, s, tau)
    err = profile_error(g, t, x, gamma=target, step=s)
    return ProfileComparison(tau, synth, req, err, target, gamma_to_sigma_rel(target), s, x)


def plot_profile(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    path: str,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float | None = None,
    coeffs: Sequence[float] | None = None,
    num: int = 2000,
    dpi: int = 120,
) -> ProfileComparison:
    """Save a PNG of the synthesised averaging profile against the requested one.

    Top panel: weight given to each training step by the requested EMA (dashed) and by the
    combination of snapshots (solid), with the snapshot steps marked; the title carries the
    relative L2 error. Bottom panel: their difference. Needs matplotlib (``pip install
    functional-ema[plot]``); it is imported here only.

    Args:
        path: where to write the PNG.
        others: as in :func:`reconstruction_profile` (no ``max_profile_error``: a poor fit is drawn,
            not refused).

    Returns:
        The :class:`ProfileComparison` drawn.

    Example:
        >>> plot_profile(gammas, steps, "profile.png", sigma_rel=0.15)   # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_profile needs matplotlib: pip install matplotlib (or functional-ema[plot])"
        ) from e
    prof = reconstruction_profile(
        snapshot_gammas, snapshot_steps, sigma_rel=sigma_rel, gamma=gamma, step=step, coeffs=coeffs, num=num
    )
    t = np.asarray(snapshot_steps, dtype=np.float64).reshape(-1)
    fig, (ax, ax_d) = plt.subplots(
        2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, constrained_layout=True
    )
    try:
        scale = prof.step  # density per unit of relative time: profiles of any length look alike
        ax.plot(prof.tau, prof.requested * scale, "k--", lw=2, label=f"requested: sigma_rel={prof.sigma_rel:.4g} (gamma={prof.gamma:.4g})")
        ax.plot(prof.tau, prof.synthesized * scale, color="tab:orange", lw=1.3, label=f"synthesised from {int(np.count_nonzero(prof.coeffs))} snapshots")
        used = np.unique(t[prof.coeffs != 0])
        ax.plot(used, np.zeros_like(used), "|", color="tab:blue", ms=8, label="snapshot steps")
        ax.set_ylabel("weight density \u00d7 step")
        ax.legend(loc="upper left", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_title(
            f"Post-hoc EMA at step {prof.step:g}: sigma_rel {prof.sigma_rel:.4g}, relative L2 error {prof.rel_error:.2e}",
            fontsize=11,
        )
        ax_d.plot(prof.tau, (prof.synthesized - prof.requested) * scale, color="tab:red", lw=1)
        ax_d.axhline(0.0, color="k", lw=0.5)
        ax_d.set_ylabel("difference")
        ax_d.set_xlabel("training step")
        ax_d.grid(alpha=0.3)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return prof


# ---------------------------------------------------------------------------------------- synthesis


def synthesize(
    snapshots: Sequence[Any],
    coeffs: Sequence[float],
    *,
    dtype: torch.dtype = torch.float32,
    accumulate_dtype: torch.dtype = torch.float64,
) -> Any:
    """``sum_i coeffs[i] * snapshots[i]``, leaf by leaf, over trees of tensors of the same structure.

    Snapshots with a zero coefficient are not read. The sum is accumulated in ``accumulate_dtype``
    (float64 by default: the coefficients alternate in sign, and fp32 snapshots are exact in it)
    and returned in ``dtype``.

    Args:
        snapshots: name-keyed trees (e.g. ``dict[str, Tensor]``), all with the same names and shapes.
        coeffs: one float per snapshot, e.g. from :func:`solve_coefficients`.

    Returns:
        A tree like ``snapshots[0]`` with ``dtype`` tensors on the snapshots' device.

    Example:
        >>> synthesize([{"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)}], [0.5, 0.5])
        {'w': tensor([2., 2.])}
    """
    x = [float(c) for c in np.asarray(coeffs, dtype=np.float64).reshape(-1)]
    if len(x) != len(snapshots):
        raise ReconstructionError(f"got {len(x)} coefficients for {len(snapshots)} snapshots")
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
                a.add_(_scaled(leaf, c, a))
    return optree.tree_unflatten(spec0, [a.to(dtype) for a in acc])


def _scaled(t: torch.Tensor, c: float, like: torch.Tensor) -> torch.Tensor:
    # Multiply, then add (two roundings, never a fused multiply-add): every element gets the same
    # arithmetic wherever it sits in a tensor, so per-rank pieces reconstruct bitwise like full ones.
    return t.to(device=like.device, dtype=like.dtype, copy=True).mul_(c)


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
    for s in schedules:
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            out.append(sigma_rel_to_gamma(float(s)))
        elif isinstance(getattr(s, "gamma", None), (int, float)):
            out.append(float(s.gamma))
        else:
            raise TypeError(
                f"post-hoc EMA needs power EMAs (schedules.power(sigma_rel=...)) or sigma_rel floats, got {s!r}"
            )
    return tuple(out)


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
    gammas = snapshot_gammas(schedules)
    if len(gammas) != state.num_emas:
        raise ValueError(f"got {len(gammas)} schedules for a state tracking {state.num_emas} EMAs")
    step = int(state.step)
    if step < 1:
        raise ValueError("the state has not been updated yet (step 0): a power EMA has no profile before step 1")
    with torch.no_grad():
        emas = tuple(
            optree.tree_map(
                lambda e: e.detach().to(device=e.device if device is None else device, dtype=dtype, copy=True),
                ema,
                none_is_leaf=False,
            )
            for ema in state.emas
        )
    return Snapshot(step, gammas, emas)


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
    the snapshots first: the result is the same).

    Example:
        >>> ema = reconstruct(snaps, sigma_rel=0.15)   # doctest: +SKIP
    """
    gammas, steps, trees = [], [], []
    for snap in snapshots:
        if len(snap.gammas) != len(snap.emas):
            raise ReconstructionError(f"snapshot at step {snap.step} has {len(snap.gammas)} gammas for {len(snap.emas)} EMAs")
        for g, tree in zip(snap.gammas, snap.emas):
            gammas.append(g)
            steps.append(snap.step)
            trees.append(tree)
    x = solve_coefficients(gammas, steps, sigma_rel=sigma_rel, gamma=gamma, step=step, max_profile_error=max_profile_error)
    return synthesize(trees, x, dtype=dtype)


# ----------------------------------------------------------------------------------- snapshot files

#: Tag prefix of snapshot folders written by :func:`save_snapshot`.
SNAPSHOT_PREFIX = "snapshot_"


def snapshot_tag(step: int) -> str:
    """``f"snapshot_{step:09d}"``: sorts by step as text up to a billion steps."""
    return f"{SNAPSHOT_PREFIX}{int(step):09d}"


def save_snapshot(
    state: EmaState,
    engine: Any,
    snapshot_dir: str | os.PathLike,
    schedules: Sequence[Schedule | float],
    *,
    tag: str | None = None,
) -> Path:
    """Write this rank's pieces of every tracked power EMA as a snapshot checkpoint. Collective.

    Call it on every rank every N steps (e.g. ``if step % 1000 == 0``). It is
    :func:`functional_ema.save` into ``snapshot_dir/snapshot_<step:09d>/``, with the power schedules
    recorded (so the files carry each EMA's ``gamma`` and the step, all that reconstruction needs).
    Each snapshot is one safetensors file per rank in the EMA dtype (keep fp32; 16-bit snapshots
    cost accuracy, see :func:`snapshot`) plus a manifest written last, so an interrupted save leaves
    an incomplete tag that the readers skip. Use a directory of its own or
    DeepSpeed's checkpoint directory: the tags never collide with ``global_step<N>``.

    Args:
        state: this rank's state tracking ``K`` power EMAs over ``local_shards(engine)``.
        engine: the DeepSpeed engine.
        snapshot_dir: directory shared by all ranks.
        schedules: the ``K`` schedules passed to :func:`functional_ema.update` (``schedules.power``)
            or their ``sigma_rel`` floats, in the state's order.
        tag: folder name; default :func:`snapshot_tag` of ``state.step``.

    Returns:
        The snapshot folder.

    Example:
        >>> scheds = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]       # doctest: +SKIP
        >>> state = fe.update(state, fe.local_shards(engine), step, decay=scheds)  # doctest: +SKIP
        >>> if step % 1000 == 0:                                                 # doctest: +SKIP
        ...     posthoc.save_snapshot(state, engine, "snapshots", scheds)
    """
    gammas = snapshot_gammas(schedules)
    if len(gammas) != state.num_emas:
        raise ValueError(f"got {len(gammas)} schedules for a state tracking {state.num_emas} EMAs")
    step = int(state.step)
    if step < 1:
        raise ValueError("the state has not been updated yet (step 0): a power EMA has no profile before step 1")
    return checkpoint.save(
        state, engine, snapshot_dir, snapshot_tag(step) if tag is None else tag, decay=[power(gamma=g) for g in gammas]
    )


class SnapshotInfo(NamedTuple):
    """One complete snapshot checkpoint on disk.

    Attributes:
        tag: its folder name.
        step: training step of the EMAs in it.
        gammas: exponent of each EMA in it (``emas.<k>.*`` tensors).
        shapes: parameter name -> full shape.
    """

    tag: str
    step: int
    gammas: tuple[float, ...]
    shapes: dict[str, tuple[int, ...]]


def list_snapshots(snapshot_dir: str | os.PathLike, *, prefix: str = SNAPSHOT_PREFIX) -> list[SnapshotInfo]:
    """Complete snapshot checkpoints in ``snapshot_dir`` (tags starting with ``prefix``), by step.

    Each is validated (manifest, every rank file's header and checksum, coverage of every
    parameter) without reading tensor data. Tags without a manifest (an interrupted save) are
    skipped with a warning.

    Raises:
        ReconstructionError: no complete snapshot, an EMA that is not a power EMA, or snapshots of
            different models.
        functional_ema.CheckpointError: a damaged snapshot.
    """
    root = Path(snapshot_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"snapshot directory {root} does not exist")
    tags = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name.startswith(prefix))
    incomplete = [t for t in tags if not (root / t / MANIFEST_NAME).is_file()]
    if incomplete:
        warnings.warn(
            f"skipping {len(incomplete)} incomplete snapshot tag(s) without a manifest (interrupted saves?): "
            f"{incomplete[:4]}{' ...' if len(incomplete) > 4 else ''}",
            stacklevel=2,
        )
    out: list[SnapshotInfo] = []
    for tag in tags:
        if tag in incomplete:
            continue
        m = checkpoint.read_manifest(root, tag)
        scheds = m.get("schedules") or []
        if len(scheds) != int(m["num_emas"]):
            raise ReconstructionError(
                f"snapshot {tag!r} in {root} does not record its EMAs' schedules (was it written by functional_ema.save "
                "without decay=?). Post-hoc EMA needs power EMAs: write snapshots with posthoc.save_snapshot"
            )
        gammas = []
        for k, d in enumerate(scheds):
            if not isinstance(d, dict) or d.get("kind") != "power" or not isinstance(d.get("gamma"), (int, float)):
                raise ReconstructionError(
                    f"snapshot {tag!r}: EMA {k} has schedule {d!r}, not a power EMA; post-hoc EMA synthesises only from "
                    "power EMAs (schedules.power(sigma_rel=...))"
                )
            gammas.append(float(d["gamma"]))
        shapes = {n: tuple(int(x) for x in s) for n, s in m["params"].items()}
        out.append(SnapshotInfo(tag, int(m["step"]), tuple(gammas), shapes))
    if not out:
        raise ReconstructionError(
            f"no complete snapshot (tags {prefix}*) in {root}; write them with posthoc.save_snapshot during training"
        )
    out.sort(key=lambda s: (s.step, s.tag))
    first = out[0]
    for s in out[1:]:
        if s.shapes != first.shapes:
            diff = sorted(set(s.shapes).symmetric_difference(first.shapes)) or sorted(
                n for n in s.shapes if s.shapes[n] != first.shapes.get(n)
            )
            raise ReconstructionError(
                f"snapshots {first.tag!r} and {s.tag!r} hold different parameters ({short_list(diff)}): "
                "they come from different models; keep one run's snapshots per directory"
            )
    return out



class _FilePlan(NamedTuple):
    root: Path
    terms: list[tuple[str, int, float]]  # (tag, EMA index, coefficient), nonzero only, by step
    shapes: dict[str, tuple[int, ...]]
    step: int
    gamma: float
    profile_error: float
    num_snapshots: int


def _plan_files(snapshot_dir, sigma_rel, gamma, step, max_profile_error, prefix) -> _FilePlan:
    infos = list_snapshots(snapshot_dir, prefix=prefix)
    gammas, steps, refs = [], [], []
    for info in infos:
        for k, g in enumerate(info.gammas):
            gammas.append(g)
            steps.append(info.step)
            refs.append((info.tag, k))
    x = solve_coefficients(
        gammas, steps, sigma_rel=sigma_rel, gamma=gamma, step=step, max_profile_error=max_profile_error
    )
    target = _target_gamma(sigma_rel, gamma)
    s = int(_resolve_step(np.asarray(steps, dtype=np.float64), step))
    err = profile_error(gammas, steps, x, gamma=target, step=s)
    terms = [(tag, k, float(c)) for (tag, k), c in zip(refs, x) if c != 0.0]
    return _FilePlan(Path(snapshot_dir), terms, infos[0].shapes, s, target, err, len(infos))


def _stream(
    plan: _FilePlan,
    ranges: dict[str, tuple[int, int, tuple[int, ...]]],
    *,
    verify: bool,
    dtype: torch.dtype,
    buffer_bytes: int,
    layout=None,
):
    """Yield ``(name, tensor)`` for each name of ``ranges`` (``name -> (start, numel, out shape)``
    of the flattened parameter): ``sum_terms c * piece`` accumulated in float64.

    Parameters are taken in groups whose float64 accumulators fit ``buffer_bytes`` (at least one
    parameter a group); each snapshot checkpoint is opened once per group. With ``layout`` (this
    rank's), a snapshot saved with that layout is read from this rank's file alone.
    """
    names = list(ranges)
    groups: list[list[str]] = []
    size = 0
    for n in names:
        nbytes = 8 * ranges[n][1]
        if not groups or size + nbytes > buffer_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for tag, k, c in plan.terms:
        by_tag.setdefault(tag, []).append((k, c))
    for group in groups:
        acc = {n: torch.zeros(ranges[n][1], dtype=torch.float64) for n in group}
        for tag, ks in by_tag.items():
            with open_checkpoint(plan.root, tag, verify, layout) as ckpt:
                for k, c in ks:
                    for n in group:
                        start, numel, _ = ranges[n]
                        piece = torch.empty(numel, dtype=ckpt.dtype)
                        ckpt.fill(piece, k, n, start, numel, verify)
                        acc[n].add_(_scaled(piece, c, acc[n]))
        for n in group:
            yield n, acc.pop(n).to(dtype).view(ranges[n][2])


def posthoc_offline(
    snapshot_dir: str | os.PathLike,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    prefix: str = SNAPSHOT_PREFIX,
    buffer_bytes: int = 1 << 30,
) -> dict[str, torch.Tensor]:
    """Full post-hoc EMA weights from the per-rank snapshot files: no process group, no GPU.

    ``EMA(sigma_rel, step) ~ sum_{snapshot j, EMA k} x_jk * full_jk`` with ``x`` from
    :func:`solve_coefficients` over every complete snapshot in ``snapshot_dir``; each full
    parameter is assembled from the ranks' pieces (any world size and ZeRO stage) and accumulated
    in float64, parameter by parameter (groups of at most ``buffer_bytes`` of accumulators), reading
    only the snapshots with a nonzero coefficient.

    Args:
        snapshot_dir: the directory :func:`save_snapshot` wrote into.
        sigma_rel, gamma, step, max_profile_error: as in :func:`solve_coefficients` (``step``
            defaults to the last snapshot).
        dtype: result dtype.
        verify: check the CRC-32s of every byte read.
        prefix: tag prefix of the snapshot folders.
        buffer_bytes: memory for float64 accumulators; smaller streams in more passes.

    Returns:
        ``{parameter name: tensor of its full shape}``; equal (bitwise) to reconstructing each
        rank's pieces (:func:`reconstruct`, :func:`posthoc_local`) and then gathering them.

    Example:
        >>> weights = posthoc.posthoc_offline("snapshots", sigma_rel=0.15)   # doctest: +SKIP
        >>> model.load_state_dict(weights, strict=False)                     # doctest: +SKIP
    """
    plan = _plan_files(snapshot_dir, sigma_rel, gamma, step, max_profile_error, prefix)
    ranges = {n: (0, math.prod(s), s) for n, s in plan.shapes.items()}
    return dict(_stream(plan, ranges, verify=verify, dtype=dtype, buffer_bytes=buffer_bytes))


def posthoc_local(
    snapshot_dir: str | os.PathLike,
    layout: Any,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    prefix: str = SNAPSHOT_PREFIX,
    buffer_bytes: int = 1 << 30,
) -> dict[str, torch.Tensor]:
    """This rank's pieces of the post-hoc EMA, from the snapshot files; never communicates.

    Args:
        snapshot_dir: the directory :func:`save_snapshot` wrote into.
        layout: a :class:`functional_ema.ShardLayout` (e.g. ``fe.shard_layout(engine)``), or a
            DeepSpeed engine. Any world size and ZeRO stage: each piece is read from the saved
            pieces that overlap it.
        others: as in :func:`posthoc_offline`.

    Returns:
        ``{name: 1-D tensor}`` shaped like ``local_shards(engine)``; e.g. wrap it as
        ``EmaState(torch.tensor(step), (pieces,))`` for :func:`functional_ema.gather_full` or
        :func:`functional_ema.swapped`.
    """
    if not isinstance(layout, ShardLayout):
        from ._api import shard_layout

        layout = shard_layout(layout)
    plan = _plan_files(snapshot_dir, sigma_rel, gamma, step, max_profile_error, prefix)
    missing = [n for n in layout.specs if n not in plan.shapes]
    bad = [n for n, s in layout.specs.items() if n in plan.shapes and tuple(s.shape) != plan.shapes[n]]
    if missing or bad:
        raise TreeMismatchError(
            f"the snapshots in {plan.root} do not fit this layout: not in the snapshots {short_list(missing)}; "
            f"other shapes {short_list(bad)}"
        )
    ranges = {n: (s.offset, s.numel, (s.numel,)) for n, s in layout.specs.items()}
    return dict(_stream(plan, ranges, verify=verify, dtype=dtype, buffer_bytes=buffer_bytes, layout=layout))


def posthoc_to_file(
    snapshot_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    prefix: str = SNAPSHOT_PREFIX,
    buffer_bytes: int = 1 << 30,
    overwrite: bool = True,
) -> Path:
    """Stream the post-hoc EMA (as :func:`posthoc_offline`) into one safetensors file, atomically.

    The file's names are the module's parameter names; its metadata records ``sigma_rel``,
    ``gamma``, ``step``, the profile error and the number of snapshots. Memory: the accumulators of
    one group (``buffer_bytes``) plus one parameter.

    ``out_path`` inside the snapshot directory's folders is refused (``checkpoint.OutputPathError``),
    and so is an existing file unless ``overwrite``.

    Command line: ``python -m functional_ema posthoc SNAPSHOT_DIR --sigma-rel 0.15 OUT.safetensors``.
    """
    plan = _plan_files(snapshot_dir, sigma_rel, gamma, step, max_profile_error, prefix)
    check_output(out_path, plan.root, [plan.root / tag for tag, _, _ in plan.terms], overwrite)
    meta = {
        "format": "functional_ema.posthoc",
        "format_version": str(FORMAT_VERSION),
        "sigma_rel": repr(gamma_to_sigma_rel(plan.gamma)),
        "gamma": repr(plan.gamma),
        "step": str(plan.step),
        "profile_error": repr(plan.profile_error),
        "num_snapshots": str(plan.num_snapshots),
    }
    ranges = {n: (0, math.prod(s), s) for n, s in plan.shapes.items()}
    entries = [(n, dtype, s) for n, s in plan.shapes.items()]
    out_path = Path(out_path)
    with _io.StreamingWriter(out_path, entries, meta) as w:
        for name, t in _stream(plan, ranges, verify=verify, dtype=dtype, buffer_bytes=buffer_bytes):
            w.write(name, t)
        w.commit()
    return out_path
