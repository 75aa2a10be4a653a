"""torch FSDP2 (``fully_shard``) on real gloo ranks (CPU): local shards, update, swap, checkpoints.

Every figure is checked against an independent unsharded reference: a plain-torch EMA of
``p.full_tensor()`` (``ref.lerp_(full, 1 - decay)`` per tensor, each step), a plain ``nn.Module``
twin loaded with the gathered EMA, a second FSDP2 model trained identically without any EMA block,
and DeepSpeed ZeRO-3 for the cross-engine checkpoint. Launches are few and batched: each one
builds several models (fp32 and bf16 mixed precision, root wrapped or not).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from functional_ema._testing.multirank import (
    ROOT,
    CollectiveSpy,
    OddNet,
    change_inside_swapped,
    full_tensor_of,
    make_engine,
    run_ranks,
    train_step,
)

DECAY = 0.75  # large steps, so a wrong weight or a missed update shows in every element
STEPS = 3
VOCAB, D, HIDDEN = 11, 7, 13  # rows not divisible by 2 or 3: FSDP2 pads the last ranks' shards
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (tag, dtype, root wrapped): unwrapped root params are plain tensors, replicated on every rank
CONFIGS = [("fp32_root", "fp32", True), ("bf16_root", "bf16", True), ("fp32_blocks_only", "fp32", False)]
DS_TAG = "zero3_w2"
# HSDP at 4 ranks: 2 replicas of a 2-rank shard group (the 1-D configs above also run there)
HSDP_CONFIGS = [("hsdp_bf16_root", "bf16", True), ("hsdp_fp32_blocks_only", "fp32", False)]


class TiedNet(nn.Module):
    """Embedding tied to the output head, a block FSDP2 shards by itself, a frozen parameter, and
    a one-row parameter (empty pieces on all ranks but the first)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)  # (11, 7)
        self.block = nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D))  # (13, 7), (7, 13)
        self.norm = nn.LayerNorm(D)
        self.gate = nn.Parameter(torch.ones(1, D))  # one row: the other ranks' pieces are empty
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, named "emb.weight"

    def forward(self, tokens):
        x = self.emb(tokens)
        x = x + self.block(x)
        return self.head(self.norm(x) * self.gate + self.frozen.sum() * 0.01)


# ------------------------------------------------------------------------------------ rank helpers


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def tp_mesh(replicas: int = 1):
    """FSDP2's mesh over every rank: 1-D, or HSDP's 2-D ``(replicate, shard)`` with ``replicas`` rows."""
    from torch.distributed.device_mesh import init_device_mesh

    world = _world()[1]
    if replicas == 1:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def _fsdp_model(seed: int, dtype: str, wrap_root: bool, model: nn.Module | None = None, replicas: int = 1):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = model if model is not None else TiedNet()
    mesh = tp_mesh(replicas)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    if hasattr(model, "block"):
        fully_shard(model.block, mesh=mesh, mp_policy=mp)
    if wrap_root:
        fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2, weight_decay=0.01)
    return model, opt


def _tokens(step: int, rank: int, n: int = 6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, n), generator=g)


def _train_step(model, opt, step: int, between=None) -> float:
    """One step; ``between()`` (if given) runs after the forward, before its backward."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank, world = _world()
    tokens = _tokens(step, rank)
    loss = F.cross_entropy(model(tokens).float().reshape(-1, VOCAB), tokens.roll(1, 1).reshape(-1))
    if between is not None:
        between()
    loss.backward()
    for p in model.parameters():  # parameters FSDP2 does not manage: averaged like DDP would
        if p.grad is not None and not isinstance(p, DTensor):
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _full_trainable(model) -> dict[str, torch.Tensor]:
    """``p.full_tensor()`` of each trainable parameter (a collective): FSDP2's own unsharded view."""
    return {n: full_tensor_of(p) for n, p in model.named_parameters() if p.requires_grad}


def _local(p) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p.detach()


def _same_training_state(a, opt_a, b, opt_b) -> bool:
    """Local shards and AdamW state of two FSDP2 models bitwise equal."""
    for p, q in zip(a.parameters(), b.parameters()):
        if not torch.equal(_local(p), _local(q)):
            return False
    for p, q in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        if set(sa) != set(sb):
            return False
        for k in sa:
            if not torch.equal(_local(sa[k]), _local(sb[k])):
                return False
        if p.grad is not None:
            return False
    return True


def _twin(dtype: str, trained: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]) -> nn.Module:
    """An unsharded TiedNet with ``trained`` (EMA) and ``frozen`` (live) full weights, in the dtype
    FSDP2 computes in (``MixedPrecisionPolicy.param_dtype`` casts the gathered fp32 weights)."""
    twin = TiedNet()
    weights = dict(trained, **frozen)
    weights["head.weight"] = weights["emb.weight"]
    twin.load_state_dict(weights, strict=True)
    return twin.to(DTYPES[dtype]).eval()


# ------------------------------------------------------------------------------------------ workers


def train_worker(ckpt_dir: str, configs, with_deepspeed: bool = False, replicas: int = 1):
    """Per config: layout, update (no collectives), gathered EMA vs reference, swapped, refusals, save.
    ``replicas > 1``: HSDP, ``replicas`` copies of one shard group (and its buffers and async saves)."""
    out = {"configs": [_train_check(ckpt_dir, *cfg, replicas=replicas) for cfg in configs]}
    if with_deepspeed:
        out["deepspeed"] = _deepspeed_save(ckpt_dir)
    if replicas > 1:
        out["hsdp_buffers"] = _hsdp_buffers_and_async(ckpt_dir, replicas)
        out["mesh_order"] = _hsdp_dst_and_mesh_order(ckpt_dir)
    else:
        out["guards"] = _guards()
        out["owned"] = _owned_and_changed()
    return out


