"""Plain ``nn.Module`` and DDP: the same verbs as DeepSpeed, checked against a plain-torch EMA.

World 1 runs in this process; DDP runs on 2 real gloo ranks. Each run checks: the EMA equals a
per-tensor ``lerp_`` of the live weights bitwise, ``update`` makes no collective call, ``swapped``
computes like an unsharded twin loaded with the EMA and restores the weights bitwise, training
inside it is refused with nothing changed, save -> load is bitwise, and offline ``consolidate``
equals the live gather. The cross-engine case loads an EMA saved by DeepSpeed ZeRO-3 at 2 ranks.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import functional_ema as fe
from functional_ema._testing.multirank import ROOT, change_inside_swapped, count_collectives, run_ranks

DECAYS = (0.9, fe.schedules.power(gamma=3.0))


class TiedNet(nn.Module):
    """Uneven sizes, a frozen parameter, a tied pair and a BatchNorm (buffers have no EMA)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(7, 13, bias=False)
        self.mid = nn.Linear(13, 13)
        self.norm = nn.BatchNorm1d(13)
        self.head = nn.Linear(13, 7, bias=False)
        self.tied = self.mid  # the same module twice: its parameters are listed once, as mid.*
        self.frozen = nn.Parameter(torch.randn(9), requires_grad=False)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        h = self.norm(self.tied(h)) + self.frozen.sum() * 0.01
        return self.head(h)


def _batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 7, generator=g), torch.randn(8, 7, generator=g)


