"""``update(..., blocking=False)``: the queued update of a CPU EMA, its ordering, waits and errors.

On a machine without a GPU nothing is queued by default (CPU weights need no transfer), so these
tests swap in :class:`functional_ema._offload.ThreadCopyEngine` (copies at the call, lerps on a
worker thread) through ``_offload.engine_for``, and send fp32 CPU runs through the staged path
(``_plan._needs_staging``), exactly as the CUDA case runs them. A *gated* engine holds the worker
until something waits for it, so every check is deterministic: a verb that did not wait would read
(or be overwritten by) the update still held on the worker. Every EMA is compared bitwise with the
blocking path and with a per-tensor ``lerp_`` in plain torch.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import functional_ema as fe
from functional_ema import _offload, _plan

DECAYS = (0.9, fe.schedules.power(gamma=3.0))


class GatedEngine(_offload.ThreadCopyEngine):
    """The CPU engine, with its worker held at the first chunk until ``gate`` opens (or failing there)."""

    def __init__(self, fail: BaseException | None = None):
        super().__init__()
        self.gate = threading.Event()
        self.fail = fail
        self.copies = 0
        self.submitted: list[Future] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        self.copies += 1
        return super().copy(dst, src)

    def ready(self, token) -> None:
        assert self.gate.wait(60), "nothing waited for the queued update"
        if self.fail is not None:
            raise self.fail

    def submit(self, fn: Callable[[], None]) -> Future:
        future = super().submit(fn)
        self.submitted.append(future)
        return future


@pytest.fixture
def engine(monkeypatch) -> GatedEngine:
    """Queued updates on CPU through a gated engine whose gate a wait opens; small chunks, so a model
    of a few hundred elements is copied and lerped in many pieces."""
    eng = GatedEngine()
    monkeypatch.setattr(_offload, "engine_for", lambda src, ema: eng)
    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: True)
    monkeypatch.setattr(_plan, "_STAGE_CHUNK_ELEMENTS", 23)
    monkeypatch.setattr(_offload, "_STAGE_CHUNK_ELEMENTS", 23)
    monkeypatch.setattr(_offload, "_COPY_CHUNK_ELEMENTS", 61)
    waits = []
    original = _offload.PendingUpdate.wait

    def wait(self):
        waits.append(self.step)
        eng.gate.set()
        original(self)

    monkeypatch.setattr(_offload.PendingUpdate, "wait", wait)
    eng.waits = waits  # type: ignore[attr-defined]
    return eng


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _train(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def _reference(history: list[dict[str, torch.Tensor]], steps: list[int], decays) -> list[dict[str, torch.Tensor]]:
    """Plain torch: per tensor, ``ema.lerp_(w, 1 - d)`` with ``d`` the decay compounded over the skipped steps."""
    emas = [{n: t.clone() for n, t in history[0].items()} for _ in decays]
    for (last, step), weights in zip(itertools.pairwise(steps), history[1:]):
        for ema, decay in zip(emas, decays):
            d = 1.0
            for s in range(last + 1, step + 1):
                d *= decay if isinstance(decay, float) else float(decay(s))
            for n, e in ema.items():
                e.copy_(weights[n]) if d == 0.0 else e.lerp_(weights[n], 1.0 - d)
    return emas


def _same(a, b) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n].cpu(), b[n].cpu()) for n in a)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_queued_update_is_bitwise_the_blocking_one(engine):
    """Fused Shards (two EMAs, a skipped step, decay 0 once) and a dict tree with a float64 EMA; in place
    and not: after each queued update the EMA equals the blocking path's and plain torch's bitwise."""
    model = _model()
    decays = [0.9, DECAYS[1]]
    queued = fe.init_ema(fe.local_shards(model), num_emas=2)
    blocking = fe.init_ema(fe.local_shards(model), num_emas=2)
    history, steps = [_weights(model)], [0]
    for step in (1, 3, 4, 5):
        _train(model, step)
        d = [0.0, decays[1]] if step == 4 else decays
        queued = fe.update(queued, fe.local_shards(model), step, decay=d, blocking=False, inplace=step != 3)
        assert engine.submitted[-1].done() is False  # held: the call returned before any lerp
        assert int(queued.step) == step
        blocking = fe.update(blocking, fe.local_shards(model), step, decay=d)
        fe.wait_update(queued)
        assert all(_same(a, b) for a, b in zip(queued.emas, blocking.emas)), step
        engine.gate.clear()
        history.append(_weights(model))
        steps.append(step)
    # The plain-torch reference (decay 0 at step 4 for EMA 0).
    ref0 = _reference(history[:3], steps[:3], [0.9])[0]
    ref0 = {n: history[3][n].clone() for n in ref0}  # decay 0 at step 4: the EMA is the weights
    ref0 = {n: e.lerp_(history[4][n], 1 - 0.9) for n, e in ref0.items()}
    assert _same(dict(queued.emas[0]), ref0)
    assert _same(dict(queued.emas[1]), _reference(history, steps, [decays[1]])[0])
    assert engine.copies > 2 * 5  # chunks: the model has 7*13+13+13*5+5 = 174 elements, copied 61 at a time

    tree = {n: t.clone() for n, t in _weights(model).items()}
    q64 = fe.init_ema(tree, dtype=torch.float64)
    b64 = fe.init_ema(tree, dtype=torch.float64)
    engine.gate.clear()
    moved = {n: t + 1 for n, t in tree.items()}
    q64 = fe.update(q64, moved, decay=0.75, blocking=False)
    b64 = fe.update(b64, moved, decay=0.75)
    assert _same(dict(fe.wait_update(q64).ema), dict(b64.ema))
    assert _same(dict(q64.ema), {n: t.double().lerp_(moved[n].double(), 0.25) for n, t in tree.items()})


def test_inplace_change_after_the_call_does_not_leak(engine):
    """The weights are copied at the call: zeroing them right after, while the lerps are still held on the
    worker, changes nothing in the EMA."""
    model = _model()
    state = fe.init_ema(fe.local_shards(model))
    before = _weights(model)
    _train(model, 1)
    at_call = _weights(model)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5, blocking=False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert not engine.submitted[-1].done()
    fe.wait_update(state)
    assert _same(dict(state.ema), {n: before[n].lerp_(at_call[n], 0.5) for n in before})


def _queue(state, model, step: int, engine: GatedEngine):
    engine.gate.clear()
    _train(model, step)
    state = fe.update(state, fe.local_shards(model), step, decay=0.5, blocking=False)
    assert not engine.submitted[-1].done()
    return state


def test_every_verb_waits_for_the_queued_update(engine, tmp_path):
    """update, save, AsyncSaver.save, swapped, gather_full, load(out=) and deepcopy each wait (once) for the
    update in flight before they read or fill the state: each sees (or keeps) the updated EMA, never the
    update landing afterwards."""
    model = _model()
    state = fe.init_ema(fe.local_shards(model))
    twin = fe.init_ema(fe.local_shards(model))  # the blocking path, step for step

    def follow(step: int) -> None:
        fe.update(twin, fe.local_shards(model), step, decay=0.5)

    step = 0
    checks: dict[str, bool] = {}

    def run(label: str, verb: Callable[[], object], check: Callable[[object], bool]) -> None:
        nonlocal state, step
        step += 1
        state = _queue(state, model, step, engine)
        follow(step)
        n = len(engine.waits)
        out = verb()
        checks[label] = engine.submitted[-1].done() and engine.waits[n:] == [step] and check(out)

    run("update", lambda: fe.update(state, fe.local_shards(model), step, decay=0.5), lambda _: True)
    checks["update_values"] = _same(dict(state.ema), dict(twin.ema))

    run(
        "save",
        lambda: fe.save(state, model, tmp_path, "s"),
        lambda _: _same(fe.load(model, tmp_path, "s").ema, twin.ema),
    )
    with fe.AsyncSaver() as saver:
        run("AsyncSaver.save", lambda: saver.save(state, model, tmp_path, "a").wait(), lambda _: True)
    checks["AsyncSaver.values"] = _same(fe.load(model, tmp_path, "a").ema, twin.ema)

    def in_swap() -> dict[str, torch.Tensor]:
        with fe.swapped(model, state):
            return _weights(model)

    run("swapped", in_swap, lambda seen: _same(seen, dict(twin.ema)))
    run("gather_full", lambda: fe.gather_full(state, model), lambda full: _same(full, dict(twin.ema)))
    run("deepcopy", lambda: copy.deepcopy(state), lambda c: _same(dict(c.ema), dict(twin.ema)))

    saved = fe.load(model, tmp_path, "s")  # an older EMA: load(out=) must leave exactly it in the state
    run("load_out", lambda: fe.load(model, tmp_path, "s", out=state), lambda loaded: loaded.ema is state.ema)
    fe.wait_update(state)  # nothing left in flight: the buffers hold what was loaded
    checks["load_out_values"] = _same(dict(state.ema), dict(saved.ema))
    assert [k for k, ok in checks.items() if not ok] == []


def test_worker_failure_surfaces_at_the_next_call(engine, tmp_path):
    """A failure on the worker is raised once, by the next call that reads the state (update, or save),
    as AsyncUpdateError with the original as its cause; the step goes back; the state is usable again."""
    model = _model()
    state = fe.init_ema(fe.local_shards(model))
    engine.fail = OSError("the copy engine lost the device")
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5, blocking=False)
    with pytest.raises(
        fe.AsyncUpdateError, match=r"step 1 .*OSError: the copy engine lost the device.*set back to 0"
    ) as e:
        fe.update(state, fe.local_shards(model), 2, decay=0.5)
    assert isinstance(e.value.__cause__, OSError)
    assert int(state.step) == 0
    engine.fail = None
    state = fe.update(state, fe.local_shards(model), 2, decay=0.5, blocking=False)
    assert int(fe.wait_update(state).step) == 2

    engine.fail = RuntimeError("lerp failed")
    state = fe.update(state, fe.local_shards(model), 3, decay=0.5, blocking=False)
    with pytest.raises(fe.AsyncUpdateError, match=r"step 3.*lerp failed"):
        fe.save(state, model, tmp_path, "t")
    assert not (tmp_path / "t" / "ema_manifest.json").exists()
    engine.fail = None
    fe.save(state, model, tmp_path, "t")  # raised once: the state saves now
    assert int(fe.load(model, tmp_path, "t").step) == 2


def test_without_cuda_weights_blocking_false_runs_at_the_call():
    """No engine queues CPU weights: blocking=False is the blocking update (nothing in flight)."""
    model = _model()
    state = fe.init_ema(fe.local_shards(model))
    twin = fe.init_ema(fe.local_shards(model))
    _train(model, 1)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5, blocking=False)
    assert getattr(state.step, "_fe_pending", None) is None
    assert _same(dict(state.ema), dict(fe.update(twin, fe.local_shards(model), 1, decay=0.5).ema))
    with pytest.raises(TypeError, match=r"blocking=\.\.\.\) must be a bool, got str"):
        fe.update(state, fe.local_shards(model), 2, blocking="no")
    with pytest.raises(TypeError, match="wait_update"):
        fe.wait_update(dict(state.ema))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py runs it on a GPU machine)"
)
def test_cuda_queued_update_orders_streams():
    """The real engine: the copy waits for the work queued before the call (a long kernel, then the write
    of the weights), the current stream waits for the copy (zeroing right after the call does not leak),
    and the EMAs (two, bf16 and fp32 targets) are bitwise the blocking update's."""
    buf = torch.randn(3_000_000, device="cuda")
    shards = fe.Shards.from_views({f"p{i}": buf.narrow(0, i * 1_000_000, 999_000) for i in range(3)})
    for dtype in (torch.float32, torch.bfloat16):
        queued = fe.init_ema(shards, num_emas=2, dtype=dtype, device="cpu", pin_memory=True)
        blocking = fe.init_ema(shards, num_emas=2, dtype=dtype, device="cpu", pin_memory=True)
        for step in range(1, 4):
            torch.cuda._sleep(50_000_000)  # the copy must wait for this, then for the write below
            buf.add_(1.0 / step)
            fe.update(queued, shards, step, decay=(0.9, 0.0 if step == 2 else 0.99), blocking=False)
            assert getattr(queued.step, "_fe_pending", None) is not None
            keep = buf.clone()
            buf.zero_()
            fe.wait_update(queued)
            buf.copy_(keep)
            fe.update(blocking, shards, step, decay=(0.9, 0.0 if step == 2 else 0.99))
            for k in range(2):
                assert all(torch.equal(a, b) for a, b in zip(queued.emas[k].segments, blocking.emas[k].segments))


