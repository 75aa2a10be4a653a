"""init_ema / update in plain torch: the fused paths against the straightforward per-tensor lerp.

Every fused, chunked, staged or grouped path must give bitwise the numbers of
``ema.lerp_(shard.to(ema.dtype), 1 - decay)`` applied tensor by tensor. Chunk sizes are shrunk so
that small trees cross many chunk boundaries and vector tails.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
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


def flat_views(sizes, gap=3, dtype=torch.float32, seed=0, as_dict=False):
    """A ``Shards`` over views of one flat buffer with ``gap`` elements between them (like a ZeRO
    partition); ``as_dict`` gives the same views as a plain dict (the per-tensor path)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(sum(sizes) + gap * len(sizes) + 5, generator=g, dtype=torch.float64).to(dtype)
    out, off = {}, 2
    for i, n in enumerate(sizes):
        out[f"layer{i}.w"] = buf.narrow(0, off, n)
        off += n + gap
    return buf, (out if as_dict else fe.Shards.from_views(out))


def perturb(tree, step, scale=1.0):
    """New values, in place (the shards are views the trainer writes into)."""
    g = torch.Generator().manual_seed(1000 + step)
    for t in optree.tree_leaves(tree):
        if t.numel():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * scale + t.double())


def info(state, shards):
    return fe.update_info(state, shards)


def run_and_compare(shards, decays, steps=(1, 2, 5, 6), dtype=torch.float32, mutate=None, **init_kw):
    """Update a state and a per-tensor reference over ``steps``; assert bitwise equality."""
    k = len(decays)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = fe.init_ema(shards, num_emas=k, dtype=dtype, **init_kw)
    plain = dict(shards) if isinstance(shards, fe.Shards) else shards  # the reference's view of them
    ref = [optree.tree_map(lambda t: t.detach().clone().to(dtype), plain) for _ in range(k)]
    last = 0
    for step in steps:
        (mutate or perturb)(shards, step)
        state = fe.update(state, shards, step, decay=decays if k > 1 else decays[0])
        for j, d in enumerate(decays):
            w = 1.0 - interval_decay(d, last, step)
            optree.tree_map(lambda e, s, w=w: e.copy_(s) if w == 1.0 else e.lerp_(s.to(e.dtype), w), ref[j], plain)
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
    _buf, shards = flat_views([1, 17, 100, 33, 64, 5, 250, 3])
    assert len(shards.segments) == 1  # one span over the buffer, gaps included
    state = run_and_compare(shards, decays)
    assert info(state, shards) == fe.UpdateInfo(fused=True, lerp_spans=1, staged_spans=0, reused=True)
    # Each EMA mirrors the span: 4 bytes x (tensors + mirrored gaps) x K.
    span = 17 + 100 + 33 + 64 + 5 + 250 + 3 + 1 + 3 * 7
    assert fe.ema_nbytes(state) == 4 * span * len(decays)
    # The same views as a plain dict take the per-tensor path, with the same numbers.
    _, plain = flat_views([1, 17, 100, 33, 64, 5, 250, 3], as_dict=True)
    state2 = run_and_compare(plain, decays)
    assert not info(state2, plain).fused and info(state2, plain).lerp_spans == 8


@pytest.mark.parametrize("decays", all_decays(), ids=str)
def test_many_trees_exact(decays):
    _, flat_a = flat_views([10, 20, 30], seed=1, as_dict=True)
    _, flat_b = flat_views([7, 0, 9], gap=0, seed=2, as_dict=True)
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
        if name not in ("nested",):  # Shards take a flat name -> tensor mapping
            run_and_compare(fe.Shards.from_views(tree), decays)


def test_views_of_2d_buffer_and_shuffled_names():
    # Tensors whose order differs from their order in memory, and 2-D views.
    buf = torch.randn(1000)
    shards = fe.Shards.from_views(
        {"z": buf[0:100].view(10, 10), "a": buf[110:300].view(19, 10), "m": buf[300:301], "b": buf[400:999]}
    )
    state = run_and_compare(shards, (0.9, 0.6))
    assert info(state, shards).lerp_spans == 1 and list(state.ema) == ["z", "a", "m", "b"]


def test_overlapping_views():
    buf = torch.randn(200)
    views = {"a": buf[0:50], "b": buf[25:75], "c": buf[75:120], "d": buf[100:180]}

    def mutate(tree, step):  # overlapping views: write the buffer, not the views
        buf.copy_(torch.randn(200, generator=torch.Generator().manual_seed(step)))

    for shards in (views, fe.Shards.from_views(views)):
        run_and_compare(shards, (0.9,), mutate=mutate)
        run_and_compare(shards, (0.9, 0.5), mutate=mutate)


def test_state_from_other_names_same_shapes_is_exact():
    # The state's tensors swapped between names: a plain dict, so the per-tensor path.
    _buf, shards = flat_views([10, 10, 10, 10], gap=0)
    state = fe.init_ema(shards)
    names = list(shards)
    swapped = fe.EmaState(
        state.step,
        ({names[0]: state.ema[names[1]], names[1]: state.ema[names[0]], **{n: state.ema[n] for n in names[2:]}},),
    )
    ref = {n: t.clone() for n, t in swapped.ema.items()}
    perturb(shards, 1)
    swapped = fe.update(swapped, shards, decay=0.5)
    assert not info(swapped, shards).fused
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
        # The fused span is staged (converted chunk by chunk), not updated per tensor.
        assert info(state, shards) == fe.UpdateInfo(True, 1, 1, True)
    # Non-contiguous fp32 tensors with a bf16 EMA: converted per tensor.
    big = torch.randn(30, 20)
    run_and_compare({"t": big.t(), "s": big[:, ::2]}, (0.9,), dtype=torch.bfloat16)


def test_large_single_tensors_with_several_emas_are_chunked():
    for shards in (
        {"big": torch.randn(1000), "small": torch.randn(3)},
        fe.Shards.from_views({"big": torch.randn(1000), "small": torch.randn(3)}),
    ):
        run_and_compare(shards, (0.9, 0.6, 0.0))


def test_staged_path_on_cpu_same_dtype(monkeypatch):
    """The pinned-CPU-EMA pipeline (copy chunk i+1 while updating chunk i) run on CPU: the same
    chunk and double-buffer logic with plain copies standing in for the side-stream copies."""
    monkeypatch.setattr(_plan, "_needs_staging", lambda src, ema: True)
    _, shards = flat_views([100, 3, 250, 1, 60, 7])
    # pin_memory is ignored without CUDA (no pinned allocator), and must not fail.
    state = run_and_compare(shards, (0.9, 0.6), device="cpu", pin_memory=True)
    assert not any(t.is_pinned() for t in state.ema.values())
    assert info(state, shards) == fe.UpdateInfo(True, 1, 1, True)
    # Standalone tensors go through the same pipeline, each in its own chunks.
    run_and_compare({"a": torch.randn(120), "b": torch.randn(5, 5), "c": torch.randn(0)}, (0.9,), pin_memory=True)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py runs it on a GPU machine)"
)
def test_cuda_weights_pinned_cpu_ema():
    buf = torch.randn(10_000, device="cuda")
    shards = fe.Shards.from_views({f"p{i}": buf[i * 1000 : i * 1000 + 990] for i in range(10)})
    state = run_and_compare(shards, (0.9, 0.6), device="cpu", pin_memory=True)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in state.ema.values())
    assert info(state, shards).staged_spans == 1


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
    assert info(newer, shards).fused and info(newer, shards).lerp_spans == 1
    new = fe.update(new, shards, decay=(0.9, 0.5))
    assert all(torch.equal(new.emas[k][n], newer.emas[k][n]) for k in range(2) for n in shards)
    assert fe.ema_nbytes(new) == fe.ema_nbytes(old)


def test_inplace_returns_state_sharing_buffers():
    shards = {"a": torch.randn(4)}
    state = fe.init_ema(shards)
    new = fe.update(state, shards, decay=0.5)
    assert new.ema["a"] is state.ema["a"] and int(state.step) == 1


def test_out_of_place_of_plain_tensors():
    state = fe.EmaState(torch.tensor(0), ({"a": torch.zeros(3), "b": torch.zeros(2, 2).t()},))
    shards = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    new = fe.update(state, shards, decay=0.75, inplace=False)
    assert torch.equal(state.ema["a"], torch.zeros(3))
    assert torch.equal(new.ema["a"], torch.full((3,), 0.25)) and torch.equal(new.ema["b"], torch.full((2, 2), 0.25))


# ------------------------------------------------------- no hidden state: honoured or refused


def test_shards_are_read_only_and_views_write_through():
    _, shards = flat_views([5, 6])
    state = fe.init_ema(shards)
    for tree in (shards, state.ema):
        with pytest.raises(TypeError, match="read-only"):
            tree["layer0.w"] = torch.zeros(5)
        with pytest.raises(TypeError, match="read-only"):
            del tree["layer0.w"]
        with pytest.raises(AttributeError, match="read-only"):
            tree.segments = ()
    # Writing into a view writes the segment: honoured by the next fused update.
    shards["layer1.w"].fill_(2.0)
    state.ema["layer0.w"].fill_(4.0)
    expect = {n: state.ema[n].clone().lerp_(shards[n], 0.5) for n in shards}
    fe.update(state, shards, decay=0.5)
    assert all(torch.equal(state.ema[n], expect[n]) for n in shards)
    assert torch.equal(state.ema["layer1.w"], expect["layer1.w"]) and torch.allclose(
        expect["layer0.w"], 2.0 + 0.5 * shards["layer0.w"]
    )
    # Every access is a fresh view: rebinding .data of one leaves the Shards as it was.
    v = shards["layer0.w"]
    before = v.clone()
    v.data = torch.zeros(5)
    assert shards["layer0.w"] is not shards["layer0.w"] and torch.equal(shards["layer0.w"], before)


def test_replacing_tensors_in_plain_dicts_is_honoured_every_call():
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
    state.ema["w3"] = torch.zeros(4)  # replacing an EMA tensor of a dict state is honoured too
    expect = 0.5 * a["w3"]
    fe.update(state, a, decay=0.5)
    assert torch.equal(state.ema["w3"], expect)


