"""FSDP2 over tensor parallelism (``parallelize_module`` then ``fully_shard``) on real gloo ranks (CPU).

Layouts: tensor parallelism alone (2 ranks, no ``fully_shard``), data parallel 2 x tensor parallel 2 (4 ranks; FSDP2 places colwise weights
``(_StridedShard(0, sf=2), Shard(0))``, rowwise ``(Shard(0), Shard(1))``, their biases and the layers
outside tensor parallelism ``(Shard(0), Replicate())``), and HSDP over it, replicate 2 x shard 2 x
tensor parallel 2 (8 ranks). Each rank's EMA is its piece of its tensor-parallel slice: the layout's
part is the tensor-parallel rank, ``tp_dims`` records each parameter's split, and the files are those
of DeepSpeed's tensor parallelism (checkpoint format 4).

The independent reference: a plain-torch EMA of ``p.full_tensor()`` (``ref.lerp_(full, 1 - decay)``
each step), and a plain ``nn.Module`` loaded with it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import functional_ema as fe
from functional_ema._testing.multirank import TP_D as D
from functional_ema._testing.multirank import (
    CollectiveSpy,
    TPNet,
    attempt,
    entered,
    run_ranks,
    tp_batch,
    tp_mesh,
    tp_model,
)

DECAY = 0.75
STEPS = 3
POWERS = (fe.schedules.power(gamma=3.0), fe.schedules.power(gamma=6.0))  # post-hoc EMA: power EMAs, snapshots


TP_PLAN_SPLITS = {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # the rest is replicated over tensor parallelism


# ------------------------------------------------------------------------------------ rank helpers


def _full_params(model) -> dict[str, torch.Tensor]:
    from functional_ema._testing.multirank import full_tensor_of

    return {n: full_tensor_of(p) for n, p in model.named_parameters()}


def _slice(full: torch.Tensor, name: str, tp: int, tp_size: int) -> torch.Tensor:
    d = TP_PLAN_SPLITS.get(name)
    return full if d is None else full.chunk(tp_size, dim=d)[tp]


# ------------------------------------------------------------------------------------------ workers


def train_worker(ckpt_dir: str, shape: list[int], also_load: str | None = None) -> dict:
    """Layout, update (no collectives), gathered slices vs reference, swapped, refusals, save and reload."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    import functional_ema as fe

    rank = dist.get_rank()
    mesh = tp_mesh(tuple(shape))
    model, opt = tp_model(0, mesh)
    layout = fe.shard_layout(model)
    r = {
        "layout": [
            layout.rank,
            layout.world_size,
            layout.replica,
            layout.replicas,
            layout.part.tp,
            layout.part.tp_size,
        ],
        "tp_dims": layout.tp_dims,
        "placements": {n: str(tuple(getattr(p, "placements", ()))) for n, p in model.named_parameters()},
        "specs": {n: [list(s.shape), s.offset, s.numel] for n, s in layout.specs.items()},
    }
    shards = fe.local_shards(model)
    params = dict(model.named_parameters())
    r["no_copy"] = all(
        shards[n].data_ptr() == getattr(params[n], "_local_tensor", params[n]).data_ptr()
        for n in shards
        if shards[n].numel()
    )
    state = fe.init_ema(shards)
    powers = fe.init_ema(shards, num_emas=len(POWERS))
    snaps = os.path.join(ckpt_dir, "snaps")
    ref = _full_params(model)
    r["update_collectives"] = []
    for step in range(1, STEPS + 1):
        model(tp_batch(step, mesh)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with CollectiveSpy() as spy:
            state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        r["update_collectives"].append(spy.total)
        for n, full in _full_params(model).items():
            ref[n].lerp_(full, 1 - DECAY)
        powers = fe.update(powers, fe.local_shards(model), step, decay=list(POWERS))
        if step >= 2:
            fe.posthoc.save_snapshot(powers, model, snaps, list(POWERS))
    # this rank's post-hoc pieces, from the files, never communicating; against the offline synthesis
    pieces = fe.posthoc.posthoc_local(snaps, layout, gamma=4.0, max_profile_error=None)
    offline = fe.posthoc.posthoc_offline(snaps, gamma=4.0, max_profile_error=None)
    r["posthoc_local_is_the_offline_slice"] = sorted(pieces) == sorted(offline) and all(
        torch.equal(
            pieces[n].reshape(-1),
            _slice(offline[n], n, layout.part.tp, layout.part.tp_size).reshape(-1)[s.offset : s.offset + s.numel],
        )
        for n, s in layout.specs.items()
    )
    # DTensor parameters report the global shape, and gather_full returns it: the slices joined
    gathered = fe.gather_full(state, model)
    r["gather_is_the_global_reference"] = sorted(gathered) == sorted(ref) and all(
        torch.equal(gathered[n], ref[n]) and tuple(gathered[n].shape) == tuple(params[n].shape) for n in ref
    )
    at_0 = fe.gather_full(state, model, dst=0)  # shard rank 0 of replica 0 of each tensor-parallel group
    r["gather_dst_is_global"] = (
        sorted(at_0) == sorted(ref) and all(torch.equal(at_0[n], ref[n]) for n in ref)
        if layout.rank == 0 and layout.replica == 0
        else at_0 == {}
    )
    r["ema_moved"] = not all(torch.equal(ref[n], f) for n, f in _full_params(model).items())
    joined = fe.gather_full(state, model, join_parts=True)  # every part's slices joined: the whole model
    on_0 = fe.gather_full(state, model, join_parts=True, dst=0)
    r["joined_bitwise"] = (
        sorted(joined) == sorted(ref)
        and all(torch.equal(joined[n], ref[n]) for n in ref)
        and (
            sorted(on_0) == sorted(ref) and all(torch.equal(on_0[n], ref[n]) for n in ref) if rank == 0 else on_0 == {}
        )
    )

    # swapped: the forward equals a plain module loaded with the full EMA (the tensor-parallel sums are
    # reduced in another order, so to rounding), the live weights come back bitwise, training is refused
    plain = TPNet()
    plain.load_state_dict(ref)
    x = torch.ones(2, D)
    before = {n: t.clone() for n, t in fe.local_shards(model).items()}
    with torch.no_grad():
        live = model(x)
        with fe.swapped(model, state):
            inside = model(x)
        r["swap_max_diff"] = (inside - plain(x)).abs().max().item()
        r["swap_differs_from_live"] = not torch.equal(inside, live)
    r["swap_restored"] = all(torch.equal(before[n], t) for n, t in fe.local_shards(model).items())
    with fe.swapped(model, state):
        loss = model(x).pow(2).mean()
        try:
            loss.backward()
            r["training_refused"] = False
        except fe.SwappedTrainingError:
            r["training_refused"] = True
    r["grads_untouched"] = all(p.grad is None for p in model.parameters())

    fe.save(state, model, ckpt_dir, tag="tp")
    with fe.AsyncSaver() as saver:
        saver.save(state, model, ckpt_dir, tag="tp_async")
    if rank == 0:
        save_file({n: t.contiguous() for n, t in ref.items()}, os.path.join(ckpt_dir, "tp.ref.safetensors"))
        r["files"] = sorted(os.listdir(os.path.join(ckpt_dir, "tp")))
        r["async_files"] = sorted(os.listdir(os.path.join(ckpt_dir, "tp_async")))
    # the same layout, a fresh model (other weights: load reads only the layout)
    fresh, _ = tp_model(123, mesh)
    loaded = fe.gather_full(fe.load(fresh, ckpt_dir, tag="tp_async"), fresh)
    r["reload_bitwise"] = all(torch.equal(loaded[n], gathered[n]) for n in gathered)
    r["saved_step"] = int(state.step)
    if also_load is not None:  # another layout's tensor-parallel EMA, re-cut for this one
        other = load_file(os.path.join(also_load, "tp.ref.safetensors"))
        got = fe.gather_full(fe.load(fresh, also_load, tag="tp"), fresh)
        r["other_layout_bitwise"] = sorted(got) == sorted(other) and all(torch.equal(got[n], other[n]) for n in other)
    return r


def load_worker(tp_dir: str, fsdp2_dir: str) -> dict:
    """A fresh 4-rank job: the dp 2 x tp 2 EMA into FSDP2 over 4 ranks (no tensor parallelism) and into
    HSDP 2 x 2; an FSDP2 world-2 EMA into dp 2 x tp 2 (cut along the recorded splits)."""
    from safetensors.torch import load_file

    import functional_ema as fe

    ref = load_file(os.path.join(tp_dir, "tp.ref.safetensors"))
    out = {}
    for kind, build in (
        ("into_fsdp2_4", lambda: tp_model(5, _mesh_1d(), tp=False)),
        ("into_hsdp", lambda: tp_model(5, _mesh_hsdp(), tp=False)),
    ):
        model, _ = build()
        state = fe.load(model, tp_dir, tag="tp")
        full = fe.gather_full(state, model)
        out[kind] = {
            "world": fe.shard_layout(model).world_size,
            "step": int(state.step),
            "bitwise": sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref),
        }
    # an FSDP2 checkpoint (saved over 4 ranks without tensor parallelism) cut along the recorded splits
    model, _ = tp_model(5, _mesh_1d(), tp=False)
    fe.save(fe.load(model, tp_dir, tag="tp"), model, fsdp2_dir, tag="tpnet_fsdp2_4")
    tp_net, _ = tp_model(9, tp_mesh((2, 2)))
    cut = fe.gather_full(fe.load(tp_net, fsdp2_dir, tag="tpnet_fsdp2_4"), tp_net)
    out["fsdp2_4_into_tp"] = sorted(cut) == sorted(ref) and all(torch.equal(cut[n], ref[n]) for n in ref)
    return out