# ------------------------------------------------------------ what is queued, and on what (make mutate)


class RecordingEngine(_offload.ThreadCopyEngine):
    """The CPU engine, recording the tokens it hands out and waits on, and the snapshots it allocates."""

    def __init__(self):
        super().__init__()
        self.tokens: list[int] = []
        self.readied: list[int] = []
        self.snapshots: list[tuple[int, torch.dtype]] = []

    def snapshot_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.snapshots.append((numel, dtype))
        return super().snapshot_buffer(numel, dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        super().copy(dst, src)
        self.tokens.append(len(self.tokens) + 100)
        return self.tokens[-1]

    def ready(self, token) -> None:
        self.readied.append(token)


@pytest.fixture
def recording(monkeypatch) -> tuple[RecordingEngine, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Queued updates through a RecordingEngine; ``engine_for``'s arguments are recorded too."""
    eng, asked = RecordingEngine(), []

    def engine_for(src, ema):
        asked.append((src, ema))
        return eng

    monkeypatch.setattr(_offload, "engine_for", engine_for)
    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: True)
    monkeypatch.setattr(_offload, "_COPY_CHUNK_ELEMENTS", 61)
    return eng, asked


def test_engine_chosen_from_the_first_span_and_tokens_waited_in_order(recording):
    """A dict tree (a plan per call): the engine is chosen from the first staged leaf's weights and its
    first EMA; the snapshot holds every staged element in the EMA's dtype; the worker waits on each
    chunk's own token, in order; the EMA is plain torch's."""
    eng, asked = recording
    tree = {"a": torch.arange(150, dtype=torch.float32), "b": torch.ones(7, dtype=torch.float32)}
    state = fe.init_ema(tree, dtype=torch.float64)
    for step in (1, 2):
        moved = {n: t + step for n, t in tree.items()}
        state = fe.wait_update(fe.update(state, moved, step, decay=0.5, blocking=False))
        src, ema = asked[-1]
        assert src.dtype == torch.float32 and torch.equal(src, tree["a"] + step)
        assert ema.dtype == torch.float64 and ema.shape == (150,)
    assert eng.snapshots == [(157, torch.float64)] * 2
    assert eng.readied == eng.tokens and len(eng.tokens) == 2 * 4  # 150 in chunks of 61 (3), then 7 (1)
    ref = {n: t.double() for n, t in tree.items()}
    for step in (1, 2):
        ref = {n: e.lerp_(tree[n].double() + step, 0.5) for n, e in ref.items()}
    assert _same(dict(state.ema), ref)


def test_engine_and_snapshot_made_once_per_plan(recording):
    """Fused Shards keep their plan: three queued updates ask for the engine once and allocate the
    snapshot once (the model's 174 elements), each bitwise the blocking update."""
    eng, asked = recording
    model = _model()
    state, twin = fe.init_ema(fe.local_shards(model)), fe.init_ema(fe.local_shards(model))
    for step in (1, 2, 3):
        _train(model, step)
        state = fe.wait_update(fe.update(state, fe.local_shards(model), step, decay=0.5, blocking=False))
        fe.update(twin, fe.local_shards(model), step, decay=0.5)
        assert _same(dict(state.ema), dict(twin.ema)), step
    assert len(asked) == 1 and eng.snapshots == [(174, torch.float32)]


def test_one_leaf_plan_queues(recording):
    """A plan of one staged span (one leaf) is queued and lands like plain torch."""
    eng, asked = recording
    w = torch.linspace(-1, 1, 10)
    state = fe.init_ema({"w": w}, dtype=torch.float64)
    state = fe.wait_update(fe.update(state, {"w": w * 3}, 1, decay=0.25, blocking=False))
    assert len(asked) == 1 and eng.snapshots == [(10, torch.float64)]
    assert torch.equal(state.ema["w"], w.double().lerp_((w * 3).double(), 0.75))


def test_plans_with_unstaged_lerps_run_at_the_call(recording, monkeypatch):
    """Only a plan whose every lerp is staged is queued: one with same-device lerps (groups) or with
    leaves converted one by one (not contiguous) runs at the call, nothing in flight, same values."""
    _, asked = recording
    model = _model()
    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: src.numel() != 13)  # the 13 biases: a group
    state, twin = fe.init_ema(fe.local_shards(model)), fe.init_ema(fe.local_shards(model))
    _train(model, 1)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5, blocking=False)
    assert getattr(state.step, "_fe_pending", None) is None and asked == []
    assert _same(dict(state.ema), dict(fe.update(twin, fe.local_shards(model), 1, decay=0.5).ema))

    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: True)
    tree = {"t": torch.arange(12.0).view(3, 4).t()}  # not contiguous: converted, not staged
    state = fe.init_ema(tree)
    state = fe.update(state, {"t": tree["t"] * 2}, 1, decay=0.5, blocking=False)
    assert getattr(state.step, "_fe_pending", None) is None and asked == []
    assert torch.equal(state.ema["t"], tree["t"].clone().lerp_(tree["t"] * 2, 0.5))