def test_rebinding_data_of_a_weight_is_seen():
    model = torch.nn.Linear(4, 3)
    state = fe.init_ema(fe.local_shards(model))
    fe.update(state, fe.local_shards(model), decay=0.5)
    new_w = torch.randn(3, 4)
    model.weight.data = new_w  # same Parameter object, other memory (like module.to(...))
    expect = state.ema["weight"].clone().lerp_(new_w, 0.5)
    fe.update(state, fe.local_shards(model), decay=0.5)  # a new reading, same layout: still fused
    assert torch.equal(state.ema["weight"], expect)
    assert info(state, fe.local_shards(model)).fused
    # A replaced Parameter object is read again under its name.
    model.bias = torch.nn.Parameter(torch.randn(3))
    fe.update(state, fe.local_shards(model), decay=0.5)
    # Freezing a parameter read keeps its place, also when the reading is re-made for another reason:
    # its EMA goes on averaging its now-constant value.
    model.bias.requires_grad_(False)
    model.weight.data = torch.randn(3, 4)
    expect = state.ema["bias"].clone().lerp_(model.bias.detach(), 0.5)
    fe.update(state, fe.local_shards(model), decay=0.5)
    assert "bias" in fe.local_shards(model) and torch.equal(state.ema["bias"], expect)
    # Unfreezing a parameter frozen when the model was first read changes what is tracked: refused by name.
    partly_frozen = torch.nn.Linear(4, 3)
    partly_frozen.bias.requires_grad_(False)
    state = fe.init_ema(fe.local_shards(partly_frozen))
    assert list(state.ema) == ["weight"]
    partly_frozen.bias.requires_grad_(True)
    with pytest.raises(fe.TreeMismatchError, match="'bias'"):
        fe.update(state, fe.local_shards(partly_frozen), decay=0.5)
    # Progressive unfreezing (the README's recipe): read the model before freezing anything.
    staged = torch.nn.Linear(4, 3)
    first = fe.local_shards(staged)
    staged.bias.requires_grad_(False)
    staged.bias.requires_grad_(True)
    assert fe.local_shards(staged) is first and list(first) == ["weight", "bias"]


def test_two_states_on_the_same_shards():
    _, shards = flat_views([300, 200])
    s1, s2 = fe.init_ema(shards), fe.init_ema(shards, num_emas=2)
    r1 = fe.init_ema(dict(shards))
    for step in range(1, 4):
        perturb(shards, step)
        fe.update(s1, shards, decay=0.9)
        fe.update(s2, shards, decay=(0.9, 0.3))
        for n, t in r1.ema.items():
            t.lerp_(shards[n], 1 - 0.9)
    assert all(torch.equal(s1.ema[n], r1.ema[n]) and torch.equal(s2.emas[0][n], r1.ema[n]) for n in shards)


def test_package_keeps_no_module_level_registries():
    """The update path keeps nothing between calls outside the objects passed in."""
    import importlib
    import pkgutil
    import types
    import weakref as _weakref

    import functional_ema

    found = []
    for mod_info in pkgutil.walk_packages(functional_ema.__path__, "functional_ema."):
        if mod_info.name.startswith("functional_ema._testing"):
            continue  # the test harness, not the library
        mod = importlib.import_module(mod_info.name)
        for name, value in vars(mod).items():
            if isinstance(
                value, (dict, list, set, _weakref.WeakKeyDictionary, _weakref.WeakValueDictionary)
            ) and not name.startswith("__"):
                if isinstance(value, types.MappingProxyType):
                    continue
                found.append(f"{mod_info.name}.{name}")
    constant_tables = {  # filled at import, never written: not state
        "functional_ema.__main__._COMMANDS",
        "functional_ema._io.DTYPE_TO_STR",
        "functional_ema._io.STR_TO_DTYPE",
        "functional_ema._io.CHECKSUMS",
    }
    # Off the update path, each with its reason in the code: gloo side groups for monitored_barrier
    # under NCCL (creating a group is a rendezvous of its ranks, so one per group is kept).
    constant_tables |= {"functional_ema._checkpoint.collective._SIDE_GROUPS"}
    # One int, no object held: how many times FSDP2 replaced a sharded parameter or its local tensor in
    # this process, so that a reading checks one number instead of every parameter (engines/fsdp2.py).
    constant_tables |= {"functional_ema.engines.fsdp2._REPLACEMENTS"}
    # One int, no object held: how many parameters or submodules were registered on modules of FSDP2 models read
    # in this process (torch's global registration hooks), so a reading sees a submodule replaced or added with
    # one more integer compare (engines/fsdp2.py, _watch_registrations; the modules are marked, not listed).
    constant_tables |= {"functional_ema.engines.fsdp2._REGISTRATIONS"}
    # Which low-precision warnings this process has given (keys, no tensors): each once per process, which the
    # warnings module's own "once" does not keep across catch_warnings/simplefilter (engines/_base.py).
    constant_tables |= {"functional_ema.engines._base._WARNED"}
    assert sorted(set(found) - constant_tables) == []


# ----------------------------------------------------------------------------------------- errors


def test_tree_mismatch_names_the_parameters():
    for make in (dict, fe.Shards.from_views):
        state = fe.init_ema(make({"enc.w": torch.zeros(3), "dec.w": torch.zeros(2)}))
        with pytest.raises(
            fe.TreeMismatchError,
            match=r"missing from shards: 'dec.w'.*not in the EMA state: 'head.w'|missing from shards: 'dec.w'",
        ):
            fe.update(state, {"enc.w": torch.zeros(3), "head.w": torch.zeros(2)})
        with pytest.raises(fe.TreeMismatchError, match=r"shards\['dec.w'\] has shape \(4,\) but the EMA .* has \(2,\)"):
            fe.update(state, make({"enc.w": torch.zeros(3), "dec.w": torch.zeros(4)}))
        with pytest.raises(TypeError, match=r"shards\['dec.w'\] is a float"):
            fe.update(state, {"enc.w": torch.zeros(3), "dec.w": 1.0})
        with pytest.raises(TypeError, match=r"shards\['dec.w'\] has dtype torch.int64"):
            fe.update(state, {"enc.w": torch.zeros(3), "dec.w": torch.zeros(2, dtype=torch.int64)})
        with pytest.raises(TypeError, match=r"shards\['dec.w'\] has dtype torch.bool"):
            fe.update(state, make({"enc.w": torch.zeros(3), "dec.w": torch.zeros(2, dtype=torch.bool)}))
        assert int(state.step) == 0


def test_state_of_parameters_of_other_whole_shapes_refused_though_pieces_match():
    # A reading's Shards records its parameters' whole shapes: ZeRO-3 pieces of a (4, 6) and a (6, 4) weight have one
    # length, so the indexes agree. An EMA made for other shapes is refused, naming the parameter and both shapes,
    # on the fused path (same index) and the per-tensor one (the bias lengths differ too), before anything moves.
    def module(w: tuple[int, int], b: int) -> torch.nn.Module:
        m = torch.nn.Module()
        m.weight, m.bias = torch.nn.Parameter(torch.ones(w)), torch.nn.Parameter(torch.ones(b))
        return m

    def flat(shards: fe.Shards) -> fe.Shards:  # one rank's 1-D pieces, keeping the reading's whole shapes
        out = fe.Shards.from_views({n: t.detach().reshape(-1) for n, t in shards.items()})
        out.full_shapes = shards.full_shapes
        return out

    mine = fe.local_shards(module((4, 6), 4))
    assert mine.full_shapes == ((4, 6), (4,))
    for other, fused in ((module((6, 4), 4), True), (module((6, 4), 6), False)):
        state = fe.init_ema(flat(mine))
        assert state.emas[0].full_shapes == ((4, 6), (4,)) and state.emas[0].clone().full_shapes == ((4, 6), (4,))
        shards = flat(fe.local_shards(other))
        assert (state.emas[0].index == shards.index) is fused
        said = (  # where the pieces differ too (the bias), that is said first
            r"shards\['weight'\] is a piece of a parameter of shape \(6, 4\) but the EMA \(emas\[0\]\) was made for "
            r"one of shape \(4, 6\)"
            if fused
            else r"shards\['bias'\] has shape \(6,\) but the EMA \(emas\[0\]\) has \(4,\)"
        )
        with pytest.raises(fe.TreeMismatchError, match=said):
            fe.update(state, shards, 1, decay=0.5)
        assert int(state.step) == 0 and all(torch.equal(t, torch.ones(t.shape)) for t in state.ema.values())
    # The same model's reading still updates (fused); so does a state without whole shapes (from_views).
    other = module((6, 4), 4)
    state = fe.update(fe.init_ema(fe.local_shards(other)), fe.local_shards(other), 1, decay=0.5)
    assert int(state.step) == 1 and fe.update_info(state, fe.local_shards(other)).fused
    plain = fe.init_ema(fe.Shards.from_views({n: t.reshape(-1) for n, t in mine.items()}))
    assert int(fe.update(plain, flat(fe.local_shards(other)), 1, decay=0.5).step) == 1


def test_step_ordering_and_same_step_is_a_no_op():
    state = fe.init_ema({"a": torch.zeros(2)}, step=5)
    same = fe.update(state, {"a": torch.ones(2)}, 5)  # e.g. gradient accumulation: no optimizer step yet
    assert same is state and int(state.step) == 5 and torch.equal(state.ema["a"], torch.zeros(2))
    with pytest.raises(ValueError, match=r"update\(step=3\) comes before the state's step 5"):
        fe.update(state, {"a": torch.ones(2)}, 3)
    assert int(fe.update(state, {"a": torch.ones(2)}).step) == 6
    assert int(fe.update(state, {"a": torch.ones(2)}, 10).step) == 10
    state.step.fill_(20)  # the counter is read from the state each call
    with pytest.raises(ValueError, match="before the state's step 20"):
        fe.update(state, {"a": torch.ones(2)}, 15)
    assert int(fe.update(state, {"a": torch.ones(2)}).step) == 21
    assert int(fe.update(state, {"a": torch.ones(2)}, torch.tensor(25)).step) == 25
    import numpy as np

    assert int(fe.update(state, {"a": torch.ones(2)}, np.int64(26)).step) == 26


@pytest.mark.parametrize(
    "bad, err",
    [
        (2.7, TypeError),
        ("5", TypeError),
        (True, TypeError),
        (torch.tensor(3.0), TypeError),
        (2**63, ValueError),
        (-1, ValueError),
    ],
)
def test_bad_steps_refused_before_anything_moves(bad, err):
    shards = fe.Shards.from_views({"a": torch.ones(3), "b": torch.ones(2)})
    state = fe.init_ema({"a": torch.zeros(3), "b": torch.zeros(2)})
    before = copy.deepcopy(state)
    with pytest.raises(err, match="step"):
        fe.update(state, shards, bad)
    with pytest.raises(err, match="step"):
        fe.init_ema(shards, step=bad)
    assert int(state.step) == 0 and all(torch.equal(state.ema[n], before.ema[n]) for n in state.ema)


def test_bad_decays_refused_before_anything_moves():
    state = fe.init_ema({"a": torch.zeros(2)})
    shards = {"a": torch.ones(2)}
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            fe.update(state, shards, 3, decay=bad)
    # A per-step decay outside [0, 1] is refused even when its product over skipped steps is fine.
    with pytest.raises(ValueError, match=r"gave -0.5 at step \d.*\[0, 1\]"):
        fe.update(state, shards, 2, decay=lambda t: -0.5)
    # A plain callable skipping very many steps: refused at once, with the fix.
    with pytest.raises(ValueError, match="interval"):
        fe.update(state, shards, 10**7, decay=lambda t: 0.99)
    assert int(state.step) == 0 and torch.equal(state.ema["a"], torch.zeros(2))
    # An exact closed form skips any number of steps at once.
    fe.update(state, shards, 10**7, decay=fe.schedules.power(gamma=7.0))
    assert int(state.step) == 10**7