def _mesh_1d():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _mesh_hsdp():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2_tp")


#: FUNCTIONAL_EMA_TIMEOUT of the partial-call launch, seconds: the bound on each rank's wait for the others.
ALONE_S = 3.0


def parts_worker() -> dict:
    """dp 2 x tp 2: a state one update ahead on tensor-parallel rank 1 (each data-parallel group agrees within
    itself: gather_full joined two EMAs' slices, swapped mixed them), then gather_full called on ranks 0-2 only
    (rank 3 skips it: the others passed their data-parallel agreement and waited in the slices' join unbounded)."""
    import torch.distributed as dist

    import functional_ema as fe

    rank = dist.get_rank()
    mesh = tp_mesh((2, 2))
    model, opt = tp_model(0, mesh)
    state = fe.init_ema(fe.local_shards(model))
    model(tp_batch(1, mesh)).pow(2).mean().backward()
    opt.step()
    state = fe.update(state, fe.local_shards(model), 1, decay=DECAY)
    ahead = fe.EmaState(state.step + fe.shard_layout(model).part.tp, state.emas)
    r = {
        "ahead": [
            attempt(lambda: fe.gather_full(ahead, model)),
            attempt(lambda: fe.gather_full(ahead, model, join_parts=True)),
            attempt(lambda: entered(fe.swapped(model, ahead))),
        ]
    }
    dist.barrier()
    if rank == 3:
        time.sleep(ALONE_S + 1)
        r["partial"] = None
    else:
        r["partial"] = attempt(lambda: fe.gather_full(state, model))
    return r


