"""The EMA inside ``torch.distributed.checkpoint`` on real gloo ranks (CPU): ``fe.dcp.EMAStateful``.

Saved with DCP at one layout and loaded with DCP at another, the EMA equals the EMA before the save,
bitwise: FSDP2 2 -> 3 ranks, HSDP 2x2 -> FSDP2 4, FSDP2 over tensor parallel (dp 2 x tp 2) -> a plain
module (no process group). A run saved with model, optimizer and EMA in one DCP request, killed and
resumed, continues bitwise. ``dcp.async_save`` writes the EMA at the call although ``update`` runs right
after it. The reference throughout: ``fe.gather_full(..., join_parts=True)`` before the save.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

from functional_ema._testing.multirank import TP_DECAY as DECAY
from functional_ema._testing.multirank import TPNet, run_ranks, tp_batch, tp_mesh, tp_model
from functional_ema.checkpoint import CheckpointMismatchError

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
        if layout == "dp_tp" and os.path.isdir(os.path.join(root, "fsdp2")):  # FSDP2's whole rows, cut by TP
            out["fsdp2_into_dp_tp"] = _load_and_compare(root, "fsdp2", "dp_tp")
    return out


def _load_and_compare(root: str, saved: str, layout: str) -> dict:
    """A fresh model at ``layout`` (other weights), a fresh state, ``dcp.load``; compared with the reference."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    import functional_ema as fe

    model, _ = _model(layout, 123)
    state = fe.init_ema(fe.local_shards(model))
    buffers = [t.data_ptr() for t in state.emas[0].values() if t.numel()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load({"ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=os.path.join(root, saved))
    ref = load_file(os.path.join(root, f"{saved}.ref.safetensors"))
    full = fe.gather_full(state, model, join_parts=True)
    return {
        "bitwise": sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref),
        "step": int(state.step),
        "world": fe.shard_layout(model).world_size,
        "in_place": [t.data_ptr() for t in state.emas[0].values() if t.numel()] == buffers,
        # rows that the new layout splits across ranks cannot be checksummed at load (said, not silent)
        "unverified_warned": any("not checksummed at load" in str(w.message) for w in caught),
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
        assert r == {"bitwise": True, "step": STEPS, "world": 3, "in_place": True, "unverified_warned": False}, (
            rank,
            r,
        )
    saved4 = run_ranks(
        "tests.test_dcp:save_worker", world_size=4, timeout=400, root=str(root), layouts=["hsdp", "dp_tp"]
    )
    for rank, r in enumerate(saved4):
        want = {"bitwise": True, "step": STEPS, "world": 4, "in_place": True}
        assert r["hsdp_into_fsdp2_4"] == {**want, "unverified_warned": False}, (rank, r)
        # FSDP2's saved rows of down.weight are 14 wide; tensor parallelism holds 7 columns: said, not silent
        # (world: the layout's data-parallel size, 2 of dp 2 x tp 2)
        assert r["fsdp2_into_dp_tp"] == {**want, "world": 2, "unverified_warned": True}, (rank, r)
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
    with pytest.raises(CheckpointMismatchError, match="no EMA 1 under key 'ema'"):
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
    assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr
    inside = subprocess.run(
        [*cli[:-1], str(root / "dp_tp" / "x.safetensors")], cwd=str(ROOT), capture_output=True, text=True, timeout=300
    )
    assert inside.returncode == 2 and "inside the DCP checkpoint" in inside.stderr, inside.stderr


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


# ----------------------------------------------------------------------------- what is refused


def _attempt(fn) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the class and message are the result (DCP's are BaseExceptions)
        return f"{type(e).__name__}: {e}"
    return "accepted"


def refusals_worker(root: str) -> dict:
    """FSDP2 at 2 ranks: a clean checkpoint, a 2-EMA one, three with a bad step, and a copy of the clean one
    with one byte of a tensor's data flipped (by rank 0); then the loads and constructions EMAStateful must
    refuse, on both ranks, and a clean load after them (no rank was left behind)."""
    import json
    import shutil
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import functional_ema as fe
    from functional_ema import _io
    from functional_ema._testing.files import hashes as file_hashes

    r = Path(root)
    model, opt = _model("fsdp2", 0)
    mesh = _layout_mesh("fsdp2")
    one = _train(model, opt, fe.init_ema(fe.local_shards(model)), mesh, range(1, STEPS + 1))
    dcp.save({"ema": fe.dcp.EMAStateful(model, one)}, checkpoint_id=r / "one")
    _save_ref(fe.gather_full(one, model), str(r / "one.ref.safetensors"))
    two = fe.init_ema(fe.local_shards(model), num_emas=2)
    two = fe.update(two, fe.local_shards(model), 1, decay=(DECAY, 0.5))
    dcp.save({"ema": fe.dcp.EMAStateful(model, two)}, checkpoint_id=r / "two")
    good = fe.dcp.EMAStateful(model, one).state_dict()
    for name, tensor_step, record_step in (("neg", -7, -7), ("frac", 2.5, 2.5), ("neg_tensor", -7, STEPS)):
        record = json.loads(good[fe.dcp.RECORD_KEY])
        record["step"] = record_step
        doctored = {**good, "step": torch.tensor(tensor_step), fe.dcp.RECORD_KEY: json.dumps(record)}
        dcp.save({"ema": doctored}, checkpoint_id=r / name)
    dist.barrier()
    if dist.get_rank() == 0:  # one byte in the middle of rank 0's piece of up.weight, in the file's data region
        shutil.copytree(r / "one", r / "flip")
        piece = bytes(_io._byte_view(one.emas[0]["up.weight"].contiguous()))
        for f in sorted((r / "flip").glob("*.distcp")):
            data = bytearray(f.read_bytes())
            at = data.find(piece)
            if at >= 0:
                data[at + len(piece) // 2] ^= 0x10
                f.write_bytes(bytes(data))
                break
        else:
            raise AssertionError("rank 0's piece of up.weight is in no .distcp file")
    dist.barrier()
    before = file_hashes(r)

    def load(name: str, num_emas: int = 1) -> str:
        state = fe.init_ema(fe.local_shards(model), num_emas=num_emas)
        ema = fe.dcp.EMAStateful(model, state, checkpoint_id=r / name)
        return _attempt(lambda: dcp.load({"ema": ema}, checkpoint_id=r / name))

    out = {
        "flip": load("flip"),
        "two_into_one": load("two"),
        "one_into_two": load("one", num_emas=2),
        "neg": load("neg"),
        "frac": load("frac"),
        "neg_tensor": load("neg_tensor"),
        "state_none": _attempt(
            lambda: dcp.save({"ema": fe.dcp.EMAStateful(model, lambda: None)}, checkpoint_id=r / "never")
        ),
        "state_int": _attempt(lambda: fe.dcp.EMAStateful(model, 3)),
        "x_not_a_model": _attempt(lambda: fe.dcp.EMAStateful({"w": torch.zeros(2)}, one)),
    }
    out["clean_after"] = _load_and_compare(str(r), "one", "fsdp2")
    dist.barrier()
    out["disk_unchanged"] = file_hashes(r) == before
    return out


def _refused(cls: type, fragments: list[str], fn, root) -> str:
    """fn() raises cls, a CheckpointError whose message holds every fragment; no file under root changes."""
    from functional_ema._testing.files import hashes as file_hashes
    from functional_ema.checkpoint import CheckpointError

    before = file_hashes(root)
    with pytest.raises(cls) as info:
        fn()
    assert isinstance(info.value, CheckpointError), type(info.value)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in: {info.value}"
    assert file_hashes(root) == before, "an error path modified files"
    return str(info.value)


def test_dcp_refuses_flipped_bytes_other_ema_counts_bad_steps_and_unreadable_folders(root, tmp_path, capsys):
    import pickle
    import shutil
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes as file_hashes
    from functional_ema._testing.multirank import ROOT
    from functional_ema.checkpoint import (
        CheckpointNotFoundError,
        CorruptCheckpointError,
        IncompleteCheckpointError,
    )

    r = root / "refusals"
    r.mkdir()
    got = run_ranks("tests.test_dcp:refusals_worker", world_size=2, timeout=400, root=str(r))
    for rank, out in enumerate(got):
        where = f"the DCP checkpoint {r}"
        assert out["flip"].startswith("CorruptCheckpointError") and "up.weight" in out["flip"], (rank, out["flip"])
        assert "XXH3-64" in out["flip"] and f"{where}/flip" in out["flip"], (rank, out["flip"])
        assert out["two_into_one"].startswith("CheckpointMismatchError"), (rank, out)
        assert f"{where}/two holds 2 EMAs (field num_emas), this state 1" in out["two_into_one"], (rank, out)
        # the reverse: DCP itself finds no EMA 1 to read, before EMAStateful sees anything
        assert out["one_into_two"] != "accepted" and "ema.emas.1." in out["one_into_two"], (rank, out)
        for case, frag in (("neg", "field 'step'"), ("frac", "field 'step'"), ("neg_tensor", "field step is -7")):
            assert out[case].startswith("CorruptCheckpointError") and frag in out[case], (rank, case, out[case])
            assert f"{where}/{case}" in out[case], (rank, case, out[case])
        assert out["state_none"].startswith("TypeError") and "state returned a builtins.NoneType" in out["state_none"]
        assert out["state_int"].startswith("TypeError") and "state must be an EmaState" in out["state_int"]
        assert out["x_not_a_model"].startswith("TypeError") and "EMAStateful: x:" in out["x_not_a_model"]
        assert out["clean_after"] == {
            "bitwise": True,
            "step": STEPS,
            "world": 2,
            "in_place": True,
            "unverified_warned": False,
        }, (rank, out)
    assert got[0]["disk_unchanged"] and not (r / "never").exists()

    # 2 ranks -> 1 process (a plain module): the resharded load verifies too, clean and flipped
    from functional_ema._testing.multirank import TPNet

    plain = TPNet()
    state = fe.init_ema(fe.local_shards(plain))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing left unverified
        warnings.filterwarnings("ignore", "torch.distributed is disabled|.*uninitialized", UserWarning)
        dcp.load({"ema": fe.dcp.EMAStateful(plain, state)}, checkpoint_id=str(r / "one"), no_dist=True)
    ref = load_file(r / "one.ref.safetensors")
    assert all(torch.equal(state.emas[0][n].view(ref[n].shape), ref[n]) for n in ref) and int(state.step) == STEPS
    ema = fe.dcp.EMAStateful(plain, fe.init_ema(fe.local_shards(plain)))
    _refused(
        CorruptCheckpointError,
        ["the DCP checkpoint", "up.weight", "XXH3-64"],
        lambda: dcp.load({"ema": ema}, checkpoint_id=str(r / "flip"), no_dist=True),
        r,
    )

    # a model without some of the checkpoint's parameters: refused, not a silent partial load
    from functional_ema._testing.multirank import TP_D, TP_H

    part = torch.nn.Module()
    part.up, part.down = torch.nn.Linear(TP_D, TP_H), torch.nn.Linear(TP_H, TP_D)
    ema = fe.dcp.EMAStateful(part, fe.init_ema(fe.local_shards(part)))
    _refused(
        CheckpointMismatchError,
        ["holds parameters the model does not", "head.bias"],
        lambda: dcp.load({"ema": ema}, checkpoint_id=str(r / "one"), no_dist=True),
        r,
    )

    # offline: consolidate_dcp verifies every row and names the file
    _refused(CorruptCheckpointError, [".distcp", "up.weight", "XXH3-64"], lambda: fe.dcp.consolidate_dcp(r / "flip"), r)
    assert sorted(fe.dcp.consolidate_dcp(r / "flip", verify=False)) == sorted(ref)  # --no-verify's meaning

    def damaged(name: str, damage) -> os.PathLike:
        d = tmp_path / name
        shutil.copytree(r / "one", d)
        damage(d)
        return d

    class Evil:  # a pickle that would run a command when unpickled
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    def truncate(f):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    cases = {
        "garbage_metadata": (
            lambda d: (d / ".metadata").write_bytes(b"not a pickle"),
            CorruptCheckpointError,
            [".metadata"],
        ),
        "truncated_metadata": (lambda d: truncate(d / ".metadata"), CorruptCheckpointError, [".metadata"]),
        "evil_metadata": (
            lambda d: (d / ".metadata").write_bytes(pickle.dumps(Evil())),
            CorruptCheckpointError,
            [".metadata", "posix.system" if os.name == "posix" else "system", "not part of DCP's metadata"],
        ),
        "no_metadata": (lambda d: (d / ".metadata").unlink(), CheckpointNotFoundError, ["not a DCP checkpoint"]),
        "truncated_distcp": (
            lambda d: truncate(d / "__1_0.distcp"),
            CorruptCheckpointError,
            ["__1_0.distcp", "truncated"],
        ),
        "missing_distcp": (
            lambda d: (d / "__1_0.distcp").unlink(),
            IncompleteCheckpointError,
            ["__1_0.distcp", "missing"],
        ),
    }
    for name, (damage, cls, frags) in cases.items():
        d = damaged(name, damage)
        _refused(cls, [str(d), *frags], lambda d=d: fe.dcp.consolidate_dcp(d), d)
    assert not (tmp_path / "ran").exists()
    (tmp_path / "empty").mkdir()
    _refused(
        CheckpointNotFoundError,
        ["not a DCP checkpoint"],
        lambda: fe.dcp.consolidate_dcp(tmp_path / "empty"),
        tmp_path / "empty",
    )
    _refused(CheckpointNotFoundError, ["no such folder"], lambda: fe.dcp.consolidate_dcp(tmp_path / "absent"), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.zeros(3)}}, checkpoint_id=str(tmp_path / "no_ema"), no_dist=True)
    _refused(
        CheckpointMismatchError,
        ["no functional_ema EMA under key 'ema'", "'model'"],
        lambda: fe.dcp.consolidate_dcp(tmp_path / "no_ema"),
        tmp_path / "no_ema",
    )

    # the command line: one "error:" line, exit 1, nothing written; options that do not apply: exit 2
    out = tmp_path / "out.safetensors"
    for src in (r / "flip", tmp_path / "garbage_metadata"):
        proc = subprocess.run(
            [sys.executable, "-m", "functional_ema", "consolidate", "--dcp", str(src), str(out)],
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr and not out.exists(), proc.stderr
    capsys.readouterr()
    for src in (tmp_path / "missing_distcp", tmp_path / "evil_metadata", tmp_path / "empty", tmp_path / "no_ema"):
        assert main(["consolidate", "--dcp", str(src), str(out)]) == 1 and not out.exists(), src
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(src) in err[0], err
    for extra, flag in (
        (["--tag", "t"], "--tag"),
        (["--tp-rank", "0"], "--tp-rank"),
        (["--tp-dim", "up.weight=0"], "--tp-dim"),
    ):
        before = file_hashes(r)
        assert main(["consolidate", "--dcp", str(r / "one"), str(out), *extra]) == 2 and not out.exists(), extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: {flag} does not apply with --dcp" in err[0], err
        assert file_hashes(r) == before
    assert main(["consolidate", str(r / "one"), str(out), "--key", "ema"]) == 2
    assert "--key applies only with --dcp" in capsys.readouterr().err
    assert main(["consolidate", "--dcp", str(r / "flip"), str(out), "--no-verify"]) == 0  # skips the checksums
    assert "checksums not verified" in capsys.readouterr().out and sorted(load_file(out)) == sorted(ref)


# ------------------------------------------------- loads of fresh replicas, no_dist, partial loads


def _moved_ema(make, seed: int):
    """A model from ``make(seed)`` and its EMA moved half-way (decay 0.5) to the weights + 1, and the same EMA
    computed in plain torch from an unsharded ``torch.nn.Linear(6, 4)`` of that seed."""
    import functional_ema as fe

    torch.manual_seed(seed)
    ref_model = torch.nn.Linear(6, 4)
    ref = {n: p.detach().lerp(p.detach() + 1.0, 0.5) for n, p in ref_model.named_parameters()}
    torch.manual_seed(seed)
    model = make(seed)
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model, fe.update(state, fe.local_shards(model), 1, decay=0.5), ref


def _equals(state, model, ref: dict) -> bool:
    import functional_ema as fe

    full = fe.gather_full(state, model)
    return int(state.step) == 1 and all(torch.equal(full[n].view(ref[n].shape), ref[n]) for n in ref)


def load_fixes_worker(root: str) -> dict:
    """2 ranks. An HSDP save (2 replicas) loaded into fresh HSDP and plain models whose replicas differ; rank 0
    alone saving and loading with DCP's no_dist=True while the process group is up; and a load with
    allow_partial_load=True from a checkpoint without the EMA."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))  # HSDP: 2 replicas of one shard

    def hsdp(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Linear(6, 4)
        fully_shard(m, mesh=mesh)
        return m

    def plain(seed: int):
        torch.manual_seed(seed)
        return torch.nn.Linear(6, 4)

    model, state, ref = _moved_ema(hsdp, 0)
    dcp.save({"ema": fe.dcp.EMAStateful(model, state)}, checkpoint_id=os.path.join(root, "hsdp"))
    out: dict = {"saved": _equals(state, model, ref)}
    for kind, make in (("hsdp", hsdp), ("plain", plain)):  # per-rank seeds: the fresh replicas differ
        fresh = make(1 + rank)
        loaded = fe.init_ema(fe.local_shards(fresh))
        out[f"fresh_{kind}"] = _attempt(
            lambda f=fresh, s=loaded: dcp.load(
                {"ema": fe.dcp.EMAStateful(f, s)}, checkpoint_id=os.path.join(root, "hsdp")
            )
        )
        out[f"fresh_{kind}_bitwise"] = _equals(loaded, fresh, ref)
    dist.barrier()
    if rank == 0:  # rank 1 waits in the barrier below: no collective of the EMA may reach it
        t0 = time.monotonic()
        alone, alone_state, alone_ref = _moved_ema(plain, 3)
        dcp.save(
            {"ema": fe.dcp.EMAStateful(alone, alone_state)}, checkpoint_id=os.path.join(root, "alone"), no_dist=True
        )
        fresh = plain(4)
        loaded = fe.init_ema(fe.local_shards(fresh))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to load in a single process"
            dcp.load(
                {"ema": fe.dcp.EMAStateful(fresh, loaded)}, checkpoint_id=os.path.join(root, "alone"), no_dist=True
            )
        out["no_dist_bitwise"] = all(torch.equal(loaded.emas[0][n].view(t.shape), t) for n, t in alone_ref.items())
        out["no_dist_step"], out["no_dist_fast"] = int(loaded.step), time.monotonic() - t0 < 60
    dist.barrier()
    out.update(_no_dist_sharded(root, hsdp, plain))
    dcp.save({"model": plain(0).state_dict()}, checkpoint_id=os.path.join(root, "model_only"))
    fresh = plain(5)
    loaded = fe.init_ema(fe.local_shards(fresh))
    before = {n: t.clone() for n, t in loaded.emas[0].items()}
    out["partial"] = _attempt(
        lambda: dcp.load(
            {"ema": fe.dcp.EMAStateful(fresh, loaded)},
            checkpoint_id=os.path.join(root, "model_only"),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    )
    out["partial_untouched"] = int(loaded.step) == 0 and all(
        torch.equal(loaded.emas[0][n], t) for n, t in before.items()
    )
    return out


def _no_dist_sharded(root: str, hsdp, plain) -> dict:
    """2 ranks. Rank 0 alone saving with no_dist=True: from FSDP2 at 2 (half of each tensor) refused, from HSDP's
    whole replicas accepted and loaded into FSDP2 at 2 bitwise. Each rank saving over a process group of its own
    (smaller than the model's): from FSDP2 refused on both, from HSDP's replicas accepted. A checkpoint of half
    the rows, as those saves wrote before they were refused, loaded by rank 0 alone and by both ranks: refused,
    the step not restored."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe

    rank, out = dist.get_rank(), {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))

    def fsdp2(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Linear(6, 4)
        fully_shard(m, mesh=mesh)
        return m

    sharded, sharded_state, _ = _moved_ema(fsdp2, 6)
    whole, whole_state, whole_ref = _moved_ema(hsdp, 7)

    def path(name: str) -> str:
        return os.path.join(root, name)

    def load(make, name: str, **kw) -> tuple[str, int]:
        fresh = make(8 + rank)
        state = fe.init_ema(fe.local_shards(fresh))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to load in a single process"
            got = _attempt(lambda: dcp.load({"ema": fe.dcp.EMAStateful(fresh, state)}, checkpoint_id=path(name), **kw))
        return got, int(state.step)

    if rank == 0:  # rank 1 waits in the barrier: nothing here may reach it
        save = dcp.save
        out["nodist_sharded"] = _attempt(
            lambda: save(
                {"ema": fe.dcp.EMAStateful(sharded, sharded_state)}, checkpoint_id=path("sharded"), no_dist=True
            )
        )
        out["nodist_sharded_nothing"] = not os.path.exists(path("sharded/.metadata"))
        out["nodist_whole"] = _attempt(
            lambda: save({"ema": fe.dcp.EMAStateful(whole, whole_state)}, checkpoint_id=path("whole"), no_dist=True)
        )
        check, fe.dcp._check_whole = fe.dcp._check_whole, lambda *a: None  # the save as it was before the refusal
        try:
            save({"ema": fe.dcp.EMAStateful(sharded, sharded_state)}, checkpoint_id=path("half"), no_dist=True)
        finally:
            fe.dcp._check_whole = check
        out["half_alone"] = load(plain, "half", no_dist=True)
    dist.barrier()
    out["half_fsdp2"] = load(fsdp2, "half")
    own = [dist.new_group([r]) for r in range(2)][rank]  # every rank makes every group
    for kind, model, state in (("sharded", sharded, sharded_state), ("whole", whole, whole_state)):
        name = f"own_{kind}{rank}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's own about a process_group of one
            out[f"own_{kind}"] = _attempt(
                lambda m=model, s=state, n=name: dcp.save(
                    {"ema": fe.dcp.EMAStateful(m, s)}, checkpoint_id=path(n), process_group=own
                )
            )
        out[f"own_{kind}_written"] = os.path.exists(path(f"{name}/.metadata"))
    fresh = fsdp2(9)
    state = fe.init_ema(fe.local_shards(fresh))
    dcp.load({"ema": fe.dcp.EMAStateful(fresh, state)}, checkpoint_id=path("whole"))
    out["whole_fsdp2_bitwise"] = _equals(state, fresh, whole_ref)
    return out


def test_dcp_loads_fresh_replicas_runs_alone_with_no_dist_and_refuses_a_partial_load(tmp_path):
    got = run_ranks("tests.test_dcp:load_fixes_worker", world_size=2, timeout=240, root=str(tmp_path))
    for rank, out in enumerate(got):
        assert out["saved"] and out["fresh_hsdp"] == out["fresh_plain"] == "accepted", (rank, out)
        assert out["fresh_hsdp_bitwise"] and out["fresh_plain_bitwise"], (rank, out)
        assert out["partial"].startswith("CheckpointMismatchError"), (rank, out["partial"])
        assert "no functional_ema EMA under key 'ema'" in out["partial"] and "allow_partial_load" in out["partial"]
        assert out["partial_untouched"], (rank, out)
    assert got[0]["no_dist_bitwise"] and got[0]["no_dist_step"] == 1 and got[0]["no_dist_fast"], got[0]
    # no_dist=True from one rank of a sharded layout, or each rank over a process group of its own: refused at the
    # save on every rank, naming the parameter and the rows the others hold, nothing written; whole replicas saved
    saves = [(0, got[0]["nodist_sharded"], "[2] to [3]")]  # the first parameter by name: 'bias'
    saves += [(rank, out["own_sharded"], f"[{2 - 2 * rank}] to [{3 - 2 * rank}]") for rank, out in enumerate(got)]
    for rank, refused, block in saves:
        assert refused.startswith(f"CheckpointError: EMAStateful.state_dict on rank {rank}: EMA 0 parameter "), refused
        assert "'bias' (shape [4]): 2 of its 4 elements" in refused, refused
        assert f"first missing block: {block}, inclusive" in refused and "nothing was written" in refused, refused
        assert "process_group smaller than the model's group" in refused and "gather_full" not in refused, refused
    assert got[0]["nodist_sharded_nothing"] and got[0]["nodist_whole"] == "accepted", got[0]
    for out in got:
        assert not out["own_sharded_written"] and out["own_whole"] == "accepted" and out["own_whole_written"], out
    # the whole replicas rank 0 saved alone load into FSDP2 at 2, bitwise
    assert got[0]["whole_fsdp2_bitwise"] and got[1]["whole_fsdp2_bitwise"], got
    # a checkpoint holding rows 0-1 of 4 (one FSDP2 rank's pieces): refused wherever a rank holds missing rows
    missing = "EMA 0 parameter 'weight': 12 of the {} elements this rank holds"
    refused, step = got[0]["half_alone"]
    assert refused.startswith("CorruptCheckpointError") and step == 0, refused
    assert missing.format(24) in refused and "[2, 0] to [3, 5]" in refused, refused
    assert "(no_dist=True, or a process_group smaller than the model's)" in refused, refused
    for rank, out in enumerate(got):  # rank 1's rows are missing; rank 0 refuses with it
        refused, step = out["half_fsdp2"]
        assert refused.startswith("CorruptCheckpointError") and step == 0, (rank, refused)
        assert missing.format(12) in refused and "[2, 0] to [3, 5]" in refused, (rank, refused)


# ------------------------------------------------------- offline: sizes, folders, older entries


def _plain_dcp(path, *, shape: bool = True):
    """A plain Linear(6, 4)'s moved EMA saved with DCP in this process (its record without the global shapes, as
    records were before them, with ``shape=False``), and its plain-torch reference."""
    import json

    import torch.distributed.checkpoint as dcp

    import functional_ema as fe

    model, state, ref = _moved_ema(lambda seed: torch.nn.Linear(6, 4), 0)
    entry = fe.dcp.EMAStateful(model, state).state_dict()  # called outside DCP: the saved entry
    if not shape:
        record = json.loads(entry[fe.dcp.RECORD_KEY])
        for ema in record["emas"].values():
            for slot in ema.values():
                del slot["shape"]
        entry[fe.dcp.RECORD_KEY] = json.dumps(record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"ema": entry}, checkpoint_id=str(path), no_dist=True)
    return model, ref


def _set_size(path, fqn: str, size) -> None:
    import pickle

    meta = pickle.loads((path / ".metadata").read_bytes())  # the test's own file
    meta.state_dict_metadata[fqn].size = torch.Size(size)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def test_consolidate_dcp_checks_sizes_files_and_reads_older_entries(tmp_path, capsys):
    import shutil

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import DefaultLoadPlanner

    import functional_ema as fe
    from functional_ema.__main__ import main
    from functional_ema.checkpoint import CheckpointVersionError, CorruptCheckpointError

    _, ref = _plain_dcp(tmp_path / "new")
    _plain_dcp(tmp_path / "old", shape=False)  # a record without the shapes is still read
    for name in ("new", "old"):
        full = fe.dcp.consolidate_dcp(tmp_path / name)
        assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref), name
    cases = {  # a damaged .metadata: refused, naming it, before anything is allocated
        "grown": ("new", [8, 6], "the EMA's checksum record says [4, 6]"),
        "grown_old": ("old", [8, 6], "some were never saved"),
        "negative": ("old", [-1, 6], "not a list of integers >= 0"),
        "huge": ("old", [2**40, 2**20], "some were never saved"),
        "shrunk": ("old", [2, 6], "lies outside its size"),
    }
    for case, (src, size, frag) in cases.items():
        d = tmp_path / case
        shutil.copytree(tmp_path / src, d)
        _set_size(d, "ema.emas.0.weight", size)
        _refused(
            CorruptCheckpointError,
            [str(d / ".metadata"), "ema.emas.0.weight", frag],
            lambda d=d: fe.dcp.consolidate_dcp(d),
            d,
        )
        assert main(["consolidate", "--dcp", str(d), str(tmp_path / "o.safetensors")]) == 1, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and frag in err[0], (case, err)
    d = tmp_path / "folder"
    shutil.copytree(tmp_path / "new", d)
    data = next(d.glob("*.distcp"))
    data.unlink()
    data.mkdir()
    _refused(CorruptCheckpointError, [str(data), "not a file"], lambda: fe.dcp.consolidate_dcp(d), d)
    from functional_ema.dcp import _check_tiling

    with pytest.raises(
        CorruptCheckpointError, match=re.escape("([0, 0], [2, 6]), ([1, 0], [2, 6])] overlap at [1, 0]")
    ):
        _check_tiling(d, "w", [4, 6], [([0, 0], [2, 6]), ([1, 0], [2, 6])])  # 24 elements, row 1 twice, row 3 never

    # an entry 0.3.0 wrote (step and EMAs, no checksum record): read unverified, with a warning
    model = torch.nn.Linear(6, 4)
    entry = {"step": torch.tensor(1), "emas": {"0": {n: t.clone() for n, t in ref.items()}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"ema": entry}, checkpoint_id=str(tmp_path / "v030"), no_dist=True)
    with pytest.warns(UserWarning, match="written by functional_ema 0.3.0.*unverified"):
        full = fe.dcp.consolidate_dcp(tmp_path / "v030")
    assert sorted(full) == sorted(ref) and all(torch.equal(full[n], ref[n]) for n in ref)
    assert main(["consolidate", "--dcp", str(tmp_path / "v030"), str(tmp_path / "v030.safetensors")]) == 0
    got = load_file(tmp_path / "v030.safetensors")
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    partial = DefaultLoadPlanner(allow_partial_load=True)
    ema = fe.dcp.EMAStateful(model, fe.init_ema(fe.local_shards(model)))
    _refused(
        CheckpointVersionError,
        ["under key 'ema'", "no entry ema.checksums", "0.3.0"],
        lambda: dcp.load({"ema": ema}, checkpoint_id=str(tmp_path / "v030"), planner=partial, no_dist=True),
        tmp_path / "v030",
    )

    # a model with one parameter more than the checkpoint's EMA, loaded with allow_partial_load: a mismatch
    class Bigger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(4))
            self.extra = torch.nn.Parameter(torch.zeros(3))

    bigger = Bigger()
    ema = fe.dcp.EMAStateful(bigger, fe.init_ema(fe.local_shards(bigger)))
    _refused(
        CheckpointMismatchError,
        ["this model has parameters its EMA does not hold", "'extra'"],
        lambda: dcp.load({"ema": ema}, checkpoint_id=str(tmp_path / "new"), planner=partial, no_dist=True),
        tmp_path / "new",
    )


def test_a_dcp_frame_without_its_entry_point_warns_once_naming_the_fallback():
    """state_dict() called from inside torch.distributed.checkpoint but past the frames where DCP's entry point
    is looked for (nested deeper, or renamed by torch): one warning naming the frame and the save it falls back
    to; called outside DCP, no warning."""
    import functional_ema as fe

    model = torch.nn.Linear(3, 2)
    stateful = fe.dcp.EMAStateful(model, fe.init_ema(fe.local_shards(model)))
    scope = {"__name__": "torch.distributed.checkpoint.renamed_saver"}
    exec("def save_renamed(s):\n    return s.state_dict()", scope)
    with pytest.warns(
        UserWarning,
        match=r"called from torch\.distributed\.checkpoint\.renamed_saver\.save_renamed "
        r"but DCP's entry point .* falling back to a save in one process",
    ) as got:
        out = scope["save_renamed"](stateful)
    assert len([w for w in got if "falling back" in str(w.message)]) == 1 and set(out) >= {"step", "emas"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stateful.state_dict()


def test_coverage_and_tiling_checks_match_a_dense_count():
    """The piece grid that the save's and the load's coverage checks (``_gap``) and consolidate_dcp's tiling check
    share, against a dense count of every element in plain numpy: random pieces of 0-d to 3-d tensors, boxes
    inside them, empty sizes included; the missing count, a first missing block that is missing, the refusals."""
    import itertools
    import json
    import random

    import numpy as np

    from functional_ema.checkpoint import CorruptCheckpointError
    from functional_ema.dcp import _check_tiling, _gap

    rng = random.Random(0)
    for _ in range(400):
        shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
        lo = [rng.randint(0, s) for s in shape]
        hi = [rng.randint(a, s) for a, s in zip(lo, shape)]
        pieces = []
        for _ in range(rng.randint(0, 4)):
            off = [rng.randint(0, s) for s in shape]
            pieces.append([off, [rng.randint(0, s - o) for o, s in zip(off, shape)], ""])
        count = np.zeros(shape, dtype=np.int64)
        for off, sizes, _ in pieces:
            count[tuple(slice(o, o + n) for o, n in zip(off, sizes))] += 1
        box = count[tuple(slice(a, b) for a, b in zip(lo, hi))]
        got = _gap(lo, hi, pieces)
        if not (box == 0).any():
            assert got is None, (shape, lo, hi, pieces, got)
        else:
            missing, first, last = got
            assert missing == int((box == 0).sum()), (shape, lo, hi, pieces, got)
            assert all(a <= f <= g < b for a, f, g, b in zip(lo, first, last, hi)), (lo, hi, got)
            assert not count[tuple(slice(f, g + 1) for f, g in zip(first, last))].any(), (shape, pieces, got)
    for _ in range(200):  # tilings: a random grid of pieces, then one piece moved back onto its neighbour
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
        cuts = [sorted({0, s, *rng.sample(range(1, s + 1), rng.randint(0, s - 1))}) for s in shape]
        grid = itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
        chunks = [([a for a, _ in cell], [b - a for a, b in cell]) for cell in grid]
        _check_tiling("at", "w", shape, chunks)
        moved = next((i for i, (off, _) in enumerate(chunks) if off and off[0]), None)
        if moved is None:
            continue
        chunks[moved] = ([chunks[moved][0][0] - 1, *chunks[moved][0][1:]], chunks[moved][1])
        with pytest.raises(CorruptCheckpointError, match=" overlap at ") as refused:
            _check_tiling("at", "w", shape, chunks)
        both, point = re.search(r"\(offsets, sizes\) (.*) overlap at (.*)$", str(refused.value)).groups()
        count = np.zeros(shape, dtype=np.int64)
        for off, sizes in chunks:
            count[tuple(slice(o, o + n) for o, n in zip(off, sizes))] += 1
        assert count[tuple(json.loads(point))] == 2 and len(json.loads(both.replace("(", "[").replace(")", "]"))) == 2
