"""The one shared multi-rank harness: real DeepSpeed engines in real processes (gloo on CPU).

``run_ranks("tests.workers_x:fn", world_size=2, **kwargs)`` starts ``world_size`` fresh Python
processes wired like ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR/PORT), calls ``fn(**kwargs)`` in
each after ``deepspeed.init_distributed("gloo")``, and returns the per-rank JSON-able results. A
failure on any rank raises ``AssertionError`` carrying that rank's traceback. Batch many checks into
one launch: a launch costs seconds, an extra engine in the same launch well under one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn

from functional_ema._testing import rank_pool

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from functional_ema._state import EmaState
    from functional_ema.schedules import DecayLike

#: A rank's process (output to a file: bytes).
RankProcess = subprocess.Popen[bytes] | rank_pool.PooledRank

# The source checkout (tests/ and examples/ live there): where this file sits in an editable install,
# else the directory the tests were started from.
ROOT = Path(__file__).resolve().parents[2] if (Path(__file__).resolve().parents[2] / "tests").is_dir() else Path.cwd()


#: Set for every rank unless the environment says otherwise: ranks never reach the hub (tests send traffic to
#: loopback only) and print no progress bars.
RANK_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extensions_dir() -> str:
    """Where DeepSpeed JIT-builds its CPU ops for this environment.

    The default ``~/.cache/torch_extensions`` is shared by every environment on the machine; two of
    them with different include paths rebuild the op on every launch (minutes). One per venv.
    """
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def run_ranks(
    target: str, world_size: int = 2, timeout: float = 600, env: dict[str, str] | None = None, **kwargs: Any
) -> list[Any]:
    """Run ``target`` ("module:function") on ``world_size`` ranks; return the list of results."""
    with tempfile.TemporaryDirectory(prefix="fe_ranks_") as tmp:
        args_path = Path(tmp) / "args.json"
        args_path.write_text(json.dumps({"target": target, "kwargs": kwargs}))
        # Each rank's async EMA saves must end by then (see _finish_async_saves); a little before the
        # parent's deadline, so that the rank reports it rather than being killed.
        deadline = time.time() + max(0.5 * timeout, timeout - 5)
        procs, log_paths = spawn_ranks(
            [sys.executable, "-c", "from functional_ema._testing.multirank import _child; _child()", str(args_path)],
            world_size,
            Path(tmp),
            env={"FE_DEADLINE": repr(deadline), **(env or {})},
            pooled=str(args_path),
        )
        try:
            wait_ranks(procs, log_paths, target, timeout)
        except AssertionError as e:  # add the errors the failed ranks reported
            errors = []
            for rank in range(world_size):
                path = Path(tmp) / f"result_{rank}.json"
                payload = json.loads(path.read_text()) if path.exists() else {}
                if "error" in payload:
                    errors.append(f"--- rank {rank} reported ---\n{payload['error']}")
            raise AssertionError("\n".join([str(e), *errors])) from None
        outputs = [_tail(path) for path in log_paths]
        results = []
        for rank, (p, out) in enumerate(zip(procs, outputs)):
            path = Path(tmp) / f"result_{rank}.json"
            payload = json.loads(path.read_text()) if path.exists() else None
            if payload is None or "error" in payload or p.returncode != 0:
                err = (payload or {}).get("error", "")
                raise AssertionError(
                    f"rank {rank} of {world_size} failed (exit {p.returncode}) in {target}:\n{err}\n--- output ---\n{out[-6000:]}"
                )
            results.append(payload["result"])
        return results


def spawn_ranks(
    argv: list[str],
    world_size: int,
    tmp: Path,
    env: dict[str, str] | None = None,
    pooled: str | None = None,
) -> tuple[list[RankProcess], list[Path]]:
    """Start ``argv`` once per rank, wired like ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...),
    each in its own process group (so :func:`kill_ranks` ends whatever a rank started too), its
    output in ``tmp/output_<rank>.txt``. ``env`` is added last. Returns the processes and log paths.

    ``pooled``: ``argv`` is :func:`_child` of the JSON file ``pooled``; the ranks are then forked from the
    warm :mod:`~functional_ema._testing.rank_pool` where it may serve them (the same run, without each rank
    importing torch and DeepSpeed again)."""
    port = _free_port()
    procs: list[RankProcess] = []
    log_paths: list[Path] = []
    for rank in range(world_size):
        penv = dict(os.environ)
        penv.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=penv.get("OMP_NUM_THREADS", "1"),
            PYTHONPATH=os.pathsep.join([str(ROOT), penv.get("PYTHONPATH", "")]),
            FE_RESULT=str(Path(tmp) / f"result_{rank}.json"),
            TORCH_EXTENSIONS_DIR=extensions_dir(),
        )
        for key, value in RANK_ENV_DEFAULTS.items():
            penv.setdefault(key, value)
        penv.update(env or {})
        # Output goes to a file, not a pipe: a pipe that nobody drains while the parent waits for
        # another rank fills at 64 KiB and blocks its writer inside a print, and the other rank
        # then waits for it in a collective until the timeout (the old "ZeRO-3 hang at step 128":
        # DeepSpeed's ZeRO-3 prints ~0.5 KB of warnings per step).
        log_paths.append(Path(tmp) / f"output_{rank}.txt")
        try:
            if pooled is not None and rank_pool.enabled(penv):
                procs.append(rank_pool.start(f"{__name__}:_child", pooled, penv, log_paths[-1], str(ROOT)))
                continue
            with open(log_paths[-1], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv, env=penv, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        except BaseException:  # re-raised after the ranks are killed
            kill_ranks(procs)
            raise
    return procs, log_paths


#: After one rank has failed, how long the others get to finish (a rank that failed early, e.g. at
#: rendezvous, would otherwise leave the others waiting for it until the whole timeout).
FAILED_RANK_GRACE_S = 30.0


def wait_ranks(procs: list[RankProcess], log_paths: list[Path], what: str, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for every rank to exit, or :data:`FAILED_RANK_GRACE_S` after one
    rank exited with an error. Then raise ``AssertionError`` with every waiting rank's Python stacks
    and output; either way no rank is left running."""
    limit: float | str = timeout  # as the report says it
    try:
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed is None:
                failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None and now + FAILED_RANK_GRACE_S < deadline:
                    deadline = now + FAILED_RANK_GRACE_S
                    limit = f"{timeout:g} s (ended {FAILED_RANK_GRACE_S:g} s after rank {failed} failed)"
            if now > deadline:
                raise AssertionError(_timeout_report(procs, log_paths, what, len(procs), limit))
            time.sleep(0.05)
    finally:
        kill_ranks(procs)


