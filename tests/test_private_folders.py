"""``save(..., shared=False)`` / ``load(..., shared=False)``: folders the ranks do not share (issue 37).

Each rank (or each simulated node) saves into its own folder, as Ray Train's workers and node-local disks
do. Real engines, real ranks (gloo): DeepSpeed ZeRO-3 and a DDP model at 2 ranks, one folder per rank;
DeepSpeed ZeRO-2 at 4 ranks as two "nodes" (ranks 0-1 share one folder, 2-3 another). Checked:

* each folder holds its ranks' files and the same manifest (byte for byte); one folder alone is never
  complete where it lacks files (``consolidate`` and a shared ``load`` refuse it, naming the missing files);
* ``load(..., shared=False)`` from the private folders restores every rank's state bitwise, at the saved
  layout; the folders merged into one (a plain copy) consolidate to the full EMA of an independent
  plain-torch reference (DeepSpeed's ``safe_get_full_fp32_param``), and load at another world size;
* refusals on every rank, with nothing committed: a stale folder on one rank (another save of the tag),
  replicas whose EMAs diverged, another world size from private folders (naming the files and the merge).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from functional_ema._testing.multirank import raised, run_ranks

DECAY = 0.9


def _folder(root: Path, rank: int, ranks_per_node: int) -> Path:
    return root / f"node{rank // ranks_per_node}"


def private_worker(root: str, kind: str, ranks_per_node: int) -> dict:
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema._testing.multirank import ddp_trained, full_fp32_reference, make_engine, train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    here = _folder(Path(root), rank, ranks_per_node) / "ckpt"
    out: dict = {"rank": rank}
    if kind == "ddp":
        x, train, full = ddp_trained(rank)
    else:
        engine = make_engine(int(kind[-1]))
        x, train, full = engine, lambda step: train_step(engine, step), lambda: full_fp32_reference(engine)

    state = fe.init_ema(fe.local_shards(x))
    ref = {n: t.clone() for n, t in full().items()}
    for step in range(1, 4):
        train(step)
        state = fe.update(state, fe.local_shards(x), step, decay=DECAY)
        for n, t in full().items():
            ref[n].lerp_(t, 1 - DECAY)
    if rank == 0:
        torch.save({n: t for n, t in ref.items()}, Path(root) / "ref.pt")
    fe.save(state, x, here, "t", decay=DECAY, shared=False)
    dist.barrier()
    mine = [t.clone() for t in state.emas[0].values()]

    loaded = fe.load(x, here, "t", shared=False)
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(mine, loaded.emas[0].values())) and int(loaded.step) == 3
    out["shared_load"] = raised(lambda: fe.load(x, here, "t"))

    # a stale folder on the last rank: another save of the tag (one step later)
    state = fe.update(state, fe.local_shards(x), 4, decay=DECAY)
    later = Path(root) / f"later{rank // ranks_per_node}"
    fe.save(state, x, later, "t", decay=DECAY, shared=False)
    dist.barrier()  # the last rank reads the later save's folder, the others the first save's
    out["stale"] = raised(lambda: fe.load(x, later if rank == world - 1 else here, "t", shared=False))
    if kind == "ddp":  # replicas whose EMAs differ: the save is refused on every rank, nothing committed
        if rank == 1:
            with torch.no_grad():
                next(iter(state.emas[0].values())).add_(1.0)
        out["diverged"] = raised(lambda: fe.save(state, x, Path(root) / f"div{rank}", "t", shared=False))
        out["diverged_files"] = sorted(p.name for p in (Path(root) / f"div{rank}").rglob("*") if p.is_file())
    dist.barrier()
    return out


def _consolidated_equals(folder: Path, ref: dict[str, torch.Tensor]) -> bool:
    import functional_ema as fe

    got = fe.consolidate(folder, "t")
    return sorted(got) == sorted(ref) and all(torch.allclose(got[n], ref[n], rtol=0, atol=1e-6) for n in ref)


@pytest.mark.parametrize(
    ("kind", "world", "per_node"), [("zero3", 2, 1), ("ddp", 2, 1), ("zero2", 4, 2)], ids=["zero3", "ddp", "2nodes"]
)
def test_private_folders_save_load_and_merge(tmp_path, kind, world, per_node):
    import functional_ema as fe
    from functional_ema.checkpoint import IncompleteCheckpointError

    res = run_ranks(
        "tests.test_private_folders:private_worker",
        world_size=world,
        timeout=600,
        root=str(tmp_path),
        kind=kind,
        ranks_per_node=per_node,
    )
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    nodes = sorted({_folder(tmp_path, r, per_node) for r in range(world)})
    manifests = {(n / "ckpt" / "t" / "ema_manifest.json").read_bytes() for n in nodes}
    assert len(manifests) == 1  # the same manifest in every folder, byte for byte
    manifest = json.loads(manifests.pop())
    listed = {e["file"] for e in manifest["files"]}
    for r in res:
        assert r["bitwise"], r
    for node in nodes:
        held = {p.name for p in (node / "ckpt" / "t").iterdir() if p.name.startswith("ema_rank_")}
        assert held <= listed and (node / "ckpt" / "ema_latest").read_text().strip() == "t"
        if held != listed:  # a folder with only some ranks' files is never complete on its own
            with pytest.raises(IncompleteCheckpointError, match="missing"):
                fe.consolidate(node / "ckpt", "t")
    if kind == "ddp":
        assert all(r["shared_load"] is None for r in res)  # every folder holds the replicated file
    else:
        for r in res:
            name, msg = r["shared_load"]
            assert name == "IncompleteCheckpointError" and "load it with shared=False" in msg, msg
    merged = tmp_path / "merged"
    for node in nodes:
        shutil.copytree(node / "ckpt", merged, dirs_exist_ok=True)
    assert _consolidated_equals(merged, ref)
    for r in res:
        name, msg = r["stale"]
        assert name == "CheckpointMismatchError" and "ranks disagree" in msg and "save" in msg, msg
    if kind == "zero3":  # at 1 rank: the private folder refused naming the missing file; the merged one loads
        from functional_ema._testing.multirank import OddNet

        model = OddNet()
        model.not_optimized.requires_grad_(False)  # the engine's optimizer leaves it out: it has no EMA
        with pytest.raises(IncompleteCheckpointError, match=r"lacks 1 file.*saved by rank 1 of 2.*merge the folders"):
            fe.load(model, nodes[0] / "ckpt", "t", shared=False)
        state = fe.load(model, merged, "t")
        assert all(torch.allclose(state.emas[0][n].view(ref[n].shape), ref[n], rtol=0, atol=1e-6) for n in ref)
    if kind == "ddp":
        for r in res:
            name, msg = r["diverged"]
            assert name == "CheckpointMismatchError" and "diverged" in msg, msg
            assert not any("manifest" in f for f in r["diverged_files"]), r["diverged_files"]


def controller_worker(root: str, async_save: bool) -> dict:
    """The integrations' controller with ``shared=False``: a not-started record and a started EMA saved into each
    rank's own folder, resumed by a fresh controller; a rank whose folder holds nothing is refused on every rank.
    With ``async_save``, each save is committed at the next one (and the last at ``wait``)."""
    import torch.distributed as dist

    from functional_ema.integrations import EMAController

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    here = Path(root) / f"node{rank}" / "run"
    ctl = EMAController(DECAY, start_step=3, shared=False, async_save=async_save)
    out: dict = {"committed": []}
    for step in range(1, 6):
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(4, 7, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ctl.on_step(model, step)
        ctl.save(model, here / f"checkpoint-{step}", step)
        out["committed"].append([(here / f"checkpoint-{s}" / "ema" / "ema_manifest.json").exists() for s in (3, 4, 5)])
    ctl.wait()
    out["committed_at_wait"] = (here / "checkpoint-5" / "ema" / "ema_manifest.json").exists()
    fresh = EMAController(DECAY, start_step=3, shared=False)
    out["unstarted"] = fresh.load(model, here / "checkpoint-2", 2) == 2 and fresh.state is None
    fresh.load(model, here / "checkpoint-5", 5)
    assert fresh.state is not None and ctl.state is not None
    out["bitwise"] = all(torch.equal(fresh.state.emas[0][n], t) for n, t in ctl.state.emas[0].items())
    empty = Path(root) / f"empty{rank}"
    (empty / "ema").mkdir(parents=True)
    out["one_empty"] = raised(lambda: fresh.load(model, here / "checkpoint-5" if rank == 0 else empty, 5))
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_controller_with_private_folders(tmp_path, async_save):
    res = run_ranks(
        "tests.test_private_folders:controller_worker",
        world_size=2,
        timeout=300,
        root=str(tmp_path),
        async_save=async_save,
    )
    # which of checkpoint-3..5 hold their manifest after the saves of steps 1..5
    if async_save:  # each committed by the save after it
        want = [[False] * 3, [False] * 3, [False] * 3, [True, False, False], [True, True, False]]
    else:
        want = [[False] * 3, [False] * 3, [True, False, False], [True, True, False], [True, True, True]]
    for r in res:
        assert r["committed"] == want and r["committed_at_wait"], r
        assert r["unstarted"] and r["bitwise"], r
        name, msg = r["one_empty"]
        assert name == "CheckpointMismatchError" and "folders disagree" in msg, msg
    for node in ("node0", "node1"):  # each folder: its own copy of the record and the manifest
        assert (tmp_path / node / "run" / "checkpoint-2" / "ema" / "integration.json").is_file()
        assert (tmp_path / node / "run" / "checkpoint-5" / "ema" / "ema_manifest.json").is_file()


def test_one_process_private_save_and_load(tmp_path):
    """A model saved by one process (no process group) with shared=False: its folder is complete on its own."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = fe.update(state, fe.local_shards(model), 1, decay=DECAY)
    fe.save(state, model, tmp_path / "ck", "t", shared=False)
    assert sorted(p.name for p in (tmp_path / "ck" / "t").iterdir()) == [
        "ema_manifest.json",
        "ema_rank_00000_of_00001.safetensors",
    ]
    for shared in (False, True):
        loaded = fe.load(model, tmp_path / "ck", "t", shared=shared)
        assert all(torch.equal(loaded.emas[0][n], t) for n, t in state.emas[0].items())
    # The same tag again: generation 1, named by its manifest too (it once said 0: the folder did not load).
    state = fe.update(state, fe.local_shards(model), 2, decay=DECAY)
    fe.save(state, model, tmp_path / "ck", "t", shared=False)
    assert sorted(p.name for p in (tmp_path / "ck" / "t").iterdir()) == [
        "ema_manifest.json",
        "ema_rank_00000_of_00001.gen1.safetensors",
    ]
    assert fe.checkpoint.read_manifest(tmp_path / "ck", "t")["generation"] == 1
    loaded = fe.load(model, tmp_path / "ck", "t", shared=False)
    assert int(loaded.step) == 2 and all(torch.equal(loaded.emas[0][n], t) for n, t in state.emas[0].items())