def test_staged_plan_with_converted_leaves_runs_at_the_call(recording):
    """A plan with staged spans and converted leaves is not queued (the worker lerps staged spans only)."""
    _, asked = recording
    t = torch.arange(12.0).view(3, 4).t()  # not contiguous: converted
    tree = {"t": t, "u": torch.arange(5.0)}
    state = fe.init_ema(tree, dtype=torch.float64)
    state = fe.update(state, {n: x * 2 for n, x in tree.items()}, 1, decay=0.5, blocking=False)
    assert getattr(state.step, "_fe_pending", None) is None and asked == []
    for n, x in tree.items():
        assert torch.equal(state.ema[n], x.double().lerp_((x * 2).double(), 0.5)), n


def test_staged_plan_without_an_engine_runs_at_the_call(monkeypatch):
    """On this machine no engine queues (CPU weights): a staged plan then runs at the call, same values."""
    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: True)
    w = torch.arange(6.0)
    state = fe.init_ema({"w": w}, dtype=torch.float64)
    state = fe.update(state, {"w": w + 1}, 1, decay=0.25, blocking=False)
    assert getattr(state.step, "_fe_pending", None) is None and int(state.step) == 1
    assert torch.equal(state.ema["w"], w.double().lerp_((w + 1).double(), 0.75))