def kill_ranks(procs: list[RankProcess]) -> None:
    """SIGKILL each rank's process group (the rank and anything it started), where still running."""
    for p in procs:
        if p.poll() is None:
            if isinstance(p, rank_pool.PooledRank):
                p.kill_group()
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _tail(path: Path, limit: int = 8000) -> str:
    data = path.read_bytes() if path.exists() else b""
    return data[-limit:].decode(errors="replace")


def _timeout_report(
    procs: list[RankProcess], log_paths: list[Path], target: str, world_size: int, timeout: float | str
) -> str:
    """Which ranks were still running at the timeout, and where: every thread's Python stack of each
    (SIGUSR1 makes the child's faulthandler print them), then that rank's last output."""
    waiting = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in waiting:
        with contextlib.suppress(ProcessLookupError):
            procs[r].send_signal(signal.SIGUSR1)
    time.sleep(2.0)  # let faulthandler write the stacks
    done = {r: p.returncode for r, p in enumerate(procs) if r not in waiting}
    limit = f"{timeout:g} s" if isinstance(timeout, (int, float)) else timeout
    parts = [
        f"timeout after {limit} in {target}: rank(s) {waiting} of {world_size} still running "
        f"(exit codes of the others: {done})"
    ]
    kill_ranks(procs)
    for r, p in enumerate(procs):
        state = "WAITING at the timeout (its stacks are at the end)" if r in waiting else f"exited {p.returncode}"
        parts.append(f"--- rank {r}: {state} ---\n{_tail(log_paths[r])}")
    return "\n".join(parts)


