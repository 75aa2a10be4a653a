"""init_ema / update in plain torch: the fused paths against the straightforward per-tensor lerp.

Every fused, chunked, staged or grouped path must give bitwise the numbers of
``ema.lerp_(shard.to(ema.dtype), 1 - decay)`` applied tensor by tensor. Chunk sizes are shrunk so
that small trees cross many chunk boundaries and vector tails.
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref

import optree
import pytest
import torch

import functional_ema as fe
from functional_ema import _plan, schedules
from functional_ema.schedules import interval_decay


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(_plan, "_CHUNK_ELEMENTS", 37)
    monkeypatch.setattr(_plan, "_STAGE_CHUNK_ELEMENTS", 53)


# ----------------------------------------------------------------------------------------- helpers


def flat_views(sizes, gap=3, dtype=torch.float32, seed=0):
    """Views of one flat buffer with ``gap`` elements between them (like a ZeRO partition)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(sum(sizes) + gap * len(sizes) + 5, generator=g, dtype=torch.float64).to(dtype)
    out, off = {}, 2
    for i, n in enumerate(sizes):
        out[f"layer{i}.w"] = buf.narrow(0, off, n)
        off += n + gap
    return buf, out


def perturb(tree, step, scale=1.0):
    """New values, in place (the shards are views the trainer writes into)."""
    g = torch.Generator().manual_seed(1000 + step)
    for t in optree.tree_leaves(tree):
        if t.numel():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * scale + t.double())


def plan_of(state, shards):
    key = _plan.cache_key(state.emas, shards)
    return _plan.lookup(key)


def run_and_compare(shards, decays, steps=(1, 2, 5, 6), dtype=torch.float32, mutate=None, **init_kw):
    """Update a state and a per-tensor reference over ``steps``; assert bitwise equality."""
    k = len(decays)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = fe.init_ema(shards, num_emas=k, dtype=dtype, **init_kw)
    ref = [optree.tree_map(lambda t: t.detach().clone().to(dtype), shards) for _ in range(k)]
    last = 0
    for step in steps:
        (mutate or perturb)(shards, step)
        state = fe.update(state, shards, step, decay=decays if k > 1 else decays[0])
        for j, d in enumerate(decays):
            w = 1.0 - interval_decay(d, last, step)
            optree.tree_map(lambda e, s, w=w: e.lerp_(s.to(e.dtype), w), ref[j], shards)
        last = step
        for j in range(k):
            got, want = optree.tree_leaves(state.emas[j]), optree.tree_leaves(ref[j])
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b), (step, j, (a - b).abs().max())
    assert int(state.step) == steps[-1]
    return state


DECAYS = {
    1: [(0.9,), (0.3,)],  # lerp weights below and above 0.5 take different formulas
    2: [(0.9, 0.3)],
    3: [(0.999, schedules.power(gamma=3.0), 0.0)],
}


def all_decays():
    return [d for ds in DECAYS.values() for d in ds]


# ------------------------------------------------------------------------------- bitwise equality


@pytest.mark.parametrize("decays", all_decays(), ids=str)
def test_flat_buffer_with_gaps_is_fused_and_exact(decays):
    buf, shards = flat_views([1, 17, 100, 33, 64, 5, 250, 3])
    state = run_and_compare(shards, decays)
    plan = plan_of(state, shards)
    assert plan.fused_runs == 1 and not plan.staged and not plan.converted
    # One EMA buffer for all K EMAs: 4 bytes x (leaves + mirrored gaps) x K.
    span = 17 + 100 + 33 + 64 + 5 + 250 + 3 + 1 + 3 * 7
    assert fe.ema_nbytes(state) == 4 * span * len(decays)


