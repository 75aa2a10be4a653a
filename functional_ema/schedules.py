"""Decay schedules: pure functions of the training step.

A schedule gives the *per-step* decay ``beta(t)`` used for the update that brings the EMA to
step ``t`` (``t >= 1`` counts optimizer steps)::

    ema_t = beta(t) * ema_{t-1} + (1 - beta(t)) * x_t

When the EMA is updated only every N steps, :func:`functional_ema.update` compounds the decays of
the skipped steps: going from step ``t0`` to ``t1`` uses ``interval(t0, t1) = prod_{s=t0+1}^{t1}
beta(s)``, so the result weighs the current weights exactly as if they had been held since ``t0``.
``constant``, ``half_life`` and ``power`` give that product in closed form; ``litema`` and ``warmup``
multiply their rising per-step decays and, once at their cap, use the constant's closed form
``cap ** n``, so a long gap costs no loop (more than 10^6 steps below the cap in one update are
refused, as for a plain callable). Any plain callable ``step -> decay`` works too (compounded by a
product over the skipped steps, at most 10^6 of them).

Because the decay depends only on the step (never on a counter inside the state), resuming from a
checkpoint cannot desynchronise it.

Example:
    >>> from functional_ema import schedules
    >>> s = schedules.power(sigma_rel=0.10)
    >>> round(s.gamma, 6)
    6.937204
    >>> round(schedules.power(gamma=6.94)(10), 12)
    0.433197084371
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from ._args import real_number as _real

__all__ = [
    "Schedule",
    "DecayLike",
    "constant",
    "litema",
    "warmup",
    "half_life",
    "power",
    "sigma_rel_to_gamma",
    "gamma_to_sigma_rel",
    "interval_decay",
    "as_schedule",
]


@runtime_checkable
class Schedule(Protocol):
    """Per-step decay ``beta(step)`` with a compounded form over an interval of steps."""

    def __call__(self, step: int) -> float: ...

    def interval(self, start: int, stop: int) -> float:
        """Decay for going from step ``start`` to ``stop`` (``prod beta(s)``, ``start < s <= stop``)."""
        ...

    def describe(self) -> dict: ...


DecayLike = float | Schedule | Callable[[int], float]


def _describe(value: Any) -> str:
    """A short description of a value that is not a decay (a big tensor is not printed)."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    if value is None:
        return "None"
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} (a {type(value).__name__})"


def _checked_decay(value: Any, source: str, where: str) -> float:
    """``value`` as a float in [0, 1]; otherwise an error naming ``source`` (which decay) and
    ``where`` (the step or steps it was asked for)."""
    real = _real(value)
    if real is None:
        raise TypeError(
            f"{source} gave {_describe(value)} {where}; a decay must be a real number in [0, 1]: make it return a float"
        )
    if not 0.0 <= real <= 1.0:  # NaN fails too
        raise ValueError(f"{source} gave {real!r} {where}; a decay must be in [0, 1]")
    return real


def _check_decay(name: str, value: float) -> float:
    real = _real(value)
    if real is None:
        raise TypeError(f"{name} must be a real number in [0, 1] (a float), got {_describe(value)}")
    if not 0.0 <= real <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {real!r}")
    return real


def _positive(name: str, value: Any, low: float = 0.0) -> float:
    """``value`` as a finite real number ``> low``; else a ``TypeError``/``ValueError`` naming ``name``."""
    real = _real(value)
    if real is None:
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    if not (real > low and math.isfinite(real)):
        raise ValueError(
            f"{name} must be a finite number > {low:g} (the schedule needs {name} > {low:g}), got {real!r}"
        )
    return real


def _step_arg(name: str, value: Any) -> int:
    """``value`` as an int step (the check of :func:`functional_ema.update`'s ``step``)."""
    from ._args import check_step

    return check_step(value, name)


def _check_steps(start: int, stop: int) -> None:
    if stop < start or start < 0:
        raise ValueError(f"interval needs 0 <= start <= stop, got start={start}, stop={stop}")


# A plain callable has no closed form for skipped steps: it is called once per step. Past this many
# steps in one update that costs ~0.2 s, so longer gaps are refused with the fix (an interval()).
MAX_CALLABLE_STEPS = 1_000_000
# Once the compounded decay is below 2**-54, ``1 - decay`` is exactly 1.0 in float64: further
# factors cannot change the update, so the product stops there.
_NEGLIGIBLE = 2.0**-54


