"""``fe.swapped`` and ``flatten_parameters`` on models whose parameters share memory, and ``swapped`` blocks that
re-stride a parameter, edit a submodule registry (``del seq[2]``, ``insert``) or register a parametrization.

Each case is checked against plain torch: the forward after the block equals the forward before it bitwise, the
parameters are the entry objects holding the trained values bitwise, and a memory tie trains as an untouched twin.
"""

from __future__ import annotations

import contextlib
import copy
import re
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import functional_ema as fe
from functional_ema.engines.module import flatten_parameters


class MemoryTied(nn.Module):
    """An embedding and a decoder tied through memory: two Parameter objects over one storage."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Embedding(6, 4)
        self.dec = nn.Linear(4, 6, bias=False)
        self.dec.weight.data = self.enc.weight.data
        self.head = nn.Linear(6, 2)

    def forward(self, idx):
        return self.head(self.dec(self.enc(idx)))


IDX = torch.tensor([0, 1, 2, 5])


def _trained(model: nn.Module, inputs, steps: int = 3):
    """``steps`` SGD steps with an EMA updated after each; the state."""
    state = fe.init_ema(fe.local_shards(model))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(1, steps + 1):
        model(inputs).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state = fe.update(state, fe.local_shards(model), step, decay=0.9)
    return state


def _live(model: nn.Module) -> dict:
    return {n: (p, p.detach().clone(), p.stride()) for n, p in model.named_parameters(remove_duplicate=False)}


def _same_as(model: nn.Module, live: dict) -> bool:
    """The parameters are the recorded objects, in the recorded order, with their values and strides bitwise."""
    now = dict(model.named_parameters(remove_duplicate=False))
    return list(now) == list(live) and all(
        now[n] is p and torch.equal(p.detach(), v) and p.stride() == s for n, (p, v, s) in live.items()
    )


def test_swapped_memory_tied_weights_hold_the_ema_and_come_back_bitwise():
    torch.manual_seed(0)
    model = MemoryTied()
    state = _trained(model, IDX)
    live, before = _live(model), model(IDX).detach()
    ema = dict(state.ema)
    assert torch.equal(ema["enc.weight"], ema["dec.weight"])  # one memory trained: one average
    with torch.no_grad(), fe.swapped(model, state):
        inside = model(IDX)
        assert torch.equal(model.enc.weight, ema["enc.weight"]) and torch.equal(model.dec.weight, ema["dec.weight"])
    twin = copy.deepcopy(model)  # untied by the copy, but both loaded with the one EMA
    twin.load_state_dict(ema)
    assert torch.equal(inside, twin(IDX).detach())
    assert _same_as(model, live) and torch.equal(model(IDX).detach(), before)
    assert model.enc.weight.data_ptr() == model.dec.weight.data_ptr()

    # a view shifted into another parameter's memory: the EMAs differ on the overlap, refused naming both, the live
    # values untouched; a column split of one weight (spans meet, no element shared) swaps as usual
    shifted = nn.Linear(4, 4)
    state = _trained(shifted, torch.randn(3, 4))
    shifted.bias.data = shifted.weight.data.reshape(-1)[2:6]
    state = fe.update(state, fe.local_shards(shifted), 4, decay=0.9)
    live = _live(shifted)
    shared = r"parameters 'weight' and 'bias' share memory|'bias' and 'weight' share"
    with pytest.raises(ValueError, match=shared), fe.swapped(shifted, state):
        pass
    assert _same_as(shifted, live)

    split = nn.Linear(4, 6)
    whole = torch.randn(6, 5)
    split.weight.data, split.bias.data = whole[:, :4], whole[:, 4]
    state = _trained(split, torch.randn(3, 4))
    live, x = _live(split), torch.randn(2, 4)
    before = split(x).detach()
    with torch.no_grad(), fe.swapped(split, state):
        assert torch.equal(split.weight, state.ema["weight"]) and torch.equal(split.bias, state.ema["bias"])
    assert _same_as(split, live) and torch.equal(split(x).detach(), before)


def test_flatten_parameters_keeps_memory_ties_and_refuses_partial_overlaps():
    torch.manual_seed(0)
    flat = MemoryTied()
    torch.manual_seed(0)
    twin = MemoryTied()  # built alike (a deepcopy would untie it)
    assert flatten_parameters(flat) == 4
    assert flat.enc.weight.data_ptr() == flat.dec.weight.data_ptr()
    for model in (flat, twin):  # trained alike, bitwise (the tie kept: one memory, both gradients applied to it)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            model(IDX).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(flat.parameters(), twin.parameters()))

    # partially overlapping parameters: refused naming both, nothing moved
    shifted = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shifted[0].bias.data = shifted[0].weight.data.reshape(-1)[2:6]
    where = [p.data_ptr() for p in shifted.parameters()]
    with pytest.raises(ValueError, match=r"parameters '0\.weight' \(4, 4\) and '0\.bias' \(4,\) partially share"):
        flatten_parameters(shifted)
    assert [p.data_ptr() for p in shifted.parameters()] == where

    # a trainable parameter tied to a frozen one (which stays): it stays too, still tied; the others move
    frozen = MemoryTied()
    frozen.enc.weight.requires_grad_(False)
    assert flatten_parameters(frozen) == 2
    assert frozen.enc.weight.data_ptr() == frozen.dec.weight.data_ptr()
    assert frozen.head.bias.data_ptr() == frozen.head.weight.data_ptr() + 4 * 12


@pytest.mark.parametrize("how", ["data", "set_"])
def test_swapped_restrided_parameter_is_put_back_and_named(how):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    state = _trained(model, torch.randn(3, 4))
    live, x = _live(model), torch.randn(2, 4)
    before = model(x).detach()
    named = r"'weight' re-typed, moved or re-strided .*strides"
    with pytest.raises(fe.SwappedParametersChangedError, match=named), torch.no_grad(), fe.swapped(model, state):
        if how == "data":
            model.weight.data = model.weight.data.t()
        else:
            model.weight.set_(model.weight.t())
    assert _same_as(model, live) and torch.equal(model(x).detach(), before)


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))


def _first_last(registry: dict) -> None:
    items = list(registry.items())
    registry.clear()
    registry.update(items[1:] + items[:1])


SUBMODULE_EDITS = {
    "del": (lambda m: m.__delitem__(2), "submodule '2' removed; submodule '3' moved to '2'"),
    "pop": (lambda m: m.pop(2), "submodule '2' removed"),
    "insert": (lambda m: m.insert(1, nn.Identity()), "submodule '1' moved to '2'"),
    "append": (lambda m: m.append(nn.ReLU()), "submodule '5' added"),
    "reorder": (lambda m: _first_last(m._modules), "submodules of the model reordered"),
    "nested": (lambda m: m[2].__setattr__("extra", nn.Linear(4, 4)), "submodule '2.extra' added"),
}


@pytest.mark.parametrize("edit", sorted(SUBMODULE_EDITS))
def test_swapped_block_that_edits_a_submodule_registry_gets_it_back(edit):
    change, named = SUBMODULE_EDITS[edit]
    model = _sequential()
    state = _trained(model, torch.randn(3, 4))
    children, live, x = list(model._modules.items()), _live(model), torch.randn(2, 4)
    before = model(x).detach()
    with pytest.raises(fe.SwappedParametersChangedError, match=named), torch.no_grad(), fe.swapped(model, state):
        change(model)
    now = list(model._modules.items())
    assert len(now) == len(children) and all(k == k0 and v is v0 for (k, v), (k0, v0) in zip(now, children))
    assert _same_as(model, live) and torch.equal(model(x).detach(), before)
    fe.update(state, fe.local_shards(model), 4, decay=0.9)  # the reading is the entry one: no refusal


def _custom(m: nn.Module) -> None:
    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(m, "bias", Double())


PARAMETRIZATIONS = {
    "weight_norm": (parametrizations.weight_norm, "'0.weight' (_WeightNorm)"),
    "orthogonal": (parametrizations.orthogonal, "'0.weight' (_Orthogonal)"),
    "custom": (_custom, "'0.bias' (Double)"),
}


@pytest.mark.parametrize("kind", sorted(PARAMETRIZATIONS))
@pytest.mark.parametrize("already", [False, True])
def test_swapped_block_that_registers_a_parametrization_gets_the_trained_forward_back(kind, already):
    apply, named = PARAMETRIZATIONS[kind]
    model = _sequential()
    if already:  # parametrized on entry (another tensor): its class and that parametrization stay
        parametrize.register_parametrization(model[0], "weight" if kind == "custom" else "bias", nn.Identity())
    state = _trained(model, torch.randn(3, 4))
    cls, live, x = type(model[0]), _live(model), torch.randn(2, 4)
    before = model(x).detach()
    message = re.escape(f"parametrization registered on {named} removed")
    with pytest.raises(fe.SwappedParametersChangedError, match=message), torch.no_grad(), fe.swapped(model, state):
        apply(model[0])
    assert type(model[0]) is cls and parametrize.is_parametrized(model[0]) == already
    assert _same_as(model, live) and torch.equal(model(x).detach(), before)
    fe.update(state, fe.local_shards(model), 4, decay=0.9)


def test_swapped_block_that_stacks_a_parametrization_on_one_from_entry_gets_it_back():
    model = _sequential()
    parametrize.register_parametrization(model[0], "weight", nn.Identity())
    state = _trained(model, torch.randn(3, 4))
    cls, live, x = type(model[0]), _live(model), torch.randn(2, 4)
    plist = list(model[0].parametrizations.weight)
    before = model(x).detach()
    named = r"submodule '0\.parametrizations\.weight\.1' added"
    with pytest.raises(fe.SwappedParametersChangedError, match=named), torch.no_grad(), fe.swapped(model, state):
        parametrize.register_parametrization(model[0], "weight", nn.Tanh())
    assert type(model[0]) is cls and list(model[0].parametrizations.weight) == plist
    assert _same_as(model, live) and torch.equal(model(x).detach(), before)


@pytest.mark.parametrize("leave_parametrized", [False, True])
def test_swapped_block_that_removes_a_parametrization_from_entry_gets_it_back(leave_parametrized):
    model = _sequential()
    _custom(model[0])  # bias parametrized on entry (2 * bias)
    state = _trained(model, torch.randn(3, 4))
    cls, live, x = type(model[0]), _live(model), torch.randn(2, 4)
    before = model(x).detach()
    named = r"parametrization of '0\.bias' removed, registered again"
    with pytest.raises(fe.SwappedParametersChangedError, match=named), torch.no_grad(), fe.swapped(model, state):
        parametrize.remove_parametrizations(model[0], "bias", leave_parametrized=leave_parametrized)
    assert type(model[0]) is cls and parametrize.is_parametrized(model[0], "bias")
    assert _same_as(model, live) and torch.equal(model(x).detach(), before)
    fe.update(state, fe.local_shards(model), 4, decay=0.9)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32)  # float32 as integers: NaN equal to itself, -0.0 not equal to 0.0


def test_swapped_memory_tied_weights_whose_emas_hold_a_nan_swap_bitwise():
    torch.manual_seed(0)
    model = MemoryTied()
    state = _trained(model, IDX)
    with torch.no_grad():
        model.enc.weight[0, 0] = float("nan")
    state = fe.update(state, fe.local_shards(model), 4, decay=0.9)
    ema = dict(state.ema)
    assert torch.equal(_bits(ema["enc.weight"]), _bits(ema["dec.weight"])) and ema["enc.weight"].isnan().any()
    live = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad(), fe.swapped(model, state):  # identical bits on the overlap, NaN included: not refused
        assert all(torch.equal(_bits(p), _bits(ema[n])) for n, p in model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(_bits(p), _bits(live[n])) for n, p in model.named_parameters(remove_duplicate=False))


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.pd = nn.ParameterDict({"a": nn.Parameter(torch.randn(3)), "b": nn.Parameter(torch.randn(3))})
        self.pl = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(2)])

    def forward(self, x):
        return self.lin(x) * sum(self.pd.values()) + sum(self.pl)


def _pop_and_set_again(pd: nn.ParameterDict) -> None:
    pd["a"] = pd.pop("a")  # the same object, now last


_ADDITIONS = {
    "attribute": (lambda m: setattr(m.lin, "extra", nn.Parameter(torch.zeros(3))), r"parameter 'lin\.extra' added"),
    "list_append": (lambda m: m.pl.append(nn.Parameter(torch.zeros(3))), r"parameter 'pl\.2' added"),
    "dict_set": (lambda m: m.pd.__setitem__("c", nn.Parameter(torch.zeros(3))), r"parameter 'pd\.c' added"),
    "dict_plain": (lambda m: m.pd.__setitem__("s", "text"), r"entry 'pd\.s' added"),
    "dict_pop": (lambda m: m.pd.pop("a"), r"'pd\.a' removed"),
    "dict_reorder": (lambda m: _pop_and_set_again(m.pd), r"parameters of 'pd' reordered"),
    "dict_plain_over_popped": (lambda m: (m.pd.pop("a"), m.pd.__setitem__("a", 1.0)), r"entry 'pd\.a' added"),
}


@pytest.mark.parametrize("edit", list(_ADDITIONS))
def test_swapped_block_that_edits_parameter_registries_and_containers_gets_them_back(edit):
    apply, named = _ADDITIONS[edit]
    torch.manual_seed(0)
    model = Containers()
    x = torch.randn(2, 3)
    state = _trained(model, x)
    live, before = _live(model), model(x).detach()
    keys, items, registries = list(model.pd.keys()), list(model.pl), [list(m._parameters) for m in model.modules()]
    with pytest.raises(fe.SwappedParametersChangedError, match=named), torch.no_grad(), fe.swapped(model, state):
        apply(model)
    assert list(model.pd.keys()) == keys and len(model.pd) == 2 and all(model.pd[k] is live[f"pd.{k}"][0] for k in keys)
    assert len(model.pl) == 2 and all(p is q for p, q in zip(model.pl, items))
    assert [list(m._parameters) for m in model.modules()] == registries
    assert _same_as(model, live) and torch.equal(model(x).detach(), before)
    fe.update(state, fe.local_shards(model), 4, decay=0.9)  # no parameter left that the state lacks


def test_swapped_refuses_a_backward_through_a_model_compiled_before_the_block():
    """Hooks added to the modules inside a torch.compile wrapper after it compiled do not run in its compiled
    forward; the wrapper's own hooks do. A backward in the block is refused and leaves every .grad as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="eager")
    state = fe.init_ema(fe.local_shards(compiled))
    x = torch.randn(3, 4)
    compiled(x).sum().backward()  # compiled before the block, as in training
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(fe.SwappedTrainingError, match="backward through a forward"), fe.swapped(compiled, state):
        compiled(x).sum().backward()
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p.detach(), live[n]) for n, p in model.named_parameters())
    with torch.no_grad(), fe.swapped(compiled, state):  # evaluation in the block still runs compiled
        assert torch.equal(compiled(x), model(x))