# ------------------------------------------------------------------- odd values (issue 21, item 5)


def snapshot(state):
    """Copies of the step counter and of every EMA tensor (segments included), to compare after a
    refused call."""
    step = state.step
    step = step.clone() if isinstance(step, torch.Tensor) and not step.is_meta else step
    tensors = [t.clone() for ema in state.emas for t in optree.tree_leaves(ema)]
    tensors += [t.clone() for ema in state.emas if isinstance(ema, fe.Shards) for t in ema.segments]
    return step, tensors


def unchanged(state, snap) -> bool:
    """Whether the step counter and every EMA tensor equal ``snap`` (meta tensors: same shape)."""
    step, tensors = snap
    now_step, now = snapshot(state)
    if isinstance(step, torch.Tensor) != isinstance(now_step, torch.Tensor):
        return False
    if isinstance(step, torch.Tensor):
        if step.is_meta or now_step.is_meta:
            same_step = step.is_meta and now_step.is_meta and step.shape == now_step.shape
        else:
            same_step = step.dtype == now_step.dtype and torch.equal(step, now_step)
    else:
        same_step = step == now_step
    return (
        same_step
        and len(now) == len(tensors)
        and all((a.shape == b.shape and a.is_meta) if a.is_meta else torch.equal(a, b) for a, b in zip(now, tensors))
    )


def _real_state(fused: bool):
    """A state at step 0 and new weights (a ``Shards`` or a plain dict of the same views)."""
    _, shards = flat_views([5, 6], as_dict=not fused)
    state = fe.init_ema(shards)
    perturb(shards, 1)
    return state, shards


ODD_COUNTERS = [
    (0, TypeError, "got int 0"),
    (torch.tensor(2**31 - 1, dtype=torch.int32), TypeError, "dtype torch.int32"),
    (torch.tensor(0.0), TypeError, "dtype torch.float32"),
    (torch.tensor([0, 0]), ValueError, r"shape \(2,\)"),
    (torch.tensor(0, device="meta"), ValueError, "on meta"),
    (torch.tensor(-3), ValueError, ">= 0"),
]


@pytest.mark.parametrize("fused", [True, False], ids=["Shards", "dict"])
@pytest.mark.parametrize("counter, err, frag", ODD_COUNTERS, ids=lambda v: str(v)[:24])
def test_odd_step_counters_refused_before_anything_moves(counter, err, frag, fused):
    """An EmaState built by hand with a counter update could not write (a Python int, int32 near
    2**31, a float, several elements, meta, negative) is refused before the EMAs move."""
    state, shards = _real_state(fused)
    bad = fe.EmaState(counter, state.emas)
    snap = snapshot(bad)
    for step in (None, 7):
        with pytest.raises(err, match=rf"state\.step must be .*{frag}") as info_:
            fe.update(bad, shards, step, decay=0.5)
        assert "init_ema" in str(info_.value)  # the fix
        assert unchanged(bad, snap)
    if not isinstance(counter, int):
        with pytest.raises(err, match=r"state\.step"):
            fe.update(bad, shards, decay=0.5, inplace=False)
    assert unchanged(bad, snap)


def test_one_element_int64_counter_is_a_counter():
    state, shards = _real_state(True)
    state = fe.EmaState(torch.tensor([4]), state.emas)
    assert int(fe.update(state, shards, decay=0.5).step) == 5 and state.step.shape == (1,)