def _product(beta: Callable[[int], float], start: int, stop: int, checked: bool = False) -> float:
    if checked and stop - start > MAX_CALLABLE_STEPS:
        raise ValueError(
            f"{_callable_name(beta)} would be called {stop - start} times to skip "
            f"steps ({start}, {stop}] (more than {MAX_CALLABLE_STEPS}); give it an interval(start, stop) method "
            "(see functional_ema.schedules.Schedule) or update more often"
        )
    out = 1.0
    for s in range(start + 1, stop + 1):
        b = beta(s)
        if type(b) is not float or (checked and not 0.0 <= b <= 1.0):  # NaN fails too
            b = _checked_decay(b, _callable_name(beta), f"at step {s}") if checked else float(b)
        out *= b
        if out < _NEGLIGIBLE:
            if checked:  # the product is settled, but every later decay is still checked (a NaN is refused)
                _check_decays(beta, s, stop)
            break
    return out


def _check_decays(beta: Callable[[int], float], start: int, stop: int) -> None:
    """Each of ``beta``'s decays over ``(start, stop]`` checked in [0, 1] (:func:`_checked_decay`), not multiplied:
    a step past the point where the product no longer changes may still return a NaN or 2.0, which is refused."""
    for s in range(start + 1, stop + 1):
        b = beta(s)
        if type(b) is not float or not 0.0 <= b <= 1.0:  # NaN fails too
            _checked_decay(b, _callable_name(beta), f"at step {s}")


def _callable_name(beta: Callable[[int], float]) -> str:
    return f"the decay callable {getattr(beta, '__qualname__', beta)!r}"


#: Gaps at a schedule's cap up to this many steps are still multiplied step by step (bitwise the per-step
#: product, at about 0.5 us a step); longer ones use the closed form ``cap ** n`` (equal to ~1e-12 relative).
_LOOP_AT_CAP = 4096


def _capped_product(beta: Callable[[int], float], cap: float, start: int, stop: int, name: str) -> float:
    """``prod beta(s)`` over ``(start, stop]`` for a non-decreasing ``beta`` that stays at ``cap`` once it reaches
    it: the per-step product, multiplied in order as :func:`_product` does (bitwise what it gives), until the
    first step at the cap, then :func:`_at_cap` for the ``n`` steps from there (``cap ** n`` past
    :data:`_LOOP_AT_CAP`, so ``every_n_steps``-sized gaps stay bitwise what earlier releases gave). More than
    :data:`MAX_CALLABLE_STEPS` steps below the cap whose product is not yet negligible are refused, as for a
    plain callable; the steps at the cap do not count toward that bound (they cost at most _LOOP_AT_CAP)."""
    out = 1.0
    for s in range(start + 1, min(stop, start + MAX_CALLABLE_STEPS) + 1):
        b = beta(s)
        if b >= cap:  # beta never exceeds its cap: this step and every later one is exactly cap
            return _at_cap(out, cap, stop - s + 1)
        out *= b
        if out < _NEGLIGIBLE:
            return out  # as the per-step product: no further factor can change the update
    if stop > start + MAX_CALLABLE_STEPS:
        raise ValueError(
            f"{name}.interval({start}, {stop}) would multiply more than {MAX_CALLABLE_STEPS} per-step decays below "
            f"its cap one by one ({stop - start} steps skipped, the bound for a plain callable); update more often"
        )
    return out


def _at_cap(out: float, cap: float, n: int) -> float:
    """``out`` times ``n`` factors ``cap``: one by one up to :data:`_LOOP_AT_CAP` (bitwise the per-step product,
    stopping where it does once negligible), else the closed form ``cap ** n`` (equal to ~1e-12 relative)."""
    if n > _LOOP_AT_CAP:
        return out * cap**n
    for _ in range(n):
        out *= cap
        if out < _NEGLIGIBLE:
            break
    return out


@dataclass(frozen=True)
class _BuiltinSchedule:
    """What the built-in schedules share: :meth:`interval` checks the steps and compounds the decays
    (:meth:`_compound`: a closed form where the schedule has one, else the product of the per-step
    decays), and :meth:`describe` is the JSON record a checkpoint stores (``kind`` and the fields)."""

    kind: ClassVar[str]

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def interval(self, start: int, stop: int) -> float:
        _check_steps(start, stop)
        return self._compound(start, stop)

    def _compound(self, start: int, stop: int) -> float:
        return _product(self, start, stop)

    def describe(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True)
