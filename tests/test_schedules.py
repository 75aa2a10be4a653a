"""Decay schedules: known values, round trips, compounded forms, and argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from functional_ema import schedules

# ------------------------------------------------------------------------------ power / sigma_rel


@pytest.mark.parametrize(
    "sigma_rel, gamma",
    [(0.05, 16.972198602303447), (0.10, 6.937203937601809)],
)
def test_sigma_rel_to_gamma_known_values(sigma_rel, gamma):
    assert schedules.sigma_rel_to_gamma(sigma_rel) == pytest.approx(gamma, rel=1e-13)
    assert schedules.power(sigma_rel=sigma_rel).gamma == pytest.approx(gamma, rel=1e-13)
    assert schedules.gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-13)


def test_gamma_to_sigma_rel_formula():
    # sigma_rel = sqrt((g + 1) / ((g + 2)^2 (g + 3))), by hand at g = 1: sqrt(2 / 36).
    assert schedules.gamma_to_sigma_rel(1.0) == pytest.approx(math.sqrt(2.0 / 36.0), rel=1e-15)
    # gamma = 0 is a uniform average: 1/sqrt(12).
    assert schedules.gamma_to_sigma_rel(0.0) == pytest.approx(12.0**-0.5, rel=1e-15)


def test_power_beta_known_values():
    s = schedules.power(gamma=6.94)
    assert s(10) == pytest.approx(0.43319708437114385, rel=1e-14)
    assert s(1000) == pytest.approx(0.9920874973147553, rel=1e-14)
    assert s(1) == 0.0  # the first update replaces the EMA by the weights
    # By hand: (1 - 1/t) ** (gamma + 1).
    assert s(10) == pytest.approx(0.9**7.94, rel=1e-15)


@pytest.mark.parametrize("gamma", [0.05, 1.0, 6.94, 16.97, 97.0, 1000.0])
def test_gamma_round_trip(gamma):
    assert schedules.sigma_rel_to_gamma(schedules.gamma_to_sigma_rel(gamma)) == pytest.approx(gamma, rel=1e-11)


@pytest.mark.parametrize("sigma_rel", [0.001, 0.01, 0.05, 0.075, 0.1, 0.15, 0.25, 0.28])
def test_sigma_rel_round_trip(sigma_rel):
    g = schedules.sigma_rel_to_gamma(sigma_rel)
    assert g > 0
    assert schedules.gamma_to_sigma_rel(g) == pytest.approx(sigma_rel, rel=1e-12)


def test_power_describe_and_sigma_rel_property():
    s = schedules.power(sigma_rel=0.1)
    d = s.describe()
    assert d["kind"] == "power"
    assert d["gamma"] == s.gamma
    assert d["sigma_rel"] == pytest.approx(0.1, rel=1e-12)


# --------------------------------------------------------------------------------- compounding


def _product(s, start, stop):
    out = 1.0
    for t in range(start + 1, stop + 1):
        out *= s(t)
    return out


@pytest.mark.parametrize(
    "sched",
    [
        schedules.power(gamma=6.94),
        schedules.power(sigma_rel=0.05),
        schedules.constant(0.999),
        schedules.half_life(37.5),
    ],
    ids=["power_g6.94", "power_s0.05", "constant", "half_life"],
)
@pytest.mark.parametrize(
    "start, stop", [(0, 0), (0, 1), (0, 7), (1, 2), (5, 13), (100, 164), (999, 1000), (1000, 3000)]
)
def test_interval_closed_form_matches_product(sched, start, stop):
    assert sched.interval(start, stop) == pytest.approx(_product(sched, start, stop), rel=1e-11, abs=1e-300)


def test_power_interval_closed_form_values():
    s = schedules.power(gamma=3.0)
    assert s.interval(50, 100) == pytest.approx(0.5**4, rel=1e-15)  # (t0 / t1) ** (gamma + 1)
    assert s.interval(0, 10) == 0.0
    assert s.interval(7, 7) == 1.0


def test_constant_and_half_life_values():
    assert schedules.constant(0.9).interval(3, 5) == pytest.approx(0.81, rel=1e-15)
    h = schedules.half_life(10)
    assert h(1) == pytest.approx(0.5**0.1, rel=1e-15)
    assert h.interval(0, 10) == pytest.approx(0.5, rel=1e-15)
    assert h.interval(20, 50) == pytest.approx(0.125, rel=1e-15)


# ------------------------------------------------------------------------------ litema / warmup


def test_litema_hand_values():
    s = schedules.litema(0.9999)
    assert s(0) == pytest.approx(1 / 10)
    assert s(5) == pytest.approx(6 / 15)
    assert s(10**6) == 0.9999  # capped
    assert schedules.litema(0.3)(5) == 0.3
    assert s.interval(0, 3) == pytest.approx((2 / 11) * (3 / 12) * (4 / 13), rel=1e-15)
    assert s.interval(4, 4) == 1.0


def test_warmup_default_hand_values():
    w = schedules.warmup()  # inv_gamma=1, power=2/3, max 0.9999
    assert w(0) == 0.0 and w(1) == 0.0  # s = t - 1 <= 0: the EMA is the weights
    assert w(2) == pytest.approx(1 - 2 ** (-2 / 3), rel=1e-15)
    assert w(3) == pytest.approx(1 - 3 ** (-2 / 3), rel=1e-15)
    assert w(11) == pytest.approx(1 - 11 ** (-2 / 3), rel=1e-15)
    assert w(10**9) == 0.9999
    assert w.interval(1, 3) == pytest.approx((1 - 2 ** (-2 / 3)) * (1 - 3 ** (-2 / 3)), rel=1e-15)


def test_warmup_parameters_hand_values():
    w = schedules.warmup(inv_gamma=2.0, power=0.5, min_decay=0.2, max_decay=0.6, start_step=3)
    assert w(3) == 0.0 and w(4) == 0.0  # s = t - 3 - 1 <= 0
    assert w(5) == 0.2  # s = 1: 1 - 1.5 ** -0.5 = 0.1835, clamped up to min_decay
    assert w(6) == pytest.approx(1 - 2**-0.5, rel=1e-15)  # s = 2
    assert w(7) == pytest.approx(1 - 2.5**-0.5, rel=1e-15)  # s = 3
    assert w(20) == 0.6  # s = 16: 1 - 9 ** -0.5 = 0.667, clamped to max_decay
    assert w.describe()["start_step"] == 3


# ------------------------------------------------------------------------- as_schedule / helpers


def test_as_schedule_and_interval_decay():
    assert schedules.as_schedule(0.9)(5) == 0.9
    p = schedules.power(gamma=2.0)
    assert schedules.as_schedule(p) is p
    f = schedules.as_schedule(lambda t: 0.5)
    assert f.interval(0, 3) == 0.125
    assert schedules.interval_decay(0.5, 2, 4) == 0.25


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "make, match",
    [
        (schedules.power, "exactly one"),
        (lambda: schedules.power(1.0, sigma_rel=0.1), "exactly one"),
        (lambda: schedules.power(gamma=0.0), "gamma > 0"),
        (lambda: schedules.power(gamma=-0.5), "gamma > 0"),
        (lambda: schedules.power(sigma_rel=0.0), "sigma_rel must be in"),
        (lambda: schedules.power(sigma_rel=0.29), "sigma_rel must be in"),
        (lambda: schedules.sigma_rel_to_gamma(-0.1), "sigma_rel must be in"),
        (lambda: schedules.gamma_to_sigma_rel(-1.0), "gamma must be a finite number > -1"),
        (lambda: schedules.constant(1.5), "decay must be in"),
        (lambda: schedules.constant(-0.1), "decay must be in"),
        (lambda: schedules.litema(2.0), "decay must be in"),
        (lambda: schedules.half_life(0), "steps > 0"),
        (lambda: schedules.warmup(inv_gamma=0.0), "inv_gamma > 0"),
        (lambda: schedules.warmup(power=-1.0), "power > 0"),
        (lambda: schedules.warmup(min_decay=0.9, max_decay=0.5), "larger than max_decay"),
        (lambda: schedules.power(gamma=1.0)(0), "steps >= 1"),
        (lambda: schedules.power(gamma=1.0).interval(5, 3), "start <= stop"),
        (lambda: schedules.constant(0.5).interval(-1, 3), "start <= stop"),
        (lambda: schedules.interval_decay(lambda t: 1.5, 0, 1), "must be in"),
    ],
)
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_as_schedule_rejects_non_decays():
    with pytest.raises(TypeError, match="decay must be"):
        schedules.as_schedule("0.9")


@pytest.mark.parametrize(
    "value, err, match",
    [
        (None, TypeError, r"gave None at step 2; a decay must be a real number in \[0, 1\]: make it return a float"),
        ("0.5", TypeError, r"gave '0.5' \(a str\) at step 2"),
        (0.5j, TypeError, r"gave 0.5j \(a complex\) at step 2"),
        (False, TypeError, r"gave False \(a bool\) at step 2"),
        (torch.tensor([0.5, 0.5]), TypeError, r"gave a Tensor of shape \(2,\) and dtype torch.float32 at step 2"),
        (torch.tensor(True), TypeError, r"gave a Tensor of shape \(\) and dtype torch.bool at step 2"),
        (1.5, ValueError, r"gave 1.5 at step 2; a decay must be in \[0, 1\]"),
    ],
    ids=str,
)
def test_decay_callable_values_checked_naming_the_step(value, err, match):
    """A plain callable's per-step value: one real number in [0, 1], else an error naming the
    callable and the step (here the second: the first gives 0.9)."""

    def my_decay(step):
        return 0.9 if step == 1 else value

    with pytest.raises(err, match=rf"the decay callable '.*my_decay' {match}"):
        schedules.interval_decay(my_decay, 0, 3)
    with pytest.raises(err, match=match):
        schedules.as_schedule(my_decay).interval(0, 3)


@pytest.mark.parametrize("late", [math.nan, 2.0, -0.5, None, 0.75], ids=str)
def test_decay_callable_checked_at_every_step_after_the_product_is_negligible(late):
    """The product stops changing once below 2**-54 (a 0.0 at step 2, or 0.5 ** 55 at step 56), but every later
    step's value is still asked and checked, before the state moves: a NaN or 2.0 at a skipped step is refused
    naming it; a valid one (0.75) leaves the product bitwise the per-step one (_loop)."""
    import functional_ema as fe

    calls: list[int] = []

    def zero_then(step):
        calls.append(step)
        return 0.0 if step == 2 else (late if step == 4 else 0.5)

    def halves(step):
        calls.append(step)
        return late if step == 58 else 0.5

    err = TypeError if late is None else ValueError
    for fn, bad in ((zero_then, 4), (halves, 58)):
        state = fe.update(fe.init_ema({"w": torch.zeros(2)}), {"w": torch.ones(2)}, 1, decay=0.5)
        if late == 0.75:
            calls.clear()
            got = schedules.interval_decay(fn, 0, 60)
            assert calls == list(range(1, 61)) and got == _loop(fn, 0, 60)  # every step asked once
            after = fe.update(state, {"w": torch.full((2,), 3.0)}, 60, decay=fn)  # steps 2..60 compounded
            assert after.emas[0]["w"].tolist() == [3.0, 3.0]  # 0.5 + (1 - ~0) * (3 - 0.5), in float32
            continue
        for call in (
            lambda: schedules.interval_decay(fn, 0, 60),
            lambda: schedules.as_schedule(fn).interval(0, 60),
            lambda: fe.update(state, {"w": torch.full((2,), 3.0)}, 60, decay=fn),
        ):
            with pytest.raises(err, match=rf"the decay callable '.*{fn.__name__}' gave .* at step {bad}"):
                call()
        assert state.emas[0]["w"].tolist() == [0.5, 0.5] and int(state.step) == 1  # nothing moved
    assert schedules.interval_decay(halves, 0, 57) == 0.5**55  # multiplied up to 2**-55, then stopped


def test_schedule_interval_values_checked_naming_the_steps():
    class Odd:
        def __init__(self, value):
            self.value = value

        def __call__(self, step):
            return 0.5

        def interval(self, start, stop):
            return self.value

        def __repr__(self):
            return "Odd()"

    for value, err, match in [
        (None, TypeError, "gave None"),
        ("0.25", TypeError, r"gave '0.25' \(a str\)"),
        (torch.ones(3), TypeError, r"gave a Tensor of shape \(3,\) and dtype torch.float32"),
        (float("nan"), ValueError, r"gave nan"),
    ]:
        with pytest.raises(err, match=rf"decay schedule Odd\(\) {match} for steps \(2, 5\]"):
            schedules.interval_decay(Odd(value), 2, 5)
    assert schedules.interval_decay(Odd(torch.tensor(0.25)), 2, 5) == 0.25
    assert schedules.interval_decay(Odd(np.float32(0.25)), 2, 5) == 0.25
    assert schedules.interval_decay(lambda t: torch.tensor([0.5]), 0, 2) == 0.25


@pytest.mark.parametrize("make", [schedules.constant, schedules.litema, lambda v: schedules.warmup(max_decay=v)])
def test_schedule_decay_arguments_must_be_real_numbers(make):
    for bad in ("0.9", None, True, 0.5j, torch.tensor([0.5, 0.5])):
        with pytest.raises(TypeError, match=r"decay must be a real number in \[0, 1\] \(a float\), got"):
            make(bad)
    assert make(np.float32(0.5)).describe() == make(0.5).describe()


# ---------------------------------------------------------------- exact bounds and messages (make mutate)


def _cubic_root(sigma_rel: float) -> float:
    """The largest root of the cubic of :func:`schedules.sigma_rel_to_gamma`, by Newton's method in
    60-digit decimal arithmetic (an independent reference), rounded to a float."""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 60
        t = 1 / (Decimal(sigma_rel) ** 2)
        g = max(t.sqrt(), Decimal(1))
        for _ in range(500):
            step = (((g + 7) * g + (16 - t)) * g + (12 - t)) / ((3 * g + 14) * g + (16 - t))
            g -= step
            if abs(step) < Decimal(10) ** -50:
                break
        return float(g)


@pytest.mark.parametrize(
    "sigma_rel", [1e-6, 1e-4, 0.001, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.08, 0.1, 0.12, 0.15, 0.18, 0.2, 0.25]
)
def test_sigma_rel_to_gamma_within_one_ulp_of_the_exact_root(sigma_rel):
    """Newton's iteration lands within one unit in the last place of the exact root, from 1e-6 to 0.25
    (closer to 1/sqrt(12) the root goes to 0 and the cubic's cancellation costs more digits)."""
    exact = _cubic_root(sigma_rel)
    assert abs(schedules.sigma_rel_to_gamma(sigma_rel) - exact) <= math.ulp(exact), (sigma_rel, exact)


def test_sigma_rel_bound_is_excluded():
    """``sigma_rel`` exactly 1/sqrt(12) would need gamma = 0: refused; a hair below is accepted (gamma > 0)."""
    assert schedules.SIGMA_REL_MAX == 12.0**-0.5
    with pytest.raises(
        ValueError, match=r"sigma_rel must be in \(0, 0\.288675\) \(gamma > 0\), got 0\.28867513459481287$"
    ):
        schedules.sigma_rel_to_gamma(schedules.SIGMA_REL_MAX)
    below = math.nextafter(schedules.SIGMA_REL_MAX, 0.0)
    assert 0.0 < schedules.sigma_rel_to_gamma(below) < 1e-6
    with pytest.raises(ValueError, match=r"got 0\.0$"):
        schedules.sigma_rel_to_gamma(0.0)
    with pytest.raises(TypeError, match=r"sigma_rel must be a real number, got '0\.1' \(a str\)"):
        schedules.sigma_rel_to_gamma("0.1")


def test_decay_bounds_are_inclusive_and_messages_name_the_value():
    """0 and 1 are decays (1 freezes the EMA, 0 copies the weights); the messages show the refused value."""
    for make in (schedules.constant, schedules.litema):
        assert make(1.0).describe()["decay"] == 1.0 and make(0.0).describe()["decay"] == 0.0
    assert schedules.constant(1.0).interval(0, 7) == 1.0
    assert schedules.litema(1.0)(10**9) == (1.0 + 10**9) / (10.0 + 10**9)
    assert schedules.litema(0.0)(5) == 0.0
    with pytest.raises(TypeError, match=r"^decay must be a real number in \[0, 1\] \(a float\), got 'x' \(a str\)$"):
        schedules.constant("x")
    with pytest.raises(ValueError, match=r"^decay must be in \[0, 1\], got 1\.5$"):
        schedules.constant(1.5)
    with pytest.raises(TypeError, match=r"^steps must be a real number, got \[10\] \(a list\)$"):
        schedules.half_life([10])
    with pytest.raises(
        ValueError, match=r"^steps must be a finite number > 0 \(the schedule needs steps > 0\), got inf$"
    ):
        schedules.half_life(math.inf)
    assert schedules.half_life(1e-300).describe() == {"kind": "half_life", "steps": 1e-300}


def test_litema_default_decay():
    s = schedules.litema()
    assert s.describe() == {"kind": "litema", "decay": 0.9999}
    assert s(10**6) == 0.9999


def test_warmup_bounds_and_names():
    """min_decay == max_decay is allowed (a constant decay after the warm-up); each refusal names its argument."""
    w = schedules.warmup(min_decay=0.5, max_decay=0.5)
    assert (w(1), w(2), w(10**6)) == (0.0, 0.5, 0.5)
    for kwargs, err, match in [
        ({"start_step": -1}, ValueError, r"^start_step=-1 is outside \[0, 2\*\*63 - 1\]$"),
        ({"start_step": 1.5}, TypeError, r"^start_step must be an int, got float 1\.5$"),
        ({"min_decay": 1.5}, ValueError, r"^min_decay must be in \[0, 1\], got 1\.5$"),
        ({"min_decay": "0"}, TypeError, r"^min_decay must be a real number in \[0, 1\]"),
        ({"max_decay": -0.5}, ValueError, r"^max_decay must be in \[0, 1\], got -0\.5$"),
        ({"min_decay": 0.6, "max_decay": 0.5}, ValueError, r"^min_decay=0\.6 is larger than max_decay=0\.5$"),
    ]:
        with pytest.raises(err, match=match):
            schedules.warmup(**kwargs)


def test_check_decays_one_or_a_list():
    """One decay becomes a list of one; a list or tuple is checked entry by entry, naming the entry."""
    p = schedules.power(gamma=1.0)
    assert schedules.check_decays(0.5) == [0.5]
    assert schedules.check_decays([0.5, p]) == [0.5, p]
    assert schedules.check_decays((0.25,)) == [0.25]
    with pytest.raises(ValueError, match=r"^decay: give at least one decay \(got an empty list\)$"):
        schedules.check_decays([])
    with pytest.raises(ValueError, match=r"^decays: give at least one decay \(got an empty tuple\)$"):
        schedules.check_decays((), "decays")
    with pytest.raises(ValueError, match=r"^decay\[1\] must be in \[0, 1\], got 2\.0$"):
        schedules.check_decays([0.5, 2.0])
    with pytest.raises(ValueError, match=r"^ema_decay\[0\] must be in \[0, 1\], got -1\.0$"):
        schedules.check_decays([-1.0], "ema_decay")
    with pytest.raises(ValueError, match=r"^decay must be in \[0, 1\], got 1\.5$"):
        schedules.check_decays(1.5)
    with pytest.raises(TypeError, match=r"^ema_decay must be a float, a schedule or a callable"):
        schedules.check_decays("0.5", "ema_decay")


def test_callable_schedule_calls_and_describes():
    """A plain callable becomes a schedule: its values as floats at the step asked, named by its qualname
    (or its repr when it has none, e.g. an instance with __call__)."""

    def tenth(step):
        return step // 10

    s = schedules.as_schedule(tenth)
    assert s(25) == 2.0 and type(s(25)) is float
    assert s.describe() == {"kind": "callable", "name": "test_callable_schedule_calls_and_describes.<locals>.tenth"}

    class Halver:
        def __call__(self, step):
            return 0.5

        def __repr__(self):
            return "Halver()"

    assert schedules.as_schedule(Halver()).describe() == {"kind": "callable", "name": "Halver()"}


# -------------------------------------------------------------- long gaps, extreme arguments (probe J)


def _loop(s, start, stop):
    """The per-step product, multiplied in order (what interval() computed for every gap before)."""
    out = 1.0
    for t in range(start + 1, stop + 1):
        out *= s(t)
        if out < 2.0**-54:
            break
    return out


@pytest.mark.parametrize(
    "sched",
    [
        schedules.warmup(),
        schedules.warmup(power=2.0, max_decay=1.0),
        schedules.warmup(inv_gamma=2.0, power=0.5, min_decay=0.2, max_decay=0.6, start_step=3),
        schedules.warmup(min_decay=1.0, max_decay=1.0),
        schedules.litema(0.999),
        schedules.litema(1.0),
    ],
    ids=["default", "uncapped", "clamped", "always_one", "litema", "litema_one"],
)
def test_warmup_and_litema_intervals_are_the_per_step_product(sched):
    """Gaps up to _LOOP_AT_CAP steps, and warmup's below its cap, are the very per-step product (bitwise); a
    longer gap at the cap (cap ** n, the closed form of a constant), or any longer litema gap (its closed form
    below the cap too), within rel 1e-12 of it (both under 2**-54 where the per-step product stops early)."""
    short = schedules._LOOP_AT_CAP
    closed_below = isinstance(sched, type(schedules.litema()))
    for start, stop in [(0, 1), (0, 9), (1, 2), (3, 40), (5, 6), (100, 164), (999, 1000), (10, 5000), (50, 50 + short)]:
        below = all(sched(t) < _cap(sched) for t in range(start + 1, stop + 1))
        got, ref = sched.interval(start, stop), _loop(sched, start, stop)
        if (below and not closed_below) or stop - start <= short:
            assert got == ref, (start, stop)
        else:
            assert got == pytest.approx(ref, rel=1e-12, abs=2.0**-54), (start, stop)
    for t in (1, 2, 50, 10**4, 10**7):  # one step (an update every step): beta(t) itself, bitwise
        assert sched.interval(t - 1, t) == sched(t)


def _cap(sched):
    return sched.max_decay if hasattr(sched, "max_decay") else sched.decay


def test_long_gaps_at_the_cap_are_closed_form_and_uncapped_ones_bounded():
    """A gap of 10**9 steps costs no loop once the schedule sits at its cap (cap ** n, like constant());
    more than 10**6 steps below the cap is refused as for a plain callable, naming the fix."""
    import time

    t0 = time.perf_counter()
    assert schedules.warmup(min_decay=1.0, max_decay=1.0).interval(1000, 1000 + 10**9) == 1.0
    assert schedules.warmup(max_decay=0.999).interval(10**7, 10**7 + 10**9) == 0.0  # 0.999 ** 1e9 underflows
    capped = schedules.warmup(max_decay=0.99).interval(10**6, 10**6 + 10**4)
    assert capped == 0.99 ** (10**4)
    assert schedules.litema(0.9999999).interval(10**8, 10**8 + 3 * 10**6) == 0.9999999 ** (3 * 10**6)
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(ValueError, match=r"warmup.*below its cap.*3000000 steps skipped.*update more often"):
        schedules.warmup(power=2.0, max_decay=1.0).interval(1000, 1000 + 3 * 10**6)
    # a product that becomes negligible stops early, as before: no refusal
    assert schedules.warmup().interval(10, 10 + 3 * 10**6) == _loop(schedules.warmup(), 10, 10 + 3 * 10**6)
    assert schedules.litema(1.0).interval(10, 10 + 3 * 10**6) < 2.0**-54  # closed form: the update is the same


def _litema_exact(decay, start, stop):
    """litema's product over (start, stop] as exp of the exactly summed logs (~1e-15 relative)."""
    logs = (
        math.log1p(-9.0 / (10 + t)) if (1.0 + t) / (10.0 + t) < decay else math.log(decay)
        for t in range(start + 1, stop + 1)
    )
    return math.exp(math.fsum(logs))


def test_litema_long_gaps_below_its_cap_are_closed_form():
    """Below its cap litema's product telescopes, so a gap of any length is computed (2e6 steps below a cap of
    1 - 1e-9 was refused), within 1e-12 of the exact product, also across the cap; no loop, so it is quick."""
    for decay, start, stop in [(1 - 1e-9, 10**6, 3 * 10**6), (0.9999, 80_000, 100_000), (0.9999, 85_000, 89_995)]:
        got = schedules.litema(decay).interval(start, stop)
        assert got == pytest.approx(_litema_exact(decay, start, stop), rel=1e-12), (decay, start, stop)
    assert schedules.litema(0.999).interval(10**17, 10**17 + 10**9) == 0.999 ** (10**9)


def test_capped_product_finishes_at_the_cap_outside_the_bound():
    """The cap reached inside the first 10**6 steps of a gap a little longer than that, with fewer than
    _LOOP_AT_CAP steps at the cap left: the steps at the cap are multiplied on (bitwise the per-step product),
    not counted toward the 10**6 bound below the cap (the call was refused, miscounting those steps)."""
    sched = schedules.warmup(inv_gamma=1.0, power=1.0, max_decay=1 - 1 / 2_999_990)  # beta(t) = 1 - 1/t below it
    first = next(t for t in range(2_999_900, 3_000_100) if sched(t) >= sched.max_decay)
    assert 2_000_000 + 10**6 >= first > 3_000_100 - schedules._LOOP_AT_CAP
    assert sched.interval(2_000_000, 3_000_100) == _loop(sched, 2_000_000, 3_000_100)


def test_power_arguments_out_of_range_refused_at_the_call():
    """Extreme gamma / sigma_rel would overflow later (beta, describe): refused at the call, naming the range."""
    with pytest.raises(ValueError, match=r"^sigma_rel must be in \[1e-12, 0\.288675\) .*got 1e-200$"):
        schedules.power(sigma_rel=1e-200)
    with pytest.raises(ValueError, match=r"^gamma must be a finite number in \(0, 1e\+12\].*got 1e\+200$"):
        schedules.power(gamma=1e200)
    with pytest.raises(ValueError, match=r"gamma must be .*1e\+12.*got 1e\+200$"):
        schedules.gamma_to_sigma_rel(1e200)
    top = schedules.power(gamma=schedules.GAMMA_MAX)
    assert math.isfinite(top.describe()["sigma_rel"]) and top(10**6) >= 0.0
    low = schedules.power(sigma_rel=schedules.SIGMA_REL_MIN)
    assert math.isfinite(low.gamma) and math.isfinite(low.describe()["sigma_rel"])


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.25), torch.tensor(0.5), torch.tensor([0.75])])
def test_check_decay_takes_real_numbers_like_constant(value):
    """check_decay (update's and the integrations' check) takes what schedules.constant takes; a bad value in
    a sequence is named by its position."""
    assert schedules.check_decay(value) is value
    assert schedules.as_schedule(value).describe() == schedules.constant(value).describe()
    assert schedules.interval_decay(value, 0, 2) == float(value) ** 2
    with pytest.raises(ValueError, match=r"^decay\[1\] must be in \[0, 1\], got 1\.5$"):
        schedules.check_decays((value, np.float32(1.5)))


def test_core_docs_warmup_row_matches_the_code():
    """docs/core.md's table row for warmup gives the code's beta: 0 (EMA = weights) up to start_step + 1."""
    from pathlib import Path

    row = next(
        line
        for line in (Path(__file__).resolve().parents[1] / "docs" / "core.md").read_text().splitlines()
        if line.startswith("| `warmup(")
    )
    assert "start_step" in row and "t <= start_step + 1" in row and "(t - start_step - 1)" in row
    w = schedules.warmup(min_decay=0.5, start_step=10)
    assert w(11) == 0.0 and w(12) == 0.5  # at t <= start_step + 1 the clamp does not apply: beta = 0
