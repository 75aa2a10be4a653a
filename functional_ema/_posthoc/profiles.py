"""Averaging profiles of power EMAs and the least-squares fit of one from others (float64 numpy)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._args import check_int, check_optional_real, check_real, check_reals, real_number
from ..schedules import GAMMA_MAX, SIGMA_REL_MAX, SIGMA_REL_MIN, gamma_to_sigma_rel, sigma_rel_to_gamma

# Post-hoc EMA takes the bounds schedules.power takes (GAMMA_MAX 1e12, SIGMA_REL_MIN 1e-12): a request is refused
# with the range where the float64 inner products, (g_a + 1)(g_b + 1), and the cubic stay finite.

#: Default limit on the relative L2 error of the synthesised averaging profile. With 64 snapshots
#: of sigma_rel 0.05 and 0.10 it admits sigma_rel ~0.016 to ~0.254 (0.075: 2.3e-4, 0.15: 5.8e-4).
DEFAULT_MAX_PROFILE_ERROR = 0.02

#: Largest time a profile is read at: training steps are int64 counters.
MAX_STEP = float(2**63 - 1)


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
    g = check_real(gamma, "gamma", low=-1.0, low_open=True)
    t = check_real(step, "step", low=0.0, high=MAX_STEP, low_open=True)
    tau = check_reals(tau, "tau", scalar=True)
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
    ga, ta, gb, tb = np.broadcast_arrays(
        check_reals(gamma_a, "gamma_a", low=-0.5, low_open=True, scalar=True),
        check_reals(step_a, "step_a", low=0.0, high=MAX_STEP, low_open=True, scalar=True),
        check_reals(gamma_b, "gamma_b", low=-0.5, low_open=True, scalar=True),
        check_reals(step_b, "step_b", low=0.0, high=MAX_STEP, low_open=True, scalar=True),
    )
    a_first = ta <= tb
    t_max = np.where(a_first, tb, ta)
    t_min = np.where(a_first, ta, tb)
    g_max = np.where(a_first, gb, ga)
    return (ga + 1.0) * (gb + 1.0) / ((ga + gb + 1.0) * t_max) * (t_min / t_max) ** g_max


# ------------------------------------------------------------------------------- argument checking


def target_gamma(sigma_rel: float | None, gamma: float | None) -> float:
    """The exponent of the requested EMA: ``gamma`` in ``(-1/2, GAMMA_MAX]``, or ``sigma_rel`` in
    ``[SIGMA_REL_MIN, 1/sqrt(12))`` converted; NaN, infinities and numbers outside are refused naming the argument."""
    if (sigma_rel is None) == (gamma is None):
        raise ReconstructionError("give exactly one of sigma_rel= or gamma= for the EMA to reconstruct")
    if gamma is not None:
        g = _number(gamma, "gamma")
        if not -0.5 < g <= GAMMA_MAX:
            raise ReconstructionError(
                f"gamma must be a finite number in (-0.5, {GAMMA_MAX:g}], got {gamma!r}: above -1/2 so that the profile "
                f"tau**gamma is square-integrable, at most {GAMMA_MAX:g} (sigma_rel {SIGMA_REL_MIN:g}, as "
                "schedules.power takes it)"
            )
        return g
    s = _number(sigma_rel, "sigma_rel")
    if not SIGMA_REL_MIN <= s < SIGMA_REL_MAX:
        raise ReconstructionError(
            f"sigma_rel={sigma_rel!r} is outside [{SIGMA_REL_MIN:g}, {SIGMA_REL_MAX:.4f}): sigma_rel 1/sqrt(12) ~ 0.2887 is "
            f"gamma = 0, a uniform average over the whole run, and no power EMA is wider; {SIGMA_REL_MIN:g} is the "
            "narrowest schedules.power takes. Ask for a sigma_rel in that range."
        )
    return sigma_rel_to_gamma(s)


def _number(value: Any, what: str) -> float:
    """``value`` as a float, NaN and infinities included (the caller refuses them with its range: ``check_real``
    would say "a number in [-inf, inf]"); ``TypeError`` naming ``what`` for anything that is not one number."""
    try:
        real = None if isinstance(value, bool) else real_number(value)
    except OverflowError:  # an int past float's range: out of every range below
        real = math.inf
    if real is None:
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r:.60}")
    return real


def _check_snapshots(snapshot_gammas: Any, snapshot_steps: Any) -> tuple[np.ndarray, np.ndarray]:
    g = check_reals(snapshot_gammas, "snapshot_gammas").reshape(-1)
    t = check_reals(snapshot_steps, "snapshot_steps", high=MAX_STEP).reshape(-1)
    if g.shape != t.shape:
        raise ReconstructionError(
            f"snapshot_gammas has {g.size} entries but snapshot_steps has {t.size}; give one (gamma, step) per snapshot"
        )
    if g.size == 0:
        raise ReconstructionError("no snapshots given: post-hoc EMA needs snapshots at >= 2 different steps")
    bad_g = g[(g <= -0.5) | (g > GAMMA_MAX)]
    if bad_g.size:  # a huge gamma would overflow the inner products (LAPACK then prints and raises)
        raise ReconstructionError(
            f"snapshot_gammas must be finite and in (-0.5, {GAMMA_MAX:g}] (square-integrable profiles, at most "
            f"sigma_rel {SIGMA_REL_MIN:g}), got {sorted(set(bad_g.tolist()))[:8]}"
        )
    if np.any(t <= 0):
        bad = t[~(t > 0)][:4].tolist()
        raise ReconstructionError(
            f"snapshot_steps must be > 0 (a power EMA has no profile before its first update), got {bad}"
        )
    return g, t


def resolve_step(t: np.ndarray, step: float | None) -> float:
    first, last = float(t.min()), float(t.max())
    if step is None:
        return last
    s = check_real(step, "step")
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


def _fit(
    g: np.ndarray, t: np.ndarray, targets: np.ndarray, step: float, rcond: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares coefficients for each target gamma; returns (coeffs[n, m], rel_errors[m])."""
    # Times in units of `step` keep A and b of order 1 (the solution does not depend on the unit).
    tn = t / step
    A = profile_inner(g[:, None], tn[:, None], g[None, :], tn[None, :])
    b = profile_inner(g[:, None], tn[:, None], targets[None, :], 1.0)
    x, *_ = np.linalg.lstsq(A, b, rcond=rcond)
    pp = profile_inner(targets, 1.0, targets, 1.0)
    err2 = np.einsum("im,ij,jm->m", x, A, x) - 2.0 * np.einsum("im,im->m", x, b) + pp
    errs = np.sqrt(np.maximum(err2, 0.0) / pp)
    if not np.all(np.isfinite(x)) or not np.all(np.isfinite(errs)):  # a NaN error would pass any error bound
        raise ReconstructionError(
            f"the least-squares fit at step {step:g} is not finite (snapshot gammas {_shown(g)}, target gammas "
            f"{_shown(targets)}): the profiles are too far apart in width for float64; ask for a gamma nearer the tracked ones"
        )
    return x, errs


