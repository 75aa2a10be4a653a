"""EMA checkpoints on real multi-rank DeepSpeed engines (gloo, CPU).

Three launches, each batching many checks (assertions run here, in the parent, on the results):

* ``world2_first``: stages 0/2/3 x fp32/bf16 train K steps, save (EMA first, then DeepSpeed), keep
  training to 2K (the reference run); references are written next to the checkpoints.
* ``world1``: loads those world-2 checkpoints at world size 1 and other ZeRO stages, continues, and
  compares with an EMA of DeepSpeed's full fp32 weights in plain torch; writes world-1
  checkpoints; SIGKILLs forked savers at every fsync / rename / unlink of a save.
* ``world2_resume``: fresh processes load DeepSpeed's and our checkpoint, continue to 2K, and must
  equal the reference run bit for bit; loads the world-1 checkpoints at world size 2; engine-side
  error cases; a rank failing mid-save.

Offline checks (consolidate, the CLI, file-level error cases) need no process group and run here.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from functional_ema._testing.multirank import (
    ROOT,
    OddNet,
    advance,
    checkpoint_decays,
    current_rank,
    diff_emas,
    error_of,
    fork_and_kill,
    gather_all,
    make_engine,
    run_ranks,
    unflat,
)

K = 3  # steps before the save; the reference run continues to 2K
CONFIGS = [(2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16"), (0, "fp32")]
RESHARD_2_TO_1 = [  # saved at world 2 -> loaded at world 1 with this stage / dtype
    ((2, "fp32"), (3, "fp32")),
    ((3, "bf16"), (1, "bf16")),
    ((3, "fp32"), (2, "fp32")),
    ((0, "fp32"), (3, "bf16")),
]
RESHARD_1_TO_2 = [((3, "fp32"), (2, "fp32")), ((1, "bf16"), (3, "bf16")), ((2, "fp32"), (0, "fp32"))]
EXPECTED = [n for n, _ in OddNet().named_parameters() if n not in ("frozen", "not_optimized")]


def _name(stage, dtype, world=2) -> str:
    return f"w{world}_s{stage}_{dtype}"


# ------------------------------------------------------------------------------ worker helpers


def _flat_refs(emas) -> dict:
    return {f"{i}/{n}": t.detach().cpu().contiguous() for i, e in enumerate(emas) for n, t in e.items()}


def _snapshot(root) -> dict:
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file():
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
        else:
            out[rel] = "dir"
    return out


# ------------------------------------------------------------------------- launch 1: world 2


def world2_first_worker(root, configs):
    """The reference runs: K steps, save (EMA, then DeepSpeed), continue to 2K."""
    from safetensors.torch import save_file

    import functional_ema as fe

    rank, out = current_rank(), {}
    for stage, dtype in configs:
        d = Path(root) / _name(stage, dtype)
        engine = make_engine(stage, dtype)
        state = fe.init_ema(fe.local_shards(engine), num_emas=2)
        state = advance(engine, state, K)
        tag_dir = fe.save(state, engine, d, decay=checkpoint_decays())
        engine.save_checkpoint(str(d), client_state=fe.client_state_summary(state, engine))
        full_k = gather_all(state, engine)
        if rank == 0:
            save_file(_flat_refs(full_k), str(d / "ref_full_k.safetensors"))
        state = advance(engine, state, K)
        save_file(_flat_refs(state.emas), str(d / f"ref_local_2k_rank{rank}.safetensors"))
        out[_name(stage, dtype)] = {
            "tag_dir": str(tag_dir),
            "files": sorted(os.listdir(tag_dir)),
            "step": int(state.step),
            "global_steps": engine.global_steps,
        }
        del engine
    return out


# ------------------------------------------------------------------------- launch 2: world 1


def world1_worker(root, reshard, kill_root):
    from safetensors.torch import load_file, save_file

    import functional_ema as fe

    out = {"reshard": {}, "saved": []}
    # 2 -> 1, also changing the ZeRO stage and the training dtype.
    for (sstage, sdtype), (tstage, tdtype) in reshard:
        src = Path(root) / _name(sstage, sdtype)
        engine = make_engine(tstage, tdtype, seed=1)  # other weights: the EMA must come from the files
        state = fe.load(engine, src)
        want = unflat(load_file(str(src / "ref_full_k.safetensors")))
        loaded = gather_all(state, engine)
        ref = [{n: t.clone() for n, t in e.items()} for e in want]
        state = advance(engine, state, 2, ref)
        key = f"{_name(sstage, sdtype)}->{_name(tstage, tdtype, 1)}"
        out["reshard"][key] = {
            "step_loaded": K,
            "loaded_mismatch": diff_emas(loaded, want),
            "continued_mismatch": diff_emas(gather_all(state, engine), ref),
            "step": int(state.step),
            "dtype": str(state.ema[EXPECTED[0]].dtype),
            "views": all(t._base is not None for e in state.emas for t in e.values()),
        }
        del engine
    # World-1 checkpoints for the reverse direction (1 -> 2).
    for stage, dtype in sorted({cfg for cfg, _ in RESHARD_1_TO_2}):
        d = Path(root) / _name(stage, dtype, 1)
        engine = make_engine(stage, dtype)
        state = advance(engine, fe.init_ema(fe.local_shards(engine), num_emas=2), K)
        fe.save(state, engine, d, decay=checkpoint_decays())
        engine.save_checkpoint(str(d))
        save_file(_flat_refs(gather_all(state, engine)), str(d / "ref_full_k.safetensors"))
        out["saved"].append(_name(stage, dtype, 1))
        del engine
    out["kill"] = _kill_points(Path(kill_root))
    return out


def _fork_save(state, engine, save_dir, tag, kill_at: int, count_file: Path | None = None) -> int:
    """fe.save in a forked child that SIGKILLs itself at its ``kill_at``-th fsync/replace/unlink."""
    import functional_ema as fe

    def install(hook):
        os.fsync, os.replace, os.unlink = hook(os.fsync), hook(os.replace), hook(os.unlink)

    return fork_and_kill(lambda: fe.save(state, engine, save_dir, tag), install, kill_at, count_file)


def _kill_points(d: Path) -> dict:
    """Kill a save at every fsync / rename / unlink it makes; the previous checkpoint must survive."""
    import functional_ema as fe
    from functional_ema.checkpoint import IncompleteCheckpointError

    engine = make_engine(2, "bf16")
    state = advance(engine, fe.init_ema(fe.local_shards(engine), num_emas=2), 2)
    fe.save(state, engine, d, "t1")
    (d / "latest").write_text("t1")  # as DeepSpeed would have
    old = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    pristine = d.parent / (d.name + "_pristine")
    shutil.copytree(d, pristine)
    state = advance(engine, state, 1)
    new = [{n: t.clone() for n, t in e.items()} for e in state.emas]

    def loaded(tag=None):
        return list(fe.load(engine, d, tag).emas)

    report = {}
    for scenario, tag in (("new_tag", "t2"), ("same_tag", "t1")):
        count_file = d.parent / "count.txt"
        status = _fork_save(state, engine, d, tag, kill_at=-1, count_file=count_file)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        n_calls = int(count_file.read_text())
        outcomes = []
        for i in range(1, n_calls + 1):
            shutil.rmtree(d)
            shutil.copytree(pristine, d)
            status = _fork_save(state, engine, d, tag, kill_at=i)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            if scenario == "new_tag":
                previous_ok = not diff_emas(loaded(), old)  # latest -> t1, untouched
                try:
                    got = "new" if not diff_emas(loaded("t2"), new) else "wrong"
                except IncompleteCheckpointError:
                    got = "incomplete"
            else:  # t1 itself is being replaced: it must load, as the old or the new state
                now = loaded()
                got = "new" if not diff_emas(now, new) else ("old" if not diff_emas(now, old) else "wrong")
                previous_ok = got in ("old", "new")
            leftovers = sorted(os.listdir(d / tag))
            # A later clean save into the same tag succeeds and removes the debris.
            fe.save(state, engine, d, tag)
            clean = sorted(os.listdir(d / tag))
            outcomes.append(
                {
                    "i": i,
                    "killed": killed,
                    "previous_ok": previous_ok,
                    "state": got,
                    "leftovers": leftovers,
                    "after_clean_save": clean,
                    "clean_loads_new": not diff_emas(loaded(tag), new),
                }
            )
        report[scenario] = {"calls": n_calls, "outcomes": outcomes}
    return report


# ------------------------------------------------------------------------- launch 3: world 2


class RenamedNet(OddNet):
    def __init__(self):
        super().__init__()
        self.middle = self.mid
        del self.mid


class MissingNet(OddNet):
    def __init__(self):
        super().__init__()
        del self.table


class ExtraNet(OddNet):
    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(4))


class ReorderedNet(OddNet):
    """OddNet's names and shapes, registered in another order: ZeRO-1/2 flatten them differently."""

    def __init__(self):
        super().__init__()
        inp = self.inp
        del self.inp
        self.inp = inp


