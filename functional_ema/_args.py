"""Argument checks at the door: one wording for each odd value, raised where the argument enters.

The verbs and the framework integrations (:class:`functional_ema.integrations._common.EMAController`,
the Lightning, Transformers and Accelerate callbacks) call these at construction or at the call,
before anything is allocated, gathered or written, so a bad value is refused with its parameter's
name instead of hours later at the first update or save. The step and decay checks are the ones
:func:`functional_ema.update` applies (:func:`check_step` here, :func:`functional_ema.schedules.check_decay`
and :func:`~functional_ema.schedules.check_decays` beside the schedules); nothing re-implements them.
This module is a leaf: it imports nothing else of the package at import time.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "MAX_STEP",
    "check_step",
    "real_number",
    "check_bool",
    "check_device",
    "check_present_device",
    "check_real",
    "check_state",
    "check_int",
    "check_mapping",
    "check_optional_int",
    "check_optional_real",
    "check_path",
    "refuse_url",
    "check_reals",
    "check_sequence",
    "check_rank",
    "check_str",
]

#: The largest step the int64 step counter holds.
MAX_STEP = 2**63 - 1


def check_step(step: Any, what: str = "step") -> int:
    """An int step (numpy / torch integer scalars accepted); bools, floats and strings refused."""
    if isinstance(step, bool):
        raise TypeError(f"{what} must be an int, got a bool ({step!r})")
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype.is_floating_point or step.dtype == torch.bool or step.is_complex():
            raise TypeError(f"{what} must be an int, got a tensor of dtype {step.dtype} and shape {tuple(step.shape)}")
        step = step.item()
    try:
        value = operator.index(step)  # ints and integer scalars only: 2.7 and "5" fail here
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(step).__name__} {step!r}") from None
    if not 0 <= value <= MAX_STEP:
        raise ValueError(f"{what}={value} is outside [0, 2**63 - 1]")
    return value


def real_number(value: Any) -> float | None:
    """``value`` as a float when it is one real number (an int or float, a numpy scalar, a
    one-element real tensor or array); ``None`` for anything else (``None``, strings, bools,
    complex numbers, tensors of several elements)."""
    if type(value) is float:
        return value
    if isinstance(value, (bool, str, bytes)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or math.prod(shape) != 1 or "complex" in str(dtype) or "bool" in str(dtype):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def check_int(value: Any, what: str, *, minimum: int = 0) -> int:
    """``value`` as an int in ``[minimum, 2**63 - 1]``: Python, numpy and torch integer scalars (0-d or
    one-element integer tensors) accepted; bools, floats, strings, ``None`` and containers refused
    (``TypeError``), out-of-range values too (``ValueError``), each naming ``what`` and the value."""
    if isinstance(value, int) and not isinstance(value, bool) and minimum <= value < 2**63:
        return value  # the usual case, without the general parsing
    number = check_step(value, what)  # the int64 step rule of update(): integer scalars only, in [0, 2**63 - 1]
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return number


def check_optional_int(value: Any, what: str, *, minimum: int = 0) -> int | None:
    """``None``, or :func:`check_int` of ``value``."""
    return None if value is None else check_int(value, what, minimum=minimum)


def check_rank(value: Any, what: str, world_size: int) -> int:
    """``value`` as a rank in ``[0, world_size)`` (an int; bools refused), naming ``what`` and the world."""
    rank = check_int(value, what)
    if rank >= world_size:
        raise ValueError(
            f"{what}={rank} is not a rank of the group: it has {world_size} rank(s), 0 to {world_size - 1}"
        )
    return rank


def check_bool(value: Any, what: str) -> bool:
    """``value`` if it is a ``bool`` (numpy bools too); ``TypeError`` for anything else (``1``, ``"no"``, ``None``):
    a truthy string would otherwise switch a behaviour on silently."""
    if isinstance(value, bool):
        return value
    if isinstance(value, np.bool_):  # not by name: numpy 2 names the type "bool", numpy 1 "bool_"
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {type(value).__name__} {value!r}")


def check_str(value: Any, what: str) -> str:
    """``value`` if it is a ``str``; ``TypeError`` naming ``what`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    return value


def check_path(value: Any, what: str, *, url_hint: str = "") -> Path:
    """``value`` (a ``str`` or ``os.PathLike``, not empty) as a ``Path``; ``TypeError``/``ValueError`` naming ``what``.
    An fsspec URL is refused (:func:`refuse_url`, with ``url_hint``): ``Path("s3://b/x")`` is the local ``s3:/b/x``.
    A ``file:///abs/dir`` URL is the local path it names (``Path`` would make it the relative folder ``file:``)."""
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text and "\x00" not in text:
            refuse_url(text, what, url_hint)
            return Path(_file_url_path(text, what))
        raise ValueError(f"{what} must name a file or folder, got {value!r}")
    raise TypeError(f"{what} must be a path (a str or os.PathLike), got {type(value).__name__} {value!r}")


def _file_url_path(text: str, what: str) -> str:
    """``text``, or the local path it names when it is a ``file://`` URL (``ValueError`` naming ``what`` when that
    URL names no local path)."""
    from ._storage import file_url_path

    try:
        local = file_url_path(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return text if local is None else local


def refuse_url(value: Any, what: str, url_hint: str = "") -> None:
    """``ValueError`` naming ``what`` and the URL when ``value`` is an fsspec URL (``s3://bucket/x``) where only a
    local path is taken; ``url_hint`` says what takes one instead (default: write or read locally, then copy)."""
    from ._storage import is_url, redact_url

    if isinstance(value, str) and is_url(value):
        instead = url_hint or "use a local path, and copy the files to or from the URL with fsspec"
        raise ValueError(f"{what} takes a local path, got the fsspec URL {redact_url(value)!r}: {instead}")


def check_location(value: Any, what: str) -> Path | str:
    """A folder (``check_path``: a ``Path``; a ``file:///abs/dir`` URL is that folder) or an fsspec URL such as
    ``s3://bucket/run`` (returned as a ``str``, its scheme in lower case: a ``Path`` would fold its ``//`` and
    name a local folder ``s3:``; one with ``.`` or ``..`` parts is refused, see ``_storage.normalize_url``)."""
    from ._storage import is_url, normalize_url, redact_url

    if isinstance(value, str) and is_url(value):
        if "\x00" in value:
            raise ValueError(f"{what} must name a folder or a URL, got {redact_url(value)!r}")
        try:
            return normalize_url(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return check_path(value, what)


def check_storage_options(value: Any, location: Path | str, what: str) -> dict[str, Any]:
    """``storage_options`` (fsspec's arguments for a URL: ``key``, ``secret``, ``endpoint_url``, ...) as a
    dict; ``None`` is ``{}``. Refused for a local folder, where nothing would read them."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"{what} must be a dict of fsspec arguments with str keys (or None), got {type(value).__name__}"
        )
    if value and not isinstance(location, str):
        raise TypeError(f"{what} are for fsspec URLs (s3://...); {os.fspath(location)!r} is a local folder")
    return dict(value)


def check_state(state: Any, what: str = "state") -> Any:
    """``state`` if it is an :class:`functional_ema.EmaState` (from ``init_ema`` or ``load``); else a ``TypeError``."""
    from ._state import EmaState

    if not isinstance(state, EmaState):
        raise TypeError(
            f"{what} must be an EmaState (from functional_ema.init_ema or functional_ema.load), got "
            f"{type(state).__name__}"
        )
    return state


def check_device(device: Any, what: str = "device") -> torch.device | None:
    """``None``, or ``device`` (a ``torch.device`` or its name, e.g. ``"cpu"``, ``"cuda:0"``) as a ``torch.device``."""
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"{what} must be a torch.device, a device name such as 'cpu', or None; got {type(device).__name__} {device!r}"
        )
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{what}={device!r} is not a device: {str(e).splitlines()[0][:120]}") from None


def check_present_device(device: Any, what: str = "device") -> torch.device | None:
    """:func:`check_device`, and a device this machine has: a ``ValueError`` naming ``what`` for ``"cuda"`` without
    CUDA or ``"cuda:3"`` with 2 GPUs, where memory is about to be allocated on it (before torch's own error, an
    ``AssertionError`` for CUDA on a CPU build, escapes from an allocation that names no argument)."""
    checked = check_device(device, what)
    kind = checked.type if checked is not None else "cpu"
    backend = getattr(torch, kind, None) if kind not in ("cpu", "meta") else None  # torch.cuda, torch.xpu, ...
    available = getattr(backend, "is_available", None)
    if checked is None or available is None:
        return checked  # no runtime module to ask: the allocation says what it says
    if not available():
        raise ValueError(
            f"{what}={device!r}: no {kind} device is available here (torch.{kind}.is_available() is False); "
            "pass 'cpu', or None for each tensor's own device"
        )
    count = getattr(backend, "device_count", None)
    if checked.index is not None and count is not None and checked.index >= count():
        raise ValueError(
            f"{what}={device!r} is not available: this machine has {count()} {kind} device(s), 0 to {count() - 1}"
        )
    return checked


def check_real(
    value: Any, what: str, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` when ``low_open``): ints, floats, numpy
    scalars and one-element real tensors accepted; bools, strings, ``None``, containers and NaN refused."""
    real = None if isinstance(value, bool) else real_number(value)
    if real is None:
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r:.60}")
    if (
        not (math.isfinite(real) or (real == high == math.inf))
        or real > high
        or real < low
        or (low_open and real == low)
    ):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{what} must be a number in {bounds}, got {real!r}")
    return real


def check_optional_real(
    value: Any, what: str, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False
) -> float | None:
    """``None``, or :func:`check_real` of ``value``."""
    return None if value is None else check_real(value, what, low=low, high=high, low_open=low_open)


def check_reals(
    value: Any,
    what: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    scalar: bool = False,
) -> np.ndarray:
    """``value`` (a list or tuple of real numbers, a real numpy array or tensor; one real number too when
    ``scalar``) as a float64 numpy array of its shape, every entry finite and in ``[low, high]``
    (``(low, high]`` when ``low_open``). ``TypeError`` for ``None``, strings, bools, dicts, a lone number
    where a sequence is expected and non-numeric entries; ``ValueError`` for NaN, infinities and entries out
    of range; each names ``what`` (and the entry)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{what} must hold real numbers, got a {value.dtype} tensor")
        array = value.detach().cpu().to(torch.float64).numpy()
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iuf":
            raise TypeError(f"{what} must hold real numbers, got a numpy array of dtype {value.dtype}")
        array = value.astype(np.float64)
    elif isinstance(value, (list, tuple)):
        entries = []
        for i, v in enumerate(value):
            real = None if isinstance(v, bool) else real_number(v)
            if real is None:
                raise TypeError(f"{what}[{i}] must be a real number, got {type(v).__name__} {v!r:.60}")
            entries.append(real)
        array = np.asarray(entries, dtype=np.float64)
    elif scalar and not isinstance(value, bool) and real_number(value) is not None:
        array = np.asarray(real_number(value), dtype=np.float64)
    else:
        kinds = "a real number or " if scalar else ""
        raise TypeError(
            f"{what} must be {kinds}a sequence of real numbers (a list, tuple, numpy array or tensor), got "
            f"{type(value).__name__} {value!r:.60}"
        )
    bad = ~np.isfinite(array) | (array < low) | (array > high) | ((array == low) if low_open else False)
    if np.any(bad):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{what} must hold finite numbers in {bounds}, got {array[bad].reshape(-1)[:4].tolist()}")
    return array


def check_sequence(value: Any, what: str, *, nonempty: bool = True) -> list[Any]:
    """``value`` (a list or tuple) as a list; ``TypeError`` for anything else (a lone item, a string, a dict,
    ``None``), ``ValueError`` when empty and ``nonempty``; each names ``what``."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list or tuple, got {type(value).__name__} {value!r:.60}")
    if nonempty and not value:
        raise ValueError(f"{what} is empty: give at least one")
    return list(value)


def check_mapping(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping (a ``dict``, a state dict); ``TypeError`` naming ``what`` otherwise."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping (a dict), got {type(value).__name__} {value!r:.60}")
    return value