class _Constant(_BuiltinSchedule):
    kind: ClassVar[str] = "constant"
    decay: float

    def __call__(self, step: int) -> float:
        return self.decay

    def _compound(self, start: int, stop: int) -> float:
        return self.decay ** (stop - start)


def constant(decay: float) -> Schedule:
    """``beta(t) = decay``; over N steps the decay compounds to ``decay**N``."""
    return _Constant(_check_decay("decay", decay))


@dataclass(frozen=True)
class _LitEma(_BuiltinSchedule):
    kind: ClassVar[str] = "litema"
    decay: float

    def __call__(self, step: int) -> float:
        return min(self.decay, (1.0 + step) / (10.0 + step))

    def _compound(self, start: int, stop: int) -> float:
        if stop - start <= _LOOP_AT_CAP:  # bitwise the per-step product, as every_n_steps-sized gaps always were
            return _capped_product(self, self.decay, start, stop, f"litema(decay={self.decay})")
        # A long gap in closed form, any length, no loop (within ~1e-12 relative of the per-step product): the
        # steps below the cap telescope (_litema_uncapped), the ones at it are decay ** n. The first step at the
        # cap is where (1 + t) / (10 + t) >= decay; a step off at that boundary changes a factor by ~1e-16.
        d = self.decay
        first_at_cap = stop + 1 if d >= 1.0 else max(0, math.ceil((10.0 * d - 1.0) / (1.0 - d)))
        below = min(stop, max(start, first_at_cap - 1))
        return _litema_uncapped(start, below) * d ** (stop - below)


def _litema_uncapped(a: int, b: int) -> float:
    """``prod (1 + t) / (10 + t)`` over ``t`` in ``(a, b]``: the numerators ``a+2 .. b+1`` and denominators
    ``a+11 .. b+10`` cancel but for nine of each, ``prod_{k=1..9} (a+1+k) / (b+1+k)`` (each ratio of two ints
    correctly rounded by Python, so ~1e-15 relative at any step)."""
    if b - a < 9:
        return math.prod((1.0 + t) / (10.0 + t) for t in range(a + 1, b + 1))
    return math.prod((a + 1 + k) / (b + 1 + k) for k in range(1, 10))


def litema(decay: float = 0.9999) -> Schedule:
    """LitEma / latent-diffusion warm-up: ``beta(t) = min(decay, (1 + t) / (10 + t))``."""
    return _LitEma(_check_decay("decay", decay))


@dataclass(frozen=True)
class _Warmup(_BuiltinSchedule):
    kind: ClassVar[str] = "warmup"
    inv_gamma: float
    power: float
    min_decay: float
    max_decay: float
    start_step: int

    def __call__(self, step: int) -> float:
        s = step - self.start_step - 1
        if s <= 0:
            return 0.0
        value = 1.0 - (1.0 + s / self.inv_gamma) ** -self.power
        return max(self.min_decay, min(value, self.max_decay))

    def _compound(self, start: int, stop: int) -> float:
        # beta is 0 up to start_step + 1, then rises (clamped) to max_decay and stays there.
        return _capped_product(self, self.max_decay, start, stop, f"warmup(max_decay={self.max_decay})")


def warmup(
    inv_gamma: float = 1.0,
    power: float = 2.0 / 3.0,
    min_decay: float = 0.0,
    max_decay: float = 0.9999,
    start_step: int = 0,
) -> Schedule:
    """diffusers / timm EMA warm-up.

    ``beta(t) = clamp(1 - (1 + s / inv_gamma) ** -power, min_decay, max_decay)`` with
    ``s = t - start_step - 1``, and ``beta(t) = 0`` (EMA = weights) while ``s <= 0``.
    ``power=2/3`` reaches 0.999 at ~31.6k steps, ``power=3/4`` reaches 0.9999 at ~215k steps.
    """
    inv_gamma, power = _positive("inv_gamma", inv_gamma), _positive("power", power)
    start_step = _step_arg("start_step", start_step)
    lo, hi = _check_decay("min_decay", min_decay), _check_decay("max_decay", max_decay)
    if lo > hi:
        raise ValueError(f"min_decay={lo} is larger than max_decay={hi}")
    return _Warmup(float(inv_gamma), float(power), lo, hi, int(start_step))