def world2_resume_worker(root, configs, reverse):
    from safetensors.torch import load_file

    import functional_ema as fe

    rank, out = current_rank(), {"resume": {}, "reverse": {}, "errors": {}}
    for stage, dtype in configs:
        d = Path(root) / _name(stage, dtype)
        # Same init as the reference run: on ZeRO-3 DeepSpeed's checkpoint lacks the trainable-but-not-optimized
        # parameter (a documented DeepSpeed behaviour), so a real resume rebuilds the model the same way.
        engine = make_engine(stage, dtype)
        _, client = engine.load_checkpoint(str(d))
        state = fe.load(engine, d)
        step_loaded, gs = int(state.step), engine.global_steps
        out["resume"][_name(stage, dtype) + "/out"] = _load_into_checks(engine, d, state)
        state = advance(engine, state, K)
        want = load_file(str(d / f"ref_local_2k_rank{rank}.safetensors"))
        out["resume"][_name(stage, dtype)] = {
            "step_loaded": step_loaded,
            "global_steps_loaded": gs,
            "client_state": client.get("functional_ema"),
            "mismatch": diff_emas(list(state.emas), unflat(want)),
            "views": all(t._base is not None for e in state.emas for t in e.values()),
        }
        if (stage, dtype) == (2, "fp32"):
            out["errors"].update(_engine_errors(engine, state, d))
        del engine
    for (sstage, sdtype), (tstage, tdtype) in reverse:
        src = Path(root) / _name(sstage, sdtype, 1)
        engine = make_engine(tstage, tdtype, seed=3)
        state = fe.load(engine, src)
        want = unflat(load_file(str(src / "ref_full_k.safetensors")))
        loaded = gather_all(state, engine)
        ref = [{n: t.clone() for n, t in e.items()} for e in want]
        state = advance(engine, state, 2, ref)
        out["reverse"][f"{_name(sstage, sdtype, 1)}->{_name(tstage, tdtype)}"] = {
            "loaded_mismatch": diff_emas(loaded, want),
            "continued_mismatch": diff_emas(gather_all(state, engine), ref),
            "pieces": {n: t.numel() for n, t in state.ema.items()},
        }
        del engine
    return out


def _load_into_checks(engine, d: Path, loaded) -> dict:
    """``load(out=...)`` into a fresh ``init_ema`` state: the same values as ``loaded`` (a plain load),
    in the target's own buffers, with the saved step (written into the target's own step tensor too)."""
    import functional_ema as fe

    target = fe.init_ema(fe.local_shards(engine), num_emas=loaded.num_emas)
    ptrs = [[t.data_ptr() for t in e.values()] for e in target.emas]
    into = fe.load(engine, d, out=target)
    return {
        "mismatch": diff_emas(list(into.emas), [dict(e) for e in loaded.emas]),
        "same_buffers": [[t.data_ptr() for t in e.values()] for e in into.emas] == ptrs,
        "step": int(into.step),
        "target_step_set": into.step is target.step and int(target.step) == int(into.step),
    }


def _load_into_errors(engine, d: Path) -> dict:
    """``load(out=...)`` refusing a state it cannot fill, before reading; and a corrupt file after reading began."""
    import torch.distributed as dist

    import functional_ema as fe

    rank, shards = current_rank(), fe.local_shards(engine)
    refused = {
        "out_num_emas": fe.init_ema(shards, num_emas=1),
        "out_dtype": fe.init_ema(shards, num_emas=2, dtype=torch.bfloat16),
        "out_names": fe.init_ema({"renamed." + n: t.clone() for n, t in shards.items()}, num_emas=2),
    }
    before = {label: [t.clone() for e in st.emas for t in e.values()] for label, st in refused.items()}
    errors = {"out_not_state": error_of(lambda: fe.load(engine, d, out={"inp.weight": torch.zeros(1)}))}
    errors.update({label: error_of(lambda st=st: fe.load(engine, d, out=st)) for label, st in refused.items()})
    errors["out_untouched_after_refusals"] = all(
        torch.equal(a, b)
        for label, st in refused.items()
        for a, b in zip(before[label], (t for e in st.emas for t in e.values()))
    )
    target = fe.init_ema(shards, num_emas=2)
    bad = d.parent / (d.name + "_corrupt")
    if rank == 0:
        shutil.copytree(d, bad)
        tag = (bad / "latest").read_text().strip()
        victim = bad / tag / "ema_rank_00001_of_00002.safetensors"
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF  # a byte of the last tensor's data
        victim.write_bytes(bytes(data))
    dist.barrier()
    errors["out_corrupt"] = error_of(lambda: fe.load(engine, bad, out=target))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(bad)
    return errors


