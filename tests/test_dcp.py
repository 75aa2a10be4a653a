"""The EMA inside ``torch.distributed.checkpoint`` on real gloo ranks (CPU): ``fe.dcp.EMAStateful``.

Saved with DCP at one layout and loaded with DCP at another, the EMA equals the EMA before the save,
bitwise: FSDP2 2 -> 3 ranks, HSDP 2x2 -> FSDP2 4, FSDP2 over tensor parallel (dp 2 x tp 2) -> a plain
module (no process group). A run saved with model, optimizer and EMA in one DCP request, killed and
resumed, continues bitwise. ``dcp.async_save`` writes the EMA at the call although ``update`` runs right
after it. The reference throughout: ``fe.gather_full(..., join_parts=True)`` before the save.
"""

from __future__ import annotations

import os

import pytest
import torch

from functional_ema._testing.multirank import TP_DECAY as DECAY
from functional_ema._testing.multirank import TPNet, run_ranks, tp_batch, tp_mesh, tp_model

STEPS = 3


def _layout_mesh(layout: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "fsdp2":
        return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return tp_mesh((2, 2))  # "dp_tp"


def _model(layout: str, seed: int):
    return tp_model(seed, _layout_mesh(layout), tp=layout == "dp_tp")


def _train(model, opt, state, mesh, steps):
    import functional_ema as fe

    for step in steps:
        model(tp_batch(step, mesh)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
    return state


def _save_ref(full: dict, path: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    if dist.get_rank() == 0:
        save_file({n: t.contiguous() for n, t in full.items()}, path)


def save_worker(root: str, layouts: list[str]) -> dict:
    """Per layout: train, save the EMA alone with DCP, and the reference beside it."""
    import torch.distributed.checkpoint as dcp

    import functional_ema as fe

    out = {}
    for layout in layouts:
        model, opt = _model(layout, 0)
        mesh = _layout_mesh(layout)
        state = _train(model, opt, fe.init_ema(fe.local_shards(model)), mesh, range(1, STEPS + 1))
        dcp.save({"ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=os.path.join(root, layout))
        _save_ref(fe.gather_full(state, model, join_parts=True), os.path.join(root, f"{layout}.ref.safetensors"))
        out[layout] = int(state.step)
        if layout == "hsdp":  # into FSDP2 over the same 4 ranks, in this launch
            out["hsdp_into_fsdp2_4"] = _load_and_compare(root, "hsdp", "fsdp2")
    return out


def _load_and_compare(root: str, saved: str, layout: str) -> dict:
    """A fresh model at ``layout`` (other weights), a fresh state, ``dcp.load``; compared with the reference."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    import functional_ema as fe

    model, _ = _model(layout, 123)
    state = fe.init_ema(fe.local_shards(model))
    buffers = [t.data_ptr() for t in state.emas[0].values() if t.numel()]
    dcp.load({"ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=os.path.join(root, saved))
    ref = load_file(os.path.join(root, f"{saved}.ref.safetensors"))
    full = fe.gather_full(state, model, join_parts=True)
    return {
        "bitwise": sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref),
        "step": int(state.step),
        "world": fe.shard_layout(model).world_size,
        "in_place": [t.data_ptr() for t in state.emas[0].values() if t.numel()] == buffers,
    }


def load_worker(root: str, saved: str, layout: str) -> dict:
    return _load_and_compare(root, saved, layout)


def resume_worker(root: str, phase: str) -> dict:
    """FSDP2 at 2 ranks; model, optimizer and EMA in one DCP request. ``first``: train STEPS, save, train 2
    more (the uninterrupted reference), and an async save with an update right after the call. ``resumed``:
    fresh processes load the request and train the same 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    import functional_ema as fe

    class Train(Stateful):
        def __init__(self, model, opt):
            self.model, self.opt = model, opt

        def state_dict(self):
            m, o = get_state_dict(self.model, self.opt)
            return {"model": m, "optim": o}

        def load_state_dict(self, sd):
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    model, opt = _model("fsdp2", 0)
    mesh = _layout_mesh("fsdp2")
    state = fe.init_ema(fe.local_shards(model))
    ckpt = os.path.join(root, "resume")
    if phase == "first":
        state = _train(model, opt, state, mesh, range(1, STEPS + 1))
        dcp.save({"train": Train(model, opt), "ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=ckpt)
        state = _train(model, opt, state, mesh, range(STEPS + 1, STEPS + 3))
        _save_ref(fe.gather_full(state, model), os.path.join(root, "resume.ref.safetensors"))
        # async: the EMA at the call is written, whatever update does right after
        at_call = fe.gather_full(state, model)
        future = dcp.async_save({"ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=os.path.join(root, "async"))
        # no collective until the save is done: its thread uses the default process group too
        state = fe.update(state, fe.local_shards(model), STEPS + 3, decay=0.0)  # the EMA jumps to the live weights
        future.result()
        moved = not all(torch.equal(at_call[n], t) for n, t in fe.gather_full(state, model).items())
        fresh, _ = _model("fsdp2", 5)
        loaded = fe.init_ema(fe.local_shards(fresh))
        dcp.load({"ema": fe.dcp.EMAStateful(fresh, loaded)}, checkpoint_id=os.path.join(root, "async"))
        got = fe.gather_full(loaded, fresh)
        return {
            "async_is_the_call": all(torch.equal(got[n], at_call[n]) for n in at_call)
            and int(loaded.step) == STEPS + 2,
            "update_moved_it": moved,
        }
    dcp.load({"train": Train(model, opt), "ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=ckpt)
    step_loaded = int(state.step)
    state = _train(model, opt, state, mesh, range(STEPS + 1, STEPS + 3))
    from safetensors.torch import load_file

    ref = load_file(os.path.join(root, "resume.ref.safetensors"))
    full = fe.gather_full(state, model)
    return {"step_loaded": step_loaded, "continued_bitwise": all(torch.equal(full[n], ref[n]) for n in ref)}


# ------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp")


def test_dcp_reshards_the_ema_bitwise(root):
    from safetensors.torch import load_file

    import functional_ema as fe

    saved2 = run_ranks("tests.test_dcp:save_worker", world_size=2, timeout=400, root=str(root), layouts=["fsdp2"])
    assert saved2[0]["fsdp2"] == STEPS
    into3 = run_ranks(
        "tests.test_dcp:load_worker", world_size=3, timeout=400, root=str(root), saved="fsdp2", layout="fsdp2"
    )
    for rank, r in enumerate(into3):
        assert r == {"bitwise": True, "step": STEPS, "world": 3, "in_place": True}, (rank, r)
    saved4 = run_ranks(
        "tests.test_dcp:save_worker", world_size=4, timeout=400, root=str(root), layouts=["hsdp", "dp_tp"]
    )
    for rank, r in enumerate(saved4):
        assert r["hsdp_into_fsdp2_4"] == {"bitwise": True, "step": STEPS, "world": 4, "in_place": True}, (rank, r)
    # dp 2 x tp 2 into a plain module, in this process (no process group): DCP joins the slices
    plain = TPNet()
    state = fe.init_ema(fe.local_shards(plain))
    import torch.distributed.checkpoint as dcp

    dcp.load({"ema": fe.dcp.EMAStateful(plain, state)}, checkpoint_id=str(root / "dp_tp"), no_dist=True)
    ref = load_file(root / "dp_tp.ref.safetensors")
    assert all(torch.equal(state.emas[0][n].view(ref[n].shape), ref[n]) for n in ref) and int(state.step) == STEPS
    # offline, from the folder alone
    for layout in ("fsdp2", "hsdp", "dp_tp"):
        full = fe.dcp.consolidate_dcp(root / layout)
        ref = load_file(root / f"{layout}.ref.safetensors")
        assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref), layout
    with pytest.raises(KeyError, match="no EMA 1 under key 'ema'"):
        fe.dcp.consolidate_dcp(root / "fsdp2", index=1)
    # and the CLI: python -m functional_ema consolidate --dcp DIR OUT.safetensors
    import subprocess
    import sys

    from functional_ema._testing.multirank import ROOT

    out = root / "dp_tp_ema.safetensors"
    cli = [sys.executable, "-m", "functional_ema", "consolidate", "--dcp", str(root / "dp_tp"), str(out)]
    proc = subprocess.run(cli, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stdout + proc.stderr
    got, ref = load_file(out), load_file(root / "dp_tp.ref.safetensors")
    assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    again = subprocess.run(cli, cwd=str(ROOT), capture_output=True, text=True, timeout=300)  # no --overwrite
    assert again.returncode == 1 and "--overwrite" in again.stderr, again.stderr
    inside = subprocess.run(
        [*cli[:-1], str(root / "dp_tp" / "x.safetensors")], cwd=str(ROOT), capture_output=True, text=True, timeout=300
    )
    assert inside.returncode == 1 and "inside the DCP checkpoint" in inside.stderr, inside.stderr


def test_dcp_resume_continues_bitwise_and_async_save_writes_the_call(root):
    first = run_ranks("tests.test_dcp:resume_worker", world_size=2, timeout=200, root=str(root), phase="first")
    for rank, r in enumerate(first):
        assert r == {"async_is_the_call": True, "update_moved_it": True}, (rank, r)
    resumed = run_ranks("tests.test_dcp:resume_worker", world_size=2, timeout=200, root=str(root), phase="resumed")
    for rank, r in enumerate(resumed):
        assert r == {"step_loaded": STEPS, "continued_bitwise": True}, (rank, r)


def test_deepspeed_engine_is_refused_pointing_to_fe_save():
    r = run_ranks("tests.test_dcp:deepspeed_worker", world_size=1, timeout=300)[0]
    assert "fe.save" in r or "functional_ema.save" in r, r


def deepspeed_worker() -> str:
    import functional_ema as fe
    from functional_ema._testing.multirank import make_engine

    engine = make_engine(3, "fp32", seed=0)
    try:
        fe.dcp.EMAStateful(engine, fe.init_ema(fe.local_shards(engine)))
    except TypeError as e:
        return str(e)
    return "not refused"