@pytest.mark.parametrize("decays", all_decays(), ids=str)
def test_many_trees_exact(decays):
    _, flat_a = flat_views([10, 20, 30], seed=1)
    _, flat_b = flat_views([7, 0, 9], gap=0, seed=2)
    big = torch.randn(64, 48)
    trees = {
        "empty": {},
        "zero_numel": {"a": torch.zeros(0), "b": torch.randn(5), "c": torch.zeros(3, 0)},
        "standalone": {"x": torch.randn(3, 4), "y": torch.randn(129), "z": torch.randn(())},
        "two_buffers": {**{f"a.{n}": t for n, t in flat_a.items()}, **{f"b.{n}": t for n, t in flat_b.items()}},
        "non_contiguous": {"t": big.t(), "s": big[:, ::3], "c": big[1:5, 2:40], "row": big[7]},
        "nested": {"enc": {"w": torch.randn(11, 3), "b": torch.randn(3)}, "dec": [torch.randn(6), torch.randn(2, 2)]},
        "mixed_dtype_shards": {"f32": torch.randn(40), "f64": torch.randn(40, dtype=torch.float64)},
    }
    for name, tree in trees.items():
        run_and_compare(tree, decays)


def test_views_of_2d_buffer_and_shuffled_names():
    # Leaves whose dict order differs from their order in memory, and 2-D views.
    buf = torch.randn(1000)
    shards = {"z": buf[0:100].view(10, 10), "a": buf[110:300].view(19, 10), "m": buf[300:301], "b": buf[400:999]}
    state = run_and_compare(shards, (0.9, 0.6))
    assert plan_of(state, shards).fused_runs == 1


def test_overlapping_views():
    buf = torch.randn(200)
    shards = {"a": buf[0:50], "b": buf[25:75], "c": buf[75:120], "d": buf[100:180]}

    def mutate(tree, step):  # overlapping views: write the buffer, not the views
        buf.copy_(torch.randn(200, generator=torch.Generator().manual_seed(step)))

    run_and_compare(shards, (0.9,), mutate=mutate)
    run_and_compare(shards, (0.9, 0.5), mutate=mutate)


def test_state_rearranged_so_a_fused_span_would_overwrite_another_leaf():
    # init over a, b, c of one buffer: the EMA buffer mirrors [a | b | c]. Then b's weights come
    # from elsewhere: a and c still share an offset, but a span over them would write b's EMA.
    buf = torch.randn(30)
    state = fe.init_ema({"a": buf[0:10], "b": buf[10:20], "c": buf[20:30]})
    other = torch.randn(10)
    shards = {"a": buf[0:10], "b": other, "c": buf[20:30]}
    ref = {n: t.clone() for n, t in state.ema.items()}
    for step in (1, 2):
        perturb(shards, step)
        state = fe.update(state, shards, decay=0.9)
        for n in ref:
            ref[n].lerp_(shards[n], 1 - 0.9)
        assert all(torch.equal(state.ema[n], ref[n]) for n in ref)
    assert plan_of(state, shards).fused_runs == 0


def test_state_from_other_names_same_shapes_is_exact():
    # The state's tensors swapped between names: offsets no longer line up, per-tensor fallback.
    buf, shards = flat_views([10, 10, 10, 10], gap=0)
    state = fe.init_ema(shards)
    names = list(shards)
    swapped = fe.EmaState(state.step, ({names[0]: state.ema[names[1]], names[1]: state.ema[names[0]], **{n: state.ema[n] for n in names[2:]}},))
    ref = {n: t.clone() for n, t in swapped.ema.items()}
    perturb(shards, 1)
    swapped = fe.update(swapped, shards, decay=0.5)
    for n in ref:
        ref[n].lerp_(shards[n], 0.5)
        assert torch.equal(swapped.ema[n], ref[n])