def _child(args_path: str | None = None) -> None:
    """One rank of :func:`run_ranks`: the target of the JSON file ``args_path`` (default ``sys.argv[1]``)."""
    # On SIGUSR1 (sent by run_ranks at a timeout) print every thread's stack: a hung test then says
    # which rank waited where.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    args = json.loads(Path(args_path or sys.argv[1]).read_text())
    result_path = Path(os.environ["FE_RESULT"])
    code = 0
    try:
        if os.environ.get("FE_DIST_INIT") == "torch":  # plain torch.distributed, for harness tests (fast start)
            import torch.distributed as dist

            dist.init_process_group("gloo")
        else:
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        mod_name, fn_name = args["target"].split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        payload = {"result": fn(**args["kwargs"])}
    except BaseException:  # noqa: BLE001 - report everything to the parent
        payload, code = {"error": traceback.format_exc()}, 1
    late = _finish_async_saves(float(os.environ.get("FE_DEADLINE", "inf")))
    if late is not None:
        payload, code = {"error": payload.get("error", "") + late}, 1
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: DeepSpeed's native threads occasionally abort there
    # ("terminate called without an active exception") after all the work is done. What teardown
    # would have waited for, this rank's async EMA writes, ended above.
    os._exit(code)


def _finish_async_saves(deadline: float) -> str | None:
    """Wait until ``deadline`` (``time.time()``) for this process's async EMA saves in flight;
    return a report of those still running then (None: none left).

    ``os._exit`` skips what a normal interpreter exit does first: joining the threads of every
    ``ThreadPoolExecutor``, which :class:`functional_ema.AsyncSaver` writes on. Without this wait a
    rank that returns with a save in flight cuts it short (rank files written, no manifest), which
    a real script would not do.

    It waits on the saves' own handles (public ``SaveHandle.done()`` / ``wait(timeout)``: the
    manifest committed, or the failure recorded), found through ``gc`` (each handle in flight is
    held by its queued or running job, so none is missed), rather than joining the executors'
    threads as ``concurrent.futures.thread._python_exit`` would: that private function joins the
    threads of every executor in the process, whoever made it (one with a blocked task hangs the
    rank), with no timeout, and waits for threads to end rather than for the checkpoint to be
    complete. Here the wait is bounded by the launch's deadline, and a rank that passes it says so.

    Before the process group is destroyed, as at a real exit (threads are joined before ``atexit``
    handlers and module teardown); the write needs no collective anyway: the ranks commit through
    files, each rank's writer thread on its own (rank 0 polls for the others' marker files).
    """
    mod = sys.modules.get("functional_ema._async")
    if mod is None:  # never imported: nothing can be in flight
        return None
    import gc

    pending = [o for o in gc.get_objects() if isinstance(o, mod.SaveHandle) and not o.done()]
    while pending and time.time() < deadline:
        with contextlib.suppress(Exception):  # TimeoutError, or the save's failure (the library logs it)
            pending[0].wait(min(0.5, max(0.0, deadline - time.time())))
        pending = [h for h in pending if not h.done()]
    if not pending:
        return None
    return "\nasync EMA save(s) still in flight at the launch's deadline: " + ", ".join(
        f"step {h.step} into {h.tag_dir}" for h in pending
    )


# ------------------------------------------------------------------------------------ killed saves


def fork_and_kill(
    body: Callable[[], object],
    install: Callable[[Callable[[Callable[..., Any]], Callable[..., Any]]], object],
    kill_at: int,
    count_file: Path | None = None,
    on_call: Callable[[], object] | None = None,
) -> int:
    """Run ``body()`` in a forked child that SIGKILLs itself at the ``kill_at``-th hooked call.

    ``install(hook)`` replaces the functions to count (e.g. ``os.fsync``) with ``hook(original)``;
    ``on_call()``, if given, runs first on every hooked call (e.g. to assert which thread calls).
    ``kill_at=-1`` never kills and writes the number of hooked calls to ``count_file``. Returns the
    child's wait status.
    """
    import signal

    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 3
        try:
            calls = [0]

            def hook(orig: Callable[..., Any]) -> Callable[..., Any]:
                def hooked(*a: Any, **k: Any) -> Any:
                    calls[0] += 1
                    if on_call is not None:
                        on_call()
                    if calls[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return orig(*a, **k)

                return hooked

            install(hook)
            body()
            if count_file is not None:
                count_file.write_text(str(calls[0]))
            code = 0
        except BaseException:  # noqa: BLE001 - the forked child prints it and exits with code 1
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


# ------------------------------------------------------------------------------ counting collectives

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_to_all",
    "all_to_all_single",
    "batch_isend_irecv",
]


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count calls into torch.distributed collectives (deepspeed.comm and DTensor go through them too)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts = {"calls": 0}
    saved: list[tuple[ModuleType, str, Callable[..., Any]]] = []
    for mod in (dist, c10d):
        for name in COLLECTIVES:
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def wrapped(*a: Any, __fn: Callable[..., Any] = fn, **k: Any) -> Any:
                counts["calls"] += 1
                return __fn(*a, **k)

            saved.append((mod, name, fn))
            setattr(mod, name, wrapped)
    try:
        yield counts
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


