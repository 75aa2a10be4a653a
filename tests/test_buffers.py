"""Buffers carried beside the EMA, and the framework-free controller, in one process (world 1).

References are plain ``lerp_`` per tensor; integer buffers must be copied, never averaged.
"""

from __future__ import annotations

import contextlib
import copy
import re
import signal

import pytest
import torch
from torch import nn

import functional_ema as fe
from functional_ema.integrations import EMAController


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))


def test_average_and_copy_modes_and_integer_buffers():
    net = _net()
    avg = fe.buffers.init_buffers(net, num_emas=2)
    cp = fe.buffers.init_buffers(net)
    ref = {n: b.detach().clone() for n, b in net.named_buffers() if b.is_floating_point()}
    for step in range(1, 5):
        net(torch.randn(16, 5))
        avg = fe.buffers.update_buffers(avg, net, step, decay=[0.5, 0.9])
        cp = fe.buffers.update_buffers(cp, net, step, mode="copy")
        for n, b in net.named_buffers():
            if b.is_floating_point():
                ref[n].lerp_(b, 0.5)
    live = dict(net.named_buffers())
    assert all(torch.equal(avg.emas[0][n], ref[n]) for n in ref)
    assert not torch.equal(avg.emas[1]["1.running_mean"], avg.emas[0]["1.running_mean"])
    assert all(torch.equal(cp.emas[0][n], live[n]) for n in ref)
    assert avg.copied["1.num_batches_tracked"].dtype == torch.int64 and int(avg.copied["1.num_batches_tracked"]) == 4
    assert int(avg.step) == 4
    assert fe.buffers.update_buffers(avg, net, 4) is avg  # same step: a no-op


def test_swapped_buffers_restores_and_evaluates_with_ema():
    net = _net()
    b = fe.buffers.init_buffers(net)
    net(torch.randn(16, 5))
    b = fe.buffers.update_buffers(b, net, 1, decay=0.5)
    live = {n: t.clone() for n, t in net.named_buffers()}
    net.eval()
    x = torch.randn(4, 5)
    twin = _net()
    twin.load_state_dict({**net.state_dict(), **b.emas[0], **b.copied})
    twin.eval()
    with torch.no_grad(), fe.buffers.swapped_buffers(net, b):
        assert torch.equal(net(x), twin(x))
    assert all(torch.equal(t, live[n]) for n, t in net.named_buffers())
    with pytest.raises(RuntimeError, match="boom"), fe.buffers.swapped_buffers(net, b):
        raise RuntimeError("boom")
    assert all(torch.equal(t, live[n]) for n, t in net.named_buffers())


def _buffers_changed_inside(net, b, change, raising: bool) -> tuple[str, str]:
    """``change()`` inside ``swapped_buffers`` (raising ``KeyError`` at the end when ``raising``): how it ended."""
    try:
        with torch.no_grad(), fe.buffers.swapped_buffers(net, b):
            change()
            if raising:
                raise KeyError("boom")
    except fe.SwappedParametersChangedError as e:
        return "changed", str(e)
    except KeyError as e:
        return "raised", " ".join(getattr(e, "__notes__", []))
    return "none", ""


def test_swapped_buffers_puts_back_buffers_the_block_retyped_or_replaced():
    """A block that re-types (``net.double()``), re-assigns (``load_state_dict(assign=True)``) the buffers or replaces
    their submodule does not leave the buffer EMA in the model: the buffers are the objects they were, with their
    dtype and live values, and ``SwappedParametersChangedError`` (or a note on the block's error) names them."""
    net = _net()
    b = fe.buffers.init_buffers(net)
    for step in (1, 2):
        net(torch.randn(16, 5))
        b = fe.buffers.update_buffers(b, net, step, decay=0.5)
    net(torch.randn(16, 5))  # the live statistics move away from the EMA
    net.eval()
    objects = dict(net.named_buffers())
    live = {n: t.clone() for n, t in objects.items()}
    assert not torch.equal(live["1.running_mean"], b.emas[0]["1.running_mean"])
    x = torch.randn(4, 5, dtype=torch.float64)
    twin = copy.deepcopy(net).double()
    twin.load_state_dict({**twin.state_dict(), **b.emas[0], **b.copied})
    inside = {}

    def retype():
        net.double()
        inside["forward"] = net(x)

    def assign():
        net.load_state_dict({n: t.clone() for n, t in net.state_dict().items()}, assign=True)

    def submodule():
        net[1] = copy.deepcopy(net[1])

    named = {retype: "buffer '1.running_mean' replaced", assign: "buffer '1.running_mean' replaced"}
    named[submodule] = "submodule '1' replaced by another BatchNorm1d"
    for change, words in named.items():
        for raising in (False, True):
            how, message = _buffers_changed_inside(net, b, change, raising)
            assert how == ("raised" if raising else "changed") and words in message, (change, how, message)
            now = dict(net.named_buffers())
            assert all(now[n] is objects[n] and torch.equal(now[n], live[n]) for n in live), (change, raising)
            assert all(now[n].dtype == live[n].dtype for n in live)
            net.float()  # the parameters stay as the block left them
    with torch.no_grad():
        assert torch.equal(inside["forward"], twin(x))  # the forward inside had the buffer EMA, in float64