def _owned_and_changed():
    """A module whose parameters FSDP manages from outside it is refused, naming what to pass, and a
    fully_shard-ed submodule is read as a model of its own; 16-bit sharded parameters warn once; a swapped
    block that re-types, re-assigns or replaces parameters leaves the trained shards back bitwise."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe

    out = {}
    model, opt = _fsdp_model(0, "fp32", True)

    def type_error(fn):
        try:
            fn()
        except TypeError as e:
            return str(e)
        return None

    out["inner_refused"] = [
        type_error(lambda: fe.local_shards(model.norm)),
        type_error(lambda: fe.local_shards(model.block[0])),
    ]
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"))
    out["fsdp1_refused"] = [type_error(lambda: fe.local_shards(x)) for x in (fsdp1, fsdp1.module, fsdp1.module[0])]
    root = fe.local_shards(model)
    own = fe.local_shards(model.block)  # fully_shard was applied to it: its own parameters, names relative to it
    out["fully_shard_submodule_is_its_own_model"] = sorted(own) == sorted(
        n.removeprefix("block.") for n in root if n.startswith("block.")
    ) and all(own[n].data_ptr() == root["block." + n].data_ptr() for n in own if own[n].numel())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fe.local_shards(_fsdp_model(1, "bf16", True)[0])  # bf16 compute over fp32 shards: no warning
        quiet = len([w for w in caught if issubclass(w.category, fe.LowPrecisionWeightsWarning)])
        for seed in (2, 3):  # bf16 sharded parameters: warned once
            torch.manual_seed(seed)
            low = TiedNet().to(torch.bfloat16)
            fully_shard(low, mesh=tp_mesh())
            fe.local_shards(low)
    low_warnings = [w for w in caught if issubclass(w.category, fe.LowPrecisionWeightsWarning)]
    out["low_precision"] = [
        quiet,
        len(low_warnings),
        all("bfloat16" in str(w.message) and w.filename == __file__ for w in low_warnings),
    ]

    # swapped: the block re-types, re-assigns or replaces parameters, returning or raising
    state = fe.init_ema(fe.local_shards(model))
    _train_step(model, opt, 1)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5)
    x = _tokens(99, 0)
    with torch.no_grad():
        live = model(x).clone()

    def retype():
        model.to(torch.bfloat16)

    def assign():
        model.load_state_dict(model.state_dict(), assign=True)  # FSDP2 installs new sharded parameters

    def new_parameter():
        model.norm.weight = nn.Parameter(torch.zeros(D))

    for kind, change in (("retype", retype), ("assign", assign), ("new", new_parameter)):
        for raising in (False, True):
            model.reshard()
            objects = dict(model.named_parameters())
            before = {n: t.clone() for n, t in fe.local_shards(model).items()}
            caught_as = change_inside_swapped(model, state, lambda: model(x), change, raising)
            now = dict(model.named_parameters())
            shards = fe.local_shards(model)
            with torch.no_grad():
                forward = model(x)
            out[f"{kind}{'_raising' if raising else ''}"] = {
                "caught": caught_as,
                "same_objects": list(now) == list(objects) and all(now[n] is objects[n] for n in objects),
                "values": sorted(shards) == sorted(before)
                and all(shards[n].dtype == before[n].dtype and torch.equal(shards[n], before[n]) for n in before),
                "forward": torch.equal(forward, live),
            }
    return out


def _train_check(ckpt_dir, tag, dtype, wrap_root, replicas=1):
    import functional_ema as fe
    from functional_ema.engines import adapter_for
    from functional_ema.engines.fsdp2 import FSDP2Adapter

    rank, _world_size = _world()
    model, opt = _fsdp_model(0, dtype, wrap_root, replicas=replicas)
    control, opt_c = _fsdp_model(
        0, dtype, wrap_root, replicas=replicas
    )  # trained the same way, never sees an EMA block
    r = {"tag": tag, "rank": rank, "adapter": type(adapter_for(model)).__name__}
    assert isinstance(adapter_for(model), FSDP2Adapter)

    # -- layout: unpadded offsets, views of the DTensors' local tensors, frozen and tied handled
    shards = fe.local_shards(model)
    layout = fe.shard_layout(model)
    params = dict(model.named_parameters())
    full0 = _full_trainable(model)
    r["names"] = list(layout.specs)
    r["layout"] = {n: [list(s.shape), s.offset, s.numel] for n, s in layout.specs.items()}
    r["layout_meta"] = [layout.rank, layout.world_size, layout.stage, layout.engine]
    r["replica"] = [layout.replica, layout.replicas]
    r["pieces_match_full_tensor"] = all(
        torch.equal(full0[n].reshape(-1)[s.offset : s.offset + s.numel], shards[n].reshape(-1))
        for n, s in layout.specs.items()
    )
    r["no_copy"] = all(
        shards[n].data_ptr() == _local(params[n]).data_ptr() and shards[n].numel() == _local(params[n]).numel()
        for n in layout.specs
        if shards[n].numel()
    )
    r["numel_is_to_local"] = all(
        s.numel == (params[n].to_local().numel() if hasattr(params[n], "to_local") else params[n].numel())
        for n, s in layout.specs.items()
    )
    r["same_reading_object"] = fe.local_shards(model) is shards

    # -- training with an EMA; update must not communicate
    state = fe.init_ema(shards)
    ref = {n: t.clone() for n, t in full0.items()}
    r["update_collectives"] = []
    losses, losses_c = [], []
    for step in range(1, STEPS + 1):
        losses.append(_train_step(model, opt, step))
        losses_c.append(_train_step(control, opt_c, step))
        with CollectiveSpy() as spy:
            state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        r["update_collectives"].append([spy.api, spy.ops])
        for n, full in _full_trainable(model).items():
            ref[n].lerp_(full, 1 - DECAY)
    r["same_reading_after_training"] = fe.local_shards(model) is shards
    r["fused_state"] = state.emas[0].index is shards.index
    with CollectiveSpy() as positive:  # the spy sees a collective when there is one
        gathered = fe.gather_full(state, model)
    r["gather_collectives_seen"] = [len(positive.api), len(positive.ops)]
    with CollectiveSpy() as positive_dtensor:
        full_tensor_of(next(p for p in model.parameters() if hasattr(p, "full_tensor")))
    r["full_tensor_collectives_seen"] = [len(positive_dtensor.api), len(positive_dtensor.ops)]
    r["ema_bitwise"] = sorted(gathered) == sorted(ref) and all(torch.equal(gathered[n], ref[n]) for n in ref)
    r["ema_moved"] = not all(torch.equal(ref[n], full0[n]) for n in ref)
    r["ema_dtype"] = str(gathered["emb.weight"].dtype)

    # -- swapped: forward == unsharded twin with the EMA; restored bitwise, also after an error
    frozen = {n: full_tensor_of(p) for n, p in model.named_parameters() if not p.requires_grad}
    twin = _twin(dtype, gathered, frozen)
    x = _tokens(99, 0)  # the same input on every rank
    before = {n: t.clone() for n, t in fe.local_shards(model).items()}
    with torch.no_grad():
        live = model(x).clone()  # leaves the root's parameters unsharded (live weights)
        with fe.swapped(model, state) as stats:
            inside = model(x).clone()
            inside_again = model(x).clone()
        live_after = model(x).clone()
        raised = False
        try:
            with fe.swapped(model, state):
                model(x)
                raise KeyError("boom")
        except KeyError:
            raised = True
        live_after_raise = model(x).clone()
        want = twin(x)
    r["swap_out_dtype"] = [str(inside.dtype), str(want.dtype)]
    r["swap_equals_twin"] = torch.equal(inside, want)
    r["swap_max_diff"] = (inside.float() - want.float()).abs().max().item()
    r["swap_repeat_equal"] = torch.equal(inside, inside_again)
    r["swap_differs_from_live"] = not torch.equal(inside, live)
    r["swap_restored_output"] = torch.equal(live_after, live) and raised and torch.equal(live_after_raise, live)
    r["swap_restored_weights"] = all(torch.equal(before[n], t) for n, t in fe.local_shards(model).items())
    r["swap_stats"] = [
        stats.swapped_params,
        stats.extra_bytes,
        sum(t.numel() * t.element_size() for t in before.values() if t.numel()),
    ]
    r["swap_nonempty"] = sum(1 for t in before.values() if t.numel())

    # -- training after the block continues bitwise as if it never ran
    step = STEPS + 1
    losses.append(_train_step(model, opt, step))
    losses_c.append(_train_step(control, opt_c, step))
    r["train_after_swap_bitwise"] = _same_training_state(model, opt, control, opt_c) and losses == losses_c

    # -- training inside the block is refused, and changes nothing
    refused = []
    with fe.swapped(model, state):
        loss = model(x).float().pow(2).mean()
        try:
            loss.backward()
        except fe.SwappedTrainingError as e:
            refused.append(f"backward: {str(e)[:60]}")
        try:
            opt.step()
        except fe.SwappedTrainingError as e:
            refused.append(f"step: {str(e)[:60]}")
        try:  # the local shards hold the EMA here: an update would average it into itself
            fe.update(state, fe.local_shards(model), int(state.step) + 1, nonfinite="skip")
        except fe.SwappedTrainingError as e:
            refused.append(f"update: {str(e)[:60]}")
    r["refused"] = refused
    r["grads_untouched"] = all(p.grad is None for p in model.parameters())
    r["refusal_changed_nothing"] = _same_training_state(model, opt, control, opt_c)
    opt.zero_grad(set_to_none=True)
    step += 1
    losses.append(_train_step(model, opt, step))
    losses_c.append(_train_step(control, opt_c, step))
    r["train_after_refusal_bitwise"] = _same_training_state(model, opt, control, opt_c) and losses == losses_c

    # -- save (loaded in a fresh process group by load_worker); the reference beside it
    state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
    gathered = fe.gather_full(state, model)
    fe.save(state, model, ckpt_dir, tag=tag)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in gathered.items()}, os.path.join(ckpt_dir, f"{tag}.ref.safetensors"))
        r["saved_files"] = sorted(os.listdir(os.path.join(ckpt_dir, tag)))
    r["saved_step"] = int(state.step)
    return r


def _deepspeed_save(ckpt_dir):
    """A ZeRO-3 EMA of OddNet (``not_optimized`` frozen, so every trained parameter has an EMA)."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = OddNet()
    model.not_optimized.requires_grad_(False)
    engine = make_engine(3, "fp32", seed=0, model=model)
    state = fe.init_ema(fe.local_shards(engine))
    for _ in range(STEPS):
        train_step(engine, engine.global_steps)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=DECAY)
    gathered = fe.gather_full(state, engine)
    fe.save(state, engine, ckpt_dir, tag=DS_TAG)
    if _world()[0] == 0:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in gathered.items()}, os.path.join(ckpt_dir, f"{DS_TAG}.ref.safetensors"))
    return {"names": sorted(gathered), "layout_stage": fe.shard_layout(engine).stage}


