"""``fe.load`` and the offline readers straight from an object store (issue 37): ranged, verified reads, no copy.

A real S3 server (SeaweedFS on loopback, ``functional_ema._testing.s3``), started once for the module and
stopped by pid at its end. Checkpoints are saved locally by ``fe.save`` (real engines, real ranks on gloo) and
uploaded with s3fs's own ``put``; the save to a URL is built and tested elsewhere. One launch per configuration
(a DDP module, DeepSpeed ZeRO-3), 2 ranks, every check of the launch batched in it:

* a load by URL at the same world size is bitwise the saved state, on every rank; each rank fetches exactly the
  pointer file, the manifest and the rank file(s) it reads (counted by an s3fs subclass, :class:`CountingS3`):
  its own share, not the checkpoint; with the tag given, nothing is listed;
* ``shared=False`` from the URL loads the same;
* a listing that lags a write (:class:`LaggingS3`: ``ls``/``find``/``info`` of folders answer with the listing of
  the previous save) changes nothing: the manifest's files are read by their exact names;
* faults, each refused on every rank with the exact error: a rank's object deleted, replaced by another of the
  same size (a checksum error naming the file), truncated, grown, and a stale object (the older generation's
  file) under the newer manifest;
* a wrong secret in ``storage_options`` (the server refuses access, s3fs's bare ``PermissionError('Forbidden')``):
  on every rank, or on rank 1 only, refused on every rank (no rank left waiting) with a ``CheckpointIOError`` naming
  the failing rank, the URL and ``load(storage_options=...)``.

Then, in this process (another world size: 1 rank), the load by URL, ``consolidate``, ``consolidate_to_file``,
``read_manifest`` and ``saved_parts`` from the URL are bitwise the full EMA the ranks gathered in memory
(``fe.gather_full``, which reads no file) and close to an independent plain-torch EMA of the full weights, each
saved byte fetched once; DeepSpeed's ``latest`` wins over ``ema_latest`` (a tag without a manifest, or a pointer that
names no plain tag, refused). Without a server: ``SafetensorsFile`` over a storage file (``memory://``) reads and
refuses exactly as over the local file, and no reader takes ``s3://b/x`` for the local folder ``s3:/b/x``.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from functional_ema._testing.multirank import raised, run_ranks

pytest.importorskip("s3fs")

import s3fs

DECAY = 0.9
BUCKET = "fe-load"
TAG = "t"


class CountingS3(s3fs.S3FileSystem):
    """s3fs, counting what it asks the server for: the bytes each GET returned (by object) and every call (by
    S3 method). Class-wide counters: reset with :meth:`reset` before what is measured."""

    protocol = ("s3count",)
    got: ClassVar[Counter] = Counter()
    calls: ClassVar[Counter] = Counter()

    @classmethod
    def reset(cls) -> None:
        cls.got, cls.calls = Counter(), Counter()

    async def _call_s3(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        type(self).calls[getattr(method, "__name__", method)] += 1
        return await super()._call_s3(method, *args, **kwargs)

    async def _cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        data = await super()._cat_file(path, *args, **kwargs)
        type(self).got[self._strip_protocol(path).rpartition("/")[2]] += len(data)
        return data


class LaggingS3(CountingS3):
    """An S3 whose listings lag: ``ls``, ``find`` and ``info`` of a folder answer with :attr:`frozen` (folder ->
    the names it held when the listing was taken), as an eventually consistent listing would after a write."""

    protocol = ("s3lag",)
    frozen: ClassVar[dict[str, list[str]]] = {}

    def _stale(self, path: str) -> str | None:
        p = self._strip_protocol(path).rstrip("/")
        return p if p in type(self).frozen else None

    async def _ls(self, path: str, detail: bool = False, **kwargs: Any) -> Any:
        p = self._stale(path)
        if p is None:
            return await super()._ls(path, detail=detail, **kwargs)
        names = [f"{p}/{n}" for n in type(self).frozen[p]]
        return [{"name": n, "type": "file", "size": 1} for n in names] if detail else names

    async def _find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        p = self._stale(path)
        if p is None:
            return await super()._find(path, *args, **kwargs)
        return [f"{p}/{n}" for n in type(self).frozen[p]]

    async def _info(self, path: str, *args: Any, **kwargs: Any) -> Any:
        p = self._stale(path)
        if p is None:
            return await super()._info(path, *args, **kwargs)
        return {"name": p, "type": "directory", "size": 0}


def _register() -> None:
    import fsspec

    fsspec.register_implementation("s3count", CountingS3, clobber=True)
    fsspec.register_implementation("s3lag", LaggingS3, clobber=True)


def _build(kind: str) -> tuple[Any, Any, Any]:
    """(the object fe reads, a training step, the full weights) of a DDP module or a ZeRO-3 engine, seeded."""
    import torch.distributed as dist

    from functional_ema._testing.multirank import OddNet, ddp_trained, full_fp32_reference, make_engine, train_step

    rank = dist.get_rank()
    if kind == "ddp":
        return ddp_trained(rank, d_in=64, hidden=700)
    engine = make_engine(3, model=OddNet(hidden=3000))
    return engine, lambda step: train_step(engine, step), lambda: full_fp32_reference(engine)


def _upload(fs: Any, local: Path, url: str) -> None:
    """The folder's files at ``url`` and nothing else (trailing slashes: its contents, whether or not the server
    kept the emptied folder after the ``rm``, as SeaweedFS does)."""
    if fs.exists(url):
        fs.rm(url, recursive=True)
    fs.put(f"{local}/", f"{url}/", recursive=True)


def url_worker(root: str, kind: str, endpoint: str, key: str, secret: str) -> dict:
    """Save twice locally (generations 0 and 1 of one tag), upload, then every load and fault of the module's
    docstring on every rank (rank 0 mutates the bucket between barriers)."""
    import torch.distributed as dist

    import functional_ema as fe

    _register()
    rank = dist.get_rank()
    here = Path(root)
    opts = {"key": key, "secret": secret, "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    admin = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    prefix = f"{BUCKET}/{kind}/ck"
    x, train, full = _build(kind)
    state = fe.init_ema(fe.local_shards(x))
    ref = {n: t.clone() for n, t in full().items()}
    for step in range(1, 5):
        train(step)
        state = fe.update(state, fe.local_shards(x), step, decay=DECAY)
        for n, t in full().items():
            ref[n].lerp_(t, 1 - DECAY)
        if step == 3:  # generation 0 of the tag, kept aside (the source of a stale object)
            fe.save(state, x, here / "ck", TAG, decay=DECAY)
            if rank == 0:
                shutil.copytree(here / "ck", here / "gen0")
            dist.barrier()
    fe.save(state, x, here / "ck", TAG, decay=DECAY)  # generation 1, step 4
    gathered = fe.gather_full(state, x)
    if rank == 0:
        torch.save({"gathered": gathered, "ref": ref}, here / "full.pt")
        _upload(admin, here / "gen0", prefix)  # what the lagging listing will keep showing
        LaggingS3.frozen = {f"{prefix}/{TAG}": admin.ls(f"{prefix}/{TAG}", detail=False)}
        LaggingS3.frozen = {k: [p.rpartition("/")[2] for p in v] for k, v in LaggingS3.frozen.items()}
        (here / "frozen.json").write_text(json.dumps(LaggingS3.frozen))
        _upload(admin, here / "ck", prefix)  # generation 1 replaces it
    dist.barrier()
    LaggingS3.frozen = json.loads((here / "frozen.json").read_text())
    mine = [t.clone() for t in state.emas[0].values()]

    def same(loaded: Any) -> bool:
        return all(torch.equal(a, b) for a, b in zip(mine, loaded.emas[0].values())) and int(loaded.step) == 4

    out: dict[str, Any] = {"rank": rank}
    url = f"s3count://{prefix}"
    for label, tag in (("latest", None), ("tag", TAG)):
        CountingS3.reset()
        out[f"bitwise_{label}"] = same(fe.load(x, url, tag, storage_options=opts))
        out[f"got_{label}"], out[f"calls_{label}"] = dict(CountingS3.got), dict(CountingS3.calls)
    out["private"] = same(fe.load(x, url, shared=False, storage_options=opts))
    lag = LaggingS3(skip_instance_cache=True, **opts)
    out["lag_listing"] = sorted(p.rpartition("/")[2] for p in lag.ls(f"{prefix}/{TAG}"))
    out["lagging"] = same(fe.load(x, f"s3lag://{prefix}", storage_options=opts))

    manifest = json.loads((here / "ck" / TAG / "ema_manifest.json").read_text())
    victim = manifest["files"][-1]["file"]  # the last rank's file (the only one of a replicated DDP save)
    obj = f"{prefix}/{TAG}/{victim}"
    raw = (here / "ck" / TAG / victim).read_bytes()
    old = sorted(p.name for p in (here / "gen0" / TAG).glob("ema_rank_*"))[-1]
    faults = {
        "deleted": None,
        "same_size": raw[:-1] + bytes([raw[-1] ^ 0xFF]),
        "truncated": raw[:-4],
        "grown": raw + b"\0" * 4,
        "stale": (here / "gen0" / TAG / old).read_bytes(),
    }
    for name, data in faults.items():
        if rank == 0:
            admin.rm(obj) if data is None else admin.pipe(obj, data)
        dist.barrier()
        out[name] = raised(lambda: fe.load(x, f"s3://{prefix}", TAG, storage_options=opts))
        dist.barrier()
        if rank == 0:
            admin.pipe(obj, raw)
        dist.barrier()
    out["restored"] = same(fe.load(x, f"s3://{prefix}", TAG, storage_options=opts))
    # the store refusing a rank's credentials (every rank's, then rank 1's only): named on every rank, no hang
    wrong = dict(opts, secret="not-" + secret, config_kwargs={"retries": {"max_attempts": 1}}, skip_instance_cache=True)
    out["forbidden"] = raised(lambda: fe.load(x, f"s3://{prefix}", TAG, storage_options=wrong))
    mixed = wrong if rank == 1 else opts
    out["forbidden_rank1"] = raised(lambda: fe.load(x, f"s3://{prefix}", TAG, storage_options=mixed))
    out["victim"], out["sizes"] = victim, {e["file"]: e["bytes"] for e in manifest["files"]}
    out["manifest_bytes"] = (here / "ck" / TAG / "ema_manifest.json").stat().st_size
    out["latest_bytes"] = (here / "ck" / "ema_latest").stat().st_size
    out["files_of_rank"] = [e["file"] for e in manifest["files"] if e["rank"] == rank] or [
        e["file"] for e in manifest["files"]
    ]
    return out


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from functional_ema._testing.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("s3")) as srv:
        srv.make_bucket(BUCKET)
        yield srv


def _expected_errors(kind: str, r: dict, url: str) -> dict[str, tuple[str, str]]:
    """The exact refusal of each fault, as the rank that reads the file raises it."""
    victim, size = r["victim"], r["sizes"][r["victim"]]
    where = f"{url}/{TAG}/{victim} (rank {int(victim.split('_')[2])} of 2)"
    return {
        "deleted": (
            "IncompleteCheckpointError",
            f"tag {TAG!r} in {url} is missing 1 file(s) listed in its manifest: {victim} (rank "
            f"{int(victim.split('_')[2])} of 2). The folder was copied or pruned partially",
        ),
        "same_size": ("CorruptCheckpointError", f"{url}/{TAG}/{victim}: checksum mismatch in tensor "),
        "truncated": (
            "CorruptCheckpointError",
            f"{where} is truncated: {size - 4} bytes, the manifest records {size}. The write or copy was cut short",
        ),
        "grown": (
            "CorruptCheckpointError",
            f"{where}: {url}/{TAG}/{victim} has {size + 4} bytes, expected {size}: it was modified after it was written",
        ),
        "stale": (
            "CorruptCheckpointError",
            f"{where}: the header does not match the checksum in the manifest; the file is corrupted",
        ),
    }


def _one_rank_model(kind: str) -> torch.nn.Module:
    from functional_ema._testing.multirank import OddNet

    if kind == "ddp":
        return torch.nn.Sequential(torch.nn.Linear(64, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5))
    model = OddNet(hidden=3000)
    model.not_optimized.requires_grad_(False)  # the engine's optimizer leaves it out: it has no EMA
    return model


@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_load_from_a_bucket(tmp_path: Path, s3: Any, kind: str) -> None:
    import functional_ema as fe

    creds = {"endpoint": s3.endpoint, "key": s3.key, "secret": s3.secret}
    res = run_ranks("tests.test_load_url:url_worker", world_size=2, timeout=600, root=str(tmp_path), kind=kind, **creds)
    prefix = f"{BUCKET}/{kind}/ck"
    url = f"s3://{prefix}"
    for r in res:
        for check in ("bitwise_latest", "bitwise_tag", "private", "lagging", "restored"):
            assert r[check], (r["rank"], check)
        # exactly the pointer, the manifest and the file(s) this rank reads: its share, not the checkpoint
        own = {f: r["sizes"][f] for f in r["files_of_rank"]}
        manifest = {"ema_manifest.json": r["manifest_bytes"]}
        assert r["got_tag"] == {**manifest, **own}, r
        assert r["got_latest"] == {"ema_latest": r["latest_bytes"], **manifest, **own}, r
        assert sum(own.values()) < sum(r["sizes"].values()) or kind == "ddp"
        assert r["calls_tag"].get("list_objects_v2", 0) == 0, r["calls_tag"]  # the tag given: nothing listed
        # the lagging listing shows the older save's names; the load read the newer manifest's files
        older = sorted(p.name for p in (tmp_path / "gen0" / TAG).iterdir())
        assert r["lag_listing"] == older and older != sorted([*r["sizes"], "ema_manifest.json"]), r["lag_listing"]
    want = _expected_errors(kind, res[0], url)
    # The rank that reads the damaged file raises its own error (both ranks read a replicated DDP save's one file:
    # rank 0 is the first to fail); the other rank the same class, naming that rank and its message.
    first = int(res[0]["victim"].split("_")[2])
    for fault, (cls, text) in want.items():
        for r in res:
            name, msg = r[fault]
            assert name == cls, (fault, r["rank"], r[fault])
            said = text if r["rank"] == first else f"load failed on rank {first} of 2 ({cls}): {text}"
            assert msg.startswith(said), (fault, r["rank"], msg, said)
    # a refused access: the failing rank's own CheckpointIOError, the other rank the same class naming it
    for fault, failing in (("forbidden", 0), ("forbidden_rank1", 1)):
        own = (
            f"rank {failing} could not read {url}: the storage refused access (Forbidden): check "
            "load(storage_options=...) (key, secret, endpoint_url) or fsspec's configuration"
        )
        for r in res:
            said = own if r["rank"] == failing else f"load failed on rank {failing} of 2 (CheckpointIOError): {own}"
            assert r[fault] == ["CheckpointIOError", said], (fault, r["rank"], r[fault])
    # another world size: one process, every saved piece re-cut from the ranges of both files
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    gathered, ref = full["gathered"], full["ref"]
    opts = {
        "key": s3.key,
        "secret": s3.secret,
        "endpoint_url": s3.endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    _register()
    CountingS3.reset()
    state = fe.load(_one_rank_model(kind), f"s3count://{prefix}", storage_options=opts)
    assert {n: state.emas[0][n].view(t.shape) for n, t in gathered.items()}.keys() == gathered.keys()
    assert all(torch.equal(state.emas[0][n].view(t.shape), t) for n, t in gathered.items())
    assert all(torch.allclose(gathered[n], ref[n], rtol=0, atol=1e-6) for n in ref)
    # every saved file once, each byte fetched once (ranges re-cut from both files), nothing else
    want_got = {"ema_latest": res[0]["latest_bytes"], "ema_manifest.json": res[0]["manifest_bytes"], **res[0]["sizes"]}
    assert dict(CountingS3.got) == want_got, (dict(CountingS3.got), want_got)
    _offline_readers(url, opts, gathered, tmp_path)
    _export_a_file_by_url(s3.fs(), f"{BUCKET}/{kind}", opts, gathered, tmp_path)
    _deepspeed_latest(s3.fs(), prefix, opts)


def _deepspeed_latest(fs: Any, prefix: str, opts: dict) -> None:
    """DeepSpeed's ``latest``, when there, wins over ``ema_latest`` (as from a folder): one naming a tag with no
    manifest is refused naming both; one that is not a plain name is refused without following it."""
    import functional_ema as fe
    from functional_ema.checkpoint import CheckpointNotFoundError, InvalidTagError

    url = f"s3://{prefix}"
    try:
        fs.pipe(f"{prefix}/latest", b"global_step9\n")
        with pytest.raises(CheckpointNotFoundError) as e:
            fe.load(_one_rank_model("ddp"), url, storage_options=opts)
        assert str(e.value) == (
            f"checkpoint directory {url}: no complete EMA checkpoint of tag 'global_step9' there ({url}/global_step9/"
            "ema_manifest.json does not exist; the manifest is written last) 'latest' names this tag: its EMA save "
            "did not finish; load another tag"
        )
        fs.pipe(f"{prefix}/latest", b"../t")
        with pytest.raises(InvalidTagError) as e:
            fe.load(_one_rank_model("ddp"), url, storage_options=opts)
        assert str(e.value).startswith(f"{url}/latest does not name a tag folder of {url}: its content "), str(e.value)
    finally:
        fs.rm(f"{prefix}/latest")


def _offline_readers(url: str, opts: dict, gathered: dict, tmp_path: Path) -> None:
    """``consolidate``, ``consolidate_to_file``, ``read_manifest`` and ``saved_parts`` from the URL (fsspec's
    configuration carries the credentials: these take no storage_options)."""
    import fsspec
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.checkpoint import read_manifest, saved_parts

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fsspec.config.conf, "s3", opts)
        got = fe.consolidate(url)
        assert got.keys() == gathered.keys() and all(torch.equal(got[n], t) for n, t in gathered.items())
        out = fe.consolidate_to_file(url, tmp_path / "ema.safetensors", progress=False)
        assert all(torch.equal(load_file(out)[n], t) for n, t in gathered.items())
        m = read_manifest(url)
        assert (m["tag"], m["step"], m["tag_dir"]) == (TAG, 4, f"{url}/{TAG}")
        assert tuple(saved_parts(f"{url}/{TAG}")) == (1, 1, True)


def _export_a_file_by_url(fs: Any, prefix: str, opts: dict, gathered: dict, tmp_path: Path) -> None:
    """The export of a consolidated file at a URL (ranged reads, its own checksums verified) holds the EMA; the
    file damaged or missing in the bucket is refused naming the URL."""
    import fsspec
    from safetensors.torch import load_file

    from functional_ema.checkpoint import CheckpointNotFoundError, CorruptCheckpointError
    from functional_ema.export import to_hf

    like = tmp_path / "like"
    like.mkdir()
    (like / "config.json").write_text(json.dumps({"model_type": "fe_load_url"}))  # names kept as the EMA's
    obj = f"{prefix}/ema.safetensors"
    raw = (tmp_path / "ema.safetensors").read_bytes()  # written by _offline_readers
    fs.pipe(obj, raw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fsspec.config.conf, "s3", opts)
        to_hf(f"s3://{obj}", tmp_path / "hf", like, progress=False)
        got: dict[str, torch.Tensor] = {}
        for f in sorted((tmp_path / "hf").glob("*.safetensors")):
            got.update(load_file(f))
        assert got.keys() == gathered.keys() and all(torch.equal(got[n], t) for n, t in gathered.items())
        assert json.loads((tmp_path / "hf" / "ema_export.json").read_text())["source"] == f"s3://{obj}"
        fs.pipe(obj, raw[:-1] + bytes([raw[-1] ^ 1]))
        with pytest.raises(CorruptCheckpointError) as e:
            to_hf(f"s3://{obj}", tmp_path / "hf2", like, progress=False)
        assert str(e.value).startswith(f"source: s3://{obj}: checksum mismatch in tensor "), str(e.value)
        with pytest.raises(CheckpointNotFoundError) as e:
            to_hf(f"s3://{prefix}/none.safetensors", tmp_path / "hf3", like, progress=False)
        assert str(e.value) == f"s3://{prefix}/none.safetensors does not exist"


def test_a_url_is_never_read_as_a_local_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every reader takes ``s3://b/x`` as a URL (once, ``Path`` made it the local folder ``s3:/b/x``): without
    fsspec each says so, naming the extra, even where a local ``s3:/b/x`` exists."""
    import functional_ema as fe
    from functional_ema.checkpoint import read_manifest, saved_parts

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "bucket" / "ck").mkdir(parents=True)  # what Path("s3://bucket/ck") names
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if not installed
    extra = (
        "'s3://bucket/ck' is a URL: reading and writing it needs fsspec and its filesystem package "
        "(pip install 'functional-ema[s3]' for s3://)"
    )
    for read in (
        lambda: fe.load(torch.nn.Linear(2, 2), "s3://bucket/ck"),
        lambda: fe.consolidate("s3://bucket/ck"),
        lambda: read_manifest("s3://bucket/ck"),
        lambda: saved_parts("s3://bucket/ck"),
    ):
        with pytest.raises(ImportError) as e:
            read()
        assert str(e.value) == extra