class CollectiveSpy:
    """Counts collectives two independent ways while active (a stricter :func:`count_collectives`).

    * ``api``: every call of a ``torch.distributed`` collective function (the module attributes
      are wrapped, so FSDP2's, DTensor's and this library's calls through them all count);
    * ``ops``: every c10d operator that reaches the dispatcher (a ``TorchDispatchMode``): the
      eager process-group ops (``c10d.allgather_`` ...) and the functional collectives DTensor
      uses (``_c10d_functional.*``), whichever Python path called them. DTensor's
      ``full_tensor()`` and redistributions use only these: the ``api`` count misses them.
    """

    NAMES: ClassVar[list[str]] = [
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "barrier",
        "monitored_barrier",
    ]

    def __init__(self) -> None:
        self.api: list[str] = []
        self.ops: list[str] = []

    @property
    def total(self) -> int:
        return len(self.api) + len(self.ops)

    def __enter__(self) -> CollectiveSpy:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch.utils._python_dispatch import TorchDispatchMode

        spy = self
        self._saved: list[tuple[ModuleType, str, Callable[..., Any]]] = []
        for mod in (dist, c10d):
            for name in self.NAMES:
                fn = mod.__dict__.get(name)
                if callable(fn):
                    self._saved.append((mod, name, fn))

                    def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _name: str = name, **k: Any) -> Any:
                        spy.api.append(_name)
                        return _fn(*a, **k)

                    setattr(mod, name, wrapped)

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(
                self,
                func: torch._ops.OpOverload,
                types: tuple[type, ...],
                args: tuple[Any, ...] = (),
                kwargs: dict[str, Any] | None = None,
            ) -> Any:
                if func.namespace in ("c10d", "_c10d_functional", "c10d_functional", "_dtensor"):
                    spy.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        self._mode = _Ops()
        self._mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._mode.__exit__(exc_type, exc, tb)
        for mod, name, fn in self._saved:
            setattr(mod, name, fn)


# ------------------------------------------------------------------------------------ test models