def _guards():
    """Unsupported placements are refused naming the parameter; the reading is re-made when stale."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import functional_ema as fe

    _rank, world = _world()
    out = {}

    def error_of(fn):
        try:
            fn()
        except NotImplementedError as e:
            return str(e)
        return None

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2 * world, 5), nn.Linear(5, 3))  # weight (5, 2w): Shard(1) divides evenly
    fully_shard(
        m[0], mesh=init_device_mesh("cpu", (world,)), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    )
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    out["shard1"] = error_of(lambda: fe.local_shards(m))

    from torch.distributed.tensor import Replicate, distribute_tensor

    m2 = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    mesh1 = init_device_mesh("cpu", (world,))
    m2[1].weight = nn.Parameter(distribute_tensor(m2[1].weight.detach(), mesh1, [Replicate()]))  # tensor-parallel style
    fully_shard(m2[0], mesh=mesh1)
    out["unmanaged_dtensor"] = error_of(lambda: fe.local_shards(m2))

    # the reading is kept while current and re-made when FSDP2 replaces a parameter or one is unfrozen;
    # a parameter frozen after the first reading keeps its place, also in readings re-made later
    model, _opt = _fsdp_model(0, "fp32", True)
    first = fe.local_shards(model)
    model.norm.weight.requires_grad_(False)
    out["freeze_keeps_reading"] = fe.local_shards(model) is first and "norm.weight" in first and "frozen" not in first
    model.frozen.requires_grad_(True)  # frozen from the start: unfreezing it is seen
    again = fe.local_shards(model)
    out["unfreeze_rereads"] = again is not first and "frozen" in again and "norm.weight" in again
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)  # FSDP2 installs new sharded parameters
    replaced = fe.local_shards(model)
    p = dict(model.named_parameters())["emb.weight"]
    out["assign_rereads"] = (
        replaced is not again
        and replaced["emb.weight"].data_ptr() == p._local_tensor.data_ptr()
        and "norm.weight" in replaced
    )
    model.float()  # module._apply: swap_tensors gives every parameter a new local tensor object
    moved = fe.local_shards(model)
    live = dict(model.named_parameters())
    out["apply_rereads"] = moved is not replaced and all(
        t.data_ptr() == live[n]._local_tensor.data_ptr() for n, t in moved.items()
    )
    # a replaced reading takes its load_state_dict post-hooks with it; a current one adds none
    hooks = len(model.norm._load_state_dict_post_hooks)
    model.load_state_dict(model.state_dict())
    reloaded = fe.local_shards(model)
    out["load_rereads_without_piling_hooks"] = (
        reloaded is not moved
        and fe.local_shards(model) is reloaded
        and len(model.norm._load_state_dict_post_hooks) == hooks
    )
    return out


def _hsdp_buffers_and_async(ckpt_dir, replicas):
    """HSDP with BatchNorm buffers: a save and an async save write one shard group's files (replica 0's
    pieces and buffers); every replica loads them back; each rank's own buffers differ (its own data)."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe

    rank, world = _world()
    mesh = tp_mesh(replicas)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, bufs = fe.init_ema(fe.local_shards(model)), fe.buffers.init_buffers(model)
    for step in range(1, STEPS + 1):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        bufs = fe.buffers.update_buffers(bufs, model, step, decay=DECAY)
    full = fe.gather_full(state, model)
    every: list = [None] * world
    dist.all_gather_object(every, {n: t.clone() for n, t in bufs.emas[0].items()})
    fe.save(state, model, ckpt_dir, tag="hsdp_buffers", buffers=bufs)
    with fe.AsyncSaver() as saver:
        saver.save(state, model, ckpt_dir, tag="hsdp_async", buffers=bufs)
    layout = fe.shard_layout(model)
    source = int(mesh.mesh[0, layout.rank])  # the replica-0 rank that holds this rank's shard
    out = {
        "source": source,
        "own_buffers_differ": not all(torch.equal(every[rank][n], every[source][n]) for n in every[rank]),
    }
    for tag in ("hsdp_buffers", "hsdp_async"):
        loaded = fe.load(model, ckpt_dir, tag=tag)
        again = fe.gather_full(loaded, model)
        got = fe.buffers.load_buffers(model, ckpt_dir, tag=tag)
        out[tag] = {
            "step": int(loaded.step),
            "ema_bitwise": sorted(again) == sorted(full) and all(torch.equal(again[n], full[n]) for n in full),
            "buffers_of_replica_0": sorted(got.emas[0]) == sorted(every[source])
            and all(torch.equal(got.emas[0][n], every[source][n]) for n in every[source]),
            "files": sorted(os.listdir(os.path.join(ckpt_dir, tag))),
        }
    if rank == 0:
        save_file({**full, **every[0]}, os.path.join(ckpt_dir, "hsdp_buffers.ref.safetensors"))
    return out


