"""How one :func:`functional_ema.update` runs: the fused ``lerp_`` calls of one (EMA, weights) pair.

An EMA update is pure memory traffic (read the EMA and the weights, write the EMA: 12 bytes per fp32
element), so the plan aims at the fewest, largest ``lerp_`` calls over contiguous memory:

* A *fused run*: leaves that are views of one source buffer (DeepSpeed's flat ZeRO partitions) and
  whose EMAs sit at the same relative offsets in one EMA buffer made by ``init_ema`` become a single
  ``lerp_`` over the whole span, alignment gaps included (the EMA buffer mirrors them).
* Several EMAs: the span is cut into chunks and the K ``lerp_`` calls of a chunk run back to back, so
  the weights are read from memory once and from cache K-1 times: 4 + 8K bytes per element instead
  of 12K.
* Everything else (arbitrary trees) runs per tensor, grouped by (device, dtype) into one
  ``torch._foreach_lerp_`` call each.
* Where the EMA has another device (a pinned CPU EMA of CUDA weights) or dtype than the weights,
  chunks of the weights are first copied into a staging buffer: on a CUDA side stream, double
  buffered, so the copy of chunk i+1 overlaps the CPU ``lerp_`` of chunk i.

All of these give bitwise the same numbers as ``ema.lerp_(shard, 1 - decay)`` per tensor: lerp is
elementwise and its vectorised and scalar code paths agree (checked in ``tests/test_core.py``).

A plan holds views of the tensors it was built from and nothing else: no registry, no cache. The
caller keeps it with the immutable objects it was built from (see ``_core``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Plan"]

# Several EMAs are updated chunk by chunk; a chunk of the weights must still be in cache when the
# K-th EMA reads it. Swept 32 Ki..2 Mi elements on a 2-core EPYC (512 KiB L2 per core, 32 MiB L3),
# K=2, fp32, 5.6M elements, 1 thread per rank, 2 ranks: 256 Ki elements (1 MiB) was the most
# consistent (1.06-1.19x a flat lerp_ moving the same bytes; two full passes: 1.16-1.32x). Smaller
# chunks pay per-call overhead, larger ones lose the cache. With several intra-op threads each
# chunk is split between them, and every chunk is one OpenMP parallel region (tens of us each,
# milliseconds when the cores are oversubscribed), so the chunk grows with the thread count.
_CHUNK_ELEMENTS = 1 << 18
# Chunks copied through a staging buffer (device-to-host or dtype conversion). 4 MiB of fp32: large
# enough that the per-chunk cost (copy launch, event wait) is small next to the copy itself.
_STAGE_CHUNK_ELEMENTS = 1 << 20

# On these devices a group of lerps runs as one torch._foreach_lerp_ call. On CPU it was ~3x faster
# than a Python loop of lerp_ for 520 small tensors and as fast for large ones (torch 2.13, 1
# thread); on CUDA it is the fused multi-tensor kernel. Other devices loop over lerp_.
_FOREACH_DEVICES = frozenset({"cpu", "cuda"})


# The tensor types a plan may lerp under inference mode (see Plan.finish): exactly these, no other subclass.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _needs_staging(src: torch.Tensor, ema: torch.Tensor) -> bool:
    """Whether the weights must be copied (and converted) before ``ema`` can lerp towards them.

    Tests patch this to send same-device fp32 runs through the staging code on CPU.
    """
    return src.device != ema.device or src.dtype != ema.dtype


def _chunk_elements() -> int:
    # Each intra-op thread gets _CHUNK_ELEMENTS of every chunk (ATen splits a lerp_ evenly).
    return _CHUNK_ELEMENTS * max(1, torch.get_num_threads())


# -------------------------------------------------------------------------------------- execution


class _Group:
    """Lerps on one (device, dtype): ``emas[j].lerp_(srcs[j], weights[ks[j]])`` for all j, in order."""

    def __init__(self, device: torch.device) -> None:
        self.foreach = device.type in _FOREACH_DEVICES
        self.emas: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.ks: list[int] = []
        self._weights_for: tuple | None = None  # (weights, per-item weights) of the last call
        self._num_emas = 0

    def add(self, emas: list[torch.Tensor], src: torch.Tensor, chunk: int) -> None:
        """Lerp every EMA in ``emas`` (EMA k at index k) towards ``src``.

        With several EMAs and a contiguous 1-D ``src`` longer than ``chunk``, the work is interleaved
        chunk by chunk (EMA 0 and 1 on chunk 0, then on chunk 1, ...) so each chunk of ``src`` is
        read from memory once.
        """
        self._num_emas = max(self._num_emas, len(emas))
        n = src.numel()
        if len(emas) > 1 and n > chunk and src.is_contiguous() and all(e.is_contiguous() for e in emas):
            src, emas, step = src.view(-1), [e.view(-1) for e in emas], chunk
        else:
            # The tensors as they are: a view (``.view(-1)``) would cost every in-place lerp_ its view
            # bookkeeping, about 40 ns a tensor, ~8% of the dispatch of a 516-tensor _foreach_lerp_.
            step = max(n, 1)
        for lo in range(0, n, step):
            m = min(step, n - lo)
            s = src if m == n else src.narrow(0, lo, m)
            for k, e in enumerate(emas):
                self.emas.append(e if m == n else e.narrow(0, lo, m))
                self.srcs.append(s)
                self.ks.append(k)

    def run(self, weights: Sequence[float]) -> None:
        if len(self.emas) == 1:  # one fused span: a plain lerp_ has less to dispatch
            self.emas[0].lerp_(self.srcs[0], weights[self.ks[0]])
            return
        if not self.emas:
            return
        if self._num_emas == 1:
            ws: Any = weights[0]
        elif self._weights_for is not None and self._weights_for[0] == tuple(weights):
            ws = self._weights_for[1]  # the usual case: constant decays give the same weights
        else:
            ws = [weights[k] for k in self.ks]
            self._weights_for = (tuple(weights), ws)
        if self.foreach:
            torch._foreach_lerp_(self.emas, self.srcs, ws)
        else:
            for j, (e, s) in enumerate(zip(self.emas, self.srcs)):
                e.lerp_(s, ws if self._num_emas == 1 else ws[j])


class _CopyStager:
    """Stages chunks with plain copies on the current stream (synchronous on CPU).

    Used for a dtype conversion on one device, and as the CPU stand-in for :class:`_CudaToHost`:
    same chunk and double-buffer bookkeeping, so tests on CPU run the same pipeline.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> None:
        self.bufs = [torch.empty(numel, dtype=dtype, device=device, pin_memory=pin) for _ in range(2)]

    def begin(self) -> None:
        pass

    def start(self, i: int, src: torch.Tensor) -> None:
        """Start copying chunk ``i`` into buffer ``i % 2`` (last used by chunk ``i - 2``, done)."""
        self.bufs[i % 2][: src.numel()].copy_(src)

    def wait(self, i: int, numel: int) -> torch.Tensor:
        return self.bufs[i % 2][:numel]