@pytest.mark.parametrize("fused", [True, False], ids=["Shards", "dict"])
def test_steps_past_the_counter_refused_before_anything_moves(fused):
    state, shards = _real_state(fused)
    state.step.fill_(2**63 - 1)
    snap = snapshot(state)
    with pytest.raises(ValueError, match=r"update\(step=None\).*does not fit the state's int64 step counter"):
        fe.update(state, shards, decay=0.5)
    with pytest.raises(ValueError, match=r"step=9223372036854775808 is outside \[0, 2\*\*63 - 1\]"):
        fe.update(state, shards, np.uint64(2**63), decay=0.5)
    with pytest.raises(ValueError, match=r"update\(step=9223372036854775808\) does not fit the state's int64"):
        fe.update(state, shards, 2**63, decay=0.5)
    assert unchanged(state, snap)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"dtype": "float32"}, TypeError, r"dtype must be a torch.dtype .*got str 'float32'; pass dtype=torch.float32"),
        ({"dtype": "torch.bfloat16"}, TypeError, r"dtype must be a torch.dtype .*pass dtype=torch.bfloat16"),
        ({"dtype": float}, TypeError, r"dtype must be a torch.dtype .*got type"),
        ({"dtype": None}, TypeError, r"dtype must be a torch.dtype .*got NoneType"),
        ({"dtype": torch.float8_e4m3fn}, TypeError, r"dtype=torch.float8_e4m3fn is not a supported EMA dtype"),
        ({"dtype": torch.float8_e5m2}, TypeError, r"dtype=torch.float8_e5m2 is not a supported EMA dtype"),
        ({"dtype": torch.int32}, TypeError, r"dtype=torch.int32 is not a supported EMA dtype.*torch.float32"),
        ({"dtype": torch.bool}, TypeError, r"dtype=torch.bool is not a supported EMA dtype"),
        ({"dtype": torch.complex64}, TypeError, r"dtype=torch.complex64 is not a supported EMA dtype"),
        ({"num_emas": "2"}, TypeError, r"num_emas must be an int >= 1 .*got str '2'"),
        ({"num_emas": 2.0}, TypeError, r"num_emas must be an int >= 1 .*got float 2.0"),
        ({"num_emas": True}, TypeError, r"num_emas must be an int >= 1 .*got a bool"),
        ({"num_emas": None}, TypeError, r"num_emas must be an int >= 1 .*got NoneType"),
        ({"num_emas": 0}, ValueError, r"num_emas must be in \[1, 1024\] \(how many EMAs to track\), got 0"),
        ({"device": "meta"}, ValueError, r"device='meta': an EMA on the meta device holds no values"),
    ],
    ids=str,
)
@pytest.mark.parametrize("fused", [True, False], ids=["Shards", "dict"])
def test_odd_init_arguments_refused(kwargs, err, match, fused):
    _, shards = flat_views([5, 6], as_dict=not fused)
    before = {n: t.clone() for n, t in shards.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before the 16-bit warning, too
        with pytest.raises(err, match=match):
            fe.init_ema(shards, **kwargs)
    assert all(torch.equal(shards[n], before[n]) for n in before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_supported_ema_dtypes(dtype):
    _, shards = flat_views([5, 6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fe.init_ema(shards, dtype=dtype, num_emas=np.int64(2))
    assert state.num_emas == 2 and state.ema.segments[0].dtype == dtype
    assert bool(caught) == (dtype in (torch.float16, torch.bfloat16))  # the 16-bit warning stays


def test_meta_tensors_refused_naming_the_parameter():
    _, shards = flat_views([5, 6])
    meta_shards = shards.mirror(torch.float32, device="meta", fill=False)  # same layout: the fused path
    assert meta_shards.index == shards.index
    meta_dict = {n: torch.empty(t.shape, device="meta") for n, t in shards.items()}
    one_meta = {**dict(shards), "layer1.w": meta_dict["layer1.w"]}
    for tree, name in ((meta_shards, "layer0.w"), (meta_dict, "layer0.w"), (one_meta, "layer1.w")):
        with pytest.raises(ValueError, match=rf"shards\['{name}'\] is on the meta device.*materialised"):
            fe.init_ema(tree)
        for fused in (True, False):
            state, real = _real_state(fused)
            snap = snapshot(state)
            with pytest.raises(ValueError, match=rf"shards\['{name}'\] is on the meta device"):
                fe.update(state, tree, decay=0.5)
            assert unchanged(state, snap)
    # An EMA state whose tensors are on meta (made from meta weights by hand), on both paths.
    for fused in (True, False):
        state, real = _real_state(fused)
        meta = {n: torch.empty(t.shape, device="meta") for n, t in real.items()}
        ema = real.mirror(torch.float32, device="meta", fill=False) if fused else meta
        bad = fe.EmaState(state.step, (ema,))
        snap = snapshot(bad)
        with pytest.raises(ValueError, match=r"state\.emas\[0\]\['layer0\.w'\] is on the meta device"):
            fe.update(bad, real, decay=0.5)
        assert unchanged(bad, snap) and int(bad.step) == 0


ODD_DECAYS = [
    (lambda s: None, TypeError, r"gave None at step 1"),
    (lambda s: "0.5", TypeError, r"gave '0.5' \(a str\) at step 1"),
    (lambda s: torch.tensor([0.5, 0.5]), TypeError, r"gave a Tensor of shape \(2,\) .* at step 1"),
    (lambda s: 0.5j, TypeError, r"gave 0.5j \(a complex\) at step 1"),
    (lambda s: True, TypeError, r"gave True \(a bool\) at step 1"),
    (lambda s: float("nan"), ValueError, r"gave nan at step 1"),
    (lambda s: 0.9 if s < 3 else None, TypeError, r"gave None at step 3"),  # fine for the first steps
]


@pytest.mark.parametrize("fused", [True, False], ids=["Shards", "dict"])
@pytest.mark.parametrize("decay, err, match", ODD_DECAYS)
def test_odd_decay_callables_refused_naming_decay_and_step(decay, err, match, fused):
    state, shards = _real_state(fused)
    snap = snapshot(state)
    with pytest.raises(err, match=rf"the decay callable '.*<lambda>' {match}; a decay must be"):
        fe.update(state, shards, 4, decay=decay)
    assert unchanged(state, snap)
    two = fe.init_ema(shards, num_emas=2)
    snap = snapshot(two)
    with pytest.raises(err, match=match):
        fe.update(two, shards, 4, decay=(0.9, decay))
    assert unchanged(two, snap)


def test_odd_decay_arguments_and_schedules_refused():
    state, shards = _real_state(True)
    snap = snapshot(state)

    class NoneInterval:
        def __call__(self, step):
            return 0.9

        def interval(self, start, stop):
            return None

        def __repr__(self):
            return "NoneInterval()"

    cases = [
        ("0.9", TypeError, "decay must be a float, a schedule or a callable"),
        (None, TypeError, "decay must be a float, a schedule or a callable"),
        (NoneInterval(), TypeError, r"decay schedule NoneInterval\(\) gave None for steps \(0, 2\]"),
    ]
    for decay, err, match in cases:
        with pytest.raises(err, match=match):
            fe.update(state, shards, 2, decay=decay)
        assert unchanged(state, snap)
    # One real number in any form is a decay.
    for ok in (lambda s: np.float32(0.5), lambda s: torch.tensor(0.5), lambda s: torch.tensor([0.5]), lambda s: 1):
        assert int(fe.update(copy.deepcopy(state), shards, 2, decay=ok).step) == 2


def test_decay_zero_is_exactly_the_weights_even_after_nan():
    _, shards = flat_views([5, 6])
    state = fe.init_ema(shards)
    with torch.no_grad():
        shards["layer0.w"][2] = float("nan")
    fe.update(state, shards, decay=0.9)
    assert torch.isnan(state.ema["layer0.w"][2])
    perturb(shards, 3)  # clean weights again (NaN + x is NaN: rewrite)
    shards["layer0.w"].copy_(torch.arange(5.0))
    for _ in range(3):
        fe.update(state, shards, decay=0.9)
    assert torch.isnan(state.ema["layer0.w"][2])  # an EMA keeps a NaN forever ...
    fe.update(state, shards, decay=0.0)  # ... until decay 0 sets it to the weights, exactly
    assert all(torch.equal(state.ema[n], shards[n]) for n in shards)


def test_nonfinite_guard_skip_and_raise():
    _, shards = flat_views([5, 6])
    for mode in ("skip", "raise"):
        state = fe.init_ema(shards)
        before = copy.deepcopy(state)
        with torch.no_grad():
            shards["layer1.w"][3] = float("inf")
        if mode == "raise":
            with pytest.raises(fe.NonFiniteError, match=r"shards\['layer1.w'\]"):
                fe.update(state, shards, 1, decay=0.5, nonfinite=mode)
        else:
            assert fe.update(state, shards, 1, decay=0.5, nonfinite=mode) is state
        assert int(state.step) == 0 and all(torch.equal(state.ema[n], before.ema[n]) for n in shards)
        shards["layer1.w"].copy_(torch.ones(6))
        fe.update(state, shards, 2, decay=0.5, nonfinite=mode)  # clean again: compounds the skipped step
        assert torch.equal(state.ema["layer1.w"], before.ema["layer1.w"].lerp(torch.ones(6), 1 - 0.25))
    # Garbage in the padding between tensors (ZeRO-3 leaves it uninitialised) is not a weight.
    buf, shards = flat_views([5, 6], gap=3)
    buf[2 + 5] = float("nan")  # inside the gap
    state = fe.init_ema(shards)
    fe.update(state, shards, decay=0.5, nonfinite="raise")
    with pytest.raises(ValueError, match="nonfinite"):
        fe.update(state, shards, decay=0.5, nonfinite="warn")


def test_all_finite_agrees_with_isfinite():
    """The nonfinite guard's check (aminmax: one read, no mask) against torch.isfinite: NaN, inf and -inf at the
    ends, the middle and random places, every float dtype, sizes across the vectorised and threaded widths."""
    from functional_ema._core import all_finite

    gen = torch.Generator().manual_seed(0)
    cases = 0
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for size in [*range(1, 40), 255, 256, 257, 1025, 32771, 327_687, 3_000_001]:
            clean = torch.randn(size, generator=gen).to(dtype)
            assert all_finite(clean) and bool(torch.isfinite(clean).all())
            where = {0, size - 1, size // 2, int(torch.randint(size, (1,), generator=gen))}
            for bad in (float("nan"), float("inf"), -float("inf")):
                for i in where:
                    t = clean.clone()
                    t[i] = bad
                    assert all_finite(t) is False, (dtype, size, bad, i)
                    cases += 1
    assert cases > 1000
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])  # finite, opposite ends
    assert all_finite(big) and all_finite(torch.empty(0)) and all_finite(torch.arange(3))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")])) and not all_finite(
        torch.full((9,), float("nan"))
    )


def test_nonfinite_guard_refuses_weights_a_float16_ema_cannot_hold():
    """A float16 EMA of fp32 weights: a finite weight above 65504 casts to inf in the lerp (the EMA inf, or NaN
    at decay 0.5); the guard checks what the EMA's dtype can hold, not only that the weight is finite."""
    w = {"a": torch.ones(3), "b": torch.ones(4)}
    for mode in ("skip", "raise"):
        with pytest.warns(UserWarning):  # a 16-bit EMA warns (resolution)
            state = fe.init_ema(w, dtype=torch.float16)
        w["b"][2] = 65519.0  # rounds to 65504 in float16: fits
        state = fe.update(state, w, 1, decay=0.5, nonfinite=mode)
        oracle = torch.ones(4).half().lerp(w["b"].half(), 0.5)  # the weight cast to the EMA's dtype, then lerped
        assert int(state.step) == 1 and torch.equal(state.ema["b"], oracle) and state.ema["b"][2].item() == 32752.0
        before = {n: t.clone() for n, t in state.ema.items()}
        w["b"][2] = 2e5
        if mode == "raise":
            with pytest.raises(
                fe.NonFiniteError, match=r"shards\['b'\] holds values beyond what its EMA's torch.float16"
            ):
                fe.update(state, w, 2, decay=0.5, nonfinite=mode)
        else:
            assert fe.update(state, w, 2, decay=0.5, nonfinite=mode) is state
        assert int(state.step) == 1 and all(torch.equal(state.ema[n], before[n]) for n in w)
        w["b"][2] = float("nan")  # a NaN is still named as one
        if mode == "raise":
            with pytest.raises(fe.NonFiniteError, match=r"shards\['b'\] holds NaN or inf"):
                fe.update(state, w, 2, decay=0.5, nonfinite=mode)
        w["b"][2] = 1.0
    unguarded = fe.update(
        fe.init_ema({"a": torch.ones(2)}, dtype=torch.float16), {"a": torch.full((2,), 2e5)}, 1, decay=0.5
    )
    assert torch.isnan(unguarded.ema["a"]).all()  # what the guard prevents (documented)
    bf16 = fe.init_ema({"a": torch.ones(2)}, dtype=torch.bfloat16)
    assert int(fe.update(bf16, {"a": torch.full((2,), 1e38)}, 1, decay=0.5, nonfinite="raise").step) == 1


def test_nonfinite_guard_pairs_each_weight_with_its_own_emas_dtype():
    """Review: the guard took the first EMA leaf's dtype for every weight: with an fp16 EMA first, a finite weight
    of an fp32 EMA above 65504 was skipped; with it second, an fp16 EMA's overflow went through (NaN)."""
    weights = {"a": torch.ones(2), "b": torch.full((3,), 1e5)}
    first16 = fe.EmaState(torch.tensor(0), ({"a": torch.ones(2, dtype=torch.float16), "b": torch.ones(3)},))
    out = fe.update(first16, weights, 1, decay=0.5, nonfinite="raise")
    assert int(out.step) == 1 and torch.equal(out.ema["b"], torch.ones(3).lerp(weights["b"], 0.5))
    second16 = fe.EmaState(torch.tensor(0), ({"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float16)},))
    with pytest.raises(fe.NonFiniteError, match=r"shards\['b'\] holds values beyond what its EMA's torch.float16"):
        fe.update(second16, weights, 1, decay=0.5, nonfinite="raise")
    assert fe.update(second16, weights, 1, decay=0.5, nonfinite="skip") is second16 and int(second16.step) == 0
    assert torch.equal(second16.ema["b"], torch.ones(3, dtype=torch.float16))
    # Shards weights whose order is not the names' (z, a), with a dict EMA, or a Shards EMA of another layout
    z, a = torch.ones(3), torch.ones(2)
    z[1] = 2e5
    views = fe.Shards.from_views([("z", z), ("a", a)])
    for ema in (
        {"a": torch.ones(2), "z": torch.ones(3, dtype=torch.float16)},
        fe.Shards.from_views([("a", torch.ones(2)), ("z", torch.ones(3, dtype=torch.float16))]),
    ):
        with pytest.raises(fe.NonFiniteError, match=r"shards\['z'\] holds values beyond what its EMA's torch.float16"):
            fe.update(fe.EmaState(torch.tensor(0), (ema,)), views, 1, decay=0.5, nonfinite="raise")


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process (a file store), destroyed after the test: the
    group-wide nonfinite decision runs its all-reduce for real, without launching ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_nonfinite_decided_over_the_shards_group(one_rank_group):
    """Shards read from a training object carry its group; update(nonfinite=...) then decides over it
    (one all-reduce): skip leaves the state as it was, raise names the rank, a failed check raises its
    own error, a step that goes back is refused, the same step is a no-op, and a clean update lands."""
    _, shards = flat_views([5, 6])
    object.__setattr__(shards, "group", one_rank_group)  # what a reading of a DDP/ZeRO/FSDP2 model sets
    state = fe.init_ema(shards)
    before = copy.deepcopy(state)
    with torch.no_grad():
        shards["layer1.w"][3] = float("nan")
    assert fe.update(state, shards, 1, decay=0.5, nonfinite="skip") is state
    assert int(state.step) == 0 and torch.equal(state.ema["layer1.w"], before.ema["layer1.w"])
    with pytest.raises(fe.NonFiniteError) as e:
        fe.update(state, shards, 1, decay=0.5, nonfinite="raise")
    assert str(e.value) == (
        "shards['layer1.w'] holds NaN or inf; the EMA was left unchanged (nonfinite='raise') (on rank 0 of 1; "
        "every rank left its EMA unchanged)"
    )
    assert int(state.step) == 0 and torch.equal(state.ema["layer1.w"], before.ema["layer1.w"])
    shards["layer1.w"].copy_(torch.arange(6.0))
    with pytest.raises(ValueError, match=r"^decay must be in \[0, 1\], got 1\.5$"):
        fe.update(state, shards, 1, decay=1.5, nonfinite="skip")
    out = fe.update(state, shards, 2, decay=0.5, nonfinite="raise")  # clean: compounds the two steps
    assert out is state and int(state.step) == 2
    for n in shards:
        assert torch.equal(state.ema[n], before.ema[n].lerp(shards[n], 1 - 0.25)), n
    after = copy.deepcopy(state)
    assert fe.update(state, shards, 2, decay=0.5, nonfinite="skip") is state  # same step: nothing to do
    with pytest.raises(ValueError, match=r"^decay must be in \[0, 1\], got 1\.5$"):
        fe.update(state, shards, 2, decay=1.5, nonfinite="skip")  # nothing to do, but the arguments are checked
    assert all(torch.equal(state.ema[n], after.ema[n]) for n in shards)
    with pytest.raises(
        ValueError, match=r"^update\(step=1\) comes before the state's step 2; steps must not decrease$"
    ):
        fe.update(state, shards, 1, decay=0.5, nonfinite="skip")
    lone = fe.init_ema({"w": torch.ones(2)})  # a plain dict carries no group: decided alone
    assert int(fe.update(lone, {"w": torch.zeros(2)}, 1, decay=0.5, nonfinite="raise").step) == 1


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
    with pytest.raises(ValueError, match=r"state.emas\[0\]\['a'\] is on the meta device .*shards\['a'\] is on cpu"):
        fe.update(state, {"a": torch.ones(2)})
    # Another accelerator than the weights' (no second device here: stand-ins with the attributes read).
    from types import SimpleNamespace

    from functional_ema import _core

    ema = SimpleNamespace(is_meta=False, device=torch.device("cuda", 1))
    with pytest.raises(ValueError) as e:
        _core._check_device(ema, torch.ones(2), lambda: "a", 0)
    assert str(e.value) == (
        "shards['a'] is on cpu but its EMA (emas[0]) is on cuda:1; keep the EMA on the weights' device or on the "
        "CPU (init_ema(..., device='cpu', pin_memory=True))"
    )
    # Accepted: a CPU EMA of accelerator weights (the offloaded EMA), and an EMA on the weights' own device.
    weights = SimpleNamespace(device=torch.device("cuda", 0))
    for device in ("cpu", "cuda:0"):
        _core._check_device(SimpleNamespace(is_meta=False, device=torch.device(device)), weights, lambda: "a", 0)


# ------------------------------------------------------------------------------ copies and pickle


def test_pickling_refused_deepcopy_works():
    _, shards = flat_views([5, 6])
    state = fe.init_ema(shards, num_emas=2)
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(state)
    with pytest.raises(TypeError, match=r"functional_ema\.save"):
        torch.save(state, __import__("io").BytesIO())
    clone = copy.deepcopy(state)
    assert isinstance(clone.ema, fe.Shards) and clone.ema.index is state.ema.index
    perturb(shards, 1)
    fe.update(state, shards, decay=(0.9, 0.5))
    assert int(clone.step) == 0 and not torch.equal(clone.ema[next(iter(shards))], state.ema[next(iter(shards))])
    fe.update(clone, shards, decay=(0.9, 0.5))
    assert info(clone, shards).fused
    assert all(torch.equal(clone.emas[k][n], state.emas[k][n]) for k in range(2) for n in shards)
    # A model that was read keeps its reading in a slot that copies and pickles leave empty.
    model = torch.nn.Linear(3, 2)
    fe.local_shards(model)
    twin = copy.deepcopy(model)
    assert torch.equal(fe.local_shards(twin)["weight"], model.weight)
    assert fe.local_shards(twin)["weight"].data_ptr() == twin.weight.data_ptr()
    buf = __import__("io").BytesIO()
    torch.save(model, buf)
    assert b"functional_ema.engines" not in pickle.dumps(model)  # loading the pickle needs no functional_ema
    assert pickle.loads(pickle.dumps(model)).__dict__["_functional_ema_reading"] is None


def test_tree_map_over_shards_gives_plain_dicts():
    _, shards = flat_views([4, 5])
    state = fe.init_ema(shards)
    doubled = optree.tree_map(lambda t: t * 2, state.ema)
    assert type(doubled) is dict and list(doubled) == sorted(shards)
    assert [p for p, _ in zip(*optree.tree_flatten_with_path(shards)[:2])] == [("layer0.w",), ("layer1.w",)]
    mapped = optree.tree_map(lambda t: t, state)  # over the whole state: a state of plain dicts
    assert isinstance(mapped, fe.EmaState) and type(mapped.ema) is dict


# ------------------------------------------------------------------------- memory on real ZeRO ranks


def zero_layout_worker(stages, steps=3):
    """Real flat ZeRO buffers: one fused span per buffer, EMA memory = 4 bytes x local partition."""
    from torch import nn

    from functional_ema._testing.multirank import make_engine, train_step

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
        how = fe.update_info(state, shards)
        flat_buffers = {t.untyped_storage().data_ptr() for t in shards.values() if t.numel()}
        out.append(
            {
                "stage": stage,
                "equal": bool(equal),
                "local_numel": sum(t.numel() for t in shards.values()),
                "ema_nbytes": fe.ema_nbytes(state),
                "fused_spans": how.lerp_spans,
                "flat_buffers": len(flat_buffers),
                "constant_cost": bool(fe.local_shards(engine) is shards and how.fused and how.reused),
            }
        )
    return out


def test_real_zero_buffers_fused_and_memory():
    from functional_ema._testing.multirank import run_ranks

    reports = run_ranks("tests.test_core:zero_layout_worker", world_size=2, stages=[(3, "bf16"), (2, "fp32")])
    for rank, per_rank in enumerate(reports):
        for rep in per_rank:
            where = f"stage {rep['stage']} rank {rank}"
            assert rep["equal"], where
            assert rep["fused_spans"] == rep["flat_buffers"] == 1, (where, rep)
            assert rep["constant_cost"], (where, "local_shards + update should reuse the plan after one identity check")
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


def test_gpu_check_script_says_so_without_cuda():
    import subprocess
    import sys

    from functional_ema._testing.multirank import ROOT

    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if torch.cuda.is_available():
        assert out.returncode == 0, out.stdout + out.stderr
        assert " 0 failed" in out.stdout
    else:
        assert out.returncode == 0 and "CUDA is not available here" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------- trees, names and edges (make mutate)


def test_ema_nbytes_counts_every_tensor_of_every_ema():
    state = fe.init_ema({"a": torch.zeros(3), "skip": None, "b": torch.zeros(2, 2, dtype=torch.float64)}, num_emas=2)
    assert fe.ema_nbytes(state) == 2 * (3 + 4) * 4  # fp32 EMAs; None is no tensor
    _, shards = flat_views([5, 6], gap=3)
    assert fe.ema_nbytes(fe.init_ema(shards)) == 4 * sum(seg.numel() for seg in shards.segments)


def test_update_info_fused_only_for_shards_of_one_layout():
    _, shards = flat_views([5, 6], gap=3)
    state = fe.init_ema(shards)
    assert fe.update_info(state, shards) == (True, 1, 0, False)
    fe.update(state, shards, 1, decay=0.5)
    assert fe.update_info(state, shards).reused is True
    _, other = flat_views([5, 6], gap=0)  # the same names and shapes, another segment layout
    assert fe.update_info(fe.init_ema(shards), other) == (False, 2, 0, False)
    assert fe.update_info(fe.init_ema(dict(shards)), shards).fused is False


def test_meta_shard_named_by_its_own_segment():
    shards = fe.Shards.from_views({"a": torch.zeros(3), "b": torch.empty(4, device="meta")})
    state = fe.init_ema(fe.Shards.from_views({"a": torch.zeros(3), "b": torch.zeros(4)}))
    with pytest.raises(ValueError) as e:
        fe.update(state, shards, decay=0.5)
    assert str(e.value) == (
        "shards['b'] is on the meta device: it has a shape but no values to average. Pass the materialised "
        "weights (e.g. after model.to_empty(device=...) and loading or initialising them)"
    )


def test_per_tensor_refusals_name_both_sides():
    state = fe.init_ema({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(fe.TreeMismatchError) as e:
        fe.update(state, {"a": torch.ones(3), "c": torch.ones(2)}, decay=0.5)
    assert "state.emas[0]" in str(e.value) and "shards" in str(e.value) and "'c'" in str(e.value), str(e.value)
    with pytest.raises(fe.TreeMismatchError) as e:
        fe.update(state, {"a": torch.ones(3), "b": torch.ones(3)}, decay=0.5)
    assert str(e.value) == (
        "shards['b'] has shape (3,) but the EMA (emas[0]) has (2,); was the state made from another model, at "
        "another world size, or before the model was sharded (fully_shard applied after init_ema)? Make the state "
        "from the model as it trains (functional_ema.load reshards a saved one)"
    )
    with pytest.raises(TypeError, match=r"^shards\['a\.0'\] is a float, expected a torch\.Tensor$"):
        fe.update(state, {"a": [1.0, 2.0, 3.0], "b": torch.ones(2)}, decay=0.5)


def test_per_tensor_update_of_parameters_builds_no_graph_and_mixes_dtypes():
    """Leaves that require grad (parameters) are averaged without autograd; a tree of two dtypes (one
    converted to the fp32 EMA) is averaged like plain torch, for each EMA."""
    p = torch.nn.Parameter(torch.arange(3.0))
    q = torch.nn.Parameter(torch.arange(2.0, dtype=torch.float64))
    state = fe.init_ema({"p": torch.zeros(3), "q": torch.zeros(2)}, num_emas=2)
    fe.update(state, {"p": p, "q": q}, 1, decay=[0.5, 0.75])
    for k, w in enumerate((0.5, 0.25)):
        e = state.emas[k]
        assert not e["p"].requires_grad and e["p"].grad_fn is None and not e["q"].requires_grad
        assert torch.equal(e["p"], torch.zeros(3).lerp_(torch.arange(3.0), w))
        assert torch.equal(e["q"], torch.zeros(2).lerp_(q.detach().float(), w))
    one = fe.init_ema({"p": torch.zeros(3)})
    fe.update(one, {"p": p}, 1, decay=0.5)
    assert not one.ema["p"].requires_grad and torch.equal(one.ema["p"], torch.arange(3.0) * 0.5)


def test_per_tensor_ema_dtypes_paired_leaf_by_leaf():
    """A state whose EMA leaves hold the shards' two dtypes, but crosswise (the f64 EMA for the f32 weight and
    the other way round): the same set of (device, dtype) on both sides is no licence for one foreach
    call, each leaf is converted to its own EMA's dtype, as plain torch would."""
    a, b = torch.arange(4.0), torch.arange(3.0, dtype=torch.float64) / 7
    state = fe.EmaState(torch.tensor(0), ({"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(3)},))
    fe.update(state, {"a": a, "b": b}, 1, decay=0.25)
    assert state.ema["a"].dtype == torch.float64 and state.ema["b"].dtype == torch.float32
    assert torch.equal(state.ema["a"], torch.ones(4, dtype=torch.float64).lerp_(a.double(), 0.75))
    assert torch.equal(state.ema["b"], torch.ones(3).lerp_(b.float(), 0.75))


def test_nonfinite_on_plain_trees():
    """nonfinite= on a dict (None leaves and empty tensors included): a NaN is found and named, an
    all-empty tree is finite, and NaN only in the padding between fused tensors does not stop the update."""
    state = fe.init_ema({"a": torch.zeros(2), "none": None, "b": torch.zeros(3)})
    bad = {"a": torch.ones(2), "none": None, "b": torch.tensor([0.0, float("nan"), 1.0])}
    assert fe.update(state, bad, 1, decay=0.5, nonfinite="skip") is state and int(state.step) == 0
    with pytest.raises(
        fe.NonFiniteError, match=r"^shards\['b'\] holds NaN or inf; the EMA was left unchanged \(nonfinite='raise'\)$"
    ):
        fe.update(state, bad, 1, decay=0.5, nonfinite="raise")
    good = {"a": torch.ones(2), "none": None, "b": torch.ones(3)}
    assert int(fe.update(state, good, 1, decay=0.5, nonfinite="raise").step) == 1
    assert torch.equal(state.ema["b"], torch.full((3,), 0.5))
    empty = fe.init_ema({"e": torch.zeros(0)})
    assert int(fe.update(empty, {"e": torch.zeros(0)}, 1, decay=0.5, nonfinite="skip").step) == 1
    buf, shards = flat_views([5, 6], gap=3)
    buf[2 + 5] = float("nan")  # inside the gap
    for mode in ("skip", "raise"):
        state = fe.init_ema(shards)
        assert int(fe.update(state, shards, 1, decay=0.0, nonfinite=mode).step) == 1, mode
        assert all(torch.equal(state.ema[n], shards[n]) for n in shards)


def test_update_bounds_step_and_decay():
    """The last step the int64 counter holds is accepted, the next refused; decay 1.0 is a decay (the EMA
    stays); a decay above 1 in a list is refused like a lone one."""
    state = fe.init_ema({"w": torch.zeros(2)})
    fe.update(state, {"w": torch.ones(2)}, 2**63 - 1, decay=0.5)
    assert int(state.step) == 2**63 - 1 and torch.equal(state.ema["w"], torch.ones(2))  # 0.5**huge == 0
    with pytest.raises(ValueError, match=r"^update\(step=9223372036854775808\) does not fit"):
        fe.update(fe.init_ema({"w": torch.zeros(2)}), {"w": torch.ones(2)}, 2**63, decay=0.5)
    state = fe.init_ema({"w": torch.zeros(2)})
    fe.update(state, {"w": torch.ones(2)}, 3, decay=1.0)
    assert int(state.step) == 3 and torch.equal(state.ema["w"], torch.zeros(2))
    two = fe.init_ema({"w": torch.zeros(2)}, num_emas=2)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got 1\.5"):
        fe.update(two, {"w": torch.ones(2)}, 1, decay=[0.5, 1.5])
    assert int(two.step) == 0 and torch.equal(two.emas[1]["w"], torch.zeros(2))


def test_fused_plan_kept_and_used_for_an_equal_layout():
    """Shards of an equal layout (a new but equal index) update fused; the plan of the very same objects is
    reused, and not for another Shards or another number of EMAs."""
    _, shards = flat_views([5, 6], gap=3)
    state = fe.init_ema(shards)
    _, again = flat_views([5, 6], gap=3)  # another buffer, an equal index
    assert again.index is not shards.index and again.index == shards.index
    assert fe.update_info(state, again) == (True, 1, 0, False)
    fe.update(state, again, 1, decay=0.5)
    assert fe.update_info(state, again).reused is True and fe.update_info(state, shards).reused is False
    assert all(torch.equal(state.ema[n], shards[n].lerp(again[n], 0.5)) for n in shards)


def test_meta_segment_without_a_name_is_named_by_its_number():
    index = fe.SegmentIndex(["a"], [(3,)], [(0, 0, 3)], [(3,), (4,)])  # segment 1 holds no named tensor
    shards = fe.Shards([torch.zeros(3), torch.empty(4, device="meta")], index)
    state = fe.init_ema(fe.Shards([torch.zeros(3), torch.zeros(4)], index))
    with pytest.raises(ValueError, match=r"^shards\['<segment 1>'\] is on the meta device"):
        fe.update(state, shards, decay=0.5)


def test_refusals_name_the_ema_side_and_wait_update_argument():
    state = fe.EmaState(torch.tensor(0), ({"a": [1.0]},))  # a hand-made state holding no tensor
    with pytest.raises(TypeError, match=r"^state\.emas\[0\]\['a\.0'\] is a float, expected a torch\.Tensor$"):
        fe.update(state, {"a": torch.ones(1)}, decay=0.5)
    with pytest.raises(TypeError) as e:
        fe.wait_update({"a": torch.ones(1)})
    assert str(e.value) == "wait_update(): state must be an EmaState (from init_ema or load), got dict"


def test_nonfinite_with_a_group_but_no_process_group():
    """Shards that carry a group while torch.distributed is not initialized (destroyed): decided alone,
    a NaN skipped (the EMA untouched) or raised, a clean update landing."""
    _, shards = flat_views([5, 6])
    object.__setattr__(shards, "group", object())  # the group of a process group that is gone
    state = fe.init_ema(shards)
    before = copy.deepcopy(state)
    with torch.no_grad():
        shards["layer0.w"][0] = float("inf")
    assert fe.update(state, shards, 1, decay=0.5, nonfinite="skip") is state
    assert int(state.step) == 0 and all(torch.equal(state.ema[n], before.ema[n]) for n in shards)
    with pytest.raises(fe.NonFiniteError, match=r"^shards\['layer0\.w'\] holds NaN or inf"):
        fe.update(state, shards, 1, decay=0.5, nonfinite="raise")
    shards["layer0.w"].copy_(torch.zeros(5))
    assert int(fe.update(state, shards, 1, decay=0.5, nonfinite="skip").step) == 1
    assert torch.equal(state.ema["layer0.w"], before.ema["layer0.w"] * 0.5)


# --------------------------------------------------- the group-wide nonfinite decision on real ranks


@contextlib.contextmanager
def _poisoned(model: Any, ranks: dict[int, str]) -> Iterator[None]:
    """NaN in parameter ``ranks[rank]`` of ``model`` (a DDP module) on the ranks listed, put back after."""
    import torch.distributed as dist

    name = ranks.get(dist.get_rank())
    if name is None:
        yield
        return
    p = dict(model.module.named_parameters())[name]
    kept = p.detach().clone()
    with torch.no_grad():
        p.view(-1)[-1] = float("nan")
    try:
        yield
    finally:
        with torch.no_grad():
            p.copy_(kept)


def _did(state: fe.EmaState, shards: fe.Shards, call: Callable[[], fe.EmaState], weight: float) -> dict[str, Any]:
    """What ``call()`` (an update of ``state`` towards ``shards``) did on this rank: the error's class and
    message, or whether it returned ``state`` itself; the state's step after; and its EMA, bitwise
    "unchanged", "updated" (``ema.lerp(shard, weight)`` per tensor) or "other"."""
    before = {n: t.clone() for n, t in state.ema.items()}
    with torch.no_grad():
        moved = {n: before[n].lerp(shards[n], weight) for n in before}
    out: dict[str, Any] = {"raised": None, "message": None, "returned_state": None}
    try:
        out["returned_state"] = call() is state
    except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts it
        out["raised"], out["message"] = type(e).__name__, str(e)
    out["step"] = int(state.step)
    for verdict, values in (("unchanged", before), ("updated", moved)):
        if all(torch.equal(state.ema[n], values[n]) for n in before):
            out["ema"] = verdict
            break
    else:
        out["ema"] = "other"
    return out


def nonfinite_together_worker() -> dict[str, Any]:
    """4 ranks: ``update(nonfinite=...)`` of a DDP model over the whole job, then of two DDP models side by
    side, one per pair of ranks ({0, 1} and {2, 3}), each pair deciding alone; every rank calls every
    update. Returns each scenario's outcome on this rank (see :func:`_did`)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    whole = DDP(torch.nn.Linear(3, 2))
    pair = DDP(torch.nn.Linear(3, 2), process_group=pairs[rank // 2])
    shards, mine = fe.local_shards(whole), fe.local_shards(pair)
    out: dict[str, Any] = {
        "groups": [dist.get_process_group_ranks(s.group) for s in (shards, mine)],
    }

    def update(state: fe.EmaState, on: fe.Shards, step: int, mode: str, decay: float = 0.5) -> fe.EmaState:
        return fe.update(state, on, step, decay=decay, nonfinite=mode)  # type: ignore[arg-type]

    def fresh(on: fe.Shards, step: int = 0) -> fe.EmaState:
        """A state of ``on`` at ``step``, then the weights moved away from it (an update must show)."""
        made = fe.init_ema(on, step=step)
        with torch.no_grad():
            for t in on.values():
                t.add_(1.0)
        return made

    state = fresh(shards)
    with _poisoned(whole, {2: "weight"}):
        out["skip"] = _did(state, shards, lambda: update(state, shards, 1, "skip"), 0.5)
    out["skip_then_clean"] = _did(state, shards, lambda: update(state, shards, 2, "skip"), 0.75)
    state = fresh(shards, 5)
    with _poisoned(whole, {1: "weight", 3: "bias"}):
        out["raise"] = _did(state, shards, lambda: update(state, shards, 6, "raise"), 0.5)
    state = fresh(shards, (3, 3, 5, 3)[rank])
    out["steps_differ"] = _did(state, shards, lambda: update(state, shards, 6, "skip"), 0.5)
    state = fresh(shards)
    with _poisoned(whole, {0: "bias"}):
        decay = (0.5, 0.5, 1.5, 2.0)[rank]  # ranks 2 and 3 fail their own checks
        out["failed_elsewhere"] = _did(state, shards, lambda: update(state, shards, 1, "raise", decay), 0.5)
    # The pairs decide side by side, each over its own group: rank r of the job is rank r % 2 of its pair.
    state = fresh(mine, (4, 2, 7, 9)[rank])
    out["pair_steps_differ"] = _did(state, mine, lambda: update(state, mine, 10, "skip"), 0.5)
    state = fresh(mine, (0, 0, 10, 10)[rank])
    with _poisoned(pair, {3: "weight"}):
        step = int(state.step) + 1
        out["pair_raise"] = _did(state, mine, lambda: update(state, mine, step, "raise"), 0.5)
    state = fresh(mine, 3)
    decay = (0.5, 1.5, 0.5, 0.5)[rank]
    out["pair_failed"] = _did(state, mine, lambda: update(state, mine, 4, "skip", decay), 0.5)
    return out


def test_core_ranks_decide_nonfinite_together():
    """update(nonfinite=...) over a group decides on every rank alike: a NaN on some ranks skips or raises
    everywhere (naming the lowest rank that saw it; a rank that saw one names its own parameter), states
    at different steps or a check failing on another rank are refused everywhere, and two groups side
    by side decide each alone, numbering their ranks within the group."""
    from functional_ema._testing.multirank import run_ranks

    results = run_ranks(
        "tests.test_core:nonfinite_together_worker", world_size=4, timeout=120, env={"FE_DIST_INIT": "torch"}
    )

    def done(step: int, ema: str = "updated") -> dict[str, Any]:
        return {"raised": None, "message": None, "returned_state": True, "step": step, "ema": ema}

    def refused(cls: str, message: str, step: int) -> dict[str, Any]:
        return {"raised": cls, "message": message, "returned_state": None, "step": step, "ema": "unchanged"}

    unchanged = "every rank left its EMA unchanged"
    own = (
        "shards[{!r}] holds NaN or inf; the EMA was left unchanged (nonfinite='raise') (on rank {} of {}; "
        + unchanged
        + ")"
    )
    seen = "rank {} of {} saw NaN or inf in its shards; " + unchanged + " (nonfinite='raise')"
    differ = (
        "update(nonfinite='skip'): ranks disagree on step: {}. Every rank left its EMA unchanged; the ranks must "
        "update the same state alike (load every rank from one checkpoint)"
    )
    failed = "update(nonfinite={!r}): the update failed on rank {} of {} (see its error); " + unchanged
    world_steps = differ.format("rank 0: 3, rank 1: 3, rank 2: 5, rank 3: 3")
    pair_steps = [differ.format("rank 0: 4, rank 1: 2"), differ.format("rank 0: 7, rank 1: 9")]
    expected = [
        {
            "groups": [[0, 1, 2, 3], [0, 1] if rank < 2 else [2, 3]],
            "skip": done(0, "unchanged"),
            "skip_then_clean": done(2),
            "raise": refused(
                "NonFiniteError",
                {1: own.format("weight", 1, 4), 3: own.format("bias", 3, 4)}.get(rank, seen.format(1, 4)),
                5,
            ),
            "steps_differ": refused("StateMismatchError", world_steps, (3, 3, 5, 3)[rank]),
            "failed_elsewhere": refused(
                *{
                    2: ("ValueError", "decay must be in [0, 1], got 1.5"),
                    3: ("ValueError", "decay must be in [0, 1], got 2.0"),
                }.get(rank, ("StateMismatchError", failed.format("raise", 2, 4))),
                0,
            ),
            "pair_steps_differ": refused("StateMismatchError", pair_steps[rank // 2], (4, 2, 7, 9)[rank]),
            "pair_raise": (
                done(1)
                if rank < 2
                else refused("NonFiniteError", own.format("weight", 1, 2) if rank == 3 else seen.format(1, 2), 10)
            ),
            "pair_failed": (
                done(4)
                if rank >= 2
                else refused(
                    *(
                        ("ValueError", "decay must be in [0, 1], got 1.5")
                        if rank == 1
                        else ("StateMismatchError", failed.format("skip", 1, 2))
                    ),
                    3,
                )
            ),
        }
        for rank in range(4)
    ]
    for rank, (got, want) in enumerate(zip(results, expected)):
        assert got.keys() == want.keys(), rank
        for scenario in want:
            assert got[scenario] == want[scenario], (rank, scenario)


# ----------------------------------- ranks whose update(nonfinite=...) calls differ (adversarial probe W)

#: FUNCTIONAL_EMA_TIMEOUT of :func:`test_ranks_whose_nonfinite_calls_differ`, seconds.
DIFFER_S = 3.0


def _raised(call: Callable[[], Any]) -> dict[str, Any]:
    """The error ``call()`` raised (class and message, or None) and the seconds it took."""
    import time

    t0 = time.monotonic()
    try:
        call()
        got: dict[str, Any] = {"raised": None, "message": None}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts it
        got = {"raised": type(e).__name__, "message": str(e)}
    return {**got, "s": time.monotonic() - t0}


def nonfinite_differ_worker() -> dict[str, Any]:
    """2 ranks (plain tensors as the ``Shards`` of a training group): ``update(nonfinite=...)`` where both ranks
    agree (the decision as before), where rank 1 passes another ``nonfinite=``, where one of rank 1's arguments is
    bad (refused before the exchange), then on fresh groups (a timeout leaves its group unusable) where one rank
    alone asks for ``nonfinite=``: rank 0, while rank 1 updates without it and goes on to a collective of another
    size (as DeepSpeed's next all-reduce), and rank 1 while rank 0 updates without it. Returns each case's outcome."""
    import datetime

    import torch.distributed as dist

    rank = dist.get_rank()

    def shards_of(group: Any) -> fe.Shards:
        _, shards = flat_views([5, 6])
        object.__setattr__(shards, "group", group)  # what a reading of a DDP/ZeRO/FSDP2 model sets
        return shards

    shared = dist.new_group([0, 1])
    shards = shards_of(shared)
    out: dict[str, Any] = {}

    def case(name: str, call: Callable[[fe.EmaState], Any], nan: bool = False) -> None:
        state = fe.init_ema(shards, step=4)
        with torch.no_grad():
            for t in shards.values():
                t.add_(1.0)  # the weights move away from the EMA: an update shows
            if nan and rank == 1:
                shards["layer1.w"][2] = float("nan")
        dist.barrier()
        out[name] = _did(state, shards, lambda: call(state), 0.5)
        with torch.no_grad():
            shards["layer1.w"][2] = 0.0

    def both(mode: str) -> Callable[[fe.EmaState], Any]:
        return lambda s: fe.update(s, shards, 5, decay=0.5, nonfinite=mode)  # type: ignore[arg-type]

    case("skip", both("skip"), nan=True)
    case("raise", both("raise"), nan=True)
    case("clean", both("skip"))
    case("modes", lambda s: fe.update(s, shards, 5, decay=0.5, nonfinite=("skip", "raise")[rank]))  # type: ignore[arg-type]
    bad: dict[str, dict[str, Any]] = {
        "step=None": {"step": None},
        "step='5'": {"step": "5"},
        "blocking": {"blocking": "no"},
        "inplace": {"inplace": 2},
        "nonfinite='warn'": {"nonfinite": "warn"},
    }
    for name, kw in bad.items():
        args = {"step": 5, "decay": 0.5, "nonfinite": "skip", **(kw if rank == 1 else {})}
        case(f"bad {name}", lambda s, args=args: fe.update(s, shards, **args))
    case("rank 1 not a state", lambda s: fe.update(s if rank == 0 else {}, shards, 5, decay=0.5, nonfinite="skip"))
    case("clean after", both("raise"))
    alone = shards_of(dist.new_group([0, 1]))
    state = fe.init_ema(alone)
    dist.barrier()
    out["rank 0 alone"] = _raised(lambda: fe.update(state, alone, 1, decay=0.5, nonfinite=(None, "skip")[1 - rank]))
    out["rank 0 alone"]["step"] = int(state.step)
    if rank == 1:  # then the next collective of its training step, on the same group: it must not meet rank 0's
        work = dist.all_reduce(torch.zeros(3), group=alone.group, async_op=True)
        out["rank 1 trains on"] = _raised(lambda: work.wait(timeout=datetime.timedelta(seconds=DIFFER_S + 5)))
    dist.barrier()
    alone = shards_of(dist.new_group([0, 1]))
    state = fe.init_ema(alone)
    out["rank 1 alone"] = _raised(lambda: fe.update(state, alone, 1, decay=0.5, nonfinite=(None, "raise")[rank]))
    dist.barrier()
    return out


def test_ranks_whose_nonfinite_calls_differ():
    """Ranks whose update(nonfinite=...) calls differ fail on every rank, clearly and within FUNCTIONAL_EMA_TIMEOUT
    (before: gloo aborted a rank whose all-reduce met another collective, or a rank waited in it for good): another
    nonfinite= is refused on both ranks naming each rank's; a bad argument on one rank is raised there and named on
    the other; a rank that alone asks for nonfinite= raises CheckpointTimeoutError naming update and what the other
    rank did, while the other's next collective is not met; matching calls decide as before (skip, raise, update)."""
    from functional_ema._testing.multirank import run_ranks

    env = {"FE_DIST_INIT": "torch", "FUNCTIONAL_EMA_TIMEOUT": f"{DIFFER_S:g}"}
    results = run_ranks("tests.test_core:nonfinite_differ_worker", world_size=2, timeout=120, env=env)

    def done(ema: str, step: int) -> dict[str, Any]:
        return {"raised": None, "message": None, "returned_state": True, "step": step, "ema": ema}

    def refused(cls: str, message: str) -> dict[str, Any]:
        return {"raised": cls, "message": message, "returned_state": None, "step": 4, "ema": "unchanged"}

    failed = (
        "update(nonfinite='skip'): the update failed on rank 1 of 2 (see its error); every rank left its EMA unchanged"
    )
    own = {
        "bad step=None": (
            "ValueError",
            "update(step=None, nonfinite='skip'): nonfinite='skip' needs the training step",
        ),
        "bad step='5'": ("TypeError", "step must be an int, got str '5'"),
        "bad blocking": ("TypeError", "update(blocking=...) must be a bool, got str 'no'"),
        "bad inplace": ("TypeError", "inplace must be True or False, got int 2"),
        "bad nonfinite='warn'": ("ValueError", 'nonfinite must be None, "skip" or "raise", got \'warn\''),
        "rank 1 not a state": ("TypeError", "update(): state must be an EmaState (from init_ema or load), got dict"),
    }
    modes = (
        "update(nonfinite={!r}): the ranks called update with different nonfinite= (rank 0: nonfinite='skip', rank "
        "1: nonfinite='raise'); every rank left its EMA unchanged. The ranks decide together whether to skip or "
        "raise: pass the same nonfinite= on every rank"
    )
    for rank, got in enumerate(results):
        assert got["skip"] == done("unchanged", 4), rank
        nan = ("rank 1 of 2 saw NaN or inf in its shards", "shards['layer1.w'] holds NaN or inf")[rank]
        assert got["raise"]["raised"] == "NonFiniteError" and got["raise"]["message"].startswith(nan), (rank, got)
        assert got["raise"]["step"] == 4 and got["raise"]["ema"] == "unchanged", rank
        assert got["clean"] == got["clean after"] == done("updated", 5), rank
        assert got["modes"] == refused("StateMismatchError", modes.format(("skip", "raise")[rank])), rank
        for name, (cls, message) in own.items():
            if rank == 0:
                assert got[name] == refused("StateMismatchError", failed), name
            else:
                assert got[name]["raised"] == cls and message in got[name]["message"], (name, got[name])
                assert (got[name]["step"], got[name]["ema"]) == (4, "unchanged"), name
    first, second = results[0]["rank 0 alone"], results[1]["rank 1 alone"]
    for got, rank, mode in ((first, 0, "skip"), (second, 1, "raise")):
        assert got["raised"] == "CheckpointTimeoutError", got
        assert got["message"].startswith(f"functional_ema.update(nonfinite={mode!r}): rank {rank} waited "), got
        assert f"(limit {DIFFER_S:g} s)" in got["message"] and "FUNCTIONAL_EMA_TIMEOUT" in got["message"], got
        assert "A rank that called update without nonfinite= makes no exchange" in got["message"], got
        assert DIFFER_S - 0.5 <= got["s"] <= DIFFER_S + 3, got
    assert first["step"] == 0  # rank 0 left its EMA alone; rank 1 (no nonfinite=) updated without any exchange
    assert (results[1]["rank 0 alone"]["raised"], results[1]["rank 0 alone"]["step"]) == (None, 1), results[1]
    assert results[1]["rank 1 trains on"]["s"] <= DIFFER_S + 3, results[1]  # ended when rank 0 gave up, not hung
    assert results[0]["rank 1 alone"]["raised"] is None


# ------------------------------------------------- arguments checked where they enter (adversarial probe J)


def test_skip_with_step_none_is_refused_at_the_call():
    """nonfinite="skip" leaves state.step where it was: with step=None (state.step + 1) the skipped steps would be
    lost and the schedule evaluated at the wrong step, so the call is refused, naming the fix; with the real step
    the skipped steps compound (the same EMA as a plain-torch loop that holds the weights over the skip)."""
    state = fe.init_ema({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"nonfinite='skip' needs the training step.*Pass step="):
        fe.update(state, {"w": torch.ones(3)}, decay=0.5, nonfinite="skip")
    assert int(state.step) == 0 and torch.equal(state.ema["w"], torch.zeros(3))
    fe.update(state, {"w": torch.ones(3)}, decay=0.5, nonfinite="raise")  # raise: nothing is skipped silently
    assert int(state.step) == 1
    sched = schedules.power(gamma=2.0)
    ema, ref, w = fe.init_ema({"w": torch.zeros(3)}), torch.zeros(3), torch.zeros(3)
    for t in range(1, 11):
        w = w + 1
        bad = w.clone()
        if t in (3, 4):
            bad[0] = float("nan")
        fe.update(ema, {"w": bad}, t, decay=sched, nonfinite="skip")
        if t not in (3, 4):  # the reference: the skipped steps' decays compounded into the next update
            last = 2 if t == 5 else t - 1
            ref = ref.lerp(w, 1 - sched.interval(last, t))
    assert int(ema.step) == 10 and torch.equal(ema.ema["w"], ref)


@pytest.mark.parametrize("kind", ["list", "tuple", "nested", "dict", "shards"])
def test_copy_copy_keeps_any_tree(kind):
    """copy.copy(state): a new state over the same tensors, each EMA the tree it was (lists, tuples, nesting)."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    tree = {
        "list": [a, b],
        "tuple": (a, b),
        "nested": {"x": [a, {"y": b}], "z": None},
        "dict": {"b": b, "a": a},
        "shards": fe.Shards.from_views({"a": a, "b": b}),
    }[kind]
    state = fe.init_ema(tree, num_emas=2)
    dup = copy.copy(state)
    assert dup.step is state.step
    for e, d in zip(state.emas, dup.emas):
        assert type(d) is type(e) and optree.tree_structure(d) == optree.tree_structure(e)
        assert all(x is y for x, y in zip(optree.tree_leaves(e), optree.tree_leaves(d))) or kind == "shards"
    if kind == "shards":
        assert dup.emas[0] is state.emas[0]  # read-only: shared, as the fused plan needs
    ref = [t.clone().lerp_(t * 3, 0.5) for t in optree.tree_leaves(state.emas[0])]
    fe.update(dup, optree.tree_map(lambda t: t * 3, tree), 1, decay=(0.5, 0.5))
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(dup.emas[0]), ref))


def _same_step_cases(model: torch.nn.Module) -> list[tuple[Any, Any, type, str]]:
    good = fe.local_shards(model)
    return [
        (None, 0.9, fe.TreeMismatchError, "missing from shards"),
        ("junk", 0.9, TypeError, "shards"),
        ({"other": torch.zeros(7)}, 0.9, fe.TreeMismatchError, "'other'"),
        (good, 5.0, ValueError, r"decay must be in \[0, 1\], got 5\.0"),
        (good, "x", TypeError, "decay must be"),
        (good, (0.9, 0.9), ValueError, "got 2 decays for a state tracking 1 EMAs"),
    ]


@pytest.mark.parametrize("inplace", [True, False])
def test_same_step_update_checks_its_arguments(inplace):
    """update at step == state.step (gradient accumulation) averages nothing, but its arguments are checked as
    at any other step: shards of another tree and bad decays are refused there, not at the next real step."""
    model = torch.nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(model))
    before = {n: t.clone() for n, t in state.ema.items()}
    for shards, decay, error, match in _same_step_cases(model):
        with pytest.raises(error, match=match):
            fe.update(state, shards, 0, decay=decay, inplace=inplace)
    assert int(state.step) == 0 and all(torch.equal(state.ema[n], before[n]) for n in before)
    good = fe.local_shards(model)
    assert (fe.update(state, good, 0, decay=0.9, inplace=inplace) is state) is inplace
    with pytest.raises(ValueError, match=r"^decay\[1\] must be in \[0, 1\], got 5\.0$"):
        fe.update(fe.init_ema(good, num_emas=2), good, 0, decay=(0.9, 5.0))
    # a dict (the per-tensor path) is checked by name and leaf type at the same step too (its shapes at the
    # next real step); a nested tree at its top level (names, kinds), the rest at the next real step
    tree = fe.init_ema({"a": torch.zeros(2), "b": torch.zeros(1)})
    with pytest.raises(fe.TreeMismatchError, match=r"missing from shards: 'b'; not in state.emas\[0\]: 'c'"):
        fe.update(tree, {"a": torch.zeros(2), "c": torch.zeros(1)}, 0, decay=0.9)
    with pytest.raises(TypeError, match=r"shards\['b'\] is a ndarray, expected a torch\.Tensor"):
        fe.update(tree, {"a": torch.zeros(2), "b": np.zeros(1)}, 0, decay=0.9)
    nested = fe.init_ema({"x": [torch.zeros(2)]})
    with pytest.raises(fe.TreeMismatchError, match=r"missing from shards: 'x\.0'"):
        fe.update(nested, {"x": torch.zeros(2)}, 0, decay=0.9)
    assert fe.update(nested, {"x": [torch.zeros(3)]}, 0, decay=0.9) is nested
    with pytest.raises(fe.TreeMismatchError, match=r"shards\['x\.0'\] has shape \(3,\)"):
        fe.update(nested, {"x": [torch.zeros(3)]}, 1, decay=0.9)


def test_same_step_checks_over_a_group(one_rank_group):
    """The group path (nonfinite on) checks the same-step arguments too, on every rank alike."""
    _, shards = flat_views([5, 6])
    object.__setattr__(shards, "group", one_rank_group)
    state = fe.init_ema(shards)
    with pytest.raises(ValueError, match=r"^decay must be in \[0, 1\], got 1\.5$"):
        fe.update(state, shards, 0, decay=1.5, nonfinite="skip")
    assert fe.update(state, shards, 0, decay=0.5, nonfinite="skip") is state


def test_emas_of_different_dtypes_refused_before_anything_moves():
    """EMA k of another dtype (or device) than EMA 0 for one tensor: refused naming both, nothing written."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    made = fe.init_ema(fe.local_shards(model), num_emas=2)
    for second in (optree.tree_map(lambda x: x.double(), made.emas[1]), made.emas[1].mirror(torch.float64)):
        state = fe.EmaState(made.step, (made.emas[0], second))
        before = [{n: t.clone() for n, t in e.items()} for e in state.emas]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        with pytest.raises(
            ValueError, match=r"state\.emas\[1\]\['0\.(bias|weight)'\] has dtype torch\.float64 .*emas\[0\]"
        ):
            fe.update(state, fe.local_shards(model), 1, decay=(0.5, 0.5))
        assert int(state.step) == 0
        assert all(torch.equal(e[n], b[n]) for e, b in zip(state.emas, before) for n in b)
    # one EMA whose tensors differ in dtype among themselves is fine (each tensor planned alone)
    one = fe.EmaState(torch.tensor(0), ({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float64)},))
    fe.update(one, {"a": torch.ones(2), "b": torch.ones(2)}, 1, decay=0.5)
    assert one.ema["b"].dtype == torch.float64 and torch.equal(one.ema["b"], torch.full((2,), 0.5, dtype=torch.float64))


def test_shards_are_a_torch_pytree_node_like_optree():
    """torch.utils._pytree sees a state's Shards EMAs as nodes of their tensors (as optree does): tree_map maps
    over the tensors and rebuilds a dict, leaves are tensors in sorted name order."""
    import torch.utils._pytree as tp

    model = torch.nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(model))
    leaves = tp.tree_leaves(state)
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    assert [t.shape for t in leaves] == [t.shape for t in optree.tree_leaves(state)]
    mapped = tp.tree_map(lambda t: t.to(torch.float64), state)
    assert type(mapped) is fe.EmaState and type(mapped.emas[0]) is dict
    assert mapped.emas[0].keys() == {"weight", "bias"}
    assert torch.equal(mapped.emas[0]["weight"], model.weight.detach().double())
    paths = [tp.keystr(p) for p, _ in tp.tree_flatten_with_path(state)[0]]
    assert paths[1:] == [".emas[0]['bias']", ".emas[0]['weight']"]


def test_complex_and_sparse_shards_refused_naming_exclude():
    with pytest.raises(TypeError, match=r"shards\['c'\] has dtype torch\.complex64.*exclude=\['c'\]"):
        fe.init_ema({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match=r"shards\['s'\] is a sparse tensor \(torch\.sparse_coo\).*exclude=\['s'\]"):
        fe.init_ema({"w": torch.zeros(2), "s": torch.eye(2).to_sparse()})


def test_init_ema_on_a_device_this_machine_lacks_is_refused_naming_device():
    with pytest.raises(ValueError, match=r"device='cuda:99'.*(not available|no cuda device is available)"):
        fe.init_ema({"w": torch.zeros(3)}, device="cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda'.*no cuda device is available"):
            fe.init_ema({"w": torch.zeros(3)}, device="cuda")


@pytest.mark.parametrize("decay", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor([0.5])])
def test_real_number_decays_accepted_like_the_schedules(decay):
    """A numpy scalar or a one-element tensor decay is the real number it holds (as schedules.constant and a
    callable's values take it): the same EMA as a plain float, bitwise."""
    w = {"w": torch.arange(3.0)}
    ref = fe.update(fe.init_ema({"w": torch.zeros(3)}), w, 3, decay=0.5)
    got = fe.update(fe.init_ema({"w": torch.zeros(3)}), w, 3, decay=decay)
    assert torch.equal(got.ema["w"], ref.ema["w"])
    two = fe.update(fe.init_ema({"w": torch.zeros(3)}, num_emas=2), w, 3, decay=(decay, 0.5))
    assert torch.equal(two.emas[0]["w"], ref.ema["w"])
    with pytest.raises(ValueError, match=r"^decay\[1\] must be in \[0, 1\], got 2\.0$"):
        fe.update(fe.init_ema({"w": torch.zeros(3)}, num_emas=2), w, 3, decay=(decay, np.float32(2.0)))
    with pytest.raises(TypeError, match=r"^decay\[0\] must be"):
        fe.update(fe.init_ema({"w": torch.zeros(3)}, num_emas=2), w, 3, decay=("x", decay))