def test_swapped_buffers_refuses_buffers_of_other_shapes_before_anything_changes():
    """A buffer state of a model with the same buffer names but other shapes is refused naming the buffer (``copy_``
    would broadcast a (1,) EMA into a (4,) buffer), as ``update_buffers`` refuses it; nothing changes."""

    def make(n):
        net = nn.Sequential(nn.Linear(4, n), nn.BatchNorm1d(n))
        net(torch.randn(8, 4))
        return net

    b = fe.buffers.init_buffers(make(1))
    net = make(4)
    live = {n: t.clone() for n, t in net.named_buffers()}
    shapes = r"buffer '1.running_mean' has shape \(4,\) in the model but \(1,\)"
    with pytest.raises(ValueError, match=shapes), fe.buffers.swapped_buffers(net, b):
        pass
    assert all(torch.equal(t, live[n]) for n, t in net.named_buffers())


def test_wrong_model_is_refused():
    b = fe.buffers.init_buffers(_net())
    with pytest.raises(ValueError, match="another model"):
        fe.buffers.update_buffers(b, nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(9)), 1)
    with pytest.raises(ValueError, match='mode must be "average" or "copy"'):
        fe.buffers.update_buffers(b, _net(), 1, mode="mean")


def _buffer_snapshot(b) -> list:
    """The step counter, every buffer EMA and every copied buffer, cloned (meta left as is)."""
    step = b.step.clone() if isinstance(b.step, torch.Tensor) and not b.step.is_meta else b.step
    return [step, *[t.clone() for ema in b.emas for t in ema.values()], *[t.clone() for t in b.copied.values()]]


def _same(a: list, b: list) -> bool:
    if len(a) != len(b) or type(a[0]) is not type(b[0]):
        return False
    if isinstance(a[0], torch.Tensor) and (a[0].is_meta or b[0].is_meta or a[0].dtype != b[0].dtype):
        return a[0].is_meta and b[0].is_meta
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"dtype": "float32"}, TypeError, r"dtype must be a torch.dtype .*pass dtype=torch.float32"),
        ({"dtype": torch.float8_e4m3fn}, TypeError, r"dtype=torch.float8_e4m3fn is not a supported EMA dtype"),
        ({"dtype": torch.int64}, TypeError, r"dtype=torch.int64 is not a supported EMA dtype"),
        ({"num_emas": "2"}, TypeError, r"num_emas must be an int >= 1 .*got str '2'"),
        ({"num_emas": 2.0}, TypeError, r"num_emas must be an int >= 1 .*got float 2.0"),
        ({"num_emas": True}, TypeError, r"num_emas must be an int >= 1 .*got a bool"),
        ({"num_emas": 0}, ValueError, r"num_emas must be in \[1, 1024\]"),
        ({"step": 2.7}, TypeError, r"step must be an int, got float 2.7"),
        ({"step": "5"}, TypeError, r"step must be an int, got str '5'"),
        ({"step": True}, TypeError, r"step must be an int, got a bool"),
        ({"step": -1}, ValueError, r"step=-1 is outside \[0, 2\*\*63 - 1\]"),
        ({"step": 2**63}, ValueError, r"step=9223372036854775808 is outside"),
    ],
    ids=str,
)
def test_odd_init_buffers_arguments_refused(kwargs, err, match):
    net = _net()
    live = {n: t.clone() for n, t in net.named_buffers()}
    with pytest.raises(err, match=match):
        fe.buffers.init_buffers(net, **kwargs)
    assert all(torch.equal(t, live[n]) for n, t in net.named_buffers())


def test_meta_buffers_refused_naming_the_buffer():
    net = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7, device="meta"))
    with pytest.raises(ValueError, match=r"buffer '1.running_mean' is on the meta device"):
        fe.buffers.init_buffers(net)