def _train_step(model, opt, step: int, rank: int = 0) -> None:
    x, y = _batch(step, rank)
    opt.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def run_checks(model, opt, save_dir: str, rank: int, world: int, make_fresh, steps: int = 5) -> dict:
    """Everything the issue asks of one engine, on this rank; returns a JSON-able report."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    names = [n for n, p in inner.named_parameters() if p.requires_grad]
    report: dict = {"names": names}
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    ref = [{n: p.detach().clone() for n, p in inner.named_parameters() if p.requires_grad} for _ in DECAYS]
    calls = 0
    for step in range(1, steps + 1):
        _train_step(model, opt, step, rank)
        with count_collectives() as counts:
            state = fe.update(state, fe.local_shards(model), step, decay=DECAYS)
        calls += counts["calls"]
        params = dict(inner.named_parameters())
        for k, d in enumerate(DECAYS):
            w = 1.0 - fe.schedules.interval_decay(d, step - 1, step)
            for n in ref[k]:
                ref[k][n].lerp_(params[n].detach(), w)
    report["update_collectives"] = calls
    report["fused"] = fe.update_info(state, fe.local_shards(model)).fused
    full = [fe.gather_full(state, model, index=k) for k in range(2)]
    report["bitwise"] = all(torch.equal(full[k][n], ref[k][n]) for k in range(2) for n in names)
    report["keys"] = sorted(full[0])

    # swapped: forward == an unsharded twin loaded with the EMA; weights restored bitwise.
    inner.eval()
    live = {n: p.detach().clone() for n, p in inner.named_parameters()}
    x, _ = _batch(99, rank)
    with torch.no_grad(), fe.swapped(model, state) as stats:
        out = model(x)
    twin = copy.deepcopy(inner)  # after the forward: DDP broadcast rank 0's buffers in it
    twin.load_state_dict(full[0], strict=False)
    with torch.no_grad():
        report["swap_forward_equal"] = torch.equal(out, twin(x))
    report["swapped_params"] = stats.swapped_params
    report["restored"] = all(torch.equal(p, live[n]) for n, p in inner.named_parameters())
    report["tied_frozen_live"] = torch.equal(inner.frozen, live["frozen"])
    inner.train()

    # Training inside swapped is refused, nothing changes (weights, grads, optimizer state).
    opt_state = copy.deepcopy(opt.state_dict())
    grads = [None if p.grad is None else p.grad.clone() for p in inner.parameters()]
    refused = []
    hoisted = fe.local_shards(model)  # read before the block, as a loop that keeps it would
    ema_before, step_before = {n: t.clone() for n, t in state.emas[0].items()}, int(state.step)
    with fe.swapped(model, state):
        x, y = _batch(7, rank)
        try:
            ((model(x) - y) ** 2).mean().backward()
        except fe.SwappedTrainingError:
            refused.append("backward")
        try:
            opt.step()
        except fe.SwappedTrainingError:
            refused.append("step")
        # An update inside the block would average the EMA (what the parameters hold there) into itself.
        for what, shards, nonfinite in (
            ("update", fe.local_shards(model), None),
            ("kept", hoisted, "skip"),
            ("inner", fe.local_shards(inner), None),  # the module a DDP wrapper holds, read through it or alone
        ):
            try:
                fe.update(state, shards, steps + 1, decay=DECAYS, nonfinite=nonfinite)
            except fe.SwappedTrainingError as e:
                refused.append(what if "inside fe.swapped" in str(e) else str(e))
    report["refused"] = refused
    report["untouched_after_refusal"] = (
        int(state.step) == step_before
        and all(torch.equal(t, ema_before[n]) for n, t in state.emas[0].items())
        and all(torch.equal(p, live[n]) for n, p in inner.named_parameters())
        and all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, inner.parameters()))
        and str(opt.state_dict()) == str(opt_state)
    )

    # Training after a swapped block continues bitwise as without it.
    shadow = copy.deepcopy(inner)
    shadow_opt = torch.optim.AdamW([p for p in shadow.parameters() if p.requires_grad], lr=1e-2)
    shadow_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict would share the moments
    step = steps + 1
    with torch.no_grad(), fe.swapped(model, state):
        model(x)
    _train_step(model, opt, step, rank)
    _train_step(shadow, shadow_opt, step, rank) if world == 1 else None
    if world == 1:
        report["training_unchanged"] = all(torch.equal(a, b) for a, b in zip(inner.parameters(), shadow.parameters()))
    state = fe.update(state, fe.local_shards(model), step, decay=DECAYS)

    # save -> load (a fresh model and state) is bitwise; offline consolidate == live gather.
    fe.save(state, model, save_dir, decay=list(DECAYS))  # tag: global_step{state.step}
    report["tag"] = fe.checkpoint.read_manifest(save_dir)["tag"]  # found through ema_latest
    fresh = make_fresh()
    loaded = fe.load(fresh, save_dir)
    report["load_bitwise"] = int(loaded.step) == step and all(
        torch.equal(loaded.emas[k][n], state.emas[k][n]) for k in range(2) for n in names
    )
    report["load_fused"] = fe.update_info(loaded, fe.local_shards(fresh)).fused
    target = fe.init_ema(fe.local_shards(fresh), num_emas=2)  # load(out=): into the buffers of a state held
    into = fe.load(fresh, save_dir, out=target)
    report["load_into"] = (
        int(into.step) == step
        and all(
            torch.equal(into.emas[k][n], state.emas[k][n])
            and into.emas[k][n].data_ptr() == target.emas[k][n].data_ptr()
            for k in range(2)
            for n in names
        )
        and fe.update_info(into, fe.local_shards(fresh)).fused
    )
    live_full = fe.gather_full(state, model)
    offline = fe.consolidate(save_dir)
    report["consolidate_equal"] = sorted(offline) == sorted(live_full) and all(
        torch.equal(offline[n], live_full[n]) for n in live_full
    )
    return report


def _check(report: dict, world: int) -> None:
    assert report["names"] == ["emb.weight", "mid.weight", "mid.bias", "norm.weight", "norm.bias", "head.weight"]
    assert report["update_collectives"] == 0
    assert report["fused"] and report["bitwise"] and report["keys"] == sorted(report["names"])
    assert report["swap_forward_equal"] and report["restored"] and report["tied_frozen_live"]
    assert report["swapped_params"] == 6
    assert report["refused"] == ["backward", "step", "update", "kept", "inner"] and report["untouched_after_refusal"]
    if world == 1:
        assert report["training_unchanged"]
    assert report["tag"] == "global_step6"
    assert report["load_bitwise"] and report["load_fused"] and report["consolidate_equal"] and report["load_into"]


@pytest.mark.parametrize("flat", [False, True], ids=["own-memory", "flatten_parameters"])
def test_plain_module_world1(tmp_path, flat):
    torch.manual_seed(0)
    model = TiedNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if flat:
        assert _step_twice_then_flatten(model, opt) == (6, True)
    report = run_checks(model, opt, str(tmp_path / "ckpt"), rank=0, world=1, make_fresh=TiedNet)
    _check(report, world=1)
    assert len(fe.local_shards(model).segments) == (1 if flat else 6)


def _step_twice_then_flatten(model, opt) -> tuple[int, bool]:
    """Train two steps (optimizer state exists), ``flatten_parameters``, and compare two more steps
    against an untouched twin: returns (parameters moved, training bitwise equal)."""
    from functional_ema.engines.module import flatten_parameters

    for step in (201, 202):
        _train_step(model, opt, step)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    moved = flatten_parameters(model)
    same = True
    for step in (203, 204):
        _train_step(model, opt, step)
        _train_step(twin, twin_opt, step)
        same = same and all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    return moved, same


def test_flatten_parameters_moves_trainable_contiguous_parameters_only():
    from functional_ema.engines.module import flatten_parameters

    torch.manual_seed(0)
    model = TiedNet()
    model.head.weight.data = model.head.weight.data.t().contiguous().t()  # non-contiguous: stays put
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    frozen_ptr, head_ptr = model.frozen.data_ptr(), model.head.weight.data_ptr()
    assert flatten_parameters(model) == 5  # emb.weight, mid.weight, mid.bias, norm.weight, norm.bias
    after = dict(model.named_parameters())
    assert all(id(after[n]) == ids[n] and torch.equal(after[n], before[n]) for n in before)
    assert model.frozen.data_ptr() == frozen_ptr and model.head.weight.data_ptr() == head_ptr
    storages = {p.untyped_storage().data_ptr() for n, p in after.items() if n not in ("frozen", "head.weight")}
    assert len(storages) == 1
    assert len(fe.local_shards(model).segments) == 2  # the flat buffer and head.weight
    _train_step(model, opt, 1)  # the optimizer still holds the same parameter objects
    assert not torch.equal(model.emb.weight, before["emb.weight"])


def _changed_inside(model, state) -> dict:
    """``swapped`` blocks that re-type the model (``.to(bfloat16)``), load with ``assign=True`` or set a new
    parameter, returning normally and raising: per case, how it ended (``SwappedParametersChangedError`` or the
    block's error with a note) and whether the parameters and buffers are back bitwise (objects, dtype, values)
    and the forward is the trained model's."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    x = _batch(77)[0]
    model.eval()
    with torch.no_grad():
        live = model(x)
    objects = {**dict(inner.named_parameters()), **dict(inner.named_buffers())}
    values = {n: t.detach().clone() for n, t in objects.items()}

    def retype():
        model.to(torch.bfloat16)

    def assign():
        inner.load_state_dict({n: torch.zeros_like(t) for n, t in inner.state_dict().items()}, assign=True)

    def new_parameter():
        inner.mid.weight = nn.Parameter(torch.zeros(13, 13))

    def submodule():  # a copy holding the EMA, registered in its place (e.g. wrapped or fused for evaluation)
        inner.head = copy.deepcopy(inner.head)

    out = {}
    for kind, change in (("retype", retype), ("assign", assign), ("new", new_parameter), ("submodule", submodule)):
        for raising in (False, True):
            caught = change_inside_swapped(model, state, lambda: model(x), change, raising)
            now = {**dict(inner.named_parameters()), **dict(inner.named_buffers())}
            with torch.no_grad():
                forward = model(x)
            out[f"{kind}{'_raising' if raising else ''}"] = {
                "caught": caught,
                "objects": list(now) == list(objects) and all(now[n] is objects[n] for n in objects),
                "values": all(now[n].dtype == values[n].dtype and torch.equal(now[n], values[n]) for n in values),
                "forward": torch.equal(forward, live),
            }
    model.train()
    return out


def _check_changed_inside(report: dict) -> None:
    named = {
        "retype": "'mid.weight' re-typed",
        "assign": "'mid.weight' replaced",
        "new": "'mid.weight' replaced",
        "submodule": "submodule 'head' replaced by another Linear",
    }
    assert sorted(report) == sorted(f"{k}{r}" for k in named for r in ("", "_raising")), report
    for case, got in report.items():
        how, message = got["caught"]
        assert how == ("raised" if case.endswith("_raising") else "changed"), (case, got)
        assert named[case.split("_")[0]] in message, (case, got)
        assert got["objects"] and got["values"] and got["forward"], (case, got)


def test_swapped_block_that_changes_parameters_puts_the_trained_ones_back():
    torch.manual_seed(0)
    model = TiedNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = fe.init_ema(fe.local_shards(model))
    for step in (1, 2):
        _train_step(model, opt, step)
        state = fe.update(state, fe.local_shards(model), step, decay=0.5)
    _check_changed_inside(_changed_inside(model, state))
    # training goes on with the optimizer's parameters, which are the model's
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own moments (load_state_dict aliases them)
    _train_step(model, opt, 3)
    _train_step(twin, twin_opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_update_inside_swapped_is_refused_for_every_reading_and_allowed_after():
    """Inside ``swapped`` the parameters hold the EMA: an update would average the EMA into itself. Refused for the
    Shards of the whole model and of a selection (read before or inside the block), also after a block that raised;
    the state is unchanged, and the next update after the block is the one a run without the block makes."""
    torch.manual_seed(0)
    model = TiedNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    whole = fe.init_ema(fe.local_shards(model))
    part = fe.init_ema(fe.local_shards(model, include=["mid.*"]))
    names = sorted(part.emas[0])
    assert names and set(names) < set(whole.emas[0])
    _train_step(model, opt, 1)
    twin = copy.deepcopy(whole)
    for block_state in (whole, part):
        for raising in (False, True):
            before = {n: t.clone() for n, t in whole.emas[0].items()}, {n: t.clone() for n, t in part.emas[0].items()}
            refused = []
            with contextlib.suppress(KeyError), fe.swapped(model, block_state), torch.no_grad():
                for state, kw in ((whole, {}), (part, {"include": ["mid.*"]})):
                    with pytest.raises(fe.SwappedTrainingError, match=r"update\(\) of weights read inside fe.swapped"):
                        fe.update(state, fe.local_shards(model, **kw), 1, decay=0.5)
                    refused.append(int(state.step))
                if raising:
                    raise KeyError("the block fails")
            assert refused == [0, 0]
            assert all(torch.equal(t, before[0][n]) for n, t in whole.emas[0].items())
            assert all(torch.equal(t, before[1][n]) for n, t in part.emas[0].items())
    whole = fe.update(whole, fe.local_shards(model), 1, decay=0.5)  # after the blocks: accepted, as without them
    part = fe.update(part, fe.local_shards(model, include=["mid.*"]), 1, decay=0.5)
    twin = fe.update(twin, {n: p.detach() for n, p in model.named_parameters() if n in twin.emas[0]}, 1, decay=0.5)
    assert all(torch.equal(whole.emas[0][n], twin.emas[0][n]) for n in twin.emas[0])
    assert all(torch.equal(part.emas[0][n], twin.emas[0][n]) for n in names)
    # A reading made inside the block (the memory moved there) is refused too: the counter is the model's.
    with pytest.raises(fe.SwappedParametersChangedError), fe.swapped(model, whole), torch.no_grad():
        model.mid.weight.data = model.mid.weight.data.clone()
        remade = fe.local_shards(model)
        with pytest.raises(fe.SwappedTrainingError):
            fe.update(whole, remade, 2, decay=0.5)
    assert int(whole.step) == 1
    fe.update(whole, fe.local_shards(model), 2, decay=0.5)
    # A copy of the model made inside the block is a model of its own: no block is open on it.
    with fe.swapped(model, whole), torch.no_grad():
        copied = copy.deepcopy(model)
    fe.update(fe.init_ema(fe.local_shards(copied)), fe.local_shards(copied), 1, decay=0.5)
    # A buffer the block registers (a cache a first forward makes) stays, and the block raises nothing.
    with fe.swapped(model, whole), torch.no_grad():
        model.mid.register_buffer("cache", torch.ones(2), persistent=False)
    assert torch.equal(model.mid.cache, torch.ones(2))


class Scale(nn.Module):
    """A forward that returns the parameter itself (a leaf tensor)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(2))

    def forward(self):
        return self.s


class AuxNet(nn.Module):
    """A forward that stores an auxiliary loss on the module, an in-place activation, and a parameter returned by
    a submodule's forward."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
        self.head = nn.Linear(4, 2)
        self.scale = Scale()
        self.keep = nn.Identity()

    def forward(self, x):
        h = self.keep(self.enc(x))
        self.aux = h.pow(2).mean()
        return self.head(h) * self.scale()


def test_swapped_refuses_input_gradients_naming_the_way_out_which_gives_the_emas():
    """An input gradient taken inside ``swapped`` (``torch.autograd.grad(out, x)``) is refused before anything is
    written, the message saying input gradients are refused too and how to take them: outside the block,
    ``torch.func.functional_call`` over ``gather_full``'s weights, which gives the gradient of a copy holding the
    EMA bitwise."""
    torch.manual_seed(0)
    model = AuxNet()
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5)
    x = torch.randn(8, 4, requires_grad=True)
    with fe.swapped(model, state), pytest.raises(fe.SwappedTrainingError) as refused:
        torch.autograd.grad(model(x).sum(), x)
    said = str(refused.value)
    assert (
        "Gradients for inputs only" in said and "torch.func.functional_call(model, fe.gather_full(state, model)" in said
    )
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    (got,) = torch.autograd.grad(torch.func.functional_call(model, fe.gather_full(state, model), (x,)).sum(), x)
    del model.aux  # a non-leaf tensor the forward stored: deepcopy refuses it
    twin = copy.deepcopy(model)
    twin.load_state_dict(fe.gather_full(state, model))
    (want,) = torch.autograd.grad(twin(x).sum(), x)
    assert torch.equal(got, want) and not torch.equal(got, torch.autograd.grad(model(x).sum(), x)[0])


def test_swapped_refuses_backward_through_any_submodule_forward():
    """Backward through a submodule's own forward, or through a loss the forward stored on the module, is refused
    inside ``swapped`` before any ``.grad`` is written; on exit no hook stays (training goes on as an untouched
    twin's, the EMA as a plain-torch reference)."""
    torch.manual_seed(0)
    model = AuxNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    (model(x).sum() + model.aux).backward()
    opt.step()
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5)
    for n, p in model.named_parameters():
        ref[n].lerp_(p.detach(), 0.5)
    assert all(torch.equal(state.ema[n], ref[n]) for n in ref)
    del model.aux  # a non-leaf tensor: deepcopy refuses it
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    live = copy.deepcopy(model.state_dict())
    opt.zero_grad(set_to_none=True)
    backwards = {
        "submodule": lambda: model.enc(x).sum().backward(),
        "inner submodule": lambda: model.enc[0](x).sum().backward(),
        "parameter returned": lambda: model.scale().sum().backward(),
        "stored loss": lambda: (model(x), model.aux.backward()),
    }
    for what, backward in backwards.items():
        refused = pytest.raises(fe.SwappedTrainingError, match="backward through a forward made inside")
        with fe.swapped(model, state), refused:
            backward()
        assert all(p.grad is None for p in model.parameters()), what
        sd = model.state_dict()
        assert all(torch.equal(sd[n], live[n]) for n in live), what
    assert all(not m._forward_hooks for m in model.modules())  # every hook removed on exit
    outside = model.enc(x)  # made before the block: passed through a forward inside, it keeps no hook
    with fe.swapped(model, state):
        model.keep(outside)
    outside.sum().backward()
    for step_model, step_opt in ((model, opt), (twin, twin_opt)):
        step_opt.zero_grad(set_to_none=True)
        (step_model(x).sum() + step_model.aux).backward()
        step_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def ddp_worker(save_dir: str, flat: bool = False) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TiedNet())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    flat_info = None
    if flat:  # after wrapping in DDP: DDP keeps averaging the gradients of the moved parameters
        twin = nn.parallel.DistributedDataParallel(copy.deepcopy(model.module))
        twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
        from functional_ema.engines.module import flatten_parameters

        moved = flatten_parameters(model)
        for step in (201, 202, 203):
            _train_step(model, opt, step, dist.get_rank())
            _train_step(twin, twin_opt, step, dist.get_rank())
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
        flat_info = [moved, same, len(fe.local_shards(model).segments)]
    report = run_checks(
        model,
        opt,
        save_dir,
        dist.get_rank(),
        dist.get_world_size(),
        make_fresh=lambda: nn.parallel.DistributedDataParallel(TiedNet()),
    )
    layout = fe.shard_layout(model)
    report["layout"] = [layout.rank, layout.world_size, layout.stage, layout.engine]
    files = sorted(p.name for p in (Path(save_dir) / report["tag"]).iterdir())
    report["files"] = files
    report["flat"] = flat_info
    state = fe.init_ema(fe.local_shards(model))
    _train_step(model, opt, 300, dist.get_rank())
    report["changed_inside"] = _changed_inside(model, fe.update(state, fe.local_shards(model), 1, decay=0.5))
    # 16-bit parameters with no fp32 master: warned once per process and reason, none for fp32 ones
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fe.local_shards(nn.Linear(3, 3))
        for _ in range(2):
            fe.local_shards(nn.Linear(3, 3).to(torch.bfloat16))
            fe.local_shards(nn.parallel.DistributedDataParallel(nn.Linear(3, 3).to(torch.bfloat16)))
    report["low_precision"] = [
        [str(w.message)[:60], w.filename == __file__]
        for w in caught
        if issubclass(w.category, fe.LowPrecisionWeightsWarning)
    ]
    if not flat:
        report["unreduced"] = _unreduced_rows(dist.get_rank())
    return report


