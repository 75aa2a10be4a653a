"""The per-step path ``update(state, local_shards(model))`` (issue 38, part 4): what it runs and what it re-checks.

The fused plan lerps the tensors themselves (no ``.view`` aliases, which cost every in-place lerp_ its view
bookkeeping) under inference mode where that is safe, bitwise equal to a per-tensor ``lerp_``; a plain module's
reading is re-made whenever a parameter or submodule is moved, replaced, renamed, added or removed, and kept
otherwise.
"""

from __future__ import annotations

import re

import optree
import pytest
import torch
from torch import nn

import functional_ema as fe
from functional_ema import _plan


def _trees() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w2d": torch.randn(5, 7, generator=g),
        "b": torch.randn(7, generator=g),
        "t": torch.randn(6, 4, generator=g).t(),  # non-contiguous: a segment of its own, lerped as it is
        "big": torch.randn(300, generator=g),
    }


def _reference(emas: dict[str, torch.Tensor], src: dict[str, torch.Tensor], w: float) -> dict[str, torch.Tensor]:
    return {n: e.clone().lerp_(src[n], w) for n, e in emas.items()}


def test_fused_plan_lerps_the_segments_themselves_bitwise_under_inference_mode():
    src = _trees()
    shards = fe.Shards.from_views(src)
    state = fe.init_ema(shards)
    for step in range(1, 4):
        for t in src.values():
            t.mul_(1.5).add_(0.25)
        expect = _reference(dict(state.ema), src, 1 - 0.9)
        versions = [e._version for e in state.ema.segments]
        fe.update(state, shards, step, decay=0.9)
        assert all(torch.equal(state.ema[n], expect[n]) for n in src), step
        # version counters still move (an EMA saved for backward elsewhere is still caught by autograd)
        assert [e._version for e in state.ema.segments] == [v + 1 for v in versions]
    plan = state.ema._memo[2]
    (group,) = plan.groups.values()
    assert plan.inference and not plan.no_grad
    # the very segment tensors (no aliases): same objects as the state's and the shards' segments
    assert all(a is b for a, b in zip(group.emas, state.ema.segments))
    assert all(a is b for a, b in zip(group.srcs, shards.segments))
    assert not any(t._is_view() for t in (*group.emas, *group.srcs))
    assert not state.ema.segments[0].is_inference()


def test_two_emas_are_chunked_and_staged_runs_keep_autograd_mode(monkeypatch):
    monkeypatch.setattr(_plan, "_CHUNK_ELEMENTS", 16)  # "big" (300 elements) is cut into chunks
    src = _trees()
    shards = fe.Shards.from_views(src)
    state = fe.init_ema(shards, num_emas=2)
    for t in src.values():
        t.add_(1.0)
    expect = [_reference(dict(e), src, w) for e, w in zip(state.emas, (1 - 0.9, 1 - 0.5))]
    fe.update(state, shards, 1, decay=(0.9, 0.5))
    assert all(torch.equal(e[n], x[n]) for e, x in zip(state.emas, expect) for n in src)
    (group,) = state.emas[0]._memo[2].groups.values()
    assert len(group.emas) > 2 * len(src)  # chunked: the weights of a chunk are read once for both EMAs

    # Staged through a copy (another device or dtype in real use): not under inference mode, whose
    # staging buffers would become inference tensors.
    monkeypatch.setattr(_plan, "_needs_staging", lambda s, e: True)
    staged_src = {"a": torch.randn(40), "b": torch.randn(3, 5)}
    staged_shards = fe.Shards.from_views(staged_src)
    staged = fe.init_ema(staged_shards)
    for t in staged_src.values():
        t.add_(2.0)
    expect_staged = _reference(dict(staged.ema), staged_src, 1 - 0.75)
    fe.update(staged, staged_shards, 1, decay=0.75)
    assert not staged.ema._memo[2].inference
    assert all(torch.equal(staged.ema[n], expect_staged[n]) for n in staged_src)