@dataclass(frozen=True)
class _HalfLife(_BuiltinSchedule):
    kind: ClassVar[str] = "half_life"
    steps: float

    def __call__(self, step: int) -> float:
        return 0.5 ** (1.0 / self.steps)

    def _compound(self, start: int, stop: int) -> float:
        return 0.5 ** ((stop - start) / self.steps)


def half_life(steps: float) -> Schedule:
    """Constant decay whose weight on past weights halves every ``steps`` steps: ``0.5**(1/steps)``."""
    return _HalfLife(_positive("steps", steps))


#: The largest ``gamma`` a power EMA takes. Far beyond any use (``sigma_rel = 0.001`` is ``gamma ~ 1e3``), and
#: low enough that ``sigma_rel`` (``(gamma + 2) ** 2 * (gamma + 3)``) and its inverse stay finite.
GAMMA_MAX = 1e12


def _gamma(name: str, gamma: Any, low: float) -> float:
    """``gamma`` as a finite real number in ``(low, GAMMA_MAX]``; else an error naming ``name`` and the range."""
    g = _positive(name, gamma, low=low)
    if g > GAMMA_MAX:
        raise ValueError(
            f"gamma must be a finite number in ({low:g}, {GAMMA_MAX:g}] (a wider profile than any run has steps for; "
            f"sigma_rel >= {SIGMA_REL_MIN:.3g}), got {g!r}"
        )
    return g