def test_bf16_ema_of_fp32_shards_warns_and_matches_per_tensor_cast():
    _, shards = flat_views([100, 3, 250, 1, 60])
    with pytest.warns(UserWarning, match="bfloat16"):
        fe.init_ema(shards, dtype=torch.bfloat16)
    for decays in ((0.9,), (0.99, 0.3)):
        state = run_and_compare(shards, decays, dtype=torch.bfloat16)
        assert all(t.dtype == torch.bfloat16 for e in state.emas for t in e.values())
        plan = plan_of(state, shards)
        # The fused span is staged (converted chunk by chunk), not updated per tensor.
        assert plan.fused_runs == 1 and len(plan.staged) == 1 and not plan.groups
        assert len(next(iter(plan.staged.values())).chunks) > 1
    # Non-contiguous fp32 leaves with a bf16 EMA: converted per tensor.
    big = torch.randn(30, 20)
    run_and_compare({"t": big.t(), "s": big[:, ::2]}, (0.9,), dtype=torch.bfloat16)


def test_large_single_tensors_with_several_emas_are_chunked():
    shards = {"big": torch.randn(1000), "small": torch.randn(3)}
    state = run_and_compare(shards, (0.9, 0.6, 0.0))
    group = next(iter(plan_of(state, shards).groups.values()))
    assert len(group.emas) == 3 * (-(-1000 // _plan._chunk_elements()) + 1)


def test_staged_path_on_cpu_same_dtype(monkeypatch):
    """The pinned-CPU-EMA pipeline (copy chunk i+1 while updating chunk i) run on CPU: the same
    chunk and double-buffer logic with plain copies standing in for the side-stream copies."""
    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: True)
    _, shards = flat_views([100, 3, 250, 1, 60, 7])
    # pin_memory is ignored without CUDA (no pinned allocator), and must not fail.
    state = run_and_compare(shards, (0.9, 0.6), device="cpu", pin_memory=True)
    assert not any(t.is_pinned() for t in state.ema.values())
    plan = plan_of(state, shards)
    staged = next(iter(plan.staged.values()))
    assert type(staged.stager) is _plan._CopyStager  # nothing CUDA-only without CUDA
    assert len(staged.chunks) == -(-(100 + 3 + 250 + 1 + 60 + 7 + 5 * 3) // 53)
    # Standalone tensors go through the same pipeline, each in its own chunks.
    run_and_compare({"a": torch.randn(120), "b": torch.randn(5, 5), "c": torch.randn(0)}, (0.9,), pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_weights_pinned_cpu_ema():
    buf = torch.randn(10_000, device="cuda")
    shards = {f"p{i}": buf[i * 1000 : i * 1000 + 990] for i in range(10)}
    state = run_and_compare(shards, (0.9, 0.6), device="cpu", pin_memory=True)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in state.ema.values())
    staged = next(iter(plan_of(state, shards).staged.values()))
    assert type(staged.stager) is _plan._CudaToHost


# ------------------------------------------------------------------------- in place / out of place


def test_out_of_place_leaves_old_state_untouched_and_stays_fused():
    _, shards = flat_views([50, 60, 70])
    old = fe.init_ema(shards, num_emas=2)
    before = copy.deepcopy(old)
    perturb(shards, 1)
    new = fe.update(old, shards, decay=(0.9, 0.5), inplace=False)
    assert int(old.step) == 0 and int(new.step) == 1
    for k in range(2):
        for n in shards:
            assert torch.equal(old.emas[k][n], before.emas[k][n])
            assert new.emas[k][n].untyped_storage().data_ptr() != old.emas[k][n].untyped_storage().data_ptr()
    inplace = fe.update(before, shards, decay=(0.9, 0.5))
    assert all(torch.equal(new.emas[k][n], inplace.emas[k][n]) for k in range(2) for n in shards)
    # The new buffers mirror the layout: the next update (either way) is one fused span.
    perturb(shards, 2)
    newer = fe.update(new, shards, decay=(0.9, 0.5), inplace=False)
    assert plan_of(newer, shards).fused_runs == 1
    new = fe.update(new, shards, decay=(0.9, 0.5))
    assert plan_of(new, shards).fused_runs == 1
    assert all(torch.equal(new.emas[k][n], newer.emas[k][n]) for k in range(2) for n in shards)
    assert fe.ema_nbytes(new) == fe.ema_nbytes(old)


def test_inplace_returns_state_sharing_buffers():
    shards = {"a": torch.randn(4)}
    state = fe.init_ema(shards)
    new = fe.update(state, shards, decay=0.5)
    assert new.ema["a"] is state.ema["a"] and int(state.step) == 1


def test_out_of_place_of_unowned_tensors():
    state = fe.EmaState(torch.tensor(0), ({"a": torch.zeros(3), "b": torch.zeros(2, 2).t()},))
    shards = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    new = fe.update(state, shards, decay=0.75, inplace=False)
    assert torch.equal(state.ema["a"], torch.zeros(3))
    assert torch.equal(new.ema["a"], torch.full((3,), 0.25)) and torch.equal(new.ema["b"], torch.full((2, 2), 0.25))


# ------------------------------------------------------------------------------ cache correctness


def test_rebinding_data_of_a_weight_is_seen():
    model = torch.nn.Linear(4, 3)
    shards = {n: p for n, p in model.named_parameters()}
    state = fe.init_ema(shards)
    fe.update(state, shards, decay=0.5)
    new_w = torch.randn(3, 4)
    model.weight.data = new_w  # same Parameter object, other memory
    expect = state.ema["weight"].clone().lerp_(new_w, 0.5)
    fe.update(state, shards, decay=0.5)
    assert torch.equal(state.ema["weight"], expect)


def test_rebinding_data_of_all_views_of_a_flat_buffer_is_seen():
    # Like module.to(...): every tensor object stays, its .data moves to a new buffer.
    buf, shards = flat_views([40, 50, 60])
    state = fe.init_ema(shards)
    fe.update(state, shards, decay=0.5)
    assert plan_of(state, shards).fused_runs == 1
    new_buf = torch.randn(buf.numel())
    for t in shards.values():
        t.data = new_buf.as_strided(t.shape, t.stride(), t.storage_offset())
    expect = {n: state.ema[n].clone().lerp_(t, 0.5) for n, t in shards.items()}
    fe.update(state, shards, decay=0.5)
    assert all(torch.equal(state.ema[n], expect[n]) for n in shards)


def test_replacing_an_ema_tensor_in_the_dict_is_seen():
    _, shards = flat_views([5, 6])
    state = fe.init_ema(shards)
    fe.update(state, shards, decay=0.5)
    n0 = next(iter(shards))
    state.ema[n0] = torch.zeros(5)
    fe.update(state, shards, decay=0.5)
    assert torch.equal(state.ema[n0], shards[n0] * 0.5)


def test_fresh_views_each_step_and_plans_do_not_keep_tensors_alive():
    buf = torch.randn(100)
    state = fe.init_ema({"a": buf[:40], "b": buf[50:90]})
    ref = {n: t.clone() for n, t in state.ema.items()}
    for step in range(1, 4):
        shards = {"a": buf[:40], "b": buf[50:90]}  # new view objects, as a naive reader makes
        buf.add_(1.0)
        fe.update(state, shards, decay=0.9)
        for n in ref:
            ref[n].lerp_(shards[n], 1 - 0.9)
            assert torch.equal(state.ema[n], ref[n])
    plan = weakref.ref(plan_of(state, shards))
    del shards, state
    gc.collect()
    assert plan() is None  # dropped with the tensors it was built from


def test_two_states_on_the_same_shards():
    _, shards = flat_views([300, 200])
    s1, s2 = fe.init_ema(shards), fe.init_ema(shards, num_emas=2)
    r1 = fe.init_ema(shards)
    for step in range(1, 4):
        perturb(shards, step)
        fe.update(s1, shards, decay=0.9)
        fe.update(s2, shards, decay=(0.9, 0.3))
        for n, t in r1.ema.items():
            t.lerp_(shards[n], 1 - 0.9)
    assert all(torch.equal(s1.ema[n], r1.ema[n]) and torch.equal(s2.emas[0][n], r1.ema[n]) for n in shards)


def recent_plan(state, shards):
    """The plan the constant-cost check finds for these dict objects, or None."""
    return _plan._RECENT.get((id(shards), *map(id, state.emas)))


def test_same_dicts_are_matched_at_constant_cost_and_stay_exact():
    _, shards = flat_views([7 + i for i in range(40)])
    state = fe.init_ema(shards, num_emas=2)
    ref = [{n: t.clone() for n, t in shards.items()} for _ in range(2)]
    for step in range(1, 5):
        perturb(shards, step)
        fe.update(state, shards, decay=(0.9, 0.6))
        for k, d in enumerate((0.9, 0.6)):
            for n, t in ref[k].items():
                t.lerp_(shards[n], 1 - d)
        assert all(torch.equal(state.emas[k][n], ref[k][n]) for k in range(2) for n in shards)
    plan = recent_plan(state, shards)
    assert plan is not None and plan is plan_of(state, shards) and plan.fused_runs == 1


def test_replacing_a_middle_value_in_the_same_dicts_is_seen():
    # The constant-cost check looks at the ends of each dict only; replacing a value in the middle
    # frees the old tensor, which drops the plan, so the next call checks every value.
    _, shards = flat_views([5, 6, 7, 8])
    state = fe.init_ema(shards)
    fe.update(state, shards, decay=0.5)
    assert recent_plan(state, shards) is not None
    new_w = torch.randn(6)
    shards["layer1.w"] = new_w  # the old view's only owner was the dict
    assert recent_plan(state, shards) is None
    expect = {n: state.ema[n].clone().lerp_(t, 0.5) for n, t in shards.items()}
    fe.update(state, shards, decay=0.5)
    assert all(torch.equal(state.ema[n], expect[n]) for n in shards)
    state.ema["layer2.w"] = torch.zeros(7)  # same for a middle EMA tensor
    expect = {n: state.ema[n].clone().lerp_(t, 0.5) for n, t in shards.items()}
    fe.update(state, shards, decay=0.5)
    assert all(torch.equal(state.ema[n], expect[n]) for n in shards)
    assert torch.equal(state.ema["layer2.w"], shards["layer2.w"] * 0.5)


def test_a_new_dict_is_checked_in_full_even_at_a_reused_address():
    # A fresh dict each step often lands at the address of the previous, freed one; with other
    # tensors in the middle it must not be taken for it.
    a = {f"w{i}": torch.randn(4) for i in range(5)}
    state = fe.init_ema(a)
    fe.update(state, a, decay=0.5)
    others = {n: torch.randn(4) for n in a}
    for step in range(2, 6):
        shards = dict(a)
        shards["w2"] = others["w2"] if step % 2 else a["w2"]  # alternate the middle tensor
        expect = {n: state.ema[n].clone().lerp_(t, 0.5) for n, t in shards.items()}
        fe.update(state, shards, decay=0.5)
        assert all(torch.equal(state.ema[n], expect[n]) for n in shards), step
        del shards


# ----------------------------------------------------------------------------------------- errors


def test_tree_mismatch_names_the_parameters():
    state = fe.init_ema({"enc.w": torch.zeros(3), "dec.w": torch.zeros(2)})
    with pytest.raises(fe.TreeMismatchError, match=r"missing from shards: 'dec.w'.*not in the EMA state: 'head.w'"):
        fe.update(state, {"enc.w": torch.zeros(3), "head.w": torch.zeros(2)})
    with pytest.raises(fe.TreeMismatchError, match=r"shards\['dec.w'\] has shape \(4,\) but the EMA .* has \(2,\)"):
        fe.update(state, {"enc.w": torch.zeros(3), "dec.w": torch.zeros(4)})
    with pytest.raises(TypeError, match=r"shards\['dec.w'\] is a float"):
        fe.update(state, {"enc.w": torch.zeros(3), "dec.w": 1.0})
    # After a cached plan exists, a mismatch is still caught.
    good = {"enc.w": torch.zeros(3), "dec.w": torch.zeros(2)}
    fe.update(state, good)
    with pytest.raises(fe.TreeMismatchError, match="'dec.w'"):
        fe.update(state, {"enc.w": good["enc.w"]})
    assert int(state.step) == 1


def test_step_ordering():
    state = fe.init_ema({"a": torch.zeros(2)}, step=5)
    with pytest.raises(ValueError, match=r"update\(step=5\) must come after the state's step 5"):
        fe.update(state, {"a": torch.ones(2)}, 5)
    with pytest.raises(ValueError, match="must come after"):
        fe.update(state, {"a": torch.ones(2)}, 3)
    assert int(fe.update(state, {"a": torch.ones(2)}).step) == 6
    assert int(fe.update(state, {"a": torch.ones(2)}, 10).step) == 10
    # The counter is read fresh each time (it is cached as a view, not as a value).
    shards = {"a": torch.ones(2)}
    fe.update(state, shards, 11)
    state.step.fill_(20)
    with pytest.raises(ValueError, match="after the state's step 20"):
        fe.update(state, shards, 15)
    assert int(fe.update(state, shards).step) == 21
    replaced = fe.EmaState(torch.tensor(30), state.emas)  # same EMA tensors, another counter
    assert int(fe.update(replaced, shards).step) == 31 and int(state.step) == 21


def test_decay_count_errors():
    state = fe.init_ema({"a": torch.zeros(2)}, num_emas=2)
    with pytest.raises(ValueError, match="tracks 2 EMAs: pass decay as a sequence of 2"):
        fe.update(state, {"a": torch.ones(2)}, decay=0.9)
    with pytest.raises(ValueError, match="got 3 decays for a state tracking 2 EMAs"):
        fe.update(state, {"a": torch.ones(2)}, decay=(0.9, 0.8, 0.7))
    with pytest.raises(ValueError, match="got 2 decays for a state tracking 1"):
        fe.update(fe.init_ema({"a": torch.zeros(2)}), {"a": torch.ones(2)}, decay=[0.9, 0.8])
    assert int(state.step) == 0
    with pytest.raises(ValueError, match="num_emas"):
        fe.init_ema({"a": torch.zeros(2)}, num_emas=0)


def test_ema_on_other_accelerator_refused():
    state = fe.EmaState(torch.tensor(0), ({"a": torch.zeros(2, device="meta")},))
    with pytest.raises(ValueError, match=r"shards\['a'\] is on cpu but its EMA is on meta"):
        fe.update(state, {"a": torch.ones(2)})


# ------------------------------------------------------------------------------ copies and pickle


def test_pickling_refused_deepcopy_works():
    _, shards = flat_views([5, 6])
    state = fe.init_ema(shards, num_emas=2)
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(state)
    with pytest.raises(TypeError, match="functional_ema.save"):
        torch.save(state, __import__("io").BytesIO())
    clone = copy.deepcopy(state)
    perturb(shards, 1)
    fe.update(state, shards, decay=(0.9, 0.5))
    assert int(clone.step) == 0 and not torch.equal(clone.ema[next(iter(shards))], state.ema[next(iter(shards))])
    fe.update(clone, shards, decay=(0.9, 0.5))
    assert all(torch.equal(clone.emas[k][n], state.emas[k][n]) for k in range(2) for n in shards)


# ------------------------------------------------------------------------- memory on real ZeRO ranks


def zero_layout_worker(stages, steps=3):
    """Real flat ZeRO buffers: one fused span per buffer, EMA memory = 4 bytes x local partition."""
    from torch import nn

    from tests._multirank import make_engine, train_step

    class Net(nn.Module):  # ~40k parameters in 8 tensors of uneven sizes, OddNet's interface
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(7, 301)
            self.mid = nn.Linear(301, 97)
            self.norm = nn.LayerNorm(97)
            self.out = nn.Linear(97, 5)

        def forward(self, x):
            return self.out(self.norm(self.mid(torch.tanh(self.inp(x)))))

    out = []
    for stage, dtype in stages:
        engine = make_engine(stage, dtype, model=Net())
        shards = fe.local_shards(engine)
        state = fe.init_ema(shards, num_emas=2)
        ref = [{n: t.clone() for n, t in shards.items()} for _ in range(2)]
        equal = True
        for _ in range(steps):
            train_step(engine, engine.global_steps)
            shards = fe.local_shards(engine)
            fe.update(state, shards, engine.global_steps, decay=(0.9, 0.5))
            for k, d in enumerate((0.9, 0.5)):
                for n, t in ref[k].items():
                    t.lerp_(shards[n], 1 - d)
            equal &= all(torch.equal(state.emas[k][n], ref[k][n]) for k in range(2) for n in shards)
        plan = plan_of(state, shards)
        constant_cost = fe.local_shards(engine) is shards and recent_plan(state, shards) is plan
        flat_buffers = {t.untyped_storage().data_ptr() for t in shards.values() if t.numel()}
        out.append({
            "stage": stage,
            "equal": bool(equal),
            "local_numel": sum(t.numel() for t in shards.values()),
            "ema_nbytes": fe.ema_nbytes(state),
            "fused_runs": plan.fused_runs,
            "flat_buffers": len(flat_buffers),
            "constant_cost": bool(constant_cost),
        })
    return out


def test_real_zero_buffers_fused_and_memory():
    from tests._multirank import run_ranks

    reports = run_ranks("tests.test_core:zero_layout_worker", world_size=2, stages=[(3, "bf16"), (2, "fp32")])
    for rank, per_rank in enumerate(reports):
        for rep in per_rank:
            where = f"stage {rep['stage']} rank {rank}"
            assert rep["equal"], where
            assert rep["fused_runs"] == rep["flat_buffers"] == 1, (where, rep)
            assert rep["constant_cost"], (where, "local_shards + update should match the plan at a constant cost")
            local_bytes = 4 * 2 * rep["local_numel"]  # K = 2 EMAs, fp32
            assert local_bytes <= rep["ema_nbytes"] <= 1.01 * local_bytes, (where, rep)


def test_fp32_ema_keeps_moving_where_bf16_stalls():
    """Decay 0.9999 under steady drift: the per-step change (1 - d) * (x - ema) is below bf16 resolution."""
    w = {"w": torch.full((8,), 0.25)}
    fp32 = fe.init_ema(w)
    with pytest.warns(UserWarning, match="stalls"):
        bf16 = fe.init_ema(w, dtype=torch.bfloat16)
    for t in range(1, 10_001):
        w["w"].fill_(0.25 + 1e-3 * t)  # steady drift to 10.25
        fp32 = fe.update(fp32, w, decay=0.9999)
        bf16 = fe.update(bf16, w, decay=0.9999)
        if t == 9_000:
            # bf16 has not moved at all: 1e-4 * (x - ema) < half a bf16 ulp at 0.25 (9.8e-4).
            assert bf16.ema["w"][0].item() == 0.25
            assert fp32.ema["w"][0].item() > 3.0
    # A continuous EMA of the ramp lags by tau * (1 - e^-1) = 6321 steps: 0.25 + 10 - 6.321 = 3.93.
    assert fp32.ema["w"][0].item() == pytest.approx(3.93, abs=0.01)
    assert bf16.ema["w"][0].item() < 0.5  # it starts creeping only once x - ema exceeds ~9.8


def test_a_plan_in_constant_cost_use_stays_cached_among_many_others():
    # The plan matched at a constant cost every step is the most recently used one: planning
    # other trees (more than the cache holds) must not evict it.
    _, shards = flat_views([5, 6, 7])
    state = fe.init_ema(shards)
    fe.update(state, shards, decay=0.5)
    plan = plan_of(state, shards)
    keep = []
    for i in range(2 * _plan._MAX_PLANS):
        other = {"x": torch.randn(3)}
        keep.append((other, fe.init_ema(other)))
        fe.update(keep[-1][1], other, decay=0.5)
        fe.update(state, shards, decay=0.5)
    assert recent_plan(state, shards) is plan and plan_of(state, shards) is plan