def test_per_tensor_plan_of_parameters_records_no_graph():
    params = {"w": nn.Parameter(torch.randn(4, 3)), "b": nn.Parameter(torch.randn(3))}
    state = fe.init_ema({n: p.detach().clone() for n, p in params.items()})
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    expect = _reference(dict(state.ema), {n: p.detach() for n, p in params.items()}, 1 - 0.8)
    fe.update(state, params, 1, decay=0.8)
    assert all(torch.equal(state.ema[n], expect[n]) for n in params)
    assert all(not e.requires_grad and e.grad_fn is None for e in state.ema.values())


def _names(model: nn.Module) -> list[str]:
    return list(fe.local_shards(model))


def test_plain_module_reading_is_kept_until_a_parameter_or_module_changes():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    first = fe.local_shards(model)
    assert fe.local_shards(model) is first

    # The same object back under an equal name (another string object): nothing changed.
    registry = model[1]._parameters
    w = registry.pop("weight")
    registry["".join(["wei", "ght"])] = w
    bias = registry.pop("bias")
    registry["bias"] = bias
    assert fe.local_shards(model) is first

    # Renamed (same object, same count): re-read under the new name.
    registry["renamed"] = registry.pop("bias")
    renamed = fe.local_shards(model)
    assert renamed is not first and list(renamed) == ["0.weight", "0.bias", "1.weight", "1.renamed"]
    assert renamed["1.renamed"].data_ptr() == bias.data_ptr()

    # Replaced by a new Parameter over the same memory: re-read, holding the new object.
    old = model[0].weight
    model[0].weight = nn.Parameter(old.detach())
    replaced = fe.local_shards(model)
    assert replaced is not renamed and replaced["0.weight"].data_ptr() == old.data_ptr()
    assert fe.engines.adapter_for(model).read().params["0.weight"] is model[0].weight

    # A submodule added to a leaf, and a module inserted into a container by editing its registry.
    model[0].extra = nn.Linear(2, 2)
    assert _names(model) == ["0.weight", "0.bias", "0.extra.weight", "0.extra.bias", "1.weight", "1.renamed"]
    stack = nn.ModuleList([nn.Linear(2, 2)])
    before = fe.local_shards(stack)
    stack.insert(0, nn.Linear(2, 3))  # ModuleList.insert writes its _modules dict directly
    after = fe.local_shards(stack)
    assert after is not before and [tuple(after[n].shape) for n in after] == [(3, 2), (3,), (2, 2), (2,)]

    # Removed: a parameter deleted from its module, and a submodule deleted.
    del model[0].extra
    del model[1].renamed
    assert _names(model) == ["0.weight", "0.bias", "1.weight"]


def test_plain_module_submodule_replaced_or_renamed_is_read_again():
    # Both keep every registry's entry count and every old parameter in its old owner: only the
    # submodules' registries show them.
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 2)))
    state = fe.init_ema(fe.local_shards(model))
    first = fe.local_shards(model)
    model[1][0] = nn.Linear(4, 2)  # replaced under its name, e.g. a new head or a PEFT wrapper
    with torch.no_grad():
        model[1][0].weight.fill_(7.0)
    replaced = fe.local_shards(model)
    assert replaced is not first and replaced["1.0.weight"].data_ptr() == model[1][0].weight.data_ptr()
    fe.update(state, replaced, 1, decay=0.0)  # d = 0: the EMA becomes the weights now trained
    assert torch.equal(state.ema["1.0.weight"], torch.full((2, 4), 7.0))

    registry = model[1]._modules
    registry["head"] = registry.pop("0")  # renamed: the same module under a new key
    assert _names(model) == ["0.weight", "0.bias", "1.head.weight", "1.head.bias"]