class OddNet(nn.Module):
    """Parameters of odd, uneven sizes (so ZeRO pads partitions and ZeRO-1/2 split parameters
    across ranks), plus a frozen parameter and a trainable one that the optimizer is not given."""

    def __init__(self, d_in: int = 7, hidden: int = 13, d_out: int = 5, extras: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.mid = nn.Linear(hidden, 11)
        self.norm = nn.LayerNorm(11)
        self.out = nn.Linear(11, d_out)
        self.table = nn.Parameter(torch.randn(37, 3) * 0.1)  # 111 elements
        if extras:
            self.frozen = nn.Parameter(torch.randn(9), requires_grad=False)
            self.not_optimized = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.norm(self.mid(h) + self.table.sum())
        y = self.out(h)
        if hasattr(self, "frozen"):
            y = y + self.frozen.sum() * 0.01 + self.not_optimized.sum() * 0.01
        return y


class BNSeq(nn.Sequential):
    """A small model with module buffers (BatchNorm: floating running statistics and an integer count),
    taking ``batch()``'s inputs."""

    def __init__(self, d_in: int = 7, hidden: int = 13, d_out: int = 5) -> None:
        super().__init__(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Linear(hidden, d_out))


def block_and_strided_groups(
    size: int,
) -> tuple[torch.distributed.ProcessGroup | None, torch.distributed.ProcessGroup | None]:
    """This rank's group among blocks of ``size`` consecutive ranks, and its group among the ranks
    ``size`` apart (the model-parallel and data-parallel groups of a Megatron-style layout). A
    collective to make: every rank makes every group."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    block = strided = None
    for i in range(world // size):
        ranks = list(range(i * size, (i + 1) * size))
        g = dist.new_group(ranks)
        if rank in ranks:
            block = g
    for j in range(size):
        ranks = list(range(j, world, size))
        g = dist.new_group(ranks)
        if rank in ranks:
            strided = g
    return block, strided


class MPU:
    """A minimal Megatron-style ``mpu`` for ``deepspeed.initialize(..., mpu=...)``: tensor-parallel groups of
    ``tp`` consecutive ranks, data-parallel groups across them. A collective to make (every rank)."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self._tp_group, self._dp_group = block_and_strided_groups(tp)

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self._tp_group)

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        return self._tp_group

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self._dp_group)

    def get_data_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self._dp_group)

    def get_data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        return self._dp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def _megatron_split(p: nn.Parameter, dim: int | None) -> None:
    """Megatron's attributes on a parameter, saying how its tensor-parallel slices join:
    ``tensor_model_parallel`` (split or replicated) and, when split, ``partition_dim``."""
    marked: Any = p  # set on the instance, as Megatron does (torch's Parameter type declares neither)
    marked.tensor_model_parallel = dim is not None
    if dim is not None:
        marked.partition_dim = dim


class ColumnParallelLinear(nn.Module):
    """Megatron's column-parallel linear: this tensor-parallel rank's rows of ``weight`` and ``bias``
    (from the full ones, the same on every rank); the output stays split."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, tp: int, tp_size: int, attributes: bool = True
    ) -> None:
        super().__init__()
        rows = weight.shape[0] // tp_size
        self.weight = nn.Parameter(weight[tp * rows : (tp + 1) * rows].clone())
        self.bias = nn.Parameter(bias[tp * rows : (tp + 1) * rows].clone())
        if attributes:  # Megatron's attributes: how the slices join
            for p in (self.weight, self.bias):
                _megatron_split(p, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t() + self.bias)


class RowParallelLinear(nn.Module):
    """Megatron's row-parallel linear: this rank's columns of ``weight``, the outputs summed over the
    tensor-parallel group (a differentiable all-reduce), then a replicated bias."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        tp: int,
        tp_size: int,
        group: torch.distributed.ProcessGroup | None,
        attributes: bool = True,
    ) -> None:
        super().__init__()
        cols = weight.shape[1] // tp_size
        self.group = group
        self.weight = nn.Parameter(weight[:, tp * cols : (tp + 1) * cols].clone())
        self.bias = nn.Parameter(bias.clone())
        if attributes:
            _megatron_split(self.weight, 1)
            _megatron_split(self.bias, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(h @ self.weight.t(), group=self.group) + self.bias


def tp_full_weights(seed: int = 0, d_in: int = 7, hidden: int = 12, d_out: int = 5) -> dict[str, torch.Tensor]:
    """The unsplit weights of :class:`TPMLP` (and of the tensor-parallel pipeline's layers)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(hidden, d_in, generator=g) * 0.4,
        "b1": torch.randn(hidden, generator=g) * 0.1,
        "w2": torch.randn(d_out, hidden, generator=g) * 0.4,
        "b2": torch.randn(d_out, generator=g) * 0.1,
    }


class TPMLP(nn.Module):
    """A Megatron-style tensor-parallel MLP (column-parallel then row-parallel linear). With
    ``attributes`` its parameters carry Megatron's ``tensor_model_parallel`` / ``partition_dim``, so
    the split is known; :data:`SPLIT` says it in ``tp_dims`` form."""

    SPLIT: ClassVar[dict[str, int | None]] = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}

    def __init__(
        self,
        tp: int,
        tp_size: int,
        group: torch.distributed.ProcessGroup | None,
        seed: int = 0,
        attributes: bool = True,
    ) -> None:
        super().__init__()
        w = tp_full_weights(seed)
        self.fc1 = ColumnParallelLinear(w["w1"], w["b1"], tp, tp_size, attributes)
        self.fc2 = RowParallelLinear(w["w2"], w["b2"], tp, tp_size, group, attributes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def pipeline_engine(stages: int = 2, seed: int = 0) -> Any:
    """A real DeepSpeed ``PipelineEngine`` (ZeRO-1) over a small MLP cut into ``stages`` stages."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(seed)
    module = PipelineModule(
        layers=[nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)], num_stages=stages, loss_fn=nn.MSELoss()
    )
    cfg = ds_config(1)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2), config=cfg
    )
    return engine