def _ranks_agree(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    seen = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, t.detach().contiguous())
    return all(torch.equal(seen[0], x) for x in seen[1:])


def _unreduced_rows(rank: int) -> dict:
    """DDP reduces the parameters trainable when it was built: one unfrozen or added later is trained apart on each
    rank. Each row: the UnsyncedReplicasWarning texts ``local_shards`` gave (and whether they point at this file),
    then the oracle of the claim, whether the ranks still agree on those weights after a step on per-rank data."""
    import warnings

    def seen(x) -> list:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fe.local_shards(x)
        return [[str(w.message), w.filename == __file__] for w in caught if w.category is fe.UnsyncedReplicasWarning]

    def step(ddp, seed: int) -> None:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + rank))
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        ddp(x).square().sum().backward()
        opt.step()

    out: dict = {}
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    net[0].requires_grad_(False)  # a backbone frozen when DDP is built (BackboneFinetuning's setup)
    ddp = nn.parallel.DistributedDataParallel(net)
    out["frozen at build, read"] = seen(ddp)
    net[0].requires_grad_(True)
    out["unfrozen, read again"] = seen(ddp)
    out["unfrozen, read a third time"] = seen(ddp)  # the same reading: warned once
    step(ddp, 10)
    out["agree after a step"] = [_ranks_agree(net[0].weight), _ranks_agree(net[1].weight)]
    # The fix the warning names: wrap again after unfreezing (from agreeing weights)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    ddp = nn.parallel.DistributedDataParallel(net)
    out["built after unfreezing"] = seen(ddp)
    step(ddp, 20)
    out["rewrapped agree"] = [_ranks_agree(net[0].weight), _ranks_agree(net[1].weight)]
    # A layer added after DDP was built is no better off than an unfrozen one
    net.add_module("extra", nn.Linear(3, 3))
    out["added after build"] = seen(ddp)
    step(ddp, 30)
    out["added agree"] = [_ranks_agree(net.extra.weight), _ranks_agree(net[0].weight)]
    return out