def test_parts_at_other_steps_or_a_part_absent_fail_on_every_rank():
    """Ranks of the same job holding other parts (tensor-parallel slices) agree on the state's step before any
    slice is joined or swapped in, and arrive within FUNCTIONAL_EMA_TIMEOUT: a part one update ahead is refused on
    every rank naming each rank's step; a verb skipped by one rank fails on the others within the bound, naming the
    verb, instead of waiting in the slices' join."""
    res = run_ranks(
        "tests.test_fsdp2_tensor_parallel:parts_worker",
        world_size=4,
        timeout=300,
        env={"FUNCTIONAL_EMA_TIMEOUT": f"{ALONE_S:g}"},
    )
    tp_of = [0, 1, 0, 1]  # mesh (dp, tp): rank = 2 * dp + tp
    steps = ", ".join(f"rank {k}: {1 + tp_of[k]}" for k in range(4))
    for rank, r in enumerate(res):
        for got, verb in zip(r["ahead"], ("gather_full", "gather_full", "swapped")):
            assert got["error"] == "StateMismatchError", (rank, got)
            assert got["msg"].startswith(f"{verb}: ranks disagree on step: {steps}"), (rank, got)
        if rank == 3:
            continue
        got = r["partial"]
        assert got["error"] == "CheckpointTimeoutError", (rank, got)
        assert got["msg"].startswith(f"functional_ema.gather_full: rank {rank} waited "), (rank, got)
        assert got["s"] <= ALONE_S + 3, (rank, got)