def test_queued_decay_zero_copies_the_weights(recording):
    """A weight of 1 (decay 0) copies the weights as the blocking path does: an EMA holding NaN or inf
    becomes exactly the weights (a lerp by 1 would keep the NaN: w - (w - nan) * 0)."""
    eng, _ = recording
    w = torch.tensor([1.0, -2.0, 3.0, 0.5])
    state = fe.init_ema({"w": w}, dtype=torch.float64)
    state.ema["w"].copy_(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0]))
    state = fe.wait_update(fe.update(state, {"w": w}, 1, decay=0.0, blocking=False))
    assert eng.tokens and torch.equal(state.ema["w"], w.double())


def test_engine_for_queues_only_cpu_emas_of_cuda_weights(monkeypatch):
    """The real choice, with CUDA faked: a CudaCopyEngine on the weights' device exactly when the weights
    are on CUDA, the EMA on the CPU and CUDA is available; otherwise None (the update runs at the call)."""
    from types import SimpleNamespace

    made: list[object] = []
    monkeypatch.setattr(_offload, "CudaCopyEngine", lambda device: made.append(device) or ("engine", device))

    def on(kind: str) -> SimpleNamespace:
        return SimpleNamespace(device=SimpleNamespace(type=kind, name=f"{kind}:1"))

    for available in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        for src, ema in itertools.product(("cuda", "cpu", "meta"), ("cpu", "cuda", "meta")):
            got = _offload.engine_for(on(src), on(ema))
            want = available and src == "cuda" and ema == "cpu"
            assert (got is not None) == want, (available, src, ema)
            if want:
                assert got == ("engine", made[-1]) and made[-1].name == "cuda:1"