def change_inside_swapped(
    x: Any, state: Any, forward: Callable[[], Any], change: Callable[[], None], raising: bool
) -> list[str] | None:
    """Run ``forward()`` then ``change()`` (a block that re-types, re-assigns or replaces parameters) inside
    ``fe.swapped(x, state)`` under ``torch.no_grad()``, raising ``KeyError`` at the end when ``raising``.

    Returns ``["changed", message]`` for the ``SwappedParametersChangedError`` the exit raises,
    ``["raised", notes]`` for the block's own ``KeyError`` (with the notes ``swapped`` added), or ``None``.
    """
    import functional_ema as fe

    try:
        with torch.no_grad(), fe.swapped(x, state):
            forward()
            change()
            if raising:
                raise KeyError("boom")
    except fe.SwappedParametersChangedError as e:
        return ["changed", str(e)]
    except KeyError as e:
        return ["raised", " ".join(getattr(e, "__notes__", []))]
    return None


def optimized_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.requires_grad and n != "not_optimized"]


def ds_config(
    stage: int, dtype: str = "fp32", offload: str | None = None, micro_batch: int = 4, **zero_extra: Any
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0, **zero_extra}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload in ("optimizer", "param"):
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if offload == "param":
        zero["offload_param"] = {"device": "cpu"}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def make_engine(
    stage: int,
    dtype: str = "fp32",
    offload: str | None = None,
    seed: int = 0,
    model: nn.Module | None = None,
    lr: float = 1e-2,
    mpu: Any = None,
    **zero_extra: Any,
) -> Any:
    """A real DeepSpeed engine over ``OddNet`` (or ``model``) with a client AdamW (and ``mpu=``, if given)."""
    import deepspeed

    torch.manual_seed(seed)
    model = model if model is not None else OddNet()
    opt = torch.optim.AdamW(optimized_params(model), lr=lr, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=ds_config(stage, dtype, offload, **zero_extra), mpu=mpu
    )
    return engine


