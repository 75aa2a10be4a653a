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


def _mappings(t: torch.Tensor) -> list[tuple[int, int, int, set[str]]]:
    """``(start, end, AnonHugePages KiB, VmFlags)`` of each mapping overlapping ``t``'s memory, from
    /proc/self/smaps (the advice splits the tensor's mapping: its whole 2 MiB pages form a mapping of their own)."""
    lo_t, hi_t = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    out: list[tuple[int, int, int, set[str]]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            out.append((lo, hi, 0, set()))
        elif out and head == "AnonHugePages:":
            lo, hi, _, flags = out[-1]
            out[-1] = (lo, hi, int(line.split()[1]), flags)
        elif out and head == "VmFlags:":
            lo, hi, kib, _ = out[-1]
            out[-1] = (lo, hi, kib, set(line.split()[1:]))
    return [m for m in out if m[0] < hi_t and lo_t < m[1]]


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
    t.fill_(1.0)  # first touch: the kernel faults it in with 2 MiB pages where it finds them free
    maps = _mappings(t)
    # The advice itself, deterministic: every whole 2 MiB page of the buffer lies in a mapping marked "hg"
    # (MADV_HUGEPAGE), and that covers at least 62 of the 64 MiB.
    advised = sum(hi - lo for lo, hi, _, flags in maps if "hg" in flags)
    assert advised >= 62 << 20, f"only {advised >> 20} MiB of the 64 MiB buffer advised: {maps}"
    # How many huge pages the kernel found free at the first touch depends on how fragmented memory is then
    # (24 of 64 MiB under a full test run, 64 on a quiet machine): some, not all.
    huge = sum(kib for _, _, kib, _ in maps)
    assert huge >= 2 << 10, f"no 2 MiB page backs the advised buffer ({huge} KiB): {maps}"
    assert torch.equal(t, torch.ones_like(t))
