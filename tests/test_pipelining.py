"""``torch.distributed.pipelining`` stages on real gloo ranks (CPU): ``fe.local_shards(stage)`` and every verb.

Two launches: 2 ranks, one plain stage module each; 4 ranks, 2 stages x FSDP2 data parallel 2. Stage
modules are cut as torchtitan cuts them (a copy of the whole model with the other stage's layers
replaced by ``nn.Identity``), so parameter names are the whole model's. Trained with ``ScheduleGPipe``.
The independent reference: a plain-torch EMA of each stage's full parameters (``full_tensor()`` under
FSDP2), and the whole model, unsharded, loaded with it.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

from functional_ema._testing.multirank import CollectiveSpy, entered, refusal, run_ranks

DECAY = 0.75
STEPS = 3
STAGE_LAYERS = ([0, 1], [2, 3, 4])
SELECTED = ("0.weight",)  # a parameter of stage 0's only: a pattern naming nothing on stage 1


def whole_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 3))


def _stage_module(index: int) -> nn.Sequential:
    """Stage ``index`` of :func:`whole_model`: the other stage's layers replaced by ``nn.Identity``."""
    mod = copy.deepcopy(whole_model())
    for i in range(len(mod)):
        if i not in STAGE_LAYERS[index]:
            mod[i] = nn.Identity()
    return mod


def full_tensor_of(p) -> torch.Tensor:
    from functional_ema._testing.multirank import full_tensor_of as full

    return full(p)


