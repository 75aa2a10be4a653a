"""The argument checks of functional_ema/_args.py, each at its exact bounds.

Every check is asked about the values either side of each bound (the bound itself included), and
about each kind it refuses; the value it returns is compared with the value given, and the message
with the words it must carry (the parameter's name, the value, the bound). These are the boundaries
mutation testing (`make mutate`) found unpinned: a `<` for a `<=` must fail a test here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from functional_ema import _args as a


def _raises(exc: type[Exception], fn, *words: str) -> str:
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)
    return msg


# ------------------------------------------------------------------------------------------- steps


def test_check_step_bounds_and_kinds():
    assert a.MAX_STEP == 9223372036854775807
    for ok in (0, 1, 7, a.MAX_STEP):
        assert a.check_step(ok) == ok and type(a.check_step(ok)) is int
    assert a.check_step(np.int64(5)) == 5
    assert a.check_step(torch.tensor(6)) == 6
    assert a.check_step(torch.tensor([9], dtype=torch.int32)) == 9
    _raises(ValueError, lambda: a.check_step(-1), "step=-1 is outside [0, 2**63 - 1]")
    _raises(ValueError, lambda: a.check_step(a.MAX_STEP + 1), f"step={a.MAX_STEP + 1} is outside")
    _raises(TypeError, lambda: a.check_step(True, "n"), "n must be an int, got a bool (True)")
    _raises(TypeError, lambda: a.check_step(False), "got a bool (False)")
    _raises(TypeError, lambda: a.check_step(2.0, "k"), "k must be an int, got float 2.0")
    _raises(TypeError, lambda: a.check_step("5"), "got str '5'")
    for t, dtype in (
        (torch.tensor(1.0), "torch.float32"),
        (torch.tensor(True), "torch.bool"),
        (torch.tensor(1 + 1j), "torch.complex64"),
    ):
        _raises(TypeError, lambda t=t: a.check_step(t), f"got a tensor of dtype {dtype} and shape ()")
    _raises(TypeError, lambda: a.check_step(torch.tensor([1, 2])), "of dtype torch.int64 and shape (2,)")
    _raises(TypeError, lambda: a.check_step(torch.tensor([], dtype=torch.int64)), "and shape (0,)")


def test_check_int_minimum_is_inclusive():
    assert a.check_int(0, "n") == 0
    assert a.check_int(3, "n", minimum=3) == 3
    assert a.check_int(2**63 - 1, "n") == 2**63 - 1
    assert a.check_int(np.int32(4), "n", minimum=4) == 4  # through the general parsing
    assert a.check_int(torch.tensor(5), "n", minimum=5) == 5
    _raises(ValueError, lambda: a.check_int(2, "every_n", minimum=3), "every_n must be >= 3, got 2")
    _raises(ValueError, lambda: a.check_int(np.int64(2), "n", minimum=3), "n must be >= 3, got 2")
    _raises(ValueError, lambda: a.check_int(0, "n", minimum=1), "n must be >= 1, got 0")
    _raises(ValueError, lambda: a.check_int(-1, "n"), "n=-1 is outside")
    _raises(ValueError, lambda: a.check_int(2**63, "n"), f"n={2**63} is outside")
    _raises(TypeError, lambda: a.check_int(True, "flag"), "flag must be an int, got a bool")
    _raises(TypeError, lambda: a.check_int(None, "n"), "n must be an int, got NoneType None")
    assert a.check_optional_int(None, "n") is None
    assert a.check_optional_int(4, "n", minimum=4) == 4
    _raises(ValueError, lambda: a.check_optional_int(3, "n", minimum=4), "n must be >= 4, got 3")


def test_check_rank_excludes_the_world_size():
    assert a.check_rank(0, "rank", 1) == 0
    assert a.check_rank(3, "src", 4) == 3
    msg = _raises(ValueError, lambda: a.check_rank(4, "src", 4), "src=4 is not a rank of the group")
    assert "it has 4 rank(s), 0 to 3" in msg
    _raises(ValueError, lambda: a.check_rank(1, "rank", 1), "it has 1 rank(s), 0 to 0")
    _raises(ValueError, lambda: a.check_rank(-1, "rank", 4), "rank=-1 is outside")
    _raises(TypeError, lambda: a.check_rank(True, "rank", 4), "got a bool")


# ------------------------------------------------------------------------------------- real numbers


def test_real_number_kinds():
    assert a.real_number(0.5) == 0.5
    assert a.real_number(3) == 3.0 and type(a.real_number(3)) is float
    assert a.real_number(np.float32(0.25)) == 0.25
    assert a.real_number(np.array(2.5)) == 2.5
    assert a.real_number(torch.tensor([[1.5]])) == 1.5
    assert a.real_number(torch.tensor(2, dtype=torch.int64)) == 2.0
    for no in (None, "1.0", b"1", True, False, 1 + 2j, [1.0], torch.tensor([1.0, 2.0]), np.zeros(0)):
        assert a.real_number(no) is None, no
    assert a.real_number(torch.tensor(1 + 1j)) is None
    assert a.real_number(np.array([True])) is None
    assert a.real_number(torch.tensor([True])) is None

    class Shaped:  # a shape and dtype but no float(): refused, not raised
        shape, dtype = (1,), "float32"

    assert a.real_number(Shaped()) is None


def test_check_real_bounds():
    assert a.check_real(0.0, "x", low=0.0, high=1.0) == 0.0
    assert a.check_real(1.0, "x", low=0.0, high=1.0) == 1.0
    assert a.check_real(2, "x") == 2.0
    assert a.check_real(np.float64(0.5), "x", low=0, high=1) == 0.5
    assert a.check_real(math.inf, "x", high=math.inf) == math.inf  # an open upper end takes infinity
    _raises(
        ValueError, lambda: a.check_real(0.0, "gamma", low=0.0, low_open=True), "gamma must be a number in (0.0, inf]"
    )
    assert a.check_real(1e-300, "gamma", low=0.0, low_open=True) == 1e-300
    _raises(
        ValueError, lambda: a.check_real(-1e-9, "x", low=0.0, high=1.0), "x must be a number in [0.0, 1.0], got -1e-09"
    )
    _raises(ValueError, lambda: a.check_real(1.0 + 1e-9, "x", low=0.0, high=1.0), "got 1.000000001")
    _raises(ValueError, lambda: a.check_real(math.nan, "x"), "x must be a number in [-inf, inf], got nan")
    _raises(ValueError, lambda: a.check_real(math.inf, "x", high=5.0), "got inf")
    _raises(ValueError, lambda: a.check_real(-math.inf, "x"), "got -inf")
    _raises(TypeError, lambda: a.check_real(True, "x"), "x must be a real number, got bool True")
    _raises(TypeError, lambda: a.check_real("0.5", "x"), "got str '0.5'")
    _raises(TypeError, lambda: a.check_real(None, "x"), "got NoneType None")
    assert a.check_optional_real(None, "x") is None
    assert a.check_optional_real(0.5, "x", low=0.0, high=0.5) == 0.5
    _raises(ValueError, lambda: a.check_optional_real(0.0, "x", low=0.0, low_open=True), "(0.0, inf]")
    _raises(ValueError, lambda: a.check_optional_real(0.6, "x", high=0.5), "got 0.6")


def test_check_reals_bounds_and_kinds():
    out = a.check_reals([0, 0.5, 1], "s", low=0.0, high=1.0)
    assert out.dtype == np.float64 and out.tolist() == [0.0, 0.5, 1.0]
    assert a.check_reals((2,), "s").tolist() == [2.0]
    assert a.check_reals(np.array([[1, 2]], dtype=np.int32), "s").tolist() == [[1.0, 2.0]]
    assert a.check_reals(np.array([3], dtype=np.uint8), "s").tolist() == [3.0]
    assert a.check_reals(torch.tensor([0.25, 0.75]), "s").tolist() == [0.25, 0.75]
    assert a.check_reals(0.5, "s", scalar=True).tolist() == 0.5
    assert a.check_reals([1e-12], "s", low=0.0, low_open=True).tolist() == [1e-12]
    _raises(
        ValueError,
        lambda: a.check_reals([0.5, 0.0], "s", low=0.0, low_open=True),
        "s must hold finite numbers in (0.0, inf], got [0.0]",
    )
    _raises(ValueError, lambda: a.check_reals([-0.1, 0.2], "s", low=0.0), "in [0.0, inf], got [-0.1]")
    _raises(ValueError, lambda: a.check_reals([1.5], "s", high=1.0), "got [1.5]")
    _raises(ValueError, lambda: a.check_reals([math.nan, math.inf], "s"), "got [nan, inf]")
    _raises(ValueError, lambda: a.check_reals(np.array([np.inf]), "s"), "got [inf]")
    _raises(TypeError, lambda: a.check_reals([0.5, True], "s"), "s[1] must be a real number, got bool True")
    _raises(TypeError, lambda: a.check_reals([0.5, "x"], "s"), "s[1] must be a real number, got str 'x'")
    _raises(
        TypeError, lambda: a.check_reals(torch.tensor([True]), "s"), "s must hold real numbers, got a torch.bool tensor"
    )
    _raises(TypeError, lambda: a.check_reals(torch.tensor([1j]), "s"), "got a torch.complex64 tensor")
    _raises(TypeError, lambda: a.check_reals(np.array(["a"]), "s"), "got a numpy array of dtype <U1")
    _raises(TypeError, lambda: a.check_reals(np.array([True]), "s"), "numpy array of dtype bool")
    msg = _raises(TypeError, lambda: a.check_reals(0.5, "s"), "s must be a sequence of real numbers")
    assert "a real number or" not in msg
    _raises(TypeError, lambda: a.check_reals(True, "s", scalar=True), "s must be a real number or a sequence")
    _raises(TypeError, lambda: a.check_reals(None, "s"), "got NoneType None")


# ------------------------------------------------------------------------------------- other kinds


def test_check_bool_str_path_mapping_sequence():
    assert a.check_bool(True, "b") is True and a.check_bool(False, "b") is False
    assert a.check_bool(np.bool_(True), "b") is True and type(a.check_bool(np.bool_(False), "b")) is bool
    _raises(TypeError, lambda: a.check_bool(1, "strict"), "strict must be True or False, got int 1")
    _raises(TypeError, lambda: a.check_bool("no", "b"), "got str 'no'")

    class bool_:  # named like numpy 1's bool, from another module: refused
        pass

    _raises(TypeError, lambda: a.check_bool(bool_(), "b"), "got bool_")
    _raises(TypeError, lambda: a.check_bool(np.int8(1), "b"), "got int8 np.int8(1)")
    assert a.check_str("x", "s") == "x"
    _raises(TypeError, lambda: a.check_str(b"x", "tag"), "tag must be a str, got bytes b'x'")
    assert a.check_path("a/b", "p") == Path("a/b")
    assert a.check_path(Path("/x"), "p") == Path("/x")
    for empty in ("", "a\x00b"):
        _raises(ValueError, lambda e=empty: a.check_path(e, "out"), "out must name a file or folder")

    class BytesPath(os.PathLike):
        def __fspath__(self) -> bytes:  # type: ignore[override]  # a bytes path: refused
            return b"x"

    _raises(ValueError, lambda: a.check_path(BytesPath(), "out"), "out must name a file or folder")
    _raises(TypeError, lambda: a.check_path(3, "out"), "out must be a path (a str or os.PathLike), got int 3")
    assert a.check_mapping({"a": 1}, "m") == {"a": 1}
    _raises(TypeError, lambda: a.check_mapping([1], "sd"), "sd must be a mapping (a dict), got list [1]")
    assert a.check_sequence((1, 2), "xs") == [1, 2]
    assert a.check_sequence([], "xs", nonempty=False) == []
    _raises(ValueError, lambda: a.check_sequence([], "xs"), "xs is empty: give at least one")
    _raises(ValueError, lambda: a.check_sequence((), "xs"), "xs is empty")
    _raises(TypeError, lambda: a.check_sequence("ab", "xs"), "xs must be a list or tuple, got str 'ab'")


def test_check_state_and_device():
    import functional_ema as fe

    state = fe.init_ema(fe.local_shards(torch.nn.Linear(2, 2)))
    assert a.check_state(state) is state
    _raises(
        TypeError, lambda: a.check_state({}, "ema"), "ema must be an EmaState (from functional_ema.init_ema", "got dict"
    )
    assert a.check_device(None) is None
    dev = torch.device("cpu")
    assert a.check_device(dev) is dev
    assert a.check_device("cpu") == torch.device("cpu")
    assert a.check_device("cuda:1") == torch.device("cuda", 1)
    _raises(ValueError, lambda: a.check_device("gpu0", "to"), "to='gpu0' is not a device")
    _raises(
        TypeError,
        lambda: a.check_device(0, "to"),
        "to must be a torch.device, a device name such as 'cpu', or None; got int 0",
    )


# ------------------------------------------------------------------- defaults and duck-typed values


class _Duck:
    """An array-like with a shape, a dtype and a float(): real_number decides by shape and dtype, not
    by whether float() happens to work (torch and numpy refuse some of these themselves)."""

    def __init__(self, shape, dtype):
        if shape is not None:
            self.shape = shape
        if dtype is not None:
            self.dtype = dtype

    def __float__(self) -> float:
        return 1.0


def test_real_number_decides_by_shape_and_dtype():
    assert a.real_number(_Duck((1,), "float32")) == 1.0
    assert a.real_number(_Duck((1, 1), "int8")) == 1.0
    for shape, dtype in [
        ((2,), "float32"),
        ((0,), "float32"),
        ((1,), "complex64"),
        ((1,), "bool"),
        ((1,), None),
        (None, "float32"),
    ]:
        assert a.real_number(_Duck(shape, dtype)) is None, (shape, dtype)


def test_default_names_and_bounds():
    _raises(TypeError, lambda: a.check_device(0), "device must be a torch.device")
    _raises(TypeError, lambda: a.check_state(None), "state must be an EmaState")
    assert a.check_optional_int(0, "n") == 0  # minimum 0 by default
    msg = _raises(
        ValueError, lambda: a.check_optional_real(math.nan, "lr"), "lr must be a number in [-inf, inf], got nan"
    )
    assert "(-inf" not in msg
    _raises(TypeError, lambda: a.check_optional_real("a", "lr"), "lr must be a real number, got str 'a'")


def test_check_device_shows_torchs_reason_cut_to_one_short_line():
    msg = _raises(
        ValueError, lambda: a.check_device("gpu0"), "device='gpu0' is not a device: Invalid device string: 'gpu0'"
    )
    long = "x" * 300
    msg = _raises(ValueError, lambda: a.check_device(long), f"device='{long}' is not a device: Expected one of cpu")
    reason = msg.split(" is not a device: ", 1)[1]
    assert len(reason) == 120 and "\n" not in reason, reason


def test_check_reals_returns_float64_and_shows_four_bad_entries():
    for value in (torch.tensor([0.5], dtype=torch.float32), torch.tensor([2], dtype=torch.int64), [1, 2], 3):
        out = a.check_reals(value, "s", scalar=True)
        assert out.dtype == np.float64, (value, out.dtype)
    _raises(ValueError, lambda: a.check_reals([-1, -2, -3, -4, -5], "s", low=0.0), "got [-1.0, -2.0, -3.0, -4.0]")
    msg = _raises(ValueError, lambda: a.check_reals([-1, -2, -3, -4, -5], "s", low=0.0))
    assert msg.endswith("got [-1.0, -2.0, -3.0, -4.0]"), msg
    _raises(
        TypeError,
        lambda: a.check_reals(0.5, "s"),
        "s must be a sequence of real numbers (a list, tuple, numpy array or tensor), got float 0.5",
    )
    _raises(TypeError, lambda: a.check_reals({"a": 1}, "s"), "got dict {'a': 1}")