def _damaged(raw: bytes, how: str) -> bytes:
    if how == "flipped":
        return raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:]
    if how == "truncated":
        return raw[:-5]
    if how == "grown":
        return raw + b"\0"
    return b"\x80\x04" + raw[2:]  # a pickle's first bytes


def test_safetensors_file_over_a_storage_reads_and_checks_as_a_local_file(tmp_path: Path) -> None:
    """``SafetensorsFile((storage, rel))`` (memory:// here) returns what the local file gives, bitwise, in ranged
    reads (5 checksum chunks and a part: two 16 MiB requests), and refuses each damage with the local message,
    the URL in place of the path."""
    import secrets

    from safetensors.torch import save_file

    from functional_ema import _io
    from functional_ema._storage import storage_for

    n = (_io.CHUNK_BYTES // 4) * 5 + 3
    big, small = torch.arange(n, dtype=torch.float32), torch.randn(3, 4)
    path = tmp_path / "f.safetensors"
    save_file({"big": big, "small": small}, str(path), metadata={"k": "v"})
    raw = path.read_bytes()
    url = f"memory://fe-st-{secrets.token_hex(4)}"
    store = storage_for(url)
    store.publish_bytes("f.safetensors", raw)
    crcs = _io.chunk_checksums(_io._byte_view(big))
    local, remote = _io.SafetensorsFile(path, len(raw)), _io.SafetensorsFile((store, "f.safetensors"), len(raw))
    assert (remote.tensors, remote.metadata, remote.header_checksum()) == (
        local.tensors,
        local.metadata,
        local.header_checksum(),
    )
    whole, part = torch.empty(n), torch.empty(_io.CHUNK_BYTES // 4 + 3)
    remote.read_into("big", whole, crcs)
    remote.read_into("big", part, crcs, start=(_io.CHUNK_BYTES // 4) * 5 - _io.CHUNK_BYTES // 4)
    assert torch.equal(whole, big) and torch.equal(part, big[-part.numel() :])
    assert torch.equal(remote.read_range("big", 1000, 1010, crcs), big[1000:1010])
    assert torch.equal(remote.read_range("small", 2, 9), small.view(-1)[2:9])

    def outcome(source: Any, how: str) -> str:
        try:
            st = _io.SafetensorsFile(source, len(raw))
            st.read_into("big", torch.empty(n), crcs)
        except _io.FormatError as e:
            return f"{type(e).__name__}: {e}"
        return "read"

    for how in ("flipped", "truncated", "grown", "pickle"):
        path.write_bytes(_damaged(raw, how))
        store.publish_bytes("f.safetensors", _damaged(raw, how))
        want = outcome(path, how).replace(str(path), f"{url}/f.safetensors")
        assert want.split(":")[0] in ("ChecksumError", "TruncatedFileError", "FormatError", "PickleFileError"), want
        assert outcome((store, "f.safetensors"), how) == want, how