@pytest.mark.parametrize("flat", [False, True], ids=["own-memory", "flatten_parameters"])
def test_ddp_two_ranks(tmp_path, flat):
    reports = run_ranks(
        "tests.test_module:ddp_worker", world_size=2, timeout=300, save_dir=str(tmp_path / "ckpt"), flat=flat
    )
    for rank, rep in enumerate(reports):
        _check(rep, world=2)
        assert rep["layout"] == [rank, 2, 0, "module"]  # replicated: whole parameters on every rank
        assert rep["flat"] == ([6, True, 1] if flat else None), rep["flat"]
        _check_changed_inside(rep["changed_inside"])
        assert rep["low_precision"] == [
            ["functional_ema: the weights read from a plain module's param", True],
            ["functional_ema: the weights read from a DistributedDataParal", True],
        ], rep["low_precision"]
        if not flat:
            _check_unreduced(rep["unreduced"])
    # Replicated weights: one rank file (rank 0's) and the manifest.
    assert reports[0]["files"] == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]


def _check_unreduced(rows: dict) -> None:
    unfrozen = rows["unfrozen, read again"]
    assert len(unfrozen) == 1 and unfrozen[0][1], rows  # pointed at the caller
    for words in (
        "trains 4 parameters but all-reduces the gradients of 2",
        "(new in this reading: '0.weight', '0.bias')",
        "Build the DistributedDataParallel wrapper after unfreezing",
        "Lightning issue #20340",
    ):
        assert words in unfrozen[0][0], unfrozen[0][0]
    assert rows["frozen at build, read"] == rows["unfrozen, read a third time"] == [], rows
    assert rows["agree after a step"] == [False, True], rows  # the warning's claim: the unfrozen layer drifts
    assert rows["built after unfreezing"] == [] and rows["rewrapped agree"] == [True, True], rows
    added = rows["added after build"]
    assert len(added) == 1 and "trains 6 parameters but all-reduces the gradients of 4" in added[0][0], rows
    assert "(new in this reading: 'extra.weight', 'extra.bias')" in added[0][0], rows
    assert rows["added agree"] == [False, True], rows


def zero3_save_worker(save_dir: str) -> dict:
    from functional_ema._testing.multirank import OddNet, make_engine, train_step

    engine = make_engine(3, "bf16", model=OddNet())
    state = fe.init_ema(fe.local_shards(engine))
    for _ in range(3):
        train_step(engine, engine.global_steps)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.8)
    fe.save(state, engine, save_dir, tag="zero3")
    full = fe.gather_full(state, engine)
    return {n: t.tolist() for n, t in full.items()}