def hsdp_load_worker(ckpt_dir: str, fsdp2_dir: str, tags, fsdp2_tags):
    """A fresh 4-rank job: HSDP checkpoints into HSDP 2x2 and into FSDP2 over 4 ranks; FSDP2 world-2
    and DeepSpeed ZeRO-3 checkpoints into HSDP 2x2."""
    from safetensors.torch import load_file

    import functional_ema as fe

    out = {"hsdp_into_hsdp": [], "hsdp_into_fsdp2_4": [], "fsdp2_2_into_hsdp": []}
    for tag, dtype, wrap_root in tags:
        model, _ = _fsdp_model(123, dtype, wrap_root, replicas=2)
        out["hsdp_into_hsdp"].append(_check_loaded(fe, load_file, model, ckpt_dir, tag))
        model, _ = _fsdp_model(123, dtype, wrap_root)
        out["hsdp_into_fsdp2_4"].append(_check_loaded(fe, load_file, model, ckpt_dir, tag))
    for tag, dtype, wrap_root in fsdp2_tags:
        model, _ = _fsdp_model(123, dtype, wrap_root, replicas=2)
        out["fsdp2_2_into_hsdp"].append(_check_loaded(fe, load_file, model, fsdp2_dir, tag))
    odd = OddNet()
    odd.not_optimized.requires_grad_(False)
    model, _ = _fsdp_model(7, "fp32", True, model=odd, replicas=2)
    out["zero3_into_hsdp"] = _check_loaded(fe, load_file, model, fsdp2_dir, DS_TAG)
    return out


def load_worker(ckpt_dir: str, tags, load_deepspeed: bool = False):
    """A fresh process group: load each saved EMA into a new FSDP2 model, gather, compare."""
    from safetensors.torch import load_file

    import functional_ema as fe

    out = []
    for tag, dtype, wrap_root in tags:
        model, _ = _fsdp_model(123, dtype, wrap_root)  # other weights: load reads only the layout
        out.append(_check_loaded(fe, load_file, model, ckpt_dir, tag))
    if load_deepspeed:
        odd = OddNet()
        odd.not_optimized.requires_grad_(False)
        model, _ = _fsdp_model(7, "fp32", True, model=odd)
        out.append(_check_loaded(fe, load_file, model, ckpt_dir, DS_TAG))
    return out