def _own_file_checks(engine, d: Path) -> dict:
    """At the saved world size and stage a load opens this rank's file only; when the model lays its
    pieces out differently (same names, other order) it opens every rank file and re-cuts them."""
    import functional_ema as fe
    from functional_ema._checkpoint.reader import open_checkpoint

    def opened(x):
        with open_checkpoint(d, None, True, fe.shard_layout(x)) as ckpt:
            return [f.rank for f in ckpt.files]

    reordered = make_engine(2, "fp32", model=ReorderedNet())
    same = fe.load(engine, d)
    other = fe.load(reordered, d)
    return {
        "opened_same_layout": opened(engine),
        "opened_other_layout": opened(reordered),
        "layouts_differ": fe.shard_layout(engine).specs != fe.shard_layout(reordered).specs,
        "other_layout_mismatch": diff_emas(gather_all(other, reordered), gather_all(same, engine)),
    }


def _engine_errors(engine, state, d: Path) -> dict:
    """Error cases that need a live engine; each must leave the disk untouched."""
    import functional_ema as fe
    from functional_ema import _io

    rank = current_rank()
    errors = {}
    before = _snapshot(d)
    for label, model in (
        ("renamed", RenamedNet),
        ("missing", MissingNet),
        ("extra", ExtraNet),
        ("shape", lambda: OddNet(hidden=14)),
    ):
        other = make_engine(2, "fp32", model=model())
        errors[label] = error_of(lambda other=other: fe.load(other, d))
        del other
    errors["dtype"] = error_of(lambda: fe.load(engine, d, dtype=torch.bfloat16))
    errors.update(_load_into_errors(engine, d))
    errors.update(_own_file_checks(engine, d))
    errors["wrong_tag_load"] = error_of(lambda: fe.load(engine, d, "global_step999"))
    errors["disk_untouched"] = _snapshot(d) == before
    # A rank failing in the middle of a save: every rank raises, no manifest, the last tag still loads.
    orig = _io.StreamingWriter.write

    def failing(self, key, tensor):
        if rank == 1:
            raise OSError(28, "No space left on device (simulated)")
        return orig(self, key, tensor)

    _io.StreamingWriter.write = failing
    try:
        errors["rank_fails_mid_save"] = error_of(lambda: fe.save(state, engine, d, "halfway"))
    finally:
        _io.StreamingWriter.write = orig
    errors["halfway_files"] = sorted(os.listdir(d / "halfway")) if (d / "halfway").is_dir() else None
    errors["halfway_load"] = error_of(lambda: fe.load(engine, d, "halfway"))
    errors["previous_still_loads"] = error_of(lambda: fe.load(engine, d))
    errors["ranks_disagree"] = error_of(lambda: fe.save(state, engine, d, f"tag_of_rank{rank}"))
    errors["disagree_dirs"] = sorted(p.name for p in d.iterdir() if p.name.startswith("tag_of_rank"))
    errors["not_a_state"] = error_of(lambda: fe.save(dict(state.ema), engine, d, "bad"))
    return errors


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ckroot(tmp_path_factory):
    return tmp_path_factory.mktemp("ema_ckpt")


@pytest.fixture(scope="module")
def world2_first(ckroot):
    res = run_ranks("tests.test_checkpoint:world2_first_worker", world_size=2, root=str(ckroot), configs=CONFIGS)
    return res


@pytest.fixture(scope="module")
def world1(ckroot, world2_first):
    kill_root = ckroot / "kill" / "ckpt"
    kill_root.parent.mkdir()
    return run_ranks(
        "tests.test_checkpoint:world1_worker",
        world_size=1,
        root=str(ckroot),
        reshard=RESHARD_2_TO_1,
        kill_root=str(kill_root),
    )[0]


