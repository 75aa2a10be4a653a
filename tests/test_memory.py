"""Huge-page advice for large fresh host buffers (functional_ema._memory)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from functional_ema import _memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _anon_huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings overlapping ``t``'s memory (from /proc/self/smaps; the advice
    splits the tensor's mapping, so its whole 2 MiB pages form a mapping of their own)."""
    lo_t, hi_t = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < hi_t and lo_t < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_small_pinned_and_non_cpu_buffers_are_left_alone():
    assert _memory.advise_huge_pages(torch.empty(1 << 18)) is False  # 1 MiB: no whole 2 MiB page inside
    assert _memory.advise_huge_pages(torch.empty(0)) is False
    assert _memory.advise_huge_pages(torch.empty(4 << 20, device="meta")) is False


def test_empty_matches_torch_empty_and_keeps_values():
    t = _memory.empty((3, 5 << 18), dtype=torch.float32)
    assert t.shape == (3, 5 << 18) and t.dtype == torch.float32 and t.is_contiguous() and not t.is_pinned()
    src = torch.randn(t.shape)
    t.copy_(src)
    assert torch.equal(t, src)
    again = torch.arange(16 << 20, dtype=torch.uint8)
    assert _memory.advise_huge_pages(again) in (True, False)  # advice on touched memory changes nothing
    assert torch.equal(again, torch.arange(16 << 20, dtype=torch.uint8))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
    reason="needs Linux with transparent huge pages enabled (madvise or always)",
)
def test_large_fresh_buffer_is_backed_by_huge_pages():
    t = _memory.empty(64 << 18, dtype=torch.float32)  # 64 MiB, a fresh mapping
    assert _memory.advise_huge_pages(t) is True
    t.fill_(1.0)  # first touch: the kernel faults it in with 2 MiB pages
    huge = _anon_huge_kib(t)
    assert huge >= 32 << 10, f"only {huge} KiB of the 64 MiB buffer is on huge pages"
    assert torch.equal(t, torch.ones_like(t))