@pytest.fixture(scope="module")
def dp_tp(root):
    d = root / "dp2_tp2"
    d.mkdir()
    return run_ranks(
        "tests.test_fsdp2_tensor_parallel:train_worker", world_size=4, timeout=400, ckpt_dir=str(d), shape=[2, 2]
    )


@pytest.fixture(scope="module")
def hsdp_tp(root):
    d = root / "r2_s2_tp2"
    d.mkdir()
    return run_ranks(
        "tests.test_fsdp2_tensor_parallel:train_worker", world_size=8, timeout=500, ckpt_dir=str(d), shape=[2, 2, 2]
    )


@pytest.fixture(scope="module")
def tp_only(dp_tp, root):
    """Tensor parallelism alone (2 ranks, no fully_shard); it also loads the dp 2 x tp 2 EMA."""
    d = root / "tp2"
    d.mkdir()
    return run_ranks(
        "tests.test_fsdp2_tensor_parallel:train_worker",
        world_size=2,
        timeout=400,
        ckpt_dir=str(d),
        shape=[2],
        also_load=str(root / "dp2_tp2"),
    )


@pytest.fixture(scope="module")
def reloaded(dp_tp, root):
    d = root / "fsdp2"
    d.mkdir()
    return run_ranks(
        "tests.test_fsdp2_tensor_parallel:load_worker",
        world_size=4,
        timeout=400,
        tp_dir=str(root / "dp2_tp2"),
        fsdp2_dir=str(d),
    )


# ------------------------------------------------------------------------------------------- tests


def _check_training(results, replicas: int) -> None:
    for rank, r in enumerate(results):
        where = (rank, r)
        shard, tp = (rank // 2) % 2, rank % 2  # row-major meshes: (replicate,) shard, tp
        assert r["layout"] == [shard, 2, rank // 4 if replicas > 1 else 0, replicas, tp, 2], where
        assert r["tp_dims"] == {
            "up.weight": 0,
            "up.bias": 0,
            "down.weight": 1,
            "down.bias": None,
            "norm.weight": None,
            "norm.bias": None,
            "head.weight": None,
            "head.bias": None,
        }, where
        assert r["no_copy"] and r["update_collectives"] == [0] * STEPS, where
        assert r["gather_is_the_global_reference"] and r["gather_dst_is_global"], where
        assert r["ema_moved"] and r["joined_bitwise"], where
        assert r["swap_max_diff"] < 1e-5 and r["swap_differs_from_live"] and r["swap_restored"], where
        assert r["training_refused"] and r["grads_untouched"], where
        assert r["reload_bitwise"] and r["saved_step"] == STEPS and r["posthoc_local_is_the_offline_slice"], where
    # the placements this covers (FSDP2's own, over tensor parallelism)
    placements = results[0]["placements"]
    lead = "Replicate(), " if replicas > 1 else ""
    assert placements["up.weight"] == f"({lead}_StridedShard(dim=0, sf=2), Shard(dim=0))", placements
    assert placements["down.weight"] == f"({lead}Shard(dim=0), Shard(dim=1))", placements
    assert placements["down.bias"] == f"({lead}Shard(dim=0), Replicate())", placements
    # the up slice's 7 rows over the shard group: 4 + 3 (the pieces tile each slice)
    assert [r["specs"]["up.weight"] for r in results[:4]] == [
        [[7, 6], 0, 24],
        [[7, 6], 0, 24],
        [[7, 6], 24, 18],
        [[7, 6], 24, 18],
    ]
    expected = [f"ema_tp{t:03d}of002_pp000of001_rank_{s:05d}_of_00002.safetensors" for t in (0, 1) for s in (0, 1)]
    assert results[0]["files"] == ["ema_manifest.json", *expected] == results[0]["async_files"]


def test_fsdp2_over_tensor_parallel_every_verb(dp_tp, root):
    from safetensors.torch import load_file

    import functional_ema as fe

    _check_training(dp_tp, replicas=1)
    ref = load_file(root / "dp2_tp2" / "tp.ref.safetensors")
    for tag in ("tp", "tp_async"):  # offline, the slices joined along the recorded splits
        full = fe.consolidate(root / "dp2_tp2", tag=tag)
        assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref), tag
    plain = TPNet()  # a plain module, no process group
    full = fe.gather_full(fe.load(plain, root / "dp2_tp2", tag="tp"), plain)
    assert all(torch.equal(full[n], ref[n]) for n in ref)


def test_hsdp_over_tensor_parallel_at_8_ranks(hsdp_tp, root):
    from safetensors.torch import load_file

    import functional_ema as fe

    _check_training(hsdp_tp, replicas=2)
    ref = load_file(root / "r2_s2_tp2" / "tp.ref.safetensors")
    full = fe.consolidate(root / "r2_s2_tp2", tag="tp")
    assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref)