def test_deepspeed_zero3_checkpoint_loads_into_a_plain_module(tmp_path):
    from functional_ema._testing.multirank import OddNet

    save_dir = str(tmp_path / "ckpt")
    full = run_ranks("tests.test_module:zero3_save_worker", world_size=2, timeout=300, save_dir=save_dir)[0]
    model = OddNet()
    model.not_optimized.requires_grad_(False)  # DeepSpeed's optimizer did not train it: no EMA
    state = fe.load(model, save_dir, tag="zero3")
    assert fe.update_info(state, fe.local_shards(model)).fused
    got = fe.gather_full(state, model)
    assert sorted(got) == sorted(full)
    assert all(torch.equal(got[n], torch.tensor(full[n], dtype=torch.float32)) for n in full)


def test_quickstart_module_example_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "examples/quickstart_module.py", "--out", str(tmp_path / "q")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "EMA eval loss" in out.stdout and "consolidated == gathered: True" in out.stdout


def test_unknown_objects_get_one_clear_error():
    for bad in (object(), {"w": torch.zeros(2)}, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)):
        with pytest.raises(
            TypeError, match=r"it accepts a deepspeed.DeepSpeedEngine .*FSDP2.*DistributedDataParallel.*nn.Module"
        ):
            fe.local_shards(bad)


def test_state_of_another_model_is_refused_by_every_verb(tmp_path):
    small, big = nn.Linear(3, 2), nn.Linear(3, 4)
    state = fe.init_ema(fe.local_shards(big))
    for verb in (
        lambda: fe.gather_full(state, small),
        lambda: fe.swapped(small, state).__enter__(),
        lambda: fe.save(state, small, tmp_path / "x", tag="t"),
    ):
        with pytest.raises(
            (fe.StateMismatchError, fe.CheckpointError), match=r"'weight'\]\[?.*has 12 elements but .*piece.* 6"
        ):
            verb()
    assert not (tmp_path / "x" / "t" / "ema_manifest.json").exists()


def test_gather_full_checks_dst_and_join_parts_at_the_call():
    """``dst`` must be a rank of the group (bools refused) and ``join_parts`` a bool, refused naming the argument
    before any collective (torch's "Group rank 9 is not part of group" never shows); a valid ``dst`` still works."""
    model = nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(model))
    for kw, err, words in [
        ({"dst": 9}, ValueError, "dst=9 is not a rank of the group: it has 1 rank(s)"),
        ({"dst": -1}, ValueError, "dst=-1"),
        ({"dst": True}, TypeError, "dst must be an int, got a bool"),
        ({"dst": 0.0}, TypeError, "dst must be an int"),
        ({"join_parts": "yes"}, TypeError, "join_parts must be True or False"),
        ({"join_parts": 1}, TypeError, "join_parts must be True or False"),
    ]:
        with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")):
            fe.gather_full(state, model, **kw)
    full = fe.gather_full(state, model, dst=0)
    assert torch.equal(full["weight"], model.weight.detach())


def test_bad_index_is_refused_at_the_call_naming_the_emas():
    """``index`` not one of the state's EMAs (2 of 2, -1, a float, a bool) is refused by ``swapped``, ``gather_full``
    and ``buffers.swapped_buffers`` alike (``ValueError``/``TypeError`` naming ``index`` and how many EMAs there
    are), before anything changes; a valid index still works."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    bstate = fe.buffers.init_buffers(model, num_emas=2)
    live = copy.deepcopy(model.state_dict())
    verbs = {
        "swapped": lambda i: fe.swapped(model, state, index=i).__enter__(),
        "gather_full": lambda i: fe.gather_full(state, model, index=i),
        "swapped_buffers": lambda i: fe.buffers.swapped_buffers(model, bstate, index=i).__enter__(),
    }
    for verb, call in verbs.items():
        for index, err, words in [
            (2, ValueError, "index=2 is not one of the EMAs: "),
            (-1, ValueError, "index=-1"),
            (1.0, TypeError, "index must be an int, got float"),
            (True, TypeError, "index must be an int, got a bool"),
        ]:
            with pytest.raises(err, match=words) as caught:
                call(index)
            assert "holds 2 EMA(s), index 0 to 1" in str(caught.value), (verb, index, str(caught.value))
            assert all(torch.equal(t, live[n]) for n, t in model.state_dict().items()), (verb, index)
    assert torch.equal(fe.gather_full(state, model, index=1)["0.weight"], model[0].weight.detach())


# ------------------------------------------------------------------ odd models, refused at reading (probe J)


def test_engine_submodules_reachable_right_after_import():
    """The documented spellings functional_ema.engines.module.flatten_parameters(model) and
    functional_ema.engines.fsdp2.flatten_local_shards work right after `import functional_ema`, and importing
    the package still imports no DeepSpeed (the adapters load on first use)."""
    code = (
        "import sys, torch, functional_ema\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "print(functional_ema.engines.module.flatten_parameters(m), callable(functional_ema.engines.fsdp2.flatten_local_shards))\n"
        "print('deepspeed' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "True", "False"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fe.engines.nope  # noqa: B018 - the attribute access is the test


def test_lazy_module_read_before_its_first_forward_is_refused_naming_the_parameter():
    model = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0\.weight' is not initialised yet .*run one forward"):
        fe.local_shards(model)
    model(torch.zeros(2, 3))  # materialised: read as any module
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = fe.init_ema(fe.local_shards(model))
    assert all(torch.equal(state.ema[n], ref[n]) for n in ref)


def test_sparse_parameter_is_refused_at_reading_suggesting_exclude():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.eye(3).to_sparse())
            self.b = nn.Parameter(torch.zeros(3))

    model = M()
    with pytest.raises(TypeError, match=r"parameter 'w' is a sparse tensor \(torch\.sparse_coo\).*exclude=\['w'\]"):
        fe.local_shards(model)
    shards = fe.local_shards(model, exclude="w")  # the hint works: the dense rest is averaged
    assert list(shards) == ["b"]
    state = fe.init_ema(shards)
    with torch.no_grad():
        model.b.add_(2.0)
    fe.update(state, fe.local_shards(model, exclude="w"), 1, decay=0.5)
    assert torch.equal(state.ema["b"], torch.zeros(3).lerp_(model.b.detach(), 0.5))


def test_model_with_nothing_trainable_is_refused_like_an_empty_selection():
    """A plain (or DDP) model with no trainable parameter would give an empty EMA: refused as a selection of
    nothing is ("nothing would be averaged"), with the fix; a model read while it trained keeps its EMA when
    frozen later, and the adapter itself (as a pipeline stage reads its module) still reads an empty module."""
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(
        ValueError, match=r"no trainable parameter \(all 2 of its parameters are frozen.*nothing would be averaged"
    ):
        fe.local_shards(frozen)
    with pytest.raises(ValueError, match=r"no trainable parameter .*nothing would be averaged"):
        fe.local_shards(nn.ReLU())
    assert len(fe.engines.adapter_for(nn.Linear(3, 2).requires_grad_(False)).read().shards) == 0
    model = nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(model))
    model.requires_grad_(False)  # frozen after the first read: still averaged, not refused
    assert list(fe.local_shards(model)) == ["weight", "bias"]
    assert int(fe.update(state, fe.local_shards(model), 1, decay=0.5).step) == 1


# ------------------------------------------------------------------------------------------------------------------
# torch.compile wrappers, a plain module at several ranks, and DDP edits after wrapping (engines/__init__.py
# adapter_for, engines/module.py). One 2-rank launch for the distributed checks.


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _outcome(fn) -> str:
    try:
        fn()
        return "accepted"
    except Exception as e:  # noqa: BLE001 - the type and message are what the test checks
        return f"{type(e).__name__}: {e}"


def _compiled_ddp_case(rank: int, root: Path) -> dict:
    """torch.compile(DDP(m)): read as the DDP model (names of m, rank r of 2); ranks at different steps are refused
    at save; at the same step rank 0 writes and every rank loads its EMA."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = _TwoLayers()
    model = torch.compile(DDP(net), backend="eager")
    layout = fe.shard_layout(model)
    out: dict = {"layout": [layout.rank, layout.world_size], "names": list(fe.local_shards(model))}
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        net.a.weight.add_(1.0)
    steps = 2 if rank == 0 else 1  # rank 1 missed an update
    for s in range(1, steps + 1):
        state = fe.update(state, fe.local_shards(model), s, decay=0.5)
    out["steps differ"] = _outcome(lambda: fe.save(state, model, root / "steps"))
    state = fe.update(state, fe.local_shards(model), 2, decay=0.5) if rank == 1 else state  # every rank alike now
    fe.save(state, model, root / "same", tag="t")
    out["files"] = sorted(os.listdir(root / "same" / "t"))
    loaded = fe.load(model, root / "same", tag="t")
    out["loaded"] = all(torch.equal(loaded.ema[n], state.ema[n]) for n in state.ema) and list(loaded.ema) == list(
        state.ema
    )
    return out