class _CudaToHost(_CopyStager):
    """Device-to-host staging on a side stream into pinned buffers, so the copy of chunk i+1 runs
    while the CPU lerps chunk i. Constructed only when the weights are on a CUDA device."""

    def __init__(self, numel: int, dtype: torch.dtype, src_device: torch.device) -> None:
        super().__init__(numel, dtype, torch.device("cpu"), pin=True)
        self.src_device = src_device
        self.stream = torch.cuda.Stream(src_device)
        self.events = [torch.cuda.Event(), torch.cuda.Event()]

    def begin(self) -> None:
        # The weights are final only once the work queued so far (the optimizer step) has run.
        self.stream.wait_stream(torch.cuda.current_stream(self.src_device))

    def start(self, i: int, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            self.bufs[i % 2][: src.numel()].copy_(src, non_blocking=True)
            self.events[i % 2].record(self.stream)

    def wait(self, i: int, numel: int) -> torch.Tensor:
        self.events[i % 2].synchronize()
        return self.bufs[i % 2][:numel]


def _make_stager(numel: int, src: torch.Tensor, ema: torch.Tensor) -> _CopyStager:
    if src.device.type == "cuda" and ema.device.type == "cpu" and torch.cuda.is_available():
        return _CudaToHost(numel, ema.dtype, src.device)
    return _CopyStager(numel, ema.dtype, ema.device)


class _Staged:
    """Chunks whose weights are copied through a stager before the EMAs lerp towards them."""

    def __init__(self) -> None:
        self.stager: _CopyStager | None = None  # made at the first run, sized to the largest chunk
        self.chunks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (weights chunk, EMA k chunks)
        self.spans: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # the same, uncut (queued updates)

    def add(self, emas: list[torch.Tensor], src: torch.Tensor, chunk: int) -> None:
        self.spans.append((src, emas))
        n = src.numel()
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            self.chunks.append((src.narrow(0, lo, m), [e.narrow(0, lo, m) for e in emas]))

    def run(self, weights: Sequence[float]) -> None:
        chunks, stager = self.chunks, self.stager
        if not chunks:
            return
        if stager is None:
            src, emas = chunks[0]
            stager = self.stager = _make_stager(max(c[0].numel() for c in chunks), src, emas[0])
        stager.begin()
        stager.start(0, chunks[0][0])
        for i, (src, emas) in enumerate(chunks):
            if i + 1 < len(chunks):
                stager.start(i + 1, chunks[i + 1][0])  # overlaps the lerps below on CUDA
            staged = stager.wait(i, src.numel())
            for k, e in enumerate(emas):
                e.lerp_(staged, weights[k])


class Plan:
    """The lerp calls of one update, over tensors of one (state, shards) pair.

    Attributes:
        groups: same-device, same-dtype lerps, one ``_foreach_lerp_`` per (device, dtype).
        staged: fused spans and contiguous leaves whose weights are staged (other device or dtype).
        converted: ``(ema, weights, k)`` for the remaining leaves of another device or dtype.
        spans, staged_spans: tensors or fused spans scheduled, and how many of them are staged.
    """

    def __init__(self) -> None:
        self.groups: dict[tuple, _Group] = {}
        self.staged: dict[tuple, _Staged] = {}
        self.converted: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.no_grad = False  # run under torch.no_grad() (the tensors may require grad)
        self.inference = False  # may run under torch.inference_mode() (see finish())
        self.spans = 0  # tensors or fused spans scheduled (non-empty)
        self.staged_spans = 0  # of those, staged through a copy (another device or dtype)
        self.single: tuple | None = None  # (bound lerp_ of the EMA span, weights span), see finish()
        self.offload: Any = None  # the engine and snapshot of queued updates (_offload), made at the first one

    def add(self, emas: list[torch.Tensor], src: torch.Tensor) -> None:
        """Schedule ``emas[k].lerp_(src, w_k)`` for each k (one leaf or one fused span)."""
        if src.numel() == 0:
            return
        self.spans += 1
        e0 = emas[0]
        if not _needs_staging(src, e0):  # _Group.add flattens only what it cuts into chunks
            key = (src.device, src.dtype)
            if key not in self.groups:
                self.groups[key] = _Group(src.device)
            self.groups[key].add(emas, src, _chunk_elements())
            return
        if src.is_contiguous() and all(e.is_contiguous() for e in emas):  # staged chunk by chunk, as 1-D
            src, emas = src.view(-1), [e.view(-1) for e in emas]
            self.staged_spans += 1
            staged_key = (src.device, e0.device, e0.dtype)
            if staged_key not in self.staged:
                self.staged[staged_key] = _Staged()
            self.staged[staged_key].add(emas, src, _STAGE_CHUNK_ELEMENTS)
        else:
            self.converted.extend((e, src, k) for k, e in enumerate(emas))

    def add_same_kind(self, ema_lists: list[list[torch.Tensor]], srcs: list[torch.Tensor]) -> None:
        """Schedule ``ema_lists[k][i].lerp_(srcs[i], w_k)`` for tensors that all share the EMAs'
        device and dtype: appended to one group as they are, without per-tensor planning."""
        if not srcs:
            return
        device, dtype = srcs[0].device, srcs[0].dtype
        group = self.groups.get((device, dtype))
        if group is None:
            group = self.groups[(device, dtype)] = _Group(device)
        group._num_emas = max(group._num_emas, len(ema_lists))
        for k, emas in enumerate(ema_lists):
            group.emas.extend(emas)
            group.srcs.extend(srcs)
            group.ks.extend([k] * len(srcs))
        self.spans += sum(1 for t in srcs if t.numel())

    def finish(self) -> None:
        """Called once built: notes whether the whole update is a single ``lerp_`` (see run)."""
        groups = list(self.groups.values())
        single = len(groups) == 1 and len(groups[0].emas) == 1 and not self.staged and not self.converted
        self.single = (groups[0].emas[0].lerp_, groups[0].srcs[0]) if single else None
        # In-place lerps of plain tensors, nothing allocated: under inference mode each lerp_ of a
        # _foreach_lerp_ skips autograd's dispatch (about 35 ns a tensor on CPU, same kernel, same
        # bits; version counters still move). An nn.Parameter is a plain tensor to it (a dict of a model's
        # parameters; an EMA made under inference mode can only be written there). Not for other subclasses
        # (DTensor...) nor staged copies, whose buffers would become inference tensors.
        self.inference = (
            not self.staged
            and not self.converted
            and all(type(t) in _PLAIN for g in groups for t in (*g.emas, *g.srcs))
        )

    def run(self, weights: Sequence[float]) -> None:
        """All lerps, in place: EMA k moves towards the weights by ``weights[k]``.

        A weight of exactly 1 (decay 0) copies the weights: ``lerp`` would keep a NaN or inf that the
        EMA holds, and decay 0 means "the EMA is the weights".
        """
        if 1.0 in weights:
            self._run_with_copies(weights)
            return
        if self.single is not None:  # one fused span, one EMA: the usual DeepSpeed case
            self.single[0](self.single[1], weights[0])
            return
        for group in self.groups.values():
            group.run(weights)
        for staged in self.staged.values():
            staged.run(weights)
        for e, s, k in self.converted:
            e.lerp_(s.to(device=e.device, dtype=e.dtype), weights[k])

    def _run_with_copies(self, weights: Sequence[float]) -> None:
        for group in self.groups.values():
            for e, s, k in zip(group.emas, group.srcs, group.ks):
                e.copy_(s) if weights[k] == 1.0 else e.lerp_(s, weights[k])
        for staged in self.staged.values():
            for s, emas in staged.chunks:
                for k, e in enumerate(emas):
                    e.copy_(s) if weights[k] == 1.0 else e.lerp_(s.to(device=e.device, dtype=e.dtype), weights[k])
        for e, s, k in self.converted:
            e.copy_(s) if weights[k] == 1.0 else e.lerp_(s.to(device=e.device, dtype=e.dtype), weights[k])