@pytest.mark.parametrize("how", ["data", "to"])
def test_plain_module_memory_moved_is_read_again(how):
    model = nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(model))
    first = fe.local_shards(model)
    if how == "data":
        model.weight.data = torch.full((2, 3), 2.0)
    else:
        model.to(torch.float64).to(torch.float32)  # same values, new memory for every parameter
    now = fe.local_shards(model)
    assert now is not first and now["weight"].data_ptr() == model.weight.data_ptr()
    expect = state.ema["weight"].clone().lerp_(model.weight.detach(), 0.5)
    fe.update(state, now, 1, decay=0.5)
    assert torch.equal(state.ema["weight"], expect)


# ------------------------------------------------------------------------------- inference mode, inplace=False


def _moved(src: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in src.values():
            t.mul_(1.5).add_(0.25)


@pytest.mark.parametrize("tree", ["shards", "dict"])
def test_state_made_under_inference_mode_updates_outside_it(tree):
    # e.g. an EMA started lazily at the first evaluation: init_ema makes normal tensors there, so the next
    # update (outside inference mode) moves them as plain lerp_ does, instead of failing halfway.
    src = _trees()
    shards = fe.Shards.from_views(src) if tree == "shards" else src
    with torch.inference_mode():
        state = fe.init_ema(shards, num_emas=2)
    assert not state.step.is_inference() and not any(t.is_inference() for e in state.emas for t in e.values())
    _moved(src)
    expect = [_reference(dict(e), src, w) for e, w in zip(state.emas, (1 - 0.9, 1 - 0.5))]
    fe.update(state, shards, 1, decay=(0.9, 0.5))
    assert int(state.step) == 1
    assert all(torch.equal(e[n], x[n]) for e, x in zip(state.emas, expect) for n in src)
    with torch.inference_mode():  # a copy made under inference mode (inplace=False) is normal too
        copy = fe.update(state, shards, 2, decay=(0.9, 0.5), inplace=False)
    fe.update(copy, shards, 3, decay=(0.9, 0.5))
    assert int(copy.step) == 3 and int(state.step) == 1


def _inference_copy(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def test_state_holding_inference_tensors_is_refused_before_anything_changes():
    src = _trees()
    shards = fe.Shards.from_views(src)
    made = fe.init_ema(shards)
    with torch.inference_mode():
        inf_emas = made.ema.clone()  # a Shards over inference segments, same layout
    by_hand = [
        (fe.EmaState(_inference_copy(made.step), (made.ema,)), "state.step"),
        (fe.EmaState(made.step, (inf_emas,)), "state.emas[0]"),
    ]
    _moved(src)
    for state, culprit in by_hand:
        before = {n: t.clone() for n, t in state.ema.items()}
        with pytest.raises(
            ValueError, match=re.escape(culprit) + r".*inference tensor.*outside torch\.inference_mode\(\)"
        ):
            fe.update(state, shards, 1, decay=0.5)
        assert int(state.step) == 0 and all(torch.equal(state.ema[n], before[n]) for n in src)


@pytest.mark.parametrize("skip", ["same step", "nonfinite"])
def test_inplace_false_returns_new_buffers_also_when_nothing_is_averaged(skip):
    model = nn.Linear(4, 3)
    old = fe.init_ema(fe.local_shards(model))
    kept = {n: t.clone() for n, t in old.ema.items()}
    if skip == "nonfinite":
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    step = 0 if skip == "same step" else 1
    new = fe.update(old, fe.local_shards(model), step, decay=0.5, inplace=False, nonfinite="skip")
    assert new is not old and new.step is not old.step and int(new.step) == 0
    assert all(torch.equal(new.ema[n], kept[n]) for n in kept)  # the same values, in new memory
    assert not any(a.data_ptr() == b.data_ptr() for a, b in zip(new.ema.segments, old.ema.segments))
    with torch.no_grad():
        model.weight[0, 0] = 5.0
    expect = {n: kept[n].clone().lerp_(p.detach(), 1 - 0.5**2) for n, p in model.named_parameters()}
    fe.update(new, fe.local_shards(model), 2, decay=0.5)  # in place on the new state only (steps 1 and 2)
    assert all(torch.equal(new.ema[n], expect[n]) for n in kept)
    assert int(old.step) == 0 and all(torch.equal(old.ema[n], kept[n]) for n in kept)


def test_inference_ema_with_parameter_weights_written_in_inference_mode():
    """docs/core.md: a tree's single EMA on the weights' device and dtype is written in inference mode, so a
    state made by hand under torch.inference_mode() updates from dict(model.named_parameters()) (nn.Parameter
    leaves) as from plain tensors, bitwise a plain lerp_; where the update could not write it (weights of a
    tensor subclass) it is refused naming the tensor, before anything changes."""
    model = nn.Linear(3, 2)
    with torch.inference_mode():
        ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = fe.EmaState(torch.tensor(0), (ema,))
    _moved(dict(model.named_parameters()))
    expect = {n: e.clone().lerp_(p.detach(), 0.5) for n, e in _cloned(ema).items() for p in [model.get_parameter(n)]}
    fe.update(state, dict(model.named_parameters()), 1, decay=0.5)
    assert int(state.step) == 1 and all(torch.equal(state.ema[n], expect[n]) for n in expect)
    assert all(not e.requires_grad and e.grad_fn is None for e in state.ema.values())

    class Sub(torch.Tensor):
        pass

    before = _cloned(ema)
    odd = {n: p.detach().clone().as_subclass(Sub) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"state\.emas\[0\]\['(bias|weight)'\] is an inference tensor"):
        fe.update(state, odd, 2, decay=0.5)
    assert int(state.step) == 1 and all(torch.equal(state.ema[n], before[n]) for n in before)


def _cloned(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.inference_mode(False):
        return {n: t.clone() for n, t in tree.items()}


def test_same_step_update_checks_reuse_the_fused_plan():
    """The same-step update (a micro-batch of gradient accumulation) checks its arguments through the plan kept
    on the EMA: the same Shards object costs one identity check, no new plan."""
    model = nn.Linear(4, 3)
    state = fe.init_ema(fe.local_shards(model))
    fe.update(state, fe.local_shards(model), 1, decay=0.9)
    memo = state.ema._memo
    for _ in range(3):
        assert fe.update(state, fe.local_shards(model), 1, decay=0.9) is state
    assert state.ema._memo is memo


def test_same_step_update_of_a_nested_tree_builds_no_plan(monkeypatch):
    """A nested tree at the same step is checked at its top level (names), not planned in full (~1 ms for 516
    tensors, nearly a real update) nor flattened (~0.2 ms); a top level that differs is planned, naming what
    differs; a deeper difference is refused by the next real update before anything moves."""
    import functional_ema._core as core

    tree = {"a": {"w": torch.zeros(3, 2), "b": torch.zeros(2)}, "c": [torch.zeros(4)]}
    state = fe.init_ema(tree)
    fe.update(state, tree, 1, decay=0.9)
    real = core._per_tensor_plan
    planned = []
    monkeypatch.setattr(core, "_per_tensor_plan", lambda *a: planned.append(1) or real(*a))
    assert fe.update(state, tree, 1, decay=0.9) is state and not planned
    with pytest.raises(fe.TreeMismatchError, match=r"missing from shards: 'c\.0'"):
        fe.update(state, {"a": tree["a"]}, 1, decay=0.9)
    with pytest.raises(fe.TreeMismatchError):
        fe.update(state, None, 1, decay=0.9)
    assert planned == [1, 1]
    deeper = {"a": tree["a"], "c": [torch.zeros(5)]}
    assert fe.update(state, deeper, 1, decay=0.9) is state  # the same step: top level only
    before = [t.clone() for t in optree.tree_leaves(state.emas[0])]
    with pytest.raises(fe.TreeMismatchError, match=r"shards\['c\.0'\] has shape \(5,\)"):
        fe.update(state, deeper, 2, decay=0.9)
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(state.emas[0])))
    assert int(state.step) == 1
