"""The storage seam (``functional_ema._storage``): every guarantee its docstring states, checked for each
implementation: a local folder, fsspec's ``memory://``, and a real S3 server (SeaweedFS, loopback only,
``functional_ema._testing.s3``) reached through ``s3fs``. The S3 server is started once for the module and
stopped by pid at its end (also when a test fails)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from functional_ema._storage import FsspecStorage, LocalStorage, Storage, check_relative, is_url, storage_for


class Boom(Exception):
    pass


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[object]:
    from functional_ema._testing.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("s3")) as srv:
        srv.make_bucket("fe-storage")
        yield srv


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "root")
    if request.param == "memory":
        return storage_for(f"memory://fe-test-{secrets.token_hex(4)}/root")
    srv = request.getfixturevalue("s3")
    url = f"s3://fe-storage/{secrets.token_hex(4)}/root"
    return FsspecStorage(url, fs=srv.fs(retries=1))


def test_publish_is_atomic_and_replaces_whole(store: Storage) -> None:
    store.publish_bytes("t/a.bin", b"old bytes")
    with pytest.raises(Boom), store.writer("t/a.bin") as f:  # a failure mid-stream publishes nothing
        f.write(b"new, half written")
        raise Boom
    assert store.read_bytes("t/a.bin") == b"old bytes"
    with pytest.raises(Boom), store.writer("t/b.bin") as f:  # nor does it leave a file where there was none
        f.write(b"x" * 100)
        raise Boom
    assert not store.exists("t/b.bin") and store.listdir("t") == ["a.bin"]
    with store.writer("t/a.bin") as f:  # while a write is open, readers see the old file
        f.write(b"new ")
        assert store.read_bytes("t/a.bin") == b"old bytes"
        f.write(b"contents")
    assert store.read_bytes("t/a.bin") == b"new contents" and store.size("t/a.bin") == 12


def test_streamed_large_file_and_exact_ranged_reads(store: Storage) -> None:
    data = os.urandom(3 << 20) + bytes(range(256)) * 4096 + os.urandom(7 << 20)  # 11 MiB: S3 multipart (5 MiB)
    with store.writer("big.bin") as f:
        for lo in range(0, len(data), 1 << 20):
            f.write(data[lo : lo + (1 << 20)])
    assert store.size("big.bin") == len(data)
    for offset, length in ((0, 10), (5 << 20, 3 << 20), ((5 << 20) - 3, 7), (len(data) - 5, 5), (17, 0)):
        assert store.read_range("big.bin", offset, length) == data[offset : offset + length]
    with pytest.raises(EOFError) as e:
        store.read_range("big.bin", len(data) - 4, 8)
    assert str(e.value) == (
        f"{store.describe('big.bin')}: asked for 8 bytes at offset {len(data) - 4}, the file holds 4 there "
        "(truncated, or replaced by another file)"
    )
    assert store.read_bytes("big.bin") == data


def test_listing_missing_files_and_removal(store: Storage) -> None:
    assert store.listdir() == [] and store.listdir("nowhere") == [] and not store.exists("x")
    for rel in ("t/a", "t/b", "t/sub/c", "u"):
        store.publish_bytes(rel, rel.encode())
    assert store.listdir() == ["t", "u"] and store.listdir("t") == ["a", "b", "sub"]
    assert store.listdir("t/sub") == ["c"] and store.exists("t/sub/c") and store.exists("t")
    for call in (store.read_bytes, store.size, lambda r: store.read_range(r, 0, 1)):
        with pytest.raises(FileNotFoundError) as e:
            call("t/missing")
        assert str(e.value) == f"{store.describe('t/missing')}: no such file"
    store.remove("t/a")
    store.remove("t/a")  # already gone: nothing
    assert store.listdir("t") == ["b", "sub"] and not store.exists("t/a")


@pytest.mark.parametrize("rel", ["", "/abs", "../x", "a/../../b", "a//b", "./a", "a\\b", "a/."])
def test_paths_outside_the_root_are_refused(store: Storage, rel: str) -> None:
    for call in (store.read_bytes, store.exists, store.remove, lambda r: store.publish_bytes(r, b"x")):
        with pytest.raises(ValueError) as e:
            call(rel)
        assert str(e.value).startswith(f"storage path {rel!r} is not a plain relative path"), str(e.value)
    assert store.listdir() == []


def test_local_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside)
    store = LocalStorage(root)
    with pytest.raises(ValueError) as e:
        store.read_bytes("link/secret")
    assert str(e.value) == (
        f"storage path 'link/secret' leads to {outside / 'secret'}, outside the root {root} (a symlink?)"
    )
    with pytest.raises(ValueError):
        store.publish_bytes("link/new", b"x")
    assert sorted(os.listdir(outside)) == ["secret"]


def test_locations_and_arguments() -> None:
    urls, paths = ("s3://b/p", "memory://x", "gs://b"), ("file:///tmp/x", "/tmp/x", "rel/x")
    assert all(is_url(x) for x in urls) and not any(is_url(x) for x in paths)
    assert is_url(Path("s3:/x")) is False
    for typo, meant in (("s3:/b/x", "s3://b/x"), ("gs:b", "gs://b"), ("file:/tmp/x", "file:///tmp/x")):
        with pytest.raises(ValueError) as e:  # a URL missing a slash: no local folder "s3:" is made of it
            storage_for(typo)
        assert f"write {meant!r}" in str(e.value) and str(e.value).startswith(f"{typo!r} looks like a URL"), str(
            e.value
        )
    assert isinstance(storage_for("run:2/x"), LocalStorage) and isinstance(storage_for("C:/x"), LocalStorage)
    assert isinstance(storage_for("/tmp/x"), LocalStorage) and storage_for("file:///tmp/x").location == "/tmp/x"
    assert isinstance(storage_for("memory://fe-test/x"), FsspecStorage)
    with pytest.raises(TypeError) as e:
        storage_for("/tmp/x", key="k")
    assert str(e.value) == "storage_options are for URLs; '/tmp/x' is a local path"
    with pytest.raises(TypeError) as e:
        check_relative(3)  # type: ignore[arg-type]
    assert str(e.value) == "storage path must be a str, got int 3"
    assert check_relative("a/b.c") == "a/b.c"


def test_s3_server_killed_mid_upload_publishes_nothing(tmp_path: Path) -> None:
    """The server SIGKILLed while a multipart upload is open: the write fails, and once a server runs again
    on the same data the previous object is there, whole, and the new one is not."""
    from functional_ema._testing.s3 import s3_server

    data_dir = tmp_path / "srv"
    with s3_server(data_dir) as srv:
        srv.make_bucket("fe-kill")
        store = FsspecStorage("s3://fe-kill/ck", fs=srv.fs(retries=1))
        store.publish_bytes("t/a.bin", b"previous")
        with pytest.raises(Exception) as e, store.writer("t/a.bin") as f:  # whatever botocore raises
            f.write(os.urandom(6 << 20))  # past one 5 MiB part: the multipart upload is open
            f.flush()
            srv.kill()
            f.write(b"tail")
        assert not isinstance(e.value, Boom)
    with s3_server(data_dir) as again:
        store = FsspecStorage("s3://fe-kill/ck", fs=again.fs(retries=1))
        assert store.read_bytes("t/a.bin") == b"previous" and store.listdir("t") == ["a.bin"]


# ------------------------------------------------------------------ the offline tools over a checkpoint at a URL


def _llama_checkpoint(root: Path) -> tuple[Path, Path, dict]:
    """A tiny Llama's EMA saved twice into ``root/ck`` (generation 1, with ``ema_latest``), its ``--like`` folder
    (``save_pretrained``) and the EMA expected in the export: the state in memory, reshaped."""
    import torch
    from transformers import LlamaForCausalLM

    import functional_ema as fe
    from tests._integration_models import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(root / "like")
    state = fe.init_ema(fe.local_shards(model))
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5).add_(step)
        state = fe.update(state, fe.local_shards(model), step, decay=0.75)
        fe.save(state, model, root / "ck", "t", decay=0.75)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return root / "ck", root / "like", {n: state.emas[0][n].reshape(shapes[n]).clone() for n in shapes}


def test_offline_tools_read_a_checkpoint_at_a_url(s3, tmp_path: Path, monkeypatch) -> None:
    """consolidate, consolidate_to_file and the export (API and ``python -m functional_ema export s3://...``)
    read a checkpoint uploaded to the S3 server exactly as its local folder; damaged or missing objects in
    the bucket are refused naming the URL. The checkpoint is read in place (ranged reads): nothing is
    written into the temporary folder."""
    import json
    import subprocess
    import sys
    import tempfile

    import fsspec
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    import functional_ema as fe
    from functional_ema.export import to_hf

    ck, like, want = _llama_checkpoint(tmp_path)
    fs = s3.fs()
    fs.put(str(ck), "fe-storage/run/ck", recursive=True)
    conf = {
        "key": s3.key,
        "secret": s3.secret,
        "endpoint_url": s3.endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    scratch = tmp_path / "scratch"  # the temporary folder of this process and of the CLI below
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    url = "s3://fe-storage/run/ck"
    local = fe.consolidate(ck, "t")
    for got in (
        fe.consolidate(url, "t"),
        fe.consolidate(url),
        fe.consolidate(f"{url}/t"),
    ):  # tag, ema_latest, tag folder
        assert sorted(got) == sorted(local) and all(torch.equal(got[n], local[n]) for n in local)
    fe.consolidate_to_file(url, tmp_path / "ema.safetensors", "t", progress=False)
    got = load_file(tmp_path / "ema.safetensors")
    assert all(torch.equal(got[n], local[n]) for n in local)

    to_hf(url, tmp_path / "hf", like, progress=False)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(loaded[n], want[n]) for n in want), [n for n in want if not torch.equal(loaded[n], want[n])]
    assert json.loads((tmp_path / "hf" / "ema_export.json").read_text())["source"] == url

    env = {**os.environ, "FSSPEC_S3_KEY": s3.key, "FSSPEC_S3_SECRET": s3.secret, "FSSPEC_S3_ENDPOINT_URL": s3.endpoint}
    cli = subprocess.run(
        [sys.executable, "-m", "functional_ema", "export", url, str(tmp_path / "cli"), "--like", str(like)],
        env={**env, "AWS_DEFAULT_REGION": "us-east-1", "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "cli").state_dict()
    assert all(torch.equal(loaded[n], want[n]) for n in want)

    # Damaged or missing objects: refused naming the URL (not the temporary copy).
    rank_file = "fe-storage/run/ck/t/ema_rank_00000_of_00001.gen1.safetensors"
    raw = bytearray(fs.cat_file(rank_file))
    raw[-1] ^= 0x01
    fs.pipe_file(rank_file, bytes(raw))
    with pytest.raises(fe.checkpoint.CorruptCheckpointError) as e:
        fe.consolidate(url, "t")
    assert f"{url}/t/ema_rank_00000_of_00001.gen1.safetensors" in str(e.value) and "checksum" in str(e.value)
    fs.rm_file(rank_file)
    with pytest.raises(fe.checkpoint.IncompleteCheckpointError) as e:
        fe.consolidate(url, "t")
    assert url in str(e.value) and "ema_rank_00000_of_00001.gen1.safetensors" in str(e.value), str(e.value)
    with pytest.raises(fe.checkpoint.CheckpointNotFoundError) as e:
        fe.consolidate(url, "nope")
    assert str(e.value) == (
        f"checkpoint directory {url}: no complete EMA checkpoint of tag 'nope' there ({url}/nope/ema_manifest.json "
        "does not exist; the manifest is written last)"
    )
    with pytest.raises(fe.checkpoint.CheckpointNotFoundError) as e:
        fe.consolidate("s3://fe-storage/run")
    assert str(e.value).startswith("checkpoint directory s3://fe-storage/run has no 'latest' file"), str(e.value)
    assert list(scratch.iterdir()) == []