def test_cuda_engine_call_order_without_a_gpu(monkeypatch):
    """CudaCopyEngine's ordering contract (its docstring), call by call, through ``engine_for``, with a recording
    stand-in for the torch.cuda names it uses. The real CUDA behaviour is checked by the CUDA-only
    test_cuda_queued_update_orders_streams and by benchmarks/gpu_check.py on a GPU machine; this test pins the
    call order on machines without one."""
    log: list[tuple] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            log.append((self.name, "waits for", getattr(other, "name", other)))

    class Event:
        def __init__(self) -> None:
            log.append(("new event",))

        def record(self, stream) -> None:
            log.append(("record", self, "on", getattr(stream, "name", stream)))

        def synchronize(self) -> None:
            log.append(("synchronize", self))

    @contextlib.contextmanager
    def in_stream(stream):
        log.append(("enter", getattr(stream, "name", stream)))
        yield
        log.append(("exit", getattr(stream, "name", stream)))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: log.append(("new stream on", device)) or Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream(f"current of {device}"))
    monkeypatch.setattr(torch.cuda, "stream", in_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)

    cuda1, cpu = torch.device("cuda", 1), torch.device("cpu")
    engine = _offload.engine_for(SimpleNamespace(device=cuda1), SimpleNamespace(device=cpu))
    assert type(engine) is _offload.CudaCopyEngine and engine.device == cuda1  # (the other cases: test above)

    src, dst = torch.arange(5.0), torch.zeros(5)
    dst.copy_ = lambda s, non_blocking=False: log.append(("copy", non_blocking)) or torch.Tensor.copy_(dst, s)
    engine.begin()
    token = engine.copy(dst, src)
    engine.release()
    engine.ready(token)
    assert log == [
        ("new stream on", cuda1),
        ("side", "waits for", "current of cuda:1"),  # begin: after the optimizer step queued on the current stream
        ("enter", "side"),
        ("copy", True),
        ("new event",),
        ("record", token, "on", "side"),
        ("exit", "side"),
        ("current of cuda:1", "waits for", "side"),  # release: the next step writes the weights after the copy
        ("synchronize", token),  # ready: that chunk's event alone
    ]
    assert type(token) is Event and torch.equal(dst, src)

    asked = []
    with monkeypatch.context() as m:  # pinned memory needs an accelerator: check the request only
        m.setattr(torch, "empty", lambda *a, **k: asked.append((a, k)) or "pinned")
        assert engine.snapshot_buffer(7, torch.float64) == "pinned"
    assert asked == [((7,), {"dtype": torch.float64, "pin_memory": True})]
    assert engine.submit(lambda: threading.current_thread().name).result(30).startswith("fe_offload_update_")


