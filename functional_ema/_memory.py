"""Large host buffers that are written once right after allocation: backed by transparent huge pages.

Fresh memory from the OS is mapped lazily: the first write to each 4 KiB page takes a page fault
that zeroes it. For a buffer that is filled once right away (a loaded or consolidated EMA, the
async save's snapshot, a new EMA) those faults cost several times the copy itself (figures in
docs/performance.md). Linux backs a mapping with 2 MiB pages on request (``madvise(MADV_HUGEPAGE)``,
honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``), 512
times fewer faults. PyTorch offers the same for all its CPU allocations behind the environment
variable ``THP_MEM_ALLOC_ENABLE=1``; here it is asked for only on the buffers that benefit.

Best effort: no effect off Linux, on CUDA or pinned memory, for buffers under 4 MiB (which hold
at most one aligned 2 MiB page), or where the kernel refuses the advice. It never changes values.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["advise_huge_pages", "empty"]

_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
_MIN_BYTES = 4 << 20


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise``, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back ``t``'s whole 2 MiB pages with huge pages; call it before first touch.

    Returns whether the advice was given (and accepted). Memory already touched keeps its pages.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes < _MIN_BYTES or t.device.type != "cpu" or t.is_pinned():
        return False
    fn = _madvise()
    if fn is None:
        return False
    lo = -(-t.data_ptr() // _HUGE) * _HUGE  # whole huge pages inside the tensor only
    hi = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty(
    shape: int | Sequence[int], dtype: torch.dtype, device: torch.device | str | None = None, pin_memory: bool = False
) -> torch.Tensor:
    """``torch.empty`` for a buffer about to be filled whole: huge pages when it is large CPU memory."""
    t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    advise_huge_pages(t)
    return t