def _inside_ddp_case(rank: int, root: Path) -> dict:
    """ddp.module, and a plain module no DDP wraps, at 2 ranks: a one-process model on each rank (rank 0 of 1), its
    verbs local. So ``if rank == 0: with fe.swapped(ddp.module, state): evaluate()`` (and gather_full, save, load
    on rank 0 alone) returns at once, while rank 1 waits for it outside any collective; and two ranks saving
    ddp.module to one tag take turns under the tag's lock, each writing a complete checkpoint."""
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(_TwoLayers())
    inner = ddp.module
    state = fe.init_ema(fe.local_shards(ddp))  # made from the wrapper, evaluated through the module (rank 0)
    first = {n: p.detach().clone() for n, p in inner.named_parameters()}
    with torch.no_grad():
        for p in inner.parameters():
            p.add_(1.0)  # alike on every rank: DDP keeps the replicas equal
    state = fe.update(state, fe.local_shards(ddp), 1, decay=0.5)
    plain = nn.Linear(2, 2)
    out: dict = {
        "inner layout": [fe.shard_layout(inner).rank, fe.shard_layout(inner).world_size],
        "plain layout": [fe.shard_layout(plain).rank, fe.shard_layout(plain).world_size],
        "averaged": all(torch.equal(state.ema[n], first[n].lerp(p.detach(), 0.5)) for n, p in inner.named_parameters()),
    }
    root.mkdir(parents=True, exist_ok=True)
    done = root / "rank 0 done"
    if rank == 0:
        out["rank 0 alone"] = _rank_zero_alone(inner, state, root / "alone")
        done.write_text("done")
    else:  # waits outside any collective: a verb of rank 0 that waited for this rank would time out
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    # Both ranks save ddp.module (weights that now differ by rank) to one tag: each writes the whole model
    with torch.no_grad():
        inner.a.weight.add_(float(rank))
    mine = fe.update(state, fe.local_shards(inner), 2, decay=0.0)
    fe.save(mine, inner, root / "both", tag="t")
    dist.barrier()
    emas = [None, None]
    dist.all_gather_object(emas, {n: t.clone() for n, t in mine.ema.items()})
    loaded = fe.load(inner, root / "both", tag="t").ema
    out["both files"] = sorted(os.listdir(root / "both" / "t"))
    out["loaded is one rank's whole"] = any(all(torch.equal(loaded[n], e[n]) for n in e) for e in emas)
    return out


def _rank_zero_alone(inner: nn.Module, state: fe.EmaState, root: Path) -> dict:
    """Rank 0's evaluation of the EMA alone: swapped (output, then the live weights back bitwise), gather_full,
    save and load, timed."""
    import time

    start = time.monotonic()
    live = {n: p.detach().clone() for n, p in inner.named_parameters()}
    x = torch.randn(5, 4)
    expect = torch.func.functional_call(inner, dict(state.ema), (x,))
    out: dict = {}
    try:
        with torch.no_grad(), fe.swapped(inner, state):
            out["swapped output"] = torch.equal(inner(x), expect)
        out["restored"] = all(torch.equal(p, live[n]) for n, p in inner.named_parameters())
        full = fe.gather_full(state, inner)
        out["gather_full"] = list(full) == list(state.ema) and all(torch.equal(full[n], state.ema[n]) for n in full)
        fe.save(state, inner, root, tag="t")
        out["files"] = sorted(os.listdir(root / "t"))
        loaded = fe.load(inner, root, tag="t").ema
        out["loaded"] = list(loaded) == list(state.ema) and all(torch.equal(loaded[n], state.ema[n]) for n in loaded)
    except Exception as e:  # noqa: BLE001 - reported: a verb that waited for rank 1 times out here
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    return out