def test_one_worker_thread_runs_the_updates_in_order():
    """The worker is one named thread: a second update waits for the first; a forked child (another
    pid) starts its own."""
    worker = _offload._Worker()
    release, seen = threading.Event(), []
    first = worker.submit(lambda: (release.wait(30), seen.append(threading.current_thread())))
    second = worker.submit(lambda: seen.append(threading.current_thread()))
    assert not second.done() and not first.done()
    try:
        second.result(timeout=0.3)
        raise AssertionError("the second update ran beside the first")
    except TimeoutError:
        pass
    release.set()
    second.result(timeout=30)
    assert seen[0] is seen[1] and seen[0].name.startswith("fe_offload_update_")
    pool = worker._pool
    assert worker.submit(lambda: None).result(timeout=30) is None and worker._pool is pool  # kept
    import os

    real, getpid = os.getpid(), os.getpid
    try:
        _offload.os.getpid = lambda: real + 1  # as in a forked child
        worker.submit(lambda: None).result(timeout=30)
        assert worker._pool is not pool and worker._pool[0] == real + 1
    finally:
        _offload.os.getpid = getpid  # (``_offload.os`` is ``os``: restoring ``os.getpid`` would keep the lambda)


def test_worker_failure_message_says_what_to_do(engine):
    model = _model()
    state = fe.init_ema(fe.local_shards(model))
    engine.fail = ValueError("boom")
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5, blocking=False)
    with pytest.raises(fe.AsyncUpdateError) as e:
        fe.wait_update(state)
    assert str(e.value) == (
        "the EMA update of step 1 queued by update(..., blocking=False) failed on its worker thread: ValueError: "
        "boom. state.step was set back to 0; the EMA values may be partly updated: load them from the last checkpoint"
    )