def _shown(values: np.ndarray) -> str:
    return str(sorted(set(values.tolist()))[:6])


# ------------------------------------------------------------------------------------ coefficients


def solve_coefficients(
    snapshot_gammas: Sequence[float] | np.ndarray,
    snapshot_steps: Sequence[float] | np.ndarray,
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
        sigma_rel: target EMA width relative to the step, in ``[1e-12, 1/sqrt(12))``; or
        gamma: target exponent in ``(-1/2, 1e12]`` (above -1/2 so that the profile is square-integrable;
            at most ``schedules.GAMMA_MAX``, as ``schedules.power``). Exactly one of the two.
        step: when the target EMA is read; default the last snapshot step. Must lie within the
            snapshots' steps. Between two snapshot steps the weights since the previous snapshot
            are unknown and show up as profile error.
        max_profile_error: refuse targets whose synthesised profile has a relative L2 error
            (:func:`profile_error`) above this (a number ``>= 0``); ``None`` disables the check.
        rcond: cut-off for small singular values of ``A``, relative to the largest, in ``[0, 1]``
            (``numpy.linalg.lstsq``; default machine precision times the number of snapshots).

    Returns:
        float64 array of ``len(snapshot_steps)`` coefficients.

    Raises:
        TypeError: an argument that is not a number (a bool, a string, ``None`` where one is needed) or
            a sequence of snapshot gammas/steps that is not a list, tuple, array or tensor of numbers.
        ValueError: a NaN or infinite number, or one out of its range (``rcond`` outside ``[0, 1]``,
            ``max_profile_error < 0``, a step past int64); the message names the argument.
        ReconstructionError: mismatched lengths, no or too few snapshots (< 2 different steps up
            to ``step``), ``step`` outside the snapshots, ``sigma_rel`` outside ``[1e-12, 0.2887)`` or ``gamma``
            outside ``(-0.5, 1e12]`` (NaN included; snapshot gammas too), a fit that is not finite, or a target the
            snapshots cannot express within ``max_profile_error`` (the message names each separate range they can).

    Example:
        >>> from functional_ema import schedules
        >>> g = schedules.sigma_rel_to_gamma(0.10)
        >>> x = solve_coefficients([g, g], [50, 100], gamma=g)   # the snapshot at step 100 itself
        >>> bool(np.allclose(x, [0.0, 1.0]))
        True
    """
    g, t = _check_snapshots(snapshot_gammas, snapshot_steps)
    target = target_gamma(sigma_rel, gamma)
    s = resolve_step(t, step)
    max_profile_error = check_optional_real(max_profile_error, "max_profile_error", low=0.0)
    rcond = check_optional_real(rcond, "rcond", low=0.0, high=1.0)
    used = _used(t, s)
    x_used, errs = _fit(g[used], t[used], np.array([target]), s, rcond)
    err = float(errs[0])
    if max_profile_error is not None and not err <= max_profile_error:
        spans = _range(g[used], t[used], s, max_profile_error, rcond, gamma_to_sigma_rel(target))
        what = f"sigma_rel={sigma_rel!r}" if sigma_rel is not None else f"gamma={gamma!r} (sigma_rel {_sr(target)})"
        tracked = ", ".join(f"{_sr(v)}" for v in sorted(set(g[used].tolist()), reverse=True))
        # Few snapshots express separate ranges around the tracked widths, with gaps between them: name each.
        can = (
            f"these snapshots express sigma_rel {' and '.join(f'~{lo:.3g} to ~{hi:.3g}' for lo, hi in spans)} at step {s:g}"
            if spans
            else f"these snapshots express no sigma_rel within that error at step {s:g}"
        )
        raise ReconstructionError(
            f"{what} cannot be synthesised from the snapshots at step {s:g}: the averaging profile would be off by "
            f"{err:.2%} (relative L2) > max_profile_error={max_profile_error:g}. Tracked sigma_rels: {tracked}; "
            f"{can}. Ask for a sigma_rel in {'that range' if len(spans) < 2 else 'one of those ranges'}, track a "
            "wider/narrower EMA, or raise max_profile_error."
        )
    out = np.zeros(t.shape, dtype=np.float64)
    out[used] = x_used[:, 0]
    return out


def _sr(gamma: float) -> str:
    return f"{gamma_to_sigma_rel(gamma):.4g}"


def profile_error(
    snapshot_gammas: Sequence[float] | np.ndarray,
    snapshot_steps: Sequence[float] | np.ndarray,
    coeffs: Sequence[float] | np.ndarray,
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
    x = _check_coeffs(coeffs, g.size)
    target = target_gamma(sigma_rel, gamma)
    s = check_real(step, "step", low=0.0, high=MAX_STEP, low_open=True)
    tn = t / s
    A = profile_inner(g[:, None], tn[:, None], g[None, :], tn[None, :])
    b = profile_inner(g, tn, target, 1.0)
    pp = float(profile_inner(target, 1.0, target, 1.0))
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, not warned about
        err2 = float(x @ A @ x - 2.0 * x @ b + pp)
    if math.isnan(err2) or math.isinf(err2):  # NaN would pass as "no error" where it is compared
        raise ReconstructionError(
            f"profile_error: the error of coeffs (largest |coeff| {float(np.abs(x).max()):g}) is not finite in float64"
        )
    return math.sqrt(max(err2, 0.0) / pp)


def _check_coeffs(coeffs: Any, num_snapshots: int) -> np.ndarray:
    """``coeffs`` as a float64 vector of one finite number per snapshot."""
    x = check_reals(coeffs, "coeffs").reshape(-1)
    if x.size != num_snapshots:
        raise ReconstructionError(f"coeffs: got {x.size} coefficients for {num_snapshots} snapshots")
    return x


def _range(
    g: np.ndarray, t: np.ndarray, step: float, max_err: float, rcond: float | None, refused: float | None = None
) -> list[tuple[float, float]]:
    """The separate ranges ``[(lo, hi), ...]`` of ``sigma_rel`` (on a log grid of 400 in ``[1e-3, 0.2887)``) whose
    profile error is within ``max_err``, in increasing order. ``refused`` (a refused ``sigma_rel``) joins the
    grid: it then splits whatever range the grid alone would have drawn across it."""
    grid = np.geomspace(1e-3, SIGMA_REL_MAX * 0.999, 400)
    if refused is not None and grid[0] < refused < grid[-1]:
        grid = np.unique(np.append(grid, refused))
    _, errs = _fit(g, t, np.array([sigma_rel_to_gamma(v) for v in grid]), step, rcond)
    ok = errs <= max_err
    spans: list[tuple[float, float]] = []
    for i in np.flatnonzero(ok):
        if i > 0 and ok[i - 1]:
            spans[-1] = (spans[-1][0], float(grid[i]))
        else:
            spans.append((float(grid[i]), float(grid[i])))
    return spans


def expressible_range(
    snapshot_gammas: Sequence[float] | np.ndarray,
    snapshot_steps: Sequence[float] | np.ndarray,
    *,
    step: float | None = None,
    max_profile_error: float = DEFAULT_MAX_PROFILE_ERROR,
    rcond: float | None = None,
) -> tuple[float, float] | None:
    """Smallest and largest ``sigma_rel`` (on a log grid of 400 in ``[1e-3, 0.2887)``) whose profile
    error at ``step`` is within ``max_profile_error``; ``None`` when none is.

    The bounds, not a promise about what lies between them: with few snapshots (fewer than ~8 of each
    tracked EMA) only widths near the tracked ones are expressible, with a gap between (2 snapshots of
    sigma_rel 0.05 and 0.10: ~0.046-0.055 and ~0.093-0.107). A refusal of :func:`solve_coefficients`
    names each separate range.

    Example:
        >>> from functional_ema import schedules
        >>> g = [schedules.sigma_rel_to_gamma(s) for s in (0.05, 0.10)]
        >>> lo, hi = expressible_range(g * 64, [s for s in range(64, 4097, 64) for _ in g])
        >>> round(lo, 3), round(hi, 3)
        (0.016, 0.254)
    """
    g, t = _check_snapshots(snapshot_gammas, snapshot_steps)
    s = resolve_step(t, step)
    max_profile_error = check_real(max_profile_error, "max_profile_error", low=0.0)
    rcond = check_optional_real(rcond, "rcond", low=0.0, high=1.0)
    used = _used(t, s)
    spans = _range(g[used], t[used], s, max_profile_error, rcond)
    return (spans[0][0], spans[-1][1]) if spans else None


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
    snapshot_gammas: Sequence[float] | np.ndarray,
    snapshot_steps: Sequence[float] | np.ndarray,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float | None = None,
    coeffs: Sequence[float] | np.ndarray | None = None,
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
    target = target_gamma(sigma_rel, gamma)
    s = resolve_step(t, step)
    num = check_int(num, "num", minimum=1)
    max_profile_error = check_optional_real(max_profile_error, "max_profile_error", low=0.0)
    if coeffs is None:
        x = solve_coefficients(g, t, gamma=target, step=s, max_profile_error=max_profile_error)
    else:
        x = _check_coeffs(coeffs, g.size)
    tau = s * (np.arange(num, dtype=np.float64) + 0.5) / num
    synth = np.zeros_like(tau)
    for xi, gi, ti in zip(x, g, t):
        if xi != 0.0:
            synth += xi * power_profile(gi, ti, tau)
    req = power_profile(target, s, tau)
    err = profile_error(g, t, x, gamma=target, step=s)
    return ProfileComparison(tau, synth, req, err, target, gamma_to_sigma_rel(target), s, x)