def batch(
    engine: Any, step: int, seed: int = 1234, n: int = 4, d_in: int = 7, d_out: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-(step, rank) data so every run with the same seeds sees the same batches."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(seed + 1000 * step + rank)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    dtype = next(p for p in engine.module.parameters()).dtype
    return x.to(engine.device, dtype), y.to(engine.device, dtype)


def train_step(engine: Any, step: int, seed: int = 1234) -> float:
    x, y = batch(engine, step, seed)
    loss = ((engine(x).float() - y.float()) ** 2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def full_fp32_reference(engine: Any) -> dict[str, torch.Tensor]:
    """Independent full fp32 master weights via DeepSpeed's own API (a collective on stages 1-3).

    Stage 0 has no such API: fp32 training updates the parameters themselves, and 16-bit training
    keeps per-parameter fp32 copies in the wrapper optimizer, paired here by position.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    stage = engine.zero_optimization_stage()
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad and n != "not_optimized"]
    params = dict(engine.module.named_parameters())
    out: dict[str, torch.Tensor] = {}
    if stage == 0:
        opt = engine.optimizer
        if hasattr(opt, "fp32_groups"):
            pairs = {id(lp): hp for lg, hg in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lg, hg)}
            return {n: pairs[id(params[n])].detach().clone().view(params[n].shape).float() for n in names}
        return {n: params[n].detach().clone().float() for n in names}
    for n in names:
        full = safe_get_full_fp32_param(params[n])
        assert full is not None, n
        out[n] = full.detach().clone().cpu().float()
    return out


def ddp_trained(
    rank: int, d_in: int = 7, hidden: int = 12, d_out: int = 5
) -> tuple[nn.Module, Callable[[int], None], Callable[[], dict[str, torch.Tensor]]]:
    """(a seeded DDP MLP, ``train(step)``: one SGD step on this rank's own batch, its full weights as copies),
    inside an initialised process group."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(4, d_in, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return model, train, lambda: {n: p.detach().clone() for n, p in net.named_parameters()}


def forward_weights(engine: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The full weights the forward uses (ZeRO-3: gathered from the partitions), cloned to CPU.

    One ``GatheredParameters`` per parameter: DeepSpeed 0.17.6 gathers a list of parameters
    with one gloo all-gather each but waits only for the last one (``_allgather_params_coalesced``),
    so on CPU the other parameters can be read before their data arrives. A single parameter takes
    the blocking path. (Fixed in later DeepSpeed, which waits for every handle.)
    """
    import deepspeed

    params = dict(engine.module.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for n in names:
        with deepspeed.zero.GatheredParameters([params[n]], enabled=engine.zero_optimization_stage() == 3):
            out[n] = params[n].detach().cpu().clone()
    return out


# ------------------------------------------------------------------ helpers shared by test modules
# (one place, so that no test file imports another's privates)


def checkpoint_decays() -> tuple[DecayLike, DecayLike]:
    from functional_ema import schedules

    return (0.8, schedules.power(gamma=3.0))


def current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def advance(engine: Any, state: EmaState, n: int, ref: list[dict[str, torch.Tensor]] | None = None) -> EmaState:
    """Train n steps, updating the EMA; with ``ref`` (full EMAs), update that plain-torch reference too."""
    import functional_ema as fe
    from functional_ema import schedules

    decays = checkpoint_decays()
    for _ in range(n):
        step = int(state.step) + 1
        train_step(engine, step)
        state = fe.update(state, fe.local_shards(engine), step, decay=decays)
        if ref is not None:
            full = full_fp32_reference(engine)
            for i, d in enumerate(decays):
                w = 1.0 - schedules.interval_decay(d, step - 1, step)
                for n_ in ref[i]:
                    ref[i][n_].lerp_(full[n_], w)
    return state


def unflat(d: Mapping[str, Any], num: int = 2) -> list[dict[str, Any]]:
    return [{k.split("/", 1)[1]: v for k, v in d.items() if k.startswith(f"{i}/")} for i in range(num)]


def diff_emas(
    a: list[Mapping[str, torch.Tensor]], b: list[Mapping[str, torch.Tensor]]
) -> list[tuple[int, str] | tuple[int, str, list[str]]]:
    bad: list[tuple[int, str] | tuple[int, str, list[str]]] = []
    for i, (x, y) in enumerate(zip(a, b)):
        if set(x) != set(y):
            bad.append((i, "names", sorted(set(x) ^ set(y))))
            continue
        for n in x:
            if x[n].dtype != y[n].dtype or x[n].shape != y[n].shape or not torch.equal(x[n].cpu(), y[n].cpu()):
                bad.append((i, n))
    return bad


def gather_all(state: EmaState, engine: Any) -> list[dict[str, torch.Tensor]]:
    import functional_ema as fe

    return [fe.gather_full(state, engine, index=i) for i in range(state.num_emas)]


def error_of(fn: Callable[[], object]) -> list[Any] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, str(e), [c.__name__ for c in type(e).__mro__]]
    return None


def raised(fn: Callable[[], object]) -> list[str] | None:
    """``[class name, message]`` of what ``fn()`` raises, ``None`` if nothing: what a rank reports for a test to
    compare exactly (``error_of`` adds the class's bases)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the class and message
        return [type(e).__name__, str(e)]
    return None


def refusal(fn: Callable[[], object]) -> str | None:
    """:func:`raised` as one string, ``"Class: message"`` (``None`` if nothing), for a test's ``startswith``."""
    got = raised(fn)
    return None if got is None else f"{got[0]}: {got[1]}"


def attempt(fn: Callable[[], object]) -> dict[str, Any]:
    """``fn()``'s error (``error``: class name, ``msg``; ``error`` None when it returned) and the seconds it took
    (``s``): what a rank reports for a test that asserts both the error and how long the rank waited."""
    t0 = time.monotonic()
    got = raised(fn)
    out: dict[str, Any] = {"error": None} if got is None else {"error": got[0], "msg": got[1]}
    out["s"] = time.monotonic() - t0
    return out


def entered(cm: Any) -> None:
    """Enter and leave the context manager ``cm`` (a collective ``swapped``: what a rank does with it, in one call)."""
    with cm:
        pass


def full_tensor_of(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()


#: TPNet's sizes: TP_H / 2 = 7 rows per tensor-parallel slice, so FSDP2 pads the second shard of each.
TP_D, TP_H, TP_OUT = 6, 14, 3
TP_DECAY = 0.75


class TPNet(nn.Module):
    """``up`` colwise, ``down`` rowwise (tensor parallel), ``norm`` and ``head`` outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(TP_D, TP_H)  # (14, 6): a 7-row slice per tensor-parallel rank
        self.down = nn.Linear(TP_H, TP_D)  # (6, 14): a 7-column slice per tensor-parallel rank
        self.norm = nn.LayerNorm(TP_D)
        self.head = nn.Linear(TP_D, TP_OUT)  # (3, 6): 2 + 1 rows over the shard group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x + self.down(torch.tanh(self.up(x)))))


def tp_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    names = {1: ("tp",), 2: ("shard", "tp"), 3: ("replicate", "shard", "tp")}[len(shape)]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of ``mesh``'s dimensions (``tp_mesh`` names them; the TP helpers find the ``"tp"`` one by name);
    ``""`` for each dimension of an unnamed mesh (a plain data-parallel mesh has no ``"tp"`` dimension)."""
    return mesh.mesh_dim_names or ("",) * mesh.ndim


def tp_model(seed: int, mesh: DeviceMesh, tp: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TPNet: tensor parallel over ``mesh["tp"]`` (when ``tp``), then ``fully_shard`` over the rest."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = TPNet()
    names = _dim_names(mesh)
    if tp:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if names == ("tp",):  # tensor parallelism alone
            return model, torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
        dp = mesh["replicate", "shard"] if "replicate" in names else mesh["shard"]
    else:
        dp = mesh
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)


def tp_batch(step: int, mesh: DeviceMesh) -> torch.Tensor:
    """The same input on the ranks of one tensor-parallel group (tensor parallelism needs it)."""
    names = _dim_names(mesh)
    coord = [mesh.get_local_rank(d) for d in range(mesh.ndim) if names[d] != "tp"]
    g = torch.Generator().manual_seed(1000 * step + sum(c * 10**i for i, c in enumerate(coord)))
    return torch.randn(4, TP_D, generator=g)


# ---------------------------------------------------------------------- expert parallel (DeepSpeed MoE)


NUM_EXPERTS = 4


class MoENet(torch.nn.Module):
    """A linear layer, a BatchNorm (module buffers), a DeepSpeed MoE layer (``NUM_EXPERTS`` linear experts over
    ``ep_size`` expert-parallel ranks, top-1, deterministic routing), a linear head. Expert ``g`` (global index)
    starts from its own seed, so no two experts are alike: an EMA taken for another expert's cannot pass."""

    def __init__(self, ep_size: int, seed: int, buffers: bool = True) -> None:
        import torch.distributed as dist
        from deepspeed.moe.layer import MoE

        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(7, 8)
        self.norm = (
            torch.nn.BatchNorm1d(8) if buffers else torch.nn.LayerNorm(8)
        )  # bf16: DeepSpeed leaves BN stats fp32
        self.moe = MoE(
            hidden_size=8,
            expert=torch.nn.Linear(8, 8),
            num_experts=NUM_EXPERTS,
            ep_size=ep_size,
            k=1,
            min_capacity=4,
            use_rts=False,
        )
        self.out = torch.nn.Linear(8, 5)
        # DeepSpeed's default expert-parallel groups are consecutive ranks: this rank is expert-parallel rank rank % ep_size
        ep, local = dist.get_rank() % ep_size, NUM_EXPERTS // ep_size
        with torch.no_grad():
            for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(1000 * seed + ep * local + i)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux, _ = self.moe(torch.tanh(self.norm(self.inp(x))))
        return self.out(h), aux