def failed_commit_worker(root: str) -> dict:
    """Each rank its own folder: tag ``t`` saved at step 2, then re-saved at step 3 and a new tag ``u`` saved,
    both with rank 1's manifest write failing (ENOSPC) after rank 0's folder wrote its manifest."""
    import errno

    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema._checkpoint import private
    from functional_ema._testing.multirank import ddp_trained

    rank = dist.get_rank()
    here = Path(root) / f"node{rank}"
    x, train, _ = ddp_trained(rank)
    state = fe.init_ema(fe.local_shards(x))
    for step in (1, 2):
        train(step)
        state = fe.update(state, fe.local_shards(x), step, decay=DECAY)
    fe.save(state, x, here, "t", shared=False)
    saved = [{n: t.clone() for n, t in e.items()} for e in state.emas]
    train(3)
    state = fe.update(state, fe.local_shards(x), 3, decay=DECAY)
    real = private.commit_manifest

    def full_on_rank_1(save_dir: Path, tag_dir: Path, manifest: dict, **kw: object) -> None:
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(tag_dir / "ema_manifest.json"))
        real(save_dir, tag_dir, manifest, **kw)

    private.commit_manifest = full_on_rank_1
    try:
        out: dict = {"resave": raised(lambda: fe.save(state, x, here, "t", shared=False))}
        out["new_tag"] = raised(lambda: fe.save(state, x, here, "u", shared=False))
    finally:
        private.commit_manifest = real
    dist.barrier()
    out["files"] = sorted(p.name for p in (here / "t").iterdir())
    out["latest"] = (here / "ema_latest").read_text().strip()
    for tag in ("t", None):  # the previous save, by its tag and by ema_latest
        loaded = fe.load(x, here, tag, shared=False)
        out[f"bitwise_{tag}"] = int(loaded.step) == 2 and all(
            torch.equal(a[n], b[n]) for a, b in zip(saved, loaded.emas) for n in a
        )
    return out