@pytest.mark.parametrize(
    "counter, err, match",
    [
        (
            0,
            TypeError,
            r"bstate\.step must be an int64 scalar tensor \(as init_buffers makes it\), got int 0.*load_buffers",
        ),
        (torch.tensor(2**31 - 1, dtype=torch.int32), TypeError, r"bstate\.step must be .*dtype torch.int32"),
        (torch.tensor(0.0), TypeError, r"bstate\.step must be .*dtype torch.float32"),
        (torch.tensor([0, 0]), ValueError, r"bstate\.step must be .*shape \(2,\)"),
        (torch.tensor(0, device="meta"), ValueError, r"bstate\.step must be .*on meta"),
    ],
    ids=str,
)
def test_odd_buffer_step_counters_refused_before_anything_moves(counter, err, match):
    net = _net()
    good = fe.buffers.init_buffers(net)
    net(torch.randn(16, 5))  # the live buffers move, the state must not
    bad = fe.buffers.BufferState(counter, good.emas, good.copied)
    snap = _buffer_snapshot(bad)
    for mode in ("average", "copy"):
        with pytest.raises(err, match=match):
            fe.buffers.update_buffers(bad, net, None, decay=0.5, mode=mode)
        assert _same(_buffer_snapshot(bad), snap)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"step": "5"}, TypeError, r"step must be an int, got str '5'"),
        ({"step": 2.7}, TypeError, r"step must be an int, got float 2.7"),
        ({"step": 2**63}, ValueError, r"step=9223372036854775808 is outside"),
        ({"decay": lambda s: None}, TypeError, r"the decay callable '.*<lambda>' gave None at step 1"),
        ({"decay": lambda s: "0.5"}, TypeError, r"the decay callable '.*<lambda>' gave '0.5' \(a str\) at step 1"),
        ({"decay": "0.5"}, TypeError, r"decay must be a float, a schedule or a callable"),
        ({"decay": 1.5}, ValueError, r"decay must be in \[0, 1\]"),
    ],
    ids=str,
)
def test_odd_update_buffers_arguments_refused_before_anything_moves(kwargs, err, match):
    net = _net()
    b = fe.buffers.init_buffers(net)
    net(torch.randn(16, 5))
    snap = _buffer_snapshot(b)
    with pytest.raises(err, match=match):
        fe.buffers.update_buffers(b, net, **kwargs)
    assert _same(_buffer_snapshot(b), snap)  # the integer buffers were not copied either