def test_tensor_parallel_alone_every_verb(tp_only, root):
    from safetensors.torch import load_file

    import functional_ema as fe

    for rank, r in enumerate(tp_only):
        where = (rank, r)
        assert r["layout"] == [0, 1, 0, 1, rank, 2], where  # no data-parallel sharding: the whole local slice
        assert r["specs"]["up.weight"] == [[7, 6], 0, 42] and r["specs"]["head.weight"] == [[3, 6], 0, 18], where
        assert r["placements"]["up.weight"] == "(Shard(dim=0),)" and r["placements"]["down.weight"] == "(Shard(dim=1),)"
        assert r["no_copy"] and r["update_collectives"] == [0] * STEPS, where
        assert r["gather_is_the_global_reference"] and r["gather_dst_is_global"], where
        assert r["ema_moved"] and r["joined_bitwise"], where
        assert r["swap_max_diff"] < 1e-5 and r["swap_differs_from_live"] and r["swap_restored"], where
        assert r["training_refused"] and r["grads_untouched"], where
        assert r["reload_bitwise"] and r["other_layout_bitwise"] and r["posthoc_local_is_the_offline_slice"], where
    expected = [f"ema_tp{t:03d}of002_pp000of001_rank_00000_of_00001.safetensors" for t in (0, 1)]
    assert tp_only[0]["files"] == ["ema_manifest.json", *expected] == tp_only[0]["async_files"]
    ref = load_file(root / "tp2" / "tp.ref.safetensors")
    full = fe.consolidate(root / "tp2", tag="tp")
    assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref)


def test_tensor_parallel_ema_loads_across_layouts(reloaded):
    for rank, r in enumerate(reloaded):
        assert r["into_fsdp2_4"] == {"world": 4, "step": STEPS, "bitwise": True}, (rank, r)
        assert r["into_hsdp"] == {"world": 2, "step": STEPS, "bitwise": True}, (rank, r)
        assert r["fsdp2_4_into_tp"], (rank, r)


def test_forged_split_or_part_in_the_manifest_is_refused_naming_the_field(dp_tp, root, tmp_path):
    """A manifest edited to join ``up.weight`` along another dimension, or to swap two parts: refused
    before anything is joined, naming the field (the rank files' checksummed headers say otherwise)."""
    import json
    import shutil

    import functional_ema as fe
    from functional_ema.checkpoint import CheckpointError

    def forged(edit) -> str:
        d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root / "dp2_tp2" / "tp", d / "tp")
        mpath = d / "tp" / "ema_manifest.json"
        m = json.loads(mpath.read_text())
        edit(m)
        mpath.write_text(json.dumps(m))
        with pytest.raises(CheckpointError) as e:
            fe.consolidate(d, tag="tp")
        return str(e.value)

    def other_dim(m):
        for p in m["parts"]:
            p["tp_dims"]["up.weight"] = 1

    def swap_parts(m):
        a, b = m["parts"][0]["part"], m["parts"][1]["part"]
        a["tp"], b["tp"] = b["tp"], a["tp"]

    msg = forged(other_dim)
    assert "tp_dims" in msg, msg
    msg = forged(swap_parts)
    assert "parts[0]" in msg, msg