def test_failed_private_commit_keeps_every_folders_previous_checkpoint(tmp_path):
    """A private save whose manifest cannot be written in one folder fails on every rank, and every folder keeps
    its previous manifest, files and ema_latest: no folder gets ahead of another (rank 0's used to commit and
    delete the previous generation, leaving step 3 in one folder and step 2 in the other: refused everywhere)."""
    res = run_ranks("tests.test_private_folders:failed_commit_worker", world_size=2, timeout=300, root=str(tmp_path))
    for r, out in enumerate(res):
        for key in ("resave", "new_tag"):
            name, msg = out[key]
            assert name == "CheckpointIOError" and "rank 1 could not write" in msg and "ENOSPC" in msg, msg
        assert out["files"] == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"], out["files"]
        assert out["latest"] == "t" and out["bitwise_t"] and out["bitwise_None"], out
        assert not (tmp_path / f"node{r}" / "u" / "ema_manifest.json").exists()


def test_interrupt_during_a_failed_commits_cleanup_releases_the_lock(tmp_path, monkeypatch):
    """A private commit fails (its manifest cannot be staged) and an interrupt lands while its new files are being
    removed: the tag folder's lock is released all the same (it was released after the cleanup, so it stayed held),
    and the next save of the tag takes it at once."""
    import functional_ema as fe
    from functional_ema._checkpoint import private
    from functional_ema._checkpoint.writer import LOCK_NAME

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=DECAY)

    def no_room(*args):
        raise OSError(28, "No space left on device")

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(private, "_stage_manifest", no_room)
        patch.setattr(private, "remove_unlisted", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fe.save(state, model, tmp_path / "ck", "t", shared=False)
    assert not (tmp_path / "ck" / "t" / LOCK_NAME).exists()
    fe.save(state, model, tmp_path / "ck", "t", shared=False, timeout=5)
    assert int(fe.load(model, tmp_path / "ck", "t", shared=False).step) == 1


def latest_worker(root: str) -> dict:
    """FSDP2 with BatchNorm buffers, 2 ranks: an ``AsyncSaver`` save of step 2, then a blocking save of step 3
    under another tag, then ``saver.wait()`` commits step 2; in private folders (the commit at the wait) and in a
    shared one with rank 1's async write slowed (the commit thread after the blocking save's). Then, from the private
    folders, the verbs without ``shared=``: ``buffers.load_buffers`` and ``checkpoint.read_manifest``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe
    import functional_ema.buffers as fb
    from functional_ema._checkpoint import writer

    rank, base, out = dist.get_rank(), Path(root), {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real = writer.write_rank_file

    def slow(path: Path, *a, **k):
        if rank == 1 and path.parent.name == "step2":
            time.sleep(2.0)  # rank 1's async write ends after the blocking save of step 3 committed
        return real(path, *a, **k)

    writer.write_rank_file = slow  # type: ignore[assignment]
    for mode in ("private", "shared"):
        shared = mode == "shared"
        here = base / (mode if shared else f"{mode}{rank}")
        state, bufs = fe.init_ema(fe.local_shards(model)), fb.init_buffers(model)
        saver = fe.AsyncSaver()
        for step in (1, 2, 3):
            g = torch.Generator().manual_seed(10 * step + rank)
            model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
            bufs = fb.update_buffers(bufs, model, step, decay=DECAY)
            if step == 2:
                saver.save(state, model, here, "step2", decay=DECAY, buffers=bufs, shared=shared)
        fe.save(state, model, here, "step3", decay=DECAY, buffers=bufs, shared=shared)
        saver.wait()
        dist.barrier()
        loaded = fe.load(model, here, shared=shared)  # tag=None: ema_latest
        out[mode] = {
            "latest": (here / "ema_latest").read_text(),
            "step": int(loaded.step),
            "bitwise": all(torch.equal(loaded.emas[0][n], t) for n, t in state.emas[0].items()),
        }
        if not shared:
            restored = fe.checkpoint.load_checkpoint(model, here, None, buffers=True, shared=False).buffers
            out[mode]["buffers"] = all(torch.equal(restored.emas[0][n], t) for n, t in bufs.emas[0].items())
            out[mode]["load_buffers"] = raised(lambda: fb.load_buffers(model, here, "step3"))
            out[mode]["read_manifest"] = raised(lambda: fe.checkpoint.read_manifest(here, "step3"))
        dist.barrier()
    writer.write_rank_file = real  # type: ignore[assignment]
    return out


def test_ema_latest_never_goes_back_and_the_verbs_without_shared_say_what_works(tmp_path):
    """:func:`latest_worker`: ``ema_latest`` keeps naming step 3 (it went back to step 2, and ``load(tag=None)``
    returned step 2's EMA) and the load is bitwise step 3's, in private folders and in a shared one; a private
    folder refused by ``load_buffers`` / ``read_manifest`` (missing rank 1's files) says what works for that verb
    (it said "load it with shared=False", which neither takes), and ``load_checkpoint(shared=False)`` restores the
    buffers bitwise."""
    res = run_ranks(
        "tests.test_private_folders:latest_worker",
        world_size=2,
        timeout=300,
        env={"FE_DIST_INIT": "torch"},
        root=str(tmp_path),
    )
    for r, out in enumerate(res):
        for mode in ("private", "shared"):
            assert out[mode]["latest"] == "step3\n" and out[mode]["step"] == 3 and out[mode]["bitwise"], (r, mode)
        assert out["private"]["buffers"], r
        for verb, fix in (
            (
                "load_buffers",
                "load_buffers cannot read: restore its buffers with functional_ema.checkpoint."
                "load_checkpoint(x, load_dir, tag, buffers=True, shared=False), or merge the folders first)",
            ),
            ("read_manifest", "read_manifest checks every listed file; each rank's folder holds the same manifest"),
        ):
            name, message = out["private"][verb]
            assert name == "IncompleteCheckpointError" and fix in message, (r, verb, message)
            assert "load it with shared=False" not in message, (r, verb, message)
