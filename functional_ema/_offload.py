"""``update(..., blocking=False)``: the update of a CPU EMA of GPU weights, queued instead of run.

The blocking update of a pinned CPU EMA (``init_ema(..., device="cpu", pin_memory=True)``) copies
the weights to the host chunk by chunk and lerps each chunk on the CPU before it returns: the
training loop waits for the device-to-host copy of all of this rank's weights (134 ms for 702M
fp32 parameters on an H200). Queued, the same work is split in two:

* **At the call** (the training thread): a side stream waits for the work already queued on the
  current stream (the optimizer step that made the weights), then copies the weights into a pinned
  host *snapshot* (one copy of the weights, allocated once and reused) and records an event per
  chunk; the current stream waits for the copies (torchtitan's "parameters read" event), so a later
  in-place change to the weights (the next optimizer step) cannot run before they are read. Then
  the lerps are handed to a worker thread, and the call returns.
* **On the worker thread**: for each chunk, wait for its copy event, then the same ``lerp_`` calls
  as the blocking path, in the same order, on the same values: the EMA is bitwise the blocking
  update's.

The next reader of the state waits for the worker: :func:`functional_ema._state.wait_pending`,
called by :func:`functional_ema.update` and by ``_fit.state_problem``, through which ``save``,
``AsyncSaver.save``, ``swapped``, ``gather_full``, ``load(out=)`` and the integrations check a state
before they touch it. A failure on the worker is raised there, once, as :class:`AsyncUpdateError`.

The stream and thread work sits behind :class:`CopyEngine`, so the ordering logic runs (and is
tested) on a machine without a GPU: :class:`ThreadCopyEngine` copies at the call and lerps on a
thread. Without CUDA weights nothing is queued: ``blocking=False`` runs the update at the call (the
CPU copy would cost about as much as the lerp it takes off the caller).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from ._plan import _STAGE_CHUNK_ELEMENTS, Plan
from ._state import PENDING_ATTR

__all__ = ["AsyncUpdateError", "CopyEngine", "CudaCopyEngine", "PendingUpdate", "ThreadCopyEngine", "queue_update"]

# Chunks of the weights copied at the call, each with its event: 8 Mi elements (32 MiB of fp32).
# Large enough that the per-chunk launch and event record (~10 us) is < 2% of its PCIe time, small
# enough that the worker starts lerping after the first 32 MiB instead of after the whole copy.
_COPY_CHUNK_ELEMENTS = 1 << 23


class AsyncUpdateError(RuntimeError):
    """An update queued with ``update(..., blocking=False)`` failed on its worker thread.

    Raised once, by the next call that reads the state (``update``, ``save``, ``swapped``, ...);
    ``__cause__`` is the original exception. ``state.step`` is set back to the step before the
    failed update; the EMA values may be partly updated (reload them from a checkpoint).
    """


class CopyEngine(Protocol):
    """How a queued update copies the weights and runs its lerps.

    The call runs :meth:`begin`, :meth:`copy` per chunk, :meth:`release`, then :meth:`submit`; the
    submitted function calls :meth:`ready` on each chunk's token before reading its copy.
    """

    def snapshot_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer of ``numel`` elements that the copies go to (pinned for a GPU)."""
        ...

    def begin(self) -> None:
        """Order the copies after the work already queued that writes the weights."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying ``src`` (weights) into ``dst`` (a chunk of the snapshot); return a token."""
        ...

    def release(self) -> None:
        """Order the work queued after this call (which may overwrite the weights) after the copies."""
        ...

    def ready(self, token: Any) -> None:
        """Block (on the worker) until the copy that returned ``token`` is complete."""
        ...

    def submit(self, fn: Callable[[], None]) -> Future:
        """Run ``fn`` on the worker thread."""
        ...


class _Worker:
    """One worker thread, started at the first use (again in a forked child, which has no threads)."""

    def __init__(self) -> None:
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that started it, the thread)

    def submit(self, fn: Callable[[], None]) -> Future:
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="fe_offload_update"))
        return self._pool[1].submit(fn)


class _WorkerEngine:
    """What every engine shares: its own worker thread, on which :meth:`submit` runs the lerps.

    Written once here, so the CPU engine's tests run the same code as :class:`CudaCopyEngine`'s.
    """

    def __init__(self) -> None:
        self._worker = _Worker()

    def submit(self, fn: Callable[[], None]) -> Future:
        return self._worker.submit(fn)