def test_controller_every_n_start_k_save_load_consolidate_strict(tmp_path):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    c = EMAController([0.9, 0.5], every_n_steps=3, start_step=2, buffers="average")
    ref = None
    moved = []
    for step in range(1, 11):
        opt.zero_grad()
        net(torch.randn(16, 5)).square().mean().backward()
        opt.step()
        for _micro in range(2):  # the same step again (gradient accumulation): a no-op
            moved.append(c.on_step(net, step))
        if step == 2:
            ref = {n: p.detach().clone() for n, p in net.named_parameters()}
            last = 2
        elif step > 2 and step % 3 == 0:
            w = 1 - 0.9 ** (step - last)
            for n, p in net.named_parameters():
                ref[n].lerp_(p.detach(), w)
            last = step
    assert moved == [
        False,
        False,
        True,
        False,
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    assert int(c.state.step) == 9
    assert all(torch.equal(c.state.emas[0][n].view(p.shape), ref[n]) for n, p in net.named_parameters())
    c.save(net, tmp_path, 10)
    sd = fe.buffers.consolidate(tmp_path, "ema")
    assert str(_net().load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
    c2 = EMAController([0.9, 0.5], every_n_steps=3, start_step=2, buffers="average")
    c2.load(net, tmp_path, framework_step=10)
    assert int(c2.state.step) == 9 and torch.equal(
        c2.buffer_state.copied["1.num_batches_tracked"], c.buffer_state.copied["1.num_batches_tracked"]
    )
    with pytest.raises(fe.CheckpointError, match="framework step 10, but the training resumed at step 5"):
        EMAController([0.9, 0.5], every_n_steps=3, start_step=2).load(net, tmp_path, framework_step=5)
    with pytest.raises(fe.CheckpointError, match="tracks 2 EMA"):
        EMAController(0.9).load(net, tmp_path, framework_step=10)
    with pytest.raises(
        fe.CheckpointError,
        match=r"EMA is at step 9, but at framework step 10 the rules \(start_step=0, "
        r"every_n_steps=1\) put it at step 10",
    ):
        EMAController([0.9, 0.5]).load(net, tmp_path, framework_step=10)


def test_controller_before_start_saves_marker_and_resumes_unstarted(tmp_path):
    net = _net()
    c = EMAController(0.9, start_step=100)
    assert c.on_step(net, 5) is False and c.state is None
    c.save(net, tmp_path, 5)
    c2 = EMAController(0.9, start_step=100)
    c2.load(net, tmp_path, framework_step=5)
    assert c2.state is None
    with c2.swapped(net) as swapped:
        assert swapped is False


def test_controller_start_rule_step_zero_never_starts():
    """The EMA starts after the first optimizer step >= max(1, start_step): step 0 (micro-batches
    before the first optimizer step) never starts it, so accumulation does not change the EMA."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plain = [EMAController([0.9, 0.5], start_step=k) for k in (0, 1, 3)]
    accum = [EMAController([0.9, 0.5], start_step=k) for k in (0, 1, 3)]
    assert all(c.on_step(net, 0) is False and c.state is None for c in accum)  # no optimizer step yet
    started_at = {}
    for step in range(1, 6):
        opt.zero_grad()
        net(torch.randn(16, 5)).square().mean().backward()
        opt.step()
        for k, c in zip((0, 1, 3), plain):
            if c.on_step(net, step) and k not in started_at:
                started_at[k] = step
                assert all(torch.equal(c.state.emas[0][n].view(p.shape), p) for n, p in net.named_parameters())
        for c in accum:  # the micro-batches of an accumulation of 2: the step before, then this step
            c.on_step(net, step - 1)
            c.on_step(net, step)
    assert started_at == {0: 1, 1: 1, 3: 3}
    for a, b in zip(plain + plain[:1], accum + plain[1:2]):  # start_step 0 and 1 are the same rule
        assert int(a.state.step) == int(b.state.step) == 5
        assert all(torch.equal(x[n], y[n]) for x, y in zip(a.state.emas, b.state.emas) for n in x)


def test_controller_copy_to_model_and_export(tmp_path):
    from safetensors.torch import load_file

    net = _net()
    c = EMAController(0.5, buffers="copy")
    assert c.on_step(net, 1) is True  # starts: the EMA equals the weights after optimizer step 1
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    net(torch.randn(16, 5))
    c.on_step(net, 2)
    assert not any(
        torch.equal(c.state.emas[0][n].view(p.shape), p) for n, p in net.named_parameters()
    )  # a real average
    want = {n: t.view(dict(net.named_parameters())[n].shape).clone() for n, t in c.state.emas[0].items()}
    c.export(net, tmp_path / "ema.safetensors")
    exported = load_file(tmp_path / "ema.safetensors")
    assert all(torch.equal(exported[n], want[n]) for n in want)
    c.copy_to_model(net)
    assert all(torch.equal(p, want[n]) for n, p in net.named_parameters())


def test_controller_rejects_bad_config():
    with pytest.raises(ValueError, match="every_n_steps"):
        EMAController(0.9, every_n_steps=0)
    with pytest.raises(ValueError, match="buffers"):
        EMAController(0.9, buffers="mean")
    with pytest.raises(ValueError, match="posthoc_dir and posthoc_every"):
        EMAController(0.9, posthoc_every=10)
    with pytest.raises(TypeError, match="power EMAs"):
        EMAController(0.9, posthoc_dir="x", posthoc_every=10)
    with pytest.raises(TypeError, match=r"pass dtype=torch\.bfloat16"):
        EMAController(0.9, dtype="bfloat16")


def test_buffers_made_under_inference_mode_update_outside_it():
    # e.g. started lazily at the first evaluation: init_buffers makes normal tensors there, so the next
    # update_buffers averages and copies as plain torch does, instead of failing after the EMAs moved.
    net = _net()
    with torch.inference_mode():
        b = fe.buffers.init_buffers(net, num_emas=2)
    net(torch.randn(16, 5))
    live = dict(net.named_buffers())
    expect = [{n: e[n].clone().lerp_(live[n], 1 - d) for n in e} for e, d in zip(b.emas, (0.5, 0.9))]
    b = fe.buffers.update_buffers(b, net, 1, decay=[0.5, 0.9])
    assert int(b.step) == 1 and torch.equal(b.copied["1.num_batches_tracked"], live["1.num_batches_tracked"])
    assert all(torch.equal(e[n], x[n]) for e, x in zip(b.emas, expect) for n in x)


@pytest.mark.parametrize("which", ["step", "copied", "emas"])
def test_buffer_state_holding_inference_tensors_refused_before_anything_moves(which):
    net = _net()
    good = fe.buffers.init_buffers(net)
    with torch.inference_mode():  # built by hand there: inference tensors
        inf = fe.buffers.BufferState(good.step.clone(), copy.deepcopy(good.emas), copy.deepcopy(good.copied))
    bad = good._replace(**{which: getattr(inf, which)})  # only this part is made of inference tensors
    net(torch.randn(16, 5))
    snap = _buffer_snapshot(bad)
    for mode in ("average", "copy"):
        with pytest.raises(ValueError, match=rf"bstate\.{which}.*inference tensor.*init_buffers"):
            fe.buffers.update_buffers(bad, net, None, decay=0.5, mode=mode)
        assert _same(_buffer_snapshot(bad), snap)


@pytest.mark.parametrize("decay", [1.5, [0.9], "not a decay", [0.5, float("nan")]], ids=str)
def test_update_buffers_copy_checks_decay_as_average_does(decay):
    net = _net()
    b = fe.buffers.init_buffers(net, num_emas=2)
    net(torch.randn(16, 5))
    snap = _buffer_snapshot(b)
    with pytest.raises((TypeError, ValueError)) as average:
        fe.buffers.update_buffers(b, net, None, decay=decay, mode="average")
    if isinstance(decay, list):  # the same refusal
        with pytest.raises(type(average.value), match=re.escape(str(average.value))):
            fe.buffers.update_buffers(b, net, None, decay=decay, mode="copy")
    else:  # one decay stands for every EMA in "copy" (nothing to compound): refused for its value only
        with pytest.raises((TypeError, ValueError), match="decay"):
            fe.buffers.update_buffers(b, net, None, decay=decay, mode="copy")
    assert _same(_buffer_snapshot(b), snap)
    fe.buffers.update_buffers(b, net, None, mode="copy")  # the default decay copies a state of 2 EMAs
    b = fe.buffers.update_buffers(b, net, None, decay=[0.5, 0.9], mode="copy")  # a good decay: copied
    live = dict(net.named_buffers())
    assert all(torch.equal(e[n], live[n]) for e in b.emas for n in e)


def test_a_buffer_whose_elements_share_memory_is_refused_naming_it_before_anything_changes():
    """An expanded (stride-0) persistent buffer: init_buffers and update_buffers average it, but swapped_buffers
    raised torch's own copy_ error naming no buffer, and EMAController.copy_to_model would write the weights first.
    Both refuse now, naming the buffer, with the model untouched."""

    class PE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("pe", torch.arange(4.0).expand(3, 4))

    model = PE()
    bstate = fe.buffers.init_buffers(model)
    model.register_buffer("pe", (torch.arange(4.0) + 1).expand(3, 4))
    bstate = fe.buffers.update_buffers(bstate, model, 1, decay=0.5)
    assert torch.equal(bstate.emas[0]["pe"], (torch.arange(4.0) + 0.5).expand(3, 4))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    shared = r"swapped_buffers: buffer 'pe' \(shape \(3, 4\), strides \(0, 1\)\) has elements"
    with pytest.raises(ValueError, match=shared), fe.buffers.swapped_buffers(model, bstate):
        pass
    ctrl = EMAController(0.5, buffers="average")
    ctrl.on_step(model, 1)
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    ctrl.on_step(model, 2)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"copy_to_model: buffer 'pe'"):
        ctrl.copy_to_model(model)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # the weights not written either


def test_float16_buffer_ema_warns_and_refuses_values_it_cannot_hold():
    """init_buffers(dtype=float16) of a running variance of 1e6 stored inf silently (init_ema's 16-bit warning was
    not given either); a finite value beyond float16's 65504 is refused naming the buffer, as init_ema refuses it
    naming the parameter. An inf the model already holds is kept as it is."""
    bn = nn.BatchNorm1d(3)
    bn.running_var.fill_(1e6)
    too_big = r"init_buffers\(dtype=torch.float16\): buffer 'running_var' holds values up to 1e\+06"
    with pytest.warns(UserWarning, match="buffer EMA in torch.float16"), pytest.raises(ValueError, match=too_big):
        fe.buffers.init_buffers(bn, dtype=torch.float16)
    with pytest.warns(UserWarning, match="EMA in torch.float16"):
        with pytest.raises(ValueError, match=r"init_ema\(dtype=torch.float16\): parameter 'a.b' holds values up to 7e"):
            fe.init_ema({"a": {"b": torch.tensor([7e4, 1.0])}, "c": [torch.ones(2)]}, dtype=torch.float16)
        state = fe.init_ema({"a": torch.tensor([float("inf"), 1.0])}, dtype=torch.float16)
    assert torch.equal(state.emas[0]["a"], torch.tensor([float("inf"), 1.0], dtype=torch.float16))
    bn.running_var.fill_(2.0)
    with pytest.warns(UserWarning):
        ok = fe.buffers.init_buffers(bn, dtype=torch.float16)
    assert torch.equal(ok.emas[0]["running_var"], torch.full((3,), 2.0, dtype=torch.float16))


def _f64_net():
    """A BatchNorm (float32 statistics) and a float64 buffer whose values float32 cannot hold."""
    net = _net()
    net.register_buffer("t", torch.zeros(3, dtype=torch.float64))
    return net


def _move_f64(net, step: int) -> None:
    net(torch.randn(16, 5))
    with torch.no_grad():
        net.t.copy_(torch.tensor([1 + 1e-12, 1 / 3, 2.0**-30], dtype=torch.float64) * step)


def test_copy_mode_copies_float64_buffers_bitwise_and_average_mode_stays_float32(tmp_path):
    """``mode="copy"`` is the live values bitwise (a float64 buffer too: the state is widened to float64), in the
    state, inside ``swapped_buffers``, after a save in ``consolidate`` and ``load_buffers``; ``mode="average"`` is
    unchanged: a float32 EMA (plain ``lerp_`` of float32 copies)."""
    net = _f64_net()
    cp, avg = fe.buffers.init_buffers(net), fe.buffers.init_buffers(net)
    ref = {n: b.detach().to(torch.float32, copy=True) for n, b in net.named_buffers() if b.is_floating_point()}
    state = fe.init_ema(fe.local_shards(net))
    for step in (1, 2):
        _move_f64(net, step)
        cp2 = fe.buffers.update_buffers(cp, net, step, mode="copy")
        avg = fe.buffers.update_buffers(avg, net, step, decay=0.5)
        state = fe.update(state, fe.local_shards(net), step)
        for n, b in net.named_buffers():
            if b.is_floating_point():
                ref[n].lerp_(b.to(torch.float32), 0.5)
    live = {n: b.detach().clone() for n, b in net.named_buffers()}
    assert cp.emas is cp2.emas and {t.dtype for t in cp.emas[0].values()} == {torch.float64}  # in place, one dtype
    assert all(torch.equal(cp.emas[0][n], live[n].to(torch.float64)) for n in ref)
    assert torch.equal(cp.emas[0]["t"], live["t"]) and cp.emas[0]["t"][0].item() == 2 * (1 + 1e-12)
    assert {t.dtype for t in avg.emas[0].values()} == {torch.float32}
    assert all(torch.equal(avg.emas[0][n], ref[n]) for n in ref)
    with fe.buffers.swapped_buffers(net, cp):
        assert torch.equal(net.t, live["t"]) and torch.equal(net[1].running_var, live["1.running_var"])
    fe.save(state, net, tmp_path, "t", buffers=cp)
    sd = fe.buffers.consolidate(tmp_path, "t")
    assert sd["t"].dtype == torch.float64 and torch.equal(sd["t"], live["t"])
    loaded = fe.buffers.load_buffers(net, tmp_path, "t")
    assert all(torch.equal(loaded.emas[0][n], cp.emas[0][n]) and loaded.emas[0][n].dtype == torch.float64 for n in ref)


def test_controller_copy_mode_float64_buffer_exact_from_the_first_step(tmp_path):
    """The callbacks' controller with ``buffers="copy"`` starts the copies in a dtype that holds every buffer (float64
    here): the state, the evaluation and the export hold the live values bitwise at the start and after updates."""
    from safetensors.torch import load_file

    net = _f64_net()
    _move_f64(net, 1)
    c = EMAController(0.5, buffers="copy")
    c.on_step(net, 1)
    assert torch.equal(c.buffer_state.emas[0]["t"], net.t)  # at the start: no float32 rounding
    _move_f64(net, 2)
    c.on_step(net, 2)
    live = {n: b.detach().clone() for n, b in net.named_buffers()}
    with c.swapped(net):
        assert torch.equal(net.t, live["t"])
    c.export(net, tmp_path / "ema.safetensors")
    exported = load_file(tmp_path / "ema.safetensors")
    assert all(torch.equal(exported[n].to(b.dtype), b) for n, b in live.items())
    assert EMAController(0.5, buffers="average")._init_buffers(net, 1).emas[0]["t"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16])
def test_buffer_of_a_dtype_no_checkpoint_stores_refused_at_init_buffers(tmp_path, dtype):
    """A complex or uint16 buffer is refused when the buffer state is made, naming the buffer, its dtype, the storable
    dtypes (the writer's list) and what to do; not steps later at the first save. A non-persistent one (torchtitan's
    freqs_cis is registered persistent=False) is not in the state at all: saved and loaded."""
    from functional_ema._io import DTYPE_TO_STR

    net = _net()
    net.register_buffer("freqs_cis", torch.ones(4, dtype=dtype))
    with pytest.raises(TypeError) as e:
        fe.buffers.init_buffers(net)
    msg = str(e.value)
    assert f"init_buffers: buffer 'freqs_cis' has dtype {dtype}, which a checkpoint cannot store" in msg
    assert all(str(d).removeprefix("torch.") in msg for d in DTYPE_TO_STR) and "persistent=False" in msg
    with pytest.raises(TypeError, match="buffer 'freqs_cis' has dtype"):
        EMAController(0.5, buffers="average").on_step(net, 1)
    del net.freqs_cis
    net.register_buffer("freqs_cis", torch.ones(4, dtype=dtype), persistent=False)
    b = fe.buffers.update_buffers(fe.buffers.init_buffers(net), net, 1)
    assert "freqs_cis" not in {**b.emas[0], **b.copied}
    fe.save(fe.init_ema(fe.local_shards(net), step=1), net, tmp_path, "t", buffers=b)
    assert int(fe.buffers.load_buffers(net, tmp_path, "t").step) == 1


class _Shared(nn.Module):
    """One buffer tensor registered under two names (``base`` and ``sub.shared``), as ``state_dict`` lists it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("base", torch.zeros(6))
        self.sub = nn.Module()
        self.sub.register_buffer("shared", self.base)

    def forward(self, x):
        with torch.no_grad():
            self.base.add_(torch.arange(6.0))
        return self.lin(x)


def test_a_buffer_shared_under_two_names_consolidates_for_strict_load(tmp_path):
    """Every ``state_dict`` name is in the state and in ``buffers.consolidate`` (so ``load_state_dict(strict=True)``
    loads it), each name the plain-torch EMA of the one tensor; a checkpoint saved with the first name only (as 0.4.0
    saved them) still loads, the second name filled from the first."""
    net = _Shared()
    b = fe.buffers.init_buffers(net)
    ref = net.base.detach().clone()
    for step in (1, 2, 3):
        net(torch.randn(2, 4))
        b = fe.buffers.update_buffers(b, net, step, decay=0.5)
        ref.lerp_(net.base, 0.5)
    assert sorted(fe.buffers.module_buffers(net)) == sorted(n for n in net.state_dict() if not n.startswith("lin."))
    assert torch.equal(b.emas[0]["base"], ref) and torch.equal(b.emas[0]["sub.shared"], ref)
    state = fe.update(fe.init_ema(fe.local_shards(net)), fe.local_shards(net), 3)
    fe.save(state, net, tmp_path, "t", buffers=b)
    sd = fe.buffers.consolidate(tmp_path, "t")
    twin = _Shared()
    assert not twin.load_state_dict(sd, strict=True).missing_keys
    assert torch.equal(twin.sub.shared, ref)
    old = fe.buffers.BufferState(b.step, ({"base": b.emas[0]["base"]},), {})  # what 0.4.0 saved
    fe.save(state, net, tmp_path, "old", buffers=old)
    loaded = fe.buffers.load_buffers(net, tmp_path, "old")
    assert sorted(loaded.emas[0]) == ["base", "sub.shared"] and torch.equal(loaded.emas[0]["sub.shared"], ref)
    assert loaded.emas[0]["sub.shared"].data_ptr() != loaded.emas[0]["base"].data_ptr()  # each moves once an update
    fe.buffers.update_buffers(loaded, net, 4, decay=0.5)
    assert torch.equal(loaded.emas[0]["sub.shared"], loaded.emas[0]["base"])


def test_copy_mode_keeps_float8_buffers_in_float32():
    """torch does not promote float8 types: a copy-mode buffer state over a float8 buffer is float32 (which holds it
    exactly), not a raw RuntimeError from the dtype promotion."""
    m = nn.Linear(2, 2)
    m.register_buffer("scale", torch.tensor([0.5, 448.0]).to(torch.float8_e4m3fn))
    m.register_buffer("count", torch.tensor(3))
    bs = fe.buffers.init_buffers(m)
    bs = fe.buffers.update_buffers(bs, m, 1, decay=0.9, mode="copy")
    with fe.buffers.swapped_buffers(m, bs):
        assert m.scale.dtype == torch.float8_e4m3fn and torch.equal(m.scale.float(), torch.tensor([0.5, 448.0]))


@pytest.mark.parametrize("mode", ["average", "copy"])
def test_update_buffers_inside_swapped_buffers_of_the_same_state_is_refused(mode):
    """Inside ``swapped_buffers(net, bstate)`` the buffers hold ``bstate``'s EMA: ``update_buffers(bstate, net)``
    is refused (``SwappedTrainingError``) before anything changes, also in nested blocks and after an exception
    leaves one; another buffer state updates as usual. After the block the update is ``torch.lerp`` bitwise."""
    net = _net()
    bstate = fe.buffers.init_buffers(net)
    net.train()
    net(torch.randn(8, 5))  # the running statistics move away from the EMA
    live = {n: b.detach().clone() for n, b in net.named_buffers()}
    ema0 = {n: t.clone() for n, t in bstate.emas[0].items()}
    copied0 = {n: t.clone() for n, t in bstate.copied.items()}
    other = fe.buffers.init_buffers(net)
    with torch.no_grad(), fe.buffers.swapped_buffers(net, bstate):
        with fe.buffers.swapped_buffers(net, bstate):
            pass
        with pytest.raises(fe.SwappedTrainingError, match="swapped_buffers"):  # the outer block is still open
            fe.buffers.update_buffers(bstate, net, 1, decay=0.5, mode=mode)
        with pytest.raises(fe.SwappedTrainingError, match="before or after the block"):
            fe.buffers.update_buffers(bstate, net, 0, decay=0.5, mode=mode)  # the state's own step too
    assert int(bstate.step) == 0 and all(torch.equal(bstate.emas[0][n], ema0[n]) for n in ema0)
    assert all(torch.equal(bstate.copied[n], copied0[n]) for n in copied0)
    assert int(fe.buffers.update_buffers(other, net, 1, mode=mode).step) == 1  # another state: not marked
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), fe.buffers.swapped_buffers(net, bstate):
        raise RuntimeError("boom")
    assert all(torch.equal(b, live[n]) for n, b in net.named_buffers())
    bstate = fe.buffers.update_buffers(bstate, net, 1, decay=0.5, mode=mode)  # after the block: the live buffers
    weight = 1.0 if mode == "copy" else 0.5
    assert int(bstate.step) == 1
    assert all(torch.equal(bstate.emas[0][n], torch.lerp(ema0[n], live[n], weight)) for n in ema0)
    assert all(torch.equal(bstate.copied[n], live[n]) for n in copied0)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