def test_update_of_the_swapped_state_is_refused_whatever_weights_it_is_given():
    """Inside ``fe.swapped(model, state)`` the parameters hold ``state``'s EMA: ``update(state, ...)`` is refused
    (before anything changes) with a dict of the model's weights too, read before or inside the block, also with
    ``inplace=False`` or at the state's own step, in nested blocks until the last closes, and after an exception
    leaves a block the mark is gone. After the blocks the same dict updates bitwise as ``torch.lerp``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    other = nn.Linear(4, 3)
    state = fe.init_ema(fe.local_shards(model))
    before = dict(fe.local_shards(model))  # a plain dict over the parameters, read before the block
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # "training": the weights move away from the EMA
    other.load_state_dict(model.state_dict())
    ema0 = {n: t.clone() for n, t in state.ema.items()}
    live = {n: p.detach().clone() for n, p in model.named_parameters()}

    def refused(st, tree, step, **kw):
        with pytest.raises(fe.SwappedTrainingError, match=r"swapped into a model by an open fe\.swapped"):
            fe.update(st, tree, step, decay=0.5, **kw)

    with torch.no_grad(), fe.swapped(model, state):
        refused(state, before, 1)
        refused(state, dict(model.named_parameters()), 1)
        with pytest.raises(fe.SwappedTrainingError, match=r"update\(\) of weights read inside fe\.swapped"):
            fe.update(state, fe.local_shards(model), 1, decay=0.5)  # a Shards read inside: said as such
        refused(state, before, 1, inplace=False)
        refused(state, before, 0)  # the state's own step: refused all the same
        refused(copy.copy(state), before, 1)  # shares the step tensor: the same state
        with fe.swapped(other, state):
            refused(state, before, 1)
        refused(state, before, 1)  # the outer block is still open
        own = copy.deepcopy(state)  # its own step and buffers: another state, updated as usual
        assert int(fe.update(own, {n: t.clone() for n, t in live.items()}, 1, decay=0.5).step) == 1
    assert int(state.step) == 0 and all(torch.equal(state.ema[n], ema0[n]) for n in ema0)
    assert all(torch.equal(p.detach(), live[n]) for n, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), fe.swapped(model, state):
        raise RuntimeError("boom")
    assert not hasattr(state.step, "_fe_swapped")  # cleared on exit, also on an exception: nothing left on the tensor
    state = fe.update(state, before, 1, decay=0.5)  # after the block: the trained weights
    assert int(state.step) == 1
    assert all(torch.equal(state.ema[n], torch.lerp(ema0[n], live[n], 0.5)) for n in ema0)


def test_the_swapped_mark_stays_with_the_state_and_survives_threads(tmp_path):
    """Review: the mark was a count in the step tensor's ``__dict__``, which ``copy.deepcopy`` and
    ``torch.save``/``load`` of the tensor carry: a copy taken inside a block was refused for good; and its
    read-modify-write lost counts across threads (a closed state refused for good)."""
    import io
    import sys
    import threading

    from functional_ema._state import marked_swapped, swapped_count

    model = nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(model))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad(), fe.swapped(model, state):
        step_copy = copy.deepcopy(state.step)
        buf = io.BytesIO()
        torch.save(state.step, buf)
        buf.seek(0)
        step_loaded = torch.load(buf, weights_only=True)
    for step in (step_copy, step_loaded):  # other states' steps: never marked by the block
        other = fe.EmaState(step, ({n: t.clone() for n, t in state.ema.items()},))
        assert int(fe.update(other, weights, 1, decay=0.5).step) == 1
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:

        def churn():
            for _ in range(300):
                with marked_swapped(state):
                    assert swapped_count(state.step) >= 1

        threads = [threading.Thread(target=churn) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert swapped_count(state.step) == 0 and not hasattr(state.step, "_fe_swapped")
    assert int(fe.update(state, weights, 1, decay=0.5).step) == 1


# ------------------------------------------------------------------- Ctrl-C landing in a swap's exit


def ctrl_c_in_exits(run_block: Callable[[Callable[[], None]], None], check: Callable[[int], None], trials: int) -> int:
    """Run a swap block ``trials`` times, a ``KeyboardInterrupt`` landing at another moment of its exit each time, and
    ``check(trial)`` after each, the interruption caught (as a trainer that saves on Ctrl-C catches it, its exception
    still alive); return how many interruptions came out of functional_ema's code (landed inside the block's exit).

    The interruption is the one Ctrl-C's default handler raises, from a real signal: a SIGALRM armed, with
    ``setitimer``'s microseconds, as the body's last statement (``run_block(arm)`` calls ``arm()`` there), whose
    handler raises it at the next bytecode boundary of the main thread, wherever the exit is. The delays sweep 1.2
    times the exit's measured duration, one step per trial (a late one lands after the block, in the wait below).
    Main thread only (signal handlers run there)."""

    def raise_interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, raise_interrupt)
    try:
        ends: list[float] = []
        durations = []
        for _ in range(7):
            run_block(lambda: ends.append(time.perf_counter()))
            durations.append(time.perf_counter() - ends[-1])
        exit_s = sorted(durations)[3]
        landed = 0
        for trial in range(trials):
            delay = max(1e-6, 1.2 * exit_s * trial / trials)
            try:
                run_block(lambda: signal.setitimer(signal.ITIMER_REAL, delay))
                while True:  # the alarm is armed: it lands here if the exit ended before it
                    time.sleep(1e-3)
            except KeyboardInterrupt as interrupt:
                frames = traceback.extract_tb(interrupt.__traceback__)
                landed += any("functional_ema" in f.filename for f in frames)
                if not _before_resuming(frames):
                    check(trial)  # as a trainer that saves on Ctrl-C sees the model: the exception alive
            check(trial)
        return landed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _before_resuming(frames: traceback.StackSummary) -> bool:
    """Whether the interruption landed at the first bytecode of contextlib's ``__exit__``, before it resumed the swap's
    generator: no code of the swap can run there (Python offers no way to defer a signal's exception), so its exit
    runs when that generator is finalized, once the exception, whose traceback holds it, is dropped."""
    entry = contextlib._GeneratorContextManager.__exit__.__code__.co_firstlineno
    return len(frames) >= 2 and frames[-2].filename == contextlib.__file__ and frames[-2].lineno == entry


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
def test_ctrl_c_landing_anywhere_in_the_exit_of_swapped_still_restores_every_parameter_bitwise():
    """Probe AO F1: Ctrl-C during the exit of ``swapped`` stopped the copy back of the live weights half-way: the
    parameters not reached yet kept the EMA, their kept-aside values dropped, and training (or a checkpoint saved
    on the KeyboardInterrupt) went on with mixed weights. Now every value is back, with autograd's versions, before
    the KeyboardInterrupt comes out, and the state is not left marked swapped."""
    from functional_ema._state import swapped_count

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(100)])  # 200 parameters: an exit of a few ms
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for t in state.ema.values():
            t.add_(1.0)  # the EMA differs from every weight
    live = _live(model)
    versions = {n: p._version for n, p in model.named_parameters()}

    def run_block(arm: Callable[[], None]) -> None:
        with fe.swapped(model, state):
            arm()

    def check(trial: int) -> None:
        wrong = [n for n, (p, v, _) in live.items() if not torch.equal(p.detach(), v)]
        assert not wrong, f"trial {trial}: {len(wrong)} parameters hold the EMA after Ctrl-C, e.g. {wrong[:3]}"
        moved = [n for n, p in model.named_parameters() if p._version != versions[n]]
        assert not moved, f"trial {trial}: autograd versions of {moved[:3]} moved"
        assert swapped_count(state.step) == 0, f"trial {trial}: the state is left marked swapped"
        assert torch.is_grad_enabled(), f"trial {trial}: gradients left off (an interrupted no_grad)"
        hooked = [n for n, m in model.named_modules() if m._forward_hooks]
        assert not hooked, f"trial {trial}: the block's forward hooks left on {hooked[:3]}: training refused for good"

    landed = ctrl_c_in_exits(run_block, check, trials=150)
    assert landed >= 50, f"only {landed} of 150 interruptions landed in the exit: the sweep missed it"
    assert _same_as(model, live)


def test_finish_makes_every_call_once_more_after_an_interruption_and_raises_a_real_error():
    """``finish`` (the exits' loop): an exception landing in a call makes that call again and the next ones, then is
    raised; a call failing every time is its own error: the others are still made, and it is raised, not the
    interruption (the values are not all back)."""
    from functional_ema._state import finish

    done: list[int] = []
    cut = [True]

    def do(k: int) -> None:
        if k == 2 and cut[0]:
            cut[0] = False
            raise KeyboardInterrupt
        done.append(k)

    with pytest.raises(KeyboardInterrupt):
        finish((do, range(5)))
    assert done == [0, 1, 2, 3, 4]

    def bad(k: int) -> None:
        if k == 1:
            raise RuntimeError(f"item {k} cannot be put back")
        done.append(k)

    done.clear()
    cut[0] = True
    with pytest.raises(RuntimeError, match="item 1 cannot be put back"):
        finish((do, range(3)), (bad, range(3)))
    assert done == [0, 1, 2, 0, 2]
    # Ctrl-C pressed again and again on one call is no error of that call: it is made again until it is done
    presses = [5]

    def pressed(k: int) -> None:
        if k == 0 and presses[0]:
            presses[0] -= 1
            raise KeyboardInterrupt
        done.append(k)

    done.clear()
    with pytest.raises(KeyboardInterrupt):
        finish((pressed, range(3)))
    assert done == [0, 1, 2] and presses == [0]


def fsdp2_ctrl_c_worker(trials: int) -> dict:
    """A rank of an FSDP2 model (``fully_shard`` over 2 gloo ranks): its own exits of ``swapped`` interrupted
    (``ctrl_c_in_exits``: FSDP2's exit reshards, a local operation, no collective)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(60)])
    fully_shard(model)
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for t in state.ema.values():
            t.add_(1.0)  # the EMA differs from every weight
    live = {n: (p, p.to_local().detach().clone()) for n, p in model.named_parameters()}
    problems: list[str] = []

    def run_block(arm: Callable[[], None]) -> None:
        with fe.swapped(model, state):
            arm()

    def check(trial: int) -> None:
        now = dict(model.named_parameters())
        wrong = [n for n, (p, v) in live.items() if now[n] is not p or not torch.equal(p.to_local(), v)]
        if wrong or not torch.is_grad_enabled():
            problems.append(
                f"trial {trial}: {len(wrong)} wrong, e.g. {wrong[:2]}; gradients on {torch.is_grad_enabled()}"
            )

    landed = ctrl_c_in_exits(run_block, check, trials=trials)
    return {"landed": landed, "problems": problems[:5]}


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
def test_ctrl_c_landing_anywhere_in_the_exit_of_swapped_restores_every_fsdp2_shard_bitwise():
    """Probe AO F1 on FSDP2 (2 ranks): every rank's local shards hold their live values again, bitwise, the same
    parameter objects registered, when Ctrl-C lands anywhere in the exit."""
    from functional_ema._testing.multirank import run_ranks

    results = run_ranks(
        "tests.test_swap_edits:fsdp2_ctrl_c_worker", world_size=2, timeout=300, env={"FE_DIST_INIT": "torch"}, trials=80
    )
    for rank, r in enumerate(results):
        assert not r["problems"], (rank, r)
        assert r["landed"] >= 25, (rank, f"only {r['landed']} of 80 interruptions landed in the exit")