def _check_loaded(fe, load_file, model, ckpt_dir, tag):
    ref = load_file(os.path.join(ckpt_dir, f"{tag}.ref.safetensors"))
    state = fe.load(model, ckpt_dir, tag=tag)
    layout = fe.shard_layout(model)
    gathered = fe.gather_full(state, model)
    return {
        "tag": tag,
        "step": int(state.step),
        "gather_bitwise": sorted(gathered) == sorted(ref) and all(torch.equal(gathered[n], ref[n]) for n in ref),
        "pieces_bitwise": all(
            torch.equal(state.emas[0][n].reshape(-1), ref[n].reshape(-1)[s.offset : s.offset + s.numel])
            for n, s in layout.specs.items()
        ),
        "fused_layout": state.emas[0].index is fe.local_shards(model).index
        or state.emas[0].index == fe.local_shards(model).index,
        "world": layout.world_size,
    }


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckroot(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2_ckpt")


@pytest.fixture(scope="module")
def trained(ckroot):
    """{world: per-rank results} of the training launches (2 ranks also save a ZeRO-3 EMA)."""
    out = {}
    for world in (2, 3):
        d = ckroot / f"w{world}"
        d.mkdir()
        out[world] = run_ranks(
            "tests.test_fsdp2:train_worker",
            world_size=world,
            ckpt_dir=str(d),
            configs=CONFIGS,
            with_deepspeed=world == 2,
        )
    return out


@pytest.fixture(scope="module")
def reloaded(trained, ckroot):
    """Second launches: fresh process groups load what the first ones saved (3 ranks: also ZeRO-3's)."""
    import shutil

    shutil.copytree(ckroot / "w2" / DS_TAG, ckroot / "w3" / DS_TAG)
    shutil.copy(ckroot / "w2" / f"{DS_TAG}.ref.safetensors", ckroot / "w3")
    return {
        world: run_ranks(
            "tests.test_fsdp2:load_worker",
            world_size=world,
            ckpt_dir=str(ckroot / f"w{world}"),
            tags=CONFIGS,
            load_deepspeed=world == 3,
        )
        for world in (2, 3)
    }


@pytest.fixture(scope="module")
def hsdp(ckroot):
    """Per-rank results of one 4-rank HSDP launch (2 replicas x 2 shards)."""
    d = ckroot / "hsdp"
    d.mkdir()
    return run_ranks("tests.test_fsdp2:train_worker", world_size=4, ckpt_dir=str(d), configs=HSDP_CONFIGS, replicas=2)


@pytest.fixture(scope="module")
def hsdp_reloaded(hsdp, trained, ckroot):
    return run_ranks(
        "tests.test_fsdp2:hsdp_load_worker",
        world_size=4,
        ckpt_dir=str(ckroot / "hsdp"),
        fsdp2_dir=str(ckroot / "w2"),
        tags=HSDP_CONFIGS,
        fsdp2_tags=CONFIGS,
    )


def _reports(trained):
    for world, per_rank in trained.items():
        for rank, res in enumerate(per_rank):
            for rep in res["configs"]:
                yield world, rank, rep


# ------------------------------------------------------------------------------------------- tests


def test_local_shards_are_unpadded_views_of_the_local_tensors(trained):
    for world, rank, rep in _reports(trained):
        where = (world, rank, rep["tag"])
        assert rep["adapter"] == "FSDP2Adapter", where
        # named_parameters() order (the root's own first), frozen left out, the tied head once
        assert rep["names"] == [
            "gate",
            "emb.weight",
            "block.0.weight",
            "block.0.bias",
            "block.2.weight",
            "block.2.bias",
            "norm.weight",
            "norm.bias",
        ], where
        assert rep["layout_meta"] == [rank, world, 3, "fsdp2"], where
        assert rep["pieces_match_full_tensor"] and rep["no_copy"] and rep["numel_is_to_local"], where
        assert rep["same_reading_object"] and rep["same_reading_after_training"], where
    # across ranks the pieces tile each parameter exactly, the last ranks' short (or empty)
    for world, per_rank in trained.items():
        for k, (tag, _, wrap_root) in enumerate(CONFIGS):
            layouts = [res["configs"][k]["layout"] for res in per_rank]
            for name, (shape, _, _) in layouts[0].items():
                total = int(torch.tensor(shape).prod())
                pieces = sorted((lay[name][1], lay[name][2]) for lay in layouts if lay[name][2])
                replicated = not wrap_root and not name.startswith("block.")
                if replicated:  # outside every fully_shard-ed module: the whole tensor on every rank
                    assert pieces == [(0, total)] * world, (world, tag, name, pieces)
                    continue
                cursor = 0
                for off, n in pieces:
                    assert off == cursor, (world, tag, name, pieces)
                    cursor += n
                assert cursor == total, (world, tag, name, pieces)
                rows = shape[0]
                chunk = -(-rows // world)
                want = [min(chunk, max(0, rows - r * chunk)) * (total // rows) for r in range(world)]
                assert [lay[name][2] for lay in layouts] == want, (world, tag, name)
    # the padding case really occurs: 11 rows over 2 ranks -> 6, 5; 7 rows over 3 -> 3, 3, 1
    assert trained[2][1]["configs"][0]["layout"]["emb.weight"] == [[11, 7], 42, 35]
    assert trained[3][2]["configs"][0]["layout"]["block.2.weight"] == [[7, 13], 78, 13]
    assert [res["configs"][0]["layout"]["gate"] for res in trained[3]] == [
        [[1, 7], 0, 7],
        [[1, 7], 0, 0],
        [[1, 7], 0, 0],
    ]


def test_gathered_ema_is_bitwise_the_reference_ema_of_full_tensor(trained):
    for world, rank, rep in _reports(trained):
        assert rep["ema_bitwise"] and rep["ema_moved"], (world, rank, rep["tag"])
        assert rep["ema_dtype"] == "torch.float32"
        assert rep["fused_state"], (world, rank, rep["tag"])


def test_update_makes_no_collective_calls(trained):
    for world, rank, rep in _reports(trained):
        assert rep["update_collectives"] == [[[], []]] * STEPS, (world, rank, rep["tag"], rep["update_collectives"])
        # the spy is not blind: it sees gather_full's collectives and DTensor's full_tensor()
        api, ops = rep["gather_collectives_seen"]
        assert api > 0 and ops > 0, rep["gather_collectives_seen"]
        assert sum(rep["full_tensor_collectives_seen"]) > 0, rep["full_tensor_collectives_seen"]


def test_swapped_forward_equals_unsharded_twin_and_restores(trained):
    for world, rank, rep in _reports(trained):
        where = (world, rank, rep["tag"], rep["swap_max_diff"])
        want_dtype = "torch.bfloat16" if rep["tag"].startswith("bf16") else "torch.float32"
        assert rep["swap_out_dtype"] == [want_dtype, want_dtype], where
        assert rep["swap_equals_twin"] and rep["swap_repeat_equal"] and rep["swap_differs_from_live"], where
        assert rep["swap_restored_output"] and rep["swap_restored_weights"], where
        swapped, extra, local_bytes = rep["swap_stats"]
        assert swapped == rep["swap_nonempty"] and extra == local_bytes, where


def test_training_after_swapped_continues_bitwise(trained):
    for world, rank, rep in _reports(trained):
        assert rep["train_after_swap_bitwise"], (world, rank, rep["tag"])


def test_training_inside_swapped_is_refused_and_changes_nothing(trained):
    for world, rank, rep in _reports(trained):
        where = (world, rank, rep["tag"], rep["refused"])
        assert [r.split(":")[0] for r in rep["refused"]] == ["backward", "step", "update"], where
        assert rep["grads_untouched"] and rep["refusal_changed_nothing"], where
        assert rep["train_after_refusal_bitwise"], where


def test_unsupported_placements_are_refused_naming_the_parameter(trained):
    for _world, per_rank in trained.items():
        for res in per_rank:
            g = res["guards"]
            assert g["shard1"] and "'0.weight'" in g["shard1"] and "Shard(dim=1)" in g["shard1"], g["shard1"]
            got = g["unmanaged_dtensor"]
            assert got and "'1.weight'" in got and "Replicate()" in got and "FSDP2 does not manage" in got, got


def test_modules_fsdp_manages_from_outside_are_refused_and_16_bit_shards_warn_once(trained):
    for per_rank in trained.values():
        for res in per_rank:
            o = res["owned"]
            for msg in o["inner_refused"]:  # model.norm (root-managed), model.block[0] (managed by model.block)
                assert msg and "was applied to an enclosing module" in msg and "root" in msg, msg
            wrapper, inner, leaf = o["fsdp1_refused"]  # FSDP1, its wrapped module (FlatParameter), a submodule
            assert wrapper and "torch FSDP1 (FullyShardedDataParallel)" in wrapper and "fully_shard" in wrapper, wrapper
            assert inner and "parameter '_flat_param' is a torch FSDP1 FlatParameter" in inner, inner
            assert leaf and "was applied to an enclosing module" in leaf, leaf
            assert o["fully_shard_submodule_is_its_own_model"], o
            assert o["low_precision"] == [0, 1, True], o["low_precision"]


def test_swapped_block_that_changes_fsdp2_parameters_leaves_the_trained_shards(trained):
    expected = {
        "retype": "'block.0.weight' re-typed",
        "assign": "replaced by a new parameter object",
        "new": "'norm.weight' replaced",
    }
    for world, per_rank in trained.items():
        for res in per_rank:
            o = res["owned"]
            for kind, want in expected.items():
                for raising in (False, True):
                    got = o[f"{kind}{'_raising' if raising else ''}"]
                    where = (world, kind, raising, got)
                    how, message = got["caught"]
                    assert how == ("raised" if raising else "changed") and want in message, where
                    assert got["values"] and got["forward"], where
                    # FSDP2 keeps its parameter objects through .to() and a set attribute; assign=True makes new ones
                    assert got["same_objects"] == (kind != "assign"), where


def test_reading_is_remade_when_fsdp2_replaces_or_unfreezes_parameters(trained):
    for _world, per_rank in trained.items():
        for res in per_rank:
            g = res["guards"]
            assert g["freeze_keeps_reading"] and g["unfreeze_rereads"] and g["assign_rereads"], g
            assert g["apply_rereads"] and g["load_rereads_without_piling_hooks"], g


def test_save_then_load_in_a_fresh_process_group_is_bitwise(trained, reloaded):
    for world, per_rank in reloaded.items():
        for rank, reps in enumerate(per_rank):
            for k, (rep, (tag, _, _)) in enumerate(zip(reps, CONFIGS)):
                assert rep["tag"] == tag and rep["world"] == world
                assert rep["step"] == trained[world][rank]["configs"][k]["saved_step"] == STEPS + 2, rep
                assert rep["gather_bitwise"] and rep["pieces_bitwise"] and rep["fused_layout"], (world, rank, rep)


def test_offline_consolidate_equals_the_live_gather(trained, ckroot):
    from safetensors.torch import load_file

    import functional_ema as fe

    for world in trained:
        for tag, _, _ in CONFIGS:
            d = ckroot / f"w{world}"
            ref = load_file(d / f"{tag}.ref.safetensors")
            full = fe.consolidate(d, tag=tag)
            assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref), (world, tag)
            manifest = fe.checkpoint.read_manifest(d, tag=tag)
            assert manifest["world_size"] == world and manifest["zero_stage"] == 3


def test_zero3_checkpoint_loads_into_fsdp2_at_3_ranks_and_into_a_plain_module(trained, reloaded, ckroot):
    from safetensors.torch import load_file

    import functional_ema as fe

    ds = trained[2][0]["deepspeed"]
    assert ds["layout_stage"] == 3
    ref = load_file(ckroot / "w2" / f"{DS_TAG}.ref.safetensors")
    assert sorted(ref) == ds["names"] and "frozen" not in ref and "not_optimized" not in ref
    for rank, reps in enumerate(reloaded[3]):
        rep = reps[-1]
        assert rep["tag"] == DS_TAG and rep["world"] == 3
        assert rep["gather_bitwise"] and rep["pieces_bitwise"] and rep["step"] == STEPS, (rank, rep)
    # a plain module, world of one, no process group
    plain = OddNet()
    plain.not_optimized.requires_grad_(False)
    state = fe.load(plain, ckroot / "w2", tag=DS_TAG)
    full = fe.gather_full(state, plain)
    assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref)
    assert fe.shard_layout(plain).world_size == 1 and int(state.step) == STEPS
    # and offline, by the same consolidate
    offline = fe.consolidate(ckroot / "w2", tag=DS_TAG)
    assert all(torch.equal(offline[n], ref[n]) for n in ref)


# ------------------------------------------------------------------- HSDP: replicas x a shard group


def test_hsdp_layout_is_the_shard_groups_and_names_the_replica(hsdp):
    for rank, res in enumerate(hsdp):
        for rep in res["configs"]:
            where = (rank, rep["tag"])
            assert rep["adapter"] == "FSDP2Adapter", where
            assert rep["layout_meta"] == [rank % 2, 2, 3, "fsdp2"] and rep["replica"] == [rank // 2, 2], where
            assert rep["pieces_match_full_tensor"] and rep["no_copy"] and rep["numel_is_to_local"], where
    for k in range(len(HSDP_CONFIGS)):  # a replica holds replica 0's pieces; the shard ranks tile
        layouts = [res["configs"][k]["layout"] for res in hsdp]
        assert layouts[2] == layouts[0] and layouts[3] == layouts[1] and layouts[0] != layouts[1]


def test_hsdp_ema_is_bitwise_with_no_collectives_and_swapped_as_on_one_mesh(hsdp):
    for rank, res in enumerate(hsdp):
        for rep in res["configs"]:
            where = (rank, rep["tag"], rep["swap_max_diff"])
            assert rep["ema_bitwise"] and rep["ema_moved"] and rep["fused_state"], where
            assert rep["update_collectives"] == [[[], []]] * STEPS, where
            assert rep["swap_equals_twin"] and rep["swap_repeat_equal"] and rep["swap_differs_from_live"], where
            assert rep["swap_restored_output"] and rep["swap_restored_weights"], where
            assert rep["train_after_swap_bitwise"] and rep["train_after_refusal_bitwise"], where
            assert [r.split(":")[0] for r in rep["refused"]] == ["backward", "step", "update"], where


def test_hsdp_save_writes_one_shard_groups_files_and_loads_at_every_layout(hsdp, hsdp_reloaded, ckroot):
    from safetensors.torch import load_file

    import functional_ema as fe

    d = ckroot / "hsdp"
    for k, (tag, _, _) in enumerate(HSDP_CONFIGS):
        assert hsdp[0]["configs"][k]["saved_files"] == [
            "ema_manifest.json",
            "ema_rank_00000_of_00002.safetensors",
            "ema_rank_00001_of_00002.safetensors",
        ]
        manifest = fe.checkpoint.read_manifest(d, tag=tag)
        assert manifest["world_size"] == 2 and manifest["zero_stage"] == 3, manifest
        ref = load_file(d / f"{tag}.ref.safetensors")
        offline = fe.consolidate(d, tag=tag)
        assert sorted(offline) == sorted(ref) and all(torch.equal(offline[n], ref[n]) for n in ref), tag
        plain = TiedNet()  # a plain module, no process group
        full = fe.gather_full(fe.load(plain, d, tag=tag), plain)
        assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref), tag
    for rank, res in enumerate(hsdp_reloaded):
        for kind, world in (("hsdp_into_hsdp", 2), ("hsdp_into_fsdp2_4", 4), ("fsdp2_2_into_hsdp", 2)):
            assert len(res[kind]) == (len(CONFIGS) if kind == "fsdp2_2_into_hsdp" else len(HSDP_CONFIGS))
            for rep in res[kind]:
                assert rep["world"] == world and rep["step"] == STEPS + 2, (rank, kind, rep)
                assert rep["gather_bitwise"] and rep["pieces_bitwise"] and rep["fused_layout"], (rank, kind, rep)
        zero3 = res["zero3_into_hsdp"]
        assert zero3["world"] == 2 and zero3["step"] == STEPS, (rank, zero3)
        assert zero3["gather_bitwise"] and zero3["pieces_bitwise"], (rank, zero3)


def test_hsdp_buffers_and_async_saves_are_replica_0s_and_every_replica_reads_them(hsdp, ckroot):
    from safetensors.torch import load_file

    import functional_ema as fe

    for rank, res in enumerate(hsdp):
        b = res["hsdp_buffers"]
        assert b["source"] == rank % 2, b
        assert b["own_buffers_differ"] == (rank >= 2), b  # so reading replica 0's buffers is seen
        for tag in ("hsdp_buffers", "hsdp_async"):
            got = b[tag]
            assert got["step"] == STEPS and got["ema_bitwise"] and got["buffers_of_replica_0"], (rank, tag, got)
            assert got["files"] == [
                "buffers_rank_00000_of_00002.safetensors",
                "buffers_rank_00001_of_00002.safetensors",
                "ema_manifest.json",
                "ema_rank_00000_of_00002.safetensors",
                "ema_rank_00001_of_00002.safetensors",
            ], (rank, tag, got["files"])
    ref = load_file(ckroot / "hsdp" / "hsdp_buffers.ref.safetensors")  # full EMA + rank 0's buffer EMA
    offline = fe.buffers.consolidate(ckroot / "hsdp", "hsdp_buffers")
    assert all(torch.equal(offline[n], ref[n]) for n in ref) and "1.running_mean" in ref


def test_quickstart_fsdp2_example_runs(tmp_path):
    """examples/quickstart_fsdp2.py, as a user would run it (it spawns its own 2 gloo ranks)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart_fsdp2.py"), str(tmp_path)],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quickstart_fsdp2: ok" in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "global_step5" / "ema_manifest.json").is_file()
    assert (tmp_path / "ema_latest").read_text().strip() == "global_step5"


def flatten_worker(dtype: str) -> dict:
    """``flatten_local_shards``: one segment, one lerp, and training bitwise as an untouched twin."""
    import functional_ema as fe
    from functional_ema.engines.fsdp2 import flatten_local_shards

    a, opt_a = _fsdp_model(0, dtype, wrap_root=True)
    b, opt_b = _fsdp_model(0, dtype, wrap_root=True)
    before = fe.local_shards(a)
    _train_step(a, opt_a, 1)
    _train_step(b, opt_b, 1)  # optimizer state exists before the move
    moved = flatten_local_shards(b)
    shards = fe.local_shards(b)
    state = fe.init_ema(shards, step=1)
    ref = {n: t.clone() for n, t in _full_trainable(b).items()}
    losses = []
    for step in range(2, 6):
        losses.append([_train_step(a, opt_a, step), _train_step(b, opt_b, step)])
        state = fe.update(state, fe.local_shards(b), step, decay=DECAY)
        for n, t in _full_trainable(b).items():
            ref[n].lerp_(t, 1 - DECAY)
    full = fe.gather_full(state, b)
    info = fe.update_info(state, fe.local_shards(b))
    return {
        "moved": moved,
        "segments_before": len(before.segments),
        "segments_after": len([s for s in fe.local_shards(b).segments if s.numel()]),
        "lerp_spans": info.lerp_spans,
        "losses_equal": all(x == y for x, y in losses),
        "training_equal": _same_training_state(a, opt_a, b, opt_b),
        "ema_bitwise": all(torch.equal(full[n], ref[n]) for n in ref),
    }


def test_flatten_local_shards_gives_one_lerp_and_changes_no_number():
    for dtype in ("fp32", "bf16"):
        for rank, r in enumerate(run_ranks("tests.test_fsdp2:flatten_worker", world_size=2, timeout=300, dtype=dtype)):
            where = (dtype, rank, r)
            assert r["moved"] >= 5 and r["segments_before"] >= 5, where
            assert r["lerp_spans"] <= 2 and r["segments_after"] <= 2, (
                where
            )  # the flat buffer (+ a replicated root tensor)
            assert r["losses_equal"] and r["training_equal"] and r["ema_bitwise"], where


def forward_swap_backward_worker() -> dict:
    """Per config (root left unsharded: its parameters are plain tensors; root wrapped too): a training forward, an
    EMA evaluation in ``swapped``, then that forward's backward and the step, against a twin that never swaps; then a
    forward made inside the block and backpropagated after it (refused)."""
    import functional_ema as fe

    out = {}
    for wrap_root in (False, True):
        model, opt = _fsdp_model(0, "fp32", wrap_root)
        twin, twin_opt = _fsdp_model(0, "fp32", wrap_root)
        losses = [[_train_step(model, opt, 1), _train_step(twin, twin_opt, 1)]]  # AdamW state exists
        state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=DECAY)
        x = _tokens(99, 0)

        def evaluate() -> None:
            with fe.swapped(model, state), torch.no_grad():
                model(x)

        r: dict = {}
        try:
            for step in (2, 3):
                losses.append([_train_step(model, opt, step, between=evaluate), _train_step(twin, twin_opt, step)])
            r["bitwise"] = _same_training_state(model, opt, twin, twin_opt) and all(a == b for a, b in losses)
        except RuntimeError as e:
            r["bitwise"] = f"{type(e).__name__}: {str(e)[:200]}"
        with fe.swapped(model, state):
            inside = model(x).float().pow(2).mean()
        try:
            inside.backward()
            r["refused"] = "not refused"
        except fe.SwappedTrainingError as e:
            r["refused"] = str(e)
        r["grads_untouched"] = all(p.grad is None for p in model.parameters())
        out["root" if wrap_root else "blocks_only"] = r
    return out


def test_backward_of_a_forward_made_before_swapped_runs_after_it_bitwise_at_2_ranks():
    """docs/core.md: training after the block continues bitwise as if it never ran, also when the block falls
    between a forward and its backward (the root's own parameters plain tensors, or FSDP2's)."""
    for rank, res in enumerate(run_ranks("tests.test_fsdp2:forward_swap_backward_worker", world_size=2, timeout=300)):
        for config, r in res.items():
            where = (rank, config, r)
            assert r["bitwise"] is True, where
            assert "backward through a forward made inside" in r["refused"] and r["grads_untouched"], where


# ------------------------------------------------- HSDP: gather_full(dst=) and meshes in another rank order

# (replicate, shard) meshes of the 4-rank HSDP launch: torch numbers each group's ranks in ascending order and FSDP2
# cuts each parameter by that number, so in MIXED_MESH the replicate group {3, 0} holds shards 1 and 0 (FSDP2 trains
# it wrong: the replicas all-reduce different shards); in ORDERED_MESH every replicate group holds one shard, though
# its rows are not in the ranks' order (ranks 1, 2 are replica 0: shard ranks 0, 1)
MIXED_MESH, ORDERED_MESH = [[3, 1], [0, 2]], [[1, 2], [0, 3]]


def _hsdp_trained(mesh):
    """An HSDP model trained STEPS steps over ``mesh`` with an EMA, and the plain-torch EMA of its full_tensor()s."""
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe

    rank, _ = _world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, ref = fe.init_ema(fe.local_shards(model)), _full_trainable(model)
    for step in range(1, STEPS + 1):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        for n, full in _full_trainable(model).items():
            ref[n].lerp_(full, 1 - DECAY)
    return model, state, ref


def _hsdp_dst_and_mesh_order(ckpt_dir):
    """Per mesh (init_device_mesh's, ORDERED_MESH): this rank's replica, what gather_full(dst=0/1) returns here
    ("empty", or whether it is bitwise the plain-torch EMA), a save loaded back; and MIXED_MESH's refusal."""
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe
    from functional_ema._testing.multirank import refusal

    names = ("replicate", "shard")
    meshes = {
        "init_device_mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=names),
        "ordered": DeviceMesh("cpu", torch.tensor(ORDERED_MESH), mesh_dim_names=names),
    }
    out = {}
    for kind, mesh in meshes.items():
        model, state, ref = _hsdp_trained(mesh)

        def bitwise(got):
            return sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)

        r = {"replica": fe.shard_layout(model).replica, "layout_rank": fe.shard_layout(model).rank}
        for dst in (0, 1):
            got = fe.gather_full(state, model, dst=dst)
            r[f"dst{dst}"] = "empty" if got == {} else bitwise(got)
        fe.save(state, model, ckpt_dir, tag=f"mesh_{kind}")
        r["loaded_bitwise"] = bitwise(fe.gather_full(fe.load(model, ckpt_dir, tag=f"mesh_{kind}"), model))
        if _world()[0] == 0:
            save_file(ref, os.path.join(ckpt_dir, f"mesh_{kind}.ref.safetensors"))
        out[kind] = r
    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 3))
    fully_shard(mixed, mesh=DeviceMesh("cpu", torch.tensor(MIXED_MESH), mesh_dim_names=names))
    out["mixed_refused"] = refusal(lambda: fe.local_shards(mixed))
    return out