def stage_worker(ckpt_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import functional_ema as fe

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // 2
    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    index = mesh.get_local_rank(0)

    def build():
        mod = _stage_module(index)
        if dp > 1:
            fully_shard(mod, mesh=mesh["dp"])
        return mod, PipelineStage(mod, index, 2, torch.device("cpu"), group=mesh.get_group("pp"))

    mod, stage = build()
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda y, t: (y - t).pow(2).mean())
    opt = torch.optim.AdamW(mod.parameters(), lr=3e-2)
    layout = fe.shard_layout(stage)
    r = {"layout": [layout.part.pp, layout.part.pp_size, layout.rank, layout.world_size], "names": list(layout.specs)}
    state = fe.init_ema(fe.local_shards(stage))
    # A selection of stage 0's layer only: it describes the whole model, so stage 1 averages nothing (its reading
    # and its module's own reading, in swapped and copies into the model, accept the pattern naming no name of its)
    sel_state = fe.init_ema(fe.local_shards(stage, include=SELECTED))
    ref = {n: full_tensor_of(p) for n, p in mod.named_parameters()}
    r["update_collectives"] = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * step + mesh.get_local_rank(1))
        x, target = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        if index == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)
        with CollectiveSpy() as spy:
            state = fe.update(state, fe.local_shards(stage), step, decay=DECAY)
        r["update_collectives"].append(spy.total)
        sel_state = fe.update(sel_state, fe.local_shards(stage, include=SELECTED), step, decay=DECAY)
        for n, p in mod.named_parameters():
            ref[n].lerp_(full_tensor_of(p), 1 - DECAY)
    gathered = fe.gather_full(state, stage)
    r["gather_bitwise"] = sorted(gathered) == sorted(ref) and all(torch.equal(gathered[n], ref[n]) for n in ref)

    # swapped: the stage's forward equals the same layers of the unsharded model loaded with the EMA
    twin = _stage_module(index)
    twin.load_state_dict(ref, strict=False)
    x = torch.ones(2, 6 if index == 0 else 10)
    before = {n: t.clone() for n, t in fe.local_shards(stage).items()}
    with torch.no_grad():
        with fe.swapped(stage, state):
            inside = mod(x)
        r["swap_equals_twin"] = torch.equal(inside, twin(x))
        r["swap_differs_from_live"] = not torch.equal(inside, mod(x))
    r["swap_restored"] = all(torch.equal(before[n], t) for n, t in fe.local_shards(stage).items())
    with fe.swapped(stage, state):
        try:
            mod(x).pow(2).mean().backward()
            r["training_refused"] = False
        except fe.SwappedTrainingError:
            r["training_refused"] = True

    # swapped with the selection: the selected parameters hold the EMA inside, the others stay live; all restored
    live = {n: full_tensor_of(p) for n, p in mod.named_parameters()}
    with torch.no_grad(), fe.swapped(stage, sel_state):
        inside = {n: full_tensor_of(p) for n, p in mod.named_parameters()}
    after = {n: full_tensor_of(p) for n, p in mod.named_parameters()}
    r["sel_swap"] = {n: torch.equal(inside[n], ref[n] if n in SELECTED else live[n]) for n in live}
    r["sel_swap_restored"] = all(torch.equal(after[n], live[n]) for n in live)

    fe.save(state, stage, ckpt_dir, tag="pp")
    with fe.AsyncSaver() as saver:
        saver.save(state, stage, ckpt_dir, tag="pp_async")
    refs: list = [None] * world
    dist.all_gather_object(refs, ref)
    whole = {n: t for d in refs for n, t in d.items()}
    joined = fe.gather_full(state, stage, join_parts=True)  # the stages merged: the whole model
    r["joined_bitwise"] = sorted(joined) == sorted(whole) and all(torch.equal(joined[n], whole[n]) for n in whole)
    sel_joined = fe.gather_full(sel_state, stage, join_parts=True)
    r["sel_joined"] = sorted(sel_joined) == list(SELECTED) and all(
        torch.equal(sel_joined[n], whole[n]) for n in SELECTED
    )
    if rank == 0:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for d in refs for n, t in d.items()}, os.path.join(ckpt_dir, "pp.ref.safetensors"))
        r["files"] = sorted(os.listdir(os.path.join(ckpt_dir, "pp")))
        r["async_files"] = sorted(os.listdir(os.path.join(ckpt_dir, "pp_async")))
    _, fresh = build()  # a fresh stage (load reads only the layout)
    loaded = fe.gather_full(fe.load(fresh, ckpt_dir, tag="pp_async"), fresh)
    r["reload_bitwise"] = all(torch.equal(loaded[n], gathered[n]) for n in gathered)
    # A state one update ahead on stage 1: every rank refuses, naming the steps (plain stages have no data-parallel
    # group to agree in: gather_full(join_parts=True) joined two EMAs' stages, swapped mixed them)
    ahead = fe.EmaState(state.step + (index == 1), state.emas)
    r["ahead_refused"] = [
        refusal(lambda: fe.gather_full(ahead, stage, join_parts=True)),
        refusal(lambda: fe.gather_full(ahead, stage)),
        refusal(lambda: entered(fe.swapped(stage, ahead))),
    ]
    if dp > 1:  # plain stage modules on 4 ranks: two ranks would hold each stage whole, unsharded
        plain = PipelineStage(_stage_module(index), index, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        try:
            fe.local_shards(plain)
            r["unsharded_refused"] = None
        except NotImplementedError as e:
            r["unsharded_refused"] = str(e)
    return r


@pytest.fixture(scope="module", params=[2, 4], ids=["2_plain_stages", "2_stages_x_fsdp2_dp2"])
def run(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"pp_{request.param}")
    return (
        request.param,
        d,
        run_ranks("tests.test_pipelining:stage_worker", world_size=request.param, timeout=400, ckpt_dir=str(d)),
    )


def test_pipeline_stages_every_verb(run):
    from safetensors.torch import load_file

    import functional_ema as fe

    world, d, results = run
    dp = world // 2
    for rank, r in enumerate(results):
        index = rank // dp
        where = (world, rank, r)
        assert r["layout"] == [index, 2, rank % dp, dp], where
        assert r["names"] == [f"{i}.{k}" for i in STAGE_LAYERS[index] if i % 2 == 0 for k in ("weight", "bias")], where
        assert r["update_collectives"] == [0] * STEPS and r["gather_bitwise"], where
        assert r["swap_equals_twin"] and r["swap_differs_from_live"] and r["swap_restored"], where
        assert r["training_refused"] and r["reload_bitwise"] and r["joined_bitwise"], where
        assert r["sel_swap"] == dict.fromkeys(r["names"], True) and r["sel_swap_restored"], where
        assert r["sel_joined"], where
        steps = ", ".join(f"rank {k}: {STEPS + (k // dp == 1)}" for k in range(world))
        for got, verb in zip(r["ahead_refused"], ("gather_full", "gather_full", "swapped")):
            assert got and got.startswith(f"StateMismatchError: {verb}: ranks disagree on step: {steps}"), (got, where)
        if dp > 1:
            assert r["unsharded_refused"] and "pipeline stage" in r["unsharded_refused"], where
    files = [f"ema_tp000of001_pp{s:03d}of002_rank_{k:05d}_of_{dp:05d}.safetensors" for s in (0, 1) for k in range(dp)]
    assert results[0]["files"] == ["ema_manifest.json", *files] == results[0]["async_files"]
    # offline: the stages joined into the whole model; and loaded by the whole, unsharded model
    ref = load_file(d / "pp.ref.safetensors")
    for tag in ("pp", "pp_async"):
        full = fe.consolidate(d, tag=tag)
        assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref), tag
    model = whole_model()
    state = fe.load(model, d, tag="pp")
    got = fe.gather_full(state, model)
    assert all(torch.equal(got[n], ref[n]) for n in ref) and int(state.step) == STEPS
    model.load_state_dict(full)
    assert model(torch.ones(1, 6)).shape == (1, 3)