def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative standard deviation of the power profile ``t**gamma`` (Karras et al. 2024, eq. 3)."""
    return _sigma_rel_of(_gamma("gamma", gamma, low=-1.0))


def _sigma_rel_of(g: float) -> float:
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


#: ``sigma_rel`` of ``gamma = 0`` (a uniform average over the whole run): ``1/sqrt(12) ~ 0.2887``.
#: ``sigma_rel`` targets at or above it are refused (they would need ``gamma <= 0``).
SIGMA_REL_MAX = 12.0**-0.5
#: The smallest ``sigma_rel`` taken: 1e-12, about that of ``GAMMA_MAX`` (smaller ones overflow the cubic).
SIGMA_REL_MIN = 1e-12


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """Inverse of :func:`gamma_to_sigma_rel`: the largest real root of
    ``g**3 + 7 g**2 + (16 - s**-2) g + (12 - s**-2) = 0`` with ``s = sigma_rel``.

    Example: ``sigma_rel_to_gamma(0.05) == 16.972198602303447`` (to float precision).
    """
    s = _real(sigma_rel)
    if s is None:
        raise TypeError(f"sigma_rel must be a real number, got {_describe(sigma_rel)}")
    # For gamma > 0 sigma_rel falls monotonically from 1/sqrt(12) (gamma = 0, a uniform average) to 0.
    if s == 0.0 or not SIGMA_REL_MIN <= s < SIGMA_REL_MAX:  # NaN fails too
        low = f"[{SIGMA_REL_MIN:g}" if 0.0 < s < SIGMA_REL_MIN else "(0"
        raise ValueError(f"sigma_rel must be in {low}, {SIGMA_REL_MAX:.6f}) (gamma > 0), got {sigma_rel!r}")
    t = s**-2
    f = lambda g: ((g + 7.0) * g + (16.0 - t)) * g + (12.0 - t)  # noqa: E731
    df = lambda g: (3.0 * g + 14.0) * g + (16.0 - t)  # noqa: E731
    # f is increasing beyond its largest root, and that root is below sqrt(t): start above, Newton down.
    g = max(math.sqrt(t), 1.0)
    for _ in range(200):
        step = f(g) / df(g)
        g_next = g - step
        if abs(step) <= 1e-15 * max(1.0, abs(g)):
            g = g_next
            break
        g = g_next
    return g


@dataclass(frozen=True)
class _Power(_BuiltinSchedule):
    kind: ClassVar[str] = "power"
    gamma: float

    def __call__(self, step: int) -> float:
        if step <= 0:
            raise ValueError(f"the power EMA is defined for steps >= 1, got {step}")
        return (1.0 - 1.0 / step) ** (self.gamma + 1.0)

    def _compound(self, start: int, stop: int) -> float:
        if stop == 0:
            return 1.0
        # prod_{s=start+1}^{stop} ((s-1)/s)^(g+1) telescopes to (start/stop)^(g+1).
        return (start / stop) ** (self.gamma + 1.0)

    @property
    def sigma_rel(self) -> float:
        return _sigma_rel_of(self.gamma)  # gamma was checked by power()

    def describe(self) -> dict:
        return {**super().describe(), "sigma_rel": self.sigma_rel}


def power(gamma: float | None = None, *, sigma_rel: float | None = None) -> Schedule:
    """EDM2 power-function EMA: ``beta(t) = (1 - 1/t) ** (gamma + 1)``.

    The EMA at step ``t`` averages the weights with a profile proportional to ``s**gamma`` over
    ``0 < s <= t``. Give either ``gamma`` or ``sigma_rel`` (the profile's width relative to ``t``).
    Updating every N steps compounds exactly to ``((t - N) / t) ** (gamma + 1)``.
    """
    if gamma is None and sigma_rel is not None:
        return _Power(sigma_rel_to_gamma(sigma_rel))
    if gamma is not None and sigma_rel is None:
        return _Power(_gamma("gamma", gamma, low=0.0))
    raise ValueError(f"power() takes exactly one of gamma= or sigma_rel=, got gamma={gamma!r}, sigma_rel={sigma_rel!r}")


@dataclass(frozen=True)
class _Callable(_BuiltinSchedule):
    kind: ClassVar[str] = "callable"
    fn: Callable[[int], float]

    def __call__(self, step: int) -> float:
        return float(self.fn(step))

    def _compound(self, start: int, stop: int) -> float:
        return _product(self.fn, start, stop, checked=True)

    def describe(self) -> dict:
        return {"kind": "callable", "name": getattr(self.fn, "__qualname__", repr(self.fn))}


def check_decay(decay: Any, what: str = "decay") -> DecayLike:
    """``decay`` if :func:`update <functional_ema.update>` can use it: a real number in [0, 1] (an int
    or float, a numpy scalar, a one-element real tensor: what :func:`constant` takes), a schedule, or a
    callable ``step -> decay`` (whose values are checked at each update);
    else a ``TypeError``/``ValueError`` naming ``what`` and the value. The check of :func:`as_schedule`,
    for callers that take a decay now and update later (the integrations, at construction)."""
    if isinstance(decay, _BuiltinSchedule) or (callable(decay) and not isinstance(decay, type)):
        return decay
    if _real(decay) is not None:  # numpy scalars and one-element real tensors too, as constant() takes them
        _check_decay(what, decay)
        return decay
    raise TypeError(
        f"{what} must be a float, a schedule or a callable step -> decay (a float in [0, 1], a schedule from "
        f"functional_ema.schedules), got {_describe(decay)}"
    )


def as_schedule(decay: DecayLike) -> Schedule:
    """Turn a float (constant decay), a schedule, or a callable ``step -> decay`` into a schedule."""
    if isinstance(decay, _BuiltinSchedule):
        return decay
    check_decay(decay)
    real = _real(decay)
    if real is not None:  # a real number (a float, a numpy scalar, a one-element tensor): a constant decay
        return constant(real)
    if hasattr(decay, "interval"):
        return cast(Schedule, decay)  # a user schedule following the protocol (callable with .interval)
    return _Callable(cast(Callable[[int], float], decay))  # check_decay left only callables


def interval_decay(decay: DecayLike, start: int, stop: int) -> float:
    """Compounded decay for moving an EMA from step ``start`` to step ``stop``; checked in [0, 1]."""
    start, stop = _step_arg("start", start), _step_arg("stop", stop)
    value = as_schedule(decay).interval(start, stop)
    if type(value) is float and 0.0 <= value <= 1.0:
        return value
    return _checked_decay(value, f"decay schedule {decay!r}", f"for steps ({start}, {stop}]")


def check_decays(decay: Any, what: str = "decay") -> list[DecayLike]:
    """One decay, or a non-empty list/tuple of them (one per EMA), each checked by
    :func:`functional_ema.schedules.check_decay` (the check :func:`functional_ema.update` applies):
    a real number in [0, 1], a schedule, or a callable ``step -> decay``."""
    if isinstance(decay, (list, tuple)):
        if not decay:
            raise ValueError(f"{what}: give at least one decay (got an empty {type(decay).__name__})")
        return [check_decay(d, f"{what}[{i}]") for i, d in enumerate(decay)]
    return [check_decay(decay, what)]