def test_hsdp_gather_dst_is_one_rank_of_replica_0_and_mixed_replicate_groups_are_refused(hsdp, ckroot):
    """gather_full(dst=d) under HSDP: the EMA on shard rank d of replica 0 only (its shard group gathers; the other
    replicas skip it); a replica is the shard group on one row of the mesh (replica 0: the row holding rank 0), so a
    mesh in another rank order saves its
    shards once each and loads back bitwise; a mesh whose replicate groups hold different shards is refused on
    every rank when read, before anything is saved."""
    from safetensors.torch import load_file

    import functional_ema as fe

    # (replica, layout rank) of ranks 0..3, and the rank holding the EMA for dst=0 and dst=1
    expected = {
        "init_device_mesh": ([(0, 0), (0, 1), (1, 0), (1, 1)], {0: 0, 1: 1}),
        # replica 0 is the row holding rank 0 ([0, 3]), so dst=0 is global rank 0 (the integrations' rank-0 writers)
        "ordered": ([(0, 0), (1, 0), (1, 1), (0, 1)], {0: 0, 1: 3}),
    }
    for kind, (coords, holder) in expected.items():
        for rank, res in enumerate(hsdp):
            r = res["mesh_order"][kind]
            where = (kind, rank, r)
            assert (r["replica"], r["layout_rank"]) == coords[rank], where
            for dst in (0, 1):
                assert r[f"dst{dst}"] == (True if rank == holder[dst] else "empty"), (dst, where)
            assert r["loaded_bitwise"] is True, where
        d = ckroot / "hsdp"
        assert sorted(os.listdir(d / f"mesh_{kind}")) == [
            "ema_manifest.json",
            "ema_rank_00000_of_00002.safetensors",
            "ema_rank_00001_of_00002.safetensors",
        ]
        ref, offline = load_file(d / f"mesh_{kind}.ref.safetensors"), fe.consolidate(d, f"mesh_{kind}")
        assert sorted(offline) == sorted(ref) and all(torch.equal(offline[n], ref[n]) for n in ref), kind
    for rank, res in enumerate(hsdp):
        msg = res["mesh_order"]["mixed_refused"]
        assert msg is not None and msg.startswith("ValueError: "), (rank, msg)
        assert "replicate group [3, 0]" in msg and "shards 1 and 0" in msg and "init_device_mesh" in msg, msg