def test_ctrl_c_landing_anywhere_in_the_exit_of_swapped_buffers_still_restores_every_buffer_bitwise():
    """Probe AO F1b: Ctrl-C during the exit of ``swapped_buffers`` stopped the copy back half-way, leaving BatchNorm
    running statistics holding EMA values. Now every buffer is back (values and autograd versions) before the
    KeyboardInterrupt comes out, and the buffer state is not left marked swapped."""
    from functional_ema._state import swapped_count
    from tests.test_swap_edits import ctrl_c_in_exits

    net = nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(100)])  # 300 buffers, 100 of them integer
    b = fe.buffers.init_buffers(net)
    with torch.no_grad():
        for t in b.emas[0].values():
            t.add_(1.0)
        for t in b.copied.values():
            t.add_(7)
    live = {n: (t, t.clone(), t._version) for n, t in net.named_buffers()}

    def run_block(arm):
        with fe.buffers.swapped_buffers(net, b):
            arm()

    def check(trial):
        wrong = [n for n, (t, v, _) in live.items() if not torch.equal(t, v)]
        assert not wrong, f"trial {trial}: {len(wrong)} buffers hold the EMA after Ctrl-C, e.g. {wrong[:3]}"
        moved = [n for n, (t, _, version) in live.items() if t._version != version]
        assert not moved, f"trial {trial}: autograd versions of {moved[:3]} moved"
        assert swapped_count(b.step) == 0, f"trial {trial}: the buffer state is left marked swapped"
        assert torch.is_grad_enabled(), f"trial {trial}: gradients left off (an interrupted no_grad)"

    landed = ctrl_c_in_exits(run_block, check, trials=150)
    assert landed >= 50, f"only {landed} of 150 interruptions landed in the exit: the sweep missed it"
    assert all(t is live[n][0] for n, t in net.named_buffers())


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("swap", ["buffers", "both"])
def test_swapped_buffers_between_a_training_forward_and_its_backward_leaves_training_bitwise(swap):
    """Probe AO F2: ``swapped_buffers`` in an evaluation mid-step (after a training forward, before its backward)
    moved the running statistics' autograd versions, so ``loss.backward()`` raised "modified by an inplace
    operation" on any BatchNorm model. Now the backward, the optimizer step and the next step equal those of a
    twin run that never swapped, bitwise (weights, gradients, buffers)."""
    x, x_val = torch.randn(8, 6), torch.randn(5, 6)
    runs = []
    for swapping in (False, True):
        net = _bn_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        state = fe.init_ema(fe.local_shards(net))
        b = fe.buffers.init_buffers(net)
        with torch.no_grad():
            for t in [*state.ema.values(), *b.emas[0].values()]:
                t.add_(0.5)
        outs = []
        for step in range(2):
            loss = net(x + step).pow(2).mean()
            if swapping:
                net.eval()
                with torch.no_grad(), contextlib.ExitStack() as stack:
                    if swap == "both":
                        stack.enter_context(fe.swapped(net, state))
                    stack.enter_context(fe.buffers.swapped_buffers(net, b))
                    outs.append(net(x_val))
                net.train()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs.append((net, outs))
    (ref, _), (net, outs) = runs
    for (n, a), (_, c) in zip(ref.state_dict().items(), net.state_dict().items()):
        assert torch.equal(a, c), f"{n} differs from the run that never swapped"
    for (n, a), (_, c) in zip(ref.named_parameters(), net.named_parameters()):
        assert torch.equal(a.grad, c.grad), f"{n}.grad differs from the run that never swapped"
    assert all(not torch.equal(o, ref.eval()(x_val)) for o in outs)  # the block did evaluate with the EMA