def _compiled_fsdp2_case() -> dict:
    """torch.compile(fully_shard(m)): read as the FSDP2 model, with m's names."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = _TwoLayers()
    fully_shard(net)
    model = torch.compile(net, backend="eager")
    return {
        "engine": fe.shard_layout(model).engine,
        "names": list(fe.local_shards(model)),
        "same reading": fe.local_shards(model) is fe.local_shards(net),
    }


def _replaced_after_wrapping_case(rank: int) -> dict:
    """DDP(find_unused_parameters=True) reduces the parameter objects it found when built: a submodule or a
    parameter replaced later keeps the count but trains on each rank's batch alone, and is warned about."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict = {}
    edits = {
        "nothing replaced": lambda m: None,
        "submodule replaced": lambda m: setattr(m, "b", nn.Linear(4, 3)),
        "parameter replaced": lambda m: setattr(m.a, "weight", nn.Parameter(torch.randn(4, 4))),
    }
    for label, edit in edits.items():
        torch.manual_seed(0)
        net = _TwoLayers()
        ddp = DDP(net, find_unused_parameters=True)
        fe.init_ema(fe.local_shards(ddp))
        edit(net)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fe.local_shards(ddp)
        out[label] = [str(w.message) for w in caught if issubclass(w.category, fe.UnsyncedReplicasWarning)]
    # ddp.module replaced: the reading follows the module DDP runs now (the check walked the old one)
    torch.manual_seed(0)
    ddp = DDP(_TwoLayers())
    state = fe.init_ema(fe.local_shards(ddp))
    ddp.module = _TwoLayers()
    with torch.no_grad():
        ddp.module.a.weight.fill_(5.0)
    state = fe.update(state, fe.local_shards(ddp), 1, decay=0.0)
    out["module replaced"] = torch.equal(state.ema["a.weight"], ddp.module.a.weight.detach())
    out["read before freezing"] = _read_before_freezing_case()
    return out


def _read_before_freezing_case() -> dict:
    """The model read before freezing (docs/core.md), then wrapped by DDP while frozen: the wrapper's first reading
    keeps what the model's kept (a new reading refused them as "missing from shards"), and unfreezing, which DDP
    does not see, is warned about."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = _TwoLayers()
    state = fe.init_ema(fe.local_shards(net))
    first = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.a.requires_grad_(False)
    ddp = DDP(net)  # reduces b only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            net.b.weight.add_(1.0)
        state = fe.update(state, fe.local_shards(ddp), 1, decay=0.5)
        frozen_phase = [str(w.message) for w in caught if issubclass(w.category, fe.UnsyncedReplicasWarning)]
        net.a.requires_grad_(True)
        fe.local_shards(ddp)
    unfrozen = [str(w.message) for w in caught if issubclass(w.category, fe.UnsyncedReplicasWarning)]
    return {
        "names": list(state.ema),
        "averaged": all(torch.equal(state.ema[n], first[n].lerp(p.detach(), 0.5)) for n, p in net.named_parameters()),
        "warned while frozen": frozen_phase,
        "warned at unfreezing": unfrozen[len(frozen_phase) :],
    }


def wrappers_worker(root: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    base = Path(root)
    return {
        "compiled ddp": _compiled_ddp_case(rank, base / "compiled"),
        "inside ddp": _inside_ddp_case(rank, base / "inside"),
        "compiled fsdp2": _compiled_fsdp2_case(),
        "replaced": _replaced_after_wrapping_case(rank),
    }


def test_compiled_wrappers_and_plain_modules_at_several_ranks(tmp_path):
    """torch.compile(DDP(m)) (torch's documented order) was read as a one-process model on every rank (world 1,
    names _orig_mod.module.*): every rank wrote "rank 0 of 1", the last writer won, and ranks at different steps
    were not refused; it is read as the DDP model now. ddp.module and a plain module stay one-process models on
    each rank, so rank 0 evaluates, gathers and saves one alone, promptly. A DDP submodule or parameter replaced
    after wrapping drifted between the ranks with no warning; ddp.module replaced kept the old module's reading."""
    reports = run_ranks(
        "tests.test_module:wrappers_worker",
        world_size=2,
        timeout=240,
        # a verb that waits for the other rank fails in 60 s, not the default 600, past which the launch is killed
        env={"FE_DIST_INIT": "torch", "FUNCTIONAL_EMA_TIMEOUT": "60"},
        root=str(tmp_path),
    )
    one_file = ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"]
    alone_files = ["ema_manifest.json", "ema_rank_00000_of_00001.safetensors"]
    for rank, rep in enumerate(reports):
        compiled = rep["compiled ddp"]
        assert compiled["layout"] == [rank, 2] and compiled["names"] == ["a.weight", "a.bias", "b.weight", "b.bias"]
        assert compiled["steps differ"].startswith("CheckpointMismatchError: save: ranks disagree on tag"), compiled
        assert "step: rank 0: 2, rank 1: 1" in compiled["steps differ"], compiled
        assert compiled["files"] == one_file and compiled["loaded"], compiled
        inside = rep["inside ddp"]
        assert inside["inner layout"] == inside["plain layout"] == [0, 1] and inside["averaged"], inside
        # one complete checkpoint: the later writer's (a new generation of the tag's file), the earlier one's gone
        manifest, data = inside["both files"]
        assert manifest == "ema_manifest.json" and re.fullmatch(
            r"ema_rank_00000_of_00001(\.gen\d+)?\.safetensors", data
        )
        assert inside["loaded is one rank's whole"], inside
        assert rep["compiled fsdp2"] == {
            "engine": "fsdp2",
            "names": ["a.weight", "a.bias", "b.weight", "b.bias"],
            "same reading": True,
        }
    alone = reports[0]["inside ddp"]["rank 0 alone"]
    assert "error" not in alone and alone["seconds"] < 30, alone  # FUNCTIONAL_EMA_TIMEOUT is 60 s here
    assert alone["swapped output"] and alone["restored"] and alone["gather_full"], alone
    assert alone["files"] == alone_files and alone["loaded"], alone
    for rep in reports:
        replaced = rep["replaced"]
        assert replaced["nothing replaced"] == [], replaced
        for label, names in (("submodule replaced", "'b.weight', 'b.bias'"), ("parameter replaced", "'a.weight'")):
            assert len(replaced[label]) == 1, (label, replaced)
            assert f"that it did not hold when it was built ({names}: replaced since" in replaced[label][0], replaced
        assert replaced["module replaced"] is True
        before = replaced["read before freezing"]
        assert before["names"] == ["a.weight", "a.bias", "b.weight", "b.bias"] and before["averaged"], before
        assert before["warned while frozen"] == [] and len(before["warned at unfreezing"]) == 1, before
        assert "trains 4 parameters but all-reduces the gradients of 2" in before["warned at unfreezing"][0], before