@pytest.fixture(scope="module")
def world2_resume(ckroot, world2_first, world1):
    return run_ranks(
        "tests.test_checkpoint:world2_resume_worker",
        world_size=2,
        root=str(ckroot),
        configs=CONFIGS,
        reverse=RESHARD_1_TO_2,
    )


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("functional_ema must never unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


# --------------------------------------------------------------------------------------- tests


def test_files_beside_deepspeeds(world2_first, ckroot):
    from safetensors import safe_open

    import functional_ema as fe
    from functional_ema import ShardLayout

    for stage, dtype in CONFIGS:
        rep0, _rep1 = (r[_name(stage, dtype)] for r in world2_first)
        files = rep0["files"]
        ours = [f for f in files if f.startswith("ema_")]
        if stage == 0:  # replicated: one file
            assert ours == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"], files
        else:
            assert ours == [
                "ema_manifest.json",
                "ema_rank_00000_of_00002.safetensors",
                "ema_rank_00001_of_00002.safetensors",
            ]
        assert any(f.endswith("model_states.pt") for f in files), files  # DeepSpeed's, same folder
        assert rep0["step"] == 2 * K and rep0["global_steps"] == 2 * K
        d = Path(rep0["tag_dir"])
        assert d.name == f"global_step{K}"  # DeepSpeed's default tag
        assert (d.parent / "latest").read_text().strip() == d.name
        m = fe.checkpoint.read_manifest(d.parent)
        assert (m["step"], m["num_emas"], m["world_size"], m["zero_stage"], m["dtype"]) == (K, 2, 2, stage, "float32")
        assert m["schedules"][0] == {"kind": "constant", "decay": 0.8} and m["schedules"][1]["kind"] == "power"
        assert list(m["params"]) == EXPECTED
        tiles = {n: [] for n in EXPECTED}
        for entry in m["files"]:
            assert entry["bytes"] == (d / entry["file"]).stat().st_size
            with safe_open(str(d / entry["file"]), framework="pt") as f:
                meta = f.metadata()
                assert (meta["format_version"], meta["step"], meta["num_emas"], meta["world_size"]) == (
                    "5",
                    str(K),
                    "2",
                    "2",
                )  # format 5 (a whole model was written as format 3 before it)
                assert (meta["rank"], meta["zero_stage"]) == (str(entry["rank"]), str(stage))
                layout = ShardLayout.from_json_dict(json.loads(meta["layout"]))
                assert json.loads(meta["schedules"]) == m["schedules"]
                for n, spec in layout.specs.items():
                    assert list(spec.shape) == m["params"][n]
                    assert f.get_slice(f"emas.1.{n}").get_shape() == [spec.numel]
                    tiles[n].append((spec.offset, spec.numel))
        for n, pieces in tiles.items():  # the saved pieces tile each parameter
            pos = 0
            for off, numel in sorted(p for p in pieces if p[1]):
                assert off == pos, (stage, n, pieces)
                pos += numel
            assert pos == torch.Size(m["params"][n]).numel()


def test_exact_resume_bitwise(world2_resume):
    for stage, dtype in CONFIGS:
        for rank, rep in enumerate(world2_resume):
            r = rep["resume"][_name(stage, dtype)]
            where = f"{_name(stage, dtype)} rank {rank}"
            assert r["step_loaded"] == K and r["global_steps_loaded"] == K, where
            assert r["mismatch"] == [], f"{where}: resumed EMA differs from the uninterrupted run: {r['mismatch'][:5]}"
            assert r["views"], where  # loaded into init_ema's flat buffers: update keeps its fused path
            into = rep["resume"][_name(stage, dtype) + "/out"]
            assert into["mismatch"] == [], f"{where}: load(out=) differs from load(): {into['mismatch'][:5]}"
            assert into["same_buffers"] and into["step"] == K and into["target_step_set"], (where, into)
            cs = r["client_state"]
            assert cs["holds_weights"] is False and cs["step"] == K and cs["zero_stage"] == stage, cs


def test_reshard_world2_to_world1(world1):
    assert len(world1["reshard"]) == len(RESHARD_2_TO_1)
    for key, r in world1["reshard"].items():
        assert r["loaded_mismatch"] == [], f"{key}: loaded EMA != saved full EMA: {r['loaded_mismatch'][:5]}"
        assert r["continued_mismatch"] == [], f"{key}: continued EMA != plain-torch EMA of the full weights"
        assert r["step"] == K + 2 and r["dtype"] == "torch.float32" and r["views"], (key, r)


def test_reshard_world1_to_world2(world2_resume):
    for rank, rep in enumerate(world2_resume):
        assert len(rep["reverse"]) == len(RESHARD_1_TO_2)
        for key, r in rep["reverse"].items():
            assert r["loaded_mismatch"] == [], f"{key} rank {rank}: {r['loaded_mismatch'][:5]}"
            assert r["continued_mismatch"] == [], f"{key} rank {rank}: {r['continued_mismatch'][:5]}"
        # On stage 3 both ranks hold a real share of the big table.
        r3 = rep["reverse"][f"{_name(1, 'bf16', 1)}->{_name(3, 'bf16')}"]
        assert 0 < r3["pieces"]["table"] < 111


def test_consolidate_equals_gather_full(world2_first, ckroot, no_unpickling):
    from safetensors.torch import load_file

    import functional_ema as fe

    for stage, dtype in CONFIGS:
        d = ckroot / _name(stage, dtype)
        want = unflat(load_file(str(d / "ref_full_k.safetensors")))
        got = [fe.consolidate(d, index=i) for i in range(2)]  # tag from `latest`
        assert diff_emas(got, want) == [], _name(stage, dtype)
        assert list(got[0]) == EXPECTED
        from_tag_folder = fe.consolidate(d / f"global_step{K}", index=1)  # a tag folder works too
        assert diff_emas([from_tag_folder], [want[1]]) == []
        assert diff_emas([fe.consolidate(d, f"global_step{K}", verify=False)], [want[0]]) == []


def test_cli_consolidate_loads_into_plain_module(world2_first, ckroot, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from functional_ema.__main__ import main

    d = ckroot / _name(3, "bf16")
    want = unflat(load_file(str(d / "ref_full_k.safetensors")))
    out = tmp_path / "ema1.safetensors"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "functional_ema", "consolidate", str(d), str(out), "--index", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and proc.stderr.count("\r") == 0  # no progress bar when not a terminal
    sd = load_file(str(out))
    assert diff_emas([sd], [want[1]]) == []
    module = OddNet()
    missing, unexpected = module.load_state_dict(sd, strict=False)
    assert sorted(missing) == ["frozen", "not_optimized"] and unexpected == []  # these have no EMA
    assert all(torch.equal(module.state_dict()[n], want[1][n]) for n in EXPECTED)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert (meta["tag"], meta["step"], meta["ema_index"]) == (f"global_step{K}", str(K), "1")
    assert json.loads(meta["schedule"])["kind"] == "power"
    # In-process: other tag / index, the tag folder form; errors leave no output file.
    out0 = tmp_path / "ema0.safetensors"
    assert main(["consolidate", str(d / f"global_step{K}"), str(out0), "--no-progress"]) == 0
    assert diff_emas([load_file(str(out0))], [want[0]]) == []
    bad = tmp_path / "bad.safetensors"
    assert main(["consolidate", str(d), str(bad), "--tag", "global_step99"]) == 1
    assert main(["consolidate", str(d), str(bad), "--index", "2"]) == 1
    assert not bad.exists() and sorted(os.listdir(tmp_path)) == ["ema0.safetensors", "ema1.safetensors"]
    with pytest.raises(SystemExit):
        main(["consolidate"])  # usage error: argparse exits with 2


def test_sigkill_during_save_keeps_previous(world1):
    kill = world1["kill"]
    for scenario, rep in kill.items():
        assert rep["calls"] >= 5, rep  # fsync(file), rename, fsync(dir), manifest fsync + rename, ...
        seen = set()
        for o in rep["outcomes"]:
            where = f"{scenario}, killed at call {o['i']} of {rep['calls']}"
            assert o["killed"], where
            assert o["previous_ok"], f"{where}: the previous checkpoint (latest) no longer loads"
            if scenario == "new_tag":
                assert o["state"] in ("incomplete", "new"), where
            else:  # overwriting the same tag: old or new, never broken
                assert o["state"] in ("old", "new"), where
            seen.add(o["state"])
            assert o["clean_loads_new"], where
            assert not any(".tmp-" in f for f in o["after_clean_save"]), o["after_clean_save"]
            assert sum(f.startswith("ema_rank_") for f in o["after_clean_save"]) == 1, o["after_clean_save"]
        # Early kills leave the old state, late ones (after the manifest rename) the new one.
        assert seen == ({"incomplete", "new"} if scenario == "new_tag" else {"old", "new"}), (scenario, seen)
    assert any(".tmp-" in f for o in kill["same_tag"]["outcomes"] for f in o["leftovers"])  # debris was there


def test_engine_error_cases(world2_resume):
    for rank, rep in enumerate(world2_resume):
        e = rep["errors"]
        assert e["disk_untouched"], rank
        name, msg, mro = e["renamed"]
        assert name == "CheckpointMismatchError" and "'mid.weight' -> 'middle.weight'" in msg, msg
        assert "in the checkpoint but not in the model" in msg and "in the model but not in the checkpoint" in msg
        name, msg, _ = e["missing"]
        assert name == "CheckpointMismatchError" and "in the checkpoint but not in the model: ['table']" in msg, msg
        name, msg, _ = e["extra"]
        assert name == "CheckpointMismatchError" and "in the model but not in the checkpoint: ['extra']" in msg, msg
        name, msg, _ = e["shape"]
        assert (
            name == "CheckpointMismatchError" and "shape of 'inp.weight': checkpoint (13, 7), model (14, 7)" in msg
        ), msg
        name, msg, _ = e["dtype"]
        assert name == "CheckpointMismatchError" and "holds float32 EMAs but dtype=bfloat16" in msg, msg
        assert e["opened_same_layout"] == [rank], e["opened_same_layout"]  # one header read, not world_size
        assert e["layouts_differ"] and e["opened_other_layout"] == [0, 1], e["opened_other_layout"]
        assert e["other_layout_mismatch"] == [], e["other_layout_mismatch"][:5]  # re-cut from both files, bitwise
        name, msg, _ = e["out_not_state"]
        assert name == "TypeError" and "load(out=...) takes an EmaState" in msg and "dict" in msg, msg
        name, msg, _ = e["out_num_emas"]
        assert (
            name == "CheckpointMismatchError"
            and "load(out=...) on rank 0" in msg
            and "holds 2 EMA(s) but the state has 1" in msg
        ), msg
        name, msg, _ = e["out_dtype"]
        assert name == "CheckpointMismatchError" and "is bfloat16 but tag" in msg and "float32 EMAs" in msg, msg
        name, msg, _ = e["out_names"]
        assert name == "CheckpointMismatchError" and "which the state lacks" in msg and "'inp.weight'" in msg, msg
        assert "'renamed.inp.weight'" in msg and "which this model does not train" in msg, msg
        assert e["out_untouched_after_refusals"]
        name, msg, _ = e["out_corrupt"]  # rank 1's file is corrupt: both ranks raise, each says its out= was written to
        assert name == "CorruptCheckpointError" and "checksum mismatch" in msg, msg
        assert f"out= was partly overwritten on rank {rank}" in msg, msg
        name, msg, mro = e["wrong_tag_load"]
        assert name == "CheckpointNotFoundError" and "global_step999" in msg and f"global_step{K}" in msg, msg
        assert "FileNotFoundError" in mro
        # A rank failing mid-save: both ranks raise, nothing is marked complete, the last tag loads.
        name, msg, _ = e["rank_fails_mid_save"]
        assert "No space left on device" in msg and ("rank 1" in msg or rank == 1), (rank, msg)
        assert "ema_manifest.json" not in (e["halfway_files"] or [])
        # the failed save removes its files, and the tag folder it made (if nothing else is in it yet)
        assert e["halfway_load"][0] in ("IncompleteCheckpointError", "CheckpointNotFoundError"), e["halfway_load"]
        assert e["previous_still_loads"] is None, e["previous_still_loads"]
        name, msg, _ = e["ranks_disagree"]
        assert name == "CheckpointMismatchError" and "ranks disagree on tag: rank 0: " in msg, msg
        assert e["disagree_dirs"] == []
        assert (
            e["not_a_state"][0] == "TypeError" and f"save on rank {rank}: expected an EmaState" in e["not_a_state"][1]
        ), e["not_a_state"]


# ------------------------------------------------------------------------- offline error cases


def _copy(ckroot: Path, tmp_path: Path, stage=2, dtype="fp32") -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(ckroot / _name(stage, dtype), dst)
    return dst


def _manifest(d: Path) -> tuple[Path, dict]:
    p = d / f"global_step{K}" / "ema_manifest.json"
    return p, json.loads(p.read_text())


def _expect(exc_name: str, fragments, fn, root: Path):
    """fn() raises exc_name whose message contains every fragment; nothing under root changes."""
    import functional_ema.checkpoint as ck

    before = _snapshot(root)
    with pytest.raises(getattr(ck, exc_name)) as info:
        fn()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in: {msg}"
    assert _snapshot(root) == before, "an error path modified files"
    return msg


def test_offline_error_cases(world2_first, ckroot, tmp_path, no_unpickling):
    import functional_ema as fe
    from functional_ema import _io

    d = _copy(ckroot, tmp_path)
    tag = f"global_step{K}"
    tdir = d / tag
    r1 = tdir / "ema_rank_00001_of_00002.safetensors"
    good = r1.read_bytes()
    cases = 0

    # 1. missing rank file
    r1.unlink()
    _expect(
        "IncompleteCheckpointError",
        ["ema_rank_00001_of_00002.safetensors", "rank 1 of 2", tag],
        lambda: fe.consolidate(d),
        d,
    )
    cases += 1
    # 2. truncated rank file
    r1.write_bytes(good[:-100])
    _expect("CorruptCheckpointError", ["truncated", "rank 1 of 2", str(len(good))], lambda: fe.consolidate(d), d)
    cases += 1
    # 3. corrupted tensor bytes (checksum names the parameter)
    r1.write_bytes(good)
    st = _io.SafetensorsFile(r1)
    key = next(k for k, e in st.tensors.items() if e.numel > 10 and k.startswith("emas.0."))
    raw = bytearray(good)
    raw[st.header_size + st.tensors[key].start + 5] ^= 0x10
    r1.write_bytes(bytes(raw))
    _expect(
        "CorruptCheckpointError",
        ["checksum mismatch", key, "rank 1 of 2", f"parameter {key[7:]!r}"],
        lambda: fe.consolidate(d),
        d,
    )
    cases += 1
    # 4. corrupted header byte (inside a number of the JSON header)
    raw = bytearray(good)
    pos = good.index(b'"step":"') + len(b'"step":"')
    raw[pos] = ord("7")
    r1.write_bytes(bytes(raw))
    _expect("CorruptCheckpointError", ["rank 1 of 2", "checksum"], lambda: fe.consolidate(d), d)
    cases += 1
    r1.write_bytes(good)
    # 5. a tag that does not exist (the message lists the complete ones)
    _expect("CheckpointNotFoundError", ["'global_step42'", f"[{tag!r}]"], lambda: fe.consolidate(d, "global_step42"), d)
    cases += 1
    # 6. a checkpoint directory that does not exist
    _expect("CheckpointNotFoundError", ["does not exist"], lambda: fe.consolidate(tmp_path / "nowhere"), tmp_path)
    cases += 1
    # 7. incomplete tag: rank files but no manifest (a save that died before its last step)
    half = d / "global_step9"
    half.mkdir()
    shutil.copy(r1, half / r1.name)
    _expect(
        "IncompleteCheckpointError",
        ["'global_step9'", "no complete EMA", "found 1 EMA rank file", f"[{tag!r}]"],
        lambda: fe.consolidate(d, "global_step9"),
        d,
    )
    cases += 1
    # 8. `latest` names a tag DeepSpeed finished but the EMA did not
    (d / "latest").write_text("global_step9")
    _expect(
        "IncompleteCheckpointError",
        ["'latest' names this tag", "functional_ema.save before engine.save_checkpoint"],
        lambda: fe.consolidate(d),
        d,
    )
    cases += 1
    (d / "latest").write_text(tag)
    # 9. a pickle handed in: DeepSpeed's own .pt file as the checkpoint path
    pt = next(tdir.glob("*model_states.pt"))
    _expect("CorruptCheckpointError", ["pickle", "never unpickles"], lambda: fe.consolidate(pt), d)
    cases += 1
    # 10. a pickle in place of a rank file
    r1.write_bytes(_pickle_bytes())
    _expect("CorruptCheckpointError", ["pickle", "rank 1 of 2"], lambda: fe.consolidate(d), d)
    cases += 1
    r1.write_bytes(good)
    # 11. written by a newer functional_ema
    mp, m = _manifest(d)
    saved_manifest = mp.read_text()
    mp.write_text(json.dumps(dict(m, format_version=99, library="functional_ema 9.0")))
    _expect(
        "CheckpointVersionError",
        ["newer functional_ema", "format version 99", "pip install -U"],
        lambda: fe.consolidate(d),
        d,
    )
    cases += 1
    mp.write_text(saved_manifest)
    # 12. dtype mismatch: a rank file rewritten in bf16 by another tool (consistent sizes/checksums)
    _rewrite_as_bf16(r1, mp)
    _expect(
        "CorruptCheckpointError",
        ["dtype mismatch", "torch.bfloat16", "torch.float32", "rank 1 of 2"],
        lambda: fe.consolidate(d),
        d,
    )
    cases += 1
    r1.write_bytes(good)
    mp.write_text(saved_manifest)
    # 13. an EMA index the checkpoint does not have
    _expect("CheckpointMismatchError", ["index=5", "holds 2 EMA(s)"], lambda: fe.consolidate(d, index=5), d)
    cases += 1
    # 14. an empty `latest` (DeepSpeed writes it non-atomically)
    (d / "latest").write_text("")
    _expect("CheckpointNotFoundError", ["is empty", "pass tag="], lambda: fe.consolidate(d), d)
    cases += 1
    (d / "latest").write_text(tag)
    # 15. a damaged manifest
    mp.write_text(saved_manifest[: len(saved_manifest) // 2])
    _expect("CorruptCheckpointError", ["not valid JSON", "manifest"], lambda: fe.consolidate(d), d)
    cases += 1
    mp.write_text(saved_manifest)
    # 16. files from two different saves mixed in one tag
    other = ckroot / _name(2, "bf16") / tag / r1.name
    shutil.copy(other, r1)
    msg = _expect("CorruptCheckpointError", ["rank 1 of 2"], lambda: fe.consolidate(d), d)
    assert "checksum" in msg or "does not belong" in msg or "modified" in msg
    cases += 1
    r1.write_bytes(good)
    # The intact copy still consolidates, and the CLI reports errors with exit code 1.
    assert list(fe.consolidate(d)) == EXPECTED
    assert cases >= 10


def _pickle_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"emas": torch.zeros(3)}, buf)  # torch.save's zip format, as a user might hand in
    return buf.getvalue()


def _rewrite_as_bf16(path: Path, manifest_path: Path) -> None:
    """Rewrite a rank file with bf16 tensors, keeping metadata, and fix sizes/checksums in the manifest."""
    from safetensors import safe_open

    from functional_ema import _io
    from functional_ema._checkpoint.format import join_chunk_checksums

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open handle has keys() but is not iterable
    st = _io.SafetensorsFile(path)
    order = sorted(st.tensors, key=lambda k: st.tensors[k].start)
    tmp = path.with_name("rewritten.safetensors")
    with _io.StreamingWriter(tmp, [(k, torch.bfloat16, tensors[k].shape) for k in order], meta) as w:
        for k in order:
            w.write(k, tensors[k].to(torch.bfloat16))
        size = w.commit()
    os.replace(tmp, path)
    m = json.loads(manifest_path.read_text())
    for e in m["files"]:
        if e["file"] == path.name:
            hexa = lambda v: _io.format_checksum(w.algo, v)  # noqa: E731
            e.update(
                bytes=size,
                header_checksum=hexa(w.header_checksum),
                chunk_checksums=join_chunk_checksums(w.algo, w.crcs),
            )
    manifest_path.write_text(json.dumps(m))


def test_partial_reads_across_pieces(world2_first, ckroot, no_unpickling):
    """Resharding reads slices that straddle saved pieces (safe_open get_slice, CRC chunks widened)."""
    import functional_ema as fe
    from functional_ema._checkpoint.reader import CheckpointReader

    d = ckroot / _name(3, "fp32")
    full = fe.consolidate(d, index=1)
    with CheckpointReader.open(d, None) as ckpt:
        pieces = ckpt.pieces["table"]
        assert len(pieces) == 2 and pieces[0][:2] == (0, 56)  # ceil(111 / 2) on rank 0, the rest on rank 1
        for verify in (True, False):
            for start, stop in ((10, 100), (0, 111), (56, 57), (55, 56), (3, 3)):
                out = torch.full((stop - start,), float("nan"))
                ckpt.fill(out, 1, "table", start, stop - start, verify)
                assert torch.equal(out, full["table"].reshape(-1)[start:stop]), (verify, start, stop)


# ------------------------------------------------------------------- checkpoint format 1 (CRC-32)

V1 = ROOT / "tests" / "data" / "ckpt_v1"  # written by the pre-format-2 code: see tests/data/make_ckpt_v1.py


def test_format1_checkpoint_consolidates(tmp_path, no_unpickling):
    from safetensors.torch import load_file

    import functional_ema as fe

    want = unflat(load_file(str(V1 / "reference_full.safetensors")))
    assert fe.checkpoint.read_manifest(V1)["format_version"] == 1
    assert diff_emas([fe.consolidate(V1, index=i) for i in range(2)], want) == []
    out = fe.consolidate_to_file(V1, tmp_path / "ema1.safetensors", index=1, progress=False)
    assert diff_emas([load_file(str(out))], [want[1]]) == []
    # Its CRC-32s are still checked: one flipped byte is reported.
    d = tmp_path / "v1"
    shutil.copytree(V1, d)
    from functional_ema import _io

    r1 = d / "global_step3" / "ema_rank_00001_of_00002.safetensors"
    st = _io.SafetensorsFile(r1)
    key = next(k for k, e in st.tensors.items() if e.numel > 10 and k.startswith("emas.1."))
    raw = bytearray(r1.read_bytes())
    raw[st.header_size + st.tensors[key].start + 3] ^= 0x01
    r1.write_bytes(bytes(raw))
    _expect(
        "CorruptCheckpointError",
        ["checksum mismatch", "crc32", key, "rank 1 of 2"],
        lambda: fe.consolidate(d, index=1),
        d,
    )


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])
def test_chunk_checksums_multi_chunk(tmp_path, algo):
    """Tensors over several 4 MiB chunks: whole reads (hashed piece by piece) and slices, both algorithms."""
    from functional_ema import _io

    t = torch.randn(3 * _io.CHUNK_BYTES // 4 + 1000)
    path = tmp_path / "x.safetensors"
    with _io.StreamingWriter(path, [("x", torch.float32, t.shape)], algo=algo) as w:
        sums = w.write("x", t)
        w.commit()
    assert sums == _io.chunk_checksums(t.numpy().tobytes(), algo=algo) and len(sums) == 4
    st = _io.SafetensorsFile(path)
    assert st.header_checksum(algo) == w.header_checksum
    out = torch.empty_like(t)
    st.read_into("x", out, sums, algo=algo)
    assert torch.equal(out, t)
    strided = torch.empty(t.numel(), 2)[:, 0]  # not contiguous: read through a host buffer, then copied
    st.read_into("x", strided, sums, algo=algo)
    assert torch.equal(strided, t)
    lo, hi = _io.CHUNK_BYTES // 4 - 7, 2 * _io.CHUNK_BYTES // 4 + 9  # straddles chunks 0..2
    assert torch.equal(st.read_range("x", lo, hi, sums, algo=algo), t[lo:hi])
    st.close()
    raw = bytearray(path.read_bytes())
    raw[st.header_size + 2 * _io.CHUNK_BYTES + 5] ^= 0x40  # in chunk 2
    path.write_bytes(bytes(raw))
    st = _io.SafetensorsFile(path)
    with pytest.raises(
        _io.ChecksumError, match=f"bytes {2 * _io.CHUNK_BYTES}\\.\\.{3 * _io.CHUNK_BYTES} of the tensor: {algo}"
    ):
        st.read_into("x", torch.empty_like(t), sums, algo=algo)
    with pytest.raises(_io.ChecksumError):
        st.read_range("x", lo, hi, sums, algo=algo)
    assert torch.equal(st.read_range("x", 0, 100, sums, algo=algo), t[:100])  # chunk 0 is intact
    st.close()


def test_io_threads_share_the_node(monkeypatch):
    """Loads and saves take this rank's share of its CPUs (every local rank runs them at once), the
    offline tools all of them, 1 to 4; FUNCTIONAL_EMA_IO_THREADS overrides, and a bad value is refused by name."""
    from functional_ema import _io

    monkeypatch.setattr(_io.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv(_io.IO_THREADS_ENV, raising=False)
    for local_ranks, want in ((None, 4), ("1", 4), ("2", 4), ("4", 2), ("8", 1), ("16", 1), ("x", 4)):
        if local_ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
        assert _io.io_threads() == want, local_ranks
        assert _io.io_threads(shared=False) == 4, local_ranks  # the offline tools run alone
    monkeypatch.setenv(_io.IO_THREADS_ENV, "3")
    assert _io.io_threads() == _io.io_threads(shared=False) == 3
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(_io.IO_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{_io.IO_THREADS_ENV} must be a positive integer, got '{bad}'"):
            _io.io_threads()


def test_one_large_tensor_read_by_several_threads_in_verified_parts(tmp_path, monkeypatch):
    """A tensor of 3.5 checksum chunks, loaded by 2 threads: cut into parts of whole chunks, each read in
    place and verified. New memory and out= give the saved values bitwise; a flipped byte in the third
    chunk fails the load naming that chunk's bytes; a load without verification reads it as it is."""
    import functional_ema as fe
    from functional_ema import _io
    from functional_ema._checkpoint import reader

    monkeypatch.setenv(_io.IO_THREADS_ENV, "2")
    cut = []
    split = reader._split_jobs
    monkeypatch.setattr(reader, "_split_jobs", lambda *a: cut.append(split(*a)) or cut[-1])
    per_chunk = _io.CHUNK_BYTES // 4
    model = torch.nn.Linear(per_chunk // 2, 7, bias=False)  # 3.5 chunks of fp32
    state = fe.init_ema(fe.local_shards(model))
    fe.save(state, model, tmp_path, "t")
    assert torch.equal(fe.load(model, tmp_path, "t").ema["weight"], state.ema["weight"])
    assert [job[4] for job in cut[-1]] == [per_chunk] * 3 + [per_chunk // 2]
    held = fe.load(model, tmp_path, "t", out=fe.init_ema(fe.local_shards(model)))
    assert torch.equal(held.ema["weight"], state.ema["weight"])
    (rank_file,) = [p for p in (tmp_path / "t").iterdir() if p.suffix == ".safetensors"]
    st = _io.SafetensorsFile(rank_file)
    at = st.header_size + st.tensors["emas.0.weight"].start + 2 * _io.CHUNK_BYTES + 123
    st.close()
    data = bytearray(rank_file.read_bytes())
    data[at] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    lo = 2 * _io.CHUNK_BYTES
    with pytest.raises(
        fe.CheckpointError, match=rf"checksum mismatch in tensor 'emas.0.weight', bytes {lo}..{lo + _io.CHUNK_BYTES} "
    ):
        fe.load(model, tmp_path, "t")
    flat = fe.load(model, tmp_path, "t", verify=False).ema["weight"].view(-1)
    want = state.ema["weight"].view(-1)
    assert torch.equal(flat[: 2 * per_chunk], want[: 2 * per_chunk]) and not torch.equal(flat, want)


def test_save_commits_in_order_and_durably(tmp_path, monkeypatch):
    """One process, a plain module: every rank file is fsynced and renamed into place before the manifest,
    which is fsynced and renamed before ``ema_latest`` points at the tag; each rename is preceded by its
    file's fsync and followed by its folder's (a crash at any point leaves the previous checkpoint whole)."""
    import stat

    import functional_ema as fe

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = fe.init_ema(fe.local_shards(model))
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file", ""))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fe.save(state, model, tmp_path, "t")
    renamed = [name for kind, name in calls if kind == "replace"]
    assert renamed == ["ema_rank_00000_of_00001.safetensors", "ema_manifest.json", "ema_latest"], renamed
    for i, (kind, _) in enumerate(calls):
        if kind == "replace":
            assert calls[i - 1][0] == "fsync file" and calls[i + 1][0] == "fsync dir", calls
    assert (tmp_path / "ema_latest").read_text() == "t\n"
    assert torch.equal(fe.load(model, tmp_path).ema["0.weight"], state.ema["0.weight"])


def test_outputs_never_replace_a_checkpoint_root_file_and_cli_ranges_are_usage_errors(tmp_path, capsys):
    """consolidate_to_file (overwrite=True by default) and ``consolidate --overwrite`` refuse ``ema_latest`` and the
    other names of files a save writes (manifest, lock, record, rank files), in any case, in the checkpoint's root:
    the checkpoint still loads, its EMA equal to a plain-torch EMA. ``--index`` and ``--tp-rank`` outside
    [0, 2**63) are usage errors (exit 2, one ``error:`` line), like the --dcp path's."""
    import functional_ema as fe
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import OutputPathError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    want = {n: p.detach().lerp(p.detach() + 1.0, 0.5) for n, p in model.named_parameters()}
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = fe.update(state, fe.local_shards(model), 1, decay=0.5)
    ck = tmp_path / "ck"
    fe.save(state, model, ck)
    before = hashes(ck)
    names = ["ema_latest", "EMA_LATEST", "ema_manifest.json", ".ema_write.lock", "integration.json"]
    names.append("ema_rank_00000_of_00001.safetensors")
    for name in names:
        with pytest.raises(OutputPathError, match="inside the checkpoint directory"):
            fe.consolidate_to_file(ck, ck / name)
        assert main(["consolidate", str(ck), str(ck / name), "--overwrite"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: OUT: refusing to write"), (name, err)
    assert hashes(ck) == before
    full = fe.consolidate(ck)  # follows ema_latest
    assert sorted(full) == sorted(want) and all(torch.equal(full[n], want[n]) for n in want)
    out = tmp_path / "o.safetensors"
    for flag, value in (("--index", "-1"), ("--tp-rank", "-1"), ("--index", str(2**63)), ("--tp-rank", str(2**70))):
        assert main(["consolidate", str(ck), str(out), flag, value]) == 2, (flag, value)
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: {flag} is {'an EMA index' if flag == '--index' else 'a rank'} (0 to 2**63 - 1), got {value}"
        ]
        assert not out.exists()
    proc = subprocess.run(  # the real command line: no traceback
        [sys.executable, "-m", "functional_ema", "consolidate", str(ck), str(out), "--tp-rank", "-1"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: --tp-rank") and "Traceback" not in proc.stderr


def test_a_state_of_plain_dicts_saves_loads_and_swaps(tmp_path):
    """init_ema over a name-keyed dict (not a reading's Shards) records no whole shapes: save, load, swapped and
    gather_full take it, with the values it holds (the whole-shape check skips what was not recorded)."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    state = fe.init_ema({n: p.detach().clone() for n, p in model.named_parameters()})
    state = fe.update(state, {n: p.detach() + 1 for n, p in model.named_parameters()}, 1, decay=0.5)
    want = {n: p.detach().clone().lerp_(p.detach() + 1, 0.5) for n, p in model.named_parameters()}
    fe.save(state, model, tmp_path, tag="s")
    loaded = fe.load(model, tmp_path, tag="s")
    assert int(loaded.step) == 1 and all(torch.equal(loaded.ema[n], t) for n, t in want.items())
    assert all(torch.equal(t, want[n]) for n, t in fe.gather_full(state, model).items())
    with fe.swapped(model, state):
        assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_load_out_sets_the_step_in_place_and_a_failed_load_leaves_it(tmp_path):
    """``load(x, dir, out=state)`` (a plain module) writes the saved EMAs and, last, the saved step into ``state``'s
    own tensors, so ``state`` itself reads as the returned state does (values bitwise as saved, the step too, the same
    step tensor); a load refused before reading, or failing while reading, leaves the step as it was."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25 * step)
        state = fe.update(state, fe.local_shards(model), step, decay=(0.5, 0.75))
    saved = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    fe.save(state, model, tmp_path / "ck", tag="t")
    out = fe.init_ema(fe.local_shards(model), num_emas=2)
    counter = out.step
    got = fe.load(model, tmp_path / "ck", tag="t", out=out)
    assert out.step is counter and got.step is counter and int(counter) == 3  # in place, as update writes it
    assert all(torch.equal(out.emas[k][n], saved[k][n]) for k in range(2) for n in saved[k])
    assert all(got.emas[k][n].data_ptr() == out.emas[k][n].data_ptr() for k in range(2) for n in saved[k])
    fresh = fe.init_ema(fe.local_shards(model), num_emas=2)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ck", bad)
    victim = next((bad / "t").glob("ema_rank_*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor's data: the load fails after reading began
    victim.write_bytes(bytes(data))
    with pytest.raises(fe.checkpoint.CorruptCheckpointError, match="out= was partly overwritten"):
        fe.load(model, bad, tag="t", out=fresh)
    assert int(fresh.step) == 0
    with torch.inference_mode():
        odd = fe.EmaState(torch.zeros((), dtype=torch.int64), fresh.emas)
    with pytest.raises(ValueError, match=r"load\(out=...\): out.step is an inference tensor"):
        fe.load(model, tmp_path / "ck", tag="t", out=odd)  # refused before a byte is read: it could not be set