class ThreadCopyEngine(_WorkerEngine):
    """The CPU stand-in: copies at the call (the snapshot), lerps on a worker thread.

    Used by the tests on machines without a GPU (same queueing, waiting and error paths as
    :class:`CudaCopyEngine`); ``snapshot_buffer`` is ordinary memory.
    """

    def snapshot_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def begin(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def release(self) -> None:
        pass

    def ready(self, token: Any) -> None:
        pass


class CudaCopyEngine(_WorkerEngine):
    """Device-to-host copies on a side stream of ``device``, lerps on a worker thread.

    Ordering (all queued at the call, none of it blocks the host):
      * the side stream waits for the current stream (the weights are final once the optimizer step
        queued on it has run);
      * each chunk is copied (``non_blocking``, into pinned memory) on the side stream and an event
        recorded after it; the worker's :meth:`ready` synchronises on that event alone;
      * the current stream waits for the side stream: whatever is queued after the call (the next
        optimizer step writing the weights in place) runs after the weights are read. This also
        covers the caching allocator: the weights' blocks belong to the current stream, so a block
        freed and reused there is reused after the copies (no ``record_stream`` needed). A dtype
        conversion's temporary is allocated on the side stream itself.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def snapshot_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def release(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def ready(self, token: Any) -> None:
        token.synchronize()


def engine_for(src: torch.Tensor, ema: torch.Tensor) -> CopyEngine | None:
    """The engine that queues updates of ``ema`` (a CPU EMA) towards ``src``, or ``None`` when they run
    at the call: only CPU EMAs of CUDA weights are queued. Tests patch this to queue on CPU."""
    if src.device.type == "cuda" and ema.device.type == "cpu" and torch.cuda.is_available():
        return CudaCopyEngine(src.device)
    return None


class PendingUpdate:
    """An update in flight, kept on ``state.step`` (see :data:`functional_ema._state.PENDING_ATTR`)."""

    def __init__(self, future: Future, counter: torch.Tensor, last: int, step: int) -> None:
        self.future, self.counter, self.last, self.step = future, counter, last, step

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        """Block until the worker is done; on its failure reset the step and raise :class:`AsyncUpdateError`."""
        error = self.future.exception()
        if error is not None:
            self.counter.fill_(self.last)
            raise AsyncUpdateError(
                f"the EMA update of step {self.step} queued by update(..., blocking=False) failed on its worker "
                f"thread: {type(error).__name__}: {error}. state.step was set back to {self.last}; the EMA values "
                "may be partly updated: load them from the last checkpoint"
            ) from error


class _Offload:
    """What a plan keeps for its queued updates: the engine and the snapshot buffers (made once)."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.snapshots: dict[int, torch.Tensor] = {}  # per staged group (by position in plan.staged)


def queue_update(plan: Plan, weights: Sequence[float], counter: torch.Tensor, last: int, step: int) -> bool:
    """Queue ``plan.run(weights)`` as described in the module docstring; ``False`` (nothing done) when the
    plan cannot be queued: it has lerps that need no copy, or no engine queues its copies.

    On ``True`` the update is in flight, recorded on ``counter`` (``state.step``); the caller sets the step.
    """
    if plan.groups or plan.converted or not plan.staged:
        return False
    offload = plan.offload
    if offload is None:
        staged = next(iter(plan.staged.values()))
        src, emas = staged.spans[0]
        engine = engine_for(src, emas[0])
        if engine is None:
            return False
        offload = plan.offload = _Offload(engine)
    engine = offload.engine
    items: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []  # (token, snapshot chunk, EMA chunks)
    engine.begin()
    with torch.no_grad():
        for g, staged in enumerate(plan.staged.values()):
            snapshot = offload.snapshots.get(g)
            if snapshot is None:
                total = sum(src.numel() for src, _ in staged.spans)
                snapshot = offload.snapshots[g] = engine.snapshot_buffer(total, staged.spans[0][1][0].dtype)
            pos = 0
            for src, emas in staged.spans:
                n = src.numel()
                for lo in range(0, n, _COPY_CHUNK_ELEMENTS):
                    m = min(_COPY_CHUNK_ELEMENTS, n - lo)
                    dst = snapshot.narrow(0, pos + lo, m)
                    token = engine.copy(dst, src.narrow(0, lo, m))
                    items.append((token, dst, [e.narrow(0, lo, m) for e in emas]))
                pos += n
    engine.release()
    future = engine.submit(lambda: _lerp_chunks(engine, items, tuple(weights)))
    setattr(counter, PENDING_ATTR, PendingUpdate(future, counter, last, step))
    return True


def _lerp_chunks(engine: CopyEngine, items: list, weights: tuple[float, ...]) -> None:
    """The worker: the blocking path's lerps (``_plan._Staged.run``: 1 Mi-element chunks, EMAs in order;
    a weight of 1 copies, as ``Plan._run_with_copies``) over each chunk once its copy is complete."""
    with torch.no_grad():  # grad mode is per thread
        for token, snap, emas in items:
            engine.ready(token)
            n = snap.numel()
            for lo in range(0, n, _STAGE_CHUNK_ELEMENTS):
                m = min(_STAGE_CHUNK_ELEMENTS, n - lo)
                s = snap if m == n else snap.narrow(0, lo, m)
                for k, e in enumerate(emas):
                    part = e if m == n else e.narrow(0, lo, m)
                    if weights[k] == 1.0:
                        part.copy_(s)
                    else:
                        part.lerp_(s, weights[k])