def test_a_module_whose_parameter_or_module_dict_is_replaced_is_read_again():
    """A module's ``_parameters`` or ``_modules`` dict replaced whole (``m.__dict__.update(fresh.__dict__)``, a
    pattern of in-place conversion code) kept the reading current: its check compared the entries of the old dicts,
    so update averaged weights the forward no longer used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = fe.init_ema(fe.local_shards(model))
    model[2].__dict__.update(nn.Linear(4, 3).__dict__)  # model[2] computes with the fresh module's parameters
    with torch.no_grad():
        model[2].weight.fill_(5.0)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5)
    for n, p in model.named_parameters():
        assert torch.equal(state.ema[n], first[n].lerp(p.detach(), 0.5)), n

    root = nn.Sequential(nn.Linear(4, 4))
    first = {n: p.detach().clone() for n, p in root.named_parameters()}
    state = fe.init_ema(fe.local_shards(root))
    root.__dict__["_modules"] = {"0": nn.Linear(4, 4)}  # the root's _modules dict object replaced
    state = fe.update(state, fe.local_shards(root), 1, decay=0.5)
    for n, p in root.named_parameters():
        assert torch.equal(state.ema[n], first[n].lerp(p.detach(), 0.5)), n


@pytest.mark.parametrize("inside", ["", "module."], ids=["compile(m)", "compile(DDP(m))"])
def test_a_checkpoint_saved_under_compiled_names_loads_into_the_compiled_model(tmp_path, inside):
    """A torch.compile-d model was read under its wrapper's names (``_orig_mod.<name>``, and
    ``_orig_mod.module.<name>`` for torch.compile(DDP(m))); it is now read as the model inside, with that model's
    names. A checkpoint written under the old names (here by a module holding the model as ``_orig_mod``, which
    lists them exactly so) loads into the compiled model, its EMA and buffers bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    old = nn.Module()
    holder = old
    if inside:
        holder._orig_mod = nn.Module()
        holder = holder._orig_mod
        holder.module = model
    else:
        holder._orig_mod = model
    state = fe.init_ema(fe.local_shards(old))
    model(torch.randn(5, 3))  # the running statistics move
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = fe.update(state, fe.local_shards(old), 1, decay=0.5)
    bstate = fe.buffers.update_buffers(fe.buffers.init_buffers(old), old, 1, decay=0.5)
    prefix = f"_orig_mod.{inside}"
    assert list(state.ema) == [prefix + n for n, _ in model.named_parameters()]
    fe.save(state, old, tmp_path, buffers=bstate)

    compiled = torch.compile(model, backend="eager")
    assert list(fe.local_shards(compiled)) == [n for n, _ in model.named_parameters()]
    loaded = fe.load(compiled, tmp_path)
    assert list(loaded.ema) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(loaded.ema[n], state.ema[prefix + n]) for n in loaded.ema)
    buffers = fe.buffers.load_buffers(compiled, tmp_path)
    assert sorted(buffers.emas[0]) == ["1.running_mean", "1.running_var"]
    assert all(torch.equal(t, bstate.emas[0][prefix + n]) for n, t in buffers.emas[0].items())
    assert torch.equal(buffers.copied["1.num_batches_tracked"], bstate.copied[prefix + "1.num_batches_tracked"])
    fe.update(loaded, fe.local_shards(compiled), 2, decay=0.5)  # and it trains on


def test_a_resume_with_parameters_frozen_as_at_the_save_names_the_fix(tmp_path):
    """The EMA of a parameter frozen after the first reading is saved; a resume that freezes it before reading the
    model is refused (the new reading leaves it out), and the message now says how to resume: read first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    state = fe.init_ema(fe.local_shards(model))
    model[0].requires_grad_(False)  # the run's schedule: frozen after the first reading, still averaged
    fe.save(fe.update(state, fe.local_shards(model), 1, decay=0.5), model, tmp_path)
    resumed = copy.deepcopy(model)  # frozen as at the save, not read yet
    with pytest.raises(fe.checkpoint.CheckpointMismatchError) as refused:
        fe.load(resumed, tmp_path)
    assert "'0.weight', '0.bias' are parameters of this model, frozen now" in str(refused.value)
    assert "read the model before freezing them: fe.load(model, ...)" in str(refused.value)
    again = copy.deepcopy(model).requires_grad_(True)  # the fix: read (load) first, then freeze
    loaded = fe.load(again, tmp_path)
    again[0].requires_grad_(False)
    assert list(loaded.ema) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(torch.equal(loaded.ema[n], state.ema[n]) for n in state.ema)


def test_backward_of_a_forward_made_before_swapped_runs_after_it_as_without_the_block():
    """A training forward, an EMA evaluation in ``swapped``, then that forward's backward and the step: parameters and
    AdamW state bitwise an untouched twin's (autograd's version counters of the saved weights are back as on entry).
    A forward made inside the block and backpropagated after it is still refused, and so is a loss built from a
    parameter inside the block whose backward runs after the parameter was changed in place (the versions inside the
    block are far from the restored ones)."""
    torch.manual_seed(0)
    model = TiedNet()  # a module listed twice (mid/tied) and a frozen parameter
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01) for m in (model, twin))
    _train_step(model, opt, 1)
    _train_step(twin, twin_opt, 1)  # AdamW state exists before the checked steps
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
    for step in (2, 3):  # twice: the versions after a first block and step are where a second block starts from
        for m, o in ((model, opt), (twin, twin_opt)):
            x, y = _batch(step)
            o.zero_grad(set_to_none=True)
            loss = ((m(x) - y) ** 2).mean()
            if m is model:
                with fe.swapped(model, state), torch.no_grad():
                    model.eval()
                    model(x)
                    model.train()
            loss.backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), twin.buffers()))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert opt.state[p].keys() == twin_opt.state[q].keys()
        assert all(torch.equal(opt.state[p][k], twin_opt.state[q][k]) for k in opt.state[p])

    opt.zero_grad(set_to_none=True)
    with fe.swapped(model, state):
        inside = ((model(_batch(4)[0]) - _batch(4)[1]) ** 2).mean()
        weight = model.head.weight
        built = (weight * weight).sum()  # no forward: no hook, autograd saved the weight as the block left it
    with pytest.raises(fe.SwappedTrainingError, match="backward through a forward made inside"):
        inside.backward()
    with torch.no_grad():
        weight.mul_(1.0)  # an in-place step after the block: same values, the version moves on by one
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        built.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_an_edit_inside_swapped_through_a_shared_version_counter_stays_visible_to_autograd():
    """Parameters that are views of one buffer share one autograd version counter; a frozen one (not averaged, so
    not swapped) edited in place inside the block: the counter is left as the edit moved it, so the backward of a
    forward made before the block is refused as without the block (restoring it hid the edit: a silently stale
    gradient)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
    at = 0
    for name, p in list(m.named_parameters()):
        owner, attr = name.rsplit(".", 1)
        setattr(m.get_submodule(owner), attr, torch.nn.Parameter(flat[at : at + p.numel()].view(p.shape)))
        at += p.numel()
    m[0].weight.requires_grad_(False)  # shares the counter with the trained ones
    state = fe.update(fe.init_ema(fe.local_shards(m)), fe.local_shards(m), 1, decay=0.5)
    h = torch.randn(5, 4, requires_grad=True)
    loss = m(h).pow(2).sum()  # saves m[0].weight for the gradient of h
    with fe.swapped(m, state), torch.no_grad():
        m[0].weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
